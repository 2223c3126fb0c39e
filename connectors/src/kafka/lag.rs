//! Consumer lag of a [`KafkaSource`](super::KafkaSource): the end of each
//! partition its readers read, looked up on a thread of the source's own.
//!
//! A reader's position moves as it polls, but only the broker knows where a
//! partition ends, and a reader blocked by backpressure polls nothing: the
//! lag must keep growing then, as records keep arriving. So one thread per
//! source and query asks the partitions' leaders for their ends (ListOffsets,
//! as kafka-exporter and Burrow do; librdkafka's own figure stops moving once
//! its prefetch queue is full) every [`REFRESH`], and never a reader.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use rtflow_runtime::metrics::PartitionLag;
use rtflow_runtime::{Result, RtflowError};

/// How often the ends are looked up: once per scrape of a 1 s scrape interval.
const REFRESH: Duration = Duration::from_secs(1);

/// The looking-up thread's name.
const LAG_THREAD: &str = "rtflow-kafka-lag";

/// The thread that looks up the ends of the partitions the source's readers
/// read. Each reader holds it; the last one dropped tells it to stop.
pub(super) struct LagWatch {
    watched: Arc<Watched>,
}

#[derive(Default)]
struct Watched {
    partitions: Mutex<Vec<(String, i32, Arc<PartitionLag>)>>,
    stop: Mutex<bool>,
    stopped: Condvar,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl LagWatch {
    /// The watch `current` still names, or a new one asking through
    /// `consumer` (made only then), each answer awaited for at most `timeout`.
    pub(super) fn shared(
        current: &Mutex<Weak<LagWatch>>,
        consumer: impl FnOnce() -> Result<BaseConsumer>,
        timeout: Duration,
    ) -> Result<Arc<LagWatch>> {
        let mut current = lock(current);
        if let Some(watch) = current.upgrade() {
            return Ok(watch);
        }
        let consumer = consumer()?;
        let watched = Arc::new(Watched::default());
        std::thread::Builder::new()
            .name(LAG_THREAD.into())
            .spawn({
                let watched = watched.clone();
                move || look_up_ends(&consumer, &watched, timeout)
            })
            .map_err(|error| {
                RtflowError::InvalidConfiguration(format!(
                    "could not start the thread that looks up Kafka consumer lag: {error}"
                ))
            })?;
        let watch = Arc::new(LagWatch { watched });
        *current = Arc::downgrade(&watch);
        Ok(watch)
    }

    /// Looks up the end of `partition` of `topic` into `lag` from now on.
    pub(super) fn watch(&self, topic: &str, partition: i32, lag: Arc<PartitionLag>) {
        lock(&self.watched.partitions).push((topic.to_owned(), partition, lag));
    }

    /// Stops looking up the end of `partition` of `topic`.
    pub(super) fn unwatch(&self, topic: &str, partition: i32) {
        lock(&self.watched.partitions).retain(|(t, p, _)| (t.as_str(), *p) != (topic, partition));
    }
}

impl Drop for LagWatch {
    fn drop(&mut self) {
        // Not joined: while a broker is away, the thread may sit in a lookup
        // for up to its timeout (10 s by default), and a query's stop must not
        // wait for a figure nobody reads any more. It ends after that lookup.
        *lock(&self.watched.stop) = true;
        self.watched.stopped.notify_all();
    }
}

fn look_up_ends(consumer: &BaseConsumer, watched: &Watched, timeout: Duration) {
    loop {
        let partitions = lock(&watched.partitions).clone();
        let mut ends = TopicPartitionList::with_capacity(partitions.len());
        for (topic, partition, _) in &partitions {
            // A ListOffsets "timestamp" of -1 asks for the end: the high
            // watermark, or the last stable offset for the read_committed
            // isolation readers use by default.
            let _ = ends.add_partition_offset(topic, *partition, Offset::End);
        }
        if !partitions.is_empty() {
            match consumer.offsets_for_times(ends, timeout) {
                Ok(ends) => {
                    for (topic, partition, lag) in &partitions {
                        let end = ends.find_partition(topic, *partition);
                        if let Some(Offset::Offset(end)) = end
                            .filter(|end| end.error().is_ok())
                            .map(|end| end.offset())
                        {
                            lag.set_end(end);
                        }
                    }
                }
                // The lag keeps its last figure; the readers report a broker
                // that stays away.
                Err(error) => tracing::debug!(%error, "could not look up partition ends"),
            }
        }
        let stop = lock(&watched.stop);
        let (stop, _) = watched
            .stopped
            .wait_timeout_while(stop, REFRESH, |stop| !*stop)
            .unwrap_or_else(|p| p.into_inner());
        if *stop {
            return;
        }
    }
}
