//! Stream-stream joins (inner, left, right and full outer) against a batch
//! reference, on random inputs, partitionings, parallelisms, join windows,
//! arrival orders, checkpoints and crashes (`rtflow::testing`), and the
//! checkpointed rows compared with those the watermark must still hold.
//! `PROPTEST_CASES=n` runs more cases.
//!
//! As in `tests/dedup.rs`, inputs come in rounds of event time so that no row
//! is ever late: round `r` holds times in `[r * SPAN, (r + 1) * SPAN)`, both
//! sides declare a watermark delay of `SPAN`, and each round ends with a tick at
//! its last millisecond in every partition of both sides (ticks have keys of
//! their own, so they match nothing).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rtflow::prelude::*;
use rtflow::testing::{check, reference, DataflowHarness, Step};

const SPAN: i64 = 100;
const LEFT_TICK: u8 = 250;
const RIGHT_TICK: u8 = 251;

/// `(key, event time, tag)`.
type Row = (u8, i64, u8);
type Out = (Option<Row>, Option<Row>);
/// The join's state as checkpointed: per key, the buffered left rows (time,
/// row, whether it matched) and right rows (time, row).
type Buffered = BTreeMap<u8, (Vec<(i64, Row, bool)>, Vec<(i64, Row)>)>;
/// A full outer join's: its right rows also carry whether they matched.
type FullBuffered = BTreeMap<u8, (Vec<(i64, Row, bool)>, Vec<(i64, Row, bool)>)>;

#[derive(Debug, Clone)]
enum Act {
    /// A row of the round at `round * SPAN + offset`.
    Left {
        partition: usize,
        key: u8,
        offset: i64,
        tag: u8,
    },
    Right {
        partition: usize,
        key: u8,
        offset: i64,
        tag: u8,
    },
    Settle,
    Checkpoint,
    Crash,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Join {
    Inner,
    Left,
    Right,
    Full,
}

#[derive(Debug, Clone)]
struct Case {
    left_partitions: usize,
    right_partitions: usize,
    parallelism: usize,
    join: Join,
    timer: bool,
    /// Before and after the left row, in ms.
    window: (i64, i64),
    rounds: Vec<Vec<Act>>,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1..=2usize,
        1..=2usize,
        1..=3usize,
        prop_oneof![
            Just(Join::Inner),
            Just(Join::Left),
            Just(Join::Right),
            Just(Join::Full)
        ],
        any::<bool>(),
        (0..=SPAN, 0..=SPAN),
    )
        .prop_flat_map(|(lp, rp, parallelism, join, timer, window)| {
            let act = prop_oneof![
                8 => (0..lp, 0..4u8, 0..SPAN, 0..4u8)
                    .prop_map(|(partition, key, offset, tag)| Act::Left { partition, key, offset, tag }),
                8 => (0..rp, 0..4u8, 0..SPAN, 0..4u8)
                    .prop_map(|(partition, key, offset, tag)| Act::Right { partition, key, offset, tag }),
                1 => Just(Act::Settle),
                1 => Just(Act::Checkpoint),
                1 => Just(Act::Crash),
            ];
            prop::collection::vec(prop::collection::vec(act, 0..16), 0..6).prop_map(
                move |rounds| Case {
                    left_partitions: lp,
                    right_partitions: rp,
                    parallelism,
                    join,
                    timer,
                    window,
                    rounds,
                },
            )
        })
}

fn fail(error: RtflowError) -> TestCaseError {
    TestCaseError::fail(error.to_string())
}

/// What a run pushed to each side, and its committed output and state.
struct Outcome {
    left: Vec<Row>,
    right: Vec<Row>,
    committed: Vec<Out>,
    state: State,
}

/// The state of the join that ran.
enum State {
    Rows(Buffered),
    Full(FullBuffered),
}

impl Case {
    fn window(&self) -> JoinWindow {
        let ms = |ms: i64| Duration::from_millis(ms as u64);
        JoinWindow::between(ms(self.window.0), ms(self.window.1))
    }

    fn run(&self) -> Result<Outcome, TestCaseError> {
        let right_input = MemorySource::<Row>::new(self.right_partitions);
        let (window, join, parallelism) = (self.window(), self.join, self.parallelism);
        let right = right_input.clone();
        let delay = Duration::from_millis(SPAN as u64);
        let harness = DataflowHarness::new(
            "stream-join",
            self.left_partitions,
            move |flow, left: Stream<Row>| {
                let left = left.with_watermark(|row: &Row| row.1, delay);
                let right = flow
                    .source(right.clone())
                    .with_watermark(|row: &Row| row.1, delay);
                let key = |row: &Row| row.0;
                match join {
                    Join::Inner => left
                        .join(&right, key, key, window)
                        .parallelism(parallelism)
                        .map(|(l, r)| (Some(l), Some(r))),
                    Join::Left => left
                        .left_join(&right, key, key, window)
                        .parallelism(parallelism)
                        .map(|(l, r)| (Some(l), r)),
                    Join::Right => left
                        .right_join(&right, key, key, window)
                        .parallelism(parallelism)
                        .map(|(l, r)| (l, Some(r))),
                    Join::Full => left
                        .full_join(&right, key, key, window)
                        .parallelism(parallelism),
                }
            },
        );
        let mut harness = if self.timer {
            harness.checkpoint_every(Duration::from_millis(40))
        } else {
            harness
        };
        let mut pushed_right = Vec::new();
        // A last round of ticks only, so the final watermark is known.
        let last = Vec::new();
        let rounds = self.rounds.iter().chain([&last]);
        harness.start().map_err(fail)?;
        for (round, acts) in rounds.enumerate() {
            let base = round as i64 * SPAN;
            for act in acts {
                match *act {
                    Act::Left {
                        partition,
                        key,
                        offset,
                        tag,
                    } => {
                        let row = (key, base + offset, tag);
                        harness.push_at(partition, row, row.1).map_err(fail)?;
                    }
                    Act::Right {
                        partition,
                        key,
                        offset,
                        tag,
                    } => {
                        let row = (key, base + offset, tag);
                        right_input.push_at(partition, row, row.1).map_err(fail)?;
                        pushed_right.push(row);
                    }
                    Act::Settle => harness.apply(&Step::Settle).map_err(fail)?,
                    Act::Checkpoint => harness.apply(&Step::Checkpoint).map_err(fail)?,
                    Act::Crash => harness.apply(&Step::Crash).map_err(fail)?,
                }
            }
            let tick = base + SPAN - 1;
            for partition in 0..self.left_partitions {
                let row = (LEFT_TICK, tick, 0);
                harness.push_at(partition, row, tick).map_err(fail)?;
            }
            for partition in 0..self.right_partitions {
                let row = (RIGHT_TICK, tick, 0);
                right_input.push_at(partition, row, tick).map_err(fail)?;
                pushed_right.push(row);
            }
        }
        right_input.end();
        harness.finish().map_err(fail)?;
        let uid = match self.join {
            Join::Inner => "stream_join-0",
            Join::Left => "stream_left_join-0",
            Join::Right => "stream_right_join-0",
            Join::Full => "stream_full_join-0",
        };
        let state = match self.join {
            Join::Full => State::Full(harness.state(uid, "rows").map_err(fail)?),
            _ => State::Rows(harness.state(uid, "rows").map_err(fail)?),
        };
        Ok(Outcome {
            left: harness.input_values(),
            right: pushed_right,
            committed: harness.committed(),
            state,
        })
    }

    /// The watermark once the last round's ticks are read.
    fn final_watermark(&self) -> i64 {
        self.rounds.len() as i64 * SPAN - 1
    }
}

#[test]
fn joins_equal_the_batch_reference_and_state_holds_only_rows_that_can_still_match() {
    check("stream join", 12, cases(), |case| {
        let outcome = case.run()?;
        let window = case.window();
        let watermark = case.final_watermark();
        let matches = |l: &Row, r: &Row| l.0 == r.0 && window.contains(l.1, r.1);

        // Every pair in range, once; with an outer join also each row of a
        // preserved side that matched nothing and whose range the watermark
        // passed.
        let keeps_left = matches!(case.join, Join::Left | Join::Full);
        let keeps_right = matches!(case.join, Join::Right | Join::Full);
        let mut expected: Vec<Out> = Vec::new();
        for l in &outcome.left {
            let mut matched = false;
            for r in outcome.right.iter().filter(|r| matches(l, r)) {
                matched = true;
                expected.push((Some(*l), Some(*r)));
            }
            if keeps_left && !matched && l.1 + window.after < watermark {
                expected.push((Some(*l), None));
            }
        }
        for r in &outcome.right {
            let matched = outcome.left.iter().any(|l| matches(l, r));
            if keeps_right && !matched && r.1 + window.before < watermark {
                expected.push((None, Some(*r)));
            }
        }
        reference::assert_same_multiset(outcome.committed, expected)?;

        // The state holds exactly the rows a future row could still match,
        // each with whether it matched; a right outer join holds the right
        // rows on its left.
        let mut expected_state = FullBuffered::new();
        let buffered_left = outcome
            .left
            .iter()
            .filter(|l| l.1 + window.after >= watermark);
        for l in buffered_left {
            let row = (l.1, *l, outcome.right.iter().any(|r| matches(l, r)));
            let rows = expected_state.entry(l.0).or_default();
            match case.join {
                Join::Right => rows.1.push(row),
                _ => rows.0.push(row),
            }
        }
        let buffered_right = outcome
            .right
            .iter()
            .filter(|r| r.1 + window.before >= watermark);
        for r in buffered_right {
            let row = (r.1, *r, outcome.left.iter().any(|l| matches(l, r)));
            let rows = expected_state.entry(r.0).or_default();
            match case.join {
                Join::Right => rows.0.push(row),
                _ => rows.1.push(row),
            }
        }
        match outcome.state {
            State::Full(state) => prop_assert_eq!(sorted(state), sorted(expected_state)),
            State::Rows(state) => {
                // Only a full join says whether the rows on its right matched.
                let expected_state: Buffered = expected_state
                    .into_iter()
                    .map(|(key, (left, right))| {
                        let right = right.into_iter().map(|(t, row, _)| (t, row)).collect();
                        (key, (left, right))
                    })
                    .collect();
                prop_assert_eq!(sorted(state), sorted(expected_state));
            }
        }
        Ok(())
    });
}

/// Each key's rows in order, to compare with those expected.
fn sorted<A: Ord, B: Ord>(
    mut rows: BTreeMap<u8, (Vec<A>, Vec<B>)>,
) -> BTreeMap<u8, (Vec<A>, Vec<B>)> {
    for (left, right) in rows.values_mut() {
        left.sort();
        right.sort();
    }
    rows
}

/// Waits until the watermark has reached every sink, hence passed the join.
fn wait_for_watermark(query: &StreamingQuery, watermark: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while query.metrics().watermark().is_none_or(|w| w < watermark) {
        assert!(
            Instant::now() < deadline,
            "watermark stuck below {watermark}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn late_rows_are_dropped_and_unmatched_left_rows_come_out_once_their_range_has_passed() {
    let flow = Dataflow::new("left-join");
    let (impressions, clicks) = (MemorySource::<Row>::new(1), MemorySource::<Row>::new(1));
    let delay = Duration::from_millis(100);
    let left = flow
        .source(impressions.clone())
        .with_watermark(|row: &Row| row.1, delay);
    let right = flow
        .source(clicks.clone())
        .with_watermark(|row: &Row| row.1, delay);
    let out = MemorySink::new();
    let window = JoinWindow::between(Duration::ZERO, Duration::from_millis(500));
    left.left_join(&right, |row| row.0, |row| row.0, window)
        .sink(out.clone());
    let config = QueryConfig::new("left-join").checkpoint_location(
        std::env::temp_dir().join(format!("rtflow-left-join-{}", std::process::id())),
    );
    let query = flow.start(config).unwrap();

    impressions
        .push_all(0, [(1, 1000, 0), (2, 1000, 0)])
        .unwrap();
    clicks.push_all(0, [(1, 1200, 0)]).unwrap();
    assert!(out.wait_for(1, Duration::from_secs(30)));
    // Both sides at 1600: the watermark 1500 passes neither range end (1500).
    impressions.push_all(0, [(9, 1600, 0)]).unwrap();
    clicks.push_all(0, [(9, 1600, 0)]).unwrap();
    wait_for_watermark(&query, 1500);
    // Behind the watermark: dropped and counted, although it would match.
    clicks.push_all(0, [(2, 1499, 0)]).unwrap();
    // On time, in impression 2's range.
    clicks.push_all(0, [(2, 1500, 1)]).unwrap();
    assert!(out.wait_for(3, Duration::from_secs(30)));
    // Both sides at 2200: the watermark 2100 passes the ranges of 1 and 2
    // (matched) and of the 9s (matched each other).
    impressions.push_all(0, [(3, 2200, 0)]).unwrap();
    clicks.push_all(0, [(4, 2200, 0)]).unwrap();
    wait_for_watermark(&query, 2100);
    // Impression 3 (range end 2700) comes out unmatched at watermark 2800.
    impressions.push_all(0, [(5, 2900, 0)]).unwrap();
    clicks.push_all(0, [(5, 2900, 0)]).unwrap();
    assert!(out.wait_for(5, Duration::from_secs(30)));
    assert_eq!(query.metrics().late_records(), 1);
    query.stop().unwrap();

    let mut rows = out.rows();
    rows.sort();
    assert_eq!(
        rows,
        [
            ((1, 1000, 0), Some((1, 1200, 0))),
            ((2, 1000, 0), Some((2, 1500, 1))),
            ((3, 2200, 0), None),
            ((5, 2900, 0), Some((5, 2900, 0))),
            ((9, 1600, 0), Some((9, 1600, 0))),
        ]
    );
}

/// `(key, event time)`, for the eviction tests.
type Pair = (u16, i64);
/// The key of the rows that move the watermark on, which no buffered row has.
const OTHER: u16 = u16::MAX;
/// A left row and its right row, if any.
type Joined = (Pair, Option<Pair>);

/// A harness whose one-partition left input and the returned right source,
/// each with a watermark at its event times, are joined (left outer, or inner
/// with every right row wrapped in `Some`) on one instance, a left row with the
/// right rows from its time to 100 ms after it.
fn pair_join(name: &str, outer: bool) -> (DataflowHarness<Pair, Joined>, MemorySource<Pair>) {
    let right_input = MemorySource::<Pair>::new(1);
    let right = right_input.clone();
    let harness = DataflowHarness::new(name, 1, move |flow, left: Stream<Pair>| {
        let by_time = |row: &Pair| row.1;
        let right = flow
            .source(right.clone())
            .with_watermark(by_time, Duration::ZERO);
        let key = |row: &Pair| row.0;
        let window = JoinWindow::between(Duration::ZERO, Duration::from_millis(100));
        let left = left.with_watermark(by_time, Duration::ZERO);
        if outer {
            left.left_join(&right, key, key, window)
        } else {
            left.join(&right, key, key, window)
                .map(|(l, r)| (l, Some(r)))
        }
    })
    .configure(|config| config.default_parallelism(1));
    (harness, right_input)
}

/// An inner join buffers a left row of each of 1,000 keys at 1 s (range 0 to
/// 100 ms after it), then both sides' watermarks move to 20 s, then
/// `records_after` more left rows of another key arrive: how many of the 1,000
/// keys are still buffered.
fn expired_keys_held(records_after: i64) -> usize {
    type Rows = BTreeMap<u16, (Vec<(i64, Pair, bool)>, Vec<(i64, Pair)>)>;
    let (mut harness, right_input) = pair_join("join-evict-slices", false);
    harness.start().unwrap();
    for key in 0..1_000 {
        harness.push_at(0, (key, 1_000), 1_000).unwrap();
    }
    right_input.push_at(0, (OTHER, 20_000), 20_000).unwrap();
    harness.push_at(0, (OTHER, 20_000), 20_000).unwrap();
    // The sinks see the watermark after the join has: the rows pushed from
    // now on reach the join after it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = || harness.query().expect("running").metrics();
    while metrics().watermark().is_none_or(|w| w < 20_000) {
        assert!(Instant::now() < deadline, "watermark stuck below 20 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    for time in 20_001..=20_000 + records_after {
        harness.push_at(0, (OTHER, time), time).unwrap();
    }
    harness.settle().unwrap();
    harness.checkpoint().unwrap();
    harness.crash().unwrap();
    let rows: Rows = harness.state("stream_join-0", "rows").unwrap();
    rows.keys().filter(|key| **key != OTHER).count()
}

/// A watermark that expires the rows of many keys of an inner join evicts a
/// slice of them at once and the rest over the records after it.
#[test]
fn a_watermark_expiring_many_keys_of_an_inner_join_evicts_them_over_the_records_after_it() {
    let held = expired_keys_held(0);
    assert!(
        (900..1_000).contains(&held),
        "expired keys held after the watermark: {held} of 1000"
    );
    // 600 records after it evict two keys each.
    assert_eq!(expired_keys_held(600), 0, "after 600 more records");
}

/// A watermark that expires 1,000 unmatched left rows of an outer join: they
/// go out a slice at a time, and the watermark the join passes on waits for
/// them, so the sink never receives one behind its watermark.
#[test]
fn a_watermark_expiring_many_unmatched_rows_of_an_outer_join_holds_until_they_are_out() {
    let (mut harness, right_input) = pair_join("outer-join-hold", true);
    harness.start().unwrap();
    for key in 0..1_000 {
        harness
            .push_at(0, (key, 1_000 + key as i64), 1_000)
            .unwrap();
    }
    right_input.push_at(0, (OTHER, 20_000), 20_000).unwrap();
    for time in 20_000..20_200 {
        harness.push_at(0, (OTHER, time), time).unwrap();
    }
    right_input.end();
    harness.finish().unwrap();

    let committed = harness.committed_with_watermarks();
    let unmatched: Vec<_> = committed
        .iter()
        .filter(|((left, right), _)| right.is_none() && left.0 != OTHER)
        .collect();
    assert_eq!(unmatched.len(), 1_000);
    for ((left, _), watermark) in &unmatched {
        let end = left.1 + 100;
        assert!(
            watermark.is_none_or(|w| w <= end),
            "{left:?} (out at {end}) reached the sink behind its watermark {watermark:?}"
        );
    }
}
