//! Checkpoints with 1 million keys of keyed state and 1% of them changed per
//! epoch: how long a checkpoint takes, what it does to record latency, and how
//! long a restart takes to produce its first output.
//!
//! 1. **Store level**: `CheckpointStore::commit` of a full snapshot of `--keys`
//!    entries, then of `--store-epochs` deltas of `--keys / 100` entries each on
//!    top of it, each commit followed by `compact()` as the coordinator does
//!    (compaction, timed from start to finish on its own thread, runs once a chain
//!    holds more than 32 blobs or its deltas outweigh its base); then
//!    `CheckpointStore::open` + `recover` of the result. Also the part of a
//!    checkpoint an actor does itself, on one count actor's share (`--keys / 2`
//!    keys, `--keys / 200` of them changed): `KeyedState::begin_snapshot` at the
//!    barrier, then `continue_snapshot` encoding every changed key (which the
//!    actor does in slices between records).
//! 2. **End to end**: generator (2 partitions) -> `key_by` -> `count` -> a probe
//!    sink. First the state is built: every one of `--keys` keys once, as fast as
//!    the query takes them (the final checkpoint then holds them all). Then the
//!    query restarts on that checkpoint and runs `--seconds` at
//!    `--keys / 100` records per epoch (`--epoch-ms`, default 1 s): consecutive
//!    records go to distinct keys (a multiplicative permutation of the key
//!    space), so each epoch changes 1% of the keys. Checkpoint durations come
//!    from `query.metrics().checkpoint` (`CheckpointStats`), the progress
//!    reports' `durationMs`, and the coordinator's own log line for compaction.
//! 3. **Latency during vs between checkpoints**, in that same run: the probe sink
//!    keeps each record's ingest time (read by the source) and the wall-clock time
//!    its batch was flushed at the sink. A checkpoint window runs from the epoch's
//!    barrier (the earlier of its arrival at a sink and the commit time minus the
//!    checkpoint and compaction durations) to the progress report published after
//!    the commit and compaction (seen by a `StreamingQueryListener`). A record
//!    whose [ingest, written] interval overlaps a window counts as *during*; the
//!    rest as *between*. The first 2 s after the restart are left out. As a
//!    control, the records overlapping the same windows moved half an epoch
//!    later, where no checkpoint runs: a slow record overlaps more windows, so
//!    this shows what the rule alone does to a p99.
//! 4. **Recovery**: `CheckpointStore::open` + `recover` of the query's location
//!    alone, then `--runs` restarts timed from `Dataflow::start` to the first
//!    output record at the sink (in process), and `--runs` restarts of a child
//!    process (this binary with `--recover-child`) timed from spawning it to the
//!    line it prints when its sink sees the first record.
//!
//! `--cpus 0` (a comma-separated list) runs every query's threads on those CPUs
//! (`QueryConfig::cpu_affinity`); by default the OS places them.
//!
//! One JSON line per figure goes to stdout; the command and a summary to stderr.
//!
//! ```text
//! cargo bench --bench checkpoint
//! cargo bench --bench checkpoint -- --keys 1000000 --seconds 40 --epoch-ms 1000 \
//!     --store-epochs 40 --runs 5
//! cargo bench --bench checkpoint -- --quick        # 100,000 keys, 15 s
//! cargo bench --bench checkpoint -- --cpus 0       # the queries on CPU 0 only
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rtflow::checkpoint::{CheckpointStore, Delta, Entry, Manifest, StateId, StateMeta};
use rtflow::prelude::*;
use rtflow::runtime::progress::{StreamingQueryListener, StreamingQueryProgress};
use rtflow::runtime::record::now_nanos;
use rtflow::runtime::state::{StateContext, StateSnapshot};
use rtflow::runtime::{Epoch, Sink, SinkContext, SinkWriter};

const PARTITIONS: u64 = 2;
/// Multiplier of the key permutation: a prime, so coprime with any key count
/// that is not one of its multiples.
const PERMUTE: u64 = 999_983;
/// Records of the first seconds after a restart are not classified.
const WARM_UP: Duration = Duration::from_secs(2);

struct Args {
    keys: u64,
    seconds: u64,
    epoch_ms: u64,
    store_epochs: u64,
    runs: u64,
    quick: bool,
    /// `--cpus`: the CPUs the queries' threads run on.
    cpus: Option<Vec<usize>>,
    /// Set in the child process of a recovery run: the checkpoint location.
    recover_child: Option<PathBuf>,
}

impl Args {
    fn parse() -> Self {
        let mut args = Self {
            keys: 1_000_000,
            seconds: 40,
            epoch_ms: 1000,
            store_epochs: 40,
            runs: 5,
            quick: std::env::var_os("RTFLOW_BENCH_QUICK").is_some(),
            cpus: None,
            recover_child: None,
        };
        let words: Vec<String> = std::env::args().skip(1).collect();
        if words.iter().any(|w| w == "--quick") {
            args.quick = true;
        }
        if args.quick {
            (args.keys, args.seconds, args.store_epochs, args.runs) = (100_000, 15, 20, 3);
        }
        let mut words = words.into_iter();
        while let Some(flag) = words.next() {
            if flag == "--recover-child" {
                args.recover_child = words.next().map(PathBuf::from);
                continue;
            }
            if flag == "--cpus" {
                let list = words.next().unwrap_or_default();
                let Ok(cpus) = list.split(',').map(str::parse).collect() else {
                    eprintln!("--cpus takes a comma-separated list of CPU numbers");
                    std::process::exit(2);
                };
                args.cpus = Some(cpus);
                continue;
            }
            let value = match flag.as_str() {
                "--keys" => &mut args.keys,
                "--seconds" => &mut args.seconds,
                "--epoch-ms" => &mut args.epoch_ms,
                "--store-epochs" => &mut args.store_epochs,
                "--runs" => &mut args.runs,
                _ => continue,
            };
            let Some(parsed) = words.next().and_then(|v| v.parse().ok()).filter(|v| *v > 0) else {
                eprintln!("{flag} takes a positive integer");
                std::process::exit(2);
            };
            *value = parsed;
        }
        if args.keys.is_multiple_of(PERMUTE) || args.keys < 100 {
            eprintln!("--keys must be at least 100 and not a multiple of {PERMUTE}");
            std::process::exit(2);
        }
        args
    }

    /// Keys changed per epoch: 1%.
    fn changed(&self) -> u64 {
        self.keys / 100
    }

    /// Records per second that change 1% of the keys per epoch.
    fn rate(&self) -> u64 {
        (self.changed() * 1000 / self.epoch_ms).max(1)
    }
}

// ---------------------------------------------------------------- statistics

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// count, p50, p90, p99, max of `values`.
#[derive(Clone, Copy)]
struct Summary {
    count: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

impl Summary {
    fn of(values: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self {
            count: sorted.len(),
            p50: percentile(&sorted, 0.5),
            p90: percentile(&sorted, 0.9),
            p99: percentile(&sorted, 0.99),
            max: sorted.last().copied().unwrap_or(f64::NAN),
        }
    }

    fn json(&self, name: &str) -> String {
        format!(
            "\"{name}_count\":{},\"{name}_p50\":{:.3},\"{name}_p90\":{:.3},\"{name}_p99\":{:.3},\
             \"{name}_max\":{:.3}",
            self.count, self.p50, self.p90, self.p99, self.max
        )
    }

    fn text(&self, unit: &str) -> String {
        format!(
            "p50 {:.2} / p90 {:.2} / p99 {:.2} / max {:.2} {unit} (n={})",
            self.p50, self.p90, self.p99, self.max, self.count
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A fresh directory under the system's temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "rtflow-bench-checkpoint-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

// ---------------------------------------------------------------- store level

/// bincode's standard varint encoding of a u64, as keyed state stores keys and
/// values.
fn varint(v: u64) -> Vec<u8> {
    if v < 251 {
        vec![v as u8]
    } else if v <= u64::from(u16::MAX) {
        let mut b = vec![251];
        b.extend_from_slice(&(v as u16).to_le_bytes());
        b
    } else if v <= u64::from(u32::MAX) {
        let mut b = vec![252];
        b.extend_from_slice(&(v as u32).to_le_bytes());
        b
    } else {
        let mut b = vec![253];
        b.extend_from_slice(&v.to_le_bytes());
        b
    }
}

fn permuted(index: u64, keys: u64) -> u64 {
    (index % keys) * PERMUTE % keys
}

fn delta(entries: Vec<Entry>) -> Delta {
    Delta {
        state: StateId::new("count-1", "accumulators"),
        meta: StateMeta {
            kind: "count".into(),
            signature: "(u64, u64)".into(),
        },
        part: 0,
        keyed: true,
        entries,
    }
}

fn manifest(epoch: Epoch) -> Manifest {
    Manifest {
        epoch,
        query_id: "bench".into(),
        watermark: None,
        sources: BTreeMap::new(),
        state: BTreeMap::new(),
        key_groups: 128,
        committed_at_ms: 0,
        run_id: "run".into(),
    }
}

fn entry(key: u64, count: u64) -> Entry {
    Entry {
        group: (key % 128) as u32,
        key: varint(key),
        value: Some(varint(count)),
    }
}

struct StoreFigures {
    base_ms: f64,
    base_bytes: usize,
    commit: Summary,
    delta_bytes: usize,
    compact: Summary,
    noop_compact: Summary,
    open: Summary,
    recover: Summary,
    chain: usize,
    /// At the barrier; encoding the changed keys.
    keyed_snapshot: (Summary, Summary),
}

fn store_level(args: &Args) -> std::result::Result<StoreFigures, BoxError> {
    let dir = TempDir::new("store");
    let keys = args.keys;
    let changed = args.changed();
    let mut store = CheckpointStore::open(&dir.0, 3)?;

    let base: Vec<Entry> = (0..keys).map(|k| entry(k, 1)).collect();
    let started = Instant::now();
    let (_, stats) = store.commit(manifest(1), vec![delta(base)])?;
    let base_ms = ms(started.elapsed());
    let base_bytes = stats.bytes;
    store.compact()?;

    let (mut commits, mut compacts, mut noops) = (Vec::new(), Vec::new(), Vec::new());
    let mut delta_bytes = 0;
    for epoch in 2..=args.store_epochs + 1 {
        let first = (epoch - 2) * changed;
        let entries: Vec<Entry> = (first..first + changed)
            .map(|i| entry(permuted(i, keys), epoch))
            .collect();
        let started = Instant::now();
        let (_, stats) = store.commit(manifest(epoch), vec![delta(entries)])?;
        commits.push(ms(started.elapsed()));
        delta_bytes = stats.bytes;
        // Compaction runs on a thread of its own: time it from start to finish.
        let started = Instant::now();
        if store.compact()? {
            store.finish_compaction()?;
            compacts.push(ms(started.elapsed()));
        } else {
            noops.push(ms(started.elapsed()));
        }
    }
    drop(store);

    let (mut opens, mut recovers, mut chain) = (Vec::new(), Vec::new(), 0);
    for _ in 0..args.runs.min(3) {
        let started = Instant::now();
        let mut store = CheckpointStore::open(&dir.0, 3)?;
        opens.push(ms(started.elapsed()));
        let started = Instant::now();
        let recovery = store.recover()?;
        recovers.push(ms(started.elapsed()));
        let live: usize = recovery.state.values().map(|s| s.entries().len()).sum();
        assert_eq!(live as u64, keys, "every key recovered");
        chain = recovery
            .manifest
            .iter()
            .flat_map(|m| m.state.values())
            .map(|c| c.blobs.len())
            .sum();
    }
    Ok(StoreFigures {
        keyed_snapshot: keyed_snapshot(args)?,
        base_ms,
        base_bytes,
        commit: Summary::of(&commits),
        delta_bytes,
        compact: Summary::of(&compacts),
        noop_compact: Summary::of(&noops),
        open: Summary::of(&opens),
        recover: Summary::of(&recovers),
        chain,
    })
}

/// `KeyedState` snapshot times of one of the query's count actors: at the
/// barrier, and encoding the changed keys.
fn keyed_snapshot(args: &Args) -> std::result::Result<(Summary, Summary), BoxError> {
    let share = args.keys / PARTITIONS;
    let changed = args.changed() / PARTITIONS;
    let ctx = StateContext::detached("count", 0, 1, 128);
    let mut counts = ctx.keyed::<u64, u64>("counts")?;
    for key in 0..share {
        counts.insert(key, 1);
    }
    counts.snapshot(&mut StateSnapshot::default())?;
    let (mut barrier, mut encoding) = (Vec::new(), Vec::new());
    for epoch in 0..args.store_epochs {
        for i in epoch * changed..(epoch + 1) * changed {
            *counts.get_or_insert_with(permuted(i, share), || 0) += 1;
        }
        let mut snapshot = StateSnapshot::default();
        let started = Instant::now();
        counts.begin_snapshot(&mut snapshot)?;
        barrier.push(ms(started.elapsed()));
        let started = Instant::now();
        assert!(counts.continue_snapshot(usize::MAX, &mut snapshot)?);
        encoding.push(ms(started.elapsed()));
        assert_eq!(snapshot.entries() as u64, changed);
    }
    Ok((Summary::of(&barrier), Summary::of(&encoding)))
}

// ---------------------------------------------------------------- the query

/// What the probe sink saw.
#[derive(Default)]
struct ProbeLog {
    /// Whether records' (ingest, written) times are kept.
    recording: AtomicBool,
    /// (ingest time, written time) per record, wall-clock ns.
    records: Mutex<Vec<(u64, u64)>>,
    /// (epoch, when the barrier reached a sink), wall-clock ns.
    barriers: Mutex<Vec<(Epoch, u64)>>,
    /// When the first record reached the sink in this run.
    first: Mutex<Option<Instant>>,
    arrived: Condvar,
}

impl ProbeLog {
    fn wait_first(&self, timeout: Duration) -> Option<Instant> {
        let guard = self.first.lock().unwrap();
        let (guard, _) = self
            .arrived
            .wait_timeout_while(guard, timeout, |first| first.is_none())
            .unwrap();
        *guard
    }
}

/// A sink that writes nothing and keeps timings in a [`ProbeLog`].
struct ProbeSink(Arc<ProbeLog>);

struct ProbeWriter {
    log: Arc<ProbeLog>,
    seen: bool,
    /// Ingest times of the records since the last flush.
    pending: Vec<u64>,
}

impl<T: Data> Sink<T> for ProbeSink {
    fn kind(&self) -> &str {
        "probe"
    }

    fn writer(&self, _ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        Ok(Box::new(ProbeWriter {
            log: self.0.clone(),
            seen: false,
            pending: Vec::new(),
        }))
    }
}

impl<T> SinkWriter<T> for ProbeWriter {
    fn write(&mut self, record: Record<T>) -> Result<()> {
        if !self.seen {
            self.seen = true;
            let now = Instant::now();
            let mut first = self.log.first.lock().unwrap();
            if first.is_none() {
                *first = Some(now);
                self.log.arrived.notify_all();
            }
        }
        self.pending.push(record.meta.ingest_time);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.log.recording.load(Ordering::Relaxed) {
            let done = now_nanos();
            let mut records = self.log.records.lock().unwrap();
            records.extend(self.pending.iter().map(|ingest| (*ingest, done)));
        }
        self.pending.clear();
        Ok(())
    }

    fn on_barrier(&mut self, epoch: Epoch) -> Result<()> {
        let at = now_nanos();
        self.log.barriers.lock().unwrap().push((epoch, at));
        SinkWriter::<T>::flush(self)
    }
}

/// Progress reports made at a checkpoint commit: (epoch, when published, ms).
#[derive(Default)]
struct Commits(Mutex<Vec<(Epoch, u64, u64)>>);

impl StreamingQueryListener for Commits {
    fn on_query_progress(&self, progress: &StreamingQueryProgress) {
        if let Some(checkpoint) = progress.duration_ms.get("checkpoint") {
            let at = now_nanos();
            self.0
                .lock()
                .unwrap()
                .push((progress.batch_id, at, *checkpoint));
        }
    }
}

/// The coordinator's log, kept to read compaction times from.
#[derive(Clone, Default)]
struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl Write for LogCapture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    fn take(&self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut *self.0.lock().unwrap())).into_owned()
    }
}

/// The value of `name=` after `after` in a log line.
fn field<'a>(line: &'a str, after: &str, name: &str) -> Option<&'a str> {
    let rest = &line[line.find(after)? + after.len()..];
    let start = rest.find(&format!(" {name}="))? + name.len() + 2;
    rest[start..].split_whitespace().next()
}

/// A `Debug`-formatted duration (`1.5s`, `12.3ms`, `40µs`, `7ns`) in ms.
fn parse_debug_ms(text: &str) -> Option<f64> {
    for (suffix, scale) in [("ms", 1.0), ("µs", 1e-3), ("ns", 1e-6), ("s", 1e3)] {
        if let Some(number) = text.strip_suffix(suffix) {
            return number.parse::<f64>().ok().map(|v| v * scale);
        }
    }
    None
}

/// Per epoch: the compaction time (ms) and the entries of the checkpoint, from
/// the coordinator's log.
fn parse_log(log: &str) -> (HashMap<Epoch, f64>, HashMap<Epoch, u64>) {
    let (mut compactions, mut entries) = (HashMap::new(), HashMap::new());
    for line in log.lines() {
        const COMPACTED: &str = "snapshot chains compacted";
        const COMMITTED: &str = "checkpoint committed";
        if line.contains(COMPACTED) {
            let epoch = field(line, COMPACTED, "epoch").and_then(|e| e.parse().ok());
            let took = field(line, COMPACTED, "took").and_then(parse_debug_ms);
            if let (Some(epoch), Some(took)) = (epoch, took) {
                compactions.insert(epoch, took);
            }
        } else if line.contains(COMMITTED) {
            let epoch = field(line, COMMITTED, "epoch").and_then(|e| e.parse().ok());
            let count = field(line, COMMITTED, "entries").and_then(|e| e.parse().ok());
            if let (Some(epoch), Some(count)) = (epoch, count) {
                entries.insert(epoch, count);
            }
        }
    }
    (compactions, entries)
}

fn config(location: &Path, args: &Args, listener: Option<Arc<Commits>>) -> QueryConfig {
    let mut config = QueryConfig::new("checkpoint-bench")
        .checkpoint_location(location)
        .trigger(Trigger::real_time(format!(
            "{} milliseconds",
            args.epoch_ms
        )))
        .min_batch_duration(Duration::from_millis(args.epoch_ms))
        .progress_interval(Duration::from_secs(3600))
        .allowlist_check(false);
    if let Some(listener) = listener {
        config = config.listener(listener);
    }
    if let Some(cpus) = &args.cpus {
        config = config.cpu_affinity(cpus.iter().copied());
    }
    config
}

/// generator -> key_by -> count -> probe. Record `i` (over both partitions)
/// counts key `permuted(i)`.
fn start(
    location: &Path,
    args: &Args,
    source: GeneratorSource<u64>,
    log: &Arc<ProbeLog>,
    listener: Option<Arc<Commits>>,
) -> Result<StreamingQuery> {
    let flow = Dataflow::new("checkpoint-bench");
    flow.source(source.partitions(PARTITIONS as usize))
        .name("generator")
        .key_by(|key: &u64| *key)
        .count()
        .sink(ProbeSink(log.clone()));
    flow.start(config(location, args, listener))
}

fn generator(keys: u64) -> GeneratorSource<u64> {
    GeneratorSource::new(move |partition, offset| {
        permuted(offset * PARTITIONS + partition as u64, keys)
    })
}

struct Built {
    seconds: f64,
    final_checkpoint: rtflow::runtime::metrics::CheckpointStats,
}

/// Counts every key once, as fast as the query takes them; the final checkpoint
/// holds them all.
fn build_state(location: &Path, args: &Args) -> std::result::Result<Built, BoxError> {
    let log = Arc::new(ProbeLog::default());
    let started = Instant::now();
    let query = start(
        location,
        args,
        generator(args.keys).rows_per_partition(args.keys.div_ceil(PARTITIONS)),
        &log,
        None,
    )?;
    query.await_termination(None)?;
    let seconds = started.elapsed().as_secs_f64();
    let final_checkpoint = query
        .metrics()
        .checkpoint
        .ok_or("no checkpoint after the build")?;
    Ok(Built {
        seconds,
        final_checkpoint,
    })
}

/// One committed checkpoint of the steady run.
struct Row {
    epoch: Epoch,
    /// `CheckpointStats::duration`: barrier injected -> manifest durable.
    duration_ms: f64,
    bytes: usize,
    /// Entries written, from the coordinator's log.
    entries: Option<u64>,
    /// How long the compaction after the commit took, if one ran.
    compaction_ms: Option<f64>,
}

struct Epochs {
    rows: Vec<Row>,
    progress_ms: Vec<f64>,
    /// Latencies (µs) of the records that overlapped each row's checkpoint.
    windows: Vec<Summary>,
    records: usize,
    during: Summary,
    during_compaction: Summary,
    between: Summary,
    /// The same windows moved half an epoch later, where no checkpoint runs:
    /// what the overlap rule alone does to a p99 (a slow record overlaps more).
    control: Summary,
    restart_ms: f64,
}

/// A checkpoint window: start and end (ns since the Unix epoch), and its row.
type Window = (u64, u64, usize);

/// The window, of `windows` sorted by start, that a record read at `ingest` and
/// written at `done` overlaps: the first one ending at or after `ingest`, if it
/// started by `done`.
fn overlapped(windows: &[Window], ingest: u64, done: u64) -> Option<&Window> {
    let i = windows.partition_point(|w| w.1 < ingest);
    windows.get(i).filter(|w| w.0 <= done)
}

/// Runs `--seconds` at 1% of the keys per epoch on the built state; classifies
/// record latencies against the checkpoint windows.
fn steady_run(
    location: &Path,
    args: &Args,
    capture: &LogCapture,
) -> std::result::Result<Epochs, BoxError> {
    let log = Arc::new(ProbeLog::default());
    let commits = Arc::new(Commits::default());
    capture.take();
    let started = Instant::now();
    let query = start(
        location,
        args,
        generator(args.keys).rows_per_second(args.rate()),
        &log,
        Some(commits.clone()),
    )?;
    let first = log
        .wait_first(Duration::from_secs(60))
        .ok_or("no output after the restart")?;
    let restart_ms = ms(first - started);
    let measured_from = now_nanos() + WARM_UP.as_nanos() as u64;
    log.recording.store(true, Ordering::Relaxed);

    let mut stats = BTreeMap::new();
    let until = Instant::now() + Duration::from_secs(args.seconds);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
        if let Some(cp) = query.metrics().checkpoint {
            stats.insert(cp.epoch, cp);
        }
    }
    log.recording.store(false, Ordering::Relaxed);
    let measured_to = now_nanos();
    query.stop()?;
    drop(query);

    let (compactions, entries) = parse_log(&capture.take());
    let commits = commits.0.lock().unwrap().clone();
    let barriers = log.barriers.lock().unwrap().clone();
    let mut windows = Vec::new();
    let mut rows = Vec::new();
    for (epoch, published, _) in &commits {
        let Some(stat) = stats.get(epoch) else {
            continue;
        };
        let compaction = compactions.get(epoch).copied();
        let compaction_ns = (compaction.unwrap_or(0.0) * 1e6) as u64;
        let estimate = published
            .saturating_sub(stat.duration.as_nanos() as u64)
            .saturating_sub(compaction_ns);
        let arrived = barriers
            .iter()
            .filter(|(e, _)| e == epoch)
            .map(|(_, at)| *at)
            .min()
            .unwrap_or(u64::MAX);
        windows.push((estimate.min(arrived), *published, rows.len()));
        rows.push(Row {
            epoch: *epoch,
            duration_ms: ms(stat.duration),
            bytes: stat.bytes,
            entries: entries.get(epoch).copied(),
            compaction_ms: compaction,
        });
    }
    let compacted: Vec<bool> = rows.iter().map(|r| r.compaction_ms.is_some()).collect();
    windows.sort_by_key(|w| w.0);
    let progress_ms = commits.iter().map(|c| c.2 as f64).collect();

    let records = log.records.lock().unwrap().clone();
    let half_epoch = args.epoch_ms * 500_000;
    let control_windows: Vec<Window> = windows
        .iter()
        .map(|&(start, end, row)| (start + half_epoch, end + half_epoch, row))
        .collect();
    let mut control = Vec::new();
    let (mut during, mut during_compaction, mut between) = (Vec::new(), Vec::new(), Vec::new());
    let mut measured = 0;
    let mut per_window: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for (ingest, done) in records {
        if ingest < measured_from || done > measured_to {
            continue;
        }
        measured += 1;
        let latency = done.saturating_sub(ingest) as f64 / 1e3;
        if overlapped(&control_windows, ingest, done).is_some() {
            control.push(latency);
        }
        match overlapped(&windows, ingest, done) {
            Some((_, _, row)) => {
                during.push(latency);
                per_window[*row].push(latency);
                if compacted[*row] {
                    during_compaction.push(latency);
                }
            }
            _ => between.push(latency),
        }
    }
    let windows = per_window.iter().map(|l| Summary::of(l)).collect();
    Ok(Epochs {
        windows,
        rows,
        progress_ms,
        records: measured,
        during: Summary::of(&during),
        during_compaction: Summary::of(&during_compaction),
        between: Summary::of(&between),
        control: Summary::of(&control),
        restart_ms,
    })
}

struct Recovery {
    open: Summary,
    recover: Summary,
    chain: usize,
    in_process: Summary,
    start_call: Summary,
    child: Summary,
    child_inner: Summary,
}

fn recovery(location: &Path, args: &Args) -> std::result::Result<Recovery, BoxError> {
    let (mut opens, mut recovers, mut chain) = (Vec::new(), Vec::new(), 0);
    for _ in 0..args.runs {
        let started = Instant::now();
        let mut store = CheckpointStore::open(location, 3)?;
        opens.push(ms(started.elapsed()));
        let started = Instant::now();
        let recovery = store.recover()?;
        recovers.push(ms(started.elapsed()));
        let live: usize = recovery.state.values().map(|s| s.entries().len()).sum();
        assert!(live as u64 >= args.keys, "every key recovered");
        chain = recovery
            .manifest
            .iter()
            .flat_map(|m| m.state.values())
            .map(|c| c.blobs.len())
            .sum();
    }

    let (mut firsts, mut starts) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        let log = Arc::new(ProbeLog::default());
        let started = Instant::now();
        let query = start(
            location,
            args,
            generator(args.keys).rows_per_second(args.rate()),
            &log,
            None,
        )?;
        starts.push(ms(started.elapsed()));
        let first = log
            .wait_first(Duration::from_secs(60))
            .ok_or("no output after a restart")?;
        firsts.push(ms(first - started));
        query.stop()?;
    }

    let (mut children, mut inner) = (Vec::new(), Vec::new());
    let exe = std::env::current_exe()?;
    for _ in 0..args.runs {
        let started = Instant::now();
        let mut child = Command::new(&exe)
            .arg("--recover-child")
            .arg(location)
            .args(["--keys", &args.keys.to_string()])
            .args(["--epoch-ms", &args.epoch_ms.to_string()])
            .args(
                args.cpus
                    .iter()
                    .flat_map(|cpus| ["--cpus".to_owned(), cpu_list(cpus)]),
            )
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = lines.next().ok_or("the child printed nothing")??;
        children.push(ms(started.elapsed()));
        let child_ms: f64 = line
            .strip_prefix("first-output-ms ")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("unexpected child output: {line}"))?;
        inner.push(child_ms);
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("the recovery child failed: {status}").into());
        }
    }
    Ok(Recovery {
        open: Summary::of(&opens),
        recover: Summary::of(&recovers),
        chain,
        in_process: Summary::of(&firsts),
        start_call: Summary::of(&starts),
        child: Summary::of(&children),
        child_inner: Summary::of(&inner),
    })
}

/// The child of a recovery run: starts the query on `location`, prints the time
/// from its own start to the first output record, stops the query.
fn recover_child(location: &Path, args: &Args) -> std::result::Result<(), BoxError> {
    let started = Instant::now();
    let log = Arc::new(ProbeLog::default());
    let query = start(
        location,
        args,
        generator(args.keys).rows_per_second(args.rate()),
        &log,
        None,
    )?;
    let first = log
        .wait_first(Duration::from_secs(60))
        .ok_or("no output after the restart")?;
    println!("first-output-ms {:.3}", ms(first - started));
    std::io::stdout().flush()?;
    query.stop()?;
    Ok(())
}

fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn main() -> std::result::Result<(), BoxError> {
    let args = Args::parse();
    if let Some(location) = &args.recover_child {
        return recover_child(location, &args);
    }
    let capture = LogCapture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "rtflow_runtime::coordinator=info",
        ))
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();

    eprintln!(
        "command: cargo bench --bench checkpoint -- --keys {} --seconds {} --epoch-ms {} \
         --store-epochs {} --runs {}{}",
        args.keys,
        args.seconds,
        args.epoch_ms,
        args.store_epochs,
        args.runs,
        args.cpus
            .as_ref()
            .map_or(String::new(), |cpus| format!(" --cpus {}", cpu_list(cpus)))
    );
    let keys = args.keys;
    let changed = args.changed();

    // 1. The store alone.
    let store = store_level(&args)?;
    println!(
        "{{\"bench\":\"checkpoint\",\"part\":\"store\",\"keys\":{keys},\"changed\":{changed},\
         \"base_commit_ms\":{:.1},\"base_bytes\":{},\"delta_bytes\":{},{},{},{},{},{},\
         \"chain_blobs\":{},{},{}}}",
        store.base_ms,
        store.base_bytes,
        store.delta_bytes,
        store.commit.json("commit_ms"),
        store.compact.json("compact_ms"),
        store.noop_compact.json("noop_compact_ms"),
        store.open.json("open_ms"),
        store.recover.json("recover_ms"),
        store.chain,
        store.keyed_snapshot.0.json("keyed_snapshot_barrier_ms"),
        store.keyed_snapshot.1.json("keyed_snapshot_encoding_ms"),
    );

    // 2. and 3. A running query.
    let location = TempDir::new("query");
    let built = build_state(&location.0, &args)?;
    println!(
        "{{\"bench\":\"checkpoint\",\"part\":\"build\",\"keys\":{keys},\"seconds\":{:.2},\
         \"final_checkpoint_ms\":{:.1},\"final_checkpoint_bytes\":{}}}",
        built.seconds,
        ms(built.final_checkpoint.duration),
        built.final_checkpoint.bytes
    );
    let epochs = steady_run(&location.0, &args, &capture)?;
    let durations: Vec<f64> = epochs.rows.iter().map(|r| r.duration_ms).collect();
    let with_compaction: Vec<f64> = epochs.rows.iter().filter_map(|r| r.compaction_ms).collect();
    let delta_entries: Vec<f64> = epochs
        .rows
        .iter()
        .filter_map(|r| r.entries.map(|e| e as f64))
        .collect();
    let bytes: Vec<f64> = epochs.rows.iter().map(|r| r.bytes as f64).collect();
    let (checkpoint, compaction, progress) = (
        Summary::of(&durations),
        Summary::of(&with_compaction),
        Summary::of(&epochs.progress_ms),
    );
    println!(
        "{{\"bench\":\"checkpoint\",\"part\":\"query\",\"keys\":{keys},\"rate\":{},\
         \"epoch_ms\":{},\"seconds\":{},\"restart_first_output_ms\":{:.1},{},{},{},\
         \"delta_entries_p50\":{:.0},\"bytes_p50\":{:.0}}}",
        args.rate(),
        args.epoch_ms,
        args.seconds,
        epochs.restart_ms,
        checkpoint.json("checkpoint_ms"),
        progress.json("progress_checkpoint_ms"),
        compaction.json("compaction_ms"),
        Summary::of(&delta_entries).p50,
        Summary::of(&bytes).p50,
    );
    let ratio = epochs.during.p99 / epochs.between.p99;
    println!(
        "{{\"bench\":\"checkpoint\",\"part\":\"latency\",\"records\":{},{},{},{},{},\
         \"p99_ratio\":{ratio:.2}}}",
        epochs.records,
        epochs.during.json("during_us"),
        epochs.during_compaction.json("during_compaction_us"),
        epochs.between.json("between_us"),
        epochs.control.json("control_us"),
    );

    // 4. Recovery.
    let state_bytes = dir_bytes(&location.0);
    let recovered = recovery(&location.0, &args)?;
    println!(
        "{{\"bench\":\"checkpoint\",\"part\":\"recovery\",\"keys\":{keys},\"location_bytes\":{state_bytes},\
         \"chain_blobs\":{},{},{},{},{},{},{}}}",
        recovered.chain,
        recovered.open.json("open_ms"),
        recovered.recover.json("recover_ms"),
        recovered.start_call.json("start_call_ms"),
        recovered.in_process.json("first_output_ms"),
        recovered.child.json("process_first_output_ms"),
        recovered.child_inner.json("child_main_first_output_ms"),
    );

    eprintln!(
        "\n{keys} keys, {changed} changed per epoch ({}%)",
        100 * changed / keys
    );
    eprintln!("store level (CheckpointStore, one state, one part):");
    eprintln!(
        "  full snapshot commit        {:.1} ms ({:.1} MB)",
        store.base_ms,
        store.base_bytes as f64 / 1e6
    );
    eprintln!(
        "  delta commit ({changed} entries, {:.0} kB)  {}",
        store.delta_bytes as f64 / 1e3,
        store.commit.text("ms")
    );
    eprintln!("  compact() when it compacts  {}", store.compact.text("ms"));
    eprintln!(
        "  compact() otherwise         {}",
        store.noop_compact.text("ms")
    );
    eprintln!("  open                        {}", store.open.text("ms"));
    eprintln!(
        "  recover ({} blobs)          {}",
        store.chain,
        store.recover.text("ms")
    );
    eprintln!(
        "  KeyedState, {} of {} keys changed: snapshot at the barrier  {}",
        changed / PARTITIONS,
        keys / PARTITIONS,
        store.keyed_snapshot.0.text("ms")
    );
    eprintln!(
        "    encoding them (in slices between records)  {}",
        store.keyed_snapshot.1.text("ms")
    );
    eprintln!(
        "query (generator x{PARTITIONS} -> key_by -> count -> sink, {} records/s, {} ms epochs, {} s):",
        args.rate(),
        args.epoch_ms,
        args.seconds
    );
    eprintln!(
        "  build: {keys} keys in {:.2} s; final checkpoint {:.1} ms ({:.1} MB)",
        built.seconds,
        ms(built.final_checkpoint.duration),
        built.final_checkpoint.bytes as f64 / 1e6
    );
    eprintln!("  checkpoint (CheckpointStats)  {}", checkpoint.text("ms"));
    eprintln!("  checkpoint (progress)         {}", progress.text("ms"));
    eprintln!("  compaction after commit       {}", compaction.text("ms"));
    eprintln!(
        "  entries per epoch p50 {:.0}",
        Summary::of(&delta_entries).p50
    );
    eprintln!("latency (ingest -> sink), µs, {} records:", epochs.records);
    eprintln!("  during checkpoints          {}", epochs.during.text("µs"));
    eprintln!(
        "    of which with compaction  {}",
        epochs.during_compaction.text("µs")
    );
    eprintln!(
        "  between checkpoints         {}",
        epochs.between.text("µs")
    );
    eprintln!(
        "  control, no checkpoint      {}",
        epochs.control.text("µs")
    );
    eprintln!("  p99 during / between        {ratio:.2} (target <= 2)");
    eprintln!("  per checkpoint: epoch, duration ms, entries, compaction ms, records, p99 µs");
    for (row, window) in epochs.rows.iter().zip(&epochs.windows) {
        eprintln!(
            "    {:>4} {:>8.1} {:>7} {:>8} {:>6} {:>9.0}",
            row.epoch,
            row.duration_ms,
            row.entries.map_or("-".into(), |e| e.to_string()),
            row.compaction_ms.map_or("-".into(), |c| format!("{c:.0}")),
            window.count,
            window.p99
        );
    }
    eprintln!(
        "recovery ({:.0} MB at the location, {} blobs):",
        state_bytes as f64 / 1e6,
        recovered.chain
    );
    eprintln!(
        "  CheckpointStore::open       {}",
        recovered.open.text("ms")
    );
    eprintln!(
        "  CheckpointStore::recover    {}",
        recovered.recover.text("ms")
    );
    eprintln!(
        "  Dataflow::start returns     {}",
        recovered.start_call.text("ms")
    );
    eprintln!(
        "  start -> first output       {} (target < 1000)",
        recovered.in_process.text("ms")
    );
    eprintln!(
        "  process spawn -> first out  {}",
        recovered.child.text("ms")
    );
    eprintln!(
        "    (child main -> first out  {})",
        recovered.child_inner.text("ms")
    );
    Ok(())
}
