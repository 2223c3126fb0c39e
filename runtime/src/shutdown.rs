//! Graceful stop on SIGTERM and SIGINT, the way systemd, Kubernetes and a
//! terminal's Ctrl-C ask a process to end.
//!
//! [`on_signals`] takes the two signals over for the whole process. The
//! first one asks every query handed to [`Shutdown::stop_on_signal`] to stop
//! as its own `stop()` does: sources end their streams, what was read is
//! processed, a final checkpoint commits and a clustered process leaves its
//! groups, so that the others take its partitions at once. The program's
//! wait on the query (`await_termination`, `await_with_status`) then
//! returns, and it stops the query, reports and returns from `main`: the
//! process exits 0. Kafka Streams does the same from a shutdown hook.
//!
//! The stop is bounded, as an orchestrator bounds it
//! (`terminationGracePeriodSeconds`, `TimeoutStopSec`): a second signal, or
//! the [grace period](Shutdown::grace_period) running out, ends the process
//! at once with a message on stderr and a non-zero status (128 + the signal's
//! number for a second signal, as a shell reports a process a signal ended;
//! 1 when the grace period ran out). A process ended so resumes from its last
//! committed checkpoint when it starts again, as after a crash.
//!
//! ```no_run
//! use std::time::Duration;
//! use rtflow_runtime::{shutdown, Dataflow, QueryConfig};
//! # fn build(flow: &Dataflow) {}
//! let shutdown = shutdown::on_signals()?.grace_period(Duration::from_secs(30));
//! let flow = Dataflow::new("counts");
//! build(&flow);
//! let query = flow.start(QueryConfig::new("counts").checkpoint_location("/var/lib/rtflow"))?;
//! shutdown.stop_on_signal(&query);
//! query.await_termination(None)?; // returns once a signal stopped it
//! query.stop()?;
//! println!("records read: {}", query.metrics().records_read());
//! # Ok::<(), rtflow_runtime::RtflowError>(())
//! ```

use std::os::raw::c_int;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::error::{Result, RtflowError};

/// How long a stop may take after the first signal when the program sets no
/// other [grace period](Shutdown::grace_period): Kubernetes' default
/// `terminationGracePeriodSeconds`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// The exit status when the grace period runs out before the stop ends.
pub const GRACE_EXPIRED_STATUS: i32 = 1;

/// Takes SIGTERM and SIGINT over for the process, and returns the handle
/// that stops queries when one arrives.
///
/// Every call returns a handle on the same process-wide state: the signals
/// are taken over once, on the first call. Call it before starting the
/// queries, so that a signal during a long start (a cluster's first
/// rebalance) is not the default kill.
pub fn on_signals() -> Result<Shutdown> {
    static PROCESS: Mutex<Option<Shutdown>> = Mutex::new(None);
    let mut process = PROCESS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(shutdown) = &*process {
        return Ok(shutdown.clone());
    }
    let signals = Signals::new([SIGTERM, SIGINT]).map_err(|error| {
        RtflowError::InvalidConfiguration(format!(
            "could not take SIGTERM and SIGINT over: {error}"
        ))
    })?;
    let shutdown = Shutdown::default();
    let watcher = shutdown.clone();
    std::thread::Builder::new()
        .name("rtflow-signals".into())
        .spawn(move || watcher.watch(signals))
        .map_err(|error| {
            RtflowError::InvalidConfiguration(format!("could not start the signal thread: {error}"))
        })?;
    Ok(process.insert(shutdown).clone())
}

/// Stops queries when SIGTERM or SIGINT arrives, within a grace period; see
/// the [module](self). Cloning it gives another handle on the same state.
#[derive(Clone, Default)]
pub struct Shutdown {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    grace: Option<Duration>,
    escalation: Escalation,
    /// Sent at the first signal; sent at once to a query handed over later.
    stops: Vec<StopRequest>,
}

impl Shutdown {
    /// How long the process may take to stop after the first signal before
    /// it ends at once ([`DEFAULT_GRACE_PERIOD`] unless set). Give the
    /// orchestrator a longer bound (systemd's `TimeoutStopSec`, Kubernetes'
    /// `terminationGracePeriodSeconds`), so that the process reports why it
    /// ended rather than being killed.
    pub fn grace_period(self, grace: Duration) -> Self {
        self.lock().grace = Some(grace);
        self
    }

    /// Stops `query` (a [`StreamingQuery`](crate::StreamingQuery), a
    /// [`RunningPipeline`](crate::pipeline::RunningPipeline), a clustered
    /// query) at the first signal, or at once if one already came. The
    /// request returns at once: the program's wait on the query returns when
    /// the query has stopped.
    pub fn stop_on_signal(&self, query: &impl Stoppable) {
        let stop = query.stop_request();
        let mut state = self.lock();
        if state.escalation.stopping() {
            drop(state);
            stop.send();
        } else {
            state.stops.push(stop);
        }
    }

    /// Whether a signal asked the process to stop.
    pub fn is_requested(&self) -> bool {
        self.lock().escalation.stopping()
    }

    /// Serves the signals for the life of the process.
    fn watch(&self, mut signals: Signals) {
        for signal in signals.forever() {
            match self.on_signal(signal) {
                Step::Stop { message, grace } => {
                    eprintln!("{message}");
                    bound(grace);
                }
                Step::Exit { status, message } => {
                    eprintln!("{message}");
                    std::process::exit(status);
                }
            }
        }
    }

    /// What `signal` asks for; the first one sends every stop request.
    fn on_signal(&self, signal: c_int) -> Step {
        let mut state = self.lock();
        let grace = state.grace.unwrap_or(DEFAULT_GRACE_PERIOD);
        let step = state.escalation.on_signal(signal, grace);
        let stops = std::mem::take(&mut state.stops);
        drop(state);
        stops.iter().for_each(StopRequest::send);
        step
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Ends the process once `grace` has passed, unless it ended before.
fn bound(grace: Duration) {
    let spawned = std::thread::Builder::new()
        .name("rtflow-grace".into())
        .spawn(move || {
            std::thread::sleep(grace);
            eprintln!("{}", grace_expired(grace));
            std::process::exit(GRACE_EXPIRED_STATUS);
        });
    if let Err(error) = spawned {
        // Unbounded, the stop still ends; a second signal still ends it.
        eprintln!("rtflow: could not bound the stop by the grace period: {error}");
    }
}

/// A query that a [`Shutdown`] can stop.
pub trait Stoppable {
    /// A request that asks the query to stop as its `stop()` does, without
    /// waiting for it; sent once the query ended, it does nothing.
    fn stop_request(&self) -> StopRequest;
}

/// Asks a query to stop from another thread; see [`Stoppable`].
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use rtflow_runtime::shutdown::StopRequest;
///
/// let stopped = Arc::new(AtomicBool::new(false));
/// let flag = stopped.clone();
/// let request = StopRequest::new(move || flag.store(true, Ordering::SeqCst));
/// request.send();
/// assert!(stopped.load(Ordering::SeqCst));
/// ```
#[derive(Clone)]
pub struct StopRequest(Arc<dyn Fn() + Send + Sync>);

impl StopRequest {
    /// A request that calls `ask`, which must return at once.
    pub fn new(ask: impl Fn() + Send + Sync + 'static) -> Self {
        Self(Arc::new(ask))
    }

    /// Asks the query to stop.
    pub fn send(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for StopRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StopRequest")
    }
}

/// The signals a process received, and what each asks for.
#[derive(Debug, Default)]
struct Escalation {
    first: Option<c_int>,
}

/// What a signal asks for.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Stop gracefully within `grace`.
    Stop { message: String, grace: Duration },
    /// End the process at once.
    Exit { status: i32, message: String },
}

impl Escalation {
    fn on_signal(&mut self, signal: c_int, grace: Duration) -> Step {
        let name = signal_name(signal);
        match self.first.replace(signal) {
            None => Step::Stop {
                message: format!(
                    "rtflow: {name} received: stopping with a final checkpoint \
                     (at most {grace:?}; a second signal ends the process at once)"
                ),
                grace,
            },
            Some(_) => Step::Exit {
                // A shell's status for a process a signal ended.
                status: 128 + signal,
                message: format!(
                    "rtflow: second signal ({name}) during the stop: exiting at once; \
                     the next start resumes from the last committed checkpoint"
                ),
            },
        }
    }

    fn stopping(&self) -> bool {
        self.first.is_some()
    }
}

fn grace_expired(grace: Duration) -> String {
    format!(
        "rtflow: the stop took longer than its grace period of {grace:?}: exiting at once \
         with status {GRACE_EXPIRED_STATUS}; the next start resumes from the last committed \
         checkpoint"
    )
}

fn signal_name(signal: c_int) -> String {
    signal_hook::low_level::signal_name(signal)
        .map_or_else(|| format!("signal {signal}"), str::to_owned)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn the_first_signal_stops_within_the_grace_period_and_a_second_exits_at_once() {
        let grace = Duration::from_secs(7);
        let mut escalation = Escalation::default();
        match escalation.on_signal(SIGTERM, grace) {
            Step::Stop { message, grace: g } => {
                assert_eq!(g, grace);
                assert!(message.contains("SIGTERM received"), "{message}");
            }
            exit => panic!("the first signal exits: {exit:?}"),
        }
        assert!(escalation.stopping());
        match escalation.on_signal(SIGINT, grace) {
            Step::Exit { status, message } => {
                assert_eq!(status, 130);
                assert!(message.contains("second signal (SIGINT)"), "{message}");
            }
            stop => panic!("the second signal does not exit: {stop:?}"),
        }
        let second_term = escalation.on_signal(SIGTERM, grace);
        assert!(matches!(second_term, Step::Exit { status: 143, .. }));
    }

    #[test]
    fn a_signal_stops_every_query_handed_over_and_those_handed_over_after_it() {
        let shutdown = Shutdown::default().grace_period(Duration::from_secs(3));
        let sent = Arc::new(AtomicUsize::new(0));
        struct Counted(Arc<AtomicUsize>);
        impl Stoppable for Counted {
            fn stop_request(&self) -> StopRequest {
                let sent = self.0.clone();
                StopRequest::new(move || {
                    sent.fetch_add(1, Ordering::SeqCst);
                })
            }
        }
        shutdown.stop_on_signal(&Counted(sent.clone()));
        shutdown.stop_on_signal(&Counted(sent.clone()));
        assert_eq!(sent.load(Ordering::SeqCst), 0);
        assert!(!shutdown.is_requested());

        let step = shutdown.on_signal(SIGTERM);
        assert!(matches!(step, Step::Stop { grace, .. } if grace == Duration::from_secs(3)));
        assert_eq!(sent.load(Ordering::SeqCst), 2);
        assert!(shutdown.is_requested());
        shutdown.stop_on_signal(&Counted(sent.clone()));
        assert_eq!(sent.load(Ordering::SeqCst), 3, "a late query stops at once");

        assert!(matches!(shutdown.on_signal(SIGTERM), Step::Exit { .. }));
        assert_eq!(sent.load(Ordering::SeqCst), 3, "each request is sent once");
    }

    #[test]
    fn the_grace_period_message_names_the_status() {
        let message = grace_expired(Duration::from_secs(30));
        assert!(message.contains("30s"), "{message}");
        assert!(message.contains("status 1"), "{message}");
    }
}
