//! [`OperatorTester`]: one operator instance driven outside a query, as its
//! actor would drive it (records, watermarks, flushes, barriers, the end), with
//! what it emits recorded in order. Operator unit tests write their inputs and
//! expected outputs as small tables, in the RisingWave style: a list of
//! [`Step`]s, and what [`run`] says the operator emitted over them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rtflow_checkpoint::snapshot::{blob_ref, decode_blob, encode_blob};
pub use rtflow_checkpoint::Delta;
use rtflow_checkpoint::{RestoredState, StateId};

use crate::error::{Result, RtflowError};
use crate::metrics::OperatorMetrics;
use crate::operator::{Chained, Emit, Operator, OperatorContext, SnapshotBuffer};
use crate::record::{Epoch, EventTime, Record, RecordMeta};
use crate::state::Restored;

/// What an operator under test emitted, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Emitted<T> {
    /// A record's value, with its event time.
    Record(T, EventTime),
    /// A watermark passed on.
    Watermark(EventTime),
}

/// Drives one operator instance and records its output.
///
/// ```
/// use rtflow_runtime::tester::{Emitted, OperatorTester};
/// use rtflow_runtime::{Collector, Operator, Record, Result};
///
/// struct Double;
///
/// impl Operator<u32, u32> for Double {
///     fn process(&mut self, record: Record<u32>, out: &mut Collector<'_, u32>) -> Result<()> {
///         out.emit(record.value * 2)
///     }
/// }
///
/// let mut double = OperatorTester::new("double", |_| Ok(Double))?;
/// double.record(21, 1_000)?;
/// double.watermark(900)?;
/// assert_eq!(double.take(), [Emitted::Record(42, 1_000), Emitted::Watermark(900)]);
/// # Ok::<(), rtflow_runtime::RtflowError>(())
/// ```
pub struct OperatorTester<In, Out> {
    chain: Box<dyn Emit<In>>,
    emitted: Arc<Mutex<Vec<Emitted<Out>>>>,
    snapshots: SnapshotBuffer,
    ctx: OperatorContext,
}

impl<In: Send + 'static, Out: Send + 'static> OperatorTester<In, Out> {
    /// Instance 0 of 1 of an operator of `kind`, made by `make` as a query's
    /// factory would be called, with nothing restored.
    pub fn new<O: Operator<In, Out>>(
        kind: &str,
        make: impl FnOnce(&OperatorContext) -> Result<O>,
    ) -> Result<Self> {
        Self::with_context(OperatorContext::detached(kind, 0, 1), make)
    }

    /// Instance `subtask` of `parallelism` of an operator of `kind`, made by
    /// `make` with the state that `checkpoints` (oldest first, as
    /// [`barrier`](Self::barrier) and [`end`](Self::end) returned them, from
    /// any instances) hold: what a restart from the last of them gives it, at
    /// this parallelism.
    pub fn restored<O: Operator<In, Out>>(
        kind: &str,
        (subtask, parallelism): (usize, usize),
        checkpoints: &[Vec<Delta>],
        make: impl FnOnce(&OperatorContext) -> Result<O>,
    ) -> Result<Self> {
        let mut states: BTreeMap<StateId, RestoredState> = BTreeMap::new();
        for (epoch, deltas) in (1..).zip(checkpoints) {
            for delta in deltas {
                let bytes = encode_blob(&delta.entries);
                let reference = blob_ref(epoch, delta.part, 0, &bytes);
                let blob = decode_blob(&delta.state, reference, bytes)
                    .map_err(|e| RtflowError::Checkpoint(e.to_string()))?;
                states
                    .entry(delta.state.clone())
                    .or_insert_with(|| RestoredState {
                        meta: delta.meta.clone(),
                        blobs: Vec::new(),
                    })
                    .blobs
                    .push(blob);
            }
        }
        let mut ctx = OperatorContext::detached(kind, subtask, parallelism);
        let key_groups = ctx.state.restored.key_groups;
        ctx.state.restored = Arc::new(Restored::new(states, Some(1), None, None, key_groups));
        Self::with_context(ctx, make)
    }

    /// An instance made in `ctx`.
    pub fn with_context<O: Operator<In, Out>>(
        ctx: OperatorContext,
        make: impl FnOnce(&OperatorContext) -> Result<O>,
    ) -> Result<Self> {
        let emitted = Arc::new(Mutex::new(Vec::new()));
        let snapshots = SnapshotBuffer::default();
        let chain = Chained::start(
            make,
            None,
            &ctx,
            Box::new(Recorder(emitted.clone())),
            Arc::new(OperatorMetrics::default()),
            snapshots.clone(),
        )?;
        Ok(Self {
            chain: Box::new(chain),
            emitted,
            snapshots,
            ctx,
        })
    }

    /// The context the instance was made in.
    pub fn context(&self) -> &OperatorContext {
        &self.ctx
    }

    /// Processes `value` with event time `event_time`.
    pub fn record(&mut self, value: In, event_time: EventTime) -> Result<()> {
        self.judged_record(value, event_time, false)
    }

    /// Processes `value` with event time `event_time`, judged late on its way
    /// ([`RecordMeta::late`]), as a clustered query's repartition reader
    /// passes on a record behind the watermark it came under.
    pub fn late_record(&mut self, value: In, event_time: EventTime) -> Result<()> {
        self.judged_record(value, event_time, true)
    }

    fn judged_record(&mut self, value: In, event_time: EventTime, late: bool) -> Result<()> {
        self.chain.record(Record {
            value,
            meta: RecordMeta {
                event_time,
                source_time: 0,
                ingest_time: 0,
                partition: 0,
                behind: false,
                late,
            },
        })
    }

    /// The input watermark advances to `watermark`.
    pub fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.chain.watermark(watermark)
    }

    /// The actor drained its mailbox.
    pub fn flush(&mut self) -> Result<()> {
        self.chain.flush()
    }

    /// The barrier of `epoch`: returns what the checkpoint stores of the
    /// operator's declared state, the changes since the previous barrier.
    pub fn barrier(&mut self, epoch: Epoch) -> Result<Vec<Delta>> {
        self.chain.barrier(epoch)?;
        self.complete_snapshot()
    }

    /// Every input ended: the operator closes; returns its last snapshot.
    pub fn end(&mut self) -> Result<Vec<Delta>> {
        self.chain.end()?;
        self.complete_snapshot()
    }

    fn complete_snapshot(&mut self) -> Result<Vec<Delta>> {
        while !self.chain.continue_snapshot(usize::MAX)? {}
        let snapshot = std::mem::take(&mut *self.snapshots.lock().expect("never poisoned"));
        Ok(snapshot.into_deltas())
    }

    /// What the operator emitted since the last call, in order.
    pub fn take(&mut self) -> Vec<Emitted<Out>> {
        std::mem::take(&mut *self.emitted.lock().expect("never poisoned"))
    }

    /// The values of the records among [`take`](Self::take), in order.
    pub fn take_values(&mut self) -> Vec<Out> {
        self.take()
            .into_iter()
            .filter_map(|emitted| match emitted {
                Emitted::Record(value, _) => Some(value),
                Emitted::Watermark(_) => None,
            })
            .collect()
    }
}

/// One step of a table-driven operator test. Later versions may add steps.
#[non_exhaustive]
pub enum Step<T> {
    /// A record with its event time.
    Record(T, EventTime),
    /// A record with its event time, judged late on its way
    /// ([`OperatorTester::late_record`]).
    LateRecord(T, EventTime),
    Watermark(EventTime),
    /// The actor drained its mailbox.
    Flush,
    /// A checkpoint barrier; epochs count from 1.
    Barrier,
    /// The instance is lost: a new one is restored from the barriers (and
    /// end) so far, as a restart from the last of them would.
    Restore,
    /// Every input ended; the last snapshot counts as a checkpoint.
    End,
}

/// What an instance of the operator `make` makes emits over `steps`, in
/// order: records with their event times, and the watermarks passed on. A
/// test tool: panics if the operator fails.
pub fn run<In, Out, O>(
    kind: &str,
    make: impl Fn(&OperatorContext) -> Result<O>,
    steps: impl IntoIterator<Item = Step<In>>,
) -> Vec<Emitted<Out>>
where
    In: Send + 'static,
    Out: Send + 'static,
    O: Operator<In, Out>,
{
    let mut tester = OperatorTester::new(kind, &make).unwrap();
    let mut checkpoints = Vec::new();
    let mut emitted = Vec::new();
    for step in steps {
        match step {
            Step::Record(value, time) => tester.record(value, time).unwrap(),
            Step::LateRecord(value, time) => tester.late_record(value, time).unwrap(),
            Step::Watermark(watermark) => tester.watermark(watermark).unwrap(),
            Step::Flush => tester.flush().unwrap(),
            Step::Barrier => {
                let epoch = checkpoints.len() as u64 + 1;
                checkpoints.push(tester.barrier(epoch).unwrap());
            }
            Step::Restore => {
                emitted.extend(tester.take());
                tester = OperatorTester::restored(kind, (0, 1), &checkpoints, &make).unwrap();
            }
            Step::End => checkpoints.push(tester.end().unwrap()),
        }
    }
    emitted.extend(tester.take());
    emitted
}

/// The end of the tester's chain.
struct Recorder<T>(Arc<Mutex<Vec<Emitted<T>>>>);

impl<T: Send> Emit<T> for Recorder<T> {
    fn record(&mut self, record: Record<T>) -> Result<()> {
        let emitted = Emitted::Record(record.value, record.meta.event_time);
        self.0.lock().expect("never poisoned").push(emitted);
        Ok(())
    }

    fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        let emitted = Emitted::Watermark(watermark);
        self.0.lock().expect("never poisoned").push(emitted);
        Ok(())
    }

    fn idle(&mut self) -> Result<()> {
        Ok(())
    }

    fn barrier(&mut self, _epoch: Epoch) -> Result<()> {
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        Ok(())
    }

    fn abort(&mut self, _error: &RtflowError) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::Collector;
    use crate::state::{KeyedState, Table};

    /// Counts records per word.
    struct Count(KeyedState<String, u64>);

    impl Operator<String, (String, u64)> for Count {
        fn process(
            &mut self,
            record: Record<String>,
            out: &mut Collector<'_, (String, u64)>,
        ) -> Result<()> {
            let count = self.0.get_or_insert_with(record.value.clone(), || 0);
            *count += 1;
            let count = *count;
            out.emit((record.value, count))
        }

        fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
            table(&mut self.0)
        }
    }

    fn count(ctx: &OperatorContext) -> Result<Count> {
        Ok(Count(ctx.state.keyed("counts")?))
    }

    #[test]
    fn a_restored_instance_goes_on_from_the_snapshots_taken() {
        let mut first = OperatorTester::new("count", count).unwrap();
        for word in ["a", "b", "a"] {
            first.record(word.to_owned(), 0).unwrap();
        }
        let epoch_1 = first.barrier(1).unwrap();
        first.record("b".to_owned(), 0).unwrap();
        let epoch_2 = first.barrier(2).unwrap();
        let entries: usize = epoch_2.iter().map(|delta| delta.entries.len()).sum();
        assert_eq!(entries, 1, "only what changed since the barrier");

        // Every key lands in one of two instances, with its count.
        let checkpoints = [epoch_1, epoch_2];
        let mut counts = Vec::new();
        for subtask in 0..2 {
            let mut restored =
                OperatorTester::restored("count", (subtask, 2), &checkpoints, count).unwrap();
            for word in ["a", "b"] {
                restored.record(word.to_owned(), 0).unwrap();
            }
            counts.extend(restored.take_values());
        }
        counts.sort();
        // Each instance restored one key's count (2) and meets the other
        // key afresh: the tester routes nothing.
        let expected = [("a", 1), ("a", 3), ("b", 1), ("b", 3)];
        assert_eq!(counts, expected.map(|(word, n)| (word.to_owned(), n)));
    }
}
