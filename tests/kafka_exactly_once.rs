//! The exactly-once Kafka sink against a real broker: each epoch's output is one
//! transaction committed with the epoch's checkpoint, read_committed consumers see
//! every record once, across restarts.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::kafka::{
    bootstrap, compacted_topic, consume, consume_to_end, expected_key_counts, keyed_records,
    produce, topic,
};
use common::{
    a_record_the_broker_refuses_fails, a_record_too_large_fails, config, copy_dir, TIMEOUT,
};
use rtflow::prelude::*;

/// Epochs end every 200 ms.
fn checkpointed(name: &str) -> QueryConfig {
    config(name)
        .trigger(Trigger::real_time("200 milliseconds"))
        .min_batch_duration(Duration::from_millis(200))
}

/// Kafka -> count per key -> Kafka, exactly once.
fn start(bootstrap: &str, input: &str, output: &str, config: QueryConfig) -> StreamingQuery {
    start_with(bootstrap, input, output, config, |sink| sink)
}

/// As [`start`], with the sink's settings changed by `tune`.
fn start_with(
    bootstrap: &str,
    input: &str,
    output: &str,
    config: QueryConfig,
    tune: impl FnOnce(KafkaSink<(String, u64)>) -> KafkaSink<(String, u64)>,
) -> StreamingQuery {
    let flow = Dataflow::new("exactly-once");
    let sink = KafkaSink::new(bootstrap, output, |(key, count): &(String, u64)| {
        KafkaMessage::new(format!("{key}:{count}")).key(key.clone())
    })
    .delivery(DeliveryGuarantee::ExactlyOnce);
    flow.source(
        KafkaSource::new(bootstrap)
            .subscribe([input])
            .starting_offsets(StartingOffsets::Earliest),
    )
    .map(|record: KafkaRecord| record.key_str().into_owned())
    .key_by(|key: &String| key.clone())
    .count()
    .sink(tune(sink));
    flow.start(config).unwrap()
}

/// The error that fails the start of a query whose exactly-once sink to
/// `output`, with the settings `tune` changes, cannot open.
fn start_error(
    bootstrap: &str,
    output: &str,
    config: QueryConfig,
    tune: impl FnOnce(KafkaSink<u64>) -> KafkaSink<u64>,
) -> RtflowError {
    let flow = Dataflow::new(config.name.clone());
    let sink = KafkaSink::new(bootstrap, output, |n: &u64| {
        KafkaMessage::new(n.to_string())
    })
    .delivery(DeliveryGuarantee::ExactlyOnce);
    flow.source(MemorySource::<u64>::new(1)).sink(tune(sink));
    flow.start(config).unwrap_err()
}

/// Output values counted by how often each appeared.
fn multiset(bootstrap: &str, output: &str, expected: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    // Wait for what is expected, then a little longer: duplicates would show.
    consume(bootstrap, output, 1, expected, TIMEOUT);
    std::thread::sleep(Duration::from_millis(500));
    for record in consume(bootstrap, output, 1, expected + 1, Duration::from_secs(2)) {
        *seen
            .entry(String::from_utf8_lossy(&record.value).into_owned())
            .or_insert(0) += 1;
    }
    seen
}

#[test]
fn every_count_is_committed_exactly_once_across_a_restart() {
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-eos-in", 3);
    let output = topic(&bootstrap, "rtflow-eos-out", 1);
    let config = checkpointed("exactly-once");
    produce(&bootstrap, &input, keyed_records(0, 1500));

    let query = start(&bootstrap, &input, &output, config.clone());
    assert_eq!(
        multiset(&bootstrap, &output, 1500),
        expected_key_counts(1500)
    );
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
    // The writers record their commits in a topic of the query's own.
    let commits = consume_to_end(
        &bootstrap,
        &format!("rtflow-commits-{}", query.id()),
        TIMEOUT,
    );
    let writers: std::collections::BTreeSet<_> = commits.iter().map(|r| r.key.clone()).collect();
    let prefix = format!("rtflow-{}-kafka-sink-0-", query.id());
    assert!(
        !writers.is_empty() && writers.iter().all(|w| w.starts_with(&prefix)),
        "{writers:?}"
    );

    produce(&bootstrap, &input, keyed_records(1500, 1800));
    let query = start(&bootstrap, &input, &output, config);
    assert_eq!(
        multiset(&bootstrap, &output, 1800),
        expected_key_counts(1800)
    );
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
}

#[test]
fn an_unreachable_broker_fails_the_exactly_once_sink_at_start_within_seconds() {
    if bootstrap().is_none() {
        return;
    }
    let started = std::time::Instant::now();
    let error = start_error(
        "127.0.0.1:1",
        "anything",
        checkpointed("exactly-once-unreachable"),
        |sink| sink.flush_timeout(Duration::from_secs(2)),
    );
    assert_eq!(error.error_class(), "SINK_FAILED");
    assert!(
        error
            .to_string()
            .contains("check that the broker is running"),
        "{error}"
    );
    assert!(
        started.elapsed() < TIMEOUT,
        "no hang: {:?}",
        started.elapsed()
    );
}

/// An epoch's transaction stays open for a batch duration and more: a batch
/// duration whose transactions would outlast what the broker allows fails at
/// start, with the way out, instead of every epoch being aborted later.
#[test]
fn a_batch_duration_longer_than_the_broker_lets_a_transaction_last_fails_at_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let output = topic(&bootstrap, "rtflow-eos-long-out", 1);
    let error = start_error(
        &bootstrap,
        &output,
        config("exactly-once-long").trigger(Trigger::real_time("20 minutes")),
        |sink| sink,
    );
    assert_eq!(error.error_class(), "SINK_FAILED");
    let message = error.to_string();
    assert!(
        message.contains("transaction.max.timeout.ms") && message.contains("2430000 ms"),
        "the error names the broker's limit and the timeout asked for: {message}"
    );
}

/// A transaction the broker aborted for lasting longer than
/// `transaction.timeout.ms` fails the query with an error that names that
/// setting, not only a fencing (the client reports both alike), and loses
/// nothing: the restart publishes every count once.
#[test]
fn a_transaction_the_broker_timed_out_fails_the_query_with_the_setting_named() {
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-eos-timeout-in", 3);
    let output = topic(&bootstrap, "rtflow-eos-timeout-out", 1);
    produce(&bootstrap, &input, keyed_records(0, 30));
    let tune = |sink: KafkaSink<(String, u64)>| sink.option("kafka.transaction.timeout.ms", 1000);
    let config = config("exactly-once-timeout");
    let query = start_with(
        &bootstrap,
        &input,
        &output,
        config.clone().trigger(Trigger::real_time("20 seconds")),
        tune,
    );
    let error = query
        .await_termination(Some(Duration::from_secs(60)))
        .unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED");
    let message = error.to_string();
    assert!(
        message.contains("transaction.timeout.ms (1000 ms)"),
        "the error names the setting: {message}"
    );

    let query = start(
        &bootstrap,
        &input,
        &output,
        config
            .trigger(Trigger::real_time("200 milliseconds"))
            .min_batch_duration(Duration::from_millis(200)),
    );
    assert_eq!(multiset(&bootstrap, &output, 30), expected_key_counts(30));
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
}

/// A commit topic whose retention deletes records would lose the commit
/// records a restart looks up: the start fails and says so.
#[test]
fn a_commit_topic_that_deletes_old_records_fails_at_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let output = topic(&bootstrap, "rtflow-eos-retention-out", 1);
    // A plain topic: cleanup.policy=delete.
    let commits = topic(&bootstrap, "rtflow-eos-retention-commits", 1);
    let error = start_error(
        &bootstrap,
        &output,
        checkpointed("exactly-once-retention"),
        |sink| sink.commit_topic(commits.clone()),
    );
    assert_eq!(error.error_class(), "SINK_FAILED");
    let message = error.to_string();
    assert!(
        message.contains(&commits) && message.contains("cleanup.policy=delete"),
        "the error names the topic and its policy: {message}"
    );
}

/// The sink creates its commit topic at start; a name the broker refuses
/// fails the start as the sink's error, naming the topic.
#[test]
fn a_commit_topic_the_broker_refuses_fails_the_sink_at_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let output = topic(&bootstrap, "rtflow-eos-bad-commits-out", 1);
    let error = start_error(
        &bootstrap,
        &output,
        checkpointed("exactly-once-bad-commits"),
        |sink| sink.commit_topic("no spaces allowed"),
    );
    assert_eq!(error.error_class(), "SINK_FAILED");
    assert!(
        error.to_string().contains("'no spaces allowed'"),
        "the error names the topic: {error}"
    );
}

/// A producer that takes over the writer's transactional id (as the writer's
/// restarted incarnation would) fences it: the fenced writer fails the query
/// rather than commit anything more.
#[test]
fn a_fenced_writer_fails_the_query() {
    use rdkafka::producer::{BaseProducer, Producer};
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-eos-fenced-in", 3);
    let output = topic(&bootstrap, "rtflow-eos-fenced-out", 1);
    produce(&bootstrap, &input, keyed_records(0, 30));
    let query = start(
        &bootstrap,
        &input,
        &output,
        checkpointed("exactly-once-fenced"),
    );
    consume(&bootstrap, &output, 1, 1, TIMEOUT);
    let successor: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set(
            "transactional.id",
            format!("rtflow-{}-kafka-sink-0-0", query.id()),
        )
        .create()
        .unwrap();
    successor.init_transactions(TIMEOUT).unwrap();
    produce(&bootstrap, &input, keyed_records(30, 60));
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    assert_eq!(error.error_class(), "SINK_FAILED");
    assert!(
        error.to_string().contains("fenced it"),
        "the error says the writer was fenced: {error}"
    );
}

/// A barrier does not wait for the broker to take an epoch's records: a
/// record the broker refuses fails the epoch's commit, and the query fails
/// with the refusal, not with a commit that merely did not go through.
#[test]
fn a_record_too_large_for_the_broker_fails_the_exactly_once_query_naming_it() {
    let Some(bootstrap) = bootstrap() else { return };
    a_record_too_large_fails(
        &bootstrap,
        checkpointed("exactly-once-large"),
        DeliveryGuarantee::ExactlyOnce,
    );
}

#[test]
fn a_record_the_broker_refuses_fails_the_exactly_once_query_with_its_delivery_error() {
    let Some(bootstrap) = bootstrap() else { return };
    a_record_the_broker_refuses_fails(
        &bootstrap,
        checkpointed("exactly-once-refused"),
        DeliveryGuarantee::ExactlyOnce,
    );
}

/// A producer that holds a transaction open on `commits`, as a writer killed
/// while committing does until it restarts or its transaction times out.
fn open_transaction_on(bootstrap: &str, commits: &str) -> rdkafka::producer::BaseProducer {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let zombie: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", format!("{commits}-zombie"))
        .create()
        .unwrap();
    zombie.init_transactions(TIMEOUT).unwrap();
    zombie.begin_transaction().unwrap();
    zombie
        .send(BaseRecord::to(commits).key("zombie").payload("1"))
        .unwrap();
    zombie.flush(TIMEOUT).unwrap();
    zombie
}

/// Runs the count over `input` (records `0..30`) until its sink took all 30,
/// then stops it. The stop ends one epoch whose output is still pending in the
/// checkpoint (the manifest is written before the transaction commits), so a
/// restart must look its commit record up on the commit topic.
fn run_one_epoch(
    bootstrap: &str,
    input: &str,
    output: &str,
    config: &QueryConfig,
    tune: impl FnOnce(KafkaSink<(String, u64)>) -> KafkaSink<(String, u64)>,
) {
    produce(bootstrap, input, keyed_records(0, 30));
    let query = start_with(bootstrap, input, output, config.clone(), tune);
    wait_until_sink_took(&query, 30);
    query.stop().unwrap();
    assert_eq!(query.exception(), None);
    assert_eq!(multiset(bootstrap, output, 30), expected_key_counts(30));
}

/// One epoch per run: it ends when the query stops.
fn one_epoch_per_run(name: &str) -> QueryConfig {
    config(name).trigger(Trigger::real_time("5 minutes"))
}

/// A transaction left open on the commit topic hides from `read_committed`
/// readers every commit record written after it began (their end is the last
/// stable offset). The restart reads to the high watermark, so it waits for
/// that transaction to end and then sees that the restored epoch committed:
/// it does not write that output again.
#[test]
fn a_restart_waits_for_a_transaction_left_open_on_the_commit_topic() {
    use rdkafka::producer::Producer;
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-eos-held-in", 3);
    let output = topic(&bootstrap, "rtflow-eos-held-out", 1);
    let commits = compacted_topic(&bootstrap, "rtflow-eos-held-commits");
    let config = one_epoch_per_run("exactly-once-held");
    let tune = |sink: KafkaSink<(String, u64)>| sink.commit_topic(commits.clone());
    // Open before the first run commits, so its commit record comes after.
    let zombie = open_transaction_on(&bootstrap, &commits);
    run_one_epoch(&bootstrap, &input, &output, &config, tune);

    produce(&bootstrap, &input, keyed_records(30, 60));
    let query = start_with(&bootstrap, &input, &output, config, tune);
    // The restart looks the commit record up at its first record, well within
    // this second, so it reads while the transaction is still open.
    let ends = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        zombie.abort_transaction(TIMEOUT).unwrap();
    });
    wait_until_sink_took(&query, 30);
    query.stop().unwrap();
    ends.join().unwrap();
    assert_eq!(query.exception(), None);
    assert_eq!(multiset(&bootstrap, &output, 60), expected_key_counts(60));
}

/// When the open transaction outlasts the sink's flush timeout, the restart
/// fails with an error that says why, rather than guess whether the restored
/// epoch committed.
#[test]
fn a_transaction_open_on_the_commit_topic_past_the_timeout_fails_the_restart() {
    use rdkafka::producer::Producer;
    let Some(bootstrap) = bootstrap() else { return };
    let input = topic(&bootstrap, "rtflow-eos-stuck-in", 3);
    let output = topic(&bootstrap, "rtflow-eos-stuck-out", 1);
    let commits = compacted_topic(&bootstrap, "rtflow-eos-stuck-commits");
    let config = one_epoch_per_run("exactly-once-stuck");
    let tune = |sink: KafkaSink<(String, u64)>| {
        sink.commit_topic(commits.clone())
            .flush_timeout(Duration::from_secs(3))
    };
    let zombie = open_transaction_on(&bootstrap, &commits);
    run_one_epoch(&bootstrap, &input, &output, &config, tune);

    produce(&bootstrap, &input, keyed_records(30, 60));
    let query = start_with(&bootstrap, &input, &output, config, tune);
    let error = query.await_termination(Some(TIMEOUT)).unwrap_err();
    zombie.abort_transaction(TIMEOUT).unwrap();
    assert_eq!(error.error_class(), "SINK_FAILED");
    let message = error.to_string();
    assert!(
        message.contains(&commits) && message.contains("open transaction"),
        "the error names the commit topic and the cause: {message}"
    );
    assert_eq!(multiset(&bootstrap, &output, 30), expected_key_counts(30));
}

/// Waits until the query's sinks have taken in `count` records.
fn wait_until_sink_took(query: &StreamingQuery, count: u64) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    while sink_records(query) < count {
        assert!(
            std::time::Instant::now() < deadline,
            "the sink got {count} records: {:?}",
            query.exception()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Records the query's sinks have taken in.
fn sink_records(query: &StreamingQuery) -> u64 {
    query
        .metrics()
        .operators
        .iter()
        .filter(|operator| operator.role == rtflow::runtime::metrics::Role::Sink)
        .map(|operator| operator.records_in)
        .sum()
}

/// A checkpoint written by the writer of 2026-12-04 holds its epoch's output
/// whole (tests/fixtures/exactly-once-pending-2026-12-04 says how it was
/// made). The writer of today restores it, writes that output once, with a
/// commit record, and a restart does not write it again. The sink commits to a
/// topic of this test's own, so no commit record from the run that wrote the
/// checkpoint is found, as after a crash before the commit.
#[test]
fn output_an_earlier_version_checkpointed_whole_is_written_once_after_an_upgrade() {
    let Some(bootstrap) = bootstrap() else { return };
    let output = topic(&bootstrap, "rtflow-eos-upgrade-out", 1);
    let commits = compacted_topic(&bootstrap, "rtflow-eos-upgrade-commits");
    let config = config("exactly-once-upgrade").trigger(Trigger::real_time("5 minutes"));
    let location = config.checkpoint_location.clone().unwrap();
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/exactly-once-pending-2026-12-04"),
        &location,
    );
    for _ in 0..2 {
        let flow = Dataflow::new("exactly-once-upgrade");
        flow.source(
            GeneratorSource::new(|partition: usize, offset: u64| format!("{partition}-{offset}"))
                .partitions(2)
                .rows_per_partition(20),
        )
        .sink(
            KafkaSink::new(&bootstrap, &output, |row: &String| {
                KafkaMessage::new(row.clone()).key(row.clone())
            })
            .delivery(DeliveryGuarantee::ExactlyOnce)
            .commit_topic(commits.clone()),
        );
        let query = flow.start(config.clone()).unwrap();
        assert!(query.await_termination(Some(TIMEOUT)).unwrap());
        assert_eq!(query.exception(), None);
    }
    let expected: BTreeMap<String, usize> = (0..2)
        .flat_map(|partition| (0..20).map(move |offset| (format!("{partition}-{offset}"), 1)))
        .collect();
    assert_eq!(multiset(&bootstrap, &output, 40), expected);
}
