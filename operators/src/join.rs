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

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{self, Record, Watermark};

    /// (user, item)
    type Order = (u32, &'static str);

    fn users() -> StaticTable<u32, &'static str> {
        StaticTable::from_rows("users", [(1, "ada"), (2, "grace"), (1, "lovelace")])
    }

    fn user(order: &Order) -> u32 {
        order.0
    }

    fn orders() -> [Step<Order>; 4] {
        [
            Record((1, "pen"), 10),
            Record((3, "ink"), 20),
            Watermark(25),
            Record((2, "cap"), 30),
        ]
    }

    #[test]
    fn an_inner_join_emits_a_pair_per_matching_row_and_drops_the_unmatched() {
        let expected = [
            Emitted::Record(((1, "pen"), "ada"), 10),
            Emitted::Record(((1, "pen"), "lovelace"), 10),
            Emitted::Watermark(25),
            Emitted::Record(((2, "cap"), "grace"), 30),
        ];
        let join = |_: &_| {
            Ok(BroadcastJoin {
                table: users(),
                key: user,
            })
        };
        assert_eq!(run("broadcast_join", join, orders()), expected);
    }

    #[test]
    fn a_left_join_emits_none_for_a_record_without_a_matching_row() {
        let expected = [
            Emitted::Record(((1, "pen"), Some("ada")), 10),
            Emitted::Record(((1, "pen"), Some("lovelace")), 10),
            Emitted::Record(((3, "ink"), None), 20),
            Emitted::Watermark(25),
            Emitted::Record(((2, "cap"), Some("grace")), 30),
        ];
        let join = |_: &_| {
            Ok(BroadcastLeftJoin {
                table: users(),
                key: user,
            })
        };
        assert_eq!(run("broadcast_left_join", join, orders()), expected);
    }
}
