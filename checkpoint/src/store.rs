//! The checkpoint store: epoch manifests in sled at the query's checkpoint
//! location. A manifest is written with `apply_batch` and made durable with
//! `flush` before anyone is told the epoch committed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::manifest::{Corrupt, Manifest};
use crate::Epoch;

/// Why the store cannot serve a query.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
}

/// What a query resumes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The latest intact manifest, if any checkpoint was committed.
    pub manifest: Option<Manifest>,
    /// Newer manifests that failed their checksum and were passed over.
    pub skipped: Vec<Corrupt>,
}

/// Manifests by epoch, plus the query's identity.
pub struct CheckpointStore {
    path: PathBuf,
    db: sled::Db,
    manifests: sled::Tree,
    retain: usize,
}

const QUERY_ID: &[u8] = b"query_id";

/// How long opening waits for a previous user of the location to let go: sled's
/// background flusher may hold the lock for a moment after a query stopped.
const LOCK_WAIT: Duration = Duration::from_secs(2);

fn open_db(path: &Path) -> sled::Result<sled::Db> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match sled::open(path) {
            Err(sled::Error::Io(error))
                if error.to_string().contains("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

impl CheckpointStore {
    /// Opens (creating if needed) the store at `path`, keeping the latest `retain`
    /// manifests.
    pub fn open(path: impl AsRef<Path>, retain: usize) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let unusable = |reason: String| StoreError::Unusable {
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(&path).map_err(|e| unusable(e.to_string()))?;
        let db = open_db(&path).map_err(|e| unusable(e.to_string()))?;
        let manifests = db
            .open_tree("manifests")
            .map_err(|e| unusable(e.to_string()))?;
        Ok(Self {
            path,
            db,
            manifests,
            retain: retain.max(1),
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

    /// The latest intact manifest, passing over corrupt newer ones. Fails if
    /// manifests exist but none is intact: restoring nothing would be wrong.
    pub fn recover(&self) -> Result<Recovery, StoreError> {
        let mut skipped = Vec::new();
        for entry in self.manifests.iter().rev() {
            let (key, bytes) = entry.map_err(|e| self.io(e))?;
            let epoch =
                Epoch::from_be_bytes(key.as_ref().try_into().map_err(|_| self.io("bad key"))?);
            match Manifest::decode(epoch, &bytes) {
                Ok(manifest) => {
                    return Ok(Recovery {
                        manifest: Some(manifest),
                        skipped,
                    })
                }
                Err(corrupt) => skipped.push(corrupt),
            }
        }
        if skipped.is_empty() {
            Ok(Recovery {
                manifest: None,
                skipped,
            })
        } else {
            Err(StoreError::NoIntactCheckpoint {
                path: self.path.clone(),
                corrupt: skipped,
            })
        }
    }

    /// Writes `manifest` durably, then drops manifests beyond the retained few.
    /// Returns the manifest's size in bytes.
    pub fn commit(&self, manifest: &Manifest) -> Result<usize, StoreError> {
        let bytes = manifest.encode();
        let size = bytes.len();
        let mut batch = sled::Batch::default();
        batch.insert(&manifest.epoch.to_be_bytes(), bytes);
        for old in self
            .manifests
            .iter()
            .keys()
            .rev()
            .skip(self.retain.saturating_sub(1))
        {
            batch.remove(old.map_err(|e| self.io(e))?);
        }
        self.manifests.apply_batch(batch).map_err(|e| self.io(e))?;
        self.db.flush().map_err(|e| self.io(e))?;
        Ok(size)
    }

    /// The epochs of the manifests kept, oldest first.
    pub fn epochs(&self) -> Result<Vec<Epoch>, StoreError> {
        self.manifests
            .iter()
            .keys()
            .map(|key| {
                let key = key.map_err(|e| self.io(e))?;
                Ok(Epoch::from_be_bytes(
                    key.as_ref().try_into().map_err(|_| self.io("bad key"))?,
                ))
            })
            .collect()
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
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn manifest(epoch: Epoch) -> Manifest {
        Manifest {
            epoch,
            query_id: "q".into(),
            watermark: None,
            sources: BTreeMap::new(),
            committed_at_ms: epoch,
        }
    }

    #[test]
    fn keeps_the_latest_few_and_recovers_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.recover().unwrap().manifest, None);
        for epoch in 1..=5 {
            store.commit(&manifest(epoch)).unwrap();
        }
        assert_eq!(store.epochs().unwrap(), vec![3, 4, 5]);
        drop(store);
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.recover().unwrap().manifest, Some(manifest(5)));
    }

    #[test]
    fn a_corrupt_manifest_is_passed_over_for_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.commit(&manifest(1)).unwrap();
        store.commit(&manifest(2)).unwrap();
        let mut torn = manifest(2).encode();
        torn.truncate(torn.len() / 2);
        store.overwrite_manifest(2, &torn).unwrap();
        let recovery = store.recover().unwrap();
        assert_eq!(recovery.manifest, Some(manifest(1)));
        assert_eq!(recovery.skipped.len(), 1);
        assert_eq!(recovery.skipped[0].epoch, 2);

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
