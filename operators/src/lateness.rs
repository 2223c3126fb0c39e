//! The watermark a stateful operator instance judges late records by
//! (windows, deduplication, stream joins), checkpointed with the state it
//! bounds.
//!
//! After a restore, lateness must be judged as it was at the barrier: a key the
//! checkpoint no longer holds was evicted because the watermark had passed it,
//! and a replayed record of that key must be late again rather than let through
//! as new. The query's restored watermark cannot serve: it is the sinks' lowest
//! at the barrier, which can trail the operator's own input watermark.
//!
//! So lateness is judged per key group, and each key group's watermark is
//! checkpointed with its keyed state: wherever the group's keys go next (an
//! instance after a parallelism change, another process of a cluster), the
//! group's records are judged by the watermark its windows were closed at,
//! even before the new owner's input has delivered a watermark (a clustered
//! run's operators start from none: its lanes report only as records flow).
//! The instance's own input watermark, the least over its lanes, is
//! checkpointed too; after a parallelism change an instance takes the least
//! of the old instances' (its keys may come from any), which only bounds what
//! it evicts: a group's own watermark decides what is late.
//!
//! A record a clustered query's repartition reader judged late already
//! ([`RecordMeta::late`]: behind the watermark it was written under and
//! every source partition still speaking) is late whatever the watermark
//! here, which may wait for a process that died.

use std::hash::Hash;

use rtflow_runtime::key_groups::{key_group, stable_hash};
use rtflow_runtime::state::{Image, KeyedState, StateSnapshot, SubtaskState, Table};
use rtflow_runtime::{EventTime, OperatorContext, RecordMeta, Result};

/// The name of an operator instance's input watermark within its operator.
const WATERMARK: &str = "watermark";
/// The name of the watermark per key group within an operator.
const GROUP_WATERMARKS: &str = "group-watermarks";

pub(crate) struct Lateness {
    /// The input watermark received so far; `EventTime::MIN` before the first.
    current: EventTime,
    state: SubtaskState<EventTime>,
    groups: GroupWatermarks,
}

/// The watermark of each key group an instance owns, as its records were
/// judged at the last barrier.
struct GroupWatermarks {
    watermarks: KeyedState<u32, EventTime>,
    /// The key groups the instance owns.
    owned: Vec<u32>,
    key_groups: usize,
    /// The highest watermark of a group restored: until the input watermark
    /// passes it, a record's lateness depends on its group.
    highest_restored: EventTime,
    /// The input watermark now, and when the groups were last brought up to it.
    input: EventTime,
    written: EventTime,
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
        let current = current.unwrap_or(EventTime::MIN);
        let watermarks: KeyedState<u32, EventTime> = ctx.state.per_key_group(GROUP_WATERMARKS)?;
        let highest_restored = watermarks.iter().map(|(_, w)| *w).max();
        Ok(Self {
            current,
            state,
            groups: GroupWatermarks {
                watermarks,
                owned: ctx.state.key_groups().collect(),
                key_groups: ctx.state.key_group_count(),
                highest_restored: highest_restored.unwrap_or(EventTime::MIN),
                input: current,
                written: current,
            },
        })
    }

    /// The input watermark: windows close and state is evicted by it.
    #[inline]
    pub(crate) fn watermark(&self) -> EventTime {
        self.current
    }

    /// The watermark a record of `key` with `meta` is judged by: the input
    /// watermark, or the one its key group had at the restored barrier if
    /// that is later; the end of time for a record judged late on its way
    /// ([`RecordMeta::late`]), which is behind every watermark.
    #[inline]
    pub(crate) fn watermark_of<K: Hash>(&self, key: &K, meta: &RecordMeta) -> EventTime {
        if meta.late {
            return EventTime::MAX;
        }
        let groups = &self.groups;
        if groups.highest_restored <= self.current {
            return self.current;
        }
        let group = key_group(stable_hash(key), groups.key_groups) as u32;
        let restored = groups.watermarks.get(&group).copied();
        restored.map_or(self.current, |w| w.max(self.current))
    }

    /// Whether a record of `key` with `meta` is behind its watermark.
    #[inline]
    pub(crate) fn is_late<K: Hash>(&self, key: &K, meta: &RecordMeta) -> bool {
        meta.event_time < self.watermark_of(key, meta)
    }

    /// Takes `watermark` if it is ahead; returns whether it was.
    pub(crate) fn advance(&mut self, watermark: EventTime) -> bool {
        if watermark <= self.current {
            return false;
        }
        self.current = watermark;
        self.groups.input = watermark;
        self.state.set(watermark);
        true
    }

    /// Declares the checkpointed states to `table` (see
    /// [`Operator::tables`](rtflow_runtime::Operator::tables)).
    pub(crate) fn tables(
        &mut self,
        table: &mut dyn FnMut(&mut dyn Table) -> Result<()>,
    ) -> Result<()> {
        table(&mut self.state)?;
        table(&mut self.groups)
    }
}

impl Table for GroupWatermarks {
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        if self.input > self.written {
            // Every group owned was judged by the input watermark at least.
            for group in &self.owned {
                let watermark = self
                    .watermarks
                    .get_or_insert_with(*group, || EventTime::MIN);
                *watermark = (*watermark).max(self.input);
            }
            self.written = self.input;
        }
        self.watermarks.begin_snapshot(out)
    }

    fn continue_snapshot(&mut self, budget: usize, out: &mut StateSnapshot) -> Result<bool> {
        self.watermarks.continue_snapshot(budget, out)
    }

    fn image(&self, keep: &dyn Fn(u32) -> bool) -> Result<Option<Image>> {
        Table::image(&self.watermarks, keep)
    }
}

#[cfg(test)]
mod tests {
    use rtflow_runtime::key_groups::{key_group, stable_hash};
    use rtflow_runtime::tester::{run, Emitted, OperatorTester, Step};
    use rtflow_runtime::{Collector, Operator, Record};

    use super::*;

    /// Passes on the records its watermark has not passed.
    struct Gate(Lateness);

    impl Operator<char, char> for Gate {
        fn process(&mut self, record: Record<char>, out: &mut Collector<'_, char>) -> Result<()> {
            if self.0.is_late(&record.value, &record.meta) {
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
            self.0.tables(table)
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
    fn a_record_judged_late_on_its_way_is_late_whatever_the_watermark() {
        use Step::{LateRecord, Record};
        let steps = [LateRecord('a', 5), Record('b', 5)];
        assert_eq!(run("gate", gate, steps), [Emitted::Record('b', 5)]);
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

    /// A key of each half of the key groups: the halves two instances own.
    fn keys_of_each_half() -> (char, char) {
        let half = |c: &char| key_group(stable_hash(c), 128) < 64;
        let first = ('a'..='z').find(half).unwrap();
        let second = ('a'..='z').find(|c| !half(c)).unwrap();
        (first, second)
    }

    #[test]
    fn after_a_rescale_each_key_group_keeps_the_watermark_it_was_judged_by() {
        let mut checkpoint = Vec::new();
        for (subtask, watermark) in [(0, 10), (1, 20)] {
            let mut old = OperatorTester::restored("gate", (subtask, 2), &[], gate).unwrap();
            old.watermark(watermark).unwrap();
            checkpoint.extend(old.barrier(1).unwrap());
        }
        let (first, second) = keys_of_each_half();
        let mut new = OperatorTester::restored("gate", (0, 1), &[checkpoint], gate).unwrap();
        new.record(first, 9).unwrap();
        // On time for the old instance 0, which owned the first half.
        new.record(first, 15).unwrap();
        // Late for the old instance 1, which owned the second half.
        new.record(second, 15).unwrap();
        new.record(second, 20).unwrap();
        assert_eq!(
            new.take(),
            [Emitted::Record(first, 15), Emitted::Record(second, 20)]
        );
    }

    #[test]
    fn a_new_owner_judges_a_group_by_its_watermark_before_its_input_has_one() {
        // As a clustered run's operator restores: keyed state only, no
        // watermark of its own until its lanes deliver one.
        let mut old = OperatorTester::restored("gate", (0, 1), &[], gate).unwrap();
        old.watermark(30).unwrap();
        let keyed_only = old
            .barrier(1)
            .unwrap()
            .into_iter()
            .filter(|delta| delta.keyed)
            .collect();
        let mut new = OperatorTester::restored("gate", (0, 1), &[keyed_only], gate).unwrap();
        let (first, second) = keys_of_each_half();
        new.record(first, 29).unwrap();
        new.record(second, 30).unwrap();
        assert_eq!(new.take(), [Emitted::Record(second, 30)]);
    }
}
