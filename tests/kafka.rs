//! The Kafka source and sink against a real Apache Kafka broker (started by
//! scripts/test.sh).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::kafka::{bootstrap, consume, produce, topic};
use common::{a_record_the_broker_refuses_fails, a_record_too_large_fails, config, TIMEOUT};
use rtflow::prelude::*;
use rtflow::runtime::metrics::{Role, SourceLag};
use rtflow::runtime::{Source, SourceContext, SourceOutput, SourceWaker};

/// `count` records per partition, valued "partition:sequence", keyed by sequence.
fn numbered(partitions: i32, count: usize) -> Vec<(i32, String, Vec<u8>)> {
    (0..count)
        .flat_map(|sequence| {
            (0..partitions).map(move |p| {
                (
                    p,
                    format!("k{sequence}"),
                    format!("{p}:{sequence}").into_bytes(),
                )
            })
        })
        .collect()
}

#[test]
fn kafka_to_kafka_delivers_every_record_in_partition_order() {
    let Some(bootstrap) = bootstrap() else { return };
    const PER_PARTITION: usize = 2000;
    let input = topic(&bootstrap, "rtflow-in", 3);
    let output = topic(&bootstrap, "rtflow-out", 3);
    produce(&bootstrap, &input, numbered(3, PER_PARTITION));

    let flow = Dataflow::new("kafka-to-kafka");
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(|record: KafkaRecord| {
        let value = record.value_str().to_uppercase();
        (
            record.partition,
            record.offset,
            record.key_str().into_owned(),
            value,
        )
    })
    .sink(KafkaSink::new(
        &bootstrap,
        &output,
        |(partition, offset, key, value): &(i32, i64, String, String)| {
            KafkaMessage::new(format!("seen {value}"))
                .key(key.clone())
                .partition(*partition)
                .header("source-offset", offset.to_string())
        },
    ));
    let query = flow.start(config("kafka-to-kafka")).unwrap();

    let read = consume(&bootstrap, &output, 3, 3 * PER_PARTITION, TIMEOUT);
    query.stop().unwrap();
    assert_eq!(read.len(), 3 * PER_PARTITION, "every record arrives");
    let mut next: HashMap<i32, usize> = HashMap::new();
    for record in &read {
        let sequence = next.entry(record.partition).or_insert(0);
        let expected = format!("seen {}:{sequence}", record.partition);
        assert_eq!(
            String::from_utf8_lossy(&record.value),
            expected,
            "partition order"
        );
        assert_eq!(record.key, format!("k{sequence}"));
        assert_eq!(
            record.headers,
            vec![("source-offset".into(), sequence.to_string().into_bytes())]
        );
        *sequence += 1;
    }
    assert_eq!(query.exception(), None);
    let metrics = query.metrics();
    assert_eq!(metrics.latency.processing.count, 3 * PER_PARTITION as u64);
    assert!(metrics.latency.source_queuing.count > 0);
}

/// Starts `source` -> memory sink and returns the values read within `wait_for`.
fn read_values(name: &str, source: KafkaSource, expected: usize) -> Vec<String> {
    let flow = Dataflow::new(name);
    let out = MemorySink::new();
    flow.source(source)
        .map(|record: KafkaRecord| record.value_str().into_owned())
        .sink(out.clone());
    let query = flow.start(config(name)).unwrap();
    out.wait_for(expected, TIMEOUT);
    // Anything beyond what was expected would show up by now.
    std::thread::sleep(Duration::from_millis(300));
    query.stop().unwrap();
    out.rows()
}

/// The reader sleeps parked, not inside librdkafka, so both a record and an
/// unpark (the coordinator's, when it sends a barrier or stops the query) end
/// a wait far longer than the test's timeout at once.
#[test]
fn an_idle_reader_wakes_for_a_record_and_for_an_unpark() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = topic(&bootstrap, "idle-reader", 1);
    let source = KafkaSource::new(&bootstrap)
        .subscribe([&topic])
        .starting_offsets(StartingOffsets::Earliest);
    assert_eq!(source.partitions().unwrap(), 1);
    let context = SourceContext {
        subtask: 0,
        parallelism: 1,
        partitions: vec![0],
        start_offsets: Default::default(),
        waker: SourceWaker::default(),
        lag: SourceLag::default(),
    };
    let mut reader = source.reader(&context).unwrap();
    let waker = context.waker.clone();
    let (polled, poll) = std::sync::mpsc::channel();
    let (next, go) = std::sync::mpsc::channel();
    let poller = std::thread::spawn(move || {
        waker.bind_current_thread();
        while let Ok(until_records) = go.recv() {
            let mut out = SourceOutput::new(16);
            // librdkafka's own events (a log line) may end a wait early too.
            while {
                reader.poll(&mut out, Duration::from_secs(3600)).unwrap();
                until_records && out.is_empty()
            } {}
            polled.send(16 - out.remaining()).unwrap();
        }
    });

    next.send(false).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    poller.thread().unpark();
    assert_eq!(poll.recv_timeout(TIMEOUT), Ok(0), "an unpark ends the wait");

    next.send(true).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    produce(&bootstrap, &topic, [(0, "k".into(), b"v".to_vec())]);
    assert_eq!(poll.recv_timeout(TIMEOUT), Ok(1), "a record ends the wait");
    drop(next);
    poller.join().unwrap();
}

#[test]
fn starting_offsets_are_honoured() {
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-offsets", 1);
    produce(
        &bootstrap,
        &input,
        (0..10).map(|i| (0, String::new(), format!("{i}").into_bytes())),
    );

    let offsets = HashMap::from([((input.clone(), 0), 6)]);
    let source = KafkaSource::new(&bootstrap)
        .subscribe([&input])
        .starting_offsets(StartingOffsets::Offsets(offsets));
    assert_eq!(read_values("offsets", source, 4), vec!["6", "7", "8", "9"]);

    // Latest: only what is appended after the start.
    let flow = Dataflow::new("latest");
    let out = MemorySink::new();
    flow.source(KafkaSource::new(&bootstrap).subscribe([&input]))
        .map(|record: KafkaRecord| record.value_str().into_owned())
        .sink(out.clone());
    let query = flow.start(config("latest")).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    produce(&bootstrap, &input, [(0, String::new(), b"new".to_vec())]);
    assert!(out.wait_for(1, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(out.rows(), vec!["new"]);
}

#[test]
fn record_fields_are_exposed() {
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-fields", 2);
    produce(
        &bootstrap,
        &input,
        [(1, "the-key".into(), b"the-value".to_vec())],
    );
    let flow = Dataflow::new("fields");
    let out = MemorySink::new();
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .sink(out.clone());
    let query = flow.start(config("fields")).unwrap();
    assert!(out.wait_for(1, TIMEOUT));
    query.stop().unwrap();
    let record = &out.records()[0];
    let value = &record.value;
    assert_eq!(
        (&*value.topic, value.partition, value.offset),
        (input.as_str(), 1, 0)
    );
    assert_eq!(value.key_str(), "the-key");
    assert_eq!(value.value_str(), "the-value");
    let (millis, kind) = value.timestamp.expect("a timestamp");
    assert_eq!(kind, rtflow::connectors::kafka::TimestampType::CreateTime);
    assert_eq!(
        record.meta.event_time, millis,
        "event time is the Kafka timestamp"
    );
    assert_eq!(record.meta.source_time, millis as u64 * 1_000_000);
}

#[test]
fn pattern_subscription_and_max_partitions() {
    let Some(bootstrap) = bootstrap() else { return };
    let a = topic(&bootstrap, "rtflow-pattern-a", 2);
    let b = topic(&bootstrap, "rtflow-pattern-b", 2);
    produce(
        &bootstrap,
        &a,
        [
            (0, String::new(), b"a0".to_vec()),
            (1, String::new(), b"a1".to_vec()),
        ],
    );
    produce(
        &bootstrap,
        &b,
        [
            (0, String::new(), b"b0".to_vec()),
            (1, String::new(), b"b1".to_vec()),
        ],
    );
    let pattern = format!("{}|{}", regex_escape(&a), regex_escape(&b));

    let flow = Dataflow::new("pattern");
    let out = MemorySink::new();
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe_pattern(pattern)
            .starting_offsets(StartingOffsets::Earliest)
            .max_partitions(2),
    )
    .name("topics")
    .map(|record: KafkaRecord| record.value_str().into_owned())
    .sink(out.clone());
    let query = flow.start(config("pattern")).unwrap();
    assert!(out.wait_for(4, TIMEOUT));
    let readers = query
        .metrics()
        .operators
        .iter()
        .filter(|o| o.operator == "topics")
        .count();
    query.stop().unwrap();
    assert_eq!(common::sorted(&out), vec!["a0", "a1", "b0", "b1"]);
    assert_eq!(readers, 2, "4 partitions dealt to at most 2 readers");
}

/// The reference documents' sizing: `maxPartitions` = 8 readers, then a shuffle
/// into 20 instances, takes 8 + 20 = 28 task slots.
#[test]
fn max_partitions_sets_the_readers_and_so_the_task_slots() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = topic(&bootstrap, "rtflow-slots", 12);
    let build = || {
        let flow = Dataflow::new("slots");
        flow.source(
            KafkaSource::new(&bootstrap)
                .subscribe([&topic])
                .max_partitions(8),
        )
        .key_by(|record: &KafkaRecord| record.partition)
        .count()
        .parallelism(20)
        .sink(MemorySink::new());
        flow
    };
    let error = build()
        .start(config("slots").task_slots(27))
        .expect_err("27 slots are too few");
    assert_eq!(error.error_class(), "INSUFFICIENT_TASK_SLOTS");
    assert!(error.to_string().contains("needs 28 task slots"), "{error}");
    let query = build().start(config("slots").task_slots(28)).unwrap();
    let readers = query
        .metrics()
        .operators
        .iter()
        .filter(|o| o.role == Role::Source)
        .count();
    query.stop().unwrap();
    assert_eq!(readers, 8);
}

fn regex_escape(text: &str) -> String {
    text.replace('.', "\\.")
}

#[test]
fn missing_topics_fail_at_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let flow = Dataflow::new("missing");
    flow.source(KafkaSource::new(&bootstrap).subscribe(["rtflow-no-such-topic"]))
        .sink(MemorySink::new());
    let error = flow.start(config("missing")).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(
        error
            .to_string()
            .contains("'rtflow-no-such-topic' does not exist"),
        "{error}"
    );

    let flow = Dataflow::new("missing-sink");
    flow.source(MemorySource::<String>::new(1))
        .sink(KafkaSink::new(
            &bootstrap,
            "rtflow-no-such-output",
            |v: &String| KafkaMessage::new(v.clone()),
        ));
    let error = flow.start(config("missing-sink")).unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED");
    assert!(
        error
            .to_string()
            .contains("'rtflow-no-such-output' does not exist"),
        "{error}"
    );
}

#[test]
fn an_unreachable_broker_fails_at_start_within_seconds() {
    if bootstrap().is_none() {
        return;
    }
    let started = Instant::now();
    let flow = Dataflow::new("unreachable");
    flow.source(
        KafkaSource::new("127.0.0.1:1")
            .subscribe(["anything"])
            .metadata_timeout(Duration::from_secs(2)),
    )
    .sink(MemorySink::new());
    let error = flow.start(config("unreachable")).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(
        error
            .to_string()
            .contains("check that the broker is running"),
        "{error}"
    );
    assert!(
        started.elapsed() < TIMEOUT,
        "no hang: {:?}",
        started.elapsed()
    );
}

#[test]
fn a_record_too_large_for_the_broker_fails_the_query() {
    let Some(bootstrap) = bootstrap() else { return };
    a_record_too_large_fails(&bootstrap, config("large"), DeliveryGuarantee::AtLeastOnce);
}

#[test]
fn a_record_the_broker_refuses_fails_the_query_with_its_delivery_error() {
    let Some(bootstrap) = bootstrap() else { return };
    a_record_the_broker_refuses_fails(
        &bootstrap,
        config("refused"),
        DeliveryGuarantee::AtLeastOnce,
    );
}

#[test]
fn unavailable_offsets_fail_unless_data_loss_is_allowed() {
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-loss", 1);
    produce(
        &bootstrap,
        &input,
        (0..3).map(|i| (0, String::new(), format!("{i}").into_bytes())),
    );
    let beyond = || StartingOffsets::Offsets(HashMap::from([((input.clone(), 0), 1_000)]));

    let flow = Dataflow::new("loss");
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(beyond()),
    )
    .sink(MemorySink::new());
    let query = flow.start(config("loss")).unwrap();
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(
        error.to_string().contains("fail_on_data_loss(false)"),
        "{error}"
    );

    let source = KafkaSource::new(&bootstrap)
        .subscribe([&input])
        .starting_offsets(beyond())
        .fail_on_data_loss(false);
    assert_eq!(read_values("loss-allowed", source, 3), vec!["0", "1", "2"]);
}

#[test]
fn unknown_options_are_rejected() {
    let Some(bootstrap) = bootstrap() else { return };
    let flow = Dataflow::new("options");
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe(["x"])
            .option("fetch.wait.max.ms", 5),
    )
    .sink(MemorySink::new());
    let error = flow.start(config("options")).unwrap_err();
    assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
    assert!(error.to_string().contains("prefix 'kafka.'"), "{error}");
}

/// Writes `(partition, timestamp in ms, value)` records with those timestamps
/// and waits until all are acknowledged.
fn produce_at(bootstrap: &str, topic: &str, records: impl IntoIterator<Item = (i32, i64, String)>) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    for (partition, ms, value) in records {
        let record = BaseRecord::<(), _>::to(topic)
            .partition(partition)
            .timestamp(ms)
            .payload(&value);
        producer.send(record).map_err(|(error, _)| error).unwrap();
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).unwrap();
}

/// A 3-partition topic whose partition `p` holds records "p:0" to "p:4", the
/// `i`th timestamped `base + i * (p + 1)` seconds, and `base` (ms): ten minutes
/// ago, well inside the broker's retention and timestamp limits.
fn timestamped_topic(bootstrap: &str, name: &str) -> (String, i64) {
    let topic = topic(bootstrap, name, 3);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let base = now / 1000 * 1000 - 600_000;
    produce_at(
        bootstrap,
        &topic,
        (0..3).flat_map(|p| {
            (0..5).map(move |i| (p, base + i64::from(i * (p + 1)) * 1000, format!("{p}:{i}")))
        }),
    );
    (topic, base)
}

fn values(partition: i32, sequences: std::ops::Range<i32>) -> Vec<String> {
    sequences.map(|i| format!("{partition}:{i}")).collect()
}

fn ordered(mut rows: Vec<String>) -> Vec<String> {
    rows.sort();
    rows
}

#[test]
fn a_starting_timestamp_starts_every_partition_at_its_first_record_at_or_after_it() {
    let Some(bootstrap) = bootstrap() else { return };
    let (input, base) = timestamped_topic(&bootstrap, "rtflow-timestamp");
    let from = |ms: i64| {
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(StartingOffsets::Timestamp(ms))
    };

    // Partitions 0 and 1 hold a record stamped exactly base + 2 s, partition 2
    // only a later one (base + 3 s).
    let expected = [values(0, 2..5), values(1, 1..5), values(2, 1..5)].concat();
    let read = read_values("timestamp-at", from(base + 2000), expected.len());
    assert_eq!(ordered(read), expected);

    // One millisecond later: partitions 0 and 1 move on to their next record.
    let expected = [values(0, 3..5), values(1, 2..5), values(2, 1..5)].concat();
    let read = read_values("timestamp-after", from(base + 2001), expected.len());
    assert_eq!(ordered(read), expected);

    // Before every record: everything.
    let expected = [values(0, 0..5), values(1, 0..5), values(2, 0..5)].concat();
    let read = read_values("timestamp-before", from(base - 1), expected.len());
    assert_eq!(ordered(read), expected);
}

#[test]
fn starting_timestamps_per_partition_and_unlisted_partitions_start_at_the_earliest() {
    let Some(bootstrap) = bootstrap() else { return };
    let (input, base) = timestamped_topic(&bootstrap, "rtflow-timestamps");
    let timestamps = HashMap::from([
        ((input.clone(), 0), base + 4000),
        ((input.clone(), 1), base + 1),
    ]);
    let source = KafkaSource::new(&bootstrap)
        .subscribe([&input])
        .starting_offsets(StartingOffsets::Timestamps(timestamps));
    let expected = [values(0, 4..5), values(1, 1..5), values(2, 0..5)].concat();
    let read = read_values("timestamps", source, expected.len());
    assert_eq!(ordered(read), expected);
}

#[test]
fn a_timestamp_after_every_record_fails_the_start_by_default() {
    let Some(bootstrap) = bootstrap() else { return };
    let (input, base) = timestamped_topic(&bootstrap, "rtflow-timestamp-error");
    let start = |name: &str, offsets: StartingOffsets| {
        let flow = Dataflow::new(name);
        flow.source(
            KafkaSource::new(&bootstrap)
                .subscribe([&input])
                .starting_offsets(offsets),
        )
        .sink(MemorySink::new());
        flow.start(config(name))
    };

    let late = base + 60_000;
    let error = start("timestamp-error", StartingOffsets::Timestamp(late)).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    let message = error.to_string();
    assert!(
        message.contains(&format!("of topic '{input}'")),
        "{message}"
    );
    assert!(
        message.contains(&format!("at or after the starting timestamp {late}")),
        "{message}"
    );
    assert!(
        message.contains("fail_on_unmatched_timestamp(false)"),
        "{message}"
    );

    // Only partition 1 has nothing that recent, and the error names it.
    let timestamps = HashMap::from([
        ((input.clone(), 0), base),
        ((input.clone(), 1), late),
        ((input.clone(), 2), base),
    ]);
    let error = start("timestamps-error", StartingOffsets::Timestamps(timestamps)).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(
        error.to_string().contains(&format!(
            "no record of partition 1 of topic '{input}' has a timestamp at or after the \
             starting timestamp {late}"
        )),
        "{error}"
    );
}

#[test]
fn a_timestamp_after_every_record_starts_at_the_end_when_unmatched_timestamps_may_not_fail() {
    let Some(bootstrap) = bootstrap() else { return };
    let (input, base) = timestamped_topic(&bootstrap, "rtflow-timestamp-latest");
    // After every record, those produced below (stamped now) included.
    let late = base + 3_600_000;
    let flow = Dataflow::new("timestamp-latest");
    let out = MemorySink::new();
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(StartingOffsets::Timestamp(late))
            .fail_on_unmatched_timestamp(false),
    )
    .map(|record: KafkaRecord| record.value_str().into_owned())
    .sink(out.clone());
    // Readers resolve their offsets as the query starts: what is produced after
    // `start` returns lies beyond them.
    let query = flow.start(config("timestamp-latest")).unwrap();
    produce(
        &bootstrap,
        &input,
        (0..3).map(|p| (p, String::new(), format!("{p}:new").into_bytes())),
    );
    assert!(out.wait_for(3, TIMEOUT));
    // Anything beyond what was expected would show up by now.
    std::thread::sleep(Duration::from_millis(300));
    query.stop().unwrap();
    assert_eq!(ordered(out.rows()), vec!["0:new", "1:new", "2:new"]);

    // Partition by partition: 0 matches a record, 1 has nothing that recent (not
    // even "1:new") and starts at the end, 2 is not listed and starts at the earliest.
    let timestamps = HashMap::from([
        ((input.clone(), 0), base + 4000),
        ((input.clone(), 1), late),
    ]);
    let source = KafkaSource::new(&bootstrap)
        .subscribe([&input])
        .starting_offsets(StartingOffsets::Timestamps(timestamps))
        .fail_on_unmatched_timestamp(false);
    let expected = [
        values(0, 4..5),
        vec!["0:new".into()],
        values(2, 0..5),
        vec!["2:new".into()],
    ]
    .concat();
    let read = read_values("timestamps-latest", source, expected.len());
    assert_eq!(ordered(read), expected);
}

#[test]
fn a_restored_query_continues_from_its_checkpoint_not_from_its_starting_timestamp() {
    let Some(bootstrap) = bootstrap() else { return };
    let (input, base) = timestamped_topic(&bootstrap, "rtflow-timestamp-restore");
    let config = config("timestamp-restore");
    let start = |ms: i64, out: &MemorySink<String>| {
        let flow = Dataflow::new("timestamp-restore");
        flow.source(
            KafkaSource::new(&bootstrap)
                .subscribe([&input])
                .starting_offsets(StartingOffsets::Timestamp(ms)),
        )
        .map(|record: KafkaRecord| record.value_str().into_owned())
        .sink(out.clone());
        flow.start(config.clone())
    };

    let first = MemorySink::new();
    let query = start(base + 2000, &first).unwrap();
    assert!(first.wait_for(11, TIMEOUT));
    query.checkpoint_now(TIMEOUT).unwrap();
    query.stop().unwrap();
    assert_eq!(
        ordered(first.rows()),
        [values(0, 2..5), values(1, 1..5), values(2, 1..5)].concat()
    );

    // A timestamp after every record would fail a first start; the restored query
    // starts from its checkpoint instead and reads only what came after it.
    produce(
        &bootstrap,
        &input,
        [(1, String::new(), b"1:after".to_vec())],
    );
    let second = MemorySink::new();
    let query = start(base + 3_600_000, &second).unwrap();
    assert!(second.wait_for(1, TIMEOUT));
    std::thread::sleep(Duration::from_millis(300));
    query.stop().unwrap();
    assert_eq!(second.rows(), vec!["1:after"]);
}

/// Waits until each of the query's `partitions` source partitions is
/// `records` behind its end; panics after the timeout.
fn wait_for_lag(query: &StreamingQuery, partitions: usize, records: u64) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let lag = query.metrics().source_lag;
        if lag.len() == partitions && lag.iter().all(|p| p.records == records) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the lag never reached {records} on {partitions} partitions: {lag:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Consumer lag is each partition's end minus its reader's position. It grows
/// while a blocked query reads nothing, as records keep arriving, shows in
/// progress reports as Spark's offsets behind latest, and falls to zero once
/// the query has read everything.
#[test]
fn consumer_lag_grows_while_the_query_is_blocked_and_falls_once_it_caught_up() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let Some(bootstrap) = bootstrap() else { return };
    let topic = topic(&bootstrap, "lag", 2);
    let held = Arc::new(AtomicBool::new(true));
    let out = MemorySink::new();
    let flow = Dataflow::new("lagging");
    let hold = held.clone();
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&topic])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .name("lagging-input")
    .map(move |record: KafkaRecord| {
        while hold.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        record.offset
    })
    .sink(out.clone());
    let query = flow
        .start(config("lagging").progress_interval(Duration::from_millis(100)))
        .unwrap();
    // Each reader reads its partition's one record and blocks in the map.
    produce(
        &bootstrap,
        &topic,
        (0..2).map(|p| (p, "k".into(), b"v".to_vec())),
    );
    wait_for_lag(&query, 2, 0);
    let blocked = (0..2).flat_map(|p| (0..300).map(move |_| (p, "k".into(), b"v".to_vec())));
    produce(&bootstrap, &topic, blocked);
    wait_for_lag(&query, 2, 300);
    let lag = query.metrics().source_lag;
    assert!(
        lag.iter()
            .all(|p| p.source == "lagging-input" && p.topic == topic),
        "{lag:?}"
    );
    let deadline = Instant::now() + TIMEOUT;
    let metrics = loop {
        let progress = query.last_progress().expect("progress every 100 ms");
        let metrics = progress.sources[0].metrics.clone();
        if metrics.get("maxOffsetsBehindLatest").map(String::as_str) == Some("300") {
            break metrics;
        }
        assert!(Instant::now() < deadline, "{}", progress.pretty_json());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(metrics["minOffsetsBehindLatest"], "300");
    assert_eq!(metrics["avgOffsetsBehindLatest"], "300.0");

    held.store(false, Ordering::Relaxed);
    wait_for_lag(&query, 2, 0);
    assert_eq!(common::wait_for_rows(&out, 602).len(), 602);
    query.stop().unwrap();
}
