//! Checkpointed state for operator and sink authors.
//!
//! State lives in memory, in the actor that owns it, so reading and updating it
//! costs a hash-map lookup. An operator claims each state from its
//! [`StateContext`] (which hands back what the last committed checkpoint held
//! for the key groups the instance owns) and declares it in
//! [`Operator::tables`](crate::Operator::tables). The runtime does the rest: at
//! every barrier it sets aside what each declared [`Table`] changed since the
//! previous one, encodes it a slice at a time between records, and stores it as
//! one incremental blob per table ([`StateSnapshot`]). A state claimed but not
//! declared fails the query at start.
//!
//! ```
//! use rtflow_runtime::state::{KeyedState, Table};
//! use rtflow_runtime::{Collector, Dataflow, Operator, OperatorContext, Record, Result, Stream};
//!
//! /// Counts records per word and emits the running count.
//! struct WordCount {
//!     counts: KeyedState<String, u64>,
//! }
//!
//! impl WordCount {
//!     fn new(ctx: &OperatorContext) -> Result<Self> {
//!         Ok(Self { counts: ctx.state.keyed("counts")? })
//!     }
//! }
//!
//! impl Operator<String, (String, u64)> for WordCount {
//!     fn process(&mut self, record: Record<String>, out: &mut Collector<'_, (String, u64)>) -> Result<()> {
//!         let count = self.counts.get_or_insert_with(record.value.clone(), || 0);
//!         *count += 1;
//!         let count = *count;
//!         out.emit((record.value, count))
//!     }
//!
//!     fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
//!         table(&mut self.counts)
//!     }
//! }
//!
//! # fn build(words: Stream<String>) {
//! words.try_transform("word_count", WordCount::new);
//! # }
//! ```

mod keyed;
mod restored;
mod snapshot;
mod subtask;
#[cfg(test)]
mod tests;

use std::any::type_name;
use std::collections::BTreeMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rtflow_checkpoint::snapshot::Blob;
use rtflow_checkpoint::{Entry, RestoredState, StateId, StateMeta};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use self::keyed::KeyedState;
use self::restored::Grouped;
pub(crate) use self::restored::Restored;
pub use self::snapshot::StateSnapshot;
pub use self::subtask::SubtaskState;

/// A state an operator holds and declares in
/// [`Operator::tables`](crate::Operator::tables), as Arroyo's tables: the runtime
/// snapshots it at every barrier, a slice at a time between records, and the
/// operator never forwards a snapshot itself.
pub trait Table: Send {
    /// At the barrier: sets aside what changed since the previous barrier,
    /// completing a snapshot still incomplete first.
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()>;

    /// Between records: encodes about `budget` more entries of the snapshot
    /// begun, and hands them to `out` once complete; returns whether it is.
    fn continue_snapshot(&mut self, _budget: usize, _out: &mut StateSnapshot) -> Result<bool> {
        Ok(true)
    }

    /// Everything the table holds of the key groups `keep` picks (per-subtask
    /// state: all of it), as a checkpoint taken now would restore it; `None`
    /// for a table that cannot say. An operator instance handed partitions
    /// inside a run ([`Handover`](crate::cluster::Handover)) is rebuilt from
    /// its tables' images, so that nothing derived from the state it let go of
    /// outlives it; a table without one makes the run restart instead.
    fn image(&self, _keep: &dyn Fn(u32) -> bool) -> Result<Option<Image>> {
        Ok(None)
    }
}

/// What a [`Table`] holds: a restorable copy of its state.
pub struct Image {
    pub id: StateId,
    pub state: RestoredState,
    /// Whether the state is keyed (it moves with its key groups) rather than
    /// held per instance.
    pub keyed: bool,
}

impl Image {
    /// State `id` of `meta` holding `entries`, as one blob.
    fn of(id: &StateId, meta: &StateMeta, entries: &[Entry], keyed: bool) -> Self {
        let state = RestoredState {
            meta: meta.clone(),
            blobs: vec![Blob::of(entries)],
        };
        Self {
            id: id.clone(),
            state,
            keyed,
        }
    }
}
use crate::error::{Result, RtflowError};
use crate::key_groups::subtask_for_key_group;
use crate::record::{Epoch, EventTime};

/// Where an operator or sink instance gets its state. Every state has a name,
/// unique within its operator.
#[derive(Clone)]
pub struct StateContext {
    /// The operator's stable id: what its state is stored under.
    pub(crate) uid: String,
    pub(crate) kind: String,
    pub(crate) subtask: usize,
    pub(crate) parallelism: usize,
    pub(crate) restored: Arc<Restored>,
    /// How many states the instance claimed ([`keyed`](Self::keyed) and
    /// [`per_subtask`](Self::per_subtask)): what it must declare as tables.
    pub(crate) claims: Arc<AtomicUsize>,
}

impl StateContext {
    /// An empty context, for operators run outside a query (tests, benchmarks).
    pub fn detached(kind: &str, subtask: usize, parallelism: usize, key_groups: usize) -> Self {
        Self {
            uid: format!("{kind}-0"),
            kind: kind.to_owned(),
            subtask,
            parallelism,
            restored: Arc::new(Restored::new(BTreeMap::new(), None, None, None, key_groups)),
            claims: Arc::default(),
        }
    }

    /// The epoch of the checkpoint this start restored from, if any.
    pub fn restored_epoch(&self) -> Option<Epoch> {
        self.restored.epoch
    }

    /// The run that committed the checkpoint this start restored from: with
    /// [`restored_epoch`](Self::restored_epoch), the checkpoint's identity.
    pub fn restored_run_id(&self) -> Option<&str> {
        self.restored.run_id.as_deref()
    }

    /// The watermark of the checkpoint this start restored from: event time must
    /// not go back behind it.
    pub fn restored_watermark(&self) -> Option<EventTime> {
        self.restored.watermark
    }

    /// Claims state `name`, checking that the checkpoint holds it with the same
    /// types, and returns what it restored.
    fn claim(&self, name: &str, signature: &str) -> Result<(StateId, StateMeta, Option<&Grouped>)> {
        let id = StateId::new(&self.uid, name);
        let meta = StateMeta {
            kind: self.kind.clone(),
            signature: signature.to_owned(),
        };
        self.restored
            .claimed
            .lock()
            .expect("claims are never poisoned")
            .insert(id.clone());
        let Some(restored) = self.restored.states.get(&id) else {
            return Ok((id, meta, None));
        };
        if restored.meta != meta {
            return Err(RtflowError::IncompatibleCheckpoint {
                difference: format!(
                    "{id} was written by a '{}' operator holding {}, but is now read by a '{}' \
                     operator holding {}",
                    restored.meta.kind, restored.meta.signature, meta.kind, meta.signature
                ),
            });
        }
        Ok((id, meta, Some(restored)))
    }

    /// Value state per key, restored with the keys whose key groups this instance
    /// owns.
    pub fn keyed<K, V>(&self, name: &str) -> Result<KeyedState<K, V>>
    where
        K: Hash + Eq + Clone + Serialize + DeserializeOwned + Send,
        V: Serialize + DeserializeOwned + Send,
    {
        let key_groups = self.restored.key_groups;
        let (id, meta, restored) = self.claim(name, type_name::<(K, V)>())?;
        self.claims.fetch_add(1, Ordering::Relaxed);
        let mine =
            |group| subtask_for_key_group(group, key_groups, self.parallelism) == self.subtask;
        KeyedState::restore(
            id,
            meta,
            self.subtask as u32,
            (key_groups, keyed::hashed_group::<K>),
            restored.map(|restored| restored.blobs.as_slice()),
            mine,
        )
    }

    /// A value per key group, keyed by the key group itself, restored with
    /// the key groups this instance owns ([`key_groups`](Self::key_groups)):
    /// for what holds for all of a group's keys, such as the watermark its
    /// records were judged late by. Write only the groups the instance owns.
    pub fn per_key_group<V>(&self, name: &str) -> Result<KeyedState<u32, V>>
    where
        V: Serialize + DeserializeOwned + Send,
    {
        let key_groups = self.restored.key_groups;
        let (id, meta, restored) = self.claim(name, type_name::<(u32, V)>())?;
        self.claims.fetch_add(1, Ordering::Relaxed);
        KeyedState::restore(
            id,
            meta,
            self.subtask as u32,
            (key_groups, keyed::itself),
            restored.map(|restored| restored.blobs.as_slice()),
            |group| self.owns_key_group(group as u32),
        )
    }

    /// The key groups this instance owns: their keys reach it, and it
    /// restores and writes their keyed state. In a clustered query, only
    /// those of the partitions the process runs.
    ///
    /// ```
    /// use rtflow_runtime::StateContext;
    /// let first_of_two = StateContext::detached("count", 0, 2, 128);
    /// assert_eq!(first_of_two.key_groups().collect::<Vec<_>>(), (0..64).collect::<Vec<_>>());
    /// ```
    pub fn key_groups(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.restored.key_groups as u32).filter(|group| self.owns_key_group(*group))
    }

    /// Whether the instance runs in a clustered query, whose records may
    /// cross processes ([`Membership`](crate::cluster::Membership)).
    pub fn is_clustered(&self) -> bool {
        self.restored.cluster.is_some()
    }

    /// How many key groups the query's keys hash into
    /// ([`QueryConfig::max_key_groups`](crate::QueryConfig::max_key_groups)).
    pub fn key_group_count(&self) -> usize {
        self.restored.key_groups
    }

    fn owns_key_group(&self, group: u32) -> bool {
        let key_groups = self.restored.key_groups;
        subtask_for_key_group(group as usize, key_groups, self.parallelism) == self.subtask
            && (self.restored.cluster.as_ref()).is_none_or(|link| link.owns_key_group(group))
    }

    /// What the checkpoint held for per-subtask state `name` in every old
    /// instance, by old subtask, whichever instance asks: for values each
    /// instance needs after a parallelism change, such as an operator's input
    /// watermark. Write the state through [`per_subtask`](Self::per_subtask).
    pub fn restored_by_every_subtask<V>(&self, name: &str) -> Result<Vec<(u32, V)>>
    where
        V: Serialize + DeserializeOwned,
    {
        let (id, _, grouped) = self.claim(name, type_name::<V>())?;
        let mut restored = Vec::new();
        for (subtask, bytes) in grouped.iter().flat_map(|g| g.live(|_| true)) {
            restored.push((subtask, decode(&id, bytes)?));
        }
        Ok(restored)
    }

    /// One value per instance (a sink's pending transaction, a reader's position).
    /// When parallelism changed, an instance also restores the values of the old
    /// instances that map to it.
    pub fn per_subtask<V>(&self, name: &str) -> Result<SubtaskState<V>>
    where
        V: Serialize + DeserializeOwned,
    {
        let (id, meta, grouped) = self.claim(name, type_name::<V>())?;
        self.claims.fetch_add(1, Ordering::Relaxed);
        let mut restored = Vec::new();
        let mine = |subtask| subtask % self.parallelism == self.subtask;
        for (subtask, bytes) in grouped.iter().flat_map(|g| g.live(mine)) {
            restored.push((subtask, decode(&id, bytes)?));
        }
        Ok(SubtaskState {
            id,
            meta,
            subtask: self.subtask as u32,
            inherited: restored.iter().map(|(s, _)| *s).collect(),
            restored,
            value: None,
            changed: false,
            touched: false,
        })
    }
}

fn encode<T: Serialize>(id: &StateId, value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .map_err(|e| RtflowError::Checkpoint(format!("cannot encode {id}: {e}")))
}

fn encode_into<T: Serialize>(id: &StateId, value: &T, buffer: &mut Vec<u8>) -> Result<()> {
    bincode::serde::encode_into_std_write(value, buffer, bincode::config::standard())
        .map(drop)
        .map_err(|e| RtflowError::Checkpoint(format!("cannot encode {id}: {e}")))
}

fn decode<T: DeserializeOwned>(id: &StateId, bytes: &[u8]) -> Result<T> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(value, _)| value)
        .map_err(|e| RtflowError::IncompatibleCheckpoint {
            difference: format!("{id} cannot be read as its declared type: {e}"),
        })
}

impl<K, V> Table for KeyedState<K, V>
where
    K: Hash + Eq + Clone + Serialize + DeserializeOwned + Send,
    V: Serialize + DeserializeOwned + Send,
{
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        KeyedState::begin_snapshot(self, out)
    }

    fn continue_snapshot(&mut self, budget: usize, out: &mut StateSnapshot) -> Result<bool> {
        KeyedState::continue_snapshot(self, budget, out)
    }

    fn image(&self, keep: &dyn Fn(u32) -> bool) -> Result<Option<Image>> {
        KeyedState::image(self, keep).map(Some)
    }
}

impl<V: Serialize + Send> Table for SubtaskState<V> {
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.snapshot(out)
    }

    fn image(&self, _keep: &dyn Fn(u32) -> bool) -> Result<Option<Image>> {
        SubtaskState::image(self).map(Some)
    }
}
