//! The checkpoint head: a plain file beside sled naming the latest committed
//! checkpoint and the checksum of its manifest, replaced atomically (write,
//! fsync, rename, fsync of the directory) after each commit is durable.
//!
//! sled recovers its log by cutting it at the first record that fails its
//! checksum, and does so without an error: a few flipped bytes near the end of
//! its log lose the newest manifests, and a deleted snapshot file of sled's can
//! empty the store. The head lets recovery tell such a loss from a location
//! that never committed, so the loss is reported, and the lost epochs' numbers
//! are never given to new checkpoints.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Epoch;

/// The file's name in the checkpoint location.
pub(crate) const HEAD_FILE: &str = "checkpoint-head";

/// The latest committed checkpoint, as the head file records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Head {
    pub(crate) epoch: Epoch,
    /// CRC-32 of the manifest's stored bytes.
    pub(crate) manifest_checksum: u32,
}

impl Head {
    /// The head of the location at `dir`: `None` if it has none (it never
    /// committed, or an rtflow version before the head wrote it), an error
    /// saying what is wrong if the file is damaged.
    pub(crate) fn read(dir: &Path) -> Result<Option<Self>, String> {
        let bytes = match fs::read(dir.join(HEAD_FILE)) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(format!("{HEAD_FILE} cannot be read: {error}")),
        };
        let damaged = |why: &str| format!("{HEAD_FILE} is damaged ({why})");
        let split = bytes
            .len()
            .checked_sub(4)
            .ok_or_else(|| damaged("shorter than its checksum"))?;
        let (body, checksum) = bytes.split_at(split);
        if crc32fast::hash(body).to_le_bytes() != checksum {
            return Err(damaged("checksum mismatch"));
        }
        bincode::serde::decode_from_slice(body, bincode::config::standard())
            .map(|(head, _)| Some(head))
            .map_err(|e| damaged(&e.to_string()))
    }

    /// Replaces the head at `dir` with `self`, durably.
    pub(crate) fn write(&self, dir: &Path) -> io::Result<()> {
        let mut bytes = bincode::serde::encode_to_vec(self, bincode::config::standard())
            .expect("a head always encodes");
        bytes.extend_from_slice(&crc32fast::hash(&bytes).to_le_bytes());
        let temporary = dir.join(format!("{HEAD_FILE}.tmp"));
        let mut file = File::create(&temporary)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        fs::rename(&temporary, dir.join(HEAD_FILE))?;
        File::open(dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_reads_back_and_damage_to_it_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Head::read(dir.path()), Ok(None));
        let head = Head {
            epoch: 7,
            manifest_checksum: 0xdead_beef,
        };
        head.write(dir.path()).unwrap();
        assert_eq!(Head::read(dir.path()), Ok(Some(head)));

        let path = dir.path().join(HEAD_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[0] ^= 0x10;
        fs::write(&path, &bytes).unwrap();
        let error = Head::read(dir.path()).unwrap_err();
        assert!(error.contains("checksum mismatch"), "{error}");
        fs::write(&path, [1, 2]).unwrap();
        let error = Head::read(dir.path()).unwrap_err();
        assert!(error.contains("shorter than its checksum"), "{error}");
    }
}
