//! [`KeyedState`]: a value per key, snapshotted incrementally and restored by
//! key group.

use std::collections::hash_map::{Entry as MapEntry, HashMap};
use std::hash::Hash;

use foldhash::fast::RandomState as FastState;
use rtflow_checkpoint::snapshot::Blob;
use rtflow_checkpoint::{Delta, Entry, StateId, StateMeta};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{decode, encode, encode_into, Image, StateSnapshot};
use crate::error::{Result, RtflowError};
use crate::key_groups::{key_group, stable_hash};
use crate::metrics::StateRows;

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
/// barrier, [`begin_snapshot`](Self::begin_snapshot) only sets the epoch's changed keys
/// aside. [`continue_snapshot`](Self::continue_snapshot) then encodes them a
/// slice at a time between records; a key that a record is about to change
/// first is encoded then, with its value at the barrier (copy on write).
pub struct KeyedState<K, V> {
    id: StateId,
    meta: StateMeta,
    part: u32,
    key_groups: usize,
    /// The key group of a key, out of `key_groups`.
    group_of: fn(&K, usize) -> u32,
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

    /// Encodes `key` of key group `group` with `value` (`None`: deleted).
    fn record<V: Serialize>(&mut self, id: &StateId, group: u32, key: &K, value: Option<&V>) {
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
                    keyed: true,
                    entries,
                }
            }),
        );
        Ok(())
    }
}

/// The key group of `key` in a state keyed by user keys: by its stable hash.
pub(super) fn hashed_group<K: Hash>(key: &K, key_groups: usize) -> u32 {
    key_group(stable_hash(key), key_groups) as u32
}

/// The key group of `key` in a state keyed by key group: the key itself.
pub(super) fn itself(group: &u32, _key_groups: usize) -> u32 {
    *group
}

impl<K, V> KeyedState<K, V>
where
    K: Hash + Eq + Clone + Serialize + DeserializeOwned + Send,
    V: Serialize + DeserializeOwned + Send,
{
    /// State `id` of instance `part`, holding the entries of `blobs` (oldest
    /// first) whose key groups `mine` picks; `group_of` tells a key's group.
    pub(super) fn restore(
        id: StateId,
        meta: StateMeta,
        part: u32,
        (key_groups, group_of): (usize, fn(&K, usize) -> u32),
        blobs: Option<&[Blob]>,
        mine: impl Fn(usize) -> bool + Sync,
    ) -> Result<Self> {
        let mut entries = HashMap::with_hasher(FastState::default());
        if let Some(blobs) = blobs {
            restore(&id, blobs, mine, &mut entries)?;
        }
        Ok(Self {
            id,
            meta,
            part,
            key_groups,
            group_of,
            live: entries.len(),
            entries,
            tag: CAPTURED + 1,
            changed: Vec::new(),
            capture: None,
        })
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
    /// hands them to `out`. A snapshot still incomplete is completed first. The
    /// runtime calls both for the tables an operator declares
    /// ([`Operator::tables`](crate::Operator::tables)); a sink writer holding
    /// keyed state calls [`snapshot`](Self::snapshot).
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
            let group = (self.group_of)(&key, self.key_groups);
            capture.record(&self.id, group, &key, slot.value.as_ref());
            if slot.value.is_none() {
                self.entries.remove(&key);
            }
        }
        if !capture.pending.is_empty() {
            return Ok(false);
        }
        let capture = self.capture.take().expect("checked above");
        capture.finish(self.id.clone(), self.meta.clone(), self.part, out)?;
        Ok(true)
    }

    /// Every key of the groups `keep` picks with its value, as one blob.
    pub(super) fn image(&self, keep: &dyn Fn(u32) -> bool) -> Result<Image> {
        let mut entries = Vec::with_capacity(self.live);
        for (key, value) in self.iter() {
            let group = (self.group_of)(key, self.key_groups);
            if keep(group) {
                entries.push(Entry {
                    group,
                    key: encode(&self.id, key)?,
                    value: Some(encode(&self.id, value)?),
                });
            }
        }
        Ok(Image::of(&self.id, &self.meta, &entries, true))
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
                            let group = (self.group_of)(key, self.key_groups);
                            capture.record(&self.id, group, key, slot.value.as_ref());
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

/// A restored chain with more entries than this is decoded on a thread of its
/// own while the restoring one fills the map: restoring a large state is what a
/// restart waits for.
pub(super) const PIPELINED: usize = 50_000;

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
