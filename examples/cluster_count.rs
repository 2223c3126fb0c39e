//! One query, several processes: a count of clicks per user over a Kafka topic,
//! shared by every process started with the same `--query` name.
//!
//! Each process joins the query's consumer groups; Kafka shares the topic's
//! partitions, and those of the query's repartition topic, among the processes.
//! Start more and they take partitions over; stop or kill one and the others
//! take its partitions back, resuming its counts from the changelog, exactly
//! once.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo run --release --example cluster_count -- --instance a --produce 200 &
//! cargo run --release --example cluster_count -- --instance b &
//! cargo run --release --example cluster_count -- --instance c &
//! scripts/kafka.sh consume rtflow-clicks-per-user 10
//! ```
//!
//! Each process prints the partitions it runs whenever they change.
//! `--seconds` bounds how long it runs (default: until stopped); SIGTERM or
//! Ctrl-C stops it with a final checkpoint, and it leaves the groups, so that
//! the others take its partitions over at once. `--metrics-address
//! HOST:PORT` serves its Prometheus metrics, the partitions it owns among
//! them; `--checkpoint-location DIR` keeps copies of the changelog partitions
//! it restored there (on a volume of its own), so that a restart reads only
//! the changelog written since. `--input` and `--output` name other topics
//! than `rtflow-clicks` and `rtflow-clicks-per-user`; deploy/ runs it under
//! systemd and on Kubernetes.

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use rtflow::prelude::*;

#[derive(Parser)]
#[command(about = "rtflow: a count per user, shared by several processes")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// This process's name in the cluster; restart a process under its name.
    #[arg(long)]
    instance: String,
    /// The topic of clicks to read, keyed by user.
    #[arg(long, default_value = "rtflow-clicks")]
    input: String,
    /// The topic the counts go to.
    #[arg(long, default_value = "rtflow-clicks-per-user")]
    output: String,
    /// The query's name: processes with the same name share the query.
    #[arg(long, default_value = "clicks-per-user")]
    query: String,
    /// Partitions of the input topic, when this creates it, and of the
    /// repartition topic.
    #[arg(long, default_value_t = 6)]
    partitions: i32,
    /// Also write this many test clicks per second to the input topic.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    produce: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long)]
    seconds: Option<u64>,
    /// Where the process keeps its copies of changelog partitions (default:
    /// none kept; every restore reads the changelog).
    #[arg(long, value_name = "DIR")]
    checkpoint_location: Option<std::path::PathBuf>,
    #[command(flatten)]
    metrics: common::MetricsArgs,
    #[command(flatten)]
    stop: common::StopArgs,
}

fn main() -> std::result::Result<(), BoxError> {
    let args = Args::parse();
    common::init_tracing();
    let shutdown = args.stop.on_signals()?;
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    admin.create_topic(&args.input, args.partitions)?;
    admin.create_topic(&args.output, args.partitions)?;

    let (bootstrap, input, output) = (
        args.bootstrap.clone(),
        args.input.clone(),
        args.output.clone(),
    );
    // Each checkpoint is a Kafka transaction, and read_committed readers see
    // the output when it commits: the interval bounds that delay.
    let mut config = QueryConfig::new(&args.query)
        .trigger(Trigger::real_time("1 second"))
        .min_batch_duration(Duration::from_secs(1));
    if let Some(location) = &args.checkpoint_location {
        config = config.checkpoint_location(location);
    }
    let query = KafkaCluster::new(&args.bootstrap)
        .instance(&args.instance)
        .repartition_partitions(args.partitions as usize)
        .start(args.metrics.apply(config), move |flow| {
            flow.source(
                KafkaSource::new(&bootstrap)
                    .subscribe([&input])
                    .starting_offsets(StartingOffsets::Earliest),
            )
            .map(|click: KafkaRecord| click.key_str().into_owned())
            .repartition_by(|user: &String| user.clone())
            .count()
            .sink(KafkaSink::new(
                &bootstrap,
                &output,
                |(user, clicks): &(String, u64)| {
                    KafkaMessage::new(format!("{user}:{clicks}")).key(user.clone())
                },
            ));
            Ok(())
        })?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    if let Some(rate) = args.produce {
        common::spawn_producer(&args.bootstrap, &args.input, rate, |n| {
            (format!("user-{}", n % 100), format!("click {n}"))
        })?;
    }
    println!(
        "{} runs its share of query '{}': {} -> count per user -> {}",
        args.instance, args.query, args.input, args.output
    );
    let deadline = args
        .seconds
        .map(|seconds| Instant::now() + Duration::from_secs(seconds));
    let mut shown = Vec::new();
    // Short waits, so that a change of share shows as it happens.
    while deadline.is_none_or(|deadline| Instant::now() < deadline)
        && !query.await_termination(Some(Duration::from_millis(100)))?
    {
        let mut partitions = query.partitions();
        partitions.sort();
        if partitions != shown {
            println!("{} runs {partitions:?}", args.instance);
            shown = partitions;
        }
    }
    query.stop()?;
    println!(
        "{} left query '{}' after {} runs",
        args.instance,
        args.query,
        query.runs()
    );
    Ok(())
}
