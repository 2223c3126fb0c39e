//! [`StaticTable`]: the static side of a stream-static join, broadcast to every
//! instance of the joining operator.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

/// An immutable keyed table shared by every actor that joins against it. A key
/// may have several rows; a join emits one output per matching row.
///
/// ```
/// use rtflow_runtime::StaticTable;
/// let users = StaticTable::from_rows("users", vec![(1, "ada"), (2, "grace"), (1, "lovelace")]);
/// assert_eq!(users.get(&1), &["ada", "lovelace"]);
/// assert!(users.get(&3).is_empty());
/// ```
pub struct StaticTable<K, V> {
    name: Arc<str>,
    rows: Arc<HashMap<K, Vec<V>>>,
    len: usize,
}

impl<K, V> Clone for StaticTable<K, V> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            rows: self.rows.clone(),
            len: self.len,
        }
    }
}

impl<K: Eq + Hash, V> StaticTable<K, V> {
    /// A table of `(key, row)` pairs, in the order given per key.
    pub fn from_rows(name: &str, rows: impl IntoIterator<Item = (K, V)>) -> Self {
        let mut by_key: HashMap<K, Vec<V>> = HashMap::new();
        let mut len = 0;
        for (key, row) in rows {
            by_key.entry(key).or_default().push(row);
            len += 1;
        }
        Self {
            name: name.into(),
            rows: Arc::new(by_key),
            len,
        }
    }

    /// The rows stored under `key`.
    pub fn get(&self, key: &K) -> &[V] {
        self.rows.get(key).map_or(&[], Vec::as_slice)
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many rows the table holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table holds no row.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
