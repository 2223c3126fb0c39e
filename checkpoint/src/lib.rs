//! # rtflow-checkpoint
//!
//! Checkpoints of rtflow queries. The runtime's coordinator drives them:
//!
//! - [`protocol`]: the commit decision as pure logic: epochs are triggered one at
//!   a time, every actor acknowledges the barrier, then the epoch may commit.
//! - [`manifest`]: what a committed epoch records (source offsets, watermark,
//!   query id) and its checksummed encoding.
//! - [`store`]: the sled-backed store at the checkpoint location: manifests are
//!   written last and flushed before the commit is announced; recovery takes the
//!   newest intact manifest and never a torn one.
//!
//! This crate knows nothing of the runtime: the runtime builds on it.

pub mod manifest;
pub mod protocol;
pub mod store;

/// Checkpoint epoch number.
pub type Epoch = u64;

pub use manifest::{Manifest, Offsets};
pub use protocol::{ActorId, CheckpointTracker};
pub use store::{CheckpointStore, Recovery, StoreError};
