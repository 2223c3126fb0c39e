//! Crash tests: a dataflow runs in a child process (this test binary, running its
//! ignored `crash_child` test) that is killed with SIGKILL at random moments and
//! restarted from its checkpoint each time: a count per key of Kafka or generator
//! input, (window mode) a tumbling-window count per key over event time, or (join
//! mode) a stream-stream join of two generators on a key and an event-time range.
//! Afterwards:
//!
//! - the exactly-once sink's output, read with read_committed, holds every
//!   `key:count` (or joined `left:right` pair) of a correct run exactly once: each
//!   record was processed once (exactly-once processing) and each output was
//!   delivered once;
//! - the at-least-once sink's output holds every one of them at least once.
//!
//! The seed of the kill schedule is printed; `RTFLOW_CRASH_SEED` replays it.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::kafka::{self, bootstrap, consume, consume_to_end, topic};
use rdkafka::producer::{BaseRecord, Producer};
use rtflow::prelude::*;

/// How many times each test kills its child.
const KILLS: usize = 20;

/// What the child runs, from `RTFLOW_CRASH_CHILD`: `mode bootstrap input eos alo dir`.
const CHILD_SPEC: &str = "RTFLOW_CRASH_CHILD";

/// Generator mode: partitions and rows per partition.
const GENERATOR_PARTITIONS: usize = 2;
const GENERATOR_ROWS: u64 = 20_000;

fn generator_key(partition: usize, offset: u64) -> String {
    format!("g{}", (offset * 7 + partition as u64) % 13)
}

/// Window mode: a generator row's event time (5 ms per row of a partition, so a
/// replay gets the same times) and the window size.
fn generator_time(offset: u64) -> i64 {
    offset as i64 * 5
}
const WINDOW: Duration = Duration::from_secs(1);

fn window_key(partition: usize, offset: u64) -> String {
    let start = generator_time(offset) / WINDOW.as_millis() as i64 * WINDOW.as_millis() as i64;
    format!("{}@{start}", generator_key(partition, offset))
}

/// Join mode: each side is a generator of `JOIN_PARTITIONS` x `JOIN_ROWS` rows
/// `(key, partition, offset)` at event time `generator_time(offset)`, so a replay
/// gets the same rows and times; rows join on equal keys when the right row is
/// from `JOIN_BEFORE` before to `JOIN_AFTER` after the left one.
const JOIN_PARTITIONS: usize = 2;
const JOIN_ROWS: u64 = 3_000;
const JOIN_KEYS: u64 = 11;
const JOIN_BEFORE: Duration = Duration::from_millis(20);
const JOIN_AFTER: Duration = Duration::from_millis(40);

/// A join row: `(key, partition, offset)`.
type JoinRow = (u64, usize, u64);

fn join_left(partition: usize, offset: u64) -> JoinRow {
    (
        (offset * 3 + partition as u64) % JOIN_KEYS,
        partition,
        offset,
    )
}

fn join_right(partition: usize, offset: u64) -> JoinRow {
    (
        (offset * 5 + 2 * partition as u64 + 1) % JOIN_KEYS,
        partition,
        offset,
    )
}

fn join_time(row: &JoinRow) -> i64 {
    generator_time(row.2)
}

/// A joined pair as written to Kafka: `l<partition>.<offset>:r<partition>.<offset>`.
fn join_value((left, right): &(JoinRow, JoinRow)) -> String {
    format!("l{}.{}:r{}.{}", left.1, left.2, right.1, right.2)
}

fn kafka_key(index: usize) -> String {
    format!("k{}", index % 17)
}

/// The dataflow under test: source -> key -> count per key -> both Kafka sinks.
#[test]
#[ignore = "the child process of the crash tests, which start it themselves"]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_SPEC) else {
        return;
    };
    let _failpoints = fail::FailScenario::setup();
    // Its logs go to a pipe: no colour.
    tracing_subscriber::fmt()
        .with_env_filter("info")
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let [mode, bootstrap, input, eos, alo, dir]: [&str; 6] = spec
        .split(' ')
        .collect::<Vec<_>>()
        .try_into()
        .expect("six fields");
    let flow = Dataflow::new("crash");
    if mode == "join" {
        // Two generators -> event time -> inner join on key and time range.
        let side = |make: fn(usize, u64) -> JoinRow| {
            flow.source(
                GeneratorSource::new(make)
                    .partitions(JOIN_PARTITIONS)
                    .rows_per_partition(JOIN_ROWS)
                    .rows_per_second(150),
            )
            .with_watermark(join_time, Duration::from_millis(100))
        };
        let (left, right) = (side(join_left), side(join_right));
        let window = JoinWindow::between(JOIN_BEFORE, JOIN_AFTER);
        let pairs = left.join(&right, |row| row.0, |row| row.0, window);
        let message = |pair: &(JoinRow, JoinRow)| KafkaMessage::new(join_value(pair));
        return run_query(flow, &pairs, message, bootstrap, eos, alo, dir);
    }
    if mode == "window" {
        // Generator -> event time -> tumbling-window count per key, as `key@start`.
        let counts = flow
            .source(
                GeneratorSource::new(|partition, offset| {
                    (generator_key(partition, offset), generator_time(offset))
                })
                .partitions(GENERATOR_PARTITIONS)
                .rows_per_partition(GENERATOR_ROWS)
                .rows_per_second(2_000),
            )
            .with_watermark(|(_, time)| *time, Duration::from_millis(500))
            .key_by(|(key, _): &(String, i64)| key.clone())
            .window(Window::tumbling(WINDOW))
            .count()
            .map(|(key, window, count)| (format!("{key}@{}", window.start), count));
        return run_child(flow, counts, bootstrap, eos, alo, dir);
    }
    let keys = match mode {
        "kafka" => flow
            .source(
                KafkaSource::new(bootstrap)
                    .subscribe([input])
                    .starting_offsets(StartingOffsets::Earliest),
            )
            .map(|record: KafkaRecord| record.key_str().into_owned()),
        _ => flow.source(
            GeneratorSource::new(generator_key)
                .partitions(GENERATOR_PARTITIONS)
                .rows_per_partition(GENERATOR_ROWS)
                .rows_per_second(2_000),
        ),
    };
    let counts = keys.key_by(|key: &String| key.clone()).count();
    run_child(flow, counts, bootstrap, eos, alo, dir);
}

/// Writes `key:count` per update to both Kafka sinks and runs the child's query.
fn run_child(
    flow: Dataflow,
    counts: Stream<(String, u64)>,
    bootstrap: &str,
    eos: &str,
    alo: &str,
    dir: &str,
) {
    let message =
        |(key, count): &(String, u64)| KafkaMessage::new(format!("{key}:{count}")).key(key.clone());
    run_query(flow, &counts, message, bootstrap, eos, alo, dir);
}

/// Writes `message` of each output to both Kafka sinks and runs the child's query.
fn run_query<T: Data>(
    flow: Dataflow,
    output: &Stream<T>,
    message: impl Fn(&T) -> KafkaMessage + Clone + Send + Sync + 'static,
    bootstrap: &str,
    eos: &str,
    alo: &str,
    dir: &str,
) {
    output.sink(
        KafkaSink::new(bootstrap, eos, message.clone()).delivery(DeliveryGuarantee::ExactlyOnce),
    );
    output.sink(KafkaSink::new(bootstrap, alo, message));
    let config = QueryConfig::new("crash")
        .checkpoint_location(dir)
        .trigger(Trigger::real_time("200 milliseconds"))
        .min_batch_duration(Duration::from_millis(200));
    let query = flow.start(config).expect("the child's query starts");
    // A Kafka query runs until killed; a generator query ends with its input.
    query.await_termination(None).expect("terminates");
    assert_eq!(query.exception(), None);
}

/// A tiny deterministic generator for the kill schedule.
struct Schedule(u64);

impl Schedule {
    fn new() -> Self {
        let seed = std::env::var("RTFLOW_CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("kill schedule seed: {seed} (RTFLOW_CRASH_SEED={seed} replays it)");
        Self(seed)
    }

    /// The next pause, in `min..max` ms.
    fn pause(&mut self, min: u64, max: u64) -> Duration {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        Duration::from_millis(min + (self.0 >> 33) % (max - min))
    }
}

/// One crash test's topics, checkpoint location and child logs.
struct Run {
    mode: &'static str,
    bootstrap: String,
    input: String,
    eos: String,
    alo: String,
    dir: PathBuf,
    round: usize,
}

impl Run {
    fn new(mode: &'static str, bootstrap: &str) -> Self {
        let dir = std::env::temp_dir()
            .join("rtflow-tests")
            .join(std::process::id().to_string())
            .join(format!("crash-{mode}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            mode,
            bootstrap: bootstrap.to_owned(),
            input: topic(bootstrap, "rtflow-crash-in", 3),
            eos: topic(bootstrap, "rtflow-crash-eos", 1),
            alo: topic(bootstrap, "rtflow-crash-alo", 1),
            dir,
            round: 0,
        }
    }

    fn log(&self, round: usize) -> PathBuf {
        self.dir.join(format!("child-{round}.log"))
    }

    /// Starts the child, with fail points from `failpoints` if given.
    fn spawn(&mut self, failpoints: Option<&str>) -> Child {
        self.round += 1;
        let spec = format!(
            "{} {} {} {} {} {}",
            self.mode,
            self.bootstrap,
            self.input,
            self.eos,
            self.alo,
            self.dir.join("checkpoint").display()
        );
        let log = std::fs::File::create(self.log(self.round)).unwrap();
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--ignored", "--exact", "crash_child", "--nocapture"])
            .env(CHILD_SPEC, spec)
            .stdout(Stdio::null())
            .stderr(log);
        command.env_remove("FAILPOINTS");
        if let Some(failpoints) = failpoints {
            command.env("FAILPOINTS", failpoints);
        }
        command.spawn().expect("the child starts")
    }

    fn kill(&self, mut child: Child) {
        // SIGKILL: no destructor, flush or goodbye runs.
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Waits for the child to exit by itself; returns whether it succeeded.
    fn wait(&self, mut child: Child, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.success();
            }
            if Instant::now() > deadline {
                self.kill(child);
                panic!(
                    "child round {} did not exit; see {}",
                    self.round,
                    self.log(self.round).display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the child has started its actors (its exactly-once sink's
    /// producers are ready), or exited, so that a kill hits a running query
    /// rather than one still starting up.
    fn wait_started(&self, child: &mut Child, timeout: Duration) {
        self.wait_logged(child, "starting actors", timeout);
    }

    /// Waits until the child's log holds `text`, or the child exited.
    fn wait_logged(&self, child: &mut Child, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log_contains(self.round, text) {
            if child.try_wait().unwrap().is_some() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "child round {} did not log '{text}' in {timeout:?}; see {}",
                self.round,
                self.log(self.round).display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_contains(&self, round: usize, text: &str) -> bool {
        std::fs::read_to_string(self.log(round)).is_ok_and(|log| log.contains(text))
    }

    /// Checks both sinks against `expected` (`key:count` once each).
    fn check(&self, expected: &BTreeMap<String, usize>) {
        let total = expected.len();
        let exactly_once = offsets_by_value(&self.bootstrap, &self.eos);
        let missing: Vec<_> = expected
            .keys()
            .filter(|v| !exactly_once.contains_key(*v))
            .take(5)
            .collect();
        // The offsets tell a consumer reading a record twice from a record
        // written twice.
        let doubled: Vec<_> = exactly_once
            .iter()
            .filter(|(_, offsets)| offsets.len() > 1)
            .take(5)
            .collect();
        let unexpected: Vec<_> = exactly_once
            .keys()
            .filter(|v| !expected.contains_key(*v))
            .take(5)
            .collect();
        assert!(
            missing.is_empty() && doubled.is_empty() && unexpected.is_empty(),
            "exactly-once output: missing {missing:?}, doubled (at offsets) {doubled:?}, \
             unexpected {unexpected:?}\n{}",
            self.story()
        );
        let at_least_once: BTreeSet<String> = offsets_by_value(&self.bootstrap, &self.alo)
            .into_keys()
            .collect();
        let expected_values: BTreeSet<String> = expected.keys().cloned().collect();
        assert_eq!(
            at_least_once, expected_values,
            "at-least-once output holds every count, and nothing else"
        );
        println!(
            "{}: {} outputs committed exactly once after {} rounds",
            self.mode, total, self.round
        );
    }

    /// Per round: the checkpoint it resumed from, the checkpoints it committed,
    /// and the epochs it wrote again, from the child logs (for failure messages).
    fn story(&self) -> String {
        let mut story = String::from("rounds (resumed from / committed / wrote again):\n");
        for round in 1..=self.round {
            let log = std::fs::read_to_string(self.log(round)).unwrap_or_default();
            let plain = strip_ansi(&log);
            let numbers = |after: &str| -> Vec<String> {
                plain
                    .lines()
                    .filter_map(|line| line.split(after).nth(1))
                    .map(|rest| rest.chars().take_while(char::is_ascii_digit).collect())
                    .collect()
            };
            let resumed = numbers("recovery{epoch=");
            let committed = numbers("checkpoint committed epoch=");
            let rewritten: Vec<_> = plain
                .lines()
                .filter(|line| line.contains("wrote again"))
                .filter_map(|line| line.split("transactional_id=").nth(1))
                .collect();
            story.push_str(&format!(
                "  {round}: {resumed:?} / {}..{} / {rewritten:?}\n",
                committed.first().map_or("-", |c| c.as_str()),
                committed.last().map_or("-", |c| c.as_str()),
            ));
        }
        story
    }
}

/// `text` without terminal colour codes.
fn strip_ansi(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().take_while(|c| *c != 'm').for_each(drop);
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The offsets of each value of `topic` (read_committed).
fn offsets_by_value(bootstrap: &str, topic: &str) -> BTreeMap<String, Vec<i64>> {
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for record in consume_to_end(bootstrap, topic, Duration::from_secs(60)) {
        seen.entry(String::from_utf8_lossy(&record.value).into_owned())
            .or_default()
            .push(record.offset);
    }
    seen
}

/// Every `key:count` a correct run emits, given how many records each key had.
fn expected_counts(per_key: &BTreeMap<String, usize>) -> BTreeMap<String, usize> {
    per_key
        .iter()
        .flat_map(|(key, n)| (1..=*n).map(move |c| (format!("{key}:{c}"), 1)))
        .collect()
}

/// Waits until read_committed output reaches `count` records.
fn wait_for_output(bootstrap: &str, topic: &str, count: usize, round: &Path) {
    let read = consume(bootstrap, topic, 1, count, Duration::from_secs(90));
    assert!(
        read.len() >= count,
        "only {} of {count} outputs committed; see {}",
        read.len(),
        round.display()
    );
}

/// One kill round: starts the child, waits until its query runs (starting up,
/// which fences the killed child's Kafka transactions, can take longer than a
/// pause), and in every other round also until it committed a checkpoint, so
/// that recovery is tested however slow the machine; then lets it run for a
/// random while and kills it: before, during or after its checkpoints.
fn kill_while_running(run: &mut Run, schedule: &mut Schedule) {
    let mut child = run.spawn(None);
    run.wait_started(&mut child, Duration::from_secs(30));
    if run.round.is_multiple_of(2) {
        run.wait_logged(&mut child, "checkpoint committed", Duration::from_secs(30));
    }
    std::thread::sleep(schedule.pause(200, 1200));
    run.kill(child);
}

/// Fails unless enough killed runs committed checkpoints to test recovery.
fn assert_killed_runs_progressed(run: &Run) {
    let checkpointed = (1..=run.round)
        .filter(|round| run.log_contains(*round, "checkpoint committed"))
        .count();
    println!(
        "{}: {checkpointed} of {} killed runs committed checkpoints",
        run.mode, run.round
    );
    assert!(
        checkpointed >= KILLS / 4,
        "the killed runs hardly progressed: only {checkpointed} committed a checkpoint"
    );
}

#[test]
fn kafka_count_survives_repeated_sigkill() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut run = Run::new("kafka", &bootstrap);
    let mut schedule = Schedule::new();

    // Input keeps arriving while the child is killed and restarted, from one
    // producer, 20 records every 10 ms: every epoch of a child (200 ms) reads
    // some, the one the fail point below ends included, whose output its
    // restart must then write again.
    let produced = Arc::new(AtomicUsize::new(0));
    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (bootstrap, input) = (bootstrap.clone(), run.input.clone());
        let (produced, producing) = (produced.clone(), producing.clone());
        std::thread::spawn(move || {
            let producer = kafka::producer(&bootstrap);
            while producing.load(Ordering::Relaxed) {
                let from = produced.load(Ordering::Relaxed);
                for i in from..from + 20 {
                    let key = kafka_key(i);
                    let record = BaseRecord::<String, [u8]>::to(&input)
                        .partition((i % 3) as i32)
                        .key(&key)
                        .payload(&[]);
                    kafka::send(&producer, record);
                }
                produced.store(from + 20, Ordering::Relaxed);
                producer.poll(Duration::from_millis(10));
            }
            producer.flush(Duration::from_secs(30)).unwrap();
        })
    };

    for kill in 0..KILLS {
        if kill == KILLS / 2 {
            // Once, deterministically, crash in the window exactly-once must
            // survive: the 4th checkpoint is durable, its transactions are not
            // committed.
            let child = run.spawn(Some("after-manifest=3*off->return"));
            assert!(
                !run.wait(child, Duration::from_secs(60)),
                "the fail point aborts the child"
            );
            assert!(run.log_contains(run.round, "checkpoint committed"));
            continue;
        }
        kill_while_running(&mut run, &mut schedule);
    }
    assert_killed_runs_progressed(&run);
    producing.store(false, Ordering::Relaxed);
    producer.join().unwrap();
    let total = produced.load(Ordering::Relaxed);
    let mut per_key = BTreeMap::new();
    for i in 0..total {
        *per_key.entry(kafka_key(i)).or_insert(0) += 1;
    }
    let expected = expected_counts(&per_key);

    let child = run.spawn(None);
    wait_for_output(&bootstrap, &run.eos, expected.len(), &run.log(run.round));
    run.kill(child);
    let resolved =
        (1..=run.round).any(|round| run.log_contains(round, "whose transaction did not commit"));
    assert!(
        resolved,
        "the restart after the fail point wrote the uncommitted epoch's output again"
    );
    run.check(&expected);
}

/// Kills a generator `mode` child at `KILLS` moments of its running query, then
/// lets a last run read the rest of the input and end by itself.
fn kill_repeatedly_then_finish(mode: &'static str, bootstrap: &str) -> Run {
    let mut run = Run::new(mode, bootstrap);
    let mut schedule = Schedule::new();
    for _ in 0..KILLS {
        kill_while_running(&mut run, &mut schedule);
    }
    assert_killed_runs_progressed(&run);
    let child = run.spawn(None);
    assert!(
        run.wait(child, Duration::from_secs(120)),
        "the final run succeeds; see {}",
        run.log(run.round).display()
    );
    assert!(
        run.log_contains(run.round, "resuming from the last committed checkpoint"),
        "the final run resumed from a checkpoint"
    );
    run
}

/// How many generator rows have each key `key_of(partition, offset)`.
fn generator_counts(key_of: fn(usize, u64) -> String) -> BTreeMap<String, usize> {
    let mut per_key = BTreeMap::new();
    for partition in 0..GENERATOR_PARTITIONS {
        for offset in 0..GENERATOR_ROWS {
            *per_key.entry(key_of(partition, offset)).or_insert(0) += 1;
        }
    }
    per_key
}

#[test]
fn generator_count_survives_repeated_sigkill() {
    let Some(bootstrap) = bootstrap() else { return };
    let run = kill_repeatedly_then_finish("generator", &bootstrap);
    run.check(&expected_counts(&generator_counts(generator_key)));
}

#[test]
fn generator_window_count_survives_repeated_sigkill() {
    let Some(bootstrap) = bootstrap() else { return };
    let run = kill_repeatedly_then_finish("window", &bootstrap);
    // Event times only grow within a partition and a restored window operator
    // judges replayed records by its watermark at the barrier, so no record is
    // late: every (key, window) counts all its records, once each.
    run.check(&expected_counts(&generator_counts(window_key)));
}

#[test]
fn generator_stream_join_survives_repeated_sigkill() {
    let Some(bootstrap) = bootstrap() else { return };
    let started = Instant::now();
    let run = kill_repeatedly_then_finish("join", &bootstrap);
    // The batch reference: every pair of rows with equal keys and the right
    // row's time in [left - before, left + after]. Times only grow within a
    // partition and a restored join judges replayed rows by its own watermark
    // at the barrier, so no row is late and every pair comes out.
    let rows = |make: fn(usize, u64) -> JoinRow| {
        (0..JOIN_PARTITIONS)
            .flat_map(move |p| (0..JOIN_ROWS).map(move |o| make(p, o)))
            .collect::<Vec<_>>()
    };
    let mut right_by_key: BTreeMap<u64, Vec<JoinRow>> = BTreeMap::new();
    for right in rows(join_right) {
        right_by_key.entry(right.0).or_default().push(right);
    }
    let (before, after) = (
        JOIN_BEFORE.as_millis() as i64,
        JOIN_AFTER.as_millis() as i64,
    );
    let mut expected = BTreeMap::new();
    for left in rows(join_left) {
        let time = join_time(&left);
        for right in right_by_key.get(&left.0).into_iter().flatten() {
            let right_time = join_time(right);
            if time - before <= right_time && right_time <= time + after {
                expected.insert(join_value(&(left, *right)), 1);
            }
        }
    }
    run.check(&expected);
    println!("join: {:.1?} in all", started.elapsed());
}
