//! The process's Kafka transaction, one per epoch, and the writers that
//! stream their records into it.
//!
//! A writer ([`Staging`]) hands its records over in batches as it goes, and
//! produces them into the transaction of their epoch on its own thread, so
//! that an epoch's records travel to the brokers while the epoch runs and its
//! commit only flushes the tail. The transaction of epoch `n + 1` opens only
//! once `n` committed (a producer has one transaction at a time): until then,
//! and while a commit holds the producer, a writer's batches wait with it, in
//! order, and go first once the transaction takes them. Those still waiting
//! when their epoch ends are parked for the commit to send.
//!
//! [`Transactions::commit`] adds the changelog records and the input offsets
//! and commits; every batch of the epoch is kept until then, so that a
//! transaction the brokers refused can be made again (a rebalance that starts
//! a new group generation while it commits).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockWriteGuard, TryLockError};
use std::time::Duration;

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, TopicPartitionList};
use rtflow_runtime::{Epoch, Result, RtflowError};

use super::link::RestoreStats;
use super::ClusterSettings;
use crate::kafka::producer::{send, Deliveries, KafkaMessage};

/// How many records a writer gathers before it hands them over, unless its
/// mailbox runs dry or its epoch ends first.
const HAND_OVER_AT: usize = 512;

/// How often a commit refused for a group generation that just ended is
/// tried again with the next one, and how long apart.
const GENERATION_RETRIES: u32 = 50;
const GENERATION_RETRY_PAUSE: Duration = Duration::from_millis(100);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records a writer handed over for an epoch's transaction, and the topic of
/// those that name none.
pub(crate) struct Batch {
    pub(crate) topic: Option<String>,
    pub(crate) messages: Vec<KafkaMessage>,
}

/// The process's transactional producer, its open transaction, and the
/// batches waiting for theirs.
pub(crate) struct Transactions {
    open: RwLock<Open>,
    /// Batches of epochs whose transaction is not open, by epoch.
    parked: Mutex<BTreeMap<Epoch, Vec<Batch>>>,
    /// Each group's metadata as of its latest generation: offsets committed
    /// with an older generation are refused.
    groups: Mutex<BTreeMap<String, ConsumerGroupMetadata>>,
    config: ClientConfig,
    timeout: Duration,
    name: String,
    pub(crate) last_restore: Mutex<Option<RestoreStats>>,
}

/// The producer and the transaction it has begun. Writers produce into it
/// under the read lock; a commit or an abort takes the write lock.
struct Open {
    /// Renewed after a failed transaction: a fresh producer (the same
    /// transactional id, initialised again) leaves no error state behind.
    producer: ThreadedProducer<Deliveries>,
    /// The epoch of the transaction begun, if one is.
    epoch: Option<Epoch>,
    /// The batches produced into it.
    sent: Mutex<Vec<Batch>>,
}

/// How one attempt at a transaction failed.
struct Failed {
    error: RtflowError,
    /// The group moved to a new generation meanwhile: the same transaction
    /// may commit with the new one.
    generation: bool,
}

impl Failed {
    fn to(what: &str, epoch: Epoch, name: &str, error: &dyn std::fmt::Display) -> Self {
        Self {
            error: RtflowError::Checkpoint(format!(
                "{name}: could not {what} the transaction of epoch {epoch}: {error}"
            )),
            generation: false,
        }
    }
}

impl From<RtflowError> for Failed {
    fn from(error: RtflowError) -> Self {
        Self {
            error,
            generation: false,
        }
    }
}

impl Transactions {
    /// The producer of the process's transactional id, initialised: an
    /// earlier incarnation's open transaction is aborted, and it can no longer
    /// commit.
    pub(crate) fn open(settings: &ClusterSettings) -> Result<Self> {
        let name = format!("kafka cluster {}", settings.bootstrap_servers);
        let config = producer_config(settings, &settings.transactional_id());
        let producer = initialised(&config, settings.operation_timeout, &name)?;
        Ok(Self {
            open: RwLock::new(Open {
                producer,
                epoch: None,
                sent: Mutex::default(),
            }),
            parked: Mutex::default(),
            groups: Mutex::default(),
            config,
            timeout: settings.operation_timeout,
            name,
            last_restore: Mutex::default(),
        })
    }

    pub(crate) fn set_group(&self, group: &str, metadata: Option<ConsumerGroupMetadata>) {
        let mut groups = lock(&self.groups);
        match metadata {
            Some(metadata) => groups.insert(group.to_owned(), metadata),
            None => groups.remove(group),
        };
    }

    fn write(&self) -> RwLockWriteGuard<'_, Open> {
        self.open.write().unwrap_or_else(|p| p.into_inner())
    }

    /// A run whose first epoch is `first` starts: its transaction opens.
    /// Every writer of the run says so; the first to does it.
    fn begin_run(&self, first: Epoch) -> Result<()> {
        let mut open = self.write();
        if open.epoch == Some(first) {
            return Ok(());
        }
        if !std::mem::take(&mut *lock(&open.sent)).is_empty() {
            // Records of a run that ended without committing them.
            self.renew(&mut open)?;
        }
        if open.epoch.is_some() {
            // The transaction is begun and empty: it becomes the new run's.
            open.epoch = Some(first);
            return Ok(());
        }
        self.begin(&mut open, first).map_err(|failed| failed.error)
    }

    /// Produces a writer's `batches` of epoch `epoch` into the epoch's
    /// transaction, which keeps them, if it is open and no commit holds it;
    /// else leaves them to the writer.
    fn try_send(&self, epoch: Epoch, batches: &mut Vec<Batch>) -> Result<()> {
        let open = match self.open.try_read() {
            Ok(open) => open,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // A commit in progress.
            Err(TryLockError::WouldBlock) => return Ok(()),
        };
        if open.epoch != Some(epoch) {
            return Ok(());
        }
        self.send_batches(&open, batches)
            .map_err(|failed| failed.error)
    }

    /// A writer's `batches` of epoch `epoch`, which ended before its
    /// transaction opened: they go into it when it commits.
    fn park(&self, epoch: Epoch, batches: &mut Vec<Batch>) {
        if !batches.is_empty() {
            lock(&self.parked).entry(epoch).or_default().append(batches);
        }
    }

    /// Aborts the open transaction and drops every batch not committed (a
    /// run that stopped without its final checkpoint).
    pub(crate) fn discard(&self) {
        let mut open = self.write();
        lock(&self.parked).clear();
        if std::mem::take(&mut *lock(&open.sent)).is_empty() {
            return;
        }
        if let Err(error) = self.renew(&mut open) {
            // The next run's first writer tries again.
            tracing::warn!(%error, "could not abort the transaction of a run that failed");
        }
    }

    /// Commits epoch `epoch`: the batches of epochs up to it, the changelog's
    /// `changes` and the offsets `positions` (by group), in one transaction;
    /// then opens the next epoch's. A rebalance that starts a new generation
    /// while it commits makes the broker refuse the offsets: the transaction
    /// is aborted and made again with the new generation, which still owns
    /// the partitions (a revocation stops the run, and so its commits, before
    /// it takes effect).
    pub(crate) fn commit(
        &self,
        epoch: Epoch,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<()> {
        let mut open = self.write();
        let mut late = self.take_parked(epoch);
        late.push(changes);
        let mut attempts = 0;
        let mut fresh = open.epoch.is_none();
        loop {
            let attempt = if fresh {
                self.begin(&mut open, epoch)
                    .and_then(|()| self.resend(&open))
            } else {
                Ok(())
            };
            let failed = match attempt
                .and_then(|()| self.send_batches(&open, &mut late))
                .and_then(|()| self.finish(&open, epoch, positions))
            {
                Ok(()) => break,
                Err(failed) => failed,
            };
            let renewed = self.renew(&mut open);
            fresh = true;
            attempts += 1;
            if !failed.generation || attempts >= GENERATION_RETRIES {
                lock(&open.sent).clear();
                return Err(failed.error);
            }
            renewed?;
            tracing::debug!(
                epoch,
                attempts,
                "the group's generation changed; committing again"
            );
            std::thread::sleep(GENERATION_RETRY_PAUSE);
        }
        lock(&open.sent).clear();
        open.epoch = None;
        self.begin(&mut open, epoch + 1)
            .map_err(|failed| failed.error)
    }

    /// The parked batches of epochs up to `epoch`, in epoch order.
    fn take_parked(&self, epoch: Epoch) -> Vec<Batch> {
        let mut parked = lock(&self.parked);
        let later = parked.split_off(&(epoch + 1));
        std::mem::replace(&mut *parked, later)
            .into_values()
            .flatten()
            .collect()
    }

    fn begin(&self, open: &mut Open, epoch: Epoch) -> Result<(), Failed> {
        open.producer
            .begin_transaction()
            .map_err(|e| Failed::to("begin", epoch, &self.name, &e))?;
        open.epoch = Some(epoch);
        Ok(())
    }

    /// Produces `batches` into the open transaction, which keeps them.
    fn send_batches(&self, open: &Open, batches: &mut Vec<Batch>) -> Result<(), Failed> {
        for batch in batches.drain(..) {
            for message in &batch.messages {
                send(&open.producer, message, batch.topic.as_deref(), &self.name)?;
            }
            lock(&open.sent).push(batch);
        }
        Ok(())
    }

    /// Produces again what the transaction held before it was made anew.
    fn resend(&self, open: &Open) -> Result<(), Failed> {
        let sent = lock(&open.sent);
        for batch in sent.iter() {
            for message in &batch.messages {
                send(&open.producer, message, batch.topic.as_deref(), &self.name)?;
            }
        }
        Ok(())
    }

    /// Adds the offsets and commits.
    fn finish(
        &self,
        open: &Open,
        epoch: Epoch,
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<(), Failed> {
        let producer = &open.producer;
        for (group, positions) in positions {
            let groups = lock(&self.groups);
            let metadata = groups.get(group).ok_or_else(|| {
                Failed::to(
                    "commit",
                    epoch,
                    &self.name,
                    &format!("the process is not in group '{group}'"),
                )
            })?;
            producer
                .send_offsets_to_transaction(positions, metadata, self.timeout)
                .map_err(|e| Failed {
                    generation: matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::IllegalGeneration
                                | RDKafkaErrorCode::RebalanceInProgress
                                | RDKafkaErrorCode::UnknownMemberId
                        )
                    ),
                    ..Failed::to("add the offsets to", epoch, &self.name, &e)
                })?;
        }
        producer
            .commit_transaction(self.timeout)
            .map_err(|e| Failed::to("commit", epoch, &self.name, &e))?;
        Ok(producer.context().check(&self.name)?)
    }

    /// Aborts what the transaction holds and starts a fresh producer; the
    /// batches it held stay, to be sent again.
    fn renew(&self, open: &mut Open) -> Result<()> {
        let _ = open.producer.abort_transaction(self.timeout);
        open.epoch = None;
        open.producer = initialised(&self.config, self.timeout, &self.name)?;
        Ok(())
    }
}

/// Gathers a writer's records of the current epoch and hands them over to
/// the process's transaction in batches: when enough gathered, when the
/// writer's mailbox runs dry, at the barrier, and at the end of the input.
/// Batches the transaction could not take yet (its epoch's is not open, or a
/// commit holds it) wait here, in order, and go first next time; those still
/// waiting when the epoch ends are parked for its commit. Records that name
/// no topic get the writer's: none carries a copy of it.
pub(crate) struct Staging {
    transactions: Arc<Transactions>,
    topic: Option<String>,
    epoch: Epoch,
    buffer: Vec<KafkaMessage>,
    waiting: Vec<Batch>,
}

impl Staging {
    /// A writer of a run whose first epoch is `first_epoch`.
    pub(crate) fn new(
        transactions: Arc<Transactions>,
        topic: Option<String>,
        first_epoch: Epoch,
    ) -> Result<Self> {
        transactions.begin_run(first_epoch)?;
        Ok(Self {
            transactions,
            topic,
            epoch: first_epoch,
            buffer: Vec::with_capacity(HAND_OVER_AT),
            waiting: Vec::new(),
        })
    }

    /// The topic of the records that name none.
    pub(crate) fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    #[inline]
    pub(crate) fn push(&mut self, message: KafkaMessage) -> Result<()> {
        self.buffer.push(message);
        if self.buffer.len() >= HAND_OVER_AT {
            self.hand_over()?;
        }
        Ok(())
    }

    /// Hands over what was gathered so far, if the transaction takes it.
    pub(crate) fn hand_over(&mut self) -> Result<()> {
        if !self.buffer.is_empty() {
            self.waiting.push(Batch {
                topic: self.topic.clone(),
                messages: std::mem::replace(&mut self.buffer, Vec::with_capacity(HAND_OVER_AT)),
            });
        }
        if !self.waiting.is_empty() {
            self.transactions.try_send(self.epoch, &mut self.waiting)?;
        }
        Ok(())
    }

    /// Epoch `epoch` ended: the rest of its records go to its transaction.
    pub(crate) fn end_epoch(&mut self, epoch: Epoch) -> Result<()> {
        self.epoch = epoch;
        self.end_input()?;
        self.epoch = epoch + 1;
        Ok(())
    }

    /// The input ended: what is left belongs to the final epoch.
    pub(crate) fn end_input(&mut self) -> Result<()> {
        self.hand_over()?;
        self.transactions.park(self.epoch, &mut self.waiting);
        Ok(())
    }
}

/// Fences the process named `instance`, which left the group without a word
/// (it died, or lost its session): the transaction it left open is aborted at
/// once, rather than when it times out, which frees every partition it wrote
/// to for `read_committed` readers; and should it still live, it can no
/// longer commit.
pub(crate) fn fence(settings: &ClusterSettings, instance: &str) -> Result<()> {
    let name = format!(
        "kafka cluster {} fencing '{instance}'",
        settings.bootstrap_servers
    );
    let config = producer_config(settings, &settings.transactional_id_of(instance));
    initialised(&config, settings.operation_timeout, &name).map(drop)
}

/// The configuration of the transactional producer `transactional_id`.
fn producer_config(settings: &ClusterSettings, transactional_id: &str) -> ClientConfig {
    let mut config = settings.client_config();
    config
        .set("transactional.id", transactional_id)
        .set(
            "transaction.timeout.ms",
            settings.transaction_timeout.as_millis().to_string(),
        )
        .set("linger.ms", "5")
        // Failures are all the writers need to hear of; a report per record
        // costs a wake-up of the producer's polling thread each.
        .set("delivery.report.only.error", "true");
    config
}

/// A transactional producer of `config`, initialised.
fn initialised(
    config: &ClientConfig,
    timeout: Duration,
    name: &str,
) -> Result<ThreadedProducer<Deliveries>> {
    let producer = ThreadedProducer::from_config_and_context(config, Deliveries::default())
        .map_err(|e| RtflowError::sink(name, format!("could not create the producer: {e}")))?;
    producer
        .init_transactions(timeout)
        .map_err(|e| RtflowError::sink(name, format!("could not initialise transactions: {e}")))?;
    Ok(producer)
}
