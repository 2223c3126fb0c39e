//! [`KafkaSink`]: one idempotent producer per sink actor; any delivery failure
//! fails the query with the broker's error.

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

use super::{Options, DEFAULT_METADATA_TIMEOUT};

/// What the sink writes for one record.
///
/// ```
/// use rtflow_connectors::kafka::KafkaMessage;
/// let message = KafkaMessage::new("payload").key("user-1").header("source", "web");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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

type Serialize<T> = Arc<dyn Fn(&T) -> KafkaMessage + Send + Sync>;

/// Writes records to Kafka, flushing at every checkpoint barrier and on stop.
///
/// ```no_run
/// use rtflow_connectors::kafka::{KafkaMessage, KafkaSink};
/// let sink = KafkaSink::new("127.0.0.1:9092", "alerts", |alert: &String| {
///     KafkaMessage::new(alert.clone())
/// });
/// ```
pub struct KafkaSink<T> {
    bootstrap_servers: String,
    topic: Option<String>,
    serialize: Serialize<T>,
    options: Options,
    flush_timeout: Duration,
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
        }
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

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::sink(format!("kafka {}", self.bootstrap_servers), message)
    }

    fn config(&self) -> Result<rdkafka::ClientConfig> {
        self.options.client_config(
            "KafkaSink",
            &[
                ("bootstrap.servers", &self.bootstrap_servers),
                ("client.id", "rtflow-sink"),
                ("linger.ms", "0"),
                ("enable.idempotence", "true"),
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
    fn kind(&self) -> &str {
        "kafka"
    }

    fn description(&self) -> String {
        match &self.topic {
            Some(topic) => format!("Kafka[{topic}]"),
            None => "Kafka[per-record topic]".into(),
        }
    }

    fn writer(&self, _ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        if let Some(topic) = &self.topic {
            self.check_topic(topic)?;
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
struct Deliveries {
    failure: Mutex<Option<String>>,
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
        let failure = self
            .producer
            .context()
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match failure {
            Some(failure) => Err(RtflowError::sink(&self.sink, failure)),
            None => Ok(()),
        }
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
        let Some(topic) = message.topic.as_deref().or(self.topic.as_deref()) else {
            return Err(RtflowError::sink(
                &self.sink,
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
            match self.producer.send(base) {
                Ok(()) => return Ok(()),
                // The local queue is full: wait for acknowledgements (backpressure).
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    self.check_deliveries()?;
                    std::thread::sleep(Duration::from_millis(1));
                    base = back;
                }
                Err((error, _)) => {
                    return Err(RtflowError::sink(
                        &self.sink,
                        format!("could not produce to '{topic}': {error}"),
                    ))
                }
            }
        }
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
