//! The traits connectors implement: a [`Source`] hands out one [`SourceReader`] per
//! source actor, a [`Sink`] one [`SinkWriter`] per sink actor.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
pub use rtflow_checkpoint::Offsets;

use crate::cancel::Cancel;
use crate::cluster::handover::Handovers;
use crate::cluster::membership::Membership;
use crate::error::{Result, RtflowError};
use crate::guard::Place;
use crate::metrics::{LatencyRecorder, OperatorMetrics, SourceLag};
use crate::operator::{Emit, SnapshotBuffer};
use crate::record::{nanos_to_event_time, now_nanos, Epoch, EventTime, Nanos, Record, RecordMeta};
use crate::state::{StateContext, StateSnapshot};

/// Which part of a source one reader reads.
#[derive(Debug, Clone)]
pub struct SourceContext {
    /// This reader's index, `0..parallelism`.
    pub subtask: usize,
    /// How many readers the source runs.
    pub parallelism: usize,
    /// The source partitions this reader owns.
    pub partitions: Vec<usize>,
    /// Where to resume, as the source's [`SourceReader::offsets`] reported them
    /// at the last committed checkpoint; empty on a first start.
    pub start_offsets: Offsets,
    /// Ends this reader's wait in [`SourceReader::poll`] from any thread: for a
    /// client library's callback, or whatever appends the records it reads.
    pub waker: SourceWaker,
    /// Where a reader that knows where its partitions end reports how far
    /// behind it is (consumer lag): `rtflow_source_lag_records` and the
    /// progress reports' `sources[].metrics`.
    pub lag: SourceLag,
}

/// Wakes a source reader sleeping in [`std::thread::park_timeout`] (see
/// [`SourceReader::poll`]), from any thread. The runtime binds it to the source
/// actor's thread before the first poll; until then a wake does nothing, and
/// none is needed, since the first poll looks before it sleeps.
///
/// ```
/// use rtflow_runtime::SourceWaker;
/// let waker = SourceWaker::default();
/// waker.wake(); // not bound yet: nothing to wake
/// waker.bind_current_thread();
/// waker.wake();
/// std::thread::park(); // returns at once: the wake left its token
/// ```
#[derive(Debug, Clone, Default)]
pub struct SourceWaker(Arc<OnceLock<Thread>>);

impl SourceWaker {
    /// Binds the waker to the calling thread, the one that polls the reader.
    /// The runtime does this on the source actor's thread; a test that polls a
    /// reader on a thread of its own does it there. Only the first call binds.
    pub fn bind_current_thread(&self) {
        self.0.get_or_init(std::thread::current);
    }

    /// Ends the reader's current wait, or its next one, at once.
    pub fn wake(&self) {
        if let Some(thread) = self.0.get() {
            thread.unpark();
        }
    }

    /// Whether `self` and `other` wake the same reader.
    pub fn same_as(&self, other: &SourceWaker) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl SourceContext {
    /// For sources whose partitions are numbered: each of this reader's
    /// partitions with the offset to start at, as [`numbered_offsets`] recorded it
    /// (0 on a first start).
    pub fn numbered_partitions(&self) -> Vec<(usize, i64)> {
        self.partitions
            .iter()
            .map(|p| {
                (
                    *p,
                    self.start_offsets.get(&p.to_string()).copied().unwrap_or(0),
                )
            })
            .collect()
    }
}

/// The offsets of numbered partitions, labelled by their number: what
/// [`SourceContext::numbered_partitions`] reads back.
pub fn numbered_offsets(positions: impl IntoIterator<Item = (usize, i64)>) -> Offsets {
    positions
        .into_iter()
        .map(|(partition, offset)| (partition.to_string(), offset))
        .collect()
}

/// A source of records (Kafka, memory, generator).
pub trait Source<T>: Send + 'static {
    /// The connector kind: "kafka", "memory", "generator", ...
    fn kind(&self) -> &str;

    /// What the source reads, for progress reports.
    fn description(&self) -> String {
        self.kind().to_owned()
    }

    /// How many partitions the source has. Called once at start, before any reader
    /// is opened.
    fn partitions(&self) -> Result<usize>;

    /// How many reader actors share `partitions`; by default one per partition.
    fn readers(&self, partitions: usize) -> usize {
        partitions
    }

    /// Whether the source can be read continuously by long-running readers.
    fn supports_real_time(&self) -> bool {
        true
    }

    /// In a clustered query, the indexes (among its `partitions()`) of the
    /// partitions this process reads, as `link` assigns them; `None` for a
    /// source the cluster cannot share out, which a clustered query rejects.
    /// Called after `partitions`.
    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        let _ = link;
        None
    }

    /// Opens the reader for `ctx.partitions`.
    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<T>>>;
}

/// A boxed source is a source: what a [`ClusterLink`](crate::cluster::ClusterLink) hands out.
impl<T: 'static> Source<T> for Box<dyn Source<T>> {
    fn kind(&self) -> &str {
        (**self).kind()
    }

    fn description(&self) -> String {
        (**self).description()
    }

    fn partitions(&self) -> Result<usize> {
        (**self).partitions()
    }

    fn readers(&self, partitions: usize) -> usize {
        (**self).readers(partitions)
    }

    fn supports_real_time(&self) -> bool {
        (**self).supports_real_time()
    }

    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        (**self).cluster_partitions(link)
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<T>>> {
        (**self).reader(ctx)
    }
}

/// Whether a reader has more to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceStatus {
    /// More records may come.
    Active,
    /// The input ended; the reader will not be polled again.
    Finished,
}

/// Reads records from the partitions of one source actor.
pub trait SourceReader<T>: Send {
    /// Puts whatever is available now into `out` (up to its capacity), waiting at
    /// most `max_wait` when nothing is. Returning promptly keeps stop and
    /// checkpoints responsive.
    ///
    /// A reader that waits by sleeping should sleep with
    /// [`std::thread::park_timeout`]: the runtime unparks a source's thread when
    /// it ends an epoch or stops the query, so the reader returns at once, and
    /// [`SourceContext::waker`] ends the wait from the thread that has records. Until
    /// a late source's barrier arrives, every operator aligning on it holds back
    /// the records the other sources sent after theirs.
    fn poll(&mut self, out: &mut SourceOutput<T>, max_wait: Duration) -> Result<SourceStatus>;

    /// The next offset of every partition it owns, by a label of the source's
    /// choosing: recorded at each checkpoint barrier and handed back through
    /// [`SourceContext::start_offsets`] on recovery.
    fn offsets(&self) -> Offsets;

    /// The reader's source passed the barrier that ends epoch `epoch`,
    /// right after its [`offsets`](Self::offsets) were taken: what it
    /// reads from now on belongs to the next epoch.
    fn on_barrier(&mut self, _epoch: Epoch) {}

    /// The process's partitions changed inside a run at the barrier just
    /// emitted ([`Handover`](crate::cluster::Handover)). A reader that
    /// cannot follow fails the run, which then restarts over the process's
    /// new share.
    fn hand_over(&mut self, change: &ReaderHandover<'_>) -> Result<()> {
        Err(RtflowError::Checkpoint(format!(
            "this reader cannot change its partitions inside a run (to {:?})",
            change.partitions
        )))
    }
}

/// How a [`Handover`](crate::cluster::Handover) changes a source reader, at
/// the barrier it happens at.
#[derive(Debug, Clone, Copy)]
pub struct ReaderHandover<'a> {
    /// The partitions it reads from now on, numbered as
    /// [`SourceContext::partitions`]; it reports offsets for them alone.
    pub partitions: &'a [usize],
    /// Where those it did not read already resume, labelled as its
    /// [`offsets`](SourceReader::offsets) label them.
    pub start_offsets: &'a Offsets,
    /// Whether event time starts over, as in a new run (the process adopted
    /// partitions): a reader that passes on event time of its own tells it
    /// again.
    pub starts_over: bool,
}

/// The batch a reader fills in one poll.
pub struct SourceOutput<T> {
    records: Vec<Record<T>>,
    capacity: usize,
    /// The query-wide number of this source's partition 0: partitions of all the
    /// sources of a query are numbered in one range, so that a watermark after a
    /// `union` tells the partitions of different sources apart.
    base: u32,
    /// The query-wide number of the partition records are pushed for.
    partition: u32,
    /// What the reader said of event time in this poll, after its records.
    progress: Option<Progress>,
}

/// Event time as a reader that knows it says it ([`SourceOutput::watermark`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Watermark(EventTime),
    Idle,
}

impl<T> SourceOutput<T> {
    /// An empty batch of at most `capacity` records: what the actor hands its
    /// reader, and what a reader's own tests can poll into.
    ///
    /// ```
    /// use rtflow_runtime::SourceOutput;
    /// let mut out = SourceOutput::new(2);
    /// out.push("a", 0);
    /// assert_eq!(out.remaining(), 1);
    /// ```
    pub fn new(capacity: usize) -> Self {
        Self::for_reader(capacity, 0, 0)
    }

    /// The batch of a reader whose source numbers its partitions from `base` in
    /// the query, and whose records come from its partition `first` until it says
    /// otherwise.
    pub(crate) fn for_reader(capacity: usize, base: u32, first: u32) -> Self {
        Self {
            records: Vec::with_capacity(capacity),
            capacity,
            base,
            partition: base + first,
            progress: None,
        }
    }

    /// Records pushed from now on come from source partition `partition` (as
    /// numbered in [`SourceContext::partitions`]); watermarks track each
    /// partition's event time. A reader of several partitions must call it: until
    /// it does, records count as its first partition's.
    #[inline]
    pub fn set_partition(&mut self, partition: usize) {
        self.partition = self.base + partition as u32;
    }

    /// Adds a record produced at `source_time`; its event time is the source time.
    #[inline]
    pub fn push(&mut self, value: T, source_time: Nanos) {
        self.push_at(value, source_time, nanos_to_event_time(source_time));
    }

    /// Adds a record with an explicit event time.
    #[inline]
    pub fn push_at(&mut self, value: T, source_time: Nanos, event_time: EventTime) {
        self.push_behind_at(value, source_time, event_time, false, false);
    }

    /// Adds a record with an explicit event time, and whether it was
    /// `behind` the watermark it was written under
    /// ([`RecordMeta::behind`]) and judged `late` by the reader for that
    /// ([`RecordMeta::late`]): for a reader whose input carries watermarks (a
    /// repartition topic).
    ///
    /// ```
    /// use rtflow_runtime::SourceOutput;
    /// let mut out = SourceOutput::new(2);
    /// out.push_behind_at("behind the watermark of every source partition", 0, 500, true, true);
    /// assert_eq!(out.remaining(), 1);
    /// ```
    #[inline]
    pub fn push_behind_at(
        &mut self,
        value: T,
        source_time: Nanos,
        event_time: EventTime,
        behind: bool,
        late: bool,
    ) {
        self.records.push(Record {
            value,
            meta: RecordMeta {
                event_time,
                source_time,
                ingest_time: 0,
                partition: self.partition,
                behind,
                late,
            },
        });
    }

    /// No record with an earlier event time follows from this reader: for a
    /// reader whose input carries watermarks (a repartition topic), which then
    /// needs no `with_watermark`. It travels after the records of the poll.
    pub fn watermark(&mut self, watermark: EventTime) {
        self.progress = Some(Progress::Watermark(watermark));
    }

    /// Every partition behind this reader is idle: leave it out of the
    /// watermark until it sends a watermark again.
    pub fn idle(&mut self) {
        self.progress = Some(Progress::Idle);
    }

    /// What the reader said of event time in this poll, taken.
    pub(crate) fn take_progress(&mut self) -> Option<Progress> {
        self.progress.take()
    }

    /// How many more records this poll may add.
    pub fn remaining(&self) -> usize {
        self.capacity.saturating_sub(self.records.len())
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Stamps the ingest time and hands the records to `emit`; one clock read per poll.
    pub(crate) fn drain_into(&mut self, emit: &mut dyn Emit<T>) -> Result<usize> {
        let ingest_time = now_nanos();
        let count = self.records.len();
        for mut record in self.records.drain(..) {
            record.meta.ingest_time = ingest_time;
            emit.record(record)?;
        }
        Ok(count)
    }
}

/// Which part of a sink one writer writes.
#[derive(Clone)]
pub struct SinkContext {
    /// The query's name.
    pub query: String,
    /// The query's id, kept across restarts.
    pub query_id: String,
    /// The id of this run of the query, new at every start.
    pub run_id: String,
    /// The sink's stable id in the dataflow.
    pub uid: String,
    /// The sink's name in the dataflow, as metrics and errors give it.
    pub name: String,
    /// This writer's index, `0..parallelism` (Spark's partition id).
    pub subtask: usize,
    /// How many writers the sink runs.
    pub parallelism: usize,
    /// How often the query checkpoints: a writer that holds output back until
    /// its epoch commits holds it about this long.
    pub batch_duration: Duration,
    /// The epoch the writer's first records belong to: 1 on a first start, the
    /// epoch after the restored checkpoint on a restart. Epoch `n` ends at
    /// [`SinkWriter::on_barrier`]`(n)`.
    pub first_epoch: Epoch,
    /// The writer's state, as the last committed checkpoint left it.
    pub state: StateContext,
    /// The query's checkpoint location, if it has one: a writer may keep files
    /// there that its checkpointed state names.
    pub checkpoint_location: Option<PathBuf>,
    /// The query-wide numbers of the source partitions whose records reach
    /// this writer.
    pub source_partitions: Vec<u32>,
    /// How many source partitions feed the sink over all its writers.
    pub upstream_partitions: u32,
    /// The delay of the `with_watermark` every record reaches the sink
    /// through, if one is on every way from a source: a source partition's
    /// own watermark is then the largest event time of its records less it.
    pub watermark_delay: Option<Duration>,
    /// In a clustered query, the process's link to its cluster.
    pub cluster: Option<Arc<dyn Membership>>,
    /// In a clustered query, whether the writer's output commits second,
    /// after the repartitions it reads ([`CommitOrder`](crate::cluster::CommitOrder)).
    pub commits_second: bool,
}

/// A sink of records (Kafka, foreach, console, memory).
pub trait Sink<T>: Send + 'static {
    /// The connector kind: "kafka", "foreach", "console", "memory", ...
    fn kind(&self) -> &str;

    /// Where the sink writes, for progress reports.
    fn description(&self) -> String {
        self.kind().to_owned()
    }

    /// Whether the sink can be written record by record by long-running writers.
    fn supports_real_time(&self) -> bool {
        true
    }

    /// Whether the sink is on real-time mode's allowlist (see
    /// [`Operator::allowlisted`](crate::Operator::allowlisted)): rtflow's own
    /// sinks are; one of your own is not unless it says so here.
    fn allowlisted(&self) -> bool {
        false
    }

    /// Opens the writer of one sink actor.
    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>>;
}

/// A boxed sink is a sink: what a [`ClusterLink`](crate::cluster::ClusterLink) hands out.
impl<T: 'static> Sink<T> for Box<dyn Sink<T>> {
    fn kind(&self) -> &str {
        (**self).kind()
    }

    fn description(&self) -> String {
        (**self).description()
    }

    fn supports_real_time(&self) -> bool {
        (**self).supports_real_time()
    }

    fn allowlisted(&self) -> bool {
        (**self).allowlisted()
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        (**self).writer(ctx)
    }
}

/// Writes the records of one sink actor.
pub trait SinkWriter<T>: Send {
    /// Writes one record. An error fails the query.
    fn write(&mut self, record: Record<T>) -> Result<()>;

    /// The actor drained its mailbox: a good moment to flush buffers.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    /// Epoch `epoch` ended: make everything written so far durable (at-least-once)
    /// or ready to commit (exactly-once).
    fn on_barrier(&mut self, _epoch: Epoch) -> Result<()> {
        self.flush()
    }

    /// Called after every `on_barrier`, and once more at the end of the input: hand
    /// what the writer must find again after a crash to `out` (a transactional
    /// writer's pending output).
    fn snapshot(&mut self, _out: &mut StateSnapshot) -> Result<()> {
        Ok(())
    }

    /// The checkpoint of `epoch` is durable: output held back for it may be
    /// published now.
    fn on_commit(&mut self, _epoch: Epoch) -> Result<()> {
        Ok(())
    }

    /// The sink's input watermark advanced to `watermark`: no record with an
    /// earlier event time is expected any more. It arrives in band, between the
    /// records written before and after it.
    fn on_watermark(&mut self, _watermark: EventTime) -> Result<()> {
        Ok(())
    }

    /// Every source partition behind the sink went idle: no watermark
    /// follows until one of them delivers again.
    fn on_idle(&mut self) -> Result<()> {
        Ok(())
    }

    /// The process's partitions changed inside a run at the barrier just
    /// passed ([`Handover`](crate::cluster::Handover)): the source partitions
    /// whose records reach the writer from now on, and whether event time
    /// `starts_over` (the process adopted partitions: the watermarks so far
    /// did not wait for them). For a writer that speaks for them, as a
    /// repartition's does.
    fn on_hand_over(&mut self, _source_partitions: &[u32], _starts_over: bool) -> Result<()> {
        Ok(())
    }

    /// The input ended (`None`) or the query is failing (`Some(error)`).
    fn close(&mut self, _error: Option<&RtflowError>) -> Result<()> {
        Ok(())
    }
}

/// What a sink actor needs from the runtime besides its context.
pub(crate) struct SinkWiring {
    pub(crate) snapshots: SnapshotBuffer,
    pub(crate) commits: Receiver<Epoch>,
    pub(crate) cancel: Cancel,
}

/// The end of a sink actor's chain: writes each record, and once the batch is
/// flushed records the latencies of its records against one clock read.
pub(crate) struct SinkEmit<T> {
    /// Where the writer runs, for its failures.
    place: Place,
    writer: Box<dyn SinkWriter<T>>,
    latency: LatencyRecorder,
    metrics: Arc<OperatorMetrics>,
    /// Timestamps of the records written since the last flush.
    unflushed: Vec<RecordMeta>,
    snapshots: SnapshotBuffer,
    /// The last watermark that reached the sink.
    watermark: Option<EventTime>,
    /// Epochs the coordinator committed; closed once the query committed its last.
    commits: Receiver<Epoch>,
    cancel: Cancel,
    /// Where the run's handovers are, and which sink instance this is.
    handovers: Arc<Handovers>,
    instance: (String, usize),
}

/// How long a finished sink waits between looks at the cancel flag while it waits
/// for the final commit.
const COMMIT_WAIT: Duration = Duration::from_millis(20);

impl<T> SinkEmit<T> {
    pub(crate) fn new(
        place: Place,
        writer: Box<dyn SinkWriter<T>>,
        latency: LatencyRecorder,
        metrics: Arc<OperatorMetrics>,
        wiring: SinkWiring,
        ctx: &SinkContext,
    ) -> Self {
        let SinkWiring {
            snapshots,
            commits,
            cancel,
        } = wiring;
        let restored_watermark = ctx.state.restored_watermark();
        Self {
            place,
            writer,
            latency,
            metrics,
            unflushed: Vec::new(),
            snapshots,
            // A checkpoint before this run's first watermark keeps the restored one.
            watermark: restored_watermark,
            commits,
            cancel,
            handovers: ctx.state.restored.handovers.clone(),
            instance: (ctx.uid.clone(), ctx.subtask),
        }
    }

    /// Tells the writer of the epochs committed since it last looked.
    fn take_commits(&mut self) -> Result<()> {
        while let Ok(epoch) = self.commits.try_recv() {
            self.place.watch(|| self.writer.on_commit(epoch))?;
        }
        Ok(())
    }

    /// Hands the writer's state and the sink's watermark at the barrier to the
    /// checkpoint: the watermark a restore starts from must match the offsets.
    fn snapshot(&mut self) -> Result<()> {
        let mut snapshot = self.snapshots.lock().expect("snapshots are never poisoned");
        snapshot.sink_watermark = Some(self.watermark);
        self.place.watch(|| self.writer.snapshot(&mut snapshot))
    }

    /// The unflushed records are now fully processed.
    fn settle(&mut self) {
        if self.unflushed.is_empty() {
            return;
        }
        let done = now_nanos();
        // Records a source read in one poll often share their timestamps: one
        // update of the histograms per run of them (three per record were 5% of
        // q0's time).
        let same_times = |a: &RecordMeta, b: &RecordMeta| {
            (a.ingest_time, a.source_time) == (b.ingest_time, b.source_time)
        };
        for run in self.unflushed.chunk_by(same_times) {
            self.latency.record(&run[0], done, run.len() as u64);
        }
        self.metrics.add(self.unflushed.len() as u64, 0);
        self.unflushed.clear();
    }
}

impl<T: Send> Emit<T> for SinkEmit<T> {
    #[inline]
    fn record(&mut self, record: Record<T>) -> Result<()> {
        // Its timestamps are taken before the write, which then receives the
        // record where it lies, uncopied (a failed write fails the actor).
        self.unflushed.push(record.meta);
        let watch = self.place.enter();
        let written = self.writer.write(record);
        watch.end();
        written.map_err(|error| self.place.locate(error))
    }

    fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.watermark = Some(watermark);
        self.metrics.set_watermark(watermark);
        self.place.watch(|| self.writer.on_watermark(watermark))
    }

    fn idle(&mut self) -> Result<()> {
        self.metrics.set_idle();
        self.place.watch(|| self.writer.on_idle())
    }

    fn barrier(&mut self, epoch: Epoch) -> Result<()> {
        // Commits always precede the next barrier in time: take them first.
        self.take_commits()?;
        self.place.watch(|| self.writer.on_barrier(epoch))?;
        self.snapshot()?;
        if let Some(bound) = self.handovers.at(epoch) {
            // After the epoch's records were handed to the writer: a failed
            // handover leaves them uncommitted, which tests/cluster.rs checks
            // the next run drops.
            fail::fail_point!("sink-hand-over", |message| Err(RtflowError::Checkpoint(
                message.unwrap_or_default()
            )));
            let (uid, subtask) = &self.instance;
            let reaching = bound.reaching(uid, *subtask);
            let starts_over = bound.reach.starts_over;
            if starts_over {
                self.watermark = None;
            }
            (self.place).watch(|| self.writer.on_hand_over(reaching, starts_over))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.place.watch(|| self.writer.flush())?;
        self.settle();
        self.take_commits()?;
        self.latency.publish_if_due();
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        self.take_commits()?;
        self.place.watch(|| self.writer.flush())?;
        self.settle();
        self.snapshot()?;
        self.latency.publish();
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        loop {
            if self.cancel.is_raised() {
                return Err(RtflowError::Cancelled);
            }
            match self.commits.recv_timeout(COMMIT_WAIT) {
                Ok(epoch) => self.place.watch(|| self.writer.on_commit(epoch))?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        self.place.watch(|| self.writer.close(None))
    }

    fn abort(&mut self, error: &RtflowError) {
        let error = self.cancel.explain(error);
        let _ = self.place.run("close", || self.writer.close(Some(error)));
        self.latency.publish();
    }
}
