//! The checkpoint commit decision, free of I/O: which epoch is in flight, which
//! actors still owe their acknowledgement, and when the epoch is complete.
//!
//! One checkpoint is in flight at a time (as Flink's default): a trigger while the
//! previous epoch still waits for acknowledgements is skipped, so barriers never
//! pile up behind a slow actor.

use crate::Epoch;

/// Index of an actor among the query's actors.
pub type ActorId = usize;

/// An acknowledgement the protocol cannot accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
}

/// Tracks checkpoints from trigger to completion; `A` is what an actor reports
/// with its acknowledgement (a source's offsets, a state snapshot's reference).
#[derive(Debug)]
pub struct CheckpointTracker<A> {
    actors: usize,
    next_epoch: Epoch,
    in_flight: Option<InFlight<A>>,
    last_completed: Option<Epoch>,
    /// The final report of every actor that finished: it stands for every later
    /// epoch, since a finished actor acknowledges nothing more.
    retired: Vec<Option<A>>,
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
        }
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
        self.in_flight = Some(InFlight {
            epoch,
            acks: self.retired.clone(),
            missing,
        });
        Some(epoch)
    }

    /// `actor` finished with `report` as its last word. Returns the epoch in
    /// flight if that was the last acknowledgement it waited for.
    pub fn retire(&mut self, actor: ActorId, report: A) -> Option<(Epoch, Vec<A>)> {
        if actor >= self.actors || self.retired[actor].is_some() {
            return None;
        }
        self.retired[actor] = Some(report.clone());
        match &self.in_flight {
            Some(in_flight) if in_flight.acks[actor].is_none() => {
                let epoch = in_flight.epoch;
                self.ack(actor, epoch, report).ok().flatten()
            }
            _ => None,
        }
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
    fn one_checkpoint_in_flight_at_a_time() {
        let mut tracker = CheckpointTracker::new(1, Some(7));
        assert_eq!(tracker.trigger(), Some(8));
        assert_eq!(tracker.trigger(), None, "epoch 8 is still in flight");
        assert_eq!(tracker.ack(0, 8, ()), Ok(Some((8, vec![()]))));
        assert_eq!(tracker.trigger(), Some(9));
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
            tracker.retire(1, "b-final"),
            Some((1, vec!["a1", "b-final"]))
        );
        assert_eq!(tracker.trigger(), Some(2));
        assert_eq!(
            tracker.ack(0, 2, "a2"),
            Ok(Some((2, vec!["a2", "b-final"])))
        );
        assert_eq!(tracker.retire(0, "a-final"), None);
        assert_eq!(tracker.trigger(), None, "nobody is left to acknowledge");
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
