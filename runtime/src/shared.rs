//! [`QueryShared`]: what a query's handle, its coordinator and the metrics
//! endpoint share: identity, metrics, lifecycle and the recent progress
//! reports.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::cluster::membership::Membership;
use crate::error::RtflowError;
use crate::metrics::QueryMetrics;
use crate::progress::{ClusterProgress, StreamingQueryListener, StreamingQueryProgress};

/// How many progress reports a query keeps for `recent_progress`.
const RECENT_PROGRESS: usize = 100;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Lifecycle {
    Starting,
    Active,
    Terminated(Option<RtflowError>),
}

/// What the coordinator, the handle and the metrics endpoint share.
pub(crate) struct QueryShared {
    pub(crate) id: Uuid,
    pub(crate) run_id: Uuid,
    pub(crate) name: String,
    pub(crate) metrics: QueryMetrics,
    pub(crate) listeners: Vec<Arc<dyn StreamingQueryListener>>,
    /// In a clustered query, the process's membership: its share, which a
    /// handover inside the run changes.
    pub(crate) cluster: Option<Arc<dyn Membership>>,
    lifecycle: Mutex<Lifecycle>,
    changed: Condvar,
    progress: Mutex<VecDeque<StreamingQueryProgress>>,
}

impl QueryShared {
    /// The process's share of a clustered query as it stands.
    pub(crate) fn cluster_progress(&self) -> Option<ClusterProgress> {
        self.cluster.as_ref().map(|link| ClusterProgress {
            member: link.member(),
            partitions: link.partitions(),
        })
    }

    /// A starting query's shared state, with a new run id.
    pub(crate) fn new(
        id: Uuid,
        name: String,
        listeners: Vec<Arc<dyn StreamingQueryListener>>,
    ) -> Self {
        Self {
            id,
            run_id: Uuid::new_v4(),
            name,
            metrics: QueryMetrics::new(),
            listeners,
            cluster: None,
            lifecycle: Mutex::new(Lifecycle::Starting),
            changed: Condvar::new(),
            progress: Mutex::default(),
        }
    }

    pub(crate) fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        self.lifecycle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn progress(&self) -> MutexGuard<'_, VecDeque<StreamingQueryProgress>> {
        self.progress
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the query runs, and whether it failed.
    pub(crate) fn liveness(&self) -> (bool, bool) {
        match &*self.lifecycle() {
            Lifecycle::Starting | Lifecycle::Active => (true, false),
            Lifecycle::Terminated(failure) => (false, failure.is_some()),
        }
    }

    /// Hands an event to every listener. A listener that panics is logged and
    /// skipped, as Spark's listener bus does: the query goes on.
    pub(crate) fn tell_listeners(&self, event: &str, tell: impl Fn(&dyn StreamingQueryListener)) {
        for listener in &self.listeners {
            let told = crate::guard::catch(|| {
                tell(listener.as_ref());
                Ok(())
            });
            if let Err(panic) = told {
                tracing::error!(
                    query = %self.name,
                    event,
                    panic = crate::guard::message(&*panic),
                    "a query listener panicked"
                );
            }
        }
    }

    /// Keeps a progress report and hands it to the listeners.
    pub(crate) fn publish(&self, progress: StreamingQueryProgress) {
        self.tell_listeners("progress", |listener| listener.on_query_progress(&progress));
        let mut recent = self.progress();
        if recent.len() == RECENT_PROGRESS {
            recent.pop_front();
        }
        recent.push_back(progress);
    }

    pub(crate) fn activate(&self) {
        *self.lifecycle() = Lifecycle::Active;
        self.changed.notify_all();
    }

    pub(crate) fn terminate(&self, failure: Option<RtflowError>) {
        *self.lifecycle() = Lifecycle::Terminated(failure);
        self.changed.notify_all();
    }

    /// Waits until the query terminates or `timeout` passes; returns the
    /// lifecycle then.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Lifecycle {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut lifecycle = self.lifecycle();
        loop {
            if matches!(*lifecycle, Lifecycle::Terminated(_)) {
                return lifecycle.clone();
            }
            lifecycle = match deadline {
                None => self
                    .changed
                    .wait(lifecycle)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return lifecycle.clone();
                    }
                    self.changed
                        .wait_timeout(lifecycle, left)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
            };
        }
    }
}
