//! Throughput of one `KafkaCluster` query run by 1, 2 and 3 OS processes on
//! this machine, beside the floor Kafka itself sets in the same run.
//!
//! * **kafka**: `--records` (default 2,000,000) small records are produced
//!   over the 6 partitions of a fresh topic; one plain read_committed
//!   consumer reads them all, and a transactional copy (one consumer, one
//!   transactional producer committing every 300 ms, the query's trigger
//!   interval) writes them to another topic. Records/s of each; the copy
//!   both to its last commit and, as rtflow's output is, to the last of its
//!   records a read_committed consumer reads back beside it (`read back`).
//! * **rtflow**: for each count of `--processes` (default `1,2,3`), the same
//!   input goes to a fresh topic, then that many child processes start the
//!   query `source -> map -> with_watermark -> repartition_by(key) -> count ->
//!   KafkaSink` under distinct instance names (keys dealt over `--keys`,
//!   default 1,000). The count emits one update per input record, so a
//!   read_committed consumer reads the output until it holds `--records`
//!   distinct `key:count` updates (any read twice, which exactly-once output
//!   never has, are reported as `duplicates`). Records/s is `--records` over
//!   the wall time from spawning the processes to the last output record.
//!   Also reported: the time to the first run in any process (process start,
//!   group join, restore), to the first output record (the first transaction
//!   committed), the rate from the first run on (which still pays for the
//!   rebalances as the other processes join), the runs the processes started
//!   together, and how long they took to stop once told to.
//!
//! Runs interleave the process counts, so that a slow spell of the machine
//! spreads over all of them; median and range of `--runs` (default 3). Two
//! million records take about 15 s a run here: 300,000 (the earlier
//! default) were too short to tell changes of under 30% from the noise.
//! Every figure is one JSON line on stdout; the command and a summary table
//! go to stderr, and each run's own figures to stderr as it ends, with the
//! directory `$TMPDIR/rtflow-bench-cluster/<query>` that keeps the logs of
//! its processes (warnings; `RUST_LOG` sets the level), shown when a run
//! fails.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster_throughput
//! cargo bench --bench cluster_throughput -- --bootstrap 127.0.0.1:9092 --records 2000000 \
//!     --runs 3 --processes 1,2,3 --keys 1000
//! ```

#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/transactions.rs"]
mod transactions;

use std::time::{Duration, Instant};

use clap::Parser;
use cluster::*;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;

#[derive(Parser)]
#[command(about = "Throughput of a KafkaCluster query in 1, 2, 3 processes beside Kafka's own")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Input records of each run.
    #[arg(long, default_value_t = 2_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    records: u64,
    /// How many processes run the query, one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3",
          value_parser = clap::value_parser!(u64).range(1..))]
    processes: Vec<u64>,
    /// Distinct keys of the input.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    keys: u64,
}

fn main() -> BenchResult<()> {
    main_of(|args: Args| {
        let processes: Vec<String> = args.processes.iter().map(u64::to_string).collect();
        eprintln!(
            "command: cargo bench --bench cluster_throughput -- --bootstrap {} --records {} \
             --runs {} --processes {} --keys {}",
            args.common.bootstrap,
            args.records,
            args.common.runs,
            processes.join(","),
            args.keys,
        );
        throughput(&args)
    })
}

/// Record `i`'s key in a throughput input.
fn throughput_key(keys: u64) -> impl Fn(u64) -> String {
    move |i| format!("k{}", i % keys)
}

/// One Kafka-only run: produce, read, and copy transactionally.
struct KafkaRun {
    produce: Duration,
    read: Duration,
    copy: Duration,
    /// The copy's start -> its last record read back, read_committed.
    copy_read_back: Duration,
}

fn kafka_run(args: &Args) -> BenchResult<KafkaRun> {
    let topics = Topics::create(&args.common.bootstrap, "kafka")?;
    let produce = produce(
        &args.common.bootstrap,
        &topics.input,
        args.records,
        throughput_key(args.keys),
    )?;

    let started = Instant::now();
    let consumer = reader(&args.common.bootstrap, &topics.input)?;
    let mut read = 0;
    while read < args.records {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            message?;
            read += 1;
        }
        if started.elapsed() > RUN_TIMEOUT {
            return Err(format!("read {read} of {} records", args.records).into());
        }
    }
    let read = started.elapsed();

    let started = Instant::now();
    // Read back as the query's output is: the copy ends for its readers when
    // they have read its last record.
    let read_back = {
        let (bootstrap, output, records) = (
            args.common.bootstrap.clone(),
            topics.output.clone(),
            args.records,
        );
        std::thread::spawn(move || -> Result<Duration, String> {
            let mut tally = Tally::new(&bootstrap, &output, records).map_err(|e| e.to_string())?;
            while !tally.is_complete() {
                tally.poll(&output);
                if started.elapsed() > RUN_TIMEOUT {
                    return Err(format!("the copy's output was not all read back: {output}"));
                }
            }
            Ok(started.elapsed())
        })
    };
    let consumer = reader(&args.common.bootstrap, &topics.input)?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.common.bootstrap)
        .set("transactional.id", &topics.query)
        .set("linger.ms", "5")
        .create()?;
    producer.init_transactions(KAFKA_TIMEOUT)?;
    producer.begin_transaction()?;
    let mut committed = Instant::now();
    let mut copied = 0;
    while copied < args.records {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message?;
            let mut record =
                BaseRecord::<[u8], [u8]>::to(&topics.output).partition(message.partition());
            if let Some(key) = message.key() {
                record = record.key(key);
            }
            if let Some(payload) = message.payload() {
                record = record.payload(payload);
            }
            while let Err((error, back)) = producer.send(record) {
                if error != KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull) {
                    return Err(format!("could not copy: {error}").into());
                }
                producer.poll(Duration::from_millis(5));
                record = back;
            }
            copied += 1;
        }
        producer.poll(Duration::ZERO);
        if committed.elapsed() >= COMMIT_INTERVAL {
            transactions::commit_transaction(&producer, KAFKA_TIMEOUT)?;
            producer.begin_transaction()?;
            committed = Instant::now();
        }
        if started.elapsed() > RUN_TIMEOUT {
            return Err(format!("copied {copied} of {} records", args.records).into());
        }
    }
    transactions::commit_transaction(&producer, KAFKA_TIMEOUT)?;
    let copy = started.elapsed();
    let copy_read_back = read_back.join().map_err(|_| "the read-back panicked")??;
    topics.delete(&args.common.bootstrap)?;
    Ok(KafkaRun {
        produce,
        read,
        copy,
        copy_read_back,
    })
}

/// One run of the query by `n` processes.
struct ClusterRun {
    output: Output,
    /// Stop file -> every process exited.
    stop: Duration,
    /// Runs the processes started, together.
    runs: u64,
}

fn cluster_run(args: &Args, n: u64) -> BenchResult<ClusterRun> {
    let topics = Topics::create(&args.common.bootstrap, &format!("{n}p"))?;
    produce(
        &args.common.bootstrap,
        &topics.input,
        args.records,
        throughput_key(args.keys),
    )?;
    let mut processes = Processes::new(&args.common.bootstrap, &topics)?;
    let spawned = Instant::now();
    for p in 0..n {
        processes.spawn(&format!("p{p}"))?;
    }
    let output = await_output(
        &args.common.bootstrap,
        &topics.output,
        args.records,
        spawned,
        &mut processes,
    )?;
    let runs = (0..n)
        .map(|p| processes.status(&format!("p{p}")).runs)
        .sum();
    let stop = processes.stop()?;
    topics.delete(&args.common.bootstrap)?;
    eprintln!(
        "{n} process(es): first run {:.2} s, first output {:.2} s, last output {:.2} s, \
         {runs} runs, {} duplicates; logs in {}",
        output.first_run.as_secs_f64(),
        output.first.as_secs_f64(),
        output.last.as_secs_f64(),
        output.duplicates,
        processes.dir.display()
    );
    Ok(ClusterRun { output, stop, runs })
}

/// Kafka's own figures, then the query's.
fn throughput(args: &Args) -> BenchResult<Vec<String>> {
    let mut summary = Vec::new();
    let kafka = (0..args.common.runs)
        .map(|_| kafka_run(args))
        .collect::<BenchResult<Vec<_>>>()?;
    let [produced, read, copied, read_back] = [
        |r: &KafkaRun| r.produce,
        |r: &KafkaRun| r.read,
        |r: &KafkaRun| r.copy,
        |r: &KafkaRun| r.copy_read_back,
    ]
    .map(|time| Spread::of(kafka.iter().map(|r| rate(args.records, time(r)))));
    println!(
        "{{\"bench\":\"cluster_throughput\",\"pipeline\":\"kafka\",\"records\":{},\"partitions\":{PARTITIONS},\
         \"runs\":{},{},{},{},{}}}",
        args.records,
        args.common.runs,
        produced.json("produce_records_per_s", 0),
        read.json("read_records_per_s", 0),
        copied.json("transactional_copy_records_per_s", 0),
        read_back.json("transactional_copy_read_back_records_per_s", 0),
    );
    summary.push(format!(
        "{} records of {PARTITIONS} partitions, {} keys; median (range) of {} runs",
        args.records, args.keys, args.common.runs
    ));
    summary.push(format!(
        "{:<28}{:>30}{:>22}{:>22}{:>30}",
        "pipeline", "records/s", "first run s", "first output s", "records/s from first run"
    ));
    summary.push(format!("{:<28}{:>30}", "kafka produce", produced.text(0)));
    summary.push(format!("{:<28}{:>30}", "kafka read", read.text(0)));
    summary.push(format!(
        "{:<28}{:>30}",
        "kafka transactional copy",
        copied.text(0)
    ));
    summary.push(format!("{:<28}{:>30}", "  read back", read_back.text(0)));

    // Interleaved: see the module doc.
    let mut runs: Vec<Vec<ClusterRun>> = args.processes.iter().map(|_| Vec::new()).collect();
    for _ in 0..args.common.runs {
        for (n, runs) in args.processes.iter().zip(&mut runs) {
            runs.push(cluster_run(args, *n)?);
        }
    }
    for (n, runs) in args.processes.iter().zip(&runs) {
        let outputs = || runs.iter().map(|r| &r.output);
        let throughput = Spread::of(outputs().map(|o| rate(args.records, o.last)));
        let running = Spread::of(outputs().map(|o| rate(args.records, o.last - o.first_run)));
        let first_run = Spread::of(outputs().map(|o| o.first_run.as_secs_f64()));
        let first = Spread::of(outputs().map(|o| o.first.as_secs_f64()));
        let wall = Spread::of(outputs().map(|o| o.last.as_secs_f64()));
        let stop = Spread::of(runs.iter().map(|r| r.stop.as_secs_f64()));
        let process_runs = Spread::of(runs.iter().map(|r| r.runs as f64));
        let duplicates: u64 = outputs().map(|o| o.duplicates).sum();
        println!(
            "{{\"bench\":\"cluster_throughput\",\"pipeline\":\"rtflow\",\"processes\":{n},\"records\":{},\
             \"keys\":{},\"partitions\":{PARTITIONS},\"runs\":{},{},{},{},{},{},{},{},\
             \"duplicates\":{duplicates}}}",
            args.records,
            args.keys,
            args.common.runs,
            throughput.json("records_per_s", 0),
            first_run.json("first_run_s", 3),
            first.json("first_output_s", 3),
            running.json("running_records_per_s", 0),
            wall.json("wall_s", 3),
            stop.json("stop_s", 3),
            process_runs.json("process_runs", 0),
        );
        summary.push(format!(
            "{:<28}{:>30}{:>22}{:>22}{:>30}",
            format!("rtflow, {n} process{}", if *n == 1 { "" } else { "es" }),
            throughput.text(0),
            first_run.text(2),
            first.text(2),
            running.text(0)
        ));
    }
    Ok(summary)
}
