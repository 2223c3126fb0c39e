//! In-memory source and sink, for tests and programs that feed or read a query
//! directly.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rtflow_runtime::connector::{numbered_offsets, Offsets};
use rtflow_runtime::record::{nanos_to_event_time, now_nanos};
use rtflow_runtime::{
    Data, EventTime, Nanos, Record, Result, RtflowError, Sink, SinkContext, SinkWriter, Source,
    SourceContext, SourceOutput, SourceReader, SourceStatus, SourceWaker,
};

struct Entry<T> {
    value: T,
    source_time: Nanos,
    event_time: EventTime,
}

struct Log<T> {
    partitions: Vec<Vec<Entry<T>>>,
    ended: Vec<bool>,
}

struct Shared<T> {
    log: Mutex<Log<T>>,
    /// The wakers of the open readers. Readers sleep parked, not on a
    /// condvar, so that the coordinator's unpark for a barrier or a stop wakes
    /// them too.
    readers: Mutex<Vec<SourceWaker>>,
}

impl<T> Shared<T> {
    fn log(&self) -> MutexGuard<'_, Log<T>> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn readers(&self) -> MutexGuard<'_, Vec<SourceWaker>> {
        self.readers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_readers(&self) {
        self.readers().iter().for_each(SourceWaker::wake);
    }
}

/// A source whose partitions the test or program appends to. Every pushed record
/// is kept, in order, per partition, so it can be read again from any offset.
///
/// ```
/// use rtflow_connectors::MemorySource;
/// let input = MemorySource::new(2);
/// input.push(0, "a").unwrap();
/// input.push_at(1, "b", 1_700_000_000_000).unwrap();
/// input.end();
/// assert!(input.push(0, "c").is_err());
/// ```
pub struct MemorySource<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for MemorySource<T> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T: Data> MemorySource<T> {
    /// A source with `partitions` empty partitions.
    pub fn new(partitions: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                log: Mutex::new(Log {
                    partitions: (0..partitions).map(|_| Vec::new()).collect(),
                    ended: vec![false; partitions],
                }),
                readers: Mutex::default(),
            }),
        }
    }

    /// Appends `value` to `partition`, produced now; its event time is now.
    pub fn push(&self, partition: usize, value: T) -> Result<()> {
        let now = now_nanos();
        self.append(partition, [(value, now, nanos_to_event_time(now))])
    }

    /// Appends `value` to `partition` with an explicit event time (ms).
    pub fn push_at(&self, partition: usize, value: T, event_time: EventTime) -> Result<()> {
        self.append(partition, [(value, now_nanos(), event_time)])
    }

    /// Appends every value to `partition`, in order, produced now.
    pub fn push_all(&self, partition: usize, values: impl IntoIterator<Item = T>) -> Result<()> {
        let now = now_nanos();
        let event_time = nanos_to_event_time(now);
        self.append(partition, values.into_iter().map(|v| (v, now, event_time)))
    }

    /// Ends every partition: readers finish once they have read everything.
    pub fn end(&self) {
        let mut log = self.shared.log();
        log.ended.iter_mut().for_each(|ended| *ended = true);
        drop(log);
        self.shared.wake_readers();
    }

    fn append(
        &self,
        partition: usize,
        entries: impl IntoIterator<Item = (T, Nanos, EventTime)>,
    ) -> Result<()> {
        let mut log = self.shared.log();
        let partitions = log.partitions.len();
        let error = |message: String| RtflowError::source("memory", message);
        match log.ended.get(partition) {
            None => {
                return Err(error(format!(
                    "partition {partition} does not exist; the source has {partitions} \
                     partitions (0..{partitions})"
                )))
            }
            Some(true) => {
                return Err(error(format!(
                    "partition {partition} has ended; records cannot be added after end()"
                )))
            }
            Some(false) => {}
        }
        log.partitions[partition].extend(entries.into_iter().map(
            |(value, source_time, event_time)| Entry {
                value,
                source_time,
                event_time,
            },
        ));
        drop(log);
        self.shared.wake_readers();
        Ok(())
    }
}

impl<T: Data> Source<T> for MemorySource<T> {
    fn kind(&self) -> &str {
        "memory"
    }

    fn partitions(&self) -> Result<usize> {
        Ok(self.shared.log().partitions.len())
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<T>>> {
        let offsets: Vec<(usize, usize)> = ctx
            .numbered_partitions()
            .into_iter()
            .map(|(partition, offset)| (partition, offset as usize))
            .collect();
        let log = self.shared.log();
        for (partition, offset) in &offsets {
            let held = log.partitions[*partition].len();
            if *offset > held {
                return Err(RtflowError::source(
                    "memory",
                    format!(
                        "partition {partition} holds {held} records, but the checkpoint \
                         resumes after {offset}: restart with the same MemorySource, or on a \
                         new checkpoint location"
                    ),
                ));
            }
        }
        drop(log);
        self.shared.readers().push(ctx.waker.clone());
        Ok(Box::new(MemoryReader {
            shared: self.shared.clone(),
            offsets,
            waker: ctx.waker.clone(),
        }))
    }
}

struct MemoryReader<T> {
    shared: Arc<Shared<T>>,
    /// (partition, next offset) for every partition this reader owns.
    offsets: Vec<(usize, usize)>,
    /// Its entry in the source's list of wakers, left when the reader goes.
    waker: SourceWaker,
}

impl<T> Drop for MemoryReader<T> {
    fn drop(&mut self) {
        self.shared
            .readers()
            .retain(|waker| !waker.same_as(&self.waker));
    }
}

impl<T: Data> SourceReader<T> for MemoryReader<T> {
    fn offsets(&self) -> Offsets {
        numbered_offsets(self.offsets.iter().map(|(p, offset)| (*p, *offset as i64)))
    }

    fn poll(&mut self, out: &mut SourceOutput<T>, max_wait: Duration) -> Result<SourceStatus> {
        let mut waited = max_wait.is_zero();
        loop {
            let log = self.shared.log();
            for (partition, offset) in &mut self.offsets {
                out.set_partition(*partition);
                let entries = &log.partitions[*partition];
                let take = out.remaining().min(entries.len() - *offset);
                for entry in &entries[*offset..*offset + take] {
                    out.push_at(entry.value.clone(), entry.source_time, entry.event_time);
                }
                *offset += take;
            }
            let finished = self
                .offsets
                .iter()
                .all(|(p, offset)| log.ended[*p] && *offset == log.partitions[*p].len());
            if finished {
                return Ok(SourceStatus::Finished);
            }
            drop(log);
            if !out.is_empty() || waited {
                return Ok(SourceStatus::Active);
            }
            // An append after the look above has unparked this thread already,
            // so the park returns at once.
            std::thread::park_timeout(max_wait);
            waited = true;
        }
    }
}

/// A sink that keeps every record it receives, readable while the query runs.
///
/// ```
/// use rtflow_connectors::MemorySink;
/// let sink = MemorySink::<u32>::new();
/// assert!(sink.rows().is_empty());
/// ```
pub struct MemorySink<T> {
    shared: Arc<(Mutex<Vec<Record<T>>>, Condvar)>,
}

impl<T> Clone for MemorySink<T> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T: Data> Default for MemorySink<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Data> MemorySink<T> {
    /// An empty sink.
    pub fn new() -> Self {
        Self {
            shared: Arc::new((Mutex::new(Vec::new()), Condvar::new())),
        }
    }

    fn records_guard(&self) -> MutexGuard<'_, Vec<Record<T>>> {
        self.shared.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The values received so far, in arrival order.
    pub fn rows(&self) -> Vec<T> {
        self.records_guard()
            .iter()
            .map(|r| r.value.clone())
            .collect()
    }

    /// The records received so far, with their timestamps.
    pub fn records(&self) -> Vec<Record<T>> {
        self.records_guard().clone()
    }

    /// How many records were received.
    pub fn len(&self) -> usize {
        self.records_guard().len()
    }

    /// Whether nothing was received.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until at least `count` records arrived, or `timeout` passed; returns
    /// whether they did.
    pub fn wait_for(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut records = self.records_guard();
        while records.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            records = self
                .shared
                .1
                .wait_timeout(records, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

impl<T: Data> Sink<T> for MemorySink<T> {
    fn allowlisted(&self) -> bool {
        true
    }

    fn kind(&self) -> &str {
        "memory"
    }

    fn writer(&self, _ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        Ok(Box::new(MemoryWriter {
            sink: self.clone(),
            pending: Vec::new(),
        }))
    }
}

/// Collects a batch without locking, then appends it to the sink at each flush.
struct MemoryWriter<T> {
    sink: MemorySink<T>,
    pending: Vec<Record<T>>,
}

impl<T: Data> SinkWriter<T> for MemoryWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        self.pending.push(record);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if !self.pending.is_empty() {
            self.sink.records_guard().append(&mut self.pending);
            self.sink.shared.1.notify_all();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use rtflow_runtime::metrics::SourceLag;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    /// Polls `reader` once on a thread of its own, with a wait far longer than
    /// the test's timeout; the receiver gets how many records it read.
    fn poll_once(
        mut reader: Box<dyn SourceReader<u32>>,
        waker: SourceWaker,
    ) -> (std::thread::JoinHandle<()>, mpsc::Receiver<usize>) {
        let (polled, poll) = mpsc::channel();
        let poller = std::thread::spawn(move || {
            waker.bind_current_thread();
            let mut out = SourceOutput::new(8);
            reader.poll(&mut out, Duration::from_secs(3600)).unwrap();
            polled.send(8 - out.remaining()).unwrap();
        });
        (poller, poll)
    }

    #[test]
    fn a_waiting_reader_wakes_for_a_record_and_for_an_unpark() {
        let source = MemorySource::<u32>::new(1);
        let context = || SourceContext {
            subtask: 0,
            parallelism: 1,
            partitions: vec![0],
            start_offsets: Offsets::default(),
            waker: SourceWaker::default(),
            lag: SourceLag::default(),
        };

        let first = context();
        let (poller, poll) = poll_once(source.reader(&first).unwrap(), first.waker);
        std::thread::sleep(Duration::from_millis(100));
        poller.thread().unpark();
        assert_eq!(poll.recv_timeout(TIMEOUT), Ok(0), "an unpark ends the wait");
        poller.join().unwrap();
        assert!(
            source.shared.readers().is_empty(),
            "a dropped reader is forgotten"
        );

        let second = context();
        let (poller, poll) = poll_once(source.reader(&second).unwrap(), second.waker);
        std::thread::sleep(Duration::from_millis(100));
        source.push(0, 7).unwrap();
        assert_eq!(poll.recv_timeout(TIMEOUT), Ok(1), "a record ends the wait");
        poller.join().unwrap();
    }
}
