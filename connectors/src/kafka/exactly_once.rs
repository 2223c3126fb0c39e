//! The exactly-once writer of [`KafkaSink`](super::KafkaSink): one Kafka
//! transaction per epoch, committed only once the epoch's checkpoint is durable.
//!
//! 1. During epoch E the writer sends records in transaction E and keeps a copy.
//! 2. At E's barrier it flushes the producer (pre-commit) and hands the copy to the
//!    checkpoint as its state, so the manifest of E holds E's output.
//! 3. When the coordinator says E committed, the writer adds a commit record
//!    (its transactional id -> E) to the compacted commit topic inside
//!    transaction E, and commits. Records that arrive between the barrier and that
//!    commit wait in memory, then open transaction E+1.
//!
//! Each writer has a deterministic transactional id (query id, sink uid,
//! subtask), so a restarted writer's `init_transactions` fences its previous
//! incarnation and aborts the transaction it left open.
//!
//! A crash before E's manifest is durable: transaction E is aborted by that
//! fencing, and the restarted query replays E from the previous checkpoint.
//! A crash after the manifest is durable but before transaction E committed: the
//! fencing aborts it too, but the manifest holds E's output. On restart the writer
//! reads the commit topic with `read_committed`; if the last epoch committed under
//! its id is older than the restored epoch, it writes the restored records again in
//! a new transaction together with the commit record for E. If not, E had
//! committed and nothing is written. Either way E's output is visible once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use rtflow_runtime::state::{StateSnapshot, SubtaskState};
use rtflow_runtime::{Data, Epoch, Record, Result, RtflowError, SinkContext, SinkWriter};
use serde::{Deserialize, Serialize};

use super::admin::KafkaAdmin;
use super::sink::{send, Deliveries, KafkaMessage, KafkaSink, Serialize as SerializeFn};

/// One epoch's output, as the checkpoint keeps it until the epoch's transaction
/// is known to have committed.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Pending {
    messages: Vec<KafkaMessage>,
}

/// The name of the writer's state within its sink.
const PENDING: &str = "pending";

pub(crate) struct TransactionalWriter<T> {
    producer: ThreadedProducer<Deliveries>,
    transactional_id: String,
    /// The transactional id of writer `subtask` of this sink.
    id_of: Box<dyn Fn(u32) -> String + Send>,
    bootstrap_servers: String,
    topic: Option<String>,
    commit_topic: String,
    serialize: SerializeFn<T>,
    timeout: Duration,
    sink: String,
    pending: SubtaskState<Pending>,
    /// The epoch the state was restored from, until the restored output is settled.
    unresolved: Option<Epoch>,
    /// Messages of the open transaction.
    open: Vec<KafkaMessage>,
    in_transaction: bool,
    /// The open transaction is pre-committed: it waits for its checkpoint.
    awaiting_commit: bool,
    /// Messages that arrived while a transaction waits for its checkpoint.
    held: Vec<KafkaMessage>,
    /// A snapshot already holds `held`: they belong to an epoch that ended.
    held_ended: bool,
}

impl<T: Data> TransactionalWriter<T> {
    pub(crate) fn open(sink: &KafkaSink<T>, ctx: &SinkContext) -> Result<Self> {
        let prefix = format!("rtflow-{}-{}", ctx.query_id, ctx.uid);
        let id_of = move |subtask: u32| format!("{prefix}-{subtask}");
        let transactional_id = id_of(ctx.subtask as u32);
        let timeout = sink.flush_timeout;
        let producer = transactional_producer(sink, &transactional_id, timeout)?;
        let pending = ctx.state.per_subtask::<Pending>(PENDING)?;
        // Writers that no longer run after a parallelism change may have left a
        // transaction open: fence them too, so it cannot commit later.
        for (old, _) in pending.restored() {
            if *old != ctx.subtask as u32 {
                // Initialising is the fencing; the producer has no other use.
                drop(transactional_producer(sink, &id_of(*old), timeout)?);
            }
        }
        KafkaAdmin::new(&sink.bootstrap_servers)?.create_compacted_topic(&sink.commit_topic)?;
        Ok(Self {
            producer,
            transactional_id,
            id_of: Box::new(id_of),
            bootstrap_servers: sink.bootstrap_servers.clone(),
            topic: sink.topic.clone(),
            commit_topic: sink.commit_topic.clone(),
            serialize: sink.serialize.clone(),
            timeout,
            sink: sink.name(),
            unresolved: ctx.state.restored_epoch(),
            pending,
            open: Vec::new(),
            in_transaction: false,
            awaiting_commit: false,
            held: Vec::new(),
            held_ended: false,
        })
    }
}

/// A producer with `transactional_id`, initialised: any earlier producer with the
/// same id is fenced and its open transaction aborted.
fn transactional_producer<T: Data>(
    sink: &KafkaSink<T>,
    transactional_id: &str,
    timeout: Duration,
) -> Result<ThreadedProducer<Deliveries>> {
    let mut config = sink.config()?;
    config.set("transactional.id", transactional_id);
    let producer = ThreadedProducer::from_config_and_context(&config, Deliveries::default())
        .map_err(|e| sink.error(format!("could not create the transactional producer: {e}")))?;
    producer.init_transactions(timeout).map_err(|e| {
        sink.error(format!(
            "could not initialise transactions for '{transactional_id}': {e}"
        ))
    })?;
    Ok(producer)
}

impl<T> TransactionalWriter<T> {
    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::sink(&self.sink, message)
    }

    fn begin(&mut self) -> Result<()> {
        if !self.in_transaction {
            self.producer
                .begin_transaction()
                .map_err(|e| self.error(format!("could not begin a transaction: {e}")))?;
            self.in_transaction = true;
        }
        Ok(())
    }

    fn send(&mut self, message: KafkaMessage) -> Result<()> {
        self.begin()?;
        send(&self.producer, &message, self.topic.as_deref(), &self.sink)?;
        self.open.push(message);
        Ok(())
    }

    /// Flushes the open transaction: everything in it is acknowledged.
    fn pre_commit(&mut self) -> Result<()> {
        self.producer.flush(self.timeout).map_err(|e| {
            self.error(format!(
                "records not acknowledged within {:?}: {e}",
                self.timeout
            ))
        })?;
        self.producer.context().check(&self.sink)
    }

    /// Commits the open transaction as `epoch` of writer `id`.
    fn commit(&mut self, id: &str, epoch: Epoch) -> Result<()> {
        let epoch_text = epoch.to_string();
        let marker = BaseRecord::to(&self.commit_topic)
            .key(id)
            .payload(&epoch_text)
            .partition(0);
        self.producer
            .send(marker)
            .map_err(|(e, _)| self.error(format!("could not write the commit record: {e}")))?;
        self.producer
            .commit_transaction(self.timeout)
            .map_err(|e| {
                self.error(format!(
                    "could not commit the transaction of epoch {epoch}: {e}"
                ))
            })?;
        self.producer.context().check(&self.sink)?;
        self.in_transaction = false;
        self.open.clear();
        Ok(())
    }

    /// Settles the output restored from the checkpoint of `epoch`: what a crash
    /// kept from committing is written again, once. Runs on the actor's thread,
    /// after every writer of the sink fenced its previous incarnation.
    fn resolve_restored(&mut self) -> Result<()> {
        let Some(epoch) = self.unresolved.take() else {
            return Ok(());
        };
        let restored = self.pending.restored();
        if restored.iter().all(|(_, p)| p.messages.is_empty()) {
            return Ok(());
        }
        let committed = self.committed_epochs()?;
        let mut redo = Vec::new();
        for (old, pending) in restored {
            let id = (self.id_of)(*old);
            if !pending.messages.is_empty() && committed.get(&id).is_none_or(|c| *c < epoch) {
                redo.push((id, pending.messages.clone()));
            }
        }
        for (id, messages) in redo {
            tracing::info!(
                transactional_id = %id,
                epoch,
                records = messages.len(),
                "writing the output of a checkpointed epoch whose transaction did not commit"
            );
            for message in messages {
                self.send(message)?;
            }
            self.pre_commit()?;
            self.commit(&id, epoch)?;
        }
        Ok(())
    }

    /// The last epoch committed under each transactional id, read to the end of
    /// the commit topic with `read_committed`.
    fn committed_epochs(&self) -> Result<HashMap<String, Epoch>> {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap_servers)
            .set("group.id", "rtflow-commit-reader")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .map_err(|e| self.error(format!("could not read the commit topic: {e}")))?;
        let (_, end) = consumer
            .fetch_watermarks(&self.commit_topic, 0, self.timeout)
            .map_err(|e| self.error(format!("could not read the commit topic: {e}")))?;
        let mut committed = HashMap::new();
        if end == 0 {
            return Ok(committed);
        }
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&self.commit_topic, 0, Offset::Beginning)
            .map_err(|e| self.error(e))?;
        consumer.assign(&assignment).map_err(|e| self.error(e))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(message) = consumer.poll(Duration::from_millis(50)) {
                let message =
                    message.map_err(|e| self.error(format!("reading the commit topic: {e}")))?;
                let epoch = std::str::from_utf8(message.payload().unwrap_or_default())
                    .ok()
                    .and_then(|text| text.parse().ok());
                if let (Some(key), Some(epoch)) = (message.key(), epoch) {
                    committed.insert(String::from_utf8_lossy(key).into_owned(), epoch);
                }
            }
            let position = consumer.position().ok().and_then(|positions| {
                positions
                    .find_partition(&self.commit_topic, 0)
                    .and_then(|p| p.offset().to_raw())
            });
            if position.is_some_and(|p| p >= end) {
                return Ok(committed);
            }
            if Instant::now() > deadline {
                return Err(self.error(format!(
                    "could not read the commit topic '{}' to its end within {:?}",
                    self.commit_topic, self.timeout
                )));
            }
        }
    }
}

impl<T: Data> SinkWriter<T> for TransactionalWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        self.resolve_restored()?;
        let message = (self.serialize)(&record.value);
        if self.awaiting_commit {
            self.held.push(message);
            Ok(())
        } else {
            self.send(message)
        }
    }

    fn flush(&mut self) -> Result<()> {
        self.resolve_restored()?;
        self.producer.context().check(&self.sink)
    }

    fn on_barrier(&mut self, _epoch: Epoch) -> Result<()> {
        self.resolve_restored()
    }

    fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.resolve_restored()?;
        let messages = if self.awaiting_commit {
            // The previous epoch has not committed yet: this one's records are
            // held back, unsent; they go out once it has.
            self.held_ended = true;
            self.held.clone()
        } else {
            if self.in_transaction {
                self.pre_commit()?;
                self.awaiting_commit = true;
            }
            std::mem::take(&mut self.open)
        };
        self.pending.set(Pending { messages });
        self.pending.snapshot(out)
    }

    fn on_commit(&mut self, epoch: Epoch) -> Result<()> {
        if !self.awaiting_commit {
            return Ok(());
        }
        let id = self.transactional_id.clone();
        self.commit(&id, epoch)?;
        self.awaiting_commit = false;
        for message in std::mem::take(&mut self.held) {
            self.send(message)?;
        }
        if std::mem::take(&mut self.held_ended) && self.in_transaction {
            self.pre_commit()?;
            self.awaiting_commit = true;
        }
        Ok(())
    }

    fn close(&mut self, _error: Option<&RtflowError>) -> Result<()> {
        // Whatever is still open never reached a durable checkpoint: a restart
        // replays it, so it must not become visible.
        if self.in_transaction {
            let _ = self.producer.abort_transaction(self.timeout);
        }
        Ok(())
    }
}
