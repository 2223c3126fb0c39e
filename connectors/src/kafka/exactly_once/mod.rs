//! The exactly-once writer of [`KafkaSink`](super::KafkaSink): one Kafka
//! transaction per epoch, committed only once the epoch's checkpoint is durable.
//!
//! 1. During epoch E the writer sends records in a transaction and appends a
//!    copy to a file in the checkpoint location (`spill`), synced as it goes.
//! 2. At E's barrier it syncs the file's tail and names the file in its
//!    checkpointed state, so the checkpoint of E holds E's output. It does not
//!    wait for the broker to acknowledge E's records first: the checkpoint can
//!    send them again, and the commit waits for them.
//! 3. When the coordinator says E committed, the writer adds a commit record
//!    (its transactional id -> E) to the compacted commit topic inside the
//!    transaction, and commits. Records that arrive between the barrier and that
//!    commit wait in memory; epochs that end while they wait stay in every
//!    checkpoint until their own transactions commit (`outbox` has the rules).
//!
//! Each writer has a deterministic transactional id (query id, sink uid,
//! subtask), so a restarted writer's `init_transactions` fences its previous
//! incarnation and aborts the transaction it left open.
//!
//! A crash before E's manifest is durable: the open transaction is aborted by
//! that fencing, and the restarted query replays E from the previous checkpoint.
//! A crash after the manifest is durable but before E's transaction committed:
//! the fencing aborts it too, but the manifest holds E's output. On restart the
//! writer reads the commit topic with `read_committed` and writes again, once,
//! every restored epoch newer than the last commit record under its id, each with
//! its commit record. Either way E's output is visible once.
//!
//! A commit record names the epoch and the run whose checkpoints hold its
//! output: the checkpoint's identity, which a rolled-back or replaced
//! checkpoint location cannot reproduce. Before it writes anything, a
//! restarted writer compares the last record under each id it answers for
//! with the checkpoint it restored ([`check_restored`]): a topic ahead of the
//! checkpoint, or naming the restored epoch with another run, means output was
//! published for a checkpoint the location no longer has, and the query fails
//! with `CHECKPOINT_FAILED` rather than skip or repeat that output.

mod outbox;
mod spill;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use rtflow_runtime::state::{StateSnapshot, SubtaskState};
use rtflow_runtime::{Data, Epoch, Record, Result, RtflowError, SinkContext, SinkWriter};

use self::outbox::{Outbox, Pending, Transactions};
use self::spill::{Spill, SpilledOutput};
use super::admin::KafkaAdmin;
use super::producer::{
    commit_transaction, send, Deliveries, KafkaMessage, ProducerSettings, Serialize as SerializeFn,
};

/// The name of the writer's state within its sink: its output files.
const SPILLED: &str = "spilled";
/// The name under which earlier versions checkpointed the output itself.
const PENDING: &str = "pending";

pub(crate) struct TransactionalWriter<T> {
    producer: KafkaTransactions,
    transactional_id: String,
    /// The transactional id of writer `subtask` of this sink.
    id_of: Box<dyn Fn(u32) -> String + Send>,
    /// The settings of the sink's clients other than its producers: the
    /// reader of the commit topic.
    clients: rdkafka::ClientConfig,
    commit_topic: String,
    serialize: SerializeFn<T>,
    spilled: SubtaskState<SpilledOutput>,
    /// The output an earlier version checkpointed whole, if restored: cleared
    /// by the first snapshot.
    pending: Option<SubtaskState<Pending>>,
    /// The output restored, by the subtask that checkpointed it: settled at
    /// the first record or barrier.
    restored_output: Vec<(u32, RestoredOutput)>,
    spill: Spill,
    /// Whether the restored checkpoint is still to be checked against the commit
    /// topic and its output settled.
    unresolved: bool,
    /// The checkpoint restored from: its epoch and the run that wrote it.
    restored: Option<(Epoch, String)>,
    /// This run's id, which the commit records of its checkpoints name.
    run_id: String,
    outbox: Outbox,
    /// The barrier the next snapshot belongs to; none at the end of the input.
    barrier: Option<Epoch>,
}

impl<T: Data> TransactionalWriter<T> {
    pub(crate) fn open(sink: &ProducerSettings<T>, ctx: &SinkContext) -> Result<Self> {
        let prefix = format!("rtflow-{}-{}", ctx.query_id, ctx.uid);
        let id_of = move |subtask: u32| format!("{prefix}-{subtask}");
        let transactional_id = id_of(ctx.subtask as u32);
        let transaction_timeout = match sink.config.get("transaction.timeout.ms") {
            Some(set) => set.to_owned(),
            None => transaction_timeout(ctx.batch_duration, sink.flush_timeout)
                .as_millis()
                .to_string(),
        };
        // Checked before the producer fences anything.
        let location =
            (ctx.checkpoint_location.as_deref()).ok_or(RtflowError::CheckpointLocationRequired)?;
        let spill = Spill::open(location, &ctx.uid, &ctx.run_id, ctx.subtask).map_err(|e| {
            RtflowError::CheckpointLocationUnusable {
                path: location.display().to_string(),
                reason: format!("{} cannot keep its output there: {e}", sink.name()),
            }
        })?;
        let producer_for = |id: &str| transactional_producer(sink, id, &transaction_timeout);
        let producer = producer_for(&transactional_id)?;
        let spilled = ctx.state.per_subtask::<SpilledOutput>(SPILLED)?;
        let pending = ctx.state.per_subtask::<Pending>(PENDING)?;
        let restored_output: Vec<_> = (pending.restored().iter())
            .map(|(old, whole)| (*old, RestoredOutput::Whole(whole.clone())))
            .chain(
                (spilled.restored().iter())
                    .map(|(old, files)| (*old, RestoredOutput::Spilled(files.clone()))),
            )
            .collect();
        // Writers that no longer run after a parallelism change may have left a
        // transaction open: fence them too, so it cannot commit later.
        for (old, _) in &restored_output {
            if *old != ctx.subtask as u32 {
                // Initialising is the fencing; the producer has no other use.
                drop(producer_for(&id_of(*old))?);
            }
        }
        let commit_topic = sink
            .commit_topic
            .clone()
            .unwrap_or_else(|| format!("rtflow-commits-{}", ctx.query_id));
        // The admin's failures are this sink's: its start is what fails.
        let as_sink_error = |error| match error {
            RtflowError::Source { message, .. } => sink.error(message),
            other => other,
        };
        let clients = other_clients(&sink.config);
        let admin = KafkaAdmin::with_config(clients.clone()).map_err(as_sink_error)?;
        admin
            .create_compacted_topic(&commit_topic)
            .map_err(as_sink_error)?;
        // A restart must find each writer's last commit record however long
        // ago it was written: retention must not delete it.
        let policy = admin.cleanup_policy(&commit_topic).map_err(as_sink_error)?;
        if policy.trim() != "compact" {
            return Err(sink.error(format!(
                "the commit topic '{commit_topic}' has cleanup.policy={policy}: retention \
                 would delete commit records and a restart would write committed output \
                 again; give it cleanup.policy=compact, or name another commit topic"
            )));
        }
        let restored = ctx.state.restored_epoch();
        let restored_run = ctx.state.restored_run_id().unwrap_or_default().to_owned();
        Ok(Self {
            producer: KafkaTransactions {
                producer,
                transactional_id: transactional_id.clone(),
                in_transaction: false,
                topic: sink.topic.clone(),
                commit_topic: commit_topic.clone(),
                timeout: sink.flush_timeout,
                transaction_timeout,
                sink: sink.name(),
            },
            transactional_id,
            id_of: Box::new(id_of),
            clients,
            commit_topic,
            serialize: sink.serialize.clone(),
            spilled,
            pending: (!pending.restored().is_empty()).then_some(pending),
            restored_output,
            spill,
            unresolved: true,
            restored: restored.map(|epoch| (epoch, restored_run)),
            run_id: ctx.run_id.clone(),
            outbox: Outbox::after(restored),
            barrier: None,
        })
    }
}

/// What a checkpoint held for one writer.
enum RestoredOutput {
    /// The output itself, as earlier versions checkpointed it.
    Whole(Pending),
    /// The files holding it.
    Spilled(SpilledOutput),
}

/// librdkafka's producer-only settings (its CONFIGURATION.md, `P`), which a
/// consumer ignores with a warning.
const PRODUCER_ONLY: [&str; 30] = [
    "transactional.id",
    "transaction.timeout.ms",
    "enable.idempotence",
    "enable.gapless.guarantee",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "queue.buffering.max.ms",
    "linger.ms",
    "message.send.max.retries",
    "retries",
    "queue.buffering.backpressure.threshold",
    "compression.codec",
    "compression.type",
    "compression.level",
    "batch.num.messages",
    "batch.size",
    "delivery.report.only.error",
    "dr_cb",
    "dr_msg_cb",
    "sticky.partitioning.linger.ms",
    "request.required.acks",
    "acks",
    "request.timeout.ms",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "queuing.strategy",
    "produce.offset.report",
    "partitioner",
    "partitioner_cb",
    "msg_order_cmp",
];

/// The settings of the sink's admin client (which creates and describes the
/// commit topic) and of the commit topic's reader: the sink's producer
/// settings, its `kafka.` options included (security ones, the client id),
/// without those only a producer reads.
fn other_clients(producer: &rdkafka::ClientConfig) -> rdkafka::ClientConfig {
    let mut config = producer.clone();
    for key in PRODUCER_ONLY {
        config.remove(key);
    }
    config
}

/// How long the broker lets a transaction stay open before it aborts it
/// (`transaction.timeout.ms`): an epoch's transaction is open from its first
/// record until its checkpoint commits, a batch duration and a checkpoint or
/// more, so librdkafka's default of 60 s would abort every epoch of a query that
/// checkpoints every few minutes. Twice the batch duration and the flush
/// timeout leave room for a slow checkpoint.
fn transaction_timeout(batch_duration: Duration, flush_timeout: Duration) -> Duration {
    (2 * batch_duration + flush_timeout).max(Duration::from_secs(60))
}

/// A producer with `transactional_id`, initialised: any earlier producer with the
/// same id is fenced and its open transaction aborted. Its transactions may
/// stay open for `transaction_timeout` ms.
fn transactional_producer<T: Data>(
    sink: &ProducerSettings<T>,
    transactional_id: &str,
    transaction_timeout: &str,
) -> Result<ThreadedProducer<Deliveries>> {
    let mut config = sink.config.clone();
    config.set("transactional.id", transactional_id);
    config.set("transaction.timeout.ms", transaction_timeout);
    let producer = ThreadedProducer::from_config_and_context(&config, Deliveries::default())
        .map_err(|e| sink.error(format!("could not create the transactional producer: {e}")))?;
    producer
        .init_transactions(sink.flush_timeout)
        .map_err(|e| {
            let hint = match e.rdkafka_error_code() {
                Some(RDKafkaErrorCode::InvalidTransactionTimeout) => format!(
                    "; its transactions may stay open for transaction.timeout.ms = \
                     {transaction_timeout} ms (twice the batch duration and the flush \
                     timeout, unless set), longer than the broker allows (its \
                     transaction.max.timeout.ms, 15 minutes by default): shorten the \
                     batch duration or raise the broker's limit"
                ),
                _ => String::new(),
            };
            sink.error(format!(
                "could not initialise transactions for '{transactional_id}': {e}{hint}"
            ))
        })?;
    Ok(producer)
}

/// The Kafka side of the writer: a transactional producer.
struct KafkaTransactions {
    producer: ThreadedProducer<Deliveries>,
    transactional_id: String,
    in_transaction: bool,
    topic: Option<String>,
    commit_topic: String,
    timeout: Duration,
    /// The broker aborts a transaction open longer than this, in ms.
    transaction_timeout: String,
    sink: String,
}

impl KafkaTransactions {
    /// The writer's error: the producer's fatal error when it has one, since
    /// whatever failed on the way (a send, a flush, a commit) is only its echo.
    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        let Some((code, reason)) = self.producer.client().fatal_error() else {
            return RtflowError::sink(&self.sink, message);
        };
        // The broker fences a producer whose transaction outlived its timeout
        // too, and the client cannot tell that from a newer producer.
        let why = match code {
            RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch => format!(
                "; a newer producer with the same transactional id fenced it (is another \
                 run of this query writing to the sink?), or the broker aborted a \
                 transaction open longer than transaction.timeout.ms ({} ms)",
                self.transaction_timeout
            ),
            _ => String::new(),
        };
        RtflowError::sink(
            &self.sink,
            format!(
                "the transactional producer '{}' failed: {reason}{why}",
                self.transactional_id
            ),
        )
    }

    /// Delivery failures reported so far, explained by `error`.
    fn check(&self) -> Result<()> {
        self.producer
            .context()
            .check(&self.sink)
            .map_err(|failure| self.error(failure))
    }
}

impl Transactions for KafkaTransactions {
    fn send(&mut self, message: &KafkaMessage) -> Result<()> {
        if !self.in_transaction {
            self.producer
                .begin_transaction()
                .map_err(|e| self.error(format!("could not begin a transaction: {e}")))?;
            self.in_transaction = true;
        }
        send(&self.producer, message, self.topic.as_deref(), &self.sink)
            .map_err(|failure| self.error(failure))
    }

    fn commit(&mut self, id: &str, epoch: Epoch, run: &str) -> Result<()> {
        let payload = CommitRecord {
            epoch,
            run: Some(run.to_owned()),
        }
        .encode();
        let record = BaseRecord::to(&self.commit_topic)
            .key(id)
            .payload(&payload)
            .partition(0);
        self.producer
            .send(record)
            .map_err(|(e, _)| self.error(format!("could not write the commit record: {e}")))?;
        commit_transaction(&self.producer, self.timeout).map_err(|e| {
            // A record the broker refused fails the commit: its refusal says why.
            self.check().err().unwrap_or_else(|| {
                self.error(format!(
                    "could not commit the transaction of epoch {epoch}: {e}"
                ))
            })
        })?;
        self.in_transaction = false;
        self.check()
    }
}

impl<T> TransactionalWriter<T> {
    /// A failure to keep the output in the checkpoint location: the checkpoint
    /// cannot hold it, so the query cannot go on exactly once.
    fn spill_error(&self, error: std::io::Error) -> RtflowError {
        RtflowError::Checkpoint(format!(
            "{}: could not keep the output of writer '{}' in the checkpoint location: {error}",
            self.producer.sink, self.transactional_id
        ))
    }

    /// Settles the output restored from the checkpoint: what a crash kept from
    /// committing is written again, once. Runs on the actor's thread, after every
    /// writer of the sink fenced its previous incarnation.
    fn resolve_restored(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.unresolved) {
            return Ok(());
        }
        // A first start has a new query id, so no writer id of its own has a
        // record yet: nothing to check or settle.
        let Some((epoch, run)) = self.restored.clone() else {
            return Ok(());
        };
        let records = committed_epochs(&self.clients, &self.commit_topic, self.producer.timeout)
            .map_err(|e| self.producer.error(e))?;
        let mut ids: Vec<String> = (self.restored_output.iter())
            .map(|(old, _)| (self.id_of)(*old))
            .collect();
        ids.push(self.transactional_id.clone());
        for id in &ids {
            check_restored(id, records.get(id), (epoch, &run)).map_err(RtflowError::Checkpoint)?;
        }
        let committed: HashMap<String, Epoch> = records
            .into_iter()
            .map(|(id, record)| (id, record.epoch))
            .collect();
        let mut restored = Vec::new();
        for (old, output) in std::mem::take(&mut self.restored_output) {
            let id = (self.id_of)(old);
            let pending = match output {
                RestoredOutput::Whole(pending) => pending,
                RestoredOutput::Spilled(files) => (self.spill)
                    .load(&files, committed.get(&id).copied())
                    .map_err(RtflowError::Checkpoint)?,
            };
            if !pending.ended.is_empty() {
                restored.push((id, pending));
            }
        }
        for (id, ended) in outbox::resolve(&restored, epoch, &run, &committed, &mut self.producer)?
        {
            tracing::info!(
                transactional_id = %id,
                end = ?ended.end,
                records = ended.messages.len(),
                "wrote again the output of a checkpointed epoch whose transaction did not commit"
            );
        }
        Ok(())
    }
}

/// What a commit record says: its writer published the output of `epoch`,
/// which the checkpoints of run `run` hold (none in records of rtflow versions
/// that wrote the epoch alone).
#[derive(Debug, Clone, PartialEq, Eq)]
struct CommitRecord {
    epoch: Epoch,
    run: Option<String>,
}

impl CommitRecord {
    /// `"{epoch} {run}"`.
    fn encode(&self) -> String {
        match &self.run {
            Some(run) => format!("{} {run}", self.epoch),
            None => self.epoch.to_string(),
        }
    }

    fn decode(payload: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(payload).ok()?;
        let mut fields = text.split(' ');
        let epoch = fields.next()?.parse().ok()?;
        Some(Self {
            epoch,
            run: fields.next().map(str::to_owned),
        })
    }
}

/// Whether the last commit record of writer `id` agrees with the checkpoint
/// restored (its epoch and the run that wrote it), so that what the restart
/// writes again, and what it skips, is decided by the checkpoint's identity and
/// never by an epoch number alone. An error says what the location lost.
fn check_restored(
    id: &str,
    last: Option<&CommitRecord>,
    (epoch, run): (Epoch, &str),
) -> std::result::Result<(), String> {
    let Some(last) = last else {
        return Ok(());
    };
    let published = match &last.run {
        Some(run) => format!("the output of epoch {} (run {run})", last.epoch),
        None => format!("the output of epoch {}", last.epoch),
    };
    let advice = "the checkpoint location was damaged, rolled back or replaced; restore \
                  the location the query last ran on, or start the query on a new \
                  location (a new query id) to publish its output anew";
    if last.epoch > epoch {
        return Err(format!(
            "the commit topic says writer '{id}' published {published}, newer than the \
             checkpoint restored (epoch {epoch}): {advice}"
        ));
    }
    if last.epoch == epoch && last.run.as_deref().is_some_and(|r| r != run) {
        return Err(format!(
            "the commit topic says writer '{id}' published {published}, but the \
             checkpoint of epoch {epoch} restored was written by run {run}: {advice}"
        ));
    }
    Ok(())
}

/// The last commit record under each transactional id, read with
/// `read_committed` up to the commit topic's high watermark.
///
/// Not up to a `read_committed` reader's own end, the last stable offset: that
/// stops before a transaction still open on the topic (another writer killed
/// while committing, until it restarts or its transaction times out) and so
/// misses every commit record written after that transaction began; the
/// restored epochs they cover would be written twice. A reader blocks at the
/// open transaction until it ends, so this read waits for it, up to `timeout`.
fn committed_epochs(
    clients: &rdkafka::ClientConfig,
    commit_topic: &str,
    timeout: Duration,
) -> std::result::Result<HashMap<String, CommitRecord>, String> {
    let reader = |isolation: &str| -> std::result::Result<BaseConsumer, String> {
        clients
            .clone()
            .set("group.id", "rtflow-commit-reader")
            .set("enable.auto.commit", "false")
            .set("isolation.level", isolation)
            .create()
            .map_err(|e| format!("could not read the commit topic: {e}"))
    };
    let (_, end) = reader("read_uncommitted")?
        .fetch_watermarks(commit_topic, 0, timeout)
        .map_err(|e| format!("could not read the commit topic: {e}"))?;
    let mut committed = HashMap::new();
    if end == 0 {
        return Ok(committed);
    }
    let consumer = reader("read_committed")?;
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(commit_topic, 0, Offset::Beginning)
        .map_err(|e| e.to_string())?;
    consumer.assign(&assignment).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(message) = consumer.poll(Duration::from_millis(50)) {
            let message = message.map_err(|e| format!("reading the commit topic: {e}"))?;
            let record = CommitRecord::decode(message.payload().unwrap_or_default());
            if let (Some(key), Some(record)) = (message.key(), record) {
                committed.insert(String::from_utf8_lossy(key).into_owned(), record);
            }
        }
        let position = consumer.position().ok().and_then(|positions| {
            positions
                .find_partition(commit_topic, 0)
                .and_then(|p| p.offset().to_raw())
        });
        if position.is_some_and(|p| p >= end) {
            return Ok(committed);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "could not read the commit topic '{commit_topic}' to offset {end} within \
                 {timeout:?}: reading stopped at offset {}, where an open transaction \
                 holds read_committed readers (a writer killed while committing holds \
                 it until it restarts or its transaction times out); until it ends, \
                 whether the restored epochs committed cannot be known",
                position.unwrap_or(0)
            ));
        }
    }
}

impl<T: Data> SinkWriter<T> for TransactionalWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        self.resolve_restored()?;
        let message = (self.serialize)(&record.value);
        self.spill
            .append(&message)
            .map_err(|e| self.spill_error(e))?;
        self.outbox.write(message, &mut self.producer)
    }

    fn flush(&mut self) -> Result<()> {
        self.resolve_restored()?;
        self.producer.check()
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.barrier = Some(epoch);
        self.resolve_restored()
    }

    fn snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.resolve_restored()?;
        let ended = self.outbox.end_epoch(self.barrier.take());
        let spilled = (self.spill.end_epoch(ended)).map_err(|e| self.spill_error(e))?;
        self.spilled.set(spilled);
        self.spilled.snapshot(out)?;
        if let Some(mut pending) = self.pending.take() {
            // Settled by now: the checkpoint no longer needs it.
            pending.clear();
            pending.snapshot(out)?;
        }
        Ok(())
    }

    fn on_commit(&mut self, epoch: Epoch) -> Result<()> {
        self.outbox.committed(
            epoch,
            &self.transactional_id,
            &self.run_id,
            &mut self.producer,
        )?;
        self.spill.committed(epoch).map_err(|e| self.spill_error(e))
    }

    fn close(&mut self, _error: Option<&RtflowError>) -> Result<()> {
        // Whatever is still open never committed with a checkpoint: a restart
        // replays or rewrites it, so it must not become visible.
        if self.producer.in_transaction {
            let _ = self
                .producer
                .producer
                .abort_transaction(self.producer.timeout);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rtflow_runtime::state::StateContext;

    use super::*;

    /// Writer 0 of one, for a query checkpointing to `location`.
    fn context(location: Option<&std::path::Path>) -> SinkContext {
        SinkContext {
            query: "q".into(),
            query_id: "q-id".into(),
            run_id: "run".into(),
            uid: "kafka-sink-0".into(),
            name: "kafka".into(),
            subtask: 0,
            parallelism: 1,
            batch_duration: Duration::from_secs(1),
            first_epoch: 1,
            state: StateContext::detached("kafka", 0, 1, 128),
            checkpoint_location: location.map(|path| path.to_path_buf()),
            source_partitions: vec![0],
            upstream_partitions: 1,
            watermark_delay: None,
            cluster: None,
            commits_second: false,
        }
    }

    /// Settings for a broker nobody listens on: the tests fail before any
    /// broker is asked.
    fn settings() -> ProducerSettings<u64> {
        ProducerSettings {
            bootstrap_servers: "127.0.0.1:1".into(),
            topic: Some("out".into()),
            serialize: Arc::new(|n: &u64| KafkaMessage::new(n.to_string())),
            config: rdkafka::ClientConfig::new(),
            flush_timeout: Duration::from_secs(1),
            commit_topic: None,
        }
    }

    #[test]
    fn a_writer_without_a_checkpoint_location_fails_before_it_fences_anything() {
        let error = TransactionalWriter::open(&settings(), &context(None))
            .err()
            .expect("no location");
        assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_REQUIRED");
    }

    #[test]
    fn a_location_that_cannot_hold_the_output_files_is_named_unusable() {
        let location = tempfile::tempdir().unwrap();
        // A file where the writer's directory would go.
        std::fs::write(location.path().join("sink-output"), b"").unwrap();
        let error = TransactionalWriter::open(&settings(), &context(Some(location.path())))
            .err()
            .expect("the directory cannot be made");
        assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_UNUSABLE");
        let message = error.to_string();
        assert!(
            message.contains(&location.path().display().to_string())
                && message.contains("cannot keep its output there"),
            "{message}"
        );
    }

    fn record(epoch: Epoch, run: Option<&str>) -> CommitRecord {
        CommitRecord {
            epoch,
            run: run.map(str::to_owned),
        }
    }

    #[test]
    fn a_commit_record_names_its_epoch_and_run_and_old_ones_their_epoch() {
        let new = record(7, Some("9f1c"));
        assert_eq!(new.encode(), "7 9f1c");
        assert_eq!(CommitRecord::decode(b"7 9f1c"), Some(new));
        assert_eq!(CommitRecord::decode(b"7"), Some(record(7, None)));
        assert_eq!(CommitRecord::decode(b"seven"), None);
    }

    #[test]
    fn a_restore_is_checked_by_the_checkpoints_identity_not_its_epoch_alone() {
        // (last commit record, checkpoint restored, whether the restart may go on)
        let cases = [
            (None, (4, "a"), true),
            (Some(record(3, Some("a"))), (4, "a"), true),
            (Some(record(3, Some("z"))), (4, "a"), true),
            (Some(record(4, Some("a"))), (4, "a"), true),
            (Some(record(4, None)), (4, "a"), true),
            // Output published for a checkpoint the location lost:
            (Some(record(5, Some("a"))), (4, "a"), false),
            (Some(record(4, Some("b"))), (4, "a"), false),
        ];
        for (last, checkpoint, allowed) in cases {
            let verdict = check_restored("w-0", last.as_ref(), checkpoint);
            assert_eq!(
                verdict.is_ok(),
                allowed,
                "{last:?} {checkpoint:?}: {verdict:?}"
            );
            if let Err(message) = verdict {
                assert!(message.contains("'w-0'"), "{message}");
            }
        }
    }

    /// A sink's producer settings, as `KafkaSink` makes them, with the
    /// user's options `options` over them.
    fn sink_config(options: &[(&str, &str)]) -> rdkafka::ClientConfig {
        let mut config = rdkafka::ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("client.id", "rtflow-sink")
            .set("linger.ms", "20")
            .set("max.in.flight.requests.per.connection", "1")
            .set("delivery.report.only.error", "true");
        for (key, value) in options {
            config.set(*key, *value);
        }
        config
    }

    /// The commit topic's admin client and reader get the sink's options, a
    /// secured cluster's included, and not the settings only a producer
    /// reads.
    #[test]
    fn the_commit_topics_clients_take_the_sinks_options() {
        let config = other_clients(&sink_config(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("client.id", "billing"),
            ("acks", "all"),
        ]));
        for (key, value) in [
            ("bootstrap.servers", "127.0.0.1:1"),
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("client.id", "billing"),
            ("max.in.flight.requests.per.connection", "1"),
        ] {
            assert_eq!(config.get(key), Some(value), "{key}");
        }
        for key in ["linger.ms", "delivery.report.only.error", "acks"] {
            assert_eq!(config.get(key), None, "{key}");
        }
    }

    /// Both clients are made from those settings: one librdkafka refuses
    /// fails them, with no broker asked.
    #[test]
    fn the_commit_topics_clients_are_made_with_the_sinks_options() {
        let clients = other_clients(&sink_config(&[("security.protocol", "no_such_protocol")]));
        let error = KafkaAdmin::with_config(clients.clone())
            .err()
            .expect("the admin client has the protocol");
        assert!(error.to_string().contains("security.protocol"), "{error}");
        let error = committed_epochs(&clients, "rtflow-commits-q-id", Duration::from_secs(1))
            .expect_err("the reader has the protocol");
        assert!(
            error.contains("could not read the commit topic")
                && error.contains("security.protocol"),
            "{error}"
        );
    }

    #[test]
    fn a_transaction_may_stay_open_for_two_batch_durations_and_a_flush() {
        let seconds = Duration::from_secs;
        assert_eq!(transaction_timeout(seconds(300), seconds(30)), seconds(630));
        // Never shorter than librdkafka's default.
        assert_eq!(transaction_timeout(seconds(1), seconds(30)), seconds(60));
    }
}
