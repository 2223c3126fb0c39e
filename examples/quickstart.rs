//! Quickstart: generator -> parse/filter -> stream-static join -> console.
//!
//! Click events are generated as text lines, parsed, filtered to purchases,
//! enriched with the user's country from a static table, and printed as they
//! arrive. After `--seconds`, or at SIGTERM or Ctrl-C, the query stops with a
//! final checkpoint and prints how many records went through and their latency.
//!
//! ```text
//! cargo run --release --example quickstart -- --seconds 10
//! RUST_LOG=rtflow_runtime=info cargo run --release --example quickstart   # with lifecycle logs
//! cargo run --release --example quickstart -- --metrics-address 127.0.0.1:9898  # + /metrics
//! ```

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use rtflow::prelude::*;

#[derive(Parser)]
#[command(about = "rtflow quickstart: generator -> parse/filter -> join -> console")]
struct Args {
    /// How long to run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Events generated per second (over all partitions).
    #[arg(long, default_value_t = 20)]
    rate: u64,
    /// Source partitions (one long-running reader each).
    #[arg(long, default_value_t = 2)]
    partitions: usize,
    #[command(flatten)]
    metrics: common::MetricsArgs,
    #[command(flatten)]
    checkpoints: common::CheckpointArgs,
    #[command(flatten)]
    stop: common::StopArgs,
}

#[derive(Debug, Clone)]
struct Click {
    user: u32,
    action: String,
    amount_cents: u64,
}

const ACTIONS: [&str; 4] = ["view", "click", "purchase", "view"];
const COUNTRIES: [&str; 5] = ["NL", "BR", "JP", "KE", "CA"];

/// The raw event, as a producer would write it: deterministic from its offset.
fn event(partition: usize, offset: u64) -> String {
    let n = offset * 7 + partition as u64 * 13;
    let amount_cents = (n * 7_919) % 10_000;
    format!(
        "user-{},{},{amount_cents}",
        n % 50,
        ACTIONS[(n % 4) as usize]
    )
}

fn parse(line: String) -> Option<Click> {
    let mut fields = line.split(',');
    let user = fields.next()?.strip_prefix("user-")?.parse().ok()?;
    let action = fields.next()?.to_owned();
    let amount_cents = fields.next()?.parse().ok()?;
    Some(Click {
        user,
        action,
        amount_cents,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    common::init_tracing();
    let shutdown = args.stop.on_signals()?;
    let users = StaticTable::from_rows(
        "users",
        (0..50u32).map(|id| (id, COUNTRIES[id as usize % COUNTRIES.len()].to_owned())),
    );

    let flow = Dataflow::new("quickstart");
    flow.source(
        GeneratorSource::new(event)
            .partitions(args.partitions)
            .rows_per_second(args.rate),
    )
    .name("clicks")
    .flat_map(parse)
    .filter(|click| click.action == "purchase")
    .broadcast_join(&users, |click| click.user)
    .sink(ConsoleSink::with_format(
        |(click, country): &(Click, String)| {
            format!(
                "user {:>2} ({country}) bought for {:>3}.{:02}",
                click.user,
                click.amount_cents / 100,
                click.amount_cents % 100
            )
        },
    ));

    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("quickstart")
                .checkpoint_location(args.checkpoints.or_temporary("quickstart"))
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    let started = Instant::now();
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;
    let elapsed = started.elapsed().as_secs_f64();

    let metrics = query.metrics();
    let read = metrics.records_out("clicks");
    let latency = metrics.latency;
    println!();
    println!(
        "records read: {read}  purchases printed: {}  ({:.0} records/s over {elapsed:.1} s)",
        latency.processing.count,
        read as f64 / elapsed
    );
    for (name, p) in [
        ("processing", latency.processing),
        ("end-to-end", latency.end_to_end),
    ] {
        println!(
            "{name:>10} latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}",
            p.p50, p.p90, p.p99
        );
    }
    Ok(())
}
