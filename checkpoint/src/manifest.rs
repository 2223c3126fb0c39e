//! The manifest of one committed epoch, and its checksummed encoding.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::snapshot::{StateChain, StateId};
use crate::Epoch;

/// Next offset per partition label (as each source names its partitions).
pub type Offsets = BTreeMap<String, i64>;

/// Everything needed to resume after `epoch`. Written last, after everything it
/// refers to, so a manifest that reads back intact describes a complete checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub epoch: Epoch,
    /// The query's id, kept across restarts.
    pub query_id: String,
    /// The event-time watermark reached by the epoch, if any.
    pub watermark: Option<i64>,
    /// Per source operator, where its readers resume.
    pub sources: BTreeMap<String, Offsets>,
    /// Per state, the snapshot blobs that rebuild it.
    pub state: BTreeMap<StateId, StateChain>,
    /// How many key groups keyed state is spread over; fixed for a checkpoint's life.
    pub key_groups: u32,
    /// When the manifest was written (ms since the Unix epoch).
    pub committed_at_ms: u64,
    /// The run of the query that committed the checkpoint. With the epoch it is
    /// the checkpoint's identity: epochs are unique within a run and every start
    /// is a new run, so a checkpoint that a rollback numbers like a lost one
    /// still differs from it, and output published for the lost one is known
    /// for what it is.
    pub run_id: String,
}

/// A manifest as versions of rtflow before [`Manifest::run_id`] wrote it.
#[derive(Serialize, Deserialize)]
struct Unnamed {
    epoch: Epoch,
    query_id: String,
    watermark: Option<i64>,
    sources: BTreeMap<String, Offsets>,
    state: BTreeMap<StateId, StateChain>,
    key_groups: u32,
    committed_at_ms: u64,
}

impl From<Unnamed> for Manifest {
    /// Its run is unknown: the empty id, which no run has.
    fn from(old: Unnamed) -> Self {
        Self {
            epoch: old.epoch,
            query_id: old.query_id,
            watermark: old.watermark,
            sources: old.sources,
            state: old.state,
            key_groups: old.key_groups,
            committed_at_ms: old.committed_at_ms,
            run_id: String::new(),
        }
    }
}

/// A stored manifest whose checksum does not match its bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the manifest of epoch {epoch} is corrupt: {reason}")]
pub struct Corrupt {
    pub epoch: Epoch,
    pub reason: String,
}

impl Manifest {
    /// The manifest's bytes followed by their CRC-32.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = bincode::serde::encode_to_vec(self, bincode::config::standard())
            .expect("a manifest always encodes");
        let checksum = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&checksum.to_le_bytes());
        bytes
    }

    /// Reads back what `encode` wrote, checking the checksum.
    pub fn decode(epoch: Epoch, bytes: &[u8]) -> Result<Self, Corrupt> {
        let corrupt = |reason: &str| Corrupt {
            epoch,
            reason: reason.to_owned(),
        };
        let split = bytes
            .len()
            .checked_sub(4)
            .ok_or_else(|| corrupt("shorter than its checksum"))?;
        let (body, checksum) = bytes.split_at(split);
        let expected = u32::from_le_bytes(checksum.try_into().expect("four bytes"));
        if crc32fast::hash(body) != expected {
            return Err(corrupt("checksum mismatch"));
        }
        let manifest: Self =
            match bincode::serde::decode_from_slice(body, bincode::config::standard()) {
                Ok((manifest, _)) => manifest,
                // The checksum held, so the bytes are as written: by a version of
                // rtflow before checkpoints had a run id.
                Err(error) => bincode::serde::decode_from_slice::<Unnamed, _>(
                    body,
                    bincode::config::standard(),
                )
                .map(|(unnamed, _)| unnamed.into())
                .map_err(|_| corrupt(&error.to_string()))?,
            };
        if manifest.epoch != epoch {
            return Err(corrupt("stored under another epoch"));
        }
        Ok(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            epoch: 3,
            query_id: "q".into(),
            watermark: Some(42),
            sources: BTreeMap::from([("kafka-0".into(), Offsets::from([("t-0".into(), 17)]))]),
            state: BTreeMap::new(),
            key_groups: 128,
            committed_at_ms: 1,
            run_id: "run".into(),
        }
    }

    #[test]
    fn round_trips() {
        assert_eq!(Manifest::decode(3, &manifest().encode()), Ok(manifest()));
    }

    #[test]
    fn a_manifest_written_before_run_ids_decodes_with_an_unknown_run() {
        let current = manifest();
        let old = Unnamed {
            epoch: current.epoch,
            query_id: current.query_id.clone(),
            watermark: current.watermark,
            sources: current.sources.clone(),
            state: current.state.clone(),
            key_groups: current.key_groups,
            committed_at_ms: current.committed_at_ms,
        };
        let mut bytes = bincode::serde::encode_to_vec(&old, bincode::config::standard()).unwrap();
        bytes.extend_from_slice(&crc32fast::hash(&bytes).to_le_bytes());
        let decoded = Manifest::decode(3, &bytes).unwrap();
        assert_eq!(decoded.run_id, "");
        assert_eq!(
            decoded,
            Manifest {
                run_id: String::new(),
                ..current
            }
        );
    }

    #[test]
    fn any_flipped_bit_or_truncation_is_detected() {
        let bytes = manifest().encode();
        for i in 0..bytes.len() {
            let mut torn = bytes.clone();
            torn[i] ^= 0x10;
            assert!(Manifest::decode(3, &torn).is_err(), "flip at byte {i}");
        }
        for len in 0..bytes.len() {
            assert!(
                Manifest::decode(3, &bytes[..len]).is_err(),
                "truncated to {len}"
            );
        }
        assert!(Manifest::decode(4, &bytes).is_err(), "wrong epoch");
    }
}
