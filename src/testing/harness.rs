//! [`DataflowHarness`]: one dataflow under test, run in-process from a memory
//! source to a capturing sink, checkpointed, crashed and restored on demand.
//!
//! The capturing sink behaves as an exactly-once (transactional) sink: what a
//! writer receives in an epoch is prepared under that epoch and becomes visible
//! in [`DataflowHarness::committed`] only once the epoch's checkpoint is durable.
//! After a crash, the harness resolves what was left prepared against the
//! checkpoint store, as a transactional sink resolves its open transactions on
//! recovery: epochs the store holds are committed, later ones discarded. A query
//! that processes every record exactly once therefore commits every output
//! exactly once, however often it crashes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rtflow_checkpoint::{CheckpointStore, Recovery, StateId};
use rtflow_connectors::MemorySource;
use rtflow_runtime::{
    Data, Dataflow, Epoch, EventTime, MetricsSnapshot, QueryConfig, Record, Result, RtflowError,
    Sink, SinkContext, SinkWriter, Stream, StreamingQuery, Trigger,
};
use serde::de::DeserializeOwned;

use super::Step;

/// The name and uid of the harness's source, as progress reports and checkpoint
/// manifests show it.
pub const INPUT: &str = "input";

/// How long a step waits for the query before failing.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The watermarks one sink writer (one subtask in one run of the query)
/// received, as [`DataflowHarness::watermarks`] reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkTrace {
    /// Which start of the query: 0 for the first, 1 after the first restart, ...
    pub run: usize,
    /// The sink subtask.
    pub subtask: usize,
    /// The watermark of the checkpoint this run restored from (`None` on a
    /// first start, or if the checkpoint had none), as the checkpoint store
    /// holds it.
    pub restored: Option<EventTime>,
    /// Every watermark the writer received, in order, with the epoch it arrived
    /// in (the one after the last barrier the writer took).
    pub watermarks: Vec<(Epoch, EventTime)>,
}

/// One record a writer received, with the last watermark its writer had
/// received before it in the same run.
#[derive(Clone)]
struct Output<T> {
    value: T,
    watermark: Option<EventTime>,
}

/// The output of every run of the query, as an exactly-once sink commits it.
struct Capture<T> {
    /// Output of the epochs whose checkpoint is durable.
    committed: BTreeMap<Epoch, Vec<Output<T>>>,
    /// Output of later epochs, as open transactions.
    prepared: BTreeMap<Epoch, Vec<Output<T>>>,
    /// Everything any writer received, committed or not.
    written: Vec<T>,
    /// The watermarks of every writer of every run.
    watermarks: Vec<WatermarkTrace>,
    /// The current run (counted from 0) and the watermark it restored.
    run: Option<(usize, Option<EventTime>)>,
}

impl<T> Capture<T> {
    /// Epochs up to `epoch` are durable: publish what they prepared.
    fn commit_through(&mut self, epoch: Epoch) {
        let later = self.prepared.split_off(&(epoch + 1));
        for (epoch, output) in std::mem::replace(&mut self.prepared, later) {
            self.committed.entry(epoch).or_default().extend(output);
        }
    }

    /// No query runs: commit what the store's last checkpoint covers, discard the
    /// rest (it will be produced again from that checkpoint).
    fn resolve(&mut self, last_checkpoint: Option<Epoch>) {
        if let Some(epoch) = last_checkpoint {
            self.commit_through(epoch);
        }
        self.prepared.clear();
    }
}

type SharedCapture<T> = Arc<Mutex<Capture<T>>>;

/// Builds the dataflow under test on the harness's source stream.
type Build<In, Out> = Box<dyn Fn(&Dataflow, Stream<In>) -> Stream<Out>>;

fn lock<T>(capture: &SharedCapture<T>) -> MutexGuard<'_, Capture<T>> {
    capture
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct CaptureSink<T>(SharedCapture<T>);

impl<T: Data> Sink<T> for CaptureSink<T> {
    fn allowlisted(&self) -> bool {
        true
    }

    fn kind(&self) -> &str {
        "memory"
    }

    fn description(&self) -> String {
        "rtflow::testing capture".into()
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        let mut capture = lock(&self.0);
        let (run, restored) = capture.run.expect("the harness counts every start");
        let trace = capture.watermarks.len();
        capture.watermarks.push(WatermarkTrace {
            run,
            subtask: ctx.subtask,
            restored,
            watermarks: Vec::new(),
        });
        Ok(Box::new(CaptureWriter {
            capture: self.0.clone(),
            epoch: ctx.first_epoch,
            trace,
            watermark: None,
        }))
    }
}

struct CaptureWriter<T> {
    capture: SharedCapture<T>,
    /// The epoch the records written now belong to: the one after the last
    /// barrier. A writer whose input ended leaves its last records to the next
    /// epoch to complete, which is this one too.
    epoch: Epoch,
    /// This writer's entry in [`Capture::watermarks`].
    trace: usize,
    /// The last watermark this writer received.
    watermark: Option<EventTime>,
}

impl<T: Data> SinkWriter<T> for CaptureWriter<T> {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        let mut capture = lock(&self.capture);
        capture.written.push(record.value.clone());
        capture
            .prepared
            .entry(self.epoch)
            .or_default()
            .push(Output {
                value: record.value,
                watermark: self.watermark,
            });
        Ok(())
    }

    fn on_watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.watermark = Some(watermark);
        lock(&self.capture).watermarks[self.trace]
            .watermarks
            .push((self.epoch, watermark));
        Ok(())
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.epoch = epoch + 1;
        Ok(())
    }

    fn on_commit(&mut self, epoch: Epoch) -> Result<()> {
        lock(&self.capture).commit_through(epoch);
        Ok(())
    }
}

/// Runs one dataflow under test: a [`MemorySource`] of `In` with a fixed number
/// of partitions, the operators `build` adds, and a sink that captures the `Out`
/// records per epoch as an exactly-once sink would commit them.
///
/// The test pushes records to chosen partitions, checkpoints, crashes and
/// restarts the query, then compares what was committed (and the checkpointed
/// operator state) with a batch reference. Each harness has a checkpoint
/// location of its own, removed when it is dropped. The trigger's batch duration
/// is five minutes unless [`checkpoint_every`](Self::checkpoint_every) says
/// otherwise, so by default checkpoints happen when the test asks for them.
///
/// ```
/// use rtflow::prelude::*;
/// use rtflow::testing::DataflowHarness;
///
/// let mut harness = DataflowHarness::new("words", 2, |_, words: Stream<String>| {
///     words.key_by(|word: &String| word.clone()).count()
/// });
/// harness.start()?;
/// harness.push(0, "a".to_string())?;
/// harness.push(1, "a".to_string())?;
/// harness.settle()?;
/// harness.checkpoint()?;
/// harness.push(0, "b".to_string())?;
/// harness.settle()?;
/// harness.crash()?; // "b" was counted, but after the last checkpoint
/// assert_eq!(harness.state::<String, u64>("count-0", "accumulators")?, [("a".into(), 2)].into());
/// harness.finish()?; // restarts, counts "b" again from the checkpoint, drains
/// let mut committed = harness.committed();
/// committed.sort();
/// assert_eq!(committed, [("a".into(), 1), ("a".into(), 2), ("b".into(), 1)]);
/// # Ok::<(), rtflow::RtflowError>(())
/// ```
pub struct DataflowHarness<In, Out> {
    name: String,
    config: QueryConfig,
    location: PathBuf,
    source: MemorySource<In>,
    capture: SharedCapture<Out>,
    build: Build<In, Out>,
    query: Option<StreamingQuery>,
    /// Every value pushed, per partition.
    pushed: Vec<Vec<In>>,
    /// How many pushed records the running query resumed after.
    resumed: u64,
    timeout: Duration,
    last_metrics: Option<MetricsSnapshot>,
}

impl<In: Data, Out: Data> DataflowHarness<In, Out> {
    /// A harness for the dataflow `build` makes of a source with `partitions`
    /// partitions (the stream it is given) and whatever else it adds to the
    /// dataflow (static tables, ...). It is built anew at every (re)start, as a
    /// restarted program would build it.
    pub fn new(
        name: &str,
        partitions: usize,
        build: impl Fn(&Dataflow, Stream<In>) -> Stream<Out> + 'static,
    ) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let location = std::env::temp_dir()
            .join("rtflow-harness")
            .join(std::process::id().to_string())
            .join(format!("{name}-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&location);
        Self {
            name: name.to_owned(),
            config: QueryConfig::new(name)
                .checkpoint_location(&location)
                .progress_interval(Duration::from_secs(3600)),
            location,
            source: MemorySource::new(partitions),
            capture: Arc::new(Mutex::new(Capture {
                committed: BTreeMap::new(),
                prepared: BTreeMap::new(),
                written: Vec::new(),
                watermarks: Vec::new(),
                run: None,
            })),
            build: Box::new(build),
            query: None,
            pushed: vec![Vec::new(); partitions],
            resumed: 0,
            timeout: DEFAULT_TIMEOUT,
            last_metrics: None,
        }
    }

    /// Changes the query's configuration (parallelism, mailboxes, chaining, ...)
    /// for the next start. The checkpoint location stays the harness's own.
    ///
    /// ```
    /// # use rtflow::prelude::*;
    /// # use rtflow::testing::DataflowHarness;
    /// let harness = DataflowHarness::new("tight", 1, |_, s: Stream<u32>| s.map(|x| x + 1))
    ///     .configure(|config| config.mailbox_capacity(2).operator_chaining(false));
    /// ```
    pub fn configure(mut self, change: impl FnOnce(QueryConfig) -> QueryConfig) -> Self {
        let config = std::mem::replace(&mut self.config, QueryConfig::new(""));
        self.config = change(config).checkpoint_location(&self.location);
        self
    }

    /// Also ends an epoch every `interval`, so checkpoints happen at moments the
    /// test does not choose (and crashes can hit one in flight).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use rtflow::prelude::*;
    /// # use rtflow::testing::DataflowHarness;
    /// let harness = DataflowHarness::new("busy", 1, |_, s: Stream<u32>| s)
    ///     .checkpoint_every(Duration::from_millis(50));
    /// ```
    pub fn checkpoint_every(self, interval: Duration) -> Self {
        self.configure(|config| {
            config
                .trigger(Trigger::real_time(interval))
                .min_batch_duration(interval)
        })
    }

    /// How long [`settle`](Self::settle), [`checkpoint`](Self::checkpoint) and
    /// [`finish`](Self::finish) wait for the query before failing (30 s).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use rtflow::prelude::*;
    /// # use rtflow::testing::DataflowHarness;
    /// let harness = DataflowHarness::new("quick", 1, |_, s: Stream<u32>| s)
    ///     .timeout(Duration::from_secs(5));
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts the query, restoring the last checkpoint if there is one; does
    /// nothing if it runs.
    pub fn start(&mut self) -> Result<()> {
        if self.query.is_some() {
            return Ok(());
        }
        let recovery = self.recovery()?;
        {
            let mut capture = lock(&self.capture);
            capture.resolve(recovery.manifest.as_ref().map(|m| m.epoch));
            let run = capture.run.map_or(0, |(run, _)| run + 1);
            capture.run = Some((run, recovery.manifest.as_ref().and_then(|m| m.watermark)));
        }
        self.resumed = resumed_offsets(&recovery).values().sum::<usize>() as u64;
        let flow = Dataflow::new(self.name.clone());
        let input = flow.source(self.source.clone()).name(INPUT).uid(INPUT);
        (self.build)(&flow, input).sink(CaptureSink(self.capture.clone()));
        self.query = Some(flow.start(self.config.clone())?);
        Ok(())
    }

    /// Appends `value` to source partition `partition`; its event time is now.
    pub fn push(&mut self, partition: usize, value: In) -> Result<()> {
        self.source.push(partition, value.clone())?;
        self.pushed[partition].push(value);
        Ok(())
    }

    /// Appends `value` to source partition `partition` with event time
    /// `event_time` (ms).
    pub fn push_at(&mut self, partition: usize, value: In, event_time: EventTime) -> Result<()> {
        self.source.push_at(partition, value.clone(), event_time)?;
        self.pushed[partition].push(value);
        Ok(())
    }

    /// Waits until the running query's sources have read every record pushed so
    /// far. A checkpoint after it covers them all.
    pub fn settle(&self) -> Result<()> {
        let query = self.running()?;
        let pushed: u64 = self.pushed.iter().map(|p| p.len() as u64).sum();
        let deadline = Instant::now() + self.timeout;
        while query.metrics().records_read() + self.resumed < pushed {
            if !query.is_active() {
                return query.exception().map_or(Ok(()), Err);
            }
            if Instant::now() > deadline {
                return Err(self.timed_out("the sources to read every record"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Ends an epoch now and waits until its checkpoint is committed; returns the
    /// epoch. Starts the query if it does not run.
    pub fn checkpoint(&mut self) -> Result<Epoch> {
        self.start()?;
        self.running()?.checkpoint_now(self.timeout)
    }

    /// Kills the query as a SIGKILL would: every actor stops at once, nothing
    /// commits after the last committed checkpoint, no final checkpoint is
    /// written. Output of uncommitted epochs is discarded. Fails with the
    /// query's error if it had failed before. Does nothing if no query runs.
    pub fn crash(&mut self) -> Result<()> {
        let Some(query) = self.query.take() else {
            return Ok(());
        };
        query.abandon();
        self.ended(query)
    }

    /// Stops the query cleanly: what the sources read is processed and a final
    /// checkpoint commits it. [`start`](Self::start) resumes after it.
    pub fn stop(&mut self) -> Result<()> {
        let Some(query) = self.query.take() else {
            return Ok(());
        };
        query.stop()?;
        self.ended(query)
    }

    /// Ends the input, (re)starts the query if needed and waits until it has
    /// processed everything and committed its final checkpoint. Nothing can be
    /// pushed afterwards.
    pub fn finish(&mut self) -> Result<()> {
        self.source.end();
        self.start()?;
        let query = self.query.take().expect("started above");
        if !query.await_termination(Some(self.timeout))? {
            query.abandon();
            return Err(self.timed_out("the query to drain its input"));
        }
        self.ended(query)
    }

    /// Carries out one step; starts the query first if it does not run. A
    /// [`Step::Crash`] crashes the query and restarts it at once.
    pub fn apply(&mut self, step: &Step<In>) -> Result<()> {
        self.start()?;
        match step {
            Step::Push {
                partition,
                value,
                event_time: None,
            } => self.push(*partition, value.clone()),
            Step::Push {
                partition,
                value,
                event_time: Some(time),
            } => self.push_at(*partition, value.clone(), *time),
            Step::Settle => self.settle(),
            Step::Checkpoint => self.checkpoint().map(drop),
            Step::Crash => {
                self.crash()?;
                self.start()
            }
        }
    }

    /// Carries out every step, then [`finish`](Self::finish)es.
    pub fn run(&mut self, steps: &[Step<In>]) -> Result<()> {
        for step in steps {
            self.apply(step)?;
        }
        self.finish()
    }

    /// The committed output, epoch by epoch, each epoch in the order its
    /// writers received it.
    pub fn committed(&self) -> Vec<Out> {
        lock(&self.capture)
            .committed
            .values()
            .flatten()
            .map(|output| output.value.clone())
            .collect()
    }

    /// The committed output of each epoch.
    pub fn committed_epochs(&self) -> BTreeMap<Epoch, Vec<Out>> {
        lock(&self.capture)
            .committed
            .iter()
            .map(|(epoch, outputs)| {
                let values = outputs.iter().map(|output| output.value.clone());
                (*epoch, values.collect())
            })
            .collect()
    }

    /// The committed output as [`committed`](Self::committed) orders it, each
    /// record with the last watermark its sink subtask had received before it
    /// (in the run that wrote it; `None` if none yet). Watermarks travel in band,
    /// so an operator upstream had passed that watermark on before it emitted
    /// the record: a windowed aggregate, for one, must not emit a window that
    /// ends at or before it.
    pub fn committed_with_watermarks(&self) -> Vec<(Out, Option<EventTime>)> {
        lock(&self.capture)
            .committed
            .values()
            .flatten()
            .map(|output| (output.value.clone(), output.watermark))
            .collect()
    }

    /// The watermarks each sink subtask received in each run of the query, with
    /// the watermark that run restored from its checkpoint, in the order the
    /// writers were opened. Crashed runs are included: this is what the sinks
    /// saw, committed or not.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow::prelude::*;
    /// use rtflow::testing::DataflowHarness;
    ///
    /// let mut harness = DataflowHarness::new("times", 1, |_, s: Stream<u32>| {
    ///     s.with_watermark(|x| i64::from(*x), Duration::from_millis(10))
    /// });
    /// harness.start()?;
    /// harness.push_at(0, 100, 100)?;
    /// harness.settle()?;
    /// harness.checkpoint()?;
    /// harness.crash()?;
    /// harness.push_at(0, 300, 300)?;
    /// harness.finish()?;
    /// let traces = harness.watermarks();
    /// assert_eq!(traces.len(), 2, "one writer per run");
    /// // The second run never goes back behind the watermark it restored.
    /// let restored = traces[1].restored.unwrap_or(i64::MIN);
    /// assert!(restored <= 90);
    /// assert!(traces[1].watermarks.iter().all(|(_, w)| *w >= restored));
    /// assert_eq!(traces[1].watermarks.last().map(|(_, w)| *w), Some(290));
    /// # Ok::<(), rtflow::RtflowError>(())
    /// ```
    pub fn watermarks(&self) -> Vec<WatermarkTrace> {
        lock(&self.capture).watermarks.clone()
    }

    /// Everything the sink received, committed or not, across every run: what an
    /// at-least-once sink would have written.
    pub fn written(&self) -> Vec<Out> {
        lock(&self.capture).written.clone()
    }

    /// Every value pushed, per partition, in the order it was pushed.
    pub fn input(&self) -> &[Vec<In>] {
        &self.pushed
    }

    /// Every value pushed, partition after partition.
    pub fn input_values(&self) -> Vec<In> {
        self.pushed.iter().flatten().cloned().collect()
    }

    /// Per partition, the values the last committed checkpoint covers: what its
    /// state must reflect. Only while no query runs.
    pub fn committed_input(&self) -> Result<Vec<Vec<In>>> {
        self.stopped()?;
        let offsets = resumed_offsets(&self.recovery()?);
        Ok(self
            .pushed
            .iter()
            .enumerate()
            .map(|(partition, values)| {
                let end = offsets.get(&partition).copied().unwrap_or(0);
                values[..end.min(values.len())].to_vec()
            })
            .collect())
    }

    /// The epoch of the last committed checkpoint. Only while no query runs.
    pub fn last_checkpoint(&self) -> Result<Option<Epoch>> {
        self.stopped()?;
        Ok(self.recovery()?.manifest.map(|m| m.epoch))
    }

    /// The keyed state `name` of operator `operator` (its uid, such as
    /// `count-0`) as the last committed checkpoint holds it, decoded as `K` and
    /// `V`. Empty if the checkpoint holds no such state. Only while no query runs.
    pub fn state<K, V>(&self, operator: &str, name: &str) -> Result<BTreeMap<K, V>>
    where
        K: DeserializeOwned + Ord,
        V: DeserializeOwned,
    {
        self.stopped()?;
        let recovery = self.recovery()?;
        let id = StateId::new(operator, name);
        let Some(state) = recovery.state.get(&id) else {
            return Ok(BTreeMap::new());
        };
        let decode_error = |e: bincode::error::DecodeError| {
            RtflowError::Checkpoint(format!("cannot decode {id} as the types asked for: {e}"))
        };
        state
            .entries()
            .iter()
            .filter_map(|entry| Some((entry.key, entry.value?)))
            .map(|(key, value)| {
                let config = bincode::config::standard();
                let (key, _) =
                    bincode::serde::decode_from_slice(key, config).map_err(decode_error)?;
                let (value, _) =
                    bincode::serde::decode_from_slice(value, config).map_err(decode_error)?;
                Ok((key, value))
            })
            .collect()
    }

    /// The running query's metrics, or those of the last run once it ended.
    pub fn metrics(&self) -> Option<MetricsSnapshot> {
        match &self.query {
            Some(query) => Some(query.metrics()),
            None => self.last_metrics.clone(),
        }
    }

    /// The running query.
    pub fn query(&self) -> Option<&StreamingQuery> {
        self.query.as_ref()
    }

    fn running(&self) -> Result<&StreamingQuery> {
        self.query.as_ref().ok_or_else(|| {
            RtflowError::InvalidConfiguration(format!(
                "harness '{}': no query runs; start() it first",
                self.name
            ))
        })
    }

    fn stopped(&self) -> Result<()> {
        match self.query {
            // sled locks the checkpoint location while a query holds it.
            Some(_) => Err(RtflowError::InvalidConfiguration(format!(
                "harness '{}': the checkpoint store is read only while no query runs; \
                 crash(), stop() or finish() it first",
                self.name
            ))),
            None => Ok(()),
        }
    }

    fn timed_out(&self, what: &str) -> RtflowError {
        RtflowError::InvalidConfiguration(format!(
            "harness '{}': waited {:?} for {what}",
            self.name, self.timeout
        ))
    }

    /// A query ended: keep its metrics, settle the sink's open epochs against
    /// the store, and pass on its failure unless it was the harness's crash.
    fn ended(&mut self, query: StreamingQuery) -> Result<()> {
        self.last_metrics = Some(query.metrics());
        let failure = query.exception();
        drop(query);
        let last = self.recovery()?.manifest.map(|m| m.epoch);
        lock(&self.capture).resolve(last);
        match failure {
            None | Some(RtflowError::Cancelled) => Ok(()),
            Some(error) => Err(error),
        }
    }

    fn recovery(&self) -> Result<Recovery> {
        let mut store = CheckpointStore::open(&self.location, self.config.checkpoints_retained)?;
        Ok(store.recover()?)
    }
}

/// Where each partition of the harness's source resumes after `recovery`.
fn resumed_offsets(recovery: &Recovery) -> BTreeMap<usize, usize> {
    let offsets = recovery
        .manifest
        .as_ref()
        .and_then(|manifest| manifest.sources.get(INPUT));
    offsets
        .into_iter()
        .flatten()
        .filter_map(|(partition, offset)| Some((partition.parse().ok()?, *offset as usize)))
        .collect()
}

impl<In, Out> Drop for DataflowHarness<In, Out> {
    fn drop(&mut self) {
        if let Some(query) = self.query.take() {
            query.abandon();
        }
        let _ = std::fs::remove_dir_all(&self.location);
    }
}

impl<In, Out> std::fmt::Debug for DataflowHarness<In, Out> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataflowHarness")
            .field("name", &self.name)
            .field("location", &self.location)
            .field("running", &self.query.is_some())
            .finish()
    }
}
