//! Stateful queries over a real Kafka broker (started by scripts/test.sh),
//! each compared with a batch reference computed from the records the test
//! produced: tumbling, sliding and session window counts, deduplication within
//! the watermark, stream-stream inner and left outer joins, and a keyed process
//! operator with event-time timers. The cases read topics of 3 or 4 partitions
//! and between them cover fewer readers than partitions (`max_partitions`), a
//! silent partition released by an idle timeout, and a stop and restart on the
//! checkpoint location halfway through the input. One more test checks that a
//! reader of several partitions tracks event time per topic partition.
//!
//! Every partition's records lag its largest event time so far by at most the
//! watermark delay, so no record is ever late, wherever a restart falls; each
//! partition ends with a sentinel far ahead in event time, whose watermark
//! closes every window, fires every timer and expires every join row.

mod common;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::kafka::{bootstrap, produce, topic};
use common::Spec;
use rtflow::operators::process::{MapState, StateDeclarations};
use rtflow::prelude::*;

/// `(key, event time in ms, id)`, produced as the text "key,time,id".
type Event = (u32, i64, u32);

/// Upper bound of every wait; never a measure of speed.
const WAIT: Duration = Duration::from_secs(60);
/// The watermark delay, and the most a record lags its partition's clock (ms).
const DELAY: i64 = 200;
/// How long a partition may be silent before the watermark stops waiting for it.
const IDLE: Duration = Duration::from_secs(2);
const PER_PARTITION: usize = 200;
/// Keys from here on are the test's own (sentinels, heartbeats); queries see
/// them, results leave them out.
const SENTINEL: u32 = 1_000_000;
/// Event time of the sentinels: far beyond every record's (at most ~8 s).
const END: i64 = 1_000_000;

fn ms(ms: i64) -> Duration {
    Duration::from_millis(ms as u64)
}

fn time(event: &Event) -> i64 {
    event.1
}

fn parse(record: KafkaRecord) -> Event {
    let text = record.value_str();
    let mut fields = text.split(',');
    let mut next = || fields.next().expect("three fields");
    (
        next().parse().unwrap(),
        next().parse().unwrap(),
        next().parse().unwrap(),
    )
}

// ---- Inputs. ---------------------------------------------------------------

/// splitmix64: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

/// The records of each partition of a topic, in the order they are produced.
type Partitions = Vec<Vec<Event>>;

/// `PER_PARTITION` records in each of `partitions` but `silent`, keys below
/// `keys`, ids unique from `first_id`. A partition's clock moves 0-39 ms a
/// record and each record lags it by up to `DELAY`: never behind the largest
/// time its partition delivered minus `DELAY`, so never behind a watermark.
fn events(seed: u64, partitions: i32, silent: Option<i32>, keys: u32, first_id: u32) -> Partitions {
    let mut rng = Rng(seed);
    let mut id = first_id;
    (0..partitions)
        .map(|p| {
            if Some(p) == silent {
                return Vec::new();
            }
            let mut clock = 0;
            (0..PER_PARTITION)
                .map(|_| {
                    clock += rng.below(40) as i64;
                    id += 1;
                    let lag = rng.below(DELAY as u64 + 1) as i64;
                    (rng.below(keys as u64) as u32, (clock - lag).max(0), id)
                })
                .collect()
        })
        .collect()
}

fn flatten(partitions: &[Partitions]) -> Vec<Event> {
    partitions.iter().flatten().flatten().copied().collect()
}

// ---- The harness. ----------------------------------------------------------

/// How a case reads its topics.
struct Case {
    name: &'static str,
    /// Partitions of each input topic.
    partitions: &'static [i32],
    /// At most this many reader actors for the first topic.
    readers: Option<usize>,
    /// A partition of the first topic that never delivers a record: every
    /// input then declares an idle timeout, without which the watermark would
    /// wait for that partition for ever.
    silent: Option<i32>,
    /// Stop halfway through the input, once a checkpoint covers what was read,
    /// and restart on the same checkpoint location.
    restart: bool,
    /// Once the watermark passed everything, produce a record whose windows
    /// closed and expect it dropped as late: the proof they did close.
    late_probe: bool,
}

impl Case {
    const fn new(name: &'static str, partitions: &'static [i32]) -> Self {
        Self {
            name,
            partitions,
            readers: None,
            silent: None,
            restart: false,
            late_probe: false,
        }
    }

    fn config(&self) -> QueryConfig {
        common::config(self.name)
            .default_parallelism(2)
            // Epochs end during the run too, not only on demand.
            .trigger(Trigger::real_time("200 milliseconds"))
            .min_batch_duration(ms(200))
            .progress_interval(Duration::from_secs(60))
    }

    /// The input topics' streams, event time declared.
    fn inputs(&self, flow: &Dataflow, bootstrap: &str, topics: &[String]) -> Vec<Stream<Event>> {
        topics
            .iter()
            .enumerate()
            .map(|(i, topic)| {
                let mut source = KafkaSource::new(bootstrap)
                    .subscribe([topic])
                    .starting_offsets(StartingOffsets::Earliest);
                if let (0, Some(readers)) = (i, self.readers) {
                    source = source.max_partitions(readers);
                }
                let events = flow.source(source).name(format!("in{i}")).map(parse);
                if self.silent.is_some() {
                    events.with_watermark_idle(time, ms(DELAY), IDLE)
                } else {
                    events.with_watermark(time, ms(DELAY))
                }
            })
            .collect()
    }

    /// Per topic, a record at `END` in every partition that is not silent.
    fn sentinels(&self) -> Vec<(usize, i32, Event)> {
        let mut sentinels = Vec::new();
        for (t, partitions) in self.partitions.iter().enumerate() {
            for p in 0..*partitions {
                if t > 0 || Some(p) != self.silent {
                    sentinels.push((t, p, (SENTINEL, END, u32::MAX)));
                }
            }
        }
        sentinels
    }
}

/// Topics and a checkpoint directory, deleted when the test ends, passed or not.
struct Resources {
    bootstrap: String,
    topics: Vec<String>,
    location: PathBuf,
}

impl Drop for Resources {
    fn drop(&mut self) {
        if let Ok(admin) = KafkaAdmin::new(&self.bootstrap) {
            for topic in &self.topics {
                let _ = admin.delete_topic(topic);
            }
        }
        let _ = std::fs::remove_dir_all(&self.location);
    }
}

/// Writes `(topic index, partition, event)`s as "key,time,id".
fn send(bootstrap: &str, topics: &[String], records: &[(usize, i32, Event)]) {
    for (t, topic) in topics.iter().enumerate() {
        let records =
            records
                .iter()
                .filter(|(to, _, _)| *to == t)
                .map(|(_, p, (key, time, id))| {
                    (
                        *p,
                        key.to_string(),
                        format!("{key},{time},{id}").into_bytes(),
                    )
                });
        produce(bootstrap, topic, records.collect::<Vec<_>>());
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "not within {WAIT:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `build` over `case`'s topics holding `inputs` (per topic) and the
/// sentinels, until the watermark passed every record, and returns what
/// reached the sink, all runs' rows in order, the test's own keys (by `key`)
/// left out. `None`: no broker, test skipped.
fn run<Out: Data + Clone>(
    case: &Case,
    inputs: &[Partitions],
    build: impl Fn(&[Stream<Event>]) -> Stream<Out>,
    key: impl Fn(&Out) -> u32,
) -> Option<Vec<Out>> {
    let bootstrap = bootstrap()?;
    let config = case.config();
    let resources = Resources {
        topics: case
            .partitions
            .iter()
            .map(|p| topic(&bootstrap, &format!("rtflow-stateful-{}", case.name), *p))
            .collect(),
        location: config.checkpoint_location.clone().unwrap(),
        bootstrap,
    };
    let (bootstrap, topics) = (&resources.bootstrap, &resources.topics);
    let start = |sink: &MemorySink<Out>| {
        let flow = Dataflow::new(case.name);
        build(&case.inputs(&flow, bootstrap, topics)).sink(sink.clone());
        flow.start(config.clone()).expect("the query starts")
    };
    let split = |first: bool| -> Vec<(usize, i32, Event)> {
        let mut records = Vec::new();
        for (t, partitions) in inputs.iter().enumerate() {
            for (p, events) in partitions.iter().enumerate() {
                let half = if case.restart { events.len() / 2 } else { 0 };
                let part = if first {
                    &events[..half]
                } else {
                    &events[half..]
                };
                records.extend(part.iter().map(|e| (t, p as i32, *e)));
            }
        }
        records
    };

    let mut sinks = vec![MemorySink::new()];
    let mut query = start(&sinks[0]);
    if case.restart {
        let first = split(true);
        send(bootstrap, topics, &first);
        wait_until("the first half is read", || {
            query.metrics().records_read() >= first.len() as u64
        });
        query
            .checkpoint_now(WAIT)
            .expect("a checkpoint covers the first half");
        query.stop().unwrap();
        assert_eq!(query.exception(), None);
        assert_eq!(query.metrics().late_records(), 0, "first run");
        drop(query);
        sinks.push(MemorySink::new());
        query = start(sinks.last().unwrap());
    }
    let mut rest = split(false);
    rest.extend(case.sentinels());
    send(bootstrap, topics, &rest);

    // The sink's watermark follows every record before it in every lane, so
    // once it passed the data, all their results are in. A reader whose
    // partitions all fell silent declares its stream idle rather than pass a
    // watermark on (as Flink does), so the partitions that are not the silent
    // one keep delivering heartbeats at the sentinels' time, as live ones would.
    let mut heartbeat = Instant::now();
    wait_until("the watermark passes every record", || {
        if case.silent.is_some() && heartbeat.elapsed() >= Duration::from_millis(100) {
            send(bootstrap, topics, &case.sentinels());
            heartbeat = Instant::now();
        }
        query.metrics().watermark() >= Some(END - DELAY)
    });
    let mut late = 0;
    if case.late_probe {
        send(bootstrap, topics, &[(0, 0, (0, 0, u32::MAX - 1))]);
        late = 1;
        wait_until("the record behind the closed windows is dropped", || {
            query.metrics().late_records() >= 1
        });
    }
    let metrics = query.metrics();
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
    assert_eq!(metrics.late_records(), late, "records dropped as late");
    if let Some(readers) = case.readers {
        let running = metrics
            .operators
            .iter()
            .filter(|o| o.operator == "in0")
            .count();
        assert_eq!(running, readers, "reader actors of the first topic");
    }
    let runs: Vec<Vec<Out>> = sinks
        .iter()
        .map(|sink| {
            sink.rows()
                .into_iter()
                .filter(|row| key(row) < SENTINEL)
                .collect()
        })
        .collect();
    assert!(
        runs.iter().all(|rows| !rows.is_empty()),
        "every run has results: the restart falls inside the output"
    );
    Some(runs.concat())
}

/// Asserts that `got` and `expected` hold the same rows as often, showing a
/// few of the differences otherwise.
fn assert_same_multiset<T: Ord + Clone + Debug>(what: &str, mut got: Vec<T>, mut expected: Vec<T>) {
    got.sort();
    expected.sort();
    if got == expected {
        return;
    }
    let mut extra = got.clone();
    for row in &expected {
        if let Ok(at) = extra.binary_search(row) {
            extra.remove(at);
        }
    }
    let mut missing = expected.clone();
    for row in &got {
        if let Ok(at) = missing.binary_search(row) {
            missing.remove(at);
        }
    }
    panic!(
        "{what}: {} rows, expected {}; {} unexpected, first {:?}; {} missing, first {:?}",
        got.len(),
        expected.len(),
        extra.len(),
        &extra[..extra.len().min(5)],
        missing.len(),
        &missing[..missing.len().min(5)],
    );
}

// ---- Windows. ----------------------------------------------------------------

/// The record count of every `(key, window)` of a batch run over `events`.
fn window_counts(spec: Spec, events: &[Event]) -> BTreeMap<(u32, Window), u64> {
    spec.windowing()
        .assign_batch(events.iter().copied())
        .into_iter()
        .map(|(window, ids)| (window, ids.len() as u64))
        .collect()
}

/// Runs a window count of `spec` per key and checks it against the reference:
/// for fixed windows every update `1..=n` of each window exactly once (nothing
/// lost, nothing counted twice, also across a restart); for sessions one update
/// per record, each within a final session of its key, and the last update of
/// every final session its count.
fn check_windows(case: Case, spec: Spec, seed: u64) {
    let input = events(seed, case.partitions[0], case.silent, 8, 0);
    let windowing = spec.windowing();
    let build =
        |inputs: &[Stream<Event>]| inputs[0].key_by(|e: &Event| e.0).window(windowing).count();
    let Some(rows) = run(&case, std::slice::from_ref(&input), build, |row| row.0) else {
        return;
    };
    let expected = window_counts(spec, &flatten(&[input]));
    if let Spec::Session { .. } = spec {
        let records: u64 = expected.values().sum();
        assert_eq!(rows.len() as u64, records, "one update per record");
        for (key, window, _) in &rows {
            assert!(
                expected
                    .keys()
                    .any(|(k, w)| k == key && w.start <= window.start && window.end <= w.end),
                "{window:?} of key {key} lies in no session"
            );
        }
        let mut last: BTreeMap<(u32, Window), u64> = BTreeMap::new();
        for (key, window, count) in rows {
            last.insert((key, window), count);
        }
        last.retain(|window, _| expected.contains_key(window));
        assert_eq!(last, expected, "the final count of every session");
    } else {
        let running = expected
            .iter()
            .flat_map(|((key, window), n)| (1..=*n).map(move |count| (*key, *window, count)));
        assert_same_multiset("window updates", rows, running.collect());
    }
}

#[test]
fn tumbling_window_counts_across_a_restart() {
    let case = Case {
        restart: true,
        ..Case::new("tumbling-restart", &[3])
    };
    check_windows(
        case,
        Spec::Sliding {
            size: 500,
            slide: 500,
        },
        1,
    );
}

/// Partition 3 shares its reader with partition 1: the reader's watermark
/// must wait for it per partition, then let it go after the idle timeout.
#[test]
fn tumbling_window_counts_with_two_readers_and_a_silent_partition() {
    let case = Case {
        readers: Some(2),
        silent: Some(3),
        late_probe: true,
        ..Case::new("tumbling-idle", &[4])
    };
    check_windows(
        case,
        Spec::Sliding {
            size: 500,
            slide: 500,
        },
        2,
    );
}

#[test]
fn sliding_window_counts_with_a_silent_partition() {
    let case = Case {
        silent: Some(2),
        late_probe: true,
        ..Case::new("sliding-idle", &[3])
    };
    check_windows(
        case,
        Spec::Sliding {
            size: 1_000,
            slide: 250,
        },
        3,
    );
}

#[test]
fn session_window_counts_with_two_readers_across_a_restart() {
    let case = Case {
        readers: Some(2),
        restart: true,
        ..Case::new("session", &[4])
    };
    check_windows(case, Spec::Session { gap: 100 }, 4);
}

// ---- Deduplication. ----------------------------------------------------------

/// How long after its first occurrence an id's duplicates are dropped (ms).
const KEEP: i64 = 2_000;

/// Like [`events`], but about half the records repeat the id of an earlier
/// record of their partition whose first occurrence is less than `KEEP`
/// before the clock, so they are duplicates the operator still remembers.
/// Returns the records and the first occurrence of each id.
fn duplicated(seed: u64, partitions: i32) -> (Partitions, Vec<Event>) {
    let mut rng = Rng(seed);
    let mut next_id = 0;
    let mut firsts = Vec::new();
    let input = (0..partitions)
        .map(|_| {
            let mut clock = 0;
            let mut recent: Vec<Event> = Vec::new();
            (0..PER_PARTITION)
                .map(|_| {
                    clock += rng.below(40) as i64;
                    let time = (clock - rng.below(DELAY as u64 + 1) as i64).max(0);
                    recent.retain(|e| clock - e.1 < KEEP);
                    if !recent.is_empty() && rng.below(2) == 0 {
                        let first = recent[rng.below(recent.len() as u64) as usize];
                        return (first.0, time, first.2);
                    }
                    next_id += 1;
                    let event = (rng.below(8) as u32, time, next_id);
                    recent.push(event);
                    firsts.push(event);
                    event
                })
                .collect()
        })
        .collect();
    (input, firsts)
}

/// Every id's duplicates come from its own partition, after it: exactly its
/// first occurrence goes through, also when it and its duplicates are on
/// either side of the restart.
#[test]
fn drop_duplicates_within_watermark_across_a_restart() {
    let case = Case {
        restart: true,
        ..Case::new("dedup-restart", &[3])
    };
    let (input, firsts) = duplicated(5, case.partitions[0]);
    let build = |inputs: &[Stream<Event>]| {
        inputs[0].drop_duplicates_within_watermark(|e: &Event| e.2, ms(KEEP))
    };
    let Some(rows) = run(&case, &[input], build, |e| e.0) else {
        return;
    };
    assert_same_multiset("first occurrences", rows, firsts);
}

// ---- Stream-stream joins. ------------------------------------------------------

/// Inner or left outer join of the two topics' events on key, a right event
/// from 100 ms before to 300 ms after the left one, against every such pair of
/// a batch run (and, outer, every left event without one).
fn check_join(case: Case, outer: bool, seed: u64) {
    let window = JoinWindow::between(ms(100), ms(300));
    let left = events(seed, case.partitions[0], None, 10, 0);
    let right = events(seed + 100, case.partitions[1], None, 10, 0);
    let build = |inputs: &[Stream<Event>]| {
        let key = |e: &Event| e.0;
        if outer {
            inputs[0].left_join(&inputs[1], key, key, window)
        } else {
            inputs[0]
                .join(&inputs[1], key, key, window)
                .map(|(l, r)| (l, Some(r)))
        }
    };
    let inputs = [left.clone(), right.clone()];
    let Some(rows) = run(&case, &inputs, build, |(l, _)| l.0) else {
        return;
    };
    let right = flatten(&[right]);
    let mut expected = Vec::new();
    for l in flatten(&[left]) {
        let matches: Vec<_> = right
            .iter()
            .filter(|r| r.0 == l.0 && window.contains(l.1, r.1))
            .map(|r| (l, Some(*r)))
            .collect();
        if outer && matches.is_empty() {
            expected.push((l, None));
        }
        expected.extend(matches);
    }
    assert_same_multiset("joined rows", rows, expected);
}

#[test]
fn inner_join_with_fewer_readers_than_partitions() {
    let case = Case {
        readers: Some(2),
        ..Case::new("inner-join", &[4, 3])
    };
    check_join(case, false, 6);
}

#[test]
fn left_outer_join_across_a_restart() {
    let case = Case {
        restart: true,
        ..Case::new("left-join-restart", &[3, 3])
    };
    check_join(case, true, 7);
}

// ---- Keyed process with event-time timers. -------------------------------------

/// The length of the event-time buckets that [`BucketCounts`] counts in (ms).
const BUCKET: i64 = 500;
const COUNTS: MapState<i64, u64> = MapState::new("counts");

/// Counts each key's records per bucket of event time, and emits
/// `(key, bucket end, count)` from an event-time timer at the bucket's end:
/// once the watermark passed the bucket, so once it holds all its records.
struct BucketCounts;

type Bucket = (u32, i64, u64);

impl KeyedProcessor<u32, Event, Bucket> for BucketCounts {
    fn init(&mut self, states: &mut StateDeclarations<'_, u32>) -> Result<()> {
        states.declare(&COUNTS)
    }

    fn handle_input(
        &mut self,
        _key: &u32,
        (_, time, _): Event,
        ctx: &mut ProcessContext<'_, '_, u32, Bucket>,
    ) -> Result<()> {
        let end = time - time.rem_euclid(BUCKET) + BUCKET;
        let mut counts = ctx.map(&COUNTS);
        let count = counts.get(&end).copied().unwrap_or(0) + 1;
        counts.insert(end, count);
        ctx.register_timer(Timer::EventTime(end));
        Ok(())
    }

    fn on_timer(
        &mut self,
        key: &u32,
        timer: Timer,
        ctx: &mut ProcessContext<'_, '_, u32, Bucket>,
    ) -> Result<()> {
        let end = timer.time();
        let count = ctx.map(&COUNTS).remove(&end).expect("a count per timer");
        ctx.emit((*key, end, count))
    }
}

/// Runs [`BucketCounts`] per key against the counts of a batch run: each
/// `(key, bucket)` exactly once, with its full count.
fn check_bucket_counts(case: Case, seed: u64) {
    let input = events(seed, case.partitions[0], case.silent, 8, 0);
    let build =
        |inputs: &[Stream<Event>]| inputs[0].key_by(|e: &Event| e.0).process(|| BucketCounts);
    let Some(rows) = run(&case, std::slice::from_ref(&input), build, |row| row.0) else {
        return;
    };
    let mut expected: BTreeMap<(u32, i64), u64> = BTreeMap::new();
    for (key, time, _) in flatten(&[input]) {
        *expected
            .entry((key, time - time.rem_euclid(BUCKET) + BUCKET))
            .or_default() += 1;
    }
    let expected = expected.into_iter().map(|((k, end), n)| (k, end, n));
    assert_same_multiset("bucket counts", rows, expected.collect());
}

/// Timers fire before the stop (the first half moves the watermark) and after
/// the restart, counts and timers pending in the checkpoint in between.
#[test]
fn event_time_timers_with_two_readers_across_a_restart() {
    let case = Case {
        readers: Some(2),
        restart: true,
        ..Case::new("process-restart", &[4])
    };
    check_bucket_counts(case, 8);
}

/// No timer could fire while the silent partition held the watermark back.
#[test]
fn event_time_timers_with_a_silent_partition() {
    let case = Case {
        silent: Some(1),
        ..Case::new("process-idle", &[3])
    };
    check_bucket_counts(case, 9);
}

// ---- Event time per topic partition. -------------------------------------------

/// One reader reads all three partitions; partition 2 lags far behind the
/// other two and holds the query's watermark back until it catches up, as a
/// reader per partition would. Each watermark is read after a checkpoint,
/// whose barrier follows the watermark of every record read before it to
/// the sink, so it is the watermark those records allow, exactly.
#[test]
fn one_reader_of_three_partitions_tracks_event_time_per_partition() {
    let Some(bootstrap) = bootstrap() else { return };
    let config = Case::new("per-partition", &[3]).config();
    let resources = Resources {
        topics: vec![topic(&bootstrap, "rtflow-stateful-per-partition", 3)],
        location: config.checkpoint_location.clone().unwrap(),
        bootstrap,
    };
    let flow = Dataflow::new("per-partition");
    let out = MemorySink::new();
    flow.source(
        KafkaSource::new(&resources.bootstrap)
            .subscribe([&resources.topics[0]])
            .starting_offsets(StartingOffsets::Earliest)
            .max_partitions(1),
    )
    .name("in0")
    .map(parse)
    .with_watermark(time, Duration::ZERO)
    .key_by(|e: &Event| e.0)
    .map(|e| e.2)
    .sink(out.clone());
    let query = flow.start(config).unwrap();
    let mut sent = 0;
    let mut watermark_after = |records: &[(i32, i64)]| {
        let records: Vec<_> = records
            .iter()
            .map(|(p, time)| {
                sent += 1;
                (0, *p, (*p as u32, *time, sent))
            })
            .collect();
        send(&resources.bootstrap, &resources.topics, &records);
        wait_until("every record reaches the sink", || {
            out.len() >= sent as usize
        });
        query.checkpoint_now(WAIT).expect("a checkpoint");
        query.metrics().watermark()
    };

    let ahead = [(0, 1_000), (0, 3_000), (0, 5_000), (1, 2_000), (1, 6_000)];
    assert_eq!(
        watermark_after(&ahead),
        None,
        "partition 2 delivered nothing yet"
    );
    assert_eq!(
        watermark_after(&[(2, 100)]),
        Some(100),
        "partition 2 at 100"
    );
    assert_eq!(
        watermark_after(&[(2, 3_000)]),
        Some(3_000),
        "partition 2 at 3000"
    );
    assert_eq!(
        watermark_after(&[(2, 9_000)]),
        Some(5_000),
        "partition 2 passed partition 0, which now holds it at 5000"
    );
    let readers = query
        .metrics()
        .operators
        .iter()
        .filter(|o| o.operator == "in0")
        .count();
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
    assert_eq!(readers, 1);
}
