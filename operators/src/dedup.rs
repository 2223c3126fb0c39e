//! Deduplication on checkpointed keyed state: the first record of each key goes
//! through, later ones with the same key are dropped.
//!
//! Both operators keep, per key, the time until which its duplicates are dropped,
//! and forget the key once the watermark passes that time:
//!
//! - [`drop_duplicates`](DedupExt::drop_duplicates), as Spark's `dropDuplicates`
//!   with a watermark: a key is kept until the watermark passes the event time of
//!   its first occurrence. Put the event time in the key (Spark's advice), so a
//!   duplicate that arrives after the key was forgotten is behind the watermark
//!   and dropped as late. Without a watermark no key is ever forgotten.
//! - [`drop_duplicates_within_watermark`](DedupExt::drop_duplicates_within_watermark),
//!   as Spark 3.5's `dropDuplicatesWithinWatermark`: a key is kept until the
//!   watermark passes its first occurrence's event time plus `delay`, so records
//!   whose event times lie within `delay` of the first are dropped however they
//!   arrive; the key need not hold the event time.
//!
//! Records behind the watermark are dropped and counted as late before either
//! looks at them. rtflow's watermark `w` promises no record earlier than `w`, so
//! a record at `w` is on time and a key is forgotten once its time is `< w`
//! (Spark's promise and comparisons are one millisecond stricter: `<= w`).
//!
//! A watermark evicts a slice of the keys it expires; the rest go a few per
//! record after it, so the records behind a watermark that expires many keys
//! do not wait for all of them. Until then an expired key counts as absent.

use std::sync::Arc;
use std::time::Duration;

use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{
    Collector, Data, EventTime, Operator, OperatorContext, Record, Result, Stream,
};

use crate::aggregate::{StateKey, StateValue};
use crate::expiry::{Expiries, EVICT_PER_RECORD, EVICT_PER_WATERMARK};
use crate::lateness::Lateness;

/// The kind (allowlist and checkpoint name) of `drop_duplicates`.
pub const DROP_DUPLICATES: &str = "drop_duplicates";
/// The kind of `drop_duplicates_within_watermark`.
pub const DROP_DUPLICATES_WITHIN_WATERMARK: &str = "drop_duplicates_within_watermark";

/// The name of the deduplication state within its operator.
const SEEN: &str = "seen";
/// The deduplication operator: per key, the event time until which duplicates
/// are dropped, in keyed state.
pub struct DropDuplicates<K, T> {
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
    /// How long after its first occurrence's event time a key is kept (ms).
    keep: i64,
    /// Per key: the event time its first occurrence was seen at plus `keep`.
    seen: KeyedState<K, EventTime>,
    /// When each key is due, built from `seen` at the first watermark.
    expiries: Option<Expiries<K>>,
    lateness: Lateness,
}

impl<K: StateKey, T> DropDuplicates<K, T> {
    /// Deduplicates by `key`, keeping each key until the watermark passes its
    /// first occurrence's event time plus `keep`; `ctx` restores what it saw.
    pub fn new(
        key: Arc<dyn Fn(&T) -> K + Send + Sync>,
        keep: Duration,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Ok(Self {
            key,
            keep: keep.as_millis() as i64,
            seen: ctx.state.keyed(SEEN)?,
            expiries: None,
            lateness: Lateness::restore(ctx)?,
        })
    }

    /// Forgets at most `budget` of the keys whose time the watermark passed.
    /// Evicting them all at once held up the records behind the watermark.
    fn evict(&mut self, budget: usize) {
        let Some(expiries) = &mut self.expiries else {
            return;
        };
        let (seen, watermark) = (&mut self.seen, self.lateness.watermark());
        expiries.expire(watermark, budget, |key| {
            // A key seen again since it was scheduled holds a later time.
            if seen.get(&key).is_some_and(|until| *until < watermark) {
                seen.remove(&key);
            }
        });
    }
}

impl<K: StateKey, T: Data> Operator<T, T> for DropDuplicates<K, T> {
    fn allowlisted() -> bool {
        true
    }

    fn stateful() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<T>, out: &mut Collector<'_, T>) -> Result<()> {
        if self.expiries.as_ref().is_some_and(Expiries::behind) {
            self.evict(EVICT_PER_RECORD);
        }
        let time = record.meta.event_time;
        let key = (self.key)(&record.value);
        let watermark = self.lateness.watermark_of(&key, &record.meta);
        if time < watermark {
            out.drop_late();
            return Ok(());
        }
        let seen = &mut self.seen;
        // An expired key not evicted yet is as good as gone.
        if seen.get(&key).is_some_and(|until| *until >= watermark) {
            return Ok(());
        }
        let until = time.saturating_add(self.keep);
        if let Some(expiries) = &mut self.expiries {
            expiries.schedule(until, key.clone());
        }
        seen.insert(key, until);
        out.emit_record(record)
    }

    fn on_watermark(&mut self, watermark: EventTime, _out: &mut Collector<'_, T>) -> Result<()> {
        if !self.lateness.advance(watermark) {
            return Ok(());
        }
        let seen = &self.seen;
        self.expiries.get_or_insert_with(|| {
            let mut expiries = Expiries::new();
            for (key, until) in seen.iter() {
                expiries.schedule(*until, key.clone());
            }
            expiries
        });
        self.evict(EVICT_PER_WATERMARK);
        Ok(())
    }

    fn on_close(&mut self, _out: &mut Collector<'_, T>) -> Result<()> {
        self.evict(usize::MAX);
        Ok(())
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        table(&mut self.seen)?;
        self.lateness.tables(table)
    }
}

/// Deduplication as builder methods on any stream. Each shuffles the stream by
/// the deduplication key itself ([`repartition_by`](Stream::repartition_by)),
/// so it needs no `key_by` before it, and runs in a clustered query as in one
/// process: there the records cross a repartition topic of their own, which
/// is why they must be serde types (`T: Serialize + DeserializeOwned`, as
/// [`StateValue`] says). The bound holds in one process too, so that a
/// dataflow builds the same whichever way it is run.
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::{DedupExt, StreamExt};
/// use rtflow_runtime::Dataflow;
/// # use rtflow_connectors::{MemorySink, MemorySource};
/// let flow = Dataflow::new("clicks");
/// // (click id, event time in ms): a producer's retries resend the same click.
/// let clicks = flow
///     .source(MemorySource::<(u64, i64)>::new(2))
///     .with_watermark(|(_, time)| *time, Duration::from_secs(10));
/// // Each (id, time) once; a key is forgotten once the watermark passes its time.
/// clicks.drop_duplicates(|click| *click).sink(MemorySink::new());
/// // Each id once among records within a minute of its first occurrence.
/// clicks
///     .drop_duplicates_within_watermark(|(id, _)| *id, Duration::from_secs(60))
///     .map(|(id, _)| id)
///     .sink(MemorySink::new());
/// ```
pub trait DedupExt<T: Data>: AsRef<Stream<T>> {
    /// The first record of each key; later records with the same key are dropped
    /// (Spark's `dropDuplicates`). A key is kept until the watermark passes the
    /// event time of its first occurrence, for ever if no watermark is declared.
    /// Include the event time in the key so that a duplicate arriving after its
    /// key was forgotten is late, and dropped as such.
    fn drop_duplicates<K: StateKey>(
        &self,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
    ) -> Stream<T>
    where
        T: StateValue,
    {
        dedup(
            self.as_ref(),
            DROP_DUPLICATES,
            Arc::new(key),
            Duration::ZERO,
        )
    }

    /// The first record of each key, dropping the records with the same key that
    /// arrive while the watermark has not passed the first one's event time plus
    /// `delay` (Spark 3.5's `dropDuplicatesWithinWatermark`): duplicates whose
    /// event times lie within `delay` of the first are always dropped, and the
    /// key's state is evicted after that. Spark takes `delay` from the watermark
    /// declaration; an operator here cannot see it, so pass the same `Duration`
    /// as to `with_watermark` (or the largest gap expected between duplicates).
    /// Without a watermark no key is ever forgotten.
    fn drop_duplicates_within_watermark<K: StateKey>(
        &self,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
        delay: Duration,
    ) -> Stream<T>
    where
        T: StateValue,
    {
        dedup(
            self.as_ref(),
            DROP_DUPLICATES_WITHIN_WATERMARK,
            Arc::new(key),
            delay,
        )
    }
}

impl<T: Data, S: AsRef<Stream<T>>> DedupExt<T> for S {}

fn dedup<K: StateKey, T: Data + StateValue>(
    stream: &Stream<T>,
    kind: &str,
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
    keep: Duration,
) -> Stream<T> {
    let shuffle_key = key.clone();
    stream
        .repartition_by(move |value: &T| shuffle_key(value))
        .as_ref()
        .try_transform(kind, move |ctx| DropDuplicates::new(key.clone(), keep, ctx))
}

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{self, Barrier, LateRecord, Record, Restore, Watermark};

    /// Deduplicates click ids, keeping each `keep` ms past its first time.
    fn clicks(
        kind: &str,
        keep: u64,
        steps: impl IntoIterator<Item = Step<u32>>,
    ) -> Vec<Emitted<u32>> {
        let id: Arc<dyn Fn(&u32) -> u32 + Send + Sync> = Arc::new(|id| *id);
        let keep = Duration::from_millis(keep);
        run(
            kind,
            |ctx| DropDuplicates::new(id.clone(), keep, ctx),
            steps,
        )
    }

    #[test]
    fn the_first_record_of_a_key_passes_and_its_duplicates_are_dropped() {
        let steps = [
            Record(1, 10),
            Record(2, 10),
            Record(1, 12),
            Record(2, 5),
            Record(3, 11),
        ];
        let expected = [
            Emitted::Record(1, 10),
            Emitted::Record(2, 10),
            Emitted::Record(3, 11),
        ];
        assert_eq!(clicks(DROP_DUPLICATES, 0, steps), expected);
    }

    #[test]
    fn a_record_judged_late_on_its_way_is_dropped_and_its_key_not_kept() {
        let steps = [LateRecord(1, 10), Record(1, 10), LateRecord(2, 10)];
        let expected = [Emitted::Record(1, 10)];
        assert_eq!(clicks(DROP_DUPLICATES, 0, steps), expected);
    }

    #[test]
    fn a_key_is_forgotten_once_the_watermark_passes_its_first_time() {
        let steps = [
            Record(1, 10),
            // A watermark at the key's time has not passed it.
            Watermark(10),
            Record(1, 12),
            Watermark(11),
            Record(1, 12),
        ];
        let expected = [
            Emitted::Record(1, 10),
            Emitted::Watermark(10),
            Emitted::Watermark(11),
            Emitted::Record(1, 12),
        ];
        assert_eq!(clicks(DROP_DUPLICATES, 0, steps), expected);
    }

    #[test]
    fn with_the_event_time_in_the_key_a_duplicate_after_its_key_was_forgotten_is_late() {
        let steps = [Record((1, 10), 10), Watermark(11), Record((1, 10), 10)];
        let expected = [Emitted::Record((1, 10), 10), Emitted::Watermark(11)];
        let click = |click: &(u32, i64)| *click;
        let dedup = |ctx: &_| DropDuplicates::new(Arc::new(click), Duration::ZERO, ctx);
        assert_eq!(run(DROP_DUPLICATES, dedup, steps), expected);
    }

    #[test]
    fn within_the_watermark_duplicates_are_dropped_until_it_passes_the_first_time_plus_the_delay() {
        let steps = [
            Record(1, 10),
            Record(1, 14),
            Record(1, 8),
            Watermark(15),
            Record(1, 15),
            Watermark(16),
            Record(1, 16),
            Record(1, 20),
        ];
        let expected = [
            Emitted::Record(1, 10),
            Emitted::Watermark(15),
            Emitted::Watermark(16),
            Emitted::Record(1, 16),
        ];
        assert_eq!(clicks(DROP_DUPLICATES_WITHIN_WATERMARK, 5, steps), expected);
    }

    #[test]
    fn a_restored_instance_still_drops_the_keys_it_saw_and_the_late_records() {
        let steps = [
            Record(1, 10),
            Record(2, 20),
            Watermark(15),
            Barrier,
            Restore,
            Record(1, 15),
            Record(2, 20),
            Record(3, 14),
            Record(3, 15),
        ];
        // Key 1 was forgotten at the watermark; 2 was not; 3 at 14 is late.
        let expected = [
            Emitted::Record(1, 10),
            Emitted::Record(2, 20),
            Emitted::Watermark(15),
            Emitted::Record(1, 15),
            Emitted::Record(3, 15),
        ];
        assert_eq!(clicks(DROP_DUPLICATES, 0, steps), expected);
    }
}
