//! [`KafkaLink`]: one process's [`ClusterLink`] to the Kafka cluster its query
//! runs on. It knows the partitions the consumer group assigned to the process,
//! holds the process's transactional producer, and commits each checkpoint as
//! one Kafka transaction: the output and repartition records its sinks staged
//! for the epoch, the changelog records of its keyed state, and its input
//! offsets (`send_offsets_to_transaction`, with the group's metadata, so that
//! a process the group has moved on from can no longer commit).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use rdkafka::{Offset, TopicPartitionList};
use rtflow_checkpoint::{Delta, Offsets};
use rtflow_runtime::cluster::{ClusterLink, ClusterRecovery, Exchanged};
use rtflow_runtime::{Epoch, Result, RtflowError, Sink, Source};

use super::changelog::{self, Fold};
use super::exchange::{ExchangeSink, ExchangeSource};
use super::local::Image;
use super::transactions::{Batch, Transactions};
use super::{ClusterSettings, WATERMARK_MARK};
use crate::kafka::admin::KafkaAdmin;
use crate::kafka::producer::KafkaMessage;

/// A `(topic, partition)`.
pub(crate) type TopicPartition = (String, i32);

type RestoredStates = BTreeMap<rtflow_checkpoint::StateId, rtflow_checkpoint::RestoredState>;

/// What the latest start of a run restored from the changelog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreStats {
    /// The partitions the run owns.
    pub partitions: usize,
    /// Bytes of changelog records read from Kafka (keys and values).
    pub changelog_bytes: u64,
    /// Bytes of live records taken from the process's local copies of the
    /// changelog partitions, which spared reading them from Kafka.
    pub local_bytes: u64,
    /// How long reading the committed offsets and the changelog took.
    pub duration: Duration,
}

/// What the link is for: learning the dataflow's topics before the process
/// joins the group, or running with the partitions the group assigned.
pub(crate) enum Mode {
    /// Every partition counts as owned; the topics asked about are recorded.
    Probe(Mutex<BTreeSet<String>>),
    Live {
        owned: BTreeSet<TopicPartition>,
        transactions: Arc<Transactions>,
    },
}

pub(crate) struct KafkaLink {
    pub(crate) settings: Arc<ClusterSettings>,
    pub(crate) mode: Mode,
}

impl KafkaLink {
    /// The topics the probe was asked about: the dataflow's inputs.
    pub(crate) fn probed_topics(&self) -> Vec<String> {
        match &self.mode {
            Mode::Probe(topics) => lock(topics).iter().cloned().collect(),
            Mode::Live { .. } => Vec::new(),
        }
    }

    pub(crate) fn transactions(&self) -> Option<&Arc<Transactions>> {
        match &self.mode {
            Mode::Live { transactions, .. } => Some(transactions),
            Mode::Probe(_) => None,
        }
    }

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::Checkpoint(format!(
            "cluster {} of query '{}': {message}",
            self.settings.bootstrap_servers, self.settings.query
        ))
    }

    fn owned_partitions(&self) -> Vec<TopicPartition> {
        match &self.mode {
            Mode::Live { owned, .. } => owned.iter().cloned().collect(),
            Mode::Probe(_) => Vec::new(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl ClusterLink for KafkaLink {
    fn member(&self) -> String {
        self.settings.instance.clone()
    }

    fn partitions(&self) -> Vec<String> {
        self.owned_partitions()
            .into_iter()
            .map(|(topic, partition)| format!("{topic}-{partition}"))
            .collect()
    }

    fn owns_key_group(&self, group: u32) -> bool {
        // Key group `g`'s state lives in changelog partition `g % partitions`,
        // which goes with repartition partition `g % partitions`.
        let partitions = self.settings.repartition_partitions as u32;
        let partition = (
            self.settings.repartition_topic(0),
            (group % partitions) as i32,
        );
        match &self.mode {
            Mode::Live { owned, .. } => owned.contains(&partition),
            Mode::Probe(_) => false,
        }
    }

    fn owned(&self, partitions: &[(String, i32)]) -> Vec<usize> {
        match &self.mode {
            Mode::Probe(topics) => {
                lock(topics).extend(partitions.iter().map(|(t, _)| t.clone()));
                (0..partitions.len()).collect()
            }
            Mode::Live { owned, .. } => partitions
                .iter()
                .enumerate()
                .filter(|(_, tp)| owned.contains(*tp))
                .map(|(i, _)| i)
                .collect(),
        }
    }

    fn exchange(
        &self,
        stage: usize,
    ) -> Result<(Box<dyn Sink<Exchanged>>, Box<dyn Source<Exchanged>>)> {
        let topic = self.settings.repartition_topic(stage);
        if matches!(self.mode, Mode::Probe(_)) {
            let admin = KafkaAdmin::new(&self.settings.bootstrap_servers)?;
            admin.create_topic(&topic, self.settings.repartition_partitions as i32)?;
            admin.create_compacted_topic_of(
                &self.settings.changelog_topic(),
                self.settings.repartition_partitions as i32,
            )?;
        }
        Ok((
            Box::new(ExchangeSink {
                settings: self.settings.clone(),
                topic: topic.clone(),
            }),
            Box::new(ExchangeSource {
                settings: self.settings.clone(),
                topic,
            }),
        ))
    }

    fn recover(&self) -> Result<ClusterRecovery> {
        let owned = self.owned_partitions();
        if owned.is_empty() {
            return Ok(ClusterRecovery::default());
        }
        let started = std::time::Instant::now();
        let offsets = self.committed_offsets(&owned)?;
        let changelog = self.settings.changelog_topic();
        let repartitions: Vec<i32> = owned
            .iter()
            .filter(|(topic, _)| self.settings.is_repartition_topic(topic))
            .map(|(_, p)| *p)
            .collect();
        let (state, read) = self.read_changelog(&changelog, &repartitions)?;
        if let Some(transactions) = self.transactions() {
            *lock(&transactions.last_restore) = Some(RestoreStats {
                partitions: owned.len(),
                changelog_bytes: read.changelog_bytes,
                local_bytes: read.local_bytes,
                duration: started.elapsed(),
            });
        }
        Ok(ClusterRecovery { offsets, state })
    }

    fn commit(
        &self,
        epoch: Epoch,
        offsets: &BTreeMap<String, Offsets>,
        deltas: &[Delta],
    ) -> Result<()> {
        let Some(transactions) = self.transactions() else {
            return Err(self.error("a probe does not commit"));
        };
        let partitions = self.settings.repartition_partitions as u32;
        let mut changes = Batch {
            topic: Some(self.settings.changelog_topic()),
            messages: Vec::new(),
        };
        for delta in deltas.iter().filter(|d| d.keyed) {
            for entry in &delta.entries {
                let (key, value) = changelog::record(&delta.state, &delta.meta, entry);
                changes.messages.push(KafkaMessage {
                    topic: None,
                    partition: Some((entry.group % partitions) as i32),
                    key: Some(key.into()),
                    value: value.map(Into::into),
                    headers: Vec::new(),
                });
            }
        }
        let positions = positions(offsets.values(), |topic| self.settings.group_of(topic))?;
        transactions.commit(epoch, changes, &positions)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl KafkaLink {
    /// The group's committed offsets of `partitions`, as the readers label
    /// them. The consumer reads them `read_committed`, so an offset commit
    /// still inside an open transaction is waited for, not read.
    fn committed_offsets(&self, partitions: &[TopicPartition]) -> Result<Offsets> {
        let mut by_group: BTreeMap<String, TopicPartitionList> = BTreeMap::new();
        for (topic, partition) in partitions {
            by_group
                .entry(self.settings.group_of(topic))
                .or_default()
                .add_partition(topic, *partition);
        }
        let mut offsets = Offsets::new();
        for (group, list) in by_group {
            self.read_committed_offsets(&group, list, &mut offsets)?;
        }
        Ok(offsets)
    }

    fn read_committed_offsets(
        &self,
        group: &str,
        list: TopicPartitionList,
        offsets: &mut Offsets,
    ) -> Result<()> {
        let consumer: BaseConsumer = self
            .settings
            .committed_reader(group)
            .create()
            .map_err(|e| self.error(format!("could not create a consumer: {e}")))?;
        let committed = consumer
            .committed_offsets(list, self.settings.operation_timeout)
            .map_err(|e| self.error(format!("could not read the committed offsets: {e}")))?;
        for element in committed.elements() {
            let Offset::Offset(offset) = element.offset() else {
                continue;
            };
            let label = format!("{}-{}", element.topic(), element.partition());
            for (upstream, watermark) in parse_watermarks(element.metadata()) {
                offsets.insert(format!("{label}{WATERMARK_MARK}{upstream}"), watermark);
            }
            offsets.insert(label, offset);
        }
        Ok(())
    }

    /// The keyed state in `partitions` of the changelog, folded: from the
    /// local copy of each partition where there is one, then the changelog
    /// after it.
    fn read_changelog(
        &self,
        changelog: &str,
        partitions: &[i32],
    ) -> Result<(RestoredStates, Read)> {
        let mut read = Read::default();
        if partitions.is_empty() {
            return Ok((BTreeMap::new(), read));
        }
        let consumer: BaseConsumer<EndsExpected> = self
            .settings
            .committed_reader(&self.settings.group())
            .set("enable.partition.eof", "true")
            .set("auto.offset.reset", "earliest")
            // The end of a partition is known only from a fetch that found
            // nothing more, which the broker holds up to this long: with the
            // default 500 ms every restore, a failover's included, waited it.
            .set("fetch.wait.max.ms", "10")
            .create_with_context(EndsExpected)
            .map_err(|e| self.error(format!("could not create a consumer: {e}")))?;
        let mut list = TopicPartitionList::new();
        let mut images: BTreeMap<i32, Image> = BTreeMap::new();
        for partition in partitions {
            let (low, high) = consumer
                .fetch_watermarks(changelog, *partition, self.settings.operation_timeout)
                .map_err(|e| self.error(format!("could not read the changelog's end: {e}")))?;
            let copy = self
                .settings
                .copies
                .as_ref()
                .and_then(|copies| copies.load(changelog, *partition))
                .filter(|image| (low..=high).contains(&image.offset));
            let image = copy.unwrap_or(Image {
                offset: low,
                ..Image::default()
            });
            read.local_bytes += image.bytes();
            if image.offset < high {
                list.add_partition_offset(changelog, *partition, Offset::Offset(image.offset))
                    .map_err(|e| self.error(e))?;
            }
            images.insert(*partition, image);
        }
        let mut open: BTreeSet<i32> = list.elements().iter().map(|e| e.partition()).collect();
        if !open.is_empty() {
            consumer
                .assign(&list)
                .map_err(|e| self.error(format!("could not read the changelog: {e}")))?;
        }
        let deadline = std::time::Instant::now() + self.settings.restore_timeout;
        while !open.is_empty() {
            if std::time::Instant::now() > deadline {
                return Err(self.error(format!(
                    "the changelog '{changelog}' was not read to its end within {:?}",
                    self.settings.restore_timeout
                )));
            }
            match consumer.poll(Duration::from_millis(100)) {
                None => {}
                Some(Ok(message)) => {
                    use rdkafka::Message;
                    let (Some(key), Some(image)) =
                        (message.key(), images.get_mut(&message.partition()))
                    else {
                        continue;
                    };
                    read.changelog_bytes += (key.len() + message.payload_len()) as u64;
                    image.apply(key, message.payload());
                }
                Some(Err(KafkaError::PartitionEOF(partition))) => {
                    let position = consumer
                        .position()
                        .map_err(|e| self.error(format!("could not read a position: {e}")))?;
                    if let (Some(Offset::Offset(offset)), Some(image)) = (
                        position
                            .find_partition(changelog, partition)
                            .map(|p| p.offset()),
                        images.get_mut(&partition),
                    ) {
                        image.offset = offset;
                    }
                    open.remove(&partition);
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, "changelog read error; retrying");
                }
            }
        }
        let mut fold = Fold::default();
        for (partition, image) in &mut images {
            for (key, value) in &image.records {
                fold.apply(key, Some(value))?;
            }
            if let Some(copies) = &self.settings.copies {
                copies.save(changelog, *partition, image)?;
            }
        }
        Ok((fold.into_states()?, read))
    }
}

/// What a restore read: from local copies, and from the changelog.
#[derive(Debug, Default, Clone, Copy)]
struct Read {
    local_bytes: u64,
    changelog_bytes: u64,
}

/// The context of a consumer that reads partitions to their end: the end of
/// a partition is what it waits for, not an error to log.
struct EndsExpected;

impl ClientContext for EndsExpected {
    fn error(&self, error: KafkaError, reason: &str) {
        let end = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !end {
            tracing::warn!(%error, reason, "changelog consumer error");
        }
    }
}

impl ConsumerContext for EndsExpected {}

/// The readers' offset labels as a partition list per consumer group
/// (`group_of` a topic): `topic-partition` is the
/// next offset to read; `topic-partition@upstream` a repartition reader's
/// watermark of an upstream source partition, which travels as the offset's
/// metadata, committed with it.
fn positions<'a>(
    offsets: impl Iterator<Item = &'a Offsets>,
    group_of: impl Fn(&str) -> String,
) -> Result<BTreeMap<String, TopicPartitionList>> {
    let mut next: BTreeMap<TopicPartition, i64> = BTreeMap::new();
    let mut watermarks: BTreeMap<TopicPartition, Vec<(String, i64)>> = BTreeMap::new();
    for labels in offsets {
        for (label, value) in labels {
            match label.split_once(WATERMARK_MARK) {
                Some((partition, upstream)) => watermarks
                    .entry(parse_label(partition)?)
                    .or_default()
                    .push((upstream.to_owned(), *value)),
                None => {
                    next.insert(parse_label(label)?, *value);
                }
            }
        }
    }
    let mut lists: BTreeMap<String, TopicPartitionList> = BTreeMap::new();
    for (tp, offset) in next {
        let metadata = watermarks
            .get(&tp)
            .map(|w| {
                w.iter()
                    .map(|(upstream, watermark)| format!("{upstream}={watermark}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let list = lists.entry(group_of(&tp.0)).or_default();
        let mut element = list.add_partition(&tp.0, tp.1);
        element
            .set_offset(Offset::Offset(offset))
            .map_err(|e| RtflowError::Checkpoint(e.to_string()))?;
        element.set_metadata(metadata);
    }
    Ok(lists)
}

fn parse_label(label: &str) -> Result<TopicPartition> {
    label
        .rsplit_once('-')
        .and_then(|(topic, partition)| Some((topic.to_owned(), partition.parse().ok()?)))
        .ok_or_else(|| {
            RtflowError::Checkpoint(format!(
                "offset label '{label}' names no topic partition; a clustered query reads \
                 only Kafka topics"
            ))
        })
}

fn parse_watermarks(metadata: &str) -> Vec<(String, i64)> {
    metadata
        .split(',')
        .filter_map(|pair| {
            let (upstream, watermark) = pair.split_once('=')?;
            Some((upstream.to_owned(), watermark.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_become_offsets_and_watermarks_their_metadata() {
        let offsets: Offsets = [
            ("orders-2".to_owned(), 17),
            ("rtflow-q-0-repartition-1".to_owned(), 40),
            (format!("rtflow-q-0-repartition-1{WATERMARK_MARK}0"), 900),
            (
                format!("rtflow-q-0-repartition-1{WATERMARK_MARK}upstream"),
                3,
            ),
        ]
        .into_iter()
        .collect();
        let group_of = |topic: &str| topic.split('-').next().unwrap().to_owned();
        let lists = positions([&offsets].into_iter(), group_of).unwrap();
        assert_eq!(lists.keys().collect::<Vec<_>>(), ["orders", "rtflow"]);
        let orders = lists["orders"].find_partition("orders", 2).unwrap();
        assert_eq!(orders.offset(), Offset::Offset(17));
        assert_eq!(orders.metadata(), "");
        let repartition = lists["rtflow"]
            .find_partition("rtflow-q-0-repartition", 1)
            .unwrap();
        assert_eq!(repartition.offset(), Offset::Offset(40));
        assert_eq!(
            parse_watermarks(repartition.metadata()),
            vec![("0".to_owned(), 900), ("upstream".to_owned(), 3)]
        );
    }

    #[test]
    fn a_label_that_names_no_partition_is_a_checkpoint_failure() {
        let offsets: Offsets = [("memory".to_owned(), 1)].into_iter().collect();
        let error = positions([&offsets].into_iter(), str::to_owned).unwrap_err();
        assert_eq!(error.error_class(), "CHECKPOINT_FAILED");
    }
}
