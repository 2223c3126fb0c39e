//! What a query reports about itself: [`StreamingQueryProgress`] (with Spark's JSON
//! field names), [`StreamingQueryStatus`], and the [`StreamingQueryListener`]
//! callbacks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use rtflow_checkpoint::Offsets;

use crate::cluster::membership::Membership;
use crate::metrics::{MetricsSnapshot, Percentiles, QueryMetrics};
use crate::record::Epoch;

/// One report of a query's progress: published at every checkpoint commit, at
/// least every `QueryConfig::progress_interval` while no epoch ends, and when the
/// query ends.
///
/// ```
/// use rtflow_runtime::progress::StreamingQueryProgress;
/// let json = r#"{"id":"a","runId":"b","name":"q","timestamp":"2026-01-01T00:00:00.000Z",
///   "batchId":0,"numInputRows":0,"inputRowsPerSecond":0.0,"processedRowsPerSecond":0.0,
///   "durationMs":{},"eventTime":{},"stateOperators":[],"sources":[],
///   "sink":{"description":"memory","numOutputRows":0},
///   "latencies":{"processingLatencyMs":{"P0":0.0,"P50":0.0,"P90":0.0,"P95":0.0,"P99":0.0},
///   "sourceQueuingLatencyMs":{"P0":0.0,"P50":0.0,"P90":0.0,"P95":0.0,"P99":0.0},
///   "e2eLatencyMs":{"P0":0.0,"P50":0.0,"P90":0.0,"P95":0.0,"P99":0.0}}}"#;
/// let progress = StreamingQueryProgress::from_json(json).unwrap();
/// assert_eq!(progress.name, "q");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamingQueryProgress {
    pub id: String,
    pub run_id: String,
    pub name: String,
    /// When the report was made, RFC 3339 in UTC.
    pub timestamp: String,
    /// The epoch (checkpoint batch) the report belongs to.
    pub batch_id: u64,
    /// Rows read from every source since the previous report.
    pub num_input_rows: u64,
    pub input_rows_per_second: f64,
    pub processed_rows_per_second: f64,
    /// Durations of the report's phases, in milliseconds.
    pub duration_ms: BTreeMap<String, u64>,
    /// Event-time figures: `watermark` (RFC 3339) once a watermark is known.
    pub event_time: BTreeMap<String, String>,
    pub state_operators: Vec<StateOperatorProgress>,
    pub sources: Vec<SourceProgress>,
    pub sink: SinkProgress,
    pub latencies: Latencies,
    /// In a clustered query: which process made the report, and the
    /// partitions (each a task of its stage) it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterProgress>,
}

/// A process's share of a clustered query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterProgress {
    /// The process's name in the cluster.
    pub member: String,
    /// The partitions it runs, as `topic-partition`: source partitions for the
    /// stage before the repartition, repartition partitions for the one after.
    pub partitions: Vec<String>,
}

/// One stateful operator's keyed state at its last barrier, summed over its
/// instances (see [`StateRows`](crate::metrics::StateRows)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateOperatorProgress {
    pub operator_name: String,
    /// Keys with a value.
    pub num_rows_total: u64,
    /// Keys set or removed in the epoch that ended at the barrier.
    pub num_rows_updated: u64,
    /// Bytes of the state's hash tables, not counting what keys and values own.
    pub memory_used_bytes: u64,
    /// Records dropped for arriving behind the watermark, since the start.
    pub num_rows_dropped_by_watermark: u64,
}

/// One source's share of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceProgress {
    pub description: String,
    /// Offsets at the start of the epoch (the previous checkpoint), in reports
    /// made at a checkpoint commit.
    pub start_offset: Option<Offsets>,
    /// Offsets at the end of the epoch, in reports made at a checkpoint commit.
    pub end_offset: Option<Offsets>,
    pub num_input_rows: u64,
    pub input_rows_per_second: f64,
    pub processed_rows_per_second: f64,
    /// For a source whose readers know where their partitions end (Kafka),
    /// Spark's consumer lag over the partitions this process reads, in
    /// records: `avgOffsetsBehindLatest`, `maxOffsetsBehindLatest` and
    /// `minOffsetsBehindLatest`. Absent, as in Spark, for other sources.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, String>,
}

/// Spark's `sources[].metrics` for partitions `lags` records behind their end.
fn offsets_behind_latest(lags: &[u64]) -> BTreeMap<String, String> {
    let (Some(min), Some(max)) = (lags.iter().min(), lags.iter().max()) else {
        return BTreeMap::new();
    };
    let avg = lags.iter().sum::<u64>() as f64 / lags.len() as f64;
    BTreeMap::from([
        // Spark writes the average as a Java double: "0.0", "12.5".
        ("avgOffsetsBehindLatest".to_owned(), format!("{avg:?}")),
        ("maxOffsetsBehindLatest".to_owned(), max.to_string()),
        ("minOffsetsBehindLatest".to_owned(), min.to_string()),
    ])
}

/// The sinks' share of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SinkProgress {
    pub description: String,
    pub num_output_rows: u64,
}

/// Latency percentiles of the records written since the previous report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Latencies {
    pub processing_latency_ms: LatencyPercentiles,
    pub source_queuing_latency_ms: LatencyPercentiles,
    pub e2e_latency_ms: LatencyPercentiles,
}

/// Percentiles in milliseconds, as Databricks reports them.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LatencyPercentiles {
    #[serde(rename = "P0")]
    pub p0: f64,
    #[serde(rename = "P50")]
    pub p50: f64,
    #[serde(rename = "P90")]
    pub p90: f64,
    #[serde(rename = "P95")]
    pub p95: f64,
    #[serde(rename = "P99")]
    pub p99: f64,
}

impl From<Percentiles> for LatencyPercentiles {
    fn from(p: Percentiles) -> Self {
        Self {
            p0: p.p0,
            p50: p.p50,
            p90: p.p90,
            p95: p.p95,
            p99: p.p99,
        }
    }
}

impl StreamingQueryProgress {
    /// The report as JSON.
    pub fn json(&self) -> String {
        serde_json::to_string(self).expect("progress always serializes")
    }

    /// The report as indented JSON.
    pub fn pretty_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("progress always serializes")
    }

    /// Reads a report back from JSON.
    pub fn from_json(json: &str) -> serde_json::Result<Self> {
        serde_json::from_str(json)
    }
}

/// What a query is doing right now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamingQueryStatus {
    pub message: String,
    /// Whether the sources returned records in the last report.
    pub is_data_available: bool,
    /// Whether the query's long-running tasks are running.
    pub is_trigger_active: bool,
}

/// A query started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryStartedEvent {
    pub id: String,
    pub run_id: String,
    pub name: String,
    pub timestamp: String,
}

/// A query terminated, failed if `exception` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryTerminatedEvent {
    pub id: String,
    pub run_id: String,
    /// The failure's message.
    pub exception: Option<String>,
    /// The failure's error class.
    pub error_class: Option<String>,
}

/// Callbacks on a query's life, called on its coordinator's thread: keep them
/// short.
pub trait StreamingQueryListener: Send + Sync {
    /// The query's actors are running.
    fn on_query_started(&self, _event: &QueryStartedEvent) {}
    /// A progress report was published.
    fn on_query_progress(&self, _progress: &StreamingQueryProgress) {}
    /// The query stopped or failed; its last progress came before this.
    fn on_query_terminated(&self, _event: &QueryTerminatedEvent) {}
}

/// RFC 3339 with milliseconds, in UTC.
pub(crate) fn timestamp(at: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

/// A source as progress reports name it.
pub(crate) struct SourceDescription {
    /// Its operator name, which its metrics are kept under.
    pub(crate) name: String,
    /// Its stable id, which its checkpointed offsets are kept under.
    pub(crate) uid: String,
    /// What it reads.
    pub(crate) description: String,
}

/// Offsets per source, by uid.
pub(crate) type SourceOffsets = BTreeMap<String, Offsets>;

/// A committed epoch: the sources' offsets before and after it, and how long
/// its checkpoint took.
#[derive(Clone, Copy)]
pub(crate) struct EpochOffsets<'a> {
    pub(crate) start: &'a SourceOffsets,
    pub(crate) end: &'a SourceOffsets,
    /// From the barrier's injection to the durable manifest.
    pub(crate) checkpoint: Duration,
    /// Writing and flushing the manifest.
    pub(crate) commit: Duration,
}

/// Builds each progress report from the counters' change since the previous one.
pub(crate) struct ProgressTracker {
    cluster: Option<Arc<dyn Membership>>,
    id: String,
    run_id: String,
    name: String,
    sources: Vec<SourceDescription>,
    sink: String,
    last_report: Instant,
    last_read: BTreeMap<String, u64>,
    last_written: u64,
}

impl ProgressTracker {
    /// Reports for the query `name` with ids `id` and `run_id`.
    pub(crate) fn new(
        (id, run_id, name): (String, String, String),
        sources: Vec<SourceDescription>,
        sinks: Vec<String>,
        cluster: Option<Arc<dyn Membership>>,
    ) -> Self {
        Self {
            id,
            run_id,
            name,
            cluster,
            sources,
            sink: sinks.join(", "),
            last_report: Instant::now(),
            last_read: BTreeMap::new(),
            last_written: 0,
        }
    }

    /// The report for everything since the previous one, in `epoch`; at a
    /// checkpoint commit, with the sources' offsets before and after it.
    pub(crate) fn report(
        &mut self,
        metrics: &QueryMetrics,
        epoch: Epoch,
        offsets: Option<EpochOffsets<'_>>,
    ) -> StreamingQueryProgress {
        let snapshot = metrics.snapshot();
        let latency = metrics.take_interval_latency();
        let elapsed = std::mem::replace(&mut self.last_report, Instant::now()).elapsed();
        let per_second = |rows: u64| rows as f64 / elapsed.as_secs_f64().max(1e-9);

        let sources: Vec<SourceProgress> = self
            .sources
            .iter()
            .map(|source| {
                let read = snapshot.records_out(&source.name);
                let before = self
                    .last_read
                    .insert(source.name.clone(), read)
                    .unwrap_or(0);
                let rows = read - before;
                let (start_offset, end_offset) = match offsets {
                    Some(EpochOffsets { start, end, .. }) => (
                        Some(start.get(&source.uid).cloned().unwrap_or_default()),
                        end.get(&source.uid).cloned(),
                    ),
                    None => (None, None),
                };
                let lags: Vec<u64> = snapshot
                    .source_lag
                    .iter()
                    .filter(|lag| lag.source == source.name)
                    .map(|lag| lag.records)
                    .collect();
                SourceProgress {
                    description: source.description.clone(),
                    start_offset,
                    end_offset,
                    num_input_rows: rows,
                    input_rows_per_second: per_second(rows),
                    processed_rows_per_second: per_second(rows),
                    metrics: offsets_behind_latest(&lags),
                }
            })
            .collect();
        let num_input_rows = sources.iter().map(|s| s.num_input_rows).sum();
        let written = snapshot.records_written();
        let num_output_rows = written - std::mem::replace(&mut self.last_written, written);
        let event_time = snapshot
            .watermark()
            .map(|ms| {
                let at = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
                BTreeMap::from([("watermark".to_owned(), timestamp(at))])
            })
            .unwrap_or_default();
        let mut duration_ms =
            BTreeMap::from([("triggerExecution".to_owned(), elapsed.as_millis() as u64)]);
        if let Some(commit) = offsets {
            duration_ms.insert(
                "checkpoint".to_owned(),
                commit.checkpoint.as_millis() as u64,
            );
            duration_ms.insert("commitOffsets".to_owned(), commit.commit.as_millis() as u64);
        }
        StreamingQueryProgress {
            id: self.id.clone(),
            run_id: self.run_id.clone(),
            name: self.name.clone(),
            timestamp: timestamp(SystemTime::now()),
            batch_id: epoch,
            num_input_rows,
            input_rows_per_second: per_second(num_input_rows),
            processed_rows_per_second: per_second(num_input_rows),
            duration_ms,
            event_time,
            state_operators: state_operators(&snapshot),
            sources,
            sink: SinkProgress {
                description: self.sink.clone(),
                num_output_rows,
            },
            latencies: Latencies {
                processing_latency_ms: latency.processing.into(),
                source_queuing_latency_ms: latency.source_queuing.into(),
                e2e_latency_ms: latency.end_to_end.into(),
            },
            cluster: self.cluster.as_ref().map(|link| ClusterProgress {
                member: link.member(),
                partitions: link.partitions(),
            }),
        }
    }
}

/// Every stateful operator's state at its instances' last barrier, summed over
/// them, in the order the operators were started.
fn state_operators(snapshot: &MetricsSnapshot) -> Vec<StateOperatorProgress> {
    let mut operators: Vec<StateOperatorProgress> = Vec::new();
    for instance in &snapshot.operators {
        let Some(rows) = instance.state else { continue };
        let at = match operators
            .iter()
            .position(|o| o.operator_name == instance.operator)
        {
            Some(at) => at,
            None => {
                operators.push(StateOperatorProgress {
                    operator_name: instance.operator.clone(),
                    num_rows_total: 0,
                    num_rows_updated: 0,
                    memory_used_bytes: 0,
                    num_rows_dropped_by_watermark: 0,
                });
                operators.len() - 1
            }
        };
        let operator = &mut operators[at];
        operator.num_rows_total += rows.total;
        operator.num_rows_updated += rows.updated;
        operator.memory_used_bytes += rows.memory_bytes;
        operator.num_rows_dropped_by_watermark += instance.late_records;
    }
    operators
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_behind_latest_reads_as_sparks() {
        assert!(offsets_behind_latest(&[]).is_empty(), "no lag known: none");
        let metrics = offsets_behind_latest(&[0, 5, 10, 6]);
        assert_eq!(metrics["avgOffsetsBehindLatest"], "5.25");
        assert_eq!(metrics["maxOffsetsBehindLatest"], "10");
        assert_eq!(metrics["minOffsetsBehindLatest"], "0");
        assert_eq!(offsets_behind_latest(&[3])["avgOffsetsBehindLatest"], "3.0");
    }
}
