//! State snapshots. An actor's snapshot of one state in one epoch is a [`Delta`]:
//! only the entries that changed. Each is stored as a checksummed blob; the chain
//! of blobs listed in a manifest, applied oldest first, rebuilds the state.
//! Compaction folds a chain into one base blob.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

// The restore merge map hashes with foldhash, seeded at random per map (see
// the runtime's keyed state).
use crate::Epoch;
use foldhash::fast::RandomState as FastState;

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
    /// As one run of bytes, not a byte at a time (the same encoding, so
    /// checkpoints written before still read).
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// As one run of bytes, like `key`.
    #[serde(with = "serde_bytes")]
    pub value: Option<Vec<u8>>,
}

/// The entries one actor changed in one state during an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    pub state: StateId,
    pub meta: StateMeta,
    /// The subtask that wrote it.
    pub part: u32,
    /// Whether `entries` are grouped by key group (keyed state, which moves
    /// with its keys) rather than by subtask.
    pub keyed: bool,
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

/// An entry read from a blob, borrowing its bytes. It encodes exactly as the
/// [`Entry`] it was written from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EntryRef<'a> {
    pub group: u32,
    /// As one run of bytes, as [`Entry::key`] is.
    #[serde(with = "serde_bytes")]
    pub key: &'a [u8],
    /// As one run of bytes, as [`Entry::value`] is.
    #[serde(with = "serde_bytes")]
    pub value: Option<&'a [u8]>,
}

impl EntryRef<'_> {
    /// The entry with its bytes copied.
    pub fn to_entry(self) -> Entry {
        Entry {
            group: self.group,
            key: self.key.to_vec(),
            value: self.value.map(<[u8]>::to_vec),
        }
    }
}

/// Encodes entries ([`Entry`] or [`EntryRef`]) as a blob: their bytes followed
/// by a CRC-32.
///
/// The entries are encoded in chunks, each preceded by its length, so that a
/// large blob (a compacted base) decodes on every core at restore.
pub fn encode_blob<E: Serialize>(entries: &[E]) -> Vec<u8> {
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

/// Where one entry lies in the bytes of its blob: start and end of its key and
/// of its value (`None`: a deletion).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    group: u32,
    key: (usize, usize),
    value: Option<(usize, usize)>,
}

/// A checked blob, its entries located in its bytes but not copied out.
#[derive(Clone, PartialEq, Eq)]
pub struct Blob {
    bytes: Vec<u8>,
    spans: Vec<Span>,
}

impl Blob {
    /// How many entries the blob holds.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether the blob holds no entry.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// The entries in `range` of `0..len()`, in the order they were written:
    /// for splitting the work of reading a large blob.
    pub fn range(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl ExactSizeIterator<Item = EntryRef<'_>> + '_ {
        self.spans[range].iter().map(|span| span.entry(&self.bytes))
    }

    /// The entries, in the order they were written.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = EntryRef<'_>> + '_ {
        self.range(0..self.len())
    }

    /// A blob of `entries`, as a snapshot stores and reads them back: for
    /// state an operator instance hands to its successor in memory.
    ///
    /// ```
    /// use rtflow_checkpoint::snapshot::Blob;
    /// use rtflow_checkpoint::Entry;
    /// let entry = Entry { group: 3, key: b"k".to_vec(), value: Some(b"v".to_vec()) };
    /// let blob = Blob::of(&[entry.clone()]);
    /// assert_eq!(blob.iter().map(|e| e.to_entry()).collect::<Vec<_>>(), [entry]);
    /// ```
    pub fn of(entries: &[Entry]) -> Self {
        let bytes = encode_blob(entries);
        let reference = blob_ref(0, 0, 0, &bytes);
        decode_blob(&StateId::new("", ""), reference, bytes).expect("a blob just encoded decodes")
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Span {
    fn entry(self, bytes: &[u8]) -> EntryRef<'_> {
        EntryRef {
            group: self.group,
            key: &bytes[self.key.0..self.key.1],
            value: self.value.map(|(start, end)| &bytes[start..end]),
        }
    }
}

/// Reads back a blob, checking its length and checksum against its reference,
/// and locates its entries without copying them.
pub fn decode_blob(state: &StateId, blob: BlobRef, bytes: Vec<u8>) -> Result<Blob, CorruptBlob> {
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
    if crc32fast::hash(&bytes) != blob.crc {
        return Err(corrupt("checksum differs from the manifest's"));
    }
    let split = bytes
        .len()
        .checked_sub(4)
        .ok_or_else(|| corrupt("shorter than its checksum"))?;
    // The manifest's CRC covers the trailing one too: bytes that match it match
    // their own checksum, which a second pass over them would only confirm.
    let body = &bytes[..split];
    let mut chunks = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let len = body[at..]
            .first_chunk::<4>()
            .ok_or_else(|| corrupt("a chunk length is cut short"))?;
        let start = at + 4;
        let end = start + u32::from_le_bytes(*len) as usize;
        if end > body.len() {
            return Err(corrupt("a chunk is cut short"));
        }
        chunks.push((start, end));
        at = end;
    }
    let locate = |&(start, end): &(usize, usize)| Reader::new(body, start, end).entries();
    let located: Vec<Result<Vec<Span>, &str>> = if chunks.len() > 1 {
        std::thread::scope(|scope| {
            let workers: Vec<_> = chunks
                .iter()
                .map(|chunk| scope.spawn(move || locate(chunk)))
                .collect();
            workers
                .into_iter()
                .map(|worker| worker.join().expect("locating entries does not panic"))
                .collect()
        })
    } else {
        chunks.iter().map(locate).collect()
    };
    let mut spans = Vec::new();
    for chunk in located {
        let chunk = chunk.map_err(corrupt)?;
        if spans.is_empty() {
            spans = chunk;
        } else {
            spans.extend(chunk);
        }
    }
    Ok(Blob { bytes, spans })
}

/// Walks one chunk as bincode's standard configuration encodes a sequence of
/// [`Entry`]: a varint count, then per entry a varint group, the key as a varint
/// length and its bytes, and the value as an option tag byte followed, if 1, by
/// a varint length and its bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    end: usize,
}

/// Bincode's varint: values below 251 in one byte, else a marker byte for the
/// little-endian width that follows.
const U16_MARKER: u8 = 251;
const U32_MARKER: u8 = 252;
const U64_MARKER: u8 = 253;

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], at: usize, end: usize) -> Self {
        Self { bytes, at, end }
    }

    fn take(&mut self, len: usize) -> Result<(usize, usize), &'static str> {
        let start = self.at;
        let end = start
            .checked_add(len)
            .filter(|end| *end <= self.end)
            .ok_or("an entry runs past its chunk")?;
        self.at = end;
        Ok((start, end))
    }

    fn byte(&mut self) -> Result<u8, &'static str> {
        let (start, _) = self.take(1)?;
        Ok(self.bytes[start])
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], &'static str> {
        let (start, end) = self.take(N)?;
        Ok(self.bytes[start..end].try_into().expect("N bytes taken"))
    }

    fn varint(&mut self) -> Result<u64, &'static str> {
        Ok(match self.byte()? {
            U16_MARKER => u16::from_le_bytes(self.fixed()?).into(),
            U32_MARKER => u32::from_le_bytes(self.fixed()?).into(),
            U64_MARKER => u64::from_le_bytes(self.fixed()?),
            small if small < U16_MARKER => small.into(),
            _ => return Err("an integer is wider than 64 bits"),
        })
    }

    fn bytes(&mut self) -> Result<(usize, usize), &'static str> {
        let len = usize::try_from(self.varint()?).map_err(|_| "a length overflows")?;
        self.take(len)
    }

    fn entries(mut self) -> Result<Vec<Span>, &'static str> {
        let count = usize::try_from(self.varint()?).map_err(|_| "a count overflows")?;
        // An entry takes at least 3 bytes: a count beyond that is damage, not an
        // allocation to make.
        if count > (self.end - self.at) / 3 {
            return Err("more entries counted than the chunk holds");
        }
        let mut spans = Vec::with_capacity(count);
        for _ in 0..count {
            let group = u32::try_from(self.varint()?).map_err(|_| "a group overflows")?;
            let key = self.bytes()?;
            let value = match self.byte()? {
                0 => None,
                1 => Some(self.bytes()?),
                _ => return Err("a value's option tag is neither 0 nor 1"),
            };
            spans.push(Span { group, key, value });
        }
        if self.at != self.end {
            return Err("bytes left over after the chunk's entries");
        }
        Ok(spans)
    }
}

/// A state's live entries (deletions applied), pointing into the blobs they
/// were read from.
pub struct Entries<'a> {
    blobs: &'a [Blob],
    /// Each entry's blob (its index in `blobs`) and place in it.
    spans: Vec<(u32, Span)>,
}

impl<'a> Entries<'a> {
    /// How many entries there are.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether there is no entry.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = EntryRef<'a>> + '_ {
        let blobs = self.blobs;
        self.spans
            .iter()
            .map(move |&(blob, span)| span.entry(&blobs[blob as usize].bytes))
    }
}

/// Applies blobs oldest first: a later entry for the same key wins, deletions
/// remove the key. Returns what is left.
///
/// The first blob (a base, usually much larger than the deltas after it) is
/// walked once and never hashed: only the later blobs' entries go into a map.
/// No entry's bytes are copied.
pub fn merge(blobs: &[Blob]) -> Entries<'_> {
    let Some((base, rest)) = blobs.split_first() else {
        return Entries {
            blobs,
            spans: Vec::new(),
        };
    };
    let mut spans: Vec<(u32, Span)> = base.spans.iter().map(|span| (0, *span)).collect();
    if !rest.is_empty() {
        let mut changes: HashMap<(u32, &[u8]), (u32, Span), FastState> =
            HashMap::with_capacity_and_hasher(
                rest.iter().map(Blob::len).sum(),
                FastState::default(),
            );
        for (index, blob) in (1..).zip(rest) {
            for span in &blob.spans {
                let key = &blob.bytes[span.key.0..span.key.1];
                changes.insert((span.group, key), (index, *span));
            }
        }
        for located in &mut spans {
            let span = located.1;
            if let Some(change) = changes.remove(&(span.group, &base.bytes[span.key.0..span.key.1]))
            {
                *located = change;
            }
        }
        spans.extend(changes.into_values());
    }
    spans.retain(|(_, span)| span.value.is_some());
    Entries { blobs, spans }
}

/// How many of the oldest blobs the later ones shadow: every key they hold is
/// written again or deleted by a later blob, so the chain without them merges
/// to the same entries. A state that rewrites all its entries every epoch (an
/// exactly-once sink's pending output) sheds its old blobs this way, where a
/// fold would write its whole value once more.
///
/// Zero when some key of the oldest blob is never written again, or when the
/// first blob kept holds a key twice: [`merge`] takes its first blob as a base
/// of distinct keys.
pub fn shadowed(blobs: &[Blob]) -> usize {
    let Some((base, rest)) = blobs.split_first() else {
        return 0;
    };
    // A base with more keys than the later blobs hold has a key they miss:
    // the common case of a large keyed state, told without hashing it.
    if rest.is_empty() || base.len() > rest.iter().map(Blob::len).sum() {
        return 0;
    }
    let mut last: HashMap<(u32, &[u8]), usize, FastState> = HashMap::default();
    let mut repeats = vec![false; blobs.len()];
    for (index, blob) in blobs.iter().enumerate() {
        for span in &blob.spans {
            let key = (span.group, &blob.bytes[span.key.0..span.key.1]);
            if last.insert(key, index) == Some(index) {
                repeats[index] = true;
            }
        }
    }
    let kept_from = last.values().copied().min().unwrap_or(0);
    if repeats[kept_from] {
        return 0;
    }
    kept_from
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

    fn blob(entries: &[Entry]) -> Blob {
        let bytes = encode_blob(entries);
        let reference = blob_ref(1, 0, 0, &bytes);
        decode_blob(&StateId::new("count-0", "counts"), reference, bytes).unwrap()
    }

    fn owned<'a>(entries: impl Iterator<Item = EntryRef<'a>>) -> Vec<Entry> {
        entries.map(EntryRef::to_entry).collect()
    }

    fn merged(blobs: &[Vec<Entry>]) -> Vec<Entry> {
        let blobs: Vec<Blob> = blobs.iter().map(|entries| blob(entries)).collect();
        let mut merged = owned(merge(&blobs).iter());
        merged.sort_by(|a, b| a.key.cmp(&b.key));
        merged
    }

    #[test]
    fn later_entries_win_and_deletions_remove() {
        let merged = merged(&[
            vec![put(1, 10), put(2, 20), put(3, 30)],
            vec![put(2, 21), delete(3)],
            vec![put(4, 40), delete(9)],
        ]);
        assert_eq!(merged, vec![put(1, 10), put(2, 21), put(4, 40)]);
    }

    #[test]
    fn later_blobs_override_and_delete_entries_of_the_first() {
        let merged_once = merged(&[
            vec![put(1, 10), put(2, 20)],
            vec![put(1, 11)],
            vec![delete(2)],
        ]);
        assert_eq!(merged_once, vec![put(1, 11)]);
        assert_eq!(merged(&[vec![put(3, 30), delete(4)]]), vec![put(3, 30)]);
        assert_eq!(merged(&[]), vec![]);
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
        assert_eq!(merged(&[vec![a, b]]).len(), 2);
    }

    #[test]
    fn blobs_round_trip_and_any_damage_is_detected() {
        let state = StateId::new("count-0", "counts");
        let entries = vec![put(1, 10), delete(2)];
        let bytes = encode_blob(&entries);
        let reference = blob_ref(3, 0, 0, &bytes);
        let decoded = decode_blob(&state, reference, bytes.clone()).unwrap();
        assert_eq!(owned(decoded.iter()), entries);
        for len in 0..bytes.len() {
            assert!(decode_blob(&state, reference, bytes[..len].to_vec()).is_err());
        }
        for i in 0..bytes.len() {
            let mut torn = bytes.clone();
            torn[i] ^= 1;
            assert!(decode_blob(&state, reference, torn).is_err(), "flip at {i}");
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
        let decoded = decode_blob(&state, reference, bytes).unwrap();
        assert_eq!(owned(decoded.iter()), entries);
    }

    #[test]
    fn entries_are_located_as_bincode_encodes_them_whatever_their_widths() {
        let lengths = [0, 1, 250, 251, 252, 300, 65_535, 65_536, 70_000];
        let groups = [0, 250, 251, 65_535, 65_536, u32::MAX];
        let entries: Vec<Entry> = lengths
            .iter()
            .zip(lengths.iter().rev())
            .zip(groups.iter().cycle())
            .enumerate()
            .map(|(i, ((&key, &value), &group))| Entry {
                group,
                key: vec![i as u8; key],
                value: (i % 3 != 0).then(|| vec![0xa5; value]),
            })
            .collect();
        let bytes = encode_blob(&entries);
        let reference = blob_ref(1, 0, 0, &bytes);
        let state = StateId::new("count-0", "counts");
        let decoded = decode_blob(&state, reference, bytes).unwrap();
        assert_eq!(owned(decoded.iter()), entries);
        let borrowed: Vec<EntryRef<'_>> = decoded.iter().collect();
        assert_eq!(encode_blob(&borrowed), encode_blob(&entries));
    }

    #[test]
    fn entries_encode_as_checkpoints_before_serde_bytes_wrote_them() {
        /// `Entry` as it was, its key and value plain sequences of `u8`s.
        #[derive(Serialize)]
        struct Before {
            group: u32,
            key: Vec<u8>,
            value: Option<Vec<u8>>,
        }
        let config = bincode::config::standard();
        let bytes: Vec<u8> = (0..=255).chain(0..1_000).map(|b| b as u8).collect();
        for value in [Some(bytes[..300].to_vec()), Some(Vec::new()), None] {
            let before = Before {
                group: 70_000,
                key: bytes.clone(),
                value: value.clone(),
            };
            let now = Entry {
                group: 70_000,
                key: bytes.clone(),
                value,
            };
            let old = bincode::serde::encode_to_vec(&before, config).unwrap();
            assert_eq!(bincode::serde::encode_to_vec(&now, config).unwrap(), old);
            let borrowed = EntryRef {
                group: now.group,
                key: &now.key,
                value: now.value.as_deref(),
            };
            assert_eq!(
                bincode::serde::encode_to_vec(borrowed, config).unwrap(),
                old
            );
            let (decoded, read): (Entry, usize) =
                bincode::serde::decode_from_slice(&old, config).unwrap();
            assert_eq!((decoded, read), (now.clone(), old.len()));
            // A blob of old entries: the same bytes, read back as the entry.
            let blob = encode_blob(&[before]);
            assert_eq!(blob, encode_blob(std::slice::from_ref(&now)));
            let reference = blob_ref(1, 0, 0, &blob);
            let state = StateId::new("count-0", "counts");
            let read = decode_blob(&state, reference, blob).unwrap();
            assert_eq!(owned(read.iter()), [now]);
        }
    }

    #[test]
    fn old_blobs_whose_every_key_is_written_again_are_shadowed() {
        let cases = [
            (vec![], 0),
            (vec![vec![put(1, 10)]], 0),
            // The pending output of a sink: one entry rewritten every epoch.
            (
                vec![vec![put(1, 10)], vec![put(1, 11)], vec![put(1, 12)]],
                2,
            ),
            (
                vec![
                    vec![put(1, 10), put(2, 20)],
                    vec![put(1, 11)],
                    vec![put(2, 21)],
                ],
                1,
            ),
            (vec![vec![put(1, 10), put(2, 20)], vec![put(1, 11)]], 0),
            // A deletion shadows too, and the blob holding it stays.
            (vec![vec![put(1, 10)], vec![delete(1)], vec![put(2, 20)]], 1),
            // The first blob kept would hold a key twice.
            (vec![vec![put(1, 10)], vec![put(1, 11), put(1, 12)]], 0),
        ];
        for (chain, expected) in cases {
            let blobs: Vec<Blob> = chain.iter().map(|entries| blob(entries)).collect();
            let shed = shadowed(&blobs);
            assert_eq!(shed, expected, "{chain:?}");
            assert_eq!(merged(&chain[shed..]), merged(&chain), "{chain:?}");
        }
    }

    #[test]
    fn a_chain_without_its_shadowed_blobs_merges_to_the_same_entries() {
        // Every chain of up to four blobs over two keys, each blob putting,
        // deleting or leaving out each key.
        let choices = |index: usize| -> Vec<Vec<Entry>> {
            let mut blobs = Vec::new();
            for one in 0..3 {
                for two in 0..3 {
                    let mut entries = Vec::new();
                    for (key, choice) in [(1, one), (2, two)] {
                        match choice {
                            0 => entries.push(put(key, index as u8)),
                            1 => entries.push(delete(key)),
                            _ => {}
                        }
                    }
                    blobs.push(entries);
                }
            }
            blobs
        };
        let mut chains: Vec<Vec<Vec<Entry>>> = vec![vec![]];
        for index in 0..4 {
            chains = chains
                .into_iter()
                .flat_map(|chain| {
                    choices(index).into_iter().map(move |entries| {
                        let mut longer = chain.clone();
                        longer.push(entries);
                        longer
                    })
                })
                .collect();
            for chain in &chains {
                let blobs: Vec<Blob> = chain.iter().map(|entries| blob(entries)).collect();
                let shed = shadowed(&blobs);
                assert_eq!(merged(&chain[shed..]), merged(chain), "{chain:?}");
            }
        }
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
