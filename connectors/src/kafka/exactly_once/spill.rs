//! The exactly-once writer's output on disk, written as it is sent.
//!
//! Every checkpoint must hold the output of the epochs whose transactions have
//! not committed (see the module above). Handed to the checkpoint as state at
//! the barrier, that output was written and synced there, a whole epoch at once
//! (some 10 MB at 30,000 records/s of 1.2 KB), while every record of the epoch
//! waited for the checkpoint to become visible. Instead the writer appends each
//! message to a file of its own as it sends it, through a thread that writes
//! the file and syncs it every few milliseconds, so at the barrier only the
//! tail is left to sync, and the checkpoint holds the file's name, length and
//! checksum ([`Spilled`]).
//!
//! Files live in `<checkpoint location>/sink-output/<sink uid>/`, one per ended
//! epoch of each writer, named `<run>-<subtask>-<sequence>`. An epoch's file is
//! deleted once its transaction commits. At a run's first commit every writer
//! has settled what it restored (each did at its first barrier at the latest),
//! so files of earlier runs are deleted then too: those the restored
//! checkpoint named, and those a crash left behind after it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rtflow_runtime::Epoch;
use serde::{Deserialize, Serialize};

use super::outbox::{End, Ended, Pending};
use crate::kafka::KafkaMessage;

/// How often the thread syncs the file being written: what is left for the
/// barrier to sync is about this much of the epoch's output.
const SYNC_EVERY: Duration = Duration::from_millis(10);

/// Bytes the writer hands its file thread at a time.
const WRITE_CHUNK: usize = 64 * 1024;

/// Chunks that may wait for the file thread: 4 MiB.
const QUEUED_CHUNKS: usize = 64;

/// One ended epoch's output in its file, as a checkpoint names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Spilled {
    pub(crate) end: End,
    /// The file's name in the sink's directory.
    pub(crate) file: String,
    pub(crate) len: u64,
    pub(crate) messages: u64,
    /// CRC-32 of the file's `len` bytes.
    pub(crate) checksum: u32,
}

/// The writer's checkpointed state: every ended epoch whose transaction had not
/// committed at the barrier, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SpilledOutput {
    pub(crate) ended: Vec<Spilled>,
}

/// One writer's files.
pub(crate) struct Spill {
    dir: PathBuf,
    run: String,
    subtask: usize,
    sequence: u64,
    /// The running epoch's file, from its first message.
    running: Option<Running>,
    /// Ended epochs not committed yet, oldest first: the outbox's, in files.
    ended: VecDeque<Spilled>,
    /// Whether this run committed yet: its first commit deletes earlier runs' files.
    committed_once: bool,
    files: FileThread,
}

struct Running {
    file: String,
    /// Encoded messages not handed to the file's thread yet.
    buffer: Vec<u8>,
    len: u64,
    messages: u64,
    hasher: crc32fast::Hasher,
}

impl Spill {
    /// The files of writer `subtask` of sink `uid` in this run, under the
    /// query's checkpoint `location`.
    pub(crate) fn open(location: &Path, uid: &str, run: &str, subtask: usize) -> io::Result<Self> {
        let dir = location.join("sink-output").join(file_name(uid));
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            files: FileThread::start(dir.clone())?,
            dir,
            run: run.to_owned(),
            subtask,
            sequence: 0,
            running: None,
            ended: VecDeque::new(),
            committed_once: false,
        })
    }

    /// Appends `message` to the running epoch's file.
    pub(crate) fn append(&mut self, message: &KafkaMessage) -> io::Result<()> {
        if self.running.is_none() {
            let file = format!("{}-{}-{}", self.run, self.subtask, self.sequence);
            self.sequence += 1;
            self.files.send(Command::Create(file.clone()))?;
            self.running = Some(Running {
                file,
                buffer: Vec::with_capacity(WRITE_CHUNK),
                len: 0,
                messages: 0,
                hasher: crc32fast::Hasher::new(),
            });
        }
        let running = self.running.as_mut().expect("just created");
        let start = running.buffer.len();
        bincode::serde::encode_into_std_write(
            message,
            &mut running.buffer,
            bincode::config::standard(),
        )
        .map_err(io::Error::other)?;
        let encoded = &running.buffer[start..];
        running.hasher.update(encoded);
        running.len += encoded.len() as u64;
        running.messages += 1;
        if running.buffer.len() >= WRITE_CHUNK {
            let full = std::mem::replace(&mut running.buffer, Vec::with_capacity(WRITE_CHUNK));
            self.files.send(Command::Write(full))?;
        }
        Ok(())
    }

    /// Ends the running epoch at `end`: its file is made durable and joins the
    /// ended epochs. Returns what the checkpoint holds.
    pub(crate) fn end_epoch(&mut self, end: Option<End>) -> io::Result<SpilledOutput> {
        if let Some(end) = end {
            let running = self
                .running
                .take()
                .expect("an epoch with output has a file");
            self.files.send(Command::Write(running.buffer))?;
            let (done, synced) = crossbeam_channel::bounded(1);
            self.files.send(Command::Seal(done))?;
            synced.recv().map_err(|_| FileThread::gone())??;
            self.ended.push_back(Spilled {
                end,
                file: running.file,
                len: running.len,
                messages: running.messages,
                checksum: running.hasher.finalize(),
            });
        }
        Ok(SpilledOutput {
            ended: self.ended.iter().cloned().collect(),
        })
    }

    /// The checkpoint of `epoch` committed and with it every ended epoch it
    /// covers: their files are no longer needed.
    pub(crate) fn committed(&mut self, epoch: Epoch) -> io::Result<()> {
        while self.ended.front().is_some_and(|e| e.end.covered_by(epoch)) {
            let spilled = self.ended.pop_front().expect("front exists");
            remove(&self.dir.join(spilled.file))?;
        }
        if !std::mem::replace(&mut self.committed_once, true) {
            let ours = format!("{}-", self.run);
            for entry in std::fs::read_dir(&self.dir)? {
                let entry = entry?;
                if !entry.file_name().to_string_lossy().starts_with(&ours) {
                    remove(&entry.path())?;
                }
            }
        }
        Ok(())
    }

    /// The output a checkpoint's `state` names that the commit of epoch
    /// `committed` (the writer's last commit record) did not publish, read back
    /// and checked. Files of published epochs may be gone: a run deletes them
    /// at its first commit.
    pub(crate) fn load(
        &self,
        state: &SpilledOutput,
        committed: Option<Epoch>,
    ) -> Result<Pending, String> {
        let ended = (state.ended.iter())
            .filter(|spilled| !committed.is_some_and(|epoch| spilled.end.covered_by(epoch)))
            .map(|spilled| {
                Ok(Ended {
                    end: spilled.end,
                    messages: read(&self.dir.join(&spilled.file), spilled)?,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Pending { ended })
    }
}

/// The messages of `spilled`, from `path`: an error names what is missing or
/// damaged.
fn read(path: &Path, spilled: &Spilled) -> Result<Vec<KafkaMessage>, String> {
    let damaged = |why: String| {
        format!(
            "the output of a checkpointed epoch ({:?}) in {} {why}; the checkpoint \
             location was damaged or partly restored, and that output cannot be \
             written again",
            spilled.end,
            path.display()
        )
    };
    let file = File::open(path).map_err(|e| damaged(format!("cannot be opened: {e}")))?;
    let mut bytes = Vec::with_capacity(spilled.len as usize);
    file.take(spilled.len)
        .read_to_end(&mut bytes)
        .map_err(|e| damaged(format!("cannot be read: {e}")))?;
    if bytes.len() as u64 != spilled.len || crc32fast::hash(&bytes) != spilled.checksum {
        return Err(damaged(format!(
            "does not match its checksum ({} of {} bytes read)",
            bytes.len(),
            spilled.len
        )));
    }
    let mut reader = BufReader::new(&bytes[..]);
    (0..spilled.messages)
        .map(|_| {
            bincode::serde::decode_from_std_read(&mut reader, bincode::config::standard())
                .map_err(|e| damaged(format!("cannot be decoded: {e}")))
        })
        .collect()
}

/// `uid` as one file name: a uid is any string, and only letters, digits, `-`
/// and `_` stand for themselves; every other byte is `%XX`.
fn file_name(uid: &str) -> String {
    let mut name = String::with_capacity(uid.len());
    for byte in uid.bytes() {
        match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' => name.push(byte as char),
            _ => name.push_str(&format!("%{byte:02X}")),
        }
    }
    name
}

fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// What the writer asks of its file thread, in order.
enum Command {
    /// Start the file of this name: the next writes go to it.
    Create(String),
    Write(Vec<u8>),
    /// Make the file durable, its bytes and its name, and say when it is.
    Seal(crossbeam_channel::Sender<io::Result<()>>),
}

/// The thread that writes and syncs a writer's files, so that the writer's own
/// thread, which records wait for, makes no system call per message.
struct FileThread {
    commands: Option<crossbeam_channel::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl FileThread {
    fn start(dir: PathBuf) -> io::Result<Self> {
        // A disk slower than the output holds the writer once this much waits.
        let (commands, received) = crossbeam_channel::bounded(QUEUED_CHUNKS);
        let thread = std::thread::Builder::new()
            .name("rtflow-sink-output".into())
            .spawn(move || write_files(&dir, &received))?;
        Ok(Self {
            commands: Some(commands),
            thread: Some(thread),
        })
    }

    fn send(&self, command: Command) -> io::Result<()> {
        let commands = self.commands.as_ref().expect("open until dropped");
        commands.send(command).map_err(|_| Self::gone())
    }

    fn gone() -> io::Error {
        io::Error::other("the thread writing the output files ended")
    }
}

impl Drop for FileThread {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The file thread's loop: writes what it is given and syncs the file every
/// `SYNC_EVERY` while it grows. A failed write is reported at the seal.
fn write_files(dir: &Path, commands: &crossbeam_channel::Receiver<Command>) {
    let mut file: Option<File> = None;
    let mut failed: Option<io::Error> = None;
    let mut dirty = false;
    let mut synced = Instant::now();
    loop {
        match commands.recv_timeout(SYNC_EVERY) {
            Ok(Command::Create(name)) => match File::create(dir.join(name)) {
                Ok(created) => file = Some(created),
                Err(error) => failed = Some(error),
            },
            Ok(Command::Write(bytes)) => {
                if let (Some(file), None) = (&mut file, &failed) {
                    failed = file.write_all(&bytes).err();
                    dirty = true;
                }
            }
            Ok(Command::Seal(done)) => {
                let result = match (file.take(), failed.take()) {
                    (_, Some(error)) => Err(error),
                    (Some(file), None) => {
                        file.sync_data().and_then(|()| File::open(dir)?.sync_all())
                    }
                    (None, None) => Err(io::Error::other("no output file was started")),
                };
                dirty = false;
                let _ = done.send(result);
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
        if dirty && synced.elapsed() >= SYNC_EVERY {
            if let (Some(file), None) = (&file, &failed) {
                failed = file.sync_data().err();
            }
            dirty = false;
            synced = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(n: u64) -> KafkaMessage {
        KafkaMessage::new(format!("value-{n}")).key(format!("key-{n}"))
    }

    #[test]
    fn an_epochs_output_reads_back_from_its_file_until_it_commits() {
        let location = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(location.path(), "sink-1", "run-a", 0).unwrap();
        for n in 0..1000 {
            spill.append(&message(n)).unwrap();
        }
        let first = spill.end_epoch(Some(End::Barrier(1))).unwrap();
        spill.append(&message(1000)).unwrap();
        let both = spill.end_epoch(Some(End::Barrier(2))).unwrap();
        assert_eq!(both.ended.len(), 2, "epoch 1 has not committed yet");
        assert_eq!(both.ended[0], first.ended[0]);
        let pending = spill.load(&both, None).unwrap();
        assert_eq!(
            pending.ended[0].messages,
            (0..1000).map(message).collect::<Vec<_>>()
        );
        assert_eq!(pending.ended[1].messages, vec![message(1000)]);

        spill.committed(1).unwrap();
        assert!(
            spill.load(&first, None).is_err(),
            "a committed epoch's file is deleted"
        );
        let published = spill.load(&first, Some(1)).unwrap();
        assert!(published.ended.is_empty(), "and a restart never reads it");
        assert_eq!(spill.end_epoch(None).unwrap().ended, both.ended[1..]);
    }

    #[test]
    fn any_uid_makes_one_directory_of_its_own() {
        assert_eq!(file_name("kafka-sink_2"), "kafka-sink_2");
        assert_eq!(file_name("../out"), "%2E%2E%2Fout");
        assert_eq!(file_name("é"), "%C3%A9");
        assert_ne!(file_name("a/b"), file_name("a_b"));
    }

    #[test]
    fn a_damaged_file_is_named_not_read() {
        let location = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(location.path(), "sink-1", "run-a", 3).unwrap();
        spill.append(&message(0)).unwrap();
        let state = spill.end_epoch(Some(End::Barrier(7))).unwrap();
        let path = spill.dir.join(&state.ended[0].file);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let error = spill.load(&state, None).unwrap_err();
        assert!(error.contains("checksum"), "{error}");
        assert!(error.contains("run-a-3-0"), "{error}");
        std::fs::remove_file(&path).unwrap();
        assert!(spill
            .load(&state, None)
            .unwrap_err()
            .contains("cannot be opened"));
    }

    #[test]
    fn a_disk_that_refuses_the_output_fails_the_epochs_seal_and_the_checkpoint_never_names_it() {
        let location = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(location.path(), "sink-1", "run-a", 0).unwrap();
        // The epoch's file is a full device: every write fails with ENOSPC.
        std::os::unix::fs::symlink("/dev/full", spill.dir.join("run-a-0-0")).unwrap();
        for n in 0..1000 {
            spill.append(&message(n)).unwrap();
        }
        let error = spill.end_epoch(Some(End::Barrier(1))).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(28), "ENOSPC: {error}");
        assert!(
            spill.end_epoch(None).unwrap().ended.is_empty(),
            "an epoch whose file is not durable is never in a checkpoint"
        );
    }

    #[test]
    fn a_committed_epochs_file_that_cannot_be_deleted_fails_the_commit() {
        let location = tempfile::tempdir().unwrap();
        let mut spill = Spill::open(location.path(), "sink-1", "run-a", 0).unwrap();
        spill.append(&message(0)).unwrap();
        let state = spill.end_epoch(Some(End::Barrier(1))).unwrap();
        let path = spill.dir.join(&state.ended[0].file);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let error = spill.committed(1).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::IsADirectory, "{error}");
    }

    #[test]
    fn a_runs_first_commit_deletes_earlier_runs_files_and_keeps_its_own() {
        let location = tempfile::tempdir().unwrap();
        let mut crashed = Spill::open(location.path(), "sink-1", "run-a", 0).unwrap();
        crashed.append(&message(0)).unwrap();
        let restored = crashed.end_epoch(Some(End::Barrier(4))).unwrap();
        crashed.append(&message(1)).unwrap();
        drop(crashed);

        let mut spill = Spill::open(location.path(), "sink-1", "run-b", 1).unwrap();
        assert!(
            spill.load(&restored, None).is_ok(),
            "a restart reads what it restored"
        );
        spill.append(&message(2)).unwrap();
        let held = spill.end_epoch(Some(End::Barrier(5))).unwrap();
        spill.append(&message(3)).unwrap();
        spill.end_epoch(Some(End::Barrier(6))).unwrap();
        spill.committed(5).unwrap();
        let left: Vec<_> = std::fs::read_dir(&spill.dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, vec!["run-b-1-1".to_owned()]);
        assert!(spill.load(&held, None).is_err());
    }
}
