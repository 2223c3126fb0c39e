//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod kafka;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rtflow::operators::Windowing;
use rtflow::prelude::*;

/// Long enough for any test query on a loaded 2-core machine.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// A valid configuration with a checkpoint directory of its own: a location
/// holds one running query at a time. A directory of the same name left by
/// an earlier test process that had the same process id is removed: its
/// checkpoints would be restored.
pub fn config(name: &str) -> QueryConfig {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir()
        .join("rtflow-tests")
        .join(std::process::id().to_string())
        .join(format!("{name}-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    QueryConfig::new(name).checkpoint_location(dir)
}

/// [`config`] with epochs ending every 100 ms.
pub fn checkpointed(name: &str) -> QueryConfig {
    config(name)
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
        .progress_interval(Duration::from_secs(60))
}

/// Words in, running count per word out, `parallelism` count instances.
pub fn word_count(
    input: &MemorySource<String>,
    config: QueryConfig,
    parallelism: usize,
) -> (StreamingQuery, MemorySink<(String, u64)>) {
    let flow = Dataflow::new("words");
    let out = MemorySink::new();
    flow.source(input.clone())
        .key_by(|word: &String| word.clone())
        .count()
        .parallelism(parallelism)
        .sink(out.clone());
    (flow.start(config).unwrap(), out)
}

/// The binary `name` (of the Debian package prometheus) that scripts/test.sh
/// found or installed, from the environment variable `var`, or `None` (test
/// skipped) outside CI without one. In CI, where scripts/test.sh installs it,
/// a missing one fails the test.
pub fn tool(var: &str, name: &str) -> Option<std::path::PathBuf> {
    match std::env::var_os(var) {
        Some(path) => Some(path.into()),
        None if std::env::var_os("CI").is_some() => {
            panic!("{var} is not set: run the tests with scripts/test.sh")
        }
        None => {
            eprintln!(
                "skipped: no {name}; run scripts/test.sh (it installs the Debian package \
                 prometheus) or set {var}"
            );
            None
        }
    }
}

/// Writes a 100-byte and then a 3 MB record through a `KafkaSink` of
/// `delivery` to a fresh topic of the broker at `bootstrap`, whose default
/// `message.max.bytes` (1 MB) refuses the second, and checks that the query
/// fails with `SINK_FAILED` naming the refusal.
pub fn a_record_too_large_fails(bootstrap: &str, config: QueryConfig, delivery: DeliveryGuarantee) {
    let output = kafka::topic(bootstrap, "rtflow-large", 1);
    let error = writing_fails(bootstrap, &output, 3_000_000, config, delivery);
    assert!(
        error.to_string().to_lowercase().contains("too large"),
        "{error}"
    );
}

/// A record the client sends but the broker refuses (the topic takes at most
/// 1,000 bytes a batch) fails the query with its delivery report's error: the
/// producers ask for reports of failures only, so this is the one path a
/// failure takes.
pub fn a_record_the_broker_refuses_fails(
    bootstrap: &str,
    config: QueryConfig,
    delivery: DeliveryGuarantee,
) {
    let output = kafka::topic_with(
        bootstrap,
        "rtflow-refused",
        1,
        &[("max.message.bytes", "1000")],
    );
    let message = writing_fails(bootstrap, &output, 5_000, config, delivery).to_string();
    assert!(
        message.contains(&format!("delivery to {output}-0 failed")),
        "{message}"
    );
    assert!(message.to_lowercase().contains("too large"), "{message}");
}

/// Writes a 100-byte record and then one of `size` bytes to `output`, and
/// returns the `SINK_FAILED` error the query ends with.
fn writing_fails(
    bootstrap: &str,
    output: &str,
    size: usize,
    config: QueryConfig,
    delivery: DeliveryGuarantee,
) -> RtflowError {
    let flow = Dataflow::new("refused");
    let input = MemorySource::new(1);
    flow.source(input.clone()).sink(
        KafkaSink::new(bootstrap, output, |size: &usize| {
            KafkaMessage::new(vec![b'x'; *size])
        })
        .delivery(delivery),
    );
    let query = flow.start(config).unwrap();
    input.push(0, 100).unwrap();
    input.push(0, size).unwrap();
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED");
    error
}

/// Runs a dataflow whose sources end, and waits until it has drained.
pub fn run_to_end(flow: Dataflow, config: QueryConfig) -> StreamingQuery {
    let query = flow.start(config).expect("query starts");
    assert_eq!(
        query.await_termination(Some(TIMEOUT)),
        Ok(true),
        "query finishes within {TIMEOUT:?}"
    );
    query
}

/// The sorted rows of a sink.
pub fn sorted<T: Ord + Clone + Send + 'static>(sink: &MemorySink<T>) -> Vec<T> {
    let mut rows = sink.rows();
    rows.sort();
    rows
}

/// Waits until `sink` holds at least `n` rows, returning them.
pub fn wait_for_rows<T: Clone + Send + 'static>(sink: &MemorySink<T>, n: usize) -> Vec<T> {
    let deadline = Instant::now() + TIMEOUT;
    while sink.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} rows", sink.len());
        std::thread::sleep(Duration::from_millis(5));
    }
    sink.rows()
}

/// The windows of a test case, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub enum Spec {
    /// Tumbling when the slide is the size.
    Sliding {
        size: i64,
        slide: i64,
    },
    Session {
        gap: i64,
    },
}

impl Spec {
    pub fn windowing(self) -> Windowing {
        let ms = |ms: i64| Duration::from_millis(ms as u64);
        match self {
            Spec::Sliding { size, slide } if size == slide => Window::tumbling(ms(size)),
            Spec::Sliding { size, slide } => Window::sliding(ms(size), ms(slide)),
            Spec::Session { gap } => Window::session(ms(gap)),
        }
    }
}

/// Copies the files and directories under `from` into `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.metadata().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}
