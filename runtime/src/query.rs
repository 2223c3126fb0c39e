//! [`StreamingQuery`]: the handle on a started dataflow.

use std::io::Write;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use actix::{Actor, Addr};
use rtflow_checkpoint::{CheckpointStore, Recovery};
use uuid::Uuid;

use crate::cluster::membership::Membership;
use crate::cluster::Handover;
use crate::config::QueryConfig;
use crate::coordinator::{
    Abandon, CheckpointNow, Coordinator, HandOver, Location, StartClaim, Startup, StopQuery,
};
use crate::endpoint::{register, Registration};
use crate::error::{Result, RtflowError};
use crate::graph::Graph;
use crate::metrics::MetricsSnapshot;
use crate::plan::{validate, Plan};
use crate::progress::{StreamingQueryProgress, StreamingQueryStatus};
use crate::record::Epoch;
use crate::shared::{Lifecycle, QueryShared};
use crate::shutdown::{StopRequest, Stoppable};

/// A running query: its identity, status, metrics, and how to stop it.
///
/// Dropping the handle stops the query and joins its threads.
pub struct StreamingQuery {
    shared: Arc<QueryShared>,
    coordinator: Addr<Coordinator>,
    coordinator_thread: Mutex<Option<JoinHandle<()>>>,
    /// The slots (long-running actor threads) the query occupies.
    task_slots: usize,
    /// While a held start waits for [`release`](Self::release): the gate that
    /// lets its actors run (dropping it abandons the start), and where the
    /// coordinator says whether they did.
    held: Mutex<Option<Held>>,
    /// Keeps the query on its `/metrics` endpoint while the handle lives.
    _endpoint: Option<Registration>,
}

/// A held start's gate, and where its coordinator answers once it opened.
type Held = (mpsc::Sender<()>, mpsc::Receiver<Result<()>>);

/// How a prepared query starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Its actors run as soon as they are wired.
    Now,
    /// Its actors are wired (factories, readers and writers made), then wait
    /// for [`StreamingQuery::release`]; nothing is read or written before.
    Held,
}

/// A query whose start-time checks passed: validated, planned within its
/// slots, its checkpoint location opened (a new one is created only once
/// it runs). Nothing of it runs yet.
pub(crate) struct Prepared {
    plan: Plan,
    config: QueryConfig,
    batch_duration: Duration,
    location: Location,
    recovery: Recovery,
    id: Uuid,
}

impl Prepared {
    pub(crate) fn new(graph: Graph, config: QueryConfig) -> Result<Self> {
        let clustered = graph.cluster.is_some();
        let batch_duration = config.check(!clustered)?;
        validate(&graph, &config)?;
        let plan = Plan::new(graph, &config)?;
        let (location, recovery, id) = match &plan.graph().cluster {
            Some(link) => {
                let id = Uuid::new_v4();
                let recovery =
                    link.recover()?
                        .into_recovery(plan.source_uids(), &config, &id.to_string());
                (Location::Cluster(link.clone()), recovery, id)
            }
            None => open_location(&config)?,
        };
        Ok(Self {
            plan,
            config,
            batch_duration,
            location,
            recovery,
            id,
        })
    }

    /// The task slots the query will occupy.
    pub(crate) fn task_slots(&self) -> usize {
        self.plan.actor_count()
    }
}

impl StreamingQuery {
    pub(crate) fn launch(prepared: Prepared, start: Start) -> Result<Self> {
        let Prepared {
            plan,
            config,
            batch_duration,
            location,
            recovery,
            id,
        } = prepared;
        let task_slots = plan.actor_count();
        let mut shared = QueryShared::new(id, config.name.clone(), config.listeners.0.clone());
        shared.metrics.set_batch_duration(batch_duration);
        shared.cluster = (plan.graph().cluster.clone()).map(|link| link as Arc<dyn Membership>);
        let shared = Arc::new(shared);
        let endpoint = config
            .metrics_address
            .map(|address| register(address, shared.clone()))
            .transpose()?;
        let (started_tx, started_rx) = mpsc::channel();
        let claim = Arc::new(StartClaim::default());
        let start_timeout = config.start_timeout;
        let (gate_tx, gate_rx) = mpsc::channel();
        let gate = (start == Start::Held).then_some(gate_rx);
        let (address_tx, address_rx) = mpsc::channel();
        let coordinator_shared = shared.clone();
        let coordinator_claim = claim.clone();
        let thread = std::thread::Builder::new()
            .name("rtflow-coord".into())
            .spawn(move || {
                let system = actix::System::new();
                system.block_on(async move {
                    let startup = Startup {
                        plan,
                        config,
                        batch_duration,
                        location,
                        recovery,
                        started: started_tx,
                        gate,
                        claim: coordinator_claim,
                    };
                    let address = Coordinator::new(coordinator_shared, startup).start();
                    let _ = address_tx.send(address);
                });
                let _ = system.run();
            })
            .map_err(|error| {
                RtflowError::InvalidConfiguration(format!(
                    "could not start the coordinator: {error}"
                ))
            })?;
        let coordinator = address_rx
            .recv()
            .expect("the coordinator thread sends its address");
        let started = match started_rx.recv_timeout(start_timeout) {
            Ok(started) => started,
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(RtflowError::Cancelled),
            // The coordinator is stuck in user code: leave its thread to
            // finish and drop what it made, as the claim tells it.
            Err(mpsc::RecvTimeoutError::Timeout) if claim.abandon() => {
                return Err(RtflowError::StartTimeout {
                    waited: format!("{start_timeout:?}"),
                });
            }
            // It has just claimed the start and runs the actors: its answer
            // follows at once.
            Err(mpsc::RecvTimeoutError::Timeout) => {
                started_rx.recv().unwrap_or(Err(RtflowError::Cancelled))
            }
        };
        let query = Self {
            shared,
            coordinator,
            coordinator_thread: Mutex::new(Some(thread)),
            task_slots,
            held: Mutex::new((start == Start::Held).then_some((gate_tx, started_rx))),
            _endpoint: endpoint,
        };
        match started {
            Ok(()) => Ok(query),
            Err(error) => {
                query.join_coordinator();
                Err(error)
            }
        }
    }

    /// Lets the actors of a held start run; returns once they do, or with
    /// the error that kept them from it.
    pub(crate) fn release(&self) -> Result<()> {
        let Some((gate, started)) = self.take_held() else {
            return Ok(());
        };
        let _ = gate.send(());
        match started.recv().unwrap_or(Err(RtflowError::Cancelled)) {
            Ok(()) => Ok(()),
            Err(error) => {
                self.join_coordinator();
                Err(error)
            }
        }
    }

    fn take_held(&self) -> Option<Held> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    /// The query's id.
    pub fn id(&self) -> Uuid {
        self.shared.id
    }

    /// How many task slots (long-running actor threads) the query occupies.
    pub fn task_slots(&self) -> usize {
        self.task_slots
    }

    /// The id of this run of the query.
    pub fn run_id(&self) -> Uuid {
        self.shared.run_id
    }

    /// The query's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Whether the query is still running.
    pub fn is_active(&self) -> bool {
        matches!(
            *self.shared.lifecycle(),
            Lifecycle::Starting | Lifecycle::Active
        )
    }

    /// The error that terminated the query, if it failed.
    pub fn exception(&self) -> Option<RtflowError> {
        match &*self.shared.lifecycle() {
            Lifecycle::Terminated(failure) => failure.clone(),
            _ => None,
        }
    }

    /// A copy of the query's counters and latency percentiles since it started.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// The latest progress report.
    pub fn last_progress(&self) -> Option<StreamingQueryProgress> {
        self.shared.progress().back().cloned()
    }

    /// The latest progress reports, oldest first (at most 100).
    pub fn recent_progress(&self) -> Vec<StreamingQueryProgress> {
        self.shared.progress().iter().cloned().collect()
    }

    /// What the query is doing now.
    pub fn status(&self) -> StreamingQueryStatus {
        let (active, failed) = self.shared.liveness();
        let data_available = self
            .shared
            .progress()
            .back()
            .is_some_and(|p| p.num_input_rows > 0);
        let message = match (active, failed, data_available) {
            (true, _, true) => "Processing new data",
            (true, _, false) => "Waiting for data to arrive",
            (false, true, _) => "Terminated with exception",
            (false, false, _) => "Stopped",
        };
        StreamingQueryStatus {
            message: message.to_owned(),
            is_data_available: data_available,
            is_trigger_active: active,
        }
    }

    /// Stops the query: sources end their streams, every record already read is
    /// processed by the sinks, and every thread is joined before this returns.
    pub fn stop(&self) -> Result<()> {
        // A held start that is stopped is abandoned: its actors never run.
        drop(self.take_held());
        if self.is_active() {
            self.coordinator.do_send(StopQuery);
        }
        self.shared.wait(None);
        self.join_coordinator();
        Ok(())
    }

    /// Ends an epoch now, without waiting for the batch duration, and waits at most
    /// `timeout` until its checkpoint is committed; returns the epoch. The epoch
    /// starts after this call (after the one in flight, if any), so it covers
    /// every record the sources had read when it was called. A query whose
    /// actors have all ended answers with its final checkpoint.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow_runtime::Dataflow;
    /// # use rtflow_runtime::QueryConfig;
    /// # fn start(flow: Dataflow) -> rtflow_runtime::Result<rtflow_runtime::StreamingQuery> {
    /// #     flow.start(QueryConfig::new("now").checkpoint_location(
    /// #         std::env::temp_dir().join(format!("rtflow-doc-now-{}", std::process::id()))))
    /// # }
    /// # let flow = Dataflow::new("now");
    /// # struct Silent;
    /// # impl rtflow_runtime::Source<u32> for Silent {
    /// #     fn kind(&self) -> &str { "memory" }
    /// #     fn partitions(&self) -> rtflow_runtime::Result<usize> { Ok(1) }
    /// #     fn reader(&self, _: &rtflow_runtime::SourceContext)
    /// #         -> rtflow_runtime::Result<Box<dyn rtflow_runtime::SourceReader<u32>>> { Ok(Box::new(Silent)) }
    /// # }
    /// # impl rtflow_runtime::SourceReader<u32> for Silent {
    /// #     fn poll(&mut self, _: &mut rtflow_runtime::SourceOutput<u32>, wait: Duration)
    /// #         -> rtflow_runtime::Result<rtflow_runtime::SourceStatus> {
    /// #         std::thread::sleep(wait);
    /// #         Ok(rtflow_runtime::SourceStatus::Active)
    /// #     }
    /// #     fn offsets(&self) -> rtflow_runtime::connector::Offsets { Default::default() }
    /// # }
    /// # struct Discard;
    /// # impl rtflow_runtime::Sink<u32> for Discard {
    /// #     fn kind(&self) -> &str { "memory" }
    /// #     fn allowlisted(&self) -> bool { true }
    /// #     fn writer(&self, _: &rtflow_runtime::SinkContext)
    /// #         -> rtflow_runtime::Result<Box<dyn rtflow_runtime::SinkWriter<u32>>> { Ok(Box::new(Discard)) }
    /// # }
    /// # impl rtflow_runtime::SinkWriter<u32> for Discard {
    /// #     fn write(&mut self, _: rtflow_runtime::Record<u32>) -> rtflow_runtime::Result<()> { Ok(()) }
    /// # }
    /// # flow.source(Silent).sink(Discard);
    /// // The query's trigger ends an epoch every 5 minutes by default.
    /// let query = start(flow)?;
    /// let first = query.checkpoint_now(Duration::from_secs(10))?;
    /// let second = query.checkpoint_now(Duration::from_secs(10))?;
    /// assert!(second > first);
    /// query.stop()?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn checkpoint_now(&self, timeout: Duration) -> Result<Epoch> {
        let (reply, answer) = mpsc::channel();
        self.coordinator.do_send(CheckpointNow(reply));
        match answer.recv_timeout(timeout) {
            Ok(epoch) => Ok(epoch),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(RtflowError::Checkpoint(format!(
                "no checkpoint committed within {timeout:?} of checkpoint_now()"
            ))),
            // The coordinator ended without answering: the query failed or ended.
            Err(mpsc::RecvTimeoutError::Disconnected) => match self.shared.wait(None) {
                Lifecycle::Terminated(Some(error)) => Err(error),
                _ => self.metrics().checkpoint.map(|c| c.epoch).ok_or_else(|| {
                    RtflowError::Checkpoint("the query ended without a checkpoint".into())
                }),
            },
        }
    }

    /// Hands partitions over inside the run: from the barrier of the next
    /// epoch that starts, the query's stateful instances keep only the key
    /// groups `handover.membership` owns and take on the state
    /// `handover.adopted` carries, without stopping (see
    /// [`Handover`]). Returns that epoch once it
    /// committed: the last checkpoint to carry changes of a group let go.
    ///
    /// For a [`ClusterLink`](crate::cluster::ClusterLink) whose process's
    /// share changes; it needs the query to checkpoint. An instance that
    /// cannot be rebuilt (one of its tables has no
    /// [`image`](crate::state::Table::image)) fails the query, which then
    /// restarts from its last commit.
    pub fn hand_over(&self, handover: Handover, timeout: Duration) -> Result<Epoch> {
        let (reply, answer) = mpsc::channel();
        self.coordinator.do_send(HandOver(handover, reply));
        match answer.recv_timeout(timeout) {
            Ok(epoch) => Ok(epoch),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(RtflowError::Checkpoint(format!(
                "no checkpoint committed within {timeout:?} of a handover"
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(match self.shared.wait(None) {
                Lifecycle::Terminated(Some(error)) => error,
                _ => RtflowError::Checkpoint("the query ended before its handover".into()),
            }),
        }
    }

    /// Abandons the query: it stops the way a killed process stops. Every
    /// actor is cancelled at once, no epoch commits after the last committed
    /// one and no final checkpoint is written; the query terminates with
    /// [`RtflowError::Cancelled`]. Restarting on the same checkpoint location
    /// recovers from the last committed checkpoint. Returns once every thread
    /// is joined.
    ///
    /// A clustered process abandons its run when the group took its
    /// partitions away without asking (its session expired); `rtflow::testing`
    /// crashes queries with it.
    pub fn abandon(&self) {
        if self.is_active() {
            self.coordinator.do_send(Abandon);
        }
        self.shared.wait(None);
        self.join_coordinator();
    }

    /// Waits until the query terminates, or at most `timeout`. Returns whether it
    /// terminated, or the error it failed with.
    pub fn await_termination(&self, timeout: Option<Duration>) -> Result<bool> {
        match self.shared.wait(timeout) {
            Lifecycle::Terminated(Some(error)) => {
                self.join_coordinator();
                Err(error)
            }
            Lifecycle::Terminated(None) => {
                self.join_coordinator();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Like [`await_termination`](Self::await_termination), redrawing a one-line
    /// status on `out` every second: records/s, p99 processing latency since the
    /// start, watermark and epoch.
    pub fn await_with_status(&self, timeout: Duration, mut out: impl Write) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut last_read = self.metrics().records_read();
        let mut last_at = Instant::now();
        loop {
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1));
            let terminated = wait.is_zero() || self.await_termination(Some(wait))?;
            if terminated {
                let _ = writeln!(out);
                return Ok(!self.is_active());
            }
            let metrics = self.metrics();
            let read = metrics.records_read();
            let rate = (read - last_read) as f64 / last_at.elapsed().as_secs_f64();
            (last_read, last_at) = (read, Instant::now());
            let watermark = metrics
                .watermark()
                .map_or_else(|| "-".to_owned(), |w| w.to_string());
            let epoch = self.last_progress().map_or(0, |p| p.batch_id);
            let _ = write!(
                out,
                "\r[{}] {rate:.0} records/s | p99 {:.3} ms | watermark {watermark} | epoch {epoch}   ",
                self.name(),
                metrics.latency.processing.p99,
            );
            let _ = out.flush();
        }
    }

    fn join_coordinator(&self) {
        let thread = self
            .coordinator_thread
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

impl Stoppable for StreamingQuery {
    /// Asks the coordinator to stop the query as [`stop`](Self::stop) does.
    /// The request holds the coordinator weakly: it keeps nothing of an
    /// ended query alive.
    fn stop_request(&self) -> StopRequest {
        let coordinator = self.coordinator.downgrade();
        StopRequest::new(move || {
            if let Some(coordinator) = coordinator.upgrade() {
                coordinator.do_send(StopQuery);
            }
        })
    }
}

impl Drop for StreamingQuery {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

impl std::fmt::Debug for StreamingQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingQuery")
            .field("id", &self.shared.id)
            .field("name", &self.shared.name)
            .field("active", &self.is_active())
            .finish()
    }
}

/// The checkpoint location of a query of one process, opened and recovered
/// unless it is new, and the query's id.
fn open_location(config: &QueryConfig) -> Result<(Location, Recovery, Uuid)> {
    let location = config
        .checkpoint_location
        .clone()
        .expect("validated: a checkpoint location is given");
    if is_new_location(&location) {
        return Ok((Location::New(location), Recovery::default(), Uuid::new_v4()));
    }
    let mut store = CheckpointStore::open(&location, config.checkpoints_retained)?;
    let recovery = store.recover()?;
    for corrupt in &recovery.skipped {
        // Its epoch's output may have been published already: plain
        // sinks see it again; an exactly-once sink that committed it
        // refuses the restart (its commit topic is ahead).
        tracing::warn!(
            %corrupt,
            "passing over a corrupt checkpoint: its epoch is replayed, and plain \
             sinks may receive its output twice"
        );
    }
    let id = store.query_id(|| Uuid::new_v4().to_string())?;
    let id = Uuid::parse_str(&id).map_err(|e| {
        RtflowError::Checkpoint(format!("the stored query id '{id}' is not a UUID: {e}"))
    })?;
    Ok((Location::Opened(Box::new(store)), recovery, id))
}

/// Whether `location` holds nothing yet: a query starting there creates it only
/// once it runs, so that one rejected at start leaves nothing behind.
fn is_new_location(location: &Path) -> bool {
    match std::fs::read_dir(location) {
        Ok(mut entries) => entries.next().is_none(),
        Err(error) => error.kind() == std::io::ErrorKind::NotFound,
    }
}
