//! No thread outlives its query: checked in a test binary of its own, so no other
//! test's actors are running at the same time.

mod common;

use common::{config, TIMEOUT};
use rtflow::prelude::*;

/// Threads of this process whose name starts with "rtflow".
fn rtflow_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("Linux /proc")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("rtflow"))
        .count()
}

fn pipeline(input: &MemorySource<u32>, fail_on: u32) -> Dataflow {
    let flow = Dataflow::new("threads");
    flow.source(input.clone())
        .map(move |x| {
            assert_ne!(x, fail_on, "failing on purpose");
            x
        })
        .rebalance()
        .filter(|_| true)
        .sink(MemorySink::new());
    flow
}

#[test]
fn every_thread_is_joined_on_stop_and_on_failure() {
    assert_eq!(rtflow_threads(), 0);

    let input = MemorySource::new(3);
    let query = pipeline(&input, u32::MAX)
        .start(config("threads").operator_chaining(false))
        .unwrap();
    input.push_all(0, 0..100).unwrap();
    // 3 sources + 3 maps + 2 filters + 2 sinks, and the coordinator.
    assert_eq!(rtflow_threads(), 11);
    query.stop().unwrap();
    assert_eq!(rtflow_threads(), 0, "stop() joins every thread");

    let input = MemorySource::new(3);
    let query = pipeline(&input, 5)
        .start(config("threads").operator_chaining(false))
        .unwrap();
    input.push_all(1, 0..10).unwrap();
    assert!(query.await_termination(Some(TIMEOUT)).is_err());
    assert_eq!(rtflow_threads(), 0, "a failure stops and joins every actor");
}
