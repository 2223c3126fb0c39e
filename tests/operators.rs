//! Every builder operator, end to end through a running query.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{config, run_to_end, sorted};
use rtflow::prelude::*;

/// A memory source with `values` spread over `partitions` partitions, ended.
fn input<T: Data>(partitions: usize, values: impl IntoIterator<Item = T>) -> MemorySource<T> {
    let source = MemorySource::new(partitions);
    for (i, value) in values.into_iter().enumerate() {
        source.push(i % partitions, value).unwrap();
    }
    source.end();
    source
}

#[test]
fn map_filter_flat_map_compose() {
    for chaining in [true, false] {
        let flow = Dataflow::new("stateless");
        let out = MemorySink::new();
        flow.source(input(3, 1..=100u32))
            .map(|x| x * 10)
            .filter(|x| x % 20 == 0)
            .flat_map(|x| vec![x, x + 1])
            .sink(out.clone());
        run_to_end(flow, config("stateless").operator_chaining(chaining));
        let expected: Vec<u32> = (1..=100u32)
            .map(|x| x * 10)
            .filter(|x| x % 20 == 0)
            .flat_map(|x| [x, x + 1])
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(sorted(&out), expected, "chaining {chaining}");
    }
}

#[test]
fn flat_map_explodes_and_drops() {
    let flow = Dataflow::new("explode");
    let out = MemorySink::new();
    flow.source(input(
        1,
        ["a b c".to_owned(), String::new(), "d".to_owned()],
    ))
    .flat_map(|line| {
        line.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    })
    .sink(out.clone());
    run_to_end(flow, config("explode"));
    assert_eq!(out.rows(), vec!["a", "b", "c", "d"]);
}

#[test]
fn union_merges_distinct_sources() {
    let flow = Dataflow::new("union");
    let out = MemorySink::new();
    let left = flow.source(input(2, 0..50u32));
    let right = flow.source(input(3, 1000..1030u32)).map(|x| x + 1);
    left.union(&right).sink(out.clone());
    run_to_end(flow, config("union"));
    let expected: Vec<u32> = (0..50).chain(1001..1031).collect();
    assert_eq!(sorted(&out), expected);
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Order {
    id: u32,
    user: u32,
}

fn users() -> StaticTable<u32, &'static str> {
    StaticTable::from_rows("users", [(1, "ada"), (2, "grace"), (2, "hopper")])
}

#[test]
fn broadcast_join_inner_emits_one_row_per_match() {
    let flow = Dataflow::new("inner");
    let out = MemorySink::new();
    let orders = [(10, 1), (11, 2), (12, 3)].map(|(id, user)| Order { id, user });
    flow.source(input(2, orders))
        .broadcast_join(&users(), |order| order.user)
        .map(|(order, name)| (order.id, name))
        .sink(out.clone());
    run_to_end(flow, config("inner"));
    assert_eq!(
        sorted(&out),
        vec![(10, "ada"), (11, "grace"), (11, "hopper")]
    );
}

#[test]
fn broadcast_join_left_outer_keeps_unmatched_records() {
    let flow = Dataflow::new("left");
    let out = MemorySink::new();
    let orders = [(10, 1), (11, 2), (12, 3)].map(|(id, user)| Order { id, user });
    flow.source(input(2, orders))
        .broadcast_left_join(&users(), |order| order.user)
        .map(|(order, name)| (order.id, name))
        .sink(out.clone());
    let query = run_to_end(flow, config("left"));
    let kinds: Vec<_> = query
        .metrics()
        .operators
        .into_iter()
        .map(|o| o.operator)
        .collect();
    assert!(
        kinds
            .iter()
            .any(|name| name.starts_with("broadcast_left_join-")),
        "registered under its own kind: {kinds:?}"
    );
    assert_eq!(
        sorted(&out),
        vec![
            (10, Some("ada")),
            (11, Some("grace")),
            (11, Some("hopper")),
            (12, None)
        ]
    );
}

#[test]
fn broadcast_join_reads_a_csv_table() {
    #[derive(Debug, Clone, serde::Deserialize)]
    struct User {
        id: u32,
        country: String,
    }
    let path = std::env::temp_dir().join(format!("rtflow-users-{}.csv", std::process::id()));
    std::fs::write(&path, "id,country\n1,NL\n2,JP\n").unwrap();
    let table = StaticTable::from_csv(&path, |u: &User| u.id).unwrap();
    let flow = Dataflow::new("csv");
    let out = MemorySink::new();
    flow.source(input(1, [1u32, 2, 3]))
        .broadcast_join(&table, |id| *id)
        .map(|(id, user)| (id, user.country))
        .sink(out.clone());
    run_to_end(flow, config("csv"));
    assert_eq!(sorted(&out), vec![(1, "NL".into()), (2, "JP".into())]);
}

/// Each record a sink partition saw, tagged with that partition.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(usize, (u32, u32))>>>;

/// A writer that tags what it sees with its partition.
struct Tagged(Seen, usize);

impl ForeachWriter<(u32, u32)> for Tagged {
    fn open(&mut self, partition_id: usize, _epoch_id: u64) -> bool {
        self.1 = partition_id;
        true
    }

    fn process(&mut self, value: (u32, u32)) -> Result<(), BoxError> {
        self.0.lock().unwrap().push((self.1, value));
        Ok(())
    }
}

#[test]
fn key_by_routes_each_key_to_one_instance_in_order() {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let flow = Dataflow::new("keyed");
    // (key, sequence number per key), spread over 3 source partitions.
    let records: Vec<(u32, u32)> = (0..3000u32).map(|i| (i % 17, i / 17)).collect();
    let source = MemorySource::new(1);
    source.push_all(0, records.clone()).unwrap();
    source.end();
    let sink_seen = seen.clone();
    flow.source(source)
        .key_by(|(key, _)| *key)
        .map(|record| record)
        .parallelism(3)
        .sink(ForeachSink::new(move || Tagged(sink_seen.clone(), 0)));
    run_to_end(flow, config("keyed").default_parallelism(3));

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), records.len(), "every record arrives once");
    let mut owner: HashMap<u32, usize> = HashMap::new();
    let mut last: HashMap<u32, u32> = HashMap::new();
    for (partition, (key, sequence)) in seen.iter() {
        assert_eq!(
            *owner.entry(*key).or_insert(*partition),
            *partition,
            "key {key} stays on one instance"
        );
        if let Some(previous) = last.insert(*key, *sequence) {
            assert!(
                previous < *sequence,
                "key {key}: {sequence} after {previous}"
            );
        }
    }
    let instances: std::collections::BTreeSet<_> = owner.values().collect();
    assert!(instances.len() > 1, "17 keys spread over several instances");
}

#[test]
fn rebalance_and_broadcast_spread_records() {
    let flow = Dataflow::new("spread");
    let dealt = MemorySink::new();
    let copied = MemorySink::new();
    let source = flow.source(input(1, 0..90u32));
    source
        .rebalance()
        .map(|x| x)
        .parallelism(3)
        .sink(dealt.clone());
    let broadcast = flow.source(input(1, 0..10u32));
    broadcast
        .broadcast()
        .map(|x| x)
        .parallelism(3)
        .sink(copied.clone());
    run_to_end(flow, config("spread"));
    assert_eq!(sorted(&dealt), (0..90).collect::<Vec<_>>());
    let mut expected: Vec<u32> = (0..10).flat_map(|x| [x, x, x]).collect();
    expected.sort();
    assert_eq!(sorted(&copied), expected);
}

#[test]
fn one_stream_feeds_several_consumers() {
    let flow = Dataflow::new("fanout");
    let evens = MemorySink::new();
    let all = MemorySink::new();
    let numbers = flow.source(input(2, 0..20u32));
    numbers.filter(|x| x % 2 == 0).sink(evens.clone());
    numbers.sink(all.clone());
    run_to_end(flow, config("fanout"));
    assert_eq!(sorted(&evens), (0..20).step_by(2).collect::<Vec<_>>());
    assert_eq!(sorted(&all), (0..20).collect::<Vec<_>>());
}

#[test]
fn with_watermark_assigns_event_time_from_the_value() {
    let flow = Dataflow::new("event-time");
    let out = MemorySink::new();
    let source = MemorySource::new(1);
    source.push_at(0, 5_000i64, 1).unwrap();
    source.push_at(0, 7_000i64, 2).unwrap();
    source.end();
    flow.source(source)
        .with_watermark(|millis| *millis, Duration::from_secs(1))
        .sink(out.clone());
    run_to_end(flow, config("event-time"));
    let event_times: Vec<i64> = out.records().iter().map(|r| r.meta.event_time).collect();
    assert_eq!(event_times, vec![5_000, 7_000]);
}

#[test]
fn memory_source_keeps_event_times_and_latency_is_measured() {
    let flow = Dataflow::new("meta");
    let out = MemorySink::new();
    let source = MemorySource::new(1);
    source.push_at(0, "a", 42).unwrap();
    source.end();
    flow.source(source).map(|s| s).sink(out.clone());
    let query = run_to_end(flow, config("meta"));
    let record = &out.records()[0];
    assert_eq!(record.meta.event_time, 42);
    assert!(record.meta.source_time <= record.meta.ingest_time);
    let latency = query.metrics().latency;
    assert_eq!(latency.processing.count, 1);
    assert!(latency.end_to_end.p50 >= latency.processing.p50);
}

#[test]
fn custom_operator_runs_when_the_allowlist_check_is_off() {
    struct RunningSum(u64);
    impl Operator<u64, u64> for RunningSum {
        fn process(
            &mut self,
            record: Record<u64>,
            out: &mut Collector<'_, u64>,
        ) -> rtflow::Result<()> {
            self.0 += record.value;
            out.emit(self.0)
        }
    }
    let flow = Dataflow::new("custom");
    let out = MemorySink::new();
    flow.source(input(1, 1..=4u64))
        .transform("running_sum", |_| RunningSum(0))
        .sink(out.clone());
    run_to_end(flow, config("custom").allowlist_check(false));
    assert_eq!(out.rows(), vec![1, 3, 6, 10]);
}

#[test]
fn generator_rows_are_deterministic_per_offset() {
    let flow = Dataflow::new("generator");
    let out = MemorySink::new();
    flow.source(
        GeneratorSource::new(|partition, offset| (partition, offset))
            .partitions(3)
            .rows_per_partition(100),
    )
    .sink(out.clone());
    run_to_end(flow, config("generator"));
    let expected: Vec<(usize, u64)> = (0..3).flat_map(|p| (0..100).map(move |o| (p, o))).collect();
    assert_eq!(sorted(&out), expected);
}

#[test]
fn generator_keeps_its_rate() {
    let flow = Dataflow::new("rate");
    let out = MemorySink::new();
    flow.source(
        GeneratorSource::new(|_, offset| offset)
            .partitions(2)
            .rows_per_second(200),
    )
    .sink(out.clone());
    let started = std::time::Instant::now();
    let query = flow.start(config("rate")).unwrap();
    assert!(out.wait_for(20, common::TIMEOUT), "rows keep coming");
    query.stop().unwrap();
    // Never ahead of the schedule (one row of rounding per partition), however
    // slow or fast the machine is.
    let allowed = (200.0 * started.elapsed().as_secs_f64()) as usize + 2;
    let rows = out.len();
    assert!(rows <= allowed, "{rows} rows, schedule allows {allowed}");
}
