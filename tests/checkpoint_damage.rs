//! A damaged or rolled-back checkpoint must never silently lose or duplicate
//! committed output.
//!
//! Every case runs Kafka (3 partitions) -> count per key -> exactly-once Kafka
//! sink, checkpointing every 200 ms, on a fresh checkpoint location and fresh
//! topics (a query id belongs to its location, and the commit topic to the query
//! id), stops it, damages the location, restarts on it, feeds more input and
//! checks the contract. Either the restarted query restores and the
//! read_committed output of the whole case holds every expected `key:count`
//! exactly once and nothing else, or the restart fails with `CHECKPOINT_FAILED`
//! (`start()` returns it, or the query terminates with it within 30 s) and the
//! output read so far holds no duplicate and nothing unexpected; it may lack the
//! tail the failed run never processed. Silent loss or duplication never passes.
//!
//! - Fault injection: truncation, bit flips and deletion of every kind of file
//!   the location holds at damage time (sled's log, its config, snapshot and blob
//!   files where sled wrote any, each snapshot segment from the newest epoch's
//!   back to the oldest (up to six), and the newest and oldest other file of
//!   each directory: manifests, a query id). Files are found by walking the
//!   location at damage time, never by fixed names beyond telling sled's own
//!   files apart.
//! - A checkpoint rolled back behind its commit topic fails the restart.
//! - A location that lost its sled store but kept its snapshot segments fails
//!   the start instead of starting as a new query.
//!
//! The damage comes from a seeded splitmix64 (`RTFLOW_DAMAGE_SEED`, decimal or
//! `0x` hex; each test prints it and its failure message names it), so the
//! same seed draws the same choices. File sizes and epoch numbers vary a little
//! with timing from run to run, so every case also prints the file, the damage
//! kind and the offset it hit. A damage test runs all of its cases before
//! failing with the list of those that broke the contract, so that one run
//! reports every outcome.

mod common;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use common::kafka::{bootstrap, expected_key_counts, keyed_records, produce, reader, topic};
use common::{config, copy_dir, TIMEOUT};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rtflow::prelude::*;

/// Records per wave of input: three per key.
const WAVE: usize = 30;
/// Waves of the first run: each lands in epochs of its own, so the location
/// holds segments of several epochs.
const FIRST_RUN_WAVES: usize = 3;
/// Records fed to the restarted query.
const MORE: usize = 30;
/// The error class a refused restart must carry.
const CHECKPOINT_FAILED: &str = "CHECKPOINT_FAILED";

// ---------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------

#[test]
fn damage_to_the_sled_log() {
    damage_cases(vec![Target::SledLog]);
}

#[test]
fn damage_to_sled_config_snapshot_and_blob_files() {
    damage_cases(vec![
        Target::SledConf,
        Target::SledSnapshot,
        Target::SledBlob,
    ]);
}

#[test]
fn damage_to_the_newest_snapshot_segment() {
    damage_cases(vec![Target::Segment { from_newest: 0 }]);
}

/// Every older segment, up to five (a first run leaves three or four): newer
/// manifests' state chains still read them.
#[test]
fn damage_to_older_snapshot_segments() {
    damage_cases(
        (1..=5)
            .map(|from_newest| Target::Segment { from_newest })
            .collect(),
    );
}

/// Files that are neither sled's nor segments (manifests or a query id kept as
/// plain files): which there are is only known once a query has run, so a
/// first run finds them, and every directory of them gets its newest and its
/// oldest file damaged.
#[test]
fn damage_to_other_files_of_the_location() {
    let Some(bootstrap) = bootstrap() else { return };
    let mut probe = Case::new(&bootstrap, "damage-probe");
    probe.run(FIRST_RUN_WAVES);
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    for file in files(&probe.location) {
        if file.class == Class::Other {
            *groups.entry(file.dir()).or_default() += 1;
        }
    }
    probe.clean();
    if groups.is_empty() {
        println!("no files besides sled's and the segments: nothing to damage here");
        return;
    }
    let targets = groups
        .into_iter()
        .flat_map(|(dir, count)| {
            let newest = Target::Other {
                dir: dir.clone(),
                newest: true,
            };
            let oldest = (count > 1).then_some(Target::Other { dir, newest: false });
            std::iter::once(newest).chain(oldest)
        })
        .collect();
    damage_cases(targets);
}

/// A location restored from a copy taken before the last run is older than
/// the commit topic, which names the epochs that run committed: restoring it
/// would publish that run's output again (or take the old commit records for
/// the new epochs' and drop them), so the restart must fail.
#[test]
fn a_checkpoint_older_than_its_commit_topic_fails_the_restart() {
    let Some(bootstrap) = bootstrap() else { return };
    let seed = seed();
    let mut case = Case::new(&bootstrap, "damage-rollback");
    case.run(FIRST_RUN_WAVES);
    let aside = case.location.with_extension("aside");
    copy_dir(&case.location, &aside);
    case.run(1);
    std::fs::remove_dir_all(&case.location).unwrap();
    std::fs::rename(&aside, &case.location).unwrap();

    let outcome = case.restart(MORE);
    let name = format!(
        "location rolled back to the copy taken after {} of {} records",
        FIRST_RUN_WAVES * WAVE,
        (FIRST_RUN_WAVES + 1) * WAVE
    );
    println!("{name}: {outcome}");
    if let Some(violation) = outcome.violation(true) {
        panic!("{name} (seed {seed:#x}): {violation}");
    }
    case.clean();
}

/// Segments without the sled store that says what they hold are not a new
/// query's location: starting afresh would read the input again and publish it
/// under a new query id, past the old commit topic.
#[test]
fn a_location_whose_sled_store_was_deleted_fails_to_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let seed = seed();
    let mut case = Case::new(&bootstrap, "damage-no-sled");
    case.run(FIRST_RUN_WAVES);
    let mut deleted = Vec::new();
    for file in files(&case.location) {
        if file.class.is_sled() {
            std::fs::remove_file(&file.path).unwrap();
            deleted.push(file.rel.clone());
        }
    }
    let blobs = case.location.join("blobs");
    if blobs.is_dir() {
        std::fs::remove_dir_all(&blobs).unwrap();
    }
    let left = files(&case.location);
    assert!(
        left.iter().any(|file| file.class == Class::Segment),
        "the first run left snapshot segments: {left:?}"
    );

    let outcome = case.restart(MORE);
    let name = format!("deleted sled's files {deleted:?}");
    println!("{name}: {outcome}");
    if let Some(violation) = outcome.violation(true) {
        panic!("{name} (seed {seed:#x}): {violation}");
    }
    let Ending::Refused {
        error,
        at_start: true,
    } = &outcome.ending
    else {
        panic!("{name}: the start itself must fail, not the running query: {outcome}");
    };
    // The message must tell the user which location it is and what is missing
    // from it (the manifests, kept in the sled store), not only that it failed.
    let message = error.to_string();
    let lower = message.to_lowercase();
    assert!(
        message.contains(&case.location.display().to_string())
            && ["manifest", "sled", "store"]
                .iter()
                .any(|word| lower.contains(word)),
        "{name}: the error names the location and what is missing: {message}"
    );
    case.clean();
}

// ---------------------------------------------------------------------------
// Fault injection
// ---------------------------------------------------------------------------

/// Runs every damage kind on each of `targets`, each on its own first run, and
/// fails at the end with every case that broke the contract.
fn damage_cases(targets: Vec<Target>) {
    let Some(bootstrap) = bootstrap() else { return };
    let seed = seed();
    let mut broken = Vec::new();
    let mut cases = 0;
    'targets: for target in targets {
        for kind in target.kinds() {
            let label = format!("{target} / {kind:?}");
            // Per case, so a case draws the same damage whatever ran before it.
            let mut rng = SplitMix64(seed ^ fnv1a(&label));
            let mut case = Case::new(&bootstrap, "damage");
            case.run(FIRST_RUN_WAVES);
            let found = files(&case.location);
            let Some(file) = target.pick(&found, &mut rng) else {
                // The same layout would come back for the other kinds, and
                // older segments than the oldest there is for the next ranks.
                println!("skipped {target}: the location holds none: {found:?}");
                case.clean();
                match target {
                    Target::Segment { .. } => break 'targets,
                    _ => break,
                }
            };
            let Some(damage) = kind.apply(&file, &mut rng) else {
                println!("skipped {label}: {} is empty", file.rel);
                case.clean();
                continue;
            };
            cases += 1;
            let name = format!("{target} {}: {damage}", file.rel);
            let outcome = case.restart(MORE);
            match outcome.violation(false) {
                None => {
                    println!("ok   {name}: {outcome}");
                    case.clean();
                }
                Some(violation) => {
                    println!(
                        "FAIL {name}: {violation} (location kept at {})",
                        case.location.display()
                    );
                    broken.push(format!("{name}: {violation}"));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "seed {seed:#x} (RTFLOW_DAMAGE_SEED): {} of {cases} cases broke the contract:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// Which file of the location a case damages.
#[derive(Debug, Clone)]
enum Target {
    /// sled's log (`db`), which holds the manifests and the query id.
    SledLog,
    SledConf,
    /// The newest of sled's page-table snapshots (`snap.*`).
    SledSnapshot,
    /// One of the values sled keeps out of its log (`blobs/`).
    SledBlob,
    /// A snapshot segment, by rank: 0 is the newest epoch's.
    Segment {
        from_newest: usize,
    },
    /// The newest or the oldest other file of one directory (`dir` relative to
    /// the location, empty for its top level).
    Other {
        dir: String,
        newest: bool,
    },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SledLog => write!(f, "sled log"),
            Self::SledConf => write!(f, "sled conf"),
            Self::SledSnapshot => write!(f, "sled snapshot"),
            Self::SledBlob => write!(f, "sled blob"),
            Self::Segment { from_newest: 0 } => write!(f, "newest segment"),
            Self::Segment { from_newest } => write!(f, "segment {from_newest} before the newest"),
            Self::Other { dir, newest } => write!(
                f,
                "{} other file in '{dir}'",
                if *newest { "newest" } else { "oldest" }
            ),
        }
    }
}

impl Target {
    fn kinds(&self) -> &'static [Kind] {
        match self {
            // The log's tail holds the last manifests sled wrote: a flip there
            // is what a torn last write looks like, so it gets a case of its own.
            Self::SledLog => &[Kind::Truncate, Kind::FlipNearEnd, Kind::Flip, Kind::Delete],
            _ => &[Kind::Truncate, Kind::Flip, Kind::Delete],
        }
    }

    fn pick(&self, files: &[File], rng: &mut SplitMix64) -> Option<File> {
        let of =
            |class: Class| -> Vec<&File> { files.iter().filter(|f| f.class == class).collect() };
        // `files` is sorted by path, and segment and sled snapshot names sort by
        // epoch and log position.
        let picked = match self {
            Self::SledLog => of(Class::SledLog).last().copied(),
            Self::SledConf => of(Class::SledConf).last().copied(),
            Self::SledSnapshot => of(Class::SledSnapshot).last().copied(),
            Self::SledBlob => rng.choose(&of(Class::SledBlob)).copied(),
            Self::Segment { from_newest } => {
                let segments = of(Class::Segment);
                segments.iter().rev().nth(*from_newest).copied()
            }
            Self::Other { dir, newest } => {
                let in_dir: Vec<&File> = of(Class::Other)
                    .into_iter()
                    .filter(|f| &f.dir() == dir)
                    .collect();
                if *newest {
                    in_dir.last().copied()
                } else {
                    in_dir.first().copied()
                }
            }
        };
        picked.cloned()
    }
}

/// How a file is damaged.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Cut short at a random point of its written bytes.
    Truncate,
    /// A few bits flipped at a random offset.
    Flip,
    /// A few bits flipped within the last 512 written bytes.
    FlipNearEnd,
    Delete,
}

impl Kind {
    /// Damages `file`, describing what it did; `None` when there is nothing to
    /// cut or flip (an empty file).
    fn apply(self, file: &File, rng: &mut SplitMix64) -> Option<String> {
        let mut bytes = std::fs::read(&file.path).unwrap();
        let len = bytes.len() as u64;
        // Only written bytes: cutting or flipping a preallocated zero tail
        // would often damage nothing.
        let written = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1) as u64;
        let description = match self {
            Self::Delete => {
                std::fs::remove_file(&file.path).unwrap();
                format!("deleted ({len} bytes)")
            }
            _ if written == 0 => return None,
            Self::Truncate => {
                let at = rng.below(written);
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&file.path)
                    .unwrap()
                    .set_len(at)
                    .unwrap();
                format!("truncated to {at} of {len} bytes")
            }
            Self::Flip | Self::FlipNearEnd => {
                let offset = match self {
                    Self::FlipNearEnd => written - 1 - rng.below(written.min(512)),
                    _ => rng.below(written),
                };
                // Three distinct bits in the (up to) 4 bytes from `offset`.
                let span = (len - offset).min(4) * 8;
                let mut bits = Vec::new();
                while bits.len() < 3.min(span as usize) {
                    let bit = rng.below(span);
                    if !bits.contains(&bit) {
                        bits.push(bit);
                    }
                }
                bits.sort_unstable();
                for bit in &bits {
                    bytes[(offset + bit / 8) as usize] ^= 1 << (bit % 8);
                }
                std::fs::write(&file.path, &bytes).unwrap();
                let at: Vec<String> = bits
                    .iter()
                    .map(|bit| format!("{}.{}", offset + bit / 8, bit % 8))
                    .collect();
                format!("flipped bits at byte.bit {} of {len} bytes", at.join(", "))
            }
        };
        Some(description)
    }
}

/// What a file of the location is, told by name alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    SledLog,
    SledConf,
    SledSnapshot,
    SledBlob,
    /// A snapshot segment under `snapshots/`.
    Segment,
    /// Anything else: manifests or a query id kept as plain files.
    Other,
}

impl Class {
    fn of(rel: &Path) -> Self {
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        match parts.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["snapshots", ..] => Self::Segment,
            ["db"] => Self::SledLog,
            ["conf"] => Self::SledConf,
            [name] if name.starts_with("snap.") => Self::SledSnapshot,
            ["blobs", ..] => Self::SledBlob,
            _ => Self::Other,
        }
    }

    fn is_sled(self) -> bool {
        matches!(
            self,
            Self::SledLog | Self::SledConf | Self::SledSnapshot | Self::SledBlob
        )
    }
}

/// One file of a checkpoint location.
#[derive(Clone)]
struct File {
    path: PathBuf,
    /// Relative to the location, with `/` between components.
    rel: String,
    class: Class,
    len: u64,
    modified: Option<SystemTime>,
}

impl File {
    /// The directory holding it, relative to the location (empty at the top).
    fn dir(&self) -> String {
        self.rel
            .rsplit_once('/')
            .map_or(String::new(), |(dir, _)| dir.to_owned())
    }
}

impl fmt::Debug for File {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} bytes)", self.rel, self.len)
    }
}

/// Every file under `location`, sorted by relative path.
fn files(location: &Path) -> Vec<File> {
    fn walk(location: &Path, dir: &Path, out: &mut Vec<File>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                walk(location, &path, out);
                continue;
            }
            let rel_path = path.strip_prefix(location).unwrap();
            let rel = rel_path
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push(File {
                class: Class::of(rel_path),
                rel,
                len: meta.len(),
                modified: meta.modified().ok(),
                path,
            });
        }
    }
    let mut out = Vec::new();
    walk(location, location, &mut out);
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    out
}

/// Waits until no file of `location` changes for 100 ms. `stop()` joins the
/// query's threads, but the store's own background writers (sled's flusher)
/// may outlive it for a moment; damage they then overwrote would test nothing.
fn settle(location: &Path) {
    let state = || -> Vec<(String, u64, Option<SystemTime>)> {
        files(location)
            .into_iter()
            .map(|f| (f.rel, f.len, f.modified))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = state();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = state();
        if now == last || Instant::now() > deadline {
            return;
        }
        last = now;
    }
}

// ---------------------------------------------------------------------------
// One case: a location, its topics, and the runs on them
// ---------------------------------------------------------------------------

struct Case {
    bootstrap: String,
    input: String,
    output: Output,
    config: QueryConfig,
    location: PathBuf,
    /// Records written to `input` so far: `0..produced`.
    produced: usize,
}

impl Case {
    fn new(bootstrap: &str, name: &str) -> Self {
        let input = topic(bootstrap, &format!("rtflow-{name}-in"), 3);
        let output = topic(bootstrap, &format!("rtflow-{name}-out"), 1);
        let config = config(name)
            .trigger(Trigger::real_time("200 milliseconds"))
            .min_batch_duration(Duration::from_millis(200));
        Self {
            bootstrap: bootstrap.to_owned(),
            location: config.checkpoint_location.clone().unwrap(),
            output: Output::new(bootstrap, &output),
            input,
            config,
            produced: 0,
        }
    }

    /// Kafka -> count per key -> Kafka, exactly once, on the case's location.
    fn start(&self) -> rtflow::Result<StreamingQuery> {
        let flow = Dataflow::new("damage");
        let sink = KafkaSink::new(
            &self.bootstrap,
            &self.output.topic,
            |(key, count): &(String, u64)| {
                KafkaMessage::new(format!("{key}:{count}")).key(key.clone())
            },
        )
        .delivery(DeliveryGuarantee::ExactlyOnce);
        flow.source(
            KafkaSource::new(&self.bootstrap)
                .subscribe([self.input.as_str()])
                .starting_offsets(StartingOffsets::Earliest),
        )
        .map(|record: KafkaRecord| record.key_str().into_owned())
        .key_by(|key: &String| key.clone())
        .count()
        .sink(sink);
        flow.start(self.config.clone())
    }

    fn produce(&mut self, count: usize) {
        produce(
            &self.bootstrap,
            &self.input,
            keyed_records(self.produced, self.produced + count),
        );
        self.produced += count;
    }

    /// A healthy run: `waves` waves of input, each waited for in the output
    /// (so each commits in epochs of its own), then a stop. Panics unless the
    /// output is then exactly once: the cases damage only what a correct run
    /// left.
    fn run(&mut self, waves: usize) {
        let query = self.start().expect("the healthy run starts");
        for _ in 0..waves {
            self.produce(WAVE);
            let expected = expected_key_counts(self.produced);
            let complete = self
                .output
                .wait_for(&expected, TIMEOUT, || query.exception());
            assert!(
                complete,
                "the healthy run publishes its counts: {:?}; {}",
                query.exception(),
                differences(&self.output.counts(), &expected)
            );
        }
        query.stop().unwrap();
        assert_eq!(query.exception(), None, "the healthy run stops cleanly");
        self.output.read_to_end(TIMEOUT);
        assert_eq!(
            self.output.counts(),
            expected_key_counts(self.produced),
            "the healthy run is exactly once: {}",
            differences(&self.output.counts(), &expected_key_counts(self.produced))
        );
        settle(&self.location);
    }

    /// Restarts on the (damaged) location, feeds `more` records, and reports
    /// how the restart ended and what the output of the whole case holds.
    fn restart(&mut self, more: usize) -> Outcome {
        let expected_total = expected_key_counts(self.produced + more);
        let ending = match self.start() {
            Err(error) => {
                let ending = Ending::of(error, true);
                self.produce(more);
                ending
            }
            Ok(query) => {
                self.produce(more);
                let ending = self.await_restart(&query, &expected_total);
                drop(query);
                ending
            }
        };
        // A failed writer may leave a transaction open until the broker times
        // it out; what is readable by then is what the contract judges.
        let read_to_end = self.output.read_to_end(Duration::from_secs(10));
        Outcome {
            ending,
            seen: self.output.counts(),
            expected: expected_total,
            read_to_end,
        }
    }

    /// Waits until the restarted query published every expected count (and a
    /// little longer, for duplicates or a late failure to show), or failed, or
    /// 30 s passed; then stops it.
    fn await_restart(
        &mut self,
        query: &StreamingQuery,
        expected: &BTreeMap<String, usize>,
    ) -> Ending {
        let terminated = |query: &StreamingQuery| match query
            .await_termination(Some(Duration::from_millis(50)))
        {
            Err(error) => Some(Ending::of(error, false)),
            Ok(true) => Some(Ending::Ended),
            Ok(false) => None,
        };
        let deadline = Instant::now() + TIMEOUT;
        while !self.output.has_all(expected) && Instant::now() < deadline {
            if let Some(ending) = terminated(query) {
                return ending;
            }
            self.output.poll(Duration::from_millis(50));
        }
        // Several epochs: a replay's duplicates commit with the next epochs.
        let grace = Instant::now() + Duration::from_secs(1);
        while Instant::now() < grace {
            if let Some(ending) = terminated(query) {
                return ending;
            }
            self.output.poll(Duration::from_millis(50));
        }
        query.stop().unwrap();
        match query.exception() {
            Some(error) => Ending::of(error, false),
            None => Ending::Restored,
        }
    }

    /// Removes the location of a case that passed (a failed one's is kept to
    /// look at).
    fn clean(&self) {
        let _ = std::fs::remove_dir_all(&self.location);
    }
}

/// How a restart ended.
enum Ending {
    /// It ran until stopped.
    Restored,
    /// It failed with `CHECKPOINT_FAILED`: at `start()`, or while running.
    Refused { error: RtflowError, at_start: bool },
    /// It failed with another error.
    Failed { error: RtflowError, at_start: bool },
    /// A Kafka source never ends: terminating without an error is a bug.
    Ended,
}

impl Ending {
    fn of(error: RtflowError, at_start: bool) -> Self {
        if error.error_class() == CHECKPOINT_FAILED {
            Self::Refused { error, at_start }
        } else {
            Self::Failed { error, at_start }
        }
    }
}

impl fmt::Display for Ending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let when = |at_start: bool| {
            if at_start {
                "start() failed"
            } else {
                "start ok, then failed"
            }
        };
        match self {
            Self::Restored => write!(f, "restored"),
            Self::Refused { error, at_start } | Self::Failed { error, at_start } => {
                write!(
                    f,
                    "{} with {}: {error}",
                    when(*at_start),
                    error.error_class()
                )
            }
            Self::Ended => write!(f, "start ok, then terminated without an error"),
        }
    }
}

struct Outcome {
    ending: Ending,
    /// The read_committed output of the whole case, value -> times seen.
    seen: BTreeMap<String, usize>,
    expected: BTreeMap<String, usize>,
    /// Whether the output was read to its end (no transaction left open).
    read_to_end: bool,
}

impl Outcome {
    /// How the outcome breaks the contract, if it does. `must_refuse`: the
    /// restart has to fail with `CHECKPOINT_FAILED`.
    fn violation(&self, must_refuse: bool) -> Option<String> {
        let differences = differences(&self.seen, &self.expected);
        let clean = self
            .seen
            .iter()
            .all(|(value, &n)| n == 1 && self.expected.contains_key(value));
        match &self.ending {
            Ending::Restored if must_refuse => Some(format!(
                "start ok, ran until stopped without {CHECKPOINT_FAILED}; output: {}",
                if differences.is_empty() {
                    "exactly once".to_owned()
                } else {
                    differences
                }
            )),
            Ending::Restored if self.seen == self.expected => None,
            Ending::Restored => Some(format!("start ok, {differences}")),
            Ending::Refused { .. } if clean => None,
            Ending::Refused { .. } => Some(format!("{}, but {differences}", self.ending)),
            Ending::Failed { .. } | Ending::Ended => Some(format!(
                "{} (not {CHECKPOINT_FAILED}); output: {}",
                self.ending,
                if differences.is_empty() {
                    "exactly once".to_owned()
                } else {
                    differences
                }
            )),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let differences = differences(&self.seen, &self.expected);
        write!(
            f,
            "{}; output {}{}",
            self.ending,
            if differences.is_empty() {
                "exactly once"
            } else {
                &differences
            },
            if self.read_to_end {
                ""
            } else {
                " (not read to its end: a transaction stayed open)"
            }
        )
    }
}

// ---------------------------------------------------------------------------
// Input, expected output, and reading it back
// ---------------------------------------------------------------------------

/// What `seen` has beyond or short of `expected`, e.g. "duplicates k1:4..k1:6;
/// missing k3:10..k3:12"; empty when they are equal.
fn differences(seen: &BTreeMap<String, usize>, expected: &BTreeMap<String, usize>) -> String {
    let duplicates = seen.iter().filter(|(_, &n)| n > 1).map(|(v, _)| v);
    let unexpected = seen.keys().filter(|v| !expected.contains_key(*v));
    let missing = expected.keys().filter(|v| !seen.contains_key(*v));
    [
        ("duplicates", ranges(duplicates)),
        ("unexpected", ranges(unexpected)),
        ("missing", ranges(missing)),
    ]
    .into_iter()
    .filter(|(_, ranges)| !ranges.is_empty())
    .map(|(what, ranges)| format!("{what} {ranges}"))
    .collect::<Vec<_>>()
    .join("; ")
}

/// `key:count` values as ranges of consecutive counts per key.
fn ranges<'a>(values: impl Iterator<Item = &'a String>) -> String {
    let mut by_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut odd = Vec::new();
    for value in values {
        match value
            .rsplit_once(':')
            .and_then(|(k, c)| Some((k, c.parse::<u64>().ok()?)))
        {
            Some((key, count)) => by_key.entry(key.to_owned()).or_default().push(count),
            None => odd.push(format!("{value:?}")),
        }
    }
    let mut out = Vec::new();
    for (key, mut counts) in by_key {
        counts.sort_unstable();
        let mut start = counts[0];
        let mut end = start;
        for &count in &counts[1..] {
            if count != end + 1 {
                out.push(range(&key, start, end));
                start = count;
            }
            end = count;
        }
        out.push(range(&key, start, end));
    }
    out.extend(odd);
    out.join(", ")
}

fn range(key: &str, start: u64, end: u64) -> String {
    if start == end {
        format!("{key}:{start}")
    } else {
        format!("{key}:{start}..{key}:{end}")
    }
}

/// A read_committed reader of the one-partition output topic, from its
/// beginning, kept for the whole case so nothing is read twice.
struct Output {
    topic: String,
    consumer: BaseConsumer,
    values: Vec<String>,
}

impl Output {
    fn new(bootstrap: &str, topic: &str) -> Self {
        let consumer = reader(bootstrap, topic, 1);
        Self {
            topic: topic.to_owned(),
            consumer,
            values: Vec::new(),
        }
    }

    /// Reads what arrives within `wait`, and whatever is ready after it.
    fn poll(&mut self, wait: Duration) {
        let mut wait = wait;
        while let Some(message) = self.consumer.poll(wait) {
            match message {
                Ok(message) => self.values.push(
                    String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned(),
                ),
                // The client retries by itself (a leader moving, a topic just
                // created); lasting trouble shows as missing output.
                Err(error) => {
                    eprintln!("reading {}: {error}", self.topic);
                    return;
                }
            }
            wait = Duration::ZERO;
        }
    }

    /// The topic's low and high watermarks; a topic created a moment ago may
    /// have no leader for a while.
    fn watermarks(&self) -> (i64, i64) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match self.consumer.fetch_watermarks(&self.topic, 0, TIMEOUT) {
                Ok(watermarks) => return watermarks,
                Err(error) if Instant::now() < deadline => {
                    eprintln!("watermarks of {}: {error}; retrying", self.topic);
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(error) => panic!("watermarks of {}: {error}", self.topic),
            }
        }
    }

    fn counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for value in &self.values {
            *counts.entry(value.clone()).or_insert(0) += 1;
        }
        counts
    }

    fn has_all(&self, expected: &BTreeMap<String, usize>) -> bool {
        let counts = self.counts();
        expected.keys().all(|value| counts.contains_key(value))
    }

    /// Reads until every value of `expected` was seen (true), `failed` returns
    /// an error, or `timeout` passed.
    fn wait_for(
        &mut self,
        expected: &BTreeMap<String, usize>,
        timeout: Duration,
        failed: impl Fn() -> Option<RtflowError>,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.has_all(expected) {
            if Instant::now() >= deadline || failed().is_some() {
                return false;
            }
            self.poll(Duration::from_millis(50));
        }
        true
    }

    /// Reads up to the end the topic has now (its high watermark), or until
    /// `timeout`; returns whether it got there. A read_committed reader stops
    /// short of it while a transaction is open.
    fn read_to_end(&mut self, timeout: Duration) -> bool {
        let (low, end) = self.watermarks();
        let deadline = Instant::now() + timeout;
        loop {
            self.poll(Duration::from_millis(50));
            let position = self.consumer.position().unwrap();
            let position = position
                .find_partition(&self.topic, 0)
                .and_then(|p| p.offset().to_raw())
                .filter(|p| *p >= 0);
            if end == low || position.is_some_and(|p| p >= end) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Deterministic damage
// ---------------------------------------------------------------------------

/// The seed every case's damage derives from: `RTFLOW_DAMAGE_SEED` to replay
/// a failure, a fixed default otherwise.
fn seed() -> u64 {
    let seed = match std::env::var("RTFLOW_DAMAGE_SEED") {
        Ok(text) => match text.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => text.parse(),
        }
        .expect("RTFLOW_DAMAGE_SEED is a number"),
        Err(_) => 0x5eed_da3a_9e00_0001,
    };
    println!("RTFLOW_DAMAGE_SEED={seed:#x}");
    seed
}

/// splitmix64: tiny, good enough to spread damage, and needs no dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn choose<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get(self.below(items.len() as u64) as usize)
        }
    }
}

/// FNV-1a, to give each case a stream of its own from the one seed.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
