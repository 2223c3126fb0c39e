//! Benchmark of a stream-stream inner join: two generator sources (impressions
//! and clicks, 2 partitions each) with watermarks (delay 100 ms) -> union ->
//! key_by -> join within 1 s either way -> sink.
//!
//! Row `o` of partition `p` has key `2o + p` on both sides, so every click
//! matches one impression:
//!
//! * **throughput**: each side generates `--records` rows as fast as the query
//!   takes them, event time = the row's offset in ms (1,000 rows per second of
//!   event time per partition); records/s is the rows of both sides divided by
//!   the wall time from `start()` until the query drains, median of `--runs`;
//! * **latency**: each side generates `--rate` rows/s for `--seconds`, event
//!   time = wall-clock time; the sink's processing latency percentiles (read by
//!   the source -> written by the sink) are reported in microseconds.
//!
//! Each measurement prints one JSON line to stdout; the command goes to stderr.
//!
//! ```text
//! cargo bench --bench stream_join
//! cargo bench --bench stream_join -- --records 2000000 --runs 3 --rate 20000 --seconds 10
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rtflow::prelude::*;
use rtflow::runtime::record::{nanos_to_event_time, now_nanos};
use rtflow::LatencyReport;

mod common;
use common::{latency_fields, median, Args};

const PARTITIONS: usize = 2;

/// `(key, event time in ms)`.
type Row = (u64, i64);

/// Starts the join; `source` makes each side's generator, and the count of
/// joined pairs is kept in `pairs`.
fn start(
    source: impl Fn() -> GeneratorSource<Row>,
    pairs: Arc<AtomicU64>,
    name: &str,
) -> Result<StreamingQuery> {
    let flow = Dataflow::new("stream-join");
    let delay = Duration::from_millis(100);
    let impressions = flow
        .source(source().partitions(PARTITIONS))
        .with_watermark(|row: &Row| row.1, delay);
    let clicks = flow
        .source(source().partitions(PARTITIONS))
        .with_watermark(|row: &Row| row.1, delay);
    let window = JoinWindow::between(Duration::from_secs(1), Duration::from_secs(1));
    impressions
        .join(&clicks, |row| row.0, |row| row.0, window)
        .parallelism(PARTITIONS)
        .sink(ForeachSink::from_fn(move |_| {
            pairs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }));
    let location = std::env::temp_dir().join(format!("rtflow-bench-stream-join-{name}"));
    let _ = std::fs::remove_dir_all(&location);
    flow.start(
        QueryConfig::new("stream-join")
            .checkpoint_location(location)
            .trigger(Trigger::real_time("5 seconds")),
    )
}

fn key(partition: usize, offset: u64) -> u64 {
    offset * PARTITIONS as u64 + partition as u64
}

/// Median wall time in seconds to join `args.records` rows per side, and the
/// pairs of the last run.
fn throughput(args: &Args) -> Result<(f64, u64)> {
    let per_partition = args.records / PARTITIONS as u64;
    let mut seconds = Vec::new();
    let mut last_pairs = 0;
    for run in 0..args.runs {
        let pairs = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let query = start(
            || GeneratorSource::new(|p, o| (key(p, o), o as i64)).rows_per_partition(per_partition),
            pairs.clone(),
            &format!("throughput-{run}"),
        )?;
        query.await_termination(None)?;
        seconds.push(started.elapsed().as_secs_f64());
        last_pairs = pairs.load(Ordering::Relaxed);
    }
    Ok((median(seconds), last_pairs))
}

/// Sink latencies after `args.seconds` at `args.rate` rows/s per side.
fn latency(args: &Args) -> Result<(LatencyReport, u64)> {
    let pairs = Arc::new(AtomicU64::new(0));
    let query = start(
        || {
            GeneratorSource::new(|p, o| (key(p, o), nanos_to_event_time(now_nanos())))
                .rows_per_second(args.rate)
        },
        pairs.clone(),
        "latency",
    )?;
    query.await_termination(Some(Duration::from_secs(args.seconds)))?;
    query.stop()?;
    Ok((query.metrics().latency, pairs.load(Ordering::Relaxed)))
}

fn main() -> Result<()> {
    let args = Args::parse(Args {
        records: 2_000_000,
        runs: 3,
        rate: 20_000,
        seconds: 10,
    });
    eprintln!("command: {}", args.command("stream_join"));
    let (seconds, pairs) = throughput(&args)?;
    let records = args.records / PARTITIONS as u64 * PARTITIONS as u64 * 2;
    println!(
        "{{\"bench\":\"stream_join\",\"mode\":\"throughput\",\"records\":{records},\
         \"pairs\":{pairs},\"runs\":{},\"seconds\":{seconds:.3},\"records_per_sec\":{:.0}}}",
        args.runs,
        records as f64 / seconds
    );
    let (report, pairs) = latency(&args)?;
    println!(
        "{{\"bench\":\"stream_join\",\"mode\":\"latency\",\"rate_per_side\":{},\"seconds\":{},\
         \"pairs\":{pairs},{}}}",
        args.rate,
        args.seconds,
        latency_fields(&report)
    );
    Ok(())
}
