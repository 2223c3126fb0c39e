//! Progress reports, listeners and the Prometheus endpoint.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, wait_for_rows, TIMEOUT};
use rtflow::prelude::*;
use rtflow::runtime::progress::{
    QueryStartedEvent, QueryTerminatedEvent, StreamingQueryListener, StreamingQueryProgress,
};

/// A free loopback address for a metrics endpoint.
fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// GET /metrics, parsed with a Prometheus text-format parser.
fn scrape(address: SocketAddr) -> prometheus_parse::Scrape {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(head.contains("text/plain"), "{head}");
    let lines = body.lines().map(|line| Ok(line.to_owned()));
    prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text format")
}

fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(ref buckets) => {
                buckets.last().map_or(0.0, |b| b.count)
            }
            prometheus_parse::Value::Summary(_) => f64::NAN,
        })
        .reduce(|a, b| a + b)
}

#[test]
fn metrics_endpoint_serves_moving_counters_for_every_query() {
    let address = free_address();
    let input = MemorySource::new(2);
    let flow = Dataflow::new("scraped");
    flow.source(input.clone())
        .name("numbers")
        .map(|x: u64| x + 1)
        .sink(MemorySink::new());
    let query = flow
        .start(config("scraped").metrics_address(address))
        .unwrap();
    let other = Dataflow::new("other");
    other
        .source(MemorySource::<u64>::new(1))
        .sink(MemorySink::new());
    let other = other
        .start(config("other").metrics_address(address))
        .unwrap();

    let records_out = |scrape: &prometheus_parse::Scrape| {
        value(
            scrape,
            "rtflow_records_out_total",
            &[("query", "scraped"), ("operator", "numbers")],
        )
    };
    let before = scrape(address);
    assert_eq!(records_out(&before), Some(0.0));
    assert_eq!(
        value(&before, "rtflow_query_up", &[("query", "scraped")]),
        Some(1.0)
    );
    assert_eq!(
        value(&before, "rtflow_query_up", &[("query", "other")]),
        Some(1.0)
    );

    input.push_all(0, 0..600).unwrap();
    input.push_all(1, 0..400).unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    let after = loop {
        let after = scrape(address);
        if value(
            &after,
            "rtflow_processing_latency_seconds",
            &[("query", "scraped")],
        ) == Some(1000.0)
        {
            break after;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "latency histogram never reached 1000"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(records_out(&after), Some(1000.0));
    assert_eq!(
        value(
            &after,
            "rtflow_records_in_total",
            &[("query", "scraped"), ("operator", "memory-2")]
        ),
        Some(1000.0)
    );
    for histogram in [
        "rtflow_e2e_latency_seconds",
        "rtflow_source_queuing_latency_seconds",
    ] {
        assert_eq!(
            value(&after, histogram, &[("query", "scraped")]),
            Some(1000.0),
            "{histogram}"
        );
    }
    query.stop().unwrap();
    let stopped = scrape(address);
    assert_eq!(
        value(&stopped, "rtflow_query_up", &[("query", "scraped")]),
        Some(0.0)
    );
    assert_eq!(
        value(&stopped, "rtflow_query_failed", &[("query", "scraped")]),
        Some(0.0)
    );
    drop(query);
    let dropped = scrape(address);
    assert_eq!(
        value(&dropped, "rtflow_query_up", &[("query", "scraped")]),
        None
    );
    other.stop().unwrap();
}

#[test]
fn an_address_in_use_is_rejected() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let flow = Dataflow::new("taken");
    flow.source(MemorySource::<u64>::new(1))
        .sink(MemorySink::new());
    let error = flow
        .start(config("taken").metrics_address(taken.local_addr().unwrap()))
        .unwrap_err();
    assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
    assert!(
        error.to_string().contains("cannot serve /metrics"),
        "{error}"
    );
}

#[test]
fn processing_latency_reflects_a_slow_map() {
    const DELAY: Duration = Duration::from_millis(20);
    let input = MemorySource::new(1);
    let flow = Dataflow::new("slow");
    flow.source(input.clone())
        .map(|x: u32| {
            std::thread::sleep(DELAY);
            x
        })
        .sink(MemorySink::new());
    let query = flow
        .start(config("slow").progress_interval(Duration::from_millis(200)))
        .unwrap();
    // One record at a time, so no record waits behind another.
    for x in 0..10 {
        input.push(0, x).unwrap();
        std::thread::sleep(DELAY * 2);
    }
    input.end();
    query.await_termination(Some(TIMEOUT)).unwrap();
    let progress = query.recent_progress();
    let reported: u64 = progress.iter().map(|p| p.num_input_rows).sum();
    assert_eq!(reported, 10, "every row is counted in exactly one report");
    let latency = query.metrics().latency.processing;
    let delay_ms = DELAY.as_secs_f64() * 1000.0;
    assert_eq!(latency.count, 10);
    assert!(
        latency.p50 >= delay_ms,
        "p50 {} ms below the map's {delay_ms} ms",
        latency.p50
    );
    let with_rows = progress.iter().find(|p| p.num_input_rows > 0).unwrap();
    assert!(
        with_rows.latencies.processing_latency_ms.p50 >= delay_ms,
        "{}",
        with_rows.pretty_json()
    );
}

/// The progress report of the checkpoint `epoch`.
fn report_of(query: &StreamingQuery, epoch: u64) -> StreamingQueryProgress {
    query
        .recent_progress()
        .into_iter()
        .rfind(|p| p.batch_id == epoch)
        .unwrap_or_else(|| panic!("no progress report for epoch {epoch}"))
}

#[test]
fn progress_reports_the_keyed_state_of_each_stateful_operator() {
    let input = MemorySource::new(1);
    let counts = MemorySink::new();
    let flow = Dataflow::new("state");
    flow.source(input.clone())
        .key_by(|x: &u32| x % 100)
        .count()
        .name("counts")
        .parallelism(2)
        .sink(counts.clone());
    let address = free_address();
    let query = flow
        .start(config("state").metrics_address(address))
        .unwrap();
    assert!(query
        .last_progress()
        .is_none_or(|p| p.state_operators.is_empty()));

    input.push_all(0, 0..1000u32).unwrap();
    wait_for_rows(&counts, 1000);
    let first = query.checkpoint_now(TIMEOUT).unwrap();
    let report = report_of(&query, first);
    let [state] = report.state_operators.as_slice() else {
        panic!("one stateful operator: {}", report.pretty_json());
    };
    assert_eq!(state.operator_name, "counts");
    assert_eq!((state.num_rows_total, state.num_rows_updated), (100, 100));
    assert!(
        state.memory_used_bytes >= 100 * 16,
        "{}",
        report.pretty_json()
    );
    assert_eq!(state.num_rows_dropped_by_watermark, 0);
    let scraped = scrape(address);
    let labels = [("query", "state"), ("operator", "counts")];
    assert_eq!(value(&scraped, "rtflow_state_rows", &labels), Some(100.0));
    assert_eq!(
        value(&scraped, "rtflow_state_memory_bytes", &labels),
        Some(state.memory_used_bytes as f64)
    );

    // Only the keys touched since the last checkpoint count as updated.
    input.push_all(0, 0..10u32).unwrap();
    wait_for_rows(&counts, 1010);
    let second = query.checkpoint_now(TIMEOUT).unwrap();
    let state = &report_of(&query, second).state_operators[0];
    assert_eq!((state.num_rows_total, state.num_rows_updated), (100, 10));
    query.stop().unwrap();
    // Records read together share their timestamps and are counted as a run.
    assert_eq!(query.metrics().latency.processing.count, 1010);
}

/// Passes on each record's source time.
struct SourceTime;

impl Operator<u64, u64> for SourceTime {
    fn process(&mut self, record: Record<u64>, out: &mut Collector<'_, u64>) -> Result<()> {
        out.emit(record.meta.source_time)
    }
}

#[test]
fn a_paced_generators_rows_carry_the_time_they_were_due() {
    const RATE: u64 = 4_000;
    let times = MemorySink::new();
    let flow = Dataflow::new("paced");
    flow.source(
        GeneratorSource::new(|_, offset| offset)
            .rows_per_second(RATE)
            .total_rows(400),
    )
    .transform("source-time", |_| SourceTime)
    .sink(times.clone());
    let query = common::run_to_end(flow, config("paced").allowlist_check(false));
    // However the reader's sleeps fell, row i was due (i + 1) / RATE seconds
    // after it started.
    let times = times.rows();
    assert_eq!(times.len(), 400);
    let step = 1_000_000_000 / RATE;
    for (i, pair) in times.windows(2).enumerate() {
        assert!(
            pair[1].abs_diff(pair[0]).abs_diff(step) <= 1,
            "rows {i} and {} are {} ns apart, not {step}",
            i + 1,
            pair[1] - pair[0]
        );
    }
    let queuing = query.metrics().latency.source_queuing;
    assert_eq!(queuing.count, 400);
}

#[test]
fn progress_json_round_trips_with_spark_field_names() {
    let input = MemorySource::new(1);
    input.push_all(0, 0..5u32).unwrap();
    input.end();
    let flow = Dataflow::new("json");
    flow.source(input).sink(MemorySink::new());
    let query = common::run_to_end(flow, config("json"));
    let progress = query.last_progress().expect("a final report");
    let json = progress.json();
    for field in [
        "\"id\"",
        "\"runId\"",
        "\"batchId\"",
        "\"numInputRows\"",
        "\"inputRowsPerSecond\"",
        "\"processedRowsPerSecond\"",
        "\"durationMs\"",
        "\"eventTime\"",
        "\"stateOperators\"",
        "\"sources\"",
        "\"sink\"",
        "\"processingLatencyMs\"",
        "\"sourceQueuingLatencyMs\"",
        "\"e2eLatencyMs\"",
        "\"P99\"",
    ] {
        assert!(json.contains(field), "{field} missing from {json}");
    }
    assert_eq!(StreamingQueryProgress::from_json(&json).unwrap(), progress);
    assert_eq!(progress.id, query.id().to_string());
    assert_eq!(progress.sources[0].description, "memory");
    let status = query.status();
    assert_eq!(status.message, "Stopped");
    assert!(!status.is_trigger_active);
}

/// Records the events a listener receives, in order.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl StreamingQueryListener for Recorder {
    fn on_query_started(&self, event: &QueryStartedEvent) {
        self.0
            .lock()
            .unwrap()
            .push(format!("started {}", event.name));
    }

    fn on_query_progress(&self, progress: &StreamingQueryProgress) {
        self.0
            .lock()
            .unwrap()
            .push(format!("progress {}", progress.num_input_rows));
    }

    fn on_query_terminated(&self, event: &QueryTerminatedEvent) {
        self.0
            .lock()
            .unwrap()
            .push(format!("terminated {:?}", event.error_class));
    }
}

#[test]
fn listener_sees_started_progress_and_terminated_in_order() {
    let recorder = Arc::new(Recorder::default());
    let input = MemorySource::new(1);
    let flow = Dataflow::new("listened");
    flow.source(input.clone())
        .map(|x: u32| {
            assert!(x < 3, "too big");
            x
        })
        .sink(MemorySink::new());
    let query = flow
        .start(
            config("listened")
                .listener(recorder.clone())
                .progress_interval(Duration::from_millis(50)),
        )
        .unwrap();
    input.push_all(0, 0..3).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    input.push(0, 3).unwrap();
    assert!(query.await_termination(Some(TIMEOUT)).is_err());

    let events = recorder.0.lock().unwrap();
    assert_eq!(events.first().map(String::as_str), Some("started listened"));
    assert_eq!(
        events.last().map(String::as_str),
        Some("terminated Some(\"OPERATOR_FAILED\")")
    );
    let progress: Vec<&String> = events[1..events.len() - 1].iter().collect();
    assert!(progress.len() >= 2, "{events:?}");
    assert!(
        progress.iter().all(|e| e.starts_with("progress ")),
        "{events:?}"
    );
}

/// GET /metrics: the body as served.
fn scrape_text(address: SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.contains(" 200 "), "{head}");
    body.to_owned()
}

#[test]
fn metrics_pass_promtool_check_metrics() {
    let Some(promtool) = common::tool("RTFLOW_PROMTOOL", "promtool") else {
        return;
    };
    // Every family the endpoint serves but consumer lag (tests/monitoring.rs
    // lints a Kafka query's): operator counters, mailboxes (a shuffle), keyed
    // state, a watermark, checkpoints and the latencies.
    let address = free_address();
    let input = MemorySource::new(2);
    let counts = MemorySink::new();
    let flow = Dataflow::new("linted");
    flow.source(input.clone())
        .name("numbers")
        .with_watermark(|x: &u64| *x as i64, Duration::from_millis(10))
        .key_by(|x: &u64| x % 10)
        .count()
        .name("counts")
        .parallelism(2)
        .sink(counts.clone());
    let query = flow
        .start(config("linted").metrics_address(address))
        .unwrap();
    input.push_all(0, 0..500u64).unwrap();
    input.push_all(1, 0..500u64).unwrap();
    wait_for_rows(&counts, 1000);
    query.checkpoint_now(TIMEOUT).unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    let text = loop {
        let text = scrape_text(address);
        let served = |name: &str| text.contains(&format!("\n# TYPE {name} "));
        let expected = [
            "rtflow_records_out_total",
            "rtflow_mailbox_depth",
            "rtflow_state_rows",
            "rtflow_watermark_seconds",
            "rtflow_checkpoint_epoch",
            "rtflow_checkpoint_age_seconds",
            "rtflow_checkpoint_failures_total",
            "rtflow_batch_duration_seconds",
            "rtflow_processing_latency_seconds",
        ];
        if expected.iter().all(|name| served(name)) {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not every family of {expected:?} is served:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    query.stop().unwrap();

    let file = std::env::temp_dir().join(format!("rtflow-metrics-{}.prom", std::process::id()));
    std::fs::write(&file, &text).unwrap();
    let output = std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", promtool.display()));
    std::fs::remove_file(&file).unwrap();
    assert!(
        output.status.success(),
        "promtool check metrics: {}\n{}{}\n--- the scraped /metrics:\n{text}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}
