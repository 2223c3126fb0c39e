//! Key groups: a shuffle hashes each key with [`stable_hash`] (the same in every
//! process and run) into one of a fixed number of key groups, and each subtask
//! owns a contiguous range of them. Keyed state is checkpointed by key group,
//! so a restore at another parallelism moves whole groups between subtasks.

use std::hash::{Hash, Hasher};

/// The key group of a key hash: the unit in which keyed state moves between actors.
pub fn key_group(hash: u64, max_key_groups: usize) -> usize {
    (hash % max_key_groups as u64) as usize
}

/// The subtask that owns `key_group` (Flink's contiguous key-group ranges).
pub fn subtask_for_key_group(key_group: usize, max_key_groups: usize, parallelism: usize) -> usize {
    key_group * parallelism / max_key_groups
}

/// A hash of `key` that is the same in every process and run, so keyed state
/// restored from a checkpoint lands on the actor that owns its key group.
pub fn stable_hash<K: Hash + ?Sized>(key: &K) -> u64 {
    let mut hasher = StableHasher(0xcbf2_9ce4_8422_2325);
    key.hash(&mut hasher);
    hasher.finish()
}

/// FNV-1a with a final avalanche so that the low bits used for key groups mix well.
struct StableHasher(u64);

impl Hasher for StableHasher {
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    // Integers hash as little-endian 64-bit values, so a key hashes the same on
    // every platform.
    fn write_u16(&mut self, n: u16) {
        self.write(&u64::from(n).to_le_bytes());
    }

    fn write_u32(&mut self, n: u32) {
        self.write(&u64::from(n).to_le_bytes());
    }

    fn write_u64(&mut self, n: u64) {
        self.write(&n.to_le_bytes());
    }

    fn write_usize(&mut self, n: usize) {
        self.write(&(n as u64).to_le_bytes());
    }

    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_hash_is_fixed_across_runs() {
        // Pinned values: keyed state in checkpoints depends on them never changing.
        assert_eq!(stable_hash(&42u64), 0xa624_5a5d_cf27_8758);
        assert_eq!(stable_hash("user-1"), 0xa299_24b8_7e5d_9430);
        assert_ne!(stable_hash("a"), stable_hash("b"));
    }

    #[test]
    fn key_groups_spread_evenly_over_subtasks() {
        let mut per_subtask = [0usize; 3];
        for key in 0..30_000u64 {
            let group = key_group(stable_hash(&key), 128);
            per_subtask[subtask_for_key_group(group, 128, 3)] += 1;
        }
        for count in per_subtask {
            assert!((9_000..11_000).contains(&count), "{per_subtask:?}");
        }
    }

    #[test]
    fn key_group_ranges_are_contiguous() {
        let owners: Vec<usize> = (0..128).map(|g| subtask_for_key_group(g, 128, 4)).collect();
        assert!(owners.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(owners[0], 0);
        assert_eq!(owners[127], 3);
    }
}
