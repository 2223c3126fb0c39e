//! [`KafkaSink`]: any delivery failure fails the query with the broker's
//! error. At-least-once by default (one producer per sink and process, one
//! request in flight per broker, so order holds across retries; flushed at
//! every barrier); exactly-once with Kafka transactions (see `exactly_once`).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::Consumer;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rtflow_runtime::{
    Data, Epoch, Record, Result, RtflowError, Sink, SinkContext, SinkWriter, StateSnapshot,
};

use super::cluster;
use super::exactly_once::TransactionalWriter;
use super::metadata;
use super::producer::{
    flush, send, topic_of, Deliveries, KafkaMessage, ProducerSettings, Serialize,
};
use super::{Options, DEFAULT_METADATA_TIMEOUT};

/// What a [`KafkaSink`] promises about each record's delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
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
    bootstrap_servers: String,
    topic: Option<String>,
    serialize: Serialize<T>,
    options: Options,
    flush_timeout: Duration,
    guarantee: DeliveryGuarantee,
    /// Where exactly-once writers record their commits; by default a topic of
    /// the query's own.
    commit_topic: Option<String>,
    /// The at-least-once writers' producer, while one of them holds it.
    producer: Mutex<Weak<ThreadedProducer<Deliveries>>>,
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
            producer: Mutex::default(),
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
    ///
    /// It means the same in a clustered query
    /// ([`KafkaCluster`](crate::kafka::KafkaCluster)): at least once, a
    /// record is written as soon as it reaches the sink, and after a failure
    /// the records processed since the last commit may be written again;
    /// exactly once, it is written in its process's transaction of the epoch,
    /// with the epoch's state changes and input offsets, visible to
    /// `read_committed` consumers when that commits.
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

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::sink(format!("kafka {}", self.bootstrap_servers), message)
    }

    /// What its writers are opened with.
    fn settings(&self) -> Result<ProducerSettings<T>> {
        Ok(ProducerSettings {
            bootstrap_servers: self.bootstrap_servers.clone(),
            topic: self.topic.clone(),
            serialize: self.serialize.clone(),
            config: self.config()?,
            flush_timeout: self.flush_timeout,
            commit_topic: self.commit_topic.clone(),
        })
    }

    fn config(&self) -> Result<rdkafka::ClientConfig> {
        // At least once, a record is out once sent. Sent at once (0 ms), a
        // reader's batch went out as its first record alone and the rest an
        // answer later (one request in flight), three times the requests the
        // broker serves at 50,000 records/s; 0.2 ms (librdkafka waits at
        // least about 1 ms when nothing else wakes it) brought rtflow from
        // 1.2-1.4x a hand-written relay's p50 there to 0.9-1.1x, and from a
        // third of it to the same at 1,000 records/s. Exactly once, a record
        // shows at the commit, whose flush sends what lingers: 20 ms batches
        // took 17 points of a core off librdkafka's threads at 30,000
        // records/s, the commit no slower (docs/performance.md).
        let linger = match self.guarantee {
            DeliveryGuarantee::AtLeastOnce => "0.2",
            DeliveryGuarantee::ExactlyOnce => "20",
        };
        self.options.client_config(
            "KafkaSink",
            &[
                ("bootstrap.servers", &self.bootstrap_servers),
                ("client.id", "rtflow-sink"),
                ("linger.ms", linger),
                // One request in flight batches what arrives meanwhile: with
                // librdkafka's 5 the idempotent producer polled its socket
                // without a timeout until the broker answered, a core per
                // producer at 10k records/s (benches/kafka_latency.rs).
                ("max.in.flight.requests.per.connection", "1"),
                // Idempotent (as Kafka's Java producer is by default): without
                // it a partition's records could reorder or repeat on retries
                // across a broker restart (librdkafka moves a partition's queue
                // between connections). Its price, a few points of a core and
                // some p99 at 50k records/s, is in docs/performance.md. A
                // transactional.id turns it on anyway.
                ("enable.idempotence", "true"),
                // Only failures need a report (`Deliveries`); a flush waits for
                // the rest. A report per record cost the producers' polling
                // thread three points of a core at 10,000-50,000 records/s
                // (docs/performance.md).
                ("delivery.report.only.error", "true"),
            ],
        )
    }

    /// The producer of the at-least-once writers in this process, made by the
    /// first. One producer, as a hand-written relay has, sends each
    /// partition's records in one request to the broker instead of one per
    /// writer, and wakes one set of librdkafka threads per batch instead of
    /// one per writer (docs/performance.md). A barrier's flush then waits for
    /// the other writers' records too, which reach the same barrier.
    fn shared_producer(
        &self,
        settings: &ProducerSettings<T>,
    ) -> Result<Arc<ThreadedProducer<Deliveries>>> {
        let mut shared = self.producer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(producer) = shared.upgrade() {
            return Ok(producer);
        }
        let producer = Arc::new(
            ThreadedProducer::from_config_and_context(&settings.config, Deliveries::default())
                .map_err(|e| settings.error(format!("could not create the producer: {e}")))?,
        );
        *shared = Arc::downgrade(&producer);
        Ok(producer)
    }

    /// Fails at start, not at the first record, when the fixed topic is missing.
    fn check_topic(&self, topic: &str) -> Result<()> {
        let consumer = metadata::client(&self.config()?)
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
        let settings = self.settings()?;
        if ctx.cluster.is_some() && self.guarantee == DeliveryGuarantee::ExactlyOnce {
            let transactions = cluster::transactions_of(ctx, &settings.name())?;
            return Ok(Box::new(ClusterWriter {
                sink: settings.name(),
                staging: cluster::Staging::new(&transactions, settings.topic, ctx.first_epoch),
                serialize: settings.serialize,
            }));
        }
        if self.guarantee == DeliveryGuarantee::ExactlyOnce {
            return Ok(Box::new(TransactionalWriter::open(&settings, ctx)?));
        }
        Ok(Box::new(KafkaWriter {
            producer: self.shared_producer(&settings)?,
            sink: settings.name(),
            topic: settings.topic,
            serialize: settings.serialize,
            flush_timeout: settings.flush_timeout,
        }))
    }
}

struct KafkaWriter<T> {
    producer: Arc<ThreadedProducer<Deliveries>>,
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
        flush(&self.producer, self.flush_timeout).map_err(|e| {
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

/// The writer of an exactly-once sink in a clustered query: its records
/// commit with the process's transaction of their epoch.
struct ClusterWriter<T> {
    staging: cluster::Staging,
    serialize: Serialize<T>,
    sink: String,
}

impl<T: Data> SinkWriter<T> for ClusterWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        let message = (self.serialize)(&record.value);
        topic_of(&message, self.staging.topic(), &self.sink)?;
        self.staging.push(message);
        Ok(())
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        // Holds the sink at its barrier: behind a repartition, its epoch's
        // second transaction waits, the first does not (tests/cluster.rs).
        fail::fail_point!("cluster-sink-barrier");
        self.staging.end_epoch(epoch);
        Ok(())
    }

    fn snapshot(&mut self, _out: &mut StateSnapshot) -> Result<()> {
        self.staging.end_input();
        Ok(())
    }
}
