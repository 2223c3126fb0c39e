//! The keyed process operator: value, list and map state per key, TTL expiry in
//! processing time, processing-time and event-time timers, and exactly the same
//! results after stops and restarts as an uninterrupted batch reference.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{checkpointed, wait_for_rows, TIMEOUT};
use proptest::prelude::*;
use rtflow::checkpoint::{CheckpointStore, StateId};
use rtflow::operators::process::{ListState, MapState, StateDeclarations, ValueState};
use rtflow::prelude::*;

/// The rows per key, each key's in order.
fn per_key<K: Ord + Clone, V: Clone>(rows: &[(K, V)]) -> BTreeMap<K, Vec<V>> {
    let mut keys: BTreeMap<K, Vec<V>> = BTreeMap::new();
    for (key, value) in rows {
        keys.entry(key.clone()).or_default().push(value.clone());
    }
    keys
}

const COUNT: ValueState<u64> = ValueState::new("count");
const WORDS: ListState<String> = ListState::new("words");
const PER_WORD: MapState<String, u32> = MapState::new("per-word");

/// Per key: the number of records (value), the words in order (list) and how
/// often each came (map); "reset" clears all three.
#[derive(Default)]
struct WordHistory;

/// What [`WordHistory`] emits per record: count, words, per-word counts.
type History = (u64, Vec<String>, Vec<(String, u32)>);

impl KeyedProcessor<char, (char, String), (char, History)> for WordHistory {
    fn init(&mut self, states: &mut StateDeclarations<'_, char>) -> Result<()> {
        states.declare(&COUNT)?;
        states.declare(&WORDS)?;
        states.declare(&PER_WORD)
    }

    fn handle_input(
        &mut self,
        key: &char,
        (_, word): (char, String),
        ctx: &mut ProcessContext<'_, '_, char, (char, History)>,
    ) -> Result<()> {
        if word == "reset" {
            ctx.value(&COUNT).clear();
            ctx.list(&WORDS).clear();
            ctx.map(&PER_WORD).clear();
            return ctx.emit((*key, (0, vec![], vec![])));
        }
        let count = ctx.value(&COUNT).get().copied().unwrap_or(0) + 1;
        ctx.value(&COUNT).set(count);
        ctx.list(&WORDS).push(word.clone());
        let mut per_word = ctx.map(&PER_WORD);
        let seen = per_word.get(&word).copied().unwrap_or(0);
        per_word.insert(word, seen + 1);
        let words = ctx.list(&WORDS).iter().cloned().collect();
        let per_word = ctx
            .map(&PER_WORD)
            .iter()
            .map(|(w, n)| (w.clone(), *n))
            .collect();
        ctx.emit((*key, (count, words, per_word)))
    }
}

#[test]
fn value_list_and_map_state_are_per_key_and_survive_a_restart() {
    let input = MemorySource::new(2);
    let start = |out: &MemorySink<(char, History)>| {
        let flow = Dataflow::new("history");
        flow.source(input.clone())
            .key_by(|(key, _): &(char, String)| *key)
            .process(WordHistory::default)
            .parallelism(2)
            .sink(out.clone());
        flow
    };
    let config = checkpointed("history");
    let word = |key: char, word: &str| (key, word.to_string());
    let first = MemorySink::new();
    let query = start(&first).start(config.clone()).unwrap();
    input
        .push_all(0, [word('a', "x"), word('a', "y"), word('a', "x")])
        .unwrap();
    input.push_all(1, [word('b', "z")]).unwrap();
    wait_for_rows(&first, 4);
    query.stop().unwrap();
    drop(query);

    // The restarted query goes on from the checkpointed states.
    let second = MemorySink::new();
    let query = start(&second).start(config).unwrap();
    input
        .push_all(0, [word('a', "y"), word('a', "reset"), word('a', "w")])
        .unwrap();
    input.push_all(1, [word('b', "z")]).unwrap();
    input.end();
    assert_eq!(query.await_termination(Some(TIMEOUT)), Ok(true));

    let owned = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let counts = |pairs: &[(&str, u32)]| {
        pairs
            .iter()
            .map(|(w, n)| (w.to_string(), *n))
            .collect::<Vec<_>>()
    };
    let mut rows = first.rows();
    rows.extend(second.rows());
    let keys = per_key(&rows);
    assert_eq!(
        keys[&'a'],
        [
            (1, owned(&["x"]), counts(&[("x", 1)])),
            (2, owned(&["x", "y"]), counts(&[("x", 1), ("y", 1)])),
            (3, owned(&["x", "y", "x"]), counts(&[("x", 2), ("y", 1)])),
            (
                4,
                owned(&["x", "y", "x", "y"]),
                counts(&[("x", 2), ("y", 2)])
            ),
            (0, vec![], vec![]),
            (1, owned(&["w"]), counts(&[("w", 1)])),
        ]
    );
    assert_eq!(
        keys[&'b'],
        [
            (1, owned(&["z"]), counts(&[("z", 1)])),
            (2, owned(&["z", "z"]), counts(&[("z", 2)])),
        ]
    );
}

const TTL: Duration = Duration::from_millis(800);
const LAST: ValueState<u32> = ValueState::new("last").with_ttl(TTL);
const RECENT: ListState<u32> = ListState::new("recent").with_ttl(TTL);
const SEEN: MapState<u32, ()> = MapState::new("seen").with_ttl(TTL);

/// Emits what each key still holds in its TTL states, then records the value.
#[derive(Default)]
struct Expiring;

/// The live value, list length and map length a record found.
type Held = (Option<u32>, usize, usize);

impl KeyedProcessor<char, (char, u32), (char, Held)> for Expiring {
    fn init(&mut self, states: &mut StateDeclarations<'_, char>) -> Result<()> {
        states.declare(&LAST)?;
        states.declare(&RECENT)?;
        states.declare(&SEEN)
    }

    fn handle_input(
        &mut self,
        key: &char,
        (_, value): (char, u32),
        ctx: &mut ProcessContext<'_, '_, char, (char, Held)>,
    ) -> Result<()> {
        let held = (
            ctx.value(&LAST).get().copied(),
            ctx.list(&RECENT).len(),
            ctx.map(&SEEN).len(),
        );
        ctx.value(&LAST).set(value);
        ctx.list(&RECENT).push(value);
        ctx.map(&SEEN).insert(value, ());
        ctx.emit((*key, held))
    }
}

/// How many entries of `state` of the process operator the last checkpoint at
/// `location` holds.
fn checkpointed_entries(location: &std::path::Path, state: &str) -> usize {
    let mut store = CheckpointStore::open(location, 10).unwrap();
    let recovery = store.recover().unwrap();
    recovery
        .state
        .get(&StateId::new("process-0", state))
        .map_or(0, |s| s.entries().len())
}

#[test]
fn ttl_state_expires_in_processing_time_and_is_swept_from_the_checkpoint() {
    let input = MemorySource::new(1);
    let out = MemorySink::new();
    let flow = Dataflow::new("ttl");
    flow.source(input.clone())
        .key_by(|(key, _): &(char, u32)| *key)
        .process(Expiring::default)
        .sink(out.clone());
    let config = checkpointed("ttl");
    let location = config.checkpoint_location.clone().unwrap();
    let query = flow.start(config).unwrap();
    // Back to back, well within the TTL.
    input.push_all(0, [('a', 1), ('a', 2), ('b', 1)]).unwrap();
    wait_for_rows(&out, 3);
    std::thread::sleep(TTL + Duration::from_millis(400));
    input.push_all(0, [('a', 3)]).unwrap();
    wait_for_rows(&out, 4);
    query.stop().unwrap();
    drop(query);

    let keys = per_key(&out.rows());
    assert_eq!(
        keys[&'a'],
        [(None, 0, 0), (Some(1), 1, 1), (None, 0, 0)],
        "the third record came after everything expired"
    );
    assert_eq!(keys[&'b'], [(None, 0, 0)]);
    // 'b' was never touched again: the sweep deleted its state and its sweep
    // timer; 'a' holds only what the last record wrote.
    for state in ["value/last", "list/recent", "map/seen", "timers"] {
        assert_eq!(checkpointed_entries(&location, state), 1, "{state}");
    }
}

/// Registers, per record `(key, delays)`, one timer per delay: event-time
/// timers `delay` after the record's event time, or processing-time timers
/// `delay` ms from now; a negative delay deletes the timer of its absolute value.
/// Every timer that fires is emitted with its key.
struct Timers {
    event_time: bool,
}

impl KeyedProcessor<char, (char, i64, Vec<i64>), (char, Timer)> for Timers {
    fn handle_input(
        &mut self,
        _key: &char,
        (_, _, delays): (char, i64, Vec<i64>),
        ctx: &mut ProcessContext<'_, '_, char, (char, Timer)>,
    ) -> Result<()> {
        let base = if self.event_time {
            ctx.event_time()
        } else {
            ctx.processing_time()
        };
        for delay in delays {
            let time = base + delay.abs();
            let timer = if self.event_time {
                Timer::EventTime(time)
            } else {
                Timer::ProcessingTime(time)
            };
            if delay < 0 {
                ctx.delete_timer(timer);
            } else {
                ctx.register_timer(timer);
            }
        }
        Ok(())
    }

    fn on_timer(
        &mut self,
        key: &char,
        timer: Timer,
        ctx: &mut ProcessContext<'_, '_, char, (char, Timer)>,
    ) -> Result<()> {
        assert!(
            !ctx.timers().contains(&timer),
            "a firing timer is no longer registered"
        );
        if let Timer::EventTime(time) = timer {
            assert_eq!(ctx.event_time(), time, "emitted at the timer's time");
            assert!(ctx.watermark() >= Some(time));
        }
        ctx.emit((*key, timer))
    }
}

fn timers_query(
    input: &MemorySource<(char, i64, Vec<i64>)>,
    event_time: bool,
    config: QueryConfig,
) -> (StreamingQuery, MemorySink<(char, Timer)>) {
    let flow = Dataflow::new("timers");
    let out = MemorySink::new();
    flow.source(input.clone())
        .with_watermark(|(_, time, _): &(char, i64, Vec<i64>)| *time, Duration::ZERO)
        .key_by(|(key, _, _)| *key)
        .process(move || Timers { event_time })
        .sink(out.clone());
    (flow.start(config).unwrap(), out)
}

#[test]
fn event_time_timers_fire_in_order_once_the_watermark_passes_them() {
    let input = MemorySource::new(1);
    let config = checkpointed("event-timers");
    let (query, out) = timers_query(&input, true, config.clone());
    input
        .push_all(
            0,
            [
                ('a', 100, vec![50, 20, 200, 30, -30]),
                ('b', 100, vec![10, 10]),
            ],
        )
        .unwrap();
    // Watermark 160: a's 120 and 150 and b's 110 are due, 300 is not; the
    // deleted 130 never fires.
    input.push_all(0, [('c', 160, vec![])]).unwrap();
    let rows = wait_for_rows(&out, 3);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(out.len(), 3, "{:?}", out.rows());
    let keys = per_key(&rows);
    assert_eq!(keys[&'a'], [Timer::EventTime(120), Timer::EventTime(150)]);
    assert_eq!(
        keys[&'b'],
        [Timer::EventTime(110)],
        "registered twice, fires once"
    );
    query.stop().unwrap();
    drop(query);

    // The pending timer is in the checkpoint: it fires after the restart.
    let (query, out) = timers_query(&input, true, config);
    input.push_all(0, [('c', 400, vec![])]).unwrap();
    assert_eq!(wait_for_rows(&out, 1), [('a', Timer::EventTime(300))]);
    query.stop().unwrap();
}

#[test]
fn processing_time_timers_fire_in_order_and_across_a_restart() {
    let input = MemorySource::new(1);
    let config = checkpointed("processing-timers");
    let (query, out) = timers_query(&input, false, config.clone());
    let start = rtflow::runtime::record::nanos_to_event_time(rtflow::runtime::record::now_nanos());
    input
        .push_all(0, [('a', 0, vec![300, 100, 200, -200, 3_000])])
        .unwrap();
    let rows = wait_for_rows(&out, 2);
    let fired: Vec<i64> = rows.iter().map(|(_, timer)| timer.time() - start).collect();
    assert!(
        matches!(rows.as_slice(), [('a', Timer::ProcessingTime(first)), ('a', Timer::ProcessingTime(second))] if second - first == 200),
        "100 then 300, the deleted 200 never: {rows:?}"
    );
    assert!(fired[0] >= 100, "not before their time: {fired:?}");
    query.stop().unwrap();
    drop(query);
    assert_eq!(out.len(), 2, "the 3 s timer is still pending");

    let (query, out) = timers_query(&input, false, config);
    let rows = wait_for_rows(&out, 1);
    assert!(
        matches!(rows.as_slice(), [('a', Timer::ProcessingTime(time))] if *time - start >= 3_000),
        "{rows:?}"
    );
    query.stop().unwrap();
}

/// Sessions end after this much event time without a record of their key.
const GAP: i64 = 100;
const START: ValueState<i64> = ValueState::new("start");
const TIMES: ListState<i64> = ListState::new("times");

/// Per-key sessionization: `(key, event time)` records, a session per run of
/// records less than [`GAP`] apart, emitted as `(key, (start, end, records))`
/// once the watermark or a later record of the key passes its end plus the gap.
#[derive(Default)]
struct Sessions;

type Session = (i64, i64, usize);

impl Sessions {
    /// Emits the key's open session and forgets it.
    fn close(key: u32, ctx: &mut ProcessContext<'_, '_, u32, (u32, Session)>) -> Result<()> {
        let Some(start) = ctx.value(&START).clear() else {
            return Ok(());
        };
        let times = ctx.list(&TIMES).clear();
        let end = *times.last().expect("a session has records");
        ctx.emit((key, (start, end, times.len())))
    }
}

impl KeyedProcessor<u32, (u32, i64), (u32, Session)> for Sessions {
    fn init(&mut self, states: &mut StateDeclarations<'_, u32>) -> Result<()> {
        states.declare(&START)?;
        states.declare(&TIMES)
    }

    fn handle_input(
        &mut self,
        key: &u32,
        (_, time): (u32, i64),
        ctx: &mut ProcessContext<'_, '_, u32, (u32, Session)>,
    ) -> Result<()> {
        if let Some(&last) = ctx.list(&TIMES).iter().last() {
            ctx.delete_timer(Timer::EventTime(last + GAP));
            if time >= last + GAP {
                Self::close(*key, ctx)?;
            }
        }
        if ctx.value(&START).get().is_none() {
            ctx.value(&START).set(time);
        }
        ctx.list(&TIMES).push(time);
        ctx.register_timer(Timer::EventTime(time + GAP));
        Ok(())
    }

    fn on_timer(
        &mut self,
        key: &u32,
        _timer: Timer,
        ctx: &mut ProcessContext<'_, '_, u32, (u32, Session)>,
    ) -> Result<()> {
        Self::close(*key, ctx)
    }
}

/// The batch reference: each key's sessions, from its event times in order.
fn reference_sessions(records: &[(u32, i64)]) -> BTreeMap<u32, Vec<Session>> {
    let mut sessions: BTreeMap<u32, Vec<Session>> = BTreeMap::new();
    for (key, time) in records {
        let key_sessions = sessions.entry(*key).or_default();
        match key_sessions.last_mut() {
            Some((_, end, count)) if *time < *end + GAP => {
                *end = *time;
                *count += 1;
            }
            _ => key_sessions.push((*time, *time, 1)),
        }
    }
    sessions
}

/// One step of a run: a record, or a stop and restart of the query.
#[derive(Debug, Clone)]
enum Step {
    /// A record of key `key` (which lives in partition `key % 2`), `advance`
    /// event-time ms after its partition's previous record.
    Record {
        key: u32,
        advance: i64,
    },
    Restart,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => (0u32..6, 0i64..2 * GAP).prop_map(|(key, advance)| Step::Record { key, advance }),
        1 => Just(Step::Restart),
    ];
    prop::collection::vec(step, 1..40)
}

/// Keys of the records that end a run: one per partition, far ahead in event
/// time, so the final watermark passes every real session's end.
const LAST_KEYS: [u32; 2] = [1_000, 1_001];

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, max_shrink_iters: 16, ..ProptestConfig::default() })]

    #[test]
    fn sessions_after_restarts_equal_the_batch_reference(steps in steps()) {
        let input = MemorySource::new(2);
        let config = checkpointed("sessions");
        let start = |out: &MemorySink<(u32, Session)>| {
            let flow = Dataflow::new("sessions");
            flow.source(input.clone())
                // One reader for both partitions, so the watermark the sessions
                // see is the minimum over the partitions, also while a stop ends
                // the readers one by one.
                .parallelism(1)
                .with_watermark(|(_, time): &(u32, i64)| *time, Duration::ZERO)
                .key_by(|(key, _)| *key)
                .process(Sessions::default)
                .parallelism(2)
                .sink(out.clone());
            flow.start(config.clone()).unwrap()
        };
        let mut outputs = vec![MemorySink::new()];
        let mut query = start(&outputs[0]);
        let mut clocks = [0i64; 2];
        let mut records = Vec::new();
        for step in &steps {
            match step {
                Step::Record { key, advance } => {
                    let partition = (*key % 2) as usize;
                    clocks[partition] += advance;
                    records.push((*key, clocks[partition]));
                    input.push(partition, (*key, clocks[partition])).unwrap();
                }
                Step::Restart => {
                    query.stop().unwrap();
                    drop(query);
                    outputs.push(MemorySink::new());
                    query = start(outputs.last().unwrap());
                }
            }
        }
        let end = clocks.iter().max().unwrap() + 10 * GAP;
        for (partition, key) in LAST_KEYS.iter().enumerate() {
            input.push(partition, (*key, end)).unwrap();
        }
        input.end();
        prop_assert_eq!(query.await_termination(Some(TIMEOUT)), Ok(true));

        let rows: Vec<_> = outputs.iter().flat_map(|out| out.rows()).collect();
        prop_assert_eq!(per_key(&rows), reference_sessions(&records));
    }
}
