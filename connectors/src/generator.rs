//! A generator source: rows made from their (partition, offset), at a fixed rate or
//! as fast as the query takes them. The same offsets always give the same rows, so
//! a replay from a checkpoint yields the same input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rtflow_runtime::connector::{numbered_offsets, Offsets};
use rtflow_runtime::record::{now_nanos, Nanos};
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
    end: End,
}

/// Where a generator's partitions end.
#[derive(Clone, Copy)]
enum End {
    Never,
    /// Every partition after this many rows.
    PerPartition(u64),
    /// After this many rows over all partitions, dealt in turn.
    Total(u64),
}

impl End {
    /// The offset at which `partition` of `partitions` ends.
    fn offset(self, partition: usize, partitions: usize) -> u64 {
        match self {
            End::Never => u64::MAX,
            End::PerPartition(rows) => rows,
            End::Total(rows) => {
                let (partition, partitions) = (partition as u64, partitions as u64);
                (rows + partitions - 1).saturating_sub(partition) / partitions
            }
        }
    }
}

impl<T: Data> GeneratorSource<T> {
    /// One partition, unlimited rate, endless.
    pub fn new(make: impl Fn(usize, u64) -> T + Send + Sync + 'static) -> Self {
        Self {
            make: Arc::new(make),
            partitions: 1,
            rows_per_second: None,
            end: End::Never,
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
        self.end = End::PerPartition(rows);
        self
    }

    /// Ends after `rows` rows over all partitions: row `i` is offset
    /// `i / partitions` of partition `i % partitions`, so the partitions end
    /// at most one row apart.
    ///
    /// ```
    /// use rtflow_connectors::GeneratorSource;
    /// // Partition 0 makes offsets 0..4 (rows 0, 3, 6, 9), partitions 1 and 2 make 0..3.
    /// let source = GeneratorSource::new(|partition, offset| offset * 3 + partition as u64)
    ///     .partitions(3)
    ///     .total_rows(10);
    /// ```
    pub fn total_rows(mut self, rows: u64) -> Self {
        self.end = End::Total(rows);
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
            lanes: ctx
                .numbered_partitions()
                .into_iter()
                .map(|(partition, offset)| Lane {
                    partition,
                    offset: offset as u64,
                    end: self.end.offset(partition, self.partitions),
                })
                .collect(),
            next: 0,
            rate,
            started: Instant::now(),
            started_nanos: now_nanos(),
            emitted: 0,
        }))
    }
}

/// One partition a reader owns.
struct Lane {
    partition: usize,
    /// The next row's offset.
    offset: u64,
    /// The offset the partition ends at.
    end: u64,
}

struct GeneratorReader<T> {
    make: MakeRow<T>,
    lanes: Vec<Lane>,
    /// The lane the next row goes to, dealt in turn.
    next: usize,
    /// Rows per second for this reader, if limited.
    rate: Option<f64>,
    started: Instant,
    /// `started` on the clock of record timestamps.
    started_nanos: Nanos,
    emitted: u64,
}

/// The shortest sleep of a reader whose next row is not due yet. Every sleep
/// costs a timer interrupt, on a virtual machine an exit to the hypervisor:
/// sleeping until each row of a fast generator is due kept a core busy at
/// 100,000 rows/s. A row waits this long at most, and its source time is when
/// it was due, so the wait shows in its source-queuing and end-to-end latency.
const PACING_STEP: Duration = Duration::from_millis(1);

impl<T: Data> GeneratorReader<T> {
    fn rows_due(&self) -> u64 {
        match self.rate {
            None => u64::MAX,
            Some(rate) => (self.started.elapsed().as_secs_f64() * rate) as u64 - self.emitted,
        }
    }

    fn finished(&self) -> bool {
        self.lanes.iter().all(|lane| lane.offset >= lane.end)
    }
}

impl<T: Data> SourceReader<T> for GeneratorReader<T> {
    fn offsets(&self) -> Offsets {
        numbered_offsets(
            self.lanes
                .iter()
                .map(|lane| (lane.partition, lane.offset as i64)),
        )
    }

    fn poll(&mut self, out: &mut SourceOutput<T>, max_wait: Duration) -> Result<SourceStatus> {
        if self.finished() {
            return Ok(SourceStatus::Finished);
        }
        let due = self.rows_due();
        if due == 0 {
            // Sleep until the next row is due (at least a pacing step), but no
            // longer than asked; a barrier or stop unparks it sooner.
            let rate = self.rate.expect("only a limited rate has nothing due");
            let next_due = Duration::from_secs_f64((self.emitted + 1) as f64 / rate);
            std::thread::park_timeout(
                next_due
                    .saturating_sub(self.started.elapsed())
                    .max(PACING_STEP)
                    .min(max_wait),
            );
            return Ok(SourceStatus::Active);
        }
        // A paced row is stamped with the time it was due by the monotonic
        // clock (`rows_due`), even where the wall clock, being slewed, reads a
        // little earlier; an unpaced one with now.
        let created = now_nanos();
        let nanos_per_row = self.rate.map(|rate| 1e9 / rate);
        let mut budget = due.min(out.remaining() as u64);
        while budget > 0 && !self.finished() {
            let lane = self.next;
            self.next = (lane + 1) % self.lanes.len();
            let lane = &mut self.lanes[lane];
            if lane.offset >= lane.end {
                continue;
            }
            let produced = match nanos_per_row {
                Some(nanos) => self.started_nanos + ((self.emitted + 1) as f64 * nanos) as Nanos,
                None => created,
            };
            out.set_partition(lane.partition);
            out.push((self.make)(lane.partition, lane.offset), produced);
            lane.offset += 1;
            self.emitted += 1;
            budget -= 1;
        }
        Ok(SourceStatus::Active)
    }
}
