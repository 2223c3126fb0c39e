//! The process's Kafka transaction, one per epoch, and the records its
//! writers stage into it.
//!
//! Writers ([`Staging`]) hand their records over in batches as they go,
//! every 256 KiB of values (or 16 Ki records). A feeder thread produces the
//! batches of the epoch the next commit commits into that epoch's
//! transaction while the epoch runs: the records travel to the brokers
//! beside the work (once that transaction is begun, a writer produces its
//! batches itself: records read before they commit skip the hop to the
//! feeder's thread), and a commit produces only what is left, adds the
//! changelog and the offsets, and commits. Had the commit produced every
//! record, the epoch's output would become visible that much later (at
//! 10,000 records/s of 1.2 KB, p99 400 ms against 337), and an epoch that
//! took long to commit would gather more records for the next. A producer
//! has one transaction at a time, so the first tier's epochs alternate
//! between two ([`Lanes`]): the next epoch's batches wait only until every
//! record of the last one is on the brokers and its offsets are accepted,
//! not for its commit. Every batch is kept until its epoch commits, so that
//! a transaction the brokers refused can be made again. Batches of small
//! records are large: handed over every 256 records, a million waiting
//! records went through 12% slower (docs/performance.md).
//!
//! A process has two transactions per epoch ([`Tiers`]): one for what it
//! read from the source topics (their offsets, and what it wrote of those
//! records to repartitions and sinks), and one for what crossed a
//! repartition (its offsets, the keyed state, and what it wrote of those
//! records). The second commits after the first of every process whose
//! records it read (`upstream`), which is what lets repartitions be read
//! before their writers commit.
//!
//! [`Feed`] decides what goes when and does no I/O; [`Transactions`] and its
//! feeder thread do the producing.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::KafkaResult;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, TopicPartitionList};
use rtflow_runtime::{Epoch, Result, RtflowError};

use super::{lock, ClusterSettings};
use crate::kafka::producer::{commit_transaction, flush, send, Deliveries, KafkaMessage};

/// A writer hands its records over once it holds this many bytes of
/// values (a repartition frame holds up to 64 KiB)...
const HAND_OVER_BYTES: usize = 256 * 1024;
/// ...or this many records.
const HAND_OVER_MESSAGES: usize = 16 * 1024;

/// How long apart a commit refused for a group generation that just ended
/// is tried again with the next one (for at most the operation timeout).
const GENERATION_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Which of a process's two transactions something commits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tier {
    /// What the process read from the source topics: their offsets, and the
    /// records written from them.
    Sourced,
    /// What crossed a repartition: its offsets, the keyed state, and the
    /// records written from them.
    Repartitioned,
}

impl Tier {
    /// The tier of a writer whose output commits second
    /// (`SinkContext::commits_second`), or first.
    pub(crate) fn of(commits_second: bool) -> Self {
        if commits_second {
            Tier::Repartitioned
        } else {
            Tier::Sourced
        }
    }

    /// How many producers take its epochs in turn ([`Lanes`]). The second
    /// tier's output is read when it commits, so its next epoch gains
    /// nothing from not waiting.
    pub(crate) fn lanes(self) -> usize {
        match self {
            Tier::Sourced => 2,
            Tier::Repartitioned => 1,
        }
    }
}

/// The process's transactional producers: two lanes for [`Tier::Sourced`],
/// one for [`Tier::Repartitioned`].
pub(crate) struct Tiers {
    sourced: Lanes,
    repartitioned: Lanes,
}

impl Tiers {
    /// Every producer of the process, initialised: what an earlier
    /// incarnation left open is aborted.
    pub(crate) fn open(settings: &ClusterSettings) -> Result<Self> {
        let lanes = |tier: Tier| -> Result<Lanes> {
            (0..tier.lanes())
                .map(|lane| Transactions::open(settings, tier, lane).map(Arc::new))
                .collect::<Result<_>>()
                .map(Lanes)
        };
        Ok(Self {
            sourced: lanes(Tier::Sourced)?,
            repartitioned: lanes(Tier::Repartitioned)?,
        })
    }

    pub(crate) fn of(&self, tier: Tier) -> &Lanes {
        match tier {
            Tier::Sourced => &self.sourced,
            Tier::Repartitioned => &self.repartitioned,
        }
    }

    fn all(&self) -> impl Iterator<Item = &Arc<Transactions>> {
        self.sourced.0.iter().chain(&self.repartitioned.0)
    }

    pub(crate) fn set_group(&self, group: &str, metadata: Option<ConsumerGroupMetadata>) {
        let metadata = metadata.map(Arc::new);
        for transactions in self.all() {
            transactions.set_group(group, metadata.clone());
        }
    }

    /// Lets transactions begin ([`Transactions::release`]).
    pub(crate) fn release(&self) {
        for transactions in self.all() {
            transactions.release();
        }
    }

    /// Drops every record not committed ([`Transactions::discard`]), and
    /// waits until what was produced of them is aborted: the next run's
    /// readers then read past it `read_committed` (`exchange`'s catch-up)
    /// rather than roll back on it once more.
    pub(crate) fn discard(&self) {
        self.discard_then(false);
    }

    /// Discards as [`discard`](Self::discard) does, after the group dropped
    /// the process (its session expired): whoever took its partitions over
    /// fenced its transactional ids meanwhile, so both producers start
    /// afresh, even one with no transaction open. Kept, that one would fail
    /// the next run's first transaction, and with it the run.
    pub(crate) fn discard_fenced(&self) {
        self.discard_then(true);
    }

    fn discard_then(&self, fenced: bool) {
        for transactions in self.all() {
            transactions.discard(fenced);
        }
        for transactions in self.all() {
            transactions.await_aborted();
        }
    }

    /// Commits `tier`'s transaction of `epoch` ([`Transactions::commit`]).
    pub(crate) fn commit(
        &self,
        tier: Tier,
        epoch: Epoch,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<()> {
        let lanes = self.of(tier);
        let next = (lanes.0.len() > 1).then(|| &*lanes.of(epoch + 1).inner);
        lanes
            .of(epoch)
            .commit(epoch, changes, positions, true, next)
    }

    /// Commits as [`commit`](Self::commit) does, the run's last commit:
    /// none of its later records is produced, so that a run about to roll
    /// back leaves no transaction to abort that another process may have
    /// read from.
    pub(crate) fn commit_last(
        &self,
        tier: Tier,
        epoch: Epoch,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
    ) -> Result<()> {
        (self.of(tier).of(epoch)).commit(epoch, changes, positions, false, None)
    }
}

/// The producers a tier's epochs commit with, in turn: epoch `x` in lane
/// `x % lanes`.
///
/// A producer has one transaction at a time. With one, the records of epoch
/// `x + 1` waited while `x` committed, then while the brokers finished that
/// transaction: the next one's first partitions are refused
/// (`CONCURRENT_TRANSACTIONS`) until the commit's markers are written, and
/// librdkafka asks again 20 ms later. At a 1 s batch those 30-60 ms were
/// most of a clustered query's p99 across a repartition. With two lanes the
/// records of `x + 1` go out as soon as every record of `x` is on the
/// brokers and `x`'s offsets are accepted (its lane is *sealed*,
/// [`Feed::open_gate`]): a key's records stay in order within a partition,
/// and a commit refused for a group generation that ended is made again
/// before anything of `x + 1` went out.
#[derive(Clone)]
pub(crate) struct Lanes(Vec<Arc<Transactions>>);

impl Lanes {
    fn of(&self, epoch: Epoch) -> &Arc<Transactions> {
        &self.0[lane_of(epoch, self.0.len())]
    }
}

/// The lane of `epoch` among `lanes`.
fn lane_of(epoch: Epoch, lanes: usize) -> usize {
    (epoch % lanes as u64) as usize
}

/// Records a writer staged for an epoch's transaction, and the topic of those
/// that name none.
pub(crate) struct Batch {
    pub(crate) topic: Option<String>,
    pub(crate) messages: Vec<KafkaMessage>,
}

/// Where the process's transaction stands, and the batches waiting for it.
#[derive(Default)]
struct Feed {
    /// The run whose writers stage: batches of a run discarded since are
    /// dropped.
    run: u64,
    /// Batches staged and not produced yet, by epoch, in the order staged.
    waiting: BTreeMap<Epoch, VecDeque<Arc<Batch>>>,
    /// The epoch the next commit commits, once known: its batches are
    /// produced as they come.
    next: Option<Epoch>,
    /// Whether a transaction is begun.
    open: bool,
    /// The batches produced into it, kept until it commits.
    produced: Vec<Arc<Batch>>,
    /// It holds records of a run discarded since: it must be aborted, by a
    /// fresh producer, before anything else.
    stale: bool,
    /// The feeder produces, or renews the producer, outside the lock.
    busy: bool,
    /// Writers producing their batches themselves, outside the lock
    /// ([`Feed::produce_now`]).
    producing: usize,
    /// A commit holds the producer.
    committing: bool,
    /// Why producing a batch failed: the commit fails with it.
    failed: Option<RtflowError>,
    /// The process stops: the feeder ends.
    closed: bool,
    /// No transaction may begin yet: the process has not written its name
    /// among the query's instances (`departures`), and one that died with a
    /// transaction open would be in no newcomer's list to fence.
    held: bool,
    /// Which of its tier's [`Lanes`] this is, if it has more than one.
    lane: Option<Lane>,
}

/// A lane among its tier's lanes.
#[derive(Debug, Clone, Copy)]
struct Lane {
    index: u64,
    count: u64,
    /// The latest epoch whose records may be produced: the one after the
    /// latest whose lane sealed, or the run's first.
    gate: Epoch,
}

/// What the feeder does next.
enum Step {
    Wait,
    /// Abort a discarded run's records: renew the producer.
    Renew,
    /// Produce `batch` of run `run`, beginning the transaction first if
    /// `begin`.
    Produce {
        run: u64,
        batch: Arc<Batch>,
        begin: bool,
    },
}

/// What a commit takes over from the feed.
struct ForCommit {
    run: u64,
    /// Batches already produced into the open transaction, if `open`.
    produced: Vec<Arc<Batch>>,
    open: bool,
    /// Batches of the epochs committed that are not produced yet.
    rest: Vec<Arc<Batch>>,
    /// The open transaction holds a discarded run's records.
    stale: bool,
    failed: Option<RtflowError>,
}

impl ForCommit {
    /// Nothing was staged or produced, and nothing must be aborted first.
    fn is_empty(&self) -> bool {
        !self.open && !self.stale && self.failed.is_none() && self.rest.is_empty()
    }
}

impl Feed {
    /// Lane `index` of `count`; one lane if `count` is 1.
    fn new(index: usize, count: usize) -> Self {
        Self {
            held: true,
            lane: (count > 1).then_some(Lane {
                index: index as u64,
                count: count as u64,
                gate: 0,
            }),
            ..Self::default()
        }
    }

    /// A run's writer whose first epoch is `first` opens: the run's number,
    /// which its batches carry.
    fn join(&mut self, first: Epoch) -> u64 {
        if !self.open {
            self.next = Some(match self.lane {
                Some(lane) => first + (lane.index + lane.count - first % lane.count) % lane.count,
                None => first,
            });
        }
        if let Some(lane) = &mut self.lane {
            lane.gate = lane.gate.max(first);
        }
        self.run
    }

    /// Whether records of `epoch` may be produced: every record of the
    /// epochs before it went out already.
    fn opened(&self, epoch: Epoch) -> bool {
        self.lane.is_none_or(|lane| epoch <= lane.gate)
    }

    /// Every record of the epoch before `epoch` is on the brokers: `epoch`'s
    /// may follow.
    fn open_gate(&mut self, epoch: Epoch) {
        if let Some(lane) = &mut self.lane {
            lane.gate = lane.gate.max(epoch);
        }
    }

    /// Takes `batch` of `epoch` from run `run`; whether the feeder may
    /// produce it now.
    fn stage(&mut self, run: u64, epoch: Epoch, batch: Batch) -> bool {
        if run != self.run || batch.messages.is_empty() {
            return false;
        }
        self.waiting
            .entry(epoch)
            .or_default()
            .push_back(Arc::new(batch));
        self.next == Some(epoch) && self.opened(epoch)
    }

    /// Whether a writer of run `run` may produce its batch of `epoch`
    /// itself, now: the transaction it goes to is begun and nothing of the
    /// epoch waits before it. It saves the hop to the feeder's thread, on
    /// the way of every record read before it commits. The writer reports
    /// with [`Feed::produced_by_writer`].
    fn produce_now(&mut self, run: u64, epoch: Epoch) -> bool {
        let now = run == self.run
            && self.open
            && self.next == Some(epoch)
            && self.opened(epoch)
            && !(self.committing || self.busy || self.held || self.stale || self.closed)
            && self.failed.is_none()
            && !self.waiting.contains_key(&epoch);
        self.producing += usize::from(now);
        now
    }

    /// Whether the producer is in use outside the lock.
    fn in_use(&self) -> bool {
        self.busy || self.producing > 0
    }

    fn step(&mut self) -> Step {
        if self.committing || self.in_use() || self.held {
            return Step::Wait;
        }
        if self.stale {
            (self.stale, self.open, self.busy) = (false, false, true);
            return Step::Renew;
        }
        if self.failed.is_some() {
            return Step::Wait;
        }
        let Some(epoch) = self.next.filter(|epoch| self.opened(*epoch)) else {
            return Step::Wait;
        };
        let Some(queue) = self.waiting.get_mut(&epoch) else {
            return Step::Wait;
        };
        let Some(batch) = queue.pop_front() else {
            return Step::Wait;
        };
        if queue.is_empty() {
            self.waiting.remove(&epoch);
        }
        let begin = !self.open;
        (self.open, self.busy) = (true, true);
        Step::Produce {
            run: self.run,
            batch,
            begin,
        }
    }

    /// The feeder produced `batch` of run `run`, or failed to.
    fn produced(&mut self, run: u64, batch: Arc<Batch>, result: Result<()>) {
        self.busy = false;
        self.took(run, batch, result);
    }

    /// A writer let produce ([`Feed::produce_now`]) produced `batch` of run
    /// `run`, or failed to.
    fn produced_by_writer(&mut self, run: u64, batch: Arc<Batch>, result: Result<()>) {
        self.producing -= 1;
        self.took(run, batch, result);
    }

    fn took(&mut self, run: u64, batch: Arc<Batch>, result: Result<()>) {
        if run != self.run {
            self.stale = true;
            return;
        }
        match result {
            Ok(()) => self.produced.push(batch),
            Err(error) => self.failed = Some(error),
        }
    }

    /// The feeder renewed the producer, or failed to.
    fn renewed(&mut self, result: Result<()>) {
        self.busy = false;
        if let Err(error) = result {
            self.failed = Some(error);
        }
    }

    /// A commit of `epoch` takes the producer, once the feeder is not busy.
    fn take_for_commit(&mut self, epoch: Epoch) -> ForCommit {
        debug_assert!(!self.in_use() && !self.committing);
        self.committing = true;
        let later = self.waiting.split_off(&(epoch + 1));
        let rest = std::mem::replace(&mut self.waiting, later)
            .into_values()
            .flatten()
            .collect();
        ForCommit {
            run: self.run,
            produced: std::mem::take(&mut self.produced),
            open: std::mem::take(&mut self.open),
            rest,
            stale: std::mem::take(&mut self.stale),
            failed: self.failed.take(),
        }
    }

    /// The commit of `epoch` for run `run` ended. The run's next epoch goes
    /// into the next transaction if `go_on`: the commit committed and was
    /// not the run's last. Otherwise nothing of the run is produced any
    /// more, and no transaction begins, until it is discarded.
    fn committed(&mut self, run: u64, epoch: Epoch, go_on: bool) {
        self.committing = false;
        if run == self.run {
            let stride = self.lane.map_or(1, |lane| lane.count);
            self.next = go_on.then_some(epoch + stride);
        }
    }

    /// Drops every batch not committed, and the run they came from.
    fn discard(&mut self) {
        self.run += 1;
        self.waiting.clear();
        self.next = None;
        self.failed = None;
        if let Some(lane) = &mut self.lane {
            // The next run's first epoch may come before this run's last.
            lane.gate = 0;
        }
        if self.open {
            (self.stale, self.open) = (true, false);
            self.produced.clear();
        }
    }

    /// Discards as [`Feed::discard`] does, for a process another fenced:
    /// its producer is renewed before anything else, even with no
    /// transaction open (the next would fail on the fenced one).
    fn discard_fenced(&mut self) {
        self.discard();
        self.stale = true;
    }
}

/// How one attempt at a transaction failed.
struct Failed {
    error: RtflowError,
    /// The group moved to a new generation meanwhile: the same transaction
    /// may commit with the new one.
    generation: bool,
}

/// The process's transactional producer, its feeder thread, and the records
/// its writers staged for the transactions still to commit.
pub(crate) struct Transactions {
    inner: Arc<Inner>,
    feeder: Option<JoinHandle<()>>,
}

struct Inner {
    /// Renewed after a failed transaction: a fresh producer (the same
    /// transactional id, initialised again) leaves no error state behind.
    producer: Mutex<Arc<ThreadedProducer<Deliveries>>>,
    feed: Mutex<Feed>,
    /// Wakes the feeder, and a commit waiting for it.
    changed: Condvar,
    /// Each group's metadata as of its latest generation: offsets committed
    /// with an older generation are refused.
    groups: Mutex<BTreeMap<String, Arc<ConsumerGroupMetadata>>>,
    config: ClientConfig,
    timeout: Duration,
    name: String,
}

impl Transactions {
    /// The producer of the process's transactional id, initialised (an
    /// earlier incarnation's open transaction is aborted, and it can no
    /// longer commit), and its feeder.
    pub(crate) fn open(settings: &ClusterSettings, tier: Tier, lane: usize) -> Result<Self> {
        let name = format!(
            "kafka cluster {} ({tier:?} {lane})",
            settings.bootstrap_servers
        );
        let id = settings.transactional_id_of(&settings.instance, tier, lane);
        let mut config = producer_config(settings, &id);
        if tier == Tier::Sourced {
            // Its records are read before it commits: they go out at once.
            // Writers hand over frames, not records, so lingering batches
            // little more: at 1,000 records/s linger 1 ms put a clustered
            // query's p50 at 3.3-3.9 ms, linger 0 at 2.0 (one process 1.7).
            config.set("linger.ms", "0");
        }
        let producer = initialised(&config, settings.operation_timeout, &name)?;
        let inner = Arc::new(Inner {
            producer: Mutex::new(Arc::new(producer)),
            feed: Mutex::new(Feed::new(lane, tier.lanes())),
            changed: Condvar::new(),
            groups: Mutex::default(),
            config,
            timeout: settings.operation_timeout,
            name,
        });
        let feeding = inner.clone();
        let feeder = std::thread::Builder::new()
            .name("rtflow-txn-feeder".into())
            .spawn(move || feeding.feed())
            .map_err(|e| {
                RtflowError::sink(&inner.name, format!("could not start its feeder: {e}"))
            })?;
        Ok(Self {
            inner,
            feeder: Some(feeder),
        })
    }

    fn set_group(&self, group: &str, metadata: Option<Arc<ConsumerGroupMetadata>>) {
        let mut groups = lock(&self.inner.groups);
        match metadata {
            Some(metadata) => groups.insert(group.to_owned(), metadata),
            None => groups.remove(group),
        };
    }

    /// Lets transactions begin, once the process's name is written among
    /// the query's instances (or could not be: then one that dies alone with
    /// a transaction open is left to its transaction timeout, as before).
    pub(crate) fn release(&self) {
        lock(&self.inner.feed).held = false;
        self.inner.changed.notify_all();
    }

    /// Drops every record not committed (a run that stopped without its
    /// final checkpoint) and aborts what of them was produced; with a fresh
    /// producer in any case if `fenced`.
    pub(crate) fn discard(&self, fenced: bool) {
        let mut feed = lock(&self.inner.feed);
        if feed.open {
            // Whoever read its records before it ended rolls back too.
            tracing::info!(transactions = %self.inner.name, "the open transaction aborts");
        }
        if fenced {
            feed.discard_fenced();
        } else {
            feed.discard();
        }
        drop(feed);
        self.inner.changed.notify_all();
    }

    /// Waits, for up to the operation timeout, until the transaction a
    /// discard left open is aborted (the producer renewed). A feeder held
    /// back begins nothing, and so has nothing to abort.
    fn await_aborted(&self) {
        let inner = &self.inner;
        let _ = inner
            .changed
            .wait_timeout_while(lock(&inner.feed), inner.timeout, |feed| {
                (feed.stale || feed.in_use()) && !feed.held && !feed.closed
            });
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
    ///
    /// The run goes on after it if `go_on` (else nothing more of the run is
    /// produced until it is discarded), and `next`, the lane of the next
    /// epoch, may then produce that epoch's records once every record of
    /// this one is on the brokers and its offsets are accepted.
    fn commit(
        &self,
        epoch: Epoch,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
        go_on: bool,
        next: Option<&Inner>,
    ) -> Result<()> {
        let inner = &self.inner;
        let taken = {
            // The feeder finishes the batch it produces; one that outlasts
            // the operation timeout (it would have died) fails the commit
            // rather than hold it for good.
            let (mut feed, waited) = inner
                .changed
                .wait_timeout_while(lock(&inner.feed), inner.timeout, |feed| {
                    feed.in_use() || feed.held
                })
                .unwrap_or_else(|p| p.into_inner());
            if waited.timed_out() {
                let why = if feed.held {
                    "the process's name was not written among the query's instances"
                } else {
                    "its records were not produced"
                };
                return Err(RtflowError::Checkpoint(format!(
                    "{}: could not commit the transaction of epoch {epoch}: {why} within {:?}",
                    inner.name, inner.timeout
                )));
            }
            feed.take_for_commit(epoch)
        };
        let run = taken.run;
        if taken.is_empty() && changes.messages.is_empty() && positions.is_empty() {
            // Nothing to commit: no transaction either.
            lock(&inner.feed).committed(run, epoch, go_on);
            inner.changed.notify_all();
            if let Some(next) = next {
                next.open_gate(epoch + 1);
            }
            return Ok(());
        }
        let result = inner.commit(epoch, taken, changes, positions, next);
        lock(&inner.feed).committed(run, epoch, go_on && result.is_ok());
        inner.changed.notify_all();
        result
    }
}

impl Drop for Transactions {
    fn drop(&mut self) {
        lock(&self.inner.feed).closed = true;
        self.inner.changed.notify_all();
        if let Some(feeder) = self.feeder.take() {
            let _ = feeder.join();
        }
    }
}

impl Inner {
    /// The feeder's loop: produces the next epoch's batches as they come,
    /// and aborts what a discarded run left in the transaction.
    fn feed(&self) {
        let mut feed = lock(&self.feed);
        loop {
            if feed.closed {
                return;
            }
            match feed.step() {
                Step::Wait => {
                    feed = self.changed.wait(feed).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                Step::Renew => {
                    drop(feed);
                    let result = self.renew();
                    feed = lock(&self.feed);
                    feed.renewed(result);
                }
                Step::Produce { run, batch, begin } => {
                    drop(feed);
                    let producer = lock(&self.producer).clone();
                    let result = if begin {
                        producer.begin_transaction().map_err(|e| {
                            RtflowError::Checkpoint(format!(
                                "{}: could not begin a transaction: {e}",
                                self.name
                            ))
                        })
                    } else {
                        Ok(())
                    }
                    .and_then(|()| self.produce(&producer, &batch));
                    feed = lock(&self.feed);
                    feed.produced(run, batch, result);
                }
            }
            self.changed.notify_all();
        }
    }

    fn produce(&self, producer: &ThreadedProducer<Deliveries>, batch: &Batch) -> Result<()> {
        for message in &batch.messages {
            send(producer, message, batch.topic.as_deref(), &self.name)?;
        }
        Ok(())
    }

    /// Commits epoch `epoch`: what `taken` produced already, the rest of it
    /// and `changes`.
    fn commit(
        &self,
        epoch: Epoch,
        taken: ForCommit,
        changes: Batch,
        positions: &BTreeMap<String, TopicPartitionList>,
        next: Option<&Inner>,
    ) -> Result<()> {
        if let Some(error) = taken.failed {
            let _ = self.renew();
            return Err(error);
        }
        if taken.stale {
            self.renew()?;
        }
        let mut open = taken.open;
        let mut batches = taken.produced;
        // How many batches the transaction begun holds already.
        let mut sent = if open { batches.len() } else { 0 };
        batches.extend(taken.rest);
        batches.push(Arc::new(changes));
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            let failed = match self.attempt(epoch, &batches, (open, sent), positions, next) {
                Ok(()) => return Ok(()),
                Err(failed) => failed,
            };
            if !failed.generation || std::time::Instant::now() >= deadline {
                let _ = self.renew();
                return Err(failed.error);
            }
            // Refused before any record was produced that the brokers had not
            // taken ([`attempt`](Self::attempt)), the transaction aborts
            // cleanly and the same producer makes it again: a new one takes
            // most of a second to initialise, which a rebalance's final
            // commit would add to every key's pause.
            let aborted = lock(&self.producer).abort_transaction(self.timeout);
            if aborted.is_err() {
                self.renew()?;
            }
            (open, sent) = (false, 0);
            tracing::debug!(epoch, "the group's generation changed; committing again");
            std::thread::sleep(GENERATION_RETRY_PAUSE);
        }
    }

    /// One attempt at epoch `epoch`'s transaction: the first `sent` of
    /// `batches` are in the transaction already, begun if `open`. Once
    /// every record of it is on the brokers and its offsets are accepted,
    /// the lane `next` may produce the next epoch's records: a generation
    /// that ended refuses the offsets, and the transaction made again then
    /// puts this epoch's records nowhere after the next one's.
    fn attempt(
        &self,
        epoch: Epoch,
        batches: &[Arc<Batch>],
        (open, sent): (bool, usize),
        positions: &BTreeMap<String, TopicPartitionList>,
        next: Option<&Inner>,
    ) -> Result<(), Failed> {
        let failed = |what: &str, e: &dyn std::fmt::Display| Failed {
            error: RtflowError::Checkpoint(format!(
                "{}: could not {what} the transaction of epoch {epoch}: {e}",
                self.name
            )),
            generation: false,
        };
        let producer = lock(&self.producer).clone();
        let started = std::time::Instant::now();
        if !open {
            producer
                .begin_transaction()
                .map_err(|e| failed("begin", &e))?;
        }
        // The offsets go before the records still to produce, and after the
        // brokers took those the feeder produced: a generation that just
        // ended refuses them while nothing is on its way, and the abort then
        // leaves the producer fit to try again. Records still queued when it
        // aborts would leave a gap in its idempotent sequence numbers, which
        // the brokers refuse (OUT_OF_ORDER_SEQUENCE_NUMBER).
        if sent > 0 {
            flush(&producer, self.timeout).map_err(|e| failed("produce the records of", &e))?;
        }
        let flushed = started.elapsed();
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
        let offsets_added = started.elapsed();
        let rest = &batches[sent..];
        for batch in rest {
            self.produce(&producer, batch).map_err(|error| Failed {
                error,
                generation: false,
            })?;
        }
        if let Some(next) = next {
            if rest.iter().any(|batch| !batch.messages.is_empty()) {
                flush(&producer, self.timeout).map_err(|e| failed("produce the records of", &e))?;
            }
            next.open_gate(epoch + 1);
        }
        commit_transaction(&producer, self.timeout).map_err(|e| failed("commit", &e))?;
        tracing::debug!(
            name = %self.name,
            epoch,
            ?flushed,
            ?offsets_added,
            committed = ?started.elapsed(),
            "committed a transaction"
        );
        producer
            .context()
            .check(&self.name)
            .map_err(|error| Failed {
                error,
                generation: false,
            })
    }

    /// Records of `epoch` may go out ([`Feed::open_gate`]).
    fn open_gate(&self, epoch: Epoch) {
        lock(&self.feed).open_gate(epoch);
        self.changed.notify_all();
    }

    /// Aborts what the transaction holds and starts a fresh producer.
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

/// Buffers a writer's records and hands them to the process's transaction of
/// their epoch, a batch at a time as they come and the rest at the barrier
/// (and at the end, for the final epoch), with the topic of those that name
/// none: no record carries a copy of it.
pub(crate) struct Staging {
    /// Each lane of the writer's tier, and the run the writer belongs to
    /// there (`Feed::join`).
    lanes: Vec<(Arc<Transactions>, u64)>,
    topic: Option<String>,
    epoch: Epoch,
    buffer: Vec<KafkaMessage>,
    /// Bytes of the values in `buffer`.
    bytes: usize,
}

impl Staging {
    pub(crate) fn new(lanes: &Lanes, topic: Option<String>, first_epoch: Epoch) -> Self {
        let lanes = (lanes.0.iter())
            .map(|lane| {
                let run = lock(&lane.inner.feed).join(first_epoch);
                (lane.clone(), run)
            })
            .collect();
        Self {
            lanes,
            topic,
            epoch: first_epoch,
            buffer: Vec::new(),
            bytes: 0,
        }
    }

    /// The topic of the records that name none.
    pub(crate) fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    #[inline]
    pub(crate) fn push(&mut self, message: KafkaMessage) {
        self.bytes += message.value.as_ref().map_or(0, |value| value.len());
        self.buffer.push(message);
        if self.buffer.len() >= HAND_OVER_MESSAGES || self.bytes >= HAND_OVER_BYTES {
            self.stage(self.epoch);
        }
    }

    /// Hands what the writer holds to its transaction now, as a writer
    /// read before its transaction commits does whenever its input paused.
    pub(crate) fn hand_over(&mut self) {
        self.stage(self.epoch);
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
        if self.buffer.is_empty() {
            return;
        }
        let batch = Batch {
            topic: self.topic.clone(),
            messages: std::mem::take(&mut self.buffer),
        };
        self.bytes = 0;
        let (transactions, run) = &self.lanes[lane_of(epoch, self.lanes.len())];
        let (inner, run) = (&transactions.inner, *run);
        let mut feed = lock(&inner.feed);
        if feed.produce_now(run, epoch) {
            drop(feed);
            let batch = Arc::new(batch);
            let producer = lock(&inner.producer).clone();
            let result = inner.produce(&producer, &batch);
            lock(&inner.feed).produced_by_writer(run, batch, result);
            inner.changed.notify_all();
        } else if feed.stage(run, epoch, batch) {
            drop(feed);
            inner.changed.notify_all();
        }
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
    for tier in [Tier::Sourced, Tier::Repartitioned] {
        for lane in 0..tier.lanes() {
            let id = settings.transactional_id_of(instance, tier, lane);
            initialised(
                &producer_config(settings, &id),
                settings.operation_timeout,
                &name,
            )
            .map(drop)?;
        }
    }
    Ok(())
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
        // As the sink's producers: one request in flight batches what comes
        // meanwhile. With librdkafka's 5, a cluster of one process at
        // 10,000 records/s (at least once, batch 5 min) gave p50 24-37 ms
        // against 19-27 with one, in four pairs run in turn; throughput the
        // same (benches/cluster_throughput, 2026-12-07).
        .set("max.in.flight.requests.per.connection", "1")
        // As the sink's producers: only failures need a report.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(value: &str) -> Batch {
        Batch {
            topic: None,
            messages: vec![KafkaMessage::new(value.to_owned())],
        }
    }

    fn value(batch: &Batch) -> String {
        let value = batch.messages[0].value.as_ref().unwrap();
        String::from_utf8(value.to_vec()).unwrap()
    }

    /// Runs the feeder's steps until it waits, producing every batch it
    /// takes; the values produced, and whether each began a transaction.
    fn feed_all(feed: &mut Feed) -> Vec<(String, bool)> {
        let mut produced = Vec::new();
        loop {
            match feed.step() {
                Step::Wait => return produced,
                Step::Renew => feed.renewed(Ok(())),
                Step::Produce { run, batch, begin } => {
                    produced.push((value(&batch), begin));
                    feed.produced(run, batch, Ok(()));
                }
            }
        }
    }

    #[test]
    fn the_next_epochs_batches_are_produced_as_they_come_and_later_ones_wait_for_its_commit() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        assert!(feed.stage(run, 1, batch("a")));
        assert!(
            !feed.stage(run, 2, batch("c")),
            "epoch 2 waits for 1's commit"
        );
        assert_eq!(feed_all(&mut feed), [("a".to_owned(), true)]);
        assert!(feed.stage(run, 1, batch("b")));
        assert_eq!(feed_all(&mut feed), [("b".to_owned(), false)]);

        let taken = feed.take_for_commit(1);
        assert!(taken.open);
        let produced: Vec<String> = taken.produced.iter().map(|b| value(b)).collect();
        assert_eq!(produced, ["a", "b"]);
        assert!(taken.rest.is_empty(), "epoch 2 is not this commit's");
        assert!(
            matches!(feed.step(), Step::Wait),
            "a commit holds the producer"
        );
        feed.committed(taken.run, 1, true);
        assert_eq!(feed_all(&mut feed), [("c".to_owned(), true)]);
    }

    #[test]
    fn a_writer_produces_itself_once_its_epochs_transaction_is_begun_and_nothing_waits() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        assert!(
            !feed.produce_now(run, 1),
            "the feeder begins the transaction"
        );
        feed.stage(run, 1, batch("a"));
        assert!(!feed.produce_now(run, 1), "'a' waits: it goes first");
        feed_all(&mut feed);
        assert!(!feed.produce_now(run, 2), "epoch 2 waits for 1's commit");
        assert!(feed.produce_now(run, 1));
        assert!(!feed.produce_now(run + 1, 1), "a discarded run's writer");
        assert!(
            matches!(feed.step(), Step::Wait),
            "a writer holds the producer"
        );
        feed.stage(run, 1, batch("c"));
        assert!(!feed.produce_now(run, 1), "'c' waits: it goes first");
        feed.produced_by_writer(run, Arc::new(batch("b")), Ok(()));
        assert_eq!(feed_all(&mut feed), [("c".to_owned(), false)]);

        let taken = feed.take_for_commit(1);
        let produced: Vec<String> = taken.produced.iter().map(|b| value(b)).collect();
        assert_eq!(produced, ["a", "b", "c"], "kept until the commit");
        assert!(!feed.produce_now(run, 1), "a commit holds the producer");
    }

    #[test]
    fn a_fenced_discard_renews_the_producer_with_no_transaction_open() {
        let mut feed = Feed::default();
        feed.join(1);
        feed.discard();
        assert!(matches!(feed.step(), Step::Wait), "nothing to abort");
        feed.discard_fenced();
        assert!(matches!(feed.step(), Step::Renew));
        feed.renewed(Ok(()));
        assert!(matches!(feed.step(), Step::Wait));
    }

    #[test]
    fn a_discard_while_a_writer_produces_renews_the_producer_once_it_is_done() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        feed.stage(run, 1, batch("a"));
        feed_all(&mut feed);
        assert!(feed.produce_now(run, 1));
        feed.discard();
        assert!(
            matches!(feed.step(), Step::Wait),
            "a writer holds the producer"
        );
        feed.produced_by_writer(run, Arc::new(batch("b")), Ok(()));
        assert!(matches!(feed.step(), Step::Renew));
    }

    #[test]
    fn a_commit_takes_what_the_feeder_has_not_produced_in_epoch_order() {
        let mut feed = Feed::default();
        let run = feed.join(5);
        feed.stage(run, 5, batch("a"));
        feed.stage(run, 6, batch("c"));
        feed.stage(run, 5, batch("b"));
        // The epoch 5 commit is the run's first, and epoch 5's barrier
        // came before the feeder woke: it produces everything itself.
        let taken = feed.take_for_commit(6);
        assert!(!taken.open && taken.produced.is_empty());
        let rest: Vec<String> = taken.rest.iter().map(|b| value(b)).collect();
        assert_eq!(rest, ["a", "b", "c"]);
        feed.committed(taken.run, 6, true);
        assert!(!feed.stage(run, 6, batch("late")), "epoch 7 is next");
        assert!(feed.stage(run, 7, batch("d")));
    }

    #[test]
    fn a_discarded_runs_batches_are_dropped_and_what_it_produced_is_aborted_first() {
        let mut feed = Feed::default();
        let old = feed.join(1);
        feed.stage(old, 1, batch("a"));
        feed_all(&mut feed);
        feed.stage(old, 1, batch("b"));
        feed.discard();
        assert!(
            !feed.stage(old, 1, batch("late")),
            "a discarded run's writer"
        );
        assert!(matches!(feed.step(), Step::Renew));
        feed.renewed(Ok(()));
        let new = feed.join(1);
        assert_ne!(new, old);
        feed.stage(new, 1, batch("x"));
        assert_eq!(feed_all(&mut feed), [("x".to_owned(), true)]);
        let taken = feed.take_for_commit(1);
        assert!(!taken.stale);
        let produced: Vec<String> = taken.produced.iter().map(|b| value(b)).collect();
        assert_eq!(produced, ["x"]);
    }

    #[test]
    fn a_batch_produced_while_its_run_was_discarded_leaves_the_transaction_to_abort() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        feed.stage(run, 1, batch("a"));
        let Step::Produce { run, batch, .. } = feed.step() else {
            panic!("the feeder produces epoch 1");
        };
        feed.discard();
        feed.produced(run, batch, Ok(()));
        assert!(matches!(feed.step(), Step::Renew));
    }

    #[test]
    fn a_commit_after_a_discard_aborts_first_and_a_failed_one_stops_the_feeder() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        feed.stage(run, 1, batch("a"));
        feed_all(&mut feed);
        feed.discard();
        let run = feed.join(1);
        feed.stage(run, 1, batch("b"));
        // The commit came before the feeder could renew the producer.
        let taken = feed.take_for_commit(1);
        assert!(taken.stale && !taken.open);
        let rest: Vec<String> = taken.rest.iter().map(|b| value(b)).collect();
        assert_eq!(rest, ["b"]);
        feed.committed(taken.run, 1, false);
        feed.stage(run, 2, batch("c"));
        assert!(
            matches!(feed.step(), Step::Wait),
            "after a failed commit, the next epoch is not known"
        );
    }

    #[test]
    fn after_a_runs_last_commit_nothing_more_of_it_is_produced_until_it_is_discarded() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        feed.stage(run, 1, batch("a"));
        feed_all(&mut feed);
        let taken = feed.take_for_commit(1);
        feed.committed(taken.run, 1, false);
        assert!(!feed.stage(run, 2, batch("b")), "epoch 2 waits");
        assert!(!feed.produce_now(run, 2), "no writer produces epoch 2");
        assert!(feed_all(&mut feed).is_empty(), "no transaction begins");
        feed.discard();
        assert!(matches!(feed.step(), Step::Wait), "nothing open to abort");
        let next = feed.join(2);
        feed.stage(next, 2, batch("c"));
        assert_eq!(feed_all(&mut feed), [("c".to_owned(), true)]);
    }

    #[test]
    fn a_lane_takes_every_other_epoch_each_once_the_lane_before_sealed() {
        let mut odd = Feed {
            held: false,
            ..Feed::new(1, 2)
        };
        let run = odd.join(4);
        assert!(!odd.stage(run, 5, batch("a")), "epoch 4 is not sealed");
        assert!(!odd.produce_now(run, 5));
        assert!(feed_all(&mut odd).is_empty());
        odd.open_gate(5);
        assert_eq!(feed_all(&mut odd), [("a".to_owned(), true)]);
        assert!(odd.produce_now(run, 5), "the gate stays open");
        odd.produced_by_writer(run, Arc::new(batch("b")), Ok(()));
        let taken = odd.take_for_commit(5);
        odd.committed(taken.run, 5, true);
        assert!(!odd.stage(run, 7, batch("c")), "epoch 6 is not sealed");
        odd.open_gate(7);
        assert_eq!(feed_all(&mut odd), [("c".to_owned(), true)]);
    }

    #[test]
    fn a_run_begins_in_the_lane_of_its_first_epoch() {
        let mut even = Feed::new(0, 2);
        let mut odd = Feed::new(1, 2);
        let (first, second) = (even.join(6), odd.join(6));
        assert!(even.opened(6) && !odd.opened(7));
        assert_eq!((even.next, odd.next), (Some(6), Some(7)));
        even.discard();
        odd.discard();
        let (first_again, second_again) = (even.join(3), odd.join(3));
        assert!((first_again, second_again) != (first, second));
        assert_eq!((even.next, odd.next), (Some(4), Some(3)));
        assert!(
            odd.opened(3) && !even.opened(4),
            "the gate of a run discarded is gone"
        );
        assert!(Feed::default().opened(9), "a tier of one lane has no gate");
    }

    #[test]
    fn no_transaction_begins_until_the_process_is_released() {
        let mut feed = Feed {
            held: true,
            ..Feed::default()
        };
        let run = feed.join(1);
        assert!(feed.stage(run, 1, batch("a")));
        assert!(feed_all(&mut feed).is_empty(), "held, the feeder waits");
        feed.held = false;
        assert_eq!(feed_all(&mut feed), [("a".to_owned(), true)]);
    }

    #[test]
    fn a_batch_the_feeder_could_not_produce_fails_the_commit() {
        let mut feed = Feed::default();
        let run = feed.join(1);
        feed.stage(run, 1, batch("a"));
        feed.stage(run, 1, batch("b"));
        let Step::Produce { run, batch, .. } = feed.step() else {
            panic!("the feeder produces epoch 1");
        };
        feed.produced(run, batch, Err(RtflowError::sink("s", "too large")));
        assert!(matches!(feed.step(), Step::Wait), "it stops producing");
        let taken = feed.take_for_commit(1);
        assert!(taken.failed.is_some());
    }
}
