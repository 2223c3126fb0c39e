//! Checkpointed state for operator and sink authors.
//!
//! State lives in memory, in the actor that owns it, so reading and updating it
//! costs a hash-map lookup. Each state remembers which keys changed since the last
//! barrier; the operator's `snapshot` hook hands only those to the checkpoint
//! ([`StateSnapshot`]), which stores them as one incremental blob. On start, a
//! [`StateContext`] gives each instance back what the last committed checkpoint
//! held for the key groups it owns.
//!
//! `KeyedState::snapshot` encodes the changed keys at the barrier, while
//! records wait. An operator with many changed keys per epoch can instead call
//! `begin_snapshot` there and `continue_snapshot` from its own
//! `continue_snapshot` hook: the runtime then encodes a slice at a time between
//! records (the built-in stateful operators do this).
//!
//! ```
//! use rtflow_runtime::state::{KeyedState, StateSnapshot};
//! use rtflow_runtime::{Collector, Operator, OperatorContext, Record, Result};
//!
//! /// Counts records per word and emits the running count.
//! struct WordCount(Option<KeyedState<String, u64>>);
//!
//! impl Operator<String, (String, u64)> for WordCount {
//!     fn on_start(&mut self, ctx: &OperatorContext) -> Result<()> {
//!         self.0 = Some(ctx.state.keyed("counts")?);
//!         Ok(())
//!     }
//!
//!     fn process(&mut self, record: Record<String>, out: &mut Collector<'_, (String, u64)>) -> Result<()> {
//!         let counts = self.0.as_mut().expect("started");
//!         let count = counts.get_or_insert_with(record.value.clone(), || 0);
//!         *count += 1;
//!         let count = *count;
//!         out.emit((record.value, count))
//!     }
//!
//!     fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
//!         self.0.as_mut().expect("started").snapshot(out)
//!     }
//! }
//! ```

use std::any::type_name;
use std::collections::hash_map::{Entry as MapEntry, HashMap};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::sync::{Arc, Mutex};

// Keyed state hashes with foldhash, seeded at random per map: SipHash cost
// more than the map operation around it for small keys, and a restart fills
// maps of millions of keys.
use foldhash::fast::RandomState as FastState;
use rtflow_checkpoint::snapshot::{merge, Blob};
use rtflow_checkpoint::{Delta, Entry, RestoredState, StateId, StateMeta};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Result, RtflowError};
use crate::key_groups::{key_group, stable_hash, subtask_for_key_group};
use crate::metrics::StateRows;
use crate::record::{Epoch, EventTime};

/// What every stateful instance of a query restores from: the recovered
/// checkpoint's states, and which of them the dataflow claimed.
#[derive(Default)]
pub(crate) struct Restored {
    states: BTreeMap<StateId, Grouped>,
    /// The epoch of the checkpoint restored from.
    pub(crate) epoch: Option<Epoch>,
    /// The watermark the checkpoint reached.
    pub(crate) watermark: Option<EventTime>,
    /// The run that committed the checkpoint.
    pub(crate) run_id: Option<String>,
    pub(crate) key_groups: usize,
    claimed: Mutex<BTreeSet<StateId>>,
}

/// A restored state's snapshot blobs; each instance picks the entries of its
/// groups. Checking a group is far cheaper than moving entries into buckets,
/// even for every instance in turn.
struct Grouped {
    meta: StateMeta,
    /// Oldest first.
    blobs: Vec<Blob>,
}

impl Grouped {
    fn new(state: RestoredState) -> Self {
        Self {
            meta: state.meta,
            blobs: state.blobs,
        }
    }

    /// The live values of the groups `wanted` picks (the blobs merged), by
    /// group. For per-subtask state, a few entries; keyed state applies the
    /// blobs straight into its own map instead.
    fn live(&self, wanted: impl Fn(usize) -> bool) -> Vec<(u32, &[u8])> {
        let mut live: Vec<(u32, &[u8])> = merge(&self.blobs)
            .iter()
            .filter(|entry| wanted(entry.group as usize))
            .filter_map(|entry| Some((entry.group, entry.value?)))
            .collect();
        live.sort_by_key(|(group, _)| *group);
        live
    }
}

impl Restored {
    pub(crate) fn new(
        states: BTreeMap<StateId, RestoredState>,
        epoch: Option<Epoch>,
        watermark: Option<EventTime>,
        run_id: Option<String>,
        key_groups: usize,
    ) -> Self {
        Self {
            states: states
                .into_iter()
                .map(|(id, state)| (id, Grouped::new(state)))
                .collect(),
            epoch,
            watermark,
            run_id,
            key_groups,
            claimed: Mutex::default(),
        }
    }

    /// The first state of the checkpoint that no instance claimed at start: the
    /// dataflow lost the operator that owned it.
    pub(crate) fn unclaimed(&self) -> Option<(&StateId, &StateMeta)> {
        let claimed = self.claimed.lock().expect("claims are never poisoned");
        self.states
            .iter()
            .find(|(id, _)| !claimed.contains(id))
            .map(|(id, state)| (id, &state.meta))
    }
}

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
        let mine =
            |group| subtask_for_key_group(group, key_groups, self.parallelism) == self.subtask;
        let mut entries = HashMap::with_hasher(FastState::default());
        if let Some(restored) = restored {
            restore(&id, &restored.blobs, mine, &mut entries)?;
        }
        Ok(KeyedState {
            id,
            meta,
            part: self.subtask as u32,
            key_groups,
            live: entries.len(),
            entries,
            tag: CAPTURED + 1,
            changed: Vec::new(),
            capture: None,
        })
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
        })
    }
}

/// A restored chain with more entries than this is decoded on a thread of its
/// own while the restoring one fills the map: restoring a large state is what a
/// restart waits for.
const PIPELINED: usize = 50_000;

/// Entries decoded at a time on the decoding thread.
const PART: usize = 16_384;

/// Restored keys and values (`None`: deleted), in the order of the chain.
type Decoded<K, V> = Vec<(K, Option<V>)>;

/// Applies the entries of `blobs`, oldest first, whose key groups `mine`
/// picks: a later entry for a key replaces an earlier one, a deletion removes
/// the key.
fn restore<K, V>(
    id: &StateId,
    blobs: &[Blob],
    mine: impl Fn(usize) -> bool + Sync,
    map: &mut HashMap<K, Slot<V>, FastState>,
) -> Result<()>
where
    K: Hash + Eq + DeserializeOwned + Send,
    V: DeserializeOwned + Send,
{
    let decode_part = |blob: &Blob, range: std::ops::Range<usize>| -> Result<Decoded<K, V>> {
        let mut decoded = Vec::with_capacity(range.len());
        for entry in blob.range(range) {
            if mine(entry.group as usize) {
                let value = entry.value.map(|v| decode(id, v)).transpose()?;
                decoded.push((decode(id, entry.key)?, value));
            }
        }
        Ok(decoded)
    };
    let apply = |map: &mut HashMap<K, Slot<V>, FastState>, decoded: Decoded<K, V>| {
        for (key, value) in decoded {
            match value {
                Some(value) => {
                    let slot = Slot {
                        value: Some(value),
                        changed_in: CAPTURED,
                    };
                    map.insert(key, slot);
                }
                None => {
                    map.remove(&key);
                }
            }
        }
    };
    // Sized once: growing a map of a million keys rehashes it some twenty
    // times. The chain's entries bound the live keys, and compaction keeps a
    // chain's deltas smaller than its base.
    let bound = || {
        blobs
            .iter()
            .flat_map(Blob::iter)
            .filter(|entry| mine(entry.group as usize))
            .count()
    };
    let total: usize = blobs.iter().map(Blob::len).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if total < PIPELINED || threads == 1 {
        map.reserve(bound());
        for blob in blobs {
            apply(map, decode_part(blob, 0..blob.len())?);
        }
        return Ok(());
    }
    std::thread::scope(|scope| {
        let (parts, decoded) = std::sync::mpsc::sync_channel(4);
        let decode_part = &decode_part;
        scope.spawn(move || {
            for blob in blobs {
                for start in (0..blob.len()).step_by(PART) {
                    let part = decode_part(blob, start..blob.len().min(start + PART));
                    let failed = part.is_err();
                    // The restoring thread hung up on an earlier failure.
                    if parts.send(part).is_err() || failed {
                        return;
                    }
                }
            }
        });
        map.reserve(bound());
        for part in decoded {
            apply(map, part?);
        }
        Ok(())
    })
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

/// What an actor's stateful operators changed in an epoch; the runtime stores it
/// with the epoch's checkpoint.
#[derive(Default)]
pub struct StateSnapshot {
    deltas: Vec<Delta>,
    /// Keyed changes encoded at the barrier, with their entry counts: cutting
    /// them into entries is left to the coordinator, so the actor goes on with
    /// its records sooner.
    captured: Vec<(usize, Cut)>,
    /// For an actor that ends in a sink: the watermark the sink had reached at the
    /// barrier (`Some(None)` before its first).
    pub(crate) sink_watermark: Option<Option<EventTime>>,
    /// Keyed snapshots begun and not yet complete.
    pub(crate) incomplete: usize,
    /// The keyed state of the snapshots begun, summed.
    pub(crate) rows: StateRows,
}

/// Changes encoded at a barrier into one buffer, cut into entries when called.
type Cut = Box<dyn FnOnce() -> Delta + Send>;

impl StateSnapshot {
    fn push(&mut self, delta: Delta) {
        if !delta.entries.is_empty() {
            self.deltas.push(delta);
        }
    }

    fn capture(&mut self, entries: usize, encode: Cut) {
        if entries > 0 {
            self.captured.push((entries, encode));
        }
    }

    /// Entries written so far (benchmarks and tests).
    pub fn entries(&self) -> usize {
        let encoded: usize = self.deltas.iter().map(|d| d.entries.len()).sum();
        encoded + self.captured.iter().map(|(n, _)| n).sum::<usize>()
    }

    /// The changes as the checkpoint stores them; the captured ones are cut into
    /// entries on the calling thread.
    pub(crate) fn into_deltas(self) -> Vec<Delta> {
        let mut deltas = self.deltas;
        deltas.extend(self.captured.into_iter().map(|(_, cut)| cut()));
        deltas
    }
}

struct Slot<V> {
    /// `None`: deleted, and not yet captured by a snapshot.
    value: Option<V>,
    /// The tag of the epoch that last changed it, until a snapshot captured the
    /// change; [`CAPTURED`] then.
    changed_in: u64,
}

/// The `changed_in` of a slot whose last change a snapshot holds.
const CAPTURED: u64 = 0;

/// A value per key, held in memory and checkpointed incrementally: a snapshot
/// writes only the keys changed since the previous one.
///
/// A snapshot is taken in two steps so that records do not wait for it. At the
/// barrier, [`snapshot`](Self::snapshot) only sets the epoch's changed keys
/// aside. [`continue_snapshot`](Self::continue_snapshot) then encodes them a
/// slice at a time between records; a key that a record is about to change
/// first is encoded then, with its value at the barrier (copy on write).
pub struct KeyedState<K, V> {
    id: StateId,
    meta: StateMeta,
    part: u32,
    key_groups: usize,
    entries: HashMap<K, Slot<V>, FastState>,
    /// The tag of the running epoch's changes.
    tag: u64,
    /// Keys changed in the running epoch, each once.
    changed: Vec<K>,
    /// The snapshot taken at the last barrier, until it is complete.
    capture: Option<Capture<K>>,
    /// Keys with a value.
    live: usize,
}

/// The changes of one epoch on their way into a snapshot.
struct Capture<K> {
    /// The tag of the epoch captured.
    tag: u64,
    /// Keys changed in that epoch and not encoded yet.
    pending: Vec<K>,
    /// Keys and values, encoded one after the other.
    buffer: Vec<u8>,
    /// Per entry: its key group, where its key ends, where its value ends.
    spans: Vec<(u32, usize, Option<usize>)>,
    /// An encoding failure, reported when the capture completes.
    failure: Option<RtflowError>,
}

impl<K: Hash + Serialize> Capture<K> {
    fn new(tag: u64, pending: Vec<K>) -> Self {
        Self {
            tag,
            buffer: Vec::with_capacity(pending.len() * 16),
            spans: Vec::with_capacity(pending.len()),
            pending,
            failure: None,
        }
    }

    /// Encodes `key` with `value` (`None`: deleted).
    fn record<V: Serialize>(
        &mut self,
        id: &StateId,
        key_groups: usize,
        key: &K,
        value: Option<&V>,
    ) {
        let group = key_group(stable_hash(key), key_groups) as u32;
        let encoded = encode_into(id, key, &mut self.buffer).and_then(|()| {
            let key_end = self.buffer.len();
            let value_end = match value {
                Some(value) => {
                    encode_into(id, value, &mut self.buffer)?;
                    Some(self.buffer.len())
                }
                None => None,
            };
            self.spans.push((group, key_end, value_end));
            Ok(())
        });
        if let Err(error) = encoded {
            self.failure.get_or_insert(error);
        }
    }

    /// The encoded entries, to be cut apart off the operator's thread.
    fn finish(
        self,
        state: StateId,
        meta: StateMeta,
        part: u32,
        out: &mut StateSnapshot,
    ) -> Result<()> {
        if let Some(error) = self.failure {
            return Err(error);
        }
        let (buffer, spans) = (self.buffer, self.spans);
        out.capture(
            spans.len(),
            Box::new(move || {
                let mut start = 0;
                let entries = spans
                    .into_iter()
                    .map(|(group, key_end, value_end)| {
                        let key = buffer[start..key_end].to_vec();
                        start = value_end.unwrap_or(key_end);
                        let value = value_end.map(|end| buffer[key_end..end].to_vec());
                        Entry { group, key, value }
                    })
                    .collect();
                Delta {
                    state,
                    meta,
                    part,
                    entries,
                }
            }),
        );
        Ok(())
    }
}

impl<K, V> KeyedState<K, V>
where
    K: Hash + Eq + Clone + Serialize,
    V: Serialize,
{
    /// The value of `key`.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).and_then(|slot| slot.value.as_ref())
    }

    /// The value of `key`, to change in place; the key counts as changed.
    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.get(key)?;
        let (slot, _) = self.mark(key.clone());
        slot.value.as_mut()
    }

    /// The value of `key`, inserting `default()` first if there is none. The key
    /// counts as changed.
    #[inline]
    pub fn get_or_insert_with(&mut self, key: K, default: impl FnOnce() -> V) -> &mut V {
        let (slot, live) = self.mark(key);
        if slot.value.is_none() {
            *live += 1;
        }
        slot.value.get_or_insert_with(default)
    }

    /// Sets the value of `key`, returning the previous one.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let (slot, live) = self.mark(key);
        let previous = slot.value.replace(value);
        if previous.is_none() {
            *live += 1;
        }
        previous
    }

    /// Deletes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.get(key)?;
        let (slot, live) = self.mark(key.clone());
        *live -= 1;
        slot.value.take()
    }

    /// The number of keys with a value.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no key has a value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every key with its value, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries
            .iter()
            .filter_map(|(key, slot)| slot.value.as_ref().map(|value| (key, value)))
    }

    /// Hands the keys changed since the previous snapshot to `out`, encoded now.
    pub fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.begin_snapshot(out)?;
        self.continue_snapshot(usize::MAX, out).map(drop)
    }

    /// Takes a snapshot of the keys changed since the previous one without
    /// encoding them: [`continue_snapshot`](Self::continue_snapshot) does, and
    /// hands them to `out`. An operator that begins a snapshot in
    /// [`Operator::snapshot`](crate::Operator::snapshot) must continue it in
    /// [`Operator::continue_snapshot`](crate::Operator::continue_snapshot); the
    /// runtime fails the query otherwise. A snapshot still incomplete is
    /// completed first.
    pub fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.continue_snapshot(usize::MAX, out)?;
        let changed = std::mem::take(&mut self.changed);
        out.rows.add(StateRows {
            total: self.live as u64,
            updated: changed.len() as u64,
            memory_bytes: (self.entries.capacity() * std::mem::size_of::<(K, Slot<V>)>()) as u64,
        });
        self.capture = Some(Capture::new(self.tag, changed));
        self.tag += 1;
        out.incomplete += 1;
        Ok(())
    }

    /// Encodes up to `budget` more keys of the snapshot taken at the last
    /// barrier; once all are, hands them to `out` and returns `true`.
    pub fn continue_snapshot(&mut self, budget: usize, out: &mut StateSnapshot) -> Result<bool> {
        let Some(capture) = &mut self.capture else {
            return Ok(true);
        };
        for _ in 0..budget {
            let Some(key) = capture.pending.pop() else {
                break;
            };
            // A key changed again since the barrier was captured then.
            let Some(slot) = self.entries.get_mut(&key) else {
                continue;
            };
            if slot.changed_in != capture.tag {
                continue;
            }
            slot.changed_in = CAPTURED;
            capture.record(&self.id, self.key_groups, &key, slot.value.as_ref());
            if slot.value.is_none() {
                self.entries.remove(&key);
            }
        }
        if !capture.pending.is_empty() {
            return Ok(false);
        }
        let capture = self.capture.take().expect("checked above");
        capture.finish(self.id.clone(), self.meta.clone(), self.part, out)?;
        out.incomplete = out.incomplete.saturating_sub(1);
        Ok(true)
    }

    /// Marks `key` changed; returns its slot and the live-key count to adjust.
    /// The first change of an epoch to a key that the incomplete snapshot has
    /// not encoded yet encodes it first.
    #[inline]
    fn mark(&mut self, key: K) -> (&mut Slot<V>, &mut usize) {
        let slot = match self.entries.entry(key) {
            MapEntry::Occupied(occupied) => {
                if occupied.get().changed_in != self.tag {
                    let (key, slot) = (occupied.key(), occupied.get());
                    if let Some(capture) = &mut self.capture {
                        if slot.changed_in == capture.tag {
                            capture.record(&self.id, self.key_groups, key, slot.value.as_ref());
                        }
                    }
                    self.changed.push(key.clone());
                }
                let slot = occupied.into_mut();
                slot.changed_in = self.tag;
                slot
            }
            MapEntry::Vacant(vacant) => {
                self.changed.push(vacant.key().clone());
                vacant.insert(Slot {
                    value: None,
                    changed_in: self.tag,
                })
            }
        };
        (slot, &mut self.live)
    }
}

/// One value per operator instance, checkpointed whenever it changed.
pub struct SubtaskState<V> {
    id: StateId,
    meta: StateMeta,
    subtask: u32,
    /// What the checkpoint held for this instance (and for old instances that map
    /// to it after a parallelism change), by old subtask.
    restored: Vec<(u32, V)>,
    /// Old instances whose values this one took over: cleared at the first
    /// snapshot, so they are restored only once.
    inherited: Vec<u32>,
    value: Option<V>,
    changed: bool,
}

impl<V: Serialize> SubtaskState<V> {
    /// What the checkpoint held, by the subtask that wrote it.
    pub fn restored(&self) -> &[(u32, V)] {
        &self.restored
    }

    /// The value set since the start, if any.
    pub fn get(&self) -> Option<&V> {
        self.value.as_ref()
    }

    /// Sets the value the next snapshot stores.
    pub fn set(&mut self, value: V) {
        self.value = Some(value);
        self.changed = true;
    }

    /// Clears the value; the next snapshot stores its deletion.
    pub fn clear(&mut self) {
        self.value = None;
        self.changed = true;
    }

    /// Hands the value to `out` if it changed since the last snapshot.
    pub fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        let mut entries = Vec::new();
        for old in std::mem::take(&mut self.inherited) {
            if old != self.subtask {
                entries.push(Entry {
                    group: old,
                    key: Vec::new(),
                    value: None,
                });
            }
        }
        if std::mem::take(&mut self.changed) {
            entries.push(Entry {
                group: self.subtask,
                key: Vec::new(),
                value: self
                    .value
                    .as_ref()
                    .map(|v| encode(&self.id, v))
                    .transpose()?,
            });
        }
        out.push(Delta {
            state: self.id.clone(),
            meta: self.meta.clone(),
            part: self.subtask,
            entries,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// What a snapshot holds: key -> value (`None`: deleted).
    fn contents(out: StateSnapshot) -> BTreeMap<u64, Option<u64>> {
        let id = StateId::new("test", "counts");
        out.into_deltas()
            .into_iter()
            .flat_map(|delta| delta.entries)
            .map(|entry| {
                let key = decode(&id, &entry.key).unwrap();
                let value = entry.value.map(|bytes| decode(&id, &bytes).unwrap());
                (key, value)
            })
            .collect()
    }

    fn counts() -> KeyedState<u64, u64> {
        StateContext::detached("count", 0, 1, 128)
            .keyed("counts")
            .unwrap()
    }

    /// Keyed state restored from a chain of blobs by `parallelism` instances:
    /// what each instance holds, all together.
    fn restored(blobs: &[Vec<(u64, Option<u64>)>], parallelism: usize) -> BTreeMap<u64, u64> {
        let id = StateId::new("count-0", "counts");
        let meta = StateMeta {
            kind: "count".into(),
            signature: type_name::<(u64, u64)>().into(),
        };
        let blobs = blobs
            .iter()
            .map(|changes| {
                let entries: Vec<Entry> = changes
                    .iter()
                    .map(|(key, value)| Entry {
                        group: key_group(stable_hash(key), 128) as u32,
                        key: encode(&id, key).unwrap(),
                        value: value.map(|v| encode(&id, &v).unwrap()),
                    })
                    .collect();
                let bytes = rtflow_checkpoint::snapshot::encode_blob(&entries);
                let reference = rtflow_checkpoint::snapshot::blob_ref(1, 0, 0, &bytes);
                rtflow_checkpoint::snapshot::decode_blob(&id, reference, bytes).unwrap()
            })
            .collect();
        let state = RestoredState { meta, blobs };
        let restored = Arc::new(Restored::new(
            BTreeMap::from([(id, state)]),
            Some(1),
            None,
            None,
            128,
        ));
        let mut all = BTreeMap::new();
        for subtask in 0..parallelism {
            let context = StateContext {
                restored: restored.clone(),
                ..StateContext::detached("count", subtask, parallelism, 128)
            };
            let state: KeyedState<u64, u64> = context.keyed("counts").unwrap();
            assert_eq!(state.len(), state.iter().count());
            for (key, value) in state.iter() {
                assert!(all.insert(*key, *value).is_none(), "{key} in one instance");
            }
        }
        all
    }

    #[test]
    fn a_chain_is_restored_oldest_first_small_or_large() {
        for keys in [100, 3 * PIPELINED as u64] {
            let base: Vec<_> = (0..keys).map(|key| (key, Some(key))).collect();
            let later: Vec<_> = (0..keys + 10)
                .filter(|key| key % 3 == 0 || key % 5 == 0)
                .map(|key| (key, (key % 5 != 0).then_some(key + 1)))
                .collect();
            let again = vec![(10, Some(7)), (1, None)];
            let expected: BTreeMap<u64, u64> = (0..keys + 10)
                .filter_map(|key| match key {
                    10 => Some((10, 7)),
                    1 => None,
                    _ if key % 5 == 0 => None,
                    _ if key % 3 == 0 => Some((key, key + 1)),
                    _ => (key < keys).then_some((key, key)),
                })
                .collect();
            for parallelism in [1, 2, 3] {
                let all = restored(&[base.clone(), later.clone(), again.clone()], parallelism);
                assert_eq!(all, expected, "{keys} keys, parallelism {parallelism}");
            }
        }
    }

    /// A value that bincode cannot encode past 99, as a state type with a
    /// failing `Serialize` would be.
    #[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
    struct Picky(u64);

    impl Serialize for Picky {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            match self.0 {
                0..100 => serializer.serialize_u64(self.0),
                _ => Err(serde::ser::Error::custom("too large to encode")),
            }
        }
    }

    fn assert_cannot_encode(result: Result<bool>) {
        match result {
            Err(RtflowError::Checkpoint(message)) => assert!(
                message.contains("cannot encode state 'picky' of operator 'count-0'")
                    && message.contains("too large"),
                "{message}"
            ),
            other => panic!("expected a checkpoint error, got {other:?}"),
        }
    }

    /// The failure surfaces when the snapshot completes, whether the key was
    /// encoded in a slice between records or because a record was about to
    /// change it (copy on write); the snapshot is never handed over.
    #[test]
    fn a_value_that_cannot_be_encoded_fails_the_snapshot() {
        for changed_before_encoding in [false, true] {
            let mut state: KeyedState<u64, Picky> = StateContext::detached("count", 0, 1, 128)
                .keyed("picky")
                .unwrap();
            state.insert(1, Picky(7));
            state.insert(2, Picky(700));
            let mut out = StateSnapshot::default();
            state.begin_snapshot(&mut out).unwrap();
            if changed_before_encoding {
                state.insert(2, Picky(8));
            }
            assert_cannot_encode(state.continue_snapshot(usize::MAX, &mut out));
            assert_eq!(
                out.entries(),
                0,
                "nothing of the failed snapshot is handed over"
            );
        }
    }

    #[test]
    fn a_key_changed_before_the_snapshot_encoded_it_is_snapshotted_as_at_the_barrier() {
        let mut state = counts();
        for key in 1..=3 {
            state.insert(key, key * 10);
        }
        let mut at_barrier = StateSnapshot::default();
        state.begin_snapshot(&mut at_barrier).unwrap();
        assert!(!state.continue_snapshot(1, &mut at_barrier).unwrap());
        state.insert(1, 11);
        state.remove(&2);
        state.insert(4, 40);
        assert!(state
            .continue_snapshot(usize::MAX, &mut at_barrier)
            .unwrap());
        assert_eq!(
            contents(at_barrier),
            BTreeMap::from([(1, Some(10)), (2, Some(20)), (3, Some(30))])
        );

        let mut next = StateSnapshot::default();
        state.begin_snapshot(&mut next).unwrap();
        assert!(state.continue_snapshot(usize::MAX, &mut next).unwrap());
        assert_eq!(
            contents(next),
            BTreeMap::from([(1, Some(11)), (2, None), (4, Some(40))])
        );
        assert_eq!(state.len(), 3);
    }

    #[derive(Debug, Clone)]
    enum Act {
        Insert(u64, u64),
        Add(u64),
        Remove(u64),
        Barrier,
        /// Encodes this many more keys of the incomplete snapshot.
        Continue(usize),
    }

    fn act() -> impl Strategy<Value = Act> {
        prop_oneof![
            4 => (0..20u64, 0..100u64).prop_map(|(k, v)| Act::Insert(k, v)),
            4 => (0..20u64).prop_map(Act::Add),
            2 => (0..20u64).prop_map(Act::Remove),
            1 => Just(Act::Barrier),
            2 => (0..8usize).prop_map(Act::Continue),
        ]
    }

    /// A snapshot taken at a barrier and the state before and at that barrier.
    type Open = (StateSnapshot, BTreeMap<u64, u64>, BTreeMap<u64, u64>);

    /// Completes the open snapshot; checks it holds every key changed in its
    /// epoch and that applying it to `rebuilt` gives the state at its barrier.
    fn settle(
        open: &mut Option<Open>,
        state: &mut KeyedState<u64, u64>,
        rebuilt: &mut BTreeMap<u64, u64>,
    ) {
        let Some((mut out, before, after)) = open.take() else {
            return;
        };
        assert!(state.continue_snapshot(usize::MAX, &mut out).unwrap());
        let held = contents(out);
        for (key, value) in &held {
            match value {
                Some(value) => rebuilt.insert(*key, *value),
                None => rebuilt.remove(key),
            };
        }
        assert_eq!(
            *rebuilt, after,
            "replayed snapshots rebuild the barrier's state"
        );
        let changed = before
            .keys()
            .chain(after.keys())
            .filter(|key| before.get(key) != after.get(key));
        for key in changed {
            assert!(held.contains_key(key), "changed key {key} is held");
        }
    }

    proptest! {
        /// However records and snapshot slices interleave, each snapshot holds
        /// exactly the keys changed in its epoch, with their values at its
        /// barrier, and replaying the snapshots rebuilds the state.
        #[test]
        fn snapshots_hold_each_epoch_as_it_was_at_its_barrier(
            acts in prop::collection::vec(act(), 0..200),
        ) {
            let mut state = counts();
            let mut model: BTreeMap<u64, u64> = BTreeMap::new();
            let mut at_last_barrier: BTreeMap<u64, u64> = BTreeMap::new();
            let mut rebuilt: BTreeMap<u64, u64> = BTreeMap::new();
            let mut open: Option<Open> = None;
            for act in acts {
                match act {
                    Act::Insert(key, value) => {
                        state.insert(key, value);
                        model.insert(key, value);
                    }
                    Act::Add(key) => {
                        *state.get_or_insert_with(key, || 0) += 1;
                        *model.entry(key).or_insert(0) += 1;
                    }
                    Act::Remove(key) => {
                        prop_assert_eq!(state.remove(&key), model.remove(&key));
                    }
                    Act::Barrier => {
                        settle(&mut open, &mut state, &mut rebuilt);
                        let mut out = StateSnapshot::default();
                        state.begin_snapshot(&mut out).unwrap();
                        let before = std::mem::replace(&mut at_last_barrier, model.clone());
                        open = Some((out, before, model.clone()));
                    }
                    Act::Continue(budget) => {
                        if let Some((out, _, _)) = &mut open {
                            if state.continue_snapshot(budget, out).unwrap() {
                                settle(&mut open, &mut state, &mut rebuilt);
                            }
                        }
                    }
                }
                prop_assert_eq!(state.len(), model.len());
            }
            settle(&mut open, &mut state, &mut rebuilt);
        }
    }
}
