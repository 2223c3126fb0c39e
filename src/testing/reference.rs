//! Batch references and comparisons: what a batch job over the whole input
//! answers, and whether a streaming query's committed results equal it.
//!
//! The comparisons return `Err(TestCaseError)` naming what differs, so a property
//! uses them with `?` and proptest shrinks the input that makes them fail.
//!
//! ```
//! use rtflow::testing::reference;
//!
//! let input = ["a", "b", "a"];
//! // A running count after key_by emits the updated count per record.
//! let updates = reference::running_counts(input, |word| *word);
//! assert_eq!(updates, vec![("a", 1), ("b", 1), ("a", 2)]);
//! assert!(reference::assert_same_multiset([("a", 2), ("a", 1), ("b", 1)], updates.clone()).is_ok());
//! assert!(reference::assert_same_per_key([("a", 2), ("a", 1), ("b", 1)], updates).is_err());
//! ```

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::AddAssign;

use proptest::test_runner::TestCaseError;

/// How many differing items a failure lists.
const SHOWN: usize = 10;

/// The number of records per key.
///
/// ```
/// let counts = rtflow::testing::reference::counts(["a", "b", "a"], |w| *w);
/// assert_eq!(counts, [("a", 2), ("b", 1)].into());
/// ```
pub fn counts<T, K: Ord>(
    input: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> K,
) -> BTreeMap<K, u64> {
    let mut counts = BTreeMap::new();
    for record in input {
        *counts.entry(key(&record)).or_default() += 1;
    }
    counts
}

/// The sum of `value` per key.
///
/// ```
/// let sums = rtflow::testing::reference::sums([("a", 2), ("b", 5), ("a", 3)], |r| r.0, |r| r.1);
/// assert_eq!(sums, [("a", 5), ("b", 5)].into());
/// ```
pub fn sums<T, K: Ord, V: AddAssign + Default>(
    input: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> K,
    value: impl Fn(&T) -> V,
) -> BTreeMap<K, V> {
    let mut sums = BTreeMap::new();
    for record in input {
        *sums.entry(key(&record)).or_default() += value(&record);
    }
    sums
}

/// What `key_by(key).count()` emits for `input` in that order: the updated count
/// of the record's key, per record.
///
/// ```
/// let updates = rtflow::testing::reference::running_counts(["x", "x"], |w| *w);
/// assert_eq!(updates, vec![("x", 1), ("x", 2)]);
/// ```
pub fn running_counts<T, K: Ord + Clone>(
    input: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> K,
) -> Vec<(K, u64)> {
    running_sums(input, key, |_| 1u64)
}

/// What `key_by(key).sum(value)` emits for `input` in that order: the updated sum
/// of the record's key, per record.
///
/// ```
/// let updates = rtflow::testing::reference::running_sums([("a", 2), ("a", 3)], |r| r.0, |r| r.1);
/// assert_eq!(updates, vec![("a", 2), ("a", 5)]);
/// ```
pub fn running_sums<T, K: Ord + Clone, V: AddAssign + Default + Clone>(
    input: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> K,
    value: impl Fn(&T) -> V,
) -> Vec<(K, V)> {
    let mut sums: BTreeMap<K, V> = BTreeMap::new();
    input
        .into_iter()
        .map(|record| {
            let key = key(&record);
            let sum = sums.entry(key.clone()).or_default();
            *sum += value(&record);
            (key, sum.clone())
        })
        .collect()
}

/// The values of each key, in the order they come.
///
/// ```
/// let grouped = rtflow::testing::reference::per_key([("a", 1), ("b", 2), ("a", 3)]);
/// assert_eq!(grouped, [("a", vec![1, 3]), ("b", vec![2])].into());
/// ```
pub fn per_key<K: Ord, V>(rows: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, Vec<V>> {
    let mut grouped: BTreeMap<K, Vec<V>> = BTreeMap::new();
    for (key, value) in rows {
        grouped.entry(key).or_default().push(value);
    }
    grouped
}

/// The last value of each key: the result an update stream converges to.
///
/// ```
/// let last = rtflow::testing::reference::latest([("a", 1), ("a", 2)]);
/// assert_eq!(last, [("a", 2)].into());
/// ```
pub fn latest<K: Ord, V>(rows: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, V> {
    rows.into_iter().collect()
}

/// Fails unless `actual` and `expected` hold the same items the same number of
/// times, in any order; the failure lists what is missing and what is extra.
///
/// ```
/// use rtflow::testing::reference::assert_same_multiset;
/// assert!(assert_same_multiset([2, 1, 2], [1, 2, 2]).is_ok());
/// let error = assert_same_multiset([1, 2, 2], [1, 2]).unwrap_err();
/// assert!(error.to_string().contains("extra (1): [2]"), "{error}");
/// ```
pub fn assert_same_multiset<T: Ord + Debug>(
    actual: impl IntoIterator<Item = T>,
    expected: impl IntoIterator<Item = T>,
) -> Result<(), TestCaseError> {
    let mut actual: Vec<T> = actual.into_iter().collect();
    let mut expected: Vec<T> = expected.into_iter().collect();
    actual.sort();
    expected.sort();
    let (mut missing, mut extra) = (Vec::new(), Vec::new());
    let (mut a, mut e) = (actual.iter().peekable(), expected.iter().peekable());
    loop {
        match (a.peek(), e.peek()) {
            (None, None) => break,
            (Some(x), Some(y)) if x == y => {
                a.next();
                e.next();
            }
            (Some(x), Some(y)) if x < y => extra.push(a.next().expect("peeked")),
            (Some(_), None) => extra.push(a.next().expect("peeked")),
            _ => missing.push(e.next().expect("peeked")),
        }
    }
    if missing.is_empty() && extra.is_empty() {
        return Ok(());
    }
    Err(TestCaseError::fail(format!(
        "the results differ from the reference as multisets ({} items, {} expected): \
         missing ({}): {:?}; extra ({}): {:?}",
        actual.len(),
        expected.len(),
        missing.len(),
        Shown(&missing),
        extra.len(),
        Shown(&extra),
    )))
}

/// Fails unless every key has the same values in the same order in `actual` and
/// `expected` (keys may interleave differently); the failure names the first key
/// that differs.
///
/// ```
/// use rtflow::testing::reference::assert_same_per_key;
/// assert!(assert_same_per_key([("b", 1), ("a", 1), ("a", 2)], [("a", 1), ("b", 1), ("a", 2)]).is_ok());
/// let error = assert_same_per_key([("a", 2), ("a", 1)], [("a", 1), ("a", 2)]).unwrap_err();
/// assert!(error.to_string().contains("key \"a\""), "{error}");
/// ```
pub fn assert_same_per_key<K: Ord + Debug, V: PartialEq + Debug>(
    actual: impl IntoIterator<Item = (K, V)>,
    expected: impl IntoIterator<Item = (K, V)>,
) -> Result<(), TestCaseError> {
    let actual = per_key(actual);
    let expected = per_key(expected);
    let empty = Vec::new();
    let keys = actual.keys().chain(expected.keys());
    for key in keys {
        let (got, want) = (
            actual.get(key).unwrap_or(&empty),
            expected.get(key).unwrap_or(&empty),
        );
        if got != want {
            return Err(TestCaseError::fail(format!(
                "key {key:?}: got {:?}, expected {:?}",
                Shown(got),
                Shown(want)
            )));
        }
    }
    Ok(())
}

/// Fails unless the maps are equal; the failure names the first key that differs.
///
/// ```
/// use std::collections::BTreeMap;
/// use rtflow::testing::reference::assert_same_map;
/// let counts = BTreeMap::from([("a", 2), ("b", 1)]);
/// assert!(assert_same_map(&counts, &counts).is_ok());
/// let error = assert_same_map(&counts, &BTreeMap::from([("a", 2)])).unwrap_err();
/// assert!(error.to_string().contains("\"b\": got Some(1), expected None"), "{error}");
/// ```
pub fn assert_same_map<K: Ord + Debug, V: PartialEq + Debug>(
    actual: &BTreeMap<K, V>,
    expected: &BTreeMap<K, V>,
) -> Result<(), TestCaseError> {
    for key in actual.keys().chain(expected.keys()) {
        let (got, want) = (actual.get(key), expected.get(key));
        if got != want {
            return Err(TestCaseError::fail(format!(
                "{key:?}: got {got:?}, expected {want:?} ({} keys, {} expected)",
                actual.len(),
                expected.len()
            )));
        }
    }
    Ok(())
}

/// The first few items of a long list.
struct Shown<'a, T>(&'a [T]);

impl<T: Debug> Debug for Shown<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        list.entries(self.0.iter().take(SHOWN));
        if self.0.len() > SHOWN {
            list.entry(&format_args!("... {} more", self.0.len() - SHOWN));
        }
        list.finish()
    }
}
