//! Counters and latency histograms. Actors count into plain fields on the hot path
//! and publish into the shared atomics and histograms here once per batch; progress
//! reports and the Prometheus endpoint read them from other threads.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::record::{EventTime, Nanos, RecordMeta};

/// What part an operator instance plays, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    Source,
    Operator,
    Sink,
    /// The writer of a clustered query's repartition: a sink to the engine,
    /// whose watermark is its own source partitions', not the operators'.
    Exchange,
}

/// Records in and out of one operator instance, for stateful operators their
/// keyed state, and for sinks the watermark that reached them.
#[derive(Debug)]
pub struct OperatorMetrics {
    records_in: AtomicU64,
    records_out: AtomicU64,
    late: AtomicU64,
    watermark: AtomicI64,
    /// For sinks: every source partition upstream is idle.
    idle: AtomicBool,
    /// For stateful operators: their keyed state at the last barrier.
    state: Mutex<Option<StateRows>>,
}

/// How much keyed state an operator instance holds, as of its last barrier:
/// Spark's state operator figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateRows {
    /// Keys with a value.
    pub total: u64,
    /// Keys set or removed in the epoch the barrier ended.
    pub updated: u64,
    /// Bytes of the state's hash tables. What keys and values own on the heap
    /// (a `String`'s letters) is not counted.
    pub memory_bytes: u64,
}

impl StateRows {
    pub(crate) fn add(&mut self, other: Self) {
        self.total += other.total;
        self.updated += other.updated;
        self.memory_bytes += other.memory_bytes;
    }

    /// What was added since `earlier`, a copy of these figures.
    pub(crate) fn since(self, earlier: Self) -> Self {
        Self {
            total: self.total - earlier.total,
            updated: self.updated - earlier.updated,
            memory_bytes: self.memory_bytes - earlier.memory_bytes,
        }
    }
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self {
            records_in: AtomicU64::new(0),
            records_out: AtomicU64::new(0),
            late: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            watermark: AtomicI64::new(EventTime::MIN),
            state: Mutex::default(),
        }
    }
}

impl OperatorMetrics {
    pub(crate) fn add(&self, records_in: u64, records_out: u64) {
        if records_in > 0 {
            self.records_in.fetch_add(records_in, Ordering::Relaxed);
        }
        if records_out > 0 {
            self.records_out.fetch_add(records_out, Ordering::Relaxed);
        }
    }

    pub(crate) fn add_late(&self, late: u64) {
        if late > 0 {
            self.late.fetch_add(late, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_watermark(&self, watermark: EventTime) {
        self.watermark.store(watermark, Ordering::Relaxed);
        self.idle.store(false, Ordering::Relaxed);
    }

    pub(crate) fn set_idle(&self) {
        self.idle.store(true, Ordering::Relaxed);
    }

    pub(crate) fn set_state(&self, rows: StateRows) {
        *lock(&self.state) = Some(rows);
    }
}

/// One actor's mailbox lanes, seen from their senders.
#[derive(Debug, Default)]
pub struct MailboxMetrics {
    capacity: AtomicU64,
    depth: AtomicU64,
    max_depth: AtomicU64,
    blocked_nanos: AtomicU64,
}

impl MailboxMetrics {
    pub(crate) fn new(capacity: usize) -> Self {
        let metrics = Self::default();
        metrics.capacity.store(capacity as u64, Ordering::Relaxed);
        metrics
    }

    pub(crate) fn observe_depth(&self, depth: usize) {
        self.depth.store(depth as u64, Ordering::Relaxed);
        self.max_depth.fetch_max(depth as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_blocked(&self, blocked: Duration) {
        self.blocked_nanos
            .fetch_add(blocked.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Latency percentiles in milliseconds (fractional: sub-millisecond latencies are
/// the point of real-time mode).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Percentiles {
    pub count: u64,
    pub p0: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    fn of(histogram: &Histogram<u64>) -> Self {
        let ms = |nanos: u64| nanos as f64 / 1e6;
        if histogram.is_empty() {
            return Self::default();
        }
        Self {
            count: histogram.len(),
            p0: ms(histogram.min()),
            p50: ms(histogram.value_at_quantile(0.50)),
            p90: ms(histogram.value_at_quantile(0.90)),
            p95: ms(histogram.value_at_quantile(0.95)),
            p99: ms(histogram.value_at_quantile(0.99)),
            max: ms(histogram.max()),
        }
    }
}

/// The three latencies of DESIGN.md, as percentiles.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LatencyReport {
    /// Read by the source -> fully processed by the sink.
    pub processing: Percentiles,
    /// Appended to the source -> read by rtflow.
    pub source_queuing: Percentiles,
    /// Produced at the source -> fully processed by the sink.
    pub end_to_end: Percentiles,
}

/// Processing, source-queuing and end-to-end latency, in nanoseconds.
#[derive(Clone)]
pub(crate) struct LatencyHistograms {
    pub(crate) processing: Histogram<u64>,
    pub(crate) source_queuing: Histogram<u64>,
    pub(crate) end_to_end: Histogram<u64>,
}

impl LatencyHistograms {
    fn new() -> Self {
        // 1 ns .. 1 hour at 2 significant digits: ~1% error, a few KiB each.
        let histogram =
            || Histogram::new_with_bounds(1, 3_600_000_000_000, 2).expect("valid histogram bounds");
        Self {
            processing: histogram(),
            source_queuing: histogram(),
            end_to_end: histogram(),
        }
    }

    fn add(&mut self, other: &Self) {
        // Both sides share bounds, so adding cannot fail.
        let _ = self.processing.add(&other.processing);
        let _ = self.source_queuing.add(&other.source_queuing);
        let _ = self.end_to_end.add(&other.end_to_end);
    }

    fn clear(&mut self) {
        self.processing.reset();
        self.source_queuing.reset();
        self.end_to_end.reset();
    }

    fn report(&self) -> LatencyReport {
        LatencyReport {
            processing: Percentiles::of(&self.processing),
            source_queuing: Percentiles::of(&self.source_queuing),
            end_to_end: Percentiles::of(&self.end_to_end),
        }
    }
}

/// Latencies since the query started, and since the last progress report.
struct Latencies {
    total: LatencyHistograms,
    interval: LatencyHistograms,
}

/// A sink actor's private latency histograms, merged into the query's every
/// [`LatencyRecorder::PUBLISH_EVERY`] so the hot path takes no lock.
pub(crate) struct LatencyRecorder {
    local: LatencyHistograms,
    shared: Arc<Mutex<Latencies>>,
    last_publish: Instant,
}

impl LatencyRecorder {
    const PUBLISH_EVERY: Duration = Duration::from_millis(100);

    /// Records the latencies of `records` records with the timestamps of
    /// `meta`, done at `done`.
    #[inline]
    pub(crate) fn record(&mut self, meta: &RecordMeta, done: Nanos, records: u64) {
        let local = &mut self.local;
        local
            .processing
            .saturating_record_n(done.saturating_sub(meta.ingest_time).max(1), records);
        local
            .end_to_end
            .saturating_record_n(done.saturating_sub(meta.source_time).max(1), records);
        local.source_queuing.saturating_record_n(
            meta.ingest_time.saturating_sub(meta.source_time).max(1),
            records,
        );
    }

    pub(crate) fn publish_if_due(&mut self) {
        if self.last_publish.elapsed() >= Self::PUBLISH_EVERY {
            self.publish();
        }
    }

    pub(crate) fn publish(&mut self) {
        self.last_publish = Instant::now();
        if self.local.processing.is_empty() {
            return;
        }
        let mut shared = lock(&self.shared);
        shared.total.add(&self.local);
        shared.interval.add(&self.local);
        drop(shared);
        self.local.clear();
    }
}

struct Registered<T> {
    operator: String,
    subtask: usize,
    metrics: Arc<T>,
}

/// How far a source reader is behind the end of one partition it reads
/// (consumer lag), in offsets: the reader publishes the next offset it will
/// read, and whatever learns where the partition ends publishes that. Both are
/// plain atomics, so the reader's side costs a store per poll.
///
/// ```
/// use rtflow_runtime::metrics::SourceLag;
/// let partition = SourceLag::default().partition("clicks", "0");
/// partition.set_position(90);
/// assert_eq!(partition.records(), None, "the end is not known yet");
/// partition.set_end(100);
/// assert_eq!(partition.records(), Some(10));
/// ```
#[derive(Debug)]
pub struct PartitionLag {
    position: AtomicI64,
    end: AtomicI64,
}

impl PartitionLag {
    const UNKNOWN: i64 = i64::MIN;

    /// The next offset the reader will read.
    pub fn set_position(&self, next: i64) {
        self.position.store(next, Ordering::Relaxed);
    }

    /// The partition's end: the offset the next record appended will take.
    pub fn set_end(&self, end: i64) {
        self.end.store(end, Ordering::Relaxed);
    }

    /// Records between the reader's position and the end, once both are known.
    pub fn records(&self) -> Option<u64> {
        let (position, end) = (
            self.position.load(Ordering::Relaxed),
            self.end.load(Ordering::Relaxed),
        );
        (position != Self::UNKNOWN && end != Self::UNKNOWN)
            // The end is looked up less often than the reader moves.
            .then(|| end.saturating_sub(position).max(0) as u64)
    }
}

impl Default for PartitionLag {
    fn default() -> Self {
        Self {
            position: AtomicI64::new(Self::UNKNOWN),
            end: AtomicI64::new(Self::UNKNOWN),
        }
    }
}

struct RegisteredLag {
    topic: String,
    partition: String,
    reader: Registered<PartitionLag>,
}

/// Where one reader of a source reports its consumer lag, partition by
/// partition ([`SourceContext::lag`](crate::SourceContext::lag)): progress
/// reports and `rtflow_source_lag_records` read what it reports. The default
/// belongs to no query, for a reader opened outside one.
#[derive(Clone, Default)]
pub struct SourceLag {
    registry: Arc<Mutex<Vec<RegisteredLag>>>,
    source: String,
    subtask: usize,
}

impl SourceLag {
    /// The lag of `partition` of `topic` (as the reader names them), reported
    /// from now on.
    pub fn partition(&self, topic: &str, partition: &str) -> Arc<PartitionLag> {
        let metrics = Arc::new(PartitionLag::default());
        lock(&self.registry).push(RegisteredLag {
            topic: topic.to_owned(),
            partition: partition.to_owned(),
            reader: Registered {
                operator: self.source.clone(),
                subtask: self.subtask,
                metrics: metrics.clone(),
            },
        });
        metrics
    }

    /// Reports `partition` of `topic` no more: the reader let it go.
    pub fn forget(&self, topic: &str, partition: &str) {
        lock(&self.registry)
            .retain(|r| (r.topic.as_str(), r.partition.as_str()) != (topic, partition));
    }
}

impl std::fmt::Debug for SourceLag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceLag")
            .field("source", &self.source)
            .field("subtask", &self.subtask)
            .finish_non_exhaustive()
    }
}

/// The latest committed checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheckpointStats {
    pub epoch: u64,
    /// From the barrier's injection to the durable manifest.
    pub duration: Duration,
    /// Bytes written for the checkpoint.
    pub bytes: usize,
}

/// Every counter of one query, shared by its actors and read by its handle, its
/// progress reports and the Prometheus endpoint.
pub struct QueryMetrics {
    operators: Mutex<Vec<(Role, Registered<OperatorMetrics>)>>,
    mailboxes: Mutex<Vec<Registered<MailboxMetrics>>>,
    lags: Arc<Mutex<Vec<RegisteredLag>>>,
    latency: Arc<Mutex<Latencies>>,
    checkpoints: Mutex<CheckpointHealth>,
    batch_duration: Duration,
}

/// The checkpoints of one run of a query.
struct CheckpointHealth {
    latest: Option<CheckpointStats>,
    /// When the latest committed, or the run started.
    since: Instant,
    failures: u64,
}

impl QueryMetrics {
    pub(crate) fn new() -> Self {
        Self {
            operators: Mutex::default(),
            mailboxes: Mutex::default(),
            lags: Arc::default(),
            latency: Arc::new(Mutex::new(Latencies {
                total: LatencyHistograms::new(),
                interval: LatencyHistograms::new(),
            })),
            checkpoints: Mutex::new(CheckpointHealth {
                latest: None,
                since: Instant::now(),
                failures: 0,
            }),
            batch_duration: Duration::ZERO,
        }
    }

    /// The trigger's batch duration, which checkpoints are due every.
    pub(crate) fn set_batch_duration(&mut self, batch_duration: Duration) {
        self.batch_duration = batch_duration;
    }

    pub(crate) fn record_checkpoint(&self, stats: CheckpointStats) {
        let mut health = lock(&self.checkpoints);
        health.latest = Some(stats);
        health.since = Instant::now();
    }

    /// An epoch did not commit: its commit failed, or the query failed while
    /// it was in flight.
    pub(crate) fn checkpoint_failed(&self) {
        lock(&self.checkpoints).failures += 1;
    }

    /// Where the reader `subtask` of the source `name` reports its lag.
    pub(crate) fn source_lag(&self, name: &str, subtask: usize) -> SourceLag {
        SourceLag {
            registry: self.lags.clone(),
            source: name.to_owned(),
            subtask,
        }
    }

    pub(crate) fn operator(&self, name: &str, subtask: usize, role: Role) -> Arc<OperatorMetrics> {
        let metrics = Arc::new(OperatorMetrics::default());
        lock(&self.operators).push((
            role,
            Registered {
                operator: name.to_owned(),
                subtask,
                metrics: metrics.clone(),
            },
        ));
        metrics
    }

    pub(crate) fn mailbox(
        &self,
        name: &str,
        subtask: usize,
        capacity: usize,
    ) -> Arc<MailboxMetrics> {
        let metrics = Arc::new(MailboxMetrics::new(capacity));
        lock(&self.mailboxes).push(Registered {
            operator: name.to_owned(),
            subtask,
            metrics: metrics.clone(),
        });
        metrics
    }

    pub(crate) fn latency_recorder(&self) -> LatencyRecorder {
        LatencyRecorder {
            local: LatencyHistograms::new(),
            shared: self.latency.clone(),
            last_publish: Instant::now(),
        }
    }

    /// The latencies recorded since the previous call, which starts a new interval.
    pub(crate) fn take_interval_latency(&self) -> LatencyReport {
        // The coordinator calls this at idle priority (SCHED_IDLE): it holds the
        // lock only for a swap, so a sink publishing meanwhile never waits for
        // it to be scheduled again (priority inversion).
        let fresh = LatencyHistograms::new();
        let interval = std::mem::replace(&mut lock(&self.latency).interval, fresh);
        interval.report()
    }

    /// Runs `read` on the latency histograms since the start.
    pub(crate) fn with_total_latency<R>(&self, read: impl FnOnce(&LatencyHistograms) -> R) -> R {
        read(&lock(&self.latency).total)
    }

    /// A consistent copy of every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let operators = lock(&self.operators)
            .iter()
            .map(|(role, r)| {
                let watermark = r.metrics.watermark.load(Ordering::Relaxed);
                OperatorSnapshot {
                    operator: r.operator.clone(),
                    subtask: r.subtask,
                    role: *role,
                    records_in: r.metrics.records_in.load(Ordering::Relaxed),
                    records_out: r.metrics.records_out.load(Ordering::Relaxed),
                    late_records: r.metrics.late.load(Ordering::Relaxed),
                    idle: r.metrics.idle.load(Ordering::Relaxed),
                    watermark: (watermark != EventTime::MIN).then_some(watermark),
                    state: *lock(&r.metrics.state),
                }
            })
            .collect();
        let mailboxes = lock(&self.mailboxes)
            .iter()
            .map(|r| MailboxSnapshot {
                operator: r.operator.clone(),
                subtask: r.subtask,
                capacity: r.metrics.capacity.load(Ordering::Relaxed) as usize,
                depth: r.metrics.depth.load(Ordering::Relaxed) as usize,
                max_depth: r.metrics.max_depth.load(Ordering::Relaxed) as usize,
                blocked: Duration::from_nanos(r.metrics.blocked_nanos.load(Ordering::Relaxed)),
            })
            .collect();
        let source_lag = lock(&self.lags)
            .iter()
            .filter_map(|lag| {
                Some(SourceLagSnapshot {
                    source: lag.reader.operator.clone(),
                    subtask: lag.reader.subtask,
                    topic: lag.topic.clone(),
                    partition: lag.partition.clone(),
                    records: lag.reader.metrics.records()?,
                })
            })
            .collect();
        let checkpoints = lock(&self.checkpoints);
        let (checkpoint, checkpoint_age, checkpoint_failures) = (
            checkpoints.latest,
            checkpoints.since.elapsed(),
            checkpoints.failures,
        );
        drop(checkpoints);
        // Copied under the lock and summarised outside it, as above.
        let latency = lock(&self.latency).total.clone();
        MetricsSnapshot {
            operators,
            mailboxes,
            source_lag,
            latency: latency.report(),
            checkpoint,
            checkpoint_age,
            checkpoint_failures,
            batch_duration: self.batch_duration,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records in and out of one operator instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorSnapshot {
    pub operator: String,
    pub subtask: usize,
    pub role: Role,
    pub records_in: u64,
    pub records_out: u64,
    /// Records dropped for arriving behind the watermark.
    pub late_records: u64,
    /// For sinks: every source partition upstream is idle.
    pub idle: bool,
    /// For sinks: the last watermark that reached them.
    pub watermark: Option<EventTime>,
    /// For stateful operators: their keyed state at the last barrier.
    pub state: Option<StateRows>,
}

/// One actor's mailbox as its senders saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MailboxSnapshot {
    /// The operator the mailbox belongs to.
    pub operator: String,
    pub subtask: usize,
    /// Capacity of each lane, in messages.
    pub capacity: usize,
    /// The lane depth seen after the latest send.
    pub depth: usize,
    /// The deepest any lane was seen after a send.
    pub max_depth: usize,
    /// Time senders spent blocked on a full lane (backpressure).
    pub blocked: Duration,
}

/// How far one reader is behind the end of one partition, as of the latest
/// look at the partition's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLagSnapshot {
    /// The source's name in the dataflow.
    pub source: String,
    /// The reader's index among the source's readers.
    pub subtask: usize,
    pub topic: String,
    pub partition: String,
    /// Records appended that the reader has not read yet.
    pub records: u64,
}

/// A copy of a query's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    pub operators: Vec<OperatorSnapshot>,
    pub mailboxes: Vec<MailboxSnapshot>,
    /// Consumer lag of every source partition whose end is known.
    pub source_lag: Vec<SourceLagSnapshot>,
    /// Latencies since the query started.
    pub latency: LatencyReport,
    /// The latest checkpoint this run committed, if any.
    pub checkpoint: Option<CheckpointStats>,
    /// Since this run last committed a checkpoint (since it started, before
    /// its first).
    pub checkpoint_age: Duration,
    /// Epochs this run did not commit: a failed commit, or a failure of the
    /// query while the epoch was in flight.
    pub checkpoint_failures: u64,
    /// The trigger's batch duration: a checkpoint is due every this long.
    pub batch_duration: Duration,
}

impl MetricsSnapshot {
    /// Records out of every instance of `operator`, summed.
    pub fn records_out(&self, operator: &str) -> u64 {
        self.operators
            .iter()
            .filter(|o| o.operator == operator)
            .map(|o| o.records_out)
            .sum()
    }

    /// Records into every instance of `operator`, summed.
    pub fn records_in(&self, operator: &str) -> u64 {
        self.operators
            .iter()
            .filter(|o| o.operator == operator)
            .map(|o| o.records_in)
            .sum()
    }

    /// Records read by every source.
    pub fn records_read(&self) -> u64 {
        self.with_role(Role::Source).map(|o| o.records_out).sum()
    }

    /// Records written by every sink, a repartition's writers included.
    pub fn records_written(&self) -> u64 {
        self.operators
            .iter()
            .filter(|o| matches!(o.role, Role::Sink | Role::Exchange))
            .map(|o| o.records_in)
            .sum()
    }

    /// Records dropped as late, over every operator.
    pub fn late_records(&self) -> u64 {
        self.operators.iter().map(|o| o.late_records).sum()
    }

    /// The query's watermark: the lowest that reached a sink, once every sink
    /// whose input is not idle has seen one; while all are idle, the lowest any
    /// reached. A repartition's writers do not count: the operators after the
    /// repartition run on the watermark of every process's source partitions,
    /// which reaches the sinks after them.
    pub fn watermark(&self) -> Option<EventTime> {
        let active: Vec<_> = self.with_role(Role::Sink).filter(|o| !o.idle).collect();
        if active.is_empty() {
            return self.with_role(Role::Sink).filter_map(|o| o.watermark).min();
        }
        active
            .into_iter()
            .map(|o| o.watermark)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .min()
    }

    fn with_role(&self, role: Role) -> impl Iterator<Item = &OperatorSnapshot> {
        self.operators.iter().filter(move |o| o.role == role)
    }
}
