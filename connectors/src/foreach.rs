//! The foreach sink: hands every row to user code, one [`ForeachWriter`] per sink
//! partition, opened and closed per epoch as in Spark.

use std::sync::Arc;

use rtflow_runtime::{
    BoxError, Data, Epoch, Record, Result, RtflowError, Sink, SinkContext, SinkWriter,
};

/// User code that writes rows to an external system.
pub trait ForeachWriter<T>: Send {
    /// Called when the writer starts epoch `epoch_id` on partition `partition_id`.
    /// Epochs are numbered across restarts (the first run's first is 1, a
    /// restarted run's the one after the restored checkpoint), so returning false
    /// for an epoch already written skips rows written before a restart.
    fn open(&mut self, _partition_id: usize, _epoch_id: Epoch) -> bool {
        true
    }

    /// Writes one row. An error fails the query.
    fn process(&mut self, value: T) -> Result<(), BoxError>;

    /// Called at the end of every epoch with `None`, or with the error that is
    /// failing the query (whichever actor it came from).
    fn close(&mut self, _error: Option<&RtflowError>) {}
}

type MakeWriter<T> = Arc<dyn Fn() -> Box<dyn ForeachWriter<T>> + Send + Sync>;

/// A sink that runs a [`ForeachWriter`] per partition.
///
/// ```
/// use rtflow_connectors::ForeachSink;
/// let sink = ForeachSink::from_fn(|value: u64| {
///     if value == u64::MAX {
///         return Err("overflow".into());
///     }
///     Ok(())
/// });
/// ```
pub struct ForeachSink<T> {
    make: MakeWriter<T>,
}

impl<T: Data> ForeachSink<T> {
    /// A sink whose writers `make` creates, one per sink partition.
    pub fn new<W: ForeachWriter<T> + 'static>(
        make: impl Fn() -> W + Send + Sync + 'static,
    ) -> Self {
        Self {
            make: Arc::new(move || Box::new(make())),
        }
    }

    /// A sink that calls `process` for every row.
    pub fn from_fn(process: impl Fn(T) -> Result<(), BoxError> + Send + Sync + 'static) -> Self {
        let process = Arc::new(process);
        Self::new(move || FnWriter(process.clone()))
    }
}

struct FnWriter<F>(Arc<F>);

impl<T, F: Fn(T) -> Result<(), BoxError> + Send + Sync> ForeachWriter<T> for FnWriter<F> {
    fn process(&mut self, value: T) -> Result<(), BoxError> {
        (self.0)(value)
    }
}

impl<T: Data> Sink<T> for ForeachSink<T> {
    fn allowlisted(&self) -> bool {
        true
    }

    fn kind(&self) -> &str {
        "foreach"
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        let mut writer = (self.make)();
        let open = writer.open(ctx.subtask, ctx.first_epoch);
        Ok(Box::new(ForeachAdapter {
            writer,
            sink: ctx.name.clone(),
            partition: ctx.subtask,
            open,
        }))
    }
}

struct ForeachAdapter<T> {
    writer: Box<dyn ForeachWriter<T>>,
    /// The sink's name, for the writer's errors.
    sink: String,
    partition: usize,
    /// Whether `open` accepted the current epoch.
    open: bool,
}

impl<T: Data> SinkWriter<T> for ForeachAdapter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        if !self.open {
            return Ok(());
        }
        self.writer
            .process(record.value)
            .map_err(|error| RtflowError::sink(&self.sink, error))
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.writer.close(None);
        self.open = self.writer.open(self.partition, epoch + 1);
        Ok(())
    }

    fn close(&mut self, error: Option<&RtflowError>) -> Result<()> {
        self.writer.close(error);
        Ok(())
    }
}
