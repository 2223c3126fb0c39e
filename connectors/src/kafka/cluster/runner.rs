//! The process's part of a clustered query: its membership of the groups and
//! the runs of its dataflow.
//!
//! A run is a query of this process over the partitions it owns. The groups'
//! member consumers never read records (their partitions stay paused); they
//! only hold the membership, each polled by a thread of its own, so that one
//! group's rebalance goes on while the other's callback waits. When a group
//! takes partitions away, the rebalance callback has the run hand them over
//! at its next barrier ([`StreamingQuery::hand_over`]) and waits until that
//! checkpoint committed, so the next owner resumes exactly where this one
//! committed; the run goes on with the rest. Partitions lost (the group
//! dropped the process when its session expired) may already run
//! elsewhere: their run is abandoned with no final checkpoint, and the next
//! owner redoes what it did since its last commit. When partitions arrive,
//! once the groups settle, the run takes them on at a barrier too, their
//! offsets and state read while it goes on. A run restarts only when it
//! cannot: the process's first, or one whose handover failed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, TopicPartitionList};
use rtflow_runtime::cluster::{ClusterRecovery, Handover};
use rtflow_runtime::shutdown::{StopRequest, Stoppable};
use rtflow_runtime::{
    guard, Dataflow, Epoch, QueryConfig, Result, RtflowError, StreamingQuery,
    StreamingQueryProgress,
};

use super::compacted;
use super::departures::{self, members, Departures};
use super::link::{KafkaLink, Mode, Owned, RestoreStats, TopicPartition};
use super::retries::{Retries, Verdict};
use super::second_tier::SecondTier;
use super::settle::{must_restart, Settling};
use super::shape::{instance_of, list_group, Shape};
use super::standby::{placement, Standby};
use super::transactions::{fence, Tiers};
use super::upstream::Upstream;
use super::{lock, ClusterSettings};

/// The threads of a process's part, as errors name them.
const RUNNER_THREAD: &str = "rtflow-cluster";
const MEMBER_THREAD: &str = "rtflow-member";

/// A process's handle on a clustered query.
pub struct ClusteredQuery {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<Result<()>>>>,
    /// How the process's part ended, once it did.
    ended: Mutex<Option<Result<()>>>,
}

struct Shared {
    settings: Arc<ClusterSettings>,
    transactions: Arc<Tiers>,
    /// What the process knows of the transactions its readers read from,
    /// kept from run to run.
    upstream: Arc<Upstream>,
    /// What the latest run restored.
    last_restore: Arc<Mutex<Option<RestoreStats>>>,
    /// The partitions the group assigned to the process.
    assignment: Mutex<BTreeSet<TopicPartition>>,
    /// Bumped by every change of the assignment.
    generation: AtomicU64,
    /// The groups that rebalanced since the runner last acted.
    settling: Mutex<Settling>,
    run: Mutex<Option<Run>>,
    /// Held while a run starts or stops: a revocation that arrives meanwhile
    /// waits until the run it must stop exists, or has committed its end.
    transition: Mutex<()>,
    runs: AtomicU64,
    /// Asked by `ClusteredQuery::stop`.
    stop: AtomicBool,
    /// Set once the last run committed its end: the members leave.
    leave: AtomicBool,
    /// A member's thread failed: the process's part of the query ends with it.
    member_failed: Mutex<Option<RtflowError>>,
    /// The groups the process is a member of, and a client that lists their
    /// members, to learn who left without a word.
    groups: Vec<String>,
    /// How many repartitions the dataflow has.
    stages: usize,
    lister: BaseConsumer,
    /// The dataflow's shape, checked against the members again before the
    /// first run.
    shape: Shape,
    departures: Mutex<Departures>,
    /// Whether the process wrote its name among the query's instances and
    /// read the others' (`departures::announce`, `departures::recall`): once,
    /// at its first rebalance.
    recalled: AtomicBool,
    /// The process's standby replicas, if it keeps any.
    standby: Option<Standby>,
}

/// A run of the process's part. Cloned out of [`Shared::run`] for a
/// handover, so that the process's partitions and progress stay readable
/// while it waits for its commit.
#[derive(Clone)]
struct Run {
    query: Arc<StreamingQuery>,
    owned: BTreeSet<TopicPartition>,
    link: Arc<KafkaLink>,
}

impl Shared {
    /// Hands `run` over to `owned` at its next barrier, with `adopted` for
    /// the partitions it takes on; the epoch it did at, once committed.
    /// Called within the transition, which keeps the run from stopping or
    /// starting meanwhile.
    fn hand_over(
        &self,
        run: &Run,
        owned: BTreeSet<TopicPartition>,
        adopted: ClusterRecovery,
    ) -> Result<Epoch> {
        let after = Arc::new(Owned::new(self.settings.clone(), owned.clone()));
        let handover = Handover {
            membership: after.clone(),
            adopted: adopted.state,
            offsets: adopted.offsets,
        };
        let epoch = run
            .query
            .hand_over(handover, self.settings.operation_timeout)?;
        run.link.settle()?;
        run.link.hand_over(after);
        // A run that failed since is the runner's to take away, not to
        // bring back.
        if let Some(current) = lock(&self.run)
            .as_mut()
            .filter(|current| Arc::ptr_eq(&current.query, &run.query))
        {
            current.owned = owned;
        }
        Ok(epoch)
    }

    /// Stops the run, if one is running, with a final checkpoint.
    fn stop_run(&self) -> Result<()> {
        let _transition = lock(&self.transition);
        self.stop_run_within_transition()
    }

    /// A run that failed (before or in its final checkpoint) returns its
    /// error, once what it did since its last commit is dropped: its
    /// transaction, open with that epoch's records, must not commit with the
    /// next run, which does the same work again.
    fn stop_run_within_transition(&self) -> Result<()> {
        let Some(run) = lock(&self.run).take() else {
            return Ok(());
        };
        let stopped = run.query.stop();
        let settled = run.link.settle();
        stopped?;
        (run.query.exception().map_or(settled, Err)).inspect_err(|_| self.transactions.discard())
    }

    /// Lets the `revoked` partitions go: they leave the assignment and the
    /// run lets them go, in one transition, so that no run starts over them
    /// in between. The run hands them over at its next barrier and goes on
    /// with the rest; it stops with a final checkpoint if it keeps none.
    /// Either commits before this returns, so that their next owner resumes
    /// where this one ended. Partitions `lost` are different: the run ends
    /// at once, what it did since its last commit is dropped, and their next
    /// owner redoes it.
    fn let_go(&self, revoked: &TopicPartitionList, lost: bool) -> Result<()> {
        let _transition = lock(&self.transition);
        let mut assignment = lock(&self.assignment);
        for element in revoked.elements() {
            assignment.remove(&(element.topic().to_owned(), element.partition()));
        }
        let owned = self.settings.co_partitioned(&assignment, self.stages);
        drop(assignment);
        if !lost {
            if self.hand_over_within_transition(owned) {
                return Ok(());
            }
            return self.stop_run_within_transition();
        }
        // Taken out of the lock first: abandoning waits for the run's
        // threads, and the process's partitions stay readable meanwhile.
        let run = lock(&self.run).take();
        if let Some(run) = run {
            run.query.abandon();
            // What it drops is what its second transaction did not commit.
            let _ = run.link.settle();
        }
        self.transactions.discard_fenced();
        Ok(())
    }

    /// Hands the run's partitions over to `owned`, a part of them, at its
    /// next barrier, and waits until that checkpoint committed: the last to
    /// carry what it did with the others. Returns whether it did; a run that
    /// would keep nothing, or failed to, is for the caller to stop.
    fn hand_over_within_transition(&self, owned: BTreeSet<TopicPartition>) -> bool {
        let Some(run) = lock(&self.run).clone() else {
            return false;
        };
        if owned.is_empty() || !owned.is_subset(&run.owned) {
            return false;
        }
        if owned == run.owned {
            return true;
        }
        let handing = Instant::now();
        let kept = owned.len();
        match self.hand_over(&run, owned, ClusterRecovery::default()) {
            Ok(epoch) => {
                tracing::info!(epoch, kept, took = ?handing.elapsed(), "partitions handed over inside the run");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "the run could not hand partitions over; it stops instead");
                false
            }
        }
    }

    /// Hands the run the partitions the process owns and it does not hold
    /// yet, at its next barrier: their committed offsets and keyed state are
    /// read first, while it runs on. Returns whether it did; a run that holds
    /// partitions the process no longer owns, or could not take the others
    /// on, is for the caller to restart.
    fn adopt(&self) -> bool {
        let _transition = lock(&self.transition);
        // Read within the transition: a revocation since the caller looked
        // has handed partitions over already, and they must not come back.
        let owned = &self
            .settings
            .co_partitioned(&lock(&self.assignment), self.stages);
        let Some(run) = lock(&self.run).clone() else {
            return false;
        };
        if !run.owned.is_subset(owned) {
            return false;
        }
        let adopting = Instant::now();
        let added: Vec<TopicPartition> = owned.difference(&run.owned).cloned().collect();
        let (recovery, restored) = match run.link.recover_partitions(&added) {
            Ok(recovered) => recovered,
            Err(error) => {
                tracing::warn!(%error, "could not restore the partitions adopted; the run restarts");
                return false;
            }
        };
        // What a restore read is the keyed state's: a share that grows by
        // input partitions alone restores none.
        if added
            .iter()
            .any(|(topic, _)| self.settings.is_repartition_topic(topic))
        {
            run.link.restored(restored);
        }
        match self.hand_over(&run, owned.clone(), recovery) {
            Ok(epoch) => {
                tracing::info!(epoch, adopted = added.len(), restore = ?restored.duration, took = ?adopting.elapsed(), "partitions adopted inside the run");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "the run could not adopt partitions; it restarts");
                false
            }
        }
    }

    /// The partitions of `topics` the process holds, as the groups'
    /// assignments added them.
    fn assigned_in(&self, topics: &[String]) -> TopicPartitionList {
        let mut held = TopicPartitionList::new();
        for (topic, partition) in lock(&self.assignment).iter() {
            if topics.contains(topic) {
                held.add_partition(topic, *partition);
            }
        }
        held
    }

    fn changed(&self, group: &str) {
        lock(&self.settling).heard(group, Instant::now());
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// A newcomer's first assignment in `group` was empty: the runner waits
    /// for the group's second round before it acts.
    fn awaits_second_round(&self, group: &str) {
        lock(&self.settling).awaits_second_round(group, Instant::now());
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// After a rebalance, with the process to own `owned`: fences the
    /// processes that left the groups since the last run started without
    /// leaving cleanly, and tells the standby replicas what to keep. A
    /// failure only costs time (open transactions of the processes gone then
    /// time out; copies stay as they are), so it is logged, not raised.
    fn after_rebalance(&self, owned: &BTreeSet<TopicPartition>) {
        let settings = &self.settings;
        // Once a member, so that a process that reads this name also finds
        // this process among the members unless it died since; and before
        // the first transaction begins, so that a process that dies with
        // one open has a name for the next to fence.
        if !self.recalled.swap(true, Ordering::SeqCst) {
            let announcing = Instant::now();
            match departures::announce(settings) {
                Ok(()) => {
                    tracing::info!(took = ?announcing.elapsed(), "the process's name is written among the query's instances")
                }
                Err(error) => {
                    tracing::warn!(%error, "could not write the process's name among the query's instances")
                }
            }
            self.transactions.release();
            match departures::recall(settings) {
                Ok(instances) => lock(&self.departures).recall(instances),
                Err(error) => {
                    tracing::warn!(%error, "could not read which processes ran the query before")
                }
            }
        }
        let members = match members(
            settings,
            &self.lister,
            &self.groups,
            settings.operation_timeout,
        ) {
            Ok(members) => members,
            Err(error) => {
                tracing::warn!(%error, "could not learn who left the cluster");
                return;
            }
        };
        if let Some(standby) = &self.standby {
            let first = settings.repartition_topic(0);
            let owns = owned
                .iter()
                .filter(|(topic, _)| *topic == first)
                .map(|(_, partition)| *partition)
                .collect();
            let mut racks = members.racks.clone();
            if let Some(rack) = &settings.rack {
                racks.insert(settings.instance.clone(), rack.clone());
            }
            let keep = placement(
                settings.repartition_partitions,
                &members.live,
                &settings.instance,
                settings.standby_replicas,
                &owns,
                &members.owners,
                &racks,
            );
            tracing::info!(?keep, owners = ?members.owners, ?racks, "standby replicas");
            standby.keep(keep);
        }
        self.fence_departed(members.live);
    }

    fn fence_departed(&self, live: BTreeSet<String>) {
        let settings = &self.settings;
        let gone = lock(&self.departures).departed(live, &settings.instance);
        for instance in gone {
            let fencing = Instant::now();
            match fence(settings, &instance) {
                Ok(()) => {
                    tracing::info!(%instance, took = ?fencing.elapsed(), "fenced a process that left the cluster");
                    if let Err(error) = departures::forget(settings, &instance) {
                        tracing::warn!(%instance, %error, "could not delete a fenced process from the instances");
                    }
                }
                Err(error) => {
                    tracing::warn!(%instance, %error, "could not fence a process that left the cluster")
                }
            }
        }
    }
}

impl ClusteredQuery {
    /// The partitions this process runs now, as `topic-partition`.
    pub fn partitions(&self) -> Vec<String> {
        lock(&self.shared.run)
            .iter()
            .flat_map(|run| &run.owned)
            .map(|(topic, partition)| format!("{topic}-{partition}"))
            .collect()
    }

    /// How many runs the process started: one, then one more for every
    /// rebalance that moved partitions to or from it.
    pub fn runs(&self) -> u64 {
        self.shared.runs.load(Ordering::SeqCst)
    }

    /// What the latest run restored from the changelog, and how long it took.
    pub fn last_restore(&self) -> Option<RestoreStats> {
        *lock(&self.shared.last_restore)
    }

    /// The latest progress report of the current run.
    pub fn last_progress(&self) -> Option<StreamingQueryProgress> {
        lock(&self.shared.run)
            .as_ref()
            .and_then(|run| run.query.last_progress())
    }

    /// Whether the process still runs its part of the query.
    pub fn is_active(&self) -> bool {
        lock(&self.thread)
            .as_ref()
            .is_some_and(|thread| !thread.is_finished())
    }

    /// Waits until the process's part of the query ends, or at most
    /// `timeout`. Returns whether it ended, or the error it failed with;
    /// as [`StreamingQuery::await_termination`].
    pub fn await_termination(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        while self.is_active() {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.join().map(|()| true)
    }

    /// Stops the current run with a final checkpoint and leaves the group;
    /// the other processes take its partitions over. A run that failed as
    /// the process stopped starts over once from its last commit, to stop
    /// with a final checkpoint of its own. If that fails too, `stop` returns
    /// the error: the process's partitions resume from its last commit.
    pub fn stop(&self) -> Result<()> {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.join()
    }

    /// The error the process's part ended with, if it failed.
    pub fn exception(&self) -> Option<RtflowError> {
        if !self.is_active() {
            // Ended on its own: its outcome is the runner thread's.
            let _ = self.join();
        }
        lock(&self.ended).clone().and_then(Result::err)
    }

    /// Waits for the runner thread; its outcome, kept for every later call.
    fn join(&self) -> Result<()> {
        let mut ended = lock(&self.ended);
        if let Some(thread) = lock(&self.thread).take() {
            let outcome = thread
                .join()
                .unwrap_or_else(|panic| Err(guard::internal(RUNNER_THREAD, &*panic)));
            *ended = Some(outcome);
        }
        ended.clone().unwrap_or(Ok(()))
    }
}

impl Stoppable for ClusteredQuery {
    /// Asks the process's part to stop as [`stop`](Self::stop) does: with a
    /// final checkpoint, leaving the groups. The request holds the process's
    /// part weakly: it keeps nothing of an ended one alive.
    fn stop_request(&self) -> StopRequest {
        let shared = Arc::downgrade(&self.shared);
        StopRequest::new(move || {
            if let Some(shared) = shared.upgrade() {
                shared.stop.store(true, Ordering::SeqCst);
            }
        })
    }
}

impl Drop for ClusteredQuery {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The group member's callbacks: they keep the assignment, and stop the run
/// before partitions are let go.
struct Member {
    shared: Arc<Shared>,
    group: String,
    topics: Vec<String>,
    /// Whether the member has been through a rebalance yet: set once its
    /// first assignment's callback ends.
    rebalanced: AtomicBool,
}

impl ClientContext for Member {}

impl Member {
    /// Hands the group's current generation to the commits. A member whose
    /// assignment was lost (its session expired) hands none: the broker takes
    /// offsets committed without a generation from anyone, and the lost
    /// partitions may already run elsewhere.
    fn publish_generation(&self, consumer: &BaseConsumer<Self>) {
        let metadata = if consumer.assignment_lost() {
            None
        } else {
            consumer.group_metadata()
        };
        self.shared.transactions.set_group(&self.group, metadata);
    }

    /// Whether `assigned` is the member's first assignment, and empty: a
    /// newcomer's, whose partitions come in the rebalance's second round.
    fn first_and_empty(&self, assigned: &TopicPartitionList) -> bool {
        !self.rebalanced.load(Ordering::SeqCst) && assigned.count() == 0
    }

    /// A newcomer's first assignment is empty: the cooperative protocol
    /// takes its partitions from the others first and hands them over in a
    /// second round. librdkafka lets a member send JoinGroup at most once a
    /// second, so the newcomer would join that round about a second after
    /// its first; every key moving to it waited for that. Subscribing again
    /// joins it as soon as this round ends.
    fn join_second_round(&self, consumer: &BaseConsumer<Self>) {
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        if let Err(error) = consumer.subscribe(&topics) {
            tracing::warn!(%error, group = %self.group, "could not ask for the second round of the rebalance; it comes within a second");
        }
    }
}

impl ConsumerContext for Member {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(assigned) = rebalance {
            if self.first_and_empty(assigned) {
                self.join_second_round(consumer);
            }
        }
        if let Rebalance::Revoke(revoked) = rebalance {
            self.publish_generation(consumer);
            let stopping = Instant::now();
            // Lost, the group dropped this process and may have handed its
            // partitions on already: a final checkpoint now would commit
            // beside their next owner. Revoked, the final checkpoint commits
            // their offsets: only then may the next owner read them.
            let lost = consumer.assignment_lost();
            if let Err(error) = self.shared.let_go(revoked, lost) {
                tracing::warn!(%error, "the run did not stop cleanly; its partitions resume from their last commit");
            }
            if lost {
                tracing::warn!(group = %self.group, lost = revoked.count(), took = ?stopping.elapsed(), "partitions lost: the run ended without a final checkpoint");
            } else {
                tracing::info!(group = %self.group, revoked = revoked.count(), took = ?stopping.elapsed(), "partitions revoked");
            }
            self.shared.changed(&self.group);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(assigned) => {
                // The member only holds the membership; the run's readers read.
                if let Err(error) = consumer.pause(assigned) {
                    tracing::warn!(%error, "could not pause the member's partitions");
                }
                let mut assignment = lock(&self.shared.assignment);
                for element in assigned.elements() {
                    assignment.insert((element.topic().to_owned(), element.partition()));
                }
                tracing::info!(group = %self.group, assigned = assigned.count(), "partitions assigned");
                let first_and_empty = self.first_and_empty(assigned);
                self.rebalanced.store(true, Ordering::SeqCst);
                if first_and_empty {
                    self.shared.awaits_second_round(&self.group);
                } else {
                    self.shared.changed(&self.group);
                }
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(error) => tracing::warn!(%error, "rebalance failed"),
        }
        self.publish_generation(consumer);
    }
}

/// Probes the dataflow, checks it against the group's, joins the group and
/// hands the process's part to a thread of its own.
pub(super) fn start<F>(
    settings: Arc<ClusterSettings>,
    config: QueryConfig,
    build: F,
) -> Result<ClusteredQuery>
where
    F: Fn(&Dataflow) -> Result<()> + Send + 'static,
{
    let lister: BaseConsumer = settings.client_config().create().map_err(|e| {
        RtflowError::InvalidConfiguration(format!("could not create the group lister: {e}"))
    })?;
    let probe = Arc::new(KafkaLink {
        order: Arc::default(),
        settings: settings.clone(),
        mode: Mode::Probe(Mutex::default()),
    });
    let flow = Dataflow::clustered(config.name.clone(), probe.clone());
    let built_by = format!("clustered query '{}'", config.name);
    guard::building(&built_by, || build(&flow))?;
    let shape = Shape::new(flow.shape(&config)?);
    let topics = probe.probed_topics();
    shape.check_members(&settings, &lister)?;
    let client_id = shape.client_id(&settings, &uuid::Uuid::new_v4().simple().to_string());
    publish_aside(&settings, shape.clone());
    let stages = topics
        .iter()
        .filter(|topic| settings.is_repartition_topic(topic))
        .count();
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Later stages' partitions follow stage 0's (`co_partitioned`): the
    // group balances stage 0 alone.
    for topic in topics
        .into_iter()
        .filter(|topic| settings.repartition_stage(topic).unwrap_or(0) == 0)
    {
        groups
            .entry(settings.group_of(&topic))
            .or_default()
            .push(topic);
    }
    let shared = Arc::new(Shared {
        transactions: Arc::new(Tiers::open(&settings)?),
        upstream: Arc::new(Upstream::new(settings.clone())),
        last_restore: Arc::default(),
        settings: settings.clone(),
        assignment: Mutex::default(),
        generation: AtomicU64::new(0),
        settling: Mutex::default(),
        run: Mutex::default(),
        transition: Mutex::default(),
        runs: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        leave: AtomicBool::new(false),
        member_failed: Mutex::default(),
        groups: groups.keys().cloned().collect(),
        stages,
        lister,
        shape,
        departures: Mutex::default(),
        recalled: AtomicBool::new(false),
        standby: (settings.standby_replicas > 0)
            .then(|| Standby::start(settings.clone()))
            .transpose()?,
    });
    let members = groups
        .into_iter()
        .map(|(group, topics)| {
            let member = join(&shared, &client_id, &group, &topics)?;
            Ok(Membership {
                member,
                client_id: client_id.clone(),
                group,
                topics,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    tracing::info!(query = %config.name, instance = %settings.instance, "joined the cluster");
    let spawn_failed = |e: std::io::Error| {
        RtflowError::InvalidConfiguration(format!("could not start the cluster runner: {e}"))
    };
    let pollers = members
        .into_iter()
        .map(|membership| {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("rtflow-member".into())
                .spawn(move || {
                    let held =
                        guard::engine(MEMBER_THREAD, || hold_membership(&shared, membership));
                    if let Err(error) = held {
                        lock(&shared.member_failed).get_or_insert(error);
                    }
                })
                .map_err(spawn_failed)
        })
        .collect::<Result<Vec<_>>>()?;
    let runner = shared.clone();
    let thread = std::thread::Builder::new()
        .name("rtflow-cluster".into())
        .spawn(move || {
            let result = guard::engine(RUNNER_THREAD, || run(&runner, &config, &build));
            // The run ends with a final commit while the process is still a
            // member; leaving the groups then revokes what is left.
            let stopped = runner.stop_run();
            if let Some(standby) = &runner.standby {
                standby.stop();
            }
            runner.leave.store(true, Ordering::SeqCst);
            for poller in pollers {
                let _ = poller.join();
            }
            let result = result.and(stopped);
            if result.is_ok() {
                // Its last commit left nothing open: no one need fence it.
                if let Err(error) = departures::forget(&runner.settings, &runner.settings.instance)
                {
                    tracing::warn!(%error, "could not delete this process from the instances");
                }
            }
            result
        })
        .map_err(spawn_failed)?;
    Ok(ClusteredQuery {
        shared,
        thread: Mutex::new(Some(thread)),
        ended: Mutex::default(),
    })
}

/// Publishes the process's shape on a thread of its own. Only a process
/// refused for another shape reads it, to name the difference, and a first
/// start waits a third of a second for it (a new topic, a new leader):
/// nothing of the query's waits on it, and a failure is logged. The
/// instances topic is made there too, for the same reason: this process
/// writes its name in it once it is a member (`departures::announce`).
fn publish_aside(settings: &Arc<ClusterSettings>, shape: Shape) {
    let settings = settings.clone();
    let spawned = std::thread::Builder::new()
        .name("rtflow-shape".into())
        .spawn(move || {
            if let Err(error) = shape.publish(&settings) {
                tracing::warn!(%error, "could not publish the dataflow's shape: a process refused for another one is told less of the difference");
            }
            if let Err(error) = compacted::create(&settings, &settings.instances_topic()) {
                tracing::warn!(%error, "could not make the instances topic");
            }
        });
    if let Err(error) = spawned {
        tracing::warn!(%error, "could not publish the dataflow's shape");
    }
}

/// A member of `group`, subscribed to `topics`, named `client_id`.
fn join(
    shared: &Arc<Shared>,
    client_id: &str,
    group: &str,
    topics: &[String],
) -> Result<BaseConsumer<Member>> {
    let settings = &shared.settings;
    let mut config = settings.committed_reader(group);
    config
        .set("client.id", client_id)
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set(
            "session.timeout.ms",
            settings.session_timeout.as_millis().to_string(),
        )
        // A member learns of a rebalance from its heartbeat's answer.
        .set("heartbeat.interval.ms", "100")
        .set("queued.max.messages.kbytes", "64");
    if settings.static_member {
        config.set("group.instance.id", &settings.instance);
    }
    if let Some(rack) = &settings.rack {
        config.set("client.rack", rack);
    }
    let member: BaseConsumer<Member> = config
        .create_with_context(Member {
            shared: shared.clone(),
            group: group.to_owned(),
            topics: topics.to_vec(),
            rebalanced: AtomicBool::new(false),
        })
        .map_err(|e| {
            RtflowError::InvalidConfiguration(format!("could not join group '{group}': {e}"))
        })?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    member.subscribe(&names).map_err(|e| {
        RtflowError::InvalidConfiguration(format!("could not subscribe to {topics:?}: {e}"))
    })?;
    Ok(member)
}

/// A process's member of one group, and what it takes to join again.
struct Membership {
    member: BaseConsumer<Member>,
    client_id: String,
    group: String,
    topics: Vec<String>,
}

/// Polls one group's member until the process stops, then leaves the group.
///
/// A member can fail for good: a static member whose session expired (the
/// group coordinator's broker died) rejoins under its instance id, and the
/// requests its previous member id still had in flight come back
/// `FENCED_INSTANCE_ID`, which librdkafka takes for another process of the
/// same name and makes fatal. Its partitions are then let go as lost, and
/// the process joins the group again with a fresh member. Fenced by a
/// genuine second process of the same name, which the group then lists under
/// another client id, it ends instead with `CLUSTER_INSTANCE_TAKEN`: joining
/// again would fence that one in turn, and the two would take the name from
/// each other for ever.
fn hold_membership(shared: &Arc<Shared>, mut membership: Membership) -> Result<()> {
    while !shared.leave.load(Ordering::SeqCst) {
        poll_member(&membership.member);
        if let Some((code, reason)) = membership.member.client().fatal_error() {
            // What the process holds of the group's topics, as it recorded
            // the assignments: a member failed for good may report none of
            // them, and a run over one it no longer holds would commit
            // next to its new owner, with the new member's generation.
            shared.let_go(&shared.assigned_in(&membership.topics), true)?;
            if taken(shared, &membership) {
                return Err(RtflowError::ClusterInstanceTaken {
                    instance: shared.settings.instance.clone(),
                });
            }
            tracing::warn!(group = %membership.group, ?code, %reason, "the group member failed for good; joining again");
            shared.changed(&membership.group);
            membership.member = join(
                shared,
                &membership.client_id,
                &membership.group,
                &membership.topics,
            )?;
        }
    }
    leave(shared, &membership.member);
    Ok(())
}

/// Whether another process holds this one's instance name in the
/// membership's group: a member of the same instance under another client
/// id, whose start differs. A group that cannot be listed (its coordinator
/// is moving) counts as not taken.
fn taken(shared: &Shared, membership: &Membership) -> bool {
    let instance = Some(shared.settings.instance.as_str());
    list_group(
        &shared.lister,
        &membership.group,
        shared.settings.operation_timeout,
    )
    .is_ok_and(|list| {
        list.groups()
            .iter()
            .flat_map(|group| group.members())
            .any(|member| {
                member.client_id() != membership.client_id
                    && instance_of(member.client_id()) == instance
            })
    })
}

fn poll_member(member: &BaseConsumer<Member>) {
    // Records never arrive (the partitions are paused); the poll serves the
    // group's callbacks.
    if let Some(Err(error)) = member.poll(Duration::from_millis(50)) {
        tracing::warn!(%error, "group member error");
    }
    // A rebalance that moved nothing from this process still starts a new
    // generation, which the next commit must name.
    member.context().publish_generation(member);
}

/// Leaves the group by unsubscribing, and waits until the member let its
/// partitions go. A static member closed while subscribed stays in the group
/// until its session times out (KIP-345: it expects to be restarted); one
/// that unsubscribes first sends its leave as any member does, so that its
/// partitions move on at once.
fn leave(shared: &Shared, member: &BaseConsumer<Member>) {
    member.unsubscribe();
    let deadline = Instant::now() + shared.settings.operation_timeout;
    while Instant::now() < deadline
        && member
            .assignment()
            .is_ok_and(|assignment| assignment.count() > 0)
    {
        poll_member(member);
    }
}

/// Starts a run over the partitions the process owns each time the
/// assignment changed and settled, until the process stops.
fn run<F>(shared: &Arc<Shared>, config: &QueryConfig, build: &F) -> Result<()>
where
    F: Fn(&Dataflow) -> Result<()>,
{
    let mut seen = shared.generation.load(Ordering::SeqCst);
    let mut running: Option<u64> = None;
    let mut retries = Retries::new(shared.settings.retry_timeout);
    // After a failed run, the next one waits until then.
    let mut not_before = Instant::now();
    let mut started_over_to_stop = false;
    loop {
        std::thread::sleep(Duration::from_millis(25));
        if shared.stop.load(Ordering::SeqCst) {
            match shared.stop_run() {
                // A run that failed as the process stopped (another
                // process's transaction it read aborted, say) dropped what
                // it did since its last commit. One more run starts over
                // from there and stops with a final checkpoint, so that a
                // stop that returns fine ended on a commit of its own.
                Err(error) if !started_over_to_stop => {
                    tracing::warn!(%error, "the run failed as the process stopped; it starts over from its last commit to stop");
                    started_over_to_stop = true;
                    start_run(shared, config, build)??;
                    continue;
                }
                stopped => return stopped,
            }
        }
        if let Some(error) = lock(&shared.member_failed).take() {
            return Err(error);
        }
        let failed = lock(&shared.run)
            .as_ref()
            .and_then(|run| run.query.exception());
        if let Some(error) = failed {
            // Taken out of the lock first: the wait holds no one else.
            let run = lock(&shared.run).take();
            if let Some(run) = run {
                // Its own failure is the one to tell.
                let _ = run.link.settle();
            }
            shared.transactions.discard();
            not_before = retry_at(&mut retries, error, "the run failed")?;
            running = None;
        }
        let generation = shared.generation.load(Ordering::SeqCst);
        if generation != seen {
            seen = generation;
            retries.reset();
        }
        if running == Some(seen)
            || Instant::now() < not_before
            || !lock(&shared.settling).take_settled(shared.groups.len(), Instant::now())
        {
            continue;
        }
        let owned = shared
            .settings
            .co_partitioned(&lock(&shared.assignment), shared.stages);
        let current = lock(&shared.run).as_ref().map(|run| run.owned.clone());
        if !must_restart(current.as_ref(), &owned) {
            // A process gone is fenced by the first live instance, which
            // may be this one even when its share stays: the open
            // transaction of the one gone holds back what every run reads.
            shared.after_rebalance(&owned);
            running = Some(seen);
            continue;
        }
        running = Some(seen);
        if shared.runs.load(Ordering::SeqCst) == 0 {
            check_again(shared)?;
        }
        // A process gone is fenced while this one's run takes its partitions
        // on, or restarts: their committed offsets are read `require_stable`,
        // which waits until the fencing aborts the open transaction of the
        // one gone, not until that transaction times out. The standby
        // replicas meanwhile save what is restored next.
        let started = std::thread::scope(|scope| {
            scope.spawn(|| shared.after_rebalance(&owned));
            if shared.adopt() {
                return Ok(Ok(()));
            }
            let stopping = Instant::now();
            if let Err(error) = shared.stop_run() {
                tracing::warn!(%error, "the previous run failed; the next resumes from its last commit");
            }
            tracing::info!(took = ?stopping.elapsed(), "the previous run stopped");
            start_run(shared, config, build)
        })?;
        if let Err(error) = started {
            not_before = retry_at(&mut retries, error, "the run did not start")?;
            running = None;
        }
    }
}

/// Checks the members' shapes once more, now that this process is one of
/// them. Two processes of different dataflows starting in the same instant
/// both find the other absent before they join; of the checks they make as
/// members, the later sees the other. A process refused here has not run,
/// so nothing it did needs undoing; one that has run stays, and the other
/// is refused by its own check. A check that cannot list the members is
/// logged: the one before joining passed.
fn check_again(shared: &Shared) -> Result<()> {
    match shared.shape.check_members(&shared.settings, &shared.lister) {
        Err(mismatch @ RtflowError::ClusterShapeMismatch { .. }) => Err(mismatch),
        Err(error) => {
            tracing::warn!(%error, "could not check the members' dataflows again before the first run");
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

/// When to start the next run after one that failed with `error` (`what`
/// says how), or the error that ends the process's part.
fn retry_at(retries: &mut Retries, error: RtflowError, what: &str) -> Result<Instant> {
    let verdict = retries.failed(&error, Instant::now());
    let failures = retries.in_a_row();
    match verdict {
        Verdict::RetryAt(at) => {
            tracing::warn!(%error, failures, "{what}; restarting from the last commit");
            Ok(at)
        }
        Verdict::GiveUp => {
            tracing::error!(%error, failures, "{what}; giving up");
            Err(error)
        }
    }
}

/// Starts a run over the partitions the process owns, if it owns any. The
/// outer error ends the process's part (its dataflow no longer builds); the
/// inner one is a start that failed, which the runner tries again.
fn start_run<F>(shared: &Shared, config: &QueryConfig, build: &F) -> Result<Result<()>>
where
    F: Fn(&Dataflow) -> Result<()>,
{
    let starting = Instant::now();
    let _transition = lock(&shared.transition);
    let owned = shared
        .settings
        .co_partitioned(&lock(&shared.assignment), shared.stages);
    if owned.is_empty() {
        return Ok(Ok(()));
    }
    let second = match SecondTier::start() {
        Ok(second) => second,
        Err(error) => return Ok(Err(error)),
    };
    let link = Arc::new(KafkaLink {
        order: Arc::default(),
        settings: shared.settings.clone(),
        mode: Mode::Live {
            owned: Mutex::new(Arc::new(Owned::new(shared.settings.clone(), owned.clone()))),
            transactions: shared.transactions.clone(),
            upstream: shared.upstream.clone(),
            verified: Arc::default(),
            second,
            first_committed: Mutex::default(),
            last_restore: shared.last_restore.clone(),
        },
    });
    let flow = Dataflow::clustered(config.name.clone(), link.clone());
    let built_by = format!("clustered query '{}'", config.name);
    guard::building(&built_by, || build(&flow))?;
    Ok(flow.start(config.clone()).map(|query| {
        shared.runs.fetch_add(1, Ordering::SeqCst);
        let restore = *lock(&shared.last_restore);
        tracing::info!(partitions = ?owned, took = ?starting.elapsed(), ?restore, "run started");
        *lock(&shared.run) = Some(Run {
            query: Arc::new(query),
            owned,
            link,
        });
    }))
}
