//! The Prometheus `/metrics` endpoint. One small HTTP server runs per address and
//! serves every query registered on it, told apart by a `query` label; each scrape
//! reads the queries' counters and histograms, so the hot path pays nothing.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};

use crate::error::{Result, RtflowError};
use crate::guard;
use crate::metrics::LatencyHistograms;
use crate::record::now_nanos;
use crate::shared::QueryShared;

/// Upper bounds of the latency histograms' buckets, in seconds (Prometheus'
/// base unit, which `promtool check metrics` asks for): 1 µs to 10 s.
const LATENCY_BUCKETS_SECONDS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

struct Endpoint {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    queries: Arc<Mutex<Vec<Arc<QueryShared>>>>,
}

fn endpoints() -> MutexGuard<'static, HashMap<SocketAddr, Endpoint>> {
    static ENDPOINTS: OnceLock<Mutex<HashMap<SocketAddr, Endpoint>>> = OnceLock::new();
    ENDPOINTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// A query's place on an endpoint; dropping it takes the query off, and stops the
/// server once no query is left on it.
pub(crate) struct Registration {
    address: SocketAddr,
    query: Arc<QueryShared>,
}

/// Serves `query`'s metrics on `address`, starting the server if it is the first.
pub(crate) fn register(address: SocketAddr, query: Arc<QueryShared>) -> Result<Registration> {
    let mut endpoints = endpoints();
    let endpoint = match endpoints.entry(address) {
        Entry::Occupied(entry) => entry.into_mut(),
        Entry::Vacant(entry) => entry.insert(start(address)?),
    };
    lock(&endpoint.queries).push(query.clone());
    Ok(Registration { address, query })
}

fn start(address: SocketAddr) -> Result<Endpoint> {
    let server = tiny_http::Server::http(address).map_err(|error| {
        RtflowError::InvalidConfiguration(format!(
            "cannot serve /metrics on {address}: {error}; choose a free address with \
             QueryConfig::metrics_address"
        ))
    })?;
    let server = Arc::new(server);
    let queries = Arc::new(Mutex::new(Vec::new()));
    let thread = std::thread::Builder::new()
        .name(ENDPOINT_THREAD.into())
        .spawn({
            let (server, queries) = (server.clone(), queries.clone());
            move || serve(&server, &queries)
        })
        .map_err(|error| {
            RtflowError::InvalidConfiguration(format!("cannot start the /metrics server: {error}"))
        })?;
    Ok(Endpoint {
        server,
        thread: Some(thread),
        queries,
    })
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut endpoints = endpoints();
        let Some(endpoint) = endpoints.get_mut(&self.address) else {
            return;
        };
        let mut queries = lock(&endpoint.queries);
        queries.retain(|q| !Arc::ptr_eq(q, &self.query));
        let empty = queries.is_empty();
        drop(queries);
        if empty {
            let mut endpoint = endpoints.remove(&self.address).expect("present");
            endpoint.server.unblock();
            if let Some(thread) = endpoint.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Answers scrapes until the last query leaves. A scrape that panics is
/// answered with a 500 carrying the panic's message, and logged: the
/// endpoint serves the next one, and the queries run on (Prometheus shows the
/// target down, which is what alerts watch).
fn serve(server: &tiny_http::Server, queries: &Mutex<Vec<Arc<QueryShared>>>) {
    for request in server.incoming_requests() {
        let answered = guard::engine(ENDPOINT_THREAD, || Ok(respond(request.url(), queries)));
        let response = answered.unwrap_or_else(|error| {
            tracing::error!(%error, "a /metrics scrape failed");
            tiny_http::Response::from_data(error.to_string().into_bytes()).with_status_code(500)
        });
        let _ = request.respond(response);
    }
}

/// The endpoint's thread, as errors name it.
const ENDPOINT_THREAD: &str = "metrics-http";

fn respond(
    url: &str,
    queries: &Mutex<Vec<Arc<QueryShared>>>,
) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    if url != "/metrics" {
        return tiny_http::Response::from_data(b"rtflow serves /metrics\n".to_vec())
            .with_status_code(404);
    }
    fail::fail_point!("metrics-scrape");
    let families = gather(&lock(queries));
    let mut body = Vec::new();
    let encoder = TextEncoder::new();
    let _ = encoder.encode(&families, &mut body);
    let content_type = tiny_http::Header::from_bytes("Content-Type", encoder.format_type())
        .expect("a valid header");
    tiny_http::Response::from_data(body).with_header(content_type)
}

/// Metric families by name, built up query by query.
#[derive(Default)]
struct Families(BTreeMap<&'static str, MetricFamily>);

impl Families {
    fn add(&mut self, name: &'static str, help: &str, kind: MetricType, metric: Metric) {
        self.0
            .entry(name)
            .or_insert_with(|| {
                let mut family = MetricFamily::default();
                family.set_name(name.to_owned());
                family.set_help(help.to_owned());
                family.set_field_type(kind);
                family
            })
            .mut_metric()
            .push(metric);
    }

    fn gauge(&mut self, name: &'static str, help: &str, labels: &[(&str, &str)], value: f64) {
        let mut gauge = Gauge::default();
        gauge.set_value(value);
        let mut metric = labelled(labels);
        metric.set_gauge(gauge);
        self.add(name, help, MetricType::GAUGE, metric);
    }

    fn counter(&mut self, name: &'static str, help: &str, labels: &[(&str, &str)], value: f64) {
        let mut counter = Counter::default();
        counter.set_value(value);
        let mut metric = labelled(labels);
        metric.set_counter(counter);
        self.add(name, help, MetricType::COUNTER, metric);
    }

    /// A latency histogram (seconds) from an HDR histogram (ns); bucket counts
    /// and the sum carry the HDR histogram's ~1% precision.
    fn latency(
        &mut self,
        name: &'static str,
        help: &str,
        query: &str,
        hdr: &hdrhistogram::Histogram<u64>,
    ) {
        let buckets = LATENCY_BUCKETS_SECONDS
            .iter()
            .map(|bound| {
                let mut bucket = Bucket::default();
                bucket.set_upper_bound(*bound);
                bucket.set_cumulative_count(hdr.count_between(0, (bound * 1e9) as u64));
                bucket
            })
            .collect();
        let mut histogram = Histogram::default();
        histogram.set_sample_count(hdr.len());
        histogram.set_sample_sum(hdr.mean() * hdr.len() as f64 / 1e9);
        histogram.set_bucket(buckets);
        let mut metric = labelled(&[("query", query)]);
        metric.set_histogram(histogram);
        self.add(name, help, MetricType::HISTOGRAM, metric);
    }
}

fn labelled(labels: &[(&str, &str)]) -> Metric {
    let mut metric = Metric::default();
    metric.set_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name((*name).to_owned());
                pair.set_value((*value).to_owned());
                pair
            })
            .collect(),
    );
    metric
}

fn gather(queries: &[Arc<QueryShared>]) -> Vec<MetricFamily> {
    let mut families = Families::default();
    for query in queries {
        let name = query.name.as_str();
        let (active, failed) = query.liveness();
        let q = [("query", name)];
        families.gauge(
            "rtflow_query_up",
            "1 while the query runs",
            &q,
            f64::from(u8::from(active)),
        );
        families.gauge(
            "rtflow_query_failed",
            "1 once the query failed",
            &q,
            f64::from(u8::from(failed)),
        );

        if let Some(cluster) = &query.cluster_progress() {
            for partition in &cluster.partitions {
                families.gauge(
                    "rtflow_cluster_partition_owned",
                    "1 for each partition (a task of its stage) this process of a clustered \
                     query runs",
                    &[
                        ("query", name),
                        ("member", &cluster.member),
                        ("partition", partition),
                    ],
                    1.0,
                );
            }
            families.gauge(
                "rtflow_cluster_partitions",
                "Partitions this process of a clustered query runs",
                &[("query", name), ("member", &cluster.member)],
                cluster.partitions.len() as f64,
            );
        }
        let snapshot = query.metrics.snapshot();
        for op in &snapshot.operators {
            let subtask = op.subtask.to_string();
            let labels = [
                ("query", name),
                ("operator", op.operator.as_str()),
                ("subtask", &subtask),
            ];
            families.counter(
                "rtflow_records_in_total",
                "Records into an operator instance",
                &labels,
                op.records_in as f64,
            );
            families.counter(
                "rtflow_records_out_total",
                "Records out of an operator instance",
                &labels,
                op.records_out as f64,
            );
            families.counter(
                "rtflow_late_records_total",
                "Records an operator instance dropped for arriving behind the watermark",
                &labels,
                op.late_records as f64,
            );
            if let Some(state) = op.state {
                families.gauge(
                    "rtflow_state_rows",
                    "Keys in a stateful operator instance's keyed state at its last barrier",
                    &labels,
                    state.total as f64,
                );
                families.gauge(
                    "rtflow_state_memory_bytes",
                    "Bytes of an operator instance's state hash tables at its last barrier",
                    &labels,
                    state.memory_bytes as f64,
                );
            }
        }
        for mailbox in &snapshot.mailboxes {
            let subtask = mailbox.subtask.to_string();
            let labels = [
                ("query", name),
                ("operator", mailbox.operator.as_str()),
                ("subtask", &subtask),
            ];
            families.gauge(
                "rtflow_mailbox_depth",
                "Messages in a mailbox lane after the latest send",
                &labels,
                mailbox.depth as f64,
            );
            families.gauge(
                "rtflow_mailbox_capacity",
                "Capacity of each mailbox lane, in messages",
                &labels,
                mailbox.capacity as f64,
            );
            families.counter(
                "rtflow_backpressure_seconds_total",
                "Time senders spent blocked on a full mailbox lane",
                &labels,
                mailbox.blocked.as_secs_f64(),
            );
        }
        for lag in &snapshot.source_lag {
            let subtask = lag.subtask.to_string();
            families.gauge(
                "rtflow_source_lag_records",
                "Records appended to a source partition that its reader has not read yet \
                 (consumer lag): the partition's end minus the reader's position",
                &[
                    ("query", name),
                    ("source", lag.source.as_str()),
                    ("subtask", &subtask),
                    ("topic", lag.topic.as_str()),
                    ("partition", lag.partition.as_str()),
                ],
                lag.records as f64,
            );
        }
        families.gauge(
            "rtflow_batch_duration_seconds",
            "The trigger's batch duration: a checkpoint is due every this long",
            &q,
            snapshot.batch_duration.as_secs_f64(),
        );
        if active {
            families.gauge(
                "rtflow_checkpoint_age_seconds",
                "Time since this run of the query last committed a checkpoint (since it \
                 started, before its first)",
                &q,
                snapshot.checkpoint_age.as_secs_f64(),
            );
        }
        families.counter(
            "rtflow_checkpoint_failures_total",
            "Epochs this run did not commit: a failed commit, or the query failing while \
             the epoch was in flight",
            &q,
            snapshot.checkpoint_failures as f64,
        );
        if let Some(checkpoint) = snapshot.checkpoint {
            families.gauge(
                "rtflow_checkpoint_epoch",
                "The latest committed epoch",
                &q,
                checkpoint.epoch as f64,
            );
            families.gauge(
                "rtflow_checkpoint_duration_seconds",
                "Barrier injection to durable manifest, for the latest checkpoint",
                &q,
                checkpoint.duration.as_secs_f64(),
            );
            families.gauge(
                "rtflow_checkpoint_size_bytes",
                "Bytes written by the latest checkpoint",
                &q,
                checkpoint.bytes as f64,
            );
        }
        if let Some(watermark) = snapshot.watermark() {
            let lag_ms = (now_nanos() / 1_000_000) as f64 - watermark as f64;
            families.gauge(
                "rtflow_watermark_seconds",
                "The query's event-time watermark (seconds since the Unix epoch)",
                &q,
                watermark as f64 / 1000.0,
            );
            families.gauge(
                "rtflow_watermark_lag_seconds",
                "Wall clock minus the watermark",
                &q,
                lag_ms / 1000.0,
            );
        }
        query
            .metrics
            .with_total_latency(|latency: &LatencyHistograms| {
                families.latency(
                    "rtflow_processing_latency_seconds",
                    "Read by the source -> fully processed by the sink",
                    name,
                    &latency.processing,
                );
                families.latency(
                    "rtflow_source_queuing_latency_seconds",
                    "Appended to the source -> read by rtflow",
                    name,
                    &latency.source_queuing,
                );
                families.latency(
                    "rtflow_e2e_latency_seconds",
                    "Produced at the source -> fully processed by the sink",
                    name,
                    &latency.end_to_end,
                );
            });
    }
    families.0.into_values().collect()
}
