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

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::{run, Step::Record, Step::Watermark};

    #[test]
    fn the_records_the_predicate_accepts_pass_with_their_event_times() {
        let steps = [
            Record(1, 10),
            Record(2, 20),
            Record(4, 15),
            Watermark(18),
            Record(3, 30),
        ];
        let expected = [
            Emitted::Record(2, 20),
            Emitted::Record(4, 15),
            Emitted::Watermark(18),
        ];
        let even = |_: &_| Ok(Filter(|n: &u32| n.is_multiple_of(2)));
        assert_eq!(run("filter", even, steps), expected);
    }

    #[test]
    fn watermarks_pass_when_every_record_is_dropped() {
        let steps = [Record(1, 10), Watermark(10), Record(3, 20), Watermark(20)];
        let expected = [Emitted::Watermark(10), Emitted::Watermark(20)];
        let none = |_: &_| Ok(Filter(|_: &u32| false));
        assert_eq!(run("filter", none, steps), expected);
    }
}
