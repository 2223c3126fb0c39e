//! `flat_map`: zero or more outputs per input (Spark's `explode` is one).

use rtflow_runtime::{Collector, Operator, Record, Result};

/// Emits every item the function returns for a record, in order.
pub struct FlatMap<F>(pub F);

impl<In, Out, I, F> Operator<In, Out> for FlatMap<F>
where
    F: Fn(In) -> I + Send + 'static,
    I: IntoIterator<Item = Out>,
{
    fn allowlisted() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<In>, out: &mut Collector<'_, Out>) -> Result<()> {
        for item in (self.0)(record.value) {
            out.emit(item)?;
        }
        Ok(())
    }
}
