//! Kafka -> filter -> console, for development: watch what flows through a topic.
//!
//! Prints every record of `--topic` (default `rtflow-input`) whose value contains
//! `--contains TEXT` (default: every record) as `partition@offset key: value`,
//! the line prefixed by the console writer's index. The topic is created if
//! missing. After `--seconds`, or at SIGTERM or Ctrl-C, the query stops with a
//! final checkpoint and the example prints how many records went through and
//! their latency.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo run --release --example kafka_console -- --produce 5 --contains 7 --seconds 30
//! cargo run --release --example kafka_console -- --topic rtflow-output --from-beginning
//! ```
//!
//! `--produce RATE` writes RATE test records per second to the topic from a
//! background thread; without it, the example shows what others write, e.g.
//! `scripts/kafka.sh produce rtflow-input` or the other Kafka examples.
//! `--bootstrap HOST:PORT` points at another broker; `--metrics-address HOST:PORT`
//! serves Prometheus metrics at `/metrics` there.

mod common;

use std::time::Duration;

use clap::Parser;
use rtflow::prelude::*;

#[derive(Parser)]
#[command(about = "rtflow: Kafka -> filter -> console")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// The topic to show.
    #[arg(long, default_value = "rtflow-input")]
    topic: String,
    /// Show only records whose value contains this text.
    #[arg(long, default_value = "")]
    contains: String,
    /// Start at the oldest record instead of the records appended from now on.
    #[arg(long)]
    from_beginning: bool,
    /// How long to run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Also write this many test records per second to the topic.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    produce: Option<u64>,
    /// Partitions of the topic, when this creates it (one reader each).
    #[arg(long, default_value_t = 2)]
    partitions: i32,
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
    KafkaAdmin::new(&args.bootstrap)?.create_topic(&args.topic, args.partitions)?;

    let starting_offsets = if args.from_beginning {
        StartingOffsets::Earliest
    } else {
        StartingOffsets::Latest
    };
    let contains = args.contains.clone();
    let flow = Dataflow::new("kafka-console");
    flow.source(
        KafkaSource::new(&args.bootstrap)
            .subscribe([&args.topic])
            .starting_offsets(starting_offsets),
    )
    .name("kafka")
    .filter(move |record| record.value_str().contains(contains.as_str()))
    .sink(ConsoleSink::with_format(|record: &KafkaRecord| {
        format!(
            "{}@{} {}: {}",
            record.partition,
            record.offset,
            record.key_str(),
            record.value_str()
        )
    }));

    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("kafka-console")
                .checkpoint_location(args.checkpoints.or_temporary("kafka-console"))
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    // Started after the query, whose readers begin at the latest offsets by default.
    if let Some(rate) = args.produce {
        common::spawn_producer(&args.bootstrap, &args.topic, rate, |n| {
            (format!("k{}", n % 3), format!("message {n}"))
        })?;
    }
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;

    common::print_summary(&query, "shown");
    Ok(())
}
