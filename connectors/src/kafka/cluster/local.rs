//! Local copies of changelog partitions: a process that restores a partition
//! keeps what it read, with the offset it read to, in sled at the query's
//! checkpoint location. When the group gives it the partition again (at its
//! next start, or a later rebalance), it reads only the changelog's tail after
//! that offset.
//!
//! A copy is trusted for [`MAX_AGE`]: the log after its offset holds the
//! latest record of every key changed since (compaction keeps the latest per
//! key), but compaction drops a tombstone after `delete.retention.ms` (24 h
//! by default), after which a deletion the copy missed could be gone.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rtflow_runtime::{Result, RtflowError};
use serde::{Deserialize, Serialize};

/// How old a copy may be and still be read.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(12 * 3600);

/// A changelog partition's live records (key to value) up to an offset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Image {
    /// The next offset to read.
    pub(crate) offset: i64,
    pub(crate) saved_at_ms: u64,
    pub(crate) records: HashMap<Vec<u8>, Vec<u8>>,
}

impl Image {
    /// Applies one changelog record, in log order.
    pub(crate) fn apply(&mut self, key: &[u8], value: Option<&[u8]>) {
        match value {
            Some(value) => self.records.insert(key.to_vec(), value.to_vec()),
            None => self.records.remove(key),
        };
    }

    /// The bytes of its keys and values.
    pub(crate) fn bytes(&self) -> u64 {
        self.records
            .iter()
            .map(|(k, v)| (k.len() + v.len()) as u64)
            .sum()
    }
}

/// Where a reader of `partition` of `topic`, whose offsets now span `low` to
/// `high`, starts: its copy in `copies`, if one lies in that span, else an
/// empty image at `low`.
pub(crate) fn resume(
    copies: Option<&LocalCopies>,
    topic: &str,
    partition: i32,
    (low, high): (i64, i64),
) -> Image {
    copies
        .and_then(|copies| copies.load(topic, partition))
        .filter(|image| (low..=high).contains(&image.offset))
        .unwrap_or(Image {
            offset: low,
            ..Image::default()
        })
}

pub(crate) struct LocalCopies {
    db: sled::Db,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn key(topic: &str, partition: i32) -> Vec<u8> {
    format!("{topic}/{partition}").into_bytes()
}

impl LocalCopies {
    /// The copies kept under `location`.
    pub(crate) fn open(location: &Path) -> Result<Self> {
        let path = location.join("changelog-copies");
        let db = sled::open(&path).map_err(|e| RtflowError::CheckpointLocationUnusable {
            path: path.display().to_string(),
            reason: format!("the changelog copies cannot be opened: {e}"),
        })?;
        Ok(Self { db })
    }

    /// The copy of `partition` of `topic`, unless there is none, it does not
    /// decode, or it is too old to trust.
    pub(crate) fn load(&self, topic: &str, partition: i32) -> Option<Image> {
        let bytes = self.db.get(key(topic, partition)).ok()??;
        let (image, _): (Image, _) =
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard()).ok()?;
        let age = Duration::from_millis(now_ms().saturating_sub(image.saved_at_ms));
        (age < MAX_AGE).then_some(image)
    }

    /// Keeps `image` as the copy of `partition` of `topic`.
    pub(crate) fn save(&self, topic: &str, partition: i32, image: &mut Image) -> Result<()> {
        image.saved_at_ms = now_ms();
        let bytes = bincode::serde::encode_to_vec(&*image, bincode::config::standard())
            .expect("images always encode");
        let failed = |e: sled::Error| {
            RtflowError::Checkpoint(format!("could not keep a changelog copy: {e}"))
        };
        self.db
            .insert(key(topic, partition), bytes)
            .map_err(failed)?;
        self.db.flush().map_err(failed)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_copy_is_loaded_with_its_offset_and_records() {
        let dir = std::env::temp_dir().join(format!("rtflow-copies-{}", std::process::id()));
        let copies = LocalCopies::open(&dir).unwrap();
        let mut image = Image {
            offset: 42,
            ..Image::default()
        };
        image.apply(b"a", Some(b"1"));
        image.apply(b"b", Some(b"2"));
        image.apply(b"a", None);
        copies.save("changelog", 3, &mut image).unwrap();
        let loaded = copies.load("changelog", 3).unwrap();
        assert_eq!(loaded, image);
        assert_eq!(loaded.records.len(), 1);
        assert!(copies.load("changelog", 4).is_none());
        drop(copies);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_location_another_process_keeps_its_copies_in_is_unusable() {
        let dir = std::env::temp_dir().join(format!("rtflow-copies-held-{}", std::process::id()));
        let held = LocalCopies::open(&dir).unwrap();
        let error = LocalCopies::open(&dir).map(|_| ()).unwrap_err();
        assert_eq!(
            error.error_class(),
            "CHECKPOINT_LOCATION_UNUSABLE",
            "{error}"
        );
        assert!(error.to_string().contains("changelog copies"), "{error}");
        drop(held);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
