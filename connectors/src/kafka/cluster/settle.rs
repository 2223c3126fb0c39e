//! When a process acts on a rebalance, and whether it needs a new run.
//!
//! A change of membership rebalances each of the process's groups (the
//! source topics' and the repartition topic's) on its own; a member learns of
//! each by its own heartbeat, up to a heartbeat interval (100 ms) apart. A run
//! started after one group's rebalance would stop again at the other's, so
//! the runner waits until it has heard from every group since it last acted;
//! a change only one group sees (a member that lost one session) is acted on
//! once the assignment has been still for [`SETTLE`]. A newcomer's first
//! assignment in a group is empty: the cooperative protocol hands it its
//! partitions in a second round, once the others let them go, so that group
//! counts as heard only from its second round on (or after
//! [`SECOND_ROUND`]); a run started before it would have to take them on
//! inside the run, which needs a commit. A cooperative
//! rebalance's second round, which hands revoked partitions to their next
//! owner, reaches every member, also those whose share it leaves alone: a
//! run whose partitions stay the same goes on through it ([`must_restart`]).

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use super::link::TopicPartition;

/// How long the assignment must stay unchanged before a run starts on it
/// when not every group has rebalanced.
pub(crate) const SETTLE: Duration = Duration::from_millis(500);

/// How long the assignment must stay unchanged once every group has
/// rebalanced: a group's callbacks come in bursts (a revocation, then the
/// assignment that ends its round).
pub(crate) const QUIET: Duration = Duration::from_millis(50);

/// How long a newcomer waits for a group's second round, which comes once
/// the others committed what they let go, before it acts without it.
pub(crate) const SECOND_ROUND: Duration = Duration::from_secs(5);

/// The groups heard from since the runner last acted on the assignment.
#[derive(Debug, Default)]
pub(crate) struct Settling {
    heard: HashSet<String>,
    /// The groups whose first assignment was empty and whose second round
    /// has not come yet.
    due: HashSet<String>,
    /// When a group was last heard from; `None` once acted on.
    last: Option<Instant>,
}

impl Settling {
    /// `group` rebalanced at `now`.
    pub(crate) fn heard(&mut self, group: &str, now: Instant) {
        self.due.remove(group);
        self.heard.insert(group.to_owned());
        self.last = Some(now);
    }

    /// The newcomer's first assignment in `group`, empty, came at `now`:
    /// its partitions come in the group's second round.
    pub(crate) fn awaits_second_round(&mut self, group: &str, now: Instant) {
        self.due.insert(group.to_owned());
        self.last = Some(now);
    }

    /// Whether the runner may act at `now` on the assignment of a process
    /// in `groups` groups; when it may, what was heard is taken, so that the
    /// next change waits again for every group.
    pub(crate) fn take_settled(&mut self, groups: usize, now: Instant) -> bool {
        let settled = self.last.is_none_or(|last| {
            let still = now.saturating_duration_since(last);
            if !self.due.is_empty() {
                return still >= SECOND_ROUND;
            }
            still >= SETTLE || (self.heard.len() >= groups && still >= QUIET)
        });
        if settled {
            *self = Self::default();
        }
        settled
    }
}

/// Whether a settled assignment that makes the process own `owned` needs a
/// new run, beside the one running over `running`, if any.
pub(crate) fn must_restart(
    running: Option<&BTreeSet<TopicPartition>>,
    owned: &BTreeSet<TopicPartition>,
) -> bool {
    match running {
        Some(running) => running != owned,
        None => !owned.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn partitions(list: &[i32]) -> BTreeSet<TopicPartition> {
        list.iter().map(|p| ("in".to_owned(), *p)).collect()
    }

    #[test]
    fn the_runner_acts_once_every_group_rebalanced_and_the_burst_ended() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.heard("source", start);
        assert!(!settling.take_settled(2, start + 200 * MS));
        settling.heard("repartition", start + 300 * MS);
        assert!(!settling.take_settled(2, start + 320 * MS));
        assert!(settling.take_settled(2, start + 350 * MS));
    }

    #[test]
    fn a_change_only_one_group_sees_is_acted_on_once_still() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.heard("source", start);
        assert!(!settling.take_settled(2, start + SETTLE - MS));
        assert!(settling.take_settled(2, start + SETTLE));
    }

    #[test]
    fn the_next_change_waits_again_for_every_group() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.heard("source", start);
        settling.heard("repartition", start);
        assert!(settling.take_settled(2, start + QUIET));
        settling.heard("source", start + SETTLE);
        assert!(!settling.take_settled(2, start + SETTLE + QUIET));
    }

    #[test]
    fn a_newcomer_waits_for_the_second_round_of_every_group_whose_first_was_empty() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.awaits_second_round("source", start);
        settling.awaits_second_round("repartition", start);
        settling.heard("repartition", start + 10 * MS);
        assert!(!settling.take_settled(2, start + SETTLE + 10 * MS));
        settling.heard("source", start + SETTLE + 100 * MS);
        assert!(!settling.take_settled(2, start + SETTLE + 120 * MS));
        assert!(settling.take_settled(2, start + SETTLE + 150 * MS));
    }

    #[test]
    fn a_second_round_that_never_comes_is_waited_for_a_while() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.awaits_second_round("source", start);
        settling.heard("repartition", start);
        assert!(!settling.take_settled(2, start + SECOND_ROUND - MS));
        assert!(settling.take_settled(2, start + SECOND_ROUND));
    }

    #[test]
    fn with_nothing_heard_the_assignment_is_settled() {
        assert!(Settling::default().take_settled(2, Instant::now()));
    }

    #[test]
    fn a_process_in_one_group_waits_only_for_its_burst_to_end() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.heard("source", start);
        assert!(!settling.take_settled(1, start + QUIET - MS));
        assert!(settling.take_settled(1, start + QUIET));
    }

    #[test]
    fn a_run_goes_on_through_a_rebalance_that_moves_none_of_its_partitions() {
        let running = partitions(&[0, 1]);
        assert!(!must_restart(Some(&running), &partitions(&[0, 1])));
    }

    #[test]
    fn a_run_restarts_when_its_partitions_change() {
        let running = partitions(&[0, 1]);
        assert!(must_restart(Some(&running), &partitions(&[0, 1, 2])));
        assert!(must_restart(Some(&running), &partitions(&[1])));
        assert!(must_restart(Some(&running), &partitions(&[])));
    }

    #[test]
    fn a_run_starts_only_over_some_partitions() {
        assert!(must_restart(None, &partitions(&[3])));
        assert!(!must_restart(None, &partitions(&[])));
    }
}
