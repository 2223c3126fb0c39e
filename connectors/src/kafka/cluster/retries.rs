//! When a process whose runs keep failing tries again, and when it gives up.
//!
//! A failure on the cluster itself (`CHECKPOINT_FAILED`: a restore or commit
//! that could not reach a broker, a leader or coordinator that moved) passes
//! once Kafka has recovered, which after a broker's crash can take longer
//! than three quick attempts: such failures are tried again, each a little
//! later, for the retry timeout (Kafka Streams' `task.timeout.ms`). Any
//! other failure (a sink's or source's own error) ends the process after
//! [`MAX_FAILED_RUNS`] runs in a row, as it would every time.

use std::time::{Duration, Instant};

use rtflow_runtime::RtflowError;

/// How many runs in a row may fail before the process gives up.
pub(crate) const MAX_FAILED_RUNS: u32 = 3;

/// The wait before the first retry; it doubles with each failure after it.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The failed runs of one generation of the group, in a row.
#[derive(Debug)]
pub(crate) struct Retries {
    /// How long failures on the cluster are tried again.
    timeout: Duration,
    in_a_row: u32,
    /// When the first failure in a row happened.
    since: Option<Instant>,
}

/// What to do after a failed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Start the next run, not before then.
    RetryAt(Instant),
    GiveUp,
}

impl Retries {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            in_a_row: 0,
            since: None,
        }
    }

    /// How many runs failed in a row.
    pub(crate) fn in_a_row(&self) -> u32 {
        self.in_a_row
    }

    /// A run failed, or did not start, at `now` with `error`.
    pub(crate) fn failed(&mut self, error: &RtflowError, now: Instant) -> Verdict {
        self.in_a_row += 1;
        let since = *self.since.get_or_insert(now);
        let on_the_cluster = matches!(error, RtflowError::Checkpoint(_));
        let patience = if on_the_cluster {
            self.timeout
        } else {
            Duration::ZERO
        };
        if self.in_a_row >= MAX_FAILED_RUNS && now.duration_since(since) >= patience {
            return Verdict::GiveUp;
        }
        let doublings = (self.in_a_row - 1).min(16);
        Verdict::RetryAt(now + (FIRST_BACKOFF * 2u32.pow(doublings)).min(MAX_BACKOFF))
    }

    /// The group moved on to a new generation: what failed before it may
    /// have failed for the assignment it replaced.
    pub(crate) fn reset(&mut self) {
        self.in_a_row = 0;
        self.since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_the_cluster() -> RtflowError {
        RtflowError::Checkpoint("could not read the changelog's end".into())
    }

    fn of_a_sink() -> RtflowError {
        RtflowError::sink("kafka", "a message without a topic")
    }

    #[test]
    fn a_sink_error_ends_the_process_after_three_runs_in_a_row() {
        let start = Instant::now();
        let mut retries = Retries::new(Duration::from_secs(300));
        assert!(matches!(
            retries.failed(&of_a_sink(), start),
            Verdict::RetryAt(_)
        ));
        assert!(matches!(
            retries.failed(&of_a_sink(), start),
            Verdict::RetryAt(_)
        ));
        assert_eq!(retries.failed(&of_a_sink(), start), Verdict::GiveUp);
    }

    #[test]
    fn failures_on_the_cluster_are_tried_again_until_the_timeout_passed() {
        let start = Instant::now();
        let seconds = |s| start + Duration::from_secs(s);
        let mut retries = Retries::new(Duration::from_secs(60));
        for at in [0, 1, 5, 30, 59] {
            assert!(
                matches!(
                    retries.failed(&on_the_cluster(), seconds(at)),
                    Verdict::RetryAt(_)
                ),
                "gave up at {at} s"
            );
        }
        assert_eq!(
            retries.failed(&on_the_cluster(), seconds(60)),
            Verdict::GiveUp
        );
    }

    #[test]
    fn a_timeout_of_zero_gives_up_after_three_runs_as_for_any_failure() {
        let start = Instant::now();
        let mut retries = Retries::new(Duration::ZERO);
        retries.failed(&on_the_cluster(), start);
        retries.failed(&on_the_cluster(), start);
        assert_eq!(retries.failed(&on_the_cluster(), start), Verdict::GiveUp);
    }

    #[test]
    fn each_retry_waits_twice_as_long_as_the_one_before_up_to_five_seconds() {
        let start = Instant::now();
        let mut retries = Retries::new(Duration::from_secs(3600));
        let waits: Vec<Duration> = (0..10)
            .map(|_| match retries.failed(&on_the_cluster(), start) {
                Verdict::RetryAt(at) => at - start,
                Verdict::GiveUp => panic!("gave up within the timeout"),
            })
            .collect();
        let ms = |ms| Duration::from_millis(ms);
        assert_eq!(waits[..4], [ms(100), ms(200), ms(400), ms(800)]);
        assert_eq!(waits[6..], [ms(5000); 4]);
    }

    #[test]
    fn a_new_generation_starts_the_count_again() {
        let start = Instant::now();
        let mut retries = Retries::new(Duration::ZERO);
        retries.failed(&of_a_sink(), start);
        retries.failed(&of_a_sink(), start);
        retries.reset();
        assert_eq!(retries.in_a_row(), 0);
        assert!(matches!(
            retries.failed(&of_a_sink(), start),
            Verdict::RetryAt(_)
        ));
    }
}
