//! What the in-process benchmarks share: their flags, medians and the latency
//! figures they print.

// Each bench compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use rtflow::{LatencyReport, Percentiles};

/// The flags of a throughput run followed by a fixed-rate latency run.
pub struct Args {
    /// Rows in a throughput run.
    pub records: u64,
    /// Throughput runs; the median is reported.
    pub runs: u64,
    /// Rows per second in the latency run.
    pub rate: u64,
    /// Length of the latency run.
    pub seconds: u64,
}

impl Args {
    /// Reads `--records N`, `--runs N`, `--rate N`, `--seconds N` over
    /// `defaults`; ignores anything else, such as the `--bench` that
    /// `cargo bench` passes.
    pub fn parse(defaults: Args) -> Self {
        let mut args = defaults;
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

    /// The command that reproduces this run.
    pub fn command(&self, bench: &str) -> String {
        format!(
            "cargo bench --bench {bench} -- --records {} --runs {} --rate {} --seconds {}",
            self.records, self.runs, self.rate, self.seconds
        )
    }
}

/// The median of `values`.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `p50 / p90 / p99 / max` in microseconds.
pub fn micros(p: &Percentiles) -> [f64; 4] {
    [p.p50, p.p90, p.p99, p.max].map(|ms| ms * 1000.0)
}

/// `p50 / p90 / p99 / max` in microseconds, as a table cell.
pub fn micros_text(p: &Percentiles) -> String {
    micros(p).map(|us| format!("{us:.1}")).join(" / ")
}

/// The JSON fields of a latency report: processing (read by the source ->
/// processed by the sink) and end-to-end (produced -> processed), in µs.
pub fn latency_fields(report: &LatencyReport) -> String {
    let [p50, p90, p99, max] = micros(&report.processing);
    let [e50, e90, e99, emax] = micros(&report.end_to_end);
    format!(
        "\"count\":{},\
         \"processing_p50_us\":{p50:.1},\"processing_p90_us\":{p90:.1},\
         \"processing_p99_us\":{p99:.1},\"processing_max_us\":{max:.1},\
         \"e2e_p50_us\":{e50:.1},\"e2e_p90_us\":{e90:.1},\
         \"e2e_p99_us\":{e99:.1},\"e2e_max_us\":{emax:.1}",
        report.processing.count
    )
}

/// A fresh checkpoint location for a run of `bench`: a run must not resume the
/// previous one's offsets and state.
pub fn fresh_location(bench: &str) -> PathBuf {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let location = std::env::temp_dir()
        .join(format!("rtflow-bench-{bench}"))
        .join(format!(
            "{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
    let _ = std::fs::remove_dir_all(&location);
    location
}
