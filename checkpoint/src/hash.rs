//! A fast hasher for maps keyed by what records carry: the keyed state of the
//! runtime and the map that merges snapshot deltas at restore.
//!
//! std's SipHash costs more than the map operation around it for small keys,
//! and a restart rebuilds maps of millions of keys. This hasher mixes each word
//! with one folded multiply (a 64 x 64 -> 128-bit product whose halves are
//! xored). It is not a cryptographic PRF: it resists collision flooding the way
//! `ahash` and `foldhash` do, by starting every map from a random seed, so the
//! keys that collide differ between maps and processes and cannot be chosen
//! ahead.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// The odd fractional digits of pi: a multiplier whose bits are evenly mixed,
/// so that both halves of the product depend on every input bit.
const MULTIPLIER: u64 = 0x243f_6a88_85a3_08d3;

/// Builds [`FastHasher`]s from a seed drawn at random for each map.
#[derive(Clone, Debug)]
pub struct FastState {
    seed: u64,
}

impl FastState {
    /// A new random seed, taken from std's `RandomState` (seeded by the OS).
    pub fn new() -> Self {
        Self {
            seed: RandomState::new().hash_one(MULTIPLIER),
        }
    }
}

impl Default for FastState {
    fn default() -> Self {
        Self::new()
    }
}

impl BuildHasher for FastState {
    type Hasher = FastHasher;

    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher { state: self.seed }
    }
}

/// The hasher of [`FastState`].
#[derive(Clone, Debug)]
pub struct FastHasher {
    state: u64,
}

#[inline]
fn folded_multiply(x: u64, y: u64) -> u64 {
    let product = u128::from(x) * u128::from(y);
    (product as u64) ^ ((product >> 64) as u64)
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // The length first, so that bytes padded with zeros into the last word
        // do not collide with the same bytes followed by zeros.
        self.write_usize(bytes.len());
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.write_u64(u64::from_le_bytes(word.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(last));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i.into());
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.write_u64(i.into());
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i.into());
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.state = folded_multiply(self.state ^ i, MULTIPLIER);
    }

    #[inline]
    fn write_u128(&mut self, i: u128) {
        self.write_u64(i as u64);
        self.write_u64((i >> 64) as u64);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn maps_are_seeded_apart() {
        let (a, b) = (FastState::new(), FastState::new());
        assert_ne!(a.hash_one(7u64), b.hash_one(7u64));
        assert_eq!(a.hash_one(7u64), a.clone().hash_one(7u64));
    }

    #[test]
    fn padding_and_boundaries_do_not_collide() {
        let state = FastState::new();
        let hashes: HashSet<u64> = [&b""[..], b"\0", b"ab", b"ab\0", b"abcdefgh", b"abcdefgh\0"]
            .iter()
            .map(|bytes| state.hash_one(bytes))
            .collect();
        assert_eq!(hashes.len(), 6);
        assert_ne!(state.hash_one(("ab", "c")), state.hash_one(("a", "bc")));
    }

    #[test]
    fn sequential_keys_spread_over_buckets_and_tags() {
        let state = FastState::new();
        let (mut low, mut high) = (vec![0u32; 1024], vec![0u32; 128]);
        for key in 0..1_024_000u64 {
            let hash = state.hash_one(key);
            low[(hash & 1023) as usize] += 1;
            high[(hash >> 57) as usize] += 1;
        }
        // 1000 expected per bucket and 8000 per tag.
        assert!(low.iter().all(|n| (800..1200).contains(n)), "{low:?}");
        assert!(high.iter().all(|n| (7200..8800).contains(n)), "{high:?}");
    }
}
