//! The checkpoint store at the query's checkpoint location: epoch manifests and
//! the query id in sled, state snapshot blobs in one segment file per epoch
//! beside it (the private `segments` module). A commit writes and syncs the
//! epoch's segment, then writes its manifest and flushes, before anyone is told
//! the epoch committed: a manifest that reads back intact refers only to blobs
//! already durable. Retention keeps the latest few manifests; segments none of
//! them refers to are deleted.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::head::{Head, HEAD_FILE};
use crate::manifest::{Corrupt, Manifest};
use crate::segments::Segments;
use crate::snapshot::{
    blob_ref, decode_blob, encode_blob, merge, shadowed, Blob, BlobRef, Delta, Entries, StateChain,
    StateId, StateMeta, BASE_PART,
};
use crate::Epoch;

/// Why the store cannot serve a query.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("checkpoint location {path} is unusable: {reason}")]
    Unusable { path: PathBuf, reason: String },
    #[error("checkpoint location {path} holds checkpoints, but none is intact ({corrupt:?})")]
    NoIntactCheckpoint {
        path: PathBuf,
        corrupt: Vec<Corrupt>,
    },
    #[error("checkpoint location {path}: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("checkpoint location {path} is damaged: {reason}")]
    Damaged { path: PathBuf, reason: String },
}

/// A state as the recovered checkpoint left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoredState {
    pub meta: StateMeta,
    /// The state's snapshot blobs, checked, oldest first. Applying their entries
    /// in that order (a later entry for a key replaces an earlier one, a deletion
    /// removes the key) rebuilds the state: a restoring instance does so straight
    /// into its own map, which saves merging the chain into another one first.
    pub blobs: Vec<Blob>,
}

impl RestoredState {
    /// Every live entry (the blobs merged), in no particular order.
    pub fn entries(&self) -> Entries<'_> {
        merge(&self.blobs)
    }
}

/// What a query resumes from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovery {
    /// The latest intact checkpoint's manifest, if any checkpoint was committed.
    pub manifest: Option<Manifest>,
    /// Its states, rebuilt from their snapshot blobs.
    pub state: BTreeMap<StateId, RestoredState>,
    /// Newer checkpoints that failed a checksum and were passed over.
    pub skipped: Vec<Corrupt>,
}

/// What a commit wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitStats {
    /// Bytes of the manifest and the new snapshot blobs.
    pub bytes: usize,
    /// Entries in the new snapshot blobs.
    pub entries: usize,
}

/// Manifests by epoch, snapshot segments, and the query's identity.
pub struct CheckpointStore {
    path: PathBuf,
    db: sled::Db,
    manifests: sled::Tree,
    segments: Segments,
    retain: usize,
    /// The retained manifests, oldest first; the last is the latest commit.
    kept: VecDeque<Manifest>,
    /// The compaction running on its thread.
    compaction: Option<Compaction>,
    /// A finished compaction, for the next commit to apply.
    folded: Option<Folded>,
}

/// A compaction in progress.
struct Compaction {
    /// The blobs it folds: their segments are kept from garbage collection while
    /// it reads them.
    chain: Vec<BlobRef>,
    /// Joined, never left behind: the thread holds the store's segments (and
    /// with them the location's lock) until it has ended.
    thread: JoinHandle<Result<Folded, String>>,
}

impl Compaction {
    /// Waits for the thread to end; its panic comes back as an error.
    fn join(self) -> Result<Folded, String> {
        self.thread.join().unwrap_or_else(|panic| {
            let message = (panic.downcast_ref::<&str>().copied())
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(no message)");
            Err(format!("thread 'rtflow-compact' panicked: {message}"))
        })
    }
}

/// A prefix of a state's chain, made shorter.
struct Folded {
    state: StateId,
    /// The blobs the compaction read.
    chain: Vec<BlobRef>,
    into: FoldedInto,
}

/// What replaces the blobs a compaction read.
enum FoldedInto {
    /// One base blob of these bytes.
    Base(Vec<u8>),
    /// The blobs after the first `n`, which later blobs shadow: nothing to write.
    Shed(usize),
}

const QUERY_ID: &[u8] = b"query_id";

/// A chain longer than this is compacted into one base blob.
const MAX_CHAIN: usize = 32;

/// How long opening waits for a previous user of the location to let go: sled's
/// background flusher may hold the lock for a moment after a query stopped.
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Opens sled at `path`. Files sled cannot make sense of are the location's
/// damage, not its unusability: they fail as [`StoreError::Damaged`].
fn open_db(path: &Path) -> Result<sled::Db, StoreError> {
    let deadline = Instant::now() + LOCK_WAIT;
    let error = |kind: fn(PathBuf, String) -> StoreError, reason: String| {
        Err(kind(path.to_path_buf(), reason))
    };
    let unusable = |path, reason| StoreError::Unusable { path, reason };
    let damaged = |path, reason| StoreError::Damaged { path, reason };
    loop {
        // sled panics on some damage rather than report it.
        let opened = std::panic::catch_unwind(|| sled::open(path));
        match opened {
            Ok(Ok(db)) => return Ok(db),
            Ok(Err(sled::Error::Io(io)))
                if io.to_string().contains("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(Err(sled::Error::Io(io)))
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData
                ) =>
            {
                return error(damaged, format!("sled cannot read its files: {io}"))
            }
            Ok(Err(sled::Error::Io(io))) => return error(unusable, io.to_string()),
            Ok(Err(other)) => {
                return error(damaged, format!("sled cannot read its files: {other}"))
            }
            Err(_) => return error(damaged, "sled failed reading its files".to_owned()),
        }
    }
}

/// Reads and checks one state's blobs, oldest first.
fn read_chain(
    segments: &Segments,
    state: &StateId,
    chain: &StateChain,
) -> Result<Vec<Blob>, Corrupt> {
    chain
        .blobs
        .iter()
        .map(|blob| {
            let corrupt = |reason: String| Corrupt {
                epoch: blob.epoch,
                reason,
            };
            match segments.read(blob) {
                Ok(Some(bytes)) => {
                    decode_blob(state, *blob, bytes).map_err(|e| corrupt(e.to_string()))
                }
                Ok(None) => Err(corrupt(format!(
                    "the segment of snapshot blob {blob:?} of {state} is missing"
                ))),
                Err(e) => Err(corrupt(format!(
                    "snapshot blob {blob:?} of {state} cannot be read: {e}"
                ))),
            }
        })
        .collect()
}

fn epoch_of(key: &[u8]) -> Option<Epoch> {
    Some(Epoch::from_be_bytes(key.try_into().ok()?))
}

impl CheckpointStore {
    /// Opens (creating if needed) the store at `path`, keeping the latest `retain`
    /// checkpoints.
    pub fn open(path: impl AsRef<Path>, retain: usize) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let unusable = |reason: String| StoreError::Unusable {
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(&path).map_err(|e| unusable(e.to_string()))?;
        let db = open_db(&path)?;
        let manifests = db
            .open_tree("manifests")
            .map_err(|e| unusable(e.to_string()))?;
        let segments =
            Segments::open(&path.join("snapshots")).map_err(|e| unusable(e.to_string()))?;
        // A location that cannot be written to fails now, not at the first commit.
        db.insert(b"opened", &[1])
            .and_then(|_| db.flush())
            .map_err(|e| unusable(e.to_string()))?;
        Ok(Self {
            path,
            db,
            manifests,
            segments,
            retain: retain.max(1),
            kept: VecDeque::new(),
            compaction: None,
            folded: None,
        })
    }

    fn io(&self, error: impl std::fmt::Display) -> StoreError {
        StoreError::Io {
            path: self.path.clone(),
            reason: error.to_string(),
        }
    }

    /// The query id stored here, or `new_id` stored now for a first start.
    pub fn query_id(&self, new_id: impl FnOnce() -> String) -> Result<String, StoreError> {
        if let Some(id) = self.db.get(QUERY_ID).map_err(|e| self.io(e))? {
            return Ok(String::from_utf8_lossy(&id).into_owned());
        }
        let id = new_id();
        self.db
            .insert(QUERY_ID, id.as_bytes())
            .map_err(|e| self.io(e))?;
        self.db.flush().map_err(|e| self.io(e))?;
        Ok(id)
    }

    /// Every stored manifest, newest first, each decoded or found corrupt,
    /// checked against the head: a manifest other than the one the head names,
    /// under the head's epoch, is corrupt.
    fn stored_manifests(
        &self,
        head: Option<Head>,
    ) -> Result<Vec<Result<Manifest, Corrupt>>, StoreError> {
        self.manifests
            .iter()
            .rev()
            .map(|entry| {
                let (key, bytes) = entry.map_err(|e| self.io(e))?;
                let epoch = epoch_of(&key).ok_or_else(|| self.io("bad manifest key"))?;
                let replaced = head.is_some_and(|head| {
                    head.epoch == epoch && head.manifest_checksum != crc32fast::hash(&bytes)
                });
                if replaced {
                    return Ok(Err(Corrupt {
                        epoch,
                        reason: format!("it is not the manifest {HEAD_FILE} names"),
                    }));
                }
                Ok(Manifest::decode(epoch, &bytes))
            })
            .collect()
    }

    fn damaged(&self, reason: String) -> StoreError {
        StoreError::Damaged {
            path: self.path.clone(),
            reason,
        }
    }

    /// The head of the location, and what the store lost of it: the head's
    /// checkpoint when its manifest is gone (sled dropped it), as damage
    /// recovery passes over. A store with no manifest at all but a head, or
    /// snapshot segments that only a commit leaves behind, lost its
    /// checkpoints: that fails, since starting afresh would process and
    /// publish everything again.
    fn check_head(&self) -> Result<(Option<Head>, Option<Corrupt>), StoreError> {
        let head = Head::read(&self.path).map_err(|reason| self.damaged(reason))?;
        let newest = self
            .manifests
            .iter()
            .keys()
            .next_back()
            .transpose()
            .map_err(|e| self.io(e))?
            .and_then(|key| epoch_of(&key));
        let Some(newest) = newest else {
            if let Some(head) = head {
                return Err(self.damaged(format!(
                    "its store holds no checkpoint manifest, but {HEAD_FILE} names the \
                     checkpoint of epoch {}: the store lost its checkpoints",
                    head.epoch
                )));
            }
            // The first epoch's segment is written before its manifest: a crash
            // between the two leaves it alone. Any other means a commit was lost.
            let mut orphans = self.segments.epochs().map_err(|e| self.io(e))?;
            orphans.retain(|epoch| *epoch != 1);
            orphans.sort_unstable();
            if !orphans.is_empty() {
                return Err(self.damaged(format!(
                    "it holds snapshot segments of epochs {orphans:?} but its store has no \
                     checkpoint manifest: the store lost its checkpoints"
                )));
            }
            return Ok((None, None));
        };
        let lost = head.filter(|head| head.epoch > newest).map(|head| Corrupt {
            epoch: head.epoch,
            reason: format!(
                "{HEAD_FILE} names it, but its manifest is missing from the store (the \
                 newest stored is epoch {newest})"
            ),
        });
        Ok((head, lost))
    }

    /// The latest checkpoint whose manifest and snapshots are intact, passing over
    /// damaged newer ones. Fails if checkpoints exist but none is intact: restoring
    /// nothing would be wrong.
    pub fn recover(&mut self) -> Result<Recovery, StoreError> {
        let (head, lost) = self.check_head()?;
        let mut skipped: Vec<Corrupt> = lost.into_iter().collect();
        let stored = self.stored_manifests(head)?;
        let mut intact = Vec::new();
        for manifest in stored {
            let manifest = match manifest {
                Ok(manifest) => manifest,
                Err(corrupt) => {
                    skipped.push(corrupt);
                    continue;
                }
            };
            let mut state = BTreeMap::new();
            let mut damage = None;
            for (id, chain) in &manifest.state {
                match read_chain(&self.segments, id, chain) {
                    Ok(blobs) => {
                        state.insert(
                            id.clone(),
                            RestoredState {
                                meta: chain.meta.clone(),
                                blobs,
                            },
                        );
                    }
                    Err(corrupt) => {
                        damage = Some(Corrupt {
                            epoch: manifest.epoch,
                            reason: corrupt.reason,
                        });
                        break;
                    }
                }
            }
            match damage {
                Some(corrupt) => skipped.push(corrupt),
                None => {
                    intact.push(manifest.clone());
                    // Older intact manifests stay retained; newer damaged ones
                    // are replaced by the next commits.
                    for older in self.stored_manifests(head)?.into_iter().flatten() {
                        if older.epoch < manifest.epoch {
                            intact.push(older);
                        }
                    }
                    intact.reverse();
                    self.kept = intact.into();
                    return Ok(Recovery {
                        manifest: Some(manifest),
                        state,
                        skipped,
                    });
                }
            }
        }
        if skipped.is_empty() {
            Ok(Recovery::default())
        } else {
            Err(StoreError::NoIntactCheckpoint {
                path: self.path.clone(),
                corrupt: skipped,
            })
        }
    }

    /// Commits an epoch: writes `deltas` as snapshot blobs into the epoch's
    /// segment and syncs it, then writes `manifest` with every state's chain (the
    /// previous commit's, extended by the new blobs) and flushes, then drops what
    /// retention no longer needs, and the damaged manifests recovery passed over.
    pub fn commit(
        &mut self,
        mut manifest: Manifest,
        deltas: Vec<Delta>,
    ) -> Result<(Manifest, CommitStats), StoreError> {
        let mut stats = CommitStats::default();
        manifest.state = self
            .kept
            .back()
            .map(|last| last.state.clone())
            .unwrap_or_default();
        let epoch = manifest.epoch;
        let folded = self.folded.take();
        let mut segment = None;
        let mut append = |bytes: &[u8]| -> Result<u64, StoreError> {
            let writer = match &mut segment {
                Some(writer) => writer,
                None => segment.insert(self.segments.create(epoch).map_err(|e| self.io(e))?),
            };
            writer.append(bytes).map_err(|e| self.io(e))
        };
        if let Some(folded) = folded {
            if let Some(chain) = manifest.state.get_mut(&folded.state) {
                if chain.blobs.starts_with(&folded.chain) {
                    match folded.into {
                        FoldedInto::Base(bytes) => {
                            let offset = append(&bytes)?;
                            stats.bytes += bytes.len();
                            let base = blob_ref(epoch, BASE_PART, offset, &bytes);
                            chain.blobs.splice(..folded.chain.len(), [base]);
                        }
                        FoldedInto::Shed(n) => {
                            chain.blobs.drain(..n);
                        }
                    }
                }
            }
        }
        for delta in deltas {
            if delta.entries.is_empty() {
                continue;
            }
            let bytes = encode_blob(&delta.entries);
            let blob = blob_ref(epoch, delta.part, append(&bytes)?, &bytes);
            stats.bytes += bytes.len();
            stats.entries += delta.entries.len();
            let chain = manifest
                .state
                .entry(delta.state)
                .or_insert_with(|| StateChain {
                    meta: delta.meta.clone(),
                    blobs: Vec::new(),
                });
            chain.meta = delta.meta;
            chain.blobs.push(blob);
        }
        if let Some(writer) = segment {
            writer.finish().map_err(|e| self.io(e))?;
        }

        let bytes = manifest.encode();
        let manifest_checksum = crc32fast::hash(&bytes);
        stats.bytes += bytes.len();
        let mut batch = sled::Batch::default();
        // Every stored manifest after the last kept one is a damaged one that
        // recovery passed over.
        let passed_over = self.kept.back().map_or(0, |last| last.epoch + 1);
        for key in self.manifests.range(passed_over.to_be_bytes()..).keys() {
            batch.remove(key.map_err(|e| self.io(e))?);
        }
        batch.insert(&manifest.epoch.to_be_bytes(), bytes);
        self.kept.retain(|kept| kept.epoch < manifest.epoch);
        self.kept.push_back(manifest.clone());
        while self.kept.len() > self.retain {
            let old = self.kept.pop_front().expect("more than retained");
            batch.remove(&old.epoch.to_be_bytes());
        }
        for key in self
            .manifests
            .range(..self.kept[0].epoch.to_be_bytes())
            .keys()
        {
            batch.remove(key.map_err(|e| self.io(e))?);
        }
        self.manifests.apply_batch(batch).map_err(|e| self.io(e))?;
        self.db.flush().map_err(|e| self.io(e))?;
        Head {
            epoch,
            manifest_checksum,
        }
        .write(&self.path)
        .map_err(|e| self.io(e))?;
        self.collect_garbage()?;
        Ok((manifest, stats))
    }

    /// Deletes the segments no retained manifest refers to (and no running
    /// compaction reads).
    fn collect_garbage(&self) -> Result<(), StoreError> {
        let compacting = self.compaction.iter().flat_map(|c| &c.chain);
        let referenced: HashSet<Epoch> = self
            .kept
            .iter()
            .flat_map(|m| m.state.values())
            .flat_map(|chain| &chain.blobs)
            .chain(compacting)
            .map(|blob| blob.epoch)
            .collect();
        for epoch in self.segments.epochs().map_err(|e| self.io(e))? {
            if !referenced.contains(&epoch) {
                self.segments.remove(epoch).map_err(|e| self.io(e))?;
            }
        }
        Ok(())
    }

    /// Folds a long or heavy snapshot chain of the latest checkpoint into one base
    /// blob, on a thread of its own so that neither records nor commits wait for
    /// it. Call it after each commit: it starts a compaction when one is due and
    /// none runs, and picks up a finished one, which the next commit applies (its
    /// manifest's chain starts with the base instead of the blobs it folded).
    /// When later blobs shadow the oldest ones ([`shadowed`]), as with a state
    /// rewritten whole every epoch, the compaction drops those instead and
    /// writes nothing. Returns whether a compaction started.
    pub fn compact(&mut self) -> Result<bool, StoreError> {
        if let Some(running) = &self.compaction {
            if !running.thread.is_finished() {
                return Ok(false);
            }
            if let Some(running) = self.compaction.take() {
                self.folded = Some(running.join().map_err(|e| self.io(e))?);
            }
        }
        if self.folded.is_some() {
            return Ok(false);
        }
        let Some(latest) = self.kept.back() else {
            return Ok(false);
        };
        let Some((id, chain)) = latest
            .state
            .iter()
            .find(|(_, chain)| chain.due_for_compaction(MAX_CHAIN))
        else {
            return Ok(false);
        };
        let (id, chain) = (id.clone(), chain.clone());
        let chain_blobs = chain.blobs.clone();
        let segments = self.segments.clone();
        // A panic folding the chain fails the next commit, which joins this
        // thread, rather than pass unseen.
        let thread = std::thread::Builder::new()
            .name("rtflow-compact".into())
            .spawn(move || {
                read_chain(&segments, &id, &chain)
                    .map(|blobs| Folded {
                        into: match shadowed(&blobs) {
                            0 => FoldedInto::Base(encode_blob(
                                &merge(&blobs).iter().collect::<Vec<_>>(),
                            )),
                            n => FoldedInto::Shed(n),
                        },
                        state: id,
                        chain: chain.blobs,
                    })
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| self.io(e))?;
        self.compaction = Some(Compaction {
            chain: chain_blobs,
            thread,
        });
        Ok(true)
    }

    /// Waits for the running compaction, if any, so the next commit applies it.
    pub fn finish_compaction(&mut self) -> Result<(), StoreError> {
        if let Some(running) = self.compaction.take() {
            self.folded = Some(running.join().map_err(|e| self.io(e))?);
        }
        Ok(())
    }

    /// The epochs of the manifests kept, oldest first.
    pub fn epochs(&self) -> Result<Vec<Epoch>, StoreError> {
        self.manifests
            .iter()
            .keys()
            .map(|key| {
                let key = key.map_err(|e| self.io(e))?;
                epoch_of(&key).ok_or_else(|| self.io("bad manifest key"))
            })
            .collect()
    }

    /// How many snapshot segments are stored.
    pub fn segment_count(&self) -> Result<usize, StoreError> {
        Ok(self.segments.epochs().map_err(|e| self.io(e))?.len())
    }

    /// Overwrites the stored bytes of `epoch`'s manifest (tests of corruption).
    #[doc(hidden)]
    pub fn overwrite_manifest(&self, epoch: Epoch, bytes: &[u8]) -> Result<(), StoreError> {
        self.manifests
            .insert(epoch.to_be_bytes(), bytes)
            .map_err(|e| self.io(e))?;
        self.db.flush().map_err(|e| self.io(e))?;
        Ok(())
    }

    /// Cuts the snapshot segment of `epoch` short (tests of corruption); returns
    /// whether there was one.
    #[doc(hidden)]
    pub fn truncate_snapshots(&self, epoch: Epoch) -> Result<bool, StoreError> {
        self.segments.truncate(epoch).map_err(|e| self.io(e))
    }
}

impl Drop for CheckpointStore {
    /// Lets a running compaction finish, so the location is free for the next
    /// query once this one is gone.
    fn drop(&mut self) {
        if let Some(running) = self.compaction.take() {
            let _ = running.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::snapshot::Entry;

    fn manifest(epoch: Epoch) -> Manifest {
        Manifest {
            epoch,
            query_id: "q".into(),
            watermark: None,
            sources: BTreeMap::new(),
            state: BTreeMap::new(),
            key_groups: 128,
            committed_at_ms: epoch,
            run_id: "run".into(),
        }
    }

    fn counts() -> StateId {
        StateId::new("count-0", "counts")
    }

    /// A delta of subtask `part` setting `key` to `value` (deleting on `None`).
    fn delta(part: u32, changes: &[(u8, Option<u8>)]) -> Delta {
        Delta {
            state: counts(),
            meta: StateMeta {
                kind: "count".into(),
                signature: "(u8, u8)".into(),
            },
            part,
            keyed: true,
            entries: changes
                .iter()
                .map(|(key, value)| Entry {
                    group: u32::from(*key),
                    key: vec![*key],
                    value: value.map(|v| vec![v]),
                })
                .collect(),
        }
    }

    fn restored(recovery: &Recovery) -> Vec<(u8, u8)> {
        let mut entries: Vec<(u8, u8)> = recovery.state[&counts()]
            .entries()
            .iter()
            .map(|e| (e.key[0], e.value.as_ref().unwrap()[0]))
            .collect();
        entries.sort_unstable();
        entries
    }

    #[test]
    fn keeps_the_latest_few_and_recovers_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.recover().unwrap().manifest, None);
        for epoch in 1..=5 {
            store.commit(manifest(epoch), Vec::new()).unwrap();
        }
        assert_eq!(store.epochs().unwrap(), vec![3, 4, 5]);
        drop(store);
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.recover().unwrap().manifest, Some(manifest(5)));
    }

    #[test]
    fn state_is_rebuilt_from_incremental_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        store.recover().unwrap();
        store
            .commit(
                manifest(1),
                vec![
                    delta(0, &[(1, Some(1)), (2, Some(1))]),
                    delta(1, &[(3, Some(1))]),
                ],
            )
            .unwrap();
        let (committed, stats) = store
            .commit(manifest(2), vec![delta(0, &[(1, Some(2)), (2, None)])])
            .unwrap();
        assert_eq!(stats.entries, 2, "only what changed is written");
        assert_eq!(committed.state[&counts()].blobs.len(), 3);
        store.commit(manifest(3), Vec::new()).unwrap();
        drop(store);

        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest.as_ref().unwrap().epoch, 3);
        assert_eq!(restored(&recovery), vec![(1, 2), (3, 1)]);
    }

    #[test]
    fn compaction_keeps_the_state_and_garbage_collection_drops_old_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        store.recover().unwrap();
        for epoch in 1..=40u8 {
            let key = epoch % 5;
            store
                .commit(
                    manifest(epoch.into()),
                    vec![delta(0, &[(key, Some(epoch))])],
                )
                .unwrap();
            store.compact().unwrap();
            store.finish_compaction().unwrap();
        }
        let latest = store.kept.back().unwrap();
        assert!(latest.state[&counts()].blobs.len() < 5, "chains are folded");
        let segments = store.segment_count().unwrap();
        assert!(segments <= 2 * (MAX_CHAIN + 1), "{segments} segments");
        drop(store);
        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(
            restored(&recovery),
            vec![(0, 40), (1, 36), (2, 37), (3, 38), (4, 39)]
        );
    }

    #[test]
    fn a_state_rewritten_every_epoch_sheds_its_old_blobs_without_writing_a_base() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        store.recover().unwrap();
        for epoch in 1..=10u8 {
            let (committed, _) = store
                .commit(
                    manifest(epoch.into()),
                    vec![delta(0, &[(1, Some(epoch)), (2, Some(epoch))])],
                )
                .unwrap();
            let blobs = &committed.state[&counts()].blobs;
            // Compaction is due once the deltas outweigh the first blob.
            assert!(blobs.len() <= 3, "epoch {epoch}: {blobs:?}");
            assert!(
                blobs.iter().all(|blob| blob.part != BASE_PART),
                "epoch {epoch}: a base was written: {blobs:?}"
            );
            store.compact().unwrap();
            store.finish_compaction().unwrap();
        }
        assert!(store.segment_count().unwrap() <= 4);
        drop(store);
        let mut store = CheckpointStore::open(dir.path(), 2).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(restored(&recovery), vec![(1, 10), (2, 10)]);
    }

    /// Three committed epochs with state, in a store closed afterwards.
    fn three_checkpoints(dir: &Path) {
        let mut store = CheckpointStore::open(dir, 3).unwrap();
        store.recover().unwrap();
        for epoch in 1..=3u8 {
            store
                .commit(manifest(epoch.into()), vec![delta(0, &[(1, Some(epoch))])])
                .unwrap();
        }
    }

    #[test]
    fn a_manifest_the_store_dropped_is_passed_over_as_damage_never_silently() {
        let dir = tempfile::tempdir().unwrap();
        three_checkpoints(dir.path());
        // What sled's recovery does when the end of its log is damaged.
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.manifests.remove(3u64.to_be_bytes()).unwrap();
        store.db.flush().unwrap();
        drop(store);

        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest.as_ref().unwrap().epoch, 2);
        assert_eq!(recovery.skipped.len(), 1, "{:?}", recovery.skipped);
        assert_eq!(
            recovery.skipped[0].epoch, 3,
            "its number is not given again"
        );
        assert!(recovery.skipped[0]
            .reason
            .contains("missing from the store"));
    }

    #[test]
    fn a_store_that_lost_every_manifest_fails_rather_than_start_afresh() {
        let dir = tempfile::tempdir().unwrap();
        three_checkpoints(dir.path());
        let wipe_sled = || {
            for entry in std::fs::read_dir(dir.path()).unwrap() {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_str().unwrap().to_owned();
                if name == "snapshots" || name.starts_with(HEAD_FILE) {
                    continue;
                }
                if path.is_dir() {
                    std::fs::remove_dir_all(&path).unwrap();
                } else {
                    std::fs::remove_file(&path).unwrap();
                }
            }
        };
        wipe_sled();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        let error = store.recover().unwrap_err();
        assert!(
            matches!(&error, StoreError::Damaged { reason, .. }
                if reason.contains("names the checkpoint of epoch 3")),
            "{error}"
        );
        drop(store);

        // Without the head, the segments still tell that commits happened.
        std::fs::remove_file(dir.path().join(HEAD_FILE)).unwrap();
        wipe_sled();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        let error = store.recover().unwrap_err();
        assert!(
            matches!(&error, StoreError::Damaged { reason, .. }
                if reason.contains("snapshot segments of epochs [2, 3]")),
            "{error}"
        );
    }

    #[test]
    fn the_first_epochs_segment_alone_is_a_crash_before_the_first_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        let mut segment = store.segments.create(1).unwrap();
        segment.append(b"blob").unwrap();
        segment.finish().unwrap();
        drop(store);
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.recover().unwrap(), Recovery::default());
    }

    #[test]
    fn a_damaged_head_fails_the_recovery() {
        let dir = tempfile::tempdir().unwrap();
        three_checkpoints(dir.path());
        std::fs::write(dir.path().join(HEAD_FILE), b"garbage").unwrap();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        let error = store.recover().unwrap_err();
        assert!(
            matches!(&error, StoreError::Damaged { reason, .. } if reason.contains(HEAD_FILE)),
            "{error}"
        );
    }

    #[test]
    fn a_truncated_snapshot_falls_back_to_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.recover().unwrap();
        store
            .commit(manifest(1), vec![delta(0, &[(1, Some(1))])])
            .unwrap();
        store
            .commit(manifest(2), vec![delta(0, &[(1, Some(2))])])
            .unwrap();
        assert!(store.truncate_snapshots(2).unwrap());
        drop(store);

        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest.as_ref().unwrap().epoch, 1);
        assert_eq!(restored(&recovery), vec![(1, 1)]);
        assert!(
            recovery.skipped[0].reason.contains("truncated"),
            "{:?}",
            recovery.skipped
        );

        // The next commit replaces the damaged epoch 2.
        store
            .commit(manifest(2), vec![delta(0, &[(1, Some(5))])])
            .unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(restored(&recovery), vec![(1, 5)]);

        store.truncate_snapshots(1).unwrap();
        store.truncate_snapshots(2).unwrap();
        assert!(matches!(
            store.recover(),
            Err(StoreError::NoIntactCheckpoint { .. })
        ));
    }

    /// A store where key 1 is 1 at epoch 1 and 2 at epoch 2.
    fn two_epochs(dir: &Path) -> CheckpointStore {
        let mut store = CheckpointStore::open(dir, 3).unwrap();
        store
            .commit(manifest(1), vec![delta(0, &[(1, Some(1))])])
            .unwrap();
        store
            .commit(manifest(2), vec![delta(0, &[(1, Some(2))])])
            .unwrap();
        store
    }

    /// Asserts that recovery passed over epoch 2 for `reason` and restored
    /// epoch 1.
    fn assert_fell_back_to_epoch_1(store: &mut CheckpointStore, reason: &str) {
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest.as_ref().unwrap().epoch, 1);
        assert_eq!(restored(&recovery), vec![(1, 1)]);
        assert_eq!(recovery.skipped[0].epoch, 2);
        assert!(
            recovery.skipped[0].reason.contains(reason),
            "{:?}",
            recovery.skipped
        );
    }

    #[test]
    fn a_missing_segment_falls_back_to_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = two_epochs(dir.path());
        store.segments.remove(2).unwrap();
        assert_fell_back_to_epoch_1(&mut store, "is missing");
    }

    #[test]
    fn an_unreadable_segment_falls_back_to_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = two_epochs(dir.path());
        // A directory where the segment was opens but cannot be read.
        let segment = store.segments.path(2);
        std::fs::remove_file(&segment).unwrap();
        std::fs::create_dir(&segment).unwrap();
        assert_fell_back_to_epoch_1(&mut store, "cannot be read");
    }

    #[test]
    fn a_corrupt_manifest_is_passed_over_for_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.commit(manifest(1), Vec::new()).unwrap();
        store.commit(manifest(2), Vec::new()).unwrap();
        let mut torn = manifest(2).encode();
        torn.truncate(torn.len() / 2);
        store.overwrite_manifest(2, &torn).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest, Some(manifest(1)));
        assert_eq!(recovery.skipped.len(), 1);
        assert_eq!(recovery.skipped[0].epoch, 2);
        // The next commit (numbered after the damaged one) drops it.
        store.commit(manifest(3), Vec::new()).unwrap();
        assert_eq!(store.epochs().unwrap(), vec![1, 3]);
        drop(store);
        let mut store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert!(store.recover().unwrap().skipped.is_empty());

        store.overwrite_manifest(3, b"garbage").unwrap();
        store.overwrite_manifest(1, b"garbage").unwrap();
        assert!(matches!(
            store.recover(),
            Err(StoreError::NoIntactCheckpoint { .. })
        ));
    }

    #[test]
    fn the_query_id_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let id = CheckpointStore::open(dir.path(), 1)
            .unwrap()
            .query_id(|| "first".into())
            .unwrap();
        let again = CheckpointStore::open(dir.path(), 1)
            .unwrap()
            .query_id(|| "second".into())
            .unwrap();
        assert_eq!((id.as_str(), again.as_str()), ("first", "first"));
    }

    #[test]
    fn an_unusable_location_is_reported() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let error = CheckpointStore::open(file.path(), 1).err().unwrap();
        assert!(matches!(error, StoreError::Unusable { .. }), "{error}");
    }
}
