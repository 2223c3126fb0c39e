//! What flows on an edge: records with their timestamps, and the in-band markers
//! (watermarks, barriers, end of stream) that travel with them.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock nanoseconds since the Unix epoch.
pub type Nanos = u64;

/// Event time in milliseconds since the Unix epoch.
pub type EventTime = i64;

/// Checkpoint epoch number.
pub type Epoch = u64;

/// What every record type must be: sent between actor threads, and cloned where a
/// stream fans out (broadcast, several consumers).
pub trait Data: Clone + Send + 'static {}
impl<T: Clone + Send + 'static> Data for T {}

/// The timestamps a record carries from source to sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordMeta {
    /// Event time (ms); the source time unless `with_watermark` assigns one.
    pub event_time: EventTime,
    /// When the source system produced the record (Kafka timestamp, generator
    /// creation time, memory push time).
    pub source_time: Nanos,
    /// When rtflow read the record from its source.
    pub ingest_time: Nanos,
    /// The source partition the record was read from (watermarks are tracked per
    /// partition).
    pub partition: u32,
    /// Behind the watermark it was written under: in a clustered query,
    /// `with_watermark` marks a record earlier than the latest event time its
    /// partition delivered before, minus the delay, and a repartition passes
    /// the mark on, so that its readers can judge the record
    /// ([`late`](Self::late)). One process judges lateness by the watermark of
    /// all partitions alone and leaves it unset.
    pub behind: bool,
    /// Judged late on its way already: a clustered query's repartition reader
    /// found it behind the watermark it crossed the repartition under, which
    /// the reader's own partitions may not know yet. Operators that drop late
    /// records (windows, deduplication, stream joins) drop it whatever their
    /// own watermark.
    pub late: bool,
}

/// A value and its timestamps.
#[derive(Debug, Clone, PartialEq)]
pub struct Record<T> {
    pub value: T,
    pub meta: RecordMeta,
}

/// One message in a mailbox lane.
#[derive(Debug)]
#[non_exhaustive]
pub enum Message<T> {
    /// A batch of records, in order.
    Data(Vec<Record<T>>),
    /// No record with an earlier event time will follow on this lane.
    Watermark(EventTime),
    /// Every source partition behind this lane is idle: leave the lane out of the
    /// watermark until it sends a watermark again.
    Idle,
    /// Ends checkpoint epoch N on this lane.
    Barrier(Epoch),
    /// The sender finished; nothing follows.
    End,
}

/// The current wall-clock time in nanoseconds.
pub fn now_nanos() -> Nanos {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as Nanos)
}

/// Milliseconds for a nanosecond timestamp, as event time.
pub fn nanos_to_event_time(nanos: Nanos) -> EventTime {
    (nanos / 1_000_000) as EventTime
}
