//! The query's small compacted topics, one record per key, read whole: the
//! published shapes (`shape`) and the instances that ran (`departures`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};

use super::ClusterSettings;
use crate::kafka::admin::KafkaAdmin;
use crate::kafka::closing::ClosingConsumer;
use crate::kafka::producer::flush;

/// Makes `topic` compacted, unless it exists, with an admin client that has
/// the cluster's options.
pub(crate) fn create(settings: &ClusterSettings, topic: &str) -> Result<(), String> {
    KafkaAdmin::with_config(settings.client_config())
        .and_then(|admin| admin.create_compacted_topic(topic))
        .map_err(|e| e.to_string())
}

/// Writes `payload` under `key` in `topic` (created compacted if missing),
/// or deletes the key if `payload` is `None`, and waits until the broker has
/// it.
pub(crate) fn write(
    settings: &ClusterSettings,
    topic: &str,
    key: &str,
    payload: Option<&[u8]>,
) -> Result<(), String> {
    create(settings, topic)?;
    let producer: ThreadedProducer<DefaultProducerContext> = (settings.client_config())
        .create()
        .map_err(|e| format!("could not create a producer: {e}"))?;
    let mut record = BaseRecord::<str, [u8]>::to(topic).key(key);
    if let Some(payload) = payload {
        record = record.payload(payload);
    }
    producer
        .send(record)
        .map_err(|(e, _)| format!("could not write to '{topic}': {e}"))?;
    flush(&producer, settings.operation_timeout)
        .map_err(|e| format!("could not write to '{topic}': {e}"))
}

/// The last payload under each key of `topic`, read to its end as it was when
/// the read began; deleted keys are left out, and so is everything when the
/// topic does not exist.
pub(crate) fn read(
    settings: &ClusterSettings,
    topic: &str,
) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, String> {
    // Reading takes a group id, though nothing is committed.
    let consumer: BaseConsumer = settings
        .client_config()
        .set("group.id", format!("{}-{topic}", settings.group()))
        .create()
        .map_err(|e| format!("could not create a consumer: {e}"))?;
    let consumer = ClosingConsumer::new(consumer);
    let (_, high) = consumer
        .fetch_watermarks(topic, 0, settings.operation_timeout)
        .map_err(|e| format!("could not read '{topic}': {e}"))?;
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, 0, Offset::Beginning)
        .map_err(|e| e.to_string())?;
    consumer.assign(&list).map_err(|e| e.to_string())?;
    let mut latest = BTreeMap::new();
    let deadline = Instant::now() + settings.operation_timeout;
    let mut position = 0;
    while position < high {
        if Instant::now() > deadline {
            return Err(format!(
                "could not read '{topic}' to offset {high} within {:?}",
                settings.operation_timeout
            ));
        }
        let Some(Ok(message)) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        position = message.offset() + 1;
        let Some(key) = message.key() else { continue };
        match message.payload() {
            Some(payload) => latest.insert(key.to_vec(), payload.to_vec()),
            None => latest.remove(key),
        };
    }
    Ok(latest)
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::kafka::Options;

    /// The admin client that creates the shapes and instances topics is made
    /// with the cluster's options: one librdkafka refuses fails it, with no
    /// broker asked.
    #[test]
    fn the_topics_admin_client_takes_the_clusters_options() {
        let mut options = Options::default();
        options.set("kafka.security.protocol", "no_such_protocol");
        let settings = ClusterSettings::for_tests(options);
        let error = create(&settings, &settings.shapes_topic()).expect_err("refused");
        assert!(
            error.contains("could not create the admin client")
                && error.contains("security.protocol"),
            "{error}"
        );
    }
}
