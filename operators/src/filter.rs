//! `filter`: keeps the records a predicate accepts.

use rtflow_runtime::{Collector, Operator, Record, Result};

/// Passes on the records for which the predicate holds.
pub struct Filter<F>(pub F);

impl<T, F> Operator<T, T> for Filter<F>
where
    F: Fn(&T) -> bool + Send + 'static,
{
    fn allowlisted() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<T>, out: &mut Collector<'_, T>) -> Result<()> {
        if (self.0)(&record.value) {
            out.emit_record(record)?;
        }
        Ok(())
    }
}
