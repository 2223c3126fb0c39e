//! Checkpoints: barriers every batch duration, durable manifests of source
//! offsets, and restarts that resume from the last committed checkpoint.

mod common;

use std::time::Duration;

use common::{checkpointed, config, TIMEOUT};
use rtflow::checkpoint::CheckpointStore;
use rtflow::prelude::*;
use rtflow::runtime::connector::Offsets;
use rtflow::runtime::StreamingQueryProgress;
use rtflow::runtime::{Source, SourceContext, SourceOutput, SourceReader, SourceStatus};

/// Starts memory source -> map -> memory sink on `config`.
fn start(input: &MemorySource<u32>, config: QueryConfig) -> (StreamingQuery, MemorySink<u32>) {
    let flow = Dataflow::new("resumable");
    let out = MemorySink::new();
    flow.source(input.clone())
        .name("numbers")
        .map(|x| x)
        .sink(out.clone());
    (flow.start(config).unwrap(), out)
}

/// Waits for a checkpoint committed after `offset` records of partition 0.
fn wait_for_checkpoint_at(query: &StreamingQuery, offset: i64) -> StreamingQueryProgress {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let committed = query.recent_progress().into_iter().find(|p| {
            p.sources[0]
                .end_offset
                .as_ref()
                .is_some_and(|end| end.get("0") == Some(&offset))
        });
        if let Some(progress) = committed {
            return progress;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint at offset {offset}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_restart_resumes_after_the_last_committed_offsets() {
    let input = MemorySource::new(1);
    let config = checkpointed("resume");
    let (query, first) = start(&input, config.clone());
    input.push_all(0, 0..100).unwrap();
    assert!(first.wait_for(100, TIMEOUT));
    let progress = wait_for_checkpoint_at(&query, 100);
    assert!(progress.batch_id >= 1);
    assert!(progress.sources[0].start_offset.is_some());
    let (id, run_id) = (query.id(), query.run_id());
    query.stop().unwrap();
    drop(query);

    let (query, second) = start(&input, config);
    assert_eq!(query.id(), id, "the query id persists across restarts");
    assert_ne!(query.run_id(), run_id, "each start is a new run");
    input.push_all(0, 100..150).unwrap();
    assert!(second.wait_for(50, TIMEOUT));
    std::thread::sleep(Duration::from_millis(200));
    query.stop().unwrap();
    assert_eq!(
        second.rows(),
        (100..150).collect::<Vec<_>>(),
        "nothing committed is read again"
    );
}

#[test]
fn epochs_advance_while_records_keep_flowing() {
    let flow = Dataflow::new("epochs");
    let out = MemorySink::new();
    flow.source(
        GeneratorSource::new(|_, offset| offset)
            .partitions(2)
            .rows_per_second(2_000),
    )
    .map(|x| x)
    .sink(out.clone());
    let query = flow.start(checkpointed("epochs")).unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while query.last_progress().map_or(0, |p| p.batch_id) < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "epochs do not advance"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    query.stop().unwrap();
    let commits: Vec<_> = query
        .recent_progress()
        .into_iter()
        .filter(|p| p.sources[0].end_offset.is_some())
        .collect();
    assert!(commits.len() >= 3);
    assert!(commits
        .iter()
        .all(|p| p.duration_ms.contains_key("checkpoint")));
    let stats = query.metrics().checkpoint.expect("checkpoint statistics");
    assert_eq!(stats.epoch, commits.last().unwrap().batch_id);
    assert!(stats.bytes > 0);
    for pair in commits.windows(2) {
        assert_eq!(
            pair[1].batch_id,
            pair[0].batch_id + 1,
            "one commit per epoch, in order"
        );
        assert_eq!(
            pair[1].sources[0].start_offset,
            pair[0].sources[0].end_offset
        );
    }
}

/// A source whose reader, with nothing to read, parks far longer than the
/// `max_wait` it is given (and than [`TIMEOUT`]): only the runtime's wake-up
/// ends its wait in time.
struct Parking;

struct ParkingReader;

impl Source<u32> for Parking {
    fn kind(&self) -> &str {
        "parking"
    }

    fn partitions(&self) -> rtflow::Result<usize> {
        Ok(1)
    }

    fn reader(&self, _ctx: &SourceContext) -> rtflow::Result<Box<dyn SourceReader<u32>>> {
        Ok(Box::new(ParkingReader))
    }
}

impl SourceReader<u32> for ParkingReader {
    fn poll(&mut self, _out: &mut SourceOutput<u32>, _max_wait: Duration) -> Result<SourceStatus> {
        std::thread::park_timeout(4 * TIMEOUT);
        Ok(SourceStatus::Active)
    }

    fn offsets(&self) -> Offsets {
        Offsets::new()
    }
}

#[test]
fn a_source_parked_in_its_reader_is_woken_for_a_barrier_and_for_stop() {
    let flow = Dataflow::new("parked");
    flow.source(Parking).map(|x| x).sink(MemorySink::new());
    let query = flow.start(config("parked")).unwrap();
    let first = query.checkpoint_now(TIMEOUT).unwrap();
    let second = query.checkpoint_now(TIMEOUT).unwrap();
    assert!(second > first);
    let (stopped, stop) = std::sync::mpsc::channel();
    std::thread::spawn(move || stopped.send(query.stop()));
    assert_eq!(stop.recv_timeout(TIMEOUT), Ok(Ok(())), "stop returns");
}

#[test]
fn a_corrupt_manifest_is_never_restored() {
    let input = MemorySource::new(1);
    let config = checkpointed("corrupt").checkpoints_retained(100);
    let location = config.checkpoint_location.clone().unwrap();
    let (query, _) = start(&input, config.clone());
    input.push_all(0, 0..10).unwrap();
    let at_ten = wait_for_checkpoint_at(&query, 10).batch_id;
    input.push_all(0, 10..20).unwrap();
    wait_for_checkpoint_at(&query, 20);
    query.stop().unwrap();
    drop(query);

    // Tear every manifest committed after offset 10: the restart must pass over
    // them and replay from offset 10.
    let store = CheckpointStore::open(&location, 100).unwrap();
    let torn: Vec<_> = store
        .epochs()
        .unwrap()
        .into_iter()
        .filter(|e| *e > at_ten)
        .collect();
    for epoch in &torn {
        store.overwrite_manifest(*epoch, b"torn").unwrap();
    }
    drop(store);
    let (query, replayed) = start(&input, config.clone());
    assert!(replayed.wait_for(10, TIMEOUT));
    query.stop().unwrap();
    assert_eq!(replayed.rows(), (10..20).collect::<Vec<_>>());
    drop(query);
    // The torn checkpoints are gone, and their epochs were not used again: a
    // transactional sink's commit record may name them.
    let store = CheckpointStore::open(&location, 100).unwrap();
    let epochs = store.epochs().unwrap();
    let newest_torn = *torn.last().expect("checkpoints after offset 10");
    assert!(
        epochs.iter().all(|e| *e <= at_ten || *e > newest_torn),
        "torn {torn:?}, stored now {epochs:?}"
    );
    assert!(epochs.last() > Some(&newest_torn), "{epochs:?}");
    drop(store);

    let store = CheckpointStore::open(&location, 100).unwrap();
    for epoch in store.epochs().unwrap() {
        store.overwrite_manifest(epoch, b"torn").unwrap();
    }
    drop(store);
    let flow = Dataflow::new("corrupt");
    flow.source(input.clone()).sink(MemorySink::new());
    let error = flow.start(config).unwrap_err();
    assert_eq!(error.error_class(), "CHECKPOINT_FAILED");
    assert!(error.to_string().contains("none is intact"), "{error}");
}

#[test]
fn an_unusable_checkpoint_location_fails_at_start() {
    let file = std::env::temp_dir().join(format!("rtflow-not-a-dir-{}", std::process::id()));
    std::fs::write(&file, "a file").unwrap();
    let flow = Dataflow::new("unusable");
    flow.source(MemorySource::<u32>::new(1))
        .sink(MemorySink::new());
    let error = flow
        .start(config("unusable").checkpoint_location(&file))
        .unwrap_err();
    assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_UNUSABLE");

    // One location, one running query.
    let shared = config("shared");
    let input = MemorySource::new(1);
    let (query, _) = start(&input, shared.clone());
    let flow = Dataflow::new("second");
    flow.source(input.clone()).sink(MemorySink::new());
    let error = flow.start(shared).unwrap_err();
    assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_UNUSABLE");
    assert!(
        error.to_string().contains("no other running query"),
        "{error}"
    );
    query.stop().unwrap();
}

#[test]
fn a_memory_source_shorter_than_the_checkpoint_fails_at_start() {
    let input = MemorySource::new(1);
    let config = checkpointed("shorter");
    let (query, out) = start(&input, config.clone());
    input.push_all(0, 0..5).unwrap();
    assert!(out.wait_for(5, TIMEOUT));
    query.stop().unwrap();
    drop(query);

    let flow = Dataflow::new("resumable");
    flow.source(MemorySource::<u32>::new(1))
        .name("numbers")
        .map(|x| x)
        .sink(MemorySink::new());
    let Err(error) = flow.start(config) else {
        panic!("a fresh source cannot resume after offset 5")
    };
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(error.to_string().contains("resumes after 5"), "{error}");
}
