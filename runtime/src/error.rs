//! The one error type of rtflow.
//!
//! Every failure a user can meet is a variant of [`RtflowError`]. Start-time
//! validation failures carry the error class of Spark's Real-time Mode (see
//! `error_class()`), and every message says what to change.

use std::fmt;

/// Shorthand used across rtflow.
pub type Result<T, E = RtflowError> = std::result::Result<T, E>;

/// The error type of every fallible rtflow call.
///
/// Later versions may add variants, and fields to the variants rtflow alone
/// makes (the start-time checks, `StartTimeout`, `Internal`, ...): match
/// with a wildcard arm, and on those variants' fields with `..`, or use
/// [`error_class`](Self::error_class).
///
/// ```
/// use rtflow_runtime::RtflowError;
/// let err = RtflowError::CheckpointLocationRequired;
/// assert_eq!(err.error_class(), "CHECKPOINT_LOCATION_REQUIRED");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RtflowError {
    /// Real-time mode only emits updated rows; other output modes are rejected.
    #[error(
        "output mode {mode} is not supported in real-time mode; \
         use OutputMode::Update (QueryConfig::output_mode)"
    )]
    OutputModeNotSupported { mode: String },

    /// Every query needs somewhere to keep its checkpoints.
    #[error(
        "a checkpoint location is required; \
         set one with QueryConfig::checkpoint_location(\"/path/to/dir\")"
    )]
    CheckpointLocationRequired,

    /// The real-time trigger's batch duration is malformed or too short.
    #[non_exhaustive]
    #[error("invalid real-time trigger interval '{interval}': {reason}")]
    InvalidTriggerInterval { interval: String, reason: String },

    /// An operator or sink outside the real-time allowlist.
    #[non_exhaustive]
    #[error(
        "{what} '{name}' is not in the real-time mode allowlist; use a supported \
         operator or sink, or disable the check with QueryConfig::allowlist_check(false) \
         at your own risk"
    )]
    OperatorOrSinkNotInAllowlist { what: &'static str, name: String },

    /// A source that cannot be read continuously.
    #[non_exhaustive]
    #[error(
        "source '{source_name}' does not support real-time reading; \
         use a source that does (kafka, memory, generator)"
    )]
    InputStreamNotSupported { source_name: String },

    /// A sink that cannot be written record by record.
    #[non_exhaustive]
    #[error(
        "sink '{sink}' does not support real-time writing; \
         use a supported sink (kafka, foreach, console, memory)"
    )]
    SinkNotSupported { sink: String },

    /// `union` of streams that come from the same source.
    #[non_exhaustive]
    #[error(
        "union reads source '{source_name}' more than once; create a separate source \
         for each input of the union instead"
    )]
    IdenticalSourcesInUnion { source_name: String },

    /// A shuffle (`key_by`) placed before `with_watermark`.
    #[non_exhaustive]
    #[error(
        "with_watermark on operator '{operator}' follows a shuffle; declare the \
         watermark before key_by, directly on the source stream"
    )]
    ShuffleBeforeWatermark { operator: String },

    /// A stateful operator with more than one shuffle between it and the nearest
    /// watermark or stateful operator upstream.
    #[non_exhaustive]
    #[error(
        "stateful operator '{operator}' is more than one shuffle away from the nearest \
         watermark or stateful operator upstream; key the stream once, directly before \
         the stateful operator"
    )]
    MultipleShuffles { operator: String },

    /// More actors than task slots: real-time mode holds one slot per actor.
    /// `whose` says what needs them (a query, a pipeline and what each of its
    /// flows needs), `fix` how to make them fit.
    #[non_exhaustive]
    #[error(
        "{whose} needs {needed} task slots (one per long-running actor) but only \
         {available} are available; {fix}"
    )]
    InsufficientTaskSlots {
        whose: String,
        needed: usize,
        available: usize,
        fix: String,
    },

    /// A setting that cannot run.
    #[error("invalid configuration: {0}")]
    InvalidConfiguration(String),

    /// A dataflow shape that cannot run (no sink, a stream never consumed, ...).
    #[error("invalid dataflow: {0}")]
    InvalidDataflow(String),

    /// A source failed while being read.
    #[error("source '{source_name}' failed: {message}")]
    Source {
        source_name: String,
        message: String,
    },

    /// A sink failed while being written.
    #[error("sink '{sink}' failed: {message}")]
    Sink { sink: String, message: String },

    /// An operator returned an error or panicked.
    #[error("operator '{operator}' (subtask {subtask}) failed: {message}")]
    Operator {
        operator: String,
        subtask: usize,
        message: String,
    },

    /// A static table could not be loaded.
    #[error("static table '{table}' could not be loaded: {message}")]
    StaticTable { table: String, message: String },

    /// The checkpoint location cannot be opened or written.
    #[error(
        "checkpoint location {path} is unusable: {reason}; choose a writable directory \
         that no other running query uses (QueryConfig::checkpoint_location)"
    )]
    CheckpointLocationUnusable { path: String, reason: String },

    /// A checkpoint could not be written, or none stored is intact.
    #[error("checkpoint failed: {0}")]
    Checkpoint(String),

    /// The dataflow cannot restore the state of its checkpoint: a stateful operator
    /// was removed, its state type changed, or the key-group count changed.
    #[non_exhaustive]
    #[error(
        "the checkpoint does not match the dataflow: {difference}; undo the change, \
         or start on a new checkpoint location"
    )]
    IncompatibleCheckpoint { difference: String },

    /// The processes of one clustered query run different dataflows.
    #[error(
        "this process's dataflow differs from the one process '{member}' of the \
         cluster runs: {difference}; run the same dataflow in every process of a \
         query, or give a changed dataflow another query name"
    )]
    ClusterShapeMismatch { member: String, difference: String },

    /// Another live process joined the clustered query under this process's
    /// instance name and took its place in the groups, as a restart would.
    #[error(
        "another live process joined the cluster as instance '{instance}' and took this \
         process's place; give every process of a query an instance name of its own"
    )]
    ClusterInstanceTaken { instance: String },

    /// The operators were not made and started within
    /// [`QueryConfig::start_timeout`](crate::QueryConfig::start_timeout):
    /// user code in a factory, `on_start`, or a source's or sink's opening
    /// has not returned. The start is abandoned: nothing runs once it returns.
    #[non_exhaustive]
    #[error(
        "the query did not start within {waited}: an operator's factory or on_start, or a \
         source's or sink's opening, has not returned; nothing of the query runs once it \
         does. Make it return, or allow it longer with QueryConfig::start_timeout"
    )]
    StartTimeout { waited: String },

    /// A thread of the engine itself (the coordinator, the `/metrics`
    /// endpoint, a cluster's runner) panicked: a defect of rtflow, not of the
    /// dataflow. The query fails rather than hang without it.
    #[non_exhaustive]
    #[error(
        "internal error on rtflow's thread '{thread}': {message}; the query stopped, and \
         restarts from its last checkpoint; please report this"
    )]
    Internal { thread: String, message: String },

    /// The actor stopped because the query is stopping after another failure.
    #[error("cancelled because the query is stopping")]
    Cancelled,
}

impl RtflowError {
    /// The stable error class string (Spark's where one applies).
    pub fn error_class(&self) -> &'static str {
        match self {
            Self::OutputModeNotSupported { .. } => {
                "STREAMING_REAL_TIME_MODE.OUTPUT_MODE_NOT_SUPPORTED"
            }
            Self::CheckpointLocationRequired => "CHECKPOINT_LOCATION_REQUIRED",
            Self::InvalidTriggerInterval { .. } => {
                "INVALID_STREAMING_REAL_TIME_MODE_TRIGGER_INTERVAL"
            }
            Self::OperatorOrSinkNotInAllowlist { .. } => {
                "STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST"
            }
            Self::InputStreamNotSupported { .. } => {
                "STREAMING_REAL_TIME_MODE.INPUT_STREAM_NOT_SUPPORTED"
            }
            Self::SinkNotSupported { .. } => "STREAMING_REAL_TIME_MODE.SINK_NOT_SUPPORTED",
            Self::IdenticalSourcesInUnion { .. } => {
                "STREAMING_REAL_TIME_MODE.IDENTICAL_SOURCES_IN_UNION_NOT_SUPPORTED"
            }
            Self::ShuffleBeforeWatermark { .. } => "SHUFFLE_NOT_SUPPORTED_BEFORE_WATERMARK",
            Self::MultipleShuffles { .. } => "MULTIPLE_SHUFFLES_NOT_SUPPORTED",
            Self::InsufficientTaskSlots { .. } => "INSUFFICIENT_TASK_SLOTS",
            Self::InvalidConfiguration(_) => "INVALID_CONFIGURATION",
            Self::InvalidDataflow(_) => "INVALID_DATAFLOW",
            Self::Source { .. } => "SOURCE_FAILED",
            Self::Sink { .. } => "SINK_FAILED",
            Self::Operator { .. } => "OPERATOR_FAILED",
            Self::StaticTable { .. } => "STATIC_TABLE_INVALID",
            Self::CheckpointLocationUnusable { .. } => "CHECKPOINT_LOCATION_UNUSABLE",
            Self::Checkpoint(_) => "CHECKPOINT_FAILED",
            Self::IncompatibleCheckpoint { .. } => {
                "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"
            }
            Self::ClusterShapeMismatch { .. } => "CLUSTER_SHAPE_MISMATCH",
            Self::ClusterInstanceTaken { .. } => "CLUSTER_INSTANCE_TAKEN",
            Self::StartTimeout { .. } => "START_TIMEOUT",
            Self::Internal { .. } => "INTERNAL_ERROR",
            Self::Cancelled => "CANCELLED",
        }
    }

    /// Wraps a user error (from a sink writer, a source reader, ...) as a sink failure.
    pub fn sink(sink: impl Into<String>, message: impl fmt::Display) -> Self {
        Self::Sink {
            sink: sink.into(),
            message: message.to_string(),
        }
    }

    /// Wraps a user error as a source failure.
    pub fn source(source_name: impl Into<String>, message: impl fmt::Display) -> Self {
        Self::Source {
            source_name: source_name.into(),
            message: message.to_string(),
        }
    }
}

/// The error type user callbacks (foreach writers, fallible maps) may return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl From<rtflow_checkpoint::StoreError> for RtflowError {
    fn from(error: rtflow_checkpoint::StoreError) -> Self {
        match error {
            rtflow_checkpoint::StoreError::Unusable { path, reason } => {
                Self::CheckpointLocationUnusable {
                    path: path.display().to_string(),
                    reason,
                }
            }
            other => Self::Checkpoint(other.to_string()),
        }
    }
}
