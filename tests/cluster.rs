//! Scale-out: several processes (this test binary, running its ignored
//! `cluster_child` test) run one query through a `KafkaCluster` on the test
//! broker. The query reads a topic of six partitions, repartitions by key, and
//! keeps a count per key and a tumbling-window count per key over event time.
//! Three processes start; one is killed with SIGKILL while input flows, and one
//! is started again under its name. The read_committed output of both counts
//! must equal the batch reference, each output record exactly once.
//!
//! Chains of repartitions, the four stream joins and `drop_duplicates` run
//! clustered the same way, and a property test runs random dataflows of them
//! through random kills and starts.
//!
//! On a replicated three-broker Kafka (`RTFLOW_KAFKA_CLUSTER_BOOTSTRAP`, which
//! scripts/test.sh starts), three processes count through the SIGKILL of the
//! broker that leads partitions of every topic of the query and coordinates
//! a process's transactions, and through its restart.

mod common;

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::kafka::{bootstrap, consume, consume_to_end, produce, producer, send, topic};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, TopicPartitionList};
use rtflow::prelude::*;
use serde::{Deserialize, Serialize};

/// What a child runs, from `RTFLOW_CLUSTER_CHILD`:
/// `bootstrap query input counts windows instance stop-file dataflow`, the
/// last one of [`dataflow_named`]'s names.
const CHILD_SPEC: &str = "RTFLOW_CLUSTER_CHILD";
/// How many standby replicas a child keeps (`KafkaCluster::standby_replicas`).
const CHILD_STANDBY: &str = "RTFLOW_CLUSTER_STANDBY";
/// A child's group session timeout in ms, when not the default.
const CHILD_SESSION: &str = "RTFLOW_CLUSTER_SESSION_MS";
/// A child's restore timeout in ms, when not the default.
const CHILD_RESTORE: &str = "RTFLOW_CLUSTER_RESTORE_MS";
/// The child's retry timeout in ms, if not the default.
const CHILD_RETRY: &str = "RTFLOW_CLUSTER_RETRY_MS";
/// The host a child stands for, when not the only one: its checkpoint
/// location is then its own although its instance name is not.
const CHILD_HOST: &str = "RTFLOW_CLUSTER_HOST";
/// Fault injection points (as `FAILPOINTS`) a child sets just before it
/// stops its query, so that they meet its final checkpoint.
const CHILD_STOP_FAILPOINTS: &str = "RTFLOW_CLUSTER_STOP_FAILPOINTS";
/// The children's batch duration in milliseconds, if not [`config`]'s.
const CHILD_BATCH: &str = "RTFLOW_CLUSTER_BATCH_MS";
/// The child's watermark interval in ms, if not the default.
const CHILD_WATERMARK_INTERVAL: &str = "RTFLOW_CLUSTER_WATERMARK_INTERVAL_MS";

/// What a process's log says when it rolls back past what it read of a
/// transaction that aborted.
const ROLLED_BACK: &str = "belong to one that aborted";

const PARTITIONS: i32 = 6;
const KEYS: usize = 10;
/// Event time advances 10 ms per record.
const STEP_MS: i64 = 10;
const WINDOW: Duration = Duration::from_secs(1);
/// The event time of the records that close every window at the end.
const FLUSH_TIME: i64 = 1 << 40;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Event {
    key: String,
    time: i64,
}

/// Record `i` of the input: `(partition, key, value)`, the value its event time.
fn record(i: usize) -> (i32, String, Vec<u8>) {
    let time = i as i64 * STEP_MS;
    (
        (i % PARTITIONS as usize) as i32,
        format!("k{}", i % KEYS),
        time.to_string().into_bytes(),
    )
}

/// Writes records `range` with one producer, pausing `pause` after each, and
/// waits until all are acknowledged.
fn produce_paced(bootstrap: &str, topic: &str, range: Range<usize>, pause: Duration) {
    let (_, flowing) = mpsc::channel();
    produce_paced_while(bootstrap, topic, range, pause, flowing);
}

/// Writes records from `range`'s start as [`produce_paced`] does, and past
/// its end until the sender of `flowing` is dropped; returns the end it
/// reached. A test that waits for something to happen while records flow
/// cannot know how long that takes on a loaded machine; one that panics
/// drops the sender as it unwinds.
fn produce_paced_while(
    bootstrap: &str,
    topic: &str,
    range: Range<usize>,
    pause: Duration,
    flowing: mpsc::Receiver<()>,
) -> usize {
    let producer = producer(bootstrap);
    let mut next = range.start;
    while next < range.end || flowing.try_recv() == Err(mpsc::TryRecvError::Empty) {
        let (partition, key, value) = record(next);
        let record = BaseRecord::to(topic)
            .partition(partition)
            .key(key.as_str())
            .payload(&value);
        send(&producer, record);
        producer.poll(Duration::ZERO);
        std::thread::sleep(pause);
        next += 1;
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    next
}

/// Produces records from `range`'s start, one producer 2.5 ms apart, for a
/// second and then while `meanwhile` runs (at least through `range`);
/// returns the end it reached. One producer all along: a new one per batch
/// takes long enough to leave an epoch without records.
fn produce_during(
    bootstrap: &str,
    topic: &str,
    range: Range<usize>,
    meanwhile: impl FnOnce(),
) -> usize {
    std::thread::scope(|scope| {
        let (keep_flowing, flowing) = mpsc::channel();
        let producing = scope.spawn(move || {
            let pause = Duration::from_micros(2_500);
            produce_paced_while(bootstrap, topic, range, pause, flowing)
        });
        std::thread::sleep(Duration::from_secs(1));
        meanwhile();
        drop(keep_flowing);
        producing.join().unwrap()
    })
}

/// One record per partition far ahead in event time: every window closes.
fn flush_records() -> Vec<(i32, String, Vec<u8>)> {
    (0..PARTITIONS)
        .map(|p| (p, "flush".to_owned(), FLUSH_TIME.to_string().into_bytes()))
        .collect()
}

/// Late record `i`: in window [0, 1000) of key `k{i % KEYS}`, which every
/// partition's watermark passed long before (produce it once the query read
/// records 0..100).
fn late_record(i: usize) -> (i32, String, Vec<u8>) {
    let (partition, key, _) = record(i);
    (partition, key, b"500".to_vec())
}

/// The batch reference: every `key:count` of the count per key, and every
/// `key@start:count` of the window count (update mode: one per record), once
/// each.
fn reference(n: usize) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    reference_with_late(n, 0)
}

/// [`reference`] with late records `0..late` too: the count per key counts
/// them; the window count drops them, as one process that never restarts
/// does.
fn reference_with_late(
    n: usize,
    late: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let on_time = (0..n).map(|i| (record(i).1, i as i64 * STEP_MS));
    let late = (0..late).map(|i| (late_record(i).1, 500));
    let (counts, _) = reference_of(on_time.clone().chain(late));
    let (_, windows) = reference_of(on_time);
    (counts, windows)
}

/// The outputs of `records` (and the flush records after them).
fn reference_of(
    records: impl Iterator<Item = (String, i64)>,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let input = records.chain(
        flush_records()
            .into_iter()
            .map(|(_, key, _)| (key, FLUSH_TIME)),
    );
    let mut per_key = BTreeMap::new();
    let mut per_window = BTreeMap::new();
    let (mut counts, mut windows) = (BTreeMap::new(), BTreeMap::new());
    for (key, time) in input {
        let count = per_key.entry(key.clone()).or_insert(0u64);
        *count += 1;
        counts.insert(format!("{key}:{count}"), 1);
        let start = time - time % WINDOW.as_millis() as i64;
        let count = per_window.entry((key.clone(), start)).or_insert(0u64);
        *count += 1;
        windows.insert(format!("{key}@{start}:{count}"), 1);
    }
    (counts, windows)
}

fn event(record: KafkaRecord) -> Event {
    Event {
        key: record.key_str().into_owned(),
        time: record.value_str().parse().unwrap_or(0),
    }
}

/// The dataflow every process runs.
fn build(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, windows: &str) {
    let by_key = side(flow, bootstrap, input).repartition_by(|e: &Event| e.key.clone());
    count_and_window(&by_key, bootstrap, counts, windows);
}

/// A running count per key written twice: at least once into `counts`, as
/// each count is made, and exactly once into `windows`, when its epoch
/// commits, which shows the committed state.
fn build_at_least_once(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, windows: &str) {
    let per_key = side(flow, bootstrap, input)
        .repartition_by(|e: &Event| e.key.clone())
        .count();
    for (topic, delivery) in [
        (counts, DeliveryGuarantee::AtLeastOnce),
        (windows, DeliveryGuarantee::ExactlyOnce),
    ] {
        per_key.sink(
            KafkaSink::new(bootstrap, topic, |(key, count): &(String, u64)| {
                KafkaMessage::new(format!("{key}:{count}"))
            })
            .delivery(delivery),
        );
    }
}

/// A running count per key of `keyed` into `counts` (`key:n`), and per key
/// and tumbling window into `windows` (`key@start:n`), both exactly once.
fn count_and_window<K, T>(keyed: &KeyedStream<K, T>, bootstrap: &str, counts: &str, windows: &str)
where
    K: rtflow::operators::StateKey + std::fmt::Display,
    T: Data,
{
    keyed.count().sink(
        KafkaSink::new(bootstrap, counts, |(key, count): &(K, u64)| {
            KafkaMessage::new(format!("{key}:{count}"))
        })
        .delivery(DeliveryGuarantee::ExactlyOnce),
    );
    keyed.window(Window::tumbling(WINDOW)).count().sink(
        KafkaSink::new(
            bootstrap,
            windows,
            |(key, window, count): &(K, rtflow::operators::Window, u64)| {
                KafkaMessage::new(format!("{key}@{}:{count}", window.start))
            },
        )
        .delivery(DeliveryGuarantee::ExactlyOnce),
    );
}

/// An event-time timer per record at its event time, behind the
/// repartition, written at least once into `counts` as `key@time` when it
/// fires.
fn timers(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, _: &str) {
    side(flow, bootstrap, input)
        .repartition_by(|e: &Event| e.key.clone())
        .process(|| Alarms)
        .sink(KafkaSink::new(bootstrap, counts, |fired: &String| {
            KafkaMessage::new(fired.clone())
        }));
}

/// Sets a timer at each record's event time and tells when it fires.
struct Alarms;

impl KeyedProcessor<String, Event, String> for Alarms {
    fn handle_input(
        &mut self,
        _key: &String,
        event: Event,
        ctx: &mut ProcessContext<'_, '_, String, String>,
    ) -> rtflow::prelude::Result<()> {
        ctx.register_timer(Timer::EventTime(event.time));
        Ok(())
    }

    fn on_timer(
        &mut self,
        key: &String,
        timer: Timer,
        ctx: &mut ProcessContext<'_, '_, String, String>,
    ) -> rtflow::prelude::Result<()> {
        match timer {
            Timer::EventTime(time) => ctx.emit(format!("{key}@{time}")),
            _ => Ok(()),
        }
    }
}

/// A count per key only, through the repartition.
fn count_per_key(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str) {
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(event)
    .repartition_by(|e: &Event| e.key.clone())
    .count()
    .sink(
        KafkaSink::new(bootstrap, counts, |(key, count): &(String, u64)| {
            KafkaMessage::new(format!("{key}:{count}"))
        })
        .delivery(DeliveryGuarantee::ExactlyOnce),
    );
}

/// The bucket the second stage of [`chain`] keys by: a function of the key
/// alone, so that the records of each bucket and window are the same in
/// every run, whatever order the first stage counts them in.
fn bucket(key: &str) -> u32 {
    key.bytes().map(u32::from).sum::<u32>() % 3
}

/// Two repartitions in a row: a count per key, whose updates are
/// repartitioned by the key's bucket, then counted per bucket (counts) and
/// per bucket and tumbling window (windows). The second stage's writers sit
/// behind the first stage's keyed count, so the watermark its windows close
/// by has crossed both repartitions.
fn chain(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, windows: &str) {
    let by_bucket = flow
        .source(
            KafkaSource::new(bootstrap)
                .subscribe([input])
                .starting_offsets(StartingOffsets::Earliest),
        )
        .map(event)
        .with_watermark(|e: &Event| e.time, Duration::from_millis(0))
        .repartition_by(|e: &Event| e.key.clone())
        .count()
        .map(|(key, _): (String, u64)| bucket(&key))
        .repartition_by(|bucket: &u32| *bucket);
    count_and_window(&by_bucket, bootstrap, counts, windows);
}

/// Every `item:n` of a running count per item: one per item's occurrence.
fn running_counts(items: impl Iterator<Item = String>) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    let mut updates = BTreeMap::new();
    for item in items {
        let count = seen.entry(item.clone()).or_insert(0u64);
        *count += 1;
        updates.insert(format!("{item}:{count}"), 1);
    }
    updates
}

/// [`chain`]'s batch reference over records `0..n`, late records `0..late`
/// (counted per bucket, dropped by the windows) and the flush records.
fn chain_reference(n: usize, late: usize) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let flush = flush_records()
        .into_iter()
        .map(|(_, key, _)| (key, FLUSH_TIME));
    let on_time = (0..n)
        .map(|i| (record(i).1, i as i64 * STEP_MS))
        .chain(flush);
    let late = (0..late).map(|i| (late_record(i).1, 500));
    let counts = running_counts(
        on_time
            .clone()
            .chain(late)
            .map(|(key, _)| bucket(&key).to_string()),
    );
    let windows = running_counts(on_time.map(|(key, time)| {
        let start = time - time % WINDOW.as_millis() as i64;
        format!("{}@{start}", bucket(&key))
    }));
    (counts, windows)
}

/// The right side of [`joins`]: a topic beside the input.
fn right_topic(input: &str) -> String {
    format!("{input}-right")
}

/// Right record `j`: keys `k0..k12` (the left side has `k0..k9`), event time
/// `10 j + 5` ms.
fn right_record(j: usize) -> (i32, String, Vec<u8>) {
    let time = j as i64 * STEP_MS + 5;
    (
        (j % PARTITIONS as usize) as i32,
        format!("k{}", (j * 3) % 13),
        time.to_string().into_bytes(),
    )
}

/// A right row joins a left row of its key from 20 ms before it to 40 ms
/// after it.
const JOIN_WINDOW: JoinWindow = JoinWindow {
    before: 20,
    after: 40,
};

fn row(e: &Event) -> String {
    format!("{}@{}", e.key, e.time)
}

fn maybe_row(e: &Option<Event>) -> String {
    e.as_ref().map_or_else(|| "-".to_owned(), row)
}

/// The events of `topic` from its start, their event time their watermark.
fn side(flow: &Dataflow, bootstrap: &str, topic: &str) -> Stream<Event> {
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([topic])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(event)
    .with_watermark(|e: &Event| e.time, Duration::ZERO)
}

/// The four stream-stream joins of the input (left) and its right topic,
/// each through its own repartition, into the counts topic as
/// `kind|left|right` (`-` for no row). The flush rows close every range and
/// are left out.
fn joins(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, _: &str) {
    let left = side(flow, bootstrap, input);
    let right = side(flow, bootstrap, &right_topic(input));
    let key = |e: &Event| e.key.clone();
    let lines = |pairs: Stream<String>| {
        pairs.filter(|line: &String| !line.contains("flush")).sink(
            KafkaSink::new(bootstrap, counts, |line: &String| {
                KafkaMessage::new(line.clone())
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
    };
    lines(
        left.join(&right, key, key, JOIN_WINDOW)
            .map(|(l, r): (Event, Event)| format!("inner|{}|{}", row(&l), row(&r))),
    );
    lines(
        left.left_join(&right, key, key, JOIN_WINDOW)
            .map(|(l, r): (Event, Option<Event>)| format!("left|{}|{}", row(&l), maybe_row(&r))),
    );
    lines(
        left.right_join(&right, key, key, JOIN_WINDOW)
            .map(|(l, r): (Option<Event>, Event)| format!("right|{}|{}", maybe_row(&l), row(&r))),
    );
    lines(left.full_join(&right, key, key, JOIN_WINDOW).map(
        |(l, r): (Option<Event>, Option<Event>)| {
            format!("full|{}|{}", maybe_row(&l), maybe_row(&r))
        },
    ));
}

/// [`joins`]' batch reference over left records `0..n` and right records
/// `0..m`: every pair in range, and every row of an outer side that has none.
fn joins_reference(n: usize, m: usize) -> BTreeMap<String, usize> {
    let as_event = |(_, key, value): (i32, String, Vec<u8>)| Event {
        key,
        time: String::from_utf8(value).unwrap().parse().unwrap(),
    };
    let lefts: Vec<Event> = (0..n).map(|i| as_event(record(i))).collect();
    let rights: Vec<Event> = (0..m).map(|j| as_event(right_record(j))).collect();
    let matches = |l: &Event, r: &Event| {
        l.key == r.key
            && l.time - JOIN_WINDOW.before <= r.time
            && r.time <= l.time + JOIN_WINDOW.after
    };
    let mut lines = Vec::new();
    for l in &lefts {
        let matched: Vec<&Event> = rights.iter().filter(|r| matches(l, r)).collect();
        for r in &matched {
            for kind in ["inner", "left", "right", "full"] {
                lines.push(format!("{kind}|{}|{}", row(l), row(r)));
            }
        }
        if matched.is_empty() {
            lines.push(format!("left|{}|-", row(l)));
            lines.push(format!("full|{}|-", row(l)));
        }
    }
    for r in rights
        .iter()
        .filter(|r| !lefts.iter().any(|l| matches(l, r)))
    {
        lines.push(format!("right|-|{}", row(r)));
        lines.push(format!("full|-|{}", row(r)));
    }
    lines.into_iter().map(|line| (line, 1)).collect()
}

/// `drop_duplicates` after a repartition by key: each `(key, time)` once,
/// into the counts topic as `key@time`, and how many distinct keys each
/// second had so far, through a third repartition, into the windows topic
/// as `second:n`.
fn dedup(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, windows: &str) {
    let distinct = flow
        .source(
            KafkaSource::new(bootstrap)
                .subscribe([input])
                .starting_offsets(StartingOffsets::Earliest),
        )
        .map(event)
        .with_watermark(|e: &Event| e.time, Duration::ZERO)
        .repartition_by(|e: &Event| e.key.clone())
        .as_ref()
        .drop_duplicates(|e: &Event| (e.key.clone(), e.time));
    distinct.sink(
        KafkaSink::new(bootstrap, counts, |e: &Event| KafkaMessage::new(row(e)))
            .delivery(DeliveryGuarantee::ExactlyOnce),
    );
    distinct
        .repartition_by(|e: &Event| e.time / 1000)
        .count()
        .sink(
            KafkaSink::new(bootstrap, windows, |(second, count): &(i64, u64)| {
                KafkaMessage::new(format!("{second}:{count}"))
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
}

/// Every record after a repartition by key, at least once into the counts
/// topic as `key@time`, in the order the stage after the repartition took
/// it.
fn in_order(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, _: &str) {
    side(flow, bootstrap, input)
        .repartition_by(|e: &Event| e.key.clone())
        .as_ref()
        .sink(KafkaSink::new(bootstrap, counts, |e: &Event| {
            KafkaMessage::new(row(e))
        }));
}

/// [`dedup`]'s batch reference over records `0..n` (each read once or more,
/// late records dropped) and the flush records.
fn dedup_reference(n: usize) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let events: Vec<(String, i64)> = (0..n)
        .map(|i| (record(i).1, i as i64 * STEP_MS))
        .chain([("flush".to_owned(), FLUSH_TIME)])
        .collect();
    let rows = events
        .iter()
        .map(|(key, time)| (format!("{key}@{time}"), 1))
        .collect();
    let seconds = running_counts(events.iter().map(|(_, time)| (time / 1000).to_string()));
    (rows, seconds)
}

fn config(query: &str) -> QueryConfig {
    QueryConfig::new(query)
        .trigger(Trigger::real_time("300 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
        .task_slots(256)
}

#[test]
#[ignore = "the child process of cluster tests; run by them"]
fn cluster_child() {
    let Ok(spec) = std::env::var(CHILD_SPEC) else {
        return;
    };
    let _failpoints = fail::FailScenario::setup();
    // Its warnings, and the cluster's rebalances, runs and fencings, go to
    // its log, which a failing test shows: a wrong result under load is
    // traced back to the restart around it.
    rtflow::logging::init("warn,rtflow_connectors::kafka::cluster=info");
    let [bootstrap, query, input, counts, windows, instance, stop, dataflow]: [String; 8] = spec
        .split(' ')
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .try_into()
        .expect("eight fields");
    let build = dataflow_named(&dataflow);
    let (b, i, c, w) = (bootstrap.clone(), input, counts, windows);
    // Each process keeps its changelog copies in a location of its own.
    let host = std::env::var(CHILD_HOST).unwrap_or_default();
    let location = PathBuf::from(&stop).with_file_name(format!("{instance}{host}.checkpoints"));
    let standby_replicas = std::env::var(CHILD_STANDBY)
        .ok()
        .and_then(|replicas| replicas.parse().ok())
        .unwrap_or(0);
    let mut cluster = KafkaCluster::new(&bootstrap)
        .instance(&instance)
        .repartition_partitions(PARTITIONS as usize)
        .standby_replicas(standby_replicas);
    if standby_replicas > 0 {
        // Each in a zone of its own, which the others read from the group.
        cluster = cluster.rack(format!("zone-{instance}"));
    }
    if let Some(ms) = std::env::var(CHILD_SESSION)
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        cluster = cluster.session_timeout(Duration::from_millis(ms));
    }
    if let Some(ms) = std::env::var(CHILD_RESTORE)
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        cluster = cluster.restore_timeout(Duration::from_millis(ms));
    }
    if let Some(ms) = std::env::var(CHILD_RETRY)
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        cluster = cluster.retry_timeout(Duration::from_millis(ms));
    }
    if let Some(ms) = std::env::var(CHILD_WATERMARK_INTERVAL)
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        cluster = cluster.watermark_interval(Duration::from_millis(ms));
    }
    let mut config = config(&query);
    if let Ok(ms) = std::env::var(CHILD_BATCH) {
        config = config.trigger(Trigger::real_time(format!("{ms} milliseconds")));
    }
    let running = cluster
        .start(config.checkpoint_location(location), move |flow| {
            build(flow, &b, &i, &c, &w);
            Ok(())
        })
        .expect("the child joins the cluster");
    let status = PathBuf::from(&stop).with_file_name(format!("{instance}.status"));
    let stop_me = status.with_extension("stop");
    let failpoints = status.with_extension("failpoints");
    while !PathBuf::from(&stop).exists() && !stop_me.exists() {
        if let Ok(set) = std::fs::read_to_string(&failpoints) {
            set_failpoints(&set);
            std::fs::remove_file(&failpoints).unwrap();
        }
        assert!(
            running.is_active(),
            "the child failed: {:?}",
            running
                .stop()
                .map_err(|error| format!("{}: {error}", error.error_class()))
        );
        // Written aside first, then renamed, so that a test never reads one
        // half written; aside per host, as two processes of one name write.
        let aside = status.with_extension(format!("tmp{host}"));
        let write = |path: &PathBuf, text: String| {
            std::fs::write(&aside, text).unwrap();
            std::fs::rename(&aside, path).unwrap();
        };
        if let Some(restore) = running.last_restore() {
            let read = format!("{} {}", restore.changelog_bytes, restore.local_bytes);
            write(&status.with_extension("restore"), read);
        }
        let owned = format!("{} {}", running.runs(), running.partitions().join(","));
        write(&status, owned);
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Ok(failpoints) = std::env::var(CHILD_STOP_FAILPOINTS) {
        set_failpoints(&failpoints);
    }
    if let Err(error) = running.stop() {
        panic!(
            "the child did not leave cleanly: {}: {error}",
            error.error_class()
        );
    }
}

/// Sets the failpoints of `failpoints` (`name=actions;...`, as `FAILPOINTS`).
fn set_failpoints(failpoints: &str) {
    for (name, actions) in failpoints.split(';').filter_map(|f| f.split_once('=')) {
        fail::cfg(name, actions).expect("a failpoint's actions");
    }
}

/// A dataflow of the tests: the bootstrap servers, then the input, counts
/// and windows topics.
type Build = Box<dyn Fn(&Dataflow, &str, &str, &str, &str) + Send>;

/// The dataflow a child runs: one of the tests' own, or a random
/// [`Pipeline`] as `prop:` and its encoding.
fn dataflow_named(name: &str) -> Build {
    if let Some(pipeline) = name.strip_prefix("prop:") {
        let pipeline = Pipeline::decode(pipeline);
        return Box::new(move |flow, bootstrap, input, counts, _| {
            pipeline.build(flow, bootstrap, input, counts)
        });
    }
    match name {
        "counts" => Box::new(build),
        "counts-at-least-once" => Box::new(build_at_least_once),
        "chain" => Box::new(chain),
        "joins" => Box::new(joins),
        "dedup" => Box::new(dedup),
        "in-order" => Box::new(in_order),
        "timers" => Box::new(timers),
        other => panic!("no dataflow '{other}'"),
    }
}

struct Cluster {
    bootstrap: String,
    query: String,
    input: String,
    counts: String,
    windows: String,
    dir: PathBuf,
    /// What the children run ([`dataflow_named`]).
    dataflow: String,
    children: BTreeMap<String, Child>,
    /// How many late records ([`late_record`]) were produced.
    late: usize,
    /// How many standby replicas the children keep.
    standby_replicas: usize,
    /// The children's group session timeout, if not the default.
    session_timeout: Option<Duration>,
    /// The children's restore timeout, if not the default.
    restore_timeout: Option<Duration>,
    /// The children's retry timeout, if not the default.
    retry_timeout: Option<Duration>,
    /// What the next child started sets at its stop (`CHILD_STOP_FAILPOINTS`).
    stop_failpoints: Option<String>,
    /// The children's batch duration, if not [`config`]'s.
    batch: Option<Duration>,
    /// The children's watermark interval, if not the default.
    watermark_interval: Option<Duration>,
}

impl Cluster {
    fn new(bootstrap: &str) -> Self {
        Self::running(bootstrap, "counts")
    }

    fn running(bootstrap: &str, dataflow: &str) -> Self {
        let input = topic(bootstrap, "cluster-in", PARTITIONS);
        let dir = std::env::temp_dir().join(&input);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            bootstrap: bootstrap.to_owned(),
            query: format!("{input}-q"),
            counts: topic(bootstrap, "cluster-counts", 1),
            windows: topic(bootstrap, "cluster-windows", 1),
            input,
            dir,
            dataflow: dataflow.to_owned(),
            children: BTreeMap::new(),
            late: 0,
            standby_replicas: 0,
            session_timeout: None,
            restore_timeout: None,
            retry_timeout: None,
            stop_failpoints: None,
            batch: None,
            watermark_interval: None,
        }
    }

    /// Produces `records` of the input, starts `instances` and waits until
    /// they share the input's partitions and counted half of the records;
    /// returns their shares.
    fn start(
        &mut self,
        instances: &[&str],
        records: Range<usize>,
        timeout: Duration,
    ) -> BTreeMap<String, Vec<String>> {
        let half = records.len() / 2;
        produce(&self.bootstrap, &self.input, records.map(record));
        for instance in instances {
            self.spawn(instance);
        }
        let shares = self.wait_for_shares(timeout);
        let (counts, _) = self.outputs(half, 0, timeout);
        assert!(counts.len() >= half, "no progress:\n{}", self.logs());
        shares
    }

    /// Produces `n` more late records ([`late_record`]).
    fn produce_late(&mut self, n: usize) {
        let late = self.late..self.late + n;
        produce(&self.bootstrap, &self.input, late.map(late_record));
        self.late += n;
    }

    fn spawn(&mut self, instance: &str) {
        self.spawn_with_failpoints(instance, "");
    }

    /// Starts `instance` with the fault injection points `failpoints` set
    /// (the `fail` crate's `FAILPOINTS`).
    fn spawn_with_failpoints(&mut self, instance: &str, failpoints: &str) {
        self.spawn_on("", instance, failpoints);
    }

    /// Starts `instance`, which sets `failpoints` just before it stops its
    /// query: its final checkpoint meets them, and no checkpoint before.
    fn spawn_failing_at_stop(&mut self, instance: &str, failpoints: &str) {
        self.stop_failpoints = Some(failpoints.to_owned());
        self.spawn(instance);
        self.stop_failpoints = None;
    }

    /// Starts `instance` as if on another machine, `host`: with a checkpoint
    /// location of its own.
    fn spawn_on(&mut self, host: &str, instance: &str, failpoints: &str) {
        let spec = [
            &self.bootstrap,
            &self.query,
            &self.input,
            &self.counts,
            &self.windows,
            &instance.to_owned(),
            &self.dir.join("stop").display().to_string(),
            &self.dataflow,
        ]
        .map(|s| s.as_str())
        .join(" ");
        // Appended to: a process started again under its name, or a second
        // one under a live one's name, keeps the log of the one before.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{instance}.log")))
            .unwrap();
        let _ = std::fs::remove_file(self.dir.join(format!("{instance}.stop")));
        let mut child = Command::new(std::env::current_exe().unwrap());
        child
            .args(["--ignored", "--exact", "cluster_child", "--nocapture"])
            .env(CHILD_SPEC, spec)
            .env("FAILPOINTS", failpoints)
            .env(CHILD_HOST, host)
            .env(CHILD_STANDBY, self.standby_replicas.to_string());
        if let Some(timeout) = self.session_timeout {
            child.env(CHILD_SESSION, timeout.as_millis().to_string());
        }
        if let Some(timeout) = self.restore_timeout {
            child.env(CHILD_RESTORE, timeout.as_millis().to_string());
        }
        if let Some(timeout) = self.retry_timeout {
            child.env(CHILD_RETRY, timeout.as_millis().to_string());
        }
        if let Some(failpoints) = &self.stop_failpoints {
            child.env(CHILD_STOP_FAILPOINTS, failpoints);
        }
        if let Some(batch) = self.batch {
            child.env(CHILD_BATCH, batch.as_millis().to_string());
        }
        if let Some(interval) = self.watermark_interval {
            child.env(CHILD_WATERMARK_INTERVAL, interval.as_millis().to_string());
        }
        let child = child
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the child starts");
        self.children.insert(instance.to_owned(), child);
    }

    /// How many runs `instance` started, and the partitions it runs now.
    fn status(&self, instance: &str) -> (u64, Vec<String>) {
        let text = std::fs::read_to_string(self.dir.join(format!("{instance}.status")))
            .unwrap_or_default();
        let (runs, partitions) = text.split_once(' ').unwrap_or(("0", ""));
        let partitions = partitions
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        (runs.parse().unwrap_or(0), partitions)
    }

    /// Waits until none of `instances` started a run or changed its share
    /// for `quiet`; their statuses then.
    fn settled(
        &self,
        instances: &[&str],
        quiet: Duration,
        timeout: Duration,
    ) -> BTreeMap<String, (u64, Vec<String>)> {
        let deadline = Instant::now() + timeout;
        let statuses = || {
            instances
                .iter()
                .map(|instance| (instance.to_string(), self.status(instance)))
                .collect::<BTreeMap<_, _>>()
        };
        let (mut last, mut since) = (statuses(), Instant::now());
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let now = statuses();
            if now != last {
                (last, since) = (now, Instant::now());
            } else if since.elapsed() >= quiet {
                return last;
            }
            assert!(
                Instant::now() < deadline,
                "the processes did not settle: {last:?}\n{}",
                self.logs()
            );
        }
    }

    /// Waits up to `timeout` until `done` holds of `instance`'s runs and
    /// share; fails with `what` otherwise.
    fn await_status(
        &self,
        instance: &str,
        timeout: Duration,
        what: &str,
        done: impl Fn(u64, &[String]) -> bool,
    ) {
        let deadline = Instant::now() + timeout;
        loop {
            let (runs, share) = self.status(instance);
            if done(runs, &share) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what} ({runs} runs, owns {share:?}):\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every running process runs some of the input's partitions.
    fn wait_for_shares(&self, timeout: Duration) -> BTreeMap<String, Vec<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            let shares: BTreeMap<String, Vec<String>> = self
                .children
                .keys()
                .map(|instance| (instance.clone(), self.status(instance).1))
                .collect();
            let input = |partitions: &Vec<String>| {
                partitions
                    .iter()
                    .any(|p| p.starts_with(&format!("{}-", self.input)))
            };
            if shares.values().all(input) {
                return shares;
            }
            assert!(
                Instant::now() < deadline,
                "the processes did not all get input partitions: {shares:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends `instance` the signal `signal`: `STOP` freezes it, `CONT` thaws
    /// it.
    fn signal(&self, instance: &str, signal: &str) {
        let pid = self.children[instance].id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "could not send {signal} to {instance}");
    }

    /// Tells `instance` alone to stop cleanly, and waits until it did.
    fn stop_one(&mut self, instance: &str) {
        let status = self.stop_child(instance);
        assert!(status.success(), "{instance} failed:\n{}", self.logs());
    }

    /// Stops `instance`, whose stop is to fail; its log.
    fn stop_one_failing(&mut self, instance: &str) -> String {
        let status = self.stop_child(instance);
        assert!(
            !status.success(),
            "{instance} stopped cleanly:\n{}",
            self.logs()
        );
        self.log(instance)
    }

    /// The log of `instance`, of every process started under its name.
    fn log(&self, instance: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{instance}.log"))).unwrap_or_default()
    }

    /// The last lines of `instance`'s log: what a failure message ends with,
    /// so that it still shows when a long one is cut in the middle.
    fn log_tail(&self, instance: &str) -> String {
        let log = self.log(instance);
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Tells `instance` to stop and waits for it; how it exited.
    fn stop_child(&mut self, instance: &str) -> std::process::ExitStatus {
        std::fs::write(self.dir.join(format!("{instance}.stop")), b"").unwrap();
        let mut child = self.children.remove(instance).unwrap();
        let status = child.wait().unwrap();
        let _ = std::fs::remove_file(self.dir.join(format!("{instance}.status")));
        status
    }

    /// Sets failpoints of the running `instance` (`name=actions;...`), as
    /// `FAILPOINTS` does at its start.
    fn set_failpoints(&self, instance: &str, failpoints: &str) {
        let aside = self.dir.join(format!("{instance}.failpoints-aside"));
        std::fs::write(&aside, failpoints).unwrap();
        std::fs::rename(aside, self.dir.join(format!("{instance}.failpoints"))).unwrap();
    }

    fn kill(&mut self, instance: &str) {
        let mut child = self.children.remove(instance).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let _ = std::fs::remove_file(self.dir.join(format!("{instance}.status")));
    }

    /// Reads both outputs until they hold as many records as `expected`, or
    /// the timeout passes.
    fn outputs(
        &self,
        counts: usize,
        windows: usize,
        timeout: Duration,
    ) -> (Vec<String>, Vec<String>) {
        (
            self.read(&self.counts, counts, timeout),
            self.read(&self.windows, windows, timeout),
        )
    }

    /// The values in one-partition `topic` (read_committed) once it holds
    /// `n` records, or when `timeout` passed.
    fn read(&self, topic: &str, n: usize, timeout: Duration) -> Vec<String> {
        consume(&self.bootstrap, topic, 1, n, timeout)
            .into_iter()
            .map(|r| String::from_utf8(r.value).unwrap())
            .collect()
    }

    /// Whether `instance` rolled a run back past records of a transaction
    /// that aborted.
    fn rolled_back(&self, instance: &str) -> bool {
        self.log(instance).contains(ROLLED_BACK)
    }

    /// How many times `instance` restarted a run that rolled back past
    /// records of a transaction that aborted.
    fn rollback_restarts(&self, instance: &str) -> u64 {
        (self.log(instance).lines())
            .filter(|line| {
                line.contains("restarting from the last commit") && line.contains(ROLLED_BACK)
            })
            .count() as u64
    }

    /// How many of `instance`'s commits the `checkpoint-commit` failpoint
    /// refused.
    fn refusals(&self, instance: &str) -> usize {
        (self.log(instance).lines())
            .filter(|l| l.contains("stopping the query") && l.contains("failed: refused"))
            .count()
    }

    /// Refuses `refused`'s next commit, again until one of `readers` rolled
    /// back past its aborted transaction: an epoch can end before its writers
    /// produced a frame for the others. Up to five refusals.
    fn refuse_until_rolled_back(&self, refused: &str, readers: &[&str]) {
        let rolled_back = || readers.iter().any(|r| self.rolled_back(r));
        for refusal in 1..=5 {
            self.set_failpoints(refused, "checkpoint-commit=1*return(refused)->off");
            let deadline = Instant::now() + Duration::from_secs(60);
            while self.refusals(refused) < refusal {
                assert!(
                    Instant::now() < deadline,
                    "{refused}'s commit was not refused:\n{}",
                    self.logs()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while !rolled_back() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if rolled_back() {
                return;
            }
        }
        panic!(
            "{}\nnone of {readers:?} rolled back past {refused}'s aborted transactions \
             in five refusals",
            self.logs()
        );
    }

    fn logs(&self) -> String {
        let mut logs = String::new();
        for entry in std::fs::read_dir(&self.dir).unwrap().flatten() {
            if entry.path().extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                logs.push_str(&format!("--- {}\n{text}\n", entry.path().display()));
            }
        }
        logs
    }

    /// Waits up to two minutes until both outputs hold as many records as
    /// `expected_counts` and `expected_windows`, then stops every process
    /// and checks them ([`stop_and_check`](Self::stop_and_check)).
    fn await_and_check(
        &mut self,
        expected_counts: &BTreeMap<String, usize>,
        expected_windows: &BTreeMap<String, usize>,
    ) {
        self.outputs(
            expected_counts.len(),
            expected_windows.len(),
            Duration::from_secs(120),
        );
        self.stop_and_check(expected_counts, expected_windows);
    }

    /// Stops every process, then checks that both outputs, read to their
    /// ends, equal the references exactly once: a run that wrote records
    /// it should not have shows them, and the last commits are read however
    /// slow the broker is.
    fn stop_and_check(
        &mut self,
        expected_counts: &BTreeMap<String, usize>,
        expected_windows: &BTreeMap<String, usize>,
    ) {
        self.stop_all();
        let counts = self.read_to_end(&self.counts);
        let windows = self.read_to_end(&self.windows);
        let logs = self.logs();
        check("count per key", &counts, expected_counts, &logs);
        check("window count per key", &windows, expected_windows, &logs);
    }

    /// The values committed in one-partition `topic`, read up to its end
    /// once no process writes it any more.
    fn read_to_end(&self, topic: &str) -> Vec<String> {
        consume_to_end(&self.bootstrap, topic, Duration::from_secs(60))
            .into_iter()
            .map(|r| String::from_utf8(r.value).unwrap())
            .collect()
    }

    /// Stops every process, then checks the counts of
    /// [`build_at_least_once`]: the exactly-once copy, the committed state,
    /// holds every count of `expected` once; the at-least-once one holds
    /// every count of `expected` at least once. After a failure it may also
    /// hold counts a run made of records whose transaction aborted, before
    /// it rolled back.
    fn stop_and_check_at_least_once(&mut self, expected: &BTreeMap<String, usize>) {
        self.stop_all();
        let logs = self.logs();
        let committed = self.read_to_end(&self.windows);
        check("committed count per key", &committed, expected, &logs);
        let counts = tally(&self.read(&self.counts, usize::MAX, Duration::from_secs(5)));
        let missing: Vec<_> = (expected.keys())
            .filter(|count| !counts.contains_key(*count))
            .take(10)
            .collect();
        assert!(
            missing.is_empty(),
            "at-least-once counts missing {missing:?}\n{logs}"
        );
        let again: usize = counts.values().map(|n| n - 1).sum();
        let rolled_back = counts.keys().filter(|c| !expected.contains_key(*c)).count();
        eprintln!(
            "at least once: {again} counts written again, {rolled_back} made by runs that rolled back"
        );
    }

    /// Waits until the counts, written at least once, hold every record of
    /// `expected` or `timeout` passed.
    fn await_counts_at_least_once(&self, expected: &BTreeMap<String, usize>, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let counts = tally(&self.read(&self.counts, usize::MAX, Duration::from_secs(2)));
            if expected.keys().all(|count| counts.contains_key(count)) || Instant::now() > deadline
            {
                return;
            }
        }
    }

    /// Waits until the at-least-once output (`counts`) holds every one of
    /// `expected`, `what` they are, and checks that it does while the
    /// input's committed offsets still sum to `committed`: they were written
    /// before their epoch committed.
    fn check_written_before_commit(
        &self,
        what: &str,
        expected: &BTreeMap<String, usize>,
        committed: i64,
    ) {
        self.await_counts_at_least_once(expected, Duration::from_secs(60));
        let written = tally(&self.read(&self.counts, usize::MAX, Duration::from_secs(2)));
        let missing: Vec<_> = (expected.keys())
            .filter(|line| !written.contains_key(*line))
            .take(10)
            .collect();
        assert!(
            missing.is_empty(),
            "{}",
            summed_up(
                &format!(
                    "{what} not written before their epoch committed: {missing:?} ({} written)",
                    written.len()
                ),
                &self.logs()
            )
        );
        assert_eq!(
            self.committed_input(),
            committed,
            "no epoch committed meanwhile"
        );
    }

    /// The offsets of the input the query's processes committed, summed
    /// over its partitions.
    fn committed_input(&self) -> i64 {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", format!("rtflow-{}", self.query))
            .set("isolation.level", "read_committed")
            .create()
            .unwrap();
        let mut partitions = TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            partitions.add_partition(&self.input, partition);
        }
        let committed = consumer
            .committed_offsets(partitions, Duration::from_secs(30))
            .unwrap();
        (committed.elements().iter())
            .filter_map(|e| match e.offset() {
                rdkafka::Offset::Offset(offset) => Some(offset),
                _ => None,
            })
            .sum()
    }

    fn stop_all(&mut self) {
        std::fs::write(self.dir.join("stop"), b"").unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        for (instance, mut child) in std::mem::take(&mut self.children) {
            loop {
                match child.try_wait().unwrap() {
                    Some(status) => {
                        assert!(
                            status.success(),
                            "{}",
                            summed_up(
                                &format!(
                                    "{instance} failed ({status}); its log ends:\n{}",
                                    self.log_tail(&instance)
                                ),
                                &self.logs()
                            )
                        );
                        break;
                    }
                    None if Instant::now() > deadline => {
                        let stacks = thread_stacks(child.id());
                        child.kill().unwrap();
                        let summary = format!(
                            "{instance} did not stop; its log ends:\n{}",
                            self.log_tail(&instance)
                        );
                        panic!(
                            "{}",
                            summed_up(&summary, &format!("{}\n{stacks}", self.logs()))
                        );
                    }
                    None => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.children.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The stacks of every thread of process `pid`, as gdb prints them, to show
/// where a process that did not stop waits; a note when gdb is not there.
fn thread_stacks(pid: u32) -> String {
    let gdb = Command::new("timeout")
        .args(["60", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "thread apply all bt"])
        .stdin(Stdio::null())
        .output();
    match gdb {
        Ok(out) if out.status.success() => {
            format!(
                "--- threads of {pid}\n{}",
                String::from_utf8_lossy(&out.stdout)
            )
        }
        Ok(out) => format!(
            "--- no threads of {pid}: gdb {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(error) => format!("--- no threads of {pid}: {error}"),
    }
}

fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// GET /metrics: the body as served.
fn scrape(address: SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

fn tally(records: &[String]) -> BTreeMap<String, usize> {
    let mut tally = BTreeMap::new();
    for record in records {
        *tally.entry(record.clone()).or_insert(0) += 1;
    }
    tally
}

#[test]
fn three_processes_one_killed_and_one_added_count_exactly_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 6_000;
    let third = total / 3;
    let shares = cluster.start(&["p0", "p1", "p2"], 0..third, Duration::from_secs(90));
    // Records late for windows that closed arrive after the start-up
    // rebalances, right after the kill, and right after the restart: a
    // restarted or rebalanced run drops them as one process does.
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, (third..2 * third).map(record));
    std::thread::sleep(Duration::from_millis(700));
    cluster.kill("p1");
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, (2 * third..total).map(record));
    std::thread::sleep(Duration::from_secs(3));
    let survivors = [cluster.status("p0"), cluster.status("p2")];
    cluster.spawn("p1");
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, flush_records());
    // The one added back takes partitions over from the others: a survivor
    // hands partitions over and takes others on at barriers inside its run
    // (its run count stays), or restarts where it cannot; either way it
    // runs a share of its own.
    let reshared = cluster.wait_for_shares(Duration::from_secs(90));
    let deadline = Instant::now() + Duration::from_secs(30);
    for (instance, before) in ["p0", "p2"].iter().zip(survivors) {
        while cluster.status(instance).1.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{instance}, which ran {:?}, runs no share",
                before.1
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    eprintln!("partitions before the kill {shares:?}, after one was added back {reshared:?}");

    let (expected_counts, expected_windows) = reference_with_late(total, cluster.late);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// An at-least-once sink of a clustered query writes each record as soon as
/// it is processed, across a repartition and another process, not when its
/// epoch commits: with a 5-minute batch (the longest a clustered query's
/// transactions allow on a broker's default `transaction.max.timeout.ms`),
/// every count is written while the input's committed offsets stay where
/// they were.
#[test]
fn a_clustered_at_least_once_sink_writes_a_record_before_its_epoch_commits() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    cluster.batch = Some(Duration::from_secs(300));
    let total = 2_000;
    cluster.start(&["p0", "p1"], 0..total / 2, Duration::from_secs(90));
    // The start-up rebalances committed at their handovers; nothing commits
    // again until the next multiple of five minutes.
    std::thread::sleep(Duration::from_secs(2));
    clear_of_the_next_tick(Duration::from_secs(300), Duration::from_secs(60));
    let committed = cluster.committed_input();
    produce(&bootstrap, &cluster.input, (total / 2..total).map(record));
    let (all, _) = reference_of((0..total).map(|i| (record(i).1, i as i64 * STEP_MS)));
    let before_flush: BTreeMap<String, usize> = all
        .into_iter()
        .filter(|(count, _)| !count.starts_with("flush"))
        .collect();
    cluster.check_written_before_commit("counts", &before_flush, committed);
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(60));
    cluster.stop_and_check_at_least_once(&expected);
}

/// Event time crosses a repartition between barriers, as in one process:
/// with a batch of five minutes, timers behind the repartition fire as the
/// watermark passes them, long before an epoch commits.
#[test]
fn timers_behind_a_repartition_fire_between_barriers() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "timers");
    cluster.batch = Some(Duration::from_secs(300));
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    // The start-up rebalances committed at their handovers; nothing commits
    // again until the next multiple of five minutes.
    std::thread::sleep(Duration::from_secs(2));
    clear_of_the_next_tick(Duration::from_secs(300), Duration::from_secs(60));
    let committed = cluster.committed_input();
    let total = 600;
    produce(&bootstrap, &cluster.input, (0..total).map(record));
    // Every source partition's watermark passed the event time of the
    // records up to the last full round over the partitions.
    let passed = total - PARTITIONS as usize;
    let expected: BTreeMap<String, usize> = (0..=passed)
        .map(|i| (format!("{}@{}", record(i).1, i as i64 * STEP_MS), 1))
        .collect();
    cluster.check_written_before_commit("fired timers", &expected, committed);
    cluster.stop_all();
}

/// With a watermark interval of zero, event time crosses a repartition only
/// at barriers: with a 5-minute batch, no timer fires behind it meanwhile.
#[test]
fn with_a_watermark_interval_of_zero_timers_behind_a_repartition_wait_for_the_barrier() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "timers");
    cluster.batch = Some(Duration::from_secs(300));
    cluster.watermark_interval = Some(Duration::ZERO);
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    std::thread::sleep(Duration::from_secs(2));
    clear_of_the_next_tick(Duration::from_secs(300), Duration::from_secs(30));
    produce(&bootstrap, &cluster.input, (0..600).map(record));
    // With the default interval every timer fires within a second or two
    // (the test above).
    std::thread::sleep(Duration::from_secs(10));
    let fired = cluster.read(&cluster.counts, usize::MAX, Duration::from_secs(2));
    assert!(
        fired.is_empty(),
        "{}",
        summed_up(
            &format!("{} timers fired between barriers", fired.len()),
            &cluster.logs()
        )
    );
    cluster.stop_all();
}

/// Records read before their transaction ends are counted once in the
/// committed state whatever happens to that transaction: a commit refused
/// (its transaction aborted) and a process SIGKILLed mid-epoch (its open
/// transaction aborted by the fencing) make the processes that read from
/// them roll back to their last commit. The exactly-once copy of the counts
/// holds each count once; the at-least-once output holds every count, maybe
/// more than once.
#[test]
fn a_clustered_count_counts_each_record_once_when_a_writer_is_killed_or_refused_mid_epoch() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    let third = 2_000;
    produce(&bootstrap, &cluster.input, (0..third).map(record));
    for instance in ["p0", "p1", "p2"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    // Records flow all along, so that every epoch of every process holds
    // some that the others read before it commits.
    let input = cluster.input.clone();
    let total = produce_during(&bootstrap, &input, third..3 * third, || {
        // p2's next commit is refused: what its writers produced in that
        // epoch, of its own input partitions, aborts. Ten keys over six
        // repartition partitions send some of it to the others' readers,
        // which roll back past it before p1 is killed (whose fencing rolls
        // readers back too).
        cluster.refuse_until_rolled_back("p2", &["p0", "p1"]);
        cluster.kill("p1");
        std::thread::sleep(Duration::from_secs(2));
        cluster.spawn("p1");
    });
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(120));
    cluster.outputs(0, expected.len(), Duration::from_secs(60));
    cluster.stop_and_check_at_least_once(&expected);
}

/// A key's records of one source partition cross a repartition in the order
/// they were read, across every barrier.
#[test]
fn a_keys_records_cross_a_repartition_in_their_order_across_epochs() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "in-order");
    cluster.batch = Some(Duration::from_millis(100));
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    // One producer at ~2,000 records/s: some 40 barriers pass while records
    // flow, each with records on their way.
    let total = 8_000;
    produce_paced(
        &bootstrap,
        &cluster.input,
        0..total,
        Duration::from_micros(500),
    );
    let rows = cluster.read(&cluster.counts, total, Duration::from_secs(120));
    assert_eq!(
        rows.len(),
        total,
        "every record crossed:\n{}",
        cluster.logs()
    );
    let mut last: BTreeMap<(String, i64), i64> = BTreeMap::new();
    for row in &rows {
        let (key, time) = row.split_once('@').unwrap();
        let time: i64 = time.parse().unwrap();
        let partition = (time / STEP_MS) % i64::from(PARTITIONS);
        if let Some(before) = last.insert((key.to_owned(), partition), time) {
            assert!(
                before < time,
                "{key} of partition {partition}: {time} after {before}\n{}",
                cluster.logs()
            );
        }
    }
    cluster.stop_all();
}

/// A process commits each epoch's second transaction beside the next epoch.
/// One that fails fails the run's next checkpoint: the run rolls back to its
/// last commit and starts over, and every count still comes out once in the
/// committed state, the output at least once.
#[cfg(feature = "failpoints")]
#[test]
fn a_second_transaction_that_fails_rolls_the_run_back_and_every_count_stays_exact() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    let total = 3_000;
    let half = total / 2;
    produce(&bootstrap, &cluster.input, (0..half).map(record));
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    cluster.set_failpoints("p0", "second-transaction=1*return(second refused)->off");
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(cluster.log("p0").lines())
        .any(|l| l.contains("stopping the query") && l.contains("second refused"))
    {
        assert!(
            Instant::now() < deadline,
            "p0's second transaction did not fail its run:\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(120));
    cluster.outputs(0, expected.len(), Duration::from_secs(60));
    cluster.stop_and_check_at_least_once(&expected);
}

/// A process commits an epoch's first transaction, its input's offsets and
/// the repartition records written of them, once its sources and their
/// writers passed the barrier: an exactly-once sink behind the repartition
/// held at the barrier holds back only the second transaction, the keyed
/// state and its output. Once the sink goes on, every count comes out once.
#[cfg(feature = "failpoints")]
#[test]
fn a_sink_held_at_its_barrier_holds_back_only_the_second_transaction() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let before = 500;
    cluster.start(&["p0"], 0..before, Duration::from_secs(90));
    // Records keep coming while the sinks stop at their next barrier, so
    // that the epoch they stop in has records of its own.
    let input = cluster.input.clone();
    let total = produce_during(&bootstrap, &input, before..before + 400, || {
        cluster.set_failpoints("p0", "cluster-sink-barrier=pause");
        // Past a few batches after p0 took the failpoint: its sinks
        // stopped at a barrier while records flowed.
        let failpoints = cluster.dir.join("p0.failpoints");
        while failpoints.exists() {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_secs(2));
    });
    // Wait until both commits stand still: the first at the epoch the sinks
    // stopped in, the second at the one before.
    let mut committed = (cluster.committed_input(), 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        std::thread::sleep(Duration::from_secs(3));
        let counted = cluster.read_to_end(&cluster.counts).len();
        let now = (cluster.committed_input(), counted);
        if now == committed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "p0 kept committing with its sinks held:\n{}",
            cluster.logs()
        );
        committed = now;
    }
    let (input_committed, counted) = committed;
    assert!(
        input_committed > counted as i64 && (counted as i64) < total as i64,
        "{}",
        summed_up(
            &format!(
                "with its sinks held at a barrier, p0 committed offsets of {input_committed} \
                 input records and the counts of {counted}: its first transaction waited for them"
            ),
            &cluster.logs()
        )
    );
    cluster.set_failpoints("p0", "cluster-sink-barrier=off");
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A run that rolls back because a transaction it read from aborted still
/// commits its own first transaction: the others read it before it
/// committed, and its abort would roll them back in turn, and theirs the
/// next, for as long as records flow. Only the process whose commit was
/// refused aborts a transaction.
#[cfg(feature = "failpoints")]
#[test]
fn a_run_rolled_back_by_another_process_abort_aborts_nothing_of_its_own() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    let aborts = |cluster: &Cluster, instance: &str| {
        (cluster.log(instance).lines())
            .filter(|l| l.contains("the open transaction aborts") && l.contains("(Sourced)"))
            .count()
    };
    let input = cluster.input.clone();
    let total = produce_during(&bootstrap, &input, 0..6_000, || {
        cluster.refuse_until_rolled_back("p1", &["p0"]);
    });
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(120));
    assert_eq!(
        aborts(&cluster, "p0"),
        0,
        "p0 rolled back and aborted nothing of its own:\n{}",
        cluster.logs()
    );
    assert!(
        aborts(&cluster, "p1") <= cluster.refusals("p1"),
        "p1 aborted only what was refused:\n{}",
        cluster.logs()
    );
    cluster.outputs(0, expected.len(), Duration::from_secs(60));
    cluster.stop_and_check_at_least_once(&expected);
}

/// A process whose commit is refused rolls back; its readers had read what
/// its writers produced into the aborted transaction. Its next run reads its
/// repartition partitions `read_committed` up to where every transaction had
/// ended, past those records, and does not roll back on them once more.
#[cfg(feature = "failpoints")]
#[test]
fn a_run_restarted_after_its_commit_was_refused_reads_past_its_own_aborted_records() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    cluster.spawn("p0");
    cluster.wait_for_shares(Duration::from_secs(90));
    let input = cluster.input.clone();
    let total = produce_during(&bootstrap, &input, 0..3_000, || {
        cluster.set_failpoints("p0", "checkpoint-commit=1*return(refused)->off");
        let deadline = Instant::now() + Duration::from_secs(60);
        while cluster.refusals("p0") < 1 {
            assert!(
                Instant::now() < deadline,
                "p0's commit was not refused:\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // The restarted run reads records on top of the aborted ones.
        std::thread::sleep(Duration::from_secs(2));
    });
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(120));
    assert!(
        !cluster.rolled_back("p0"),
        "p0 rolled back on its own aborted records:\n{}",
        cluster.logs()
    );
    cluster.outputs(0, expected.len(), Duration::from_secs(60));
    cluster.stop_and_check_at_least_once(&expected);
}

/// A process that joins takes its share from the others inside their runs,
/// and gives it back the same way when it leaves: each of the others hands
/// partitions over or takes them on at a barrier and runs on, with no
/// restart but the rollback of a run that read records of a commit the
/// rebalance refused, and every count comes out once, with late records dropped as
/// one process drops them.
#[test]
fn a_process_that_joins_and_leaves_moves_only_its_share_and_the_others_keep_running() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 8_000;
    let quarter = total / 4;
    let others = ["p0", "p1"];
    cluster.start(&others, 0..quarter, Duration::from_secs(90));
    let before = cluster.settled(&others, Duration::from_secs(2), Duration::from_secs(60));
    cluster.produce_late(6);
    produce(
        &bootstrap,
        &cluster.input,
        (quarter..2 * quarter).map(record),
    );
    cluster.spawn("p2");
    cluster.produce_late(6);
    produce(
        &bootstrap,
        &cluster.input,
        (2 * quarter..3 * quarter).map(record),
    );
    cluster.await_status(
        "p2",
        Duration::from_secs(90),
        "p2 took no share",
        |runs, share| runs > 0 && !share.is_empty(),
    );
    let joined = cluster.settled(
        &["p0", "p1", "p2"],
        Duration::from_secs(2),
        Duration::from_secs(60),
    );
    let mut moved = 0;
    for instance in others {
        let ((runs, share), (runs_before, share_before)) = (&joined[instance], &before[instance]);
        // A restart is the rollback of a run that read records of a commit
        // the rebalance refused (its transaction aborted): nothing else.
        assert!(
            runs == runs_before || cluster.rolled_back(instance),
            "{instance} restarted as p2 joined:\n{}",
            cluster.logs()
        );
        assert!(
            share.iter().all(|p| share_before.contains(p)) && !share.is_empty(),
            "{instance} ran {share_before:?}, then {share:?}:\n{}",
            cluster.logs()
        );
        moved += share_before.len() - share.len();
    }
    assert!(moved > 0, "nothing moved to p2: {joined:?}");

    cluster.stop_one("p2");
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, (3 * quarter..total).map(record));
    let deadline = Instant::now() + Duration::from_secs(60);
    while others
        .iter()
        .map(|i| cluster.status(i).1.len())
        .sum::<usize>()
        < before.values().map(|(_, share)| share.len()).sum()
    {
        assert!(
            Instant::now() < deadline,
            "p2's share was not taken back:\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for instance in others {
        assert!(
            cluster.status(instance).0 == before[instance].0 || cluster.rolled_back(instance),
            "{instance} restarted as p2 left:\n{}",
            cluster.logs()
        );
    }
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference_with_late(total, cluster.late);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A transaction left open on the changelog by a writer nobody fences holds
/// a restore until it ends: the state committed after it (a
/// `read_committed` reader sees none of it before then) is restored with
/// the offsets it went with. A restore that stopped waiting after 5 s once
/// resumed from those offsets without that state, and counts started again.
#[test]
fn a_restore_waits_for_a_changelog_transaction_left_open() {
    let Some(bootstrap) = bootstrap() else { return };
    let (cluster, open) = killed_with_a_changelog_transaction_left_open(&bootstrap);
    restarted_while_it_stays_open(cluster, &bootstrap, open);
}

/// Starts `p0` again and gives it the rest of the input; aborts `open` past
/// the 5 s after which a restore used to give up on it; checks that every
/// count comes out once.
fn restarted_while_it_stays_open(mut cluster: Cluster, bootstrap: &str, open: BaseProducer) {
    let total = RESTORED + 1_000;
    cluster.spawn("p0");
    produce(bootstrap, &cluster.input, (RESTORED..total).map(record));
    produce(bootstrap, &cluster.input, flush_records());
    std::thread::sleep(Duration::from_secs(8));
    open.abort_transaction(Duration::from_secs(30)).unwrap();
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A transaction left open right where a process's last restore ended (its
/// local copy's offset) holds its next restore too: the read finds no record
/// before it, and librdkafka may then tell no position. The restore took
/// that for the end and resumed the committed offsets without the state
/// committed behind the transaction, so counts went back (once in a whole
/// run of this file under load, and once under a broker crash); it now asks
/// the partition's last stable offset and waits.
#[test]
fn a_restore_waits_for_a_transaction_left_open_where_its_local_copy_ends() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let half = RESTORED / 2;
    cluster.start(&["p0"], 0..half, Duration::from_secs(90));
    // Restarted with nothing new to count: its restore reads the changelog
    // to its end and keeps that as its local copy.
    cluster.kill("p0");
    cluster.spawn("p0");
    cluster.wait_for_shares(Duration::from_secs(90));
    let open = leave_a_transaction_open(&bootstrap, &format!("rtflow-{}-changelog", cluster.query));
    produce(&bootstrap, &cluster.input, (half..RESTORED).map(record));
    let (counts, _) = cluster.outputs(RESTORED, 0, Duration::from_secs(90));
    assert!(counts.len() >= RESTORED, "no progress:\n{}", cluster.logs());
    cluster.kill("p0");
    restarted_while_it_stays_open(cluster, &bootstrap, open);
}

/// A restore that a changelog transaction left open outlasts fails its run
/// with `CHECKPOINT_FAILED`, naming the open transaction. With no retry
/// timeout, three such runs end the process. Given one, the process tries
/// again, later each time, and goes on once the transaction ended: nothing
/// is lost, every count comes out once.
#[test]
fn a_restore_outlasted_by_a_changelog_transaction_left_open_fails_naming_it() {
    let Some(bootstrap) = bootstrap() else { return };
    let (mut cluster, open) = killed_with_a_changelog_transaction_left_open(&bootstrap);
    let total = RESTORED + 1_000;
    cluster.restore_timeout = Some(Duration::from_secs(2));
    cluster.retry_timeout = Some(Duration::ZERO);
    cluster.spawn("p0");
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = cluster.children.get_mut("p0").unwrap().try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the restore did not give up:\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    cluster.children.remove("p0");
    assert!(!status.success(), "p0 ended well:\n{}", cluster.logs());
    let log = std::fs::read_to_string(cluster.dir.join("p0.log")).unwrap();
    assert!(
        log.contains("CHECKPOINT_FAILED") && log.contains("a transaction there stayed open"),
        "p0 did not fail naming the open transaction:\n{log}"
    );

    cluster.retry_timeout = Some(Duration::from_secs(120));
    cluster.spawn("p0");
    let failed_runs = |log: &str| log.matches("a transaction there stayed open").count();
    let before = failed_runs(&log);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let log = std::fs::read_to_string(cluster.dir.join("p0.log")).unwrap();
        if failed_runs(&log) >= before + 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restore did not fail again:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        cluster
            .children
            .get_mut("p0")
            .unwrap()
            .try_wait()
            .unwrap()
            .is_none(),
        "p0 gave up within its retry timeout:\n{}",
        cluster.logs()
    );
    open.abort_transaction(Duration::from_secs(30)).unwrap();
    produce(&bootstrap, &cluster.input, (RESTORED..total).map(record));
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// How many records [`killed_with_a_changelog_transaction_left_open`]
/// counted before its kill.
const RESTORED: usize = 2_000;

/// A cluster of one process, `p0`, killed after it counted [`RESTORED`]
/// records, half of them after a transaction of a producer nobody fences
/// began on every changelog partition; that transaction, still open.
fn killed_with_a_changelog_transaction_left_open(bootstrap: &str) -> (Cluster, BaseProducer) {
    let mut cluster = Cluster::new(bootstrap);
    let half = RESTORED / 2;
    cluster.start(&["p0"], 0..half, Duration::from_secs(90));
    let open = leave_a_transaction_open(bootstrap, &format!("rtflow-{}-changelog", cluster.query));
    produce(bootstrap, &cluster.input, (half..RESTORED).map(record));
    let (counts, _) = cluster.outputs(RESTORED, 0, Duration::from_secs(90));
    assert!(counts.len() >= RESTORED, "no progress:\n{}", cluster.logs());
    cluster.kill("p0");
    (cluster, open)
}

/// Begins a transaction of a producer no process of the query knows, with a
/// record in every partition of `topic`, and leaves it open.
fn leave_a_transaction_open(bootstrap: &str, topic: &str) -> BaseProducer {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", format!("{topic}-left-open"))
        .set("transaction.timeout.ms", "120000")
        .create()
        .unwrap();
    producer.init_transactions(Duration::from_secs(30)).unwrap();
    producer.begin_transaction().unwrap();
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let partitions = metadata.topics()[0].partitions().len() as i32;
    assert!(partitions > 0, "the changelog '{topic}' has no partitions");
    for partition in 0..partitions {
        producer
            .send(
                BaseRecord::to(topic)
                    .partition(partition)
                    .key("left open")
                    .payload("never committed"),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    producer
}

/// A process SIGKILLed and restarted under its name before its session
/// times out rejoins the groups as the static member it was: it takes back
/// the partitions it had, the others run on without a rebalance (their
/// shares unchanged, and no run restarted but to roll back past what they
/// read of the dead process's aborted transaction), and every count comes
/// out once. The session timeout is five minutes: a restart the groups took
/// for a newcomer would wait that long for the dead incarnation to time out
/// before it got any partition.
#[test]
fn a_process_restarted_under_its_name_takes_its_partitions_back_without_a_rebalance() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    cluster.session_timeout = Some(Duration::from_secs(300));
    let total = 6_000;
    let half = total / 2;
    let everyone = ["p0", "p1", "p2"];
    cluster.start(&everyone, 0..half, Duration::from_secs(90));
    let before = cluster.settled(&everyone, Duration::from_secs(3), Duration::from_secs(60));
    let rollbacks_before = ["p0", "p2"].map(|instance| cluster.rollback_restarts(instance));
    cluster.kill("p1");
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    cluster.spawn("p1");
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    let (counts, _) = cluster.outputs(
        expected_counts.len(),
        expected_windows.len(),
        Duration::from_secs(120),
    );
    assert!(
        counts.len() >= expected_counts.len(),
        "the output stalled after p1's restart:\n{}",
        cluster.logs()
    );
    for (instance, rollbacks_before) in ["p0", "p2"].into_iter().zip(rollbacks_before) {
        let (runs, share) = cluster.status(instance);
        assert_eq!(
            share,
            before[instance].1,
            "{instance} changed its share:\n{}",
            cluster.logs()
        );
        // The dead process's open transaction aborted: a reader of what it
        // wrote there (records, or a word of event time) rolls back.
        let rollbacks = cluster.rollback_restarts(instance) - rollbacks_before;
        assert!(
            runs <= before[instance].0 + rollbacks,
            "{instance} restarted its run {} times, {rollbacks} of them to roll back:\n{}",
            runs - before[instance].0,
            cluster.logs()
        );
    }
    assert_eq!(
        cluster.status("p1"),
        (1, before["p1"].1.clone()),
        "p1 did not take back what it had:\n{}",
        cluster.logs()
    );
    cluster.stop_and_check(&expected_counts, &expected_windows);
}

/// A static member whose instance id another member takes (as librdkafka's
/// own rejoin does when the group coordinator's broker dies: the previous
/// member id's requests come back `FENCED_INSTANCE_ID`, which it makes
/// fatal) lets its partitions go, joins the groups again and takes a share
/// again, and every count comes out once.
#[test]
fn a_member_fenced_by_its_instance_id_joins_again_and_counts_exactly_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 4_000;
    let half = total / 2;
    cluster.start(&["p0", "p1"], 0..half, Duration::from_secs(90));
    let (runs, _) = cluster.status("p0");
    let groups = [
        (format!("rtflow-{}", cluster.query), cluster.input.clone()),
        (
            format!("rtflow-{}-repartition", cluster.query),
            format!("rtflow-{}-0-repartition", cluster.query),
        ),
    ];
    for (group, topic) in groups {
        let intruder: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .set("group.instance.id", "p0")
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", "6000")
            .create()
            .unwrap();
        intruder.subscribe(&[&topic]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while intruder.assignment().unwrap().count() == 0 && Instant::now() < deadline {
            intruder.poll(Duration::from_millis(50));
        }
    }
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    produce(&bootstrap, &cluster.input, flush_records());
    cluster.await_status(
        "p0",
        Duration::from_secs(90),
        "p0 did not run again after its members were fenced",
        |now, share| now != runs && !share.is_empty(),
    );
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// Two live processes under one instance name: the second takes the name's
/// place in the groups, as a restart would, and the one it displaced ends
/// with `CLUSTER_INSTANCE_TAKEN` instead of taking the name back for ever
/// (each would fence the other's member and producer in turn, and nothing
/// would commit). The one that stays counts every record once.
#[test]
fn a_second_live_process_under_one_name_ends_one_of_them_with_a_typed_error() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 4_000;
    let half = total / 2;
    cluster.start(&["p0", "p1"], 0..half, Duration::from_secs(90));
    let mut first = cluster.children.remove("p0").unwrap();
    cluster.spawn_on(".elsewhere", "p0", "");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut displaced = loop {
        if first.try_wait().unwrap().is_some() {
            break first;
        }
        let second = cluster.children.get_mut("p0").unwrap();
        if second.try_wait().unwrap().is_some() {
            let second = cluster.children.insert("p0".into(), first).unwrap();
            break second;
        }
        assert!(
            Instant::now() < deadline,
            "both processes named p0 still run a minute later:\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!displaced.wait().unwrap().success());
    let logs = cluster.logs();
    assert!(
        logs.contains(
            "CLUSTER_INSTANCE_TAKEN: another live process joined the cluster as instance 'p0'"
        ),
        "the process displaced did not end with CLUSTER_INSTANCE_TAKEN:\n{logs}"
    );
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A process that dies while it is the only one, and whose session times out
/// before any other process starts, is in no survivor's memory: a newcomer
/// of another name reads its name from the query's instances topic and
/// fences it, rather than wait for the transaction it left open to time
/// out, and every count comes out once. Its name is then deleted: the next
/// newcomer has no one to fence.
#[test]
fn a_process_that_died_alone_is_fenced_by_a_newcomer_of_another_name() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 3_000;
    let third = total / 3;
    cluster.start(&["p0"], 0..third, Duration::from_secs(90));
    produce(&bootstrap, &cluster.input, (third..2 * third).map(record));
    cluster.kill("p0");
    // Past its session timeout (6 s): the groups have forgotten it.
    std::thread::sleep(Duration::from_secs(8));
    cluster.spawn("p1");
    produce(&bootstrap, &cluster.input, (2 * third..total).map(record));
    let (counts, _) = cluster.outputs(total, 0, Duration::from_secs(90));
    assert!(counts.len() >= total, "no progress:\n{}", cluster.logs());
    cluster.stop_one("p1");
    cluster.spawn("p2");
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
    let logs = cluster.logs();
    let fenced = |instance: &str| {
        logs.lines().any(|line| {
            line.contains("fenced a process that left the cluster")
                && line.contains(&format!("instance={instance} "))
        })
    };
    assert!(fenced("p0"), "p1 did not fence p0:\n{logs}");
    assert!(
        !fenced("p1"),
        "p1 stopped cleanly, yet p2 fenced it:\n{logs}"
    );
}

/// A static member that stops leaves the groups all the same: the other
/// process takes its partitions over long before its session (60 s) would
/// time out, and every count comes out once.
#[test]
fn a_process_that_stops_hands_its_partitions_over_before_its_session_times_out() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    cluster.session_timeout = Some(Duration::from_secs(60));
    let total = 4_000;
    let half = total / 2;
    cluster.start(&["p0", "p1"], 0..half, Duration::from_secs(90));
    cluster.stop_one("p1");
    let stopped = Instant::now();
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    produce(&bootstrap, &cluster.input, flush_records());
    cluster.await_status(
        "p0",
        Duration::from_secs(30).saturating_sub(stopped.elapsed()),
        "p0 did not take p1's partitions over",
        |_, share| share.len() >= 2 * PARTITIONS as usize,
    );
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// With a standby replica, the survivor of two processes keeps warm copies
/// of the other's changelog partitions; when the other is SIGKILLed and never
/// comes back, the survivor restores them from those copies plus the
/// changelog's tail, and every count still comes out once.
#[test]
fn a_dead_process_partitions_restore_from_a_standby_copy_exactly_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    cluster.standby_replicas = 1;
    let total = 4_000;
    let half = total / 2;
    let shares = cluster.start(&["p0", "p1"], 0..half, Duration::from_secs(90));
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    // Past the standby's save interval, so that its copies hold most of
    // p1's partitions.
    std::thread::sleep(Duration::from_secs(3));
    cluster.kill("p1");
    produce(&bootstrap, &cluster.input, flush_records());
    cluster.await_status(
        "p0",
        Duration::from_secs(60),
        "p0 did not take p1's partitions over",
        |_, share| share.len() >= 2 * PARTITIONS as usize,
    );
    // The restore of the partitions taken over read their state from the
    // copies; without them it reads every changelog partition from its start
    // (tens of kilobytes here against a state of about ten). The process
    // writes what it restored and what it owns one after the other: the
    // restore may show a moment later.
    let restored = || {
        let restore = std::fs::read_to_string(cluster.dir.join("p0.restore")).unwrap();
        let (changelog, local) = restore.split_once(' ').unwrap();
        let read: (u64, u64) = (changelog.parse().unwrap(), local.parse().unwrap());
        read
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while restored().1 == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (changelog, local) = restored();
    assert!(
        local > 0 && changelog < local,
        "p0 restored {changelog} bytes from the changelog and {local} from its copies \
         (partitions before the kill {shares:?}):\n{}",
        cluster.logs()
    );
    let logs = cluster.logs();
    assert!(
        logs.contains(r#""p1": "zone-p1""#),
        "p0 never read p1's rack from the group:\n{logs}"
    );
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A process frozen (SIGSTOP) for longer than the group's session timeout is
/// dropped from the group, which hands its partitions to the others. When it
/// thaws, what its run did before the freeze must not commit, since those
/// partitions run elsewhere now: it abandons the run, rejoins and takes a
/// share again, and every record counts once.
#[test]
fn a_process_frozen_past_its_session_abandons_what_it_lost_and_rejoins() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 6_000;
    let third = total / 3;
    cluster.start(&["p0", "p1", "p2"], 0..third, Duration::from_secs(90));
    produce(&bootstrap, &cluster.input, (third..2 * third).map(record));
    std::thread::sleep(Duration::from_millis(700));
    let (frozen_runs, _) = cluster.status("p1");
    cluster.signal("p1", "STOP");
    produce(&bootstrap, &cluster.input, (2 * third..total).map(record));
    // The session timeout is 6 s: p0 and p2 take p1's partitions over.
    std::thread::sleep(Duration::from_secs(10));
    cluster.signal("p1", "CONT");
    produce(&bootstrap, &cluster.input, flush_records());
    // Thawed, p1 learns that its session expired, abandons its run and
    // starts a new one over the share the group gives it back.
    cluster.await_status(
        "p1",
        Duration::from_secs(90),
        "p1 did not lose its partitions and rejoin",
        |runs, share| {
            let log = std::fs::read_to_string(cluster.dir.join("p1.log")).unwrap_or_default();
            runs > frozen_runs && !share.is_empty() && log.contains("partitions lost")
        },
    );
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
    // The others fenced p1's producers while it was frozen: it starts both
    // afresh once it learns its session expired, rather than fail its next
    // run's first transaction on one (and its stop, had it come then).
    let log = cluster.log("p1");
    let after_loss = &log[log.rfind("partitions lost").unwrap()..];
    assert!(
        !after_loss.contains("fenced by a newer instance"),
        "p1 ran on a fenced producer after it rejoined:\n{}",
        cluster.logs()
    );
}

/// A process that hangs (its first commit never ends) leaves the event time
/// of the source partitions it took over where their previous owner told it
/// last, and the watermark of every reader waits for them until the others
/// take them over after the kill. Records late for windows that closed in one
/// process arrive meanwhile, and again in the replay of the hung process's
/// partitions: they stay late.
#[cfg(feature = "failpoints")]
#[test]
fn late_records_stay_late_while_a_process_hangs_and_once_its_partitions_are_taken_over() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 1_200;
    produce(&bootstrap, &cluster.input, (0..total / 2).map(record));
    // p0 first: a process that hangs while it owns every partition holds
    // the rebalance that would hand them on.
    cluster.spawn("p0");
    cluster.wait_for_shares(Duration::from_secs(90));
    cluster.spawn_with_failpoints("p1", "checkpoint-commit=sleep(120000)");
    cluster.wait_for_shares(Duration::from_secs(90));
    let (counts, _) = cluster.outputs(50, 0, Duration::from_secs(90));
    assert!(counts.len() >= 50, "no progress:\n{}", cluster.logs());
    cluster.produce_late(12);
    // p0 reads the late records of its partitions, and of its key groups,
    // while p1 still hangs; it takes p1's partitions over once the group's
    // session times out after the kill.
    std::thread::sleep(Duration::from_secs(3));
    cluster.kill("p1");
    produce(&bootstrap, &cluster.input, (total / 2..total).map(record));
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference_with_late(total, cluster.late);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A run whose handover fails stops, and what it did since its last commit
/// is dropped: its transaction, open with the epoch's records, must not
/// commit with the next run, which does that work again. Every handover of
/// p0 fails (at its sinks, once they handed the epoch's records over); p0
/// takes p1's partitions on when p1 leaves, while records flow, so that the
/// failed epoch holds some.
#[cfg(feature = "failpoints")]
#[test]
fn a_run_that_fails_to_adopt_restarts_without_what_it_did_since_its_last_commit() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 6_000;
    let third = total / 3;
    produce(&bootstrap, &cluster.input, (0..third).map(record));
    cluster.spawn("p1");
    cluster.wait_for_shares(Duration::from_secs(90));
    cluster.spawn_with_failpoints("p0", "sink-hand-over=return(a handover failed)");
    cluster.wait_for_shares(Duration::from_secs(90));
    let input = cluster.input.clone();
    std::thread::scope(|scope| {
        let (bootstrap, input) = (&bootstrap, &input);
        scope.spawn(move || {
            for step in (third..total).step_by(50) {
                produce(bootstrap, input, (step..step + 50).map(record));
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        std::thread::sleep(Duration::from_secs(1));
        cluster.stop_one("p1");
    });
    let log = std::fs::read_to_string(cluster.dir.join("p0.log")).unwrap_or_default();
    assert!(
        log.contains("could not adopt partitions"),
        "p0 adopted p1's partitions:\n{}",
        cluster.logs()
    );
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// A process whose final checkpoint fails says so when it stops, rather than
/// leave as if its last records had committed; the next process to take its
/// place counts them once.
#[test]
fn a_final_checkpoint_that_fails_fails_the_stop() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let total = 3_000;
    let half = total / 2;
    produce(&bootstrap, &cluster.input, (0..half).map(record));
    cluster.spawn_failing_at_stop(
        "p0",
        "checkpoint-commit=return(the final checkpoint failed)",
    );
    cluster.wait_for_shares(Duration::from_secs(90));
    cluster.outputs(1, 0, Duration::from_secs(60));
    produce(&bootstrap, &cluster.input, (half..total).map(record));
    let log = cluster.stop_one_failing("p0");
    assert!(
        log.contains("the child did not leave cleanly: CHECKPOINT_FAILED")
            && log.contains("the final checkpoint failed"),
        "p0's stop did not return its final checkpoint's error:\n{log}"
    );
    cluster.spawn("p0");
    produce(&bootstrap, &cluster.input, flush_records());
    let (expected_counts, expected_windows) = reference(total);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

/// The bootstrap servers of the replicated three-broker cluster, if one runs.
fn replicated_bootstrap() -> Option<String> {
    let bootstrap = std::env::var("RTFLOW_KAFKA_CLUSTER_BOOTSTRAP").ok();
    if bootstrap.is_none() {
        eprintln!(
            "skipped: no replicated Kafka cluster; scripts/test.sh starts one \
             (RTFLOW_KAFKA_NODES=3 scripts/kafka.sh start)"
        );
    }
    bootstrap
}

/// Runs `scripts/kafka.sh <args>` on the replicated cluster whose first
/// broker listens at the first address of `bootstrap`.
fn kafka_sh(bootstrap: &str, args: &[&str]) {
    assert!(
        kafka_sh_succeeds(bootstrap, args),
        "kafka.sh {args:?} failed"
    );
}

/// Whether `scripts/kafka.sh <args>` succeeds, as [`kafka_sh`] runs it.
fn kafka_sh_succeeds(bootstrap: &str, args: &[&str]) -> bool {
    let port = bootstrap
        .split(',')
        .next()
        .and_then(|address| address.rsplit(':').next())
        .expect("a bootstrap address with a port");
    Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kafka.sh"))
        .args(args)
        .env("RTFLOW_KAFKA_NODES", "3")
        .env("RTFLOW_KAFKA_PORT", port)
        // A broker restarted beside the query's processes and the other
        // tests took over 60 s to answer on a loaded CI machine.
        .env("RTFLOW_KAFKA_START_TIMEOUT", "180")
        .stdout(Stdio::null())
        .status()
        .expect("scripts/kafka.sh runs")
        .success()
}

/// Hands every partition back to its preferred leader, so that leadership
/// is spread over the brokers again after an earlier crash moved it. A
/// broker that restarted lately may not be back in every partition's
/// in-sync replicas yet, which fails the election: it is tried for a minute.
fn elect_preferred_leaders(bootstrap: &str) {
    let args = [
        "tool",
        "org.apache.kafka.tools.LeaderElectionCommand",
        "--bootstrap-server",
        bootstrap,
        "--election-type",
        "PREFERRED",
        "--all-topic-partitions",
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !kafka_sh_succeeds(bootstrap, &args) {
        assert!(Instant::now() < deadline, "kafka.sh {args:?} failed");
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Calls `attempt` until it succeeds, for at most a minute.
fn until_ok<T, E: std::fmt::Debug>(what: &str, mut attempt: impl FnMut() -> Result<T, E>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match attempt() {
            Ok(value) => return value,
            Err(error) if Instant::now() < deadline => {
                eprintln!("{what}: {error:?}, retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(error) => panic!("{what}: {error:?} for a minute"),
        }
    }
}

/// The leader of each partition of `topic`, by partition.
fn leaders(client: &BaseConsumer, topic: &str) -> Vec<i32> {
    let metadata = client
        .fetch_metadata(Some(topic), Duration::from_secs(30))
        .unwrap();
    let mut partitions: Vec<(i32, i32)> = metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| (p.id(), p.leader()))
        .collect();
    partitions.sort();
    partitions.into_iter().map(|(_, leader)| leader).collect()
}

/// The first name `{prefix}{i}` whose id (`id_of` the name) broker `victim`
/// coordinates, given the leaders of the coordinators' topic by partition.
fn coordinated_by(
    victim: i32,
    coordinators: &[i32],
    prefix: &str,
    id_of: impl Fn(&str) -> String,
) -> String {
    (0..1000)
        .map(|i| format!("{prefix}{i}"))
        .find(|name| coordinators[coordinator_partition(&id_of(name))] == victim)
        .unwrap_or_else(|| panic!("broker {victim} coordinates none: leaders {coordinators:?}"))
}

/// The partition of `__transaction_state` or `__consumer_offsets` (4
/// partitions each, scripts/kafka.sh) whose leader coordinates the
/// transactions of the transactional id `id`, or the group `id`, as Kafka
/// picks it: Java's `String.hashCode`, made positive, modulo the count.
fn coordinator_partition(id: &str) -> usize {
    let hash = id
        .encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    let positive = if hash == i32::MIN { 0 } else { hash.abs() };
    positive as usize % 4
}

#[test]
fn three_processes_on_a_replicated_kafka_count_each_record_once_through_a_broker_crash() {
    let Some(bootstrap) = replicated_bootstrap() else {
        return;
    };
    let mut cluster = Cluster::running(&bootstrap, "counts-at-least-once");
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    // The transaction state topic exists once a transactional producer
    // began, the group metadata topic once a group's offsets were asked for.
    // On a fresh cluster both are created by these calls, and their
    // coordinators answer NOT_COORDINATOR until they have loaded.
    let warm = format!("{}-warm", cluster.input);
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("transactional.id", &warm)
        .create()
        .unwrap();
    until_ok("init_transactions", || {
        producer.init_transactions(Duration::from_secs(10))
    });
    drop(producer);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", &warm)
        .create()
        .unwrap();
    let mut input_partition = TopicPartitionList::new();
    input_partition.add_partition(&cluster.input, 0);
    until_ok("committed_offsets", || {
        consumer.committed_offsets(input_partition.clone(), Duration::from_secs(10))
    });
    drop(consumer);
    elect_preferred_leaders(&bootstrap);
    // The broker to kill leads the output, and coordinates the query's
    // group and the transactions of the process named for it.
    let victim = leaders(&client, &cluster.counts)[0];
    let groups = leaders(&client, "__consumer_offsets");
    let query = coordinated_by(victim, &groups, &format!("{}-q", cluster.input), |query| {
        format!("rtflow-{query}")
    });
    cluster.query = query;
    let transactions = leaders(&client, "__transaction_state");
    let third_name = coordinated_by(victim, &transactions, "p2-", |instance| {
        format!("rtflow-{}-{instance}", cluster.query)
    });
    let total = 6_000;
    let third = total / 3;
    cluster.start(
        &["p0", "p1", &third_name],
        0..third,
        Duration::from_secs(120),
    );
    for topic in [
        cluster.input.clone(),
        format!("rtflow-{}-0-repartition", cluster.query),
        format!("rtflow-{}-changelog", cluster.query),
    ] {
        assert!(
            leaders(&client, &topic).contains(&victim),
            "broker {victim} leads no partition of {topic}"
        );
    }

    produce(&bootstrap, &cluster.input, (third..2 * third).map(record));
    std::thread::sleep(Duration::from_millis(700));
    kafka_sh(&bootstrap, &["node", &victim.to_string(), "kill"]);
    produce(&bootstrap, &cluster.input, (2 * third..total).map(record));
    std::thread::sleep(Duration::from_secs(5));
    kafka_sh(&bootstrap, &["node", &victim.to_string(), "start"]);
    produce(&bootstrap, &cluster.input, flush_records());

    let (expected, _) = reference(total);
    cluster.await_counts_at_least_once(&expected, Duration::from_secs(180));
    cluster.outputs(0, expected.len(), Duration::from_secs(60));
    let exited: Vec<String> = cluster
        .children
        .iter_mut()
        .filter_map(|(instance, child)| child.try_wait().unwrap().map(|_| instance.clone()))
        .collect();
    assert!(
        exited.is_empty(),
        "{exited:?} exited through the broker's crash:\n{}",
        cluster.logs()
    );
    cluster.stop_and_check_at_least_once(&expected);
}

/// A failure's message: `summary`, the processes' `logs`, and `summary`
/// again, so that a report that keeps only a long message's first and last
/// lines still says what failed.
fn summed_up(summary: &str, logs: &str) -> String {
    format!("{summary}\n{logs}\n=== {summary}")
}

/// Sleeps past the next tick of `batch` (clustered epochs end on its
/// multiples since the Unix epoch) if it comes within `within`: a check that
/// no epoch commits meanwhile then has that long.
fn clear_of_the_next_tick(batch: Duration, within: Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let batch_ms = batch.as_millis();
    let to_tick = Duration::from_millis((batch_ms - now.as_millis() % batch_ms) as u64);
    if to_tick < within {
        std::thread::sleep(to_tick + Duration::from_secs(2));
    }
}

/// `output` holds every record of `expected` exactly once, and nothing else.
fn check(what: &str, output: &[String], expected: &BTreeMap<String, usize>, logs: &str) {
    let output = tally(output);
    let wrong: Vec<_> = output
        .iter()
        .filter(|(record, n)| expected.get(*record) != Some(n))
        .take(10)
        .collect();
    let missing: Vec<_> = expected
        .keys()
        .filter(|record| !output.contains_key(*record))
        .take(10)
        .collect();
    let summary = format!(
        "{what}: {} records, {} expected; unexpected or repeated {wrong:?}, missing {missing:?}",
        output.values().sum::<usize>(),
        expected.len()
    );
    assert!(
        wrong.is_empty() && missing.is_empty(),
        "{}",
        summed_up(&summary, logs)
    );
}

/// A process that runs the query's dataflow in the test's own process.
fn start_here(
    bootstrap: &str,
    cluster: &Cluster,
    instance: &str,
    metrics: SocketAddr,
    build_it: impl Fn(&Dataflow, &str, &str, &str, &str) + Send + 'static,
) -> rtflow::Result<ClusteredQuery> {
    let (b, i, c, w) = (
        bootstrap.to_owned(),
        cluster.input.clone(),
        cluster.counts.clone(),
        cluster.windows.clone(),
    );
    KafkaCluster::new(bootstrap)
        .instance(instance)
        .repartition_partitions(PARTITIONS as usize)
        .start(
            config(&cluster.query).metrics_address(metrics),
            move |flow| {
                build_it(flow, &b, &i, &c, &w);
                Ok(())
            },
        )
}

/// The query of [`build`], but summing event times instead of counting keys.
fn sum_per_key(flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, _: &str) {
    side(flow, bootstrap, input)
        .repartition_by(|e: &Event| e.key.clone())
        .sum(|e: &Event| e.time)
        .sink(
            KafkaSink::new(bootstrap, counts, |(key, sum): &(String, i64)| {
                KafkaMessage::new(format!("{key}:{sum}"))
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
}

#[test]
fn a_process_with_another_dataflow_cannot_join_and_is_told_the_difference() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let metrics = free_address();
    let first = start_here(&bootstrap, &cluster, "a", metrics, build).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Alone in the group, it runs every partition of both stages, and its
    // progress reports and /metrics say so.
    let all: Vec<String> = (0..PARTITIONS)
        .map(|p| format!("{}-{p}", cluster.input))
        .chain((0..PARTITIONS).map(|p| format!("rtflow-{}-0-repartition-{p}", cluster.query)))
        .collect();
    let mut sorted_all = all.clone();
    sorted_all.sort();
    loop {
        let progress = first.last_progress().and_then(|p| p.cluster);
        if let Some(progress) = progress.filter(|p| p.partitions.len() == all.len()) {
            assert_eq!(progress.member, "a");
            let mut partitions = progress.partitions;
            partitions.sort();
            assert_eq!(partitions, sorted_all);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no progress names the partitions"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let scraped = scrape(metrics);
    for partition in &all {
        let line = format!(
            "rtflow_cluster_partition_owned{{query=\"{}\",member=\"a\",partition=\"{partition}\"}} 1",
            cluster.query
        );
        assert!(scraped.contains(&line), "{line} not in\n{scraped}");
    }
    let error = start_here(&bootstrap, &cluster, "b", free_address(), sum_per_key)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(error.error_class(), "CLUSTER_SHAPE_MISMATCH", "{error}");
    let message = error.to_string();
    assert!(message.contains("process 'a'"), "{message}");
    assert!(
        message.contains("'count-0' (count)") && message.contains("(sum)"),
        "the first differing step is named: {message}"
    );
    // The running process is not disturbed by the one turned away.
    assert!(first.is_active());
    first.stop().unwrap();
}

/// A share handed over inside a run shows in the process's progress reports
/// and `/metrics` as it stands, not as the run began.
#[test]
fn a_share_handed_over_inside_the_run_shows_in_progress_and_metrics() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::new(&bootstrap);
    let metrics = free_address();
    let first = start_here(&bootstrap, &cluster, "a", metrics, build).unwrap();
    let all = 2 * PARTITIONS as usize;
    let deadline = Instant::now() + Duration::from_secs(60);
    while first.partitions().len() < all {
        assert!(Instant::now() < deadline, "a never ran every partition");
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.spawn("b");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let share = first.partitions().len();
        let reported = (first.last_progress().and_then(|p| p.cluster))
            .map(|progress| progress.partitions.len());
        let gauge = format!(
            "rtflow_cluster_partitions{{query=\"{}\",member=\"a\"}} {share}",
            cluster.query
        );
        if share < all && reported == Some(share) && scrape(metrics).contains(&gauge) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a owns {share} partitions, its progress says {reported:?}, its /metrics:\n{}",
            scrape(metrics)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    first.stop().unwrap();
    cluster.stop_all();
}

/// Two processes of different dataflows started in the same instant both
/// find the group empty before either joins. Each checks the members again
/// once it is one itself, before its first run: the later check sees the
/// other, so they never both run, and one that does not run fails with
/// `CLUSTER_SHAPE_MISMATCH`.
#[test]
fn two_processes_of_different_dataflows_started_at_once_never_both_run() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    produce(&bootstrap, &cluster.input, (0..60).map(record));
    type BuildIt = fn(&Dataflow, &str, &str, &str, &str);
    let go = std::sync::Barrier::new(2);
    let started: Vec<(&str, rtflow::Result<ClusteredQuery>)> = std::thread::scope(|scope| {
        let starts: Vec<_> = [("count", build as BuildIt), ("sum", sum_per_key)]
            .into_iter()
            .map(|(instance, build_it)| {
                let (bootstrap, cluster, go) = (&bootstrap, &cluster, &go);
                scope.spawn(move || {
                    go.wait();
                    let query = start_here(bootstrap, cluster, instance, free_address(), build_it);
                    (instance, query)
                })
            })
            .collect();
        starts.into_iter().map(|s| s.join().unwrap()).collect()
    });
    let mut ran: BTreeMap<&str, bool> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for (instance, query) in &started {
            if let Ok(query) = query {
                *ran.entry(instance).or_default() |= query.runs() > 0;
            }
        }
        assert!(
            ran.values().filter(|ran| **ran).count() < 2,
            "both processes ran, each its own dataflow"
        );
        let settled = started.iter().all(|(instance, query)| match query {
            Ok(query) => ran[instance] || !query.is_active(),
            Err(_) => true,
        });
        if settled {
            break;
        }
        assert!(Instant::now() < deadline, "neither ran nor failed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The one that runs goes on; the other does not start later.
    std::thread::sleep(Duration::from_secs(2));
    for (instance, query) in &started {
        match query {
            Ok(query) if ran[instance] => {
                assert!(query.is_active(), "{instance}: {:?}", query.exception());
                query.stop().unwrap();
            }
            Ok(query) => {
                let error = query
                    .exception()
                    .expect("a process that did not run failed");
                assert_eq!(error.error_class(), "CLUSTER_SHAPE_MISMATCH", "{error}");
            }
            Err(error) => {
                assert_eq!(error.error_class(), "CLUSTER_SHAPE_MISMATCH", "{error}");
            }
        }
    }
}

/// A process of an earlier rtflow version in the group, which could not read
/// this version's repartition words, turns a newer process away with
/// `CLUSTER_SHAPE_MISMATCH` naming both protocols, before it reads a record.
#[test]
fn a_process_of_an_earlier_protocol_in_the_group_turns_a_newer_one_away() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    // What a process of protocol 1 published, and how it named itself: its
    // dataflow's steps under their fingerprint, without a protocol line.
    let fingerprint = "00000000000000e1";
    let shapes = format!("rtflow-{}-shapes", cluster.query);
    KafkaAdmin::new(&bootstrap)
        .unwrap()
        .create_compacted_topic(&shapes)
        .unwrap();
    let steps = "key groups: 128\nstep 0: source of 6 partitions 'kafka-0' (kafka) reading []";
    produce(
        &bootstrap,
        &shapes,
        [(0, fingerprint.to_owned(), steps.as_bytes().to_vec())],
    );
    let earlier: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", format!("rtflow-{}", cluster.query))
        .set("client.id", format!("earlier.shape-{fingerprint}"))
        .create()
        .unwrap();
    earlier.subscribe(&[&cluster.input]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while earlier.assignment().unwrap().count() == 0 {
        assert!(
            Instant::now() < deadline,
            "the earlier process never joined"
        );
        earlier.poll(Duration::from_millis(100));
    }
    let error = start_here(&bootstrap, &cluster, "newer", free_address(), build)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(error.error_class(), "CLUSTER_SHAPE_MISMATCH", "{error}");
    let message = error.to_string();
    assert!(message.contains("process 'earlier'"), "{message}");
    assert!(
        message.contains("here cluster protocol: 3, there cluster protocol: 1"),
        "the protocols are named: {message}"
    );
}

/// Starts a clustered query of `build_it`'s dataflow that needs no broker to
/// be rejected.
fn rejected(build_it: impl Fn(&Dataflow) + Send + 'static) -> RtflowError {
    KafkaCluster::new("127.0.0.1:1")
        .start(config("rejected"), move |flow| {
            build_it(flow);
            Ok(())
        })
        .map(|_| ())
        .unwrap_err()
}

#[test]
fn a_key_by_within_one_process_is_rejected_in_a_clustered_query() {
    let error = rejected(|flow| {
        flow.source(MemorySource::<(String, i64)>::new(2))
            .key_by(|(key, _): &(String, i64)| key.clone())
            .count()
            .sink(MemorySink::new());
    });
    assert_eq!(error.error_class(), "INVALID_DATAFLOW");
    assert!(
        error.to_string().contains("shuffle with repartition_by"),
        "{error}"
    );
}

#[test]
fn a_source_the_cluster_cannot_share_out_is_rejected() {
    let error = rejected(|flow| {
        flow.source(MemorySource::<String>::new(2))
            .sink(MemorySink::new());
    });
    assert_eq!(error.error_class(), "INVALID_DATAFLOW");
    assert!(error.to_string().contains("read a Kafka topic"), "{error}");
}

/// Counts each key's events per tumbling window, the source partitions going
/// idle after 500 ms without a record.
fn windows_with_idleness(flow: &Dataflow, bootstrap: &str, input: &str, _: &str, windows: &str) {
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(event)
    .with_watermark_idle(
        |e: &Event| e.time,
        Duration::ZERO,
        Duration::from_millis(500),
    )
    .repartition_by(|e: &Event| e.key.clone())
    .window(Window::tumbling(WINDOW))
    .count()
    .sink(
        KafkaSink::new(
            bootstrap,
            windows,
            |(key, window, count): &(String, rtflow::operators::Window, u64)| {
                KafkaMessage::new(format!("{key}@{}:{count}", window.start))
            },
        )
        .delivery(DeliveryGuarantee::ExactlyOnce),
    );
}

/// One process "a" running [`windows_with_idleness`].
fn start_windows_with_idleness(bootstrap: &str, cluster: &Cluster) -> ClusteredQuery {
    start_here(
        bootstrap,
        cluster,
        "a",
        free_address(),
        windows_with_idleness,
    )
    .unwrap()
}

/// An input record: its partition, key and event time.
fn at(partition: i32, key: &str, time: i64) -> (i32, String, Vec<u8>) {
    (partition, key.to_owned(), time.to_string().into_bytes())
}

#[test]
fn a_silent_partition_goes_idle_and_lets_the_watermark_through_the_repartition() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    // The first records are there before the query starts: records that
    // reach a partition after its source partitions went idle may be late,
    // in one process too, depending on which partition is read first.
    // Partition 5 never receives a record.
    produce(
        &bootstrap,
        &cluster.input,
        (0..5).flat_map(|p| [at(p, "k1", 100), at(p, "k2", 10_000)]),
    );
    let running = start_windows_with_idleness(&bootstrap, &cluster);
    let read = |n: usize| cluster.read(&cluster.windows, n, Duration::from_secs(60));
    assert_eq!(read(10).len(), 10, "the first records were counted");
    // Once the watermark has reached 10 000 (partition 5 idle), a record of
    // the window [0, 1000) is late; one of the same key behind it is not.
    let deadline = Instant::now() + Duration::from_secs(60);
    let watermark = || {
        running
            .last_progress()
            .and_then(|p| p.event_time.get("watermark").cloned())
    };
    while watermark().is_none_or(|w| w.as_str() < "1970-01-01T00:00:10.000Z") {
        assert!(
            Instant::now() < deadline,
            "the watermark stayed at {:?}",
            watermark()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    produce(
        &bootstrap,
        &cluster.input,
        [at(0, "k1", 200), at(0, "k1", 20_000)],
    );
    let windows = read(11);
    running.stop().unwrap();
    assert!(
        windows.contains(&"k1@20000:1".to_owned()),
        "the record in time was counted: {windows:?}"
    );
    assert!(
        !windows.contains(&"k1@0:6".to_owned()),
        "the late record was dropped: {windows:?}"
    );
}

#[test]
fn records_ahead_of_their_partitions_watermark_count_whichever_repartition_reader_reads_first() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let running = start_windows_with_idleness(&bootstrap, &cluster);
    let deadline = Instant::now() + Duration::from_secs(60);
    while running.last_progress().is_none() {
        assert!(Instant::now() < deadline, "the query never reported");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Every source partition goes idle, and so does every repartition
    // partition. Then one source partition brings records of ten keys
    // (spread over the repartition's partitions, read by several readers)
    // and a watermark past their window: each record came before the
    // watermark on its lane, and counts, as in one process.
    std::thread::sleep(Duration::from_secs(2));
    let keys: Vec<String> = (0..10).map(|k| format!("k{k}")).collect();
    produce(
        &bootstrap,
        &cluster.input,
        keys.iter()
            .map(|key| at(0, key, 100))
            .chain([at(0, "k0", 10_000)]),
    );
    let windows = cluster.read(&cluster.windows, keys.len() + 1, Duration::from_secs(60));
    running.stop().unwrap();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|key| !windows.contains(&format!("{key}@0:1")))
        .collect();
    assert!(
        missing.is_empty(),
        "{missing:?} dropped as late: {windows:?}"
    );
    assert!(windows.contains(&"k0@10000:1".to_owned()), "{windows:?}");
}

#[test]
fn a_restarted_process_reports_the_watermark_its_windows_run_on() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let watermark_of = |query: &ClusteredQuery| {
        query
            .last_progress()
            .and_then(|p| p.event_time.get("watermark").cloned())
    };
    let await_watermark = |query: &ClusteredQuery, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while watermark_of(query).as_deref() != Some("1970-01-01T00:00:05.000Z") {
            assert!(
                Instant::now() < deadline,
                "{what}: the progress watermark stayed at {:?}",
                watermark_of(query)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let first = start_here(&bootstrap, &cluster, "a", free_address(), build).unwrap();
    produce(
        &bootstrap,
        &cluster.input,
        (0..PARTITIONS).map(|p| (p, "k1".to_owned(), b"5000".to_vec())),
    );
    await_watermark(&first, "the first run");
    first.stop().unwrap();
    drop(first);
    // Its source partitions deliver nothing now: the windows run on the
    // watermark the repartition restored, and the report says so.
    let second = start_here(&bootstrap, &cluster, "a", free_address(), build).unwrap();
    await_watermark(&second, "the restarted run");
    second.stop().unwrap();
}

#[test]
fn a_stateless_query_shared_by_two_processes_copies_each_record_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let copy = |flow: &Dataflow, bootstrap: &str, input: &str, output: &str, _: &str| {
        flow.source(
            KafkaSource::new(bootstrap)
                .subscribe([input])
                .starting_offsets(StartingOffsets::Earliest),
        )
        .map(|record: KafkaRecord| record.value_str().into_owned())
        .sink(
            KafkaSink::new(bootstrap, output, |value: &String| {
                KafkaMessage::new(value.clone())
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
    };
    let values = |from: usize, to: usize| {
        (from..to).map(|i| {
            (
                (i % PARTITIONS as usize) as i32,
                String::new(),
                i.to_string().into_bytes(),
            )
        })
    };
    let a = start_here(&bootstrap, &cluster, "a", free_address(), copy).unwrap();
    let b = start_here(&bootstrap, &cluster, "b", free_address(), copy).unwrap();
    produce(&bootstrap, &cluster.input, values(0, 600));
    let read = |n: usize, timeout: Duration| cluster.read(&cluster.counts, n, timeout);
    assert_eq!(read(600, Duration::from_secs(60)).len(), 600);
    let deadline = Instant::now() + Duration::from_secs(60);
    while a.partitions().is_empty() || b.partitions().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the two processes never shared the input"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // One leaves; the other takes its partitions over where it committed.
    b.stop().unwrap();
    produce(&bootstrap, &cluster.input, values(600, 1200));
    assert_eq!(read(1200, Duration::from_secs(60)).len(), 1200);
    a.stop().unwrap();
    // Whatever the last commits added is read too.
    let copied = read(1201, Duration::from_secs(3));
    let expected: BTreeMap<String, usize> = (0..1200).map(|i| (i.to_string(), 1)).collect();
    check("copy", &copied, &expected, "");
}

#[test]
fn a_process_restores_the_partitions_it_had_from_its_local_copy_and_the_changelog_tail() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let location = cluster.dir.join("a.checkpoints");
    let start = || {
        let (b, i, c) = (
            bootstrap.clone(),
            cluster.input.clone(),
            cluster.counts.clone(),
        );
        KafkaCluster::new(&bootstrap)
            .instance("a")
            .repartition_partitions(PARTITIONS as usize)
            .start(
                config(&cluster.query).checkpoint_location(&location),
                move |flow| {
                    count_per_key(flow, &b, &i, &c);
                    Ok(())
                },
            )
            .unwrap()
    };
    let restored = |query: &ClusteredQuery| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(restore) = query.last_restore() {
                return restore;
            }
            assert!(Instant::now() < deadline, "no run started");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let read = |n: usize, timeout: Duration| cluster.read(&cluster.counts, n, timeout);
    produce(&bootstrap, &cluster.input, (0..600).map(record));
    let first = start();
    assert_eq!(read(600, Duration::from_secs(60)).len(), 600);
    first.stop().unwrap();
    // The location's copies are the handle's until it is dropped.
    drop(first);
    // The second run reads the state from the changelog and keeps a copy.
    let second = start();
    let from_kafka = restored(&second);
    assert!(from_kafka.changelog_bytes > 0, "{from_kafka:?}");
    second.stop().unwrap();
    drop(second);
    // The third reads it from the copy; the changelog holds nothing newer.
    let third = start();
    let from_copy = restored(&third);
    assert!(from_copy.local_bytes > 0, "{from_copy:?}");
    assert_eq!(from_copy.changelog_bytes, 0, "{from_copy:?}");
    // And the counts go on from the restored state, each once.
    produce(&bootstrap, &cluster.input, (600..1200).map(record));
    assert_eq!(read(1200, Duration::from_secs(60)).len(), 1200);
    third.stop().unwrap();
    let counts = read(1201, Duration::from_secs(3));
    let (expected, _) = reference(1200);
    let expected = expected
        .into_iter()
        .filter(|(record, _)| !record.starts_with("flush"))
        .collect();
    check("count per key", &counts, &expected, "");
}

#[test]
fn a_key_by_after_a_repartition_is_rejected_in_a_clustered_query() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let rekeyed = |flow: &Dataflow, bootstrap: &str, input: &str, counts: &str, _: &str| {
        flow.source(KafkaSource::new(bootstrap).subscribe([input]))
            .map(event)
            .repartition_by(|e: &Event| e.key.clone())
            .as_ref()
            .key_by(|e: &Event| e.time)
            .count()
            .name("count per time")
            .sink(
                KafkaSink::new(bootstrap, counts, |(time, n): &(i64, u64)| {
                    KafkaMessage::new(format!("{time}:{n}"))
                })
                .delivery(DeliveryGuarantee::ExactlyOnce),
            );
    };
    let error = start_here(&bootstrap, &cluster, "a", free_address(), rekeyed)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(error.error_class(), "INVALID_DATAFLOW", "{error}");
    let message = error.to_string();
    assert!(
        message.contains("'count per time' keys the repartitioned stream again")
            && message.contains("repartition_by"),
        "{message}"
    );
}

#[test]
fn three_processes_count_through_two_repartitions_exactly_once_through_a_kill() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "chain");
    let total = 3_000;
    let third = total / 3;
    cluster.start(&["p0", "p1", "p2"], 0..third, Duration::from_secs(90));
    // Late for the second stage's windows, which closed long ago: dropped
    // there after the kill and the restart as in one process.
    produce(&bootstrap, &cluster.input, (third..2 * third).map(record));
    std::thread::sleep(Duration::from_millis(700));
    cluster.kill("p1");
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, (2 * third..total).map(record));
    std::thread::sleep(Duration::from_secs(3));
    cluster.spawn("p1");
    cluster.produce_late(6);
    produce(&bootstrap, &cluster.input, flush_records());
    let reshared = cluster.wait_for_shares(Duration::from_secs(90));
    // Every process owns the same partitions of both repartition topics.
    for (instance, partitions) in &reshared {
        let owned = |stage: usize| -> Vec<String> {
            let prefix = format!("rtflow-{}-{stage}-repartition-", cluster.query);
            let mut owned: Vec<String> = partitions
                .iter()
                .filter_map(|p| p.strip_prefix(&prefix).map(str::to_owned))
                .collect();
            owned.sort();
            owned
        };
        assert_eq!(owned(0), owned(1), "{instance}: {partitions:?}");
    }
    let (expected_counts, expected_windows) = chain_reference(total, cluster.late);
    cluster.await_and_check(&expected_counts, &expected_windows);
}

#[test]
fn the_four_stream_joins_run_clustered_exactly_once() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "joins");
    let right = right_topic(&cluster.input);
    KafkaAdmin::new(&bootstrap)
        .unwrap()
        .create_topic(&right, PARTITIONS)
        .unwrap();
    let (n, m) = (1_200, 900);
    produce(&bootstrap, &cluster.input, (0..n / 2).map(record));
    produce(&bootstrap, &right, (0..m / 2).map(right_record));
    for instance in ["p0", "p1"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    let (lines, _) = cluster.outputs(100, 0, Duration::from_secs(90));
    assert!(lines.len() >= 100, "no progress:\n{}", cluster.logs());
    // A third process takes partitions, and the joins' rows with them, over.
    cluster.spawn("p2");
    produce(&bootstrap, &cluster.input, (n / 2..n).map(record));
    produce(&bootstrap, &right, (m / 2..m).map(right_record));
    cluster.wait_for_shares(Duration::from_secs(90));
    produce(&bootstrap, &cluster.input, flush_records());
    produce(&bootstrap, &right, flush_records());
    let expected = joins_reference(n, m);
    for kind in ["inner", "left", "right", "full"] {
        assert!(
            expected
                .keys()
                .any(|line| line.starts_with(&format!("{kind}|"))),
            "the reference has {kind} rows"
        );
    }
    assert!(expected.keys().any(|line| line.ends_with("|-")));
    assert!(expected.keys().any(|line| line.contains("|-|")));
    cluster.await_and_check(&expected, &BTreeMap::new());
}

#[test]
fn drop_duplicates_runs_clustered_exactly_once_through_a_kill() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut cluster = Cluster::running(&bootstrap, "dedup");
    let total = 1_500;
    produce(&bootstrap, &cluster.input, (0..total).map(record));
    for instance in ["p0", "p1", "p2"] {
        cluster.spawn(instance);
    }
    cluster.wait_for_shares(Duration::from_secs(90));
    let (rows, _) = cluster.outputs(total / 3, 0, Duration::from_secs(90));
    assert!(rows.len() >= total / 3, "no progress:\n{}", cluster.logs());
    // Every record again: each a duplicate, or late once its key was forgotten.
    produce(&bootstrap, &cluster.input, (0..total / 2).map(record));
    cluster.kill("p2");
    produce(&bootstrap, &cluster.input, (total / 2..total).map(record));
    cluster.produce_late(6);
    std::thread::sleep(Duration::from_secs(2));
    cluster.spawn("p2");
    produce(&bootstrap, &cluster.input, flush_records());
    cluster.wait_for_shares(Duration::from_secs(90));
    let (expected_rows, expected_seconds) = dedup_reference(total);
    cluster.await_and_check(&expected_rows, &expected_seconds);
}

#[test]
fn a_clustered_sink_message_without_a_topic_fails_the_process_with_its_sink_error() {
    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    let nowhere = |flow: &Dataflow, bootstrap: &str, input: &str, _: &str, _: &str| {
        flow.source(
            KafkaSource::new(bootstrap)
                .subscribe([input])
                .starting_offsets(StartingOffsets::Earliest),
        )
        .map(|record: KafkaRecord| record.value_str().into_owned())
        .sink(
            KafkaSink::per_record_topic(bootstrap, |value: &String| {
                KafkaMessage::new(value.clone())
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
    };
    let running = start_here(&bootstrap, &cluster, "a", free_address(), nowhere).unwrap();
    produce(
        &bootstrap,
        &cluster.input,
        [(0, String::new(), b"x".to_vec())],
    );
    // Each run fails at the record; after three in a row the process gives up.
    let error = running
        .await_termination(Some(Duration::from_secs(120)))
        .unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED", "{error}");
    assert!(error.to_string().contains("names no topic"), "{error}");
}

/// The fault matrix's row for the build closure of a clustered query (see
/// tests/faults.rs): it fails where it runs, at the start (a panic or an
/// error) or in the runner that builds each run (a panic), with its class,
/// the user's message and the query's name; the handle keeps the error; and
/// a mended process counts every record waiting meanwhile exactly once.
#[test]
fn a_failing_build_closure_fails_the_process_and_a_mended_one_counts_exactly_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let Some(bootstrap) = bootstrap() else { return };
    let cluster = Cluster::new(&bootstrap);
    produce(&bootstrap, &cluster.input, (0..600).map(record));
    // Builds the dataflow, failing on call `fail_on` (the probe at the start
    // is call 1, the first run's call 2) by `fail`.
    let start = |fail_on: usize, fail: fn() -> rtflow::Result<()>| {
        let calls = Arc::new(AtomicUsize::new(0));
        let (b, i, c) = (
            bootstrap.clone(),
            cluster.input.clone(),
            cluster.counts.clone(),
        );
        KafkaCluster::new(&bootstrap)
            .instance("a")
            .repartition_partitions(PARTITIONS as usize)
            .start(config(&cluster.query), move |flow| {
                if calls.fetch_add(1, Ordering::SeqCst) + 1 == fail_on {
                    fail()?;
                }
                count_per_key(flow, &b, &i, &c);
                Ok(())
            })
    };
    let panics = || panic!("injected fault in the build closure");
    let errs = || {
        Err(RtflowError::InvalidConfiguration(
            "injected fault in the build closure".into(),
        ))
    };
    let place = format!("clustered query '{}'", cluster.query);
    let assert_names = |error: &RtflowError, class: &str| {
        assert_eq!(error.error_class(), class, "{error}");
        let text = error.to_string();
        assert!(
            text.contains("injected fault in the build closure"),
            "{text}"
        );
        assert!(text.contains(&place), "{text}");
    };
    for (fail, class) in [
        (panics as fn() -> _, "INVALID_DATAFLOW"),
        (errs, "INVALID_CONFIGURATION"),
    ] {
        let error = start(1, fail).map(|_| ()).unwrap_err();
        assert_names(&error, class);
    }
    let running = start(2, panics).unwrap();
    let error = running
        .await_termination(Some(Duration::from_secs(60)))
        .unwrap_err();
    assert_names(&error, "INVALID_DATAFLOW");
    assert_eq!(running.exception(), Some(error.clone()));
    assert_eq!(running.await_termination(Some(Duration::ZERO)), Err(error));
    assert!(!running.is_active());
    drop(running);

    let mended = start(0, errs).unwrap();
    let read = |n: usize, timeout: Duration| cluster.read(&cluster.counts, n, timeout);
    assert_eq!(read(600, Duration::from_secs(60)).len(), 600);
    mended.stop().unwrap();
    let (expected, _) = reference(600);
    let expected = expected
        .into_iter()
        .filter(|(record, _)| !record.starts_with("flush"))
        .collect();
    check(
        "count per key",
        &read(601, Duration::from_secs(3)),
        &expected,
        "",
    );
}

/// A step of a random [`Pipeline`] over the input's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Drops every record whose number is a multiple of this.
    Filter(i64),
    /// Maps key `k<n>` to `k<n % this>`.
    Rekey(u32),
    /// A repartition by key.
    Repartition,
    /// `drop_duplicates` by `(key, time)`: the flush records are the only
    /// duplicates.
    Dedup,
}

/// What a random [`Pipeline`] ends in, into the counts topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// A count per key, `key:n`.
    Count,
    /// A tumbling-window count per key, `key@start:n`.
    Window,
    /// The inner join with the right topic, `left|right` (flush rows left out).
    Join,
}

/// A random dataflow of the property test: steps, then an end. Every
/// output it makes is a function of the input alone (no record is late, as
/// every partition's event time only grows), so a batch reference checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pipeline {
    steps: Vec<Step>,
    end: End,
}

impl Step {
    fn apply(self, mut e: Event) -> Option<Event> {
        match self {
            Self::Filter(m) => (e.time / STEP_MS % m != 0).then_some(e),
            Self::Rekey(r) => {
                if let Some(n) = e.key.strip_prefix('k').and_then(|n| n.parse::<u32>().ok()) {
                    e.key = format!("k{}", n % r);
                }
                Some(e)
            }
            Self::Repartition | Self::Dedup => Some(e),
        }
    }
}

impl Pipeline {
    fn encode(&self) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|step| match step {
                Step::Filter(m) => format!("f{m}"),
                Step::Rekey(r) => format!("k{r}"),
                Step::Repartition => "r".to_owned(),
                Step::Dedup => "d".to_owned(),
            })
            .collect();
        let end = match self.end {
            End::Count => "c",
            End::Window => "w",
            End::Join => "j",
        };
        format!("{}-{end}", steps.join("."))
    }

    fn decode(text: &str) -> Self {
        let (steps, end) = text.rsplit_once('-').expect("steps-end");
        let steps = steps
            .split('.')
            .filter(|s| !s.is_empty())
            .map(|step| match step.split_at(1) {
                ("f", m) => Step::Filter(m.parse().unwrap()),
                ("k", r) => Step::Rekey(r.parse().unwrap()),
                ("r", _) => Step::Repartition,
                ("d", _) => Step::Dedup,
                other => panic!("no step {other:?}"),
            })
            .collect();
        let end = match end {
            "c" => End::Count,
            "w" => End::Window,
            "j" => End::Join,
            other => panic!("no end {other}"),
        };
        Self { steps, end }
    }

    fn build(&self, flow: &Dataflow, bootstrap: &str, input: &str, counts: &str) {
        let mut events = side(flow, bootstrap, input);
        for step in self.steps.clone() {
            events = match step {
                Step::Filter(_) | Step::Rekey(_) => events
                    .flat_map(move |e: Event| step.apply(e))
                    .name(format!("{step:?}")),
                Step::Repartition => events
                    .repartition_by(|e: &Event| e.key.clone())
                    .as_ref()
                    .clone(),
                Step::Dedup => events.drop_duplicates(|e: &Event| (e.key.clone(), e.time)),
            };
        }
        let lines = match self.end {
            End::Count => events
                .repartition_by(|e: &Event| e.key.clone())
                .count()
                .map(|(key, n): (String, u64)| format!("{key}:{n}")),
            End::Window => events
                .repartition_by(|e: &Event| e.key.clone())
                .window(Window::tumbling(WINDOW))
                .count()
                .map(
                    |(key, window, n): (String, rtflow::operators::Window, u64)| {
                        format!("{key}@{}:{n}", window.start)
                    },
                ),
            End::Join => {
                let right = side(flow, bootstrap, &right_topic(input));
                let key = |e: &Event| e.key.clone();
                events
                    .join(&right, key, key, JOIN_WINDOW)
                    .map(|(l, r): (Event, Event)| format!("{}|{}", row(&l), row(&r)))
                    .filter(|line: &String| !line.contains("flush"))
            }
        };
        lines.sink(
            KafkaSink::new(bootstrap, counts, |line: &String| {
                KafkaMessage::new(line.clone())
            })
            .delivery(DeliveryGuarantee::ExactlyOnce),
        );
    }

    /// The output over left records `0..n`, right records `0..m` and the
    /// flush records of both.
    fn reference(&self, n: usize, m: usize) -> BTreeMap<String, usize> {
        let as_event = |(_, key, value): (i32, String, Vec<u8>)| Event {
            key,
            time: String::from_utf8(value).unwrap().parse().unwrap(),
        };
        // What each dedup step saw: two of them in a row each keep a first.
        let mut seen = std::collections::BTreeSet::new();
        let events: Vec<Event> = (0..n)
            .map(record)
            .chain(flush_records())
            .map(as_event)
            .filter_map(|e| {
                self.steps.iter().enumerate().try_fold(e, |e, (at, step)| {
                    let e = step.apply(e)?;
                    let first = *step != Step::Dedup || seen.insert((at, e.key.clone(), e.time));
                    first.then_some(e)
                })
            })
            .collect();
        match self.end {
            End::Count => running_counts(events.into_iter().map(|e| e.key)),
            End::Window => running_counts(events.into_iter().map(|e| {
                let start = e.time - e.time % WINDOW.as_millis() as i64;
                format!("{}@{start}", e.key)
            })),
            End::Join => {
                let rights: Vec<Event> = (0..m).map(right_record).map(as_event).collect();
                let mut lines = BTreeMap::new();
                for l in events.iter().filter(|e| e.key != "flush") {
                    for r in rights.iter().filter(|r| {
                        l.key == r.key
                            && l.time - JOIN_WINDOW.before <= r.time
                            && r.time <= l.time + JOIN_WINDOW.after
                    }) {
                        lines.insert(format!("{}|{}", row(l), row(r)), 1);
                    }
                }
                lines
            }
        }
    }
}

/// What happens to the processes between two chunks of input.
#[derive(Debug, Clone, Copy)]
enum Change {
    Kill(usize),
    Spawn(usize),
}

fn pipelines() -> impl proptest::strategy::Strategy<Value = Pipeline> {
    use proptest::prelude::*;
    let step = prop_oneof![
        (2i64..5).prop_map(Step::Filter),
        (2u32..8).prop_map(Step::Rekey),
        Just(Step::Repartition),
        Just(Step::Dedup),
    ];
    let end = prop_oneof![Just(End::Count), Just(End::Window), Just(End::Join)];
    (proptest::collection::vec(step, 0..4), end).prop_map(|(steps, end)| Pipeline { steps, end })
}

fn changes() -> impl proptest::strategy::Strategy<Value = Vec<Change>> {
    use proptest::prelude::*;
    let change = prop_oneof![
        (0usize..3).prop_map(Change::Kill),
        (0usize..3).prop_map(Change::Spawn),
    ];
    proptest::collection::vec(change, 1..4)
}

/// Runs `pipeline` on three processes (`p0..p2`), input in chunks with
/// `changes` between them (a SIGKILL of a running process, unless it is the
/// last; a start of one not running), and checks its output against the
/// batch reference, exactly once.
fn run_pipeline(bootstrap: &str, pipeline: &Pipeline, changes: &[Change]) {
    let mut cluster = Cluster::running(bootstrap, &format!("prop:{}", pipeline.encode()));
    let right = right_topic(&cluster.input);
    KafkaAdmin::new(bootstrap)
        .unwrap()
        .create_topic(&right, PARTITIONS)
        .unwrap();
    let (n, m) = (600, 400);
    let chunks = changes.len() + 1;
    let chunk = |c: usize, total: usize| (c * total / chunks)..((c + 1) * total / chunks);
    let names = ["p0", "p1", "p2"];
    for name in names {
        cluster.spawn(name);
    }
    for (c, change) in std::iter::once(None)
        .chain(changes.iter().map(Some))
        .enumerate()
    {
        match change {
            Some(Change::Kill(p))
                if cluster.children.len() > 1 && cluster.children.contains_key(names[*p]) =>
            {
                cluster.kill(names[*p]);
            }
            Some(Change::Spawn(p)) if !cluster.children.contains_key(names[*p]) => {
                cluster.spawn(names[*p]);
            }
            _ => {}
        }
        produce(bootstrap, &cluster.input, chunk(c, n).map(record));
        produce(bootstrap, &right, chunk(c, m).map(right_record));
        std::thread::sleep(Duration::from_millis(1500));
    }
    produce(bootstrap, &cluster.input, flush_records());
    produce(bootstrap, &right, flush_records());
    cluster.wait_for_shares(Duration::from_secs(90));
    let expected = pipeline.reference(n, m);
    cluster.await_and_check(&expected, &BTreeMap::new());
}

#[test]
fn the_reference_of_two_dedups_in_a_row_keeps_what_one_keeps() {
    let dedups = |n| Pipeline {
        steps: vec![Step::Dedup; n],
        end: End::Window,
    };
    let once = dedups(1).reference(600, 0);
    assert!(!once.is_empty());
    assert_eq!(dedups(2).reference(600, 0), once);
}

#[test]
fn a_pipeline_encodes_to_what_a_child_decodes() {
    let pipeline = Pipeline {
        steps: vec![
            Step::Filter(3),
            Step::Rekey(4),
            Step::Repartition,
            Step::Dedup,
        ],
        end: End::Window,
    };
    assert_eq!(pipeline.encode(), "f3.k4.r.d-w");
    assert_eq!(Pipeline::decode(&pipeline.encode()), pipeline);
    let bare = Pipeline {
        steps: Vec::new(),
        end: End::Join,
    };
    assert_eq!(Pipeline::decode(&bare.encode()), bare);
}

/// Random dataflows of filters, rekeyings, repartitions and deduplications,
/// ending in a count, a window count or a stream join, run by three
/// processes through random kills and starts, each equal to its batch
/// reference, exactly once. `RTFLOW_CLUSTER_CASES` sets how many (3 by
/// default, each some 20-40 s).
#[test]
fn random_dataflows_run_clustered_exactly_once_through_kills_and_starts() {
    use proptest::test_runner::{Config, TestRunner};
    let Some(bootstrap) = bootstrap() else { return };
    let cases = std::env::var("RTFLOW_CLUSTER_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    let mut runner = TestRunner::new(Config {
        cases,
        // A failing case takes a minute; shrinking it would take an hour.
        max_shrink_iters: 0,
        ..Config::default()
    });
    runner
        .run(&(pipelines(), changes()), |(pipeline, changes)| {
            eprintln!("pipeline {} with {changes:?}", pipeline.encode());
            run_pipeline(&bootstrap, &pipeline, &changes);
            Ok(())
        })
        .unwrap();
}
