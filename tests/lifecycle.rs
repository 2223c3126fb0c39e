//! Query lifecycle: stop drains and joins, failures propagate with their cause,
//! backpressure bounds memory without losing a record.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{config, TIMEOUT};
use rtflow::prelude::*;

#[test]
fn stop_drains_records_already_read() {
    let flow = Dataflow::new("drain");
    let input = MemorySource::new(2);
    let out = MemorySink::new();
    flow.source(input.clone())
        .map(|x: u64| x + 1)
        .rebalance()
        .map(|x| x * 2)
        .sink(out.clone());
    let query = flow.start(config("drain")).unwrap();
    assert!(query.is_active());
    input.push_all(0, 0..500).unwrap();
    input.push_all(1, 500..1000).unwrap();
    assert!(out.wait_for(1000, TIMEOUT));
    query.stop().unwrap();
    assert!(!query.is_active());
    assert_eq!(query.exception(), None);
    assert_eq!(query.await_termination(None), Ok(true));
    let mut rows = out.rows();
    rows.sort();
    assert_eq!(rows, (0..1000).map(|x| (x + 1) * 2).collect::<Vec<_>>());
}

/// The `Cpus_allowed_list` line of a thread's /proc status ("0-1", "3").
fn allowed_cpus(status: &str) -> String {
    let status = std::fs::read_to_string(status).expect("Linux /proc");
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc status");
    line.trim().to_owned()
}

#[test]
fn cpu_affinity_pins_every_actor() {
    let caller = allowed_cpus("/proc/thread-self/status");
    // The first CPU this thread may use: "0-1" or "2,5" both start with it.
    let cpu: usize = caller
        .split(['-', ','])
        .next()
        .and_then(|first| first.parse().ok())
        .unwrap();
    let flow = Dataflow::new("pinned");
    let input = MemorySource::new(2);
    let out = MemorySink::new();
    let on_thread = |_| allowed_cpus("/proc/thread-self/status");
    flow.source(input.clone())
        .map(on_thread)
        .rebalance()
        .map(move |source_cpus| (source_cpus, allowed_cpus("/proc/thread-self/status")))
        .sink(out.clone());
    let query = flow
        .start(
            config("pinned")
                .cpu_affinity([cpu])
                .operator_chaining(false),
        )
        .unwrap();
    input.push_all(0, 0..50u32).unwrap();
    input.push_all(1, 50..100u32).unwrap();
    assert!(out.wait_for(100, TIMEOUT));
    query.stop().unwrap();
    let expected = (cpu.to_string(), cpu.to_string());
    assert!(
        out.rows().iter().all(|cpus| *cpus == expected),
        "{:?}",
        out.rows()
    );
    assert_eq!(
        allowed_cpus("/proc/thread-self/status"),
        caller,
        "the caller's own thread keeps its affinity"
    );
}

#[test]
fn await_termination_times_out_while_running() {
    let flow = Dataflow::new("wait");
    flow.source(MemorySource::<u32>::new(1))
        .sink(MemorySink::new());
    let query = flow.start(config("wait")).unwrap();
    assert_eq!(
        query.await_termination(Some(Duration::from_millis(50))),
        Ok(false)
    );
    assert!(query.is_active());
    query.stop().unwrap();
    assert_eq!(query.await_termination(Some(Duration::ZERO)), Ok(true));
}

#[test]
fn query_has_identity() {
    let flow = Dataflow::new("identity");
    flow.source(MemorySource::<u32>::new(1))
        .sink(MemorySink::new());
    let query = flow.start(config("named")).unwrap();
    assert_eq!(query.name(), "named");
    assert_ne!(query.id(), query.run_id());
}

#[test]
fn a_panicking_map_fails_the_query_with_its_message() {
    for chaining in [true, false] {
        let flow = Dataflow::new("panic");
        let input = MemorySource::new(2);
        flow.source(input.clone())
            .map(|x: u32| {
                if x == 13 {
                    panic!("boom on {x}");
                }
                x
            })
            .sink(MemorySink::new());
        let query = flow
            .start(config("panic").operator_chaining(chaining))
            .unwrap();
        input.push_all(0, 0..20).unwrap();
        let error = query
            .await_termination(Some(TIMEOUT))
            .expect_err("the query fails");
        assert_eq!(error.error_class(), "OPERATOR_FAILED");
        assert!(
            error.to_string().contains("panicked: boom on 13"),
            "{error}"
        );
        assert!(error.to_string().contains("map-1"), "{error}");
        assert!(!query.is_active());
        assert_eq!(query.exception(), Some(error));
    }
}

#[test]
fn a_failing_sink_fails_the_query_and_its_writer_sees_the_error() {
    struct Flaky(Arc<Mutex<Vec<String>>>);
    impl ForeachWriter<u32> for Flaky {
        fn process(&mut self, value: u32) -> Result<(), BoxError> {
            if value == 7 {
                return Err(format!("cannot write {value}").into());
            }
            Ok(())
        }
        fn close(&mut self, error: Option<&RtflowError>) {
            self.0.lock().unwrap().push(format!("{error:?}"));
        }
    }
    let closes = Arc::new(Mutex::new(Vec::new()));
    let writer_closes = closes.clone();
    let flow = Dataflow::new("flaky");
    let input = MemorySource::new(1);
    flow.source(input.clone())
        .sink(ForeachSink::new(move || Flaky(writer_closes.clone())));
    let query = flow.start(config("flaky")).unwrap();
    input.push_all(0, 0..10).unwrap();
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED");
    assert!(error.to_string().contains("cannot write 7"), "{error}");
    let closes = closes.lock().unwrap();
    assert_eq!(closes.len(), 1);
    assert!(closes[0].contains("cannot write 7"), "{closes:?}");
}

#[test]
fn foreach_writer_is_opened_per_partition_and_closed_at_the_end() {
    struct Recorder(Arc<Mutex<Vec<String>>>);
    impl ForeachWriter<u32> for Recorder {
        fn open(&mut self, partition_id: usize, epoch_id: u64) -> bool {
            self.0
                .lock()
                .unwrap()
                .push(format!("open {partition_id} {epoch_id}"));
            true
        }
        fn process(&mut self, value: u32) -> Result<(), BoxError> {
            self.0.lock().unwrap().push(format!("row {value}"));
            Ok(())
        }
        fn close(&mut self, error: Option<&RtflowError>) {
            self.0
                .lock()
                .unwrap()
                .push(format!("close {}", error.is_some()));
        }
    }
    let events = Arc::new(Mutex::new(Vec::new()));
    let writer_events = events.clone();
    let flow = Dataflow::new("foreach");
    let input = MemorySource::new(1);
    input.push_all(0, [1, 2]).unwrap();
    input.end();
    flow.source(input)
        .sink(ForeachSink::new(move || Recorder(writer_events.clone())));
    common::run_to_end(flow, config("foreach"));
    assert_eq!(
        *events.lock().unwrap(),
        vec!["open 0 1", "row 1", "row 2", "close false"]
    );
}

/// Records the epochs a foreach writer is opened for.
struct Opens(Arc<Mutex<Vec<u64>>>);

impl ForeachWriter<u32> for Opens {
    fn open(&mut self, _partition_id: usize, epoch_id: u64) -> bool {
        self.0.lock().unwrap().push(epoch_id);
        true
    }
    fn process(&mut self, _value: u32) -> Result<(), BoxError> {
        Ok(())
    }
}

#[test]
fn a_restarted_foreach_writer_opens_the_epoch_after_the_restored_checkpoint() {
    let config = config("foreach-epochs");
    let input = MemorySource::new(1);
    let run = |rows: std::ops::Range<u32>| {
        let opens = Arc::new(Mutex::new(Vec::new()));
        let writer_opens = opens.clone();
        let flow = Dataflow::new("foreach-epochs");
        flow.source(input.clone())
            .sink(ForeachSink::new(move || Opens(writer_opens.clone())));
        let query = flow.start(config.clone()).unwrap();
        input.push_all(0, rows).unwrap();
        query.checkpoint_now(TIMEOUT).unwrap();
        query.checkpoint_now(TIMEOUT).unwrap();
        query.stop().unwrap();
        let opens = opens.lock().unwrap().clone();
        opens
    };
    let first = run(0..5);
    let second = run(5..10);
    assert_eq!(first[0], 1, "a first run starts at epoch 1: {first:?}");
    assert!(first.windows(2).all(|w| w[1] == w[0] + 1), "{first:?}");
    // The stop committed the last epoch the first run opened: an idempotent
    // writer that skips the epochs it wrote must not skip the new run's.
    assert_eq!(
        second[0],
        first.last().unwrap() + 1,
        "first run {first:?}, second {second:?}"
    );
}

#[test]
fn a_foreach_writer_stopped_by_another_operators_failure_is_told_that_failure() {
    struct Closes(Arc<Mutex<Vec<String>>>);
    impl ForeachWriter<u32> for Closes {
        fn process(&mut self, _value: u32) -> Result<(), BoxError> {
            Ok(())
        }
        fn close(&mut self, error: Option<&RtflowError>) {
            if let Some(error) = error {
                self.0.lock().unwrap().push(error.to_string());
            }
        }
    }
    let closes = Arc::new(Mutex::new(Vec::new()));
    let writer_closes = closes.clone();
    let flow = Dataflow::new("upstream-failure");
    let input = MemorySource::new(1);
    flow.source(input.clone())
        .map(|x: u32| {
            if x == 5 {
                panic!("boom on {x}");
            }
            x
        })
        // The sink runs on actors of its own, which the failure cancels.
        .rebalance()
        .sink(ForeachSink::new(move || Closes(writer_closes.clone())));
    let query = flow.start(config("upstream-failure")).unwrap();
    input.push_all(0, 0..10).unwrap();
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    assert_eq!(error.error_class(), "OPERATOR_FAILED");
    let closes = closes.lock().unwrap();
    assert!(
        !closes.is_empty(),
        "every writer is closed with the failure"
    );
    assert!(
        closes.iter().all(|close| close.contains("boom on 5")),
        "{closes:?}"
    );
}

#[test]
fn dropping_the_handle_stops_the_query() {
    let out = MemorySink::new();
    {
        let flow = Dataflow::new("drop");
        flow.source(GeneratorSource::new(|_, o| o).rows_per_second(1000))
            .sink(out.clone());
        let _query = flow.start(config("drop")).unwrap();
        assert!(out.wait_for(1, TIMEOUT));
    }
    let after_drop = out.len();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        out.len(),
        after_drop,
        "nothing arrives once the handle is dropped"
    );
}

/// A gate the sink waits at until the test opens it.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn wait(&self) {
        let (open, changed) = &*self.0;
        let mut open = open.lock().unwrap();
        while !*open {
            open = changed.wait(open).unwrap();
        }
    }

    fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
}

#[test]
fn backpressure_throttles_the_source_and_loses_nothing() {
    const PER_PARTITION: u64 = 20_000;
    let gate = Gate::default();
    let received = Arc::new(Mutex::new(Vec::new()));
    let flow = Dataflow::new("backpressure");
    let (sink_gate, sink_received) = (gate.clone(), received.clone());
    flow.source(
        GeneratorSource::new(|partition, offset| (partition, offset))
            .partitions(2)
            .rows_per_partition(PER_PARTITION),
    )
    .name("generator")
    .map(|row| row)
    .sink(ForeachSink::from_fn(move |row| {
        sink_gate.wait();
        sink_received.lock().unwrap().push(row);
        Ok(())
    }));
    let query = flow
        .start(
            config("backpressure")
                .operator_chaining(false)
                .mailbox_capacity(4)
                .max_records_per_message(16),
        )
        .unwrap();

    // With the sink blocked, the generator gets only as far as the mailboxes allow.
    let read = || query.metrics().records_out("generator");
    let deadline = std::time::Instant::now() + TIMEOUT;
    let settled = loop {
        let before = read();
        std::thread::sleep(Duration::from_millis(200));
        let after = read();
        if before == after && after > 0 {
            break after;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the source never stopped reading"
        );
    };
    // Per partition: two lanes of 4 messages x 16 records, plus a batch in hand at
    // each of the three actors and in each output buffer.
    let bound = 2 * (2 * 4 * 16 + 5 * 16);
    assert!(
        settled <= bound,
        "{settled} records read, at most {bound} fit in flight"
    );
    let metrics = query.metrics();
    assert!(!metrics.mailboxes.is_empty());
    for mailbox in &metrics.mailboxes {
        assert!(mailbox.max_depth <= mailbox.capacity, "{mailbox:?}");
    }
    assert!(
        metrics.mailboxes.iter().any(|m| m.blocked > Duration::ZERO),
        "senders blocked on full mailboxes: {:?}",
        metrics.mailboxes
    );

    gate.open();
    assert_eq!(query.await_termination(Some(TIMEOUT)), Ok(true));
    let received = received.lock().unwrap();
    assert_eq!(
        received.len() as u64,
        2 * PER_PARTITION,
        "every record arrives exactly once"
    );
    let mut next: HashMap<usize, u64> = HashMap::new();
    for (partition, offset) in received.iter() {
        let expected = next.entry(*partition).or_insert(0);
        assert_eq!(
            offset, expected,
            "partition {partition} in order, none lost or repeated"
        );
        *expected += 1;
    }
}

#[test]
fn a_factory_that_does_not_return_fails_the_start_with_start_timeout() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let released = Arc::new((Mutex::new(false), Condvar::new()));
    let returned = Arc::new(AtomicBool::new(false));
    let input = MemorySource::new(1);
    input.push_all(0, [1u32, 2, 3]).unwrap();
    let out = MemorySink::new();
    let flow = Dataflow::new("stuck");
    let (factory_released, factory_returned) = (released.clone(), returned.clone());
    flow.source(input.clone())
        .try_transform("stuck", move |_| {
            let (lock, wake) = &*factory_released;
            let mut go = lock.lock().unwrap();
            while !*go {
                go = wake.wait(go).unwrap();
            }
            factory_returned.store(true, Ordering::SeqCst);
            Ok(rtflow::operators::Map(|x: u32| x))
        })
        .sink(out.clone());
    let config = config("stuck")
        .start_timeout(Duration::from_millis(200))
        .allowlist_check(false);
    let location = config.checkpoint_location.clone().unwrap();
    let error = flow.start(config).unwrap_err();
    assert_eq!(error.error_class(), "START_TIMEOUT", "{error}");
    assert!(
        error.to_string().contains("QueryConfig::start_timeout"),
        "{error}"
    );
    assert!(
        !returned.load(Ordering::SeqCst),
        "start returned while the factory still ran"
    );
    // Once the factory returns, nothing of the abandoned start runs.
    let (lock, wake) = &*released;
    *lock.lock().unwrap() = true;
    wake.notify_all();
    while !returned.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(out.len(), 0, "the records waiting were not read");
    assert!(!location.exists(), "nothing was checkpointed");
}
