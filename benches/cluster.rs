//! Scale-out of a clustered query: the throughput of one `KafkaCluster` query
//! run by 1, 2 and 3 OS processes on this machine, beside the floor Kafka
//! itself sets in the same run, and how long a process takes to restore keyed
//! state from the changelog.
//!
//! * **kafka**: `--records` (default 300,000) small records are produced over
//!   the 6 partitions of a fresh topic; one plain read_committed consumer reads
//!   them all, and a transactional copy (one consumer, one transactional
//!   producer committing every 300 ms, the query's trigger interval) writes
//!   them to another topic. Records/s of each, median and range of `--runs`
//!   (default 3).
//! * **rtflow**: for each count of `--processes` (default `1,2,3`), the same
//!   input goes to a fresh topic, then that many child processes (this binary,
//!   re-run with `RTFLOW_BENCH_CLUSTER_CHILD` set) start the query `source ->
//!   map -> with_watermark -> repartition_by(key) -> count -> KafkaSink` under
//!   distinct instance names (keys dealt over `--keys`, default 1,000). The
//!   count emits one update per input record, so a read_committed consumer
//!   reads the output until it holds `--records` distinct `key:count` updates
//!   (any read twice, which exactly-once output never has, are reported as
//!   `duplicates`). Records/s is `--records` over the wall time from
//!   spawning the processes to the last output record. Also reported: the
//!   time to the first run in any process (process start, group join,
//!   restore), to the first output record (the first transaction committed),
//!   the rate from the first run on (which still pays for the rebalances as
//!   the other processes join), the runs the processes started together, and
//!   how long they took to stop once told to through the stop file they poll.
//!   Runs interleave the process counts; median and range of `--runs`.
//! * **restore**: one process counts an input of `--restore-keys` (default
//!   200,000) distinct 100-byte keys, one record each, and stops; a process
//!   under a fresh instance name then starts the same query, restores the
//!   whole keyed state from the changelog, and reports what
//!   `ClusteredQuery::last_restore` says it read and how long it took, from
//!   which seconds per GB of changelog follow. The processes have no
//!   checkpoint location, hence no local copies of the changelog: the
//!   restore reads all of it from Kafka (`local_bytes` is 0).
//! * **failover**: three processes count `--failover-keys` (default 40) keys,
//!   each updated every 250 ms, and a read_committed consumer notes when each
//!   key's updates arrive. Once the output flows from all three, process `p1`
//!   is SIGKILLed; in the `restart` scenario a process of the same name starts
//!   at once, in `gone` none ever does. Reported: the longest gap between a
//!   key's consecutive updates from 2 s before the kill to 30 s after it,
//!   p50 / p99 / max over the keys (the dead process's open transaction holds
//!   back every partition it wrote to, so every key can stall, not only those
//!   it owned), beside the longest gap before the kill and the session
//!   timeout (6 s) that bounds how soon the group drops a dead process.
//! * **rebalance**: processes `p0` and `p1` count `--failover-keys` keys, each
//!   updated every 250 ms, under the same read_committed watch. Once they have
//!   settled (no run started for 8 s), `p2` starts (2 -> 3 processes); once all
//!   three have settled, `p2` stops cleanly through a stop file of its own
//!   (3 -> 2), and the two settle again. Each process's status file names the
//!   repartition partitions its run owns; a key's partition follows from its
//!   key group (`stable_hash`, `key_group`, as `repartition_by` computes it),
//!   so the keys of each transition split into those whose repartition
//!   partition stayed with its process and those that moved. Reported per
//!   transition and split: each key's longest gap between consecutive updates
//!   from the change of membership until the processes settled, p50 / p99 /
//!   max over the keys, beside the longest gap of any key in the seconds before
//!   `p2` starts and twice the batch duration (issue #30's bound for keys that
//!   do not move).
//!
//! `--sections` picks the measurements (default all four).
//!
//! Every figure is one JSON line on stdout; the command and a summary table go
//! to stderr. The bench's consumers and producers share the machine's cores
//! with the broker and the processes, as they would in production on one box.
//! Each throughput run also prints its own figures to stderr, with the
//! directory `$TMPDIR/rtflow-bench-cluster/<query>` that keeps the logs of its
//! processes (warnings; `RUST_LOG` sets the level), shown when a run fails.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster
//! cargo bench --bench cluster -- --bootstrap 127.0.0.1:9092 --records 300000 --runs 3 \
//!     --processes 1,2,3 --keys 1000 --restore-keys 200000 --failover-keys 40 \
//!     --sections throughput,restore,failover,rebalance
//! ```
//!
//! The broker is `--bootstrap`, else `$RTFLOW_KAFKA_BOOTSTRAP`, else 127.0.0.1:9092.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rtflow::prelude::*;
use serde::{Deserialize, Serialize};

/// What a child process runs, from this variable:
/// `bootstrap query input output instance dir`.
const CHILD_SPEC: &str = "RTFLOW_BENCH_CLUSTER_CHILD";
/// Partitions of the input, the output and the repartition topic.
const PARTITIONS: i32 = 6;
/// The size of a key of the restore measurement's input.
const RESTORE_KEY_BYTES: usize = 100;
/// The query's trigger interval, also the transactional copy's commit interval.
const COMMIT_INTERVAL: Duration = Duration::from_millis(300);
/// How long a measurement may take before the bench gives up on it.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);
/// How often each key of the failover measurement is updated.
const FAILOVER_TICK: Duration = Duration::from_millis(250);
/// How long the failover measurement watches the output after the kill.
const FAILOVER_WATCH: Duration = Duration::from_secs(30);
/// How long no process may have started a run before the kill.
const SETTLED: Duration = Duration::from_secs(8);
/// The group's session timeout, KafkaCluster's default.
const SESSION_TIMEOUT: Duration = Duration::from_secs(6);
/// How long a Kafka client call may block.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

type BenchResult<T> = std::result::Result<T, BoxError>;

#[derive(Parser)]
#[command(
    about = "Throughput of a KafkaCluster query in 1, 2, 3 processes; restore time; \
             gaps through failovers and rebalances"
)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value_t = default_bootstrap())]
    bootstrap: String,
    /// Input records of each throughput run.
    #[arg(long, default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(1..))]
    records: u64,
    /// Runs of each throughput measurement; median and range are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    runs: u64,
    /// How many processes run the query, one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3",
          value_parser = clap::value_parser!(u64).range(1..))]
    processes: Vec<u64>,
    /// Distinct keys of the throughput input.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    keys: u64,
    /// Distinct keys (one record each) of the restore measurement's state.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    restore_keys: u64,
    /// Keys of the failover and rebalance measurements, each updated every
    /// 250 ms.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u64).range(1..))]
    failover_keys: u64,
    /// The measurements to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "throughput,restore,failover,rebalance"
    )]
    sections: Vec<Section>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    Throughput,
    Restore,
    Failover,
    Rebalance,
}

fn default_bootstrap() -> String {
    std::env::var("RTFLOW_KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// An input record as the query sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Event {
    key: String,
    time: i64,
}

/// The dataflow every process runs: the count per key of `input`, each update
/// written to `output` under its key.
fn build(flow: &Dataflow, bootstrap: &str, input: &str, output: &str) {
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(|record: KafkaRecord| Event {
        key: record.key_str().into_owned(),
        time: record.value_str().parse().unwrap_or(0),
    })
    .with_watermark(|e: &Event| e.time, Duration::ZERO)
    .repartition_by(|e: &Event| e.key.clone())
    .count()
    .sink(KafkaSink::new(
        bootstrap,
        output,
        |(key, count): &(String, u64)| KafkaMessage::new(count.to_string()).key(key.clone()),
    ));
}

fn config(query: &str) -> QueryConfig {
    QueryConfig::new(query)
        .trigger(Trigger::real_time("300 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
        .task_slots(64)
}

/// A child process: joins the cluster, writes its status every 50 ms, and
/// leaves when the stop file appears.
fn child(spec: &str) -> BenchResult<()> {
    rtflow::logging::init("warn");
    let [bootstrap, query, input, output, instance, dir]: [String; 6] = spec
        .split(' ')
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|_| format!("{CHILD_SPEC} has not six fields: {spec}"))?;
    let (b, i, o) = (bootstrap.clone(), input, output);
    let running = KafkaCluster::new(&bootstrap)
        .instance(&instance)
        .repartition_partitions(PARTITIONS as usize)
        .start(config(&query), move |flow: &Dataflow| {
            build(flow, &b, &i, &o);
            Ok(())
        })?;
    let dir = PathBuf::from(dir);
    let status = dir.join(format!("{instance}.status"));
    let repartition = format!("rtflow-{query}-0-repartition-");
    while !dir.join("stop").exists() && !dir.join(format!("{instance}.stop")).exists() {
        if !running.is_active() {
            return Err(format!("the process failed: {:?}", running.stop()).into());
        }
        let restore = running.last_restore().map_or_else(
            || "0 0 0 0".to_owned(),
            |r| {
                format!(
                    "{} {} {} {}",
                    r.partitions,
                    r.changelog_bytes,
                    r.local_bytes,
                    r.duration.as_micros()
                )
            },
        );
        let owned: Vec<String> = running
            .partitions()
            .iter()
            .filter_map(|p| p.strip_prefix(&repartition).map(str::to_owned))
            .collect();
        let owned = if owned.is_empty() {
            "-".to_owned()
        } else {
            owned.join(",")
        };
        std::fs::write(
            status.with_extension("tmp"),
            format!("{} {restore} {owned}", running.runs()),
        )?;
        std::fs::rename(status.with_extension("tmp"), &status)?;
        std::thread::sleep(Duration::from_millis(50));
    }
    running.stop()?;
    Ok(())
}

/// A child's latest status.
#[derive(Debug, Default)]
struct Status {
    /// Runs the process started (one, plus one per rebalance that moved
    /// partitions to or from it).
    runs: u64,
    /// What its latest run restored: partitions owned (`0` before the first
    /// run), bytes read from the changelog and from local copies of it, and
    /// how long that took.
    restored_partitions: usize,
    changelog_bytes: u64,
    local_bytes: u64,
    restore: Duration,
    /// The partitions of the (first) repartition topic its current run owns.
    repartition: Vec<i32>,
}

impl Status {
    fn parse(text: &str) -> Option<Self> {
        let (numbers, owned) = text.rsplit_once(' ')?;
        let fields: Vec<u64> = numbers
            .split(' ')
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        let [runs, partitions, changelog_bytes, local_bytes, micros] = fields[..] else {
            return None;
        };
        let repartition = match owned {
            "-" => Vec::new(),
            owned => owned
                .split(',')
                .map(str::parse)
                .collect::<std::result::Result<_, _>>()
                .ok()?,
        };
        Some(Self {
            runs,
            restored_partitions: partitions as usize,
            changelog_bytes,
            local_bytes,
            restore: Duration::from_micros(micros),
            repartition,
        })
    }
}

fn unique(label: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_nanos();
    format!("bench-cluster-{label}-{}-{nanos}", std::process::id())
}

/// Writes `n` records `(key(i), i)` round-robin over the partitions and waits
/// until all are acknowledged; returns how long that took.
fn produce(
    bootstrap: &str,
    topic: &str,
    n: u64,
    key: impl Fn(u64) -> String,
) -> BenchResult<Duration> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "20")
        .create()?;
    let started = Instant::now();
    for i in 0..n {
        let (key, value) = (key(i), i.to_string());
        let mut record = BaseRecord::to(topic)
            .partition((i % PARTITIONS as u64) as i32)
            .key(&key)
            .payload(&value);
        while let Err((error, back)) = producer.send(record) {
            if error != KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull) {
                return Err(format!("could not produce to {topic}: {error}").into());
            }
            producer.poll(Duration::from_millis(5));
            record = back;
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(KAFKA_TIMEOUT)?;
    Ok(started.elapsed())
}

/// A read_committed consumer of every partition of `topic`, from the start.
fn reader(bootstrap: &str, topic: &str) -> BenchResult<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "rtflow-bench-cluster")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        // The end of a run is when the last record is seen: fetch often.
        .set("fetch.wait.max.ms", "50")
        .create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    Ok(consumer)
}

/// A query's topics: its input and output, and the ones the cluster makes.
struct Topics {
    query: String,
    input: String,
    output: String,
}

impl Topics {
    fn create(bootstrap: &str, label: &str) -> BenchResult<Self> {
        let query = unique(label);
        let topics = Self {
            input: format!("{query}-in"),
            output: format!("{query}-out"),
            query,
        };
        let admin = KafkaAdmin::new(bootstrap)?;
        admin.create_topic(&topics.input, PARTITIONS)?;
        admin.create_topic(&topics.output, PARTITIONS)?;
        Ok(topics)
    }

    /// Deletes the input, the output, and the cluster's topics of the query
    /// (`rtflow-<query>-...`: repartition, changelog, shapes).
    fn delete(&self, bootstrap: &str) -> BenchResult<()> {
        let admin = KafkaAdmin::new(bootstrap)?;
        let prefix = format!("rtflow-{}-", self.query);
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()?;
        let metadata = client.fetch_metadata(None, KAFKA_TIMEOUT)?;
        let internal = metadata
            .topics()
            .iter()
            .map(|t| t.name())
            .filter(|name| name.starts_with(&prefix));
        for topic in [self.input.as_str(), self.output.as_str()]
            .into_iter()
            .chain(internal)
        {
            admin.delete_topic(topic)?;
        }
        Ok(())
    }
}

/// The child processes of one query.
struct Processes {
    spec: String,
    dir: PathBuf,
    children: Vec<(String, Child)>,
    /// Processes told to stop through their own stop file, until they exit.
    stopping: Vec<(String, Child)>,
}

impl Processes {
    fn new(bootstrap: &str, topics: &Topics) -> BenchResult<Self> {
        let dir = std::env::temp_dir()
            .join("rtflow-bench-cluster")
            .join(&topics.query);
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            spec: [bootstrap, &topics.query, &topics.input, &topics.output].join(" "),
            dir,
            children: Vec::new(),
            stopping: Vec::new(),
        })
    }

    fn spawn(&mut self, instance: &str) -> BenchResult<()> {
        let log = std::fs::File::create(self.dir.join(format!("{instance}.log")))?;
        let child = Command::new(std::env::current_exe()?)
            .env(
                CHILD_SPEC,
                format!("{} {instance} {}", self.spec, self.dir.display()),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.children.push((instance.to_owned(), child));
        Ok(())
    }

    /// SIGKILLs the process `instance`.
    fn kill(&mut self, instance: &str) -> BenchResult<()> {
        let index = self
            .children
            .iter()
            .position(|(name, _)| name == instance)
            .ok_or_else(|| format!("no process {instance}"))?;
        let (_, mut child) = self.children.remove(index);
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Whether a process has started a run.
    fn running(&self) -> bool {
        self.children
            .iter()
            .any(|(instance, _)| self.status(instance).runs > 0)
    }

    fn status(&self, instance: &str) -> Status {
        std::fs::read_to_string(self.dir.join(format!("{instance}.status")))
            .ok()
            .and_then(|text| Status::parse(&text))
            .unwrap_or_default()
    }

    /// Tells the process `instance` alone to stop, through its own stop
    /// file; [`Processes::check`] notes when it has left.
    fn tell_to_stop(&mut self, instance: &str) -> BenchResult<()> {
        let index = self
            .children
            .iter()
            .position(|(name, _)| name == instance)
            .ok_or_else(|| format!("no process {instance}"))?;
        std::fs::write(self.dir.join(format!("{instance}.stop")), b"")?;
        self.stopping.push(self.children.remove(index));
        Ok(())
    }

    /// Whether a process told to stop alone is still running.
    fn is_stopping(&self) -> bool {
        !self.stopping.is_empty()
    }

    /// An error with the logs if a process has exited: none should before it
    /// is told to stop, and one told to stop must exit cleanly.
    fn check(&mut self) -> BenchResult<()> {
        for (instance, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                return Err(
                    format!("{instance} exited early ({status}):\n{}", logs(&self.dir)).into(),
                );
            }
        }
        for (instance, child) in &mut self.stopping {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    return Err(
                        format!("{instance} failed ({status}):\n{}", logs(&self.dir)).into(),
                    );
                }
            }
        }
        self.stopping
            .retain_mut(|(_, child)| matches!(child.try_wait(), Ok(None)));
        Ok(())
    }

    /// Tells every process to stop and waits until all have left the
    /// cluster; returns how long that took.
    fn stop(&mut self) -> BenchResult<Duration> {
        let started = Instant::now();
        std::fs::write(self.dir.join("stop"), b"")?;
        for (instance, mut child) in std::mem::take(&mut self.children) {
            let status = loop {
                if let Some(status) = child.try_wait()? {
                    break status;
                }
                if started.elapsed() > RUN_TIMEOUT {
                    child.kill()?;
                    child.wait()?;
                    return Err(format!("{instance} did not stop:\n{}", logs(&self.dir)).into());
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if !status.success() {
                return Err(format!("{instance} failed ({status}):\n{}", logs(&self.dir)).into());
            }
        }
        let stopped = started.elapsed();
        std::fs::remove_file(self.dir.join("stop"))?;
        Ok(stopped)
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, child) in self.children.iter_mut().chain(&mut self.stopping) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The processes' logs in `dir`, for an error message.
fn logs(dir: &Path) -> String {
    let mut logs = String::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            logs.push_str(&format!("--- {}\n{text}\n", entry.path().display()));
        }
    }
    logs
}

/// When the output of a run arrived, from the spawning of its processes.
struct Output {
    /// The first run started in a process.
    first_run: Duration,
    /// The first output record was read.
    first: Duration,
    /// The last output record was read.
    last: Duration,
    /// Updates read more than once: none if the output is exactly once.
    duplicates: u64,
}

/// Reads `output` until it holds `expected` distinct `key:count` updates,
/// watching the processes spawned at `since`.
fn await_output(
    bootstrap: &str,
    output: &str,
    expected: u64,
    since: Instant,
    processes: &mut Processes,
) -> BenchResult<Output> {
    let consumer = reader(bootstrap, output)?;
    let mut updates = HashSet::with_capacity(expected as usize);
    let mut duplicates = 0;
    let (mut first_run, mut first) = (None, None);
    let mut checked = Instant::now();
    while (updates.len() as u64) < expected {
        match consumer.poll(Duration::from_millis(20)) {
            Some(Ok(message)) => {
                first.get_or_insert_with(|| since.elapsed());
                let update = (
                    message.key().map(<[u8]>::to_vec),
                    message.payload().map(<[u8]>::to_vec),
                );
                if !updates.insert(update) {
                    duplicates += 1;
                }
            }
            Some(Err(error)) => eprintln!("reading {output}: {error}"),
            None => {}
        }
        if checked.elapsed() < Duration::from_millis(20) {
            continue;
        }
        checked = Instant::now();
        if first_run.is_none() && processes.running() {
            first_run = Some(since.elapsed());
        }
        processes.check()?;
        if since.elapsed() > RUN_TIMEOUT {
            return Err(format!(
                "{} of {expected} output records in {RUN_TIMEOUT:?}:\n{}",
                updates.len(),
                logs(&processes.dir)
            )
            .into());
        }
    }
    let last = since.elapsed();
    Ok(Output {
        // A run's first records can come out before its status file tells.
        first_run: first_run.unwrap_or(last).min(first.unwrap_or(last)),
        first: first.unwrap_or(last),
        last,
        duplicates,
    })
}

/// Record `i`'s key in a throughput input.
fn throughput_key(keys: u64) -> impl Fn(u64) -> String {
    move |i| format!("k{}", i % keys)
}

/// One Kafka-only run: produce, read, and copy transactionally.
struct KafkaRun {
    produce: Duration,
    read: Duration,
    copy: Duration,
}

fn kafka_run(args: &Args) -> BenchResult<KafkaRun> {
    let topics = Topics::create(&args.bootstrap, "kafka")?;
    let produce = produce(
        &args.bootstrap,
        &topics.input,
        args.records,
        throughput_key(args.keys),
    )?;

    let started = Instant::now();
    let consumer = reader(&args.bootstrap, &topics.input)?;
    let mut read = 0;
    while read < args.records {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            message?;
            read += 1;
        }
        if started.elapsed() > RUN_TIMEOUT {
            return Err(format!("read {read} of {} records", args.records).into());
        }
    }
    let read = started.elapsed();

    let started = Instant::now();
    let consumer = reader(&args.bootstrap, &topics.input)?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.bootstrap)
        .set("transactional.id", &topics.query)
        .set("linger.ms", "5")
        .create()?;
    producer.init_transactions(KAFKA_TIMEOUT)?;
    producer.begin_transaction()?;
    let mut committed = Instant::now();
    let mut copied = 0;
    while copied < args.records {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message?;
            let mut record =
                BaseRecord::<[u8], [u8]>::to(&topics.output).partition(message.partition());
            if let Some(key) = message.key() {
                record = record.key(key);
            }
            if let Some(payload) = message.payload() {
                record = record.payload(payload);
            }
            while let Err((error, back)) = producer.send(record) {
                if error != KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull) {
                    return Err(format!("could not copy: {error}").into());
                }
                producer.poll(Duration::from_millis(5));
                record = back;
            }
            copied += 1;
        }
        producer.poll(Duration::ZERO);
        if committed.elapsed() >= COMMIT_INTERVAL {
            producer.commit_transaction(KAFKA_TIMEOUT)?;
            producer.begin_transaction()?;
            committed = Instant::now();
        }
        if started.elapsed() > RUN_TIMEOUT {
            return Err(format!("copied {copied} of {} records", args.records).into());
        }
    }
    producer.commit_transaction(KAFKA_TIMEOUT)?;
    let copy = started.elapsed();
    topics.delete(&args.bootstrap)?;
    Ok(KafkaRun {
        produce,
        read,
        copy,
    })
}

/// One run of the query by `n` processes.
struct ClusterRun {
    output: Output,
    /// Stop file -> every process exited.
    stop: Duration,
    /// Runs the processes started, together.
    runs: u64,
}

fn cluster_run(args: &Args, n: u64) -> BenchResult<ClusterRun> {
    let topics = Topics::create(&args.bootstrap, &format!("{n}p"))?;
    produce(
        &args.bootstrap,
        &topics.input,
        args.records,
        throughput_key(args.keys),
    )?;
    let mut processes = Processes::new(&args.bootstrap, &topics)?;
    let spawned = Instant::now();
    for p in 0..n {
        processes.spawn(&format!("p{p}"))?;
    }
    let output = await_output(
        &args.bootstrap,
        &topics.output,
        args.records,
        spawned,
        &mut processes,
    )?;
    let runs = (0..n)
        .map(|p| processes.status(&format!("p{p}")).runs)
        .sum();
    let stop = processes.stop()?;
    topics.delete(&args.bootstrap)?;
    eprintln!(
        "{n} process(es): first run {:.2} s, first output {:.2} s, last output {:.2} s, \
         {runs} runs, {} duplicates; logs in {}",
        output.first_run.as_secs_f64(),
        output.first.as_secs_f64(),
        output.last.as_secs_f64(),
        output.duplicates,
        processes.dir.display()
    );
    Ok(ClusterRun { output, stop, runs })
}

/// The restore measurement.
struct Restore {
    /// The output of the first process, which counted the input.
    counted: Output,
    /// The second process: spawn -> its run restored the whole state.
    restored_after: Duration,
    status: Status,
}

fn restore(args: &Args) -> BenchResult<Restore> {
    let topics = Topics::create(&args.bootstrap, "restore")?;
    produce(&args.bootstrap, &topics.input, args.restore_keys, |i| {
        format!("k{i:0>width$}", width = RESTORE_KEY_BYTES - 1)
    })?;
    let mut processes = Processes::new(&args.bootstrap, &topics)?;
    let spawned = Instant::now();
    processes.spawn("counter")?;
    let counted = await_output(
        &args.bootstrap,
        &topics.output,
        args.restore_keys,
        spawned,
        &mut processes,
    )?;
    processes.stop()?;

    let spawned = Instant::now();
    processes.spawn("restorer")?;
    // Alone in both groups, it owns every input and repartition partition.
    let status = loop {
        let status = processes.status("restorer");
        if status.restored_partitions == 2 * PARTITIONS as usize {
            break status;
        }
        processes.check()?;
        if spawned.elapsed() > RUN_TIMEOUT {
            return Err(format!(
                "the restorer did not restore in {RUN_TIMEOUT:?} ({status:?}):\n{}",
                logs(&processes.dir)
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let restored_after = spawned.elapsed();
    processes.stop()?;
    topics.delete(&args.bootstrap)?;
    Ok(Restore {
        counted,
        restored_after,
        status,
    })
}

/// What a failover cost: per key, the longest gap between consecutive
/// updates around the kill, in seconds.
struct Failover {
    stalls: Vec<f64>,
    /// The longest gap of any key in the seconds before the kill.
    steady: f64,
}

/// When each key's updates arrived at a read_committed consumer of a query's
/// output.
struct Watch {
    consumer: BaseConsumer,
    arrivals: HashMap<Vec<u8>, Vec<Instant>>,
}

impl Watch {
    fn new(bootstrap: &str, output: &str) -> BenchResult<Self> {
        Ok(Self {
            consumer: reader(bootstrap, output)?,
            arrivals: HashMap::new(),
        })
    }

    /// Reads the output until `until`, watching the processes.
    fn read_until(&mut self, until: Instant, processes: &mut Processes) -> BenchResult<()> {
        while Instant::now() < until {
            if let Some(message) = self.consumer.poll(Duration::from_millis(20)) {
                let message = message?;
                let key = message.key().unwrap_or_default().to_vec();
                self.arrivals.entry(key).or_default().push(Instant::now());
            }
            processes.check()?;
        }
        Ok(())
    }

    /// Reads until every one of `instances` runs, no process is still
    /// stopping, and none of them started a run for [`SETTLED`].
    fn settle(&mut self, processes: &mut Processes, instances: &[&str]) -> BenchResult<()> {
        let since = Instant::now();
        let runs = |processes: &Processes| -> Option<u64> {
            let runs = instances.iter().map(|p| processes.status(p).runs);
            runs.map(|r| (r > 0).then_some(r)).sum()
        };
        let mut settled = (None, Instant::now());
        while settled.0.is_none() || processes.is_stopping() || settled.1.elapsed() < SETTLED {
            if since.elapsed() > RUN_TIMEOUT {
                return Err(format!(
                    "{instances:?} did not settle in {RUN_TIMEOUT:?}:\n{}",
                    logs(&processes.dir)
                )
                .into());
            }
            self.read_until(Instant::now() + Duration::from_millis(100), processes)?;
            let now = runs(processes);
            if now != settled.0 || processes.is_stopping() {
                settled = (now, Instant::now());
            }
        }
        Ok(())
    }

    /// Key `k`'s longest gap between consecutive updates from `from` to
    /// `to`, in seconds, counting from its last update before `from`.
    fn longest_gap(&self, key: &str, from: Instant, to: Instant) -> f64 {
        let times = self
            .arrivals
            .get(key.as_bytes())
            .map_or(&[][..], Vec::as_slice);
        longest_gap(times, from, to)
    }

    /// The longest gap of any key from `from` to `to`, in seconds.
    fn steady(&self, from: Instant, to: Instant) -> f64 {
        self.arrivals
            .values()
            .map(|times| longest_gap(times, from, to))
            .fold(0.0, f64::max)
    }
}

fn longest_gap(times: &[Instant], from: Instant, to: Instant) -> f64 {
    let mut last = times
        .iter()
        .rev()
        .find(|t| **t <= from)
        .copied()
        .unwrap_or(from);
    let mut longest = Duration::ZERO;
    for t in times.iter().filter(|t| **t > from && **t <= to) {
        longest = longest.max(*t - last);
        last = *t;
    }
    longest.max(to - last).as_secs_f64()
}

/// Starts the pacer of the failover and rebalance measurements: it updates
/// `keys` keys of `input` every [`FAILOVER_TICK`] until told to stop.
fn pace(
    bootstrap: &str,
    input: &str,
    keys: u64,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<BenchResult<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (bootstrap, input, told) = (bootstrap.to_owned(), input.to_owned(), stop.clone());
    let pacer = std::thread::spawn(move || update_keys(&bootstrap, &input, keys, &told));
    (stop, pacer)
}

/// Three processes count keys updated every [`FAILOVER_TICK`]; `p1` is killed,
/// and with `restart` started again at once under its name.
fn failover(args: &Args, restart: bool) -> BenchResult<Failover> {
    let scenario = if restart { "restart" } else { "gone" };
    let topics = Topics::create(&args.bootstrap, &format!("failover-{scenario}"))?;
    let mut processes = Processes::new(&args.bootstrap, &topics)?;
    let (stop, pacer) = pace(&args.bootstrap, &topics.input, args.failover_keys);
    for p in 0..3 {
        processes.spawn(&format!("p{p}"))?;
    }
    let mut watch = Watch::new(&args.bootstrap, &topics.output)?;
    // Every process runs, and the rebalances of their joining have settled.
    watch.settle(&mut processes, &["p0", "p1", "p2"])?;
    let killed = Instant::now();
    processes.kill("p1")?;
    if restart {
        processes.spawn("p1")?;
    }
    watch.read_until(killed + FAILOVER_WATCH, &mut processes)?;
    stop.store(true, Ordering::SeqCst);
    pacer.join().map_err(|_| "the pacer panicked")??;
    processes.stop()?;
    topics.delete(&args.bootstrap)?;

    let from = killed - Duration::from_secs(2);
    let end = killed + FAILOVER_WATCH;
    let stalls = (0..args.failover_keys)
        .map(|k| watch.longest_gap(&format!("k{k}"), from, end))
        .collect();
    let steady = watch.steady(killed - SETTLED + Duration::from_secs(2), from);
    Ok(Failover { stalls, steady })
}

/// The changes of membership of the rebalance measurement: `p2` joins
/// (2 -> 3 processes), then leaves (3 -> 2).
const TRANSITIONS: [&str; 2] = ["join", "leave"];
/// How the keys of a transition split: their repartition partition stayed
/// with its process, or moved to another.
const SPLITS: [&str; 2] = ["stayed", "moved"];

/// One run of the rebalance measurement.
struct Rebalance {
    /// Per transition and split, each key's longest gap between consecutive
    /// updates from the change of membership until the processes settled,
    /// in seconds.
    gaps: [[Vec<f64>; 2]; 2],
    /// The longest gap of any key in the seconds before `p2` joins.
    steady: f64,
}

/// Which process's current run owns each partition of the repartition topic.
fn owners(processes: &Processes, instances: &[&str]) -> BenchResult<HashMap<i32, String>> {
    let mut owners = HashMap::new();
    for instance in instances {
        for partition in processes.status(instance).repartition {
            owners.insert(partition, (*instance).to_owned());
        }
    }
    if owners.len() != PARTITIONS as usize {
        return Err(format!("the processes own {owners:?} of {PARTITIONS} partitions").into());
    }
    Ok(owners)
}

/// The repartition partition of key `k` in the query of [`build`]: its key
/// group's, as `repartition_by` and the exchange compute it.
fn repartition_partition(key: &str, key_groups: usize) -> i32 {
    let group = rtflow::runtime::key_groups::key_group(
        rtflow::runtime::key_groups::stable_hash(key),
        key_groups,
    );
    (group % PARTITIONS as usize) as i32
}

/// Processes `p0` and `p1` count keys updated every [`FAILOVER_TICK`]; once
/// they settle, `p2` joins, and once all three settle, `p2` stops cleanly.
fn rebalance(args: &Args) -> BenchResult<Rebalance> {
    let topics = Topics::create(&args.bootstrap, "rebalance")?;
    let key_groups = config(&topics.query).max_key_groups;
    let mut processes = Processes::new(&args.bootstrap, &topics)?;
    let (stop, pacer) = pace(&args.bootstrap, &topics.input, args.failover_keys);
    let (two, three) = (["p0", "p1"], ["p0", "p1", "p2"]);
    for p in two {
        processes.spawn(p)?;
    }
    let mut watch = Watch::new(&args.bootstrap, &topics.output)?;
    watch.settle(&mut processes, &two)?;
    let before = owners(&processes, &two)?;
    let joined = Instant::now();
    processes.spawn("p2")?;
    watch.settle(&mut processes, &three)?;
    let between = owners(&processes, &three)?;
    let left = Instant::now();
    processes.tell_to_stop("p2")?;
    watch.settle(&mut processes, &two)?;
    let after = owners(&processes, &two)?;
    let end = Instant::now();
    stop.store(true, Ordering::SeqCst);
    pacer.join().map_err(|_| "the pacer panicked")??;
    processes.stop()?;
    topics.delete(&args.bootstrap)?;

    let transition = |from: Instant, to: Instant, was: &HashMap<i32, String>, is| {
        let is: &HashMap<i32, String> = is;
        let mut split: [Vec<f64>; 2] = Default::default();
        for k in 0..args.failover_keys {
            let key = format!("k{k}");
            let partition = repartition_partition(&key, key_groups);
            let moved = was[&partition] != is[&partition];
            split[usize::from(moved)].push(watch.longest_gap(&key, from, to));
        }
        split
    };
    Ok(Rebalance {
        gaps: [
            transition(joined, left, &before, &between),
            transition(left, end, &between, &after),
        ],
        steady: watch.steady(joined - SETTLED + Duration::from_secs(1), joined),
    })
}

/// Writes one update of each of `keys` keys every [`FAILOVER_TICK`] until
/// `stop`, each key to its own partition.
fn update_keys(bootstrap: &str, topic: &str, keys: u64, stop: &AtomicBool) -> BenchResult<()> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "1")
        .create()?;
    let mut next = Instant::now();
    let started = SystemTime::now();
    while !stop.load(Ordering::SeqCst) {
        let time = started.elapsed()?.as_millis().to_string();
        for k in 0..keys {
            let key = format!("k{k}");
            let record = BaseRecord::to(topic)
                .partition((k % PARTITIONS as u64) as i32)
                .key(&key)
                .payload(&time);
            producer.send(record).map_err(|(e, _)| e)?;
        }
        producer.poll(Duration::ZERO);
        next += FAILOVER_TICK;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    producer.flush(KAFKA_TIMEOUT)?;
    Ok(())
}

/// Percentile `p` of sorted `values`.
fn percentile(values: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Median and range.
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut values: Vec<f64> = values.into_iter().collect();
        values.sort_by(f64::total_cmp);
        Self {
            median: values[values.len() / 2],
            min: values[0],
            max: values[values.len() - 1],
        }
    }

    /// `"name":median,"name_min":min,"name_max":max`.
    fn json(&self, name: &str, decimals: usize) -> String {
        format!(
            "\"{name}\":{:.decimals$},\"{name}_min\":{:.decimals$},\"{name}_max\":{:.decimals$}",
            self.median, self.min, self.max
        )
    }

    /// `median (min-max)`.
    fn text(&self, decimals: usize) -> String {
        format!(
            "{:.decimals$} ({:.decimals$}-{:.decimals$})",
            self.median, self.min, self.max
        )
    }
}

/// The longest gaps of each run summarised over the runs: the spread of each
/// run's p50, p99 and max.
struct Gaps {
    p50: Spread,
    p99: Spread,
    max: Spread,
}

impl Gaps {
    fn of(runs: impl IntoIterator<Item = Vec<f64>>) -> Self {
        let runs: Vec<Vec<f64>> = runs
            .into_iter()
            .map(|mut gaps| {
                gaps.sort_by(f64::total_cmp);
                gaps
            })
            .collect();
        let at = |p: f64| Spread::of(runs.iter().map(|gaps| percentile(gaps, p)));
        Self {
            p50: at(50.0),
            p99: at(99.0),
            max: at(100.0),
        }
    }

    /// `"{name}_p50_s"`, `"{name}_p99_s"` and `"{name}_max_s"`, each with its range.
    fn json(&self, name: &str) -> String {
        format!(
            "{},{},{}",
            self.p50.json(&format!("{name}_p50_s"), 2),
            self.p99.json(&format!("{name}_p99_s"), 2),
            self.max.json(&format!("{name}_max_s"), 2)
        )
    }

    /// The p50, p99 and max columns of a summary row.
    fn columns(&self) -> String {
        format!(
            "{:>22}{:>22}{:>22}",
            self.p50.text(2),
            self.p99.text(2),
            self.max.text(2)
        )
    }
}

fn rate(records: u64, time: Duration) -> f64 {
    records as f64 / time.as_secs_f64()
}

fn main() -> BenchResult<()> {
    if let Ok(spec) = std::env::var(CHILD_SPEC) {
        return child(&spec);
    }
    let args = Args::parse();
    let processes: Vec<String> = args.processes.iter().map(u64::to_string).collect();
    let sections: Vec<String> = args
        .sections
        .iter()
        .map(|s| format!("{s:?}").to_lowercase())
        .collect();
    eprintln!(
        "command: cargo bench --bench cluster -- --bootstrap {} --records {} --runs {} \
         --processes {} --keys {} --restore-keys {} --failover-keys {} --sections {}",
        args.bootstrap,
        args.records,
        args.runs,
        processes.join(","),
        args.keys,
        args.restore_keys,
        args.failover_keys,
        sections.join(",")
    );
    let mut summary = Vec::new();
    if args.sections.contains(&Section::Throughput) {
        throughput(&args, &mut summary)?;
    }
    if args.sections.contains(&Section::Restore) {
        summary.push(restored(&args)?);
    }
    if args.sections.contains(&Section::Failover) {
        failovers(&args, &mut summary)?;
    }
    if args.sections.contains(&Section::Rebalance) {
        rebalances(&args, &mut summary)?;
    }
    eprintln!();
    for line in summary {
        eprintln!("{line}");
    }
    Ok(())
}

/// The throughput section: Kafka's own figures, then the query's.
fn throughput(args: &Args, summary: &mut Vec<String>) -> BenchResult<()> {
    let kafka = (0..args.runs)
        .map(|_| kafka_run(args))
        .collect::<BenchResult<Vec<_>>>()?;
    let [produced, read, copied] = [
        |r: &KafkaRun| r.produce,
        |r: &KafkaRun| r.read,
        |r: &KafkaRun| r.copy,
    ]
    .map(|time| Spread::of(kafka.iter().map(|r| rate(args.records, time(r)))));
    println!(
        "{{\"bench\":\"cluster\",\"pipeline\":\"kafka\",\"records\":{},\"partitions\":{PARTITIONS},\
         \"runs\":{},{},{},{}}}",
        args.records,
        args.runs,
        produced.json("produce_records_per_s", 0),
        read.json("read_records_per_s", 0),
        copied.json("transactional_copy_records_per_s", 0),
    );
    summary.push(format!(
        "{} records of {PARTITIONS} partitions, {} keys; median (range) of {} runs",
        args.records, args.keys, args.runs
    ));
    summary.push(format!(
        "{:<28}{:>30}{:>22}{:>22}{:>30}",
        "pipeline", "records/s", "first run s", "first output s", "records/s from first run"
    ));
    summary.push(format!("{:<28}{:>30}", "kafka produce", produced.text(0)));
    summary.push(format!("{:<28}{:>30}", "kafka read", read.text(0)));
    summary.push(format!(
        "{:<28}{:>30}",
        "kafka transactional copy",
        copied.text(0)
    ));

    // Interleaved, so that a slow spell of the machine spreads over all counts.
    let mut runs: Vec<Vec<ClusterRun>> = args.processes.iter().map(|_| Vec::new()).collect();
    for _ in 0..args.runs {
        for (n, runs) in args.processes.iter().zip(&mut runs) {
            runs.push(cluster_run(args, *n)?);
        }
    }
    for (n, runs) in args.processes.iter().zip(&runs) {
        let outputs = || runs.iter().map(|r| &r.output);
        let throughput = Spread::of(outputs().map(|o| rate(args.records, o.last)));
        let running = Spread::of(outputs().map(|o| rate(args.records, o.last - o.first_run)));
        let first_run = Spread::of(outputs().map(|o| o.first_run.as_secs_f64()));
        let first = Spread::of(outputs().map(|o| o.first.as_secs_f64()));
        let wall = Spread::of(outputs().map(|o| o.last.as_secs_f64()));
        let stop = Spread::of(runs.iter().map(|r| r.stop.as_secs_f64()));
        let process_runs = Spread::of(runs.iter().map(|r| r.runs as f64));
        let duplicates: u64 = outputs().map(|o| o.duplicates).sum();
        println!(
            "{{\"bench\":\"cluster\",\"pipeline\":\"rtflow\",\"processes\":{n},\"records\":{},\
             \"keys\":{},\"partitions\":{PARTITIONS},\"runs\":{},{},{},{},{},{},{},{},\
             \"duplicates\":{duplicates}}}",
            args.records,
            args.keys,
            args.runs,
            throughput.json("records_per_s", 0),
            first_run.json("first_run_s", 3),
            first.json("first_output_s", 3),
            running.json("running_records_per_s", 0),
            wall.json("wall_s", 3),
            stop.json("stop_s", 3),
            process_runs.json("process_runs", 0),
        );
        summary.push(format!(
            "{:<28}{:>30}{:>22}{:>22}{:>30}",
            format!("rtflow, {n} process{}", if *n == 1 { "" } else { "es" }),
            throughput.text(0),
            first_run.text(2),
            first.text(2),
            running.text(0)
        ));
    }
    Ok(())
}

/// The restore section; its summary line.
fn restored(args: &Args) -> BenchResult<String> {
    let restore = restore(args)?;
    let status = &restore.status;
    let seconds = status.restore.as_secs_f64();
    let gb = status.changelog_bytes as f64 / 1e9;
    println!(
        "{{\"bench\":\"cluster\",\"pipeline\":\"restore\",\"keys\":{},\
         \"key_bytes\":{RESTORE_KEY_BYTES},\"partitions\":{},\"changelog_bytes\":{},\
         \"local_bytes\":{},\"restore_s\":{seconds:.3},\"s_per_gb\":{:.2},\"restored_after_spawn_s\":{:.3},\
         \"count_records_per_s\":{:.0},\"duplicates\":{}}}",
        args.restore_keys,
        status.restored_partitions,
        status.changelog_bytes,
        status.local_bytes,
        seconds / gb,
        restore.restored_after.as_secs_f64(),
        rate(args.restore_keys, restore.counted.last),
        restore.counted.duplicates,
    );
    Ok(format!(
        "restore: {} keys of {RESTORE_KEY_BYTES} bytes, {:.1} MB of changelog over {} \
         partitions in {seconds:.3} s: {:.1} s/GB",
        args.restore_keys,
        status.changelog_bytes as f64 / 1e6,
        status.restored_partitions,
        seconds / gb
    ))
}

/// The failover section: each scenario `--runs` times, interleaved.
fn failovers(args: &Args, summary: &mut Vec<String>) -> BenchResult<()> {
    let mut runs: [Vec<Failover>; 2] = Default::default();
    for _ in 0..args.runs {
        for (restart, runs) in [true, false].into_iter().zip(&mut runs) {
            runs.push(failover(args, restart)?);
        }
    }
    summary.push(format!(
        "failover of 3 processes, {} keys updated every {} ms, session timeout {} s: \
         a key's longest gap in s, median (range) of {} runs",
        args.failover_keys,
        FAILOVER_TICK.as_millis(),
        SESSION_TIMEOUT.as_secs(),
        args.runs
    ));
    summary.push(format!(
        "{:<28}{:>22}{:>22}{:>22}{:>22}",
        "scenario", "p50", "p99", "max", "before the kill"
    ));
    for (scenario, runs) in ["restart", "gone"].into_iter().zip(&runs) {
        let stalls = Gaps::of(runs.iter().map(|r| r.stalls.clone()));
        let steady = Spread::of(runs.iter().map(|r| r.steady));
        println!(
            "{{\"bench\":\"cluster\",\"pipeline\":\"failover\",\"scenario\":\"{scenario}\",\
             \"keys\":{},\"runs\":{},\"session_timeout_s\":{},{},{}}}",
            args.failover_keys,
            args.runs,
            SESSION_TIMEOUT.as_secs(),
            stalls.json("stall"),
            steady.json("steady_max_gap_s", 2),
        );
        summary.push(format!(
            "{:<28}{}{:>22}",
            format!("SIGKILL, {scenario}"),
            stalls.columns(),
            steady.text(2)
        ));
    }
    Ok(())
}

/// The rebalance section: `--runs` runs of 2 -> 3 -> 2 processes.
fn rebalances(args: &Args, summary: &mut Vec<String>) -> BenchResult<()> {
    let runs = (0..args.runs)
        .map(|_| rebalance(args))
        .collect::<BenchResult<Vec<_>>>()?;
    let target = 2.0 * COMMIT_INTERVAL.as_secs_f64();
    let steady = Spread::of(runs.iter().map(|r| r.steady));
    summary.push(format!(
        "rebalance, {} keys updated every {} ms, batch {} ms: a key's longest gap in s \
         while p2 joins (2 -> 3) and leaves (3 -> 2), median (range) of {} runs; \
         target {target:.2} s (twice the batch), before the join {}",
        args.failover_keys,
        FAILOVER_TICK.as_millis(),
        COMMIT_INTERVAL.as_millis(),
        args.runs,
        steady.text(2)
    ));
    summary.push(format!(
        "{:<28}{:>8}{:>22}{:>22}{:>22}",
        "keys", "count", "p50", "p99", "max"
    ));
    for (t, transition) in TRANSITIONS.into_iter().enumerate() {
        for (s, keys) in SPLITS.into_iter().enumerate() {
            // A run may move no key (or every key) of a transition.
            let gaps: Vec<Vec<f64>> = runs
                .iter()
                .map(|r| r.gaps[t][s].clone())
                .filter(|gaps| !gaps.is_empty())
                .collect();
            if gaps.is_empty() {
                continue;
            }
            let count = Spread::of(gaps.iter().map(|gaps| gaps.len() as f64));
            let (ran, gaps) = (gaps.len(), Gaps::of(gaps));
            println!(
                "{{\"bench\":\"cluster\",\"pipeline\":\"rebalance\",\
                 \"transition\":\"{transition}\",\"keys\":\"{keys}\",\"runs\":{ran},\
                 \"batch_s\":{:.2},\"target_s\":{target:.2},{},{},{}}}",
                COMMIT_INTERVAL.as_secs_f64(),
                count.json("key_count", 0),
                gaps.json("gap"),
                steady.json("steady_max_gap_s", 2),
            );
            summary.push(format!(
                "{:<28}{:>8}{}",
                format!("{transition}, {keys}"),
                count.text(0),
                gaps.columns()
            ));
        }
    }
    Ok(())
}
