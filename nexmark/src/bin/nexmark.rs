//! The Nexmark bench: runs one query on `--events` events from the generator
//! (in-process) or from a Kafka topic, and prints one JSON line with the
//! throughput, the sink's processing latency percentiles (read by the source ->
//! written by the sink) and the peak resident memory.
//!
//! ```text
//! cargo run --release -p rtflow-nexmark -- --query q0 --events 10000000 --rate max
//! cargo run --release -p rtflow-nexmark -- --query q5 --events 1000000 --rate 100000
//! cargo run --release -p rtflow-nexmark -- load --events 10000000 --topic nexmark
//! cargo run --release -p rtflow-nexmark -- --query q0 --events 10000000 --source kafka --topic nexmark
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use rtflow::prelude::*;
use rtflow::RtflowError;
use rtflow_nexmark::{
    load_kafka, queries, Event, GeneratorConfig, Millis, NexmarkGenerator, NexmarkSource,
};

#[derive(Parser)]
#[command(about = "Runs a Nexmark query on rtflow and prints its figures as one JSON line")]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The query: q0, q1, q2, q3, q4, q5, q7, q8 or q11.
    #[arg(long, global = true, default_value = "q0")]
    query: String,
    /// How many events to run through the query.
    #[arg(long, global = true, default_value_t = 10_000_000)]
    events: u64,
    /// Events per second made by the generator ("max": as fast as the query
    /// takes them). Event time advances at this rate; with "max", at
    /// --event-rate.
    #[arg(long, global = true, default_value = "max")]
    rate: String,
    /// Event time's pace with --rate max, in events per second of event time
    /// (the Flink suite's TPS).
    #[arg(long, global = true, default_value_t = 10_000_000)]
    event_rate: u64,
    #[arg(long, global = true, value_enum, default_value_t = SourceKind::Generator)]
    source: SourceKind,
    /// Generator partitions, or Kafka partitions when loading.
    #[arg(long, global = true, default_value_t = 2)]
    partitions: usize,
    #[arg(long, global = true, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    #[arg(long, global = true, default_value = "nexmark")]
    topic: String,
    /// The checkpoint interval (the real-time trigger's batch duration).
    #[arg(long, global = true, default_value = "10 seconds")]
    checkpoint_interval: String,
    /// The CPUs the query's threads run on (QueryConfig::cpu_affinity), as
    /// "0" or "0,1"; by default the OS places them.
    #[arg(long, global = true, value_delimiter = ',')]
    cpus: Option<Vec<usize>>,
}

#[derive(Subcommand)]
enum Command {
    /// Writes --events events to the Kafka topic --topic (--partitions partitions).
    Load,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SourceKind {
    Generator,
    Kafka,
}

/// The generator's settings for a run at `rate` events/s (`None`: max).
fn generator(rate: Option<u64>, event_rate: u64) -> NexmarkGenerator {
    let now = rtflow::runtime::record::now_nanos() / 1_000_000;
    NexmarkGenerator::new(GeneratorConfig {
        seed: 0,
        base_time: now as Millis,
        events_per_second: rate.unwrap_or(event_rate),
    })
}

/// Ends `stream` in a sink that counts its rows, without a shared counter per row.
fn count_into<T: Clone + Send + 'static>(stream: &Stream<T>, total: &Arc<AtomicU64>) {
    struct Counter(u64, Arc<AtomicU64>);
    impl<T> ForeachWriter<T> for Counter {
        fn process(&mut self, _row: T) -> Result<(), BoxError> {
            self.0 += 1;
            Ok(())
        }
        fn close(&mut self, _error: Option<&RtflowError>) {
            self.1
                .fetch_add(std::mem::take(&mut self.0), Ordering::Relaxed);
        }
    }
    let total = total.clone();
    stream.sink(ForeachSink::new(move || Counter(0, total.clone())));
}

/// Adds `query` on `events` to the dataflow, its output counted into `rows`.
fn build(query: &str, events: &Stream<Event>, rows: &Arc<AtomicU64>) -> Result<(), String> {
    match query {
        "q0" => count_into(&queries::q0(events), rows),
        "q1" => count_into(&queries::q1(events), rows),
        "q2" => count_into(&queries::q2(events), rows),
        "q3" => count_into(&queries::q3(events), rows),
        "q4" => count_into(&queries::q4(events), rows),
        "q5" => count_into(&queries::q5(events), rows),
        "q7" => count_into(&queries::q7(events), rows),
        "q8" => count_into(&queries::q8(events), rows),
        "q11" => count_into(&queries::q11(events), rows),
        other => return Err(format!("unknown query '{other}': q0-q5, q7, q8 or q11")),
    }
    Ok(())
}

/// The peak resident set size, from /proc/self/status.
fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn run(args: &Args, rate: Option<u64>) -> Result<(), Box<dyn std::error::Error>> {
    let flow = Dataflow::new(format!("nexmark-{}", args.query));
    let events = match args.source {
        SourceKind::Generator => {
            let mut source = NexmarkSource::new(generator(rate, args.event_rate))
                .partitions(args.partitions)
                .events(args.events);
            if let Some(rate) = rate {
                source = source.rate(rate);
            }
            flow.source(source)
        }
        SourceKind::Kafka => flow
            .source(
                KafkaSource::new(&args.bootstrap)
                    .subscribe([&args.topic])
                    .starting_offsets(StartingOffsets::Earliest),
            )
            .map(|record: KafkaRecord| {
                serde_json::from_slice::<Event>(record.value.as_deref().unwrap_or_default())
                    .expect("the topic holds Nexmark events as JSON (see `nexmark load`)")
            }),
    }
    .name("nexmark");
    let rows = Arc::new(AtomicU64::new(0));
    build(&args.query, &events, &rows)?;
    let location = std::env::temp_dir().join(format!("rtflow-nexmark-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&location);
    let started = Instant::now();
    let mut config = QueryConfig::new(format!("nexmark-{}", args.query))
        .checkpoint_location(&location)
        .trigger(Trigger::real_time(args.checkpoint_interval.as_str()));
    if let Some(cpus) = &args.cpus {
        config = config.cpu_affinity(cpus.iter().copied());
    }
    let query = flow.start(config)?;
    match args.source {
        SourceKind::Generator => {
            query.await_termination(None)?;
        }
        // A topic never ends: stop once the source has read the events.
        SourceKind::Kafka => {
            while query.metrics().records_out("nexmark") < args.events {
                if query.await_termination(Some(Duration::from_millis(5)))? {
                    return Err("the query ended before reading --events events".into());
                }
            }
            query.stop()?;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&location);
    let latency = query.metrics().latency.processing;
    let events_per_s = args.events as f64 / seconds;
    let cores = args.cpus.as_ref().map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        Vec::len,
    );
    let us = |ms: f64| (ms * 10_000.0).round() / 10.0;
    let figures = serde_json::json!({
        "query": args.query,
        "source": if args.source == SourceKind::Kafka { "kafka" } else { "generator" },
        "events": args.events,
        "rate": args.rate,
        "partitions": args.partitions,
        "seconds": (seconds * 1000.0).round() / 1000.0,
        "events_per_s": events_per_s.round(),
        "events_per_s_per_core": (events_per_s / cores as f64).round(),
        "output_rows": rows.load(Ordering::Relaxed),
        "latency_p50_us": us(latency.p50),
        "latency_p90_us": us(latency.p90),
        "latency_p99_us": us(latency.p99),
        "peak_rss_kb": peak_rss_kb(),
    });
    println!("{figures}");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let rate = match args.rate.as_str() {
        "max" => None,
        rate => Some(rate.parse::<u64>().ok().filter(|r| *r > 0).ok_or_else(|| {
            format!("--rate takes 'max' or a positive number of events per second, not '{rate}'")
        })?),
    };
    match args.command {
        Some(Command::Load) => {
            load_kafka(
                generator(rate, args.event_rate),
                args.events,
                &args.bootstrap,
                &args.topic,
                args.partitions,
            )?;
            eprintln!("wrote {} events to {}", args.events, args.topic);
            Ok(())
        }
        None => run(&args, rate),
    }
}
