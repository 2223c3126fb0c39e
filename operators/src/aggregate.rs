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
