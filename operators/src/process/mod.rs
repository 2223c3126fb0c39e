//! The keyed process operator, in the spirit of Spark's `transformWithState` and
//! Flink's `KeyedProcessFunction`: after `key_by`, a [`KeyedProcessor`] handles
//! each record with its key's named value, list and map states (optionally with a
//! processing-time TTL), registers event-time and processing-time timers, and
//! emits any number of records, from records and from timers.
//!
//! Everything a processor keeps between calls lives in checkpointed keyed state:
//! each declared state is its own [`KeyedState`](rtflow_runtime::KeyedState), and
//! the timers are one more, indexed by time in memory. After a crash, the operator
//! continues exactly where the last committed checkpoint left it, pending timers
//! included; fields of the processor itself are not checkpointed.
//!
//! - Event-time timers fire, in time order, when the operator's input watermark
//!   reaches them (a timer at `t` fires once the watermark is `>= t`), before the
//!   watermark goes downstream. One registered at or before the current watermark
//!   fires at the next watermark.
//! - Processing-time timers fire when the actor has drained its input or, while
//!   it is idle, every few milliseconds: within about 20 ms of their time.
//! - The end of the input does not fire pending timers: `stop()` ends the input
//!   too, and a restarted query must find them pending.
//! - Records behind the watermark are handed to the processor like any other;
//!   [`ProcessContext::watermark`] lets it decide, as Flink leaves it to the
//!   function.
//!
//! ```
//! use std::time::Duration;
//! use rtflow_connectors::{MemorySink, MemorySource};
//! use rtflow_operators::process::{KeyedProcessExt, KeyedProcessor, ProcessContext, StateDeclarations, Timer, ValueState};
//! use rtflow_runtime::{Dataflow, QueryConfig, Result};
//!
//! /// Counts each user's clicks and reports the count once the user was quiet
//! /// for 10 s of event time.
//! #[derive(Default)]
//! struct ClicksPerVisit;
//!
//! const CLICKS: ValueState<u64> = ValueState::new("clicks");
//! const VISIT_END: ValueState<i64> = ValueState::new("visit-end");
//!
//! impl KeyedProcessor<String, (String, i64), (String, u64)> for ClicksPerVisit {
//!     fn init(&mut self, states: &mut StateDeclarations<'_, String>) -> Result<()> {
//!         states.declare(&CLICKS)?;
//!         states.declare(&VISIT_END)
//!     }
//!
//!     fn handle_input(
//!         &mut self,
//!         user: &String,
//!         (_, time): (String, i64),
//!         ctx: &mut ProcessContext<'_, '_, String, (String, u64)>,
//!     ) -> Result<()> {
//!         if let Some(end) = ctx.value(&VISIT_END).get().copied() {
//!             ctx.delete_timer(Timer::EventTime(end));
//!             // The watermark has not reached the end yet, but this click has.
//!             if time >= end {
//!                 let clicks = ctx.value(&CLICKS).clear().unwrap_or(0);
//!                 ctx.emit((user.clone(), clicks))?;
//!             }
//!         }
//!         let mut clicks = ctx.value(&CLICKS);
//!         let count = clicks.get().copied().unwrap_or(0) + 1;
//!         clicks.set(count);
//!         ctx.value(&VISIT_END).set(time + 10_000);
//!         ctx.register_timer(Timer::EventTime(time + 10_000));
//!         Ok(())
//!     }
//!
//!     fn on_timer(
//!         &mut self,
//!         user: &String,
//!         _timer: Timer,
//!         ctx: &mut ProcessContext<'_, '_, String, (String, u64)>,
//!     ) -> Result<()> {
//!         ctx.value(&VISIT_END).clear();
//!         let clicks = ctx.value(&CLICKS).clear().unwrap_or(0);
//!         ctx.emit((user.clone(), clicks))
//!     }
//! }
//!
//! let flow = Dataflow::new("visits");
//! let clicks = MemorySource::new(1);
//! let visits = MemorySink::new();
//! flow.source(clicks.clone())
//!     .with_watermark(|(_, time): &(String, i64)| *time, Duration::ZERO)
//!     .key_by(|(user, _)| user.clone())
//!     .process(ClicksPerVisit::default)
//!     .sink(visits.clone());
//! let dir = std::env::temp_dir().join("rtflow-doc-process");
//! # let _ = std::fs::remove_dir_all(&dir);
//! let query = flow.start(QueryConfig::new("visits").checkpoint_location(dir))?;
//! let ann = |time| ("ann".to_string(), time);
//! clicks.push_all(0, [ann(1_000), ann(4_000), ann(30_000), ann(50_000)])?;
//! clicks.end();
//! query.await_termination(Some(Duration::from_secs(10)))?;
//! // The last visit is still open: the watermark stopped at 50 s.
//! assert_eq!(visits.rows(), [("ann".to_string(), 2), ("ann".to_string(), 1)]);
//! # Ok::<(), rtflow_runtime::RtflowError>(())
//! ```

mod state;
mod timers;

use std::marker::PhantomData;
use std::sync::Arc;

use rtflow_runtime::record::{nanos_to_event_time, now_nanos};
use rtflow_runtime::state::Table;
use rtflow_runtime::{
    Collector, Data, EventTime, KeyedStream, Operator, OperatorContext, Record, RecordMeta, Result,
    RtflowError, StateContext, Stream,
};

use self::state::{AnyState, Declared, Slot};
pub use self::state::{
    Cell, ListAccess, ListKind, ListState, MapAccess, MapKind, MapState, Stamped, StateKind,
    StateSpec, ValueAccess, ValueKind, ValueState,
};
pub use self::timers::{ProcessingTime, Timer};
use self::timers::{Queue, Timers};
use crate::{StateKey, StateValue};

/// A user's per-key logic: what to do with each record of a key, and when one of
/// the key's timers fires. One instance runs per operator instance, for all the
/// keys it owns; keep what must survive a restart in declared states, not in
/// fields. See the [module documentation](self) for an example.
pub trait KeyedProcessor<K, In, Out>: Send + 'static {
    /// Declares the states the processor uses, once per instance before the first
    /// record. A state is restored from the checkpoint under its name; a
    /// declaration removed since the checkpoint fails the restart, as a removed
    /// stateful operator does.
    fn init(&mut self, _states: &mut StateDeclarations<'_, K>) -> Result<()> {
        Ok(())
    }

    /// Handles one record of `key`.
    fn handle_input(
        &mut self,
        key: &K,
        record: In,
        ctx: &mut ProcessContext<'_, '_, K, Out>,
    ) -> Result<()>;

    /// Handles a timer of `key` that fired; it is no longer registered.
    fn on_timer(
        &mut self,
        _key: &K,
        _timer: Timer,
        _ctx: &mut ProcessContext<'_, '_, K, Out>,
    ) -> Result<()> {
        Ok(())
    }
}

/// Where [`KeyedProcessor::init`] declares its states.
pub struct StateDeclarations<'a, K> {
    ctx: &'a StateContext,
    states: &'a mut Vec<Box<dyn AnyState<K>>>,
}

impl<K: StateKey> StateDeclarations<'_, K> {
    /// Declares `spec`, restoring what the checkpoint holds for it. Names are
    /// unique within the operator.
    pub fn declare<S: StateKind>(&mut self, spec: &StateSpec<S>) -> Result<()> {
        if self.states.iter().any(|s| s.name() == spec.name()) {
            return Err(RtflowError::InvalidDataflow(format!(
                "the process operator declares state '{}' twice; give each state its own name",
                spec.name()
            )));
        }
        let declared: Declared<K, S::Cell> = Declared::claim(self.ctx, spec)?;
        self.states.push(Box::new(declared));
        Ok(())
    }
}

/// Everything an instance keeps: the declared states and the timers.
struct Store<K> {
    states: Vec<Box<dyn AnyState<K>>>,
    timers: Timers<K>,
}

impl<K: StateKey> Store<K> {
    /// Deletes what of `key` expired by `now` in every state, and schedules the
    /// next sweep of the key if anything is left to expire.
    fn sweep(&mut self, key: &K, now: ProcessingTime) {
        let next = self
            .states
            .iter_mut()
            .filter_map(|s| s.sweep(key, now))
            .min();
        if let Some(next) = next {
            self.timers.schedule_sweep(key, next);
        }
    }
}

/// What a [`KeyedProcessor`] sees of the current key and the operator while it
/// handles a record or a timer: the key's states and timers, the clocks, and
/// where to emit.
pub struct ProcessContext<'a, 'o, K, Out> {
    key: &'a K,
    store: &'a mut Store<K>,
    out: &'a mut Collector<'o, Out>,
    /// The timestamps of what is emitted.
    meta: RecordMeta,
    watermark: Option<EventTime>,
    now: ProcessingTime,
}

impl<K: StateKey, Out> ProcessContext<'_, '_, K, Out> {
    /// The key being handled.
    pub fn key(&self) -> &K {
        self.key
    }

    /// The event time of what is handled: the record's, or an event-time timer's
    /// time; for a processing-time timer, the watermark. Emitted records carry it.
    pub fn event_time(&self) -> EventTime {
        self.meta.event_time
    }

    /// The operator's input watermark (restored from the checkpoint after a
    /// restart), `None` before the first one.
    pub fn watermark(&self) -> Option<EventTime> {
        self.watermark
    }

    /// The wall-clock time, in ms since the Unix epoch: for a record, when the
    /// operator began the batch of records it came in (the actor takes up to a
    /// few dozen messages at a time); for a timer, when it fired.
    pub fn processing_time(&self) -> ProcessingTime {
        self.now
    }

    /// Emits `value` with the timestamps of what is handled.
    pub fn emit(&mut self, value: Out) -> Result<()> {
        self.out.emit_record(Record {
            value,
            meta: self.meta,
        })
    }

    /// Registers `timer` for the current key; the same timer twice fires once.
    pub fn register_timer(&mut self, timer: Timer) {
        self.store.timers.register(self.key, timer);
    }

    /// Deletes the current key's `timer`, if registered.
    pub fn delete_timer(&mut self, timer: Timer) {
        self.store.timers.delete(self.key, timer);
    }

    /// The current key's registered timers, event-time first, each in time order.
    pub fn timers(&self) -> Vec<Timer> {
        self.store.timers.list(self.key)
    }

    /// The current key's value in `spec`.
    ///
    /// # Panics
    ///
    /// If `spec` was not declared in [`KeyedProcessor::init`] (with these types).
    pub fn value<V: StateValue>(&mut self, spec: &ValueState<V>) -> ValueAccess<'_, K, V> {
        ValueAccess(self.slot(spec))
    }

    /// The current key's list in `spec`.
    ///
    /// # Panics
    ///
    /// If `spec` was not declared in [`KeyedProcessor::init`] (with these types).
    pub fn list<V: StateValue>(&mut self, spec: &ListState<V>) -> ListAccess<'_, K, V> {
        ListAccess(self.slot(spec))
    }

    /// The current key's map in `spec`.
    ///
    /// # Panics
    ///
    /// If `spec` was not declared in [`KeyedProcessor::init`] (with these types).
    pub fn map<UK, UV>(&mut self, spec: &MapState<UK, UV>) -> MapAccess<'_, K, UK, UV>
    where
        UK: Ord + StateValue,
        UV: StateValue,
    {
        MapAccess(self.slot(spec))
    }

    fn slot<S: StateKind>(&mut self, spec: &StateSpec<S>) -> Slot<'_, K, S::Cell> {
        let Store { states, timers } = &mut *self.store;
        let state = states
            .iter_mut()
            .find(|s| s.name() == spec.name())
            .unwrap_or_else(|| {
                panic!(
                    "state '{}' is used but not declared in KeyedProcessor::init",
                    spec.name()
                )
            });
        let declared = state
            .as_any()
            .downcast_mut::<Declared<K, S::Cell>>()
            .unwrap_or_else(|| {
                panic!(
                    "state '{}' is used with other types than it was declared with",
                    spec.name()
                )
            });
        declared.slot(self.key, timers, self.now)
    }
}

/// The keyed process operator: runs a [`KeyedProcessor`] per key (see the
/// [module documentation](self)).
pub struct KeyedProcess<K, In, Out, P> {
    key: Arc<dyn Fn(&In) -> K + Send + Sync>,
    processor: P,
    store: Store<K>,
    watermark: Option<EventTime>,
    /// The processing time of the batch of records being handled, read at its
    /// first record: a clock read per record cost a sixth of a busy operator.
    batch_time: Option<ProcessingTime>,
    _out: PhantomData<fn() -> Out>,
}

impl<K, In, Out, P> KeyedProcess<K, In, Out, P>
where
    K: StateKey,
    P: KeyedProcessor<K, In, Out>,
{
    /// The operator running `processor` on the keys `key` reads, with the
    /// states the processor declares and its timers restored by `ctx`.
    pub fn new(
        key: Arc<dyn Fn(&In) -> K + Send + Sync>,
        mut processor: P,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        let mut states = Vec::new();
        processor.init(&mut StateDeclarations {
            ctx: &ctx.state,
            states: &mut states,
        })?;
        Ok(Self {
            key,
            processor,
            store: Store {
                states,
                timers: Timers::start(&ctx.state)?,
            },
            watermark: ctx.state.restored_watermark(),
            batch_time: None,
            _out: PhantomData,
        })
    }

    /// Fires the timers of `queue` due by `upto`, earliest first, including those
    /// registered while firing.
    fn fire(&mut self, queue: Queue, upto: i64, out: &mut Collector<'_, Out>) -> Result<()> {
        let store = &mut self.store;
        let now = nanos_to_event_time(now_nanos());
        while let Some((time, key)) = store.timers.pop(queue, upto) {
            let (timer, event_time) = match queue {
                Queue::Sweep => {
                    store.sweep(&key, now);
                    continue;
                }
                Queue::Event => (Timer::EventTime(time), time),
                Queue::Processing => (
                    Timer::ProcessingTime(time),
                    self.watermark.unwrap_or(EventTime::MIN),
                ),
            };
            let meta = RecordMeta {
                event_time,
                ..out.meta()
            };
            let mut ctx = ProcessContext {
                key: &key,
                store,
                out,
                meta,
                watermark: self.watermark,
                now,
            };
            self.processor.on_timer(&key, timer, &mut ctx)?;
        }
        Ok(())
    }
}

impl<K, In, Out, P> Operator<In, Out> for KeyedProcess<K, In, Out, P>
where
    K: StateKey,
    In: Data,
    Out: Data,
    P: KeyedProcessor<K, In, Out>,
{
    fn allowlisted() -> bool {
        true
    }

    fn stateful() -> bool {
        true
    }

    fn process(&mut self, record: Record<In>, out: &mut Collector<'_, Out>) -> Result<()> {
        let store = &mut self.store;
        let key = (self.key)(&record.value);
        let mut ctx = ProcessContext {
            key: &key,
            store,
            out,
            meta: record.meta,
            watermark: self.watermark,
            now: *self
                .batch_time
                .get_or_insert_with(|| nanos_to_event_time(now_nanos())),
        };
        self.processor.handle_input(&key, record.value, &mut ctx)
    }

    fn on_watermark(&mut self, watermark: EventTime, out: &mut Collector<'_, Out>) -> Result<()> {
        self.watermark = Some(watermark);
        self.fire(Queue::Event, watermark, out)
    }

    fn on_flush(&mut self, out: &mut Collector<'_, Out>) -> Result<()> {
        self.batch_time = None;
        let now = nanos_to_event_time(now_nanos());
        self.fire(Queue::Processing, now, out)?;
        self.fire(Queue::Sweep, now, out)
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        for state in &mut self.store.states {
            table(state.table())?;
        }
        table(self.store.timers.table())
    }
}

/// The keyed process operator as a builder method on a keyed stream.
pub trait KeyedProcessExt<K: StateKey, T: Data> {
    /// Runs the processor `factory` makes (one per operator instance) on every
    /// record of every key; its emitted records form the returned stream. See
    /// the [module documentation](self).
    fn process<Out: Data, P>(&self, factory: impl Fn() -> P + Send + Sync + 'static) -> Stream<Out>
    where
        P: KeyedProcessor<K, T, Out>;
}

impl<K: StateKey, T: Data> KeyedProcessExt<K, T> for KeyedStream<K, T> {
    fn process<Out: Data, P>(&self, factory: impl Fn() -> P + Send + Sync + 'static) -> Stream<Out>
    where
        P: KeyedProcessor<K, T, Out>,
    {
        let key = self.key_fn();
        self.as_ref().try_transform("process", move |ctx| {
            KeyedProcess::new(key.clone(), factory(), ctx)
        })
    }
}

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{self, Barrier, End, Record, Restore, Watermark};

    const COUNT: ValueState<u64> = ValueState::new("count");

    /// Counts each user's records and reports the count 10 ms of event time
    /// after the first, starting over then.
    struct CountFor10Ms;

    impl KeyedProcessor<String, &'static str, (String, u64)> for CountFor10Ms {
        fn init(&mut self, states: &mut StateDeclarations<'_, String>) -> Result<()> {
            states.declare(&COUNT)
        }

        fn handle_input(
            &mut self,
            _user: &String,
            _record: &'static str,
            ctx: &mut ProcessContext<'_, '_, String, (String, u64)>,
        ) -> Result<()> {
            let mut count = ctx.value(&COUNT);
            let next = count.get().copied().unwrap_or(0) + 1;
            count.set(next);
            if next == 1 {
                let end = ctx.event_time() + 10;
                ctx.register_timer(Timer::EventTime(end));
            }
            Ok(())
        }

        fn on_timer(
            &mut self,
            user: &String,
            _timer: Timer,
            ctx: &mut ProcessContext<'_, '_, String, (String, u64)>,
        ) -> Result<()> {
            let count = ctx.value(&COUNT).clear().unwrap_or(0);
            ctx.emit((user.clone(), count))
        }
    }

    fn counts(steps: impl IntoIterator<Item = Step<&'static str>>) -> Vec<Emitted<(String, u64)>> {
        let user: Arc<dyn Fn(&&'static str) -> String + Send + Sync> =
            Arc::new(|user| user.to_string());
        run(
            "process",
            |ctx| KeyedProcess::new(user.clone(), CountFor10Ms, ctx),
            steps,
        )
    }

    fn report(user: &str, count: u64, time: EventTime) -> Emitted<(String, u64)> {
        Emitted::Record((user.to_owned(), count), time)
    }

    #[test]
    fn a_timer_fires_once_the_watermark_reaches_it_before_the_watermark_goes_on() {
        let steps = [
            Record("ann", 0),
            Record("ann", 3),
            Record("bob", 5),
            Watermark(9),
            Watermark(10),
            Record("ann", 12),
            Watermark(15),
        ];
        let expected = [
            Emitted::Watermark(9),
            report("ann", 2, 10),
            Emitted::Watermark(10),
            report("bob", 1, 15),
            Emitted::Watermark(15),
        ];
        assert_eq!(counts(steps), expected);
    }

    #[test]
    fn a_timer_registered_behind_the_watermark_fires_at_the_next_one() {
        // The record is late, but the processor decides what to do with it.
        let steps = [Watermark(20), Record("ann", 5), Watermark(21)];
        let expected = [
            Emitted::Watermark(20),
            report("ann", 1, 15),
            Emitted::Watermark(21),
        ];
        assert_eq!(counts(steps), expected);
    }

    #[test]
    fn a_restored_instance_goes_on_from_the_states_and_timers_of_the_last_barrier() {
        let steps = [
            Record("ann", 0),
            Barrier,
            // Lost with the instance: the count goes on from 1.
            Record("ann", 4),
            Restore,
            Record("ann", 5),
            Watermark(10),
        ];
        let expected = [report("ann", 2, 10), Emitted::Watermark(10)];
        assert_eq!(counts(steps), expected);
    }

    #[test]
    fn the_end_leaves_pending_timers_for_the_restarted_query() {
        let steps = [Record("ann", 0), End, Restore, Watermark(10)];
        let expected = [report("ann", 1, 10), Emitted::Watermark(10)];
        assert_eq!(counts(steps), expected);
    }
}
