//! Windowed aggregations after `key_by`: tumbling, sliding and session windows,
//! one update per record and window, late records dropped and counted, window
//! state evicted by the watermark and restored exactly across restarts; and a
//! property test against a batch reference on random inputs, partitionings and
//! arrival orders; with the `testing` feature, tumbling counts against the same
//! reference across random checkpoints, crashes and restores.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{config, Spec, TIMEOUT};
use proptest::prelude::*;
use rtflow::checkpoint::{CheckpointStore, StateId};
use rtflow::operators::Windowing;
use rtflow::prelude::*;

/// `(key, event time in ms, value)`.
type Event = (u8, i64, i64);

fn key(event: &Event) -> u8 {
    event.0
}

fn time(event: &Event) -> i64 {
    event.1
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn window(start: i64, end: i64) -> Window {
    Window { start, end }
}

/// Epochs end every 100 ms; one instance per operator unless set, so that the
/// updates of different keys arrive in order.
fn checkpointed(name: &str) -> QueryConfig {
    config(name)
        .default_parallelism(1)
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(ms(100))
        .progress_interval(Duration::from_secs(60))
}

/// The last value emitted per `(key, window)`: its final aggregate.
fn latest<O: Clone>(rows: &[(u8, Window, O)]) -> BTreeMap<(u8, Window), O> {
    rows.iter()
        .map(|(key, window, value)| ((*key, *window), value.clone()))
        .collect()
}

/// Waits until the query's watermark reached `at_least`.
fn wait_for_watermark(query: &StreamingQuery, at_least: i64) {
    let deadline = Instant::now() + TIMEOUT;
    while query.metrics().watermark().is_none_or(|w| w < at_least) {
        assert!(
            Instant::now() < deadline,
            "watermark stuck at {:?}",
            query.metrics().watermark()
        );
        std::thread::sleep(ms(5));
    }
}

/// The values of a window's records, sorted: a user aggregate that shows exactly
/// which records each window took (and exercises `merge` for sessions).
struct Collect;

impl AggregateFunction<Event> for Collect {
    type Acc = Vec<i64>;
    type Out = Vec<i64>;

    fn create(&self) -> Vec<i64> {
        Vec::new()
    }
    fn add(&self, values: &mut Vec<i64>, event: &Event) {
        let at = values.partition_point(|v| *v < event.2);
        values.insert(at, event.2);
    }
    fn merge(&self, values: &mut Vec<i64>, other: Vec<i64>) {
        values.extend(other);
        values.sort_unstable();
    }
    fn result(&self, values: &Vec<i64>) -> Vec<i64> {
        values.clone()
    }
}

#[test]
fn every_record_emits_the_updated_aggregate_of_each_of_its_windows() {
    let flow = Dataflow::new("windows");
    let input = MemorySource::new(1);
    input
        .push_all(0, [(1, 100, 5), (1, 1_100, 7), (2, 900, 1), (1, 1_900, -2)])
        .unwrap();
    input.end();
    let keyed = flow
        .source(input)
        .with_watermark(time, Duration::from_secs(5))
        .key_by(key);
    let tumbling = keyed.window(Window::tumbling(ms(1_000)));
    let (count, sum, min, max, avg) = (
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
    );
    tumbling.count().sink(count.clone());
    tumbling.sum(|e| e.2).sink(sum.clone());
    tumbling.min(|e| e.2).sink(min.clone());
    tumbling.max(|e| e.2).sink(max.clone());
    tumbling.avg(|e| e.2 as f64).sink(avg.clone());
    let sliding = MemorySink::new();
    keyed
        .window(Window::sliding(ms(1_000), ms(500)))
        .aggregate(Collect)
        .sink(sliding.clone());
    let sessions = MemorySink::new();
    keyed
        .window(Window::session(ms(1_000)))
        .count()
        .sink(sessions.clone());
    common::run_to_end(flow, checkpointed("windows"));

    let (first, second) = (window(0, 1_000), window(1_000, 2_000));
    assert_eq!(
        count.rows(),
        [(1, first, 1), (1, second, 1), (2, first, 1), (1, second, 2)],
        "one update per record, in order"
    );
    assert_eq!(
        latest(&sum.rows()),
        BTreeMap::from([((1, first), 5), ((1, second), 5), ((2, first), 1)])
    );
    assert_eq!(latest(&min.rows())[&(1, second)], -2);
    assert_eq!(latest(&max.rows())[&(1, second)], 7);
    assert_eq!(latest(&avg.rows())[&(1, second)], 2.5);
    assert_eq!(
        sliding.rows(),
        [
            (1, window(-500, 500), vec![5]),
            (1, window(0, 1_000), vec![5]),
            (1, window(500, 1_500), vec![7]),
            (1, window(1_000, 2_000), vec![7]),
            (2, window(0, 1_000), vec![1]),
            (2, window(500, 1_500), vec![1]),
            (1, window(1_000, 2_000), vec![-2, 7]),
            (1, window(1_500, 2_500), vec![-2]),
        ],
        "each record updates every sliding window it is in, earliest first"
    );
    assert_eq!(
        sessions.rows(),
        [
            (1, window(100, 1_100), 1),
            (1, window(1_100, 2_100), 1),
            (2, window(900, 1_900), 1),
            (1, window(1_100, 2_900), 2),
        ],
        "records 1 s apart start a new session; closer ones extend it"
    );
}

#[test]
fn a_record_bridging_two_sessions_merges_them() {
    let flow = Dataflow::new("sessions");
    let input = MemorySource::new(1);
    input
        .push_all(0, [(1, 0, 1), (1, 300, 2), (1, 150, 3), (1, 1_000, 4)])
        .unwrap();
    input.end();
    let out = MemorySink::new();
    flow.source(input)
        .with_watermark(time, ms(500))
        .key_by(key)
        .window(Window::session(ms(200)))
        .aggregate(Collect)
        .sink(out.clone());
    common::run_to_end(flow, checkpointed("sessions"));
    assert_eq!(
        out.rows(),
        [
            (1, window(0, 200), vec![1]),
            (1, window(300, 500), vec![2]),
            (1, window(0, 500), vec![1, 2, 3]),
            (1, window(1_000, 1_200), vec![4]),
        ]
    );
}

/// Starts source -> watermark (no delay) -> key_by -> `windowing` collect -> sink.
fn collect_query(
    input: &MemorySource<Event>,
    windowing: Windowing,
    config: QueryConfig,
) -> (StreamingQuery, MemorySink<(u8, Window, Vec<i64>)>) {
    let flow = Dataflow::new("late");
    let out = MemorySink::new();
    flow.source(input.clone())
        .with_watermark(time, Duration::ZERO)
        .key_by(key)
        .window(windowing)
        .aggregate(Collect)
        .sink(out.clone());
    (flow.start(config).unwrap(), out)
}

#[test]
fn records_whose_windows_closed_are_dropped_and_counted() {
    // Tumbling: late once the watermark reached the end of the record's window.
    let input = MemorySource::new(1);
    let (query, out) = collect_query(
        &input,
        Window::tumbling(ms(1_000)),
        checkpointed("tumbling"),
    );
    input.push_all(0, [(1, 100, 1), (1, 1_000, 2)]).unwrap();
    wait_for_watermark(&query, 1_000);
    input
        .push_all(0, [(1, 999, 3), (1, 1_001, 4), (2, 1_000, 5)])
        .unwrap();
    assert!(out.wait_for(4, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(query.metrics().late_records(), 1);
    assert_eq!(
        out.rows(),
        [
            (1, window(0, 1_000), vec![1]),
            (1, window(1_000, 2_000), vec![2]),
            (1, window(1_000, 2_000), vec![2, 4]),
            (2, window(1_000, 2_000), vec![5]),
        ]
    );

    // Sliding: a record updates its windows that are still open, and is late
    // only when all of them closed.
    let input = MemorySource::new(1);
    let (query, out) = collect_query(
        &input,
        Window::sliding(ms(1_000), ms(500)),
        checkpointed("sliding"),
    );
    input.push_all(0, [(1, 1_000, 1)]).unwrap();
    wait_for_watermark(&query, 1_000);
    input.push_all(0, [(1, 700, 2), (1, 400, 3)]).unwrap();
    assert!(out.wait_for(3, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(
        query.metrics().late_records(),
        1,
        "400 is in [-500, 500) and [0, 1000)"
    );
    assert_eq!(
        out.rows(),
        [
            (1, window(500, 1_500), vec![1]),
            (1, window(1_000, 2_000), vec![1]),
            (1, window(500, 1_500), vec![1, 2]),
        ],
        "700 left [0, 1000), which had closed"
    );

    // Sessions: late when behind the watermark, as it might belong to a session
    // that closed.
    let input = MemorySource::new(1);
    let (query, out) = collect_query(&input, Window::session(ms(300)), checkpointed("session"));
    input.push_all(0, [(1, 500, 1), (1, 1_000, 2)]).unwrap();
    wait_for_watermark(&query, 1_000);
    input.push_all(0, [(1, 999, 3), (1, 1_100, 4)]).unwrap();
    assert!(out.wait_for(3, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(query.metrics().late_records(), 1);
    assert_eq!(
        out.rows(),
        [
            (1, window(500, 800), vec![1]),
            (1, window(1_000, 1_300), vec![2]),
            (1, window(1_000, 1_400), vec![2, 4]),
        ]
    );
}

#[test]
fn open_windows_and_the_watermark_are_restored_exactly() {
    let input = MemorySource::new(2);
    let config = checkpointed("restore");
    let tumbling = Window::tumbling(ms(1_000));
    let (query, out) = collect_query(&input, tumbling, config.clone());
    input.push_all(0, [(1, 100, 1), (1, 1_200, 2)]).unwrap();
    input.push_all(1, [(1, 1_500, 3)]).unwrap();
    wait_for_watermark(&query, 1_200);
    assert!(out.wait_for(3, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    // Partition 1 is behind, so the restarted source's watermark stays at the
    // restored 1_200 until it moves: the window operator must still know [0, 1000)
    // closed, and [1000, 2000) must hold both records.
    let (query, out) = collect_query(&input, tumbling, config);
    input.push_all(1, [(1, 200, 4), (1, 1_700, 5)]).unwrap();
    assert!(out.wait_for(1, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(query.metrics().late_records(), 1);
    assert_eq!(
        out.rows(),
        [(1, window(1_000, 2_000), vec![2, 3, 5])],
        "nothing replayed, nothing lost"
    );
}

// ---- The property: committed results equal a batch reference. -------------

/// The watermark delay of the property's dataflows.
const DELAY: i64 = 40;
/// The key of the last record of every partition, at the same, latest time: it
/// moves every source partition's watermark past every other window.
const SENTINEL: u8 = 99;

/// Times, sizes, slides and gaps are multiples of 5 ms, so records often fall on
/// window boundaries and exactly one gap apart.
fn spec_strategy() -> impl Strategy<Value = Spec> {
    prop_oneof![
        (2i64..16).prop_map(|size| Spec::Sliding {
            size: size * 5,
            slide: size * 5,
        }),
        (2i64..16, 1i64..16).prop_map(|(size, slide)| Spec::Sliding {
            size: size * 5,
            slide: slide.min(size) * 5,
        }),
        (1i64..12).prop_map(|gap| Spec::Session { gap: gap * 5 }),
    ]
}

/// Per partition, records that are never late: each is at most `DELAY` behind
/// the greatest event time its partition delivered before it, and the watermark
/// can never be ahead of that minus `DELAY`.
fn partitions_strategy() -> impl Strategy<Value = Vec<Vec<Event>>> {
    prop::collection::vec(
        prop::collection::vec((0u8..4, -DELAY / 5..6, -50i64..50), 0..40),
        1..=3,
    )
    .prop_map(|partitions| {
        partitions
            .into_iter()
            .map(|steps| {
                let mut max = 0;
                steps
                    .into_iter()
                    .map(|(key, step, value)| {
                        let time = (max + step * 5).max(0);
                        max = max.max(time);
                        (key, time, value)
                    })
                    .collect()
            })
            .collect()
    })
}

/// Every window of a batch run over `events`, with the values of its records.
fn reference(spec: Spec, events: &[Event]) -> BTreeMap<(u8, Window), Vec<i64>> {
    let mut windows = spec.windowing().assign_batch(events.iter().copied());
    for values in windows.values_mut() {
        values.sort_unstable();
    }
    windows
}

/// Runs the dataflow on `partitions` (plus a sentinel each) pushed in
/// `interleaving`, and checks its results and final state against the reference.
fn check_windows(
    spec: Spec,
    mut partitions: Vec<Vec<Event>>,
    interleaving: Vec<usize>,
    source_parallelism: usize,
    parallelism: usize,
) -> std::result::Result<(), TestCaseError> {
    let last = partitions.iter().flatten().map(time).max().unwrap_or(0);
    let end = last + 200 + DELAY;
    for records in &mut partitions {
        records.push((SENTINEL, end, 0));
    }
    let all: Vec<Event> = partitions.iter().flatten().copied().collect();
    let expected = reference(spec, &all);

    let input = MemorySource::new(partitions.len());
    let flow = Dataflow::new("windows-property");
    let keyed = flow
        .source(input.clone())
        .parallelism(source_parallelism.min(partitions.len()))
        .with_watermark(time, ms(DELAY as u64))
        .key_by(key);
    let windowed = keyed.window(spec.windowing());
    let (collected, counts, sums) = (MemorySink::new(), MemorySink::new(), MemorySink::new());
    windowed
        .aggregate(Collect)
        .parallelism(parallelism)
        .sink(collected.clone());
    windowed
        .count()
        .parallelism(parallelism)
        .sink(counts.clone());
    windowed
        .sum(|e| e.2)
        .parallelism(parallelism)
        .sink(sums.clone());
    let config = checkpointed("windows-property");
    let location = config.checkpoint_location.clone().unwrap();
    let query = flow.start(config).unwrap();

    // Push in the generated order across partitions (each partition's own order
    // kept), the query running meanwhile.
    let mut next = vec![0; partitions.len()];
    let order = interleaving
        .into_iter()
        .map(|i| i % partitions.len())
        .chain((0..partitions.len()).flat_map(|p| std::iter::repeat_n(p, partitions[p].len())));
    for partition in order {
        if let Some(event) = partitions[partition].get(next[partition]) {
            input.push(partition, *event).unwrap();
            next[partition] += 1;
        }
    }
    input.end();
    prop_assert_eq!(query.await_termination(Some(TIMEOUT)), Ok(true));
    prop_assert_eq!(query.metrics().late_records(), 0);
    drop(query);

    // Every window got every record of it, and one update per record and window.
    let updates: usize = expected.values().map(Vec::len).sum();
    let rows = collected.rows();
    let sessions = matches!(spec, Spec::Session { .. });
    if sessions {
        // A session's earlier updates may name a shorter window that later merged:
        // each lies within one final session of its key.
        prop_assert_eq!(rows.len(), all.len());
        for (key, window, _) in &rows {
            prop_assert!(
                expected
                    .keys()
                    .any(|(k, w)| k == key && w.start <= window.start && window.end <= w.end),
                "{:?} of key {} is in no session",
                window,
                key
            );
        }
    } else {
        prop_assert_eq!(rows.len(), updates);
    }
    let mut got = latest(&rows);
    if sessions {
        got.retain(|window, _| expected.contains_key(window));
    }
    prop_assert_eq!(&got, &expected);
    let mut counts = latest(&counts.rows());
    let mut sums = latest(&sums.rows());
    if sessions {
        counts.retain(|window, _| expected.contains_key(window));
        sums.retain(|window, _| expected.contains_key(window));
    }
    let expected_counts: BTreeMap<_, _> = expected
        .iter()
        .map(|(window, values)| (*window, values.len() as u64))
        .collect();
    let expected_sums: BTreeMap<_, _> = expected
        .iter()
        .map(|(window, values)| (*window, values.iter().sum::<i64>()))
        .collect();
    prop_assert_eq!(counts, expected_counts);
    prop_assert_eq!(sums, expected_sums);

    // State is bounded by the watermark: the final checkpoint holds only the keys
    // with a window the final watermark (the sentinels' time minus the delay) has
    // not closed, which is the sentinel's alone.
    let watermark = end - DELAY;
    let open: BTreeSet<u8> = expected
        .keys()
        .filter(|(_, window)| window.end > watermark)
        .map(|(key, _)| *key)
        .collect();
    prop_assert_eq!(&open, &BTreeSet::from([SENTINEL]));
    let recovery = CheckpointStore::open(&location, 3)
        .unwrap()
        .recover()
        .unwrap();
    for kind in ["window_aggregate", "window_count", "window_sum"] {
        let state = &recovery.state[&StateId::new(format!("{kind}-0"), "windows")];
        prop_assert_eq!(state.entries().len(), open.len(), "{} keys held", kind);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn windowed_aggregates_equal_a_batch_reference(
        spec in spec_strategy(),
        partitions in partitions_strategy(),
        interleaving in prop::collection::vec(0usize..3, 0..120),
        source_parallelism in 1usize..=3,
        parallelism in 1usize..=3,
    ) {
        check_windows(spec, partitions, interleaving, source_parallelism, parallelism)?;
    }
}

// ---- The same on the testing harness, across crashes. ----------------------

/// Tumbling-window counts per key through `rtflow::testing::DataflowHarness`,
/// with checkpoints, crashes and restores at random points: the committed
/// updates of every `(key, window)` are its running count `1..=n` once each,
/// `n` the window's records in a batch run, and the checkpointed window state
/// holds, at every crash, exactly the counts of the input its offsets cover.
#[cfg(feature = "testing")]
mod across_crashes {
    use super::*;
    use rtflow::testing::{check, reference as batch, DataflowHarness, Step};

    /// What happens between pushes: the next record of a partition (modulo the
    /// partition count) is pushed, or the sources catch up, or an epoch ends, or
    /// the query crashes and restarts.
    #[derive(Debug, Clone, Copy)]
    enum Act {
        Push(usize),
        Settle,
        Checkpoint,
        Crash,
    }

    /// A case: window size (ms), count parallelism, whether epochs also end on
    /// a 40 ms timer, the records of each partition (never late) and the acts
    /// that interleave them.
    #[derive(Debug, Clone)]
    struct Case {
        size: i64,
        parallelism: usize,
        timer: bool,
        partitions: Vec<Vec<Event>>,
        acts: Vec<Act>,
    }

    fn cases() -> impl Strategy<Value = Case> {
        let act = prop_oneof![
            12 => (0usize..3).prop_map(Act::Push),
            2 => Just(Act::Settle),
            2 => Just(Act::Checkpoint),
            2 => Just(Act::Crash),
        ];
        (
            2i64..16,
            1usize..=3,
            any::<bool>(),
            partitions_strategy(),
            prop::collection::vec(act, 0..60),
        )
            .prop_map(|(size, parallelism, timer, partitions, acts)| Case {
                size: size * 5,
                parallelism,
                timer,
                partitions,
                acts,
            })
    }

    impl Case {
        /// Every partition's records with a sentinel at the end that moves the
        /// watermark past every other window.
        fn records(&self) -> Vec<Vec<Event>> {
            let last = self.partitions.iter().flatten().map(time).max();
            let end = last.unwrap_or(0) + 4 * self.size + DELAY;
            let mut records = self.partitions.clone();
            for partition in &mut records {
                partition.push((SENTINEL, end, 0));
            }
            records
        }

        /// The acts as harness steps, each partition's records in its order;
        /// what the acts did not push is pushed at the end.
        fn steps(&self) -> Vec<Step<Event>> {
            let records = self.records();
            let push = |partition: usize, event: Event| Step::Push {
                partition,
                value: event,
                event_time: Some(event.1),
            };
            let mut next = vec![0; records.len()];
            let mut steps = Vec::new();
            for act in &self.acts {
                steps.push(match *act {
                    Act::Push(p) => {
                        let p = p % records.len();
                        // The sentinels go last, once everything else is in.
                        match records[p].get(next[p]).filter(|e| e.0 != SENTINEL) {
                            Some(event) => {
                                next[p] += 1;
                                push(p, *event)
                            }
                            None => continue,
                        }
                    }
                    Act::Settle => Step::Settle,
                    Act::Checkpoint => Step::Checkpoint,
                    Act::Crash => Step::Crash,
                });
            }
            for (p, partition) in records.iter().enumerate() {
                steps.extend(partition[next[p]..].iter().map(|event| push(p, *event)));
            }
            steps
        }
    }

    /// The record count of every `(key, window)` of a batch run over `events`.
    fn counts(size: i64, events: &[Event]) -> BTreeMap<(u8, Window), u64> {
        reference(Spec::Sliding { size, slide: size }, events)
            .into_iter()
            .map(|(window, values)| (window, values.len() as u64))
            .collect()
    }

    #[test]
    fn tumbling_counts_are_exactly_once_across_crashes() {
        check("tumbling counts across crashes", 16, cases(), |case| {
            let (size, parallelism) = (case.size, case.parallelism);
            let harness =
                DataflowHarness::new("windows", case.partitions.len(), move |_, input| {
                    input
                        .with_watermark(time, ms(DELAY as u64))
                        .key_by(key)
                        .window(Window::tumbling(ms(size as u64)))
                        .count()
                        .parallelism(parallelism)
                });
            let mut harness = if case.timer {
                harness.checkpoint_every(ms(40))
            } else {
                harness
            };
            harness.start()?;
            for step in case.steps() {
                if step != Step::Crash {
                    harness.apply(&step)?;
                    continue;
                }
                harness.crash()?;
                // Every window the checkpoint holds has the count of the input
                // its offsets cover: nothing counted twice, nothing lost.
                let covered = counts(size, &harness.committed_input()?.concat());
                let state = harness.state::<u8, Vec<(Window, u64)>>("window_count-0", "windows")?;
                for (key, windows) in state {
                    for (window, count) in windows {
                        prop_assert_eq!(
                            Some(&count),
                            covered.get(&(key, window)),
                            "checkpointed count of ({}, {:?})",
                            key,
                            window
                        );
                    }
                }
                harness.start()?;
            }
            harness.finish()?;

            let input = harness.input_values();
            let expected = counts(size, &input);
            prop_assert_eq!(harness.metrics().expect("ended").late_records(), 0);
            // Each window's updates 1, 2, ..., n, committed once each.
            let updates: Vec<((u8, Window), u64)> = harness
                .committed()
                .into_iter()
                .map(|(key, window, count)| ((key, window), count))
                .collect();
            let running = expected
                .iter()
                .flat_map(|(window, n)| (1..=*n).map(move |count| (*window, count)));
            batch::assert_same_multiset(updates.clone(), running)?;
            prop_assert_eq!(batch::latest(updates), expected.clone());
            // No window was updated after the watermark at the sink passed it.
            for ((key, window, count), watermark) in harness.committed_with_watermarks() {
                prop_assert!(
                    watermark.is_none_or(|w| window.end > w),
                    "({}, {:?}, {}) behind watermark {:?}",
                    key,
                    window,
                    count,
                    watermark
                );
            }
            // The final checkpoint holds only the sentinels' window.
            let state = harness.state::<u8, Vec<(Window, u64)>>("window_count-0", "windows")?;
            let sentinel = expected
                .iter()
                .filter(|((key, _), _)| *key == SENTINEL)
                .map(|((_, window), n)| (*window, *n))
                .collect::<Vec<_>>();
            prop_assert_eq!(state, BTreeMap::from([(SENTINEL, sentinel)]));
            Ok(())
        });
    }

    /// How many of 1,000 keys whose window [0, 10 s) a watermark at 20 s
    /// closed, followed by `records_after` records of one other key, still
    /// hold it in the next checkpoint; and whether that other key's open
    /// window is held.
    fn closed_windows_held(records_after: i64) -> (usize, bool) {
        const OTHER: u16 = u16::MAX;
        let mut harness =
            DataflowHarness::new("evict-slices", 1, |_, input: Stream<(u16, i64)>| {
                input
                    .with_watermark(|(_, time)| *time, Duration::ZERO)
                    .key_by(|(key, _)| *key)
                    .window(Window::tumbling(ms(10_000)))
                    .count()
                    .map(|(key, _, count)| (key, count))
            })
            .configure(|config| config.default_parallelism(1));
        harness.start().unwrap();
        for key in 0..1_000 {
            harness.push_at(0, (key, 1_000), 1_000).unwrap();
        }
        // The watermark follows the source's batch: once the source has read
        // the record that moves it, every later record comes after it.
        harness.push_at(0, (OTHER, 20_000), 20_000).unwrap();
        harness.settle().unwrap();
        for time in 20_001..=20_000 + records_after {
            harness.push_at(0, (OTHER, time), time).unwrap();
        }
        harness.settle().unwrap();
        harness.checkpoint().unwrap();
        harness.crash().unwrap();
        let windows: BTreeMap<u16, Vec<(Window, u64)>> =
            harness.state("window_count-0", "windows").unwrap();
        let closed = windows.keys().filter(|key| **key != OTHER).count();
        (closed, windows.contains_key(&OTHER))
    }

    /// A watermark that closes the windows of many keys evicts a slice of them
    /// at once and the rest over the records after it: the records behind it
    /// wait for a slice, not for all of them.
    #[test]
    fn a_watermark_closing_many_windows_evicts_them_over_the_records_after_it() {
        let (closed, open) = closed_windows_held(0);
        assert!(
            (900..1_000).contains(&closed),
            "closed windows held after the watermark: {closed} of 1000"
        );
        assert!(open, "the open window is held");
        // 600 records after it evict two keys each.
        let (closed, open) = closed_windows_held(600);
        assert_eq!(closed, 0, "closed windows held after 600 more records");
        assert!(open, "the open window is held");
    }
}
