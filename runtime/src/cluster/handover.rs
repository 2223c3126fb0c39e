//! Handing partitions over inside a run: a process of a clustered query
//! whose share changes lets go of key groups, or takes more on, at a barrier,
//! while its tasks go on running.
//!
//! A [`Handover`] is asked for through
//! [`StreamingQuery::hand_over`](crate::StreamingQuery::hand_over) and bound
//! to the next epoch the coordinator ends ([`Handovers`]). Every stateful
//! operator instance meets it at that epoch's barrier, after its snapshot:
//! it is rebuilt from its own state of the key groups it keeps, as a
//! checkpoint taken then would restore it, together with the state of the
//! key groups it adopts. Whatever it derived from its state (timers, join
//! buffers, the lateness of each key group) is derived again, so nothing of
//! a group let go outlives the barrier, and the checkpoint of that epoch is
//! the last to carry the group's changes from this process. Every actor
//! meets it before it acknowledges the barrier, so a handover that fails
//! anywhere fails that epoch too: its checkpoint never commits.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rtflow_checkpoint::{Offsets, RestoredState, StateId};

use super::membership::Membership;
use crate::record::Epoch;

/// What a running process of a clustered query owns from a barrier on.
pub struct Handover {
    /// The process's partitions and key groups after the barrier.
    pub membership: Arc<dyn Membership>,
    /// The keyed state of the key groups it adopts, as
    /// [`ClusterLink::recover`](super::ClusterLink::recover) gives it.
    pub adopted: BTreeMap<StateId, RestoredState>,
    /// Where the partitions it adopts resume, labelled as the readers label
    /// them.
    pub offsets: Offsets,
}

/// Where a [`Handover`] leaves a run's actors,
/// by node uid and subtask.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Reach {
    /// Of each source reader: the partitions it reads.
    pub(crate) readers: BTreeMap<(String, usize), Vec<usize>>,
    /// Of each operator and sink instance: the source partitions, numbered
    /// query-wide, whose records reach it.
    pub(crate) reaching: BTreeMap<(String, usize), Vec<u32>>,
    /// Whether a reader takes on partitions: the run's event time then
    /// starts over, as a new run's would.
    pub(crate) starts_over: bool,
}

/// A handover as the run's actors meet it: with where it leaves each of them.
pub(crate) struct Bound {
    pub(crate) handover: Handover,
    pub(crate) reach: Reach,
}

impl Bound {
    /// The partitions reader `subtask` of source `uid` reads after it.
    pub(crate) fn read_by(&self, uid: &str, subtask: usize) -> &[usize] {
        (self.reach.readers.get(&(uid.to_owned(), subtask))).map_or(&[], Vec::as_slice)
    }

    /// The source partitions whose records reach instance `subtask` of the
    /// operator or sink `uid` after it.
    pub(crate) fn reaching(&self, uid: &str, subtask: usize) -> &[u32] {
        (self.reach.reaching.get(&(uid.to_owned(), subtask))).map_or(&[], Vec::as_slice)
    }
}

/// A run's handovers: one asked for waits for the next epoch to end, and is
/// bound to that epoch until it commits.
#[derive(Default)]
pub(crate) struct Handovers {
    asked: Mutex<Vec<Bound>>,
    bound: Mutex<BTreeMap<Epoch, Arc<Bound>>>,
}

impl Handovers {
    /// Asks for `handover` at the next epoch's barrier, leaving the actors
    /// as `reach` says.
    pub(crate) fn ask(&self, handover: Handover, reach: Reach) {
        lock(&self.asked).push(Bound { handover, reach });
    }

    /// The coordinator ends `epoch`: what was asked for happens at its
    /// barrier. Of several asked for meanwhile, the last says what the
    /// process owns, and the state each adopted is kept (an instance restores
    /// only what it owns).
    pub(crate) fn bind(&self, epoch: Epoch) {
        let mut asked = lock(&self.asked).drain(..).collect::<Vec<_>>().into_iter();
        let Some(mut bound) = asked.next() else {
            return;
        };
        for later in asked {
            let Bound { handover, reach } = later;
            bound.handover.membership = handover.membership;
            bound.handover.offsets.extend(handover.offsets);
            for (id, state) in handover.adopted {
                let adopted = &mut bound.handover.adopted;
                match adopted.get_mut(&id) {
                    Some(held) => held.blobs.extend(state.blobs),
                    None => {
                        adopted.insert(id, state);
                    }
                }
            }
            let starts_over = bound.reach.starts_over || reach.starts_over;
            bound.reach = Reach {
                starts_over,
                ..reach
            };
        }
        lock(&self.bound).insert(epoch, Arc::new(bound));
    }

    /// The handover at `epoch`'s barrier, if any.
    pub(crate) fn at(&self, epoch: Epoch) -> Option<Arc<Bound>> {
        lock(&self.bound).get(&epoch).cloned()
    }

    /// `epoch` committed: every actor has met its barrier.
    pub(crate) fn committed(&self, epoch: Epoch) {
        lock(&self.bound).retain(|bound, _| *bound > epoch);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::any::Any;

    use super::*;

    struct Owns(u32);

    impl Membership for Owns {
        fn member(&self) -> String {
            "p".into()
        }
        fn partitions(&self) -> Vec<String> {
            Vec::new()
        }
        fn owns_key_group(&self, group: u32) -> bool {
            group < self.0
        }
        fn owned(&self, _: &[(String, i32)]) -> Vec<usize> {
            Vec::new()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn owning(groups: u32) -> Handover {
        Handover {
            membership: Arc::new(Owns(groups)),
            adopted: BTreeMap::new(),
            offsets: Offsets::new(),
        }
    }

    #[test]
    fn a_handover_happens_at_the_barrier_of_the_next_epoch_ended_until_it_commits() {
        let handovers = Handovers::default();
        handovers.bind(4);
        assert!(handovers.at(4).is_none(), "nothing was asked for");
        handovers.ask(owning(1), Reach::default());
        assert!(handovers.at(5).is_none(), "not bound before its epoch ends");
        handovers.bind(5);
        assert!(handovers
            .at(5)
            .unwrap()
            .handover
            .membership
            .owns_key_group(0));
        handovers.bind(6);
        assert!(handovers.at(6).is_none(), "bound once");
        handovers.committed(4);
        assert!(
            handovers.at(5).is_some(),
            "kept until its own epoch commits"
        );
        handovers.committed(5);
        assert!(handovers.at(5).is_none());
    }

    #[test]
    fn of_several_asked_for_before_an_epoch_ends_the_last_says_what_is_owned_and_all_adopt() {
        let state = |entry: u8| RestoredState {
            meta: rtflow_checkpoint::StateMeta {
                kind: "count".into(),
                signature: "u8".into(),
            },
            blobs: vec![rtflow_checkpoint::snapshot::Blob::of(&[
                rtflow_checkpoint::Entry {
                    group: entry.into(),
                    key: vec![entry],
                    value: Some(vec![entry]),
                },
            ])],
        };
        let id = StateId::new("count", "counts");
        let handovers = Handovers::default();
        let mut first = owning(1);
        first.adopted.insert(id.clone(), state(0));
        let mut second = owning(3);
        second.adopted.insert(id.clone(), state(2));
        handovers.ask(first, Reach::default());
        handovers.ask(second, Reach::default());
        handovers.bind(7);
        let bound = handovers.at(7).unwrap();
        assert!(bound.handover.membership.owns_key_group(2));
        let groups: Vec<u32> = (bound.handover.adopted[&id].entries().iter())
            .map(|e| e.group)
            .collect();
        assert_eq!(groups.len(), 2, "both adopted: {groups:?}");
    }
}
