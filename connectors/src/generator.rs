//! A generator source: rows made from their (partition, offset), at a fixed rate or
//! as fast as the query takes them. The same offsets always give the same rows, so
//! a replay from a checkpoint yields the same input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rtflow_runtime::connector::{numbered_offsets, Offsets};
use rtflow_runtime::record::now_nanos;
use rtflow_runtime::{
    Data, Result, RtflowError, Source, SourceContext, SourceOutput, SourceReader, SourceStatus,
};

type MakeRow<T> = Arc<dyn Fn(usize, u64) -> T + Send + Sync>;

/// Generates rows with `make(partition, offset)`.
///
/// ```
/// use rtflow_connectors::GeneratorSource;
/// let source = GeneratorSource::new(|partition, offset| format!("p{partition}-{offset}"))
///     .partitions(2)
///     .rows_per_second(1_000)
///     .rows_per_partition(10_000);
/// ```
pub struct GeneratorSource<T> {
    make: MakeRow<T>,
    partitions: usize,
    rows_per_second: Option<u64>,
    rows_per_partition: Option<u64>,
}

impl<T: Data> GeneratorSource<T> {
    /// One partition, unlimited rate, endless.
    pub fn new(make: impl Fn(usize, u64) -> T + Send + Sync + 'static) -> Self {
        Self {
            make: Arc::new(make),
            partitions: 1,
            rows_per_second: None,
            rows_per_partition: None,
        }
    }

    /// Spreads rows over `partitions` partitions, one reader actor each.
    pub fn partitions(mut self, partitions: usize) -> Self {
        self.partitions = partitions;
        self
    }

    /// Total rows per second over all partitions. Without it, rows come as fast as
    /// the query takes them.
    pub fn rows_per_second(mut self, rows: u64) -> Self {
        self.rows_per_second = Some(rows);
        self
    }

    /// Ends each partition after this many rows.
    pub fn rows_per_partition(mut self, rows: u64) -> Self {
        self.rows_per_partition = Some(rows);
        self
    }
}

impl<T: Data> Source<T> for GeneratorSource<T> {
    fn kind(&self) -> &str {
        "generator"
    }

    fn partitions(&self) -> Result<usize> {
        Ok(self.partitions)
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<T>>> {
        if self.rows_per_second == Some(0) {
            return Err(RtflowError::source(
                "generator",
                "rows_per_second must be positive; omit it to generate as fast as possible",
            ));
        }
        let rate = self
            .rows_per_second
            .map(|total| total as f64 * ctx.partitions.len() as f64 / self.partitions as f64);
        Ok(Box::new(GeneratorReader {
            make: self.make.clone(),
            offsets: ctx
                .numbered_partitions()
                .into_iter()
                .map(|(partition, offset)| (partition, offset as u64))
                .collect(),
            next: 0,
            limit: self.rows_per_partition.unwrap_or(u64::MAX),
            rate,
            started: Instant::now(),
            emitted: 0,
        }))
    }
}

struct GeneratorReader<T> {
    make: MakeRow<T>,
    /// (partition, next offset) for every partition this reader owns.
    offsets: Vec<(usize, u64)>,
    /// The partition the next row goes to, dealt in turn.
    next: usize,
    limit: u64,
    /// Rows per second for this reader, if limited.
    rate: Option<f64>,
    started: Instant,
    emitted: u64,
}

impl<T: Data> GeneratorReader<T> {
    fn rows_due(&self) -> u64 {
        match self.rate {
            None => u64::MAX,
            Some(rate) => (self.started.elapsed().as_secs_f64() * rate) as u64 - self.emitted,
        }
    }

    fn finished(&self) -> bool {
        self.offsets.iter().all(|(_, offset)| *offset >= self.limit)
    }
}

impl<T: Data> SourceReader<T> for GeneratorReader<T> {
    fn offsets(&self) -> Offsets {
        numbered_offsets(self.offsets.iter().map(|(p, offset)| (*p, *offset as i64)))
    }

    fn poll(&mut self, out: &mut SourceOutput<T>, max_wait: Duration) -> Result<SourceStatus> {
        if self.finished() {
            return Ok(SourceStatus::Finished);
        }
        let due = self.rows_due();
        if due == 0 {
            // Sleep until the next row is due, but no longer than asked.
            let rate = self.rate.expect("only a limited rate has nothing due");
            let next_due = Duration::from_secs_f64((self.emitted + 1) as f64 / rate);
            std::thread::sleep(
                next_due
                    .saturating_sub(self.started.elapsed())
                    .min(max_wait),
            );
            return Ok(SourceStatus::Active);
        }
        let created = now_nanos();
        let mut budget = due.min(out.remaining() as u64);
        while budget > 0 && !self.finished() {
            let lane = self.next;
            self.next = (lane + 1) % self.offsets.len();
            let (partition, offset) = &mut self.offsets[lane];
            if *offset >= self.limit {
                continue;
            }
            out.set_partition(*partition);
            out.push((self.make)(*partition, *offset), created);
            *offset += 1;
            self.emitted += 1;
            budget -= 1;
        }
        Ok(SourceStatus::Active)
    }
}
