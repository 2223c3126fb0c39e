//! # rtflow-runtime
//!
//! The engine under rtflow. A user builds a [`Dataflow`] of [`Stream`]s; starting it
//! hands the graph to the `coordinator`, an actix actor on its own thread, which
//! validates it ([`plan`]), fuses forward chains of operators into actors, and
//! starts one long-running thread per actor. Actors talk only through bounded
//! `crossbeam-channel` mailbox lanes ([`dispatch`]): a full lane blocks its sender,
//! so backpressure reaches the sources and nothing is dropped or unbounded.
//!
//! How the parts fit:
//!
//! - [`dataflow`]: the builder ([`Dataflow`], [`Stream`], [`KeyedStream`]) of
//!   the logical `graph`.
//! - [`operator`]: the [`Operator`] trait operator authors implement, and the
//!   [`Emit`] chain an actor pushes records through.
//! - [`state`]: checkpointed keyed and per-instance state for operators and sinks,
//!   snapshotted incrementally at each barrier and restored on start.
//! - [`connector`]: the [`Source`] and [`Sink`] traits connectors implement.
//! - [`cluster`]: what a process running one query with others owns, and how
//!   its checkpoints commit into the cluster; the repartition's in-band
//!   watermark rule.
//! - [`pipeline`]: declarative pipelines: named sinks, update flows, one
//!   handle for all.
//! - [`tester`]: one operator instance driven outside a query, for operator
//!   unit tests.
//! - [`plan`]: start-time validation (with Spark's error classes), parallelism,
//!   chaining, slots, and wiring of lanes to operators; `placement`: which CPUs
//!   the query's threads may run on.
//! - `actor`: the two loops an actor runs; `inputs`: watermark minimum and barrier
//!   alignment over an actor's lanes, as pure logic.
//! - [`guard`]: user code and rtflow's own threads run under guards, so a
//!   panic fails the query with a typed error instead of hanging it.
//! - [`shutdown`]: graceful stop of queries on SIGTERM and SIGINT, within a
//!   grace period.
//! - [`query`]: the [`StreamingQuery`] handle; [`metrics`]: counters and latency;
//!   [`progress`]: progress reports and listeners; `endpoint`: Prometheus
//!   `/metrics`.
//!
//! Dependencies point one way: rtflow-operators and rtflow-connectors build on
//! this crate; it knows neither.

mod actor;
mod cancel;
pub mod cluster;
pub mod config;
pub mod connector;
mod coordinator;
pub mod dataflow;
pub mod dispatch;
mod endpoint;
pub mod error;
mod graph;
pub mod guard;
mod inputs;
pub mod key_groups;
pub mod metrics;
pub mod operator;
pub mod pipeline;
mod placement;
pub mod plan;
pub mod progress;
pub mod query;
pub mod record;
mod shared;
pub mod shutdown;
pub mod state;
pub mod table;
pub mod tester;
pub mod watermark;
mod wiring;

pub use config::{OutputMode, QueryConfig, Trigger};
pub use connector::{
    ReaderHandover, Sink, SinkContext, SinkWriter, Source, SourceContext, SourceOutput,
    SourceReader, SourceStatus, SourceWaker,
};
pub use dataflow::{Dataflow, KeyedStream, Stream};
pub use error::{BoxError, Result, RtflowError};
pub use metrics::{LatencyReport, MetricsSnapshot, Percentiles};
pub use operator::{Collector, Emit, Operator, OperatorContext};
pub use progress::{StreamingQueryListener, StreamingQueryProgress, StreamingQueryStatus};
pub use query::StreamingQuery;
pub use record::{Data, Epoch, EventTime, Nanos, Record, RecordMeta};
pub use state::{KeyedState, StateContext, StateSnapshot, SubtaskState};
pub use table::StaticTable;
