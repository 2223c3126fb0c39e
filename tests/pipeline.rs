//! Declarative pipelines: named sinks written by several update flows, each a
//! query with its own checkpoint, started, watched, stopped and restarted
//! through one handle, and the pipeline's task slots shared by its flows.

mod common;

use std::time::Duration;

use common::{sorted, TIMEOUT};
use rtflow::prelude::*;

/// A pipeline root of its own per test.
fn root(name: &str) -> std::path::PathBuf {
    let root = std::env::temp_dir()
        .join("rtflow-pipelines")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// Epochs every 100 ms, so stops and restarts are quick.
fn quick(config: QueryConfig) -> QueryConfig {
    config
        .trigger(Trigger::real_time("100 milliseconds"))
        .min_batch_duration(Duration::from_millis(100))
}

/// Orders and refunds (two flows) into one named sink, tagged by flow.
fn shop(
    root: &std::path::Path,
    orders: &MemorySource<u64>,
    refunds: &MemorySource<u64>,
    out: &MemorySink<(char, u64)>,
    slots: usize,
) -> Pipeline {
    let mut pipeline = Pipeline::new("shop")
        .checkpoint_root(root)
        .task_slots(slots);
    let sink = pipeline.create_sink("amounts", out.clone());
    let orders = orders.clone();
    pipeline.update_flow("orders", &sink, quick, move |flow: &Dataflow| {
        flow.source(orders).map(|amount| ('o', amount))
    });
    let refunds = refunds.clone();
    pipeline.update_flow("refunds", &sink, quick, move |flow: &Dataflow| {
        flow.source(refunds).map(|amount| ('r', amount))
    });
    pipeline
}

#[test]
fn flows_write_into_one_named_sink_and_restart_from_their_own_checkpoints() {
    let root = root("restart");
    let (orders, refunds) = (MemorySource::new(2), MemorySource::new(1));
    let out = MemorySink::new();
    let running = shop(&root, &orders, &refunds, &out, 8).start().unwrap();
    assert_eq!(running.flows().count(), 2);
    assert_eq!(
        running.task_slots_used(),
        3,
        "two order readers, one refund reader"
    );
    orders.push_all(0, [1, 2]).unwrap();
    orders.push_all(1, [3]).unwrap();
    refunds.push_all(0, [10]).unwrap();
    assert!(out.wait_for(4, TIMEOUT));
    for (_, query) in running.flows() {
        query.checkpoint_now(TIMEOUT).unwrap();
    }
    let progress = running.last_progress();
    let flows: Vec<_> = progress.iter().map(|(flow, _)| *flow).collect();
    assert_eq!(flows, ["orders", "refunds"]);
    assert!(progress.iter().all(|(_, p)| p.is_some()), "{progress:?}");
    running.stop().unwrap();
    assert!(!running.is_active());
    assert!(running.exceptions().is_empty());
    assert!(root.join("orders").exists() && root.join("refunds").exists());

    // Each flow resumes after what it committed: nothing read twice.
    let running = shop(&root, &orders, &refunds, &out, 8).start().unwrap();
    orders.push_all(1, [4]).unwrap();
    refunds.push_all(0, [20]).unwrap();
    assert!(out.wait_for(6, TIMEOUT));
    running.stop().unwrap();
    let mut rows = out.rows();
    rows.sort();
    assert_eq!(
        rows,
        [('o', 1), ('o', 2), ('o', 3), ('o', 4), ('r', 10), ('r', 20)]
    );
}

#[test]
fn flows_share_the_pipelines_task_slots_and_start_all_or_none() {
    let root = root("slots");
    let (orders, refunds) = (MemorySource::new(2), MemorySource::new(2));
    let out = MemorySink::new();
    // Records already wait: a flow that ran at all would write them.
    orders.push_all(0, [1, 2]).unwrap();
    refunds.push_all(1, [10]).unwrap();
    let Err(error) = shop(&root, &orders, &refunds, &out, 3).start() else {
        panic!("the flows need 4 slots and the pipeline has 3")
    };
    assert_eq!(error.error_class(), "INSUFFICIENT_TASK_SLOTS");
    let message = error.to_string();
    for part in [
        "pipeline 'shop' (flow 'orders' 2, flow 'refunds' 2) needs 4 task slots",
        "only 3 are available",
        "flow 'refunds' does not fit in the 1 left",
        "raise Pipeline::task_slots(4)",
    ] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(out.len(), 0, "no flow ran");
    assert!(!root.exists(), "no flow checkpointed");

    // With the slots they need, both start and read what waited.
    let running = shop(&root, &orders, &refunds, &out, 4).start().unwrap();
    assert!(out.wait_for(3, TIMEOUT));
    running.stop().unwrap();
    assert_eq!(sorted(&out), [('o', 1), ('o', 2), ('r', 10)]);
}

#[test]
fn a_flow_that_fails_to_start_keeps_every_flow_from_running() {
    struct Refused;
    impl Operator<u64, u64> for Refused {
        fn allowlisted() -> bool {
            true
        }
        fn process(&mut self, record: Record<u64>, out: &mut Collector<'_, u64>) -> Result<()> {
            out.emit(record.value)
        }
    }
    // The second flow's operator cannot be made, or its build closure panics.
    type Build = fn(&Dataflow, MemorySource<u64>) -> Stream<u64>;
    let refusing: Build = |flow, source| {
        flow.source(source)
            .try_transform("refused", |_| -> Result<Refused> {
                Err(RtflowError::InvalidConfiguration("no licence key".into()))
            })
    };
    let panicking: Build = |_, _| panic!("the topic list is empty");
    let cases: [(Build, &str, &[&str]); 2] = [
        (
            refusing,
            "INVALID_CONFIGURATION",
            &["no licence key", "operator 'refused-1', subtask 0"],
        ),
        (
            panicking,
            "INVALID_DATAFLOW",
            &["pipeline 'shop', flow 'refunds'", "the topic list is empty"],
        ),
    ];
    for (build, class, parts) in cases {
        let root = root("refused-flow");
        let (orders, refunds) = (MemorySource::new(2), MemorySource::new(1));
        orders.push_all(0, [1, 2]).unwrap();
        refunds.push_all(0, [10]).unwrap();
        let out = MemorySink::new();
        let mut pipeline = Pipeline::new("shop").checkpoint_root(&root);
        let sink = pipeline.create_sink("amounts", out.clone());
        let source = orders.clone();
        pipeline.update_flow("orders", &sink, quick, move |flow: &Dataflow| {
            flow.source(source)
        });
        let source = refunds.clone();
        pipeline.update_flow("refunds", &sink, quick, move |flow: &Dataflow| {
            build(flow, source)
        });
        let Err(error) = pipeline.start() else {
            panic!("the refunds flow cannot start")
        };
        assert_eq!(error.error_class(), class, "{error}");
        for part in parts {
            assert!(error.to_string().contains(part), "{part:?} in {error}");
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(out.len(), 0, "the orders flow did not run either");
        assert!(!root.exists(), "no flow checkpointed");
    }
}

#[test]
fn a_flow_into_a_sink_of_another_pipeline_or_a_second_flow_of_a_name_is_refused() {
    let root = root("refused");
    let mut other = Pipeline::new("other");
    let foreign = other.create_sink("elsewhere", MemorySink::<u64>::new());
    let mut pipeline = Pipeline::new("shop").checkpoint_root(&root);
    let sink = pipeline.create_sink("amounts", MemorySink::<u64>::new());
    let orders = MemorySource::<u64>::new(1);
    let source = orders.clone();
    pipeline.update_flow("orders", &sink, quick, move |flow: &Dataflow| {
        flow.source(source)
    });
    let source = orders.clone();
    pipeline.update_flow("orders", &foreign, quick, move |flow: &Dataflow| {
        flow.source(source)
    });
    let Err(error) = pipeline.start() else {
        panic!("misbuilt pipelines do not start")
    };
    assert_eq!(error.error_class(), "INVALID_DATAFLOW");
    assert!(
        error.to_string().contains("two flows named 'orders'"),
        "{error}"
    );
    assert!(!root.exists(), "nothing started, nothing written");
}

#[test]
fn a_pipeline_needs_a_checkpoint_root_and_its_own_sinks() {
    let mut pipeline = Pipeline::new("rootless");
    let sink = pipeline.create_sink("amounts", MemorySink::<u64>::new());
    let orders = MemorySource::<u64>::new(1);
    pipeline.update_flow("orders", &sink, quick, move |flow: &Dataflow| {
        flow.source(orders)
    });
    let Err(error) = pipeline.start() else {
        panic!("a pipeline without a root has nowhere to checkpoint")
    };
    assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_REQUIRED");

    let root = root("foreign");
    let mut other = Pipeline::new("other");
    let foreign = other.create_sink("elsewhere", MemorySink::<u64>::new());
    let mut pipeline = Pipeline::new("shop").checkpoint_root(&root);
    let orders = MemorySource::<u64>::new(1);
    pipeline.update_flow("orders", &foreign, quick, move |flow: &Dataflow| {
        flow.source(orders)
    });
    let Err(error) = pipeline.start() else {
        panic!("a flow into another pipeline's sink is refused")
    };
    assert_eq!(error.error_class(), "INVALID_DATAFLOW");
    assert!(
        error
            .to_string()
            .contains("sink 'elsewhere', which this pipeline did not create"),
        "{error}"
    );
    assert!(!root.exists());
}
