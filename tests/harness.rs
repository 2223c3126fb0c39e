//! The engine's own properties, checked with `rtflow::testing`: running
//! aggregates keep exactly-once state and output across random crash points,
//! per-key order survives a shuffle, and no mailbox holds more than its
//! capacity. A deliberately broken operator shows that the harness catches
//! what these properties rule out. `PROPTEST_CASES=n` runs more cases.
//!
//! Sink watermarks are monotone within a run and never behind the one restored
//! from the checkpoint, and no window reaches a sink behind its watermark.
//! Windows (`tests/windows.rs`), deduplication (`tests/dedup.rs`) and joins
//! (`tests/stream_join.rs`) have their exactly-once properties on the same
//! harness next to their other tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use rtflow::prelude::*;
use rtflow::testing::{check, pin_keys, reference, schedule, try_check, DataflowHarness, Step};

/// Words from a small alphabet, so that keys repeat.
fn words() -> impl Strategy<Value = String> + Clone {
    prop::sample::select(vec!["a", "b", "c", "d", "e"]).prop_map(String::from)
}

/// A run's shape: source partitions, operator parallelism, whether epochs also
/// end on a 40 ms timer (so crashes hit checkpoints in flight), and the steps.
#[derive(Debug, Clone)]
struct Run<T> {
    partitions: usize,
    parallelism: usize,
    timer: bool,
    steps: Vec<Step<T>>,
}

fn runs<T: Clone + std::fmt::Debug + 'static>(
    values: impl Strategy<Value = T> + Clone + 'static,
    pinned: Option<fn(&T) -> u8>,
) -> impl Strategy<Value = Run<T>> {
    (1..=3usize, 1..=3usize, any::<bool>()).prop_flat_map(
        move |(partitions, parallelism, timer)| {
            let steps = schedule(values.clone(), partitions, 0..40);
            let steps = match pinned {
                Some(key) => pin_keys(steps, partitions, key).boxed(),
                None => steps.boxed(),
            };
            steps.prop_map(move |steps| Run {
                partitions,
                parallelism,
                timer,
                steps,
            })
        },
    )
}

impl<T> Run<T> {
    fn harness<Out: Data>(
        &self,
        name: &str,
        build: impl Fn(&Dataflow, Stream<T>) -> Stream<Out> + 'static,
    ) -> DataflowHarness<T, Out>
    where
        T: Data,
    {
        let harness = DataflowHarness::new(name, self.partitions, build);
        if self.timer {
            harness.checkpoint_every(Duration::from_millis(40))
        } else {
            harness
        }
    }
}

/// Carries out `steps`, calling `after_crash` while the query is down after each
/// crash, then finishes the run.
fn run_checking_crashes<In: Data, Out: Data>(
    harness: &mut DataflowHarness<In, Out>,
    steps: &[Step<In>],
    after_crash: impl Fn(&DataflowHarness<In, Out>) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    harness.start()?;
    for step in steps {
        if let Step::Crash = step {
            harness.crash()?;
            after_crash(harness)?;
            harness.start()?;
        } else {
            harness.apply(step)?;
        }
    }
    harness.finish()?;
    Ok(())
}

fn word_count(run: &Run<String>) -> DataflowHarness<String, (String, u64)> {
    let parallelism = run.parallelism;
    run.harness("count", move |_, words| {
        words
            .key_by(|word: &String| word.clone())
            .count()
            .parallelism(parallelism)
    })
}

#[test]
fn running_counts_are_exactly_once_across_crashes() {
    check(
        "count: exactly once across crashes",
        48,
        runs(words(), None),
        |run| {
            let mut harness = word_count(&run);
            run_checking_crashes(&mut harness, &run.steps, |harness| {
                // The last checkpoint counted what its source offsets cover, once.
                let covered = harness.committed_input()?.concat();
                reference::assert_same_map(
                    &harness.state("count-0", "accumulators")?,
                    &reference::counts(covered, String::clone),
                )
            })?;
            let input = harness.input_values();
            reference::assert_same_map(
                &harness.state("count-0", "accumulators")?,
                &reference::counts(&input, |w| w.to_string()),
            )?;
            // Each key's updates 1, 2, ..., n committed once each, in order.
            reference::assert_same_per_key(
                harness.committed(),
                reference::running_counts(input, String::clone),
            )?;
            Ok(())
        },
    );
}

/// A key and an amount.
fn amounts() -> impl Strategy<Value = (u8, i64)> + Clone {
    (0u8..4, -50i64..100)
}

fn amount_key(record: &(u8, i64)) -> u8 {
    record.0
}

#[test]
fn running_sums_are_exactly_once_and_in_key_order_across_crashes() {
    let runs = runs(amounts(), Some(amount_key as fn(&(u8, i64)) -> u8));
    check("sum: exactly once, per-key order", 32, runs, |run| {
        let parallelism = run.parallelism;
        let mut harness = run.harness("sum", move |_, amounts| {
            amounts
                .key_by(amount_key)
                .sum(|(_, amount)| *amount)
                .parallelism(parallelism)
        });
        run_checking_crashes(&mut harness, &run.steps, |harness| {
            let covered = harness.committed_input()?.concat();
            reference::assert_same_map(
                &harness.state("sum-0", "accumulators")?,
                &reference::sums(covered, amount_key, |r| r.1),
            )
        })?;
        // Every key lives in one partition, so its running sums have one order:
        // the partition's, through the shuffle and every restart.
        reference::assert_same_per_key(
            harness.committed(),
            reference::running_sums(harness.input_values(), amount_key, |r| r.1),
        )?;
        Ok(())
    });
}

/// Set once some case filled a mailbox to its capacity: the bound is reached,
/// so the property that it is never exceeded says something.
static FILLED: AtomicBool = AtomicBool::new(false);

#[test]
fn per_key_order_survives_a_shuffle_and_no_mailbox_exceeds_its_capacity() {
    let sequenced = (0u8..4, 0u32..1_000_000);
    let shapes = (1..=4usize, 1..=4usize, any::<bool>());
    let cases = (runs(sequenced, Some(|r: &(u8, u32)| r.0)), shapes);
    check("shuffle order, mailbox bound", 24, cases, |(run, shape)| {
        let (capacity, per_message, chaining) = shape;
        let parallelism = run.parallelism;
        let steps: Vec<_> = run
            .steps
            .iter()
            .filter(|s| **s != Step::Crash)
            .cloned()
            .collect();
        let mut harness = run
            .harness("order", move |_, records| {
                // Each record passes the shuffle as the latest value of its key,
                // then a slow step lets the mailboxes in front of it fill up.
                records
                    .key_by(|r: &(u8, u32)| r.0)
                    .reduce(|_, latest| *latest)
                    .parallelism(parallelism)
                    .map(|(_, record)| {
                        std::thread::sleep(Duration::from_micros(200));
                        record
                    })
            })
            .configure(|config| {
                config
                    .mailbox_capacity(capacity)
                    .max_records_per_message(per_message)
                    .operator_chaining(chaining)
            });
        harness.run(&steps)?;
        // Records are (key, sequence) pairs: each key's must come out as pushed.
        reference::assert_same_per_key(harness.committed(), harness.input_values())?;
        let metrics = harness.metrics().expect("the run ended");
        for mailbox in &metrics.mailboxes {
            prop_assert_eq!(mailbox.capacity, capacity, "{:?}", mailbox);
            prop_assert!(mailbox.max_depth <= capacity, "{:?}", mailbox);
            if mailbox.max_depth == capacity {
                FILLED.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    });
    assert!(
        FILLED.load(Ordering::Relaxed),
        "no case ever filled a mailbox: the bound was never put to the test"
    );
}

/// `(key, event time in ms)`.
type Timed = (u8, i64);

/// A watermark run: source partitions, window parallelism, watermark delay
/// (ms), whether epochs also end on a 40 ms timer, and the steps, every push
/// with its event time.
#[derive(Debug, Clone)]
struct TimedRun {
    partitions: usize,
    parallelism: usize,
    delay: u64,
    timer: bool,
    steps: Vec<Step<Timed>>,
}

/// Event times drift upwards with the schedule (5 ms per step) with a jitter
/// of -80..40 ms, so the watermark advances while a fair share of records
/// arrive behind it, late for the window they belong to.
fn timed_runs() -> impl Strategy<Value = TimedRun> {
    (
        1..=3usize,
        1..=3usize,
        prop::sample::select(vec![0u64, 10, 30, 60]),
        any::<bool>(),
    )
        .prop_flat_map(move |(partitions, parallelism, delay, timer)| {
            schedule((0u8..4, -80i64..40), partitions, 0..40).prop_map(move |steps| {
                let steps = steps
                    .into_iter()
                    .enumerate()
                    .map(|(i, step)| match step {
                        Step::Push {
                            partition,
                            value: (key, jitter),
                            ..
                        } => {
                            let time = (i as i64 * 5 + jitter).max(0);
                            Step::Push {
                                partition,
                                value: (key, time),
                                event_time: Some(time),
                            }
                        }
                        other => other,
                    })
                    .collect();
                TimedRun {
                    partitions,
                    parallelism,
                    delay,
                    timer,
                    steps,
                }
            })
        })
}

/// The size of the tumbling windows the watermark property counts in.
const WINDOW_MS: u64 = 25;

#[test]
fn watermarks_are_monotone_and_never_go_back_behind_a_restore() {
    check("watermarks monotone", 24, timed_runs(), |run| {
        let (parallelism, delay) = (run.parallelism, run.delay);
        let harness = DataflowHarness::new("watermarks", run.partitions, move |_, input| {
            input
                .with_watermark(|(_, time): &Timed| *time, Duration::from_millis(delay))
                .key_by(|(key, _): &Timed| *key)
                .window(Window::tumbling(Duration::from_millis(WINDOW_MS)))
                .count()
                .parallelism(parallelism)
        });
        let mut harness = if run.timer {
            harness.checkpoint_every(Duration::from_millis(40))
        } else {
            harness
        };
        harness.run(&run.steps)?;

        let traces = harness.watermarks();
        let runs = traces.iter().map(|t| t.run).max().map_or(0, |r| r + 1);
        prop_assert_eq!(
            runs,
            1 + run.steps.iter().filter(|s| **s == Step::Crash).count(),
            "one run per start"
        );
        // Across runs the restored watermark never goes back either.
        let mut floors: BTreeMap<usize, Option<i64>> = BTreeMap::new();
        for trace in &traces {
            floors.insert(trace.run, trace.restored);
        }
        let floors: Vec<_> = floors.into_values().collect();
        prop_assert!(
            floors.windows(2).all(|pair| pair[1] >= pair[0]),
            "restored watermarks went back: {:?}",
            floors
        );
        for trace in &traces {
            let mut last = trace.restored;
            for (epoch, watermark) in &trace.watermarks {
                // Non-decreasing within the run, never behind the restored one.
                prop_assert!(
                    Some(*watermark) >= last,
                    "run {} subtask {}: watermark {} in epoch {} after {:?} (restored {:?}): {:?}",
                    trace.run,
                    trace.subtask,
                    watermark,
                    epoch,
                    last,
                    trace.restored,
                    trace.watermarks
                );
                last = Some(*watermark);
            }
        }
        // Every window a sink received after a watermark ends after it: the
        // window operator, which passed that watermark on before it, had closed
        // every window up to it and counts no record behind it.
        for ((key, window, count), watermark) in harness.committed_with_watermarks() {
            if let Some(watermark) = watermark {
                prop_assert!(
                    window.end > watermark,
                    "({key}, {window:?}, {count}) committed behind watermark {watermark}"
                );
            }
        }
        // Late records are dropped, never counted: each committed count is at
        // most the number of records of its window, and the final count of a
        // window no record was late for is exactly that number.
        let mut pushed: BTreeMap<(u8, i64), u64> = BTreeMap::new();
        for (key, time) in harness.input_values() {
            *pushed
                .entry((key, time - time.rem_euclid(WINDOW_MS as i64)))
                .or_default() += 1;
        }
        let committed = harness.committed();
        for (key, window, count) in &committed {
            let records = pushed.get(&(*key, window.start)).copied().unwrap_or(0);
            prop_assert!(
                *count <= records,
                "({key}, {window:?}) counted {count} of {records}"
            );
        }
        let late = harness.metrics().expect("the run ended").late_records();
        if late == 0 && !run.steps.contains(&Step::Crash) {
            let finals: BTreeMap<(u8, i64), u64> = committed
                .iter()
                .map(|(key, window, count)| ((*key, window.start), *count))
                .collect();
            prop_assert_eq!(finals, pushed);
        }
        Ok(())
    });
}

/// A checkpoint taken in a run whose sinks have not received a watermark yet
/// must still hold the watermark that run restored: the restored watermark is
/// the floor of every later one (sinks start a run at the restored watermark).
/// Found by `watermarks_are_monotone_and_never_go_back_behind_a_restore`.
#[test]
fn a_checkpoint_before_the_first_watermark_of_a_run_keeps_the_restored_one() {
    let mut harness = DataflowHarness::new("restored-floor", 1, |_, input| {
        input
            .with_watermark(|(_, time): &Timed| *time, Duration::from_millis(10))
            .key_by(|(key, _): &Timed| *key)
            .window(Window::tumbling(Duration::from_millis(WINDOW_MS)))
            .count()
    });
    harness.start().unwrap();
    harness.push_at(0, (1, 100), 100).unwrap();
    harness.settle().unwrap();
    harness.checkpoint().unwrap();
    harness.crash().unwrap();
    harness.start().unwrap();
    harness.checkpoint().unwrap(); // nothing new: no watermark reaches the sink
    harness.crash().unwrap();
    harness.start().unwrap();
    harness.push_at(0, (1, 30), 30).unwrap(); // late for the watermark of run 0
    harness.finish().unwrap();
    // One entry per run (every sink subtask of a run restored the same).
    let mut restored: Vec<_> = harness
        .watermarks()
        .iter()
        .map(|t| (t.run, t.restored))
        .collect();
    restored.dedup();
    assert_eq!(restored, [(0, None), (1, Some(90)), (2, Some(90))]);
    for trace in harness.watermarks() {
        assert!(
            trace.watermarks.iter().all(|(_, w)| *w >= 90) || trace.run == 0,
            "{trace:?}"
        );
    }
}

/// A broken word count: it keeps its counts in a map that outlives the query
/// (as an external cache would) instead of in checkpointed state. Records
/// replayed after a crash, which that map already counted, are counted twice.
struct LeakyCount(Arc<Mutex<HashMap<String, u64>>>);

impl Operator<String, (String, u64)> for LeakyCount {
    fn process(
        &mut self,
        record: Record<String>,
        out: &mut Collector<'_, (String, u64)>,
    ) -> Result<()> {
        let count = {
            let mut counts = self.0.lock().unwrap();
            let count = counts.entry(record.value.clone()).or_default();
            *count += 1;
            *count
        };
        out.emit((record.value, count))
    }
}

#[test]
fn the_harness_catches_an_operator_that_double_counts_after_a_restore() {
    let failure = try_check("leaky count", 32, runs(words(), None), |run| {
        let cache = Arc::new(Mutex::new(HashMap::new()));
        let mut harness = run
            .harness("leaky", move |_, words| {
                let cache = cache.clone();
                words
                    .transform("leaky_count", move |_| LeakyCount(cache.clone()))
                    .parallelism(1)
            })
            .configure(|config| config.allowlist_check(false));
        harness.run(&run.steps)?;
        reference::assert_same_multiset(
            harness.committed(),
            reference::running_counts(harness.input_values(), String::clone),
        )?;
        Ok(())
    })
    .expect_err("double counting after a restore is caught");
    eprintln!("caught, as it must be:\n{failure}");
    let steps = &failure.minimal_input.steps;
    assert!(steps.contains(&Step::Crash), "{failure}");
    assert!(
        steps.iter().any(|s| matches!(s, Step::Push { .. })),
        "{failure}"
    );
    let report = failure.to_string();
    assert!(report.contains("extra"), "{report}");
    assert!(report.contains("PROPTEST_RNG_SEED="), "{report}");
}

#[test]
fn the_testing_guide_shows_its_example_test_as_it_runs() {
    let guide = include_str!("../docs/guide/testing.md");
    assert!(
        guide.contains(include_str!("testing_guide.rs")),
        "docs/guide/testing.md must show tests/testing_guide.rs verbatim"
    );
}
