//! `drop_duplicates` and `drop_duplicates_within_watermark` against a batch
//! reference, on random inputs, partitionings, parallelisms, arrival orders,
//! checkpoints and crashes (`rtflow::testing`); the checkpointed state is
//! compared with the keys the watermark must still hold. `PROPTEST_CASES=n`
//! runs more cases.
//!
//! Inputs come in rounds of event time so that no record is ever late, however
//! the threads interleave and wherever a crash restores the watermark: round `r`
//! holds times in `[r * SPAN, (r + 1) * SPAN)`, the watermark delay is `SPAN`,
//! and each round ends with a tick at its last millisecond in every partition,
//! so the watermark stays below the round being pushed and reaches the end of
//! the previous one. Late records get their own test, where the watermark they
//! are behind is waited for.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rtflow::prelude::*;
use rtflow::testing::{check, reference, DataflowHarness, Step};

/// The event-time span of a round and the watermark delay (ms).
const SPAN: i64 = 100;
/// Ids of the ticks that end each round: 10 000 + the round.
const TICK: u16 = 10_000;
/// How long `drop_duplicates_within_watermark` keeps a key: every id's records
/// lie within two rounds, so within it of each other.
const KEEP: Duration = Duration::from_millis(2 * SPAN as u64);

/// `(id, event time, tag)`: records with the same id (and time) but different
/// tags are duplicates that can be told apart.
type Event = (u16, i64, u8);

#[derive(Debug, Clone)]
enum Act {
    /// An event of the round: id `round * 8 + id` (so an id spans two rounds) at
    /// `round * SPAN + offset`.
    Push {
        partition: usize,
        id: u16,
        offset: i64,
        tag: u8,
    },
    Settle,
    Checkpoint,
    Crash,
}

/// A run: source partitions, deduplication parallelism, whether epochs also end
/// on a 40 ms timer, whether every id lives in one partition (so its first
/// occurrence is the first pushed), and the rounds.
#[derive(Debug, Clone)]
struct Case {
    partitions: usize,
    parallelism: usize,
    timer: bool,
    pinned: Option<u64>,
    rounds: Vec<Vec<Act>>,
}

fn acts(partitions: usize) -> impl Strategy<Value = Vec<Act>> {
    let act = prop_oneof![
        16 => (0..partitions, 0..16u16, 0..SPAN, 0..4u8)
            .prop_map(|(partition, id, offset, tag)| Act::Push { partition, id, offset, tag }),
        1 => Just(Act::Settle),
        1 => Just(Act::Checkpoint),
        1 => Just(Act::Crash),
    ];
    prop::collection::vec(act, 0..16)
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1..=3usize,
        1..=3usize,
        any::<bool>(),
        prop::option::of(any::<u64>()),
    )
        .prop_flat_map(|(partitions, parallelism, timer, pinned)| {
            prop::collection::vec(acts(partitions), 0..6).prop_map(move |rounds| Case {
                partitions,
                parallelism,
                timer,
                pinned,
                rounds,
            })
        })
}

impl Case {
    /// The harness steps: each round's acts, then its ticks; a last round of
    /// ticks only, so the final watermark is `final_watermark()`.
    fn steps(&self) -> Vec<Step<Event>> {
        let push = |partition, event: Event| Step::Push {
            partition,
            value: event,
            event_time: Some(event.1),
        };
        let mut steps = Vec::new();
        for (round, acts) in self.rounds.iter().enumerate() {
            let base = round as i64 * SPAN;
            for act in acts {
                steps.push(match *act {
                    Act::Push {
                        partition,
                        id,
                        offset,
                        tag,
                    } => {
                        let id = round as u16 * 8 + id;
                        let partition = match self.pinned {
                            Some(salt) => {
                                let mut hasher = DefaultHasher::new();
                                (salt, id).hash(&mut hasher);
                                (hasher.finish() % self.partitions as u64) as usize
                            }
                            None => partition,
                        };
                        push(partition, (id, base + offset, tag))
                    }
                    Act::Settle => Step::Settle,
                    Act::Checkpoint => Step::Checkpoint,
                    Act::Crash => Step::Crash,
                });
            }
            steps.extend(self.ticks(round).map(|(p, tick)| push(p, tick)));
        }
        steps.extend(self.ticks(self.rounds.len()).map(|(p, tick)| push(p, tick)));
        steps
    }

    /// The tick ending `round` in every partition (identical, so any may win).
    fn ticks(&self, round: usize) -> impl Iterator<Item = (usize, Event)> {
        let tick = (TICK + round as u16, (round as i64 + 1) * SPAN - 1, 0);
        (0..self.partitions).map(move |p| (p, tick))
    }

    /// The watermark once the last round's ticks are read: its tick time minus
    /// the delay.
    fn final_watermark(&self) -> i64 {
        self.rounds.len() as i64 * SPAN - 1
    }

    fn harness(
        &self,
        name: &str,
        dedup: impl Fn(Stream<Event>) -> Stream<Event> + 'static,
    ) -> DataflowHarness<Event, Event> {
        let parallelism = self.parallelism;
        let harness = DataflowHarness::new(name, self.partitions, move |_, input| {
            let events =
                input.with_watermark(|(_, time, _)| *time, Duration::from_millis(SPAN as u64));
            dedup(events).parallelism(parallelism)
        });
        if self.timer {
            harness.checkpoint_every(Duration::from_millis(40))
        } else {
            harness
        }
    }
}

/// Every record pushed, in the order each partition received it, partition
/// after partition: the first of a key in this order is its first occurrence
/// when all its records share a partition.
fn first_per_key<K: Ord>(
    input: &[Vec<Event>],
    key: impl Fn(&Event) -> K,
) -> BTreeMap<K, Vec<Event>> {
    let mut occurrences: BTreeMap<K, Vec<Event>> = BTreeMap::new();
    for event in input.iter().flatten() {
        occurrences.entry(key(event)).or_default().push(*event);
    }
    occurrences
}

/// Checks that the committed output holds one record per key, the first
/// occurrence when ids are pinned to partitions (else any occurrence).
fn check_one_per_key<K: Ord + Clone + std::fmt::Debug>(
    committed: Vec<Event>,
    occurrences: &BTreeMap<K, Vec<Event>>,
    pinned: bool,
    key: impl Fn(&Event) -> K,
) -> Result<(), TestCaseError> {
    reference::assert_same_multiset(committed.iter().map(&key), occurrences.keys().cloned())?;
    for event in committed {
        let candidates = &occurrences[&key(&event)];
        if pinned {
            prop_assert_eq!(event, candidates[0], "the first occurrence goes through");
        } else {
            prop_assert!(candidates.contains(&event), "{event:?} was never pushed");
        }
    }
    Ok(())
}

#[test]
fn drop_duplicates_keeps_the_first_of_each_key_and_forgets_keys_behind_the_watermark() {
    check("drop_duplicates", 12, cases(), |case| {
        let key = |(id, time, _): &Event| (*id, *time);
        let mut harness = case.harness("dedup", move |events| events.drop_duplicates(key));
        harness.run(&case.steps()).map_err(fail)?;

        let occurrences = first_per_key(harness.input(), key);
        check_one_per_key(
            harness.committed(),
            &occurrences,
            case.pinned.is_some(),
            key,
        )?;
        // A key is kept until the watermark passes its event time, no longer.
        let watermark = case.final_watermark();
        let expected: BTreeMap<(u16, i64), i64> = occurrences
            .keys()
            .filter(|(_, time)| *time >= watermark)
            .map(|(id, time)| ((*id, *time), *time))
            .collect();
        let state = harness
            .state::<(u16, i64), i64>("drop_duplicates-0", "seen")
            .map_err(fail)?;
        prop_assert_eq!(state, expected);
        Ok(())
    });
}

#[test]
fn drop_duplicates_within_watermark_keeps_one_per_key_within_the_delay_and_then_forgets_it() {
    check("drop_duplicates_within_watermark", 12, cases(), |case| {
        let key = |(id, _, _): &Event| *id;
        let mut harness = case.harness("dedup-within", move |events| {
            events.drop_duplicates_within_watermark(key, KEEP)
        });
        harness.run(&case.steps()).map_err(fail)?;

        let occurrences = first_per_key(harness.input(), key);
        check_one_per_key(
            harness.committed(),
            &occurrences,
            case.pinned.is_some(),
            key,
        )?;
        // A key is kept until the watermark passes its first occurrence's time
        // plus the delay. Which occurrence came first is known when ids are
        // pinned; otherwise the key must be kept if its earliest record says so,
        // and may be only if its latest does.
        let watermark = case.final_watermark();
        let keep = KEEP.as_millis() as i64;
        let state = harness
            .state::<u16, i64>("drop_duplicates_within_watermark-0", "seen")
            .map_err(fail)?;
        if case.pinned.is_some() {
            let expected: BTreeMap<u16, i64> = occurrences
                .iter()
                .map(|(id, events)| (*id, events[0].1 + keep))
                .filter(|(_, until)| *until >= watermark)
                .collect();
            prop_assert_eq!(state, expected);
        } else {
            let held: BTreeSet<u16> = state.keys().copied().collect();
            let times = |id: &u16| occurrences[id].iter().map(|e| e.1);
            let must: BTreeSet<u16> = occurrences
                .keys()
                .filter(|id| times(id).min().unwrap() + keep >= watermark)
                .copied()
                .collect();
            let may: BTreeSet<u16> = occurrences
                .keys()
                .filter(|id| times(id).max().unwrap() + keep >= watermark)
                .copied()
                .collect();
            prop_assert!(
                must.is_subset(&held) && held.is_subset(&may),
                "state {held:?}, must hold {must:?}, may hold {may:?}"
            );
        }
        Ok(())
    });
}

fn fail(error: RtflowError) -> TestCaseError {
    TestCaseError::fail(error.to_string())
}

/// Waits until the watermark has reached every sink, hence passed the
/// deduplication operator.
fn wait_for_watermark(harness: &DataflowHarness<Event, Event>, watermark: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while harness
        .query()
        .expect("running")
        .metrics()
        .watermark()
        .is_none_or(|w| w < watermark)
    {
        assert!(
            Instant::now() < deadline,
            "watermark stuck below {watermark}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Pushes `(1, 1000)` and `(2, 1500)`, waits for the watermark 1400 (delay
/// 100), then late and on-time duplicates; returns what was committed and how
/// many records were dropped as late.
fn late_run(
    name: &str,
    dedup: impl Fn(Stream<Event>) -> Stream<Event> + 'static,
) -> (Vec<Event>, u64) {
    let mut harness = DataflowHarness::new(name, 1, move |_, input: Stream<Event>| {
        dedup(input.with_watermark(|(_, time, _)| *time, Duration::from_millis(100)))
    });
    harness.start().unwrap();
    harness.push(0, (1, 1000, 0)).unwrap();
    harness.push(0, (2, 1500, 0)).unwrap();
    wait_for_watermark(&harness, 1400);
    for late in [(1, 1000, 1), (3, 1399, 0)] {
        harness.push(0, late).unwrap();
    }
    for on_time in [(3, 1400, 0), (2, 1500, 1), (4, 1450, 0)] {
        harness.push(0, on_time).unwrap();
    }
    harness.finish().unwrap();
    let late = harness.metrics().unwrap().late_records();
    let mut committed = harness.committed();
    committed.sort();
    (committed, late)
}

#[test]
fn records_behind_the_watermark_are_dropped_and_counted() {
    let (committed, late) = late_run("dedup-late", |events| {
        events.drop_duplicates(|(id, time, _)| (*id, *time))
    });
    assert_eq!(
        committed,
        [(1, 1000, 0), (2, 1500, 0), (3, 1400, 0), (4, 1450, 0)]
    );
    assert_eq!(late, 2);

    // Within the watermark: id 1 at 1000 is kept until 1000 + 500 and id 3's
    // late record never enters the state, so its on-time record goes through.
    let (committed, late) = late_run("dedup-within-late", |events| {
        events.drop_duplicates_within_watermark(|(id, _, _)| *id, Duration::from_millis(500))
    });
    assert_eq!(
        committed,
        [(1, 1000, 0), (2, 1500, 0), (3, 1400, 0), (4, 1450, 0)]
    );
    assert_eq!(late, 2);
}

#[test]
fn without_a_watermark_every_key_is_kept() {
    let mut harness = DataflowHarness::new("dedup-forever", 2, |_, input: Stream<Event>| {
        input.drop_duplicates(|(id, _, _)| *id)
    });
    harness.start().unwrap();
    for (i, time) in [0, 1_000_000, 2_000_000, 0].into_iter().enumerate() {
        harness.push(i % 2, (7, time, i as u8)).unwrap();
        harness.push(i % 2, (i as u16, time, 0)).unwrap();
    }
    harness.finish().unwrap();
    assert_eq!(harness.committed().iter().filter(|e| e.0 == 7).count(), 1);
    let state = harness
        .state::<u16, i64>("drop_duplicates-0", "seen")
        .unwrap();
    assert_eq!(
        state.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2, 3, 7],
        "no key forgotten"
    );
}

/// A restart at a higher parallelism gives keys to instances that had no
/// watermark of their own: they judge lateness by the checkpointed one all the
/// same, so replayed or new records behind it are dropped, not let through.
#[test]
fn a_restart_at_another_parallelism_keeps_the_checkpointed_watermark() {
    let parallelism = Arc::new(AtomicUsize::new(1));
    let chosen = parallelism.clone();
    let mut harness = DataflowHarness::new("dedup-rescale", 1, move |_, input: Stream<Event>| {
        input
            .with_watermark(|(_, time, _)| *time, Duration::from_millis(100))
            .drop_duplicates(|(id, time, _)| (*id, *time))
            .parallelism(chosen.load(Ordering::Relaxed))
    });
    harness.start().unwrap();
    harness.push(0, (1, 1500, 0)).unwrap();
    wait_for_watermark(&harness, 1400);
    harness.stop().unwrap();

    parallelism.store(3, Ordering::Relaxed);
    harness.start().unwrap();
    for id in 100..130 {
        harness.push(0, (id, 1000, 0)).unwrap();
    }
    harness.push(0, (2, 1600, 0)).unwrap();
    harness.finish().unwrap();
    let mut committed = harness.committed();
    committed.sort();
    assert_eq!(committed, [(1, 1500, 0), (2, 1600, 0)]);
    assert_eq!(harness.metrics().unwrap().late_records(), 30);
}

/// Deduplicates 1,000 ids first seen at 1 s and kept for 1 s, then passes a
/// watermark of 20 s with a record of another id, then `records_after` more of
/// it and id 0 again: how many expired ids are still held, and whether id 0
/// went through.
fn expired_ids_held(records_after: i64) -> (usize, bool) {
    const OTHER: u16 = u16::MAX;
    let mut harness = DataflowHarness::new("dedup-evict-slices", 1, |_, input: Stream<Event>| {
        input
            .with_watermark(|(_, time, _)| *time, Duration::ZERO)
            .drop_duplicates_within_watermark(|(id, _, _)| *id, Duration::from_secs(1))
    })
    .configure(|config| config.default_parallelism(1));
    harness.start().unwrap();
    for id in 0..1_000 {
        harness.push_at(0, (id, 1_000, 0), 1_000).unwrap();
    }
    // The watermark follows the source's batch: once the source has read the
    // record that moves it, every later record reaches the operator after it.
    harness.push_at(0, (OTHER, 20_000, 0), 20_000).unwrap();
    harness.settle().unwrap();
    let last = 20_000 + records_after;
    for time in 20_001..=last {
        harness.push_at(0, (OTHER, time, 0), time).unwrap();
    }
    harness.push_at(0, (0, last, 1), last).unwrap();
    harness.settle().unwrap();
    harness.checkpoint().unwrap();
    harness.crash().unwrap();
    let again = harness.committed().contains(&(0, last, 1));
    let seen = harness
        .state::<u16, i64>("drop_duplicates_within_watermark-0", "seen")
        .unwrap();
    let expired = seen.values().filter(|until| **until == 2_000).count();
    (expired, again)
}

/// A watermark that expires many ids evicts a slice of them at once and the
/// rest over the records after it, duplicates included; an expired id not
/// evicted yet counts as gone.
#[test]
fn a_watermark_expiring_many_ids_evicts_them_over_the_records_after_it() {
    let (expired, again) = expired_ids_held(0);
    assert!(
        (900..1_000).contains(&expired),
        "expired ids held after the watermark: {expired} of 1000"
    );
    assert!(again, "id 0, expired but held, goes through");
    // 600 records after it, all but the first duplicates, evict two ids each.
    let (expired, again) = expired_ids_held(600);
    assert_eq!(expired, 0, "expired ids held after 600 more records");
    assert!(again, "id 0, evicted, goes through");
}
