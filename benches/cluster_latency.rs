//! A keyed query across a shuffle, in one process and clustered: how long a
//! record takes from its production to a `read_committed` reader of the
//! output.
//!
//! The dataflow is `KafkaSource` (`--partitions`, default 4, records of
//! `--record-bytes`, default 1,200, each under its own key) ->
//! `drop_duplicates(key)`, which shuffles by the key (in a cluster through a
//! repartition topic) -> `KafkaSink`. Every record reaches the output once.
//! The same build closure runs, each in processes of its own, as
//!
//! * `one`: `Dataflow::start`, one process;
//! * `cluster-1` and `cluster-3`: `KafkaCluster::start` in one and in three
//!   processes;
//! * `kstreams` (with `--kstreams DIR`, the Kafka Streams app of
//!   `../shared/peers/kstreams`): Kafka Streams 4.1 running the same topology
//!   (`repartition()`, a dedup processor on a RocksDB store with a
//!   changelog), its commit interval the batch duration;
//! * `relay-shuffle` (at least once only): the floor for any engine that
//!   shuffles through Kafka, two hand-written rdkafka relays in one process,
//!   one from the input to a shuffle topic by the key's hash, one from there
//!   to the output (no state, no commits; the settings of `kafka_latency`'s
//!   relay: `linger.ms=1`, 5 requests in flight, `fetch.wait.max.ms=5`),
//!
//! with an at-least-once and an exactly-once sink (`--deliveries alo,eo`),
//! at each batch duration of `--batches` (default 100 ms, 1 s and 5 min) and
//! each rate of `--rates` (default 1,000 and 10,000 records/s), for
//! `--seconds` (default 20) each, the first 2 s not measured. With
//! `--rounds N` every mode runs N times in turn (each round in a rotated
//! order) and the summary pools the rounds' latencies: a broker stall of a
//! few hundred milliseconds, which on this kind of machine hits one run in
//! a few and moves its p99 by as much, then weighs on one run in N. Exactly-once
//! output shows when its epoch commits, so a batch longer than the run is
//! measured at least once only. Each run prints one JSON line to stdout;
//! the summary (p50 / p99 / p99.9 and each ratio to one process at the same
//! delivery, batch and rate, and of a clustered at-least-once query to
//! `relay-shuffle` at the same rate) goes to stderr. For a clustered query
//! with a batch of 1 s or more it also gives p50 / p99 of the records
//! produced in the first 100 ms after a batch tick (its epochs end on
//! multiples of the batch duration since the Unix epoch), which meet that
//! checkpoint's commits: a change to them shows there even when a noisy
//! machine hides it in the p99 of all.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster_latency
//! cargo bench --bench cluster_latency -- --rates 1000 --batches 1s --deliveries alo \
//!     --modes one,cluster-3 --seconds 30
//! ../shared/peers/kstreams/build.sh
//! cargo bench --bench cluster_latency -- --batches 100ms --deliveries eo \
//!     --kstreams ../shared/peers/kstreams
//! ```

#[path = "common/latency.rs"]
mod latency;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use latency::{consume, forward, now_us, quantile_ms, Load, Sample, PRODUCED_US};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rtflow::prelude::*;
use serde::{Deserialize, Serialize};

type BenchResult<T> = std::result::Result<T, BoxError>;

/// What a child process runs, from this variable: the fields of [`Spec`].
const CHILD_SPEC: &str = "RTFLOW_BENCH_LATENCY_CHILD";
/// Records produced in the first seconds are not measured: connections,
/// fetch sessions and caches are still warming up.
const WARM_UP: Duration = Duration::from_secs(2);
/// How long the consumer waits for the last records once the producer is done.
const DRAIN: Duration = Duration::from_secs(15);
/// Records produced this soon after a batch tick are also reported apart,
/// for batches of ten times this or more.
const AT_TICK: Duration = Duration::from_millis(100);
/// How long the processes must have kept their partitions before the load
/// starts.
const SETTLED: Duration = Duration::from_secs(3);
/// How long processes may take to start or stop.
const START_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Parser)]
#[command(about = "Latency of a keyed query across a shuffle, in one process and clustered")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value_t = default_bootstrap())]
    bootstrap: String,
    /// Records per second over all partitions, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000, 10_000])]
    rates: Vec<u64>,
    /// Batch durations (humantime: 100ms, 1s, 5m), one run each.
    #[arg(long, value_delimiter = ',', default_values = ["100ms", "1s", "5m"])]
    batches: Vec<humantime::Duration>,
    /// The sink's delivery: alo (at least once), eo (exactly once).
    #[arg(long, value_delimiter = ',', default_values = ["alo", "eo"])]
    deliveries: Vec<Delivery>,
    /// What runs the query.
    #[arg(long, value_delimiter = ',',
          default_values = ["one", "cluster-1", "cluster-3", "relay-shuffle"])]
    modes: Vec<Mode>,
    /// The Kafka Streams app's directory: runs it too, as mode `kstreams`.
    #[arg(long)]
    kstreams: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    partitions: u64,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    #[arg(long, default_value_t = 1_200)]
    record_bytes: u64,
    /// Runs every mode this many times in turn, and summarises each mode's
    /// rounds pooled.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Keeps each run's directory (the processes' logs; `RUST_LOG` sets
    /// what they write) and prints its path.
    #[arg(long)]
    keep_logs: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn default_bootstrap() -> String {
    std::env::var("RTFLOW_KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
enum Delivery {
    Alo,
    Eo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
enum Mode {
    One,
    #[value(name = "cluster-1")]
    Cluster1,
    #[value(name = "cluster-3")]
    Cluster3,
    Kstreams,
    #[value(name = "relay-shuffle")]
    RelayShuffle,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::One => "one",
            Mode::Cluster1 => "cluster-1",
            Mode::Cluster3 => "cluster-3",
            Mode::Kstreams => "kstreams",
            Mode::RelayShuffle => "relay-shuffle",
        }
    }

    fn processes(self) -> usize {
        match self {
            Mode::Cluster3 => 3,
            Mode::One | Mode::Cluster1 | Mode::Kstreams | Mode::RelayShuffle => 1,
        }
    }
}

/// What a child process runs.
#[derive(Clone, Serialize, Deserialize)]
struct Spec {
    mode: Mode,
    delivery: Delivery,
    batch_ms: u64,
    partitions: u64,
    bootstrap: String,
    query: String,
    input: String,
    output: String,
    instance: String,
    dir: PathBuf,
}

/// An input record as the query sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Event {
    key: String,
    partition: i32,
    value: String,
    produced: Vec<u8>,
}

/// The dataflow, the same in every mode.
fn build(flow: &Dataflow, spec: &Spec) {
    let mut sink = KafkaSink::new(&spec.bootstrap, &spec.output, |e: &Event| {
        KafkaMessage::new(e.value.clone())
            .key(e.key.clone())
            .partition(e.partition)
            .header(PRODUCED_US, e.produced.clone())
    });
    if spec.delivery == Delivery::Eo {
        sink = sink.delivery(DeliveryGuarantee::ExactlyOnce);
    }
    flow.source(
        KafkaSource::new(&spec.bootstrap)
            .subscribe([spec.input.as_str()])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(|record: KafkaRecord| Event {
        key: record.key_str().into_owned(),
        partition: record.partition,
        value: record.value_str().into_owned(),
        produced: record
            .header(PRODUCED_US)
            .map_or_else(Vec::new, |h| h.to_vec()),
    })
    .drop_duplicates(|e: &Event| e.key.clone())
    .sink(sink);
}

fn config(spec: &Spec) -> QueryConfig {
    let batch = Duration::from_millis(spec.batch_ms);
    QueryConfig::new(&spec.query)
        .trigger(Trigger::real_time(format!(
            "{} milliseconds",
            spec.batch_ms
        )))
        // Below real-time mode's default minimum (5 s), which guards against
        // checkpointing too often by mistake, not for a latency measurement.
        .min_batch_duration(batch.min(Duration::from_secs(5)))
        .task_slots(64)
}

/// A child: runs the query, writes how many input partitions it reads
/// every 50 ms, and stops when the stop file appears.
fn child(spec: Spec) -> BenchResult<()> {
    rtflow::logging::init("warn");
    let status = spec.dir.join(format!("{}.status", spec.instance));
    let stop = spec.dir.join("stop");
    let write_status = |owned: usize| -> BenchResult<()> {
        std::fs::write(status.with_extension("tmp"), owned.to_string())?;
        std::fs::rename(status.with_extension("tmp"), &status)?;
        Ok(())
    };
    match spec.mode {
        Mode::One => {
            let flow = Dataflow::new("cluster-latency");
            build(&flow, &spec);
            let query =
                flow.start(config(&spec).checkpoint_location(spec.dir.join("checkpoints")))?;
            // One process reads every partition.
            write_status(spec.partitions as usize)?;
            while !stop.exists() {
                if !query.is_active() {
                    return Err(format!("the query failed: {:?}", query.exception()).into());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            query.stop()?;
        }
        Mode::Cluster1 | Mode::Cluster3 => {
            let read = format!("{}-", spec.input);
            let config = config(&spec);
            let spec = std::sync::Arc::new(spec);
            let building = spec.clone();
            let query = KafkaCluster::new(&spec.bootstrap)
                .instance(&spec.instance)
                .repartition_partitions(4)
                .start(config, move |flow: &Dataflow| {
                    build(flow, &building);
                    Ok(())
                })?;
            while !stop.exists() {
                if !query.is_active() {
                    return Err(format!("the process failed: {:?}", query.stop()).into());
                }
                let owned = if query.runs() == 0 {
                    0
                } else {
                    let partitions = query.partitions();
                    partitions.iter().filter(|p| p.starts_with(&read)).count()
                };
                write_status(owned)?;
                std::thread::sleep(Duration::from_millis(50));
            }
            query.stop()?;
        }
        Mode::RelayShuffle => {
            let shuffle = shuffle_topic(&spec);
            let stop_relays = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|scope| -> BenchResult<()> {
                let to_shuffle = scope.spawn(|| {
                    relay(&spec, &spec.input, &shuffle, &stop_relays, |message| {
                        let key = message.key().unwrap_or_default();
                        let hash = key.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
                        });
                        (hash % spec.partitions) as i32
                    })
                });
                let to_output = scope.spawn(|| {
                    relay(&spec, &shuffle, &spec.output, &stop_relays, |message| {
                        message.partition()
                    })
                });
                write_status(spec.partitions as usize)?;
                while !stop.exists() && !to_shuffle.is_finished() && !to_output.is_finished() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                stop_relays.store(true, Ordering::Release);
                for relay in [to_shuffle, to_output] {
                    relay.join().expect("a relay does not panic")?;
                }
                Ok(())
            })?;
        }
        Mode::Kstreams => unreachable!("Kafka Streams runs as its own app"),
    }
    Ok(())
}

/// The topic `relay-shuffle` shuffles through.
fn shuffle_topic(spec: &Spec) -> String {
    format!("{}-shuffle", spec.input)
}

/// Reads every partition of `input` from the beginning and produces each
/// message to partition `to(message)` of `output`, key, value and headers as
/// read, until `stop`.
fn relay(
    spec: &Spec,
    input: &str,
    output: &str,
    stop: &std::sync::atomic::AtomicBool,
    to: impl Fn(&BorrowedMessage<'_>) -> i32,
) -> BenchResult<()> {
    let config = |settings: &[(&str, &str)]| {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &spec.bootstrap)
            .set("socket.nagle.disable", "true");
        for (key, value) in settings {
            config.set(*key, *value);
        }
        config
    };
    let consumer: BaseConsumer = config(&[
        ("group.id", "rtflow-bench-relay-shuffle"),
        ("enable.auto.commit", "false"),
        ("fetch.wait.max.ms", "5"),
    ])
    .create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..spec.partitions as i32 {
        assignment.add_partition_offset(input, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let producer: BaseProducer = config(&[
        ("linger.ms", "1"),
        ("max.in.flight.requests.per.connection", "5"),
    ])
    .create()?;
    while !stop.load(Ordering::Acquire) {
        producer.poll(Duration::ZERO);
        let Some(message) = consumer.poll(Duration::from_millis(1)) else {
            continue;
        };
        let message = message?;
        forward(&producer, &message, output, to(&message))?;
    }
    producer.flush(Duration::from_secs(30))?;
    Ok(())
}

/// The processes running one measurement's query.
struct Processes {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Processes {
    fn spawn(args: &Args, spec: &Spec) -> BenchResult<Self> {
        std::fs::create_dir_all(&spec.dir)?;
        let mut processes = Self {
            dir: spec.dir.clone(),
            children: Vec::new(),
        };
        if spec.mode == Mode::Kstreams {
            let dir = args
                .kstreams
                .as_ref()
                .expect("kstreams runs with its directory");
            let (guarantee, commit) = match spec.delivery {
                Delivery::Alo => ("at_least_once", spec.batch_ms),
                Delivery::Eo => ("exactly_once_v2", spec.batch_ms),
            };
            let log = std::fs::File::create(spec.dir.join("kstreams.log"))?;
            let child = Command::new(dir.join("run.sh"))
                .args([&spec.bootstrap, &spec.input, &spec.output, guarantee])
                .arg(commit.to_string())
                .env("APP_ID", &spec.query)
                .env("FRESH", "1")
                .stdout(std::fs::File::create(spec.dir.join("kstreams.status"))?)
                .stderr(log)
                .spawn()?;
            processes.children.push(child);
            return Ok(processes);
        }
        for i in 0..spec.mode.processes() {
            let instance = format!("p{i}");
            let log = std::fs::File::create(spec.dir.join(format!("{instance}.log")))?;
            let child_spec = Spec {
                instance,
                dir: spec.dir.clone(),
                ..spec.clone()
            };
            let child = Command::new(std::env::current_exe()?)
                .env(CHILD_SPEC, serde_json::to_string(&child_spec)?)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()?;
            processes.children.push(child);
        }
        Ok(processes)
    }

    /// Waits until the processes read every input partition between them,
    /// and kept them for [`SETTLED`].
    fn await_settled(&mut self, mode: Mode, partitions: u64) -> BenchResult<()> {
        let started = Instant::now();
        let mut since = Instant::now();
        let mut last = None;
        loop {
            self.check()?;
            let owned: Vec<String> = if mode == Mode::Kstreams {
                let running = std::fs::read_to_string(self.dir.join("kstreams.status"))
                    .unwrap_or_default()
                    .contains("RUNNING");
                vec![if running { partitions } else { 0 }.to_string()]
            } else {
                (0..mode.processes())
                    .map(|i| {
                        std::fs::read_to_string(self.dir.join(format!("p{i}.status")))
                            .unwrap_or_default()
                    })
                    .collect()
            };
            let total: u64 = owned.iter().filter_map(|o| o.parse::<u64>().ok()).sum();
            if last.as_ref() != Some(&owned) {
                (last, since) = (Some(owned), Instant::now());
            } else if total == partitions && since.elapsed() >= SETTLED {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(format!("the processes did not settle:\n{}", self.logs()).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// An error with the logs if a process has exited.
    fn check(&mut self) -> BenchResult<()> {
        for child in &mut self.children {
            if let Some(status) = child.try_wait()? {
                return Err(format!("a process exited early ({status}):\n{}", self.logs()).into());
            }
        }
        Ok(())
    }

    fn stop(mut self) -> BenchResult<()> {
        std::fs::write(self.dir.join("stop"), b"")?;
        let started = Instant::now();
        for child in &mut self.children {
            // Kafka Streams closes on SIGTERM; rtflow's children on the file.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            loop {
                if child.try_wait()?.is_some() {
                    break;
                }
                if started.elapsed() > START_TIMEOUT {
                    child.kill()?;
                    return Err(format!("a process did not stop:\n{}", self.logs()).into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    fn logs(&self) -> String {
        let mut logs = String::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                logs.push_str(&format!("--- {}\n{text}\n", entry.path().display()));
            }
        }
        logs
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One measurement.
struct Run {
    mode: Mode,
    delivery: Delivery,
    batch: Duration,
    rate: u64,
    round: u64,
    produced: u64,
    received: u64,
    /// Sorted, microseconds; never empty.
    latencies: Vec<u64>,
    /// Those of records produced within [`AT_TICK`] after a batch tick,
    /// sorted; a clustered query's only (one process ends its epochs a
    /// batch apart from its start, not on the clock).
    at_tick: Vec<u64>,
}

impl Run {
    fn ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latencies, q)
    }

    /// The `q` quantile of the records produced just after a tick, if any.
    fn at_tick_ms(&self, q: f64) -> Option<f64> {
        (!self.at_tick.is_empty()).then(|| quantile_ms(&self.at_tick, q))
    }

    fn batch(&self) -> String {
        humantime::format_duration(self.batch).to_string()
    }

    fn key(&self) -> (Mode, Delivery, Duration, u64) {
        (self.mode, self.delivery, self.batch, self.rate)
    }
}

/// Each mode's rounds as one run, their latencies pooled, in the order the
/// modes first ran.
fn pooled(runs: &[Run]) -> Vec<Run> {
    let mut pooled: Vec<Run> = Vec::new();
    for run in runs {
        match pooled.iter_mut().find(|p| p.key() == run.key()) {
            Some(p) => {
                p.produced += run.produced;
                p.received += run.received;
                p.latencies.extend(&run.latencies);
                p.at_tick.extend(&run.at_tick);
            }
            None => pooled.push(Run {
                latencies: run.latencies.clone(),
                at_tick: run.at_tick.clone(),
                ..*run
            }),
        }
    }
    for run in &mut pooled {
        run.latencies.sort_unstable();
        run.at_tick.sort_unstable();
    }
    pooled
}

fn run(
    args: &Args,
    mode: Mode,
    delivery: Delivery,
    batch: Duration,
    rate: u64,
    round: u64,
) -> BenchResult<Run> {
    let id = format!("{}-{}", std::process::id(), now_us());
    let spec = Spec {
        mode,
        delivery,
        batch_ms: batch.as_millis() as u64,
        partitions: args.partitions,
        bootstrap: args.bootstrap.clone(),
        query: format!("cluster-latency-{id}"),
        input: format!("rtflow-cluster-latency-in-{id}"),
        output: format!("rtflow-cluster-latency-out-{id}"),
        instance: String::new(),
        dir: std::env::temp_dir().join(format!("rtflow-bench-cluster-latency-{id}")),
    };
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    admin.create_topic(&spec.input, args.partitions as i32)?;
    admin.create_topic(&spec.output, args.partitions as i32)?;
    if mode == Mode::RelayShuffle {
        admin.create_topic(&shuffle_topic(&spec), args.partitions as i32)?;
    }
    let mut processes = Processes::spawn(args, &spec)?;
    processes.await_settled(mode, args.partitions)?;
    let measure_from_us = now_us() + WARM_UP.as_micros() as u64;
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let expected = AtomicU64::new(u64::MAX);
    let (produced, (received, samples)) = std::thread::scope(|scope| {
        let consumer = scope.spawn(|| {
            consume(
                &args.bootstrap,
                args.partitions,
                &[],
                &spec.output,
                &expected,
                until + DRAIN,
                measure_from_us,
            )
        });
        let load = Load {
            bootstrap: &args.bootstrap,
            partitions: args.partitions,
            record_bytes: args.record_bytes,
            keyed: true,
            options: &[],
        };
        let produced = load.produce(rate, &spec.input, until);
        expected.store(*produced.as_ref().unwrap_or(&0), Ordering::Release);
        let consumed = consumer.join().expect("the consumer thread does not panic");
        Ok::<_, BoxError>((produced?, consumed?))
    })?;
    processes.check()?;
    processes.stop()?;
    // Best effort: leftovers in the temp dir and on the broker harm nothing.
    if args.keep_logs {
        eprintln!("logs of the run: {}", spec.dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&spec.dir);
    }
    for topic in [&spec.input, &spec.output, &shuffle_topic(&spec)] {
        let _ = admin.delete_topic(topic);
    }
    if samples.is_empty() {
        return Err(format!(
            "{} {delivery:?}: no record produced after the warm-up came out within {DRAIN:?} \
             of the end",
            mode.name()
        )
        .into());
    }
    let mut latencies: Vec<u64> = samples.iter().map(|s| s.latency_us).collect();
    let clustered = matches!(mode, Mode::Cluster1 | Mode::Cluster3);
    let mut at_tick: Vec<u64> = (samples.iter())
        .filter(|s| clustered && just_after_a_tick(s, batch))
        .map(|s| s.latency_us)
        .collect();
    latencies.sort_unstable();
    at_tick.sort_unstable();
    Ok(Run {
        mode,
        delivery,
        batch,
        rate,
        round,
        produced,
        received,
        latencies,
        at_tick,
    })
}

/// Whether `sample` was produced within [`AT_TICK`] after a tick of `batch`,
/// for a batch of ten times that or more.
fn just_after_a_tick(sample: &Sample, batch: Duration) -> bool {
    let (batch, window) = (batch.as_micros() as u64, AT_TICK.as_micros() as u64);
    batch >= 10 * window && sample.produced_us % batch < window
}

fn print_json(args: &Args, run: &Run) {
    println!(
        "{{\"bench\":\"cluster_latency\",\"mode\":\"{}\",\"delivery\":\"{:?}\",\"batch_ms\":{},\
         \"rate\":{},\"round\":{},\"partitions\":{},\"record_bytes\":{},\"seconds\":{},\
         \"produced\":{},\"received\":{},\"measured\":{},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\
         \"p999_ms\":{:.3},\"max_ms\":{:.3},\"at_tick_measured\":{},\"at_tick_p50_ms\":{},\
         \"at_tick_p99_ms\":{}}}",
        run.mode.name(),
        run.delivery,
        run.batch.as_millis(),
        run.rate,
        run.round,
        args.partitions,
        args.record_bytes,
        args.seconds,
        run.produced,
        run.received,
        run.latencies.len(),
        run.ms(0.5),
        run.ms(0.99),
        run.ms(0.999),
        run.ms(1.0),
        run.at_tick.len(),
        json_ms(run.at_tick_ms(0.5)),
        json_ms(run.at_tick_ms(0.99)),
    );
}

fn json_ms(ms: Option<f64>) -> String {
    ms.map_or_else(|| "null".to_owned(), |ms| format!("{ms:.3}"))
}

fn print_summary(args: &Args, runs: &[Run]) {
    let runs = &pooled(runs);
    eprintln!(
        "\nKafka({} partitions) -> drop_duplicates(key) -> Kafka; {} bytes per record for {} s \
         in {} round(s), pooled, the first {} s of each not measured; latency from production \
         to a read_committed reader, ms; \
         x one = the ratio to one process at the same delivery, batch and rate \
         (target for a clustered at-least-once query: <= 1.5 at p50 and p99); \
         x relay = a clustered at-least-once query's ratio to relay-shuffle at the same rate; \
         at tick = a clustered query's records produced in the first {} ms after a batch tick \
         (batches of {} s and more)",
        args.partitions,
        args.record_bytes,
        args.seconds,
        args.rounds,
        WARM_UP.as_secs(),
        AT_TICK.as_millis(),
        (10 * AT_TICK).as_secs()
    );
    eprintln!(
        "{:>6} {:>9} {:>4} {:<14}{:>9}{:>8}  {:>30}  {:>20}  {:>22}  {:>18}",
        "rate",
        "batch",
        "sink",
        "mode",
        "measured",
        "missing",
        "p50 / p99 / p99.9",
        "x one p50/p99/p99.9",
        "x relay p50/p99/p99.9",
        "at tick p50 / p99"
    );
    let ratios = |run: &Run, to: Option<&Run>| {
        to.map_or_else(
            || "-".to_owned(),
            |to| {
                [0.5, 0.99, 0.999]
                    .map(|q| format!("{:.2}", run.ms(q) / to.ms(q).max(0.001)))
                    .join(" / ")
            },
        )
    };
    for run in runs {
        let one = runs.iter().find(|r| {
            (r.mode, r.delivery, r.batch, r.rate) == (Mode::One, run.delivery, run.batch, run.rate)
        });
        let relay = (matches!(run.mode, Mode::Cluster1 | Mode::Cluster3)
            && run.delivery == Delivery::Alo)
            .then(|| (runs.iter()).find(|r| (r.mode, r.rate) == (Mode::RelayShuffle, run.rate)))
            .flatten();
        let at_tick = match (run.at_tick_ms(0.5), run.at_tick_ms(0.99)) {
            (Some(p50), Some(p99)) => format!("{p50:.1} / {p99:.1}"),
            _ => "-".to_owned(),
        };
        eprintln!(
            "{:>6} {:>9} {:>4} {:<14}{:>9}{:>8}  {:>30}  {:>20}  {:>22}  {:>18}",
            run.rate,
            run.batch(),
            format!("{:?}", run.delivery).to_lowercase(),
            run.mode.name(),
            run.latencies.len(),
            run.produced.saturating_sub(run.received),
            format!(
                "{:.1} / {:.1} / {:.1}",
                run.ms(0.5),
                run.ms(0.99),
                run.ms(0.999)
            ),
            ratios(run, one),
            ratios(run, relay),
            at_tick
        );
    }
}

fn main() -> BenchResult<()> {
    if let Ok(spec) = std::env::var(CHILD_SPEC) {
        return child(serde_json::from_str(&spec)?);
    }
    let mut args = Args::parse();
    if args.kstreams.is_some() && !args.modes.contains(&Mode::Kstreams) {
        args.modes.push(Mode::Kstreams);
    }
    let list = |items: Vec<String>| items.join(",");
    eprintln!(
        "command: cargo bench --bench cluster_latency -- --bootstrap {} --rates {} --batches {} \
         --deliveries {} --modes {} --partitions {} --seconds {} --record-bytes {} --rounds {}",
        args.bootstrap,
        list(args.rates.iter().map(u64::to_string).collect()),
        list(args.batches.iter().map(ToString::to_string).collect()),
        list(
            args.deliveries
                .iter()
                .map(|d| format!("{d:?}").to_lowercase())
                .collect()
        ),
        list(args.modes.iter().map(|m| m.name().to_owned()).collect()),
        args.partitions,
        args.seconds,
        args.record_bytes,
        args.rounds
    );
    let mut runs = Vec::new();
    for &rate in &args.rates {
        for &batch in &args.batches {
            let batch: Duration = batch.into();
            for &delivery in &args.deliveries {
                if delivery == Delivery::Eo && batch >= Duration::from_secs(args.seconds) {
                    // Its output shows only when the run stops.
                    continue;
                }
                for round in 0..args.rounds {
                    // Rotated, so that no mode always runs right after
                    // another.
                    let mut modes = args.modes.clone();
                    let first = round as usize % modes.len();
                    modes.rotate_left(first);
                    for mode in modes {
                        // The relays have no batch: one run per rate and round.
                        let relayed = |r: &Run| {
                            (r.mode, r.rate, r.round) == (Mode::RelayShuffle, rate, round)
                        };
                        if (mode == Mode::Kstreams && args.kstreams.is_none())
                            || (mode == Mode::RelayShuffle
                                && (delivery == Delivery::Eo || runs.iter().any(relayed)))
                        {
                            continue;
                        }
                        let run = run(&args, mode, delivery, batch, rate, round)?;
                        print_json(&args, &run);
                        runs.push(run);
                    }
                }
            }
        }
    }
    print_summary(&args, &runs);
    Ok(())
}
