//! [`StreamingQuery`]: the handle on a started dataflow.

use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use actix::{Actor, Addr};
use uuid::Uuid;

use crate::config::QueryConfig;
use crate::coordinator::{Coordinator, Startup, StopQuery};
use crate::error::{Result, RtflowError};
use crate::graph::Graph;
use crate::metrics::{MetricsSnapshot, QueryMetrics};

#[derive(Debug, Clone, PartialEq)]
enum Lifecycle {
    Starting,
    Active,
    Terminated(Option<RtflowError>),
}

/// What the coordinator and the handle share.
pub(crate) struct QueryShared {
    pub(crate) name: String,
    pub(crate) metrics: QueryMetrics,
    lifecycle: Mutex<Lifecycle>,
    changed: Condvar,
}

impl QueryShared {
    fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        self.lifecycle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn activate(&self) {
        *self.lifecycle() = Lifecycle::Active;
        self.changed.notify_all();
    }

    pub(crate) fn terminate(&self, failure: Option<RtflowError>) {
        *self.lifecycle() = Lifecycle::Terminated(failure);
        self.changed.notify_all();
    }
}

/// A running query: its identity, status, metrics, and how to stop it.
///
/// Dropping the handle stops the query and joins its threads.
pub struct StreamingQuery {
    id: Uuid,
    run_id: Uuid,
    shared: Arc<QueryShared>,
    coordinator: Addr<Coordinator>,
    coordinator_thread: Mutex<Option<JoinHandle<()>>>,
}

impl StreamingQuery {
    pub(crate) fn launch(graph: Graph, config: QueryConfig) -> Result<Self> {
        let shared = Arc::new(QueryShared {
            name: config.name.clone(),
            metrics: QueryMetrics::new(),
            lifecycle: Mutex::new(Lifecycle::Starting),
            changed: Condvar::new(),
        });
        let (started_tx, started_rx) = mpsc::channel();
        let (address_tx, address_rx) = mpsc::channel();
        let coordinator_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rtflow-coord".into())
            .spawn(move || {
                let system = actix::System::new();
                system.block_on(async move {
                    let startup = Startup {
                        graph,
                        config,
                        started: started_tx,
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
        let started = started_rx.recv().unwrap_or(Err(RtflowError::Cancelled));
        let query = Self {
            id: Uuid::new_v4(),
            run_id: Uuid::new_v4(),
            shared,
            coordinator,
            coordinator_thread: Mutex::new(Some(thread)),
        };
        match started {
            Ok(()) => Ok(query),
            Err(error) => {
                query.join_coordinator();
                Err(error)
            }
        }
    }

    /// The query's id.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The id of this run of the query.
    pub fn run_id(&self) -> Uuid {
        self.run_id
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

    /// A copy of the query's counters and latency percentiles.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// Stops the query: sources end their streams, every record already read is
    /// processed by the sinks, and every thread is joined before this returns.
    pub fn stop(&self) -> Result<()> {
        if self.is_active() {
            self.coordinator.do_send(StopQuery);
        }
        self.wait(None);
        self.join_coordinator();
        Ok(())
    }

    /// Waits until the query terminates, or at most `timeout`. Returns whether it
    /// terminated, or the error it failed with.
    pub fn await_termination(&self, timeout: Option<Duration>) -> Result<bool> {
        match self.wait(timeout) {
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

    fn wait(&self, timeout: Option<Duration>) -> Lifecycle {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut lifecycle = self.shared.lifecycle();
        loop {
            if matches!(*lifecycle, Lifecycle::Terminated(_)) {
                return lifecycle.clone();
            }
            lifecycle = match deadline {
                None => self
                    .shared
                    .changed
                    .wait(lifecycle)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return lifecycle.clone();
                    }
                    self.shared
                        .changed
                        .wait_timeout(lifecycle, left)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
            };
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

impl Drop for StreamingQuery {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

impl std::fmt::Debug for StreamingQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingQuery")
            .field("id", &self.id)
            .field("name", &self.shared.name)
            .field("active", &self.is_active())
            .finish()
    }
}
