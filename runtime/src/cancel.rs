//! [`Cancel`]: the flag a failing query raises so that every actor exits at once,
//! with the failure that raised it, so sinks closing on the way out can say why.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::error::RtflowError;

/// How long [`Cancel::explain`] waits for the coordinator to name a failure.
const CAUSE_WAIT: Duration = Duration::from_secs(5);

/// Shared by the coordinator and every actor of one query.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cancel(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    raised: AtomicBool,
    cause: OnceLock<RtflowError>,
}

impl Cancel {
    /// Raises the flag; `cause` is the failure that stops the query (none for a
    /// simulated crash). The first cause given stays.
    pub(crate) fn raise(&self, cause: Option<RtflowError>) {
        if let Some(cause) = cause {
            let _ = self.0.cause.set(cause);
        }
        self.0.raised.store(true, Ordering::Release);
    }

    /// Whether the query is being cancelled: the hot-path check, one relaxed load.
    #[inline]
    pub(crate) fn is_raised(&self) -> bool {
        self.0.raised.load(Ordering::Relaxed)
    }

    /// The error an actor stopped by `error` should report to its sink: the
    /// failure that cancelled the query when `error` is only the cancellation.
    /// An actor whose input lane broke because the actor feeding it failed is
    /// cancelled before the coordinator has heard of that failure: it waits for
    /// the coordinator to raise the flag, at most [`CAUSE_WAIT`]. Only a failing
    /// query takes this path.
    pub(crate) fn explain<'a>(&'a self, error: &'a RtflowError) -> &'a RtflowError {
        if *error != RtflowError::Cancelled {
            return error;
        }
        let deadline = Instant::now() + CAUSE_WAIT;
        while !self.0.raised.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return error;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.0.cause.get().unwrap_or(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancelled_actor_learns_the_failure_that_cancelled_it() {
        let cancel = Cancel::default();
        let failure = RtflowError::sink("s", "disk full");
        let raiser = cancel.clone();
        let cause = failure.clone();
        // The coordinator hears of the failure after the actor was cancelled.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            raiser.raise(Some(cause));
        });
        assert_eq!(cancel.explain(&RtflowError::Cancelled), &failure);
        late.join().unwrap();
        cancel.raise(Some(RtflowError::sink("s", "later")));
        assert!(cancel.is_raised());
        assert_eq!(cancel.explain(&RtflowError::Cancelled), &failure);
        let own = RtflowError::sink("t", "own failure");
        assert_eq!(cancel.explain(&own), &own, "an actor's own error stays");
    }

    #[test]
    fn a_crash_cancels_without_a_cause() {
        let cancel = Cancel::default();
        cancel.raise(None);
        assert!(cancel.is_raised());
        assert_eq!(
            cancel.explain(&RtflowError::Cancelled),
            &RtflowError::Cancelled
        );
    }
}
