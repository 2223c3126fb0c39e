//! Kafka -> rtflow -> Kafka end-to-end latency, in the shape of Databricks'
//! real-time mode latency benchmark.
//!
//! A producer thread writes `--record-bytes` (default 1,200) byte records at a
//! fixed `--rate` (default 10,000 records/s in total) round-robin over the
//! `--partitions` (default 4) partitions of a fresh input topic for `--seconds`
//! (default 20); each record carries its production wall-clock time in
//! microseconds in the `produced-us` header. The query reads the input (one reader
//! per partition), uppercases the payload and writes it with the header to the same
//! partition of a fresh output topic. A consumer thread reads the output and
//! records, for every record produced after a 2 s warm-up, the read time minus
//! `produced-us`: the latency a downstream application sees.
//!
//! At each rate of `--rates` (default 1,000, 10,000, 30,000 and 50,000
//! records/s; `--rate N` for one) it measures the pipelines of `--pipelines`
//! (default all six), one after the other:
//!
//! * `kafka`: the same producer and consumer on one topic with nothing in
//!   between (one hop: the floor the broker and the machine set);
//! * `relay`: a hand-written rdkafka relay that consumes the input and
//!   produces each record to the same partition of the output, key, value and
//!   headers as read (two hops: the floor for any consume -> produce engine);
//! * `rtflow`: the pipeline above, at least once;
//! * `relay-eo`: the relay made exactly once, as by hand: a transactional
//!   producer commits what it relayed with the consumer's offsets every
//!   `--batch-ms` (default 300): the floor for exactly-once output;
//! * `rtflow-eo`: the pipeline with an exactly-once `KafkaSink`, batch
//!   duration `--batch-ms`;
//! * `rtflow-cluster`: the pipeline run by `KafkaCluster` in one process,
//!   whose checkpoints commit as one Kafka transaction each, batch duration
//!   `--batch-ms`.
//!
//! The consumer reads `read_committed` (librdkafka's default), so the
//! exactly-once pipelines' latency is the delay until their output is
//! visible. Each run prints one JSON line to stdout (latency in ms; for
//! rtflow in one process also its processing latency, read -> handed to the
//! producer, and its source queuing latency, Kafka timestamp -> read, from
//! `query.metrics()`; for the relay its own source queuing, sampled one
//! record in 16), and the CPU this process's threads (by name) and the
//! local broker used while the records measured were produced, in percent of
//! a core (`common/cpu.rs`); the command, a summary table, each rtflow pipeline's
//! ratio to its floor (`relay`, or `relay-eo` for the exactly-once ones) at
//! p50, p99 and p99.9 per rate, the exactly-once p99s beside their target
//! (the batch duration plus the relay's p99), and the highest rate each
//! pipeline sustained (every record out within the drain, p99 under 1 s, the
//! last quarter's median latency within twice the first's) go to stderr.
//!
//! `--producer-profile` (a comma list; default `smooth`) sets how the
//! bench's producer batches, and every rate is measured under each:
//!
//! * `smooth`: `linger.ms=0` with one request in flight per connection: it
//!   sends at once when the broker has answered, and batches what came
//!   meanwhile, so the input arrives evenly paced;
//! * `bursty`: `linger.ms=1` with 5 requests in flight, as a producer tuned
//!   for latency sends: a batch per partition every millisecond or so;
//! * `default`: librdkafka's defaults, `linger.ms=5` with a million requests
//!   in flight (Java's: `linger.ms=5`, 5 in flight): 5 ms of records per
//!   partition at a time.
//!
//! Every client of the bench disables Nagle's algorithm. The consumer uses
//! `fetch.wait.max.ms=5`.
//!
//! `--source-option`, `--sink-option`, `--producer-option`, `--consumer-option`
//! and `--relay-option KEY=VALUE` (repeatable) set librdkafka settings of the
//! KafkaSource, the KafkaSink, the bench's producer (over its profile's), its
//! consumer, and the relay's consumer and producer (both). The relay reads as rtflow's source
//! does (`fetch.wait.max.ms=5`) and produces with the settings that measured
//! best for it (`linger.ms=1`, 5 requests in flight: lower p99 than rtflow's
//! sink's one request in flight; docs/performance.md).
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench kafka_latency
//! cargo bench --bench kafka_latency -- --bootstrap 127.0.0.1:9092 --rates 1000,10000 \
//!     --partitions 4 --seconds 20 --record-bytes 1200
//! cargo bench --bench kafka_latency -- --rate 1000 --partitions 1 \
//!     --sink-option statistics.interval.ms=1000
//! cargo bench --bench kafka_latency -- --rates 1000,10000 --batch-ms 300 \
//!     --pipelines relay,relay-eo,rtflow-eo,rtflow-cluster
//! cargo bench --bench kafka_latency -- --rates 1000,10000,30000,50000 \
//!     --pipelines relay,rtflow --producer-profile smooth,bursty,default
//! ```
//!
//! The broker is `--bootstrap`, else `$RTFLOW_KAFKA_BOOTSTRAP`, else 127.0.0.1:9092.
//! `RUST_LOG` (e.g. `rtflow_runtime::coordinator=debug`) prints rtflow's logs to stderr.

#[path = "common/cpu.rs"]
mod cpu;
#[path = "common/latency.rs"]
mod latency;
#[path = "common/transactions.rs"]
mod transactions;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use rtflow::prelude::*;
use rtflow::LatencyReport;

use latency::{consume, forward, median_ms, now_us, quantile_ms, Load, PRODUCED_US};

/// Records produced in the first seconds are not measured: connections, fetch
/// sessions and caches are still warming up.
const WARM_UP: Duration = Duration::from_secs(2);
/// The relay reads the clock for one record in this many: its source queuing
/// without a system call per record.
const QUEUING_SAMPLE: u64 = 16;
/// How long the consumer waits for the last records once the producer is done.
const DRAIN: Duration = Duration::from_secs(10);

type BenchResult<T> = std::result::Result<T, BoxError>;

#[derive(Clone, clap::Parser)]
#[command(
    about = "Kafka -> rtflow -> Kafka latency, beside the floors that hand-written relays set"
)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value_t = default_bootstrap())]
    bootstrap: String,
    /// Records per second over all partitions, one measurement each.
    #[arg(long, alias = "rate", value_delimiter = ',',
          default_values_t = [1_000, 10_000, 30_000, 50_000],
          value_parser = clap::value_parser!(u64).range(1..))]
    rates: Vec<u64>,
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    partitions: u64,
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    #[arg(long, default_value_t = 1_200, value_parser = clap::value_parser!(u64).range(1..))]
    record_bytes: u64,
    /// The exactly-once pipelines' batch duration (the query's trigger, the
    /// relay's commit interval), in milliseconds.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    batch_ms: u64,
    /// rtflow's readers of the input (`KafkaSource::max_partitions`); 0, the
    /// default, runs one per partition.
    #[arg(long, default_value_t = 0)]
    readers: u64,
    /// What runs at each rate, in this order.
    #[arg(long, value_delimiter = ',', default_values = Pipeline::ALL.map(Pipeline::name),
          value_parser = |name: &str| Pipeline::named(name).ok_or("an unknown pipeline"))]
    pipelines: Vec<Pipeline>,
    /// How the bench's producer batches, one measurement of every rate each:
    /// smooth, bursty or default.
    #[arg(long = "producer-profile", alias = "producer-profiles", value_delimiter = ',',
          default_value = "smooth",
          value_parser = |name: &str| Profile::named(name).ok_or("smooth, bursty or default"))]
    profiles: Vec<Profile>,
    /// A librdkafka setting (`key=value`, repeatable) for rtflow's source.
    #[arg(long = "source-option", value_parser = key_value)]
    source_options: Vec<(String, String)>,
    /// ... for rtflow's sink.
    #[arg(long = "sink-option", value_parser = key_value)]
    sink_options: Vec<(String, String)>,
    /// ... for the bench's producer.
    #[arg(long = "producer-option", value_parser = key_value)]
    producer_options: Vec<(String, String)>,
    /// ... for the bench's consumer.
    #[arg(long = "consumer-option", value_parser = key_value)]
    consumer_options: Vec<(String, String)>,
    /// ... for the relays' clients.
    #[arg(long = "relay-option", value_parser = key_value)]
    relay_options: Vec<(String, String)>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn default_bootstrap() -> String {
    std::env::var("RTFLOW_KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// A librdkafka setting, `key=value`.
fn key_value(option: &str) -> std::result::Result<(String, String), &'static str> {
    let (key, value) = option.split_once('=').ok_or("a librdkafka key=value")?;
    Ok((key.to_owned(), value.to_owned()))
}

/// input -> uppercase -> output, on `flow`; the sink commits exactly once
/// per batch if `exactly_once` (in a cluster it always does).
fn build(flow: &Dataflow, args: &Args, input: &str, output: &str, exactly_once: bool) {
    let mut source = KafkaSource::new(&args.bootstrap)
        .subscribe([input])
        .starting_offsets(StartingOffsets::Earliest);
    if args.readers > 0 {
        source = source.max_partitions(args.readers as usize);
    }
    for (key, value) in &args.source_options {
        source = source.option(&format!("kafka.{key}"), value);
    }
    let mut sink = KafkaSink::new(
        &args.bootstrap,
        output,
        |(partition, value, produced): &(i32, String, Option<bytes::Bytes>)| {
            let message = KafkaMessage::new(value.clone()).partition(*partition);
            match produced {
                Some(stamp) => message.header(PRODUCED_US, stamp.clone()),
                None => message,
            }
        },
    );
    if exactly_once {
        sink = sink.delivery(DeliveryGuarantee::ExactlyOnce);
    }
    for (key, value) in &args.sink_options {
        sink = sink.option(&format!("kafka.{key}"), value);
    }
    flow.source(source)
        .map(|record: KafkaRecord| {
            let value = record.value_str().to_ascii_uppercase();
            (record.partition, value, record.header(PRODUCED_US).cloned())
        })
        .sink(sink);
}

/// A running rtflow pipeline.
enum Query {
    Single(StreamingQuery),
    Cluster(ClusteredQuery),
}

impl Query {
    /// Stops it; rtflow's own latency figures, where it keeps them.
    fn stop(self) -> BenchResult<Option<LatencyReport>> {
        match self {
            Query::Single(query) => {
                query.stop()?;
                Ok(Some(query.metrics().latency))
            }
            Query::Cluster(query) => {
                query.stop()?;
                Ok(None)
            }
        }
    }
}

/// Starts `pipeline`'s rtflow query, and returns once it runs. An
/// at-least-once query checkpoints rarely: its batch duration sets no latency.
fn start(
    args: &Args,
    pipeline: Pipeline,
    input: &str,
    output: &str,
    checkpoints: &Path,
) -> BenchResult<Query> {
    let batch = Duration::from_millis(args.batch_ms);
    // Below real-time mode's default minimum (5 s), which guards against
    // checkpointing too often by mistake, not for a latency measurement.
    let config = |name: &str, batch: Duration| {
        QueryConfig::new(name)
            .trigger(Trigger::real_time(format!(
                "{} milliseconds",
                batch.as_millis()
            )))
            .min_batch_duration(batch.min(Duration::from_secs(5)))
    };
    match pipeline {
        Pipeline::Rtflow | Pipeline::RtflowExactlyOnce => {
            let exactly_once = pipeline == Pipeline::RtflowExactlyOnce;
            let flow = Dataflow::new("kafka-latency");
            build(&flow, args, input, output, exactly_once);
            let batch = if exactly_once {
                batch
            } else {
                Duration::from_secs(30)
            };
            Ok(Query::Single(flow.start(
                config("kafka-latency", batch).checkpoint_location(checkpoints),
            )?))
        }
        Pipeline::RtflowCluster => {
            let (input, output, options) = (input.to_owned(), output.to_owned(), args.clone());
            let query = KafkaCluster::new(&args.bootstrap).instance("bench").start(
                config(&format!("kafka-latency-{}", now_us()), batch),
                move |flow: &Dataflow| {
                    build(flow, &options, &input, &output, true);
                    Ok(())
                },
            )?;
            let started = Instant::now();
            while query.runs() == 0 {
                if !query.is_active() || started.elapsed() > Duration::from_secs(60) {
                    query.stop()?;
                    return Err("the clustered query did not start its run within 60 s".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(Query::Cluster(query))
        }
        Pipeline::Kafka | Pipeline::Relay | Pipeline::RelayExactlyOnce => {
            unreachable!("{} is no rtflow query", pipeline.name())
        }
    }
}

/// Relays `input` to `output` until `stop`: each record to the same partition,
/// with the key, value and headers it was read with. One thread polls the
/// consumer and serves the producer, as a minimal hand-written relay does.
///
/// Returns the source queuing (Kafka timestamp to read, µs) of every
/// `QUEUING_SAMPLE`th record stamped from `measure_from_us` on (the relay
/// starts with the producer, so the first records wait for its first fetch),
/// measured as rtflow's source measures its own.
fn relay(
    args: &Args,
    input: &str,
    output: &str,
    stop: &AtomicBool,
    measure_from_us: u64,
) -> BenchResult<Vec<u64>> {
    let (consumer, producer) = relay_clients(
        args,
        input,
        &[("group.id", "rtflow-bench-relay".to_owned())],
        &[],
    )?;
    let mut queuing = Vec::new();
    let mut read = 0u64;
    while !stop.load(Ordering::Acquire) {
        producer.poll(Duration::ZERO);
        let Some(message) = consumer.poll(Duration::from_millis(1)) else {
            continue;
        };
        let message = message?;
        read += 1;
        if read.is_multiple_of(QUEUING_SAMPLE) {
            match message.timestamp().to_millis() {
                Some(ms) if ms as u64 * 1000 >= measure_from_us => {
                    queuing.push(now_us().saturating_sub(ms as u64 * 1000));
                }
                _ => {}
            }
        }
        forward(&producer, &message, output, message.partition())?;
    }
    producer.flush(Duration::from_secs(30))?;
    Ok(queuing)
}

/// A relay's consumer of every partition of `input` from the beginning, and
/// its producer: the settings both relays use, then `consumer` and
/// `producer`, then `--relay-option`s.
fn relay_clients(
    args: &Args,
    input: &str,
    consumer: &[(&str, String)],
    producer: &[(&str, String)],
) -> BenchResult<(BaseConsumer, BaseProducer)> {
    let config = |base: &[(&str, &str)], extra: &[(&str, String)]| {
        let mut config = ClientConfig::new();
        for (key, value) in base {
            config.set(*key, *value);
        }
        for (key, value) in extra {
            config.set(*key, value);
        }
        config
            .set("bootstrap.servers", &args.bootstrap)
            .set("socket.nagle.disable", "true");
        for (key, value) in &args.relay_options {
            config.set(key, value);
        }
        config
    };
    let consumer: BaseConsumer = config(
        &[
            ("enable.auto.commit", "false"),
            ("enable.partition.eof", "false"),
            ("fetch.wait.max.ms", "5"),
        ],
        consumer,
    )
    .create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..args.partitions as i32 {
        assignment.add_partition_offset(input, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let producer: BaseProducer = config(
        &[
            ("linger.ms", "1"),
            ("max.in.flight.requests.per.connection", "5"),
        ],
        producer,
    )
    .create()?;
    Ok((consumer, producer))
}

/// Relays `input` to `output` as [`relay`] does, exactly once: a
/// transactional producer commits what it relayed, with the consumer's
/// offsets, every `--batch-ms`, as a hand-written exactly-once relay does (and
/// as Kafka Streams does with `processing.guarantee=exactly_once_v2`).
fn relay_exactly_once(
    args: &Args,
    input: &str,
    output: &str,
    stop: &AtomicBool,
) -> BenchResult<()> {
    let (consumer, producer) = relay_clients(
        args,
        input,
        &[
            ("group.id", format!("rtflow-bench-relay-{}", now_us())),
            ("isolation.level", "read_committed".to_owned()),
        ],
        &[(
            "transactional.id",
            format!("rtflow-bench-relay-{}", now_us()),
        )],
    )?;
    let timeout = Duration::from_secs(30);
    producer.init_transactions(timeout)?;
    producer.begin_transaction()?;
    let batch = Duration::from_millis(args.batch_ms);
    let mut committed = Instant::now();
    let mut next = TopicPartitionList::new();
    while !stop.load(Ordering::Acquire) {
        producer.poll(Duration::ZERO);
        if committed.elapsed() >= batch {
            if next.count() > 0 {
                producer.send_offsets_to_transaction(
                    &next,
                    &consumer
                        .group_metadata()
                        .ok_or("the relay's consumer has no group")?,
                    timeout,
                )?;
            }
            transactions::commit_transaction(&producer, timeout)?;
            producer.begin_transaction()?;
            committed = Instant::now();
        }
        let Some(message) = consumer.poll(Duration::from_millis(1)) else {
            continue;
        };
        let message = message?;
        next.add_partition_offset(
            input,
            message.partition(),
            Offset::Offset(message.offset() + 1),
        )?;
        forward(&producer, &message, output, message.partition())?;
    }
    transactions::commit_transaction(&producer, timeout)?;
    Ok(())
}

/// How the bench's producer batches its input: what the readers see arrive.
#[derive(Clone, Copy, PartialEq)]
enum Profile {
    /// `linger.ms=0`, one request in flight: sent when the broker has
    /// answered, so the input arrives evenly paced.
    Smooth,
    /// `linger.ms=1`, 5 requests in flight: a batch per partition every
    /// millisecond or so, as a producer tuned for latency sends.
    Bursty,
    /// librdkafka's defaults (`linger.ms=5`, a million requests in flight),
    /// close to Java's (`linger.ms=5`, 5 in flight): 5 ms of records per
    /// partition at a time.
    Default,
}

impl Profile {
    const ALL: [Profile; 3] = [Profile::Smooth, Profile::Bursty, Profile::Default];

    fn name(self) -> &'static str {
        match self {
            Profile::Smooth => "smooth",
            Profile::Bursty => "bursty",
            Profile::Default => "default",
        }
    }

    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The producer's settings, before any `--producer-option`.
    fn options(self) -> [(&'static str, &'static str); 2] {
        let (linger, in_flight) = match self {
            Profile::Smooth => ("0", "1"),
            Profile::Bursty => ("1", "5"),
            Profile::Default => ("5", "1000000"),
        };
        [
            ("linger.ms", linger),
            ("max.in.flight.requests.per.connection", in_flight),
        ]
    }
}

/// What a run measures.
#[derive(Clone, Copy, PartialEq)]
enum Pipeline {
    /// Producer -> topic -> consumer: Kafka alone.
    Kafka,
    /// Producer -> input -> hand-written rdkafka relay -> output -> consumer.
    Relay,
    /// Producer -> input -> rtflow (uppercase) -> output -> consumer.
    Rtflow,
    /// The relay, committing a transaction every batch duration.
    RelayExactlyOnce,
    /// rtflow with an exactly-once sink, committing every batch duration.
    RtflowExactlyOnce,
    /// rtflow clustered (`KafkaCluster`, one process): every checkpoint one
    /// Kafka transaction of the process.
    RtflowCluster,
}

impl Pipeline {
    const ALL: [Pipeline; 6] = [
        Pipeline::Kafka,
        Pipeline::Relay,
        Pipeline::Rtflow,
        Pipeline::RelayExactlyOnce,
        Pipeline::RtflowExactlyOnce,
        Pipeline::RtflowCluster,
    ];

    fn name(self) -> &'static str {
        match self {
            Pipeline::Kafka => "kafka",
            Pipeline::Relay => "relay",
            Pipeline::Rtflow => "rtflow",
            Pipeline::RelayExactlyOnce => "relay-eo",
            Pipeline::RtflowExactlyOnce => "rtflow-eo",
            Pipeline::RtflowCluster => "rtflow-cluster",
        }
    }

    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    fn is_rtflow(self) -> bool {
        matches!(
            self,
            Pipeline::Rtflow | Pipeline::RtflowExactlyOnce | Pipeline::RtflowCluster
        )
    }

    /// The hand-written pipeline this one is measured against.
    fn floor(self) -> Option<Pipeline> {
        match self {
            Pipeline::Rtflow => Some(Pipeline::Relay),
            Pipeline::RtflowExactlyOnce | Pipeline::RtflowCluster => {
                Some(Pipeline::RelayExactlyOnce)
            }
            Pipeline::Kafka | Pipeline::Relay | Pipeline::RelayExactlyOnce => None,
        }
    }
}

struct Run {
    pipeline: Pipeline,
    profile: Profile,
    rate: u64,
    produced: u64,
    received: u64,
    /// Sorted, microseconds; never empty.
    latencies: Vec<u64>,
    /// The median latency (ms) of the first and of the last quarter of the
    /// records measured, in the order they arrived: a pipeline falling behind
    /// shows a last quarter far slower than the first.
    quarters: (f64, f64),
    /// rtflow's own figures (rtflow runs in one process only).
    rtflow: Option<LatencyReport>,
    /// The at-least-once relay's source queuing, sorted, microseconds (a
    /// sample; empty for the other pipelines).
    relay_queuing: Vec<u64>,
    /// The CPU used while the records measured were produced.
    cpu: cpu::Usage,
}

impl Run {
    /// The relay's source queuing p50 and p99 in milliseconds, if sampled.
    fn relay_queuing(&self) -> Option<[f64; 2]> {
        let sorted = &self.relay_queuing;
        (!sorted.is_empty()).then(|| [quantile_ms(sorted, 0.5), quantile_ms(sorted, 0.99)])
    }

    /// The `q` quantile of the latencies in milliseconds.
    fn ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latencies, q)
    }

    fn percentiles(&self) -> [f64; 6] {
        [0.50, 0.90, 0.95, 0.99, 0.999, 1.0].map(|q| self.ms(q))
    }

    /// Whether the pipeline kept up: every record out within the drain, p99
    /// under a second, and its lag not growing (the last quarter's median
    /// within twice the first's, or 50 ms of it).
    fn sustained(&self) -> bool {
        let (first, last) = self.quarters;
        let growing = last > (2.0 * first).max(first + 50.0);
        self.received >= self.produced && self.ms(0.99) < 1_000.0 && !growing
    }
}

/// One run on fresh topics, deleted afterwards.
fn run(args: &Args, profile: Profile, rate: u64, pipeline: Pipeline) -> BenchResult<Run> {
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    let id = format!("{}-{}", std::process::id(), now_us());
    let input = format!("rtflow-latency-in-{id}");
    let checkpoints = std::env::temp_dir().join(format!("rtflow-bench-kafka-latency-{id}"));
    admin.create_topic(&input, args.partitions as i32)?;
    let output = match pipeline {
        Pipeline::Kafka => input.clone(),
        _ => {
            let output = format!("rtflow-latency-out-{id}");
            admin.create_topic(&output, args.partitions as i32)?;
            output
        }
    };
    let query = if pipeline.is_rtflow() {
        // A topic just created can take a moment to show in the metadata.
        let mut attempts = 0;
        Some(loop {
            match start(args, pipeline, &input, &output, &checkpoints) {
                Err(error) if attempts < 20 && error.to_string().contains("does not exist") => {
                    attempts += 1;
                    std::thread::sleep(Duration::from_millis(250));
                }
                started => break started?,
            }
        })
    } else {
        None
    };
    let measure_from_us = now_us() + WARM_UP.as_micros() as u64;
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let expected = AtomicU64::new(u64::MAX);
    let stop_relay = AtomicBool::new(false);
    let (produced, (received, mut latencies), cpu, mut queuing) = std::thread::scope(|scope| {
        let cpu = scope.spawn(|| {
            std::thread::sleep(WARM_UP);
            let from = cpu::Sample::now();
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
            cpu::Sample::now().since(&from)
        });
        let relay = match pipeline {
            Pipeline::Relay => Some(named("relay", scope, || {
                relay(args, &input, &output, &stop_relay, measure_from_us)
            })),
            Pipeline::RelayExactlyOnce => Some(named("relay", scope, || {
                relay_exactly_once(args, &input, &output, &stop_relay).map(|()| Vec::new())
            })),
            _ => None,
        };
        let consumer = named("consumer", scope, || {
            consume(
                &args.bootstrap,
                args.partitions,
                &args.consumer_options,
                &output,
                &expected,
                until + DRAIN,
                measure_from_us,
            )
        });
        let producer_options: Vec<(String, String)> = profile
            .options()
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .chain(args.producer_options.iter().cloned())
            .collect();
        let load = Load {
            bootstrap: &args.bootstrap,
            partitions: args.partitions,
            record_bytes: args.record_bytes,
            keyed: false,
            options: &producer_options,
        };
        let produced = load.produce(rate, &input, until);
        expected.store(*produced.as_ref().unwrap_or(&0), Ordering::Release);
        let consumed = (consumer.join().expect("the consumer thread does not panic")).map(
            |(received, samples)| {
                (
                    received,
                    samples.iter().map(|s| s.latency_us).collect::<Vec<u64>>(),
                )
            },
        );
        stop_relay.store(true, Ordering::Release);
        let relay_queuing = match relay {
            Some(relay) => relay.join().expect("the relay thread does not panic")?,
            None => Vec::new(),
        };
        let cpu = cpu.join().expect("the CPU sampler does not panic");
        Ok::<_, BoxError>((produced?, consumed?, cpu, relay_queuing))
    })?;
    let rtflow = match query {
        Some(query) => {
            let latency = query.stop()?;
            // Best effort: a leftover directory in the temp dir harms nothing.
            let _ = std::fs::remove_dir_all(&checkpoints);
            latency
        }
        None => None,
    };
    if output != input {
        admin.delete_topic(&output)?;
    }
    admin.delete_topic(&input)?;
    if latencies.is_empty() {
        return Err(format!(
            "no record produced after the warm-up came out within {DRAIN:?} of the end"
        )
        .into());
    }
    let quarters = (
        median_ms(&latencies[..latencies.len().div_ceil(4)]),
        median_ms(&latencies[latencies.len() * 3 / 4..]),
    );
    latencies.sort_unstable();
    queuing.sort_unstable();
    Ok(Run {
        pipeline,
        profile,
        rate,
        produced,
        received,
        latencies,
        quarters,
        rtflow,
        relay_queuing: queuing,
        cpu,
    })
}

fn main() -> BenchResult<()> {
    let args = <Args as clap::Parser>::parse();
    // rtflow's own logs, to stderr, when asked for: how a checkpoint's time
    // splits shows in the coordinator's and the sinks' debug lines.
    if let Ok(filter) = std::env::var("RUST_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let options: String = [
        ("--source-option", &args.source_options),
        ("--sink-option", &args.sink_options),
        ("--producer-option", &args.producer_options),
        ("--consumer-option", &args.consumer_options),
        ("--relay-option", &args.relay_options),
    ]
    .iter()
    .flat_map(|(flag, options)| options.iter().map(move |(k, v)| format!(" {flag} {k}={v}")))
    .collect();
    let rates: Vec<String> = args.rates.iter().map(u64::to_string).collect();
    let pipelines: Vec<&str> = args.pipelines.iter().map(|p| p.name()).collect();
    let profiles: Vec<&str> = args.profiles.iter().map(|p| p.name()).collect();
    let readers = match args.readers {
        0 => String::new(),
        n => format!(" --readers {n}"),
    };
    eprintln!(
        "command: cargo bench --bench kafka_latency -- --bootstrap {} --rates {} --pipelines {} \
         --producer-profile {} --batch-ms {} --partitions {} --seconds {} --record-bytes {}\
         {readers}{options}",
        args.bootstrap,
        rates.join(","),
        pipelines.join(","),
        profiles.join(","),
        args.batch_ms,
        args.partitions,
        args.seconds,
        args.record_bytes
    );
    let mut runs = Vec::new();
    for &profile in &args.profiles {
        for &rate in &args.rates {
            for &pipeline in &args.pipelines {
                let run = run(&args, profile, rate, pipeline)?;
                print_json(&args, &run);
                runs.push(run);
            }
        }
    }
    print_summary(&args, &runs);
    Ok(())
}

/// Spawns `f` on a thread named `name` (the CPU figures' name for it).
fn named<'scope, T: Send + 'scope>(
    name: &str,
    scope: &'scope std::thread::Scope<'scope, '_>,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::thread::ScopedJoinHandle<'scope, T> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn_scoped(scope, f)
        .expect("a thread starts")
}

/// One JSON line per run, to stdout.
fn print_json(args: &Args, run: &Run) {
    let [p50, p90, p95, p99, p999, max] = run.percentiles();
    let rtflow = run.rtflow.map_or(String::new(), |latency| {
        format!(
            ",\"rtflow_processing_p50_ms\":{:.3},\"rtflow_processing_p99_ms\":{:.3},\
             \"rtflow_source_queuing_p50_ms\":{:.3},\"rtflow_source_queuing_p99_ms\":{:.3}",
            latency.processing.p50,
            latency.processing.p99,
            latency.source_queuing.p50,
            latency.source_queuing.p99
        )
    });
    let relay = match run.relay_queuing() {
        Some([p50, p99]) => format!(
            ",\"relay_source_queuing_p50_ms\":{p50:.3},\"relay_source_queuing_p99_ms\":{p99:.3}"
        ),
        None => String::new(),
    };
    let threads: Vec<String> = run
        .cpu
        .by_thread
        .iter()
        .filter(|(_, percent)| **percent >= 0.5)
        .map(|(name, percent)| format!("\"{name}\":{percent:.1}"))
        .collect();
    let cpu = format!(
        ",\"cpu_pct\":{:.1},\"broker_cpu_pct\":{:.1},\"cpu_pct_by_thread\":{{{}}}",
        run.cpu.process,
        run.cpu.broker,
        threads.join(",")
    );
    println!(
        "{{\"bench\":\"kafka_latency\",\"pipeline\":\"{}\",\"producer_profile\":\"{}\",\
         \"records\":{},\"produced\":{},\"received\":{},\"rate\":{},\"partitions\":{},\"record_bytes\":{},\"seconds\":{},\
         \"p50_ms\":{p50:.3},\"p90_ms\":{p90:.3},\"p95_ms\":{p95:.3},\"p99_ms\":{p99:.3},\
         \"p999_ms\":{p999:.3},\"max_ms\":{max:.3},\"first_quarter_p50_ms\":{:.3},\
         \"last_quarter_p50_ms\":{:.3},\"sustained\":{}{rtflow}{relay}{cpu}}}",
        run.pipeline.name(),
        run.profile.name(),
        run.latencies.len(),
        run.produced,
        run.received,
        run.rate,
        args.partitions,
        args.record_bytes,
        args.seconds,
        run.quarters.0,
        run.quarters.1,
        run.sustained(),
    );
}

/// The table of every run, rtflow against its floor per profile and rate,
/// and the highest rate each pipeline sustained, to stderr.
fn print_summary(args: &Args, runs: &[Run]) {
    eprintln!(
        "\nKafka({} partitions) -> [uppercase -> Kafka]; {} bytes per record for {} s, \
         the first {} s not measured; latency in ms",
        args.partitions,
        args.record_bytes,
        args.seconds,
        WARM_UP.as_secs()
    );
    eprintln!(
        "{:<8}{:>7} {:<15}{:>9}{:>9}  {:>48}  {:>16}  {:>16}",
        "profile",
        "rate",
        "pipeline",
        "measured",
        "missing",
        "end-to-end p50/p90/p95/p99/p99.9/max",
        "processing p50/p99",
        "queuing p50/p99"
    );
    for run in runs {
        let row = run.percentiles().map(|ms| format!("{ms:.2}")).join(" / ");
        let relay = run
            .relay_queuing()
            .map(|[p50, p99]| format!("{p50:.2} / {p99:.2}"));
        let (processing, queuing) = run.rtflow.map_or_else(
            || ("-".to_owned(), relay.unwrap_or_else(|| "-".to_owned())),
            |latency| {
                (
                    format!(
                        "{:.2} / {:.2}",
                        latency.processing.p50, latency.processing.p99
                    ),
                    format!(
                        "{:.2} / {:.2}",
                        latency.source_queuing.p50, latency.source_queuing.p99
                    ),
                )
            },
        );
        eprintln!(
            "{:<8}{:>7} {:<15}{:>9}{:>9}  {:>48}  {:>16}  {:>16}",
            run.profile.name(),
            run.rate,
            run.pipeline.name(),
            run.latencies.len(),
            run.produced.saturating_sub(run.received),
            row,
            processing,
            queuing
        );
    }
    let of = |profile: Profile, pipeline: Pipeline, rate: u64| {
        runs.iter()
            .find(|run| run.profile == profile && run.pipeline == pipeline && run.rate == rate)
    };
    eprintln!(
        "\nrtflow / its floor at p50, p99, p99.9 (target at least once: <= 1.2 at p50 and \
         <= 1.5 at p99); the exactly-once floor is relay-eo"
    );
    eprintln!(
        "{:<8}{:>7} {:<15}{:>7} {:>7} {:>7}",
        "profile", "rate", "pipeline", "p50", "p99", "p99.9"
    );
    for &profile in &args.profiles {
        for &rate in &args.rates {
            for &pipeline in &args.pipelines {
                let Some(floor) = pipeline.floor() else {
                    continue;
                };
                let (Some(floor), Some(rtflow)) =
                    (of(profile, floor, rate), of(profile, pipeline, rate))
                else {
                    continue;
                };
                let ratio = |q: f64| rtflow.ms(q) / floor.ms(q).max(0.001);
                eprintln!(
                    "{:<8}{rate:>7} {:<15}{:>7.2} {:>7.2} {:>7.2}",
                    profile.name(),
                    pipeline.name(),
                    ratio(0.50),
                    ratio(0.99),
                    ratio(0.999)
                );
            }
        }
    }
    eprintln!(
        "\nexactly-once output visible to read_committed readers: p99 against the batch \
         duration ({} ms) plus the at-least-once relay's p99 (the target)",
        args.batch_ms
    );
    for &profile in &args.profiles {
        for &rate in &args.rates {
            let Some(relay) = of(profile, Pipeline::Relay, rate) else {
                continue;
            };
            let target = args.batch_ms as f64 + relay.ms(0.99);
            for pipeline in [
                Pipeline::RelayExactlyOnce,
                Pipeline::RtflowExactlyOnce,
                Pipeline::RtflowCluster,
            ] {
                if let Some(run) = of(profile, pipeline, rate) {
                    eprintln!(
                        "{:<8}{rate:>7} {:<15} p99 {:>9.2} ms, target {target:.2} ms: {}",
                        profile.name(),
                        pipeline.name(),
                        run.ms(0.99),
                        if run.ms(0.99) <= target {
                            "within"
                        } else {
                            "over"
                        }
                    );
                }
            }
        }
    }
    eprintln!(
        "\nhighest rate sustained (every record out, p99 under 1 s, lag not growing), of \
         those measured:"
    );
    for &profile in &args.profiles {
        for &pipeline in &args.pipelines {
            let highest = runs
                .iter()
                .filter(|run| run.profile == profile && run.pipeline == pipeline && run.sustained())
                .map(|run| run.rate)
                .max();
            let highest = highest.map_or_else(|| "none".to_owned(), |rate| rate.to_string());
            eprintln!("  {:<8}{:<15}{highest}", profile.name(), pipeline.name());
        }
    }
}
