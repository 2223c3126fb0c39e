//! [`Restored`]: what every stateful instance of a query restores from, and
//! which states the dataflow claimed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use rtflow_checkpoint::snapshot::{merge, Blob};
use rtflow_checkpoint::{RestoredState, StateId, StateMeta};

use crate::cluster::handover::Handovers;
use crate::cluster::membership::Membership;
use crate::record::{Epoch, EventTime};

/// What every stateful instance of a query restores from: the recovered
/// checkpoint's states, and which of them the dataflow claimed.
#[derive(Default)]
pub(crate) struct Restored {
    pub(super) states: BTreeMap<StateId, Grouped>,
    /// The epoch of the checkpoint restored from.
    pub(crate) epoch: Option<Epoch>,
    /// The watermark the checkpoint reached.
    pub(crate) watermark: Option<EventTime>,
    /// The run that committed the checkpoint.
    pub(crate) run_id: Option<String>,
    pub(crate) key_groups: usize,
    /// In a clustered query, the process's link: the key groups whose state
    /// this process restores and writes are those of its partitions.
    pub(crate) cluster: Option<Arc<dyn Membership>>,
    /// The run's handovers, which its stateful instances meet at barriers.
    pub(crate) handovers: Arc<Handovers>,
    pub(super) claimed: Mutex<BTreeSet<StateId>>,
}

/// A restored state's snapshot blobs; each instance picks the entries of its
/// groups. Checking a group is far cheaper than moving entries into buckets,
/// even for every instance in turn.
pub(super) struct Grouped {
    pub(super) meta: StateMeta,
    /// Oldest first.
    pub(super) blobs: Vec<Blob>,
}

impl Grouped {
    fn new(state: RestoredState) -> Self {
        Self {
            meta: state.meta,
            blobs: state.blobs,
        }
    }

    /// The live values of the groups `wanted` picks (the blobs merged), by
    /// group. For per-subtask state, a few entries; keyed state applies the
    /// blobs straight into its own map instead.
    pub(super) fn live(&self, wanted: impl Fn(usize) -> bool) -> Vec<(u32, &[u8])> {
        let mut live: Vec<(u32, &[u8])> = merge(&self.blobs)
            .iter()
            .filter(|entry| wanted(entry.group as usize))
            .filter_map(|entry| Some((entry.group, entry.value?)))
            .collect();
        live.sort_by_key(|(group, _)| *group);
        live
    }
}

impl Restored {
    pub(crate) fn new(
        states: BTreeMap<StateId, RestoredState>,
        epoch: Option<Epoch>,
        watermark: Option<EventTime>,
        run_id: Option<String>,
        key_groups: usize,
    ) -> Self {
        Self {
            states: states
                .into_iter()
                .map(|(id, state)| (id, Grouped::new(state)))
                .collect(),
            epoch,
            watermark,
            run_id,
            key_groups,
            cluster: None,
            handovers: Arc::default(),
            claimed: Mutex::default(),
        }
    }

    /// The first state of the checkpoint that no instance claimed at start: the
    /// dataflow lost the operator that owned it.
    pub(crate) fn unclaimed(&self) -> Option<(&StateId, &StateMeta)> {
        let claimed = self.claimed.lock().expect("claims are never poisoned");
        self.states
            .iter()
            .find(|(id, _)| !claimed.contains(id))
            .map(|(id, state)| (id, &state.meta))
    }
}
