//! [`KafkaLink`]: one process's [`ClusterLink`] to the Kafka cluster its query
//! runs on. It knows the partitions the consumer group assigned to the process,
//! holds the process's transactional producer, and commits each checkpoint as
//! one Kafka transaction: the output and repartition records its sinks staged
//! for the epoch, the changelog records of its keyed state, and its input
//! offsets (`send_offsets_to_transaction`, with the group's metadata, so that
//! a process the group has moved on from can no longer commit).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use rdkafka::{Offset, TopicPartitionList};
use rtflow_checkpoint::{Delta, Offsets};
use rtflow_runtime::cluster::{ClusterLink, ClusterRecovery, CommitOrder, Exchanged, Membership};
use rtflow_runtime::{Epoch, Result, RtflowError, Sink, SinkContext, Source};

use super::changelog::{self, Fold};
use super::exchange::{ExchangeSink, ExchangeSource};
use super::local::{self, Image};
use super::second_tier::SecondTier;
use super::transactions::{Batch, Lanes, Tier, Tiers};
use super::upstream::{Reads, Upstream, Verified, READ_MARK};
use super::{lock, while_coordinator_moves, ClusterSettings, WATERMARK_MARK};
use crate::kafka::admin::KafkaAdmin;
use crate::kafka::closing::ClosingConsumer;
use crate::kafka::metadata;
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
        /// What the process owns now: a handover inside the run changes it.
        owned: Mutex<Arc<Owned>>,
        transactions: Arc<Tiers>,
        /// What the process knows of the transactions its readers read from.
        upstream: Arc<Upstream>,
        /// What the run's commits verified its readers read.
        verified: Arc<Mutex<Verified>>,
        /// Commits each epoch's second transaction beside the next epoch.
        second: SecondTier,
        /// The epoch whose first transaction `commit_first` committed, until
        /// `commit` of that epoch commits the rest.
        first_committed: Mutex<Option<Epoch>>,
        /// Where the run tells what it restored.
        last_restore: Arc<Mutex<Option<RestoreStats>>>,
    },
}

pub(crate) struct KafkaLink {
    pub(crate) settings: Arc<ClusterSettings>,
    pub(crate) mode: Mode,
    /// What commits second, as the dataflow's plan decided.
    pub(crate) order: Arc<Mutex<CommitOrder>>,
}

impl KafkaLink {
    /// The topics the probe was asked about: the dataflow's inputs.
    pub(crate) fn probed_topics(&self) -> Vec<String> {
        match &self.mode {
            Mode::Probe(topics) => lock(topics).iter().cloned().collect(),
            Mode::Live { .. } => Vec::new(),
        }
    }

    pub(crate) fn transactions(&self) -> Option<&Arc<Tiers>> {
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
            Mode::Live { owned, .. } => lock(owned).partitions.iter().cloned().collect(),
            Mode::Probe(_) => Vec::new(),
        }
    }

    /// Waits until the run's last second transaction ended; fails if one
    /// failed. A run's end and a handover wait for it: the partitions'
    /// next run, here or elsewhere, resumes from what they committed.
    pub(crate) fn settle(&self) -> Result<()> {
        match &self.mode {
            Mode::Live { second, .. } => second.settle(),
            Mode::Probe(_) => Ok(()),
        }
    }

    /// The run handed partitions over: the process owns `owned` from now on.
    pub(crate) fn hand_over(&self, owned: Arc<Owned>) {
        if let Mode::Live { owned: now, .. } = &self.mode {
            *lock(now) = owned;
        }
    }
}

/// What a process owns of a clustered query's partitions: every stage's
/// partition `p` goes with partition `p` of the changelog and its key groups.
pub(crate) struct Owned {
    settings: Arc<ClusterSettings>,
    partitions: BTreeSet<TopicPartition>,
}

impl Owned {
    pub(crate) fn new(
        settings: Arc<ClusterSettings>,
        partitions: BTreeSet<TopicPartition>,
    ) -> Self {
        Self {
            settings,
            partitions,
        }
    }
}

impl Membership for Owned {
    fn member(&self) -> String {
        self.settings.instance.clone()
    }

    fn partitions(&self) -> Vec<String> {
        (self.partitions.iter())
            .map(|(topic, partition)| format!("{topic}-{partition}"))
            .collect()
    }

    fn owns_key_group(&self, group: u32) -> bool {
        // Key group `g`'s state lives in changelog partition `g % partitions`,
        // which goes with partition `g % partitions` of every repartition
        // topic: the process owns it in all stages or in none.
        let partitions = self.settings.repartition_partitions as u32;
        let partition = (
            self.settings.repartition_topic(0),
            (group % partitions) as i32,
        );
        self.partitions.contains(&partition)
    }

    fn owned(&self, partitions: &[(String, i32)]) -> Vec<usize> {
        (partitions.iter().enumerate())
            .filter(|(_, tp)| self.partitions.contains(*tp))
            .map(|(i, _)| i)
            .collect()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The transaction of the process `ctx` runs in that a writer stages its
/// records in: the one of its tier.
pub(crate) fn transactions_of(ctx: &SinkContext, sink: &str) -> Result<Lanes> {
    ctx.cluster
        .as_ref()
        .and_then(|link| link.as_any().downcast_ref::<KafkaLink>())
        .and_then(|link| link.transactions())
        .map(|tiers| tiers.of(Tier::of(ctx.commits_second)).clone())
        .ok_or_else(|| {
            RtflowError::sink(
                sink,
                "this writer runs only in a query clustered on Kafka (KafkaCluster)",
            )
        })
}

impl Membership for KafkaLink {
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
        match &self.mode {
            Mode::Live { owned, .. } => lock(owned).owns_key_group(group),
            Mode::Probe(_) => false,
        }
    }

    fn owned(&self, partitions: &[(String, i32)]) -> Vec<usize> {
        match &self.mode {
            Mode::Probe(topics) => {
                lock(topics).extend(partitions.iter().map(|(t, _)| t.clone()));
                (0..partitions.len()).collect()
            }
            Mode::Live { owned, .. } => lock(owned).owned(partitions),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ClusterLink for KafkaLink {
    fn exchange(
        &self,
        stage: usize,
    ) -> Result<(Box<dyn Sink<Exchanged>>, Box<dyn Source<Exchanged>>)> {
        let topic = self.settings.repartition_topic(stage);
        if matches!(self.mode, Mode::Probe(_)) {
            let admin = KafkaAdmin::with_config(self.settings.client_config())?;
            admin.create_topic(&topic, self.settings.repartition_partitions as i32)?;
            admin.create_compacted_topic_of(
                &self.settings.changelog_topic(),
                self.settings.repartition_partitions as i32,
            )?;
        }
        let upstream = match &self.mode {
            Mode::Live { upstream, .. } => Some(upstream.clone()),
            Mode::Probe(_) => None,
        };
        Ok((
            Box::new(ExchangeSink::new(
                self.settings.clone(),
                topic.clone(),
                self.transactions().cloned(),
            )),
            Box::new(ExchangeSource {
                settings: self.settings.clone(),
                topic,
                stage,
                order: self.order.clone(),
                upstream,
            }),
        ))
    }

    fn commit_order(&self, order: CommitOrder) {
        tracing::debug!(?order, "commit order");
        *lock(&self.order) = order;
    }

    fn recover(&self) -> Result<ClusterRecovery> {
        let (recovery, restored) = self.recover_partitions(&self.owned_partitions())?;
        self.restored(restored);
        Ok(recovery)
    }

    fn commit_first(&self, epoch: Epoch, offsets: &BTreeMap<String, Offsets>) -> Result<()> {
        let Mode::Live {
            first_committed, ..
        } = &self.mode
        else {
            return Err(self.error("a probe does not commit"));
        };
        self.commit_sourced(epoch, offsets)?;
        *lock(first_committed) = Some(epoch);
        Ok(())
    }

    fn commit(
        &self,
        epoch: Epoch,
        offsets: &BTreeMap<String, Offsets>,
        deltas: &[Delta],
    ) -> Result<()> {
        let Mode::Live {
            transactions,
            upstream,
            verified,
            second,
            first_committed,
            ..
        } = &self.mode
        else {
            return Err(self.error("a probe does not commit"));
        };
        if lock(first_committed).take() != Some(epoch) {
            self.commit_sourced(epoch, offsets)?;
        }
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
        let later = self.offsets_committing(offsets, true);
        let repartitioned =
            positions(later.iter().copied(), |topic| self.settings.group_of(topic))?;
        tracing::debug!(
            epoch,
            changes = changes.messages.len(),
            ?repartitioned,
            "committing the second transaction"
        );
        let second_transaction = SecondTransaction {
            epoch,
            reads: reads(later.into_iter())?,
            changes,
            positions: repartitioned,
        };
        let (transactions, upstream, verified) =
            (transactions.clone(), upstream.clone(), verified.clone());
        // After a second transaction that failed it is dropped, and the next
        // epoch's first commit fails the run.
        second.hand_over(
            epoch,
            Box::new(move || second_transaction.commit(&transactions, &upstream, &verified)),
        );
        Ok(())
    }
}

/// What an epoch's second transaction commits: the changelog's `changes`
/// and the `positions` of what was read after a repartition, once the
/// `reads` of those readers ended committed.
struct SecondTransaction {
    epoch: Epoch,
    reads: BTreeMap<TopicPartition, Reads>,
    changes: Batch,
    positions: BTreeMap<String, TopicPartitionList>,
}

impl SecondTransaction {
    fn commit(self, tiers: &Tiers, upstream: &Upstream, verified: &Mutex<Verified>) -> Result<()> {
        fail::fail_point!("second-transaction", |message| Err(
            RtflowError::Checkpoint(message.unwrap_or_default())
        ));
        let checks: Vec<_> = {
            let verified = lock(verified);
            (self.reads.iter())
                .filter_map(|(partition, reads)| {
                    Some((partition.clone(), verified.check(partition, reads)?))
                })
                .collect()
        };
        upstream.verify(&checks)?;
        tiers.commit(
            Tier::Repartitioned,
            self.epoch,
            self.changes,
            &self.positions,
        )?;
        let mut verified = lock(verified);
        for (partition, reads) in self.reads {
            verified.passed(partition, reads);
        }
        Ok(())
    }
}

impl KafkaLink {
    /// Of `offsets` (by source uid), those of the sources whose offsets
    /// commit second ([`CommitOrder::second`]), or first.
    fn offsets_committing<'a>(
        &self,
        offsets: &'a BTreeMap<String, Offsets>,
        second: bool,
    ) -> Vec<&'a Offsets> {
        let order = lock(&self.order);
        (offsets.iter())
            .filter(|(uid, _)| order.second.contains(*uid) == second)
            .map(|(_, o)| o)
            .collect()
    }

    /// Commits epoch `epoch`'s first transaction: the offsets of the sources
    /// that commit first, among `offsets`, with the records written of them.
    fn commit_sourced(&self, epoch: Epoch, offsets: &BTreeMap<String, Offsets>) -> Result<()> {
        let Mode::Live {
            transactions,
            second,
            ..
        } = &self.mode
        else {
            return Err(self.error("a probe does not commit"));
        };
        let first = self.offsets_committing(offsets, false);
        let sourced = positions(first.into_iter(), |topic| self.settings.group_of(topic))?;
        tracing::debug!(epoch, ?sourced, "committing the first transaction");
        let nothing = Batch {
            topic: None,
            messages: Vec::new(),
        };
        // A run whose second transaction failed lost that epoch's records:
        // it starts over from its last commit. Its first transaction is
        // sound (it holds only what the run read of the source topics and
        // wrote from it) and other processes read it before it commits:
        // aborted, it would roll their runs back in turn, and theirs the
        // next. So it commits, as the run's last.
        if let Err(error) = second.check() {
            tracing::warn!(epoch, %error, "the second transaction failed; the run commits its first and rolls back the rest");
            transactions.commit_last(Tier::Sourced, epoch, nothing, &sourced)?;
            return Err(error);
        }
        transactions.commit(Tier::Sourced, epoch, nothing, &sourced)
    }

    /// Where `owned`, partitions of this process, resume: their committed
    /// offsets, and the keyed state of the key groups they carry, with what
    /// reading them took. For a run's start, and for partitions a run adopts
    /// while it goes on.
    pub(crate) fn recover_partitions(
        &self,
        owned: &[TopicPartition],
    ) -> Result<(ClusterRecovery, RestoreStats)> {
        let started = std::time::Instant::now();
        let stats = |read: Read| RestoreStats {
            partitions: owned.len(),
            changelog_bytes: read.changelog_bytes,
            local_bytes: read.local_bytes,
            duration: started.elapsed(),
        };
        if owned.is_empty() {
            return Ok((ClusterRecovery::default(), stats(Read::default())));
        }
        let offsets = self.committed_offsets(owned)?;
        tracing::debug!(?offsets, "committed offsets read");
        let changelog = self.settings.changelog_topic();
        // Every stage's partition `p` carries the key groups of changelog
        // partition `p`: read it once.
        let repartitions: Vec<i32> = owned
            .iter()
            .filter(|(topic, _)| self.settings.is_repartition_topic(topic))
            .map(|(_, p)| *p)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let (state, read) = self.read_changelog(&changelog, &repartitions)?;
        Ok((ClusterRecovery { offsets, state }, stats(read)))
    }

    /// Tells the process what the latest restore read.
    pub(crate) fn restored(&self, stats: RestoreStats) {
        if let Mode::Live { last_restore, .. } = &self.mode {
            *lock(last_restore) = Some(stats);
        }
    }

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
        // Each group's read waits on a client of its own: side by side, a
        // run's start waits on one.
        let reads: Vec<Result<Offsets>> = std::thread::scope(|scope| {
            let reads: Vec<_> = by_group
                .into_iter()
                .map(|(group, list)| {
                    scope.spawn(move || {
                        let mut offsets = Offsets::new();
                        self.read_committed_offsets(&group, list, &mut offsets)
                            .map(|()| offsets)
                    })
                })
                .collect();
            reads
                .into_iter()
                .map(|read| {
                    read.join()
                        .unwrap_or_else(|_| Err(self.error("reading committed offsets panicked")))
                })
                .collect()
        });
        let mut offsets = Offsets::new();
        for read in reads {
            offsets.extend(read?);
        }
        Ok(offsets)
    }

    fn read_committed_offsets(
        &self,
        group: &str,
        list: TopicPartitionList,
        offsets: &mut Offsets,
    ) -> Result<()> {
        // A client kept from run to run: a new one would connect and look
        // the group's coordinator up first, some 50 ms of every rebalance's
        // pause. One that failed is not kept.
        let config = self.settings.committed_reader(group);
        let reader = metadata::client(&config)
            .map_err(|e| self.error(format!("could not create a consumer: {e}")))?;
        // While a broker's death moves the group's coordinator, the read is
        // refused for a few seconds: asked again, not failed, or the quick
        // restarts of a run would use up its tries within a second.
        let timeout = self.settings.operation_timeout;
        let committed =
            while_coordinator_moves(timeout, || reader.committed_offsets(list.clone(), timeout))
                .inspect_err(|_| metadata::forget(&config))
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
        let consumer = ClosingConsumer::new(consumer);
        // The end to read to is the high watermark, which a read_uncommitted
        // client is told. A read_committed one is told the last stable
        // offset, which stays at the start of a transaction until the broker
        // has written its commit markers, some time after the commit
        // returned; the committed offsets, read before, wait for them. A run
        // restored right after the previous one committed then resumed from
        // the new offsets with the state as it was before that commit.
        let ends_config = self.settings.uncommitted_reader();
        let ends = metadata::client(&ends_config)
            .map_err(|e| self.error(format!("could not create a consumer: {e}")))?;
        let mut list = TopicPartitionList::new();
        let mut images: BTreeMap<i32, Image> = BTreeMap::new();
        // The partitions still to read, each with the end to read it to.
        let mut open: BTreeMap<i32, i64> = BTreeMap::new();
        for partition in partitions {
            // A kept client that failed may go on failing (its metadata
            // stale after a broker's crash): the next run makes a new one.
            let (low, high) = ends
                .fetch_watermarks(changelog, *partition, self.settings.operation_timeout)
                .inspect_err(|_| metadata::forget(&ends_config))
                .map_err(|e| self.error(format!("could not read the changelog's end: {e}")))?;
            let copies = self.settings.copies.as_ref();
            let image = local::resume(copies, changelog, *partition, (low, high));
            tracing::debug!(
                changelog,
                partition,
                from = image.offset,
                high,
                "restoring a changelog partition"
            );
            read.local_bytes += image.bytes();
            if image.offset < high {
                list.add_partition_offset(changelog, *partition, Offset::Offset(image.offset))
                    .map_err(|e| self.error(e))?;
                open.insert(*partition, high);
            }
            images.insert(*partition, image);
        }
        if !open.is_empty() {
            consumer
                .assign(&list)
                .map_err(|e| self.error(format!("could not read the changelog: {e}")))?;
        }
        let deadline = std::time::Instant::now() + self.settings.restore_timeout;
        // Since when the read has waited at a transaction still open, and
        // whether that was told.
        let mut held_since: Option<std::time::Instant> = None;
        let mut told = false;
        // The partitions whose read reached the end it could see without a
        // record, and those read again since their last stable offset (what
        // a `read_committed` reader may read up to) passed the high watermark.
        let mut quiet: BTreeSet<i32> = BTreeSet::new();
        let mut read_again: BTreeSet<i32> = BTreeSet::new();
        let mut stable_asked = std::time::Instant::now();
        while !open.is_empty() {
            let asked: Vec<i32> = if stable_asked.elapsed() >= QUIET_ASK_EVERY {
                stable_asked = std::time::Instant::now();
                quiet.iter().copied().collect()
            } else {
                Vec::new()
            };
            for partition in asked {
                let (_, stable) = consumer
                    .fetch_watermarks(changelog, partition, self.settings.operation_timeout)
                    .map_err(|e| self.error(format!("could not read the changelog's end: {e}")))?;
                // Short of the high watermark, a transaction before it is
                // still open (or its markers are on their way): what it
                // committed may come, so the read waits. Past it, everything
                // there has ended: the partition is read again from where it
                // began, and a read that again finds nothing is done.
                if stable < open[&partition] {
                    held_since.get_or_insert_with(std::time::Instant::now);
                    continue;
                }
                let began = Offset::Offset(images[&partition].offset);
                consumer
                    .seek(changelog, partition, began, self.settings.operation_timeout)
                    .map_err(|e| self.error(format!("could not read the changelog: {e}")))?;
                quiet.remove(&partition);
                read_again.insert(partition);
            }
            let held_for = held_since.map(|since| since.elapsed());
            if !told && held_for.is_some_and(|held| held >= OPEN_TRANSACTION_NOTICE) {
                tracing::warn!(changelog, partitions = ?open.keys(), transaction_timeout = ?self.settings.transaction_timeout, "the restore waits for a changelog transaction left open: a process gone unfenced, whose transaction timeout ends it");
                told = true;
            }
            if std::time::Instant::now() > deadline {
                let why = if held_for.is_some() {
                    ": a transaction there stayed open"
                } else {
                    ""
                };
                return Err(self.error(format!(
                    "the changelog '{changelog}' was not read to its end within {:?}{why}",
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
                    let offset = position
                        .find_partition(changelog, partition)
                        .map(|p| p.offset());
                    let (Some(image), Some(&high)) =
                        (images.get_mut(&partition), open.get(&partition))
                    else {
                        continue;
                    };
                    // librdkafka may tell no position before a partition's
                    // first record: where the read ended is then not known,
                    // and a transaction still open may begin right where it
                    // began. Taking that for the end once restored a local
                    // copy without what committed behind such a transaction.
                    let Some(Offset::Offset(offset)) = offset else {
                        if read_again.remove(&partition) {
                            // Read again from where it began once everything
                            // before the high watermark had ended, it found
                            // nothing committed there.
                            image.offset = high;
                            open.remove(&partition);
                        } else {
                            quiet.insert(partition);
                        }
                        continue;
                    };
                    quiet.remove(&partition);
                    read_again.remove(&partition);
                    image.offset = offset;
                    // Short of the high watermark, the read stopped at a
                    // transaction: one committed whose markers are on their
                    // way, or one a process left open, which its fencing or
                    // its timeout aborts. It is waited for either way:
                    // restoring without it could leave out state that
                    // committed offsets went with, behind it or in it.
                    if open.get(&partition).is_some_and(|high| offset < *high) {
                        held_since.get_or_insert_with(std::time::Instant::now);
                    } else {
                        open.remove(&partition);
                    }
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, "changelog read error; retrying");
                }
            }
        }
        let mut fold = Fold::default();
        for (partition, image) in &mut images {
            tracing::debug!(
                changelog,
                partition,
                read_to = image.offset,
                keys = image.records.len(),
                "restored a changelog partition"
            );
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

/// How often a restore asks the last stable offset of the partitions whose
/// read found no record.
const QUIET_ASK_EVERY: Duration = Duration::from_millis(100);

/// How long a restore waits for a changelog transaction it reached to end
/// (its commit markers, written after the commit returned, or the abort of a
/// process fenced meanwhile, both within a second as a rule) before it says
/// so.
const OPEN_TRANSACTION_NOTICE: Duration = Duration::from_secs(5);

/// What a restore read: from local copies, and from the changelog.
#[derive(Debug, Default, Clone, Copy)]
struct Read {
    local_bytes: u64,
    changelog_bytes: u64,
}

/// The context of a consumer that reads partitions to their end: the end of
/// a partition is what it waits for, not an error to log.
pub(crate) struct EndsExpected;

impl ClientContext for EndsExpected {
    fn error(&self, error: KafkaError, reason: &str) {
        let end = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !end {
            tracing::warn!(%error, reason, "consumer error");
        }
    }
}

impl ConsumerContext for EndsExpected {}

/// A reader's offset label, parsed.
enum Label<'a> {
    /// `topic-partition`: the next offset to read.
    Next(TopicPartition),
    /// `topic-partition@upstream`: a repartition reader's watermark of an
    /// upstream source partition.
    Watermark(TopicPartition, &'a str),
    /// `topic-partition#what`: what a reader that reads before its writers
    /// commit told of its reads.
    Read(TopicPartition, &'a str),
}

/// The labels of `offsets`, parsed, with their values.
fn labels<'a>(
    offsets: impl Iterator<Item = &'a Offsets>,
) -> impl Iterator<Item = Result<(Label<'a>, i64)>> {
    offsets.flatten().map(|(label, value)| {
        let label = if let Some((partition, what)) = label.split_once(READ_MARK) {
            Label::Read(parse_label(partition)?, what)
        } else if let Some((partition, upstream)) = label.split_once(WATERMARK_MARK) {
            Label::Watermark(parse_label(partition)?, upstream)
        } else {
            Label::Next(parse_label(label)?)
        };
        Ok((label, *value))
    })
}

/// What the readers that read before their writers commit told of their
/// reads, by partition.
fn reads<'a>(
    offsets: impl Iterator<Item = &'a Offsets>,
) -> Result<BTreeMap<TopicPartition, Reads>> {
    let mut reads: BTreeMap<TopicPartition, BTreeMap<&str, i64>> = BTreeMap::new();
    let mut next: BTreeMap<TopicPartition, i64> = BTreeMap::new();
    for label in labels(offsets) {
        match label? {
            (Label::Read(partition, what), value) => {
                reads.entry(partition).or_default().insert(what, value);
            }
            (Label::Next(partition), value) => {
                next.insert(partition, value);
            }
            (Label::Watermark(..), _) => {}
        }
    }
    reads
        .into_iter()
        .map(|(partition, told)| {
            let value = |what| {
                told.get(what).copied().ok_or_else(|| {
                    RtflowError::Checkpoint(format!(
                        "the reader of {}-{} told no '{what}' of its reads",
                        partition.0, partition.1
                    ))
                })
            };
            let reads = Reads {
                lineage: value("lineage")?,
                from: value("from")?,
                read: value("read")?,
                position: next.get(&partition).copied().unwrap_or_default(),
            };
            Ok((partition, reads))
        })
        .collect()
}

/// The readers' offset labels as a partition list per consumer group
/// (`group_of` a topic): each partition's next offset, with its watermark
/// table as the offset's metadata, committed with it.
fn positions<'a>(
    offsets: impl Iterator<Item = &'a Offsets>,
    group_of: impl Fn(&str) -> String,
) -> Result<BTreeMap<String, TopicPartitionList>> {
    let mut next: BTreeMap<TopicPartition, i64> = BTreeMap::new();
    let mut watermarks: BTreeMap<TopicPartition, Vec<(String, i64)>> = BTreeMap::new();
    for label in labels(offsets) {
        match label? {
            (Label::Next(partition), value) => {
                next.insert(partition, value);
            }
            (Label::Watermark(partition, upstream), value) => watermarks
                .entry(partition)
                .or_default()
                .push((upstream.to_owned(), value)),
            (Label::Read(..), _) => {}
        }
    }
    let mut lists: BTreeMap<String, TopicPartitionList> = BTreeMap::new();
    for (tp, offset) in next {
        let metadata = watermarks
            .get(&tp)
            .map(|w| encode_watermarks(w))
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

/// Marks metadata written by [`encode_watermarks`], against the
/// `upstream=watermark,...` pairs of earlier versions.
const GROUPED: char = '#';

/// A repartition partition's watermark table as offset metadata, which the
/// broker bounds (`offset.metadata.max.bytes`, 4 KiB by default): grouped by
/// watermark, since the writers of one process tell one watermark for all
/// its source partitions, and runs of consecutive partitions as ranges:
/// `#900=0-2,5;950=3-4;6=upstream`. About 4 bytes per source partition, so
/// 4 KiB hold some 800 of them, against some 200 as pairs.
fn encode_watermarks(entries: &[(String, i64)]) -> String {
    let mut groups: BTreeMap<i64, (Vec<u32>, Vec<&str>)> = BTreeMap::new();
    for (upstream, watermark) in entries {
        let group = groups.entry(*watermark).or_default();
        match upstream.parse() {
            Ok(partition) => group.0.push(partition),
            Err(_) => group.1.push(upstream),
        }
    }
    let mut metadata = String::from(GROUPED);
    for (watermark, (mut partitions, names)) in groups {
        if metadata.len() > 1 {
            metadata.push(';');
        }
        partitions.sort_unstable();
        let mut keys: Vec<String> = Vec::new();
        let mut rest = partitions.as_slice();
        while let [first, ..] = rest {
            let run = rest
                .iter()
                .zip(*first..)
                .take_while(|(partition, expected)| **partition == *expected)
                .count();
            let last = rest[run - 1];
            keys.push(if run == 1 {
                first.to_string()
            } else {
                format!("{first}-{last}")
            });
            rest = &rest[run..];
        }
        keys.extend(names.into_iter().map(str::to_owned));
        metadata.push_str(&format!("{watermark}={}", keys.join(",")));
    }
    metadata
}

/// The entries [`encode_watermarks`] wrote, or pairs of an earlier version.
fn parse_watermarks(metadata: &str) -> Vec<(String, i64)> {
    let Some(grouped) = metadata.strip_prefix(GROUPED) else {
        return metadata
            .split(',')
            .filter_map(|pair| {
                let (upstream, watermark) = pair.split_once('=')?;
                Some((upstream.to_owned(), watermark.parse().ok()?))
            })
            .collect();
    };
    let mut entries = Vec::new();
    for group in grouped.split(';') {
        let Some((watermark, keys)) = group.split_once('=') else {
            continue;
        };
        let Ok(watermark) = watermark.parse::<i64>() else {
            continue;
        };
        for key in keys.split(',') {
            let range = key
                .split_once('-')
                .and_then(|(first, last)| Some((first.parse::<u32>().ok()?, last.parse().ok()?)));
            match range {
                Some((first, last)) => {
                    entries.extend((first..=last).map(|p| (p.to_string(), watermark)))
                }
                None => entries.push((key.to_owned(), watermark)),
            }
        }
    }
    entries
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
        let mut watermarks = parse_watermarks(repartition.metadata());
        watermarks.sort();
        assert_eq!(
            watermarks,
            vec![("0".to_owned(), 900), ("upstream".to_owned(), 3)]
        );
    }

    #[test]
    fn a_readers_reads_come_with_its_position_and_a_missing_one_is_a_checkpoint_failure() {
        let label = "rtflow-q-0-repartition-1";
        let mut offsets: Offsets = [
            (label.to_owned(), 40),
            (format!("{label}{WATERMARK_MARK}0"), 900),
            (format!("{label}{READ_MARK}lineage"), 7),
            (format!("{label}{READ_MARK}from"), 10),
            (format!("{label}{READ_MARK}read"), 25),
            ("orders-2".to_owned(), 17),
        ]
        .into_iter()
        .collect();
        let read = reads([&offsets].into_iter()).unwrap();
        let partition = ("rtflow-q-0-repartition".to_owned(), 1);
        assert_eq!(
            read.keys().collect::<Vec<_>>(),
            [&partition],
            "orders is read committed"
        );
        assert_eq!(
            read[&partition],
            Reads {
                lineage: 7,
                from: 10,
                read: 25,
                position: 40
            }
        );
        offsets.remove(&format!("{label}{READ_MARK}read"));
        let error = reads([&offsets].into_iter()).unwrap_err();
        assert_eq!(error.error_class(), "CHECKPOINT_FAILED");
    }

    #[test]
    fn watermark_tables_are_grouped_by_watermark_with_ranges_of_partitions() {
        let entries: Vec<(String, i64)> = [(0, 900), (1, 900), (2, 900), (5, 900), (3, 950)]
            .into_iter()
            .map(|(p, w)| (p.to_string(), w))
            .chain([("4".to_owned(), 950), ("upstream".to_owned(), 6)])
            .collect();
        let metadata = encode_watermarks(&entries);
        assert_eq!(metadata, "#6=upstream;900=0-2,5;950=3-4");
        let mut parsed = parse_watermarks(&metadata);
        parsed.sort();
        let mut expected = entries.clone();
        expected.sort();
        assert_eq!(parsed, expected);
        assert_eq!(
            parse_watermarks("0=900,upstream=3"),
            [("0".to_owned(), 900), ("upstream".to_owned(), 3)],
            "as earlier versions wrote it"
        );
        assert_eq!(encode_watermarks(&[]), "#");
        assert!(parse_watermarks("#").is_empty());
    }

    #[test]
    fn eight_hundred_source_partitions_fit_the_brokers_default_metadata_bound() {
        // Three processes' writers told three watermarks, their partitions
        // dealt round-robin: no two neighbours share one.
        let entries: Vec<(String, i64)> = (0..800)
            .map(|p: i64| (p.to_string(), 1_796_290_500_000 + p % 3))
            .chain([("upstream".to_owned(), 800)])
            .collect();
        let metadata = encode_watermarks(&entries);
        assert!(metadata.len() <= 4096, "{} bytes", metadata.len());
        assert_eq!(parse_watermarks(&metadata).len(), entries.len());
    }

    #[test]
    fn a_label_that_names_no_partition_is_a_checkpoint_failure() {
        let offsets: Offsets = [("memory".to_owned(), 1)].into_iter().collect();
        let error = positions([&offsets].into_iter(), str::to_owned).unwrap_err();
        assert_eq!(error.error_class(), "CHECKPOINT_FAILED");
    }
}
