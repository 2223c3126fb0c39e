//! Kafka enrichment with a stream-static broadcast join.
//!
//! Reads `"user_id,action"` events from `rtflow-events`, left-joins each with a
//! static table of users (broadcast to every joining actor, as Spark Real-time Mode's
//! broadcast stream-static join), and writes one JSON object per event to
//! `rtflow-enriched`, keyed by user id; an unknown user keeps its event with
//! `"user":null`. The users come from a built-in list, or from a CSV file with
//! the header `id,name,country` given as `--users FILE`. Both topics are created
//! if missing. After `--seconds`, or at SIGTERM or Ctrl-C, the query stops
//! with a final checkpoint and the example prints how many records went
//! through and their latency.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo run --release --example kafka_enrich -- --produce 100 --seconds 30
//! scripts/kafka.sh consume rtflow-enriched 10
//! ```
//!
//! `--produce RATE` writes RATE test events per second to `rtflow-events` from a
//! background thread; without it, feed the topic yourself, e.g.
//! `echo 3,click | scripts/kafka.sh produce rtflow-events`.
//! `--bootstrap HOST:PORT` points at another broker; `--metrics-address HOST:PORT`
//! serves Prometheus metrics at `/metrics` there.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use rtflow::prelude::*;
use serde::Deserialize;

const INPUT: &str = "rtflow-events";
const OUTPUT: &str = "rtflow-enriched";

#[derive(Parser)]
#[command(about = "rtflow: Kafka events -> broadcast join with users -> Kafka")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// How long to run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Also write this many test events per second to the input topic.
    #[arg(long, value_name = "RATE", value_parser = clap::value_parser!(u64).range(1..))]
    produce: Option<u64>,
    /// Users to join with: a CSV file with the header `id,name,country`.
    #[arg(long, value_name = "FILE")]
    users: Option<PathBuf>,
    /// Partitions of the topics, when this creates them (one reader each).
    #[arg(long, default_value_t = 2)]
    partitions: i32,
    #[command(flatten)]
    metrics: common::MetricsArgs,
    #[command(flatten)]
    checkpoints: common::CheckpointArgs,
    #[command(flatten)]
    stop: common::StopArgs,
}

#[derive(Debug, Clone, Deserialize)]
struct User {
    id: u32,
    name: String,
    country: String,
}

#[derive(Debug, Clone)]
struct Event {
    user_id: u32,
    action: String,
}

fn parse(record: KafkaRecord) -> Option<Event> {
    let value = record.value_str();
    let (user_id, action) = value.split_once(',')?;
    Some(Event {
        user_id: user_id.trim().parse().ok()?,
        action: action.trim().to_owned(),
    })
}

/// The event and its user as a JSON object; `{:?}` quotes and escapes plain text
/// as JSON does.
fn to_json((event, user): &(Event, Option<User>)) -> String {
    let user = match user {
        Some(u) => format!("{{\"name\":{:?},\"country\":{:?}}}", u.name, u.country),
        None => "null".to_owned(),
    };
    format!(
        "{{\"user_id\":{},\"action\":{:?},\"user\":{user}}}",
        event.user_id, event.action
    )
}

fn load_users(file: Option<&PathBuf>) -> Result<StaticTable<u32, User>> {
    let Some(file) = file else {
        let rows = [(1, "ada", "GB"), (2, "grace", "US"), (3, "edsger", "NL")];
        return Ok(StaticTable::from_rows(
            "users",
            rows.map(|(id, name, country)| {
                let user = User {
                    id,
                    name: name.to_owned(),
                    country: country.to_owned(),
                };
                (id, user)
            }),
        ));
    };
    StaticTable::from_csv(file, |user: &User| user.id)
}

fn main() -> std::result::Result<(), BoxError> {
    let args = Args::parse();
    common::init_tracing();
    let shutdown = args.stop.on_signals()?;
    let users = load_users(args.users.as_ref())?;
    let admin = KafkaAdmin::new(&args.bootstrap)?;
    admin.create_topic(INPUT, args.partitions)?;
    admin.create_topic(OUTPUT, args.partitions)?;

    let flow = Dataflow::new("kafka-enrich");
    flow.source(KafkaSource::new(&args.bootstrap).subscribe([INPUT]))
        .name("kafka")
        .flat_map(parse)
        .broadcast_left_join(&users, |event| event.user_id)
        // Keyed by user, as the input is, so each user's events stay in order.
        .sink(KafkaSink::new(&args.bootstrap, OUTPUT, |row| {
            KafkaMessage::new(to_json(row)).key(row.0.user_id.to_string())
        }));

    let query = flow.start(
        args.metrics.apply(
            QueryConfig::new("kafka-enrich")
                .checkpoint_location(args.checkpoints.or_temporary("kafka-enrich"))
                .trigger(Trigger::real_time("30 seconds")),
        ),
    )?;
    shutdown.stop_on_signal(&query);
    args.metrics.announce();
    // Started after the query, whose readers begin at the latest offsets.
    if let Some(rate) = args.produce {
        // User 0 is in no table, to show the left join.
        common::spawn_producer(&args.bootstrap, INPUT, rate, |n| {
            let user = (n % 4).to_string();
            let event = format!("{user},{}", ["view", "click", "purchase"][n as usize % 3]);
            (user, event)
        })?;
    }
    println!(
        "{INPUT} -> join {} users -> {OUTPUT} for {} s on {}",
        users.len(),
        args.seconds,
        args.bootstrap
    );
    query.await_with_status(Duration::from_secs(args.seconds), std::io::stderr())?;
    query.stop()?;

    common::print_summary(&query, "written");
    Ok(())
}
