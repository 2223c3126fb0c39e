//! # rtflow-checkpoint
//!
//! Checkpoints of rtflow queries. The runtime's coordinator drives them:
//!
//! - [`protocol`]: the commit decision as pure logic: epochs are triggered one at
//!   a time, every actor acknowledges the barrier, then the epoch may commit.
//! - [`manifest`]: what a committed epoch records (source offsets, watermark,
//!   query id, the snapshot chain of every state, the key-group count) and its
//!   checksummed encoding.
//! - [`snapshot`]: incremental state snapshots: the entries an actor changed in an
//!   epoch, as checksummed blobs, and how a chain of them rebuilds a state.
//! - [`store`]: the store at the checkpoint location: an epoch's blobs first, in
//!   one synced segment file (`segments`), then its manifest in sled, flushed
//!   before the commit is announced; recovery takes the newest checkpoint whose
//!   manifest and blobs are intact, never a torn one; retention, garbage
//!   collection and compaction of snapshot chains.
//!
//! This crate knows nothing of the runtime: the runtime builds on it.

mod head;
pub mod manifest;
pub mod protocol;
mod segments;
pub mod snapshot;
pub mod store;

/// Checkpoint epoch number.
pub type Epoch = u64;

pub use manifest::{Manifest, Offsets};
pub use protocol::{ActorId, CheckpointTracker};
pub use snapshot::{Delta, Entries, Entry, EntryRef, StateChain, StateId, StateMeta};
pub use store::{CheckpointStore, CommitStats, Recovery, RestoredState, StoreError};
