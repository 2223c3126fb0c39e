//! A broker stopped and restarted mid-stream: the query either resumes with every
//! record delivered, in order, or fails with the broker's error; it never drops
//! records silently. A test binary of its own, since it stops the shared broker.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::config;
use common::kafka::{bootstrap, consume, produce, topic};
use rtflow::prelude::*;

fn kafka_script(args: &[&str], port: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .env("RTFLOW_KAFKA_PORT", port)
        // A loaded machine can take a while to reload the broker's logs.
        .env("RTFLOW_KAFKA_START_TIMEOUT", "180")
        .status()
        .expect("scripts/kafka.sh runs");
    assert!(status.success(), "scripts/kafka.sh {args:?} failed");
}

fn batch(partitions: i32, sequences: std::ops::Range<usize>) -> Vec<(i32, String, Vec<u8>)> {
    sequences
        .flat_map(|s| {
            (0..partitions).map(move |p| (p, String::new(), format!("{p}:{s}").into_bytes()))
        })
        .collect()
}

/// How many of the 3 x 400 `partition:sequence` values written `read`
/// lacks, and the first of them.
fn missing(read: &[common::kafka::Read]) -> String {
    let seen: std::collections::HashSet<String> = read
        .iter()
        .map(|r| String::from_utf8_lossy(&r.value).into_owned())
        .collect();
    let lacking: Vec<String> = batch(3, 0..400)
        .into_iter()
        .map(|(_, _, value)| String::from_utf8(value).unwrap())
        .filter(|value| !seen.contains(value))
        .collect();
    let first: Vec<&String> = lacking.iter().take(20).collect();
    format!("{} of them, first {first:?}", lacking.len())
}

#[test]
fn a_broker_restart_mid_stream_loses_nothing() {
    let Some(bootstrap) = bootstrap() else { return };
    let port = bootstrap.rsplit(':').next().unwrap().to_owned();
    let input = topic(&bootstrap, "rtflow-restart-in", 3);
    let output = topic(&bootstrap, "rtflow-restart-out", 3);

    let flow = Dataflow::new("restart");
    flow.source(
        KafkaSource::new(&bootstrap)
            .subscribe([&input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .sink(KafkaSink::new(
        &bootstrap,
        &output,
        |record: &KafkaRecord| {
            KafkaMessage::new(record.value.clone().unwrap_or_default()).partition(record.partition)
        },
    ));
    let query = flow.start(config("restart")).unwrap();

    produce(&bootstrap, &input, batch(3, 0..200));
    kafka_script(&["stop"], &port);
    std::thread::sleep(Duration::from_secs(2));
    kafka_script(&["start"], &port);
    produce(&bootstrap, &input, batch(3, 200..400));

    // A broker that kept the whole suite's topics can take a minute or
    // more after its restart before every partition has a leader again.
    let read = consume(&bootstrap, &output, 3, 1200, Duration::from_secs(180));
    let failure = query.exception();
    let records_read = query.metrics().records_read();
    query.stop().unwrap();
    if let Some(error) = failure {
        // Failing loudly with the broker's error is an allowed outcome.
        eprintln!("the query failed with the broker's error: {error}");
        assert!(
            matches!(error.error_class(), "SOURCE_FAILED" | "SINK_FAILED"),
            "{error}"
        );
        return;
    }
    assert_eq!(
        read.len(),
        1200,
        "the query is running, so every record must arrive; it read {records_read}, \
         and the output lacks {}",
        missing(&read)
    );
    let mut next: HashMap<i32, usize> = HashMap::new();
    for record in &read {
        let sequence = next.entry(record.partition).or_insert(0);
        let expected = format!("{}:{sequence}", record.partition);
        assert_eq!(
            String::from_utf8_lossy(&record.value),
            expected,
            "in order, none lost or repeated"
        );
        *sequence += 1;
    }
}
