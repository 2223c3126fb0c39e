//! Running aggregates per key: after `key_by`, every record updates its key's
//! accumulator and emits `(key, result)` at once (update output mode). The
//! accumulators are keyed state, so they survive a restart exactly once.

use std::hash::Hash;
use std::sync::Arc;

use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{Collector, Data, Operator, OperatorContext, Record, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// What a state key must be: hashed to its key group, stored in checkpoints.
pub trait StateKey: Data + Hash + Eq + Clone + Serialize + DeserializeOwned {}
impl<K: Data + Hash + Eq + Clone + Serialize + DeserializeOwned> StateKey for K {}

/// What an accumulator must be: kept per key, stored in checkpoints.
pub trait StateValue: Send + Serialize + DeserializeOwned + 'static {}
impl<V: Send + Serialize + DeserializeOwned + 'static> StateValue for V {}

/// Folds a record into an accumulator.
pub type AddFn<T, Acc> = Arc<dyn Fn(&mut Acc, &T) + Send + Sync>;

/// How to fold records into an accumulator and read a result from it.
pub struct Aggregation<T, Acc, Out> {
    /// The accumulator of a key's first record.
    pub first: Arc<dyn Fn(&T) -> Acc + Send + Sync>,
    /// Folds a later record in.
    pub add: AddFn<T, Acc>,
    /// The value emitted after each record.
    pub result: Arc<dyn Fn(&Acc) -> Out + Send + Sync>,
}

impl<T, Acc, Out> Clone for Aggregation<T, Acc, Out> {
    fn clone(&self) -> Self {
        Self {
            first: self.first.clone(),
            add: self.add.clone(),
            result: self.result.clone(),
        }
    }
}

/// The running-aggregate operator: one accumulator per key in keyed state.
pub struct RunningAggregate<K, T, Acc, Out> {
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
    aggregation: Aggregation<T, Acc, Out>,
    state: KeyedState<K, Acc>,
}

impl<K: StateKey, T, Acc: StateValue, Out> RunningAggregate<K, T, Acc, Out> {
    /// An instance whose accumulators `ctx` restores.
    pub fn new(
        key: Arc<dyn Fn(&T) -> K + Send + Sync>,
        aggregation: Aggregation<T, Acc, Out>,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Ok(Self {
            key,
            aggregation,
            state: ctx.state.keyed(ACCUMULATORS)?,
        })
    }
}

/// The name of an aggregate's state within its operator.
const ACCUMULATORS: &str = "accumulators";

impl<K, T, Acc, Out> Operator<T, (K, Out)> for RunningAggregate<K, T, Acc, Out>
where
    K: StateKey,
    T: Data,
    Acc: StateValue,
    Out: Data,
{
    fn allowlisted() -> bool {
        true
    }

    fn stateful() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<T>, out: &mut Collector<'_, (K, Out)>) -> Result<()> {
        let state = &mut self.state;
        let key = (self.key)(&record.value);
        let result = match state.get_mut(&key) {
            Some(acc) => {
                (self.aggregation.add)(acc, &record.value);
                (self.aggregation.result)(acc)
            }
            None => {
                let acc = (self.aggregation.first)(&record.value);
                let result = (self.aggregation.result)(&acc);
                state.insert(key.clone(), acc);
                result
            }
        };
        out.emit((key, result))
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        table(&mut self.state)
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::cell::RefCell;

    use rtflow_connectors::MemorySource;
    use rtflow_runtime::tester::Emitted;
    use rtflow_runtime::{Dataflow, EventTime, Stream};

    use super::*;
    use crate::KeyedStreamExt;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{self, Barrier, Record, Restore, Watermark};

    /// (user, cents)
    type Purchase = (&'static str, i64);

    /// Stands in for a stream keyed by user: runs the aggregation a
    /// [`KeyedStreamExt`] method builds over its steps, so that the tests
    /// drive the library's own count, sum, min, max and avg.
    struct Script {
        steps: RefCell<Vec<Step<Purchase>>>,
        emitted: RefCell<Option<Box<dyn Any>>>,
    }

    impl KeyedStreamExt<String, Purchase> for Script {
        fn aggregate<Acc: StateValue, Out: Data>(
            &self,
            kind: &str,
            aggregation: Aggregation<Purchase, Acc, Out>,
        ) -> Stream<(String, Out)> {
            let key: Arc<dyn Fn(&Purchase) -> String + Send + Sync> =
                Arc::new(|(user, _)| user.to_string());
            let make = |ctx: &_| RunningAggregate::new(key.clone(), aggregation.clone(), ctx);
            let emitted = run(kind, make, self.steps.take());
            *self.emitted.borrow_mut() = Some(Box::new(emitted));
            // Never run: the method's return value only.
            Dataflow::new("unused").source(MemorySource::new(1))
        }
    }

    /// What the aggregate `build` picks emits over `steps`.
    fn running<Out: 'static>(
        steps: impl IntoIterator<Item = Step<Purchase>>,
        build: impl FnOnce(&Script) -> Stream<(String, Out)>,
    ) -> Vec<Emitted<(String, Out)>> {
        let script = Script {
            steps: RefCell::new(steps.into_iter().collect()),
            emitted: RefCell::new(None),
        };
        build(&script);
        let emitted = script.emitted.take().expect("build called aggregate");
        *emitted.downcast().expect("the aggregate's output type")
    }

    fn update<T>(user: &str, value: T, time: EventTime) -> Emitted<(String, T)> {
        Emitted::Record((user.to_owned(), value), time)
    }

    fn purchases() -> [Step<Purchase>; 4] {
        [
            Record(("ann", 30), 1),
            Record(("bob", 5), 2),
            Record(("ann", 10), 3),
            Record(("ann", 50), 4),
        ]
    }

    /// The values of the updates, per aggregate.
    fn values<T>(emitted: Vec<Emitted<(String, T)>>) -> Vec<T> {
        emitted
            .into_iter()
            .filter_map(|emitted| match emitted {
                Emitted::Record((_, value), _) => Some(value),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_record_emits_its_keys_count_at_its_event_time() {
        let steps = [
            Record(("ann", 30), 10),
            Record(("bob", 5), 20),
            Watermark(15),
            Record(("ann", 10), 5),
        ];
        let expected = [
            update("ann", 1, 10),
            update("bob", 1, 20),
            Emitted::Watermark(15),
            update("ann", 2, 5),
        ];
        assert_eq!(running(steps, |by_user| by_user.count()), expected);
    }

    #[test]
    fn sum_min_max_and_avg_are_running_per_key() {
        let sum = running(purchases(), |by_user| by_user.sum(|(_, cents)| *cents));
        assert_eq!(values(sum), [30, 5, 40, 90]);
        let min = running(purchases(), |by_user| by_user.min(|(_, cents)| *cents));
        assert_eq!(values(min), [30, 5, 10, 10]);
        let max = running(purchases(), |by_user| by_user.max(|(_, cents)| *cents));
        assert_eq!(values(max), [30, 5, 30, 50]);
        let avg = running(purchases(), |by_user| {
            by_user.avg(|(_, cents)| *cents as f64)
        });
        assert_eq!(values(avg), [30.0, 5.0, 20.0, 30.0]);
    }

    #[test]
    fn a_restored_instance_goes_on_from_the_counts_of_the_last_barrier() {
        // ann's second record came after the barrier: lost with the instance,
        // as its source replays it.
        let steps = [
            Record(("ann", 30), 1),
            Record(("bob", 5), 2),
            Barrier,
            Record(("ann", 10), 3),
            Restore,
            Record(("ann", 10), 3),
            Record(("bob", 7), 4),
        ];
        let expected = [
            update("ann", 1, 1),
            update("bob", 1, 2),
            update("ann", 2, 3),
            update("ann", 2, 3),
            update("bob", 2, 4),
        ];
        assert_eq!(running(steps, |by_user| by_user.count()), expected);
    }
}
