//! Start-time validation: every check fails with its error class and a message
//! that says what to change, before any actor starts.

mod common;

use std::time::Duration;

use common::config;
use rtflow::prelude::*;
use rtflow::runtime::{Sink, SinkContext, SinkWriter, Source, SourceContext, SourceReader};

fn simple_flow() -> Dataflow {
    let flow = Dataflow::new("v");
    flow.source(MemorySource::<u32>::new(2))
        .map(|x| x + 1)
        .sink(MemorySink::new());
    flow
}

fn start_error(flow: Dataflow, config: QueryConfig) -> RtflowError {
    flow.start(config).expect_err("the query is rejected")
}

#[test]
fn output_mode_must_be_update() {
    for mode in [OutputMode::Append, OutputMode::Complete] {
        let error = start_error(simple_flow(), config("v").output_mode(mode));
        assert_eq!(
            error.error_class(),
            "STREAMING_REAL_TIME_MODE.OUTPUT_MODE_NOT_SUPPORTED"
        );
        assert!(error.to_string().contains("OutputMode::Update"), "{error}");
    }
}

#[test]
fn checkpoint_location_is_required() {
    let error = start_error(simple_flow(), QueryConfig::new("v"));
    assert_eq!(error.error_class(), "CHECKPOINT_LOCATION_REQUIRED");
    assert!(error.to_string().contains("checkpoint_location"), "{error}");
}

#[test]
fn trigger_interval_is_checked() {
    let cases = [
        (Trigger::real_time("1 second"), "at least 5000 ms"),
        (Trigger::real_time("1 month"), "month-based"),
        (Trigger::real_time(Duration::ZERO), "positive"),
        (Trigger::real_time("-30 seconds"), "positive"),
        (Trigger::real_time("soon"), "not a number"),
    ];
    for (trigger, says) in cases {
        let error = start_error(simple_flow(), config("v").trigger(trigger));
        assert_eq!(
            error.error_class(),
            "INVALID_STREAMING_REAL_TIME_MODE_TRIGGER_INTERVAL"
        );
        assert!(error.to_string().contains(says), "{error}");
    }
    let lowered = config("v")
        .trigger(Trigger::real_time("1 second"))
        .min_batch_duration(Duration::from_millis(1000));
    simple_flow().start(lowered).unwrap().stop().unwrap();
}

#[test]
fn custom_operators_and_sinks_are_outside_the_allowlist() {
    struct Identity;
    impl Operator<u32, u32> for Identity {
        fn process(
            &mut self,
            record: Record<u32>,
            out: &mut Collector<'_, u32>,
        ) -> rtflow::Result<()> {
            out.emit_record(record)
        }
    }
    let build = || {
        let flow = Dataflow::new("v");
        flow.source(MemorySource::<u32>::new(1))
            .transform("identity", |_| Identity)
            .sink(MemorySink::new());
        flow
    };
    let error = start_error(build(), config("v"));
    assert_eq!(
        error.error_class(),
        "STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST"
    );
    assert!(error.to_string().contains("'identity'"), "{error}");
    assert!(
        error.to_string().contains("allowlist_check(false)"),
        "{error}"
    );
    build()
        .start(config("v").allowlist_check(false))
        .unwrap()
        .stop()
        .unwrap();

    let flow = Dataflow::new("v");
    flow.source(MemorySource::<u32>::new(1))
        .sink(CustomSink { real_time: true });
    let error = start_error(flow, config("v"));
    assert_eq!(
        error.error_class(),
        "STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST"
    );
    assert!(error.to_string().contains("sink 'parquet'"), "{error}");
}

struct CustomSink {
    real_time: bool,
}

impl Sink<u32> for CustomSink {
    fn kind(&self) -> &str {
        "parquet"
    }

    fn supports_real_time(&self) -> bool {
        self.real_time
    }

    fn writer(&self, _ctx: &SinkContext) -> rtflow::Result<Box<dyn SinkWriter<u32>>> {
        unreachable!("never started")
    }
}

struct BatchOnlySource;

impl Source<u32> for BatchOnlySource {
    fn kind(&self) -> &str {
        "files"
    }

    fn partitions(&self) -> rtflow::Result<usize> {
        Ok(1)
    }

    fn supports_real_time(&self) -> bool {
        false
    }

    fn reader(&self, _ctx: &SourceContext) -> rtflow::Result<Box<dyn SourceReader<u32>>> {
        unreachable!("never started")
    }
}

#[test]
fn source_must_support_real_time() {
    let flow = Dataflow::new("v");
    flow.source(BatchOnlySource).sink(MemorySink::new());
    let error = start_error(flow, config("v"));
    assert_eq!(
        error.error_class(),
        "STREAMING_REAL_TIME_MODE.INPUT_STREAM_NOT_SUPPORTED"
    );
    assert!(error.to_string().contains("files-0"), "{error}");
}

#[test]
fn sink_must_support_real_time() {
    let flow = Dataflow::new("v");
    flow.source(MemorySource::<u32>::new(1))
        .sink(CustomSink { real_time: false });
    // Even with the allowlist off: a sink that cannot write per record never runs.
    let error = start_error(flow, config("v").allowlist_check(false));
    assert_eq!(
        error.error_class(),
        "STREAMING_REAL_TIME_MODE.SINK_NOT_SUPPORTED"
    );
}

#[test]
fn union_inputs_must_be_distinct_sources() {
    let flow = Dataflow::new("v");
    let numbers = flow.source(MemorySource::<u32>::new(1)).name("numbers");
    let doubled = numbers.map(|x| x * 2);
    numbers.union(&doubled).sink(MemorySink::new());
    let error = start_error(flow, config("v"));
    assert_eq!(
        error.error_class(),
        "STREAMING_REAL_TIME_MODE.IDENTICAL_SOURCES_IN_UNION_NOT_SUPPORTED"
    );
    assert!(error.to_string().contains("'numbers'"), "{error}");
    assert!(error.to_string().contains("separate source"), "{error}");

    let flow = Dataflow::new("v");
    let numbers = flow.source(MemorySource::<u32>::new(1));
    numbers.union(&numbers).sink(MemorySink::new());
    assert_eq!(
        start_error(flow, config("v")).error_class(),
        "STREAMING_REAL_TIME_MODE.IDENTICAL_SOURCES_IN_UNION_NOT_SUPPORTED"
    );
}

#[test]
fn no_shuffle_before_with_watermark() {
    let flow = Dataflow::new("v");
    flow.source(MemorySource::<i64>::new(1))
        .key_by(|x| *x)
        .map(|x| x)
        .with_watermark(|x| *x, Duration::from_secs(5))
        .sink(MemorySink::new());
    let error = start_error(flow, config("v"));
    assert_eq!(
        error.error_class(),
        "SHUFFLE_NOT_SUPPORTED_BEFORE_WATERMARK"
    );
}

#[test]
fn at_most_one_shuffle_in_front_of_a_stateful_operator() {
    let two_shuffles = Dataflow::new("v");
    two_shuffles
        .source(MemorySource::<i64>::new(2))
        .rebalance()
        .map(|x| x + 1)
        .key_by(|x| *x % 10)
        .count()
        .name("counts")
        .sink(MemorySink::new());
    let error = start_error(two_shuffles, config("v"));
    assert_eq!(error.error_class(), "MULTIPLE_SHUFFLES_NOT_SUPPORTED");
    assert!(error.to_string().contains("'counts'"), "{error}");

    // A watermark or a stateful operator in between starts the count again.
    let anchored = Dataflow::new("v");
    anchored
        .source(MemorySource::<i64>::new(2))
        .with_watermark(|x| *x, Duration::from_secs(1))
        .key_by(|x| *x % 10)
        .count()
        .key_by(|(_, count)| *count)
        .count()
        .sink(MemorySink::new());
    anchored
        .start(config("v"))
        .expect("one shuffle per stateful operator")
        .stop()
        .unwrap();
}

#[test]
fn task_slots_must_cover_every_actor() {
    // 4 source partitions, then a shuffle to 3 instances: 4 + 3 actors.
    let flow = Dataflow::new("v");
    flow.source(MemorySource::<u32>::new(4))
        .key_by(|x| *x)
        .map(|x| x)
        .sink(MemorySink::new());
    let error = start_error(flow, config("v").default_parallelism(3).task_slots(6));
    assert_eq!(error.error_class(), "INSUFFICIENT_TASK_SLOTS");
    let message = error.to_string();
    assert!(message.contains("needs 7 task slots"), "{message}");
    assert!(message.contains("only 6"), "{message}");
    assert!(message.contains("task_slots(7)"), "{message}");
}

#[test]
fn chaining_changes_how_many_slots_a_query_needs() {
    let build = || {
        let flow = Dataflow::new("v");
        flow.source(MemorySource::<u32>::new(2))
            .map(|x| x)
            .filter(|_| true)
            .sink(MemorySink::new());
        flow
    };
    // Chained: one actor per partition. Unchained: source, map, filter, sink each.
    build()
        .start(config("v").task_slots(2))
        .unwrap()
        .stop()
        .unwrap();
    let error = start_error(build(), config("v").task_slots(2).operator_chaining(false));
    assert!(error.to_string().contains("needs 8 task slots"), "{error}");
}

#[test]
fn dataflow_shape_errors() {
    let flow = Dataflow::new("v");
    let _ = flow.source(MemorySource::<u32>::new(1)).map(|x| x);
    let error = start_error(flow, config("v"));
    assert_eq!(error.error_class(), "INVALID_DATAFLOW");
    assert!(error.to_string().contains("no sink"), "{error}");

    let flow = Dataflow::new("v");
    let numbers = flow.source(MemorySource::<u32>::new(1));
    numbers.sink(MemorySink::new());
    let _ = numbers.map(|x| x).name("dangling");
    let error = start_error(flow, config("v"));
    assert!(
        error.to_string().contains("'dangling' is never used"),
        "{error}"
    );

    let flow = Dataflow::new("v");
    flow.source(MemorySource::<u32>::new(1))
        .map(|x| x)
        .parallelism(0)
        .sink(MemorySink::new());
    let error = start_error(flow, config("v"));
    assert!(
        error.to_string().contains("parallelism must be at least 1"),
        "{error}"
    );
}

#[test]
fn zero_sizes_are_invalid_configuration() {
    let error = start_error(simple_flow(), config("v").max_records_per_message(0));
    assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
    assert!(
        error.to_string().contains("max_records_per_message"),
        "{error}"
    );
}

#[test]
fn cpu_affinity_must_name_cpus_the_process_may_use() {
    let error = start_error(simple_flow(), config("v").cpu_affinity([]));
    assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
    assert!(error.to_string().contains("names no CPU"), "{error}");
    let error = start_error(simple_flow(), config("v").cpu_affinity([100_000]));
    assert_eq!(error.error_class(), "INVALID_CONFIGURATION");
    assert!(error.to_string().contains("CPU 100000"), "{error}");
}

#[test]
fn connector_input_errors_are_typed() {
    let source = MemorySource::<u32>::new(2);
    let error = source.push(2, 1).unwrap_err();
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(error.to_string().contains("has 2 partitions"), "{error}");
    source.end();
    assert!(source.push(0, 1).unwrap_err().to_string().contains("ended"));

    let flow = Dataflow::new("v");
    flow.source(GeneratorSource::new(|_, o| o).rows_per_second(0))
        .sink(MemorySink::new());
    let error = start_error(flow, config("v"));
    assert_eq!(error.error_class(), "SOURCE_FAILED");
    assert!(
        error
            .to_string()
            .contains("rows_per_second must be positive"),
        "{error}"
    );
}

#[test]
fn csv_table_errors_name_the_file_and_row() {
    #[derive(Debug, serde::Deserialize)]
    struct User {
        id: u32,
    }
    let missing = StaticTable::<u32, User>::from_csv("/nonexistent/users.csv", |u| u.id);
    let error = missing.err().expect("missing file");
    assert_eq!(error.error_class(), "STATIC_TABLE_INVALID");
    assert!(
        error.to_string().contains("/nonexistent/users.csv"),
        "{error}"
    );

    let path = std::env::temp_dir().join(format!("rtflow-bad-{}.csv", std::process::id()));
    std::fs::write(&path, "id\n1\nnot-a-number\n").unwrap();
    let error = StaticTable::<u32, User>::from_csv(&path, |u| u.id)
        .err()
        .expect("bad row");
    assert!(error.to_string().contains("line: 3"), "{error}");
}

/// A sink whose writers cannot be opened, as a sink whose system is down.
struct UnreachableSink;

impl Sink<u32> for UnreachableSink {
    fn kind(&self) -> &str {
        "memory"
    }

    fn allowlisted(&self) -> bool {
        true
    }

    fn writer(&self, ctx: &SinkContext) -> rtflow::Result<Box<dyn SinkWriter<u32>>> {
        Err(RtflowError::sink(&ctx.uid, "the service is unreachable"))
    }
}

#[test]
fn a_query_rejected_at_start_leaves_nothing_at_its_checkpoint_location() {
    type Build = fn(&Dataflow);
    type Configure = fn(QueryConfig) -> QueryConfig;
    let rejections: [(&str, Build, Configure); 4] = [
        (
            "STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST",
            |flow| {
                flow.source(MemorySource::<u32>::new(1))
                    .sink(CustomSink { real_time: true })
            },
            |config| config,
        ),
        (
            "INSUFFICIENT_TASK_SLOTS",
            |flow| {
                flow.source(MemorySource::<u32>::new(4))
                    .sink(MemorySink::new())
            },
            |config| config.task_slots(2),
        ),
        (
            "SINK_FAILED",
            |flow| {
                flow.source(MemorySource::<u32>::new(1))
                    .sink(UnreachableSink)
            },
            |config| config,
        ),
        (
            "INVALID_STREAMING_REAL_TIME_MODE_TRIGGER_INTERVAL",
            |flow| {
                flow.source(MemorySource::<u32>::new(1))
                    .sink(MemorySink::new())
            },
            |config| config.trigger(Trigger::real_time(Duration::from_millis(10))),
        ),
    ];
    for (class, build, configure) in rejections {
        let config = configure(config("rejected"));
        let location = config.checkpoint_location.clone().unwrap();
        let flow = Dataflow::new("rejected");
        build(&flow);
        assert_eq!(start_error(flow, config.clone()).error_class(), class);
        assert!(!location.exists(), "{class} created {location:?}");

        // An empty directory given by the user stays empty.
        std::fs::create_dir_all(&location).unwrap();
        let flow = Dataflow::new("rejected");
        build(&flow);
        assert_eq!(start_error(flow, config).error_class(), class);
        let left: Vec<_> = std::fs::read_dir(&location).unwrap().collect();
        assert!(left.is_empty(), "{class} wrote {left:?}");
        std::fs::remove_dir(&location).unwrap();
    }
}
