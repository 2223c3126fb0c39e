//! # rtflow-operators
//!
//! The operators of rtflow, one family per file, each a struct implementing the
//! runtime's [`Operator`](rtflow_runtime::Operator) trait. [`StreamExt`] adds them
//! to every [`Stream`] (and [`KeyedStream`](rtflow_runtime::KeyedStream)) as builder
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

mod filter;
mod flat_map;
mod join;
mod map;

use std::hash::Hash;
use std::sync::Arc;

pub use filter::Filter;
pub use flat_map::FlatMap;
pub use join::{BroadcastJoin, BroadcastLeftJoin};
pub use map::Map;
use rtflow_runtime::{Data, StaticTable, Stream};

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
        self.as_ref().transform("broadcast_join", move |_| {
            let key = key.clone();
            BroadcastLeftJoin {
                table: table.clone(),
                key: move |value: &T| key(value),
            }
        })
    }
}

impl<T: Data, S: AsRef<Stream<T>>> StreamExt<T> for S {}
