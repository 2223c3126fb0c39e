//! Changelog records: how keyed state changes travel to the compacted
//! changelog topic, and how a process taking partitions over folds them back
//! into the state it restores.
//!
//! A record's key names the state, the key group and the entry's key, so
//! compaction keeps the latest value of each entry; its value holds the
//! state's metadata and the entry's value, or nothing for a deleted entry (a
//! tombstone, which compaction removes in time).

use std::collections::{BTreeMap, HashMap};

use rtflow_checkpoint::snapshot::{blob_ref, decode_blob, encode_blob};
use rtflow_checkpoint::{Entry, RestoredState, StateId, StateMeta};
use rtflow_runtime::Result;
use rtflow_runtime::RtflowError;
use serde::{Deserialize, Serialize};

/// The key of a changelog record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChangeKey {
    pub(crate) operator: String,
    pub(crate) state: String,
    pub(crate) group: u32,
    /// As one run of bytes, not a byte at a time (the same encoding).
    #[serde(with = "serde_bytes")]
    pub(crate) key: Vec<u8>,
}

/// The value of a changelog record that sets an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChangeValue {
    pub(crate) kind: String,
    pub(crate) signature: String,
    /// As one run of bytes, not a byte at a time (the same encoding).
    #[serde(with = "serde_bytes")]
    pub(crate) value: Vec<u8>,
}

pub(crate) fn encode<V: Serialize>(value: &V) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("changelog records always encode")
}

fn decode<V: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<V> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(value, _)| value)
        .map_err(|e| RtflowError::Checkpoint(format!("a changelog record does not decode: {e}")))
}

/// The key and value of the changelog record of `entry` of `state`.
pub(crate) fn record(
    state: &StateId,
    meta: &StateMeta,
    entry: &Entry,
) -> (Vec<u8>, Option<Vec<u8>>) {
    let key = ChangeKey {
        operator: state.operator.clone(),
        state: state.name.clone(),
        group: entry.group,
        key: entry.key.clone(),
    };
    let value = entry.value.as_ref().map(|value| ChangeValue {
        kind: meta.kind.clone(),
        signature: meta.signature.clone(),
        value: value.clone(),
    });
    (encode(&key), value.map(|v| encode(&v)))
}

/// The live entries of one state, by key group and key, with the state's
/// metadata once a record that sets an entry told it.
type Folded = (Option<StateMeta>, HashMap<(u32, Vec<u8>), Vec<u8>>);

/// Keyed state folded from changelog records, the latest per entry.
#[derive(Default)]
pub(crate) struct Fold {
    states: BTreeMap<StateId, Folded>,
}

impl Fold {
    /// Applies one changelog record, in log order.
    pub(crate) fn apply(&mut self, key: &[u8], value: Option<&[u8]>) -> Result<()> {
        let key: ChangeKey = decode(key)?;
        let state = self
            .states
            .entry(StateId::new(key.operator, key.state))
            .or_default();
        match value {
            Some(bytes) => {
                let value: ChangeValue = decode(bytes)?;
                state.0 = Some(StateMeta {
                    kind: value.kind,
                    signature: value.signature,
                });
                state.1.insert((key.group, key.key), value.value);
            }
            None => {
                state.1.remove(&(key.group, key.key));
            }
        }
        Ok(())
    }

    /// The states as a restore reads them: one blob each.
    pub(crate) fn into_states(self) -> Result<BTreeMap<StateId, RestoredState>> {
        let mut restored = BTreeMap::new();
        for (id, (meta, entries)) in self.states {
            let Some(meta) = meta else { continue };
            if entries.is_empty() {
                continue;
            }
            let entries: Vec<Entry> = entries
                .into_iter()
                .map(|((group, key), value)| Entry {
                    group,
                    key,
                    value: Some(value),
                })
                .collect();
            let bytes = encode_blob(&entries);
            let blob = decode_blob(&id, blob_ref(0, 0, 0, &bytes), bytes)
                .map_err(|e| RtflowError::Checkpoint(e.to_string()))?;
            restored.insert(
                id,
                RestoredState {
                    meta,
                    blobs: vec![blob],
                },
            );
        }
        Ok(restored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> StateMeta {
        StateMeta {
            kind: "count".into(),
            signature: "(u64, u64)".into(),
        }
    }

    #[test]
    fn keys_and_values_encode_as_processes_before_serde_bytes_wrote_them() {
        /// `ChangeKey` and `ChangeValue` as they were, their bytes plain
        /// sequences of `u8`s.
        #[derive(Serialize)]
        struct KeyBefore(String, String, u32, Vec<u8>);
        #[derive(Serialize)]
        struct ValueBefore(String, String, Vec<u8>);
        let bytes: Vec<u8> = (0..=255).chain(0..300).map(|b| b as u8).collect();
        let key = ChangeKey {
            operator: "count-0".into(),
            state: "counts".into(),
            group: 300,
            key: bytes.clone(),
        };
        let before = KeyBefore("count-0".into(), "counts".into(), 300, bytes.clone());
        assert_eq!(encode(&key), encode(&before));
        assert_eq!(decode::<ChangeKey>(&encode(&before)).unwrap(), key);
        let value = ChangeValue {
            kind: "count".into(),
            signature: "u64".into(),
            value: bytes.clone(),
        };
        let before = ValueBefore("count".into(), "u64".into(), bytes);
        assert_eq!(encode(&value), encode(&before));
        assert_eq!(decode::<ChangeValue>(&encode(&before)).unwrap(), value);
    }

    #[test]
    fn the_latest_record_of_each_entry_is_restored_and_tombstones_delete() {
        let id = StateId::new("count-0", "counts");
        let set = |group, key: &[u8], value: Option<&[u8]>| Entry {
            group,
            key: key.to_vec(),
            value: value.map(<[u8]>::to_vec),
        };
        let mut fold = Fold::default();
        for entry in [
            set(1, b"a", Some(b"1")),
            set(2, b"b", Some(b"1")),
            set(1, b"a", Some(b"2")),
            set(2, b"b", None),
        ] {
            let (key, value) = record(&id, &meta(), &entry);
            fold.apply(&key, value.as_deref()).unwrap();
        }
        let states = fold.into_states().unwrap();
        let state = &states[&id];
        assert_eq!(state.meta, meta());
        let live: Vec<_> = state
            .entries()
            .iter()
            .map(|e| (e.group, e.key.to_vec(), e.value.map(<[u8]>::to_vec)))
            .collect();
        assert_eq!(live, vec![(1, b"a".to_vec(), Some(b"2".to_vec()))]);
    }

    #[test]
    fn a_record_that_does_not_decode_is_a_checkpoint_failure() {
        let error = Fold::default().apply(b"\xff\xff", None).unwrap_err();
        assert_eq!(error.error_class(), "CHECKPOINT_FAILED");
    }
}
