//! One consumer per source and process, a queue per partition: what the
//! readers of the Kafka source and of a cluster's repartition share.
//!
//! A consumer per reader fetched, woke and polled per partition, which cost
//! the broker and the process CPU in proportion to the partitions read. Now
//! the readers of one source share a consumer ([`SharedConsumer`]): one fetch
//! session and one set of librdkafka threads serve every partition, and each
//! reader polls the queues of its own partitions ([`PartitionQueues`]). The
//! last reader to let go of the consumer closes it off its thread.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, DefaultConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use rdkafka::Message;
use rdkafka::{Offset, TopicPartitionList};
use rtflow_runtime::{RtflowError, SourceWaker};

use super::closing::drop_off_thread;

/// The consumer the readers of one source share, while one of them holds it.
#[derive(Default)]
pub(crate) struct SharedConsumer(Mutex<Weak<BaseConsumer>>);

impl SharedConsumer {
    /// The consumer the readers hold, else a new one from `create`.
    pub(crate) fn get<E>(
        &self,
        create: impl FnOnce() -> Result<BaseConsumer, E>,
    ) -> Result<Arc<BaseConsumer>, E> {
        let mut shared = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(consumer) = shared.upgrade() {
            return Ok(consumer);
        }
        let consumer = Arc::new(create()?);
        *shared = Arc::downgrade(&consumer);
        Ok(consumer)
    }
}

/// A reader's partitions of a shared consumer, each with its own queue,
/// assigned while the reader lives.
pub(crate) struct PartitionQueues {
    /// The queue of each partition, in the order they were given.
    queues: Vec<PartitionQueue<DefaultConsumerContext>>,
    /// The queue to poll first, so that no partition starves the others.
    next: usize,
    /// The shared consumer; taken when the reader drops.
    consumer: Option<Arc<BaseConsumer>>,
    assignment: TopicPartitionList,
}

impl PartitionQueues {
    /// Assigns `partitions` (topic, partition, the offset to read from) of
    /// `consumer`; `waker` is woken when one of their queues, empty, receives
    /// a record or an error.
    pub(crate) fn assign(
        consumer: Arc<BaseConsumer>,
        partitions: &[(&str, i32, i64)],
        waker: &SourceWaker,
    ) -> KafkaResult<Self> {
        let mut queues = Vec::with_capacity(partitions.len());
        let mut assignment = TopicPartitionList::new();
        for (topic, partition, offset) in partitions {
            // Split before the partition is assigned, so that none of its
            // records reaches the consumer's own queue.
            let mut queue = consumer
                .split_partition_queue(topic, *partition)
                .ok_or_else(|| {
                    KafkaError::Subscription(format!("no partition {partition} of '{topic}'"))
                })?;
            // The reader waits parked, not inside librdkafka: a barrier's
            // unpark must end the wait at once, and a poll waits out its whole
            // timeout. librdkafka calls this from its own threads.
            let waker = waker.clone();
            queue.set_nonempty_callback(move || waker.wake());
            queues.push(queue);
            assignment.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
        }
        consumer.incremental_assign(&assignment)?;
        Ok(Self {
            queues,
            next: 0,
            consumer: Some(consumer),
            assignment,
        })
    }

    /// The next record or error of the partitions, round robin, with the
    /// index of its partition; else an event of the shared consumer (a record
    /// there is [`stray`]).
    pub(crate) fn poll(&mut self) -> Option<(Option<usize>, KafkaResult<BorrowedMessage<'_>>)> {
        let count = self.queues.len();
        let queues = &self.queues;
        let found = (0..count)
            .map(|k| (self.next + k) % count)
            .find_map(|i| Some((i, queues[i].poll(Duration::ZERO)?)));
        if let Some((i, polled)) = found {
            self.next = (i + 1) % count;
            return Some((Some(i), polled));
        }
        // Each queue was split before its partition was assigned, which leaves
        // the consumer's own queue only the client's events, such as errors.
        self.consumer
            .as_ref()
            .expect("held until dropped")
            .poll(Duration::ZERO)
            .map(|polled| (None, polled))
    }
}

impl Drop for PartitionQueues {
    fn drop(&mut self) {
        if let Some(consumer) = self.consumer.take() {
            // The consumer may outlive the reader, in another reader's hands.
            let _ = consumer.incremental_unassign(&self.assignment);
            // The last reader to drop closes it, off the run's path.
            drop_off_thread((std::mem::take(&mut self.queues), consumer));
        }
    }
}

/// The error for a record polled from the shared consumer's own queue: it
/// may be another reader's, so the run fails (and restarts from its last
/// checkpoint) rather than lose it or count it under the wrong partition.
pub(crate) fn stray(source: &str, message: &BorrowedMessage<'_>) -> RtflowError {
    RtflowError::source(
        source,
        format!(
            "record {} of {}-{} reached the shared consumer's own queue, not its partition's",
            message.offset(),
            message.topic(),
            message.partition()
        ),
    )
}
