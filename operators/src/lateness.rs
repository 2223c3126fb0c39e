//! The input watermark a stateful operator instance judges late records by
//! (windows, deduplication, stream joins), checkpointed with the state it bounds.
//!
//! After a restore, lateness must be judged as it was at the barrier: a key the
//! checkpoint no longer holds was evicted because the watermark had passed it,
//! and a replayed record of that key must be late again rather than let through
//! as new. The query's restored watermark cannot serve: it is the sinks' lowest
//! at the barrier, which can trail the operator's own input watermark.
//!
//! So each instance checkpoints the watermark it received. Watermarks travel in
//! band and every instance after a shuffle reads every upstream lane, so at an
//! aligned barrier all instances hold the same one. After a parallelism change
//! an instance restores the least of the old instances' watermarks (all of
//! them, not only those of the old instances it replaces: its keys may come
//! from any); the least never drops a record the old instances would have
//! taken.

use rtflow_runtime::state::{StateSnapshot, SubtaskState, Table};
use rtflow_runtime::{EventTime, OperatorContext, Result};

/// The name of an operator instance's watermark within its operator.
const WATERMARK: &str = "watermark";

pub(crate) struct Lateness {
    /// The watermark received so far; `EventTime::MIN` before the first.
    current: EventTime,
    state: SubtaskState<EventTime>,
}

impl Lateness {
    pub(crate) fn restore(ctx: &OperatorContext) -> Result<Self> {
        let restored = ctx
            .state
            .restored_by_every_subtask::<EventTime>(WATERMARK)?;
        let mut state = ctx.state.per_subtask(WATERMARK)?;
        let current = restored.iter().map(|(_, watermark)| *watermark).min();
        if let Some(watermark) = current {
            state.set(watermark);
        }
        Ok(Self {
            current: current.unwrap_or(EventTime::MIN),
            state,
        })
    }

    /// The watermark: records before it are late.
    #[inline]
    pub(crate) fn watermark(&self) -> EventTime {
        self.current
    }

    /// Whether a record at `time` is behind the watermark.
    #[inline]
    pub(crate) fn is_late(&self, time: EventTime) -> bool {
        time < self.current
    }

    /// Takes `watermark` if it is ahead; returns whether it was.
    pub(crate) fn advance(&mut self, watermark: EventTime) -> bool {
        if watermark <= self.current {
            return false;
        }
        self.current = watermark;
        self.state.set(watermark);
        true
    }
}

impl Table for Lateness {
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.state.snapshot(out)
    }
}

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::{run, Emitted, OperatorTester, Step};
    use rtflow_runtime::{Collector, Operator, Record};

    use super::*;

    /// Passes on the records its watermark has not passed.
    struct Gate(Lateness);

    impl Operator<char, char> for Gate {
        fn process(&mut self, record: Record<char>, out: &mut Collector<'_, char>) -> Result<()> {
            if self.0.is_late(record.meta.event_time) {
                out.drop_late();
                return Ok(());
            }
            out.emit_record(record)
        }

        fn on_watermark(
            &mut self,
            watermark: EventTime,
            _: &mut Collector<'_, char>,
        ) -> Result<()> {
            self.0.advance(watermark);
            Ok(())
        }

        fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
            table(&mut self.0)
        }
    }

    fn gate(ctx: &OperatorContext) -> Result<Gate> {
        Ok(Gate(Lateness::restore(ctx)?))
    }

    #[test]
    fn a_record_at_the_watermark_is_on_time_and_one_before_it_is_late() {
        use Step::{Record, Watermark};
        let steps = [
            Record('a', 5),
            Watermark(10),
            Record('b', 9),
            Record('c', 10),
        ];
        let expected = [
            Emitted::Record('a', 5),
            Emitted::Watermark(10),
            Emitted::Record('c', 10),
        ];
        assert_eq!(run("gate", gate, steps), expected);
    }

    #[test]
    fn a_restored_instance_judges_lateness_by_the_watermark_of_the_barrier() {
        use Step::{Barrier, Record, Restore, Watermark};
        // The watermark after the barrier is lost with the instance: records
        // between the two are on time again, as they are replayed.
        let steps = [
            Watermark(10),
            Barrier,
            Watermark(20),
            Restore,
            Record('a', 9),
            Record('b', 15),
        ];
        let expected = [
            Emitted::Watermark(10),
            Emitted::Watermark(20),
            Emitted::Record('b', 15),
        ];
        assert_eq!(run("gate", gate, steps), expected);
    }

    #[test]
    fn after_a_rescale_an_instance_takes_the_least_watermark_of_the_old_ones() {
        let mut checkpoint = Vec::new();
        for (subtask, watermark) in [(0, 10), (1, 20)] {
            let mut old = OperatorTester::restored("gate", (subtask, 2), &[], gate).unwrap();
            old.watermark(watermark).unwrap();
            checkpoint.extend(old.barrier(1).unwrap());
        }
        let mut new = OperatorTester::restored("gate", (0, 1), &[checkpoint], gate).unwrap();
        new.record('a', 9).unwrap();
        // Late for the old instance 1, but instance 0 would have taken it.
        new.record('b', 15).unwrap();
        assert_eq!(new.take(), [Emitted::Record('b', 15)]);
    }
}
