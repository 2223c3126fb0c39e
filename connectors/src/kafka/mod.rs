//! Apache Kafka source and sink, through rdkafka (librdkafka).
//!
//! - [`KafkaSource`] reads topics (a list, a pattern, or explicit partitions) with
//!   one long-running reader actor per topic partition by default. Partitions are
//!   assigned manually and offsets are tracked by rtflow: there is no consumer
//!   group and no rebalancing.
//! - [`KafkaSink`] writes records to a fixed topic or to the topic each record
//!   names, with one request in flight by default (records keep their order on
//!   retries); at-least-once (`linger.ms=0.2`), or exactly-once through Kafka
//!   transactions committed with each checkpoint (`exactly_once`, `linger.ms=20`:
//!   its records show only at the commit).
//! - [`KafkaCluster`] runs one query in several processes: a consumer group
//!   shares the partitions out, `repartition_by` goes through a repartition
//!   topic, keyed state through a changelog topic, and each process commits
//!   its checkpoints as Kafka transactions.
//! - [`KafkaAdmin`] creates and deletes topics, for examples and tests.
//!
//! Both connectors take librdkafka settings as `.option("kafka.<key>", value)`;
//! they override rtflow's low-latency defaults.

mod admin;
mod closing;
mod cluster;
mod exactly_once;
mod lag;
mod metadata;
mod producer;
mod sink;
mod source;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdkafka::ClientConfig;
use rtflow_runtime::{Result, RtflowError};

pub use admin::KafkaAdmin;
pub use cluster::{ClusteredQuery, KafkaCluster, RestoreStats};
pub use producer::KafkaMessage;
pub use sink::{DeliveryGuarantee, KafkaSink};
pub use source::{KafkaSource, StartingOffsets};

/// How long start-up waits for the broker's metadata before failing.
const DEFAULT_METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// What a record's Kafka timestamp means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TimestampType {
    /// Set by the producer.
    CreateTime,
    /// Set by the broker when it appended the record.
    LogAppendTime,
}

/// One record read from Kafka; serde types, so that a clustered query can
/// repartition records as read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KafkaRecord {
    /// The topic, shared by every record of its partition: reading a record
    /// allocates no copy of its name.
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Bytes>,
    pub value: Option<Bytes>,
    /// Milliseconds since the Unix epoch, with its meaning.
    pub timestamp: Option<(i64, TimestampType)>,
    pub headers: Vec<(String, Option<Bytes>)>,
}

impl KafkaRecord {
    /// The value as UTF-8 text (lossy), or "" when there is none.
    pub fn value_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.value.as_deref().unwrap_or_default())
    }

    /// The key as UTF-8 text (lossy), or "" when there is none.
    pub fn key_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.key.as_deref().unwrap_or_default())
    }

    /// The first header named `name`.
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .and_then(|(_, value)| value.as_ref())
    }
}

/// `kafka.`-prefixed options, checked and stripped of their prefix.
#[derive(Debug, Clone, Default)]
struct Options(BTreeMap<String, String>);

impl Options {
    fn set(&mut self, key: &str, value: &str) {
        self.0.insert(key.to_owned(), value.to_owned());
    }

    /// A librdkafka configuration: what every client of rtflow sets, then
    /// `defaults`, then the user's options over them.
    fn client_config(&self, connector: &str, defaults: &[(&str, &str)]) -> Result<ClientConfig> {
        let mut config = ClientConfig::new();
        // Small requests (a record, a frame, a transaction's round trip) go
        // at once rather than wait for the acknowledgement of the one before.
        config.set("socket.nagle.disable", "true");
        for (key, value) in defaults {
            config.set(*key, *value);
        }
        for (key, value) in &self.0 {
            let Some(librdkafka_key) = key.strip_prefix("kafka.") else {
                return Err(RtflowError::InvalidConfiguration(format!(
                    "{connector} option '{key}' is unknown; librdkafka settings take the \
                     prefix 'kafka.', as in .option(\"kafka.fetch.wait.max.ms\", \"50\")"
                )));
            };
            config.set(librdkafka_key, value);
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_sends_at_once_unless_the_user_says_otherwise() {
        let defaults = Options::default()
            .client_config("KafkaSink", &[("linger.ms", "0.2")])
            .unwrap();
        assert_eq!(defaults.get("socket.nagle.disable"), Some("true"));
        assert_eq!(defaults.get("linger.ms"), Some("0.2"));
        let mut options = Options::default();
        options.set("kafka.socket.nagle.disable", "false");
        let config = options.client_config("KafkaSink", &[]).unwrap();
        assert_eq!(config.get("socket.nagle.disable"), Some("false"));
    }
}
