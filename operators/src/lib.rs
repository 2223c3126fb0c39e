//! # rtflow-operators
//!
//! The operators of rtflow, one family per file, each a struct implementing the
//! runtime's [`Operator`](rtflow_runtime::Operator) trait. [`StreamExt`] adds them
//! to every [`Stream`] (and [`KeyedStream`]) as builder
//! methods; the facade's prelude brings it into scope.
//!
//! ```
//! use rtflow_operators::StreamExt;
//! use rtflow_runtime::Dataflow;
//! # use rtflow_connectors::{MemorySink, MemorySource};
//! let flow = Dataflow::new("words");
//! let lines = flow.source(MemorySource::<String>::new(1));
//! lines
//!     .flat_map(|line| line.split(' ').map(str::to_owned).collect::<Vec<_>>())
//!     .filter(|word| !word.is_empty())
//!     .map(|word| word.len())
//!     .sink(MemorySink::new());
//! ```

mod aggregate;
mod dedup;
mod expiry;
mod filter;
mod flat_map;
mod join;
mod join_stream;
mod lateness;
mod map;
pub mod process;
mod window;

use std::hash::Hash;
use std::ops::AddAssign;
use std::sync::Arc;

pub use aggregate::{AddFn, Aggregation, RunningAggregate, StateKey, StateValue};
pub use dedup::{DedupExt, DropDuplicates, DROP_DUPLICATES, DROP_DUPLICATES_WITHIN_WATERMARK};
pub use filter::Filter;
pub use flat_map::FlatMap;
pub use join::{BroadcastJoin, BroadcastLeftJoin};
pub use join_stream::{
    Either, JoinWindow, StreamJoin, StreamJoinExt, STREAM_FULL_JOIN, STREAM_JOIN, STREAM_LEFT_JOIN,
    STREAM_RIGHT_JOIN,
};
pub use map::Map;
pub use process::{KeyedProcess, KeyedProcessExt, KeyedProcessor};
use rtflow_runtime::{Data, KeyedStream, StaticTable, Stream};
pub use window::{AggregateFunction, Window, WindowExt, WindowedStream, Windowing};

/// The stateless operators as builder methods on any stream.
pub trait StreamExt<T: Data>: AsRef<Stream<T>> {
    /// One output per record.
    fn map<U: Data>(&self, f: impl Fn(T) -> U + Send + Sync + 'static) -> Stream<U> {
        let f = Arc::new(f);
        self.as_ref().transform("map", move |_| {
            let f = f.clone();
            Map(move |value| f(value))
        })
    }

    /// The records for which `predicate` holds.
    fn filter(&self, predicate: impl Fn(&T) -> bool + Send + Sync + 'static) -> Stream<T> {
        let predicate = Arc::new(predicate);
        self.as_ref().transform("filter", move |_| {
            let predicate = predicate.clone();
            Filter(move |value: &T| predicate(value))
        })
    }

    /// Every item `f` returns for a record (explode).
    fn flat_map<U: Data, I>(&self, f: impl Fn(T) -> I + Send + Sync + 'static) -> Stream<U>
    where
        I: IntoIterator<Item = U> + 'static,
    {
        let f = Arc::new(f);
        self.as_ref().transform("flat_map", move |_| {
            let f = f.clone();
            FlatMap(move |value| f(value))
        })
    }

    /// Inner stream-static join: `(record, row)` for every row of `table` under the
    /// record's key.
    fn broadcast_join<K, V>(
        &self,
        table: &StaticTable<K, V>,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
    ) -> Stream<(T, V)>
    where
        K: Eq + Hash + Send + Sync + 'static,
        V: Data + Sync,
    {
        let (table, key) = (table.clone(), Arc::new(key));
        self.as_ref().transform("broadcast_join", move |_| {
            let key = key.clone();
            BroadcastJoin {
                table: table.clone(),
                key: move |value: &T| key(value),
            }
        })
    }

    /// Left outer stream-static join: like `broadcast_join`, plus `(record, None)`
    /// for records without a match.
    fn broadcast_left_join<K, V>(
        &self,
        table: &StaticTable<K, V>,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
    ) -> Stream<(T, Option<V>)>
    where
        K: Eq + Hash + Send + Sync + 'static,
        V: Data + Sync,
    {
        let (table, key) = (table.clone(), Arc::new(key));
        self.as_ref().transform("broadcast_left_join", move |_| {
            let key = key.clone();
            BroadcastLeftJoin {
                table: table.clone(),
                key: move |value: &T| key(value),
            }
        })
    }
}

impl<T: Data, S: AsRef<Stream<T>>> StreamExt<T> for S {}

/// Running aggregates per key as builder methods on a keyed stream: every record
/// emits its key's updated aggregate (update output mode).
///
/// ```
/// use rtflow_operators::{KeyedStreamExt, StreamExt};
/// use rtflow_runtime::Dataflow;
/// # use rtflow_connectors::{MemorySink, MemorySource};
/// let flow = Dataflow::new("spend");
/// let purchases = flow.source(MemorySource::<(String, f64)>::new(1));
/// let by_user = purchases.key_by(|(user, _)| user.clone());
/// by_user.count().sink(MemorySink::new());
/// by_user.sum(|(_, amount)| *amount).sink(MemorySink::new());
/// by_user.avg(|(_, amount)| *amount).sink(MemorySink::new());
/// ```
pub trait KeyedStreamExt<K: StateKey, T: Data> {
    /// A running aggregate of operator family `kind` (its name on the allowlist and
    /// in checkpoints).
    fn aggregate<Acc: StateValue, Out: Data>(
        &self,
        kind: &str,
        aggregation: Aggregation<T, Acc, Out>,
    ) -> Stream<(K, Out)>;

    /// Records per key so far.
    fn count(&self) -> Stream<(K, u64)> {
        self.aggregate(
            "count",
            Aggregation {
                first: Arc::new(|_| 1u64),
                add: Arc::new(|count, _| *count += 1),
                result: Arc::new(|count| *count),
            },
        )
    }

    /// The sum of `value` per key so far.
    fn sum<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, N)>
    where
        N: StateValue + Data + Copy + AddAssign,
    {
        let value = Arc::new(value);
        let add = value.clone();
        self.aggregate(
            "sum",
            Aggregation {
                first: Arc::new(move |record| value(record)),
                add: Arc::new(move |sum, record| *sum += add(record)),
                result: Arc::new(|sum| *sum),
            },
        )
    }

    /// The least `value` per key so far.
    fn min<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, N)>
    where
        N: StateValue + Data + Copy + PartialOrd,
    {
        extreme(self, "min", value, |new, old| new < old)
    }

    /// The greatest `value` per key so far.
    fn max<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, N)>
    where
        N: StateValue + Data + Copy + PartialOrd,
    {
        extreme(self, "max", value, |new, old| new > old)
    }

    /// The mean of `value` per key so far.
    fn avg(&self, value: impl Fn(&T) -> f64 + Send + Sync + 'static) -> Stream<(K, f64)> {
        let value = Arc::new(value);
        let add = value.clone();
        self.aggregate(
            "avg",
            Aggregation {
                first: Arc::new(move |record| (value(record), 1u64)),
                add: Arc::new(move |(sum, count), record| {
                    *sum += add(record);
                    *count += 1;
                }),
                result: Arc::new(|(sum, count)| sum / *count as f64),
            },
        )
    }

    /// Folds each key's records with `f`, starting from its first record.
    fn reduce(&self, f: impl Fn(&T, &T) -> T + Send + Sync + 'static) -> Stream<(K, T)>
    where
        T: StateValue + Clone,
    {
        self.aggregate(
            "reduce",
            Aggregation {
                first: Arc::new(T::clone),
                add: Arc::new(move |acc, record| *acc = f(acc, record)),
                result: Arc::new(T::clone),
            },
        )
    }
}

/// `min` or `max`: keeps the value for which `replaces(new, old)` holds.
fn extreme<K, T, N, S>(
    stream: &S,
    kind: &str,
    value: impl Fn(&T) -> N + Send + Sync + 'static,
    replaces: fn(&N, &N) -> bool,
) -> Stream<(K, N)>
where
    K: StateKey,
    T: Data,
    N: StateValue + Data + Copy + PartialOrd,
    S: KeyedStreamExt<K, T> + ?Sized,
{
    let value = Arc::new(value);
    let add = value.clone();
    stream.aggregate(
        kind,
        Aggregation {
            first: Arc::new(move |record| value(record)),
            add: Arc::new(move |current, record| {
                let candidate = add(record);
                if replaces(&candidate, current) {
                    *current = candidate;
                }
            }),
            result: Arc::new(|current| *current),
        },
    )
}

impl<K: StateKey, T: Data> KeyedStreamExt<K, T> for KeyedStream<K, T> {
    fn aggregate<Acc: StateValue, Out: Data>(
        &self,
        kind: &str,
        aggregation: Aggregation<T, Acc, Out>,
    ) -> Stream<(K, Out)> {
        let key = self.key_fn();
        self.as_ref().try_transform(kind, move |ctx| {
            RunningAggregate::new(key.clone(), aggregation.clone(), ctx)
        })
    }
}
