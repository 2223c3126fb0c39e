//! Event time: watermarks computed at the source per partition (min over the
//! partitions of their largest event time, minus the delay), carried in real time
//! to the sinks, and restored from the checkpoint without going back.

mod common;

use std::time::{Duration, Instant};

use common::{config, TIMEOUT};
use rtflow::prelude::*;

/// Waits until the query's watermark satisfies `done`, returning it.
fn wait_for_watermark(query: &StreamingQuery, done: impl Fn(Option<i64>) -> bool) -> Option<i64> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let watermark = query.metrics().watermark();
        if done(watermark) {
            return watermark;
        }
        assert!(
            Instant::now() < deadline,
            "watermark stuck at {watermark:?}: {:?}",
            query.metrics().operators
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn start(input: &MemorySource<i64>, config: QueryConfig, parallelism: usize) -> StreamingQuery {
    let flow = Dataflow::new("event-time");
    flow.source(input.clone())
        .parallelism(parallelism)
        .with_watermark(|time: &i64| *time, Duration::from_millis(10))
        .key_by(|time: &i64| *time % 3)
        .map(|time| time)
        .sink(MemorySink::new());
    flow.start(config).unwrap()
}

#[test]
fn the_slowest_partition_holds_the_watermark_back_in_real_time() {
    let input = MemorySource::new(3);
    let query = start(&input, config("slowest"), 2);
    input.push_all(0, [100, 500, 900]).unwrap();
    input.push_all(1, [300]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        query.metrics().watermark(),
        None,
        "partition 2 sent nothing yet"
    );

    input.push_all(2, [200]).unwrap();
    assert_eq!(wait_for_watermark(&query, |w| w.is_some()), Some(190));
    input.push_all(2, [2_000]).unwrap();
    assert_eq!(
        wait_for_watermark(&query, |w| w >= Some(290)),
        Some(290),
        "partition 1 at 300"
    );
    input.push_all(1, [1_000]).unwrap();
    assert_eq!(
        wait_for_watermark(&query, |w| w >= Some(890)),
        Some(890),
        "partition 0 at 900"
    );
    query.stop().unwrap();
}

#[test]
fn an_idle_partition_is_released_after_the_timeout() {
    let input = MemorySource::new(2);
    let flow = Dataflow::new("idle");
    // Two readers: the one of the silent partition declares its stream idle.
    flow.source(input.clone())
        .parallelism(2)
        .with_watermark_idle(|time: &i64| *time, Duration::ZERO, Duration::from_secs(1))
        .sink(MemorySink::new());
    let query = flow.start(config("idle")).unwrap();
    // Partition 1 turns idle first; partition 0 then has the whole timeout
    // before it could turn idle too, and release partition 1's 3,000 below.
    std::thread::sleep(Duration::from_millis(1_200));
    input.push_all(0, [1_000]).unwrap();
    assert_eq!(wait_for_watermark(&query, |w| w.is_some()), Some(1_000));
    input.push_all(1, [3_000]).unwrap();
    input.push_all(0, [2_000]).unwrap();
    assert_eq!(
        wait_for_watermark(&query, |w| w >= Some(2_000)),
        Some(2_000),
        "partition 1 counts again once it delivers"
    );
    query.stop().unwrap();
}

#[test]
fn a_restored_watermark_never_goes_back() {
    let input = MemorySource::new(1);
    let config = config("restored")
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(Duration::from_millis(100));
    let query = start(&input, config.clone(), 1);
    input.push_all(0, [5_000]).unwrap();
    assert_eq!(wait_for_watermark(&query, |w| w.is_some()), Some(4_990));
    query.stop().unwrap();
    drop(query);

    let query = start(&input, config, 1);
    input.push_all(0, [1_000]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        query.metrics().watermark().is_none_or(|w| w >= 4_990),
        "{:?}",
        query.metrics().watermark()
    );
    input.push_all(0, [6_000]).unwrap();
    assert_eq!(
        wait_for_watermark(&query, |w| w >= Some(5_990)),
        Some(5_990)
    );
    query.stop().unwrap();
}

#[test]
fn a_stop_does_not_let_the_faster_lanes_close_windows_early() {
    let input = MemorySource::new(2);
    let config = config("stop-holds")
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(Duration::from_millis(100));
    let start = |input: &MemorySource<i64>| {
        let flow = Dataflow::new("stop-holds");
        let out = MemorySink::new();
        flow.source(input.clone())
            .parallelism(2)
            .with_watermark(|time: &i64| *time, Duration::ZERO)
            .key_by(|_: &i64| 0u8)
            .window(Window::tumbling(Duration::from_secs(1)))
            .count()
            .parallelism(1)
            .sink(out.clone());
        (flow.start(config.clone()).unwrap(), out)
    };
    let (query, out) = start(&input);
    // Partition 0 runs far ahead; partition 1 holds the watermark at 200.
    input.push_all(0, [100, 10_000]).unwrap();
    input.push_all(1, [200]).unwrap();
    assert!(out.wait_for(3, TIMEOUT));
    // Stopping ends both lanes of the window operator, one after the other:
    // the lane of partition 1 must keep holding the watermark at 200.
    query.stop().unwrap();
    drop(query);

    let (query, out) = start(&input);
    input.push_all(1, [500]).unwrap();
    assert!(out.wait_for(1, TIMEOUT));
    query.stop().unwrap();
    let (_, window, count) = out.rows()[0];
    assert_eq!(
        (window.start, window.end, count),
        (0, 1_000, 3),
        "500 is not late"
    );
    assert_eq!(query.metrics().late_records(), 0);
}

#[test]
fn a_watermark_after_a_union_waits_for_the_partitions_of_every_input() {
    let (left, right) = (MemorySource::new(2), MemorySource::new(2));
    let flow = Dataflow::new("union-watermark");
    flow.source(left.clone())
        .union(&flow.source(right.clone()))
        .with_watermark(|time: &i64| *time, Duration::from_millis(10))
        .key_by(|time: &i64| *time % 3)
        .map(|time| time)
        .sink(MemorySink::new());
    let query = flow.start(config("union-watermark")).unwrap();
    left.push_all(0, [1_000]).unwrap();
    left.push_all(1, [2_000]).unwrap();
    right.push_all(0, [3_000]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        query.metrics().watermark(),
        None,
        "partition 1 of the right source sent nothing yet"
    );
    right.push_all(1, [500]).unwrap();
    assert_eq!(wait_for_watermark(&query, |w| w.is_some()), Some(490));
    right.push_all(1, [5_000]).unwrap();
    assert_eq!(
        wait_for_watermark(&query, |w| w >= Some(990)),
        Some(990),
        "the left source's partition 0 at 1000"
    );
    query.stop().unwrap();
}
