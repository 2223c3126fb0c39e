//! Counters and latency histograms. Actors count into plain fields on the hot path
//! and publish into the shared atomics and histograms here once per batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::record::{Nanos, RecordMeta};

/// Records in and out of one operator instance.
#[derive(Debug, Default)]
pub struct OperatorMetrics {
    records_in: AtomicU64,
    records_out: AtomicU64,
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
}

/// One mailbox lane set, seen from its senders.
#[derive(Debug, Default)]
pub struct MailboxMetrics {
    capacity: AtomicU64,
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

#[derive(Clone)]
struct LatencyHistograms {
    processing: Histogram<u64>,
    source_queuing: Histogram<u64>,
    end_to_end: Histogram<u64>,
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
}

/// A sink actor's private latency histograms, merged into the query's every
/// [`LatencyRecorder::PUBLISH_EVERY`] so the hot path takes no lock.
pub(crate) struct LatencyRecorder {
    local: LatencyHistograms,
    shared: Arc<Mutex<LatencyHistograms>>,
    last_publish: Instant,
}

impl LatencyRecorder {
    const PUBLISH_EVERY: Duration = Duration::from_millis(100);

    #[inline]
    pub(crate) fn record(&mut self, meta: &RecordMeta, done: Nanos) {
        let local = &mut self.local;
        local
            .processing
            .saturating_record(done.saturating_sub(meta.ingest_time).max(1));
        local
            .end_to_end
            .saturating_record(done.saturating_sub(meta.source_time).max(1));
        local
            .source_queuing
            .saturating_record(meta.ingest_time.saturating_sub(meta.source_time).max(1));
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
        if let Ok(mut shared) = self.shared.lock() {
            shared.add(&self.local);
        }
        self.local.clear();
    }
}

/// Every counter of one query, shared by its actors and read by its handle.
pub struct QueryMetrics {
    operators: Mutex<Vec<(String, usize, Arc<OperatorMetrics>)>>,
    mailboxes: Mutex<Vec<(String, usize, Arc<MailboxMetrics>)>>,
    latency: Arc<Mutex<LatencyHistograms>>,
}

impl QueryMetrics {
    pub(crate) fn new() -> Self {
        Self {
            operators: Mutex::default(),
            mailboxes: Mutex::default(),
            latency: Arc::new(Mutex::new(LatencyHistograms::new())),
        }
    }

    pub(crate) fn operator(&self, name: &str, subtask: usize) -> Arc<OperatorMetrics> {
        let metrics = Arc::new(OperatorMetrics::default());
        lock(&self.operators).push((name.to_owned(), subtask, metrics.clone()));
        metrics
    }

    pub(crate) fn mailbox(
        &self,
        name: &str,
        subtask: usize,
        capacity: usize,
    ) -> Arc<MailboxMetrics> {
        let metrics = Arc::new(MailboxMetrics::new(capacity));
        lock(&self.mailboxes).push((name.to_owned(), subtask, metrics.clone()));
        metrics
    }

    pub(crate) fn latency_recorder(&self) -> LatencyRecorder {
        LatencyRecorder {
            local: LatencyHistograms::new(),
            shared: self.latency.clone(),
            last_publish: Instant::now(),
        }
    }

    /// A consistent copy of every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let operators = lock(&self.operators)
            .iter()
            .map(|(name, subtask, m)| OperatorSnapshot {
                operator: name.clone(),
                subtask: *subtask,
                records_in: m.records_in.load(Ordering::Relaxed),
                records_out: m.records_out.load(Ordering::Relaxed),
            })
            .collect();
        let mailboxes = lock(&self.mailboxes)
            .iter()
            .map(|(name, subtask, m)| MailboxSnapshot {
                operator: name.clone(),
                subtask: *subtask,
                capacity: m.capacity.load(Ordering::Relaxed) as usize,
                max_depth: m.max_depth.load(Ordering::Relaxed) as usize,
                blocked: Duration::from_nanos(m.blocked_nanos.load(Ordering::Relaxed)),
            })
            .collect();
        let latency = {
            let histograms = lock(&self.latency);
            LatencyReport {
                processing: Percentiles::of(&histograms.processing),
                source_queuing: Percentiles::of(&histograms.source_queuing),
                end_to_end: Percentiles::of(&histograms.end_to_end),
            }
        };
        MetricsSnapshot {
            operators,
            mailboxes,
            latency,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records in and out of one operator instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorSnapshot {
    pub operator: String,
    pub subtask: usize,
    pub records_in: u64,
    pub records_out: u64,
}

/// One actor's mailbox as its senders saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MailboxSnapshot {
    /// The operator the mailbox belongs to.
    pub operator: String,
    pub subtask: usize,
    /// Capacity of each lane, in messages.
    pub capacity: usize,
    /// The deepest any lane was seen after a send.
    pub max_depth: usize,
    /// Time senders spent blocked on a full lane (backpressure).
    pub blocked: Duration,
}

/// A copy of a query's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    pub operators: Vec<OperatorSnapshot>,
    pub mailboxes: Vec<MailboxSnapshot>,
    pub latency: LatencyReport,
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
}
