//! A console sink: prints each row as it arrives, for development.

use std::fmt::Debug;
use std::io::Write;
use std::sync::Arc;

use rtflow_runtime::{Data, Record, Result, RtflowError, Sink, SinkContext, SinkWriter};

type Format<T> = Arc<dyn Fn(&T) -> String + Send + Sync>;

/// Prints one line per row to standard output, prefixed by the writer's partition.
///
/// ```
/// use rtflow_connectors::ConsoleSink;
/// let debug = ConsoleSink::<(u32, String)>::new();
/// let custom = ConsoleSink::with_format(|(id, name): &(u32, String)| format!("{id}: {name}"));
/// ```
pub struct ConsoleSink<T> {
    format: Format<T>,
}

impl<T: Debug> ConsoleSink<T> {
    /// Prints rows with their `Debug` form.
    pub fn new() -> Self {
        Self::with_format(|row: &T| format!("{row:?}"))
    }
}

impl<T: Debug> Default for ConsoleSink<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ConsoleSink<T> {
    /// Prints rows as `format` renders them.
    pub fn with_format(format: impl Fn(&T) -> String + Send + Sync + 'static) -> Self {
        Self {
            format: Arc::new(format),
        }
    }
}

impl<T: Data> Sink<T> for ConsoleSink<T> {
    fn allowlisted(&self) -> bool {
        true
    }

    fn kind(&self) -> &str {
        "console"
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        Ok(Box::new(ConsoleWriter {
            format: self.format.clone(),
            partition: ctx.subtask,
        }))
    }
}

struct ConsoleWriter<T> {
    format: Format<T>,
    partition: usize,
}

impl<T: Data> SinkWriter<T> for ConsoleWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        let line = (self.format)(&record.value);
        writeln!(std::io::stdout().lock(), "[{}] {line}", self.partition)
            .map_err(|error| RtflowError::sink("console", error))
    }
}
