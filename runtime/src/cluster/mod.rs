//! One query run by several processes: the runtime's side of it.
//!
//! A clustered query is cut at each [`repartition_by`](crate::Stream::repartition_by)
//! into stages joined by topics of the cluster. Each process runs every
//! stage, but only for the partitions the cluster assigned to it: its
//! [`ClusterLink`] says which, makes the repartition's sink and source, restores
//! what the process owns, and commits each of its checkpoints into the cluster
//! (outputs, repartition records, keyed state changes and input offsets at
//! once). The runtime knows no client library: rtflow-connectors' Kafka
//! cluster implements the link.
//!
//! The link's [`Membership`] (`membership.rs`: the process's name, partitions
//! and key groups) is what sources and keyed state ask; it names no connector,
//! so they can hold it while the link hands out connectors. `repartition.rs`
//! has the steps that encode records before the repartition's topic and
//! decode them after it. When the process's share changes, its run goes on:
//! a [`Handover`] (`handover.rs`) names what it owns from a barrier on and
//! carries the state and offsets of what it adopts, and every actor meets it
//! at that barrier ([`StreamingQuery::hand_over`](crate::StreamingQuery::hand_over)).
//!
//! Watermarks cross a repartition in band: the writers of the repartition in
//! each process tell every partition, together ([`WritersProgress`]), at each
//! barrier and between barriers as it moves ([`WritersProgress::within`]), the
//! watermark of the source partitions their process reads (Kafka partitions,
//! or the previous stage's repartition partitions), and each reader takes,
//! per partition it reads, the minimum over all source partitions of the
//! largest watermark heard of each ([`UpstreamWatermarks`]), the min-of-max
//! rule of one process. With each word the writers also tell how far each
//! source partition's records went ([`WritersProgress::passed`]): whatever a
//! committed offset passed is then known to every reader, whichever run
//! reads the partition next.

pub(crate) mod handover;
pub(crate) mod membership;
pub(crate) mod repartition;

use std::collections::{BTreeMap, BTreeSet};

use rtflow_checkpoint::{Delta, Manifest, Offsets, Recovery, RestoredState, StateId};
use serde::{Deserialize, Serialize};

pub use self::handover::Handover;
pub use self::membership::Membership;
use crate::config::QueryConfig;
use crate::connector::{Sink, Source};
use crate::error::Result;
use crate::record::{Epoch, EventTime};

/// A record on its way through a repartition topic: its key's
/// [`stable_hash`](crate::key_groups::stable_hash) (whose key group picks the
/// topic partition) and the record, encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchanged {
    pub key_hash: u64,
    pub payload: Vec<u8>,
}

/// What a writer of a repartition topic tells each of its partitions: the
/// source partitions (numbered query-wide, as
/// [`RecordMeta::partition`](crate::RecordMeta::partition)) whose records it
/// forwards, out of how many feed the repartition, and how far their event
/// time is: a watermark, or `None` when they went idle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamProgress {
    pub upstream: u32,
    pub partitions: Vec<u32>,
    pub watermark: Option<EventTime>,
}

/// What a writer of a repartition has yet to tell its partitions of its
/// input's event time, told once per epoch after the epoch's records.
///
/// A watermark reached and an idleness begun within one epoch are both told,
/// in that order: told only the idleness, readers would never learn the
/// watermark the writer's records were judged by before it went quiet.
///
/// ```
/// use rtflow_runtime::cluster::WriterProgress;
/// let mut progress = WriterProgress::default();
/// progress.watermark(10);
/// progress.idle();
/// assert_eq!(progress.to_tell(), [Some(10), None]);
/// assert_eq!(progress.to_tell(), [], "nothing changed since");
/// progress.watermark(10);
/// assert_eq!(progress.to_tell(), [Some(10)], "active again, at the same watermark");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriterProgress {
    /// The input now.
    input: WriterInput,
    /// The input as told last.
    told: WriterInput,
}

impl WriterProgress {
    /// The input's watermark is `watermark`: it is active.
    pub fn watermark(&mut self, watermark: EventTime) {
        self.input.watermark(watermark);
    }

    /// The input went idle.
    pub fn idle(&mut self) {
        self.input.idle();
    }

    /// What to tell since the last call, in order: a watermark (`Some`),
    /// then whether the input went idle (`None`).
    pub fn to_tell(&mut self) -> Vec<Option<EventTime>> {
        let (now, told) = (self.input, std::mem::replace(&mut self.told, self.input));
        let mut tell = Vec::new();
        let resumed = told.idle && !now.idle;
        if let Some(watermark) = now.watermark {
            if resumed || told.watermark != Some(watermark) {
                tell.push(Some(watermark));
            }
        }
        if now.idle && !told.idle {
            tell.push(None);
        }
        tell
    }
}

/// What a writer of a repartition knows of its input's event time: the
/// latest watermark, and whether the input is idle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterInput {
    watermark: Option<EventTime>,
    idle: bool,
}

impl WriterInput {
    /// The input's watermark is `watermark`: it is active.
    pub fn watermark(&mut self, watermark: EventTime) {
        self.watermark = Some(watermark);
        self.idle = false;
    }

    /// The input went idle.
    pub fn idle(&mut self) {
        self.idle = true;
    }

    /// Whether a record at `event_time` is behind the input's watermark: the
    /// writer marks it so, and readers judge it by [`late_across`].
    ///
    /// ```
    /// use rtflow_runtime::cluster::WriterInput;
    /// let mut input = WriterInput::default();
    /// assert!(!input.is_behind(5), "no watermark yet");
    /// input.watermark(10);
    /// assert!(input.is_behind(9));
    /// assert!(!input.is_behind(10));
    /// ```
    #[inline]
    pub fn is_behind(&self, event_time: EventTime) -> bool {
        self.watermark
            .is_some_and(|watermark| event_time < watermark)
    }
}

/// What the writers of one repartition in one process tell its partitions,
/// together, once every writer ended the epoch (and between barriers,
/// [`within`](Self::within)).
///
/// The writers speak for the source partitions the process reads: behind a
/// shuffle every writer forwards records of every one of them, so one
/// writer's watermark says nothing of another's records. A reader takes the
/// largest watermark heard of a source partition; told per writer, it could
/// run ahead of the records another writer still stages in the same epoch
/// (they land after the first writer's word in the partition). Told once for
/// all of them, after all of them staged the epoch's records, it is the least
/// of their watermarks at the barrier, and every record they write later is
/// at or after it, as in one process.
///
/// It relies on one checkpoint in flight at a time: no writer reaches epoch
/// `n + 1` before every writer reached `n`.
///
/// ```
/// use rtflow_runtime::cluster::{WriterInput, WritersProgress};
/// let mut writers = WritersProgress::new(2, 4);
/// writers.join(&[0, 1]);
/// writers.join(&[1]);
/// let at = |watermark| {
///     let mut input = WriterInput::default();
///     input.watermark(watermark);
///     input
/// };
/// assert!(writers.reached(0, 7, at(50)).is_empty(), "writer 1 has not ended epoch 7");
/// let told = writers.reached(1, 7, at(30)).progress;
/// assert_eq!(told.len(), 1);
/// assert_eq!((told[0].partitions.as_slice(), told[0].watermark), (&[0, 1][..], Some(30)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritersProgress {
    upstream: u32,
    partitions: BTreeSet<u32>,
    /// Per writer: what it told last.
    writers: Vec<Writer>,
    /// Every writer ended the epochs up to this one ([`INPUT_ENDED`]: their
    /// input).
    told_through: Option<Epoch>,
    progress: WriterProgress,
    /// How far the records of each source partition went (their own
    /// watermark), as the writers merged it, and as last told.
    passed: BTreeMap<u32, EventTime>,
    passed_told: BTreeMap<u32, EventTime>,
    /// Changes of the source partitions the writers speak for, by the epoch
    /// whose barrier they came at; each takes effect once that epoch was
    /// told of.
    changes: BTreeMap<Epoch, PartitionsChange>,
}

/// What one writer told [`WritersProgress`] last.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Writer {
    /// The epoch it ended last: `None` in the run's first epoch,
    /// [`INPUT_ENDED`] once its input ended.
    ended: Option<Epoch>,
    /// Its input then, or since ([`WritersProgress::within`]).
    input: WriterInput,
    /// Whether it told its input since it ended that epoch: it met the
    /// barrier's handover, if any, and handed over what it wrote before.
    within: bool,
}

/// What a writer whose input ended ended last: no barrier comes after it.
const INPUT_ENDED: Epoch = Epoch::MAX;

/// What a handover changed of the source partitions a process's writers
/// speak for ([`WritersProgress::hand_over`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PartitionsChange {
    gone: BTreeSet<u32>,
    added: BTreeSet<u32>,
    starts_over: bool,
}

impl WritersProgress {
    /// For `writers` writers, out of `upstream` source partitions that feed
    /// the repartition in every process.
    pub fn new(writers: usize, upstream: u32) -> Self {
        Self {
            upstream,
            partitions: BTreeSet::new(),
            writers: vec![Writer::default(); writers],
            told_through: None,
            progress: WriterProgress::default(),
            passed: BTreeMap::new(),
            passed_told: BTreeMap::new(),
            changes: BTreeMap::new(),
        }
    }

    /// The records of source partition `partition` a writer forwarded
    /// reached `watermark`: their largest event time, less the delay of the
    /// `with_watermark` they came through. Merged before the writer ends
    /// its epoch, and told with the word that follows once every writer
    /// has ([`WritersWord::passed`]).
    ///
    /// A run that ends before its `with_watermark` emits a watermark (it
    /// waits for every partition it reads to deliver) still commits the
    /// offsets of the records it read: told nothing, the next run of their
    /// partition would not know how far it got, and would take a late
    /// record that is its first for one on time.
    pub fn passed(&mut self, partition: u32, watermark: EventTime) {
        let passed = self.passed.entry(partition).or_insert(watermark);
        *passed = (*passed).max(watermark);
    }

    /// A writer that forwards the records of source `partitions`.
    pub fn join(&mut self, partitions: &[u32]) {
        self.partitions.extend(partitions);
    }

    /// The process's partitions changed inside a run at epoch `epoch`'s
    /// barrier: after that epoch the writers forward no records of source
    /// partitions `gone` (their next reader's writers speak for them) and
    /// those of `added`, and if the process adopted partitions event time
    /// `starts_over` as in a new run. The word about `epoch` is still about
    /// the partitions before, whichever writer ends it last: its records
    /// came from them.
    ///
    /// Starting over forgets what was not told yet: the inputs that reached
    /// it did not wait for the partitions adopted. The writers tell again
    /// from their inputs' next watermarks.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{WriterInput, WritersProgress};
    /// let at = |watermark| {
    ///     let mut input = WriterInput::default();
    ///     input.watermark(watermark);
    ///     input
    /// };
    /// let mut writers = WritersProgress::new(2, 4);
    /// writers.join(&[0, 1]);
    /// writers.reached(0, 7, at(30));
    /// writers.hand_over(7, &[1], &[2], true);
    /// let told = writers.reached(1, 7, at(40)).progress;
    /// assert_eq!(told[0].partitions, [0, 1], "epoch 7 still had records of 1");
    /// writers.reached(0, 8, at(90));
    /// let told = writers.reached(1, 8, WriterInput::default()).progress;
    /// assert!(told.is_empty(), "2 was adopted: no watermark until every writer has one");
    /// writers.reached(0, 9, at(50));
    /// let told = writers.reached(1, 9, at(60)).progress;
    /// assert_eq!((told[0].partitions.as_slice(), told[0].watermark), (&[0, 2][..], Some(50)));
    /// ```
    pub fn hand_over(&mut self, epoch: Epoch, gone: &[u32], added: &[u32], starts_over: bool) {
        let change = self.changes.entry(epoch).or_default();
        change.gone.extend(gone);
        change.added.extend(added);
        change.starts_over |= starts_over;
    }

    /// Writer `writer` ended epoch `epoch`, its input as `input`, after it
    /// staged the epoch's records: what to tell, after them, if it was the
    /// last writer to end the epoch.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{WriterInput, WritersProgress};
    /// let mut writers = WritersProgress::new(2, 4);
    /// writers.join(&[0, 1]);
    /// writers.passed(0, 900);
    /// assert!(writers.reached(0, 7, WriterInput::default()).is_empty(), "writer 1 has not ended epoch 7");
    /// writers.passed(0, 800);
    /// writers.passed(1, 950);
    /// let word = writers.reached(1, 7, WriterInput::default());
    /// assert_eq!(word.passed, [(0, 900), (1, 950)]);
    /// writers.passed(1, 990);
    /// writers.reached(0, 8, WriterInput::default());
    /// let word = writers.reached(1, 8, WriterInput::default());
    /// assert_eq!(word.passed, [(1, 990)], "only what went further");
    /// ```
    pub fn reached(&mut self, writer: usize, epoch: Epoch, input: WriterInput) -> WritersWord {
        self.writers[writer] = Writer {
            ended: Some(epoch),
            input,
            within: false,
        };
        self.tell()
    }

    /// Writer `writer`'s input ended, as `input`, after it staged its last
    /// records: what to tell, if it was the last writer to get there.
    pub fn ended(&mut self, writer: usize, input: WriterInput) -> WritersWord {
        self.writers[writer] = Writer {
            ended: Some(INPUT_ENDED),
            input,
            within: true,
        };
        self.tell()
    }

    /// Writer `writer`'s input is `input` between two barriers, after it
    /// handed everything it wrote so far to its transaction: the progress
    /// to tell now, if the writers' least watermark moved (or they went
    /// idle, or active again) and every writer told its input since the
    /// last barrier's word. A reader then moves its event time on within
    /// the epoch, as one process does: windows close and timers fire behind
    /// a repartition without waiting for the barrier.
    ///
    /// Sound for the reason the barrier's word is: every writer's records
    /// written before it told its input are ahead of the word, and those
    /// written after are at or after that input's watermark. Nothing is told
    /// while a barrier is under way (some writer ended an epoch that was not
    /// told of yet): its word comes soon. How far each source partition went
    /// ([`passed`](Self::passed)) waits for the barrier.
    ///
    /// `None` if the writer ended an epoch the others have not: its input is
    /// not taken, and it must tell it again once the barrier's word is out
    /// (its input may not move again, and every writer's is needed).
    ///
    /// ```
    /// use rtflow_runtime::cluster::{WriterInput, WritersProgress};
    /// let at = |watermark| {
    ///     let mut input = WriterInput::default();
    ///     input.watermark(watermark);
    ///     input
    /// };
    /// let mut writers = WritersProgress::new(2, 4);
    /// writers.join(&[0, 1]);
    /// writers.reached(0, 7, at(10));
    /// writers.reached(1, 7, at(20));
    /// assert_eq!(writers.within(0, at(50)), Some(vec![]), "writer 1 has not told since epoch 7");
    /// let told = writers.within(1, at(40)).unwrap();
    /// assert_eq!((told[0].partitions.as_slice(), told[0].watermark), (&[0, 1][..], Some(40)));
    /// assert_eq!(writers.within(1, at(60)).unwrap()[0].watermark, Some(50), "writer 0 holds the least");
    /// assert_eq!(writers.within(1, at(65)), Some(vec![]), "the least did not move");
    /// writers.reached(0, 8, at(80));
    /// assert_eq!(writers.within(0, at(90)), None, "epoch 8's barrier is under way: tell again");
    /// assert_eq!(writers.within(1, at(90)), Some(vec![]));
    /// ```
    pub fn within(&mut self, writer: usize, input: WriterInput) -> Option<Vec<UpstreamProgress>> {
        let through = self.told_through;
        let told = &mut self.writers[writer];
        if told.ended != through {
            return None;
        }
        (told.input, told.within) = (input, true);
        let every_one = (self.writers.iter())
            .all(|w| w.ended == Some(INPUT_ENDED) || (w.ended == through && w.within));
        if !every_one {
            return Some(Vec::new());
        }
        if let Some(through) = through {
            // Every writer met the barrier of `through` and its handover:
            // its records come from the partitions after it.
            self.apply_changes_before(through + 1);
        }
        Some(self.progress())
    }

    fn tell(&mut self) -> WritersWord {
        let mut through = Epoch::MAX;
        for writer in &self.writers {
            match writer.ended {
                None => return WritersWord::default(),
                Some(epoch) => through = through.min(epoch),
            }
        }
        if self.told_through.is_some_and(|told| told >= through) {
            return WritersWord::default();
        }
        self.told_through = Some(through);
        self.apply_changes_before(through);
        let passed: Vec<(u32, EventTime)> = self
            .passed
            .iter()
            .filter(|(partition, watermark)| self.passed_told.get(partition) < Some(watermark))
            .map(|(partition, watermark)| (*partition, *watermark))
            .collect();
        self.passed_told.extend(passed.iter().copied());
        WritersWord {
            passed,
            progress: self.progress(),
        }
    }

    /// The latest epoch every writer ended, told of (or about to be, by the
    /// writer whose report made it so).
    pub fn told_through(&self) -> Option<Epoch> {
        self.told_through
    }

    /// Takes in the handovers at the barriers of epochs before `through`.
    fn apply_changes_before(&mut self, through: Epoch) {
        while let Some(entry) = self.changes.first_entry() {
            if *entry.key() >= through {
                break;
            }
            let change = entry.remove();
            for partition in &change.gone {
                self.partitions.remove(partition);
                self.passed.remove(partition);
                self.passed_told.remove(partition);
            }
            self.partitions.extend(&change.added);
            if change.starts_over {
                self.progress = WriterProgress::default();
            }
        }
    }

    /// The progress to tell from the writers' inputs, if it changed.
    fn progress(&mut self) -> Vec<UpstreamProgress> {
        let inputs: Vec<WriterInput> = self.writers.iter().map(|w| w.input).collect();
        let active: Vec<&WriterInput> = inputs.iter().filter(|i| !i.idle).collect();
        if active.is_empty() {
            if let Some(least) = inputs.iter().filter_map(|i| i.watermark).min() {
                self.progress.watermark(least);
            }
            self.progress.idle();
        } else if let Some(least) = active.iter().map(|i| i.watermark).min().flatten() {
            // `min` over options puts `None` first: one active writer without
            // a watermark holds every other back.
            self.progress.watermark(least);
        }
        if self.partitions.is_empty() {
            return Vec::new();
        }
        let partitions: Vec<u32> = self.partitions.iter().copied().collect();
        self.progress
            .to_tell()
            .into_iter()
            .map(|watermark| UpstreamProgress {
                upstream: self.upstream,
                partitions: partitions.clone(),
                watermark,
            })
            .collect()
    }
}

/// What the writers of a process tell every partition of a repartition once
/// all of them ended an epoch: how far each source partition went that went
/// further since the last word, then their progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WritersWord {
    pub passed: Vec<(u32, EventTime)>,
    pub progress: Vec<UpstreamProgress>,
}

impl WritersWord {
    /// Whether there is nothing to tell (not every writer ended the epoch).
    pub fn is_empty(&self) -> bool {
        self.passed.is_empty() && self.progress.is_empty()
    }
}

/// What a process of a clustered query resumes from.
#[derive(Debug, Clone, Default)]
pub struct ClusterRecovery {
    /// The committed offsets of every partition the process owns, labelled
    /// as the sources' readers label them.
    pub offsets: Offsets,
    /// The keyed state of the key groups the process owns.
    pub state: BTreeMap<StateId, RestoredState>,
}

impl ClusterRecovery {
    /// The checkpoint a process's run restores: nothing for a query that
    /// never committed, otherwise epoch 0 of this run, with every source
    /// handed every label (each reader picks its own partitions').
    pub(crate) fn into_recovery<'a>(
        self,
        sources: impl IntoIterator<Item = &'a str>,
        config: &QueryConfig,
        query_id: &str,
    ) -> Recovery {
        if self.offsets.is_empty() && self.state.is_empty() {
            return Recovery::default();
        }
        let manifest = Manifest {
            epoch: 0,
            query_id: query_id.to_owned(),
            watermark: None,
            sources: sources
                .into_iter()
                .map(|uid| (uid.to_owned(), self.offsets.clone()))
                .collect(),
            state: BTreeMap::new(),
            key_groups: config.max_key_groups as u32,
            committed_at_ms: 0,
            run_id: String::new(),
        };
        Recovery {
            manifest: Some(manifest),
            state: self.state,
            skipped: Vec::new(),
        }
    }
}

/// The link between one process and the cluster it runs a query in: its
/// [`Membership`], and the repartitions, restore and commits it runs through
/// the cluster.
pub trait ClusterLink: Membership {
    /// The sink and source of the query's repartition number `stage`.
    #[allow(clippy::type_complexity)]
    fn exchange(
        &self,
        stage: usize,
    ) -> Result<(Box<dyn Sink<Exchanged>>, Box<dyn Source<Exchanged>>)>;

    /// What of the dataflow commits second, once it is complete and before
    /// any of it runs.
    fn commit_order(&self, order: CommitOrder);

    /// Where this process's partitions resume: their committed offsets, and
    /// the keyed state of the key groups they carry.
    fn recover(&self) -> Result<ClusterRecovery>;

    /// Commits the first part of checkpoint `epoch` ([`CommitOrder`]) as soon
    /// as every source and the actors that commit first acknowledged it, not
    /// the slowest of the rest: among `offsets` (by source uid), those of the
    /// sources that commit first, and the output written of their records.
    /// The next epoch's records of those writers then go out without waiting
    /// for the whole checkpoint. [`commit`](Self::commit) of the same epoch
    /// commits the rest. By default nothing commits early: a link that
    /// commits each epoch as a whole leaves it all to `commit`.
    fn commit_first(&self, _epoch: Epoch, _offsets: &BTreeMap<String, Offsets>) -> Result<()> {
        Ok(())
    }

    /// Commits checkpoint `epoch` into the cluster: the output its sinks
    /// staged for it, its keyed state `deltas`, and the source `offsets` it
    /// ends at (by source uid, as the readers labelled them); what
    /// [`commit_first`](Self::commit_first) committed of it already, it
    /// leaves out.
    fn commit(
        &self,
        epoch: Epoch,
        offsets: &BTreeMap<String, Offsets>,
        deltas: &[Delta],
    ) -> Result<()>;
}

/// The order a process of a clustered query commits its work in, each
/// epoch: first what it read from source topics, with what it wrote of
/// those records (to repartitions and sinks); then what crossed a
/// repartition, with the keyed state and what it wrote of those records.
/// A repartition written first can be read before it commits: what is read
/// of it commits second, once it committed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitOrder {
    /// The repartitions, by number, whose writers commit first.
    pub read_before_commit: BTreeSet<usize>,
    /// The sources, by uid, whose offsets commit second: every
    /// repartition's reader, and any source some of whose records meet
    /// records that crossed a repartition.
    pub second: BTreeSet<String>,
}

/// A reader's view of event time in one repartition partition: the latest
/// watermark of each upstream source partition, as its writers told it.
///
/// ```
/// use rtflow_runtime::cluster::{UpstreamProgress, UpstreamWatermarks};
/// let mut partition = UpstreamWatermarks::default();
/// let told = |partitions: Vec<u32>, watermark| UpstreamProgress { upstream: 2, partitions, watermark };
/// partition.update(&told(vec![0], Some(50)));
/// assert_eq!(partition.watermark(), None, "source partition 1 not heard of yet");
/// partition.update(&told(vec![1], Some(70)));
/// assert_eq!(partition.watermark(), Some(50));
/// partition.update(&told(vec![0], None));
/// assert_eq!(partition.watermark(), Some(70), "an idle partition holds nothing back");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamWatermarks {
    upstream: u32,
    /// The latest watermark per source partition, idle ones included.
    watermarks: BTreeMap<u32, EventTime>,
    idle: BTreeSet<u32>,
    /// How many times writers told, counting from 1.
    updates: u64,
    /// Per source partition told of: the updates that told of it last,
    /// latest first.
    told: BTreeMap<u32, [u64; STALE_AFTER]>,
    /// A source partition last told of before this update is stale: another
    /// one was told of `STALE_AFTER` times since.
    stale_before: u64,
}

/// How many times one source partition is told of while another is not
/// before the other is stale: its writer fell that many epochs behind, less
/// one (it died, hangs or has not started).
const STALE_AFTER: usize = 3;

impl UpstreamWatermarks {
    /// Takes in what a writer told. A watermark never goes back: a writer
    /// restarted from an older checkpoint repeats older watermarks.
    pub fn update(&mut self, progress: &UpstreamProgress) {
        self.take(progress, true);
    }

    /// Takes in what a writer told between two barriers
    /// ([`WritersProgress::within`]), as [`update`](Self::update) does, but
    /// as no word toward the staleness of other source partitions, which
    /// counts barriers: a process whose writers tell often would make the
    /// others' partitions look as if their writers fell behind.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{UpstreamProgress, UpstreamWatermarks};
    /// let mut partition = UpstreamWatermarks::default();
    /// let told = |partitions: Vec<u32>, watermark| UpstreamProgress { upstream: 2, partitions, watermark: Some(watermark) };
    /// partition.update(&told(vec![0], 100));
    /// partition.update(&told(vec![1], 200));
    /// for watermark in 300..310 {
    ///     partition.update_within(&told(vec![1], watermark));
    /// }
    /// assert_eq!(partition.least_lately_heard(), Some(100), "0 still speaks");
    /// assert_eq!(partition.watermark(), Some(100));
    /// ```
    pub fn update_within(&mut self, progress: &UpstreamProgress) {
        self.take(progress, false);
    }

    fn take(&mut self, progress: &UpstreamProgress, at_barrier: bool) {
        self.upstream = self.upstream.max(progress.upstream);
        self.updates += 1;
        for partition in &progress.partitions {
            let told = self.told.entry(*partition).or_default();
            if at_barrier {
                told.rotate_right(1);
            }
            told[0] = self.updates;
            if at_barrier {
                self.stale_before = self.stale_before.max(told[STALE_AFTER - 1]);
            }
            match progress.watermark {
                Some(watermark) => {
                    self.idle.remove(partition);
                    self.raise(*partition, watermark);
                }
                None => {
                    self.idle.insert(*partition);
                }
            }
        }
    }

    /// How many source partitions feed the repartition.
    pub fn upstream(&self) -> u32 {
        self.upstream
    }

    /// Whether every upstream source partition is idle.
    pub fn is_idle(&self) -> bool {
        self.upstream > 0 && self.idle.len() == self.upstream as usize
    }

    /// The watermark of the partition: the least over the source partitions
    /// that are not idle, once every source partition was heard of.
    pub fn watermark(&self) -> Option<EventTime> {
        let heard = self
            .watermarks
            .keys()
            .chain(&self.idle)
            .collect::<BTreeSet<_>>();
        if self.upstream == 0 || heard.len() < self.upstream as usize {
            return None;
        }
        self.least(|_| true)
    }

    /// The least watermark over the source partitions heard of lately that
    /// are not idle, whether or not every source partition was heard of: a
    /// source partition restored, or told of last, before another one was
    /// told of three times since is left out.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{UpstreamProgress, UpstreamWatermarks};
    /// let mut partition = UpstreamWatermarks::default();
    /// let told = |partitions: Vec<u32>, watermark| UpstreamProgress { upstream: 3, partitions, watermark: Some(watermark) };
    /// partition.update(&told(vec![0], 100));
    /// partition.update(&told(vec![1], 900));
    /// assert_eq!(partition.least_lately_heard(), Some(100));
    /// partition.update(&told(vec![1], 950));
    /// partition.update(&told(vec![1], 990));
    /// assert_eq!(partition.least_lately_heard(), Some(990), "0's writer fell behind");
    /// assert_eq!(partition.watermark(), None, "2 not heard of, 0 still counts");
    /// ```
    pub fn least_lately_heard(&self) -> Option<EventTime> {
        self.least(|partition| {
            let told = self.told.get(&partition).map_or(0, |told| told[0]);
            told >= self.stale_before
        })
    }

    /// Takes in how far the records of some source partitions went (each
    /// one's own watermark, [`WritersProgress::passed`]): a partition's
    /// watermark is at least that, so a record of it behind that is behind
    /// whichever run reads it next. The staleness of what was told stays as
    /// the words of progress left it.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{UpstreamProgress, UpstreamWatermarks};
    /// let mut partition = UpstreamWatermarks::default();
    /// partition.passed(&[(0, 900)]);
    /// partition.update(&UpstreamProgress { upstream: 2, partitions: vec![0, 1], watermark: Some(500) });
    /// assert!(partition.is_behind(0, 800), "its records went to 900");
    /// assert_eq!(partition.watermark(), Some(500));
    /// ```
    pub fn passed(&mut self, passed: &[(u32, EventTime)]) {
        for (partition, watermark) in passed {
            self.raise(*partition, *watermark);
        }
    }

    /// Raises `partition`'s watermark to `watermark`: it never goes back.
    fn raise(&mut self, partition: u32, watermark: EventTime) {
        let latest = self.watermarks.entry(partition).or_insert(watermark);
        *latest = (*latest).max(watermark);
    }

    /// Whether a record of source partition `partition` at `event_time`,
    /// read after what the partition's writers told of it, is behind the
    /// watermark they told: it was behind when written, whether or not its
    /// writer knew.
    ///
    /// A process that takes a source partition over, or restarts its run,
    /// starts its watermarks from nothing, so its `with_watermark` and its
    /// writers would not mark (`behind`) a record its partition had passed
    /// before. What the earlier run told, every reader heard before the
    /// record: it was committed first, and every partition of a repartition
    /// hears every word.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{UpstreamProgress, UpstreamWatermarks};
    /// let mut partition = UpstreamWatermarks::default();
    /// partition.update(&UpstreamProgress { upstream: 2, partitions: vec![0], watermark: Some(900) });
    /// assert!(partition.is_behind(0, 500));
    /// assert!(!partition.is_behind(0, 900));
    /// assert!(!partition.is_behind(1, 500), "nothing told of source partition 1");
    /// ```
    #[inline]
    pub fn is_behind(&self, partition: u32, event_time: EventTime) -> bool {
        self.watermarks
            .get(&partition)
            .is_some_and(|watermark| event_time < *watermark)
    }

    fn least(&self, counts: impl Fn(u32) -> bool) -> Option<EventTime> {
        self.watermarks
            .iter()
            .filter(|(partition, _)| !self.idle.contains(partition) && counts(**partition))
            .map(|(_, watermark)| *watermark)
            .min()
    }

    /// The table as offsets labels travel: `(source partition, watermark)`,
    /// idle partitions included with their last watermark, so that a restart
    /// resumes the event time its offsets were committed with.
    pub fn entries(&self) -> Vec<(u32, EventTime)> {
        self.watermarks.iter().map(|(p, w)| (*p, *w)).collect()
    }

    /// The table a restart resumes: what [`entries`](Self::entries) gave, out
    /// of `upstream` source partitions.
    pub fn restore(upstream: u32, entries: impl IntoIterator<Item = (u32, EventTime)>) -> Self {
        Self {
            upstream,
            watermarks: entries.into_iter().collect(),
            ..Self::default()
        }
    }
}

/// What a reader of several partitions of one repartition knows of event
/// time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventTimeAcross {
    /// The least watermark over the partitions.
    Watermark(EventTime),
    /// Every partition is idle, after the least watermark they heard, if any.
    Idle(Option<EventTime>),
    /// A partition has not heard of every source partition.
    Unknown,
}

impl EventTimeAcross {
    /// The event time across `partitions`, each one's table.
    ///
    /// Every partition of a repartition hears the same words from each
    /// writer, in the same order: partitions that disagree were read to
    /// different points. A partition whose every source partition is idle
    /// while another's are not is behind or ahead of it, and the records
    /// still to be read from it may come before the other's watermark, as
    /// they did on their writer's lane. So an idle partition holds the others
    /// back at its last watermark (at none, if it never heard one) until
    /// every partition is idle: another's watermark never passes records it
    /// still holds, which one process would count.
    ///
    /// ```
    /// use rtflow_runtime::cluster::{EventTimeAcross, UpstreamProgress, UpstreamWatermarks};
    /// let told = |words: &[Option<i64>]| {
    ///     let mut table = UpstreamWatermarks::default();
    ///     for watermark in words {
    ///         table.update(&UpstreamProgress { upstream: 1, partitions: vec![0], watermark: *watermark });
    ///     }
    ///     table
    /// };
    /// let tables = [told(&[Some(30)]), told(&[Some(20)])];
    /// assert_eq!(EventTimeAcross::of(&tables), EventTimeAcross::Watermark(20));
    /// let tables = [told(&[Some(30)]), told(&[Some(20), None])];
    /// assert_eq!(EventTimeAcross::of(&tables), EventTimeAcross::Watermark(20), "idle at 20");
    /// assert_eq!(EventTimeAcross::of(&tables[1..]), EventTimeAcross::Idle(Some(20)));
    /// let tables = [told(&[None, Some(30)]), told(&[None])];
    /// assert_eq!(EventTimeAcross::of(&tables), EventTimeAcross::Unknown, "the second is behind");
    /// ```
    pub fn of<'a>(partitions: impl IntoIterator<Item = &'a UpstreamWatermarks>) -> Self {
        let mut least: Option<EventTime> = None;
        let (mut active, mut unknown) = (false, false);
        for partition in partitions {
            let watermark = if partition.is_idle() {
                partition.watermarks.values().min().copied()
            } else {
                active = true;
                partition.watermark()
            };
            match watermark {
                Some(w) => least = Some(least.map_or(w, |l| l.min(w))),
                None => unknown = true,
            }
        }
        match (active, unknown, least) {
            (false, _, _) => Self::Idle(least),
            (true, false, Some(watermark)) => Self::Watermark(watermark),
            _ => Self::Unknown,
        }
    }
}

/// Whether a record at `event_time` that was behind the watermark it was
/// written under ([`RecordMeta::behind`](crate::RecordMeta::behind),
/// [`WriterInput::is_behind`]) is late for a reader of `partitions`: it is
/// also behind every source partition each of them heard of lately
/// ([`UpstreamWatermarks::least_lately_heard`]).
///
/// A reader's watermark waits for every source partition, also for one whose
/// writer died or hangs before it told anything, or told last long ago: until
/// its next owner tells, the operators after the reader judge records by no
/// watermark, or an old one. They would take a record every process passed
/// long ago, which one process, whose partitions all move on, drops. The
/// writer knew the record was behind, the reader knows where the source
/// partitions that still speak are; a record behind both is late, and a
/// source partition not heard of lately holds nothing back. While every
/// source partition speaks, this is the reader's watermark: a record behind
/// it is late as its operators would judge it anyway.
///
/// ```
/// use rtflow_runtime::cluster::{late_across, UpstreamProgress, UpstreamWatermarks};
/// let mut partition = UpstreamWatermarks::default();
/// partition.update(&UpstreamProgress { upstream: 3, partitions: vec![0, 1], watermark: Some(900) });
/// assert_eq!(partition.watermark(), None, "source partition 2 not heard of");
/// assert!(late_across([&partition], 500));
/// assert!(!late_across([&partition], 950));
/// ```
pub fn late_across<'a>(
    partitions: impl IntoIterator<Item = &'a UpstreamWatermarks>,
    event_time: EventTime,
) -> bool {
    partitions
        .into_iter()
        .filter_map(UpstreamWatermarks::least_lately_heard)
        .all(|watermark| event_time < watermark)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn told(partitions: &[u32], watermark: Option<EventTime>) -> UpstreamProgress {
        UpstreamProgress {
            upstream: 3,
            partitions: partitions.to_vec(),
            watermark,
        }
    }

    #[test]
    fn a_source_partition_let_go_and_taken_back_is_told_of_again() {
        let at = |watermark| {
            let mut input = WriterInput::default();
            input.watermark(watermark);
            input
        };
        let mut writers = WritersProgress::new(1, 3);
        writers.join(&[0, 1]);
        writers.hand_over(4, &[1], &[], false);
        writers.hand_over(5, &[], &[1], true);
        writers.reached(0, 4, at(10));
        assert_eq!(writers.reached(0, 5, at(20)).progress[0].partitions, [0]);
        let told = writers.reached(0, 6, at(30)).progress;
        assert_eq!(told[0].partitions, [0, 1]);
    }

    #[test]
    fn the_watermark_waits_for_every_source_partition_and_takes_their_minimum() {
        let mut table = UpstreamWatermarks::default();
        assert_eq!(table.watermark(), None);
        table.update(&told(&[0, 1], Some(10)));
        assert_eq!(table.watermark(), None);
        table.update(&told(&[2], Some(30)));
        assert_eq!(table.watermark(), Some(10));
        table.update(&told(&[0, 1], Some(40)));
        assert_eq!(table.watermark(), Some(30));
    }

    #[test]
    fn a_record_behind_its_writer_is_late_once_behind_every_source_partition_heard_of() {
        let mut table = UpstreamWatermarks::default();
        assert!(late_across([&table], 5), "nothing heard of holds it back");
        table.update(&told(&[0], Some(10)));
        table.update(&told(&[1], Some(30)));
        assert!(late_across([&table], 9));
        assert!(!late_across([&table], 10));
        table.update(&told(&[0], None));
        assert!(
            late_across([&table], 29),
            "an idle partition holds nothing back"
        );
        let mut behind = UpstreamWatermarks::default();
        behind.update(&told(&[0, 1, 2], Some(20)));
        assert!(
            !late_across([&table, &behind], 25),
            "each partition read counts"
        );
    }

    #[test]
    fn a_record_its_restarted_writer_did_not_mark_is_behind_what_the_earlier_run_told() {
        let mut table = UpstreamWatermarks::default();
        table.update(&told(&[0, 1], Some(20_000)));
        table.update(&told(&[2], Some(19_000)));
        // Source partition 0's new run starts from no watermark: its first
        // record, at 500, reaches the writer unmarked.
        assert!(table.is_behind(0, 500));
        assert!(late_across([&table], 500), "and behind every partition");
        assert!(table.is_behind(0, 19_500));
        assert!(
            !late_across([&table], 19_500),
            "behind its own partition, not partition 2: one process counts it"
        );
        table.update(&told(&[0], None));
        assert!(
            table.is_behind(0, 500),
            "an idle partition's last watermark still bounds its records"
        );
    }

    #[test]
    fn a_source_partition_whose_writer_fell_behind_holds_no_record_back() {
        let mut table = UpstreamWatermarks::restore(3, [(0, 10), (1, 10), (2, 10)]);
        assert!(
            !late_across([&table], 50),
            "restored, and current until others speak"
        );
        for watermark in [100, 110] {
            table.update(&told(&[1, 2], Some(watermark)));
        }
        assert!(!late_across([&table], 50), "told of twice while 0 was not");
        table.update(&told(&[1, 2], Some(120)));
        assert!(
            late_across([&table], 50),
            "three times: 0's writer fell behind"
        );
        assert_eq!(
            table.watermark(),
            Some(10),
            "the watermark still waits for it"
        );
        table.update(&told(&[0], Some(40)));
        assert!(!late_across([&table], 50), "0 speaks again");
    }

    #[test]
    fn a_watermark_never_goes_back() {
        let mut table = UpstreamWatermarks::default();
        table.update(&told(&[0, 1, 2], Some(50)));
        // A writer that took partition 1 over replays from its older checkpoint.
        table.update(&told(&[1], Some(20)));
        assert_eq!(table.watermark(), Some(50));
    }

    #[test]
    fn idle_partitions_are_left_out_until_they_speak_again() {
        let mut table = UpstreamWatermarks::default();
        table.update(&told(&[0, 1], Some(10)));
        table.update(&told(&[2], None));
        assert_eq!(table.watermark(), Some(10), "idle counts as heard");
        table.update(&told(&[0, 1], None));
        assert!(table.is_idle());
        assert_eq!(table.watermark(), None);
        table.update(&told(&[2], Some(60)));
        assert!(!table.is_idle());
        assert_eq!(table.watermark(), Some(60));
    }

    #[test]
    fn across_partitions_one_that_has_not_heard_of_every_source_partition_holds_all_back() {
        let mut heard = UpstreamWatermarks::default();
        heard.update(&told(&[0, 1, 2], Some(50)));
        let mut partly = UpstreamWatermarks::default();
        partly.update(&told(&[0], Some(70)));
        assert_eq!(
            EventTimeAcross::of([&heard, &partly]),
            EventTimeAcross::Unknown
        );
        partly.update(&told(&[1, 2], None));
        assert_eq!(
            EventTimeAcross::of([&heard, &partly]),
            EventTimeAcross::Watermark(50)
        );
        assert_eq!(EventTimeAcross::of([]), EventTimeAcross::Idle(None));
    }

    #[test]
    fn a_partition_gone_idle_holds_the_others_back_until_they_go_idle_too() {
        // Both partitions hear: 0, 1 and 2 at 50, then idle, then 0 at 90.
        let mut ahead = UpstreamWatermarks::default();
        let mut behind = UpstreamWatermarks::default();
        for table in [&mut ahead, &mut behind] {
            table.update(&told(&[0, 1, 2], Some(50)));
            table.update(&told(&[0, 1, 2], None));
        }
        ahead.update(&told(&[0], Some(90)));
        assert_eq!(
            EventTimeAcross::of([&ahead, &behind]),
            EventTimeAcross::Watermark(50),
            "records of the second before 0's 90 may still come"
        );
        behind.update(&told(&[0], Some(90)));
        assert_eq!(
            EventTimeAcross::of([&ahead, &behind]),
            EventTimeAcross::Watermark(90)
        );
        for table in [&mut ahead, &mut behind] {
            table.update(&told(&[0], None));
        }
        assert_eq!(
            EventTimeAcross::of([&ahead, &behind]),
            EventTimeAcross::Idle(Some(50)),
            "the least watermark heard of a source partition"
        );
    }

    #[test]
    fn a_partition_idle_before_it_heard_any_watermark_holds_the_others_back() {
        let mut ahead = UpstreamWatermarks::default();
        let mut behind = UpstreamWatermarks::default();
        for table in [&mut ahead, &mut behind] {
            table.update(&told(&[0, 1, 2], None));
        }
        ahead.update(&told(&[0], Some(90)));
        assert_eq!(
            EventTimeAcross::of([&ahead, &behind]),
            EventTimeAcross::Unknown
        );
    }

    fn input(watermark: Option<EventTime>, idle: bool) -> WriterInput {
        let mut input = WriterInput::default();
        if let Some(watermark) = watermark {
            input.watermark(watermark);
        }
        if idle {
            input.idle();
        }
        input
    }

    fn watermarks(told: &[UpstreamProgress]) -> Vec<Option<EventTime>> {
        told.iter().map(|t| t.watermark).collect()
    }

    #[test]
    fn writers_tell_once_every_one_ended_the_epoch_the_least_of_their_watermarks() {
        let mut writers = WritersProgress::new(3, 6);
        for partitions in [&[0, 2][..], &[0, 2], &[4]] {
            writers.join(partitions);
        }
        assert!(writers.reached(0, 1, input(Some(40), false)).is_empty());
        assert!(writers.reached(2, 1, input(Some(10), false)).is_empty());
        let told = writers.reached(1, 1, input(Some(25), false)).progress;
        assert_eq!(watermarks(&told), [Some(10)]);
        assert_eq!(told[0].partitions, [0, 2, 4]);
        assert_eq!(told[0].upstream, 6);
        // Epoch 2: unchanged least, nothing new to tell.
        assert!(writers.reached(0, 2, input(Some(50), false)).is_empty());
        assert!(writers.reached(1, 2, input(Some(50), false)).is_empty());
        assert!(writers.reached(2, 2, input(Some(10), false)).is_empty());
        assert!(writers.reached(2, 3, input(Some(60), false)).is_empty());
        assert!(writers.reached(0, 3, input(Some(70), false)).is_empty());
        assert_eq!(
            watermarks(&writers.reached(1, 3, input(Some(55), false)).progress),
            [Some(55)]
        );
    }

    #[test]
    fn an_active_writer_without_a_watermark_holds_the_others_back_and_idle_ones_do_not() {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0, 1]);
        writers.reached(0, 1, input(Some(40), false));
        assert!(writers.reached(1, 1, input(None, false)).is_empty());
        writers.reached(0, 2, input(Some(40), false));
        assert_eq!(
            watermarks(&writers.reached(1, 2, input(None, true)).progress),
            [Some(40)],
            "an idle writer is left out"
        );
        writers.reached(0, 3, input(Some(90), true));
        assert_eq!(
            watermarks(&writers.reached(1, 3, input(None, true)).progress),
            [Some(90), None],
            "all idle: the watermark the last records were judged by, then idleness"
        );
        writers.reached(0, 4, input(Some(95), false));
        assert_eq!(
            watermarks(&writers.reached(1, 4, input(None, true)).progress),
            [Some(95)],
            "active again"
        );
    }

    #[test]
    fn the_end_of_the_input_is_told_once_every_writer_got_there() {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0]);
        writers.join(&[1]);
        writers.reached(0, 1, input(Some(5), false));
        writers.reached(1, 1, input(Some(5), false));
        assert!(writers.ended(0, input(Some(20), false)).is_empty());
        assert_eq!(
            watermarks(&writers.ended(1, input(Some(30), false)).progress),
            [Some(20)]
        );
        assert!(writers.ended(1, input(Some(30), false)).is_empty());
    }

    #[test]
    fn between_barriers_writers_tell_what_moved_and_the_barrier_only_what_moved_since() {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0, 1]);
        assert!(
            writers.within(0, input(Some(5), false)).unwrap().is_empty(),
            "writer 1 has not told yet"
        );
        writers.reached(0, 1, input(Some(10), false));
        writers.reached(1, 1, input(Some(10), false));
        assert!(writers
            .within(0, input(Some(10), false))
            .unwrap()
            .is_empty());
        assert!(
            writers
                .within(1, input(Some(10), false))
                .unwrap()
                .is_empty(),
            "the least did not move"
        );
        assert_eq!(
            watermarks(&writers.within(0, input(Some(30), true)).unwrap()),
            []
        );
        assert_eq!(
            watermarks(&writers.within(1, input(Some(20), true)).unwrap()),
            [Some(20), None],
            "all idle: the least watermark, then idleness"
        );
        writers.reached(0, 2, input(Some(20), true));
        let word = writers.reached(1, 2, input(Some(20), true));
        assert!(word.is_empty(), "told already between the barriers");
        assert_eq!(
            watermarks(&writers.within(0, input(Some(40), false)).unwrap()),
            [],
            "writer 1 has not told since the barrier"
        );
        assert_eq!(
            watermarks(&writers.within(1, input(None, true)).unwrap()),
            [Some(40)],
            "active again"
        );
    }

    #[test]
    fn in_the_runs_first_epoch_writers_tell_between_barriers_too() {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0, 1]);
        assert!(writers.within(0, input(Some(5), false)).unwrap().is_empty());
        assert_eq!(
            watermarks(&writers.within(1, input(Some(8), false)).unwrap()),
            [Some(5)]
        );
        writers.reached(0, 1, input(Some(9), false));
        assert!(
            writers.within(1, input(Some(9), false)).unwrap().is_empty(),
            "the first barrier is under way"
        );
        assert_eq!(
            watermarks(&writers.reached(1, 1, input(Some(9), false)).progress),
            [Some(9)]
        );
    }

    /// A writer that told its input while its barrier was under way tells
    /// it again after the barrier's word, even if it did not move: the word
    /// between barriers needs every writer's, and one whose input stays put
    /// would hold its process's watermarks back until the next barrier.
    #[test]
    fn a_writers_input_told_while_its_barrier_is_under_way_is_not_taken() {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0, 1]);
        writers.reached(0, 1, input(Some(10), false));
        assert_eq!(writers.within(0, input(Some(15), false)), None);
        writers.reached(1, 1, input(Some(10), false));
        assert_eq!(writers.within(1, input(Some(20), false)), Some(vec![]));
        assert_eq!(
            watermarks(&writers.within(0, input(Some(15), false)).unwrap()),
            [Some(15)],
            "told again, the same input"
        );
    }

    #[test]
    fn between_barriers_writers_speak_for_the_partitions_after_the_handover() {
        let mut writers = WritersProgress::new(2, 4);
        writers.join(&[0, 1]);
        writers.reached(0, 1, input(Some(10), false));
        writers.hand_over(1, &[1], &[2], false);
        writers.reached(1, 1, input(Some(10), false));
        writers.hand_over(1, &[], &[3], false);
        writers.within(0, input(Some(50), false)).unwrap();
        let told = writers.within(1, input(Some(60), false)).unwrap();
        assert_eq!(told[0].partitions, [0, 2, 3], "1 went, 2 and 3 came");
        assert_eq!(told[0].watermark, Some(50));
        writers.reached(0, 2, input(Some(50), false));
        let word = writers.reached(1, 2, input(Some(70), false));
        assert!(word.progress.is_empty(), "the handover was taken in once");
    }

    #[test]
    fn a_handover_that_starts_over_tells_nothing_between_barriers_until_every_writer_has_a_watermark(
    ) {
        let mut writers = WritersProgress::new(2, 2);
        writers.join(&[0]);
        writers.reached(0, 1, input(Some(90), false));
        writers.reached(1, 1, input(Some(90), false));
        writers.hand_over(1, &[], &[1], true);
        writers.within(0, input(Some(20), false)).unwrap();
        assert!(
            writers.within(1, input(None, false)).unwrap().is_empty(),
            "writer 1 has no watermark since it started over"
        );
        assert_eq!(
            watermarks(&writers.within(1, input(Some(30), false)).unwrap()),
            [Some(20)],
            "told again from the writers' inputs after the adoption"
        );
    }

    #[test]
    fn writers_that_read_no_partition_tell_nothing() {
        let mut writers = WritersProgress::new(1, 4);
        writers.join(&[]);
        assert!(writers.reached(0, 1, input(Some(5), false)).is_empty());
    }

    #[test]
    fn a_restored_table_resumes_its_watermark() {
        let mut table = UpstreamWatermarks::default();
        table.update(&told(&[0], Some(5)));
        table.update(&told(&[1, 2], Some(9)));
        let restored = UpstreamWatermarks::restore(3, table.entries());
        assert_eq!(restored.watermark(), Some(5));
    }
}
