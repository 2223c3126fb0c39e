//! Guards around code that may panic, so that a panic fails the query or its
//! start with a typed error instead of leaving a thread gone and a query
//! waiting for it.
//!
//! Where user code runs on an actor or the coordinator, it runs under the
//! guard of its place: a panic becomes the typed error of that operator,
//! source or sink (with the panic's message, and for start-time code the
//! hook), and an error the code returns is made to say where it came from.
//!
//! Start-time hooks run under `Place::run`, which catches. The per-record
//! hooks run under `Place::watch` instead: catching there would cost a call
//! the compiler cannot inline per record (half the chained throughput), and
//! a guard with a `Drop` would add a landing pad per call (a tenth of a
//! window benchmark's throughput). A
//! watched hook only marks its place as running on the thread, and restores
//! the outer one when it returns; a panic leaves the innermost marked. The
//! actor's loop catches the panic once, outside the records, and fails with
//! that place's error (`blamed`).
//!
//! [`engine`] guards a thread of the engine's own, [`building`] a closure that
//! builds a dataflow.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Result, RtflowError};
use crate::metrics::Role;

/// An operator, source or sink instance: where user code runs.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    pub(crate) role: Role,
    pub(crate) name: String,
    pub(crate) subtask: usize,
}

impl Place {
    pub(crate) fn new(role: Role, name: impl Into<String>, subtask: usize) -> Self {
        Self {
            role,
            name: name.into(),
            subtask,
        }
    }

    /// Runs `hook` of this place's user code. A panic becomes this place's
    /// error; an error it returns is [`located`](Self::locate) here.
    #[inline]
    pub(crate) fn run<T>(&self, hook: &str, body: impl FnOnce() -> Result<T>) -> Result<T> {
        match catch(body) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(locate(error, self)),
            Err(panic) => Err(self.failed(format!("panicked in {hook}: {}", message(&*panic)))),
        }
    }

    /// Runs `hook` of this place's user code without catching: a panic
    /// unwinds on to the actor's loop, which fails with this place's error
    /// ([`blamed`]); an error it returns is [`located`](Self::locate) here.
    #[inline]
    pub(crate) fn watch<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let watch = self.enter();
        let result = body();
        watch.end();
        result.map_err(|error| self.locate(error))
    }

    /// Marks this place's user code as running on this thread, until the
    /// returned watch ends: a panic meanwhile is blamed here ([`blamed`]),
    /// unless a place it enters blames itself.
    #[inline]
    pub(crate) fn enter(&self) -> Watch {
        Watch {
            outer: RUNNING.replace(self),
        }
    }

    /// This place's failure with `message`: `OPERATOR_FAILED`, `SOURCE_FAILED`
    /// or `SINK_FAILED`.
    pub(crate) fn failed(&self, message: String) -> RtflowError {
        match self.role {
            Role::Operator => RtflowError::Operator {
                operator: self.name.clone(),
                subtask: self.subtask,
                message,
            },
            Role::Source => RtflowError::Source {
                source_name: self.name.clone(),
                message: format!("reader {}: {message}", self.subtask),
            },
            Role::Sink | Role::Exchange => RtflowError::Sink {
                sink: self.name.clone(),
                message: format!("writer {}: {message}", self.subtask),
            },
        }
    }

    /// `error` as returned here, made to say where (see [`locate`]). On an
    /// actor's thread, an error located once passes the places it returns
    /// through unchanged: it arose at the first, further downstream.
    #[cold]
    pub(crate) fn locate(&self, error: RtflowError) -> RtflowError {
        if LOCATED.replace(true) {
            return error;
        }
        locate(error, self)
    }
}

/// `error`, made to say that it happened in `place`: the classes whose
/// message names no place keep their class and gain `place` in their message;
/// the others (an operator, source or sink failure, a start-time check) say
/// where already.
fn locate(error: RtflowError, place: &dyn std::fmt::Display) -> RtflowError {
    let at = |message: String| format!("{message} (in {place})");
    match error {
        RtflowError::InvalidConfiguration(message) => {
            RtflowError::InvalidConfiguration(at(message))
        }
        RtflowError::InvalidDataflow(message) => RtflowError::InvalidDataflow(at(message)),
        RtflowError::Checkpoint(message) => RtflowError::Checkpoint(at(message)),
        other => other,
    }
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let role = match self.role {
            Role::Source => "source",
            Role::Operator => "operator",
            Role::Sink | Role::Exchange => "sink",
        };
        write!(f, "{role} '{}', subtask {}", self.name, self.subtask)
    }
}

thread_local! {
    /// Whether an error on its way out of this actor's chain already says
    /// where it arose. Only errors set it: nothing per record.
    static LOCATED: Cell<bool> = const { Cell::new(false) };

    /// The innermost watched place running on this thread: what a panic the
    /// actor's loop catches is blamed on. A panic leaves it as it was when
    /// the panic began. One word, so that marking costs a few instructions
    /// per record (the hook's name would double them).
    static RUNNING: Cell<*const Place> = const { Cell::new(std::ptr::null()) };
}

/// A watched hook running ([`Place::enter`]); [`end`](Self::end) it when the
/// hook returns. Nothing to drop: a panic leaves the hook marked as running.
#[must_use = "end the watch when the hook returns"]
pub(crate) struct Watch {
    outer: *const Place,
}

impl Watch {
    #[inline]
    pub(crate) fn end(self) {
        RUNNING.set(self.outer);
    }
}

/// The error of a panic caught by an actor's loop: the failure of the
/// innermost watched place running when it began, else of `fallback`.
pub(crate) fn blamed(panic: &(dyn Any + Send), fallback: &Place) -> RtflowError {
    let running = RUNNING.replace(std::ptr::null());
    // SAFETY: `running` is null or points to the place of a hook that was
    // running on this thread when the panic began. Places belong to the
    // actor's chain (its operators, outputs and sink) or to its source, which
    // the actor's loop keeps alive until it has turned the panic into this
    // error: unwinding left them as they were.
    let place = unsafe { running.as_ref() }.unwrap_or(fallback);
    place.failed(format!("panicked: {}", message(panic)))
}

/// Runs `body`, catching a panic.
#[inline]
pub(crate) fn catch<T>(body: impl FnOnce() -> Result<T>) -> std::thread::Result<Result<T>> {
    catch_unwind(AssertUnwindSafe(body))
}

/// Runs `body` on the engine's own thread `thread`: a panic becomes
/// `INTERNAL_ERROR` naming the thread, with the panic's message.
///
/// ```
/// use rtflow_runtime::guard::engine;
/// let error = engine::<()>("rtflow-cluster", || panic!("lost the plot")).unwrap_err();
/// assert_eq!(error.error_class(), "INTERNAL_ERROR");
/// assert!(error.to_string().contains("'rtflow-cluster'"));
/// ```
pub fn engine<T>(thread: &str, body: impl FnOnce() -> Result<T>) -> Result<T> {
    catch(body).unwrap_or_else(|panic| Err(internal(thread, &*panic)))
}

/// The `INTERNAL_ERROR` of the engine's thread `thread` that panicked with
/// `panic` (see [`engine`]).
///
/// ```
/// let payload = std::panic::catch_unwind(|| panic!("lost")).unwrap_err();
/// let error = rtflow_runtime::guard::internal("rtflow-cluster", &*payload);
/// assert!(error.to_string().contains("'rtflow-cluster': panicked: lost"));
/// ```
pub fn internal(thread: &str, panic: &(dyn Any + Send)) -> RtflowError {
    RtflowError::Internal {
        thread: thread.to_owned(),
        message: format!("panicked: {}", message(panic)),
    }
}

/// Runs a user's closure that builds a dataflow (a pipeline flow's, a
/// clustered query's), described by `what`: a panic in it becomes
/// `INVALID_DATAFLOW` with the panic's message, and an error it returns says
/// where it came from.
///
/// ```
/// use rtflow_runtime::guard::building;
/// let error = building::<()>("flow 'orders'", || panic!("no such topic")).unwrap_err();
/// assert_eq!(error.error_class(), "INVALID_DATAFLOW");
/// assert!(error.to_string().contains("flow 'orders'"));
/// assert!(error.to_string().contains("no such topic"));
/// ```
pub fn building<T>(what: &str, build: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch(build) {
        Ok(built) => built.map_err(|error| locate(error, &what)),
        Err(panic) => Err(RtflowError::InvalidDataflow(format!(
            "{what}: the closure that builds its dataflow panicked: {}",
            message(&*panic)
        ))),
    }
}

/// The message a panic was raised with, from its payload.
///
/// ```
/// let payload = std::panic::catch_unwind(|| panic!("at {}", 3)).unwrap_err();
/// assert_eq!(rtflow_runtime::guard::message(&*payload), "at 3");
/// ```
pub fn message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_the_failure_of_its_place() {
        let place = Place::new(Role::Sink, "audit", 1);
        let error = place
            .run::<()>("write", || panic!("disk on fire"))
            .unwrap_err();
        assert_eq!(error.error_class(), "SINK_FAILED");
        let message = error.to_string();
        assert!(message.contains("'audit'"), "{message}");
        assert!(
            message.contains("panicked in write: disk on fire"),
            "{message}"
        );
    }

    #[test]
    fn a_panic_through_watched_places_is_blamed_on_the_innermost() {
        let (outer, inner) = (
            Place::new(Role::Operator, "enrich", 0),
            Place::new(Role::Sink, "audit", 0),
        );
        let fallback = Place::new(Role::Operator, "the chain", 0);
        let panic =
            catch::<()>(|| outer.watch(|| inner.watch(|| panic!("disk on fire")))).unwrap_err();
        let error = blamed(&*panic, &fallback);
        assert_eq!(error.error_class(), "SINK_FAILED");
        assert!(error.to_string().contains("'audit'"), "{error}");
        assert!(
            error.to_string().contains("panicked: disk on fire"),
            "{error}"
        );
        // Nothing is left blamed for the next panic, which nothing watched.
        let panic = catch::<()>(|| panic!("elsewhere")).unwrap_err();
        let error = blamed(&*panic, &fallback);
        assert!(error.to_string().contains("'the chain'"), "{error}");
        // A hook that returned blames nothing.
        outer.watch(|| Ok(())).unwrap();
        let panic = catch::<()>(|| panic!("later")).unwrap_err();
        assert!(blamed(&*panic, &fallback)
            .to_string()
            .contains("'the chain'"));
    }

    #[test]
    fn a_returned_error_keeps_its_class_and_gains_its_place() {
        let place = Place::new(Role::Operator, "enrich", 0);
        let error = place
            .run::<()>("process", || {
                Err(RtflowError::InvalidConfiguration("no token".into()))
            })
            .unwrap_err();
        assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
        assert!(error
            .to_string()
            .contains("no token (in operator 'enrich', subtask 0)"));
        let sink = RtflowError::sink("elsewhere", "refused");
        assert_eq!(place.locate(sink.clone()), sink, "already placed");
    }

    #[test]
    fn an_error_from_downstream_passes_through_unchanged() {
        let (upstream, downstream) = (
            Place::new(Role::Operator, "map-1", 0),
            Place::new(Role::Operator, "window-2", 0),
        );
        let error = upstream
            .watch(|| {
                downstream.watch::<()>(|| Err(RtflowError::Checkpoint("cannot encode".into())))
            })
            .unwrap_err();
        let located = "cannot encode (in operator 'window-2', subtask 0)";
        assert_eq!(error, RtflowError::Checkpoint(located.into()));
    }

    #[test]
    fn an_engine_panic_names_its_thread() {
        let error = engine::<()>("rtflow-coord", || panic!("{} went wrong", 42)).unwrap_err();
        assert_eq!(error.error_class(), "INTERNAL_ERROR");
        assert!(error.to_string().contains("'rtflow-coord'"));
        assert!(error.to_string().contains("42 went wrong"));
    }
}
