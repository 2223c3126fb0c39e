//! Kafka -> Kafka: Spark Real-time Mode's headline example in rtflow.
//!
//! Reads `rtflow-input`, casts each record's key and value to strings,
//! uppercases the value and writes it to `rtflow-output` under the same key; the
//! Spark equivalent is `selectExpr("CAST(key AS STRING)", "upper(CAST(value AS
//! STRING))")` between a Kafka source and a Kafka sink with a real-time trigger.
//! Both topics are created if missing. After `--seconds` the query stops and the
//! example prints how many records went through and their latency.
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
//! `--bootstrap HOST:PORT` points at another broker; `--metrics-address HOST:PORT`
//! serves Prometheus metrics at `/metrics` there. `--exactly-once` writes
//! each epoch in one Kafka transaction (read the output with
//! `--isolation-level read_committed` to see it at each checkpoint).

mod common;

use std::time::Duration;

use clap::Parser;
use rtflow::prelude::*;

const INPUT: &str = "rtflow-input";
const OUTPUT: &str = "rtflow-output";

#[derive(Parser)]
#[command(about = "rtflow: Kafka -> uppercase the value -> Kafka")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
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
}

fn main() -> std::result::Result<(), BoxError> {
    let args = Args::parse();
    common::init_tracing();
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    admin.create_topic(INPUT, args.partitions)?;
    admin.create_topic(OUTPUT, args.partitions)?;

    let flow = Dataflow::new("kafka-to-kafka");
    flow.source(KafkaSource::new(&args.bootstrap).subscribe([INPUT]))
        .name("kafka")
        // CAST(key AS STRING) keeps a missing key missing.
        .map(|record: KafkaRecord| {
            let key = record.key.is_some().then(|| record.key_str().into_owned());
            (key, record.value_str().to_uppercase())
        })
        .sink(
            KafkaSink::new(
                &args.bootstrap,
                OUTPUT,
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

    let checkpoints = std::env::temp_dir().join("rtflow-kafka-to-kafka");
    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("kafka-to-kafka")
                .checkpoint_location(checkpoints)
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    args.metrics.announce();
    // Started after the query, whose readers begin at the latest offsets.
    if let Some(rate) = args.produce {
        common::spawn_producer(&args.bootstrap, INPUT, rate, |n| {
            (format!("user-{}", n % 10), format!("event {n}"))
        })?;
    }
    println!(
        "{INPUT} -> uppercase -> {OUTPUT} for {} s on {}",
        args.seconds, args.bootstrap
    );
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;

    common::print_summary(&query, "written");
    Ok(())
}
