//! The operator model: a struct that implements [`Operator`] and writes only the
//! hooks it needs. The runtime calls the hooks from the actor's one loop.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use crate::cluster::handover::Bound;
use crate::error::{Result, RtflowError};
use crate::guard::Place;
use crate::metrics::{OperatorMetrics, Role};
use crate::record::{now_nanos, Epoch, EventTime, Record, RecordMeta};
use crate::state::{Restored, StateContext, StateSnapshot, Table};

/// Where the stateful operators of one actor put their snapshots at a barrier; the
/// actor sends them to the coordinator with its acknowledgement.
pub(crate) type SnapshotBuffer = Arc<Mutex<StateSnapshot>>;

/// Where an actor pushes what it produces: the next operator in the same actor
/// (chaining), the dispatcher to the next actors' mailboxes, or a sink.
///
/// Operator authors meet it only through [`Collector`].
pub trait Emit<T>: Send {
    /// Takes one record.
    fn record(&mut self, record: Record<T>) -> Result<()>;
    /// Takes a watermark that has advanced.
    fn watermark(&mut self, watermark: EventTime) -> Result<()>;
    /// Every source partition upstream is idle: the watermark should not wait for
    /// this stream until it sends a watermark again.
    fn idle(&mut self) -> Result<()>;
    /// Takes the barrier that ends `epoch`.
    fn barrier(&mut self, epoch: Epoch) -> Result<()>;
    /// Continues the snapshots taken at the last barrier by about `budget`
    /// entries each; returns whether all are complete.
    fn continue_snapshot(&mut self, _budget: usize) -> Result<bool> {
        Ok(true)
    }
    /// The actor drained what its mailbox held: push buffered records on now, so
    /// batching never waits for a batch to fill.
    fn flush(&mut self) -> Result<()>;
    /// Every input ended: finish, snapshot, flush and pass the end on. The end is
    /// the last barrier: what follows it is committed by the query's final epoch.
    fn end(&mut self) -> Result<()>;
    /// The actor reported its end to the coordinator: wait for what must follow
    /// (a sink's final commit) and release resources.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
    /// The actor is failing with `error`: release what is held, without output.
    fn abort(&mut self, error: &RtflowError);
}

/// Who an operator instance is, and where it gets its checkpointed state.
#[derive(Clone)]
pub struct OperatorContext {
    /// The operator's name in the dataflow.
    pub operator: String,
    /// This instance's index, `0..parallelism`.
    pub subtask: usize,
    /// How many instances the operator runs.
    pub parallelism: usize,
    /// The source partitions whose records reach this instance before any shuffle
    /// (what `with_watermark` waits for).
    pub source_partitions: Vec<u32>,
    /// The instance's state, as the last committed checkpoint left it.
    pub state: StateContext,
}

impl OperatorContext {
    /// The context of instance `subtask` of an operator run outside a query
    /// (operator tests and benchmarks): no state to restore.
    pub fn detached(kind: &str, subtask: usize, parallelism: usize) -> Self {
        Self {
            operator: format!("{kind}-0"),
            subtask,
            parallelism,
            source_partitions: vec![subtask as u32],
            state: StateContext::detached(kind, subtask, parallelism, 128),
        }
    }
}

/// The output handle an operator writes to; records emitted while processing a
/// record inherit its timestamps.
pub struct Collector<'a, T> {
    next: &'a mut dyn Emit<T>,
    meta: RecordMeta,
    counts: &'a mut Counts,
}

/// What an operator instance emitted and dropped as late since the counts were
/// last published.
#[derive(Default)]
pub(crate) struct Counts {
    out: u64,
    late: u64,
}

impl<'a, T> Collector<'a, T> {
    /// Emits `value` with the timestamps of the record being processed.
    #[inline]
    pub fn emit(&mut self, value: T) -> Result<()> {
        self.counts.out += 1;
        self.next.record(Record {
            value,
            meta: self.meta,
        })
    }

    /// Emits a record with timestamps of its own.
    #[inline]
    pub fn emit_record(&mut self, record: Record<T>) -> Result<()> {
        self.counts.out += 1;
        self.next.record(record)
    }

    /// The timestamps emitted records inherit.
    pub fn meta(&self) -> RecordMeta {
        self.meta
    }

    /// Counts a record dropped for arriving behind the watermark (the operator's
    /// `rtflow_late_records_total`).
    #[inline]
    pub fn drop_late(&mut self) {
        self.counts.late += 1;
    }

    /// Emits a watermark: no record with an earlier event time follows. For
    /// operators that generate watermarks, as `with_watermark` does.
    pub fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.next.watermark(watermark)
    }

    /// Declares the stream idle: downstream watermarks stop waiting for it until
    /// it emits a watermark again. For operators that generate watermarks.
    pub fn idle(&mut self) -> Result<()> {
        self.next.idle()
    }
}

/// A dataflow operator with one input: map, filter, join against a static table, ...
///
/// Only `process` is required; the other hooks default to doing nothing.
///
/// A hook that returns an error or panics fails the query (or its start, for
/// the factory and `on_start`): a panic as `OPERATOR_FAILED` naming the
/// operator and the panic's message; an error keeps its class and
/// says in which operator it arose. The query restarts from its last
/// checkpoint.
///
/// ```
/// use rtflow_runtime::{Collector, Operator, Record, Result};
///
/// /// Emits the running length of every string it sees.
/// struct RunningLength(usize);
///
/// impl Operator<String, usize> for RunningLength {
///     fn process(&mut self, record: Record<String>, out: &mut Collector<'_, usize>) -> Result<()> {
///         self.0 += record.value.len();
///         out.emit(self.0)
///     }
/// }
/// ```
pub trait Operator<In, Out>: Send + 'static {
    /// Whether instances keep state from one record to the next (start-time
    /// validation limits the shuffles in front of stateful operators).
    fn stateful() -> bool
    where
        Self: Sized,
    {
        false
    }

    /// Whether the operator is on real-time mode's allowlist. While
    /// [`QueryConfig::allowlist_check`](crate::QueryConfig::allowlist_check) is
    /// on, a query using an operator off it fails at start with
    /// `STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST`. rtflow's own
    /// operators are on it; one of your own is not unless it says so here.
    fn allowlisted() -> bool
    where
        Self: Sized,
    {
        false
    }

    /// Called once before the first record, when the query wires the actor
    /// (on the coordinator's thread).
    fn on_start(&mut self, _ctx: &OperatorContext) -> Result<()> {
        Ok(())
    }

    /// Called for every input record.
    fn process(&mut self, record: Record<In>, out: &mut Collector<'_, Out>) -> Result<()>;

    /// Called when the input watermark advances, before it is passed downstream.
    fn on_watermark(&mut self, _watermark: EventTime, _out: &mut Collector<'_, Out>) -> Result<()> {
        Ok(())
    }

    /// The event time of the earliest output the operator still owes for input
    /// that the watermark has passed, if any. The watermark passed downstream
    /// stays at or below it, so that output is not late there; it moves on as
    /// the hold does, after the records and flushes that release it. For an
    /// operator that spreads the work due at a watermark over the records after
    /// it instead of holding them all up.
    fn watermark_hold(&self) -> Option<EventTime> {
        None
    }

    /// Called when the actor drained its input, and every few milliseconds while it
    /// is idle: for work driven by time (processing-time timers, idle partitions,
    /// watermarks emitted once per batch rather than per record).
    fn on_flush(&mut self, _out: &mut Collector<'_, Out>) -> Result<()> {
        Ok(())
    }

    /// The checkpointed state the operator holds: calls `table` once with each
    /// [`Table`] it claimed from its [`StateContext`] (see [`crate::state`]).
    /// The runtime snapshots them at every barrier and once more after
    /// `on_close`; an operator that claimed more states than it declares here
    /// fails at start.
    fn tables(&mut self, _table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        Ok(())
    }

    /// Called at the barrier where the process's partitions change inside a
    /// run ([`Handover`](crate::cluster::Handover)), with the instance's
    /// context as it is from then on: for an operator that keeps no state but
    /// follows the source partitions reaching it, such as `with_watermark`.
    /// `starts_over`: the process adopted partitions, and event time starts
    /// over as in a new run (the watermarks so far did not wait for them). A
    /// stateful operator is made again from its state instead.
    fn on_hand_over(&mut self, _ctx: &OperatorContext, _starts_over: bool) -> Result<()> {
        Ok(())
    }

    /// Called once when every input has ended, before the end is passed downstream.
    fn on_close(&mut self, _out: &mut Collector<'_, Out>) -> Result<()> {
        Ok(())
    }
}

/// What makes an operator's instances, again for a rebuild.
pub(crate) type Remake<O> = Arc<dyn Fn(&OperatorContext) -> Result<O> + Send + Sync>;

/// The operator `make` makes in `ctx`, started, checked to declare every
/// state it claimed: its factory and hooks run under its `place`.
fn made<O: Operator<In, Out>, In, Out>(
    place: &Place,
    make: impl FnOnce(&OperatorContext) -> Result<O>,
    ctx: &OperatorContext,
) -> Result<O> {
    let mut operator = place.run("its factory", || make(ctx))?;
    place.run("on_start", || operator.on_start(ctx))?;
    let mut declared = 0;
    place.run("tables", || {
        operator.tables(&mut |_| {
            declared += 1;
            Ok(())
        })
    })?;
    let claimed = ctx.state.claims.load(std::sync::atomic::Ordering::Relaxed);
    if declared < claimed {
        return Err(RtflowError::Operator {
            operator: ctx.operator.clone(),
            subtask: ctx.subtask,
            message: format!(
                "it claimed {claimed} states from its StateContext but declares {declared} \
                 in Operator::tables ({}): its checkpoints would miss the others; declare \
                 every state it holds",
                std::any::type_name::<O>()
            ),
        });
    }
    Ok(operator)
}

/// An operator fused with whatever follows it in the same actor.
pub(crate) struct Chained<O, In, Out> {
    operator: O,
    /// The context the operator was made in, and what makes it again when a
    /// handover rebuilds it (`None`: it cannot be).
    ctx: OperatorContext,
    remake: Option<Remake<O>>,
    /// Where the operator's hooks run, for their failures.
    place: Place,
    next: Box<dyn Emit<Out>>,
    metrics: Arc<OperatorMetrics>,
    snapshots: SnapshotBuffer,
    records_in: u64,
    counts: Counts,
    /// The watermark received, and the one passed on: lower while the
    /// operator holds it back ([`Operator::watermark_hold`]).
    watermark_in: EventTime,
    watermark_out: EventTime,
    _input: PhantomData<fn(In)>,
}

impl<O: Operator<In, Out>, In, Out: 'static> Chained<O, In, Out> {
    /// The operator `make` makes in `ctx`, started: its factory and
    /// `on_start` run under its place.
    pub(crate) fn start(
        make: impl FnOnce(&OperatorContext) -> Result<O>,
        remake: Option<Remake<O>>,
        ctx: &OperatorContext,
        next: Box<dyn Emit<Out>>,
        metrics: Arc<OperatorMetrics>,
        snapshots: SnapshotBuffer,
    ) -> Result<Self> {
        let place = Place::new(Role::Operator, &ctx.operator, ctx.subtask);
        let operator = made(&place, make, ctx)?;
        Ok(Self {
            operator,
            ctx: ctx.clone(),
            remake,
            place,
            next,
            metrics,
            snapshots,
            records_in: 0,
            counts: Counts::default(),
            watermark_in: EventTime::MIN,
            watermark_out: EventTime::MIN,
            _input: PhantomData,
        })
    }

    /// Meets the handover at `epoch`'s barrier, after the snapshot. A
    /// stateful operator is made again from what it holds of the key groups
    /// it keeps and the state of those it adopts, as a restore from that
    /// checkpoint would make it, so that nothing derived from a group let go
    /// survives; another is told ([`Operator::on_hand_over`]). When the
    /// process adopts partitions, event time starts over as in a new run:
    /// the watermarks passed on so far were not waiting for them.
    fn hand_over(&mut self, epoch: Epoch, bound: &Bound) -> Result<()> {
        let reaching = bound.reaching(&self.ctx.state.uid, self.ctx.subtask);
        let starts_over = bound.reach.starts_over;
        if starts_over {
            self.watermark_in = EventTime::MIN;
            self.watermark_out = EventTime::MIN;
        }
        if !O::stateful() {
            self.ctx.source_partitions = reaching.to_vec();
            let (operator, ctx) = (&mut self.operator, &self.ctx);
            return self
                .place
                .run("on_hand_over", || operator.on_hand_over(ctx, starts_over));
        }
        let handover = &bound.handover;
        let cannot = |why: &str| RtflowError::Operator {
            operator: self.ctx.operator.clone(),
            subtask: self.ctx.subtask,
            message: format!("cannot take part in a handover of partitions inside a run: {why}"),
        };
        let Some(remake) = self.remake.clone() else {
            return Err(cannot("it was not made by a dataflow"));
        };
        let keep = |group: u32| handover.membership.owns_key_group(group);
        let mut states = BTreeMap::new();
        let mut imageless = false;
        {
            let mut snapshot = self.snapshots.lock().expect("snapshots are never poisoned");
            let operator = &mut self.operator;
            self.place.watch(|| {
                operator.tables(&mut |table| {
                    table.continue_snapshot(usize::MAX, &mut snapshot)?;
                    match table.image(&keep)? {
                        // What an instance holds for itself, its watermark
                        // among it, a new run would not restore either.
                        Some(image) if image.keyed || !starts_over => {
                            states.insert(image.id, image.state);
                        }
                        Some(_) => {}
                        None => imageless = true,
                    }
                    Ok(())
                })
            })?;
        }
        if imageless {
            return Err(cannot("one of its tables has no image (Table::image)"));
        }
        let uid = &self.ctx.state.uid;
        let adopted = handover
            .adopted
            .iter()
            .filter(|(id, _)| id.operator == *uid);
        for (id, adopted) in adopted {
            let blobs = adopted.blobs.iter().cloned();
            match states.get_mut(id) {
                Some(held) => held.blobs.extend(blobs),
                None => {
                    states.insert(id.clone(), adopted.clone());
                }
            }
        }
        let before = &self.ctx.state.restored;
        let watermark = Some(self.watermark_in)
            .filter(|w| *w > EventTime::MIN)
            .or(before.watermark)
            .filter(|_| !starts_over);
        let mut restored = Restored::new(
            states,
            Some(epoch),
            watermark,
            before.run_id.clone(),
            before.key_groups,
        );
        restored.cluster = Some(handover.membership.clone());
        restored.handovers = before.handovers.clone();
        let mut ctx = self.ctx.clone();
        ctx.source_partitions = reaching.to_vec();
        ctx.state.restored = Arc::new(restored);
        ctx.state.claims = Arc::default();
        self.operator = made(&self.place, |ctx| remake(ctx), &ctx)?;
        self.ctx = ctx;
        Ok(())
    }

    /// Runs the operator's `hook` watched as its [`Place`], with
    /// `meta` for what it emits.
    #[inline]
    fn run_hook(
        &mut self,
        meta: RecordMeta,
        hook: impl FnOnce(&mut O, &mut Collector<'_, Out>) -> Result<()>,
    ) -> Result<()> {
        let watch = self.place.enter();
        let mut out = Collector {
            next: &mut *self.next,
            meta,
            counts: &mut self.counts,
        };
        let result = hook(&mut self.operator, &mut out);
        watch.end();
        result.map_err(|error| self.place.locate(error))
    }

    /// Runs a hook that is not about one record; what it emits is stamped now.
    fn out_of_band(
        &mut self,
        event_time: EventTime,
        hook: impl FnOnce(&mut O, &mut Collector<'_, Out>) -> Result<()>,
    ) -> Result<()> {
        let now = now_nanos();
        let meta = RecordMeta {
            event_time,
            source_time: now,
            ingest_time: now,
            partition: 0,
            behind: false,
            late: false,
        };
        self.run_hook(meta, hook)
    }

    /// Passes on the received watermark, or the operator's hold if that is
    /// earlier, when it has advanced past what was passed on.
    fn pass_watermark(&mut self) -> Result<()> {
        let watermark = match self.operator.watermark_hold() {
            Some(hold) => hold.min(self.watermark_in),
            None => self.watermark_in,
        };
        if watermark <= self.watermark_out {
            return Ok(());
        }
        self.watermark_out = watermark;
        self.next.watermark(watermark)
    }

    /// Passes on what the operator's hold has released since, if it holds
    /// back a watermark it received: after each record, flush and the close.
    #[inline]
    fn release_held_watermark(&mut self) -> Result<()> {
        if self.watermark_out < self.watermark_in {
            self.pass_watermark()?;
        }
        Ok(())
    }

    fn snapshot(&mut self) -> Result<()> {
        let mut snapshot = self.snapshots.lock().expect("snapshots are never poisoned");
        let rows_before = snapshot.rows;
        let operator = &mut self.operator;
        self.place
            .watch(|| operator.tables(&mut |table| table.begin_snapshot(&mut snapshot)))?;
        if O::stateful() {
            self.metrics.set_state(snapshot.rows.since(rows_before));
        }
        Ok(())
    }

    fn publish_counts(&mut self) {
        let counts = std::mem::take(&mut self.counts);
        self.metrics.add(self.records_in, counts.out);
        self.metrics.add_late(counts.late);
        self.records_in = 0;
    }
}

impl<O: Operator<In, Out>, In, Out: 'static> Emit<In> for Chained<O, In, Out> {
    #[inline]
    fn record(&mut self, record: Record<In>) -> Result<()> {
        self.records_in += 1;
        self.run_hook(record.meta, |op, out| op.process(record, out))?;
        self.release_held_watermark()
    }

    fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.out_of_band(watermark, |op, out| op.on_watermark(watermark, out))?;
        self.watermark_in = watermark;
        self.pass_watermark()
    }

    fn idle(&mut self) -> Result<()> {
        self.next.idle()
    }

    fn barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.snapshot()?;
        if let Some(bound) = self.ctx.state.restored.handovers.at(epoch) {
            self.hand_over(epoch, &bound)?;
        }
        self.next.barrier(epoch)
    }

    fn continue_snapshot(&mut self, budget: usize) -> Result<bool> {
        let mut snapshot = self.snapshots.lock().expect("snapshots are never poisoned");
        let mut done = true;
        let operator = &mut self.operator;
        self.place.watch(|| {
            operator.tables(&mut |table| {
                done &= table.continue_snapshot(budget, &mut snapshot)?;
                Ok(())
            })
        })?;
        drop(snapshot);
        Ok(self.next.continue_snapshot(budget)? && done)
    }

    fn flush(&mut self) -> Result<()> {
        self.out_of_band(EventTime::MIN, |op, out| op.on_flush(out))?;
        self.release_held_watermark()?;
        self.publish_counts();
        self.next.flush()
    }

    fn end(&mut self) -> Result<()> {
        self.out_of_band(EventTime::MAX, |op, out| op.on_close(out))?;
        self.release_held_watermark()?;
        self.snapshot()?;
        self.publish_counts();
        self.next.end()
    }

    fn finish(&mut self) -> Result<()> {
        self.next.finish()
    }

    fn abort(&mut self, error: &crate::RtflowError) {
        self.next.abort(error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Owes one output per time the watermark passed, and pays one per record
    /// or flush, earliest first.
    #[derive(Default)]
    struct Owing {
        due: Vec<EventTime>,
        scheduled: Vec<EventTime>,
    }

    impl Owing {
        fn pay_one(&mut self, out: &mut Collector<'_, u32>) -> Result<()> {
            match self.due.pop() {
                Some(time) => out.emit(time as u32),
                None => Ok(()),
            }
        }
    }

    impl Operator<u32, u32> for Owing {
        fn process(&mut self, record: Record<u32>, out: &mut Collector<'_, u32>) -> Result<()> {
            self.pay_one(out)?;
            self.scheduled.push(record.value as EventTime);
            Ok(())
        }
        fn on_watermark(
            &mut self,
            watermark: EventTime,
            _out: &mut Collector<'_, u32>,
        ) -> Result<()> {
            let (due, later) = self.scheduled.iter().partition(|t| **t < watermark);
            self.scheduled = later;
            self.due.extend::<Vec<_>>(due);
            self.due.sort_by(|a, b| b.cmp(a));
            Ok(())
        }
        fn watermark_hold(&self) -> Option<EventTime> {
            self.due.last().copied()
        }
        fn on_flush(&mut self, out: &mut Collector<'_, u32>) -> Result<()> {
            self.pay_one(out)
        }
        fn on_close(&mut self, out: &mut Collector<'_, u32>) -> Result<()> {
            while !self.due.is_empty() {
                self.pay_one(out)?;
            }
            Ok(())
        }
    }

    #[test]
    fn a_held_watermark_follows_the_output_the_operator_still_owes() {
        use crate::tester::{run, Emitted, Step};
        let steps = [
            Step::Record(10, 10),
            Step::Record(20, 20),
            Step::Record(30, 30),
            // 10 and 20 fall due: the watermark waits at the earliest, 10.
            Step::Watermark(25),
            Step::Record(40, 40),
            Step::Flush,
            // Nothing owed: the watermark catches up, once.
            Step::Flush,
            Step::Watermark(26),
            // 30 and 40 fall due; the close pays both and releases the watermark.
            Step::Watermark(50),
            Step::End,
        ];
        // The order of outputs and watermarks is what the hold decides.
        let seen: Vec<(char, EventTime)> = run("owing", |_| Ok(Owing::default()), steps)
            .into_iter()
            .map(|emitted| match emitted {
                Emitted::Record(value, _) => ('r', EventTime::from(value)),
                Emitted::Watermark(watermark) => ('w', watermark),
            })
            .collect();
        let expected = [
            ('w', 10),
            ('r', 10),
            ('w', 20),
            ('r', 20),
            ('w', 25),
            ('w', 26),
            ('w', 30),
            ('r', 30),
            ('r', 40),
            ('w', 50),
        ];
        assert_eq!(seen, expected);
    }
}
