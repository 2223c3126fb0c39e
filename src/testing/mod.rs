//! Property-based testing of dataflows, built on [proptest](https://docs.rs/proptest)
//! (enable the `testing` feature).
//!
//! The parts fit together like this:
//!
//! - [`DataflowHarness`] runs one dataflow in-process on a memory source whose
//!   partitions, arrival order and event times the test controls. It checkpoints
//!   on demand, crashes the query the way a killed process dies (no final
//!   checkpoint) and restarts it from its last checkpoint, captures the sink's
//!   output per epoch as an exactly-once sink would commit it, and reads the
//!   operators' checkpointed state.
//! - [`Step`] is one thing a test does to a running dataflow: push a record, let
//!   the sources catch up, checkpoint, crash. The strategies in this module
//!   generate inputs ([`schedule`]), partitionings ([`pin_keys`]), interleavings
//!   ([`Step::Settle`] points) and crash schedules ([`Step::Crash`] points), and
//!   shrink a failing schedule to a minimal one.
//! - [`reference`](mod@reference) computes what a batch job over the same input would answer
//!   (counts and sums per key) and compares committed results with it, as
//!   multisets or per key in order.
//! - [`check`] runs a property over a strategy with the case count of
//!   `PROPTEST_CASES` (or the test's default) and reports a failure with its
//!   minimal input and the `PROPTEST_RNG_SEED` that reproduces it; [`try_check`]
//!   returns the failure instead.
//!
//! ```
//! use proptest::prelude::*;
//! use rtflow::prelude::*;
//! use rtflow::testing::{check, reference, schedule, DataflowHarness};
//!
//! let words = prop::sample::select(vec!["a", "b", "c"]).prop_map(String::from);
//! check("word count", 2, schedule(words, 2, 0..12), |steps| {
//!     let mut harness = DataflowHarness::new("words", 2, |_, input: Stream<String>| {
//!         input.key_by(|word: &String| word.clone()).count()
//!     });
//!     harness.run(&steps)?;
//!     // Every update committed once, whatever the crashes.
//!     reference::assert_same_multiset(
//!         harness.committed(),
//!         reference::running_counts(harness.input_values(), |word| word.clone()),
//!     )?;
//!     Ok(())
//! });
//! ```
//!
//! The guide `docs/guide/testing.md` ("Testing your dataflow") walks through a
//! complete example.

mod check;
mod harness;
pub mod reference;
mod schedule;

pub use check::{cases, check, try_check, Failure};
pub use harness::{DataflowHarness, WatermarkTrace, INPUT};
pub use schedule::{pin_keys, schedule, Step};

/// proptest itself, so tests need no second dependency to write strategies.
pub use proptest;
