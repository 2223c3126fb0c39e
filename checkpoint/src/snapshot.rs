//! State snapshots. An actor's snapshot of one state in one epoch is a [`Delta`]:
//! only the entries that changed. Each is stored as a checksummed blob; the chain
//! of blobs listed in a manifest, applied oldest first, rebuilds the state.
//! Compaction folds a chain into one base blob.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Epoch;

/// One state of one operator: the operator's stable id and the state's name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StateId {
    pub operator: String,
    pub name: String,
}

impl StateId {
    pub fn new(operator: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            operator: operator.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for StateId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "state '{}' of operator '{}'", self.name, self.operator)
    }
}

/// What a state holds, to tell at restore whether the dataflow still reads it the
/// same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateMeta {
    /// The operator family that owns the state (`count`, `kafka`, ...).
    pub kind: String,
    /// The Rust types of the state's keys and values.
    pub signature: String,
}

/// One changed entry. `group` is the key group of a keyed state's key (or the
/// subtask of a per-subtask state): it decides which actor restores the entry, so
/// state follows its keys when parallelism changes. `value: None` deletes the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub group: u32,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

/// The entries one actor changed in one state during an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    pub state: StateId,
    pub meta: StateMeta,
    /// The subtask that wrote it.
    pub part: u32,
    pub entries: Vec<Entry>,
}

/// The `part` of a compacted base blob.
pub const BASE_PART: u32 = u32::MAX;

/// Where a blob is stored (`len` bytes at `offset` of the snapshot segment of
/// `epoch`) and what its bytes must hash to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlobRef {
    pub epoch: Epoch,
    pub part: u32,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
}

/// The blobs that rebuild one state, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChain {
    pub meta: StateMeta,
    pub blobs: Vec<BlobRef>,
}

impl StateChain {
    /// Whether folding the chain into one blob is worth it: too many blobs to read
    /// at restore, or deltas that together outweigh the base they sit on.
    pub fn due_for_compaction(&self, max_blobs: usize) -> bool {
        let Some((first, rest)) = self.blobs.split_first() else {
            return false;
        };
        let deltas: u64 = rest.iter().map(|b| b.len).sum();
        self.blobs.len() > max_blobs || (!rest.is_empty() && deltas > first.len)
    }
}

/// A blob whose bytes do not match its reference or checksum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("snapshot blob {blob:?} of {state} is corrupt: {reason}")]
pub struct CorruptBlob {
    pub state: StateId,
    pub blob: BlobRef,
    pub reason: String,
}

/// Encodes entries as a blob: their bytes followed by a CRC-32.
///
/// The entries are encoded in chunks, each preceded by its length, so that a
/// large blob (a compacted base) decodes on every core at restore.
pub fn encode_blob(entries: &[Entry]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for chunk in entries.chunks(CHUNK) {
        let encoded = bincode::serde::encode_to_vec(chunk, bincode::config::standard())
            .expect("entries always encode");
        bytes.extend_from_slice(&(encoded.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&encoded);
    }
    let checksum = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    bytes
}

/// Entries per independently decodable chunk of a blob.
const CHUNK: usize = 65_536;

/// The reference a manifest keeps for `bytes` of `part`, stored at `offset` of
/// the segment of `epoch`.
pub fn blob_ref(epoch: Epoch, part: u32, offset: u64, bytes: &[u8]) -> BlobRef {
    BlobRef {
        epoch,
        part,
        offset,
        len: bytes.len() as u64,
        crc: crc32fast::hash(bytes),
    }
}

/// Reads back a blob, checking it against its reference and its own checksum.
pub fn decode_blob(
    state: &StateId,
    blob: BlobRef,
    bytes: &[u8],
) -> Result<Vec<Entry>, CorruptBlob> {
    let corrupt = |reason: &str| CorruptBlob {
        state: state.clone(),
        blob,
        reason: reason.to_owned(),
    };
    if bytes.len() as u64 != blob.len {
        return Err(corrupt(&format!(
            "{} bytes stored, {} expected (truncated?)",
            bytes.len(),
            blob.len
        )));
    }
    if crc32fast::hash(bytes) != blob.crc {
        return Err(corrupt("checksum differs from the manifest's"));
    }
    let split = bytes
        .len()
        .checked_sub(4)
        .ok_or_else(|| corrupt("shorter than its checksum"))?;
    let (body, checksum) = bytes.split_at(split);
    if crc32fast::hash(body).to_le_bytes() != checksum {
        return Err(corrupt("checksum mismatch"));
    }
    let mut chunks = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| corrupt("a chunk length is cut short"))?;
        let len = u32::from_le_bytes(*len) as usize;
        if tail.len() < len {
            return Err(corrupt("a chunk is cut short"));
        }
        let (chunk, tail) = tail.split_at(len);
        chunks.push(chunk);
        rest = tail;
    }
    let decode = |chunk: &[u8]| -> Result<Vec<Entry>, CorruptBlob> {
        bincode::serde::decode_from_slice(chunk, bincode::config::standard())
            .map(|(entries, _)| entries)
            .map_err(|e| corrupt(&e.to_string()))
    };
    let decoded: Vec<Result<Vec<Entry>, CorruptBlob>> = if chunks.len() > 1 {
        std::thread::scope(|scope| {
            let workers: Vec<_> = chunks
                .iter()
                .map(|chunk| scope.spawn(move || decode(chunk)))
                .collect();
            workers
                .into_iter()
                .map(|worker| worker.join().expect("decoding does not panic"))
                .collect()
        })
    } else {
        chunks.into_iter().map(decode).collect()
    };
    let mut entries = Vec::new();
    for chunk in decoded {
        let chunk = chunk?;
        if entries.is_empty() {
            entries = chunk;
        } else {
            entries.extend(chunk);
        }
    }
    Ok(entries)
}

/// Applies blobs oldest first: a later entry for the same key wins, deletions
/// remove the key. Returns what is left.
///
/// The first blob (a base, usually much larger than the deltas after it) is
/// walked once and never hashed: only the later blobs' entries go into a map.
pub fn merge(blobs: impl IntoIterator<Item = Vec<Entry>>) -> Vec<Entry> {
    let mut blobs = blobs.into_iter();
    let Some(mut base) = blobs.next() else {
        return Vec::new();
    };
    let mut changes: HashMap<(u32, Vec<u8>), Option<Vec<u8>>> = HashMap::new();
    for entries in blobs {
        changes.reserve(entries.len());
        for entry in entries {
            changes.insert((entry.group, entry.key), entry.value);
        }
    }
    if !changes.is_empty() {
        for entry in &mut base {
            // Move the key out for the lookup, and back in.
            let id = (entry.group, std::mem::take(&mut entry.key));
            match changes.remove_entry(&id) {
                Some(((_, key), value)) => {
                    entry.key = key;
                    entry.value = value;
                }
                None => entry.key = id.1,
            }
        }
        base.extend(
            changes
                .into_iter()
                .map(|((group, key), value)| Entry { group, key, value }),
        );
    }
    base.retain(|entry| entry.value.is_some());
    base
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: u8, value: u8) -> Entry {
        Entry {
            group: u32::from(key % 4),
            key: vec![key],
            value: Some(vec![value]),
        }
    }

    fn delete(key: u8) -> Entry {
        Entry {
            group: u32::from(key % 4),
            key: vec![key],
            value: None,
        }
    }

    #[test]
    fn later_entries_win_and_deletions_remove() {
        let mut merged = merge([
            vec![put(1, 10), put(2, 20), put(3, 30)],
            vec![put(2, 21), delete(3)],
            vec![put(4, 40), delete(9)],
        ]);
        merged.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(merged, vec![put(1, 10), put(2, 21), put(4, 40)]);
    }

    #[test]
    fn later_blobs_override_and_delete_entries_of_the_first() {
        let mut merged = merge([
            vec![put(1, 10), put(2, 20)],
            vec![put(1, 11)],
            vec![delete(2)],
        ]);
        merged.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(merged, vec![put(1, 11)]);
        assert_eq!(merge([vec![put(3, 30), delete(4)]]), vec![put(3, 30)]);
        assert_eq!(merge(Vec::<Vec<Entry>>::new()), vec![]);
    }

    #[test]
    fn equal_keys_of_different_groups_stay_apart() {
        let a = Entry {
            group: 0,
            key: b"pending".to_vec(),
            value: Some(vec![1]),
        };
        let b = Entry {
            group: 1,
            ..a.clone()
        };
        assert_eq!(merge([vec![a, b]]).len(), 2);
    }

    #[test]
    fn blobs_round_trip_and_any_damage_is_detected() {
        let state = StateId::new("count-0", "counts");
        let entries = vec![put(1, 10), delete(2)];
        let bytes = encode_blob(&entries);
        let reference = blob_ref(3, 0, 0, &bytes);
        assert_eq!(decode_blob(&state, reference, &bytes), Ok(entries));
        for len in 0..bytes.len() {
            assert!(decode_blob(&state, reference, &bytes[..len]).is_err());
        }
        for i in 0..bytes.len() {
            let mut torn = bytes.clone();
            torn[i] ^= 1;
            assert!(
                decode_blob(&state, reference, &torn).is_err(),
                "flip at {i}"
            );
        }
    }

    #[test]
    fn a_blob_of_many_chunks_round_trips() {
        let state = StateId::new("count-0", "counts");
        let entries: Vec<Entry> = (0..2 * CHUNK + 5)
            .map(|i| Entry {
                group: (i % 128) as u32,
                key: (i as u64).to_le_bytes().to_vec(),
                value: (i % 7 != 0).then(|| vec![i as u8]),
            })
            .collect();
        let bytes = encode_blob(&entries);
        let reference = blob_ref(1, 0, 0, &bytes);
        assert_eq!(decode_blob(&state, reference, &bytes), Ok(entries));
    }

    #[test]
    fn compaction_is_due_for_long_chains_or_heavy_deltas() {
        let blob = |len| BlobRef {
            epoch: 1,
            part: 0,
            offset: 0,
            len,
            crc: 0,
        };
        let chain = |blobs: Vec<BlobRef>| StateChain {
            meta: StateMeta {
                kind: "count".into(),
                signature: "u64".into(),
            },
            blobs,
        };
        assert!(!chain(vec![]).due_for_compaction(4));
        assert!(!chain(vec![blob(100)]).due_for_compaction(4));
        assert!(!chain(vec![blob(100), blob(30), blob(30)]).due_for_compaction(4));
        assert!(chain(vec![blob(100), blob(60), blob(60)]).due_for_compaction(4));
        assert!(chain(vec![blob(100); 5]).due_for_compaction(4));
    }
}
