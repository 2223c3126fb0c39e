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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rtflow::prelude::*;
use rtflow::runtime::record::now_nanos;
use rtflow::{LatencyReport, Percentiles};

const PARTITIONS: u64 = 2;
const KEYS: u64 = 10_000;

struct Args {
    /// Rows over all generator partitions in a throughput run.
    records: u64,
    /// Throughput runs; the median is reported.
    runs: u64,
    /// Rows per second over all partitions in the latency run.
    rate: u64,
    /// Length of the latency run.
    seconds: u64,
}

impl Args {
    /// Reads `--records N`, `--runs N`, `--rate N`, `--seconds N`; ignores anything
    /// else, such as the `--bench` that `cargo bench` passes.
    fn parse() -> Self {
        let mut args = Self {
            records: 5_000_000,
            runs: 3,
            rate: 100_000,
            seconds: 10,
        };
        let mut words = std::env::args().skip(1);
        while let Some(flag) = words.next() {
            let value = match flag.as_str() {
                "--records" => &mut args.records,
                "--runs" => &mut args.runs,
                "--rate" => &mut args.rate,
                "--seconds" => &mut args.seconds,
                _ => continue,
            };
            let Some(parsed) = words.next().and_then(|v| v.parse().ok()).filter(|v| *v > 0) else {
                eprintln!("{flag} takes a positive integer");
                std::process::exit(2);
            };
            *value = parsed;
        }
        args
    }
}

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
    // A fresh checkpoint location per run: a run must not resume the previous
    // one's offsets and windows.
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let location = std::env::temp_dir()
        .join("rtflow-bench-window")
        .join(format!(
            "{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
    let _ = std::fs::remove_dir_all(&location);
    flow.start(
        QueryConfig::new("window")
            .checkpoint_location(location)
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
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[seconds.len() / 2])
}

/// Sink latencies after `args.seconds` at `args.rate` rows/s.
fn latency(args: &Args) -> Result<LatencyReport> {
    let query = start(GeneratorSource::new(row).rows_per_second(args.rate))?;
    query.await_termination(Some(Duration::from_secs(args.seconds)))?;
    query.stop()?;
    Ok(query.metrics().latency)
}

/// `p50 / p90 / p99 / max` in microseconds.
fn micros(p: &Percentiles) -> [f64; 4] {
    [p.p50, p.p90, p.p99, p.max].map(|ms| ms * 1000.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    eprintln!(
        "command: cargo bench --bench window -- --records {} --runs {} --rate {} --seconds {}",
        args.records, args.runs, args.rate, args.seconds
    );
    let records = args.records / PARTITIONS * PARTITIONS;
    let seconds = throughput(&args)?;
    let per_sec = records as f64 / seconds;
    println!(
        "{{\"bench\":\"window\",\"mode\":\"throughput\",\"records\":{records},\"runs\":{},\
         \"seconds\":{seconds:.3},\"records_per_sec\":{per_sec:.0}}}",
        args.runs
    );

    let report = latency(&args)?;
    let [p50, p90, p99, max] = micros(&report.processing);
    let [e50, e90, e99, emax] = micros(&report.end_to_end);
    println!(
        "{{\"bench\":\"window\",\"mode\":\"latency\",\"rate\":{},\"seconds\":{},\"count\":{},\
         \"processing_p50_us\":{p50:.1},\"processing_p90_us\":{p90:.1},\
         \"processing_p99_us\":{p99:.1},\"processing_max_us\":{max:.1},\
         \"e2e_p50_us\":{e50:.1},\"e2e_p90_us\":{e90:.1},\
         \"e2e_p99_us\":{e99:.1},\"e2e_max_us\":{emax:.1}}}",
        args.rate, args.seconds, report.processing.count
    );

    let row = |p: &Percentiles| micros(p).map(|us| format!("{us:.1}")).join(" / ");
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
        row(&report.processing),
        row(&report.end_to_end)
    );
    Ok(())
}
