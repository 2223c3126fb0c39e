//! Benchmark of the dataflow generator (2 partitions) -> map -> filter -> sink.
//!
//! For operator chaining on (the default: each partition's whole pipeline runs in
//! one actor) and off (every operator its own actor thread, linked by bounded
//! mailboxes), it measures:
//!
//! * **throughput**: the generator produces `--records` rows in total as fast
//!   as the query takes them; records/s is the rows generated divided by the wall
//!   time from `start()` until `await_termination` returns, median of `--runs` runs;
//! * **latency**: the generator produces `--rate` rows/s in total for `--seconds`,
//!   then the query is stopped and the sink's processing (read by the source ->
//!   processed by the sink) and end-to-end (produced -> processed) latency
//!   percentiles are reported in microseconds.
//!
//! Each measurement prints one JSON line to stdout; the command and a summary
//! table go to stderr.
//!
//! ```text
//! cargo bench --bench pipeline
//! cargo bench --bench pipeline -- --records 20000000 --runs 3 --rate 100000 --seconds 10
//! ```

use std::time::{Duration, Instant};

use rtflow::prelude::*;
use rtflow::LatencyReport;

mod common;
use common::{fresh_location, latency_fields, median, micros_text, Args};

const PARTITIONS: u64 = 2;

/// Starts generator -> map -> filter -> sink, the generator's pace set by `source`.
fn start(source: GeneratorSource<u64>, chaining: bool) -> Result<StreamingQuery> {
    let flow = Dataflow::new("pipeline");
    flow.source(source.partitions(PARTITIONS as usize))
        .name("generator")
        .map(|x: u64| x.wrapping_mul(31) ^ 7)
        .filter(|x| x % 100 != 0)
        .sink(ForeachSink::from_fn(|_| Ok(())));
    flow.start(
        QueryConfig::new("pipeline")
            .checkpoint_location(fresh_location("pipeline"))
            .trigger(Trigger::real_time("30 seconds"))
            .operator_chaining(chaining),
    )
}

/// Median wall time, in seconds, to push `args.records` rows through.
fn throughput(args: &Args, chaining: bool) -> Result<f64> {
    let mut seconds = Vec::new();
    for _ in 0..args.runs {
        let started = Instant::now();
        let query = start(
            GeneratorSource::new(|_, offset| offset).rows_per_partition(args.records / PARTITIONS),
            chaining,
        )?;
        query.await_termination(None)?;
        seconds.push(started.elapsed().as_secs_f64());
        let generated = query.metrics().records_out("generator");
        assert_eq!(
            generated,
            args.records / PARTITIONS * PARTITIONS,
            "rows generated"
        );
    }
    Ok(median(seconds))
}

/// Sink latencies after `args.seconds` at `args.rate` rows/s.
fn latency(args: &Args, chaining: bool) -> Result<LatencyReport> {
    let query = start(
        GeneratorSource::new(|_, offset| offset).rows_per_second(args.rate),
        chaining,
    )?;
    query.await_termination(Some(Duration::from_secs(args.seconds)))?;
    query.stop()?;
    Ok(query.metrics().latency)
}

fn main() -> Result<()> {
    let args = Args::parse(Args {
        records: 20_000_000,
        runs: 3,
        rate: 100_000,
        seconds: 10,
    });
    eprintln!("command: {}", args.command("pipeline"));
    let records = args.records / PARTITIONS * PARTITIONS;
    let mut table = Vec::new();
    for chaining in [true, false] {
        let seconds = throughput(&args, chaining)?;
        let per_sec = records as f64 / seconds;
        println!(
            "{{\"bench\":\"pipeline\",\"mode\":\"throughput\",\"chaining\":{chaining},\
             \"records\":{records},\"runs\":{},\"seconds\":{seconds:.3},\
             \"records_per_sec\":{per_sec:.0}}}",
            args.runs
        );

        let report = latency(&args, chaining)?;
        println!(
            "{{\"bench\":\"pipeline\",\"mode\":\"latency\",\"chaining\":{chaining},\
             \"rate\":{},\"seconds\":{},{}}}",
            args.rate,
            args.seconds,
            latency_fields(&report)
        );
        table.push((chaining, per_sec, report));
    }

    eprintln!(
        "\ngenerator({PARTITIONS} partitions) -> map -> filter -> sink; throughput: \
         {records} records, median of {} runs; latency: {} records/s for {} s, in µs",
        args.runs, args.rate, args.seconds
    );
    eprintln!(
        "{:<9}{:>13}{:>11}  {:>34}  {:>34}",
        "chaining",
        "records/s",
        "count",
        "processing p50/p90/p99/max",
        "end-to-end p50/p90/p99/max"
    );
    for (chaining, per_sec, report) in table {
        eprintln!(
            "{:<9}{:>13.0}{:>11}  {:>34}  {:>34}",
            if chaining { "on" } else { "off" },
            per_sec,
            report.processing.count,
            micros_text(&report.processing),
            micros_text(&report.end_to_end)
        );
    }
    Ok(())
}
