//! The repartition topic of a clustered query, and the writers that stage
//! their records into the process's transaction.
//!
//! [`ExchangeSink`] writes each record to the partition of its key group, and
//! at each barrier tells every partition the watermark of the source
//! partitions behind it; a repartition read before it commits is also told
//! between barriers, as the watermark moves. Records travel in frames: a
//! Kafka message holds the records a writer has for one partition, up to
//! [`FRAME_RECORDS`], so that librdkafka and the broker handle a message per
//! frame, not per record.
//! [`ExchangeSource`] reads the partitions the group assigned to the process
//! and passes on the least watermark over all source partitions
//! ([`UpstreamWatermarks`]).
//!
//! A repartition of records read from the source topics is read as it is
//! written: its writers hand each frame to their transaction as soon as
//! their input pauses, and its readers read `read_uncommitted` and tell how
//! many messages they passed on, which the process's commit checks against
//! what committed (`upstream`). A partition taken on below its last stable
//! offset (every run's start, a run's adoption) is read `read_committed` up
//! to it first ([`CatchUp`]): what aborted there, the rolled-back run's own
//! transaction among it, is passed over rather than read and rolled back on
//! once more. A repartition of records that crossed one before is read
//! `read_committed`, when its writers' epoch commits.
//!
//! At each batch tick a process's writers mark every partition after the
//! epoch's records ([`Wire::Ticked`]); a reader that has not passed that
//! tick holds the partition back from the mark on ([`Partition::held`]), so
//! that its epoch takes no record of their next one.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use rtflow_runtime::cluster::{
    late_across, CommitOrder, EventTimeAcross, Exchanged, UpstreamProgress, UpstreamWatermarks,
    WriterInput, WritersProgress,
};
use rtflow_runtime::connector::Offsets;
use rtflow_runtime::key_groups::key_group;
use rtflow_runtime::{
    Epoch, EventTime, Nanos, ReaderHandover, Record, Result, RtflowError, Sink, SinkContext,
    SinkWriter, Source, SourceContext, SourceOutput, SourceReader, SourceStatus, SourceWaker,
};
use serde::{Deserialize, Serialize};

use super::link::TopicPartition;
use super::transactions::{Staging, Tier, Tiers};
use super::upstream::{counted, new_lineage, Skip, Upstream, READ_MARK, UNCOUNTED};
use super::{lock, ClusterSettings, WATERMARK_MARK};
use crate::kafka::closing::ClosingConsumer;
use crate::kafka::producer::KafkaMessage;

/// What a repartition record holds. A change that a process of the version
/// before cannot decode raises the shape's `CLUSTER_PROTOCOL`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Wire {
    Record {
        event_time: EventTime,
        source_time: Nanos,
        /// Whether the record was behind its own partition's watermark
        /// (`RecordMeta::behind`) or its writer's input watermark, or judged
        /// late before: readers judge it by [`late_across`].
        behind: bool,
        /// The source partition it came from, numbered as the writers'
        /// progress numbers them: readers judge it by what earlier runs told
        /// of that partition too ([`UpstreamWatermarks::is_behind`]).
        partition: u32,
        /// As one run of bytes: serde's default, a sequence of `u8`s, wrote
        /// and read it a byte at a time (the same encoding; a tenth of a
        /// clustered process's CPU samples at 10,000 records/s of 1.2 KB).
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    Progress(UpstreamProgress),
    /// How far the records of source partitions went, each one's own
    /// watermark ([`UpstreamWatermarks::passed`]), told before the progress.
    Passed(Vec<(u32, EventTime)>),
    /// Progress told between two barriers ([`WritersProgress::within`]).
    Within(UpstreamProgress),
    /// The writers of one process passed the barrier of the batch tick at
    /// this wall-clock millisecond, after every record of the epoch it
    /// ended: what they write next belongs to the epoch after it. A reader
    /// that has not passed that tick holds the partition back until it
    /// does ([`Partition::held`]).
    Ticked(i64),
}

/// The longest a reader holds a partition back for a batch tick it has not
/// passed: a tick its coordinator skipped (a checkpoint still in flight)
/// would otherwise hold it a batch duration, and at-least-once output with
/// it. Let go sooner, the records fall in the reader's current epoch, as
/// without holding.
const HOLD_AT_MOST: Duration = Duration::from_millis(100);

/// A partition held back for a batch tick ([`Partition::held`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    tick: i64,
    since: Instant,
}

/// The batch tick at or before `now` (since the Unix epoch), in
/// milliseconds: where an epoch that ends now ends, for epochs that end on
/// multiples of `batch`. Barriers of handovers and stops, between ticks,
/// name the tick before them, which holds nothing back.
fn tick_at(now: Duration, batch: Duration) -> i64 {
    let batch = batch.as_millis().max(1);
    (now.as_millis() / batch * batch) as i64
}

fn tick_now(batch: Duration) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    tick_at(now, batch)
}

fn encode(wire: &Wire) -> Vec<u8> {
    bincode::serde::encode_to_vec(wire, bincode::config::standard())
        .expect("repartition records always encode")
}

/// The most records a frame holds. A reader passes a frame on whole within
/// one poll (its offset is the frame's), so this bounds that poll too.
const FRAME_RECORDS: usize = 256;
/// A frame that reached this size goes out whatever its records.
const FRAME_BYTES: usize = 64 * 1024;

/// The records a writer has for one partition: their encodings one after
/// the other, a message's value. A message of one record, as writers before
/// frames wrote, is a frame of one; a word of the writers' progress travels
/// as a message of its own.
#[derive(Default)]
struct Frame {
    bytes: Vec<u8>,
    records: usize,
}

impl Frame {
    fn add(&mut self, wire: &Wire) {
        bincode::serde::encode_into_std_write(wire, &mut self.bytes, bincode::config::standard())
            .expect("repartition records always encode");
        self.records += 1;
    }

    fn is_full(&self) -> bool {
        self.records >= FRAME_RECORDS || self.bytes.len() >= FRAME_BYTES
    }

    /// The frame as a message to `partition`, if it holds any record.
    fn take(&mut self, partition: usize) -> Option<KafkaMessage> {
        if self.records == 0 {
            return None;
        }
        self.records = 0;
        Some(KafkaMessage {
            topic: None,
            partition: Some(partition as i32),
            key: None,
            value: Some(std::mem::take(&mut self.bytes).into()),
            headers: Vec::new(),
        })
    }
}

/// The repartition records of one message, a frame, in order.
fn decode_frame(mut bytes: &[u8]) -> impl Iterator<Item = std::result::Result<Wire, String>> + '_ {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        let decoded =
            bincode::serde::decode_from_slice::<Wire, _>(bytes, bincode::config::standard());
        Some(match decoded {
            Ok((wire, read)) => {
                bytes = &bytes[read..];
                Ok(wire)
            }
            Err(e) => {
                bytes = &[];
                Err(e.to_string())
            }
        })
    })
}

/// The writing side of a repartition.
pub(crate) struct ExchangeSink {
    settings: Arc<ClusterSettings>,
    topic: String,
    /// The process's transactions; none in a probe, which writes nothing.
    transactions: Option<Arc<Tiers>>,
    /// What the run's writers tell together, made by the first writer.
    told: Arc<Mutex<Option<Told>>>,
}

/// The writers' progress, and the staging of what they tell: its own, so
/// that it lands after the records every writer staged for the epoch.
struct Told {
    progress: WritersProgress,
    staging: Staging,
}

impl ExchangeSink {
    pub(crate) fn new(
        settings: Arc<ClusterSettings>,
        topic: String,
        transactions: Option<Arc<Tiers>>,
    ) -> Self {
        Self {
            settings,
            topic,
            transactions,
            told: Arc::default(),
        }
    }
}

impl Sink<Exchanged> for ExchangeSink {
    fn kind(&self) -> &str {
        "repartition"
    }

    fn description(&self) -> String {
        format!("Repartition[{}]", self.topic)
    }

    fn allowlisted(&self) -> bool {
        true
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<Exchanged>>> {
        let tier = Tier::of(ctx.commits_second);
        let transactions = (self.transactions.as_ref())
            .map(|tiers| tiers.of(tier).clone())
            .ok_or_else(|| {
                RtflowError::sink(self.description(), "a probe of the dataflow writes nothing")
            })?;
        lock(&self.told)
            .get_or_insert_with(|| Told {
                progress: WritersProgress::new(ctx.parallelism, ctx.upstream_partitions),
                staging: Staging::new(&transactions, Some(self.topic.clone()), ctx.first_epoch),
            })
            .progress
            .join(&ctx.source_partitions);
        Ok(Box::new(ExchangeWriter {
            staging: Staging::new(&transactions, Some(self.topic.clone()), ctx.first_epoch),
            frames: std::iter::repeat_with(Frame::default)
                .take(self.settings.repartition_partitions)
                .collect(),
            partitions: self.settings.repartition_partitions as u32,
            key_groups: self.settings.key_groups,
            subtask: ctx.subtask,
            epoch: ctx.first_epoch,
            batch: self.settings.batch_duration,
            read_uncommitted: tier == Tier::Sourced,
            barrier: false,
            input: WriterInput::default(),
            within: self.settings.watermark_interval.map(|every| Within {
                every,
                spoke: false,
                at: Instant::now(),
                input: WriterInput::default(),
            }),
            told: self.told.clone(),
            reaching: ctx.source_partitions.clone(),
            passed: match ctx.watermark_delay {
                Some(_) => {
                    let reaching = ctx.source_partitions.iter().max().map_or(0, |p| p + 1);
                    vec![EventTime::MIN; reaching as usize]
                }
                None => Vec::new(),
            },
            delay: ctx
                .watermark_delay
                .map_or(0, |d| d.as_millis() as EventTime),
        }))
    }
}

struct ExchangeWriter {
    staging: Staging,
    /// The frame being filled for each partition.
    frames: Vec<Frame>,
    partitions: u32,
    key_groups: usize,
    subtask: usize,
    /// The epoch the writer's records belong to now.
    epoch: Epoch,
    /// The query's batch duration: epochs end on its multiples.
    batch: Duration,
    /// Whether the repartition is read before it commits: each frame goes
    /// out once the writer's input pauses.
    read_uncommitted: bool,
    /// Whether the last call was `on_barrier`: the `snapshot` after it does
    /// not end the input.
    barrier: bool,
    input: WriterInput,
    /// What it told between barriers; `None` if it tells only at barriers
    /// (`KafkaCluster::watermark_interval` zero).
    within: Option<Within>,
    told: Arc<Mutex<Option<Told>>>,
    /// The source partitions whose records reach the writer.
    reaching: Vec<u32>,
    /// The largest event time of the records written, by source partition
    /// number (`EventTime::MIN` for none yet); empty when no
    /// `with_watermark` is on every way here, whose delay is the next field.
    passed: Vec<EventTime>,
    delay: EventTime,
}

/// What a writer told of its input between barriers
/// ([`WritersProgress::within`]).
struct Within {
    /// How often at most: each word is a message to every partition.
    every: Duration,
    /// Whether it told since the last barrier.
    spoke: bool,
    at: Instant,
    input: WriterInput,
}

impl Within {
    /// Whether to tell `input` now: once after each barrier, so that the
    /// writers' word can form, then as it moves, at most every `every`.
    fn due(&self, input: WriterInput) -> bool {
        !self.spoke || (input != self.input && self.at.elapsed() >= self.every)
    }

    fn spoke(&mut self, input: WriterInput) {
        (self.spoke, self.at, self.input) = (true, Instant::now(), input);
    }
}

/// Stages `word` for every one of `partitions` partitions; a mark of a
/// batch tick as a message that commits' checks do not count.
fn tell_every_partition(staging: &mut Staging, partitions: u32, word: &Wire) {
    let value = encode(word);
    let headers = match word {
        Wire::Ticked(_) => vec![(UNCOUNTED.to_owned(), Vec::new().into())],
        _ => Vec::new(),
    };
    for partition in 0..partitions {
        staging.push(KafkaMessage {
            topic: None,
            partition: Some(partition as i32),
            key: None,
            value: Some(value.clone().into()),
            headers: headers.clone(),
        });
    }
}

impl ExchangeWriter {
    /// Stages every frame that holds records, before the epoch ends.
    fn flush(&mut self) {
        for (partition, frame) in self.frames.iter_mut().enumerate() {
            if let Some(message) = frame.take(partition) {
                self.staging.push(message);
            }
        }
    }

    /// Tells every partition what the writers of this process tell together
    /// about epoch `epoch`, after the records this writer staged for it: each
    /// writer stages its records before it reports, so the last to report
    /// tells after all of them.
    fn report(&self, epoch: Epoch, ended: bool) {
        let mut told = lock(&self.told);
        let told = told.as_mut().expect("made with the first writer");
        for (partition, largest) in self.passed.iter().enumerate() {
            if *largest > EventTime::MIN {
                told.progress
                    .passed(partition as u32, largest.saturating_sub(self.delay));
            }
        }
        let told_through = told.progress.told_through();
        let word = if ended {
            told.progress.ended(self.subtask, self.input)
        } else {
            told.progress.reached(self.subtask, epoch, self.input)
        };
        // The last writer to end the epoch marks where the next one's
        // records begin, for readers late for the tick.
        let ticked =
            (!ended && self.read_uncommitted && told.progress.told_through() != told_through)
                .then(|| Wire::Ticked(tick_now(self.batch)));
        let words = (!word.passed.is_empty())
            .then_some(Wire::Passed(word.passed))
            .into_iter()
            .chain(word.progress.into_iter().map(Wire::Progress));
        for word in words.chain(ticked) {
            tell_every_partition(&mut told.staging, self.partitions, &word);
        }
        told.staging.end_epoch(epoch);
    }

    /// Tells every partition what the writers of this process tell together
    /// between barriers, if this writer's turn to speak came
    /// ([`Within::due`]): after the records it handed over.
    fn report_within(&mut self) {
        let Some(within) = self.within.as_mut().filter(|w| w.due(self.input)) else {
            return;
        };
        let mut told = lock(&self.told);
        let told = told.as_mut().expect("made with the first writer");
        // Not taken while this writer's barrier is under way: still due.
        let Some(progress) = told.progress.within(self.subtask, self.input) else {
            return;
        };
        within.spoke(self.input);
        if progress.is_empty() {
            return;
        }
        for progress in progress {
            tell_every_partition(&mut told.staging, self.partitions, &Wire::Within(progress));
        }
        told.staging.hand_over();
    }
}

impl SinkWriter<Exchanged> for ExchangeWriter {
    #[inline]
    fn write(&mut self, record: Record<Exchanged>) -> Result<()> {
        let group = key_group(record.value.key_hash, self.key_groups) as u32;
        let partition = (group % self.partitions) as usize;
        let event_time = record.meta.event_time;
        if let Some(largest) = self.passed.get_mut(record.meta.partition as usize) {
            *largest = (*largest).max(event_time);
        }
        let frame = &mut self.frames[partition];
        frame.add(&Wire::Record {
            event_time,
            source_time: record.meta.source_time,
            behind: record.meta.behind || record.meta.late || self.input.is_behind(event_time),
            partition: record.meta.partition,
            payload: record.value.payload,
        });
        if frame.is_full() {
            if let Some(message) = frame.take(partition) {
                self.staging.push(message);
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.read_uncommitted {
            self.flush();
            self.staging.hand_over();
            self.report_within();
        }
        Ok(())
    }

    fn on_watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.input.watermark(watermark);
        Ok(())
    }

    fn on_idle(&mut self) -> Result<()> {
        self.input.idle();
        Ok(())
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        // The word after the epoch's records says how far each source
        // partition went, which a later run of it needs; the watermark has
        // mostly been told between the barriers already.
        self.flush();
        self.staging.end_epoch(epoch);
        self.report(epoch, false);
        if let Some(within) = &mut self.within {
            within.spoke = false;
        }
        self.epoch = epoch + 1;
        self.barrier = true;
        Ok(())
    }

    fn on_hand_over(&mut self, source_partitions: &[u32], starts_over: bool) -> Result<()> {
        let gone: Vec<u32> = (self.reaching.iter())
            .filter(|partition| !source_partitions.contains(partition))
            .copied()
            .collect();
        let added: Vec<u32> = (source_partitions.iter())
            .filter(|partition| !self.reaching.contains(partition))
            .copied()
            .collect();
        for partition in &gone {
            if let Some(largest) = self.passed.get_mut(*partition as usize) {
                *largest = EventTime::MIN;
            }
        }
        if !self.passed.is_empty() {
            let reaching = source_partitions.iter().max().map_or(0, |p| p + 1);
            let reaching = (reaching as usize).max(self.passed.len());
            self.passed.resize(reaching, EventTime::MIN);
        }
        if starts_over {
            // Until the watermark of what reaches it now comes, the writer
            // tells none: the last it had did not wait for the partitions
            // adopted.
            self.input = WriterInput::default();
        }
        let mut told = lock(&self.told);
        let told = told.as_mut().expect("made with the first writer");
        // `on_barrier` moved on to the next epoch: the one it ended is the
        // handover's.
        told.progress
            .hand_over(self.epoch - 1, &gone, &added, starts_over);
        self.reaching = source_partitions.to_vec();
        Ok(())
    }

    fn snapshot(&mut self, _out: &mut rtflow_runtime::StateSnapshot) -> Result<()> {
        // After a barrier nothing is left; at the end of the input, what is
        // left belongs to the final epoch, which commits next.
        if !std::mem::take(&mut self.barrier) {
            self.flush();
            self.staging.end_input();
            self.report(self.epoch, true);
        }
        Ok(())
    }
}

/// The reading side of a repartition.
pub(crate) struct ExchangeSource {
    pub(crate) settings: Arc<ClusterSettings>,
    pub(crate) topic: String,
    pub(crate) stage: usize,
    /// Whether it reads records before their transaction ends
    /// ([`CommitOrder::read_before_commit`]), and what the process knows of
    /// those that aborted.
    pub(crate) order: Arc<Mutex<CommitOrder>>,
    pub(crate) upstream: Option<Arc<Upstream>>,
}

impl ExchangeSource {
    fn partition_list(&self) -> Vec<(String, i32)> {
        (0..self.settings.repartition_partitions as i32)
            .map(|p| (self.topic.clone(), p))
            .collect()
    }
}

impl Source<Exchanged> for ExchangeSource {
    fn kind(&self) -> &str {
        "repartition"
    }

    fn description(&self) -> String {
        format!("Repartition[{}]", self.topic)
    }

    fn partitions(&self) -> Result<usize> {
        Ok(self.settings.repartition_partitions)
    }

    fn cluster_partitions(
        &self,
        link: &dyn rtflow_runtime::cluster::Membership,
    ) -> Option<Vec<usize>> {
        Some(link.owned(&self.partition_list()))
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<Exchanged>>> {
        let error = |e: &dyn std::fmt::Display| {
            RtflowError::source(self.description(), format!("could not read: {e}"))
        };
        let uncommitted = lock(&self.order).read_before_commit.contains(&self.stage);
        let mut config = self
            .settings
            .committed_reader(&self.settings.group_of(&self.topic));
        if uncommitted {
            config.set("isolation.level", "read_uncommitted");
        }
        // Taken on below its last stable offset, a partition is read up to
        // it by a `read_committed` reader of the same group.
        let catch_up = uncommitted.then(|| {
            let mut config = config.clone();
            config
                .set("isolation.level", "read_committed")
                .set("enable.partition.eof", "true")
                .set("fetch.wait.max.ms", "1");
            config
        });
        let mut consumer: BaseConsumer = config
            .set("enable.auto.offset.store", "false")
            .set("fetch.wait.max.ms", "5")
            .create()
            .map_err(|e| error(&e))?;
        let waker = ctx.waker.clone();
        consumer.set_nonempty_callback(move || waker.wake());
        let mut reader = ExchangeReader {
            consumer: ClosingConsumer::new(consumer),
            topic: self.topic.clone(),
            source: self.description(),
            uncommitted,
            upstream: self.upstream.clone(),
            partitions: Vec::new(),
            catch_up_config: catch_up,
            catching_up: None,
            waker: ctx.waker.clone(),
            emitted: None,
            restored: true,
            idle: false,
            batch: self.settings.batch_duration,
            tick: tick_now(self.settings.batch_duration),
        };
        let partitions = (ctx.partitions.iter())
            .map(|number| {
                Partition::resumed(
                    &self.topic,
                    *number,
                    &ctx.start_offsets,
                    self.upstream.as_deref(),
                )
            })
            .collect();
        reader.take_on(partitions)?;
        Ok(Box::new(reader))
    }
}

struct Partition {
    number: usize,
    partition: i32,
    position: i64,
    watermarks: UpstreamWatermarks,
    /// What was read since the reader took the partition on, at `from`, in
    /// a lineage of reads of its own (`upstream`).
    lineage: i64,
    from: i64,
    read: i64,
    /// Aborted messages to pass over.
    skip: Option<Skip>,
    /// The batch tick the partition waits for: a process's writers passed
    /// it ([`Wire::Ticked`]) and the reader has not, so what follows may be
    /// their next epoch's. Read now, it would belong to this epoch of the
    /// reader, whose commit would then wait for theirs, a batch later.
    /// Flink's aligned barriers hold an input channel back the same way.
    held: Option<Held>,
    /// What was read of the partition while held, to pass on in order once
    /// the reader passed the tick.
    pending: VecDeque<OwnedMessage>,
}

impl Partition {
    /// Partition `number` of `topic`, where `offsets` resume it: its offset
    /// and the watermark table committed with it; and the aborted messages
    /// to pass over there, that `upstream` knows of.
    fn resumed(topic: &str, number: usize, offsets: &Offsets, upstream: Option<&Upstream>) -> Self {
        let partition = number as i32;
        let label = format!("{topic}-{partition}");
        let position = offsets.get(&label).copied().unwrap_or(0);
        let mut upstream_partitions = 0;
        let mut watermarks = Vec::new();
        let prefix = format!("{label}{WATERMARK_MARK}");
        for (key, value) in offsets.range(prefix.clone()..) {
            let Some(which) = key.strip_prefix(&prefix) else {
                break;
            };
            match which {
                "upstream" => upstream_partitions = *value as u32,
                partition => {
                    if let Ok(partition) = partition.parse() {
                        watermarks.push((partition, *value));
                    }
                }
            }
        }
        let skip = upstream.and_then(|u| u.skip_of(&(topic.to_owned(), partition)));
        Self {
            number,
            partition,
            position,
            watermarks: UpstreamWatermarks::restore(upstream_partitions, watermarks),
            lineage: new_lineage(),
            from: position,
            read: 0,
            skip,
            held: None,
            pending: VecDeque::new(),
        }
    }

    /// Whether a message of the partition read now waits behind others.
    fn holds(&self) -> bool {
        self.held.is_some() || !self.pending.is_empty()
    }
}

/// The partitions a reader took on below their last stable offset, read
/// `read_committed` up to it. Had they been read `read_uncommitted` from
/// where they resume, the records of a transaction that aborted there would
/// pass again, and the run roll back on them again: a run restarted after
/// its own commit was refused would roll back once more on its own records.
struct CatchUp {
    consumer: ClosingConsumer,
    /// Each partition's last stable offset when it was taken on.
    until: BTreeMap<i32, i64>,
    /// When it began: records it reads wait for their transactions, so a
    /// long catch-up shows as latency.
    since: Instant,
}

struct ExchangeReader {
    consumer: ClosingConsumer,
    topic: String,
    source: String,
    /// Whether it reads before the writers commit, and tells its reads.
    uncommitted: bool,
    upstream: Option<Arc<Upstream>>,
    partitions: Vec<Partition>,
    /// The configuration of the `read_committed` reader that catches up,
    /// when the reader reads before the writers commit.
    catch_up_config: Option<ClientConfig>,
    catching_up: Option<CatchUp>,
    waker: SourceWaker,
    emitted: Option<EventTime>,
    /// Whether the restored watermark is still to be passed on.
    restored: bool,
    /// Whether the reader declared its lane idle: only one with no partition
    /// does.
    idle: bool,
    /// The query's batch duration, and the batch tick the reader passed
    /// last (its start's, before any).
    batch: Duration,
    tick: i64,
}

impl ExchangeReader {
    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::source(
            &self.source,
            format!("could not change partitions: {message}"),
        )
    }

    /// Takes `added` on where each resumes: those below their last stable
    /// offset through the catch-up reader, the others at once.
    fn take_on(&mut self, added: Vec<Partition>) -> Result<()> {
        if added.is_empty() {
            return Ok(());
        }
        let stable = match (&self.catch_up_config, &self.upstream) {
            (Some(_), Some(upstream)) => {
                let partitions: Vec<TopicPartition> = (added.iter())
                    .map(|p| (self.topic.clone(), p.partition))
                    .collect();
                upstream.stable_offsets(&partitions).unwrap_or_else(|error| {
                    // Read as before: an abort there rolls the run back once more.
                    tracing::warn!(source = %self.source, %error, "partitions taken on are read uncommitted from where they resume");
                    Vec::new()
                })
            }
            _ => Vec::new(),
        };
        let (mut now, mut later) = (TopicPartitionList::new(), TopicPartitionList::new());
        let mut until = BTreeMap::new();
        for (i, partition) in added.iter().enumerate() {
            let at = Offset::Offset(partition.position);
            match stable.get(i) {
                Some(&stable) if stable > partition.position => {
                    later
                        .add_partition_offset(&self.topic, partition.partition, at)
                        .map_err(|e| self.error(e))?;
                    until.insert(partition.partition, stable);
                }
                _ => now
                    .add_partition_offset(&self.topic, partition.partition, at)
                    .map_err(|e| self.error(e))?,
            }
        }
        self.partitions.extend(added);
        if now.count() > 0 {
            self.consumer
                .incremental_assign(&now)
                .map_err(|e| self.error(e))?;
        }
        if until.is_empty() {
            return Ok(());
        }
        if self.catching_up.is_none() {
            let config = self.catch_up_config.as_ref().expect("asked only with one");
            let mut consumer: BaseConsumer = config.create().map_err(|e| self.error(e))?;
            let waker = self.waker.clone();
            consumer.set_nonempty_callback(move || waker.wake());
            self.catching_up = Some(CatchUp {
                consumer: ClosingConsumer::new(consumer),
                until: BTreeMap::new(),
                since: Instant::now(),
            });
        }
        let catching_up = self.catching_up.as_mut().expect("made above");
        catching_up.until.extend(until);
        catching_up
            .consumer
            .incremental_assign(&later)
            .map_err(|e| RtflowError::source(&self.source, format!("could not catch up: {e}")))
    }

    /// Ends the catch-up of `partition`: every message below its last
    /// stable offset was read, and the reader reads on from there.
    fn caught_up(&mut self, partition: i32) -> Result<()> {
        let Some(until) = self.stop_catching_up(partition)? else {
            return Ok(());
        };
        let failed = |e| catch_up_not_ended(&self.source, e);
        // What lies between the last message read and the stable offset
        // aborted, or marks a transaction's end.
        if let Some(p) = self
            .partitions
            .iter_mut()
            .find(|p| p.partition == partition)
        {
            p.position = p.position.max(until);
            let mut list = TopicPartitionList::new();
            list.add_partition_offset(&self.topic, partition, Offset::Offset(p.position))
                .map_err(failed)?;
            self.consumer.incremental_assign(&list).map_err(failed)?;
        }
        Ok(())
    }

    /// Takes `partition` off the catch-up reader, if it has it: the last
    /// stable offset it was to read it up to. The catch-up reader ends with
    /// its last partition.
    fn stop_catching_up(&mut self, partition: i32) -> Result<Option<i64>> {
        let Some(catching_up) = self.catching_up.as_mut() else {
            return Ok(None);
        };
        let Some(until) = catching_up.until.remove(&partition) else {
            return Ok(None);
        };
        let mut list = TopicPartitionList::new();
        list.add_partition(&self.topic, partition);
        catching_up
            .consumer
            .incremental_unassign(&list)
            .map_err(|e| catch_up_not_ended(&self.source, e))?;
        if catching_up.until.is_empty() {
            let took = catching_up.since.elapsed();
            tracing::info!(source = %self.source, ?took, "the partitions taken on were read up to their last stable offsets");
            self.catching_up = None;
        }
        Ok(Some(until))
    }

    /// Passes on the event time across the reader's partitions, if it moved.
    ///
    /// When every source partition went idle, the lane stays at the last
    /// watermark rather than going idle: the operators after the readers
    /// take the least watermark over their lanes and leave idle lanes out,
    /// so another reader's watermark, read first, would pass records this
    /// reader still holds from before the same word, which came before it on
    /// their writer's lane and count in one process.
    fn tell(&mut self, out: &mut SourceOutput<Exchanged>) {
        let watermark = match EventTimeAcross::of(self.partitions.iter().map(|p| &p.watermarks)) {
            EventTimeAcross::Watermark(watermark) => watermark,
            EventTimeAcross::Idle(Some(watermark)) => watermark,
            EventTimeAcross::Idle(None) | EventTimeAcross::Unknown => return,
        };
        if self.emitted.is_none_or(|e| watermark > e) {
            out.watermark(watermark);
            self.emitted = Some(watermark);
        }
    }
}

impl SourceReader<Exchanged> for ExchangeReader {
    fn on_barrier(&mut self, _epoch: Epoch) {
        self.tick = self.tick.max(tick_now(self.batch));
        release(&mut self.partitions, self.tick, Instant::now());
    }

    fn offsets(&self) -> Offsets {
        let mut offsets = Offsets::new();
        for partition in &self.partitions {
            let label = format!("{}-{}", self.topic, partition.partition);
            for (upstream, watermark) in partition.watermarks.entries() {
                offsets.insert(format!("{label}{WATERMARK_MARK}{upstream}"), watermark);
            }
            offsets.insert(
                format!("{label}{WATERMARK_MARK}upstream"),
                i64::from(partition.watermarks.upstream()),
            );
            if self.uncommitted {
                for (what, value) in [
                    ("lineage", partition.lineage),
                    ("from", partition.from),
                    ("read", partition.read),
                ] {
                    offsets.insert(format!("{label}{READ_MARK}{what}"), value);
                }
            }
            offsets.insert(label, partition.position);
        }
        offsets
    }

    fn hand_over(&mut self, change: &ReaderHandover<'_>) -> Result<()> {
        // Only what changes is assigned or unassigned, as the Kafka source
        // does: replacing the whole assignment just before the consumer
        // closes (a handover that fails) can abort the process in librdkafka
        // (confluentinc/librdkafka#5573).
        let leaving: Vec<i32> = (self.partitions.iter())
            .filter(|p| !change.partitions.contains(&p.number))
            .map(|p| p.partition)
            .collect();
        let mut gone = TopicPartitionList::new();
        for partition in leaving {
            if self.stop_catching_up(partition)?.is_none() {
                gone.add_partition(&self.topic, partition);
            }
        }
        self.partitions
            .retain(|p| change.partitions.contains(&p.number));
        if gone.count() > 0 {
            self.consumer
                .incremental_unassign(&gone)
                .map_err(|e| self.error(e))?;
        }
        let added = (change.partitions.iter())
            .filter(|number| !self.partitions.iter().any(|p| p.number == **number))
            .map(|number| {
                Partition::resumed(
                    &self.topic,
                    *number,
                    change.start_offsets,
                    self.upstream.as_deref(),
                )
            })
            .collect();
        self.take_on(added)?;
        if change.starts_over {
            // Told again, idleness too: the operators after it wait for
            // every reader's word anew.
            self.emitted = None;
            self.restored = true;
            self.idle = false;
        }
        Ok(())
    }

    fn poll(
        &mut self,
        out: &mut SourceOutput<Exchanged>,
        max_wait: Duration,
    ) -> Result<SourceStatus> {
        if self.partitions.is_empty() {
            // It speaks for no partition: nothing downstream waits for it.
            if !self.idle {
                out.idle();
                self.idle = true;
            } else {
                std::thread::park_timeout(max_wait);
            }
            return Ok(SourceStatus::Active);
        }
        if std::mem::take(&mut self.restored) {
            self.tell(out);
        }
        release(&mut self.partitions, self.tick, Instant::now());
        if pass_pending(&mut self.partitions, &self.source, out, self.tick)? {
            self.tell(out);
            return Ok(SourceStatus::Active);
        }
        let mut waited = max_wait.is_zero();
        while out.remaining() > 0 {
            if let Some(catching_up) = &self.catching_up {
                match catching_up.next(&mut self.partitions, &self.source, out)? {
                    Step::Reached(partition) => {
                        self.caught_up(partition)?;
                        continue;
                    }
                    Step::Passed { told: true } => {
                        self.tell(out);
                        break;
                    }
                    Step::Passed { told: false } => continue,
                    Step::Nothing => {}
                }
            }
            match self.consumer.poll(Duration::ZERO) {
                None if waited => break,
                None => std::thread::park_timeout(max_wait),
                Some(Ok(message)) => {
                    let held = (self.partitions.iter_mut())
                        .find(|p| p.partition == message.partition() && p.holds());
                    if let Some(partition) = held {
                        partition.pending.push_back(message.detach());
                    } else if pass(&mut self.partitions, &self.source, &message, out, self.tick)? {
                        // The poll ends here: what it tells travels after its
                        // records, and must precede the records of the epochs
                        // after it, as in one process.
                        self.tell(out);
                        break;
                    }
                }
                Some(Err(error)) => {
                    tracing::warn!(source = %self.source, %error, "kafka consumer error; retrying");
                    break;
                }
            }
            waited = true;
        }
        Ok(SourceStatus::Active)
    }
}

/// Lets go of the partitions held for a batch tick at or before `tick`, the
/// reader's, now that it passed it, and of those held [`HOLD_AT_MOST`]
/// before `now`.
fn release(partitions: &mut [Partition], tick: i64, now: Instant) {
    for partition in partitions {
        if partition
            .held
            .is_some_and(|held| held.tick <= tick || now >= held.since + HOLD_AT_MOST)
        {
            partition.held = None;
        }
    }
}

/// Passes on what `partitions` no longer held read meanwhile, in order,
/// until one is held again or `out` is full; whether it told of event time
/// (the poll then ends, as for a message read now).
fn pass_pending(
    partitions: &mut [Partition],
    source: &str,
    out: &mut SourceOutput<Exchanged>,
    tick: i64,
) -> Result<bool> {
    for index in 0..partitions.len() {
        while out.remaining() > 0 && partitions[index].held.is_none() {
            let Some(message) = partitions[index].pending.pop_front() else {
                break;
            };
            if pass(partitions, source, &message, out, tick)? {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// What the catch-up reader read next.
enum Step {
    /// A message, passed on; whether it told of event time.
    Passed {
        told: bool,
    },
    /// A partition's last stable offset when it was taken on.
    Reached(i32),
    Nothing,
}

impl CatchUp {
    fn next(
        &self,
        partitions: &mut [Partition],
        source: &str,
        out: &mut SourceOutput<Exchanged>,
    ) -> Result<Step> {
        match self.consumer.poll(Duration::ZERO) {
            Some(Ok(message)) => {
                let partition = message.partition();
                match self.until.get(&partition) {
                    // Below the last stable offset of its take-on: an
                    // epoch that committed already, nothing to hold back.
                    Some(until) if message.offset() < *until => Ok(Step::Passed {
                        told: pass(partitions, source, &message, out, i64::MAX)?,
                    }),
                    _ => Ok(Step::Reached(partition)),
                }
            }
            // Every message below the partition's last stable offset now, and
            // so below the one it was taken on at, was read.
            Some(Err(KafkaError::PartitionEOF(partition))) => Ok(Step::Reached(partition)),
            Some(Err(error)) => {
                tracing::warn!(source, %error, "kafka consumer error while catching up; retrying");
                Ok(Step::Nothing)
            }
            None => Ok(Step::Nothing),
        }
    }
}

/// A catch-up that librdkafka would not let end (an unassign of the catch-up
/// reader, or the assign of the main one that follows it).
fn catch_up_not_ended(source: &str, error: KafkaError) -> RtflowError {
    RtflowError::source(source, format!("could not end a catch-up: {error}"))
}

/// Passes `message`, a frame of one of `partitions`, on whole; whether it
/// told of event time. A word that its writers passed a batch tick after
/// `tick`, the reader's, holds the partition back.
fn pass(
    partitions: &mut [Partition],
    source: &str,
    message: &impl Message,
    out: &mut SourceOutput<Exchanged>,
    tick: i64,
) -> Result<bool> {
    let Some(index) = partitions
        .iter()
        .position(|p| p.partition == message.partition())
    else {
        return Ok(false);
    };
    let partition = &mut partitions[index];
    partition.position = message.offset() + 1;
    if let Some(skip) = &partition.skip {
        let skipped = skip.skips(message.offset());
        if skip.is_behind(partition.position) {
            partition.skip = None;
        }
        if skipped {
            return Ok(false);
        }
    }
    if counted(message) {
        partition.read += 1;
    }
    let mut told = false;
    // A frame passes on whole: the checkpoint's offset is the next frame's.
    for wire in decode_frame(message.payload().unwrap_or_default()) {
        let wire = wire.map_err(|e| {
            RtflowError::source(
                source,
                format!(
                    "record {} of partition {} is no repartition record: {e}",
                    message.offset(),
                    message.partition()
                ),
            )
        })?;
        let partition = &mut partitions[index];
        match wire {
            Wire::Record {
                event_time,
                source_time,
                behind,
                partition: source_partition,
                payload,
            } => {
                out.set_partition(partition.number);
                let record = Exchanged {
                    key_hash: 0,
                    payload,
                };
                let behind = behind || partition.watermarks.is_behind(source_partition, event_time);
                let tables = partitions.iter().map(|p| &p.watermarks);
                let late = behind && late_across(tables, event_time);
                out.push_behind_at(record, source_time, event_time, behind, late);
            }
            Wire::Progress(progress) => {
                partition.watermarks.update(&progress);
                told = true;
            }
            Wire::Passed(passed) => {
                partition.watermarks.passed(&passed);
                told = true;
            }
            Wire::Within(progress) => {
                partition.watermarks.update_within(&progress);
                told = true;
            }
            Wire::Ticked(ticked) => {
                if ticked > tick {
                    partition.held = Some(Held {
                        tick: ticked,
                        since: Instant::now(),
                    });
                }
            }
        }
    }
    Ok(told)
}

#[cfg(test)]
mod tests {
    use rdkafka::message::{Header, OwnedHeaders};

    use super::*;

    fn record(i: usize) -> Wire {
        Wire::Record {
            event_time: i as EventTime,
            source_time: 7,
            behind: i.is_multiple_of(2),
            partition: 3,
            payload: vec![i as u8; i % 5],
        }
    }

    #[test]
    fn a_frame_gives_back_its_records_in_order() {
        let mut frame = Frame::default();
        (0..10).for_each(|i| frame.add(&record(i)));
        let message = frame.take(4).unwrap();
        assert_eq!(message.partition, Some(4));
        let bytes = message.value.unwrap();
        let wires: Vec<Wire> = decode_frame(&bytes).map(Result::unwrap).collect();
        assert_eq!(wires, (0..10).map(record).collect::<Vec<_>>());
        assert!(frame.take(4).is_none(), "emptied");
    }

    #[test]
    fn a_payload_encodes_as_processes_before_serde_bytes_wrote_it() {
        /// `Wire` as it was, its payload a plain sequence of `u8`s.
        #[derive(Serialize)]
        #[allow(dead_code)]
        enum Before {
            Record {
                event_time: EventTime,
                source_time: Nanos,
                behind: bool,
                partition: u32,
                payload: Vec<u8>,
            },
        }
        let payload: Vec<u8> = (0..=255).chain(0..1_000).map(|b| b as u8).collect();
        let before = Before::Record {
            event_time: -5,
            source_time: 7,
            behind: true,
            partition: 3,
            payload: payload.clone(),
        };
        let now = Wire::Record {
            event_time: -5,
            source_time: 7,
            behind: true,
            partition: 3,
            payload,
        };
        let old = bincode::serde::encode_to_vec(&before, bincode::config::standard()).unwrap();
        assert_eq!(encode(&now), old);
        let decoded: Vec<Wire> = decode_frame(&old).map(Result::unwrap).collect();
        assert_eq!(decoded, [now]);
    }

    #[test]
    fn a_writer_tells_once_after_each_barrier_then_what_moved_at_its_pace() {
        let at = |watermark| {
            let mut input = WriterInput::default();
            input.watermark(watermark);
            input
        };
        let mut within = Within {
            every: Duration::from_millis(50),
            spoke: false,
            at: Instant::now(),
            input: at(10),
        };
        assert!(within.due(at(10)), "not told since the barrier");
        within.spoke(at(10));
        assert!(!within.due(at(10)), "nothing moved");
        assert!(!within.due(at(20)), "told less than 50 ms ago");
        within.at -= within.every;
        assert!(within.due(at(20)));
        assert!(!within.due(at(10)), "nothing moved since");
    }

    /// Message `offset` of partition 0 of `t`, holding `wires`.
    fn message(offset: i64, wires: &[Wire]) -> OwnedMessage {
        let mut frame = Vec::new();
        for wire in wires {
            frame.extend(encode(wire));
        }
        OwnedMessage::new(
            Some(frame),
            None,
            "t".to_owned(),
            rdkafka::Timestamp::NotAvailable,
            0,
            offset,
            None,
        )
    }

    #[test]
    fn the_batch_tick_is_the_multiple_of_the_batch_at_or_before_now() {
        let second = Duration::from_secs(1);
        assert_eq!(tick_at(Duration::from_millis(12_345), second), 12_000);
        assert_eq!(tick_at(Duration::from_millis(12_000), second), 12_000);
        assert_eq!(tick_at(Duration::from_millis(99), Duration::ZERO), 99);
    }

    /// A mark of a batch tick carries the header that leaves it out of a
    /// commit's check: what a reader read of it counts only its other
    /// messages, as the check's `read_committed` count does.
    #[test]
    fn a_reader_counts_what_it_read_but_the_marks_of_batch_ticks() {
        let mut partitions = [Partition::resumed("t", 0, &Offsets::new(), None)];
        let mut out = SourceOutput::new(10);
        let marked = OwnedHeaders::new().insert(Header {
            key: UNCOUNTED,
            value: Some(&[][..]),
        });
        let ticked = message(0, &[Wire::Ticked(2_000)]).replace_headers(Some(marked));
        assert!(!counted(&ticked));
        pass(&mut partitions, "s", &ticked, &mut out, 2_000).unwrap();
        assert_eq!((partitions[0].read, partitions[0].position), (0, 1));
        let records = message(1, &[record(1)]);
        assert!(counted(&records));
        pass(&mut partitions, "s", &records, &mut out, 2_000).unwrap();
        assert_eq!((partitions[0].read, partitions[0].position), (1, 2));
    }

    #[test]
    fn a_partition_whose_writers_passed_a_later_tick_is_held_until_the_reader_passes_it() {
        let mut partitions = [Partition::resumed("t", 0, &Offsets::new(), None)];
        let mut out = SourceOutput::new(10);
        let ticked = message(0, &[Wire::Ticked(2_000)]);
        assert!(!pass(&mut partitions, "s", &ticked, &mut out, 2_000).unwrap());
        assert_eq!(partitions[0].held, None, "the reader passed that tick");
        let ticked = message(1, &[Wire::Ticked(3_000)]);
        pass(&mut partitions, "s", &ticked, &mut out, 2_000).unwrap();
        let since = partitions[0].held.expect("held").since;
        assert_eq!(partitions[0].held.map(|held| held.tick), Some(3_000));
        assert!(partitions[0].holds());
        let next = [
            message(2, &[record(1), record(2)]),
            message(3, &[record(3)]),
        ];
        partitions[0].pending.extend(next);
        assert!(!pass_pending(&mut partitions, "s", &mut out, 2_000).unwrap());
        assert_eq!(out.remaining(), 10, "nothing passes while held");
        assert_eq!(partitions[0].position, 2, "nor is read past the word");
        release(&mut partitions, 2_999, since);
        assert!(partitions[0].held.is_some(), "not there yet");
        release(&mut partitions, 3_000, since);
        assert!(!pass_pending(&mut partitions, "s", &mut out, 3_000).unwrap());
        assert_eq!(out.remaining(), 7, "the held records pass in order");
        assert_eq!(partitions[0].position, 4);
        assert!(!partitions[0].holds());
    }

    #[test]
    fn held_messages_pass_only_up_to_the_next_later_tick() {
        let mut partitions = [Partition::resumed("t", 0, &Offsets::new(), None)];
        let mut out = SourceOutput::new(10);
        partitions[0].pending.extend([
            message(5, &[record(1)]),
            message(6, &[Wire::Ticked(4_000)]),
            message(7, &[record(2)]),
        ]);
        pass_pending(&mut partitions, "s", &mut out, 3_000).unwrap();
        assert_eq!(out.remaining(), 9);
        let held = partitions[0].held.expect("held again");
        assert_eq!(held.tick, 4_000);
        assert_eq!(
            partitions[0].pending.len(),
            1,
            "the record after the word waits"
        );
        release(&mut partitions, 3_000, held.since + HOLD_AT_MOST / 2);
        assert!(partitions[0].held.is_some());
        release(&mut partitions, 3_000, held.since + HOLD_AT_MOST);
        assert!(
            partitions[0].held.is_none(),
            "a tick the reader's coordinator skips holds nothing for long"
        );
        pass_pending(&mut partitions, "s", &mut out, 3_000).unwrap();
        assert_eq!(out.remaining(), 8);
    }

    #[test]
    fn a_word_told_between_barriers_decodes_as_itself() {
        let word = Wire::Within(UpstreamProgress {
            upstream: 6,
            partitions: vec![0, 2],
            watermark: Some(-3),
        });
        let wires: Vec<Wire> = decode_frame(&encode(&word)).map(Result::unwrap).collect();
        assert_eq!(wires, [word]);
    }

    #[test]
    fn a_message_of_one_record_is_a_frame_of_one() {
        let wires: Vec<Wire> = decode_frame(&encode(&record(3)))
            .map(Result::unwrap)
            .collect();
        assert_eq!(wires, [record(3)]);
    }

    #[test]
    fn a_frame_is_full_at_its_record_bound_and_a_cut_one_fails_to_decode() {
        let mut frame = Frame::default();
        (0..FRAME_RECORDS - 1).for_each(|i| frame.add(&record(i)));
        assert!(!frame.is_full());
        frame.add(&record(0));
        assert!(frame.is_full());
        let bytes = frame.take(0).unwrap().value.unwrap();
        let cut = &bytes[..bytes.len() - 1];
        let decoded: Vec<_> = decode_frame(cut).collect();
        assert_eq!(decoded.len(), FRAME_RECORDS);
        assert!(decoded.last().unwrap().is_err(), "the cut record");
    }
}
