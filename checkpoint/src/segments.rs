//! Snapshot segments: the blobs an epoch's commit writes, one after the other in
//! one plain file per epoch, synced once. The manifests in sled say which bytes
//! of which segment make up each blob, and with which checksum.
//!
//! Plain files because a blob is written once, read only at recovery and deleted
//! whole: a database's page cache, log and its garbage collection would only
//! copy the bytes around, on the coordinator's time and the records' cores.

use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::snapshot::BlobRef;
use crate::Epoch;

const SUFFIX: &str = ".blobs";

/// The directory of segment files.
#[derive(Debug, Clone)]
pub(crate) struct Segments {
    dir: PathBuf,
}

impl Segments {
    /// The segments under `dir`, created if missing.
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub(crate) fn path(&self, epoch: Epoch) -> PathBuf {
        self.dir.join(format!("{epoch:020}{SUFFIX}"))
    }

    /// Starts the segment of `epoch`, replacing one a crash left unreferenced.
    pub(crate) fn create(&self, epoch: Epoch) -> io::Result<SegmentWriter> {
        Ok(SegmentWriter {
            file: BufWriter::with_capacity(WRITE_CHUNK, File::create(self.path(epoch))?),
            dir: self.dir.clone(),
            len: 0,
        })
    }

    /// The stored bytes of `blob`: `None` if its segment is missing, fewer bytes
    /// than the reference says if the segment was cut short.
    pub(crate) fn read(&self, blob: &BlobRef) -> io::Result<Option<Vec<u8>>> {
        let mut file = match File::open(self.path(blob.epoch)) {
            Ok(file) => file,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error),
        };
        file.seek(SeekFrom::Start(blob.offset))?;
        let mut bytes = Vec::with_capacity(blob.len as usize);
        file.take(blob.len).read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }

    /// The epochs that have a segment.
    pub(crate) fn epochs(&self) -> io::Result<Vec<Epoch>> {
        let mut epochs = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name();
            let epoch = name
                .to_str()
                .and_then(|name| name.strip_suffix(SUFFIX))
                .and_then(|epoch| epoch.parse::<Epoch>().ok());
            epochs.extend(epoch);
        }
        Ok(epochs)
    }

    pub(crate) fn remove(&self, epoch: Epoch) -> io::Result<()> {
        match std::fs::remove_file(self.path(epoch)) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
            _ => Ok(()),
        }
    }

    /// Cuts the segment of `epoch` to half its length (tests of corruption);
    /// returns whether there was one.
    pub(crate) fn truncate(&self, epoch: Epoch) -> io::Result<bool> {
        let path = self.path(epoch);
        let Ok(metadata) = std::fs::metadata(&path) else {
            return Ok(false);
        };
        let file = File::options().write(true).open(&path)?;
        file.set_len(metadata.len() / 2)?;
        file.sync_all()?;
        Ok(true)
    }
}

/// The most bytes one `write` system call copies. A kernel without
/// preemption (`preempt=none`, common on VMs) finishes a system call before a
/// woken actor can take the core, and copying into fresh page-cache pages is
/// slow where the host reclaims freed guest memory: a 100 kB blob written in
/// one call kept the coordinator, idle priority or not, on its core for
/// milliseconds.
const WRITE_CHUNK: usize = 16 * 1024;

/// One segment being written.
pub(crate) struct SegmentWriter {
    file: BufWriter<File>,
    dir: PathBuf,
    len: u64,
}

impl SegmentWriter {
    /// Appends `bytes`; returns the offset they start at.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let offset = self.len;
        for chunk in bytes.chunks(WRITE_CHUNK) {
            self.file.write_all(chunk)?;
        }
        self.len += bytes.len() as u64;
        Ok(offset)
    }

    /// Makes the segment durable: its bytes, and its name in the directory.
    pub(crate) fn finish(self) -> io::Result<()> {
        let file = self.file.into_inner().map_err(|e| e.into_error())?;
        file.sync_data()?;
        File::open(&self.dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::blob_ref;

    #[test]
    fn blobs_read_back_from_their_offsets_and_a_cut_segment_reads_short() {
        let dir = tempfile::tempdir().unwrap();
        let segments = Segments::open(dir.path()).unwrap();
        let mut writer = segments.create(7).unwrap();
        let first = blob_ref(7, 0, writer.append(b"first").unwrap(), b"first");
        let second = blob_ref(7, 1, writer.append(b"second").unwrap(), b"second");
        writer.finish().unwrap();

        assert_eq!(segments.read(&first).unwrap().unwrap(), b"first");
        assert_eq!(segments.read(&second).unwrap().unwrap(), b"second");
        assert_eq!(segments.epochs().unwrap(), vec![7]);

        assert!(segments.truncate(7).unwrap());
        assert_eq!(segments.read(&second).unwrap().unwrap(), b"");
        segments.remove(7).unwrap();
        assert_eq!(segments.read(&first).unwrap(), None);
        assert!(segments.epochs().unwrap().is_empty());
    }
}
