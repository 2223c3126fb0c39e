//! When keyed state expires, in event time: which keys to look at when the
//! watermark passes a time, without scanning the whole state.
//!
//! The schedule is derived from the checkpointed state, never checkpointed
//! itself: an operator rebuilds it from its state after a start, then schedules
//! every insert. A key may be listed more than once; whoever takes it checks
//! its state.

use std::collections::BTreeMap;

use rtflow_runtime::EventTime;

/// Keys an operator evicts when the watermark advances; the rest go a few per
/// record after it (see [`Expiries::expire`]).
pub(crate) const EVICT_PER_WATERMARK: usize = 64;

/// Keys evicted per record while expired ones are left, by an operator whose
/// record schedules one key: one more, so eviction keeps up with any input.
pub(crate) const EVICT_PER_RECORD: usize = 2;

/// Keys by the event time after which they may expire.
pub(crate) struct Expiries<K> {
    at: BTreeMap<EventTime, Vec<K>>,
    /// Whether the last [`expire`](Self::expire) left keys due: those of an
    /// operator's records that it keeps evicting after a watermark.
    behind: bool,
}

impl<K> Expiries<K> {
    pub(crate) fn new() -> Self {
        Self {
            at: BTreeMap::new(),
            behind: false,
        }
    }

    /// `key` may expire once the watermark passes `time`.
    pub(crate) fn schedule(&mut self, time: EventTime, key: K) {
        self.at.entry(time).or_default().push(key);
    }

    /// Hands `expire` at most `budget` of the keys scheduled before `limit`,
    /// the earliest first, removing them from the schedule; whether more are
    /// due is [`behind`](Self::behind) until the next call. For an operator
    /// that spreads its evictions over the records after a watermark instead
    /// of stalling them all at once.
    pub(crate) fn expire(&mut self, limit: EventTime, budget: usize, expire: impl FnMut(K)) {
        self.behind = self.take(limit, budget, expire);
    }

    /// The earliest time a key is scheduled for: an operator that owes output
    /// for the keys due holds its watermark back to it.
    pub(crate) fn earliest(&self) -> Option<EventTime> {
        self.at.first_key_value().map(|(time, _)| *time)
    }

    /// Whether the last [`expire`](Self::expire) left keys due. Later
    /// schedules do not change it: they are for times the watermark has not
    /// passed yet.
    pub(crate) fn behind(&self) -> bool {
        self.behind
    }

    /// Takes keys for [`expire`](Self::expire); returns whether more are due.
    fn take(&mut self, limit: EventTime, mut budget: usize, mut expire: impl FnMut(K)) -> bool {
        while let Some(mut entry) = self.at.first_entry() {
            if *entry.key() >= limit {
                return false;
            }
            if budget == 0 {
                return true;
            }
            let keys = entry.get_mut();
            let taken = keys.len().min(budget);
            budget -= taken;
            keys.drain(keys.len() - taken..).for_each(&mut expire);
            if keys.is_empty() {
                entry.remove();
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiries_hand_out_the_keys_scheduled_before_the_watermark_once() {
        let mut expiries = Expiries::new();
        expiries.schedule(10, "a");
        expiries.schedule(5, "b");
        expiries.schedule(10, "c");
        expiries.schedule(20, "d");
        let mut due = |limit| {
            let mut keys = Vec::new();
            expiries.expire(limit, usize::MAX, |key| keys.push(key));
            assert!(!expiries.behind());
            keys
        };
        assert_eq!(due(10), ["b"]);
        assert_eq!(due(11), ["a", "c"]);
        assert!(due(11).is_empty());
        assert_eq!(due(i64::MAX), ["d"]);
    }

    #[test]
    fn expire_hands_out_at_most_its_budget_and_says_whether_more_are_due() {
        let mut expiries = Expiries::new();
        for (time, key) in [(5, "a"), (5, "b"), (5, "c"), (7, "d"), (9, "e")] {
            expiries.schedule(time, key);
        }
        let mut taken = Vec::new();
        expiries.expire(9, 2, |key| taken.push(key));
        assert!(expiries.behind());
        assert_eq!(taken.len(), 2);
        // The rest of time 5, then time 7, which ends what is due before 9.
        expiries.expire(9, 2, |key| taken.push(key));
        assert!(!expiries.behind());
        taken.sort();
        assert_eq!(taken, ["a", "b", "c", "d"]);
        // Nothing due: no key handed out, whatever the budget.
        expiries.expire(9, 10, |key| taken.push(key));
        assert!(!expiries.behind());
        assert_eq!(taken.len(), 4);
        // A zero budget takes nothing but still tells that keys are due.
        expiries.expire(10, 0, |key| taken.push(key));
        assert!(expiries.behind());
        expiries.expire(10, 1, |key| taken.push(key));
        assert!(!expiries.behind());
        assert_eq!(taken.last(), Some(&"e"));
    }
}
