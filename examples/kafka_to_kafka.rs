//! Kafka -> Kafka: Spark Real-time Mode's headline example in rtflow.
//!
//! Reads `rtflow-input`, casts each record's key and value to strings,
//! uppercases the value and writes it to `rtflow-output` under the same key; the
//! Spark equivalent is `selectExpr("CAST(key AS STRING)", "upper(CAST(value AS
//! STRING))")` between a Kafka source and a Kafka sink with a real-time trigger.
//! Both topics are created if missing. After `--seconds`, or at SIGTERM or
//! Ctrl-C, the query stops with a final checkpoint and the example prints how
//! many records went through and their latency; started again, it resumes
//! where it stopped.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo run --release --example kafka_to_kafka -- --produce 100 --seconds 30
//! scripts/kafka.sh consume rtflow-output 10
//! ```
//!
//! `--produce RATE` writes RATE test records per second to `rtflow-input` from a
//! background thread; without it, feed the topic yourself, e.g. with
//! `scripts/kafka.sh produce rtflow-input --keyed` ("key<TAB>value" lines).
//! `--bootstrap HOST:PORT` points at another broker, `--input` and `--output`
//! name other topics, `--from-beginning` reads the input's oldest records on a
//! first start; `--metrics-address HOST:PORT`
//! serves Prometheus metrics at `/metrics` there. `--exactly-once` writes
//! each epoch in one Kafka transaction (read the output with
//! `--isolation-level read_committed` to see it at each checkpoint).

mod common;

use std::time::Duration;

use clap::Parser;
use rtflow::prelude::*;

#[derive(Parser)]
#[command(about = "rtflow: Kafka -> uppercase the value -> Kafka")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// The topic to read.
    #[arg(long, default_value = "rtflow-input")]
    input: String,
    /// The topic to write.
    #[arg(long, default_value = "rtflow-output")]
    output: String,
    /// On a first start, read the input's oldest records instead of the
    /// records appended from now on.
    #[arg(long)]
    from_beginning: bool,
    /// How long to run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Also write this many test records per second to the input topic.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    produce: Option<u64>,
    /// Partitions of the topics, when this creates them (one reader each).
    #[arg(long, default_value_t = 2)]
    partitions: i32,
    /// Write through Kafka transactions committed with each checkpoint.
    #[arg(long)]
    exactly_once: bool,
    #[command(flatten)]
    metrics: common::MetricsArgs,
    #[command(flatten)]
    checkpoints: common::CheckpointArgs,
    #[command(flatten)]
    stop: common::StopArgs,
}

fn main() -> std::result::Result<(), BoxError> {
    let args = Args::parse();
    common::init_tracing();
    let shutdown = args.stop.on_signals()?;
    let (input, output) = (args.input.as_str(), args.output.as_str());
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    admin.create_topic(input, args.partitions)?;
    admin.create_topic(output, args.partitions)?;

    let starting_offsets = if args.from_beginning {
        StartingOffsets::Earliest
    } else {
        StartingOffsets::Latest
    };
    let flow = Dataflow::new("kafka-to-kafka");
    flow.source(
        KafkaSource::new(&args.bootstrap)
            .subscribe([input])
            .starting_offsets(starting_offsets),
    )
    .name("kafka")
    // CAST(key AS STRING) keeps a missing key missing.
    .map(|record: KafkaRecord| {
        let key = record.key.is_some().then(|| record.key_str().into_owned());
        (key, record.value_str().to_uppercase())
    })
    .sink(
        KafkaSink::new(
            &args.bootstrap,
            output,
            |(key, value): &(Option<String>, String)| {
                let message = KafkaMessage::new(value.clone());
                match key {
                    Some(key) => message.key(key.clone()),
                    None => message,
                }
            },
        )
        .delivery(if args.exactly_once {
            DeliveryGuarantee::ExactlyOnce
        } else {
            DeliveryGuarantee::AtLeastOnce
        }),
    );

    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("kafka-to-kafka")
                .checkpoint_location(args.checkpoints.or_temporary("kafka-to-kafka"))
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    // Started after the query, whose readers begin at the latest offsets.
    if let Some(rate) = args.produce {
        common::spawn_producer(&args.bootstrap, input, rate, |n| {
            (format!("user-{}", n % 10), format!("event {n}"))
        })?;
    }
    println!(
        "{input} -> uppercase -> {output} for {} s on {}",
        args.seconds, args.bootstrap
    );
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;

    common::print_summary(&query, "written");
    Ok(())
}
