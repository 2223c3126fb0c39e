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

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::{run, Step::Record, Step::Watermark};

    #[test]
    fn every_item_is_emitted_in_order_with_its_records_event_time() {
        let steps = [
            Record("to be", 10),
            Record("", 20),
            Watermark(20),
            Record("or", 30),
        ];
        // The empty line yields nothing, not an empty word.
        let expected = [
            Emitted::Record("to", 10),
            Emitted::Record("be", 10),
            Emitted::Watermark(20),
            Emitted::Record("or", 30),
        ];
        let words = |_: &_| Ok(FlatMap(|line: &'static str| line.split_whitespace()));
        assert_eq!(run("flat_map", words, steps), expected);
    }
}
