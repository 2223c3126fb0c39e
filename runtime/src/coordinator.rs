//! The coordinator: the control-plane actor of one query. It validates and plans
//! the dataflow, starts one thread per actor, notices actors exit, and stops the
//! query on `stop()` or on the first failure.
//!
//! It is an actix actor on a thread of its own with its own `System`, so queries
//! behave the same inside or outside a user's async runtime. Only low-rate control
//! messages go through it; records never do.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::SystemTime;

use actix::{Actor, ActorContext, AsyncContext, Context, Handler, Message, System};

use crate::actor::ActorEnv;
use crate::config::QueryConfig;
use crate::error::{Result, RtflowError};
use crate::graph::Graph;
use crate::plan::{validate, ActorSpec, Plan};
use crate::progress::{timestamp, ProgressTracker, QueryStartedEvent, QueryTerminatedEvent};
use crate::query::QueryShared;
use crate::record::Epoch;

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

/// What the coordinator needs to start a query, and where to say whether it did.
pub(crate) struct Startup {
    pub(crate) graph: Graph,
    pub(crate) config: QueryConfig,
    pub(crate) started: mpsc::Sender<Result<()>>,
}

pub(crate) struct Coordinator {
    shared: Arc<QueryShared>,
    startup: Option<Startup>,
    env: ActorEnv,
    threads: Vec<JoinHandle<()>>,
    running: usize,
    failure: Option<RtflowError>,
    progress: Option<ProgressTracker>,
    /// The current checkpoint epoch.
    epoch: Epoch,
}

impl Coordinator {
    pub(crate) fn new(shared: Arc<QueryShared>, startup: Startup) -> Self {
        let env = ActorEnv {
            cancel: Arc::default(),
            stop: Arc::default(),
            max_records: startup.config.max_records_per_message,
            source_metrics: None,
        };
        Self {
            shared,
            startup: Some(startup),
            env,
            threads: Vec::new(),
            running: 0,
            failure: None,
            progress: None,
            epoch: 0,
        }
    }

    fn start_actors(
        &mut self,
        graph: Graph,
        config: &QueryConfig,
        ctx: &Context<Self>,
    ) -> Result<()> {
        let _span = tracing::info_span!("start", query = %config.name).entered();
        config.validate()?;
        validate(&graph, config)?;
        self.progress = Some(ProgressTracker::new(
            &self.shared,
            graph.source_descriptions(),
            graph.sink_descriptions(),
        ));
        let plan = Plan::new(graph, config)?;
        let actors = plan.wire(config, &self.shared.metrics, &self.env)?;
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
                    self.env.cancel.store(true, Ordering::Relaxed);
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

    fn join_threads(&mut self) {
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }

    fn publish_progress(&mut self) {
        if let Some(tracker) = &mut self.progress {
            let progress = tracker.report(&self.shared.metrics, self.epoch);
            self.shared.publish(progress);
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
        for listener in &self.shared.listeners {
            listener.on_query_terminated(&event);
        }
    }
}

/// Runs one actor body; a panic becomes the actor's error, message included.
fn run_actor(actor: ActorSpec) -> Result<()> {
    let ActorSpec {
        label,
        subtask,
        main,
    } = actor;
    catch_unwind(AssertUnwindSafe(main)).unwrap_or_else(|panic| {
        Err(RtflowError::Operator {
            operator: label,
            subtask,
            message: format!("panicked: {}", panic_message(&panic)),
        })
    })
}

fn panic_message(panic: &Box<dyn Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

impl Actor for Coordinator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let Startup {
            graph,
            config,
            started,
        } = self.startup.take().expect("started once");
        match self.start_actors(graph, &config, ctx) {
            Ok(()) => {
                self.shared.activate();
                let _ = started.send(Ok(()));
                let event = QueryStartedEvent {
                    id: self.shared.id.to_string(),
                    run_id: self.shared.run_id.to_string(),
                    name: self.shared.name.clone(),
                    timestamp: timestamp(SystemTime::now()),
                };
                for listener in &self.shared.listeners {
                    listener.on_query_started(&event);
                }
                ctx.run_interval(config.progress_interval, |coordinator, _| {
                    coordinator.publish_progress()
                });
            }
            Err(error) => {
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
            if error != RtflowError::Cancelled && self.failure.is_none() {
                tracing::error!(%error, "actor failed; stopping the query");
                self.failure = Some(error);
                self.env.cancel.store(true, Ordering::Relaxed);
            }
        }
        if self.running == 0 {
            self.join_threads();
            let _span = tracing::info_span!("stop", query = %self.shared.name).entered();
            tracing::info!(failed = self.failure.is_some(), "query terminated");
            self.publish_progress();
            let failure = self.failure.take();
            self.terminate(failure);
            ctx.stop();
        }
    }
}

impl Handler<StopQuery> for Coordinator {
    type Result = ();

    fn handle(&mut self, _: StopQuery, _ctx: &mut Context<Self>) {
        tracing::info!(query = %self.shared.name, "stopping: ending source streams");
        self.env.stop.store(true, Ordering::Relaxed);
    }
}
