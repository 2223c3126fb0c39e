//! Unit tests of keyed and per-subtask state: snapshots, restores and their
//! interleavings with records.

use std::collections::BTreeMap;

use proptest::prelude::*;

use rtflow_checkpoint::{Entry, RestoredState};

use super::keyed::PIPELINED;
use super::*;
use crate::key_groups::{key_group, stable_hash};

/// What a snapshot holds: key -> value (`None`: deleted).
fn contents(out: StateSnapshot) -> BTreeMap<u64, Option<u64>> {
    let id = StateId::new("test", "counts");
    out.into_deltas()
        .into_iter()
        .flat_map(|delta| delta.entries)
        .map(|entry| {
            let key = decode(&id, &entry.key).unwrap();
            let value = entry.value.map(|bytes| decode(&id, &bytes).unwrap());
            (key, value)
        })
        .collect()
}

fn counts() -> KeyedState<u64, u64> {
    StateContext::detached("count", 0, 1, 128)
        .keyed("counts")
        .unwrap()
}

/// Keyed state restored from a chain of blobs by `parallelism` instances:
/// what each instance holds, all together.
fn restored(blobs: &[Vec<(u64, Option<u64>)>], parallelism: usize) -> BTreeMap<u64, u64> {
    let id = StateId::new("count-0", "counts");
    let meta = StateMeta {
        kind: "count".into(),
        signature: type_name::<(u64, u64)>().into(),
    };
    let blobs = blobs
        .iter()
        .map(|changes| {
            let entries: Vec<Entry> = changes
                .iter()
                .map(|(key, value)| Entry {
                    group: key_group(stable_hash(key), 128) as u32,
                    key: encode(&id, key).unwrap(),
                    value: value.map(|v| encode(&id, &v).unwrap()),
                })
                .collect();
            let bytes = rtflow_checkpoint::snapshot::encode_blob(&entries);
            let reference = rtflow_checkpoint::snapshot::blob_ref(1, 0, 0, &bytes);
            rtflow_checkpoint::snapshot::decode_blob(&id, reference, bytes).unwrap()
        })
        .collect();
    let state = RestoredState { meta, blobs };
    let restored = Arc::new(Restored::new(
        BTreeMap::from([(id, state)]),
        Some(1),
        None,
        None,
        128,
    ));
    let mut all = BTreeMap::new();
    for subtask in 0..parallelism {
        let context = StateContext {
            restored: restored.clone(),
            ..StateContext::detached("count", subtask, parallelism, 128)
        };
        let state: KeyedState<u64, u64> = context.keyed("counts").unwrap();
        assert_eq!(state.len(), state.iter().count());
        for (key, value) in state.iter() {
            assert!(all.insert(*key, *value).is_none(), "{key} in one instance");
        }
    }
    all
}

#[test]
fn a_chain_is_restored_oldest_first_small_or_large() {
    for keys in [100, 3 * PIPELINED as u64] {
        let base: Vec<_> = (0..keys).map(|key| (key, Some(key))).collect();
        let later: Vec<_> = (0..keys + 10)
            .filter(|key| key % 3 == 0 || key % 5 == 0)
            .map(|key| (key, (key % 5 != 0).then_some(key + 1)))
            .collect();
        let again = vec![(10, Some(7)), (1, None)];
        let expected: BTreeMap<u64, u64> = (0..keys + 10)
            .filter_map(|key| match key {
                10 => Some((10, 7)),
                1 => None,
                _ if key % 5 == 0 => None,
                _ if key % 3 == 0 => Some((key, key + 1)),
                _ => (key < keys).then_some((key, key)),
            })
            .collect();
        for parallelism in [1, 2, 3] {
            let all = restored(&[base.clone(), later.clone(), again.clone()], parallelism);
            assert_eq!(all, expected, "{keys} keys, parallelism {parallelism}");
        }
    }
}

/// A value that bincode cannot encode past 99, as a state type with a
/// failing `Serialize` would be.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
struct Picky(u64);

impl Serialize for Picky {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            0..100 => serializer.serialize_u64(self.0),
            _ => Err(serde::ser::Error::custom("too large to encode")),
        }
    }
}

fn assert_cannot_encode(result: Result<bool>) {
    match result {
        Err(RtflowError::Checkpoint(message)) => assert!(
            message.contains("cannot encode state 'picky' of operator 'count-0'")
                && message.contains("too large"),
            "{message}"
        ),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

/// The failure surfaces when the snapshot completes, whether the key was
/// encoded in a slice between records or because a record was about to
/// change it (copy on write); the snapshot is never handed over.
#[test]
fn a_value_that_cannot_be_encoded_fails_the_snapshot() {
    for changed_before_encoding in [false, true] {
        let mut state: KeyedState<u64, Picky> = StateContext::detached("count", 0, 1, 128)
            .keyed("picky")
            .unwrap();
        state.insert(1, Picky(7));
        state.insert(2, Picky(700));
        let mut out = StateSnapshot::default();
        state.begin_snapshot(&mut out).unwrap();
        if changed_before_encoding {
            state.insert(2, Picky(8));
        }
        assert_cannot_encode(state.continue_snapshot(usize::MAX, &mut out));
        assert_eq!(
            out.entries(),
            0,
            "nothing of the failed snapshot is handed over"
        );
    }
}

#[test]
fn a_key_changed_before_the_snapshot_encoded_it_is_snapshotted_as_at_the_barrier() {
    let mut state = counts();
    for key in 1..=3 {
        state.insert(key, key * 10);
    }
    let mut at_barrier = StateSnapshot::default();
    state.begin_snapshot(&mut at_barrier).unwrap();
    assert!(!state.continue_snapshot(1, &mut at_barrier).unwrap());
    state.insert(1, 11);
    state.remove(&2);
    state.insert(4, 40);
    assert!(state
        .continue_snapshot(usize::MAX, &mut at_barrier)
        .unwrap());
    assert_eq!(
        contents(at_barrier),
        BTreeMap::from([(1, Some(10)), (2, Some(20)), (3, Some(30))])
    );

    let mut next = StateSnapshot::default();
    state.begin_snapshot(&mut next).unwrap();
    assert!(state.continue_snapshot(usize::MAX, &mut next).unwrap());
    assert_eq!(
        contents(next),
        BTreeMap::from([(1, Some(11)), (2, None), (4, Some(40))])
    );
    assert_eq!(state.len(), 3);
}

#[derive(Debug, Clone)]
enum Act {
    Insert(u64, u64),
    Add(u64),
    Remove(u64),
    Barrier,
    /// Encodes this many more keys of the incomplete snapshot.
    Continue(usize),
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        4 => (0..20u64, 0..100u64).prop_map(|(k, v)| Act::Insert(k, v)),
        4 => (0..20u64).prop_map(Act::Add),
        2 => (0..20u64).prop_map(Act::Remove),
        1 => Just(Act::Barrier),
        2 => (0..8usize).prop_map(Act::Continue),
    ]
}

/// A snapshot taken at a barrier and the state before and at that barrier.
type Open = (StateSnapshot, BTreeMap<u64, u64>, BTreeMap<u64, u64>);

/// Completes the open snapshot; checks it holds every key changed in its
/// epoch and that applying it to `rebuilt` gives the state at its barrier.
fn settle(
    open: &mut Option<Open>,
    state: &mut KeyedState<u64, u64>,
    rebuilt: &mut BTreeMap<u64, u64>,
) {
    let Some((mut out, before, after)) = open.take() else {
        return;
    };
    assert!(state.continue_snapshot(usize::MAX, &mut out).unwrap());
    let held = contents(out);
    for (key, value) in &held {
        match value {
            Some(value) => rebuilt.insert(*key, *value),
            None => rebuilt.remove(key),
        };
    }
    assert_eq!(
        *rebuilt, after,
        "replayed snapshots rebuild the barrier's state"
    );
    let changed = before
        .keys()
        .chain(after.keys())
        .filter(|key| before.get(key) != after.get(key));
    for key in changed {
        assert!(held.contains_key(key), "changed key {key} is held");
    }
}

proptest! {
    /// However records and snapshot slices interleave, each snapshot holds
    /// exactly the keys changed in its epoch, with their values at its
    /// barrier, and replaying the snapshots rebuilds the state.
    #[test]
    fn snapshots_hold_each_epoch_as_it_was_at_its_barrier(
        acts in prop::collection::vec(act(), 0..200),
    ) {
        let mut state = counts();
        let mut model: BTreeMap<u64, u64> = BTreeMap::new();
        let mut at_last_barrier: BTreeMap<u64, u64> = BTreeMap::new();
        let mut rebuilt: BTreeMap<u64, u64> = BTreeMap::new();
        let mut open: Option<Open> = None;
        for act in acts {
            match act {
                Act::Insert(key, value) => {
                    state.insert(key, value);
                    model.insert(key, value);
                }
                Act::Add(key) => {
                    *state.get_or_insert_with(key, || 0) += 1;
                    *model.entry(key).or_insert(0) += 1;
                }
                Act::Remove(key) => {
                    prop_assert_eq!(state.remove(&key), model.remove(&key));
                }
                Act::Barrier => {
                    settle(&mut open, &mut state, &mut rebuilt);
                    let mut out = StateSnapshot::default();
                    state.begin_snapshot(&mut out).unwrap();
                    let before = std::mem::replace(&mut at_last_barrier, model.clone());
                    open = Some((out, before, model.clone()));
                }
                Act::Continue(budget) => {
                    if let Some((out, _, _)) = &mut open {
                        if state.continue_snapshot(budget, out).unwrap() {
                            settle(&mut open, &mut state, &mut rebuilt);
                        }
                    }
                }
            }
            prop_assert_eq!(state.len(), model.len());
        }
        settle(&mut open, &mut state, &mut rebuilt);
    }
}
