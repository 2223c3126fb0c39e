//! Topic administration: the exactly-once sink's commit topic, and topics for
//! examples, benchmarks and tests. Topics get the cluster's default
//! replication factor (`default.replication.factor`).

use std::time::Duration;

use futures_executor::block_on;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use rtflow_runtime::{Result, RtflowError};

/// Creates and deletes topics on a Kafka cluster.
///
/// ```no_run
/// use rtflow_connectors::kafka::KafkaAdmin;
/// let admin = KafkaAdmin::new("127.0.0.1:9092")?;
/// admin.create_topic("clicks", 3)?;
/// # Ok::<(), rtflow_runtime::RtflowError>(())
/// ```
pub struct KafkaAdmin {
    client: AdminClient<DefaultClientContext>,
    options: AdminOptions,
}

fn admin_error(message: impl std::fmt::Display) -> RtflowError {
    RtflowError::source("kafka admin", message)
}

impl KafkaAdmin {
    /// Connects to the cluster at `bootstrap_servers`.
    pub fn new(bootstrap_servers: &str) -> Result<Self> {
        let client = ClientConfig::new()
            .set("bootstrap.servers", bootstrap_servers)
            .create()
            .map_err(admin_error)?;
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        Ok(Self { client, options })
    }

    /// Creates `topic` with `partitions` partitions; an existing topic is left
    /// as it is.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.create(topic, partitions, &[])
    }

    /// Creates a one-partition compacted topic (for the latest value per key),
    /// unless it exists: what an exactly-once sink's commit topic must be.
    pub fn create_compacted_topic(&self, topic: &str) -> Result<()> {
        self.create(topic, 1, &[("cleanup.policy", "compact")])
    }

    /// The cleanup policy of an existing `topic` (`delete`, `compact`, or both).
    pub(crate) fn cleanup_policy(&self, topic: &str) -> Result<String> {
        let specifier = ResourceSpecifier::Topic(topic);
        let results = block_on(self.client.describe_configs([&specifier], &self.options))
            .map_err(admin_error)?;
        let described = results
            .into_iter()
            .next()
            .ok_or_else(|| admin_error(format!("no configuration for topic '{topic}'")))?
            .map_err(|code| admin_error(format!("could not describe topic '{topic}': {code}")))?;
        Ok(described
            .get("cleanup.policy")
            .and_then(|entry| entry.value.clone())
            .unwrap_or_default())
    }

    fn create(&self, topic: &str, partitions: i32, config: &[(&str, &str)]) -> Result<()> {
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
