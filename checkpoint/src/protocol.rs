//! The checkpoint commit decision, free of I/O: which epoch is in flight, which
//! actors still owe their acknowledgement, and when the epoch is complete.
//!
//! One checkpoint is in flight at a time (as Flink's default): a trigger while the
//! previous epoch still waits for acknowledgements is skipped, so barriers never
//! pile up behind a slow actor.
//!
//! A clustered query commits an epoch in two parts: what its processes read
//! from source topics and wrote of those records first, the rest once every
//! actor acknowledged. The actors of the first part (its [first
//! tier](CheckpointTracker::set_first_tier)) complete it on their own, so that
//! it commits without waiting for the slowest actor of the rest.

use crate::Epoch;

/// Index of an actor among the query's actors.
pub type ActorId = usize;

/// An acknowledgement the protocol cannot accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AckError {
    #[error("actor {actor} acknowledged epoch {epoch}, but epoch {in_flight:?} is in flight")]
    UnexpectedEpoch {
        actor: ActorId,
        epoch: Epoch,
        in_flight: Option<Epoch>,
    },
    #[error("actor {actor} is not one of the query's {actors} actors")]
    UnknownActor { actor: ActorId, actors: usize },
    #[error("actor {actor} acknowledged epoch {epoch} twice")]
    Duplicate { actor: ActorId, epoch: Epoch },
}

/// The epoch in flight and what each actor acknowledged so far.
#[derive(Debug)]
struct InFlight<A> {
    epoch: Epoch,
    acks: Vec<Option<A>>,
    missing: usize,
    /// Whether [`CheckpointTracker::first_tier_complete`] reported it.
    first_tier_reported: bool,
}

/// Tracks checkpoints from trigger to completion; `A` is what an actor reports
/// with its acknowledgement (a source's offsets, a state snapshot's reference).
#[derive(Debug)]
pub struct CheckpointTracker<A> {
    actors: usize,
    next_epoch: Epoch,
    in_flight: Option<InFlight<A>>,
    last_completed: Option<Epoch>,
    /// Per finished actor, the report that stands for every later epoch, since a
    /// finished actor acknowledges nothing more.
    retired: Vec<Option<A>>,
    /// Per finished actor, its last report while no epoch has taken it yet (its
    /// final state changes must be committed exactly once).
    last_words: Vec<Option<A>>,
    /// The actors whose acknowledgements complete an epoch's first part.
    first_tier: Vec<ActorId>,
}

impl<A: Clone> CheckpointTracker<A> {
    /// A tracker for `actors` actors, resuming after `last_committed` (epochs start
    /// at 1).
    pub fn new(actors: usize, last_committed: Option<Epoch>) -> Self {
        Self {
            actors,
            next_epoch: last_committed.map_or(1, |epoch| epoch + 1),
            in_flight: None,
            last_completed: last_committed,
            retired: (0..actors).map(|_| None).collect(),
            last_words: (0..actors).map(|_| None).collect(),
            first_tier: Vec::new(),
        }
    }

    /// Names the actors whose acknowledgements alone complete the first part of
    /// an epoch ([`first_tier_complete`](Self::first_tier_complete)). None by
    /// default: an epoch then completes only as a whole.
    pub fn set_first_tier(&mut self, actors: impl IntoIterator<Item = ActorId>) {
        self.first_tier = actors.into_iter().filter(|a| *a < self.actors).collect();
    }

    /// The number the next epoch triggered will have.
    pub fn next_epoch(&self) -> Epoch {
        self.next_epoch
    }

    /// Numbers the next epochs after `epoch` too. Recovery passes it for the
    /// newest damaged checkpoint it passed over: that checkpoint's epoch may have
    /// published output (a transactional sink's commit record names it), which a
    /// new epoch of the same number would be taken for.
    pub fn number_after(&mut self, epoch: Epoch) {
        self.next_epoch = self.next_epoch.max(epoch + 1);
    }

    /// The acknowledgements a new epoch starts with: finished actors' reports.
    fn retired_acks(&mut self) -> Vec<Option<A>> {
        self.retired
            .iter()
            .zip(&mut self.last_words)
            .map(|(standing, last)| last.take().or_else(|| standing.clone()))
            .collect()
    }

    /// Starts the next epoch, or `None` while one is still in flight or when no
    /// actor is left to acknowledge it.
    pub fn trigger(&mut self) -> Option<Epoch> {
        let missing = self.retired.iter().filter(|r| r.is_none()).count();
        if self.in_flight.is_some() || missing == 0 {
            return None;
        }
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let acks = self.retired_acks();
        self.in_flight = Some(InFlight {
            epoch,
            acks,
            missing,
            first_tier_reported: false,
        });
        Some(epoch)
    }

    /// `actor` finished: `last` is its last word (taken by exactly one epoch), and
    /// `standing` stands in for it in every epoch after that. Returns the epoch in
    /// flight if that was the last acknowledgement it waited for.
    pub fn retire(&mut self, actor: ActorId, last: A, standing: A) -> Option<(Epoch, Vec<A>)> {
        if actor >= self.actors || self.retired[actor].is_some() {
            return None;
        }
        self.retired[actor] = Some(standing);
        match &self.in_flight {
            Some(in_flight) if in_flight.acks[actor].is_none() => {
                let epoch = in_flight.epoch;
                self.ack(actor, epoch, last).ok().flatten()
            }
            _ => {
                self.last_words[actor] = Some(last);
                None
            }
        }
    }

    /// Once every actor finished and no epoch is in flight: the final epoch, if
    /// some actor's last word is not committed yet. It completes at once.
    pub fn finish(&mut self) -> Option<(Epoch, Vec<A>)> {
        let all_retired = self.retired.iter().all(Option::is_some);
        let unsaid = self.last_words.iter().any(Option::is_some);
        if self.in_flight.is_some() || !all_retired || !unsaid {
            return None;
        }
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        self.last_completed = Some(epoch);
        let reports = self
            .retired_acks()
            .into_iter()
            .map(|a| a.expect("every actor retired"))
            .collect();
        Some((epoch, reports))
    }

    /// Whether every actor finished.
    pub fn all_finished(&self) -> bool {
        self.retired.iter().all(Option::is_some)
    }

    /// Records `actor`'s acknowledgement of `epoch`. Once every actor has
    /// acknowledged, returns the epoch with every actor's report, in actor order:
    /// it may now be committed.
    pub fn ack(
        &mut self,
        actor: ActorId,
        epoch: Epoch,
        report: A,
    ) -> Result<Option<(Epoch, Vec<A>)>, AckError> {
        if actor >= self.actors {
            return Err(AckError::UnknownActor {
                actor,
                actors: self.actors,
            });
        }
        let in_flight = match &mut self.in_flight {
            Some(in_flight) if in_flight.epoch == epoch => in_flight,
            other => {
                return Err(AckError::UnexpectedEpoch {
                    actor,
                    epoch,
                    in_flight: other.as_ref().map(|f| f.epoch),
                })
            }
        };
        let slot = &mut in_flight.acks[actor];
        if slot.is_some() {
            return Err(AckError::Duplicate { actor, epoch });
        }
        *slot = Some(report);
        in_flight.missing -= 1;
        if in_flight.missing > 0 {
            return Ok(None);
        }
        let done = self.in_flight.take().expect("in flight above");
        self.last_completed = Some(done.epoch);
        let reports = done
            .acks
            .into_iter()
            .map(|a| a.expect("every actor acked"))
            .collect();
        Ok(Some((done.epoch, reports)))
    }

    /// The epoch in flight with the reports of its first tier, in actor order,
    /// once every actor of the first tier acknowledged it while others still
    /// owe theirs; once per epoch. An epoch whose last acknowledgement came
    /// from its first tier completes as a whole instead ([`ack`](Self::ack)).
    pub fn first_tier_complete(&mut self) -> Option<(Epoch, Vec<(ActorId, A)>)> {
        let in_flight = self.in_flight.as_mut()?;
        if in_flight.first_tier_reported || self.first_tier.is_empty() {
            return None;
        }
        let reports = (self.first_tier.iter())
            .map(|&actor| Some((actor, in_flight.acks[actor].clone()?)))
            .collect::<Option<Vec<_>>>()?;
        in_flight.first_tier_reported = true;
        Some((in_flight.epoch, reports))
    }

    /// Drops the epoch in flight (an actor failed): it will never complete.
    pub fn abort(&mut self) -> Option<Epoch> {
        self.in_flight.take().map(|f| f.epoch)
    }

    /// The epoch in flight.
    pub fn in_flight(&self) -> Option<Epoch> {
        self.in_flight.as_ref().map(|f| f.epoch)
    }

    /// The latest epoch every actor acknowledged.
    pub fn last_completed(&self) -> Option<Epoch> {
        self.last_completed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epoch_completes_when_every_actor_acked() {
        let mut tracker = CheckpointTracker::new(3, None);
        assert_eq!(tracker.trigger(), Some(1));
        assert_eq!(tracker.ack(2, 1, "c"), Ok(None));
        assert_eq!(tracker.ack(0, 1, "a"), Ok(None));
        assert_eq!(tracker.ack(1, 1, "b"), Ok(Some((1, vec!["a", "b", "c"]))));
        assert_eq!(tracker.last_completed(), Some(1));
        assert_eq!(tracker.in_flight(), None);
        assert_eq!(tracker.trigger(), Some(2));
    }

    #[test]
    fn the_first_tier_completes_its_part_once_before_the_rest() {
        let mut tracker = CheckpointTracker::new(3, None);
        tracker.set_first_tier([0, 2]);
        assert_eq!(tracker.first_tier_complete(), None, "nothing in flight");
        assert_eq!(tracker.trigger(), Some(1));
        assert_eq!(tracker.ack(0, 1, "a"), Ok(None));
        assert_eq!(tracker.first_tier_complete(), None, "actor 2 owes its ack");
        assert_eq!(tracker.ack(2, 1, "c"), Ok(None));
        assert_eq!(
            tracker.first_tier_complete(),
            Some((1, vec![(0, "a"), (2, "c")]))
        );
        assert_eq!(tracker.first_tier_complete(), None, "reported once");
        assert_eq!(tracker.ack(1, 1, "b"), Ok(Some((1, vec!["a", "b", "c"]))));
        assert_eq!(tracker.trigger(), Some(2));
        assert_eq!(tracker.ack(1, 2, "b"), Ok(None));
        assert_eq!(tracker.ack(0, 2, "a"), Ok(None));
        assert_eq!(
            tracker.ack(2, 2, "c"),
            Ok(Some((2, vec!["a", "b", "c"]))),
            "the first tier's last ack completed the whole epoch"
        );
        assert_eq!(tracker.first_tier_complete(), None);
    }

    #[test]
    fn a_retired_first_tier_actor_stands_in_for_its_part() {
        let mut tracker = CheckpointTracker::new(2, None);
        tracker.set_first_tier([0]);
        assert_eq!(tracker.retire(0, "a-last", "a"), None);
        assert_eq!(tracker.trigger(), Some(1));
        assert_eq!(
            tracker.first_tier_complete(),
            Some((1, vec![(0, "a-last")]))
        );
        assert_eq!(tracker.ack(1, 1, "b"), Ok(Some((1, vec!["a-last", "b"]))));
    }

    #[test]
    fn one_checkpoint_in_flight_at_a_time() {
        let mut tracker = CheckpointTracker::new(1, Some(7));
        assert_eq!(tracker.trigger(), Some(8));
        assert_eq!(tracker.trigger(), None, "epoch 8 is still in flight");
        assert_eq!(tracker.ack(0, 8, ()), Ok(Some((8, vec![()]))));
        assert_eq!(tracker.trigger(), Some(9));
    }

    #[test]
    fn epochs_of_damaged_checkpoints_are_not_numbered_again() {
        let mut tracker = CheckpointTracker::<()>::new(1, Some(7));
        tracker.number_after(9);
        tracker.number_after(4);
        assert_eq!(tracker.trigger(), Some(10));
        assert_eq!(tracker.last_completed(), Some(7));
    }

    #[test]
    fn bad_acknowledgements_are_rejected() {
        let mut tracker = CheckpointTracker::new(2, None);
        assert!(matches!(
            tracker.ack(0, 1, ()),
            Err(AckError::UnexpectedEpoch {
                in_flight: None,
                ..
            })
        ));
        tracker.trigger();
        assert!(matches!(
            tracker.ack(5, 1, ()),
            Err(AckError::UnknownActor { .. })
        ));
        assert!(matches!(
            tracker.ack(0, 2, ()),
            Err(AckError::UnexpectedEpoch {
                in_flight: Some(1),
                ..
            })
        ));
        assert_eq!(tracker.ack(0, 1, ()), Ok(None));
        assert_eq!(
            tracker.ack(0, 1, ()),
            Err(AckError::Duplicate { actor: 0, epoch: 1 })
        );
    }

    #[test]
    fn a_finished_actor_stands_in_with_its_last_report() {
        let mut tracker = CheckpointTracker::new(2, None);
        assert_eq!(tracker.trigger(), Some(1));
        assert_eq!(tracker.ack(0, 1, "a1"), Ok(None));
        assert_eq!(
            tracker.retire(1, "b-last", "b"),
            Some((1, vec!["a1", "b-last"]))
        );
        assert_eq!(tracker.trigger(), Some(2));
        assert_eq!(tracker.ack(0, 2, "a2"), Ok(Some((2, vec!["a2", "b"]))));
        assert_eq!(tracker.finish(), None, "actor 0 still runs");
        assert_eq!(tracker.retire(0, "a-last", "a"), None);
        assert_eq!(tracker.trigger(), None, "nobody is left to acknowledge");
        assert!(tracker.all_finished());
        assert_eq!(
            tracker.finish(),
            Some((3, vec!["a-last", "b"])),
            "the final epoch takes actor 0's last word"
        );
        assert_eq!(tracker.finish(), None, "everything was said");
    }

    #[test]
    fn a_last_word_said_between_epochs_goes_into_the_next_one_only() {
        let mut tracker = CheckpointTracker::new(2, None);
        assert_eq!(tracker.retire(1, "b-last", "b"), None);
        assert_eq!(tracker.trigger(), Some(1));
        assert_eq!(tracker.ack(0, 1, "a1"), Ok(Some((1, vec!["a1", "b-last"]))));
        assert_eq!(tracker.trigger(), Some(2));
        assert_eq!(tracker.ack(0, 2, "a2"), Ok(Some((2, vec!["a2", "b"]))));
        assert_eq!(tracker.retire(0, "a-last", "a"), None);
        assert_eq!(tracker.finish(), Some((3, vec!["a-last", "b"])));
    }

    #[test]
    fn an_aborted_epoch_never_completes_and_is_not_reused() {
        let mut tracker = CheckpointTracker::new(2, None);
        tracker.trigger();
        tracker.ack(0, 1, ()).unwrap();
        assert_eq!(tracker.abort(), Some(1));
        assert!(
            tracker.ack(1, 1, ()).is_err(),
            "late acks of an aborted epoch are refused"
        );
        assert_eq!(tracker.last_completed(), None);
        assert_eq!(tracker.trigger(), Some(2));
    }
}
