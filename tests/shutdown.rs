//! The graceful stop, as systemd and Kubernetes ask for it: the examples run
//! as processes of their own (built here by cargo, with this test's features
//! and profile), are sent SIGTERM or SIGINT, and must stop with a final
//! checkpoint and exit 0; started again they resume from that checkpoint,
//! every record once. Of two clustered processes, the one stopped leaves its
//! groups, and the survivor owns every partition within 2 s of its exit. A
//! second signal during a stop, or a stop longer than the grace period, ends
//! the process at once with a non-zero status and says so. The event-time
//! example writes window counts and serves a watermark.
//!
//! Every test but the quickstart's needs the test broker
//! (`RTFLOW_KAFKA_BOOTSTRAP`).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::kafka::{bootstrap, consume, produce, topic};
use common::{config, wait_for_rows, TIMEOUT};
use rtflow::prelude::*;

/// The examples these tests run.
const EXAMPLES: [&str; 4] = [
    "quickstart",
    "kafka_to_kafka",
    "cluster_count",
    "kafka_windows",
];

/// Long enough for an example's start or stop on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(120);

/// A SIGTERM during a clustered process's stop: survivors own its
/// partitions within this of its exit (issue #51).
const TAKEOVER: Duration = Duration::from_secs(2);

/// The path of example `name`'s binary, all of [`EXAMPLES`] built once per
/// test process with this test's features and profile, so that a
/// `cargo test --all-features` reuses what it built.
fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<BTreeMap<String, PathBuf>> = OnceLock::new();
    BUILT.get_or_init(build_examples)[name].clone()
}

fn build_examples() -> BTreeMap<String, PathBuf> {
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--message-format=json-render-diagnostics"]);
    for name in EXAMPLES {
        cargo.args(["--example", name]);
    }
    let features: Vec<&str> = [
        ("failpoints", cfg!(feature = "failpoints")),
        ("testing", cfg!(feature = "testing")),
    ]
    .into_iter()
    .filter_map(|(feature, on)| on.then_some(feature))
    .collect();
    if !features.is_empty() {
        cargo.args(["--features", &features.join(",")]);
    }
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    let output = cargo.stderr(Stdio::inherit()).output().expect("cargo runs");
    assert!(output.status.success(), "the examples did not build");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| {
            message["reason"] == "compiler-artifact"
                && message["target"]["kind"]
                    .as_array()
                    .is_some_and(|kinds| kinds.iter().any(|kind| kind == "example"))
        })
        .filter_map(|message| {
            let name = message["target"]["name"].as_str()?.to_owned();
            Some((name, PathBuf::from(message["executable"].as_str()?)))
        })
        .collect()
}

/// A directory of the test's own, emptied.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("rtflow-tests")
        .join(std::process::id().to_string())
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running example: its stdout lines with the time each arrived, and its
/// stderr in a file.
struct Example {
    name: String,
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    stderr: PathBuf,
}

impl Example {
    fn start(name: &str, dir: &std::path::Path, label: &str, args: &[&str]) -> Self {
        let stderr = dir.join(format!("{label}.stderr"));
        let mut child = Command::new(example(name))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("the example starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                kept.lock().unwrap().push((Instant::now(), line));
            }
        });
        Self {
            name: label.to_owned(),
            child,
            lines,
            stderr,
        }
    }

    /// The first stdout line that `matches`, and when it arrived; fails
    /// after `timeout`.
    fn line(&self, timeout: Duration, matches: impl Fn(&str) -> bool) -> (Instant, String) {
        let deadline = Instant::now() + timeout;
        loop {
            let found = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, line)| matches(line))
                .cloned();
            if let Some(found) = found {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no such line:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stdout(&self) -> String {
        let lines = self.lines.lock().unwrap();
        lines.iter().map(|(_, line)| format!("{line}\n")).collect()
    }

    /// Stderr, each status line the example redraws on a line of its own.
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr)
            .unwrap_or_default()
            .replace('\r', "\n")
    }

    fn output(&self) -> String {
        format!(
            "--- {} stdout\n{}--- {} stderr\n{}",
            self.name,
            self.stdout(),
            self.name,
            self.stderr()
        )
    }

    /// Waits until stderr says `text`.
    fn await_stderr(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.stderr().contains(text) {
            assert!(
                Instant::now() < deadline,
                "stderr never said '{text}':\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "could not send {signal} to {}", self.name);
    }

    /// Waits until the process exits; how, and when. Kills it after
    /// `timeout`.
    fn exit(&mut self, timeout: Duration) -> (ExitStatus, Instant) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let exited = Instant::now();
                // Its last stdout lines, read to the end.
                std::thread::sleep(Duration::from_millis(100));
                return (status, exited);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("{} did not exit:\n{}", self.name, self.output());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends SIGTERM and checks that the process stops gracefully: exit 0,
    /// having said so; when it exited.
    fn terminate(&mut self) -> Instant {
        self.signal("TERM");
        let (status, exited) = self.exit(PATIENCE);
        assert!(status.success(), "{status}:\n{}", self.output());
        assert!(
            self.stderr().contains("SIGTERM received: stopping"),
            "{}",
            self.output()
        );
        exited
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The values of one-partition `topic` once it holds `n` records, or after
/// `timeout`.
fn values(bootstrap: &str, topic: &str, n: usize, timeout: Duration) -> Vec<String> {
    consume(bootstrap, topic, 1, n, timeout)
        .into_iter()
        .map(|record| String::from_utf8(record.value).unwrap())
        .collect()
}

/// How many times each value occurs.
fn tally(values: &[String]) -> BTreeMap<&str, usize> {
    let mut tally = BTreeMap::new();
    for value in values {
        *tally.entry(value.as_str()).or_default() += 1;
    }
    tally
}

fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// GET /metrics: the body as served, or "" while nothing answers.
fn scrape(address: SocketAddr) -> String {
    let Ok(mut stream) = TcpStream::connect(address) else {
        return String::new();
    };
    let mut response = String::new();
    let _ = write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n");
    let _ = stream.read_to_string(&mut response);
    response
}

/// What `kafka_to_kafka` writes for event `i`.
fn uppercased(i: usize) -> String {
    format!("EVENT {i}")
}

fn events(range: std::ops::Range<usize>) -> impl Iterator<Item = (i32, String, Vec<u8>)> {
    range.map(|i| {
        (
            (i % 2) as i32,
            format!("k{}", i % 10),
            format!("event {i}").into(),
        )
    })
}

/// What a signal sends: a stop request ends a query, and every flow of a
/// pipeline, with a final checkpoint long before their 5-minute interval,
/// and their waits return.
#[test]
fn a_stop_request_stops_a_query_and_a_pipeline_with_a_final_checkpoint() {
    let input = MemorySource::new(1);
    let output = MemorySink::new();
    let flow = Dataflow::new("requested");
    flow.source(input.clone()).sink(output.clone());
    let query = flow.start(config("requested")).unwrap();
    input.push_all(0, [1u32, 2, 3]).unwrap();
    wait_for_rows(&output, 3);
    query.stop_request().send();
    assert_eq!(query.await_termination(Some(TIMEOUT)), Ok(true));
    assert!(query.metrics().checkpoint.is_some(), "no final checkpoint");

    let mut pipeline = Pipeline::new("requested").checkpoint_root(scratch("pipeline"));
    let sink = pipeline.create_sink("out", MemorySink::<u32>::new());
    for name in ["a", "b"] {
        let source = MemorySource::<u32>::new(1);
        pipeline.update_flow(
            name,
            &sink,
            |config| config,
            move |flow: &Dataflow| flow.source(source),
        );
    }
    let running = pipeline.start().unwrap();
    running.stop_request().send();
    assert_eq!(running.await_termination(Some(TIMEOUT)), Ok(true));
    for (flow, query) in running.flows() {
        assert!(
            query.metrics().checkpoint.is_some(),
            "{flow}: no final checkpoint"
        );
    }
}

/// The quickstart needs no broker: SIGINT (Ctrl-C) stops it as SIGTERM does,
/// and it prints its summary.
#[test]
fn ctrl_c_stops_the_quickstart_gracefully_with_its_summary() {
    let dir = scratch("quickstart");
    let location = dir.join("checkpoints").display().to_string();
    let mut quickstart = Example::start(
        "quickstart",
        &dir,
        "quickstart",
        &["--seconds", "600", "--checkpoint-location", &location],
    );
    quickstart.line(PATIENCE, |line| line.contains(" bought for "));
    quickstart.signal("INT");
    let (status, _) = quickstart.exit(PATIENCE);
    assert!(status.success(), "{status}:\n{}", quickstart.output());
    assert!(
        quickstart.stderr().contains("SIGINT received: stopping"),
        "{}",
        quickstart.output()
    );
    quickstart.line(Duration::ZERO, |line| line.starts_with("records read: "));
}

/// SIGTERM stops `kafka_to_kafka` with a final checkpoint: its 30 s
/// checkpoint interval never came, yet the restart reads only what was
/// written since, and the output holds every record once.
#[test]
fn sigterm_makes_a_final_checkpoint_that_a_restart_resumes_from_exactly_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let dir = scratch("kafka-to-kafka");
    let input = topic(&bootstrap, "shutdown-in", 2);
    let output = topic(&bootstrap, "shutdown-out", 1);
    let location = dir.join("checkpoints").display().to_string();
    let args = [
        "--bootstrap",
        &bootstrap,
        "--input",
        &input,
        "--output",
        &output,
        "--from-beginning",
        "--seconds",
        "600",
        "--checkpoint-location",
        &location,
    ];
    let half = 500;
    produce(&bootstrap, &input, events(0..half));
    let mut first = Example::start("kafka_to_kafka", &dir, "first", &args);
    let written = values(&bootstrap, &output, half, PATIENCE);
    assert_eq!(written.len(), half, "{}", first.output());
    first.terminate();
    first.line(Duration::ZERO, |line| {
        line.starts_with(&format!("records read: {half} "))
    });

    produce(&bootstrap, &input, events(half..2 * half));
    let mut second = Example::start("kafka_to_kafka", &dir, "second", &args);
    let written = values(&bootstrap, &output, 2 * half, PATIENCE);
    assert_eq!(written.len(), 2 * half, "{}", second.output());
    second.terminate();
    // Read past the end: a record written twice shows.
    let written = values(&bootstrap, &output, 2 * half + 20, Duration::from_secs(3));
    let expected: Vec<String> = (0..2 * half).map(uppercased).collect();
    assert_eq!(tally(&written), tally(&expected), "every record once");
    second.line(Duration::ZERO, |line| {
        line.starts_with(&format!("records read: {half} "))
    });
}

/// Two `cluster_count` processes share a count per user. SIGTERM stops one:
/// it commits, leaves its groups although it is a static member, and exits
/// 0; the survivor owns every partition within 2 s of that exit and counts
/// on, each count once.
#[test]
fn a_clustered_process_stopped_by_sigterm_leaves_and_the_survivor_owns_its_partitions() {
    let Some(bootstrap) = bootstrap() else { return };
    let dir = scratch("cluster-count");
    let input = topic(&bootstrap, "shutdown-clicks", 6);
    let output = topic(&bootstrap, "shutdown-counts", 1);
    let query = format!("{input}-q");
    let start = |instance: &str| {
        let location = dir.join(instance).display().to_string();
        let args = [
            "--bootstrap",
            &bootstrap,
            "--instance",
            instance,
            "--query",
            &query,
            "--input",
            &input,
            "--output",
            &output,
            "--checkpoint-location",
            &location,
        ];
        Example::start("cluster_count", &dir, instance, &args)
    };
    let clicks = |range: std::ops::Range<usize>| {
        range.map(|i| ((i % 6) as i32, format!("user-{}", i % 10), Vec::new()))
    };
    let half = 300;
    produce(&bootstrap, &input, clicks(0..half));
    let mut a = start("a");
    let mut b = start("b");
    let counted = values(&bootstrap, &output, half, PATIENCE);
    assert_eq!(counted.len(), half, "{}\n{}", a.output(), b.output());

    let exited = b.terminate();
    b.line(Duration::ZERO, |line| line.starts_with("b left query"));
    // Six input and six repartition partitions.
    let (owned_at, _) = a.line(PATIENCE, |line| {
        line.starts_with("a runs [") && line.matches(", ").count() == 11
    });
    let after_exit = owned_at.saturating_duration_since(exited);
    assert!(
        after_exit <= TAKEOVER,
        "the survivor owned every partition {after_exit:?} after the exit:\n{}\n{}",
        a.output(),
        b.output()
    );

    produce(&bootstrap, &input, clicks(half..2 * half));
    let counted = values(&bootstrap, &output, 2 * half, PATIENCE);
    assert_eq!(counted.len(), 2 * half, "{}", a.output());
    a.terminate();
    let counted = values(&bootstrap, &output, 2 * half + 20, Duration::from_secs(3));
    let expected: Vec<String> = (0..10)
        .flat_map(|user| (1..=2 * half / 10).map(move |n| format!("user-{user}:{n}")))
        .collect();
    assert_eq!(tally(&counted), tally(&expected), "every count once");
}

/// Starts a lone `cluster_count` that owns its partitions.
fn lone_cluster_count(name: &str, extra: &[&str]) -> Option<Example> {
    let bootstrap = bootstrap()?;
    let dir = scratch(name);
    let input = topic(&bootstrap, name, 2);
    let output = format!("{input}-out");
    let query = format!("{input}-q");
    let mut args = vec![
        "--bootstrap",
        &bootstrap,
        "--instance",
        "only",
        "--query",
        &query,
        "--input",
        &input,
        "--output",
        &output,
        "--partitions",
        "2",
    ];
    args.extend_from_slice(extra);
    let process = Example::start("cluster_count", &dir, "only", &args);
    process.line(PATIENCE, |line| line.starts_with("only runs [\""));
    Some(process)
}

/// A second SIGTERM while the first one's stop runs ends the process at
/// once, with 128 + 15 and a message.
#[test]
fn a_second_sigterm_during_the_stop_exits_at_once_with_143() {
    let Some(mut process) = lone_cluster_count("shutdown-twice", &[]) else {
        return;
    };
    process.signal("TERM");
    process.await_stderr("SIGTERM received: stopping", PATIENCE);
    process.signal("TERM");
    let second = Instant::now();
    let (status, exited) = process.exit(PATIENCE);
    assert_eq!(status.code(), Some(143), "{}", process.output());
    assert!(
        exited - second < Duration::from_secs(5),
        "exited {:?} after the second signal",
        exited - second
    );
    assert!(
        process.stderr().contains("second signal (SIGTERM)"),
        "{}",
        process.output()
    );
    assert!(
        !process.stdout().contains("left query"),
        "{}",
        process.output()
    );
}

/// A stop that outlasts `--grace-period` ends the process with status 1 and
/// a message.
#[test]
fn a_stop_longer_than_the_grace_period_exits_with_1() {
    let Some(mut process) = lone_cluster_count("shutdown-grace", &["--grace-period", "0"]) else {
        return;
    };
    process.signal("TERM");
    let (status, _) = process.exit(PATIENCE);
    assert_eq!(status.code(), Some(1), "{}", process.output());
    assert!(
        process.stderr().contains("longer than its grace period"),
        "{}",
        process.output()
    );
}

/// `kafka_windows` counts each user's views per tumbling window of event
/// time, serves its watermark on `/metrics`, and stops on SIGTERM.
#[test]
fn kafka_windows_counts_views_per_event_time_window() {
    let Some(bootstrap) = bootstrap() else { return };
    let dir = scratch("kafka-windows");
    let input = topic(&bootstrap, "shutdown-views", 2);
    let output = topic(&bootstrap, "shutdown-windows", 1);
    let location = dir.join("checkpoints").display().to_string();
    let metrics = free_address();
    let address = metrics.to_string();
    let args = [
        "--bootstrap",
        &bootstrap,
        "--input",
        &input,
        "--output",
        &output,
        "--produce",
        "200",
        "--window",
        "1",
        "--delay",
        "0",
        "--seconds",
        "600",
        "--checkpoint-location",
        &location,
        "--metrics-address",
        &address,
    ];
    let mut windows = Example::start("kafka_windows", &dir, "windows", &args);
    // Three seconds of views: two windows closed.
    let counts = values(&bootstrap, &output, 600, PATIENCE);
    assert_eq!(counts.len(), 600, "{}", windows.output());
    let deadline = Instant::now() + PATIENCE;
    let watermark = loop {
        let scraped = scrape(metrics);
        let watermark = scraped
            .lines()
            .find(|line| line.starts_with("rtflow_watermark_seconds{"))
            .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok());
        if let Some(watermark) = watermark.filter(|w| *w > 0.0) {
            break watermark;
        }
        assert!(Instant::now() < deadline, "no watermark:\n{scraped}");
        std::thread::sleep(Duration::from_millis(100));
    };
    windows.terminate();
    windows.line(Duration::ZERO, |line| line.starts_with("watermark: 1"));

    // `user start..end count`, each count one more than the key's last.
    let mut last: BTreeMap<(String, i64), u64> = BTreeMap::new();
    for value in &counts {
        let parsed = (|| {
            let (user, rest) = value.split_once(' ')?;
            let (span, count) = rest.split_once(' ')?;
            let (start, end) = span.split_once("..")?;
            let (start, end): (i64, i64) = (start.parse().ok()?, end.parse().ok()?);
            Some((user.to_owned(), start, end, count.parse::<u64>().ok()?))
        })();
        let (user, start, end, count) = parsed.unwrap_or_else(|| panic!("malformed: {value}"));
        assert_eq!((start % 1000, end - start), (0, 1000), "{value}");
        let previous = last.insert((user, start), count).unwrap_or(0);
        assert_eq!(count, previous + 1, "{value}");
    }
    let closed = last
        .keys()
        .filter(|(_, start)| ((start + 1000) as f64) <= watermark * 1000.0)
        .count();
    assert!(closed > 0, "no window behind the watermark {watermark}");
}

/// The systemd unit and the Kubernetes StatefulSet under deploy/ run
/// `cluster_count` with flags it takes, serve `/metrics` on the port that
/// deploy/prometheus/prometheus.yml scrapes for clustered processes, keep a
/// checkpoint location, and give the stop longer than the process's grace
/// period, so that the process ends by itself.
#[test]
fn the_deployment_recipes_match_cluster_count_and_the_prometheus_config() {
    let help = Command::new(example("cluster_count"))
        .arg("--help")
        .output()
        .expect("cluster_count runs");
    let help = String::from_utf8_lossy(&help.stdout);
    let deploy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let read = |path: &str| std::fs::read_to_string(deploy.join(path)).unwrap();
    let prometheus = read("prometheus/prometheus.yml");
    let (_, cluster_job) = prometheus
        .split_once("job_name: rtflow-cluster")
        .expect("prometheus.yml scrapes the job rtflow-cluster");
    let scraped: Vec<&str> = cluster_job
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- \""))
        .collect();
    assert!(!scraped.is_empty(), "no targets in {cluster_job}");
    assert!(
        scraped.iter().all(|target| target.ends_with(":9898\"")),
        "{scraped:?}"
    );

    for (recipe, stop_bound) in [
        ("systemd/rtflow-clicks@.service", "TimeoutStopSec="),
        (
            "kubernetes/statefulset.yaml",
            "terminationGracePeriodSeconds: ",
        ),
    ] {
        let text = read(recipe);
        // What the recipe runs, without its comments.
        let words: Vec<&str> = text
            .lines()
            .filter(|line| !line.trim_start().starts_with('#'))
            .flat_map(str::split_whitespace)
            .map(|word| word.trim_matches(|c| matches!(c, '"' | ',' | '.' | ')' | '(')))
            .filter(|word| !matches!(*word, "-" | "\\" | ""))
            .collect();
        let flags = words.iter().filter(|word| {
            word.strip_prefix("--")
                .is_some_and(|name| name.starts_with(|c: char| c.is_ascii_lowercase()))
        });
        for flag in flags {
            assert!(
                help.contains(&format!("{flag} ")),
                "{recipe}: cluster_count takes no {flag}"
            );
        }
        let after = |flag: &str| {
            let at = words.iter().position(|word| *word == flag);
            at.and_then(|at| words.get(at + 1).copied())
                .unwrap_or_else(|| panic!("{recipe} passes no {flag}"))
        };
        assert_eq!(after("--metrics-address"), "0.0.0.0:9898", "{recipe}");
        assert!(
            after("--checkpoint-location").starts_with("/var/lib/rtflow/"),
            "{recipe}"
        );
        let grace: u64 = after("--grace-period").parse().unwrap();
        let bound: u64 = text
            .lines()
            .find_map(|line| line.trim().strip_prefix(stop_bound))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or_else(|| panic!("{recipe} sets no {stop_bound}"));
        assert!(
            grace < bound,
            "{recipe}: a grace period of {grace} s is not within {stop_bound}{bound}"
        );
    }
    let unit = read("systemd/rtflow-clicks@.service");
    assert!(unit.contains("\nKillSignal=SIGTERM\n"), "{unit}");
}
