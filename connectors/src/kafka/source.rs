//! [`KafkaSource`]: long-running readers over manually assigned topic partitions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use regex::Regex;
use rtflow_runtime::cluster::Membership;
use rtflow_runtime::connector::Offsets;
use rtflow_runtime::metrics::{PartitionLag, SourceLag};
use rtflow_runtime::record::now_nanos;
use rtflow_runtime::ReaderHandover;
use rtflow_runtime::{
    Result, RtflowError, Source, SourceContext, SourceOutput, SourceReader, SourceStatus,
};

use super::closing::ClosingConsumer;
use super::lag::LagWatch;
use super::metadata;
use super::{KafkaRecord, Options, TimestampType, DEFAULT_METADATA_TIMEOUT};

/// Where readers start in each partition.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartingOffsets {
    /// The oldest record still in the log.
    Earliest,
    /// Only records appended after the query starts.
    #[default]
    Latest,
    /// The given offset per `(topic, partition)`; partitions not listed start at
    /// the earliest record.
    Offsets(HashMap<(String, i32), i64>),
    /// Every partition starts at its first record whose timestamp is at or after
    /// this one, in milliseconds since the Unix epoch (Spark's `startingTimestamp`;
    /// Kafka's `offsetsForTimes`). A partition with no such record, an empty one
    /// included, fails the start unless
    /// [`fail_on_unmatched_timestamp(false)`](KafkaSource::fail_on_unmatched_timestamp)
    /// starts it at its latest offset.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::{KafkaSource, StartingOffsets};
    /// // Everything from 2024-06-01T00:00:00Z on.
    /// let clicks = KafkaSource::new("127.0.0.1:9092")
    ///     .subscribe(["clicks"])
    ///     .starting_offsets(StartingOffsets::Timestamp(1_717_200_000_000));
    /// ```
    Timestamp(i64),
    /// A timestamp (ms since the Unix epoch) per `(topic, partition)`: each starts
    /// at its first record at or after its timestamp, as with
    /// [`Timestamp`](StartingOffsets::Timestamp) (Spark's
    /// `startingOffsetsByTimestamp`). Partitions not listed start at the earliest
    /// record, as with [`Offsets`](StartingOffsets::Offsets), where Spark requires
    /// every partition to be listed.
    ///
    /// ```no_run
    /// use std::collections::HashMap;
    /// use rtflow_connectors::kafka::{KafkaSource, StartingOffsets};
    /// let timestamps = HashMap::from([
    ///     (("clicks".to_owned(), 0), 1_717_200_000_000),
    ///     (("clicks".to_owned(), 1), 1_717_203_600_000),
    /// ]);
    /// let clicks = KafkaSource::new("127.0.0.1:9092")
    ///     .subscribe(["clicks"])
    ///     .starting_offsets(StartingOffsets::Timestamps(timestamps))
    ///     // Partitions with nothing that recent start at the end instead of failing.
    ///     .fail_on_unmatched_timestamp(false);
    /// ```
    Timestamps(HashMap<(String, i32), i64>),
}

#[derive(Debug, Clone)]
enum Subscription {
    Topics(Vec<String>),
    Pattern(String),
    Partitions(Vec<(String, i32)>),
}

/// Reads Kafka topics: one reader actor per topic partition (Spark RTM's 1:1
/// mapping) unless [`max_partitions`](KafkaSource::max_partitions) caps the
/// readers, each then reading several partitions. Event time is tracked per
/// topic partition either way: a partition behind the others holds the
/// watermark back even when its reader reads faster ones too.
///
/// ```no_run
/// use rtflow_connectors::kafka::{KafkaSource, StartingOffsets};
/// let clicks = KafkaSource::new("127.0.0.1:9092")
///     .subscribe(["clicks"])
///     .starting_offsets(StartingOffsets::Earliest)
///     .option("kafka.fetch.wait.max.ms", "20");
/// ```
pub struct KafkaSource {
    bootstrap_servers: String,
    subscription: Subscription,
    starting_offsets: StartingOffsets,
    max_partitions: Option<usize>,
    fail_on_data_loss: bool,
    fail_on_unmatched_timestamp: bool,
    metadata_timeout: Duration,
    options: Options,
    /// The `(topic, partition)` list found at start; reader partition indexes point
    /// into it.
    assigned: Mutex<Vec<(String, i32)>>,
    /// What looks up the ends of the readers' partitions, while a reader holds it.
    lag: Mutex<Weak<LagWatch>>,
}

impl KafkaSource {
    /// A source on the cluster at `bootstrap_servers`, starting at the latest
    /// offsets. Name what to read with `subscribe`, `subscribe_pattern` or `assign`.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            subscription: Subscription::Topics(Vec::new()),
            starting_offsets: StartingOffsets::default(),
            max_partitions: None,
            fail_on_data_loss: true,
            fail_on_unmatched_timestamp: true,
            metadata_timeout: DEFAULT_METADATA_TIMEOUT,
            options: Options::default(),
            assigned: Mutex::default(),
            lag: Mutex::default(),
        }
    }

    /// Reads every partition of these topics.
    pub fn subscribe<S: Into<String>>(mut self, topics: impl IntoIterator<Item = S>) -> Self {
        self.subscription = Subscription::Topics(topics.into_iter().map(Into::into).collect());
        self
    }

    /// Reads every partition of the topics whose whole name matches `pattern` (a
    /// regular expression) when the query starts.
    pub fn subscribe_pattern(mut self, pattern: impl Into<String>) -> Self {
        self.subscription = Subscription::Pattern(pattern.into());
        self
    }

    /// Reads exactly these `(topic, partition)`s.
    pub fn assign<S: Into<String>>(
        mut self,
        partitions: impl IntoIterator<Item = (S, i32)>,
    ) -> Self {
        self.subscription = Subscription::Partitions(
            partitions
                .into_iter()
                .map(|(topic, partition)| (topic.into(), partition))
                .collect(),
        );
        self
    }

    /// Where to start reading.
    pub fn starting_offsets(mut self, offsets: StartingOffsets) -> Self {
        self.starting_offsets = offsets;
        self
    }

    /// Runs at most `readers` reader actors (Spark's `maxPartitions`: the number
    /// of input partitions, and so of task slots, the source takes), the topic
    /// partitions dealt round them. Without it, one reader per topic partition.
    pub fn max_partitions(mut self, readers: usize) -> Self {
        self.max_partitions = Some(readers.max(1));
        self
    }

    /// Whether offsets that are no longer available fail the query (the default)
    /// or make readers continue from the earliest available record.
    pub fn fail_on_data_loss(mut self, fail: bool) -> Self {
        self.fail_on_data_loss = fail;
        self
    }

    /// Whether a partition in which [`StartingOffsets::Timestamp`] or
    /// [`StartingOffsets::Timestamps`] finds no record at or after its timestamp
    /// fails the start (Spark's `startingOffsetsByTimestampStrategy`): by default
    /// (`true`, Spark's "error") the query fails to start with a source error
    /// naming the topic, the partition and the timestamp; with `false` (Spark's
    /// "latest") the partition starts at its latest offset, reading only records
    /// appended from then on. Like every starting position,
    /// this applies only to a first start: a query restored from a checkpoint
    /// continues from the checkpoint's offsets.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::{KafkaSource, StartingOffsets};
    /// let an_hour_ago = std::time::SystemTime::now()
    ///     .duration_since(std::time::UNIX_EPOCH)
    ///     .unwrap()
    ///     .as_millis() as i64
    ///     - 3_600_000;
    /// let recent = KafkaSource::new("127.0.0.1:9092")
    ///     .subscribe(["clicks"])
    ///     .starting_offsets(StartingOffsets::Timestamp(an_hour_ago))
    ///     .fail_on_unmatched_timestamp(false);
    /// ```
    pub fn fail_on_unmatched_timestamp(mut self, fail: bool) -> Self {
        self.fail_on_unmatched_timestamp = fail;
        self
    }

    /// How long start-up waits for the cluster's metadata. Default 10 s.
    pub fn metadata_timeout(mut self, timeout: Duration) -> Self {
        self.metadata_timeout = timeout;
        self
    }

    /// Sets a librdkafka consumer setting: `.option("kafka.<key>", value)`.
    pub fn option(mut self, key: &str, value: impl ToString) -> Self {
        self.options.set(key, &value.to_string());
        self
    }

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::source(format!("kafka {}", self.bootstrap_servers), message)
    }

    fn consumer(&self) -> Result<BaseConsumer> {
        self.consumer_config()?
            .create()
            .map_err(|e| self.error(format!("could not create the consumer: {e}")))
    }

    fn consumer_config(&self) -> Result<ClientConfig> {
        let reset = if self.fail_on_data_loss {
            "error"
        } else {
            "earliest"
        };
        self.options.client_config(
            "KafkaSource",
            &[
                ("bootstrap.servers", &self.bootstrap_servers),
                ("group.id", "rtflow"),
                ("client.id", "rtflow-source"),
                ("enable.auto.commit", "false"),
                ("enable.auto.offset.store", "false"),
                ("enable.partition.eof", "false"),
                ("auto.offset.reset", reset),
                // Measured on the local broker (benches/kafka_latency.rs): a
                // 5 ms fetch wait gave p50 4.6 ms where 100 ms gave 36 ms, at
                // the cost of idle fetches; override with kafka.fetch.wait.max.ms.
                ("fetch.wait.max.ms", "5"),
                // librdkafka stops fetching a partition once this much is
                // prefetched, so a reader blocked on a full mailbox pauses it.
                // 1 MiB, the size of one fetch, throttled a 1 MB/s partition to
                // seconds of lag; the back-off (1 s by default) is how soon
                // librdkafka looks again.
                ("queued.max.messages.kbytes", "16384"),
                ("fetch.queue.backoff.ms", "5"),
            ],
        )
    }

    /// Asks the cluster which partitions the subscription covers.
    fn resolve(&self) -> Result<Vec<(String, i32)>> {
        let consumer = metadata::client(&self.consumer_config()?)
            .map_err(|e| self.error(format!("could not create the consumer: {e}")))?;
        let unreachable = |e: KafkaError| {
            self.error(format!(
                "could not fetch metadata within {:?}: {e}; check that the broker is \
                 running and that the bootstrap servers are right",
                self.metadata_timeout
            ))
        };
        let topics: Vec<String> = match &self.subscription {
            Subscription::Topics(topics) if topics.is_empty() => {
                return Err(
                    self.error("no topic to read; call subscribe, subscribe_pattern or assign")
                )
            }
            Subscription::Topics(topics) => topics.clone(),
            Subscription::Partitions(partitions) => {
                partitions.iter().map(|(t, _)| t.clone()).collect()
            }
            Subscription::Pattern(pattern) => {
                let regex = Regex::new(&format!("^(?:{pattern})$"))
                    .map_err(|e| self.error(format!("invalid topic pattern: {e}")))?;
                let metadata = consumer
                    .fetch_metadata(None, self.metadata_timeout)
                    .map_err(unreachable)?;
                let matched: Vec<String> = metadata
                    .topics()
                    .iter()
                    .map(|t| t.name().to_owned())
                    .filter(|name| !name.starts_with("__") && regex.is_match(name))
                    .collect();
                if matched.is_empty() {
                    return Err(self.error(format!("no topic matches the pattern '{pattern}'")));
                }
                matched
            }
        };
        let mut found = Vec::new();
        for topic in dedup(topics) {
            let metadata = consumer
                .fetch_metadata(Some(&topic), self.metadata_timeout)
                .map_err(unreachable)?;
            let entry = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .ok_or_else(|| self.error(format!("no metadata for topic '{topic}'")))?;
            if let Some(error) = entry.error() {
                let code = RDKafkaErrorCode::from(error);
                return Err(match code {
                    RDKafkaErrorCode::UnknownTopicOrPartition => self.error(format!(
                        "topic '{topic}' does not exist; create it before starting the query"
                    )),
                    _ => self.error(format!("topic '{topic}': {code}")),
                });
            }
            found.extend(entry.partitions().iter().map(|p| (topic.clone(), p.id())));
        }
        if let Subscription::Partitions(wanted) = &self.subscription {
            if let Some((topic, partition)) = wanted.iter().find(|w| !found.contains(w)) {
                return Err(self.error(format!(
                    "partition {partition} of topic '{topic}' does not exist"
                )));
            }
            found = dedup(wanted.clone());
        }
        found.sort();
        Ok(found)
    }

    /// Where readers start in partitions with no checkpointed offset.
    fn starts(&self) -> Starts {
        Starts {
            source: format!("kafka {}", self.bootstrap_servers),
            starting_offsets: self.starting_offsets.clone(),
            fail_on_unmatched_timestamp: self.fail_on_unmatched_timestamp,
            metadata_timeout: self.metadata_timeout,
        }
    }

    /// Settings that are wrong whatever the cluster holds.
    fn check(&self) -> Result<()> {
        let negative = match &self.starting_offsets {
            StartingOffsets::Timestamp(ms) => (*ms < 0).then(|| format!("{ms}")),
            StartingOffsets::Timestamps(timestamps) => timestamps
                .iter()
                .filter(|(_, ms)| **ms < 0)
                .min()
                .map(|((topic, partition), ms)| format!("{ms} for {topic}-{partition}")),
            _ => None,
        };
        match negative {
            Some(what) => Err(RtflowError::InvalidConfiguration(format!(
                "KafkaSource starting timestamp {what} is negative; starting timestamps \
                 are milliseconds since the Unix epoch"
            ))),
            None => Ok(()),
        }
    }
}

/// Where a reader starts in a partition no checkpoint holds an offset for:
/// the source's starting offsets, resolved against the cluster. Kept by
/// each reader, which may be handed such a partition inside a run.
#[derive(Clone)]
struct Starts {
    source: String,
    starting_offsets: StartingOffsets,
    fail_on_unmatched_timestamp: bool,
    metadata_timeout: Duration,
}

impl Starts {
    /// Where a reader starts in `(topic, partition)`: the checkpoint's offset, else
    /// the configured starting offset, resolved to a number so the reader always
    /// knows its position.
    fn offset(
        &self,
        consumer: &BaseConsumer,
        checkpoint: &Offsets,
        topic: &str,
        partition: i32,
    ) -> Result<i64> {
        if let Some(offset) = checkpoint.get(&partition_label(topic, partition)) {
            return Ok(*offset);
        }
        let key = (topic.to_owned(), partition);
        let timestamp = match &self.starting_offsets {
            StartingOffsets::Offsets(offsets) => {
                if let Some(offset) = offsets.get(&key) {
                    return Ok(*offset);
                }
                None
            }
            StartingOffsets::Timestamp(ms) => Some(*ms),
            StartingOffsets::Timestamps(timestamps) => timestamps.get(&key).copied(),
            StartingOffsets::Earliest | StartingOffsets::Latest => None,
        };
        if let Some(ms) = timestamp {
            return self.offset_at_time(consumer, topic, partition, ms);
        }
        let (low, high) = self.watermarks(consumer, topic, partition)?;
        Ok(match self.starting_offsets {
            StartingOffsets::Latest => high,
            _ => low,
        })
    }

    /// The first offset of `(topic, partition)` whose record's timestamp is at or
    /// after `ms`; with no such record, an error, or the latest offset under
    /// `fail_on_unmatched_timestamp(false)`.
    fn offset_at_time(
        &self,
        consumer: &BaseConsumer,
        topic: &str,
        partition: i32,
        ms: i64,
    ) -> Result<i64> {
        // The end is read before the lookup: a record appended between the two
        // lies at or beyond it, so it is read rather than skipped.
        let end = if self.fail_on_unmatched_timestamp {
            None
        } else {
            Some(self.watermarks(consumer, topic, partition)?.1)
        };
        let failed = |e: &dyn std::fmt::Display| {
            self.error(format!(
                "could not look up the offset of {topic}-{partition} at timestamp {ms}: {e}"
            ))
        };
        let mut query = TopicPartitionList::new();
        query
            .add_partition_offset(topic, partition, Offset::Offset(ms))
            .map_err(|e| failed(&e))?;
        let found = consumer
            .offsets_for_times(query, self.metadata_timeout)
            .map_err(|e| failed(&e))?;
        let element = found
            .find_partition(topic, partition)
            .ok_or_else(|| failed(&"the broker did not answer for it"))?;
        element.error().map_err(|e| failed(&e))?;
        // librdkafka answers -1 (`Offset::End`) when no record is that recent.
        match (element.offset(), end) {
            (Offset::Offset(offset), _) if offset >= 0 => Ok(offset),
            (_, Some(end)) => Ok(end),
            (_, None) => Err(self.error(format!(
                "no record of partition {partition} of topic '{topic}' has a timestamp \
                 at or after the starting timestamp {ms} (ms since the Unix epoch), so \
                 there is no offset to start at; call fail_on_unmatched_timestamp(false) \
                 to start such partitions at their latest offset"
            ))),
        }
    }

    /// The `(earliest, latest)` offsets of `(topic, partition)`.
    fn watermarks(
        &self,
        consumer: &BaseConsumer,
        topic: &str,
        partition: i32,
    ) -> Result<(i64, i64)> {
        // A partition whose leader is still being elected (its topic was
        // just made, or its broker just started) is asked again.
        let deadline = std::time::Instant::now() + self.metadata_timeout;
        loop {
            match consumer.fetch_watermarks(topic, partition, self.metadata_timeout) {
                Err(KafkaError::MetadataFetch(
                    RDKafkaErrorCode::NotLeaderForPartition | RDKafkaErrorCode::LeaderNotAvailable,
                )) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                read => {
                    return read.map_err(|e| {
                        self.error(format!(
                            "could not read the offsets of {topic}-{partition}: {e}"
                        ))
                    })
                }
            }
        }
    }

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::source(&self.source, message)
    }
}

/// How a partition is named in checkpoints.
fn partition_label(topic: &str, partition: i32) -> String {
    format!("{topic}-{partition}")
}

fn dedup<T: Ord>(mut items: Vec<T>) -> Vec<T> {
    items.sort();
    items.dedup();
    items
}

impl Source<KafkaRecord> for KafkaSource {
    fn kind(&self) -> &str {
        "kafka"
    }

    fn description(&self) -> String {
        let what = match &self.subscription {
            Subscription::Topics(topics) => format!("Subscribe[{}]", topics.join(",")),
            Subscription::Pattern(pattern) => format!("SubscribePattern[{pattern}]"),
            Subscription::Partitions(partitions) => format!("Assign{partitions:?}"),
        };
        format!("Kafka[{what}]")
    }

    fn partitions(&self) -> Result<usize> {
        self.check()?;
        let partitions = self.resolve()?;
        let count = partitions.len();
        *self.assigned.lock().unwrap_or_else(|p| p.into_inner()) = partitions;
        Ok(count)
    }

    fn readers(&self, partitions: usize) -> usize {
        self.max_partitions
            .map_or(partitions, |readers| readers.min(partitions))
    }

    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        let assigned = self.assigned.lock().unwrap_or_else(|p| p.into_inner());
        Some(link.owned(&assigned))
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<KafkaRecord>>> {
        let assigned = self.assigned.lock().unwrap_or_else(|p| p.into_inner());
        let mut partitions: Vec<(Arc<str>, i32)> = Vec::with_capacity(ctx.partitions.len());
        for i in &ctx.partitions {
            let (topic, partition) = &assigned[*i];
            partitions.push((shared_topic(&partitions, topic), *partition));
        }
        let mut consumer = ClosingConsumer::new(self.consumer()?);
        // The reader waits parked, not inside librdkafka: a barrier's unpark
        // must end the wait at once, and `BaseConsumer::poll` waits out its
        // whole timeout. librdkafka calls this from its own threads when the
        // consumer's queue goes from empty to holding an event. A poll that
        // consumed one of librdkafka's own events (a log line) returns nothing
        // even if messages follow it; those wait until the reader's sleep
        // ends (`max_wait`, 20 ms in a query), as rare as such events are.
        let waker = ctx.waker.clone();
        consumer.set_nonempty_callback(move || waker.wake());
        let mut assignment = TopicPartitionList::new();
        let mut positions = Vec::with_capacity(partitions.len());
        let watch = LagWatch::shared(&self.lag, || self.consumer(), self.metadata_timeout)?;
        let mut lags = Vec::with_capacity(partitions.len());
        let starts = self.starts();
        for (topic, partition) in &partitions {
            let offset = starts.offset(&consumer, &ctx.start_offsets, topic, *partition)?;
            assignment
                .add_partition_offset(topic, *partition, Offset::Offset(offset))
                .map_err(|e| self.error(e))?;
            positions.push(offset);
            let lag = ctx.lag.partition(topic, &partition.to_string());
            lag.set_position(offset);
            watch.watch(topic, *partition, lag.clone());
            lags.push(lag);
        }
        consumer
            .assign(&assignment)
            .map_err(|e| self.error(format!("could not assign partitions: {e}")))?;
        Ok(Box::new(KafkaReader {
            consumer,
            source: format!("kafka {}", self.bootstrap_servers),
            partitions,
            numbers: ctx.partitions.clone(),
            positions,
            lags,
            watch,
            lag: ctx.lag.clone(),
            all: assigned.clone(),
            starts,
        }))
    }
}

struct KafkaReader {
    consumer: ClosingConsumer,
    source: String,
    /// The partitions read, each with its topic's name, which every record
    /// read from it shares ([`shared_topic`]).
    partitions: Vec<(Arc<str>, i32)>,
    /// Each partition's number in the source ([`SourceContext::partitions`]),
    /// which watermarks track event time by.
    numbers: Vec<usize>,
    /// The next offset to read, per partition.
    positions: Vec<i64>,
    /// Where each partition's position is published, once per poll.
    lags: Vec<Arc<PartitionLag>>,
    /// Held so the ends go on being looked up while the reader lives.
    watch: Arc<LagWatch>,
    /// Where the partitions' lags are reported.
    lag: SourceLag,
    /// Every partition of the source, by number: a handover may hand the
    /// reader any of them.
    all: Vec<(String, i32)>,
    /// Where a partition handed over with no offset starts.
    starts: Starts,
}

impl KafkaReader {
    /// An error the reader cannot continue after; transient ones (a broker away
    /// for a while) are retried by librdkafka.
    fn fatal(&self, error: &KafkaError) -> Option<RtflowError> {
        let code = error.rdkafka_error_code()?;
        let message = match code {
            RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange => format!(
                "the requested offsets of {:?} are no longer available (deleted by \
                 retention, or beyond the end of the log): {error}; the query fails \
                 rather than skip records; set fail_on_data_loss(false) to continue from \
                 the earliest available offset",
                self.partitions
            ),
            RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownPartition
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::Fatal => format!("{error}"),
            _ => return None,
        };
        Some(RtflowError::source(&self.source, message))
    }
}

/// The name of `topic` for a partition the reader takes: the one its held
/// partitions of that topic share, or a new one. Records take a reference
/// to it, so that reading one allocates no copy of the name.
fn shared_topic(partitions: &[(Arc<str>, i32)], topic: &str) -> Arc<str> {
    partitions
        .iter()
        .find(|(held, _)| **held == *topic)
        .map_or_else(|| Arc::from(topic), |(held, _)| Arc::clone(held))
}

/// Where `partition` of `topic` is among the reader's partitions; none for a
/// message fetched before the reader let its partition go.
fn held(partitions: &[(Arc<str>, i32)], topic: &str, partition: i32) -> Option<usize> {
    partitions
        .iter()
        .position(|(t, p)| *p == partition && **t == *topic)
}

/// The record of `message`, read from a partition of `topic` (its name as
/// the reader holds it).
fn record<M: Message>(message: &M, topic: Arc<str>) -> (KafkaRecord, Option<i64>) {
    let timestamp = match message.timestamp() {
        Timestamp::CreateTime(ms) => Some((ms, TimestampType::CreateTime)),
        Timestamp::LogAppendTime(ms) => Some((ms, TimestampType::LogAppendTime)),
        Timestamp::NotAvailable => None,
    };
    let headers = message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| (h.key.to_owned(), h.value.map(Bytes::copy_from_slice)))
                .collect()
        })
        .unwrap_or_default();
    let record = KafkaRecord {
        topic,
        partition: message.partition(),
        offset: message.offset(),
        key: message.key().map(Bytes::copy_from_slice),
        value: message.payload().map(Bytes::copy_from_slice),
        timestamp,
        headers,
    };
    (record, timestamp.map(|(ms, _)| ms))
}

impl SourceReader<KafkaRecord> for KafkaReader {
    fn offsets(&self) -> Offsets {
        self.partitions
            .iter()
            .zip(&self.positions)
            .map(|((topic, partition), offset)| (partition_label(topic, *partition), *offset))
            .collect()
    }

    fn hand_over(&mut self, change: &ReaderHandover<'_>) -> Result<()> {
        // It passes on no event time of its own: `with_watermark` does.
        if change.partitions == self.numbers {
            return Ok(());
        }
        // Only what changes is assigned or unassigned: a kept partition
        // fetches on undisturbed, and replacing the whole assignment just
        // before the consumer closes (a handover that fails) can abort the
        // process in librdkafka (a second stop of a partition being removed,
        // confluentinc/librdkafka#5573).
        let mut gone = TopicPartitionList::new();
        let held = std::mem::take(&mut self.partitions)
            .into_iter()
            .zip(std::mem::take(&mut self.numbers))
            .zip(std::mem::take(&mut self.positions))
            .zip(std::mem::take(&mut self.lags));
        for ((((topic, partition), number), position), lag) in held {
            if change.partitions.contains(&number) {
                self.partitions.push((topic, partition));
                self.numbers.push(number);
                self.positions.push(position);
                self.lags.push(lag);
            } else {
                self.watch.unwatch(&topic, partition);
                self.lag.forget(&topic, &partition.to_string());
                gone.add_partition(&topic, partition);
            }
        }
        let mut added = TopicPartitionList::new();
        for number in change.partitions {
            if self.numbers.contains(number) {
                continue;
            }
            let (topic, partition) = &self.all[*number];
            let partition = *partition;
            // No offset: no process committed one yet (the cluster's first
            // rebalance moved it before its first commit). It starts as a
            // run's start would start it.
            let position =
                self.starts
                    .offset(&self.consumer, change.start_offsets, topic, partition)?;
            added
                .add_partition_offset(topic, partition, Offset::Offset(position))
                .map_err(|e| RtflowError::source(&self.source, e.to_string()))?;
            let lag = self.lag.partition(topic, &partition.to_string());
            lag.set_position(position);
            self.watch.watch(topic, partition, lag.clone());
            let topic = shared_topic(&self.partitions, topic);
            self.partitions.push((topic, partition));
            self.numbers.push(*number);
            self.positions.push(position);
            self.lags.push(lag);
        }
        let changed = |e: KafkaError| {
            RtflowError::source(&self.source, format!("could not change partitions: {e}"))
        };
        if gone.count() > 0 {
            self.consumer.incremental_unassign(&gone).map_err(changed)?;
        }
        if added.count() > 0 {
            self.consumer.incremental_assign(&added).map_err(changed)?;
        }
        Ok(())
    }

    fn poll(
        &mut self,
        out: &mut SourceOutput<KafkaRecord>,
        max_wait: Duration,
    ) -> Result<SourceStatus> {
        let mut waited = max_wait.is_zero();
        while out.remaining() > 0 {
            match self.consumer.poll(Duration::ZERO) {
                None if waited => break,
                None => std::thread::park_timeout(max_wait),
                Some(Ok(message)) => {
                    // None: one fetched before the reader let its partition go.
                    let Some(i) = held(&self.partitions, message.topic(), message.partition())
                    else {
                        continue;
                    };
                    self.positions[i] = message.offset() + 1;
                    out.set_partition(self.numbers[i]);
                    let (record, timestamp) = record(&message, Arc::clone(&self.partitions[i].0));
                    match timestamp {
                        Some(ms) => out.push_at(record, ms as u64 * 1_000_000, ms),
                        None => out.push(record, now_nanos()),
                    }
                }
                Some(Err(error)) => {
                    if let Some(fatal) = self.fatal(&error) {
                        return Err(fatal);
                    }
                    tracing::warn!(source = %self.source, %error, "kafka consumer error; retrying");
                    break;
                }
            }
            waited = true;
        }
        for (lag, position) in self.lags.iter().zip(&self.positions) {
            lag.set_position(*position);
        }
        Ok(SourceStatus::Active)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_partitions_caps_the_readers_as_spark_does() {
        let source = KafkaSource::new("127.0.0.1:1");
        assert_eq!(
            source.readers(12),
            12,
            "one reader per partition by default"
        );
        let capped = KafkaSource::new("127.0.0.1:1").max_partitions(8);
        assert_eq!(capped.readers(12), 8);
        assert_eq!(capped.readers(3), 3, "never more readers than partitions");
        assert_eq!(
            KafkaSource::new("127.0.0.1:1").max_partitions(0).readers(5),
            1
        );
    }

    #[test]
    fn records_of_a_partition_share_one_topic_name() {
        use rdkafka::message::OwnedMessage;

        // As `reader` and `hand_over` take partitions.
        let mut partitions: Vec<(Arc<str>, i32)> = Vec::new();
        for (topic, partition) in [("clicks", 0), ("views", 0), ("clicks", 1)] {
            partitions.push((shared_topic(&partitions, topic), partition));
        }
        // As `poll` reads a message.
        let read = |topic: &str, partition: i32, offset: i64| {
            let message = OwnedMessage::new(
                Some(b"v".to_vec()),
                None,
                topic.to_owned(),
                Timestamp::CreateTime(5),
                partition,
                offset,
                None,
            );
            let i = held(&partitions, message.topic(), message.partition())?;
            Some(record(&message, Arc::clone(&partitions[i].0)).0)
        };
        let first = read("clicks", 0, 7).unwrap();
        let second = read("clicks", 0, 8).unwrap();
        assert_eq!(
            (&*first.topic, first.partition, first.offset),
            ("clicks", 0, 7)
        );
        assert_eq!((&*second.topic, second.offset), ("clicks", 8));
        assert!(
            Arc::ptr_eq(&first.topic, &second.topic),
            "one allocation of the name for every record of a partition"
        );
        let other_partition = read("clicks", 1, 0).unwrap();
        assert!(Arc::ptr_eq(&first.topic, &other_partition.topic));
        let views = read("views", 0, 3).unwrap();
        assert_eq!(&*views.topic, "views");
        assert!(!Arc::ptr_eq(&first.topic, &views.topic));
        assert!(read("clicks", 2, 0).is_none(), "a partition not held");
        assert!(read("orders", 0, 0).is_none(), "a topic not held");
    }

    #[test]
    fn negative_starting_timestamps_are_rejected_before_contacting_the_broker() {
        let global = KafkaSource::new("127.0.0.1:1")
            .subscribe(["t"])
            .starting_offsets(StartingOffsets::Timestamp(-1));
        let error = global.partitions().unwrap_err();
        assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
        assert!(
            error.to_string().contains("timestamp -1 is negative"),
            "{error}"
        );

        let timestamps = HashMap::from([(("t".to_owned(), 0), 5), (("t".to_owned(), 2), -7)]);
        let error = KafkaSource::new("127.0.0.1:1")
            .subscribe(["t"])
            .starting_offsets(StartingOffsets::Timestamps(timestamps))
            .partitions()
            .unwrap_err();
        assert!(
            error.to_string().contains("-7 for t-2 is negative"),
            "{error}"
        );
    }
}
