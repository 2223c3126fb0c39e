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

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::Emitted;

    use super::*;
    use rtflow_runtime::tester::{run, Step::Record, Step::Watermark};

    #[test]
    fn every_value_is_mapped_and_keeps_its_event_time() {
        let steps = [
            Record("a", 10),
            Record("abc", 5),
            Watermark(8),
            Record("", 20),
        ];
        let expected = [
            Emitted::Record(1, 10),
            Emitted::Record(3, 5),
            Emitted::Watermark(8),
            Emitted::Record(0, 20),
        ];
        let len = |_: &_| Ok(Map(|word: &str| word.len()));
        assert_eq!(run("map", len, steps), expected);
    }

    #[test]
    fn only_a_watermark_ahead_of_the_last_one_is_passed_on() {
        let steps = [Watermark(10), Watermark(10), Watermark(5), Watermark(12)];
        let expected = [Emitted::Watermark(10), Emitted::Watermark(12)];
        let double = |_: &_| Ok(Map(|n: u32| n * 2));
        assert_eq!(run("map", double, steps), expected);
    }
}
