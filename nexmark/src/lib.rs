//! # rtflow-nexmark
//!
//! The Nexmark benchmark on rtflow: an online auction's stream of people,
//! auctions and bids, and the queries stream processors compare themselves on.
//!
//! - [`model`]: the events ([`Person`], [`Auction`], [`Bid`], [`Event`]).
//! - [`generator`]: the deterministic event generator ([`NexmarkGenerator`]),
//!   after the nexmark project's reference generator; as an rtflow source
//!   ([`NexmarkSource`], checkpointed by offset) and as a Kafka loader
//!   ([`load_kafka`]).
//! - [`queries`]: q0, q1, q2, q3, q4, q5, q7, q8 and q11 built with rtflow's
//!   builder API, each a function from the event stream to its result stream.
//! - [`reference`](mod@reference): the same queries as plain batch code over a `Vec<Event>`,
//!   and how to read a query's update stream as its final result: the tests
//!   compare the two.
//! - The `nexmark` binary (`src/bin/nexmark.rs`) runs a query on the generator or
//!   on a Kafka topic and prints throughput, latency and peak memory as JSON.
//!
//! ```
//! use std::time::Duration;
//! use rtflow::prelude::*;
//! use rtflow_nexmark::{queries, reference, GeneratorConfig, NexmarkGenerator, NexmarkSource};
//!
//! let generator = NexmarkGenerator::new(GeneratorConfig::default());
//! let flow = Dataflow::new("q1");
//! let events = flow.source(NexmarkSource::new(generator.clone()).partitions(2).events(10_000));
//! let output = MemorySink::new();
//! queries::q1(&events).sink(output.clone());
//! let dir = std::env::temp_dir().join(format!("nexmark-doc-lib-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let query = flow.start(QueryConfig::new("q1").checkpoint_location(dir))?;
//! query.await_termination(Some(Duration::from_secs(60)))?;
//!
//! let mut rows = output.rows();
//! rows.sort();
//! let events: Vec<_> = generator.events(0..10_000).collect();
//! assert_eq!(rows, reference::q1(&events));
//! # Ok::<(), rtflow::RtflowError>(())
//! ```

pub mod generator;
pub mod model;
pub mod queries;
pub mod reference;

pub use generator::{load_kafka, GeneratorConfig, NexmarkGenerator, NexmarkSource};
pub use model::{Auction, Bid, Event, Millis, Person};
