//! A transaction commit for the benches' hand-written floors that does not
//! sleep: rust-rdkafka's `commit_transaction` flushes first, and its flush
//! polls a `BaseProducer` in slices of 100 ms that run out whole while a
//! message is in flight, adding up to 100 ms to every commit.

use std::time::{Duration, Instant};

use rdkafka::error::KafkaResult;
use rdkafka::producer::{BaseProducer, Producer};

/// Serves `producer`'s delivery reports until nothing is in flight, then
/// commits its transaction, whose own flush then returns at once.
pub fn commit_transaction(producer: &BaseProducer, timeout: Duration) -> KafkaResult<()> {
    let deadline = Instant::now() + timeout;
    while producer.in_flight_count() > 0 && Instant::now() < deadline {
        producer.poll(Duration::from_millis(1));
    }
    producer.commit_transaction(timeout)
}
