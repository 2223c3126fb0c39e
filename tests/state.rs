//! Keyed state and running aggregates: exact results, state restored exactly once
//! across restarts, rescaling by key group, and restarts after code changes.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{checkpointed, sorted, word_count, TIMEOUT};
use rtflow::checkpoint::CheckpointStore;
use rtflow::prelude::*;
use rtflow::runtime::state::{KeyedState, Table};

/// The final value per key of an update stream.
fn latest<K: Ord + Clone, V: Clone>(rows: &[(K, V)]) -> BTreeMap<K, V> {
    rows.iter().cloned().collect()
}

fn words(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| format!("w{}", i % 7))
}

fn expected_counts(n: usize) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for word in words(n) {
        *counts.entry(word).or_default() += 1;
    }
    counts
}

#[test]
fn every_aggregate_emits_the_updated_value_per_record() {
    let flow = Dataflow::new("aggregates");
    let input = MemorySource::new(2);
    let pair = |key: &str, value: i64| (key.to_string(), value);
    input
        .push_all(0, [pair("a", 3), pair("b", 10), pair("a", 1)])
        .unwrap();
    input.push_all(1, [pair("a", 8), pair("b", -4)]).unwrap();
    input.end();
    let keyed = flow
        .source(input)
        .key_by(|(key, _): &(String, i64)| key.clone());
    let (count, sum, min, max, avg, reduce) = (
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
        MemorySink::new(),
    );
    keyed.count().sink(count.clone());
    keyed.sum(|(_, v)| *v).sink(sum.clone());
    keyed.min(|(_, v)| *v).sink(min.clone());
    keyed.max(|(_, v)| *v).sink(max.clone());
    keyed.avg(|(_, v)| *v as f64).sink(avg.clone());
    keyed
        .reduce(|a, b| (a.0.clone(), a.1 * b.1))
        .map(|(key, (_, product))| (key, product))
        .sink(reduce.clone());
    common::run_to_end(flow, checkpointed("aggregates"));

    let key = |k: &str| k.to_string();
    assert_eq!(
        latest(&count.rows()),
        BTreeMap::from([(key("a"), 3), (key("b"), 2)])
    );
    assert_eq!(
        latest(&sum.rows()),
        BTreeMap::from([(key("a"), 12), (key("b"), 6)])
    );
    assert_eq!(
        latest(&min.rows()),
        BTreeMap::from([(key("a"), 1), (key("b"), -4)])
    );
    assert_eq!(
        latest(&max.rows()),
        BTreeMap::from([(key("a"), 8), (key("b"), 10)])
    );
    assert_eq!(
        latest(&avg.rows()),
        BTreeMap::from([(key("a"), 4.0), (key("b"), 3.0)])
    );
    assert_eq!(
        latest(&reduce.rows()),
        BTreeMap::from([(key("a"), 24), (key("b"), -40)])
    );
    let mut counts: Vec<_> = count.rows().into_iter().filter(|(k, _)| k == "a").collect();
    counts.sort();
    assert_eq!(
        counts,
        vec![(key("a"), 1), (key("a"), 2), (key("a"), 3)],
        "one update per record"
    );
}

#[test]
fn counts_continue_exactly_once_across_restarts_and_rescaling() {
    let input = MemorySource::new(3);
    let config = checkpointed("restarts");
    let mut pushed = 0;
    for (round, parallelism) in [2, 2, 3, 1].into_iter().enumerate() {
        let (query, out) = word_count(&input, config.clone(), parallelism);
        let batch: Vec<String> = words(pushed + 300).skip(pushed).collect();
        for (i, word) in batch.into_iter().enumerate() {
            input.push(i % 3, word).unwrap();
        }
        pushed += 300;
        assert!(out.wait_for(300, TIMEOUT), "round {round}");
        query.stop().unwrap();
        assert_eq!(
            out.len(),
            300,
            "round {round}: nothing replayed after a clean stop"
        );
        for (word, count) in latest(&out.rows()) {
            assert_eq!(
                count,
                expected_counts(pushed)[&word],
                "round {round}, {word}"
            );
        }
    }
}

#[test]
fn a_truncated_snapshot_is_never_restored() {
    let input = MemorySource::new(1);
    let config = checkpointed("truncated").checkpoints_retained(10);
    let location = config.checkpoint_location.clone().unwrap();
    let (query, out) = word_count(&input, config.clone(), 1);
    input.push_all(0, words(100)).unwrap();
    assert!(out.wait_for(100, TIMEOUT));
    let deadline = std::time::Instant::now() + TIMEOUT;
    while query.last_progress().map_or(0, |p| p.batch_id) < 1 {
        assert!(std::time::Instant::now() < deadline, "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    input.push_all(0, words(120).skip(100)).unwrap();
    assert!(out.wait_for(120, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    // Damage the snapshots of the final checkpoint: the restart must restore the
    // one before it and replay what came after, counting every word once.
    let mut store = CheckpointStore::open(&location, 10).unwrap();
    let last = *store.epochs().unwrap().last().unwrap();
    assert!(store.truncate_snapshots(last).unwrap());
    let recovery = store.recover().unwrap();
    assert!(recovery.manifest.unwrap().epoch < last);
    drop(store);

    input.push_all(0, words(150).skip(120)).unwrap();
    let (query, out) = word_count(&input, config, 1);
    let deadline = std::time::Instant::now() + TIMEOUT;
    while latest(&out.rows()) != expected_counts(150) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            latest(&out.rows())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    query.stop().unwrap();
}

/// Starts `build` on `config` after a first run of word count, and returns the
/// start's error.
fn restart_after_word_count(
    name: &str,
    change: impl FnOnce(&Dataflow, Stream<String>, MemorySink<(String, u64)>),
    config_change: impl FnOnce(QueryConfig) -> QueryConfig,
) -> (
    Result<StreamingQuery>,
    MemorySource<String>,
    MemorySink<(String, u64)>,
) {
    let input = MemorySource::new(1);
    let config = checkpointed(name);
    let (query, out) = word_count(&input, config.clone(), 1);
    input.push_all(0, words(70)).unwrap();
    assert!(out.wait_for(70, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    let flow = Dataflow::new("words");
    let out = MemorySink::new();
    let stream = flow.source(input.clone());
    change(&flow, stream, out.clone());
    (flow.start(config_change(config)), input, out)
}

#[test]
fn a_compatible_change_restores_the_state() {
    let (started, input, out) = restart_after_word_count(
        "compatible",
        |_, stream, out| {
            // A new stateless step and a new map body around the same count.
            stream
                .filter(|word| !word.is_empty())
                .map(|word| word.to_uppercase().to_lowercase())
                .key_by(|word: &String| word.clone())
                .count()
                .map(|(word, count)| (word, count))
                .sink(out);
        },
        |config| config,
    );
    let query = started.expect("a compatible change restores");
    input.push_all(0, words(77).skip(70)).unwrap();
    assert!(out.wait_for(7, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(latest(&out.rows()), expected_counts(77));
    assert!(sorted(&out).iter().all(|(_, count)| *count == 11));
}

/// Two sources: the first into a plain sink, the second into word count;
/// `first_step` may add a step on the first, which shifts every node after it.
fn two_sources(
    first: &MemorySource<String>,
    second: &MemorySource<String>,
    first_step: bool,
    config: QueryConfig,
) -> (StreamingQuery, MemorySink<(String, u64)>) {
    let flow = Dataflow::new("two-sources");
    let mut stream = flow.source(first.clone());
    if first_step {
        stream = stream.filter(|word| !word.is_empty());
    }
    stream.sink(MemorySink::new());
    let out = MemorySink::new();
    flow.source(second.clone())
        .key_by(|word: &String| word.clone())
        .count()
        .sink(out.clone());
    (flow.start(config).unwrap(), out)
}

#[test]
fn a_step_added_before_a_later_source_keeps_that_sources_offsets() {
    let (first, second) = (MemorySource::new(1), MemorySource::new(1));
    let config = checkpointed("later-source");
    let (query, out) = two_sources(&first, &second, false, config.clone());
    first.push_all(0, words(10)).unwrap();
    second.push_all(0, words(70)).unwrap();
    assert!(out.wait_for(70, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    let (query, out) = two_sources(&first, &second, true, config);
    second.push_all(0, words(77).skip(70)).unwrap();
    assert!(out.wait_for(7, TIMEOUT));
    query.stop().unwrap();
    // Resumed after its 70 words, not from the start, and with its counts.
    assert_eq!(out.len(), 7, "{:?}", out.rows());
    assert_eq!(latest(&out.rows()), expected_counts(77));
}

#[test]
fn a_removed_stateful_operator_fails_at_start_naming_it() {
    let (started, _, _) = restart_after_word_count(
        "removed",
        |_, stream, _| {
            stream.map(|word| (word, 0)).sink(MemorySink::new());
        },
        |config| config,
    );
    let Err(error) = started else {
        panic!("the count's state would be lost")
    };
    assert_eq!(
        error.error_class(),
        "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"
    );
    assert!(error.to_string().contains("operator 'count-0'"), "{error}");
    assert!(error.to_string().contains("no longer has"), "{error}");
}

#[test]
fn a_changed_state_type_fails_at_start_naming_it() {
    let (started, _, _) = restart_after_word_count(
        "retyped",
        |_, stream, _| {
            stream
                .key_by(|word: &String| word.clone())
                .sum(|_| 1u32)
                .uid("count-0")
                .sink(MemorySink::new());
        },
        |config| config,
    );
    let Err(error) = started else {
        panic!("u64 counts cannot be read as u32 sums")
    };
    assert_eq!(
        error.error_class(),
        "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"
    );
    let message = error.to_string();
    assert!(message.contains("'count' operator holding"), "{message}");
    assert!(message.contains("'sum' operator holding"), "{message}");
    assert!(message.contains("u32"), "{message}");
}

#[test]
fn a_changed_key_group_count_fails_at_start() {
    let (started, _, _) = restart_after_word_count(
        "key-groups",
        |_, stream, out| {
            stream
                .key_by(|word: &String| word.clone())
                .count()
                .sink(out);
        },
        |config| config.max_key_groups(64),
    );
    let Err(error) = started else {
        panic!("keys would land in other groups")
    };
    assert_eq!(
        error.error_class(),
        "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"
    );
    assert!(error.to_string().contains("128 key groups"), "{error}");
    assert!(error.to_string().contains("64"), "{error}");
}

/// Counts records per word in keyed state it claims when made; declares it
/// as its table unless `declared` is false.
struct CustomCount {
    counts: KeyedState<String, u64>,
    declared: bool,
}

impl CustomCount {
    fn new(ctx: &OperatorContext, declared: bool) -> rtflow::Result<Self> {
        Ok(Self {
            counts: ctx.state.keyed("counts")?,
            declared,
        })
    }
}

impl Operator<String, (String, u64)> for CustomCount {
    fn process(
        &mut self,
        record: Record<String>,
        out: &mut Collector<'_, (String, u64)>,
    ) -> rtflow::Result<()> {
        let count = self.counts.get_or_insert_with(record.value.clone(), || 0);
        *count += 1;
        let count = *count;
        out.emit((record.value, count))
    }

    fn tables(
        &mut self,
        table: &mut dyn FnMut(&mut dyn Table) -> rtflow::Result<()>,
    ) -> rtflow::Result<()> {
        if self.declared {
            table(&mut self.counts)?;
        }
        Ok(())
    }
}

fn custom_count(
    input: &MemorySource<String>,
    config: QueryConfig,
    declared: bool,
) -> rtflow::Result<(StreamingQuery, MemorySink<(String, u64)>)> {
    let flow = Dataflow::new("custom");
    let out = MemorySink::new();
    flow.source(input.clone())
        .key_by(|word: &String| word.clone())
        .as_ref()
        .try_transform("custom_count", move |ctx| CustomCount::new(ctx, declared))
        .sink(out.clone());
    Ok((flow.start(config.allowlist_check(false))?, out))
}

#[test]
fn a_declared_table_is_checkpointed_and_restored_by_the_runtime() {
    let input = MemorySource::new(1);
    let config = checkpointed("custom-table");
    let (query, out) = custom_count(&input, config.clone(), true).unwrap();
    input.push_all(0, words(70)).unwrap();
    assert!(out.wait_for(70, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    let (query, out) = custom_count(&input, config, true).unwrap();
    input.push_all(0, words(77).skip(70)).unwrap();
    assert!(out.wait_for(7, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(latest(&out.rows()), expected_counts(77));
}

#[test]
fn a_state_claimed_but_not_declared_fails_at_start() {
    let input = MemorySource::new(1);
    let Err(error) = custom_count(&input, checkpointed("undeclared"), false) else {
        panic!("its checkpoints would miss the counts")
    };
    assert_eq!(error.error_class(), "OPERATOR_FAILED");
    let message = error.to_string();
    assert!(message.contains("claimed 1 states"), "{message}");
    assert!(
        message.contains("declares 0 in Operator::tables"),
        "{message}"
    );
    assert!(message.contains("CustomCount"), "{message}");
}
