//! Loading a [`StaticTable`] from a CSV file with a header row.

use std::hash::Hash;
use std::path::Path;

use rtflow_runtime::{Result, RtflowError, StaticTable};
use serde::de::DeserializeOwned;

/// Loads static tables from CSV files.
pub trait CsvTable<K, V>: Sized {
    /// Reads every row of `path` into `V` (columns matched by header name) and keys
    /// it with `key`.
    ///
    /// ```
    /// use rtflow_connectors::CsvTable;
    /// use rtflow_runtime::StaticTable;
    /// #[derive(Clone, serde::Deserialize)]
    /// struct User { id: u32, name: String }
    /// let path = std::env::temp_dir().join("rtflow-doc-users.csv");
    /// std::fs::write(&path, "id,name\n1,ada\n2,grace\n").unwrap();
    /// let users = StaticTable::from_csv(&path, |u: &User| u.id).unwrap();
    /// assert_eq!(users.get(&2)[0].name, "grace");
    /// ```
    fn from_csv(path: impl AsRef<Path>, key: impl Fn(&V) -> K) -> Result<Self>;
}

impl<K: Eq + Hash, V: DeserializeOwned> CsvTable<K, V> for StaticTable<K, V> {
    fn from_csv(path: impl AsRef<Path>, key: impl Fn(&V) -> K) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let error = |message: String| RtflowError::StaticTable {
            table: name.clone(),
            message,
        };
        let mut reader = csv::Reader::from_path(path).map_err(|e| error(e.to_string()))?;
        let mut rows = Vec::new();
        for row in reader.deserialize::<V>() {
            let row = row.map_err(|e| error(e.to_string()))?;
            rows.push((key(&row), row));
        }
        Ok(StaticTable::from_rows(&name, rows))
    }
}
