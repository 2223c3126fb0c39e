//! Kafka -> event-time tumbling windows -> Kafka: page views per user and window.
//!
//! Reads `rtflow-views`, whose records are keyed by user, takes each record's
//! Kafka timestamp as its event time, declares a watermark `--delay` seconds
//! behind the highest event time seen on every partition, and counts each
//! user's views per tumbling window of `--window` seconds. Each count is
//! written to `rtflow-views-per-window` as `user start..end count` (the
//! window's bounds in milliseconds since the Unix epoch), keyed by
//! `user@start`, and updated with every view (Spark's update output mode; the
//! last record of a key is the window's final count). A window closes when
//! the watermark passes its end; views that arrive after that are late, and
//! are dropped and counted. Both topics are created if missing. After
//! `--seconds`, or at SIGTERM or Ctrl-C, the query stops with a final
//! checkpoint and prints how many records went through, their latency and
//! the watermark.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo run --release --example kafka_windows -- --produce 100 --seconds 60 \
//!     --metrics-address 127.0.0.1:9898
//! scripts/kafka.sh consume rtflow-views-per-window 10
//! ```
//!
//! `--produce RATE` writes RATE test views per second to `rtflow-views` from a
//! background thread; without it, feed the topic yourself, e.g. with
//! `scripts/kafka.sh produce rtflow-views --keyed` ("user<TAB>page" lines).
//! `--metrics-address HOST:PORT` serves Prometheus metrics at `/metrics`
//! there, the watermark and its lag among them (deploy/grafana's dashboard
//! shows them). `--bootstrap HOST:PORT` points at another broker, `--input`
//! and `--output` name other topics, `--from-beginning` reads the input's
//! oldest records on a first start.

mod common;

use std::time::Duration;

use clap::Parser;
use rtflow::prelude::*;

#[derive(Parser)]
#[command(about = "rtflow: Kafka -> views per user and event-time window -> Kafka")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// The topic of views to read, keyed by user.
    #[arg(long, default_value = "rtflow-views")]
    input: String,
    /// The topic the counts go to.
    #[arg(long, default_value = "rtflow-views-per-window")]
    output: String,
    /// On a first start, read the input's oldest records instead of the
    /// records appended from now on.
    #[arg(long)]
    from_beginning: bool,
    /// The length of a window, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    window: u64,
    /// How far behind the latest event time the watermark stays, in seconds:
    /// how late a view may arrive and still count.
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    delay: u64,
    /// How long to run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Also write this many test views per second to the input topic.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    produce: Option<u64>,
    /// Partitions of the topics, when this creates them (one reader each).
    #[arg(long, default_value_t = 2)]
    partitions: i32,
    #[command(flatten)]
    metrics: common::MetricsArgs,
    #[command(flatten)]
    checkpoints: common::CheckpointArgs,
    #[command(flatten)]
    stop: common::StopArgs,
}

/// A view's user and event time (the Kafka timestamp, in ms since the Unix
/// epoch; a record without one counts as late).
fn view(record: KafkaRecord) -> (String, i64) {
    let time = record.timestamp.map_or(0, |(ms, _)| ms);
    (record.key_str().into_owned(), time)
}

/// `user start..end count`, keyed by `user@start`: a window's count, which
/// later records of the same key update.
fn window_count((user, window, count): &(String, Window, u64)) -> KafkaMessage {
    KafkaMessage::new(format!("{user} {}..{} {count}", window.start, window.end))
        .key(format!("{user}@{}", window.start))
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
    let flow = Dataflow::new("kafka-windows");
    flow.source(
        KafkaSource::new(&args.bootstrap)
            .subscribe([input])
            .starting_offsets(starting_offsets),
    )
    .name("kafka")
    .map(view)
    .with_watermark(|(_, time)| *time, Duration::from_secs(args.delay))
    .key_by(|(user, _)| user.clone())
    .window(Window::tumbling(Duration::from_secs(args.window)))
    .count()
    .sink(KafkaSink::new(&args.bootstrap, output, window_count));

    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("kafka-windows")
                .checkpoint_location(args.checkpoints.or_temporary("kafka-windows"))
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    // Started after the query, whose readers begin at the latest offsets.
    if let Some(rate) = args.produce {
        common::spawn_producer(&args.bootstrap, input, rate, |n| {
            (format!("user-{}", n % 10), format!("page-{}", n % 7))
        })?;
    }
    println!(
        "{input} -> views per user and {} s window -> {output} for {} s on {}",
        args.window, args.seconds, args.bootstrap
    );
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;

    common::print_summary(&query, "window counts written");
    let metrics = query.metrics();
    match metrics.watermark() {
        Some(watermark) => println!("watermark: {watermark} ms since the Unix epoch"),
        None => println!("watermark: none yet (a partition has seen no record)"),
    }
    Ok(())
}
