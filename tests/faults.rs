//! The fault matrix: user code fails at every place it runs, by a panic and,
//! where the hook can return one, an error. Every row asserts that the start
//! or the query fails within seconds, with the place's error class, the
//! user's message and the operator's name; that `await_termination` returns
//! the error and `exception()` keeps it; that no thread of the query is left;
//! and that once the code is mended, a restart on the same checkpoint
//! location continues exactly once. A new hook is one more row in [`rows`].
//!
//! A test binary of its own: the thread check counts every rtflow thread of
//! the process, and the fail points that make rtflow's own threads panic
//! are the process's.
#![cfg(feature = "failpoints")]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rtflow::operators::process::{StateDeclarations, ValueState};
use rtflow::operators::Aggregation;
use rtflow::prelude::*;
use rtflow::runtime::connector::Offsets;
use rtflow::runtime::{
    Epoch, EventTime, Sink, SinkContext, SinkWriter, Source, SourceContext, SourceOutput,
    SourceReader, SourceStatus,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use common::TIMEOUT;

/// How long a fault may take to fail the query or its start.
const FAIL_WITHIN: Duration = Duration::from_secs(20);

/// Records per batch; run 1 reads batch 0, the faulty run batch 1, the
/// mended run batch 2.
const BATCH: u64 = 40;

/// Keys: a record `v` counts for key `v % KEYS`.
const KEYS: u64 = 5;

// ---- The faults user code raises --------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Panic,
    Error,
}

/// The hook armed to fail, and how.
static ARMED: Mutex<Option<(&'static str, Fault)>> = Mutex::new(None);

fn arm(armed: Option<(&'static str, Fault)>) {
    *ARMED.lock().unwrap_or_else(|p| p.into_inner()) = armed;
    // rtflow's own code fails through its fail points.
    if let Some(point) = ENGINE_POINTS
        .iter()
        .find(|p| p.hook == armed.map_or("", |a| a.0))
    {
        fail::cfg(point.point, &format!("panic({})", message(point.hook))).unwrap();
    } else {
        ENGINE_POINTS.iter().for_each(|p| fail::remove(p.point));
    }
}

/// A hook of rtflow's own, and the fail point that makes it panic.
struct EnginePoint {
    hook: &'static str,
    point: &'static str,
}

/// The coordinator panics while it commits a checkpoint.
const ENGINE_POINTS: [EnginePoint; 1] = [EnginePoint {
    hook: "the coordinator's commit",
    point: "after-manifest",
}];

/// What the user's code says when it fails at `hook`.
fn message(hook: &str) -> String {
    format!("injected fault in {hook}")
}

/// What user code at `hook` does: nothing, or the fault armed for it.
fn at(hook: &'static str) -> Result<()> {
    let armed = *ARMED.lock().unwrap_or_else(|p| p.into_inner());
    match armed {
        Some((armed, Fault::Panic)) if armed == hook => panic!("{}", message(hook)),
        Some((armed, Fault::Error)) if armed == hook => {
            Err(RtflowError::InvalidConfiguration(message(hook)))
        }
        _ => Ok(()),
    }
}

/// [`at`] for code that cannot return an error: only armed with panics.
fn panics_at(hook: &'static str) {
    at(hook).expect("hooks without a Result are armed with panics only");
}

// ---- What the rows build ----------------------------------------------

/// What every run of a row shares: the sources it reads, where its output
/// lands, its checkpoint location.
#[derive(Clone)]
struct Setup {
    input: MemorySource<u64>,
    /// The right side of the join row: one record per key.
    keys: MemorySource<u64>,
    out: Output,
    location: PathBuf,
}

/// The `(key, running count)` rows written, in order.
type Output = Arc<Mutex<Vec<(u64, u64)>>>;

impl Setup {
    fn new(row: &str, fault: Fault) -> Self {
        let location = std::env::temp_dir()
            .join("rtflow-faults")
            .join(std::process::id().to_string())
            .join(format!("{row}-{fault:?}").replace([' ', ':', '\'', '/'], "_"));
        let keys = MemorySource::new(1);
        keys.push_all(0, 0..KEYS).unwrap();
        Self {
            input: MemorySource::new(2),
            keys,
            out: Output::default(),
            location,
        }
    }

    /// Batch `n` of the input, over both partitions.
    fn push(&self, n: u64) {
        for value in n * BATCH..(n + 1) * BATCH {
            self.input.push((value % 2) as usize, value).unwrap();
        }
    }

    fn end(&self) {
        self.input.end();
        self.keys.end();
    }

    /// The last count written for each key.
    fn counts(&self) -> BTreeMap<u64, u64> {
        self.out.lock().unwrap().iter().copied().collect()
    }
}

/// The counts of the first `batches` batches.
fn expected(batches: u64) -> BTreeMap<u64, u64> {
    let mut counts = BTreeMap::new();
    for value in 0..batches * BATCH {
        *counts.entry(value % KEYS).or_default() += 1;
    }
    counts
}

fn key(value: &u64) -> u64 {
    value % KEYS
}

/// The usual end of a row's dataflow: a running count per key.
fn count(stream: &Stream<u64>) -> Stream<(u64, u64)> {
    stream.key_by(key).count().name("count").parallelism(2)
}

/// The usual sink: appends to the setup's output.
fn collect(setup: &Setup) -> Box<dyn Sink<(u64, u64)>> {
    let out = setup.out.clone();
    Box::new(ForeachSink::from_fn(move |row| {
        out.lock().unwrap().push(row);
        Ok(())
    }))
}

/// A custom operator that passes records on and can fail in any hook.
struct Faulty;

impl Operator<u64, u64> for Faulty {
    fn allowlisted() -> bool {
        true
    }
    fn on_start(&mut self, _ctx: &OperatorContext) -> Result<()> {
        at("on_start")
    }
    fn process(&mut self, record: Record<u64>, out: &mut Collector<'_, u64>) -> Result<()> {
        at("process")?;
        out.emit(record.value)
    }
    fn on_watermark(&mut self, _: EventTime, _: &mut Collector<'_, u64>) -> Result<()> {
        at("on_watermark")
    }
    fn on_flush(&mut self, _: &mut Collector<'_, u64>) -> Result<()> {
        at("on_flush")
    }
    fn on_close(&mut self, _: &mut Collector<'_, u64>) -> Result<()> {
        at("on_close")
    }
}

/// The usual count of what a [`FaultySource`] reads.
fn from_faulty_source(flow: &Dataflow, setup: &Setup) -> Stream<(u64, u64)> {
    count(
        &flow
            .source(FaultySource(setup.input.clone()))
            .name("clicks"),
    )
}

/// A [`Counter`] per key.
fn counted(flow: &Dataflow, setup: &Setup) -> Stream<(u64, u64)> {
    flow.source(setup.input.clone())
        .key_by(key)
        .process(|| Counter)
        .name("counter")
}

fn through_faulty(flow: &Dataflow, setup: &Setup) -> Stream<(u64, u64)> {
    let faulty = flow
        .source(setup.input.clone())
        .with_watermark(|value| *value as i64, Duration::ZERO)
        .try_transform("faulty", |_| {
            at("its factory")?;
            Ok(Faulty)
        })
        .name("faulty");
    count(&faulty)
}

/// Counts per key in keyed state, and sets a processing-time timer for
/// every record.
struct Counter;

const SEEN: ValueState<u64> = ValueState::new("seen");

impl KeyedProcessor<u64, u64, (u64, u64)> for Counter {
    fn init(&mut self, states: &mut StateDeclarations<'_, u64>) -> Result<()> {
        states.declare(&SEEN)
    }
    fn handle_input(
        &mut self,
        key: &u64,
        _record: u64,
        ctx: &mut ProcessContext<'_, '_, u64, (u64, u64)>,
    ) -> Result<()> {
        at("handle_input")?;
        let seen = ctx.value(&SEEN).get().copied().unwrap_or(0) + 1;
        ctx.value(&SEEN).set(seen);
        let soon = ctx.processing_time() + 1;
        ctx.register_timer(Timer::ProcessingTime(soon));
        ctx.emit((*key, seen))
    }
    fn on_timer(
        &mut self,
        _key: &u64,
        _timer: Timer,
        _ctx: &mut ProcessContext<'_, '_, u64, (u64, u64)>,
    ) -> Result<()> {
        at("on_timer")
    }
}

/// Counts per key and window with a function of the user's.
struct CountIn;

impl AggregateFunction<u64> for CountIn {
    type Acc = u64;
    type Out = u64;
    fn create(&self) -> u64 {
        0
    }
    fn add(&self, count: &mut u64, _: &u64) {
        panics_at("AggregateFunction::add");
        *count += 1;
    }
    fn merge(&self, count: &mut u64, other: u64) {
        *count += other;
    }
    fn result(&self, count: &u64) -> u64 {
        *count
    }
}

/// A count whose state cannot always be encoded or decoded.
#[derive(Debug, Clone, Copy)]
struct Flaky(u64);

impl Serialize for Flaky {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        at("encode").map_err(serde::ser::Error::custom)?;
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Flaky {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        at("decode").map_err(serde::de::Error::custom)?;
        u64::deserialize(deserializer).map(Flaky)
    }
}

/// A source that reads through to a memory source, and can fail.
struct FaultySource(MemorySource<u64>);

impl Source<u64> for FaultySource {
    fn kind(&self) -> &str {
        "faulty"
    }
    fn partitions(&self) -> Result<usize> {
        self.0.partitions()
    }
    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<u64>>> {
        at("Source::reader")?;
        Ok(Box::new(FaultyReader(self.0.reader(ctx)?)))
    }
}

struct FaultyReader(Box<dyn SourceReader<u64>>);

impl SourceReader<u64> for FaultyReader {
    fn poll(&mut self, out: &mut SourceOutput<u64>, max_wait: Duration) -> Result<SourceStatus> {
        at("SourceReader::poll")?;
        self.0.poll(out, max_wait)
    }
    fn offsets(&self) -> Offsets {
        self.0.offsets()
    }
}

/// A sink that writes through to the usual one, and can fail.
struct FaultySink(Box<dyn Sink<(u64, u64)>>);

impl Sink<(u64, u64)> for FaultySink {
    fn kind(&self) -> &str {
        "faulty"
    }
    fn allowlisted(&self) -> bool {
        true
    }
    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<(u64, u64)>>> {
        at("Sink::writer")?;
        Ok(Box::new(FaultyWriter(self.0.writer(ctx)?)))
    }
}

struct FaultyWriter(Box<dyn SinkWriter<(u64, u64)>>);

impl SinkWriter<(u64, u64)> for FaultyWriter {
    fn write(&mut self, record: Record<(u64, u64)>) -> Result<()> {
        at("SinkWriter::write")?;
        self.0.write(record)
    }
    fn flush(&mut self) -> Result<()> {
        self.0.flush()
    }
    fn on_commit(&mut self, epoch: Epoch) -> Result<()> {
        self.0.on_commit(epoch)
    }
    fn close(&mut self, error: Option<&RtflowError>) -> Result<()> {
        at("SinkWriter::close")?;
        self.0.close(error)
    }
}

/// A foreach writer into the setup's output that can fail.
struct FaultyForeach(Output);

impl ForeachWriter<(u64, u64)> for FaultyForeach {
    fn open(&mut self, _partition: usize, _epoch: Epoch) -> bool {
        panics_at("ForeachWriter::open");
        true
    }
    fn process(&mut self, row: (u64, u64)) -> Result<(), BoxError> {
        at("ForeachWriter::process")?;
        self.0.lock().unwrap().push(row);
        Ok(())
    }
    fn close(&mut self, _error: Option<&RtflowError>) {
        panics_at("ForeachWriter::close");
    }
}

// ---- The rows ---------------------------------------------------------

/// When a row's fault is armed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Armed {
    /// Before the faulty run starts: its start or its restore fails.
    AtStart,
    /// Once it runs, before it reads batch 1.
    Running,
    /// Once it runs; then its input ends, which calls the hook.
    AtEnd,
}

/// How a row runs its dataflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runner {
    Query,
    /// As the one flow of a pipeline.
    Pipeline,
}

struct Row {
    hook: &'static str,
    armed: Armed,
    /// The class of a panic, and of an error where the hook can return one.
    panic: &'static str,
    error: Option<&'static str>,
    /// The operator, source, sink or flow the error must name.
    place: &'static str,
    build: fn(&Dataflow, &Setup) -> Stream<(u64, u64)>,
    sink: MakeSink,
    runner: Runner,
}

/// Makes the sink a row writes into.
type MakeSink = fn(&Setup) -> Box<dyn Sink<(u64, u64)>>;

const OPERATOR: &str = "OPERATOR_FAILED";
const SOURCE: &str = "SOURCE_FAILED";
const SINK: &str = "SINK_FAILED";
const CONFIGURATION: &str = "INVALID_CONFIGURATION";

/// A row of the usual shape: `build`, into the usual sink, as a query.
fn row(
    hook: &'static str,
    armed: Armed,
    (panic, error): (&'static str, Option<&'static str>),
    place: &'static str,
    build: fn(&Dataflow, &Setup) -> Stream<(u64, u64)>,
) -> Row {
    Row {
        hook,
        armed,
        panic,
        error,
        place,
        build,
        sink: collect,
        runner: Runner::Query,
    }
}

fn rows() -> Vec<Row> {
    use Armed::*;
    let operator = (OPERATOR, Some(CONFIGURATION));
    let closure = (OPERATOR, None);
    let plain = |flow: &Dataflow, setup: &Setup| count(&flow.source(setup.input.clone()));
    let mut rows = vec![
        row("its factory", AtStart, operator, "faulty", through_faulty),
        row("on_start", AtStart, operator, "faulty", through_faulty),
        row("process", Running, operator, "faulty", through_faulty),
        row("on_watermark", Running, operator, "faulty", through_faulty),
        row("on_flush", Running, operator, "faulty", through_faulty),
        row("on_close", AtEnd, operator, "faulty", through_faulty),
        row("handle_input", Running, operator, "counter", counted),
        row("on_timer", Running, operator, "counter", counted),
        row(
            "AggregateFunction::add",
            Running,
            closure,
            "window",
            |flow, setup| {
                flow.source(setup.input.clone())
                    .with_watermark(|value| *value as i64, Duration::ZERO)
                    .key_by(key)
                    .window(Window::tumbling(Duration::from_secs(60)))
                    .aggregate(CountIn)
                    .name("window")
                    .map(|(key, _window, count)| (key, count))
            },
        ),
        row("key_by key", Running, closure, "count", |flow, setup| {
            flow.source(setup.input.clone())
                .key_by(|value: &u64| {
                    panics_at("key_by key");
                    key(value)
                })
                .count()
                .name("count")
                .parallelism(2)
        }),
        row("window key", Running, closure, "window", |flow, setup| {
            flow.source(setup.input.clone())
                .with_watermark(|value| *value as i64, Duration::ZERO)
                .key_by(|value: &u64| {
                    panics_at("window key");
                    key(value)
                })
                .window(Window::tumbling(Duration::from_secs(60)))
                .count()
                .name("window")
                .parallelism(2)
                .map(|(key, _window, count)| (key, count))
        }),
        row("join key", Running, closure, "join", |flow, setup| {
            let keys = flow.source(setup.keys.clone());
            let joined = flow
                .source(setup.input.clone())
                .join(
                    &keys,
                    |value: &u64| {
                        panics_at("join key");
                        key(value)
                    },
                    |key: &u64| *key,
                    JoinWindow::between(Duration::from_secs(3600), Duration::from_secs(3600)),
                )
                .name("join")
                .map(|(value, _key)| value);
            count(&joined)
        }),
        row(
            "drop_duplicates key",
            Running,
            closure,
            "dedup",
            |flow, setup| {
                let distinct = flow
                    .source(setup.input.clone())
                    .drop_duplicates(|value: &u64| {
                        panics_at("drop_duplicates key");
                        *value
                    })
                    .name("dedup");
                count(&distinct)
            },
        ),
        row("map closure", Running, closure, "mapped", |flow, setup| {
            let mapped = flow
                .source(setup.input.clone())
                .map(|value| {
                    panics_at("map closure");
                    value
                })
                .name("mapped");
            count(&mapped)
        }),
        row(
            "filter closure",
            Running,
            closure,
            "filtered",
            |flow, setup| {
                let kept = flow
                    .source(setup.input.clone())
                    .filter(|_| {
                        panics_at("filter closure");
                        true
                    })
                    .name("filtered");
                count(&kept)
            },
        ),
        row(
            "flat_map closure",
            Running,
            closure,
            "flattened",
            |flow, setup| {
                let flat = flow
                    .source(setup.input.clone())
                    .flat_map(|value| {
                        panics_at("flat_map closure");
                        [value]
                    })
                    .name("flattened");
                count(&flat)
            },
        ),
        row(
            "Source::reader",
            AtStart,
            (SOURCE, Some(CONFIGURATION)),
            "clicks",
            from_faulty_source,
        ),
        row(
            "SourceReader::poll",
            Running,
            (SOURCE, Some(CONFIGURATION)),
            "clicks",
            from_faulty_source,
        ),
        row(
            "encode",
            Running,
            (OPERATOR, Some("CHECKPOINT_FAILED")),
            "flaky",
            flaky_count,
        ),
        // State that cannot be read back is a checkpoint the dataflow does
        // not match, as Spark's state schema check says.
        row(
            "decode",
            AtStart,
            (
                OPERATOR,
                Some("STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"),
            ),
            "flaky",
            flaky_count,
        ),
    ];
    let sinks: [(&'static str, Armed, Option<&'static str>, MakeSink); 6] = [
        ("Sink::writer", AtStart, Some(CONFIGURATION), |setup| {
            Box::new(FaultySink(collect(setup)))
        }),
        ("SinkWriter::write", Running, Some(CONFIGURATION), |setup| {
            Box::new(FaultySink(collect(setup)))
        }),
        ("SinkWriter::close", AtEnd, Some(CONFIGURATION), |setup| {
            Box::new(FaultySink(collect(setup)))
        }),
        ("ForeachWriter::open", Running, None, foreach),
        ("ForeachWriter::process", Running, Some(SINK), foreach),
        ("ForeachWriter::close", Running, None, foreach),
    ];
    for (hook, armed, error, sink) in sinks {
        // A sink is named after its kind.
        let place = match hook.split("::").next() {
            Some("ForeachWriter") => "sink 'foreach-",
            _ => "sink 'faulty-",
        };
        rows.push(Row {
            hook,
            armed,
            panic: SINK,
            error,
            place,
            build: plain,
            sink,
            runner: Runner::Query,
        });
    }
    rows.push(Row {
        hook: ENGINE_POINTS[0].hook,
        armed: Armed::Running,
        panic: "INTERNAL_ERROR",
        error: None,
        place: "'rtflow-coord'",
        build: plain,
        sink: collect,
        runner: Runner::Query,
    });
    rows.push(Row {
        hook: "the flow's build closure",
        armed: Armed::AtStart,
        panic: "INVALID_DATAFLOW",
        error: None,
        place: "pipeline 'faults', flow 'counts'",
        build: |flow, setup| {
            panics_at("the flow's build closure");
            count(&flow.source(setup.input.clone()))
        },
        sink: collect,
        runner: Runner::Pipeline,
    });
    rows
}

fn foreach(setup: &Setup) -> Box<dyn Sink<(u64, u64)>> {
    let out = setup.out.clone();
    Box::new(ForeachSink::new(move || FaultyForeach(out.clone())))
}

fn flaky_count(flow: &Dataflow, setup: &Setup) -> Stream<(u64, u64)> {
    flow.source(setup.input.clone())
        .key_by(key)
        .aggregate(
            "flaky_count",
            Aggregation {
                first: Arc::new(|_: &u64| Flaky(1)),
                add: Arc::new(|count: &mut Flaky, _: &u64| count.0 += 1),
                result: Arc::new(|count: &Flaky| count.0),
            },
        )
        .name("flaky")
}

// ---- Running a row ----------------------------------------------------

/// A started row: a query, or a pipeline of one flow.
enum Started {
    Query(StreamingQuery),
    Pipeline(RunningPipeline),
}

impl Started {
    fn query(&self) -> &StreamingQuery {
        match self {
            Self::Query(query) => query,
            Self::Pipeline(pipeline) => pipeline.flow("counts").expect("the one flow"),
        }
    }

    fn await_termination(&self, timeout: Duration) -> Result<bool> {
        match self {
            Self::Query(query) => query.await_termination(Some(timeout)),
            Self::Pipeline(pipeline) => pipeline.await_termination(Some(timeout)),
        }
    }
}

fn quick(config: QueryConfig) -> QueryConfig {
    config
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
}

fn start(row: &Row, setup: &Setup) -> Result<Started> {
    match row.runner {
        Runner::Query => {
            let flow = Dataflow::new("faults");
            (row.build)(&flow, setup).sink((row.sink)(setup));
            let config = quick(QueryConfig::new("faults"))
                .checkpoint_location(&setup.location)
                .allowlist_check(false);
            flow.start(config).map(Started::Query)
        }
        Runner::Pipeline => {
            let mut pipeline = Pipeline::new("faults")
                .checkpoint_root(&setup.location)
                .task_slots(16);
            let sink = pipeline.create_sink("counts", (row.sink)(setup));
            let (build, flow_setup) = (row.build, setup.clone());
            pipeline.update_flow(
                "counts",
                &sink,
                |config| quick(config).allowlist_check(false),
                move |flow: &Dataflow| build(flow, &flow_setup),
            );
            pipeline.start().map(Started::Pipeline)
        }
    }
}

/// Waits until the run read `records`, then commits a checkpoint of them.
fn checkpoint_after(started: &Started, records: u64) {
    let query = started.query();
    let deadline = Instant::now() + TIMEOUT;
    while query.metrics().records_read() < records {
        assert!(Instant::now() < deadline, "read {records} records");
        assert!(query.is_active(), "{:?}", query.exception());
        std::thread::sleep(Duration::from_millis(5));
    }
    query.checkpoint_now(TIMEOUT).expect("a checkpoint commits");
}

/// The threads of this process that rtflow started.
fn rtflow_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("Linux /proc")
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.ok()?.path().join("comm")).ok()?;
            let name = comm.trim().to_owned();
            (name.starts_with("rtflow") || name == "metrics-http").then_some(name)
        })
        .collect()
}

fn assert_no_threads_left(what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let threads = rtflow_threads();
        if threads.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: threads left: {threads:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One row with one fault: a clean run, the faulty run, the mended run.
fn run(row: &Row, fault: Fault, class: &str) {
    let what = format!("{} ({fault:?})", row.hook);
    let setup = Setup::new(row.hook, fault);
    let _ = std::fs::remove_dir_all(&setup.location);
    let keys_read = if row.hook == "join key" { KEYS } else { 0 };

    // A clean run reads batch 0 and checkpoints it.
    arm(None);
    let clean = start(row, &setup).unwrap_or_else(|e| panic!("{what}: clean start: {e}"));
    setup.push(0);
    checkpoint_after(&clean, BATCH + keys_read);
    clean.query().stop().unwrap();
    drop(clean);

    // The faulty run fails: at its start (batch 1 waiting for it), or
    // while it runs (and reads batch 1).
    let armed = Some((row.hook, fault));
    if row.armed == Armed::AtStart {
        setup.push(1);
        arm(armed);
    }
    let failed_at = Instant::now();
    let error = match start(row, &setup) {
        Err(error) => error,
        Ok(started) => {
            arm(armed);
            if row.armed != Armed::AtStart {
                setup.push(1);
            }
            if row.armed == Armed::AtEnd {
                setup.end();
            }
            let error = match started.await_termination(FAIL_WITHIN) {
                Err(error) => error,
                Ok(ended) => panic!("{what}: no failure (ended: {ended})"),
            };
            assert_eq!(
                started.query().exception().as_ref(),
                Some(&error),
                "{what}: exception() keeps the error"
            );
            assert_eq!(
                started.await_termination(Duration::ZERO).unwrap_err(),
                error,
                "{what}: await_termination returns it every time"
            );
            error
        }
    };
    assert!(failed_at.elapsed() < FAIL_WITHIN, "{what}: failed late");
    assert_eq!(error.error_class(), class, "{what}: {error}");
    let text = error.to_string();
    assert!(
        text.contains(&message(row.hook)),
        "{what}: the user's message in {text}"
    );
    assert!(
        text.contains(row.place),
        "{what}: '{}' in {text}",
        row.place
    );
    assert_no_threads_left(&what);

    // Mended, the query restarts from the same location and counts every
    // record once.
    arm(None);
    let mended = start(row, &setup).unwrap_or_else(|e| panic!("{what}: mended start: {e}"));
    let batches = if row.armed == Armed::AtEnd {
        2
    } else {
        setup.push(2);
        setup.end();
        3
    };
    assert_eq!(
        mended.await_termination(TIMEOUT),
        Ok(true),
        "{what}: the mended run ends"
    );
    assert_eq!(setup.counts(), expected(batches), "{what}: counted once");
    drop(mended);
    assert_no_threads_left(&what);
}

/// A scrape of `/metrics` on `address`: the status line and the body.
fn scrape(address: std::net::SocketAddr) -> (String, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// The metrics endpoint's thread panicking in a scrape answers it with a 500
/// carrying the message; the query runs on and the next scrape is served.
fn a_scrape_that_panics_is_answered_with_its_error() {
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let setup = Setup::new("scrape", Fault::Panic);
    let flow = Dataflow::new("scraped");
    count(&flow.source(setup.input.clone())).sink(collect(&setup));
    let config = quick(QueryConfig::new("scraped"))
        .checkpoint_location(&setup.location)
        .metrics_address(address);
    let query = flow.start(config).unwrap();
    fail::cfg("metrics-scrape", "panic(injected fault in a scrape)").unwrap();
    let (status, body) = scrape(address);
    fail::remove("metrics-scrape");
    assert!(status.contains(" 500"), "{status}");
    assert!(body.contains("'metrics-http'"), "{body}");
    assert!(body.contains("injected fault in a scrape"), "{body}");
    assert!(query.is_active());
    let (status, body) = scrape(address);
    assert!(status.contains(" 200"), "{status}");
    assert!(body.contains("rtflow_"), "{body}");
    query.stop().unwrap();
    drop(query);
    assert_no_threads_left("the scraped query");
}

/// A checkpoint whose commit fails fails the query with `CHECKPOINT_FAILED`
/// and is counted as failed, for the checkpoint alerts; the checkpoint before
/// it stays the latest.
fn a_checkpoint_that_fails_to_commit_is_counted() {
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let setup = Setup::new("commit", Fault::Panic);
    let flow = Dataflow::new("committing");
    count(&flow.source(setup.input.clone())).sink(collect(&setup));
    let config = quick(QueryConfig::new("committing"))
        .trigger(Trigger::real_time("1 hour"))
        .checkpoint_location(&setup.location)
        .metrics_address(address);
    let query = flow.start(config).unwrap();
    let committed = query.checkpoint_now(TIMEOUT).unwrap();
    let (_, body) = scrape(address);
    let line = "rtflow_checkpoint_failures_total{query=\"committing\"} 0";
    assert!(body.contains(line), "{line} not in\n{body}");
    fail::cfg("checkpoint-commit", "return(injected commit failure)").unwrap();
    let error = query.checkpoint_now(TIMEOUT).unwrap_err();
    fail::remove("checkpoint-commit");
    assert_eq!(error.error_class(), "CHECKPOINT_FAILED", "{error}");
    assert!(
        error.to_string().contains("injected commit failure"),
        "{error}"
    );
    assert_eq!(query.metrics().checkpoint_failures, 1);
    assert_eq!(query.metrics().checkpoint.map(|c| c.epoch), Some(committed));
    let (_, body) = scrape(address);
    for line in [
        "rtflow_checkpoint_failures_total{query=\"committing\"} 1",
        "rtflow_query_failed{query=\"committing\"} 1",
    ] {
        assert!(body.contains(line), "{line} not in\n{body}");
    }
    drop(query);
    assert_no_threads_left("the query whose commit failed");
}

#[test]
fn a_fault_anywhere_fails_the_query_and_a_mended_restart_counts_once() {
    for row in rows() {
        run(&row, Fault::Panic, row.panic);
        if let Some(class) = row.error {
            run(&row, Fault::Error, class);
        }
    }
    a_scrape_that_panics_is_answered_with_its_error();
    a_checkpoint_that_fails_to_commit_is_counted();
}
