//! What the cluster benches share: the query their child processes run, the
//! children themselves, and the Kafka topics, readers and figures around them.
//!
//! A cluster bench re-runs its own binary as each process of the query: with
//! [`CHILD_SPEC`] set, [`main_of`] runs [`child`] instead of the bench. A
//! child joins the cluster under an instance name, writes its [`Status`]
//! every 50 ms, and leaves when its stop file appears. The bench drives them
//! through [`Processes`] and reads the output with [`await_output`] (every
//! update once) or a [`Watch`] (when each key's updates arrived).

// Each bench compiles this module on its own and uses only part of it.
#![allow(dead_code)]

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
pub const CHILD_SPEC: &str = "RTFLOW_BENCH_CLUSTER_CHILD";
/// How a child joins the groups, from this variable: `static` (the
/// default) or `dynamic` ([`Membership`]).
pub const CHILD_MEMBERSHIP: &str = "RTFLOW_BENCH_CLUSTER_MEMBERSHIP";
/// Partitions of the input, the output and the repartition topic.
pub const PARTITIONS: i32 = 6;

/// The query's trigger interval, also the transactional copy's commit interval.
pub const COMMIT_INTERVAL: Duration = Duration::from_millis(300);
/// How long a measurement may take before the bench gives up on it.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(180);
/// How often each key of the failover and rebalance measurements is updated.
pub const TICK: Duration = Duration::from_millis(250);

/// How long no process may have started a run for the processes to count
/// as settled.
pub const SETTLED: Duration = Duration::from_secs(8);
/// The group's session timeout, KafkaCluster's default.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(6);
/// How long a Kafka client call may block.
pub const KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

/// What a bench step returns.
pub type BenchResult<T> = std::result::Result<T, BoxError>;

/// The flags every cluster bench takes.
#[derive(clap::Args)]
pub struct Common {
    /// Kafka bootstrap servers.
    #[arg(long, default_value_t = default_bootstrap())]
    pub bootstrap: String,
    /// Runs of each measurement, interleaved; median and range are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub runs: u64,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

/// The flags of the benches that pace updates of a few keys through the
/// query (failover, rebalance).
#[derive(Parser)]
#[command(about = "Stalls of a KafkaCluster query's keys through a change of its processes")]
pub struct PacedArgs {
    #[command(flatten)]
    pub common: Common,
    /// Keys, each updated every 250 ms.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
}

/// How the processes join the query's groups
/// (`KafkaCluster::static_membership`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Membership {
    /// Under their instance names: a process restarted under its name takes
    /// its partitions back without a rebalance.
    Static,
    /// As newcomers at every start.
    Dynamic,
}

impl Membership {
    pub fn name(self) -> &'static str {
        match self {
            Membership::Static => "static",
            Membership::Dynamic => "dynamic",
        }
    }
}

/// The `main` of a cluster bench: a child process if [`CHILD_SPEC`] is set,
/// else `bench` over the parsed flags, whose summary lines go to stderr last.
pub fn main_of<A: Parser>(bench: impl FnOnce(A) -> BenchResult<Vec<String>>) -> BenchResult<()> {
    if let Ok(spec) = std::env::var(CHILD_SPEC) {
        return child(&spec);
    }
    let summary = bench(A::parse())?;
    eprintln!();
    for line in summary {
        eprintln!("{line}");
    }
    Ok(())
}

/// `$RTFLOW_KAFKA_BOOTSTRAP`, else the broker of `scripts/kafka.sh start`.
pub fn default_bootstrap() -> String {
    std::env::var("RTFLOW_KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// An input record as the query sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    pub key: String,
    pub time: i64,
}

/// The dataflow every process runs: the count per key of `input`, each update
/// written to `output` under its key.
pub fn build(flow: &Dataflow, bootstrap: &str, input: &str, output: &str) {
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
    .sink(
        KafkaSink::new(bootstrap, output, |(key, count): &(String, u64)| {
            KafkaMessage::new(count.to_string()).key(key.clone())
        })
        .delivery(DeliveryGuarantee::ExactlyOnce),
    );
}

/// The query's configuration: a 300 ms real-time trigger.
pub fn config(query: &str) -> QueryConfig {
    QueryConfig::new(query)
        .trigger(Trigger::real_time("300 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
        .task_slots(64)
}

/// A child process: joins the cluster, writes its status every 50 ms, and
/// leaves when the stop file appears.
pub fn child(spec: &str) -> BenchResult<()> {
    rtflow::logging::init("warn");
    let [bootstrap, query, input, output, instance, dir]: [String; 6] = spec
        .split(' ')
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|_| format!("{CHILD_SPEC} has not six fields: {spec}"))?;
    let read = format!("{input}-");
    let (b, i, o) = (bootstrap.clone(), input, output);
    let dynamic = std::env::var(CHILD_MEMBERSHIP).is_ok_and(|m| m == Membership::Dynamic.name());
    let running = KafkaCluster::new(&bootstrap)
        .instance(&instance)
        .repartition_partitions(PARTITIONS as usize)
        .static_membership(!dynamic)
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
        let partitions = running.partitions();
        let owned = |prefix: &str| {
            let owned: Vec<&str> = partitions
                .iter()
                .filter_map(|p| p.strip_prefix(prefix))
                .collect();
            if owned.is_empty() {
                "-".to_owned()
            } else {
                owned.join(",")
            }
        };
        std::fs::write(
            status.with_extension("tmp"),
            format!(
                "{} {restore} {} {}",
                running.runs(),
                owned(&repartition),
                owned(&read)
            ),
        )?;
        std::fs::rename(status.with_extension("tmp"), &status)?;
        std::thread::sleep(Duration::from_millis(50));
    }
    running.stop()?;
    Ok(())
}

/// A child's latest status.
#[derive(Debug, Default)]
pub struct Status {
    /// Runs the process started (one, plus one per rebalance that moved
    /// partitions to or from it).
    pub runs: u64,
    /// What its latest run restored: partitions owned (`0` before the first
    /// run), bytes read from the changelog and from local copies of it, and
    /// how long that took.
    pub restored_partitions: usize,
    pub changelog_bytes: u64,
    pub local_bytes: u64,
    pub restore: Duration,
    /// The partitions of the (first) repartition topic its current run owns.
    pub repartition: Vec<i32>,
    /// The partitions of the input its current run reads.
    pub input: Vec<i32>,
}

impl Status {
    pub fn parse(text: &str) -> Option<Self> {
        let (numbers, input) = text.rsplit_once(' ')?;
        let (numbers, repartition) = numbers.rsplit_once(' ')?;
        let fields: Vec<u64> = numbers
            .split(' ')
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        let [runs, partitions, changelog_bytes, local_bytes, micros] = fields[..] else {
            return None;
        };
        let owned = |partitions: &str| match partitions {
            "-" => Some(Vec::new()),
            partitions => partitions
                .split(',')
                .map(str::parse)
                .collect::<std::result::Result<_, _>>()
                .ok(),
        };
        Some(Self {
            runs,
            restored_partitions: partitions as usize,
            changelog_bytes,
            local_bytes,
            restore: Duration::from_micros(micros),
            repartition: owned(repartition)?,
            input: owned(input)?,
        })
    }
}

/// A name no earlier run used, for a query and its topics.
pub fn unique(label: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_nanos();
    format!("bench-cluster-{label}-{}-{nanos}", std::process::id())
}

/// Writes `n` records `(key(i), i)` round-robin over the partitions and waits
/// until all are acknowledged; returns how long that took.
pub fn produce(
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
pub fn reader(bootstrap: &str, topic: &str) -> BenchResult<BaseConsumer> {
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
pub struct Topics {
    pub query: String,
    pub input: String,
    pub output: String,
}

impl Topics {
    pub fn create(bootstrap: &str, label: &str) -> BenchResult<Self> {
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
    pub fn delete(&self, bootstrap: &str) -> BenchResult<()> {
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
pub struct Processes {
    spec: String,
    /// How the processes spawned from now on join the groups.
    pub membership: Membership,
    /// Where the processes keep their status, stop files and logs.
    pub dir: PathBuf,
    children: Vec<(String, Child)>,
    /// Processes told to stop through their own stop file, until they exit.
    stopping: Vec<(String, Child)>,
}

impl Processes {
    pub fn new(bootstrap: &str, topics: &Topics) -> BenchResult<Self> {
        let dir = std::env::temp_dir()
            .join("rtflow-bench-cluster")
            .join(&topics.query);
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            spec: [bootstrap, &topics.query, &topics.input, &topics.output].join(" "),
            membership: Membership::Static,
            dir,
            children: Vec::new(),
            stopping: Vec::new(),
        })
    }

    pub fn spawn(&mut self, instance: &str) -> BenchResult<()> {
        let log = std::fs::File::create(self.dir.join(format!("{instance}.log")))?;
        let child = Command::new(std::env::current_exe()?)
            .env(
                CHILD_SPEC,
                format!("{} {instance} {}", self.spec, self.dir.display()),
            )
            .env(CHILD_MEMBERSHIP, self.membership.name())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.children.push((instance.to_owned(), child));
        Ok(())
    }

    /// SIGKILLs the process `instance`.
    pub fn kill(&mut self, instance: &str) -> BenchResult<()> {
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
    pub fn running(&self) -> bool {
        self.children
            .iter()
            .any(|(instance, _)| self.status(instance).runs > 0)
    }

    pub fn status(&self, instance: &str) -> Status {
        std::fs::read_to_string(self.dir.join(format!("{instance}.status")))
            .ok()
            .and_then(|text| Status::parse(&text))
            .unwrap_or_default()
    }

    /// Tells the process `instance` alone to stop, through its own stop
    /// file; [`Processes::check`] notes when it has left.
    pub fn tell_to_stop(&mut self, instance: &str) -> BenchResult<()> {
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
    pub fn is_stopping(&self) -> bool {
        !self.stopping.is_empty()
    }

    /// An error with the logs if a process has exited: none should before it
    /// is told to stop, and one told to stop must exit cleanly.
    pub fn check(&mut self) -> BenchResult<()> {
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
    pub fn stop(&mut self) -> BenchResult<Duration> {
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
pub fn logs(dir: &Path) -> String {
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
pub struct Output {
    /// The first run started in a process.
    pub first_run: Duration,
    /// The first output record was read.
    pub first: Duration,
    /// The last output record was read.
    pub last: Duration,
    /// Updates read more than once: none if the output is exactly once.
    pub duplicates: u64,
}

/// Reads `output` until it holds `expected` distinct `key:count` updates,
/// watching the processes spawned at `since`.
pub fn await_output(
    bootstrap: &str,
    output: &str,
    expected: u64,
    since: Instant,
    processes: &mut Processes,
) -> BenchResult<Output> {
    let mut tally = Tally::new(bootstrap, output, expected)?;
    let (mut first_run, mut first) = (None, None);
    let mut checked = Instant::now();
    while !tally.is_complete() {
        if tally.poll(output) {
            first.get_or_insert_with(|| since.elapsed());
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
                tally.updates.len(),
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
        duplicates: tally.duplicates,
    })
}

/// A record's key and value.
type Update = (Option<Vec<u8>>, Option<Vec<u8>>);

/// The distinct `(key, value)` records a read_committed consumer of a topic
/// has read, and how many it read twice: every measured pipeline's output is
/// read back by one, so that their figures are alike.
pub struct Tally {
    consumer: BaseConsumer,
    updates: HashSet<Update>,
    expected: u64,
    pub duplicates: u64,
}

impl Tally {
    pub fn new(bootstrap: &str, topic: &str, expected: u64) -> BenchResult<Self> {
        Ok(Self {
            consumer: reader(bootstrap, topic)?,
            updates: HashSet::with_capacity(expected as usize),
            expected,
            duplicates: 0,
        })
    }

    /// Reads a record, waiting up to 20 ms; whether one came.
    pub fn poll(&mut self, topic: &str) -> bool {
        match self.consumer.poll(Duration::from_millis(20)) {
            Some(Ok(message)) => {
                let update = (
                    message.key().map(<[u8]>::to_vec),
                    message.payload().map(<[u8]>::to_vec),
                );
                if !self.updates.insert(update) {
                    self.duplicates += 1;
                }
                true
            }
            Some(Err(error)) => {
                eprintln!("reading {topic}: {error}");
                false
            }
            None => false,
        }
    }

    pub fn is_complete(&self) -> bool {
        self.updates.len() as u64 >= self.expected
    }
}

/// When each key's updates arrived at a read_committed consumer of a query's
/// output.
pub struct Watch {
    consumer: BaseConsumer,
    arrivals: HashMap<Vec<u8>, Vec<Instant>>,
}

impl Watch {
    pub fn new(bootstrap: &str, output: &str) -> BenchResult<Self> {
        Ok(Self {
            consumer: reader(bootstrap, output)?,
            arrivals: HashMap::new(),
        })
    }

    /// Reads the output until `until`, watching the processes.
    pub fn read_until(&mut self, until: Instant, processes: &mut Processes) -> BenchResult<()> {
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
    pub fn settle(&mut self, processes: &mut Processes, instances: &[&str]) -> BenchResult<()> {
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
    pub fn longest_gap(&self, key: &str, from: Instant, to: Instant) -> f64 {
        let times = self
            .arrivals
            .get(key.as_bytes())
            .map_or(&[][..], Vec::as_slice);
        longest_gap(times, from, to)
    }

    /// The longest gap of any key from `from` to `to`, in seconds.
    pub fn steady(&self, from: Instant, to: Instant) -> f64 {
        self.arrivals
            .values()
            .map(|times| longest_gap(times, from, to))
            .fold(0.0, f64::max)
    }
}

/// The longest gap between consecutive `times` from `from` to `to`, in
/// seconds, counting from the last time before `from`.
pub fn longest_gap(times: &[Instant], from: Instant, to: Instant) -> f64 {
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
/// `keys` keys of `input` every [`TICK`] until told to stop.
pub fn pace(
    bootstrap: &str,
    input: &str,
    keys: u64,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<BenchResult<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (bootstrap, input, told) = (bootstrap.to_owned(), input.to_owned(), stop.clone());
    let pacer = std::thread::spawn(move || update_keys(&bootstrap, &input, keys, &told));
    (stop, pacer)
}

/// Writes one update of each of `keys` keys every [`TICK`] until
/// `stop`, each key to its own partition.
pub fn update_keys(bootstrap: &str, topic: &str, keys: u64, stop: &AtomicBool) -> BenchResult<()> {
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
        next += TICK;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    producer.flush(KAFKA_TIMEOUT)?;
    Ok(())
}

/// Percentile `p` of sorted `values`.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Median and range.
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut values: Vec<f64> = values.into_iter().collect();
        values.sort_by(f64::total_cmp);
        Self {
            median: values[values.len() / 2],
            min: values[0],
            max: values[values.len() - 1],
        }
    }

    /// `"name":median,"name_min":min,"name_max":max`.
    pub fn json(&self, name: &str, decimals: usize) -> String {
        format!(
            "\"{name}\":{:.decimals$},\"{name}_min\":{:.decimals$},\"{name}_max\":{:.decimals$}",
            self.median, self.min, self.max
        )
    }

    /// `median (min-max)`.
    pub fn text(&self, decimals: usize) -> String {
        format!(
            "{:.decimals$} ({:.decimals$}-{:.decimals$})",
            self.median, self.min, self.max
        )
    }
}

/// The longest gaps of each run summarised over the runs: the spread of each
/// run's p50, p99 and max.
pub struct Gaps {
    pub p50: Spread,
    pub p99: Spread,
    pub max: Spread,
}

impl Gaps {
    pub fn of(runs: impl IntoIterator<Item = Vec<f64>>) -> Self {
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
    pub fn json(&self, name: &str) -> String {
        format!(
            "{},{},{}",
            self.p50.json(&format!("{name}_p50_s"), 2),
            self.p99.json(&format!("{name}_p99_s"), 2),
            self.max.json(&format!("{name}_max_s"), 2)
        )
    }

    /// The p50, p99 and max columns of a summary row.
    pub fn columns(&self) -> String {
        format!(
            "{:>22}{:>22}{:>22}",
            self.p50.text(2),
            self.p99.text(2),
            self.max.text(2)
        )
    }
}

/// Records per second.
pub fn rate(records: u64, time: Duration) -> f64 {
    records as f64 / time.as_secs_f64()
}
