//! Every query on 50,000 generated events (two partitions, so every shuffle
//! and watermark merge is exercised), its final result read from what the
//! sink received and compared with the batch reference over the same events.
//! Event time advances at 1,000 events/s, so the run spans 50 s of event time:
//! several tumbling windows, 25 sliding ones, and sessions that merge.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use rtflow::prelude::*;
use rtflow_nexmark::{queries, reference, Event, GeneratorConfig, NexmarkGenerator, NexmarkSource};

/// The root crate's Kafka test helpers: the same rule for finding the broker
/// that scripts/test.sh started (skip outside CI, fail in CI).
#[allow(dead_code)]
#[path = "../../tests/common/kafka.rs"]
mod kafka;

const EVENTS: u64 = 50_000;

fn generator() -> NexmarkGenerator {
    NexmarkGenerator::new(GeneratorConfig {
        events_per_second: 1_000,
        ..GeneratorConfig::default()
    })
}

/// The events the queries run on, made once for all tests.
fn events() -> &'static [Event] {
    static EVENTS_MADE: OnceLock<Vec<Event>> = OnceLock::new();
    EVENTS_MADE.get_or_init(|| generator().events(0..EVENTS).collect())
}

/// Runs `query` on the events to the end of the input and returns every row
/// the sink received, in arrival order.
fn run<T: Clone + Send + 'static>(
    name: &str,
    query: impl Fn(&Stream<Event>) -> Stream<T>,
) -> Vec<T> {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let flow = Dataflow::new(name);
    let events = flow.source(NexmarkSource::new(generator()).partitions(2).events(EVENTS));
    let output = MemorySink::new();
    query(&events).sink(output.clone());
    let location = std::env::temp_dir().join(format!(
        "rtflow-nexmark-test-{name}-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&location);
    let query = flow
        .start(QueryConfig::new(name).checkpoint_location(&location))
        .unwrap();
    assert!(query
        .await_termination(Some(Duration::from_secs(120)))
        .unwrap());
    assert_eq!(query.metrics().late_records(), 0, "no event is late");
    let _ = std::fs::remove_dir_all(&location);
    output.rows()
}

fn sorted<T: Ord>(mut rows: Vec<T>) -> Vec<T> {
    rows.sort();
    rows
}

#[test]
fn the_generator_makes_the_reference_mix() {
    let events = events();
    let count = |kind: fn(&Event) -> bool| events.iter().filter(|e| kind(e)).count();
    assert_eq!(count(|e| matches!(e, Event::Person(_))), 1_000);
    assert_eq!(count(|e| matches!(e, Event::Auction(_))), 3_000);
    assert_eq!(count(|e| matches!(e, Event::Bid(_))), 46_000);
    assert!(events
        .windows(2)
        .all(|w| w[0].date_time() <= w[1].date_time()));
    assert_eq!(
        events[EVENTS as usize - 1].date_time() - events[0].date_time(),
        49_999,
        "1,000 events per second of event time"
    );
}

#[test]
fn q0_passes_every_bid() {
    let rows = run("q0", queries::q0);
    assert_eq!(rows.len(), 46_000);
    assert_eq!(sorted(rows), reference::q0(events()));
}

#[test]
fn q1_converts_every_price() {
    let rows = run("q1", queries::q1);
    assert_eq!(sorted(rows), reference::q1(events()));
}

#[test]
fn q2_selects_the_bids_of_every_123rd_auction() {
    let rows = run("q2", queries::q2);
    let expected = reference::q2(events());
    assert!(expected.len() > 100, "{} bids selected", expected.len());
    assert_eq!(sorted(rows), expected);
}

#[test]
fn q3_joins_auctions_with_their_sellers() {
    let rows = run("q3", queries::q3);
    let expected = reference::q3(events());
    assert!(expected.len() > 100, "{} auctions", expected.len());
    assert_eq!(sorted(rows), expected);
}

#[test]
fn q4_averages_the_winning_bids_per_category() {
    let rows = run("q4", queries::q4);
    let expected = reference::q4(events());
    assert_eq!(expected.len(), 5, "every category has winning bids");
    assert_eq!(reference::latest(rows), expected);
}

#[test]
fn q5_finds_the_auctions_with_the_most_bids_per_window() {
    let rows = run("q5", queries::q5);
    let expected = reference::q5(events());
    assert!(expected.len() >= 25, "{} windows", expected.len());
    assert_eq!(reference::final_q5(rows), expected);
}

#[test]
fn q7_finds_the_highest_bids_per_window() {
    let rows = run("q7", queries::q7);
    let expected = reference::q7(events());
    assert_eq!(expected.len(), 5, "50 s of events from a whole minute on");
    assert_eq!(reference::final_q7(rows), expected);
}

#[test]
fn q8_finds_the_people_selling_in_the_window_they_joined() {
    let rows = run("q8", queries::q8);
    let expected = reference::q8(events());
    assert!(expected.len() > 10, "{} new sellers", expected.len());
    assert_eq!(sorted(rows), expected, "each new seller once");
}

#[test]
fn q11_counts_the_bids_of_every_session() {
    let rows = run("q11", queries::q11);
    let expected = reference::q11(events());
    let merged = expected.values().filter(|bids| **bids > 1).count();
    assert!(merged > 100, "{merged} sessions of several bids");
    assert_eq!(reference::final_q11(rows), expected);
}

/// A query stopped midway and restarted on its checkpoint resumes the
/// generator at its offsets: together the two runs see every event once.
#[test]
fn a_restarted_query_replays_nothing_and_misses_nothing() {
    let location =
        std::env::temp_dir().join(format!("rtflow-nexmark-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&location);
    let output = MemorySink::new();
    let start = |rate: Option<u64>| {
        let flow = Dataflow::new("restart");
        let mut source = NexmarkSource::new(generator()).partitions(2).events(EVENTS);
        if let Some(rate) = rate {
            source = source.rate(rate);
        }
        queries::q0(&flow.source(source)).sink(output.clone());
        flow.start(QueryConfig::new("restart").checkpoint_location(&location))
            .unwrap()
    };
    let first = start(Some(50_000));
    assert!(output.wait_for(10_000, Duration::from_secs(60)));
    first.stop().unwrap();
    let stopped_at = output.len();
    assert!(
        stopped_at < 46_000,
        "stopped midway, after {stopped_at} bids"
    );
    let second = start(None);
    assert!(second
        .await_termination(Some(Duration::from_secs(120)))
        .unwrap());
    let _ = std::fs::remove_dir_all(&location);
    assert_eq!(sorted(output.rows()), reference::q0(events()));
}

/// A query over the events the loader wrote to a new topic of `partitions`
/// partitions, read by at most `readers` readers: `check` watches the running
/// query and the rows its sink received. The topic and checkpoint location are
/// removed afterwards.
fn over_kafka<T: Clone + Send + 'static>(
    name: &str,
    partitions: usize,
    readers: Option<usize>,
    query: impl Fn(&Stream<Event>) -> Stream<T>,
    check: impl FnOnce(&StreamingQuery, &MemorySink<T>),
) {
    let Some(bootstrap) = kafka::bootstrap() else {
        return;
    };
    let topic = format!("nexmark-{name}-{}", std::process::id());
    rtflow_nexmark::load_kafka(generator(), EVENTS, &bootstrap, &topic, partitions).unwrap();
    let flow = Dataflow::new(name);
    let mut source = KafkaSource::new(&bootstrap)
        .subscribe([&topic])
        .starting_offsets(StartingOffsets::Earliest);
    if let Some(readers) = readers {
        source = source.max_partitions(readers);
    }
    let events = flow.source(source).map(|record: KafkaRecord| {
        serde_json::from_slice::<Event>(record.value.as_deref().unwrap_or_default()).unwrap()
    });
    let output = MemorySink::new();
    query(&events).sink(output.clone());
    let location =
        std::env::temp_dir().join(format!("rtflow-nexmark-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&location);
    let running = flow
        .start(QueryConfig::new(name).checkpoint_location(&location))
        .unwrap();
    check(&running, &output);
    running.stop().unwrap();
    let _ = std::fs::remove_dir_all(&location);
    let _ = KafkaAdmin::new(&bootstrap).and_then(|admin| admin.delete_topic(&topic));
}

/// q5 on a 3-partition topic read by 2 readers, so one reader reads two
/// partitions: event time is tracked per topic partition, the watermark
/// advances, no bid is late, and the answer is the reference's.
#[test]
fn q5_over_a_kafka_topic_of_three_partitions_equals_the_reference() {
    let expected = reference::q5(events());
    let latest = events().iter().map(Event::date_time).max().unwrap();
    over_kafka("q5-kafka", 3, Some(2), queries::q5, |query, output| {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while reference::final_q5(output.rows()) != expected
            || query.metrics().watermark() < Some(latest - 1_000)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "q5 over Kafka: {} windows of {}, watermark {:?} (latest event {latest})",
                reference::final_q5(output.rows()).len(),
                expected.len(),
                query.metrics().watermark()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(query.metrics().late_records(), 0, "no bid is late");
    });
}

/// The loader writes the events to a topic, and a query reading the topic
/// gives the answer it gives on the generator.
#[test]
fn q2_reads_the_events_the_loader_wrote_to_kafka() {
    let expected = reference::q2(events());
    over_kafka("q2-kafka", 2, None, queries::q2, |_, output| {
        assert!(output.wait_for(expected.len(), Duration::from_secs(60)));
        assert_eq!(sorted(output.rows()), expected);
    });
}
