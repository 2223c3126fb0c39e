//! The coordinator: the control-plane actor of one query. It wires the planned
//! dataflow, starts one thread per actor, ends an epoch every batch duration
//! (barriers from the sources, acknowledgements from every actor, then a durable
//! manifest), publishes progress, and stops the query on `stop()` or on the first
//! failure.
//!
//! It is an actix actor on a thread of its own with its own `System`, so queries
//! behave the same inside or outside a user's async runtime. Only low-rate control
//! messages go through it; records never do.
//!
//! What it decides about epochs, free of actix and I/O, is in `epochs`: what
//! the acknowledgements of an epoch make of its manifest, and which
//! `checkpoint_now` requests an epoch answers; when an epoch commits is
//! `rtflow_checkpoint::CheckpointTracker`'s.

mod epochs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use actix::{Actor, ActorContext, AsyncContext, Context, Handler, Message, System};
use crossbeam_channel::Sender;
use rtflow_checkpoint::protocol::ActorId;
use rtflow_checkpoint::{CheckpointStore, CheckpointTracker, CommitStats, Manifest, Recovery};

use self::epochs::{assemble, Ack, Assembled, Requests};
use crate::actor::{ActorEnv, Report};
use crate::cancel::Cancel;
use crate::cluster::handover::Handovers;
use crate::cluster::membership::Membership;
use crate::cluster::ClusterLink;
use crate::cluster::Handover;
use crate::config::QueryConfig;
use crate::error::{Result, RtflowError};
use crate::guard::{self, Place};
use crate::metrics::{CheckpointStats, Role};
use crate::plan::{ActorSpec, Plan, Resume};
use crate::progress::{
    timestamp, EpochOffsets, ProgressTracker, QueryStartedEvent, QueryTerminatedEvent,
    SourceOffsets,
};
use crate::record::{now_nanos, Epoch};
use crate::shared::QueryShared;
use crate::state::Restored;

/// An actor thread ended, with how.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ActorExited {
    result: Result<()>,
}

/// `StreamingQuery::stop()`: end the sources' streams and let the rest drain.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopQuery;

/// `StreamingQuery::checkpoint_now()`: end an epoch that starts after this
/// request, and send its number once it committed.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct CheckpointNow(pub(crate) mpsc::Sender<Epoch>);

/// `StreamingQuery::hand_over()`: a handover at the barrier of an epoch that
/// starts after this request, whose number is sent once it committed.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct HandOver(pub(crate) Handover, pub(crate) mpsc::Sender<Epoch>);

/// `StreamingQuery::abandon()`: cancel every actor at once, as a killed process
/// would stop, with no final checkpoint.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Abandon;

/// A checkpoint report from an actor.
#[derive(Message)]
#[rtype(result = "()")]
struct ActorReport(Report);

/// What the coordinator needs to start a query, and where to say whether it did.
pub(crate) struct Startup {
    pub(crate) plan: Plan,
    pub(crate) config: QueryConfig,
    pub(crate) batch_duration: Duration,
    pub(crate) location: Location,
    /// The checkpoint the query resumes from (none for a new location).
    pub(crate) recovery: Recovery,
    pub(crate) started: mpsc::Sender<Result<()>>,
    /// For a held start: once the actors are wired, `started` says so, and
    /// they run only when this gate opens (a gate dropped abandons the start).
    pub(crate) gate: Option<mpsc::Receiver<()>>,
    /// Whether the actors may run, or `start()` stopped waiting for them
    /// ([`QueryConfig::start_timeout`]): then whatever the wiring made is
    /// dropped, and nothing runs.
    pub(crate) claim: Arc<StartClaim>,
}

/// The `checkpoint-commit` failpoint: a commit the brokers or the store
/// refused, for tests. Both parts of a clustered epoch's commit take it.
fn refused_by_failpoint() -> Result<()> {
    fail::fail_point!("checkpoint-commit", |message| Err(RtflowError::Checkpoint(
        message.unwrap_or_default()
    )));
    Ok(())
}

/// Who settles a start: the coordinator, by running the actors once they are
/// wired, or `start()`, by giving up waiting for them; whichever claims it
/// first. The other follows: an abandoned start never runs, and a start
/// whose actors run is waited for.
#[derive(Default)]
pub(crate) struct StartClaim(AtomicU8);

impl StartClaim {
    const WAITING: u8 = 0;
    const RUNNING: u8 = 1;
    const ABANDONED: u8 = 2;

    /// The coordinator claims the start to run its actors.
    pub(crate) fn run(&self) -> bool {
        self.claim(Self::RUNNING)
    }

    /// `start()` claims the start to give it up.
    pub(crate) fn abandon(&self) -> bool {
        self.claim(Self::ABANDONED)
    }

    fn claim(&self, outcome: u8) -> bool {
        let claimed =
            self.0
                .compare_exchange(Self::WAITING, outcome, Ordering::SeqCst, Ordering::SeqCst);
        claimed.is_ok()
    }
}

/// The checkpoint location of a starting query.
pub(crate) enum Location {
    /// A location that held something, opened.
    Opened(Box<CheckpointStore>),
    /// A location that does not exist yet or is empty: created once every actor
    /// is wired, so that a query rejected at start writes nothing there.
    New(PathBuf),
    /// A clustered query's process: its checkpoints commit into the cluster.
    Cluster(Arc<dyn ClusterLink>),
}

impl Location {
    /// Where to commit checkpoints, created now for a new location.
    fn into_store(self, config: &QueryConfig, query_id: &str) -> Result<Store> {
        match self {
            Self::Opened(store) => Ok(Store::Local(store)),
            Self::New(path) => {
                let store = CheckpointStore::open(&path, config.checkpoints_retained)?;
                store.query_id(|| query_id.to_owned())?;
                Ok(Store::Local(Box::new(store)))
            }
            Self::Cluster(link) => Ok(Store::Cluster(link)),
        }
    }
}

/// Where checkpoints commit.
enum Store {
    Local(Box<CheckpointStore>),
    Cluster(Arc<dyn ClusterLink>),
}

/// The checkpoint side of a running query.
struct Checkpoints {
    store: Store,
    tracker: CheckpointTracker<Ack>,
    /// Per actor: for sources, the source's uid and its barrier channel.
    sources: Vec<Option<(String, Sender<Epoch>)>>,
    /// Per sink actor: where to say an epoch committed. Dropped after the final
    /// commit, which lets finished sinks close.
    commits: Vec<Sender<Epoch>>,
    key_groups: u32,
    /// The offsets of the last committed epoch, per source uid.
    committed: SourceOffsets,
    /// When the epoch in flight was triggered.
    triggered_at: Instant,
    requests: Requests<mpsc::Sender<Epoch>>,
    /// The handovers the actors meet at barriers, and the plan that says
    /// where each leaves them.
    handovers: Arc<Handovers>,
    plan: Plan,
}

pub(crate) struct Coordinator {
    shared: Arc<QueryShared>,
    startup: Option<Startup>,
    env: ActorEnv,
    threads: Vec<JoinHandle<()>>,
    running: usize,
    failure: Option<RtflowError>,
    progress: Option<ProgressTracker>,
    checkpoints: Option<Checkpoints>,
    /// The latest committed epoch.
    epoch: Epoch,
}

impl Coordinator {
    pub(crate) fn new(shared: Arc<QueryShared>, startup: Startup) -> Self {
        let env = ActorEnv {
            actor: 0,
            report: Arc::new(|_| {}),
            barriers: None,
            waker: None,
            cancel: Cancel::default(),
            stop: Arc::default(),
            max_records: startup.config.max_records_per_message,
            partition_base: 0,
            first_partition: 0,
            source_metrics: None,
            snapshots: Default::default(),
            chain: Place::new(Role::Operator, String::new(), 0),
            handovers: Arc::default(),
            reading: None,
        };
        Self {
            shared,
            startup: Some(startup),
            env,
            threads: Vec::new(),
            running: 0,
            failure: None,
            progress: None,
            checkpoints: None,
            epoch: 0,
        }
    }

    fn start_actors(&mut self, startup: Startup, ctx: &Context<Self>) -> Result<()> {
        let Startup {
            plan,
            config,
            location,
            recovery,
            started,
            gate,
            claim,
            ..
        } = startup;
        let Recovery {
            manifest: resume,
            state,
            skipped,
        } = recovery;
        let _span = tracing::info_span!("start", query = %config.name).entered();
        if let Some(cpus) = &config.cpu_affinity {
            crate::placement::pin_current_thread(cpus)?;
        }
        let shared = &self.shared;
        self.progress = Some(ProgressTracker::new(
            (
                shared.id.to_string(),
                shared.run_id.to_string(),
                shared.name.clone(),
            ),
            plan.graph().source_descriptions(),
            plan.graph().sink_descriptions(),
            shared.cluster.clone(),
        ));
        let coordinator = ctx.address();
        self.env.report = Arc::new(move |report| coordinator.do_send(ActorReport(report)));
        let committed = resume
            .as_ref()
            .map(|m| m.sources.clone())
            .unwrap_or_default();
        if let Some(manifest) = &resume {
            let _span = tracing::info_span!("recovery", epoch = manifest.epoch).entered();
            tracing::info!(
                sources = committed.len(),
                "resuming from the last committed checkpoint"
            );
            self.epoch = manifest.epoch;
        }
        if let Some(manifest) = &resume {
            check_compatible(manifest, &plan, &config)?;
        }
        let mut restored = Restored::new(
            state,
            resume.as_ref().map(|m| m.epoch),
            resume.as_ref().and_then(|m| m.watermark),
            resume.as_ref().map(|m| m.run_id.clone()),
            config.max_key_groups,
        );
        if let Location::Cluster(link) = &location {
            restored.cluster = Some(link.clone() as Arc<dyn Membership>);
        }
        let restored = Arc::new(restored);
        let mut tracker = CheckpointTracker::new(plan.actor_count(), resume.map(|m| m.epoch));
        if let Some(damaged) = skipped.iter().map(|corrupt| corrupt.epoch).max() {
            tracker.number_after(damaged);
        }
        let query_id = self.shared.id.to_string();
        let run_id = self.shared.run_id.to_string();
        let resume_from = Resume {
            query_id: &query_id,
            run_id: &run_id,
            offsets: &committed,
            state: restored.clone(),
            first_epoch: tracker.next_epoch(),
        };
        let mut actors = plan.wire(&config, &self.shared.metrics, &self.env, &resume_from)?;
        if matches!(location, Location::Cluster(_)) {
            // Every source too, the repartitions' readers among them: once
            // they passed the barrier, none reads records of the next epoch
            // that the first transaction's commit lets this process's
            // writers produce. Read in this epoch, those would hold its
            // second transaction until the next commit.
            let first = (actors.iter().enumerate())
                .filter(|(_, a)| !a.commits_second || a.source.is_some());
            tracker.set_first_tier(first.map(|(actor, _)| actor));
        }
        if let Some((id, meta)) = restored.unclaimed() {
            return Err(RtflowError::IncompatibleCheckpoint {
                difference: format!(
                    "the checkpoint holds {id} (a '{}' operator), which the dataflow no \
                     longer has; restore the operator or give it back its .uid(...)",
                    meta.kind
                ),
            });
        }
        if let Some(gate) = gate {
            let _ = started.send(Ok(()));
            gate.recv().map_err(|_| RtflowError::Cancelled)?;
        }
        if !claim.run() {
            return Err(RtflowError::Cancelled);
        }
        self.checkpoints = Some(Checkpoints {
            store: location.into_store(&config, &query_id)?,
            tracker,
            sources: actors.iter_mut().map(|a| a.source.take()).collect(),
            commits: actors.iter_mut().filter_map(|a| a.commits.take()).collect(),
            key_groups: config.max_key_groups as u32,
            committed,
            triggered_at: Instant::now(),
            requests: Requests::default(),
            handovers: restored.handovers.clone(),
            plan,
        });
        tracing::info!(actors = actors.len(), "starting actors");
        for (index, actor) in actors.into_iter().enumerate() {
            let coordinator = ctx.address();
            let spawned = std::thread::Builder::new()
                .name(format!("rtflow-{index}"))
                .spawn(move || {
                    let result = run_actor(actor);
                    coordinator.do_send(ActorExited { result });
                });
            match spawned {
                Ok(thread) => {
                    self.threads.push(thread);
                    self.running += 1;
                }
                Err(error) => {
                    self.env.cancel.raise(None);
                    self.join_threads();
                    return Err(RtflowError::InvalidConfiguration(format!(
                        "could not start actor thread {index}: {error}; lower the query's \
                         parallelism"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Joins the actors' threads once every one has ended; from then on
    /// there is no actor to give way to (see [`yield_to_actors`]).
    fn join_threads(&mut self) {
        yield_to_actors(false);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }

    fn publish_progress(&mut self, offsets: Option<EpochOffsets<'_>>) {
        if let Some(tracker) = &mut self.progress {
            let progress = tracker.report(&self.shared.metrics, self.epoch, offsets);
            self.shared.publish(progress);
        }
    }

    /// Ends an epoch at every multiple of `period` on the wall clock. The
    /// processes of a clustered query then end their epochs together, so that
    /// a process's second transaction, which waits for the first ones of the
    /// processes it read from, waits only for their commits, not for the
    /// rest of their epochs.
    fn trigger_on_the_clock(ctx: &mut Context<Self>, period: Duration) {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        ctx.run_later(until_next_multiple(now, period), move |coordinator, ctx| {
            coordinator.guarded(ctx, |coordinator, _| coordinator.trigger_checkpoint());
            Self::trigger_on_the_clock(ctx, period);
        });
    }

    /// Ends the next epoch at every source, unless one is still in flight.
    fn trigger_checkpoint(&mut self) {
        let Some(checkpoints) = &mut self.checkpoints else {
            return;
        };
        let Some(epoch) = checkpoints.tracker.trigger() else {
            return;
        };
        tracing::debug!(epoch, "ending epoch");
        checkpoints.triggered_at = Instant::now();
        checkpoints.requests.triggered(epoch);
        checkpoints.handovers.bind(epoch);
        for (_, barriers) in checkpoints.sources.iter().flatten() {
            // A source that already exited acknowledged through its final report.
            let _ = barriers.send(epoch);
        }
        self.wake_sources();
    }

    /// Cuts short the source actors' waits in their readers (see
    /// [`SourceReader::poll`](crate::SourceReader::poll)), so that a barrier or
    /// stop just sent leaves each source at once rather than after its wait. A
    /// source not parked returns from its next park at once and polls again.
    fn wake_sources(&self) {
        let sources = self.checkpoints.iter().flat_map(|c| &c.sources);
        for (thread, _) in self
            .threads
            .iter()
            .zip(sources)
            .filter(|(_, s)| s.is_some())
        {
            thread.thread().unpark();
        }
    }

    /// Every actor acknowledged `epoch`: write its snapshots and manifest durably,
    /// then tell the sinks it committed.
    fn commit(&mut self, epoch: Epoch, acks: Vec<Ack>) -> Result<()> {
        let metrics = &self.shared.metrics;
        let checkpoints = self.checkpoints.as_mut().expect("checkpoints run");
        let _span = tracing::info_span!("checkpoint", epoch).entered();
        let uids = checkpoints
            .sources
            .iter()
            .map(|source| source.as_ref().map(|(uid, _)| uid.as_str()));
        let Assembled {
            sources,
            watermark,
            deltas,
        } = assemble(uids, acks);
        let manifest = Manifest {
            epoch,
            query_id: self.shared.id.to_string(),
            watermark,
            sources,
            state: Default::default(),
            key_groups: checkpoints.key_groups,
            committed_at_ms: now_nanos() / 1_000_000,
            run_id: self.shared.run_id.to_string(),
        };
        let writing = Instant::now();
        let written = || -> Result<_> {
            refused_by_failpoint()?;
            match &mut checkpoints.store {
                Store::Local(store) => Ok(store.commit(manifest, deltas)?),
                Store::Cluster(link) => {
                    link.commit(epoch, &manifest.sources, &deltas)?;
                    let entries = deltas.iter().map(|d| d.entries.len()).sum();
                    Ok((manifest, CommitStats { bytes: 0, entries }))
                }
            }
        };
        let (manifest, stats) = written().inspect_err(|_| metrics.checkpoint_failed())?;
        // The window exactly-once sinks must survive: the checkpoint is durable, its
        // transactions are not committed yet.
        fail::fail_point!("after-manifest", |_| std::process::abort());
        let commit = writing.elapsed();
        let duration = checkpoints.triggered_at.elapsed();
        tracing::info!(
            epoch,
            bytes = stats.bytes,
            entries = stats.entries,
            ?duration,
            written_in = ?commit,
            "checkpoint committed"
        );
        checkpoints.handovers.committed(epoch);
        for sink in &checkpoints.commits {
            // A sink that already exited has nothing left to commit.
            let _ = sink.send(epoch);
        }
        self.shared.metrics.record_checkpoint(CheckpointStats {
            epoch,
            duration,
            bytes: stats.bytes,
        });
        let previous = std::mem::replace(&mut checkpoints.committed, manifest.sources);
        if let Store::Local(store) = &mut checkpoints.store {
            if store.compact()? {
                tracing::debug!(epoch, "compacting a snapshot chain in the background");
            }
        }
        self.epoch = epoch;
        let committed = self
            .checkpoints
            .as_ref()
            .expect("checkpoints run")
            .committed
            .clone();
        self.publish_progress(Some(EpochOffsets {
            start: &previous,
            end: &committed,
            checkpoint: duration,
            commit,
        }));
        Ok(())
    }

    /// The actors that commit first acknowledged `epoch` (a clustered query):
    /// commit their part of it now.
    fn commit_first(&mut self, epoch: Epoch, acks: Vec<(ActorId, Ack)>) -> Result<()> {
        let checkpoints = self.checkpoints.as_ref().expect("checkpoints run");
        let Store::Cluster(link) = &checkpoints.store else {
            return Ok(());
        };
        let _span = tracing::info_span!("checkpoint", epoch).entered();
        let (actors, acks): (Vec<_>, Vec<_>) = acks.into_iter().unzip();
        let uids = (actors.iter())
            .map(|&actor| (checkpoints.sources[actor].as_ref()).map(|(uid, _)| uid.as_str()));
        let offsets = assemble(uids, acks).sources;
        // A failure fails the query, whose abort of the epoch in flight
        // counts the failed checkpoint.
        refused_by_failpoint()?;
        link.commit_first(epoch, &offsets)?;
        tracing::debug!(epoch, took = ?checkpoints.triggered_at.elapsed(), "first tier committed");
        Ok(())
    }

    fn on_report(&mut self, report: Report) -> Result<()> {
        let Some(checkpoints) = &mut self.checkpoints else {
            return Ok(());
        };
        let complete = match report {
            Report::Barrier {
                actor,
                epoch,
                offsets,
                snapshot,
            } => {
                let sink_watermark = snapshot.sink_watermark;
                let ack = Ack {
                    offsets,
                    deltas: snapshot.into_deltas(),
                    sink_watermark,
                };
                checkpoints
                    .tracker
                    .ack(actor, epoch, ack)
                    .map_err(|e| RtflowError::Checkpoint(e.to_string()))?
            }
            Report::Finished {
                actor,
                offsets,
                snapshot,
            } => {
                let standing = Ack {
                    offsets: offsets.clone(),
                    deltas: Vec::new(),
                    sink_watermark: snapshot.sink_watermark,
                };
                let sink_watermark = snapshot.sink_watermark;
                let last = Ack {
                    offsets,
                    deltas: snapshot.into_deltas(),
                    sink_watermark,
                };
                checkpoints.tracker.retire(actor, last, standing)
            }
        };
        if let Some((epoch, acks)) = complete {
            self.commit(epoch, acks)?;
        } else if let Some((epoch, acks)) = checkpoints.tracker.first_tier_complete() {
            self.commit_first(epoch, acks)?;
        }
        let checkpoints = self.checkpoints.as_mut().expect("checkpoints run");
        if checkpoints.tracker.all_finished() && checkpoints.tracker.in_flight().is_none() {
            // Every actor ended: commit what they said last, then let the sinks
            // that wait for that final commit close.
            if let Some((epoch, acks)) = checkpoints.tracker.finish() {
                self.commit(epoch, acks)?;
            }
            self.checkpoints
                .as_mut()
                .expect("checkpoints run")
                .commits
                .clear();
        }
        self.serve_requests();
        Ok(())
    }

    /// Answers the `checkpoint_now` requests whose epoch committed, and ends a new
    /// epoch for those still waiting for one.
    fn serve_requests(&mut self) {
        let Some(checkpoints) = &mut self.checkpoints else {
            return;
        };
        let tracker = &checkpoints.tracker;
        let finished = tracker.all_finished() && tracker.in_flight().is_none();
        let served = checkpoints
            .requests
            .serve(tracker.last_completed(), finished);
        for (reply, epoch) in served.answered {
            let _ = reply.send(epoch);
        }
        if served.trigger {
            self.trigger_checkpoint();
        }
    }

    fn fail(&mut self, error: RtflowError) {
        if self.failure.is_none() {
            tracing::error!(%error, "stopping the query");
            self.env.cancel.raise(Some(error.clone()));
            self.failure = Some(error);
            let aborted = self.checkpoints.as_mut().and_then(|c| c.tracker.abort());
            if aborted.is_some() {
                self.shared.metrics.checkpoint_failed();
            }
        }
    }

    fn terminate(&mut self, failure: Option<RtflowError>) {
        let event = QueryTerminatedEvent {
            id: self.shared.id.to_string(),
            run_id: self.shared.run_id.to_string(),
            exception: failure.as_ref().map(ToString::to_string),
            error_class: failure.as_ref().map(|e| e.error_class().to_owned()),
        };
        self.shared.terminate(failure);
        self.shared.tell_listeners("terminated", |listener| {
            listener.on_query_terminated(&event)
        });
    }

    /// Runs a handler's `body`. A panic of the coordinator's own fails the
    /// query with `INTERNAL_ERROR` naming this thread, and once no actor is
    /// left to report its exit, terminates it: the coordinator never leaves a
    /// query waiting for a thread that is gone.
    fn guarded(
        &mut self,
        ctx: &mut Context<Self>,
        body: impl FnOnce(&mut Self, &mut Context<Self>),
    ) {
        let outcome = guard::engine(COORDINATOR_THREAD, || {
            body(self, ctx);
            Ok(())
        });
        if let Err(error) = outcome {
            self.fail(error);
            if self.running == 0 {
                self.join_threads();
                let failure = self.failure.take();
                self.terminate(failure);
                ctx.stop();
            }
        }
    }
}

/// The coordinator's thread, as errors name it.
const COORDINATOR_THREAD: &str = "rtflow-coord";

/// Checks that the dataflow can restore `manifest`: same key groups, and every
/// source it has offsets for still present. States are checked as operators
/// claim them, and after wiring for any left unclaimed.
fn check_compatible(manifest: &Manifest, plan: &Plan, config: &QueryConfig) -> Result<()> {
    let key_groups = config.max_key_groups as u32;
    if !manifest.state.is_empty() && manifest.key_groups != key_groups {
        return Err(RtflowError::IncompatibleCheckpoint {
            difference: format!(
                "its keyed state is spread over {} key groups, but the query is configured \
                 with {key_groups} (QueryConfig::max_key_groups)",
                manifest.key_groups
            ),
        });
    }
    let sources = plan.source_uids();
    if let Some(missing) = manifest
        .sources
        .keys()
        .find(|s| !sources.contains(s.as_str()))
    {
        return Err(RtflowError::IncompatibleCheckpoint {
            difference: format!(
                "it holds offsets of source '{missing}', which the dataflow no longer has \
                 (sources are matched by uid: give it back its .uid(...))"
            ),
        });
    }
    Ok(())
}

/// Runs one actor body. Its loop catches what its user code raises, so the
/// errors it ends with say where already; a panic outside the loop is
/// blamed on the actor's chain of operators.
fn run_actor(actor: ActorSpec) -> Result<()> {
    let ActorSpec {
        label,
        subtask,
        main,
        ..
    } = actor;
    guard::catch(main).unwrap_or_else(|panic| {
        Err(guard::blamed(
            &*panic,
            &Place::new(Role::Operator, label, subtask),
        ))
    })
}

impl Actor for Coordinator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let startup = self.startup.take().expect("started once");
        let started = startup.started.clone();
        let (progress_interval, batch_duration) =
            (startup.config.progress_interval, startup.batch_duration);
        let outcome = guard::engine(COORDINATOR_THREAD, || self.start_actors(startup, ctx));
        match outcome {
            Ok(()) => {
                yield_to_actors(true);
                self.shared.activate();
                let _ = started.send(Ok(()));
                let event = QueryStartedEvent {
                    id: self.shared.id.to_string(),
                    run_id: self.shared.run_id.to_string(),
                    name: self.shared.name.clone(),
                    timestamp: timestamp(SystemTime::now()),
                };
                self.shared
                    .tell_listeners("started", |listener| listener.on_query_started(&event));
                ctx.run_interval(progress_interval, |coordinator, ctx| {
                    coordinator.guarded(ctx, |coordinator, _| coordinator.publish_progress(None))
                });
                if self.shared.cluster.is_some() {
                    Self::trigger_on_the_clock(ctx, batch_duration);
                } else {
                    ctx.run_interval(batch_duration, |coordinator, ctx| {
                        coordinator.guarded(ctx, |coordinator, _| coordinator.trigger_checkpoint())
                    });
                }
                // A clustered run's first epoch ends sooner: a run restarted
                // by a rebalance starts on the backlog of its pause, which
                // only a commit makes visible downstream, once per
                // repartition stage.
                if self.shared.cluster.is_some() {
                    ctx.run_later(batch_duration / 4, |coordinator, ctx| {
                        coordinator.guarded(ctx, |coordinator, _| coordinator.trigger_checkpoint())
                    });
                }
            }
            Err(error) => {
                // Whatever started before the failure stops again.
                self.env.cancel.raise(Some(error.clone()));
                self.join_threads();
                self.shared.terminate(Some(error.clone()));
                let _ = started.send(Err(error));
                ctx.stop();
            }
        }
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        System::current().stop();
    }
}

impl Handler<ActorExited> for Coordinator {
    type Result = ();

    fn handle(&mut self, exited: ActorExited, ctx: &mut Context<Self>) {
        self.running -= 1;
        if let Err(error) = exited.result {
            // A cancelled actor is a consequence; keep the failure that caused it.
            if error != RtflowError::Cancelled {
                self.fail(error);
            }
        }
        if self.running == 0 {
            self.join_threads();
            let _span = tracing::info_span!("stop", query = %self.shared.name).entered();
            tracing::info!(failed = self.failure.is_some(), "query terminated");
            let published = guard::engine(COORDINATOR_THREAD, || {
                self.publish_progress(None);
                Ok(())
            });
            if let Err(error) = published {
                self.fail(error);
            }
            let failure = self.failure.take();
            self.terminate(failure);
            ctx.stop();
        }
    }
}

impl Handler<ActorReport> for Coordinator {
    type Result = ();

    fn handle(&mut self, ActorReport(report): ActorReport, ctx: &mut Context<Self>) {
        if self.failure.is_some() {
            return;
        }
        self.guarded(ctx, |coordinator, _| {
            if let Err(error) = coordinator.on_report(report) {
                coordinator.fail(error);
            }
        });
    }
}

impl Handler<CheckpointNow> for Coordinator {
    type Result = ();

    fn handle(&mut self, CheckpointNow(reply): CheckpointNow, ctx: &mut Context<Self>) {
        // A failing query drops the request: the caller learns of the failure.
        if let (None, Some(checkpoints)) = (&self.failure, &mut self.checkpoints) {
            checkpoints.requests.push(reply);
            self.guarded(ctx, |coordinator, _| coordinator.serve_requests());
        }
    }
}

impl Handler<HandOver> for Coordinator {
    type Result = ();

    fn handle(&mut self, HandOver(handover, reply): HandOver, ctx: &mut Context<Self>) {
        // A failing query drops the request: the caller learns of the failure.
        if let (None, Some(checkpoints)) = (&self.failure, &mut self.checkpoints) {
            let reach = checkpoints.plan.hand_over(&*handover.membership);
            checkpoints.handovers.ask(handover, reach);
            checkpoints.requests.push(reply);
            self.guarded(ctx, |coordinator, _| coordinator.serve_requests());
        }
    }
}

impl Handler<Abandon> for Coordinator {
    type Result = ();

    fn handle(&mut self, _: Abandon, _ctx: &mut Context<Self>) {
        tracing::warn!(query = %self.shared.name, "abandoned: no final checkpoint");
        self.fail(RtflowError::Cancelled);
    }
}

impl Handler<StopQuery> for Coordinator {
    type Result = ();

    fn handle(&mut self, _: StopQuery, _ctx: &mut Context<Self>) {
        tracing::info!(query = %self.shared.name, "stopping: ending source streams");
        self.env.stop.store(true, Ordering::Relaxed);
        self.wake_sources();
    }
}

/// Puts the calling thread (the coordinator) under `SCHED_IDLE` while the
/// actors run (`true`): its work (writing a checkpoint, building a progress
/// report) gives way at once to an actor woken by a record, which a low nice
/// value does not guarantee (the scheduler lets a running thread use up its
/// slice first). On a saturated machine checkpoints therefore slow down instead
/// of the records. Called once the actors run: a thread inherits the policy of
/// the thread that starts it, and actors started after this would run at idle
/// priority too, behind every other thread of the machine (sled's writers
/// during a checkpoint among them). The compaction thread the coordinator
/// starts later inherits it, as it should. Once the actors have ended
/// (`false`) the coordinator takes the normal policy back: its teardown (the
/// store's last flush) and its exit are what `stop()` waits for.
fn yield_to_actors(yes: bool) {
    #[cfg(target_os = "linux")]
    // SAFETY: sched_setscheduler only reads `param`; `pid = 0` names the
    // calling thread. Failing leaves the policy as it was, which is only slower.
    unsafe {
        let policy = if yes {
            libc::SCHED_IDLE
        } else {
            libc::SCHED_OTHER
        };
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, policy, &param);
    }
}

/// How long from `now` until the next multiple of `period`, a whole period
/// when `now` is one.
fn until_next_multiple(now: Duration, period: Duration) -> Duration {
    let period = period.as_nanos().max(1);
    let rest = now.as_nanos() % period;
    Duration::from_nanos((period - rest) as u64)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{until_next_multiple, StartClaim};

    #[test]
    fn a_start_is_claimed_once_by_whichever_comes_first() {
        let run_first = StartClaim::default();
        assert!(run_first.run());
        assert!(!run_first.abandon(), "running actors are waited for");
        let abandoned_first = StartClaim::default();
        assert!(abandoned_first.abandon());
        assert!(!abandoned_first.run(), "an abandoned start never runs");
    }

    #[test]
    fn epochs_end_on_multiples_of_the_batch_duration() {
        let second = Duration::from_secs(1);
        let at = |ms| Duration::from_millis(ms);
        assert_eq!(until_next_multiple(at(12_300), second), at(700));
        assert_eq!(until_next_multiple(at(12_000), second), second);
        assert_eq!(until_next_multiple(at(12_999), second), at(1));
    }
}
