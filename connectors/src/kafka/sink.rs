//! [`KafkaSink`]: one producer per sink actor; any delivery failure fails the
//! query with the broker's error. At-least-once by default (one request in
//! flight per broker, so order holds across retries; flushed at every barrier);
//! exactly-once with Kafka transactions (see `exactly_once`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Message};
use rtflow_runtime::{Data, Epoch, Record, Result, RtflowError, Sink, SinkContext, SinkWriter};

use super::exactly_once::TransactionalWriter;
use super::{Options, DEFAULT_METADATA_TIMEOUT};

/// What the sink writes for one record.
///
/// ```
/// use rtflow_connectors::kafka::KafkaMessage;
/// let message = KafkaMessage::new("payload").key("user-1").header("source", "web");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KafkaMessage {
    /// The topic; required with [`KafkaSink::per_record_topic`], ignored otherwise.
    pub topic: Option<String>,
    /// The partition; by default librdkafka's partitioner picks it from the key.
    pub partition: Option<i32>,
    pub key: Option<Bytes>,
    pub value: Option<Bytes>,
    pub headers: Vec<(String, Bytes)>,
}

impl KafkaMessage {
    /// A message with this value.
    pub fn new(value: impl Into<Bytes>) -> Self {
        Self {
            value: Some(value.into()),
            ..Self::default()
        }
    }

    /// Sets the key.
    pub fn key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the topic (for [`KafkaSink::per_record_topic`]).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Sets the partition.
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }
}

pub(crate) type Serialize<T> = Arc<dyn Fn(&T) -> KafkaMessage + Send + Sync>;

/// What a [`KafkaSink`] promises about each record's delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeliveryGuarantee {
    /// Every record is written at least once: the producer is flushed before each
    /// barrier is acknowledged, and a restart may write the records of the
    /// unfinished epoch again.
    #[default]
    AtLeastOnce,
    /// `read_committed` consumers see every record exactly once: each epoch's
    /// records are written in a Kafka transaction that commits only after the
    /// epoch's checkpoint is durable.
    ExactlyOnce,
}

/// Writes records to Kafka, flushing at every checkpoint barrier and on stop.
///
/// ```no_run
/// use rtflow_connectors::kafka::{KafkaMessage, KafkaSink};
/// let sink = KafkaSink::new("127.0.0.1:9092", "alerts", |alert: &String| {
///     KafkaMessage::new(alert.clone())
/// });
/// ```
pub struct KafkaSink<T> {
    pub(crate) bootstrap_servers: String,
    pub(crate) topic: Option<String>,
    pub(crate) serialize: Serialize<T>,
    options: Options,
    pub(crate) flush_timeout: Duration,
    guarantee: DeliveryGuarantee,
    /// Where exactly-once writers record their commits; by default a topic of
    /// the query's own.
    pub(crate) commit_topic: Option<String>,
}

impl<T: Data> KafkaSink<T> {
    /// Writes every record to `topic`.
    pub fn new(
        bootstrap_servers: impl Into<String>,
        topic: impl Into<String>,
        serialize: impl Fn(&T) -> KafkaMessage + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: Some(topic.into()),
            ..Self::per_record_topic(bootstrap_servers, serialize)
        }
    }

    /// Writes each record to the topic its [`KafkaMessage`] names.
    pub fn per_record_topic(
        bootstrap_servers: impl Into<String>,
        serialize: impl Fn(&T) -> KafkaMessage + Send + Sync + 'static,
    ) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            topic: None,
            serialize: Arc::new(serialize),
            options: Options::default(),
            flush_timeout: Duration::from_secs(30),
            guarantee: DeliveryGuarantee::default(),
            commit_topic: None,
        }
    }

    /// Sets the delivery guarantee (default at-least-once).
    ///
    /// Exactly-once output becomes visible to `read_committed` consumers when its
    /// epoch commits, so once per batch duration rather than record by record.
    /// An epoch's transaction may stay open for twice the batch duration and
    /// the flush timeout (`transaction.timeout.ms`, unless set with
    /// [`option`](Self::option)); brokers cap that (`transaction.max.timeout.ms`,
    /// 15 minutes by default), so a longer batch duration fails at start.
    pub fn delivery(mut self, guarantee: DeliveryGuarantee) -> Self {
        self.guarantee = guarantee;
        self
    }

    /// The compacted topic where exactly-once writers record the epochs they
    /// committed (created if missing). Default `rtflow-commits-<query id>`. An
    /// existing topic with another `cleanup.policy` fails the start: retention
    /// would delete the commit records a restart looks up.
    ///
    /// A restart reads it to its end, waiting for any transaction left open on
    /// it. So queries that share one can hold each other's restarts back: a
    /// writer killed while committing holds that read until it restarts or its
    /// transaction times out.
    pub fn commit_topic(mut self, topic: impl Into<String>) -> Self {
        self.commit_topic = Some(topic.into());
        self
    }

    /// Sets a librdkafka producer setting: `.option("kafka.<key>", value)`.
    pub fn option(mut self, key: &str, value: impl ToString) -> Self {
        self.options.set(key, &value.to_string());
        self
    }

    /// How long a flush (at a barrier or on stop) may wait for acknowledgements
    /// before the query fails. Default 30 s.
    pub fn flush_timeout(mut self, timeout: Duration) -> Self {
        self.flush_timeout = timeout;
        self
    }

    pub(crate) fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::sink(self.name(), message)
    }

    pub(crate) fn name(&self) -> String {
        format!("kafka {}", self.bootstrap_servers)
    }

    pub(crate) fn config(&self) -> Result<rdkafka::ClientConfig> {
        self.options.client_config(
            "KafkaSink",
            &[
                ("bootstrap.servers", &self.bootstrap_servers),
                ("client.id", "rtflow-sink"),
                ("linger.ms", "0"),
                // Not idempotent (a transactional.id still turns it on): that
                // producer stops sending once 5 messages, not requests, are in
                // flight and polls its socket without a timeout until the broker
                // answers, a core per producer at 10k records/s. One request in
                // flight keeps the order on retries and batches what arrives
                // meanwhile (benches/kafka_latency.rs).
                ("max.in.flight.requests.per.connection", "1"),
                ("socket.nagle.disable", "true"),
            ],
        )
    }

    /// Fails at start, not at the first record, when the fixed topic is missing.
    fn check_topic(&self, topic: &str) -> Result<()> {
        let consumer: BaseConsumer = self
            .config()?
            .create()
            .map_err(|e| self.error(format!("could not create a client: {e}")))?;
        let metadata = consumer
            .fetch_metadata(Some(topic), DEFAULT_METADATA_TIMEOUT)
            .map_err(|e| {
                self.error(format!(
                    "could not fetch metadata: {e}; check that the broker is running and \
                     that the bootstrap servers are right"
                ))
            })?;
        let missing = metadata.topics().iter().any(|t| {
            t.name() == topic
                && t.error().map(RDKafkaErrorCode::from)
                    == Some(RDKafkaErrorCode::UnknownTopicOrPartition)
        });
        if missing {
            return Err(self.error(format!(
                "topic '{topic}' does not exist; create it before starting the query"
            )));
        }
        Ok(())
    }
}

impl<T: Data> Sink<T> for KafkaSink<T> {
    fn allowlisted(&self) -> bool {
        true
    }

    fn kind(&self) -> &str {
        "kafka"
    }

    fn description(&self) -> String {
        match &self.topic {
            Some(topic) => format!("Kafka[{topic}]"),
            None => "Kafka[per-record topic]".into(),
        }
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        if let Some(topic) = &self.topic {
            self.check_topic(topic)?;
        }
        if self.guarantee == DeliveryGuarantee::ExactlyOnce {
            return Ok(Box::new(TransactionalWriter::open(self, ctx)?));
        }
        let deliveries = Deliveries::default();
        let producer = ThreadedProducer::from_config_and_context(&self.config()?, deliveries)
            .map_err(|e| self.error(format!("could not create the producer: {e}")))?;
        Ok(Box::new(KafkaWriter {
            producer,
            topic: self.topic.clone(),
            serialize: self.serialize.clone(),
            flush_timeout: self.flush_timeout,
            sink: format!("kafka {}", self.bootstrap_servers),
        }))
    }
}

/// Keeps the first delivery failure the producer reports, for the writer to raise.
#[derive(Default)]
pub(crate) struct Deliveries {
    failure: Mutex<Option<String>>,
}

impl Deliveries {
    /// The first failure reported, as the sink's error.
    pub(crate) fn check(&self, sink: &str) -> Result<()> {
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match failure {
            Some(failure) => Err(RtflowError::sink(sink, failure)),
            None => Ok(()),
        }
    }
}

/// Hands `message` to the producer, waiting while its local queue is full
/// (backpressure). Fails on a message without a topic.
pub(crate) fn send(
    producer: &ThreadedProducer<Deliveries>,
    message: &KafkaMessage,
    topic: Option<&str>,
    sink: &str,
) -> Result<()> {
    let Some(topic) = message.topic.as_deref().or(topic) else {
        return Err(RtflowError::sink(
            sink,
            "a KafkaSink::per_record_topic message names no topic; set KafkaMessage::topic",
        ));
    };
    let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
    for (name, value) in &message.headers {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_ref()),
        });
    }
    let mut base = BaseRecord::to(topic).headers(headers);
    if let Some(key) = &message.key {
        base = base.key(key.as_ref());
    }
    if let Some(value) = &message.value {
        base = base.payload(value.as_ref());
    }
    if let Some(partition) = message.partition {
        base = base.partition(partition);
    }
    loop {
        match producer.send(base) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                producer.context().check(sink)?;
                std::thread::sleep(Duration::from_millis(1));
                base = back;
            }
            Err((error, _)) => {
                return Err(RtflowError::sink(
                    sink,
                    format!("could not produce to '{topic}': {error}"),
                ))
            }
        }
    }
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((error, message)) = result {
            let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            failure.get_or_insert_with(|| {
                format!(
                    "delivery to {}-{} failed: {error}",
                    message.topic(),
                    message.partition()
                )
            });
        }
    }
}

struct KafkaWriter<T> {
    producer: ThreadedProducer<Deliveries>,
    topic: Option<String>,
    serialize: Serialize<T>,
    flush_timeout: Duration,
    sink: String,
}

impl<T> KafkaWriter<T> {
    fn check_deliveries(&self) -> Result<()> {
        self.producer.context().check(&self.sink)
    }

    fn flush_producer(&self) -> Result<()> {
        self.producer.flush(self.flush_timeout).map_err(|e| {
            RtflowError::sink(
                &self.sink,
                format!(
                    "records not acknowledged within {:?}: {e}",
                    self.flush_timeout
                ),
            )
        })?;
        self.check_deliveries()
    }
}

impl<T: Data> SinkWriter<T> for KafkaWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        let message = (self.serialize)(&record.value);
        send(&self.producer, &message, self.topic.as_deref(), &self.sink)
    }

    fn flush(&mut self) -> Result<()> {
        self.check_deliveries()
    }

    fn on_barrier(&mut self, _epoch: Epoch) -> Result<()> {
        self.flush_producer()
    }

    fn close(&mut self, error: Option<&RtflowError>) -> Result<()> {
        match error {
            None => self.flush_producer(),
            Some(_) => Ok(()),
        }
    }
}
