//! Kafka helpers: the broker that scripts/test.sh started, fresh topics, and a
//! plain rdkafka producer and consumer to feed and check queries independently of
//! rtflow's own connectors.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rtflow::prelude::KafkaAdmin;

/// The broker's address, or `None` (test skipped) outside CI when no broker was
/// started. In CI a missing broker fails the test: Kafka tests never skip there.
pub fn bootstrap() -> Option<String> {
    match std::env::var("RTFLOW_KAFKA_BOOTSTRAP") {
        Ok(bootstrap) => Some(bootstrap),
        Err(_) if std::env::var_os("CI").is_some() => {
            panic!("RTFLOW_KAFKA_BOOTSTRAP is not set: run the tests with scripts/test.sh")
        }
        Err(_) => {
            eprintln!("skipped: no Kafka broker; run scripts/test.sh to start one");
            None
        }
    }
}

/// A new topic with a name no other test uses.
pub fn topic(bootstrap: &str, name: &str, partitions: i32) -> String {
    topic_with(bootstrap, name, partitions, &[])
}

/// A new topic, as [`topic`], with the topic-level settings `config`.
pub fn topic_with(bootstrap: &str, name: &str, partitions: i32, config: &[(&str, &str)]) -> String {
    let topic = unique(name);
    KafkaAdmin::new(bootstrap)
        .unwrap()
        .create_topic_with(&topic, partitions, config)
        .unwrap();
    await_metadata(bootstrap, &topic, partitions);
    topic
}

/// Waits until the broker's metadata holds `topic` with its partitions: a
/// query started right after the topic was made once found none ("does not
/// exist") on a broker that had just started.
fn await_metadata(bootstrap: &str, topic: &str, partitions: i32) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let known = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()
            .and_then(|metadata| {
                let entry = metadata.topics().iter().find(|t| t.name() == topic)?;
                Some(entry.error().is_none() && entry.partitions().len() == partitions as usize)
            });
        if known == Some(true) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "topic '{topic}' never showed in the metadata"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A new one-partition compacted topic (an exactly-once sink's commit topic)
/// with a name no other test uses.
pub fn compacted_topic(bootstrap: &str, name: &str) -> String {
    let topic = unique(name);
    KafkaAdmin::new(bootstrap)
        .unwrap()
        .create_compacted_topic(&topic)
        .unwrap();
    topic
}

fn unique(name: &str) -> String {
    // Tests start together on threads of one process, and the clock of a VM
    // can give two of them the same reading: two tests once shared a query
    // (and its shape check) that way. The count tells them apart.
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}-{made}", std::process::id())
}

/// An idempotent producer: retries through a broker's crash write each
/// record once.
pub fn producer(bootstrap: &str) -> BaseProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .set("enable.idempotence", "true")
        .create()
        .unwrap()
}

/// Writes `(partition, key, value)` records and waits until all are acknowledged.
pub fn produce(
    bootstrap: &str,
    topic: &str,
    records: impl IntoIterator<Item = (i32, String, Vec<u8>)>,
) {
    let producer = producer(bootstrap);
    for (partition, key, value) in records {
        let record = BaseRecord::to(topic)
            .partition(partition)
            .key(&key)
            .payload(&value);
        send(&producer, record);
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).unwrap();
}

/// Sends `record`, waiting while the producer's queue is full.
pub fn send<K, P>(producer: &BaseProducer, mut record: BaseRecord<'_, K, P>)
where
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    while let Err((error, back)) = producer.send(record) {
        assert!(
            matches!(
                error,
                rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::QueueFull
                )
            ),
            "{error}"
        );
        producer.poll(Duration::from_millis(10));
        record = back;
    }
}

/// One record as read back by the plain consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub value: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// A read_committed consumer assigned to `topic`'s partitions from the beginning.
pub fn reader(bootstrap: &str, topic: &str, partitions: i32) -> BaseConsumer {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "rtflow-tests")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    consumer
}

fn to_read(message: &BorrowedMessage<'_>) -> Read {
    Read {
        partition: message.partition(),
        offset: message.offset(),
        key: String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned(),
        value: message.payload().unwrap_or_default().to_vec(),
        headers: message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Reads `topic` from the beginning (read_committed) until `count` records arrived
/// or `timeout` passed. A broker that cannot be reached for a while (it
/// restarts, or a test crashed it) only delays the read: the consumer's errors
/// are printed and it polls on.
pub fn consume(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Read> {
    let consumer = reader(bootstrap, topic, partitions);
    let deadline = Instant::now() + timeout;
    let mut read = Vec::new();
    while read.len() < count && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(message)) => read.push(to_read(&message)),
            Some(Err(error)) => eprintln!("reading {topic}: {error}; polling on"),
            None => {}
        }
    }
    read
}

/// Reads the one partition of `topic` (read_committed) up to the end it had when
/// called: every committed record, and nothing left waiting.
pub fn consume_to_end(bootstrap: &str, topic: &str, timeout: Duration) -> Vec<Read> {
    let consumer = reader(bootstrap, topic, 1);
    let (start, end) = consumer.fetch_watermarks(topic, 0, timeout).unwrap();
    if start >= end {
        return Vec::new();
    }
    let deadline = Instant::now() + timeout;
    let mut read = Vec::new();
    loop {
        if let Some(message) = consumer.poll(Duration::from_millis(50)) {
            read.push(to_read(&message.unwrap()));
        }
        let position = consumer.position().unwrap();
        let position = position
            .find_partition(topic, 0)
            .and_then(|p| p.offset().to_raw());
        if position.is_some_and(|p| p >= end) {
            return read;
        }
        assert!(
            Instant::now() < deadline,
            "{topic} not read to offset {end} in {timeout:?}"
        );
    }
}

/// Records `from..to`, round-robin over 3 partitions, keyed by `k{i % 10}`:
/// the input of the exactly-once count per key.
pub fn keyed_records(from: usize, to: usize) -> Vec<(i32, String, Vec<u8>)> {
    (from..to)
        .map(|i| {
            (
                (i % 3) as i32,
                format!("k{}", i % 10),
                i.to_string().into_bytes(),
            )
        })
        .collect()
}

/// Every `key:count` a correct count per key emits for `keyed_records(0, n)`,
/// once each.
pub fn expected_key_counts(n: usize) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for i in 0..n {
        *counts.entry(format!("k{}", i % 10)).or_insert(0u64) += 1;
    }
    counts
        .into_iter()
        .flat_map(|(key, n)| (1..=n).map(move |c| (format!("{key}:{c}"), 1)))
        .collect()
}
