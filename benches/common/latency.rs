//! The load and the measurement of the Kafka latency benches: a producer that
//! paces records at a fixed rate, each stamped with its production time in a
//! header, and a `read_committed` consumer that times every output record
//! from that stamp, the latency a downstream application sees.

// Each bench compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseProducer, BaseRecord, DefaultProducerContext, Producer, ThreadedProducer,
};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The header holding the production time, microseconds since the Unix epoch.
pub const PRODUCED_US: &str = "produced-us";
/// The producer's pacing interval.
pub const TICK: Duration = Duration::from_millis(1);

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_micros() as u64
}

/// What the producer writes.
pub struct Load<'a> {
    pub bootstrap: &'a str,
    /// Records go round-robin over this many partitions.
    pub partitions: u64,
    pub record_bytes: u64,
    /// Whether each record carries its sequence number as its key, so that
    /// a keyed query sees every key once.
    pub keyed: bool,
    /// librdkafka settings (`key=value`) over the producer's own.
    pub options: &'a [(String, String)],
}

impl Load<'_> {
    /// Writes `rate` records/s to `topic` until `until`; returns how many it
    /// wrote.
    ///
    /// It sends with `linger.ms=0` and one request in flight per connection:
    /// at once when the broker has answered, batching what came meanwhile.
    /// librdkafka's default (a million requests in flight) sends a request per
    /// partition every millisecond at 10,000 records/s, which on a 2-core
    /// machine queued requests at the broker for hundreds of milliseconds.
    pub fn produce(&self, rate: u64, topic: &str, until: Instant) -> Result<u64, Error> {
        // Threaded: its own thread serves the delivery reports.
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", self.bootstrap)
            .set("linger.ms", "0")
            .set("max.in.flight.requests.per.connection", "1")
            .set("socket.nagle.disable", "true");
        for (key, value) in self.options {
            config.set(key, value);
        }
        let producer: ThreadedProducer<DefaultProducerContext> = config.create()?;
        let payload: String = (b'a'..=b'z')
            .cycle()
            .take(self.record_bytes as usize)
            .map(char::from)
            .collect();
        let started = Instant::now();
        let mut sent = 0;
        let mut key = String::new();
        loop {
            let now = Instant::now();
            if now >= until {
                break;
            }
            // Every tick sends the records due by now, stamped with one clock
            // read: a sleep and clock reads per record (system calls on this
            // VM) would cost more CPU at 10,000 records/s than the rest of the
            // producer.
            let due = ((now - started).as_secs_f64() * rate as f64) as u64 + 1;
            let stamp = now_us().to_string();
            while sent < due {
                let headers = OwnedHeaders::new().insert(Header {
                    key: PRODUCED_US,
                    value: Some(&stamp),
                });
                let mut record = BaseRecord::<str, _>::to(topic)
                    .partition((sent % self.partitions) as i32)
                    .payload(&payload)
                    .headers(headers);
                if self.keyed {
                    key.clear();
                    key.push_str(&sent.to_string());
                    record = record.key(key.as_str());
                }
                // A full local queue (a broker still warming up, seconds
                // behind) delays the record, whose stamp keeps the time it was
                // due.
                while let Err((error, unsent)) = producer.send(record) {
                    if error.rdkafka_error_code() != Some(RDKafkaErrorCode::QueueFull) {
                        return Err(format!("could not produce: {error}").into());
                    }
                    std::thread::sleep(TICK);
                    record = unsent;
                }
                sent += 1;
            }
            std::thread::sleep(TICK);
        }
        producer.flush(Duration::from_secs(30))?;
        Ok(sent)
    }
}

/// A record read back: when it was produced (microseconds since the Unix
/// epoch) and how long it took to come out (microseconds).
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub produced_us: u64,
    pub latency_us: u64,
}

/// Reads `partitions` partitions of `topic` from the start, `read_committed`,
/// until `expected` records arrived (set once the producer is done) or
/// `deadline`; returns how many arrived and a sample of each produced at or
/// after `measure_from_us`, in the order they arrived.
pub fn consume(
    bootstrap: &str,
    partitions: u64,
    options: &[(String, String)],
    topic: &str,
    expected: &AtomicU64,
    deadline: Instant,
    measure_from_us: u64,
) -> Result<(u64, Vec<Sample>), Error> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "rtflow-bench")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("socket.nagle.disable", "true")
        .set("fetch.wait.max.ms", "5");
    for (key, value) in options {
        config.set(key, value);
    }
    let consumer: BaseConsumer = config.create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions as i32 {
        assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut received = 0;
    let mut samples = Vec::new();
    while received < expected.load(Ordering::Acquire) && Instant::now() < deadline {
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let read_us = now_us();
        let message = message?;
        received += 1;
        let produced_us = message
            .headers()
            .and_then(|headers| headers.iter().find(|h| h.key == PRODUCED_US))
            .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<u64>().ok())
            .ok_or("an output record has no produced-us header")?;
        if produced_us >= measure_from_us {
            samples.push(Sample {
                produced_us,
                latency_us: read_us.saturating_sub(produced_us),
            });
        }
    }
    Ok((received, samples))
}

/// The `q` quantile (nearest rank) of `sorted` (µs, not empty) in milliseconds.
pub fn quantile_ms(sorted: &[u64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
}

/// The median of `latencies` (µs, any order, not empty) in milliseconds.
pub fn median_ms(latencies: &[u64]) -> f64 {
    let mut sorted = latencies.to_vec();
    sorted.sort_unstable();
    sorted[sorted.len() / 2] as f64 / 1000.0
}

/// Produces `message` to `partition` of `output`, with the key, value and
/// headers it was read with, as a hand-written relay does; a full local
/// queue waits for the broker, as backpressure.
pub fn forward(
    producer: &BaseProducer,
    message: &BorrowedMessage<'_>,
    output: &str,
    partition: i32,
) -> Result<(), Error> {
    let mut record = BaseRecord::<[u8], [u8]>::to(output).partition(partition);
    if let Some(key) = message.key() {
        record = record.key(key);
    }
    if let Some(payload) = message.payload() {
        record = record.payload(payload);
    }
    if let Some(headers) = message.headers() {
        record = record.headers(headers.detach());
    }
    while let Err((error, back)) = producer.send(record) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::QueueFull) {
            return Err(format!("a relay could not produce: {error}").into());
        }
        producer.poll(Duration::from_millis(1));
        record = back;
    }
    Ok(())
}
