//! Stream-static joins: each record is looked up in a [`StaticTable`] broadcast to
//! every instance, so no shuffle is needed.

use std::hash::Hash;

use rtflow_runtime::{Collector, Data, Operator, Record, Result, StaticTable};

/// Inner stream-static join: one `(record, row)` per matching row; records without
/// a match are dropped.
pub struct BroadcastJoin<K, V, F> {
    pub table: StaticTable<K, V>,
    pub key: F,
}

/// Left outer stream-static join: one `(record, Some(row))` per matching row, or
/// one `(record, None)` when nothing matches.
pub struct BroadcastLeftJoin<K, V, F> {
    pub table: StaticTable<K, V>,
    pub key: F,
}

/// Emits `wrap(row)` next to the value for every row, cloning the value for all
/// but the last.
fn emit_matches<T: Clone, V: Clone, W>(
    value: T,
    rows: &[V],
    out: &mut Collector<'_, (T, W)>,
    wrap: impl Fn(V) -> W,
) -> Result<()> {
    let Some((last, rest)) = rows.split_last() else {
        return Ok(());
    };
    for row in rest {
        out.emit((value.clone(), wrap(row.clone())))?;
    }
    out.emit((value, wrap(last.clone())))
}

impl<T, K, V, F> Operator<T, (T, V)> for BroadcastJoin<K, V, F>
where
    T: Data,
    K: Eq + Hash + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
    F: Fn(&T) -> K + Send + 'static,
{
    fn allowlisted() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<T>, out: &mut Collector<'_, (T, V)>) -> Result<()> {
        let rows = self.table.get(&(self.key)(&record.value));
        emit_matches(record.value, rows, out, |row| row)
    }
}

impl<T, K, V, F> Operator<T, (T, Option<V>)> for BroadcastLeftJoin<K, V, F>
where
    T: Data,
    K: Eq + Hash + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
    F: Fn(&T) -> K + Send + 'static,
{
    fn allowlisted() -> bool {
        true
    }

    #[inline]
    fn process(
        &mut self,
        record: Record<T>,
        out: &mut Collector<'_, (T, Option<V>)>,
    ) -> Result<()> {
        let rows = self.table.get(&(self.key)(&record.value));
        if rows.is_empty() {
            return out.emit((record.value, None));
        }
        emit_matches(record.value, rows, out, Some)
    }
}
