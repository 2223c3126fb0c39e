//! Partitions handed over inside a run ([`StreamingQuery::hand_over`]): at a
//! barrier, the stateful instances let go of key groups without a trace and
//! take on the state of others, while the query goes on running.

mod common;

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{checkpointed, word_count, TIMEOUT};
use rtflow::checkpoint::CheckpointStore;
use rtflow::checkpoint::Offsets;
use rtflow::prelude::*;
use rtflow::runtime::cluster::{Handover, Membership};
use rtflow::runtime::key_groups::{key_group, stable_hash};
use rtflow::runtime::state::{StateSnapshot, Table};
use rtflow::runtime::{
    ReaderHandover, Source, SourceContext, SourceOutput, SourceReader, SourceStatus,
};

/// Key groups of the default query configuration.
const KEY_GROUPS: usize = 128;

/// Owns the partitions of [`Queues`] in `partitions`, and every key group
/// but those of the keys in `unowned`.
struct Share {
    partitions: BTreeSet<i32>,
    unowned: Vec<&'static str>,
}

impl Membership for Share {
    fn member(&self) -> String {
        "handover-test".into()
    }
    fn partitions(&self) -> Vec<String> {
        Vec::new()
    }
    fn owns_key_group(&self, group: u32) -> bool {
        self.unowned.iter().all(|key| group_of(key) != group)
    }
    fn owned(&self, partitions: &[(String, i32)]) -> Vec<usize> {
        (0..partitions.len())
            .filter(|i| self.partitions.contains(&partitions[*i].1))
            .collect()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn group_of(word: &str) -> u32 {
    key_group(stable_hash(&word.to_owned()), KEY_GROUPS) as u32
}

/// Every key group but those of `words`.
fn all_but(words: &[&'static str]) -> Share {
    Share {
        partitions: BTreeSet::new(),
        unowned: words.to_vec(),
    }
}

fn push(input: &MemorySource<String>, word: &str, times: usize) {
    input
        .push_all(0, std::iter::repeat_n(word.to_owned(), times))
        .unwrap();
}

/// A handover to `share` that adopts nothing.
fn to(share: Share) -> Handover {
    Handover {
        membership: Arc::new(share),
        adopted: BTreeMap::new(),
        offsets: Offsets::new(),
    }
}

/// The latest count of `word` once it reaches `count`.
fn wait_for_count(out: &MemorySink<(String, u64)>, word: &str, count: u64) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let latest: BTreeMap<String, u64> = out.rows().into_iter().collect();
        if latest.get(word) == Some(&count) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{word} never reached {count}: {latest:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn key_groups_let_go_leave_no_trace_and_the_others_count_on() {
    let (kept, gone) = ("apple", "pear");
    assert_ne!(group_of(kept), group_of(gone));
    let input = MemorySource::new(1);
    let config = checkpointed("handover-let-go");
    let (query, out) = word_count(&input, config.clone(), 2);
    push(&input, kept, 3);
    push(&input, gone, 5);
    wait_for_count(&out, kept, 3);
    wait_for_count(&out, gone, 5);

    query.hand_over(to(all_but(&[gone])), TIMEOUT).unwrap();
    assert!(query.is_active(), "the query runs on");
    push(&input, kept, 2);
    wait_for_count(&out, kept, 5);
    // A record of a group let go reaching the instance anyway (in a cluster
    // its partition is no longer read) finds no state: it counts from nothing.
    push(&input, gone, 1);
    wait_for_count(&out, gone, 1);
    query.stop().unwrap();
    drop(query);

    // What this run checkpointed of the group after letting it go is only
    // what that stray record wrote: no deletion of the state it let go.
    let mut store =
        CheckpointStore::open(config.checkpoint_location.as_ref().unwrap(), 10).unwrap();
    let recovery = store.recover().unwrap();
    let gone_entries: Vec<_> = recovery
        .state
        .values()
        .flat_map(|state| state.entries().iter().collect::<Vec<_>>())
        .filter(|entry| entry.group == group_of(gone))
        .map(|entry| entry.value.is_some())
        .collect();
    assert!(
        !gone_entries.is_empty() && gone_entries.iter().all(|live| *live),
        "{gone_entries:?}"
    );
}

#[test]
fn a_handover_restores_the_state_it_adopts_and_counts_on_from_it() {
    // One query counts a word to 41 and stops: its checkpoint is the state
    // another query adopts, as a process adopts what a changelog holds.
    let word = "plum";
    let first = checkpointed("handover-source");
    let input = MemorySource::new(1);
    let (query, out) = word_count(&input, first.clone(), 2);
    push(&input, word, 41);
    wait_for_count(&out, word, 41);
    query.stop().unwrap();
    drop(query);
    let mut store = CheckpointStore::open(first.checkpoint_location.as_ref().unwrap(), 10).unwrap();
    let adopted = store.recover().unwrap().state;
    drop(store);

    let input = MemorySource::new(1);
    let (query, out) = word_count(&input, checkpointed("handover-adopt"), 2);
    push(&input, "fig", 1);
    wait_for_count(&out, "fig", 1);
    let handover = Handover {
        membership: Arc::new(all_but(&[])),
        adopted,
        offsets: Offsets::new(),
    };
    query.hand_over(handover, TIMEOUT).unwrap();
    push(&input, word, 1);
    wait_for_count(&out, word, 42);
    push(&input, "fig", 1);
    wait_for_count(&out, "fig", 2);
    query.stop().unwrap();
}

#[test]
fn a_window_of_a_key_group_let_go_is_neither_closed_nor_deleted() {
    let (kept, gone) = ("apple", "pear");
    let flow = Dataflow::new("windows");
    let input: MemorySource<(String, i64)> = MemorySource::new(1);
    let out = MemorySink::new();
    flow.source(input.clone())
        .with_watermark(|(_, at): &(String, i64)| *at, Duration::ZERO)
        .key_by(|(word, _): &(String, i64)| word.clone())
        .window(Window::tumbling(Duration::from_millis(1_000)))
        .count()
        .sink(out.clone());
    let config = checkpointed("handover-windows");
    let query = flow.start(config.clone()).unwrap();
    input
        .push_all(0, [(kept.to_owned(), 100), (gone.to_owned(), 200)])
        .unwrap();
    assert!(out.wait_for(2, TIMEOUT), "{:?}", out.rows());
    query.hand_over(to(all_but(&[gone])), TIMEOUT).unwrap();
    // The watermark passes the end of the first window, which closes for
    // the key kept; the window of the key let go is its next owner's to
    // close, so this run leaves it as it was.
    input
        .push_all(0, [(kept.to_owned(), 1_500), (kept.to_owned(), 2_500)])
        .unwrap();
    assert!(out.wait_for(4, TIMEOUT), "{:?}", out.rows());
    query.checkpoint_now(TIMEOUT).unwrap();
    query.stop().unwrap();
    drop(query);

    let location = config.checkpoint_location.as_ref().unwrap();
    let recovery = CheckpointStore::open(location, 10)
        .unwrap()
        .recover()
        .unwrap();
    let windows_of = |word: &str| -> usize {
        let state = recovery
            .state
            .iter()
            .find(|(id, _)| id.name == "windows")
            .map(|(_, state)| state)
            .expect("the window's state is checkpointed");
        let entries = state.entries();
        let count = entries.iter().filter(|e| e.group == group_of(word)).count();
        count
    };
    assert_eq!(windows_of(gone), 1, "the window let go is left whole");
    assert_eq!(
        windows_of(kept),
        1,
        "the key kept closed its first window and holds its third"
    );
}

/// A source of two partitions that a membership shares out as a cluster
/// shares Kafka partitions, each partition a queue of `(key, event time)`.
#[derive(Clone, Default)]
struct Queues(Arc<Mutex<[Queue; 2]>>);

/// A partition of [`Queues`]: `(key, event time)`s not read yet.
type Queue = VecDeque<(String, i64)>;

impl Queues {
    fn push(&self, partition: usize, key: &str, at: i64) {
        self.0.lock().unwrap()[partition].push_back((key.to_owned(), at));
    }
}

impl Source<(String, i64)> for Queues {
    fn kind(&self) -> &str {
        "queues"
    }

    fn partitions(&self) -> Result<usize> {
        Ok(2)
    }

    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        Some(link.owned(&[("queues".into(), 0), ("queues".into(), 1)]))
    }

    fn reader(&self, ctx: &SourceContext) -> Result<Box<dyn SourceReader<(String, i64)>>> {
        Ok(Box::new(QueueReader {
            queues: self.clone(),
            read: ctx.partitions.iter().map(|p| (*p, 0)).collect(),
        }))
    }
}

struct QueueReader {
    queues: Queues,
    /// Per partition read: how many records it took.
    read: BTreeMap<usize, i64>,
}

impl SourceReader<(String, i64)> for QueueReader {
    fn poll(
        &mut self,
        out: &mut SourceOutput<(String, i64)>,
        max_wait: Duration,
    ) -> Result<SourceStatus> {
        let mut queues = self.queues.0.lock().unwrap();
        for (partition, taken) in &mut self.read {
            out.set_partition(*partition);
            while let Some(record) = queues[*partition].pop_front() {
                out.push(record, rtflow::runtime::record::now_nanos());
                *taken += 1;
            }
        }
        drop(queues);
        std::thread::park_timeout(max_wait);
        Ok(SourceStatus::Active)
    }

    fn offsets(&self) -> Offsets {
        self.read
            .iter()
            .map(|(p, taken)| (p.to_string(), *taken))
            .collect()
    }

    fn hand_over(&mut self, change: &ReaderHandover<'_>) -> Result<()> {
        self.read.retain(|p, _| change.partitions.contains(p));
        for partition in change.partitions {
            let resumed = change.start_offsets.get(&partition.to_string());
            self.read
                .entry(*partition)
                .or_insert(*resumed.unwrap_or(&0));
        }
        Ok(())
    }
}

#[test]
fn a_reader_lets_its_partition_go_and_the_watermark_no_longer_waits_for_it() {
    let queues = Queues::default();
    let flow = Dataflow::new("readers");
    let out = MemorySink::new();
    flow.source(queues.clone())
        .with_watermark(|(_, at): &(String, i64)| *at, Duration::ZERO)
        .sink(out.clone());
    let config = checkpointed("handover-readers");
    let query = flow.start(config.clone()).unwrap();
    queues.push(0, "a", 100);
    queues.push(1, "b", 200);
    assert!(out.wait_for(2, TIMEOUT), "{:?}", out.rows());
    wait_for_watermark(&query, 100);

    query
        .hand_over(
            to(Share {
                partitions: BTreeSet::from([0]),
                unowned: Vec::new(),
            }),
            TIMEOUT,
        )
        .unwrap();
    queues.push(1, "b", 300);
    queues.push(0, "a", 1_000);
    assert!(out.wait_for(3, TIMEOUT), "{:?}", out.rows());
    // Partition 1 went quiet at 200 and is another's now: nothing here waits
    // for it.
    wait_for_watermark(&query, 1_000);
    query.checkpoint_now(TIMEOUT).unwrap();
    query.stop().unwrap();
    let mut keys: Vec<String> = out.rows().into_iter().map(|(key, _)| key).collect();
    keys.sort();
    assert_eq!(keys, ["a", "a", "b"], "partition 1 is no longer read");
    drop(query);

    let location = config.checkpoint_location.as_ref().unwrap();
    let recovery = CheckpointStore::open(location, 10)
        .unwrap()
        .recover()
        .unwrap();
    let offsets: Vec<BTreeMap<String, i64>> =
        recovery.manifest.unwrap().sources.into_values().collect();
    assert_eq!(
        offsets,
        [BTreeMap::from([("0".to_owned(), 2)])],
        "only the partition kept has offsets after the handover"
    );
}

fn wait_for_watermark(query: &StreamingQuery, at_least: i64) {
    let deadline = Instant::now() + TIMEOUT;
    while query.metrics().watermark() < Some(at_least) {
        assert!(
            Instant::now() < deadline,
            "the watermark stayed at {:?}",
            query.metrics().watermark()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_partition_adopted_behind_the_watermark_counts_as_in_a_new_run() {
    let queues = Queues::default();
    let flow = Dataflow::new("adopting");
    let out = MemorySink::new();
    flow.source(queues.clone())
        .with_watermark(|(_, at): &(String, i64)| *at, Duration::ZERO)
        .key_by(|(key, _): &(String, i64)| key.clone())
        .window(Window::tumbling(Duration::from_millis(1_000)))
        .count()
        .sink(out.clone());
    let query = flow.start(checkpointed("handover-adopting")).unwrap();
    // Partition 1 and key b are another process's.
    let share = |partitions: &[i32], unowned: Vec<&'static str>| Handover {
        membership: Arc::new(Share {
            partitions: partitions.iter().copied().collect(),
            unowned,
        }),
        adopted: BTreeMap::new(),
        offsets: Offsets::from([("1".to_owned(), 0)]),
    };
    query.hand_over(share(&[0], vec!["b"]), TIMEOUT).unwrap();
    queues.push(0, "a", 100);
    queues.push(0, "a", 1_500);
    assert!(out.wait_for(2, TIMEOUT), "{:?}", out.rows());
    wait_for_watermark(&query, 1_500);
    queues.push(1, "b", 200);

    // This process takes partition 1 and key b over, as a rebalance hands
    // them from a process that had not read that far: b's record is on time
    // for b, whose windows this run never judged.
    query.hand_over(share(&[0, 1], vec![]), TIMEOUT).unwrap();
    assert!(
        out.wait_for(3, TIMEOUT),
        "b's record was dropped: {:?}",
        out.rows()
    );
    query.stop().unwrap();
    let b: Vec<String> = (out.rows().iter())
        .map(|row| format!("{row:?}"))
        .filter(|row| row.contains("\"b\""))
        .collect();
    assert_eq!(b.len(), 1, "{:?}", out.rows());
    assert!(b[0].ends_with(", 1)"), "{b:?}");
}

/// Counts records in a table of its own that cannot say what it holds.
struct Tally(u64);

impl Table for Tally {
    fn begin_snapshot(&mut self, _out: &mut StateSnapshot) -> Result<()> {
        Ok(())
    }
}

impl Operator<String, u64> for Tally {
    fn stateful() -> bool {
        true
    }

    fn allowlisted() -> bool {
        true
    }

    fn process(&mut self, _: Record<String>, out: &mut Collector<'_, u64>) -> Result<()> {
        self.0 += 1;
        out.emit(self.0)
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        table(self)
    }
}

#[test]
fn a_state_with_no_image_fails_the_handover_naming_it() {
    let input = MemorySource::new(1);
    let flow = Dataflow::new("imageless");
    let out = MemorySink::new();
    flow.source(input.clone())
        .try_transform("tally", |_| Ok(Tally(0)))
        .sink(out.clone());
    let query = flow.start(checkpointed("handover-imageless")).unwrap();
    push(&input, "fig", 1);
    assert!(out.wait_for(1, TIMEOUT));
    let error = query.hand_over(to(all_but(&["fig"])), TIMEOUT).unwrap_err();
    assert_eq!(error.error_class(), "OPERATOR_FAILED", "{error}");
    assert!(error.to_string().contains("Table::image"), "{error}");
}

/// Two partitions shared out as a cluster shares Kafka's, whose readers
/// read nothing and cannot change their partitions.
struct Fixed;

impl Source<String> for Fixed {
    fn kind(&self) -> &str {
        "fixed"
    }

    fn partitions(&self) -> Result<usize> {
        Ok(2)
    }

    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        Some(link.owned(&[("fixed".into(), 0), ("fixed".into(), 1)]))
    }

    fn reader(&self, _: &SourceContext) -> Result<Box<dyn SourceReader<String>>> {
        Ok(Box::new(Fixed))
    }
}

impl SourceReader<String> for Fixed {
    fn poll(&mut self, _: &mut SourceOutput<String>, max_wait: Duration) -> Result<SourceStatus> {
        std::thread::park_timeout(max_wait);
        Ok(SourceStatus::Active)
    }

    fn offsets(&self) -> Offsets {
        Offsets::new()
    }
}

#[test]
fn a_reader_that_cannot_change_its_partitions_fails_the_handover() {
    let flow = Dataflow::new("fixed");
    flow.source(Fixed).sink(MemorySink::new());
    let query = flow.start(checkpointed("handover-fixed")).unwrap();
    let share = Share {
        partitions: BTreeSet::from([0]),
        unowned: Vec::new(),
    };
    let error = query.hand_over(to(share), TIMEOUT).unwrap_err();
    assert_eq!(error.error_class(), "CHECKPOINT_FAILED", "{error}");
    assert!(
        error
            .to_string()
            .contains("cannot change its partitions inside a run"),
        "{error}"
    );
}

/// A Kafka partition handed to a reader with no offset to resume from (no
/// process committed one yet: a cluster's first rebalance moved it before
/// its first commit) starts where the source's starting offsets say, as a
/// run's start would start it.
#[test]
fn a_kafka_partition_handed_over_with_no_offset_starts_at_the_starting_offsets() {
    let Some(bootstrap) = common::kafka::bootstrap() else {
        return;
    };
    let input = common::kafka::topic(&bootstrap, "handover-in", 2);
    let records = |partition: i32, values: &[&str]| -> Vec<(i32, String, Vec<u8>)> {
        let record = |value: &&str| (partition, "k".to_owned(), value.as_bytes().to_vec());
        values.iter().map(record).collect()
    };
    common::kafka::produce(&bootstrap, &input, records(0, &["a0"]));
    common::kafka::produce(&bootstrap, &input, records(1, &["b0"]));
    let flow = Dataflow::new("kafka-handover");
    let out = MemorySink::new();
    let source = KafkaSource::new(&bootstrap)
        .subscribe([&input])
        .starting_offsets(StartingOffsets::Earliest)
        .max_partitions(1);
    flow.source(source)
        .map(|record| format!("{}@{}", record.value_str(), record.offset))
        .sink(out.clone());
    let query = flow.start(checkpointed("handover-kafka")).unwrap();
    assert!(out.wait_for(2, TIMEOUT), "read {:?}", out.rows());
    let only_first = Share {
        partitions: BTreeSet::from([0]),
        unowned: Vec::new(),
    };
    query.hand_over(to(only_first), TIMEOUT).unwrap();
    common::kafka::produce(&bootstrap, &input, records(1, &["b1"]));
    let both = Share {
        partitions: BTreeSet::from([0, 1]),
        unowned: Vec::new(),
    };
    query.hand_over(to(both), TIMEOUT).unwrap();
    assert!(out.wait_for(4, TIMEOUT), "read {:?}", out.rows());
    let mut read = out.rows();
    read.sort();
    assert_eq!(read, ["a0@0", "b0@0", "b0@0", "b1@1"]);
    query.stop().unwrap();
}
