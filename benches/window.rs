//! Benchmark of a sliding-window count per key: generator (2 partitions) ->
//! watermark (1 s delay) -> key_by -> window of 10 s sliding by 2 s -> count ->
//! sink, over 10k keys. Each record updates the 5 windows it falls into, so the
//! sink receives 5 rows per record.
//!
//! Event time is the wall clock when the generator makes a row, so the watermark
//! advances in real time and windows are evicted as they close, as in production.
//!
//! * **throughput**: the generator produces `--records` rows as fast as the
//!   query takes them; records/s is rows in divided by the wall time from
//!   `start()` until `await_termination` returns, median of `--runs` runs;
//! * **latency**: the generator produces `--rate` rows/s for `--seconds`, then
//!   the query is stopped and the sink's processing (read by the source ->
//!   written by the sink) and end-to-end (produced -> written) latency
//!   percentiles are reported in microseconds.
//!
//! Each measurement prints one JSON line to stdout; the command and a summary go
//! to stderr.
//!
//! ```text
//! cargo bench --bench window
//! cargo bench --bench window -- --records 5000000 --runs 3 --rate 100000 --seconds 10
//! ```

use std::time::{Duration, Instant};

use rtflow::prelude::*;
use rtflow::runtime::record::now_nanos;
use rtflow::LatencyReport;

mod common;
use common::{fresh_location, latency_fields, median, micros_text, Args};

const PARTITIONS: u64 = 2;
const KEYS: u64 = 10_000;

/// `(key, event time in ms)`: keys dealt in turn over both partitions.
fn row(partition: usize, offset: u64) -> (u64, i64) {
    let key = (offset * PARTITIONS + partition as u64) % KEYS;
    (key, (now_nanos() / 1_000_000) as i64)
}

/// Starts the windowed count, the generator's pace set by `source`.
fn start(source: GeneratorSource<(u64, i64)>) -> Result<StreamingQuery> {
    let flow = Dataflow::new("window");
    flow.source(source.partitions(PARTITIONS as usize))
        .name("generator")
        .with_watermark(|(_, time)| *time, Duration::from_secs(1))
        .key_by(|(key, _)| *key)
        .window(Window::sliding(
            Duration::from_secs(10),
            Duration::from_secs(2),
        ))
        .count()
        .sink(ForeachSink::from_fn(|_| Ok(())));
    flow.start(
        QueryConfig::new("window")
            .checkpoint_location(fresh_location("window"))
            .trigger(Trigger::real_time("30 seconds")),
    )
}

/// Median wall time, in seconds, to push `args.records` rows through.
fn throughput(args: &Args) -> Result<f64> {
    let mut seconds = Vec::new();
    for _ in 0..args.runs {
        let started = Instant::now();
        let query = start(GeneratorSource::new(row).rows_per_partition(args.records / PARTITIONS))?;
        query.await_termination(None)?;
        seconds.push(started.elapsed().as_secs_f64());
        assert_eq!(
            query.metrics().records_out("generator"),
            args.records / PARTITIONS * PARTITIONS,
            "rows generated"
        );
        assert_eq!(query.metrics().late_records(), 0, "no row is late");
    }
    Ok(median(seconds))
}

/// Sink latencies after `args.seconds` at `args.rate` rows/s.
fn latency(args: &Args) -> Result<LatencyReport> {
    let query = start(GeneratorSource::new(row).rows_per_second(args.rate))?;
    query.await_termination(Some(Duration::from_secs(args.seconds)))?;
    query.stop()?;
    Ok(query.metrics().latency)
}

fn main() -> Result<()> {
    let args = Args::parse(Args {
        records: 5_000_000,
        runs: 3,
        rate: 100_000,
        seconds: 10,
    });
    eprintln!("command: {}", args.command("window"));
    let records = args.records / PARTITIONS * PARTITIONS;
    let seconds = throughput(&args)?;
    let per_sec = records as f64 / seconds;
    println!(
        "{{\"bench\":\"window\",\"mode\":\"throughput\",\"records\":{records},\"runs\":{},\
         \"seconds\":{seconds:.3},\"records_per_sec\":{per_sec:.0}}}",
        args.runs
    );

    let report = latency(&args)?;
    println!(
        "{{\"bench\":\"window\",\"mode\":\"latency\",\"rate\":{},\"seconds\":{},{}}}",
        args.rate,
        args.seconds,
        latency_fields(&report)
    );

    eprintln!(
        "\ngenerator({PARTITIONS} partitions) -> watermark -> key_by ({KEYS} keys) -> \
         sliding window 10 s / 2 s -> count -> sink"
    );
    eprintln!(
        "throughput: {per_sec:.0} records/s in ({:.0} window updates/s out), {records} records, \
         median of {} runs",
        per_sec * 5.0,
        args.runs
    );
    eprintln!(
        "latency at {} records/s for {} s ({} rows at the sink), µs p50/p90/p99/max: \
         processing {}; end-to-end {}",
        args.rate,
        args.seconds,
        report.processing.count,
        micros_text(&report.processing),
        micros_text(&report.end_to_end)
    );
    Ok(())
}
