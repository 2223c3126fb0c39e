//! The process's Kafka transaction, one per epoch, and the records its
//! writers stage into it.
//!
//! Writers ([`Staging`]) buffer their records for the epoch and stage them at
//! its barrier. [`Transactions::commit`] produces every record staged for the
//! epoch into one transaction, with the changelog records and the input
//! offsets, and commits it. One thread producing a whole epoch lets
//! librdkafka fill large batches: records produced into the open
//! transaction as they came, from the writers' threads or from a feeder
//! thread of the process, measured slower (docs/performance.md).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::KafkaResult;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, TopicPartitionList};
use rtflow_runtime::{Epoch, Result, RtflowError};

use super::ClusterSettings;
use crate::kafka::producer::{commit_transaction, send, Deliveries, KafkaMessage};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Buffers a writer's records of the current epoch and stages them into the
/// process's transaction at the barrier (and at the end, for the final epoch),
/// with the topic of those that name none: no record carries a copy of it.
pub(crate) struct Staging {
    transactions: Arc<Transactions>,
    topic: Option<String>,
    epoch: Epoch,
    buffer: Vec<KafkaMessage>,
}

impl Staging {
    pub(crate) fn new(
        transactions: Arc<Transactions>,
        topic: Option<String>,
        first_epoch: Epoch,
    ) -> Self {
        Self {
            transactions,
            topic,
            epoch: first_epoch,
            buffer: Vec::new(),
        }
    }

    /// The topic of the records that name none.
    pub(crate) fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    #[inline]
    pub(crate) fn push(&mut self, message: KafkaMessage) {
        self.buffer.push(message);
    }

    /// Epoch `epoch` ended: its records go to its transaction.
    pub(crate) fn end_epoch(&mut self, epoch: Epoch) {
        self.stage(epoch);
        self.epoch = epoch + 1;
    }

    /// The input ended: what is left belongs to the final epoch.
    pub(crate) fn end_input(&mut self) {
        self.stage(self.epoch);
    }

    fn stage(&mut self, epoch: Epoch) {
        self.transactions.stage(
            epoch,
            Batch {
                topic: self.topic.clone(),
                messages: std::mem::take(&mut self.buffer),
            },
        );
    }
}

/// The process's transactional producer and the records its sinks staged,
/// by epoch, for the transactions still to commit.
pub(crate) struct Transactions {
    /// Renewed after a failed transaction: a fresh producer (the same
    /// transactional id, initialised again) leaves no error state behind.
    producer: Mutex<Arc<ThreadedProducer<Deliveries>>>,
    staged: Mutex<BTreeMap<Epoch, Vec<Batch>>>,
    /// Each group's metadata as of its latest generation: offsets committed
    /// with an older generation are refused.
    groups: Mutex<BTreeMap<String, Arc<ConsumerGroupMetadata>>>,
    config: ClientConfig,
    timeout: Duration,
    name: String,
}

/// Records a writer staged for an epoch's transaction, and the topic of those
/// that name none.
pub(crate) struct Batch {
    pub(crate) topic: Option<String>,
    pub(crate) messages: Vec<KafkaMessage>,
}

/// How long apart a commit refused for a group generation that just ended
/// is tried again with the next one (for at most the operation timeout).
const GENERATION_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How one attempt at a transaction failed.
struct Failed {
    error: RtflowError,
    /// The group moved to a new generation meanwhile: the same transaction
    /// may commit with the new one.
    generation: bool,
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
            producer: Mutex::new(Arc::new(producer)),
            staged: Mutex::default(),
            groups: Mutex::default(),
            config,
            timeout: settings.operation_timeout,
            name,
        })
    }

    /// Records to commit with epoch `epoch`, staged by a sink at its barrier.
    pub(crate) fn stage(&self, epoch: Epoch, batch: Batch) {
        if !batch.messages.is_empty() {
            lock(&self.staged).entry(epoch).or_default().push(batch);
        }
    }

    pub(crate) fn set_group(&self, group: &str, metadata: Option<ConsumerGroupMetadata>) {
        let mut groups = lock(&self.groups);
        match metadata {
            Some(metadata) => groups.insert(group.to_owned(), Arc::new(metadata)),
            None => groups.remove(group),
        };
    }

    /// Drops what was staged for epochs that will not commit (a run that
    /// stopped without its final checkpoint).
    pub(crate) fn discard(&self) {
        lock(&self.staged).clear();
    }

    /// Commits the records staged for epochs up to `epoch`, the changelog's
    /// `changes` and the offsets `positions` (by group) in one transaction.
    ///
    /// A rebalance that starts a new generation while it commits makes the
    /// broker refuse the offsets (`ILLEGAL_GENERATION`): the transaction is
    /// aborted and made again with the new generation, which still owns the
    /// partitions (a cooperative revocation stops the run, and so its
    /// commits, before it takes effect). A member the group removed
    /// (`UNKNOWN_MEMBER_ID`: its session expired) owns nothing any more: its
    /// partitions may already run elsewhere, so that commit fails for good.
    pub(crate) fn commit(
        &self,
        epoch: Epoch,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<()> {
        let mut staged: Vec<Batch> = {
            let mut staged = lock(&self.staged);
            let later = staged.split_off(&(epoch + 1));
            std::mem::replace(&mut *staged, later)
                .into_values()
                .flatten()
                .collect()
        };
        staged.push(changes);
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            let failed = match self.attempt(epoch, &staged, positions) {
                Ok(()) => return Ok(()),
                Err(failed) => failed,
            };
            if !failed.generation || std::time::Instant::now() >= deadline {
                let _ = self.renew();
                return Err(failed.error);
            }
            // Refused before any record of the epoch was produced, the
            // transaction aborts cleanly and the same producer makes it
            // again: a new one takes most of a second to initialise, which a
            // rebalance's final commit would add to every key's pause.
            let aborted = lock(&self.producer).abort_transaction(self.timeout);
            if aborted.is_err() {
                self.renew()?;
            }
            tracing::debug!(epoch, "the group's generation changed; committing again");
            std::thread::sleep(GENERATION_RETRY_PAUSE);
        }
    }

    fn attempt(
        &self,
        epoch: Epoch,
        staged: &[Batch],
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<(), Failed> {
        let failed = |what: &str, e: &dyn std::fmt::Display| Failed {
            error: RtflowError::Checkpoint(format!(
                "{}: could not {what} the transaction of epoch {epoch}: {e}",
                self.name
            )),
            generation: false,
        };
        let producer = lock(&self.producer);
        producer
            .begin_transaction()
            .map_err(|e| failed("begin", &e))?;
        // The offsets go first: a generation that just ended refuses them
        // before anything is produced, and only then may the abort leave the
        // producer fit for another try (aborted records would leave a gap
        // in its idempotent sequence numbers: OUT_OF_ORDER_SEQUENCE_NUMBER).
        for (group, positions) in positions {
            // Cloned out of the lock, which the members' threads take to
            // hand on each new generation.
            let metadata = lock(&self.groups).get(group).cloned().ok_or_else(|| {
                failed("commit", &format!("the process is not in group '{group}'"))
            })?;
            self.send_offsets(&producer, positions, metadata)
                .map_err(|unanswered| failed("add the offsets to", &unanswered))?
                .map_err(|e| Failed {
                    generation: matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::IllegalGeneration
                                | RDKafkaErrorCode::RebalanceInProgress
                        )
                    ),
                    ..failed("add the offsets to", &e)
                })?;
        }
        for batch in staged {
            for message in &batch.messages {
                send(&producer, message, batch.topic.as_deref(), &self.name).map_err(|error| {
                    Failed {
                        error,
                        generation: false,
                    }
                })?;
            }
        }
        commit_transaction(&producer, self.timeout).map_err(|e| failed("commit", &e))?;
        producer
            .context()
            .check(&self.name)
            .map_err(|error| Failed {
                error,
                generation: false,
            })
    }

    /// Aborts what the failed attempt left open and starts a fresh producer.
    fn renew(&self) -> Result<()> {
        let mut producer = lock(&self.producer);
        let _ = producer.abort_transaction(self.timeout);
        *producer = Arc::new(initialised(&self.config, self.timeout, &self.name)?);
        Ok(())
    }

    /// Adds `positions` of the group `metadata` names to the open transaction.
    ///
    /// librdkafka may never return from this call when the group's
    /// coordinator died (its timeout is not enforced while it looks for the
    /// coordinator: confluentinc/librdkafka#5456, #5511), which would hold the
    /// commit, the run and the process's stop for good. The call therefore
    /// runs on a thread of its own, and one that outlasts the operation
    /// timeout fails the attempt: the producer is renewed, which fences the
    /// stuck one, and the thread ends whenever librdkafka lets it go.
    fn send_offsets(
        &self,
        producer: &Arc<ThreadedProducer<Deliveries>>,
        positions: &TopicPartitionList,
        metadata: Arc<ConsumerGroupMetadata>,
    ) -> std::result::Result<KafkaResult<()>, String> {
        let (producer, positions, timeout) = (producer.clone(), positions.clone(), self.timeout);
        let (reply, answer) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("rtflow-txn-offsets".into())
            .spawn(move || {
                let _ = reply
                    .send(producer.send_offsets_to_transaction(&positions, &metadata, timeout));
            })
            .map_err(|e| format!("could not start its thread: {e}"))?;
        // librdkafka caps the call's own timeout at the transaction timeout.
        answer
            .recv_timeout(timeout)
            .map_err(|_| format!("librdkafka did not return within {timeout:?}"))
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
        .set("linger.ms", "5");
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
