//! # rtflow
//!
//! A real-time streaming dataflow runtime: records flow from source to sink the
//! moment they arrive, through long-running actors linked by bounded mailboxes,
//! while a checkpoint interval (the trigger's batch duration) decides only how
//! often progress is made durable.
//!
//! This crate is the facade. It re-exports the crates that do the work:
//! [`runtime`] (graph, actors, coordinator, query), [`operators`] (map, filter,
//! joins, ...), [`connectors`] (Kafka, memory, generator, console, foreach, ...)
//! and [`checkpoint`] (the checkpoint store and commit protocol).
//! `use rtflow::prelude::*` brings in everything a dataflow needs;
//! [`logging`] sets up logs for a program, and [`shutdown`] stops its
//! queries gracefully on SIGTERM and SIGINT. With the
//! `testing` feature, `rtflow::testing` is a property-based harness for testing
//! dataflows (crashes and restores included) against a batch reference.
//!
//! ```
//! use std::time::Duration;
//! use rtflow::prelude::*;
//!
//! let flow = Dataflow::new("doubler");
//! let input = MemorySource::new(2);
//! let output = MemorySink::new();
//! flow.source(input.clone())
//!     .map(|x: u64| x * 2)
//!     .filter(|x| x % 3 != 0)
//!     .sink(output.clone());
//!
//! let dir = std::env::temp_dir().join(format!("rtflow-doc-doubler-{}", std::process::id()));
//! let query = flow.start(QueryConfig::new("doubler").checkpoint_location(dir))?;
//! input.push_all(0, [1, 2, 3])?;
//! input.push_all(1, [4, 5])?;
//! input.end();
//! query.await_termination(Some(Duration::from_secs(10)))?;
//!
//! let mut rows = output.rows();
//! rows.sort();
//! assert_eq!(rows, vec![2, 4, 8, 10]);
//! # Ok::<(), rtflow::RtflowError>(())
//! ```

pub use rtflow_checkpoint as checkpoint;
pub use rtflow_connectors as connectors;
pub use rtflow_operators as operators;
pub use rtflow_runtime as runtime;

pub mod logging;
pub use rtflow_runtime::shutdown;
#[cfg(feature = "testing")]
pub mod testing;

pub use rtflow_runtime::{
    BoxError, Collector, Data, Dataflow, KeyedStream, LatencyReport, MetricsSnapshot, Operator,
    OperatorContext, OutputMode, Percentiles, QueryConfig, Record, RecordMeta, Result, RtflowError,
    StaticTable, Stream, StreamingQuery, Trigger,
};

/// Everything a dataflow program needs, in one import.
pub mod prelude {
    pub use rtflow_connectors::kafka::{
        ClusteredQuery, DeliveryGuarantee, KafkaAdmin, KafkaCluster, KafkaMessage, KafkaRecord,
        KafkaSink, KafkaSource, StartingOffsets,
    };
    pub use rtflow_connectors::{
        ConsoleSink, CsvTable, ForeachSink, ForeachWriter, GeneratorSource, MemorySink,
        MemorySource,
    };
    pub use rtflow_operators::process::{KeyedProcessExt, KeyedProcessor, ProcessContext, Timer};
    pub use rtflow_operators::{AggregateFunction, Window, WindowExt};
    pub use rtflow_operators::{DedupExt, Either, JoinWindow, StreamJoinExt};
    pub use rtflow_operators::{KeyedStreamExt, StreamExt};
    pub use rtflow_runtime::pipeline::{NamedSink, Pipeline, RunningPipeline};
    pub use rtflow_runtime::shutdown::{Shutdown, Stoppable};
    pub use rtflow_runtime::{
        BoxError, Collector, Data, Dataflow, KeyedStream, Operator, OperatorContext, OutputMode,
        QueryConfig, Record, Result, RtflowError, StaticTable, Stream, StreamingQuery, Trigger,
    };
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The guide's and the reference's examples, compiled as doc tests (and
/// run, where they need no Kafka broker).
#[cfg(doctest)]
mod guide_doctests {
    #[doc = include_str!("../docs/guide/getting-started.md")]
    struct GettingStarted;
    #[doc = include_str!("../docs/guide/kafka.md")]
    struct Kafka;
    #[doc = include_str!("../docs/guide/state-and-event-time.md")]
    struct StateAndEventTime;
    #[doc = include_str!("../docs/guide/cluster.md")]
    struct Cluster;
    #[doc = include_str!("../docs/guide/operations.md")]
    struct Operations;
    #[doc = include_str!("../docs/reference/topics.md")]
    struct Topics;
}
