//! What the examples share: logs, `--metrics-address`, `--checkpoint-location`,
//! the graceful stop on SIGTERM and SIGINT (`--grace-period`), a test-input
//! producer, the closing summary.
#![allow(dead_code)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::producer::{BaseProducer, BaseRecord};
use rdkafka::ClientConfig;
use rtflow::prelude::*;

/// Prints `RUST_LOG`-filtered logs to stderr (warnings and errors by
/// default, so that a damaged checkpoint passed over is seen), in colour only
/// on a terminal.
pub fn init_tracing() {
    rtflow::logging::init("warn");
}

/// `--grace-period`, which every example takes (`#[command(flatten)]`): the
/// bound on a graceful stop.
#[derive(clap::Args)]
pub struct StopArgs {
    /// On SIGTERM or SIGINT, stop with a final checkpoint within this many
    /// seconds, else exit at once with status 1; a second signal exits at once.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub grace_period: u64,
}

impl StopArgs {
    /// Takes SIGTERM and SIGINT over: call it before starting the query,
    /// then hand the query to [`Shutdown::stop_on_signal`].
    pub fn on_signals(&self) -> rtflow::Result<Shutdown> {
        Ok(rtflow::shutdown::on_signals()?.grace_period(Duration::from_secs(self.grace_period)))
    }
}

/// `--checkpoint-location`, which every example takes (`#[command(flatten)]`).
#[derive(clap::Args)]
pub struct CheckpointArgs {
    /// Where the query keeps its checkpoints (default: a directory named
    /// after the example in the system's temporary directory).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_location: Option<PathBuf>,
}

impl CheckpointArgs {
    /// The location given, or `rtflow-<example>` in the temporary directory.
    pub fn or_temporary(&self, example: &str) -> PathBuf {
        self.checkpoint_location
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("rtflow-{example}")))
    }
}

/// `--metrics-address`, which every example takes (`#[command(flatten)]`).
#[derive(clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (default: not served).
    #[arg(long, value_name = "HOST:PORT", value_parser = socket_address)]
    pub metrics_address: Option<SocketAddr>,
}

impl MetricsArgs {
    /// `config`, serving `/metrics` on `--metrics-address` if given.
    pub fn apply(&self, config: QueryConfig) -> QueryConfig {
        match self.metrics_address {
            Some(address) => config.metrics_address(address),
            None => config,
        }
    }

    /// Says where the started query serves its metrics, if anywhere.
    pub fn announce(&self) {
        if let Some(address) = self.metrics_address {
            println!("Prometheus metrics: http://{address}/metrics");
        }
    }
}

/// `HOST:PORT`, the host a name (`localhost`) or an IP address.
fn socket_address(text: &str) -> std::result::Result<SocketAddr, String> {
    text.to_socket_addrs()
        .map_err(|error| format!("{error} (expected HOST:PORT, e.g. 127.0.0.1:9898)"))?
        .next()
        .ok_or_else(|| format!("{text} resolves to no address"))
}

/// Writes `rate` records per second to `topic` from a background thread that
/// lives as long as the program; `record(n)` makes the n-th (key, value).
pub fn spawn_producer(
    bootstrap: &str,
    topic: &str,
    rate: u64,
    record: impl Fn(u64) -> (String, String) + Send + 'static,
) -> std::result::Result<(), BoxError> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "0")
        .create()?;
    let topic = topic.to_owned();
    std::thread::spawn(move || {
        let started = Instant::now();
        for n in 0u64.. {
            let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let (key, value) = record(n);
            // Test input only: a record the full local queue refuses is skipped.
            let _ = producer.send(BaseRecord::to(&topic).key(&key).payload(&value));
            producer.poll(Duration::ZERO);
        }
    });
    Ok(())
}

/// Prints how many records the stopped query read and wrote, and their latency.
pub fn print_summary(query: &StreamingQuery, written: &str) {
    let metrics = query.metrics();
    let latency = metrics.latency;
    println!();
    println!(
        "records read: {}  {written}: {}",
        metrics.records_read(),
        metrics.records_written()
    );
    // End-to-end starts at the Kafka record timestamp, which has millisecond resolution.
    for (name, p) in [
        ("processing", latency.processing),
        ("end-to-end", latency.end_to_end),
    ] {
        println!("{name:>10} latency ms: p50 {:.3}  p99 {:.3}", p.p50, p.p99);
    }
}
