//! # rtflow-connectors
//!
//! Sources and sinks, each implementing the runtime's
//! [`Source`](rtflow_runtime::Source) / [`Sink`](rtflow_runtime::Sink) traits:
//!
//! - [`MemorySource`] / [`MemorySink`]: feed and read a query from code.
//! - [`GeneratorSource`]: deterministic rows at a fixed or unlimited rate.
//! - [`ConsoleSink`]: prints rows as they arrive.
//! - [`ForeachSink`]: hands rows to a user [`ForeachWriter`].
//! - [`kafka`]: Apache Kafka source and sink (rdkafka), and topic administration.
//! - [`CsvTable`]: loads a [`StaticTable`](rtflow_runtime::StaticTable) for
//!   stream-static joins from a CSV file.

mod console;
mod foreach;
mod generator;
pub mod kafka;
mod memory;
mod static_table;

pub use console::ConsoleSink;
pub use foreach::{ForeachSink, ForeachWriter};
pub use generator::GeneratorSource;
pub use memory::{MemorySink, MemorySource};
pub use static_table::CsvTable;
