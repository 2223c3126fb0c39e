//! No thread outlives its query, and the actors run at normal priority while the
//! coordinator runs at idle priority: checked in a test binary of its own, so no
//! other test's actors are running at the same time.

mod common;

use std::time::{Duration, Instant};

use common::{config, TIMEOUT};
use rtflow::prelude::*;

/// The threads of this process whose name starts with "rtflow": name and
/// scheduling policy (`SCHED_OTHER` = 0, `SCHED_IDLE` = 5).
fn rtflow_threads() -> Vec<(String, u32)> {
    std::fs::read_dir("/proc/self/task")
        .expect("Linux /proc")
        .filter_map(|task| {
            let path = task.ok()?.path();
            let name = std::fs::read_to_string(path.join("comm")).ok()?;
            let stat = std::fs::read_to_string(path.join("stat")).ok()?;
            // Field 41 of stat, counting from the state (field 3) after the
            // parenthesised name.
            let policy = stat[stat.rfind(')')? + 2..]
                .split(' ')
                .nth(38)?
                .parse()
                .ok()?;
            Some((name.trim().to_owned(), policy))
        })
        .filter(|(name, _)| name.starts_with("rtflow"))
        .collect()
}

/// [`rtflow_threads`] once every one of them has named itself. A new thread
/// names itself when it first runs; until then it carries the name of the
/// thread that spawned it, so an actor not yet scheduled reads as a second
/// "rtflow-coord".
fn named_rtflow_threads() -> Vec<(String, u32)> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let threads = rtflow_threads();
        let coordinators = threads.iter().filter(|(name, _)| name == "rtflow-coord");
        if coordinators.count() <= 1 || Instant::now() > deadline {
            return threads;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The names of the rtflow threads still listed after a join. The kernel wakes
/// a joiner from the joined thread's exit, a moment before it takes the
/// thread off `/proc/self/task`: a thread that is gone leaves the list within
/// that moment, one left running stays in it.
fn threads_left() -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let left: Vec<String> = rtflow_threads().into_iter().map(|(name, _)| name).collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
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
    assert_eq!(rtflow_threads().len(), 0);

    let input = MemorySource::new(3);
    let query = pipeline(&input, u32::MAX)
        .start(config("threads").operator_chaining(false))
        .unwrap();
    input.push_all(0, 0..100).unwrap();
    // 3 sources + 3 maps + 2 filters + 2 sinks, and the coordinator.
    let threads = named_rtflow_threads();
    assert_eq!(threads.len(), 11);
    // Threads inherit their spawner's policy: the coordinator, which starts
    // the actors, must give way only once they run.
    for (name, policy) in threads {
        let expected = if name == "rtflow-coord" { 5 } else { 0 };
        assert_eq!(policy, expected, "scheduling policy of {name}");
    }
    query.stop().unwrap();
    assert_eq!(
        threads_left(),
        Vec::<String>::new(),
        "stop() joins every thread"
    );

    let input = MemorySource::new(3);
    let query = pipeline(&input, 5)
        .start(config("threads").operator_chaining(false))
        .unwrap();
    input.push_all(1, 0..10).unwrap();
    assert!(query.await_termination(Some(TIMEOUT)).is_err());
    assert_eq!(
        threads_left(),
        Vec::<String>::new(),
        "a failure stops and joins every actor"
    );
}
