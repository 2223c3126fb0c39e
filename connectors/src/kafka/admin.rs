//! Topic administration: the exactly-once sink's commit topic, and topics for
//! examples, benchmarks and tests. Topics get the cluster's default
//! replication factor (`default.replication.factor`).

use std::time::{Duration, Instant};

use futures_executor::block_on;
use rdkafka::admin::{
    AdminClient, AdminOptions, ConfigResource, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use rtflow_runtime::{Result, RtflowError};

use super::Options;

/// Creates and deletes topics on a Kafka cluster.
///
/// ```no_run
/// use rtflow_connectors::kafka::KafkaAdmin;
/// let admin = KafkaAdmin::new("127.0.0.1:9092")?;
/// admin.create_topic("clicks", 3)?;
/// # Ok::<(), rtflow_runtime::RtflowError>(())
/// ```
///
/// On a secured cluster, give it the librdkafka settings the connectors take
/// ([`with_options`](Self::with_options)).
pub struct KafkaAdmin {
    client: AdminClient<DefaultClientContext>,
    options: AdminOptions,
}

/// How long the broker may take over one administrative request.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

fn admin_error(message: impl std::fmt::Display) -> RtflowError {
    RtflowError::source("kafka admin", message)
}

impl KafkaAdmin {
    /// Connects to the cluster at `bootstrap_servers`.
    pub fn new(bootstrap_servers: &str) -> Result<Self> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers);
        Self::with_config(config)
    }

    /// Connects to the cluster at `bootstrap_servers` with librdkafka
    /// settings, given as [`KafkaSource`](super::KafkaSource),
    /// [`KafkaSink`](super::KafkaSink) and [`KafkaCluster`](super::KafkaCluster)
    /// take them: `("kafka.<key>", value)`. A key without the prefix fails
    /// with `INVALID_CONFIGURATION`, a setting librdkafka refuses with
    /// `SOURCE_FAILED`.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::KafkaAdmin;
    /// let admin = KafkaAdmin::with_options(
    ///     "kafka-1:9093",
    ///     [
    ///         ("kafka.security.protocol", "SASL_SSL"),
    ///         ("kafka.sasl.mechanism", "SCRAM-SHA-512"),
    ///         ("kafka.sasl.username", "rtflow"),
    ///         ("kafka.sasl.password", "change-me"),
    ///     ],
    /// )?;
    /// admin.create_topic("clicks", 3)?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn with_options<K, V>(
        bootstrap_servers: &str,
        options: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self>
    where
        K: AsRef<str>,
        V: ToString,
    {
        let mut settings = Options::default();
        for (key, value) in options {
            settings.set(key.as_ref(), &value.to_string());
        }
        let config =
            settings.client_config("KafkaAdmin", &[("bootstrap.servers", bootstrap_servers)])?;
        Self::with_config(config)
    }

    /// Connects with `config`: the settings of the connector it serves, so
    /// that a secured cluster's options reach it too.
    pub(crate) fn with_config(config: ClientConfig) -> Result<Self> {
        let client = config
            .create()
            .map_err(|e| admin_error(format!("could not create the admin client: {e}")))?;
        let options = AdminOptions::new().operation_timeout(Some(OPERATION_TIMEOUT));
        Ok(Self { client, options })
    }

    /// Creates `topic` with `partitions` partitions; an existing topic is left
    /// as it is.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.create_topic_with(topic, partitions, &[])
    }

    /// Creates a one-partition compacted topic (for the latest value per key),
    /// unless it exists: what an exactly-once sink's commit topic must be.
    pub fn create_compacted_topic(&self, topic: &str) -> Result<()> {
        self.create_topic_with(topic, 1, &[("cleanup.policy", "compact")])
    }

    /// Creates a compacted topic of `partitions` partitions unless it exists:
    /// a clustered query's changelog.
    pub(crate) fn create_compacted_topic_of(&self, topic: &str, partitions: i32) -> Result<()> {
        self.create_topic_with(topic, partitions, &[("cleanup.policy", "compact")])
    }

    /// The cleanup policy of an existing `topic` (`delete`, `compact`, or both).
    pub(crate) fn cleanup_policy(&self, topic: &str) -> Result<String> {
        self.cleanup_policy_within(topic, OPERATION_TIMEOUT)
    }

    /// The broker describes a topic it does not know with no settings at all,
    /// not even the defaults, and a topic another client has just created may
    /// not have reached it yet: such an answer is asked again until `timeout`
    /// has passed.
    fn cleanup_policy_within(&self, topic: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let described = self.describe(topic)?;
            if !described.entries.is_empty() {
                return described
                    .get("cleanup.policy")
                    .and_then(|entry| entry.value.clone())
                    .ok_or_else(|| {
                        admin_error(format!("topic '{topic}' has no cleanup.policy setting"))
                    });
            }
            if Instant::now() + pause > deadline {
                return Err(admin_error(format!(
                    "the broker did not describe topic '{topic}' within {} ms: it does \
                     not exist, or the broker has not learnt of it yet",
                    timeout.as_millis()
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    fn describe(&self, topic: &str) -> Result<ConfigResource> {
        let specifier = ResourceSpecifier::Topic(topic);
        let results = block_on(self.client.describe_configs([&specifier], &self.options))
            .map_err(admin_error)?;
        results
            .into_iter()
            .next()
            .ok_or_else(|| admin_error(format!("no configuration for topic '{topic}'")))?
            .map_err(|code| admin_error(format!("could not describe topic '{topic}': {code}")))
    }

    /// Creates `topic` with `partitions` partitions and the topic-level
    /// settings `config` (e.g. `retention.ms`); an existing topic is left as
    /// it is.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::KafkaAdmin;
    /// let admin = KafkaAdmin::new("127.0.0.1:9092")?;
    /// admin.create_topic_with("alerts", 3, &[("retention.ms", "3600000")])?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn create_topic_with(
        &self,
        topic: &str,
        partitions: i32,
        config: &[(&str, &str)],
    ) -> Result<()> {
        // -1: the broker's default, so that a cluster that keeps every topic on
        // three brokers keeps the commit records there too.
        let mut new_topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
        for (key, value) in config {
            new_topic = new_topic.set(key, value);
        }
        let results = block_on(self.client.create_topics([&new_topic], &self.options))
            .map_err(admin_error)?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(admin_error(format!(
                        "could not create topic '{name}': {code}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Deletes `topic`; a missing topic is not an error.
    pub fn delete_topic(&self, topic: &str) -> Result<()> {
        let results =
            block_on(self.client.delete_topics(&[topic], &self.options)).map_err(admin_error)?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((name, code)) => {
                    return Err(admin_error(format!(
                        "could not delete topic '{name}': {code}"
                    )))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The test broker's address, or `None` (skip) outside CI.
    pub(crate) fn broker() -> Option<String> {
        let bootstrap = std::env::var("RTFLOW_KAFKA_BOOTSTRAP");
        if bootstrap.is_err() {
            assert!(
                std::env::var_os("CI").is_none(),
                "RTFLOW_KAFKA_BOOTSTRAP is not set: run the tests with scripts/test.sh"
            );
            eprintln!("skipped: no Kafka broker; run scripts/test.sh to start one");
        }
        bootstrap.ok()
    }

    /// The parallel writers of an exactly-once sink each create the commit
    /// topic and read its policy at once; the ones that find it already made
    /// may ask a broker that has not caught up yet.
    #[test]
    fn clients_that_create_a_topic_together_all_read_its_policy() {
        let Some(bootstrap) = broker() else { return };
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        for round in 0..40 {
            let topic = format!("rtflow-admin-race-{unique}-{round}");
            let writers: Vec<_> = (0..4)
                .map(|_| {
                    let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
                    std::thread::spawn(move || {
                        let admin = KafkaAdmin::new(&bootstrap)?;
                        admin.create_compacted_topic(&topic)?;
                        admin.cleanup_policy(&topic)
                    })
                })
                .collect();
            for writer in writers {
                assert_eq!(writer.join().unwrap(), Ok("compact".to_string()), "{topic}");
            }
            KafkaAdmin::new(&bootstrap)
                .unwrap()
                .delete_topic(&topic)
                .unwrap();
        }
    }

    /// The settings reach the client: one librdkafka refuses fails its
    /// creation, with no broker asked.
    #[test]
    fn an_admin_takes_the_connectors_options() {
        let error = KafkaAdmin::with_options(
            "127.0.0.1:1",
            [("kafka.security.protocol", "no_such_protocol")],
        )
        .err()
        .expect("librdkafka refuses the protocol");
        assert_eq!(error.error_class(), "SOURCE_FAILED");
        let message = error.to_string();
        assert!(
            message.contains("could not create the admin client")
                && message.contains("security.protocol"),
            "{message}"
        );
        let error = KafkaAdmin::with_options("127.0.0.1:1", [("security.protocol", "SASL_SSL")])
            .err()
            .expect("no prefix");
        assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
        assert!(error.to_string().contains("KafkaAdmin option"), "{error}");
    }

    #[test]
    fn an_admin_with_options_creates_and_deletes_topics() {
        let Some(bootstrap) = broker() else { return };
        let topic = format!(
            "rtflow-admin-options-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let admin = KafkaAdmin::with_options(
            &bootstrap,
            [
                ("kafka.client.id", "rtflow-admin-test"),
                ("kafka.security.protocol", "plaintext"),
            ],
        )
        .unwrap();
        admin.create_compacted_topic(&topic).unwrap();
        assert_eq!(admin.cleanup_policy(&topic).unwrap(), "compact");
        admin.delete_topic(&topic).unwrap();
    }

    #[test]
    fn a_missing_topic_has_no_policy_to_read() {
        let Some(bootstrap) = broker() else { return };
        let admin = KafkaAdmin::new(&bootstrap).unwrap();
        let started = Instant::now();
        let error = admin
            .cleanup_policy_within("rtflow-admin-no-such-topic", Duration::from_millis(300))
            .unwrap_err();
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "it asked again"
        );
        assert_eq!(error.error_class(), "SOURCE_FAILED");
        assert!(
            error
                .to_string()
                .contains("'rtflow-admin-no-such-topic' within 300 ms"),
            "{error}"
        );
    }
}
