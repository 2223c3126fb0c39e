//! `map`: one output per input.

use rtflow_runtime::{Collector, Operator, Record, Result};

/// Applies a function to every record's value.
pub struct Map<F>(pub F);

impl<In, Out, F> Operator<In, Out> for Map<F>
where
    F: Fn(In) -> Out + Send + 'static,
{
    fn allowlisted() -> bool {
        true
    }

    #[inline]
    fn process(&mut self, record: Record<In>, out: &mut Collector<'_, Out>) -> Result<()> {
        out.emit((self.0)(record.value))
    }
}
