//! Monitoring as deployed: a real Prometheus server (the Debian package's
//! binary, on loopback) scrapes a quickstart-like query, a Kafka query and a
//! process of a clustered query every second, with the rules of
//! deploy/prometheus/alerts.yml. Every expression of the Grafana dashboard
//! deploy/grafana/rtflow.json must return data and every rule must evaluate;
//! the consumer lag must rise while the Kafka query is held and fall to zero
//! once it caught up; the growing-lag and query-down alerts must fire. The
//! rules' own promtool unit tests run here too.

mod common;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::kafka::{bootstrap, topic};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
use rdkafka::ClientConfig;
use rtflow::prelude::*;
use serde_json::Value;

/// How long Prometheus gets to show what the test waits for: a few scrapes
/// and rule evaluations (1 s apart), on a loaded 2-core machine.
const WITHIN: Duration = Duration::from_secs(60);

/// What the dashboard's `$__rate_interval` stands for: Grafana takes at least
/// four scrape intervals; ten 1 s scrapes leave room for a late one.
const RATE_INTERVAL: &str = "10s";

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Runs `promtool` with `args`; panics with its output unless it succeeds.
fn promtool(promtool: &Path, args: &[&str]) {
    let output = Command::new(promtool)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", promtool.display()));
    assert!(
        output.status.success(),
        "promtool {args:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

#[test]
fn the_deployed_config_and_rules_pass_promtool_and_the_rules_their_unit_tests() {
    let Some(tool) = common::tool("RTFLOW_PROMTOOL", "promtool") else {
        return;
    };
    let config = deploy("prometheus/prometheus.yml");
    promtool(&tool, &["check", "config", config.to_str().unwrap()]);
    let tests = deploy("prometheus/alerts_test.yml");
    promtool(&tool, &["test", "rules", tests.to_str().unwrap()]);
}

/// A GET on `address`: the status code and the body.
fn get(address: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok());
    (status.expect("a status code"), body.to_owned())
}

/// `text` as a URL query value.
fn encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server run by the test, killed when dropped, whatever the
/// test's outcome.
struct Prometheus {
    child: Child,
    address: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts `binary` on `config` (a prometheus.yml that loads `rules` as
    /// alerts.yml), and waits until it is ready.
    fn start(binary: &Path, dir: &Path, config: &str, rules: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        std::fs::write(dir.join("alerts.yml"), rules).unwrap();
        let address = free_address();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(binary)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot run {}: {error}", binary.display()));
        let mut prometheus = Self {
            child,
            address,
            dir: dir.to_owned(),
        };
        let deadline = Instant::now() + WITHIN;
        loop {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!("prometheus exited ({status}):\n{}", prometheus.log());
            }
            let ready = TcpStream::connect(address)
                .is_ok()
                .then(|| get(address, "/-/ready").0);
            if ready == Some(200) {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready:\n{}",
                prometheus.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The `data` of an API answer; panics on an error.
    fn api(&self, path: &str) -> Value {
        let (status, body) = get(self.address, path);
        let answer: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: {status} {e}: {body}"));
        assert_eq!(answer["status"], "success", "GET {path}: {body}");
        answer["data"].clone()
    }

    /// The series `expr` returns now, each as its labels and value.
    fn query(&self, expr: &str) -> Vec<(Value, f64)> {
        let data = self.api(&format!("/api/v1/query?query={}", encoded(expr)));
        let result = data["result"].as_array().cloned().unwrap_or_default();
        result
            .into_iter()
            .map(|series| {
                let value = series["value"][1].as_str().unwrap_or("NaN");
                (series["metric"].clone(), value.parse().unwrap_or(f64::NAN))
            })
            .collect()
    }

    /// The alerts firing now, each as its labels.
    fn firing(&self) -> Vec<Value> {
        let alerts = self.api("/api/v1/alerts")["alerts"].clone();
        let alerts = alerts.as_array().cloned().unwrap_or_default();
        alerts
            .into_iter()
            .filter(|alert| alert["state"] == "firing")
            .map(|alert| alert["labels"].clone())
            .collect()
    }

    /// Waits until `check` returns `Some`, saying what it waited for.
    fn wait_for<T>(&self, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + WITHIN;
        loop {
            if let Some(done) = check() {
                return done;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {WITHIN:?}\n--- prometheus log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until the alert `name` fires for the query `query`.
    fn wait_for_alert(&self, name: &str, query: &str) {
        self.wait_for(&format!("{name} firing for {query}"), || {
            self.firing()
                .iter()
                .any(|labels| labels["alertname"] == name && labels["query"] == query)
                .then_some(())
        });
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The scrape configuration of deploy/prometheus/prometheus.yml (its job
/// names, which the alert rules use), aimed at the test's endpoints, every
/// second.
fn scrape_config(single: SocketAddr, cluster: SocketAddr) -> String {
    format!(
        "global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: rtflow
    static_configs: [{{ targets: [\"{single}\"] }}]
  - job_name: rtflow-cluster
    static_configs: [{{ targets: [\"{cluster}\"] }}]
"
    )
}

/// deploy/prometheus/alerts.yml, quickened so that alerts fire in seconds:
/// every `for:` becomes 2 s and every range (`[10m]`) 10 s, ten scrapes. The
/// thresholds stay as they are.
fn quick_rules() -> String {
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    let mut quick = String::new();
    for line in rules.lines() {
        if line.trim_start().starts_with("for:") {
            let indent = &line[..line.len() - line.trim_start().len()];
            quick.push_str(&format!("{indent}for: 2s\n"));
            continue;
        }
        let mut rest = line;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']').map(|c| open + c);
            let range = close.map(|close| &rest[open + 1..close]);
            match range.filter(|r| is_duration(r)) {
                Some(range) => {
                    quick.push_str(&rest[..open]);
                    quick.push_str("[10s]");
                    rest = &rest[open + range.len() + 2..];
                }
                None => {
                    quick.push_str(&rest[..=open]);
                    rest = &rest[open + 1..];
                }
            }
        }
        quick.push_str(rest);
        quick.push('\n');
    }
    quick
}

/// Whether `text` is a PromQL duration such as `5m`.
fn is_duration(text: &str) -> bool {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    !digits.is_empty() && digits.len() < text.len() && digits.chars().all(|c| c.is_ascii_digit())
}

/// Every PromQL expression of the dashboard's panels, with the dashboard's
/// variables filled in: `$query` as Grafana fills it for "All".
fn dashboard_exprs(queries: &[&str]) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy("grafana/rtflow.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    let mut panels: Vec<Value> = dashboard["panels"].as_array().unwrap().clone();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().cloned().unwrap_or_default());
        for target in panel["targets"].as_array().cloned().unwrap_or_default() {
            let expr = target["expr"].as_str().expect("a PromQL target");
            let filled = expr
                .replace("$__rate_interval", RATE_INTERVAL)
                .replace("$query", &queries.join("|"));
            assert!(!filled.contains('$'), "a variable left in {filled}");
            exprs.push((panel["title"].as_str().unwrap().to_owned(), filled));
        }
    }
    assert!(exprs.len() >= 20, "the dashboard's expressions: {exprs:?}");
    exprs
}

/// The parts of the quickstart (examples/quickstart.rs): generated clicks,
/// parsed, filtered to purchases and joined with a table of users.
fn quickstart(name: &str, metrics: SocketAddr) -> StreamingQuery {
    let users = StaticTable::from_rows("users", (0..50u32).map(|id| (id, format!("c{}", id % 5))));
    let flow = Dataflow::new(name);
    flow.source(
        GeneratorSource::new(|partition, offset| {
            let n = offset * 7 + partition as u64 * 13;
            format!("user-{},{}", n % 50, ["view", "purchase"][(n % 2) as usize])
        })
        .partitions(2)
        .rows_per_second(200),
    )
    .name("clicks")
    .flat_map(|line: String| {
        let (user, action) = line.split_once(',')?;
        Some((
            user.strip_prefix("user-")?.parse::<u32>().ok()?,
            action.to_owned(),
        ))
    })
    .filter(|(_, action)| action == "purchase")
    .broadcast_join(&users, |(user, _)| *user)
    .sink(ForeachSink::from_fn(|_| Ok(())));
    flow.start(quick(common::config(name)).metrics_address(metrics))
        .unwrap()
}

fn quick(config: QueryConfig) -> QueryConfig {
    config
        .trigger(Trigger::real_time("1 second"))
        .min_batch_duration(Duration::from_millis(100))
        .progress_interval(Duration::from_secs(1))
}

/// Clicks per user over a Kafka topic, with a watermark from the records'
/// timestamps; a map holds every record while `held` is set.
fn kafka_query(
    name: &str,
    bootstrap: &str,
    input: &str,
    held: &Arc<AtomicBool>,
    metrics: SocketAddr,
) -> StreamingQuery {
    let flow = Dataflow::new(name);
    let held = held.clone();
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .name("clicks")
    .with_watermark(
        |click: &KafkaRecord| click.timestamp.map_or(0, |(ms, _)| ms),
        Duration::from_secs(1),
    )
    .map(move |click: KafkaRecord| {
        while held.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        click.key_str().into_owned()
    })
    .key_by(|user: &String| user.clone())
    .count()
    .name("clicks-per-user")
    .sink(ForeachSink::from_fn(|_| Ok(())));
    flow.start(quick(common::config(name)).metrics_address(metrics))
        .unwrap()
}

/// One process of a clustered count per user.
fn clustered(
    name: &str,
    bootstrap: &str,
    input: &str,
    output: &str,
    metrics: SocketAddr,
) -> ClusteredQuery {
    let (b, i, o) = (bootstrap.to_owned(), input.to_owned(), output.to_owned());
    KafkaCluster::new(bootstrap)
        .instance("monitored")
        .repartition_partitions(2)
        .start(
            QueryConfig::new(name)
                .trigger(Trigger::real_time("1 second"))
                .min_batch_duration(Duration::from_millis(100))
                .metrics_address(metrics),
            move |flow| {
                flow.source(
                    KafkaSource::new(&b)
                        .subscribe([&i])
                        .starting_offsets(StartingOffsets::Earliest),
                )
                .map(|click: KafkaRecord| click.key_str().into_owned())
                .repartition_by(|user: &String| user.clone())
                .count()
                .sink(KafkaSink::new(&b, &o, |(user, clicks): &(String, u64)| {
                    KafkaMessage::new(format!("{user}:{clicks}"))
                }));
                Ok(())
            },
        )
        .unwrap()
}

/// Writes clicks to topics of two partitions from a thread of its own, a
/// hundred per second to each topic, until dropped; `burst` adds many at once.
struct Clicks {
    producer: Arc<BaseProducer>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Clicks {
    fn start(bootstrap: &str, topics: &[String]) -> Self {
        let producer: Arc<BaseProducer> = Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", bootstrap)
                .set("linger.ms", "5")
                .create()
                .unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (producer, stop, topics) = (producer.clone(), stop.clone(), topics.to_vec());
            move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    for topic in &topics {
                        send(&producer, topic, n..n + 5);
                    }
                    n += 5;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        Self {
            producer,
            stop,
            thread: Some(thread),
        }
    }

    fn burst(&self, topic: &str, clicks: u64) {
        send(&self.producer, topic, 0..clicks);
        self.producer.flush(Duration::from_secs(30)).unwrap();
    }

    /// Stops writing, once everything written is acknowledged.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
        self.producer.flush(Duration::from_secs(30)).unwrap();
    }
}

impl Drop for Clicks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn send(producer: &BaseProducer, topic: &str, clicks: std::ops::Range<u64>) {
    for n in clicks {
        let user = format!("user-{}", n % 20);
        let record = BaseRecord::to(topic)
            .partition((n % 2) as i32)
            .key(&user)
            .payload("click");
        common::kafka::send(producer, record);
    }
    producer.poll(Duration::ZERO);
}

/// Lets a held query go when dropped, so that a failing test still stops it.
struct Release(Arc<AtomicBool>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

#[test]
fn prometheus_scrapes_queries_the_dashboard_shows_them_and_the_alerts_fire() {
    let Some(binary) = common::tool("RTFLOW_PROMETHEUS", "prometheus") else {
        return;
    };
    let Some(bootstrap) = bootstrap() else { return };
    let run = std::process::id();
    let (quickstart_name, kafka_name, cluster_name) = (
        format!("quickstart-{run}"),
        format!("kafka-{run}"),
        format!("cluster-{run}"),
    );
    let kafka_input = topic(&bootstrap, "monitoring-in", 2);
    let cluster_input = topic(&bootstrap, "monitoring-cluster-in", 2);
    let cluster_output = topic(&bootstrap, "monitoring-cluster-out", 1);
    let mut clicks = Clicks::start(&bootstrap, &[kafka_input.clone(), cluster_input.clone()]);

    let (single, cluster) = (free_address(), free_address());
    let quickstart = quickstart(&quickstart_name, single);
    let held = Arc::new(AtomicBool::new(false));
    let kafka = kafka_query(&kafka_name, &bootstrap, &kafka_input, &held, single);
    let _release = Release(held.clone());
    let process = clustered(
        &cluster_name,
        &bootstrap,
        &cluster_input,
        &cluster_output,
        cluster,
    );

    let prometheus = Prometheus::start(
        &binary,
        &std::env::temp_dir().join(format!("rtflow-monitoring-{run}")),
        &scrape_config(single, cluster),
        &quick_rules(),
    );

    // Every panel of the dashboard shows data: each expression returns a
    // series with a number (a latency quantile over no records is NaN).
    let queries = [
        quickstart_name.as_str(),
        kafka_name.as_str(),
        cluster_name.as_str(),
    ];
    let exprs = dashboard_exprs(&queries);
    let mut seen = Vec::new();
    prometheus.wait_for("data in every panel of the dashboard", || {
        let empty: Vec<_> = exprs
            .iter()
            .filter(|(_, expr)| {
                !prometheus
                    .query(expr)
                    .iter()
                    .any(|(_, value)| value.is_finite())
            })
            .collect();
        if empty != seen {
            // Shown if the wait fails.
            println!("panels without data yet: {empty:?}");
            seen = empty.clone();
        }
        empty.is_empty().then_some(())
    });
    // The dashboard's query variable lists them.
    let listed = prometheus.api("/api/v1/label/query/values?match[]=rtflow_query_up");
    for query in queries {
        assert!(
            listed.as_array().unwrap().iter().any(|q| q == query),
            "{query} not in {listed}"
        );
    }

    // Every alert rule evaluates without error.
    prometheus.wait_for("every rule evaluated", || {
        let groups = prometheus.api("/api/v1/rules")["groups"].clone();
        let rules: Vec<Value> = groups
            .as_array()?
            .iter()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        for rule in &rules {
            assert_ne!(rule["health"], "err", "{rule}");
        }
        (rules.len() == 8 && rules.iter().all(|rule| rule["health"] == "ok")).then_some(())
    });

    // Held, the Kafka query reads nothing while clicks keep coming: its lag
    // grows past the alert's threshold, and the alert fires.
    let lag = format!("sum(rtflow_source_lag_records{{query=\"{kafka_name}\"}})");
    let lag_now = || prometheus.query(&lag).first().map(|(_, value)| *value);
    held.store(true, Ordering::Relaxed);
    clicks.burst(&kafka_input, 1500);
    prometheus.wait_for("the consumer lag of the held query over 1000", || {
        lag_now().filter(|lag| *lag > 1000.0)
    });
    prometheus.wait_for_alert("RtflowConsumerLagGrowing", &kafka_name);

    // Once it may read again, it catches up: the lag falls to zero.
    clicks.stop();
    held.store(false, Ordering::Relaxed);
    prometheus.wait_for("the consumer lag back to zero", || {
        lag_now().filter(|lag| *lag == 0.0)
    });

    // A query that stopped is down.
    quickstart.stop().unwrap();
    prometheus.wait_for_alert("RtflowQueryDown", &quickstart_name);

    // And what the endpoints serve with consumer lag and a cluster passes
    // promtool's lint as well.
    if let Some(tool) = common::tool("RTFLOW_PROMTOOL", "promtool") {
        for address in [single, cluster] {
            let (_, text) = get(address, "/metrics");
            let output = Command::new(&tool)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .and_then(|mut child| {
                    child.stdin.take().unwrap().write_all(text.as_bytes())?;
                    child.wait_with_output()
                })
                .unwrap();
            assert!(
                output.status.success(),
                "promtool check metrics: {}{}\n{text}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
    kafka.stop().unwrap();
    process.stop().unwrap();
}
