//! The coordinator's commit decision (`CheckpointTracker`) against a reference
//! model, with proptest-state-machine: triggers, acknowledgements (valid and
//! not), actors finishing, final commits and crashes, in any order the runtime
//! can produce them. `PROPTEST_CASES=n` runs more sequences.
//!
//! Besides agreeing with the model step by step, every run must keep the
//! protocol's promises: epochs complete in increasing order, an epoch carries
//! exactly one report of each actor for that epoch, and a finished actor's last
//! report is committed exactly once. The even actors are a first tier: an
//! epoch's first part is reported once they all acknowledged it while it is
//! still in flight, once, with a report of each of them for that epoch.

use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use rtflow::checkpoint::protocol::AckError;
use rtflow::checkpoint::{CheckpointTracker, Epoch};

/// What an actor hands in: its acknowledgement of an epoch, its last words when
/// it finished, and what stands in for it in every epoch after that.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    Ack(usize, Epoch),
    Last(usize),
    Standing(usize),
}

impl Report {
    fn actor(&self) -> usize {
        match self {
            Report::Ack(actor, _) | Report::Last(actor) | Report::Standing(actor) => *actor,
        }
    }
}

/// An epoch that every actor acknowledged, with their reports in actor order.
type Completed = Option<(Epoch, Vec<Report>)>;

#[derive(Debug, Clone)]
enum Transition {
    /// The batch duration elapsed (or `checkpoint_now`): start the next epoch.
    Trigger,
    /// An actor passed a barrier on.
    Ack { actor: usize, epoch: Epoch },
    /// An actor's input ended.
    Retire(usize),
    /// Every actor may have ended: commit the final epoch.
    Finish,
    /// The query failed or was killed, and restarts from the last completed epoch.
    Crash,
}

/// What the tracker must answer to the last transition.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Start,
    Triggered(Option<Epoch>),
    Acked(Result<Completed, AckError>),
    Completed(Completed),
    Aborted(Option<Epoch>),
}

#[derive(Debug, Clone)]
struct InFlight {
    epoch: Epoch,
    reports: Vec<Option<Report>>,
}

/// The protocol as plainly as it can be said.
#[derive(Debug, Clone)]
struct Model {
    actors: usize,
    next_epoch: Epoch,
    last_completed: Option<Epoch>,
    in_flight: Option<InFlight>,
    /// Actors whose input ended since the last (re)start.
    retired: Vec<bool>,
    /// Finished actors whose last words no epoch has taken yet.
    unsaid: Vec<bool>,
    outcome: Outcome,
}

impl Model {
    fn new(actors: usize, last_completed: Option<Epoch>) -> Self {
        Self {
            actors,
            next_epoch: last_completed.map_or(1, |epoch| epoch + 1),
            last_completed,
            in_flight: None,
            retired: vec![false; actors],
            unsaid: vec![false; actors],
            outcome: Outcome::Start,
        }
    }

    /// The report of `actor` in an epoch that starts now, if it finished.
    fn standing_in(&mut self, actor: usize) -> Option<Report> {
        if !self.retired[actor] {
            return None;
        }
        if std::mem::take(&mut self.unsaid[actor]) {
            Some(Report::Last(actor))
        } else {
            Some(Report::Standing(actor))
        }
    }

    /// Completes the epoch in flight if every actor has reported.
    fn complete_if_done(&mut self) -> Completed {
        let done = self.in_flight.as_ref()?.reports.iter().all(Option::is_some);
        if !done {
            return None;
        }
        let InFlight { epoch, reports } = self.in_flight.take().expect("in flight");
        self.last_completed = Some(epoch);
        Some((epoch, reports.into_iter().flatten().collect()))
    }

    fn ack(&mut self, actor: usize, epoch: Epoch) -> Result<Completed, AckError> {
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
        if in_flight.reports[actor].is_some() {
            return Err(AckError::Duplicate { actor, epoch });
        }
        in_flight.reports[actor] = Some(Report::Ack(actor, epoch));
        Ok(self.complete_if_done())
    }
}

struct ProtocolModel;

impl ReferenceStateMachine for ProtocolModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        (1..=4usize, proptest::option::of(1..5 as Epoch))
            .prop_map(|(actors, last)| Model::new(actors, last))
            .boxed()
    }

    fn transitions(model: &Model) -> BoxedStrategy<Transition> {
        let running: Vec<usize> = (0..model.actors).filter(|a| !model.retired[*a]).collect();
        let epoch = model
            .in_flight
            .as_ref()
            .map_or(model.next_epoch, |f| f.epoch);
        // Acknowledgements of the epoch in flight by actors still running, as
        // the runtime sends them, and now and then one it must refuse.
        let ack = match running.is_empty() {
            true => Just(Transition::Finish).boxed(),
            false => prop::sample::select(running.clone())
                .prop_map(move |actor| Transition::Ack { actor, epoch })
                .boxed(),
        };
        let bad_ack = (0..=model.actors, epoch.saturating_sub(1)..=epoch + 1)
            .prop_map(|(actor, epoch)| Transition::Ack { actor, epoch });
        let retire = match running.is_empty() {
            true => Just(Transition::Finish).boxed(),
            false => prop::sample::select(running)
                .prop_map(Transition::Retire)
                .boxed(),
        };
        prop_oneof![
            3 => Just(Transition::Trigger),
            8 => ack,
            1 => bad_ack,
            2 => retire,
            1 => Just(Transition::Finish),
            1 => Just(Transition::Crash),
        ]
        .boxed()
    }

    fn apply(mut model: Model, transition: &Transition) -> Model {
        model.outcome = match *transition {
            Transition::Trigger => {
                let all_retired = model.retired.iter().all(|r| *r);
                if model.in_flight.is_some() || all_retired {
                    Outcome::Triggered(None)
                } else {
                    let epoch = model.next_epoch;
                    model.next_epoch += 1;
                    let reports = (0..model.actors).map(|a| model.standing_in(a)).collect();
                    model.in_flight = Some(InFlight { epoch, reports });
                    Outcome::Triggered(Some(epoch))
                }
            }
            Transition::Ack { actor, epoch } => Outcome::Acked(model.ack(actor, epoch)),
            Transition::Retire(actor) => {
                if model.retired[actor] {
                    Outcome::Completed(None)
                } else {
                    model.retired[actor] = true;
                    match &mut model.in_flight {
                        Some(in_flight) if in_flight.reports[actor].is_none() => {
                            in_flight.reports[actor] = Some(Report::Last(actor));
                        }
                        _ => model.unsaid[actor] = true,
                    }
                    Outcome::Completed(model.complete_if_done())
                }
            }
            Transition::Finish => {
                let all_retired = model.retired.iter().all(|r| *r);
                let unsaid = model.unsaid.iter().any(|u| *u);
                if model.in_flight.is_some() || !all_retired || !unsaid {
                    Outcome::Completed(None)
                } else {
                    let epoch = model.next_epoch;
                    model.next_epoch += 1;
                    model.last_completed = Some(epoch);
                    let reports = (0..model.actors)
                        .map(|a| model.standing_in(a).expect("every actor retired"))
                        .collect();
                    Outcome::Completed(Some((epoch, reports)))
                }
            }
            Transition::Crash => {
                let aborted = model.in_flight.as_ref().map(|f| f.epoch);
                let restarted = Model::new(model.actors, model.last_completed);
                model = restarted;
                Outcome::Aborted(aborted)
            }
        };
        model
    }
}

/// The tracker under test, and what it committed since the last (re)start.
struct Tracker {
    tracker: CheckpointTracker<Report>,
    actors: usize,
    committed: Vec<(Epoch, Vec<Report>)>,
    last_said: Option<Epoch>,
    /// The first parts completed, as `first_tier_complete` reported them.
    first_parts: Vec<(Epoch, Vec<(usize, Report)>)>,
    /// The actors that acknowledged the epoch in flight, and those retired.
    acked: BTreeSet<usize>,
    retired: BTreeSet<usize>,
}

impl Tracker {
    fn record(&mut self, completed: &Completed) {
        if let Some((epoch, reports)) = completed {
            assert!(
                self.last_said.is_none_or(|last| *epoch > last),
                "epoch {epoch} completed after epoch {:?}",
                self.last_said
            );
            self.last_said = Some(*epoch);
            self.committed.push((*epoch, reports.clone()));
        }
    }
}

impl StateMachineTest for Tracker {
    type SystemUnderTest = Self;
    type Reference = ProtocolModel;

    fn init_test(model: &Model) -> Self {
        let mut tracker = CheckpointTracker::new(model.actors, model.last_completed);
        tracker.set_first_tier(first_tier(model.actors));
        Self {
            tracker,
            actors: model.actors,
            committed: Vec::new(),
            last_said: model.last_completed,
            first_parts: Vec::new(),
            acked: BTreeSet::new(),
            retired: BTreeSet::new(),
        }
    }

    fn apply(mut sut: Self, model: &Model, transition: Transition) -> Self {
        let outcome = match transition {
            Transition::Trigger => {
                let triggered = sut.tracker.trigger();
                if triggered.is_some() {
                    sut.acked.clear();
                }
                Outcome::Triggered(triggered)
            }
            Transition::Ack { actor, epoch } => {
                let acked = sut.tracker.ack(actor, epoch, Report::Ack(actor, epoch));
                if let Ok(completed) = &acked {
                    sut.record(completed);
                    sut.acked.insert(actor);
                }
                // Due once the first tier acknowledged (or stands in, retired)
                // an epoch still in flight whose first part was not reported.
                let in_flight = sut.tracker.in_flight();
                let due = in_flight.is_some_and(|epoch| {
                    sut.first_parts.last().is_none_or(|(done, _)| *done < epoch)
                }) && (first_tier(sut.actors).iter())
                    .all(|a| sut.acked.contains(a) || sut.retired.contains(a));
                let first_part = sut.tracker.first_tier_complete();
                assert_eq!(
                    first_part.is_some(),
                    due,
                    "the first part reported when due, only then"
                );
                if let Some((epoch, _)) = &first_part {
                    assert_eq!(
                        sut.tracker.in_flight(),
                        Some(*epoch),
                        "the first part of the epoch in flight"
                    );
                    assert!(
                        sut.first_parts.iter().all(|(done, _)| done < epoch),
                        "the first part of epoch {epoch} completed twice or out of order"
                    );
                    sut.first_parts.extend(first_part);
                }
                Outcome::Acked(acked)
            }
            Transition::Retire(actor) => {
                sut.retired.insert(actor);
                let completed =
                    sut.tracker
                        .retire(actor, Report::Last(actor), Report::Standing(actor));
                sut.record(&completed);
                Outcome::Completed(completed)
            }
            Transition::Finish => {
                let completed = sut.tracker.finish();
                sut.record(&completed);
                Outcome::Completed(completed)
            }
            Transition::Crash => {
                let aborted = sut.tracker.abort();
                sut = Self::init_test(model);
                Outcome::Aborted(aborted)
            }
        };
        assert_eq!(outcome, model.outcome, "the tracker and the model disagree");
        sut
    }

    fn check_invariants(sut: &Self, model: &Model) {
        assert_eq!(
            sut.tracker.in_flight(),
            model.in_flight.as_ref().map(|f| f.epoch)
        );
        assert_eq!(sut.tracker.last_completed(), model.last_completed);
        assert_eq!(sut.tracker.all_finished(), model.retired.iter().all(|r| *r));
        let mut last_words = vec![0; sut.actors];
        for (epoch, reports) in &sut.committed {
            assert_eq!(reports.len(), sut.actors, "one report per actor");
            for (actor, report) in reports.iter().enumerate() {
                assert_eq!(report.actor(), actor, "reports in actor order");
                match report {
                    Report::Ack(_, acked) => assert_eq!(acked, epoch, "an ack of its epoch"),
                    Report::Last(_) => last_words[actor] += 1,
                    Report::Standing(_) => {}
                }
            }
        }
        assert!(
            last_words.iter().all(|n| *n <= 1),
            "a last word committed twice: {last_words:?}"
        );
        for (epoch, reports) in &sut.first_parts {
            let actors: Vec<usize> = reports.iter().map(|(actor, _)| *actor).collect();
            assert_eq!(
                actors,
                first_tier(sut.actors),
                "one report per first-tier actor"
            );
            for (actor, report) in reports {
                assert_eq!(report.actor(), *actor);
                if let Report::Ack(_, acked) = report {
                    assert_eq!(acked, epoch, "an ack of its epoch");
                }
            }
        }
        // Once everything ended and was committed, every last word was, once.
        let settled = sut.tracker.all_finished()
            && sut.tracker.in_flight().is_none()
            && !model.unsaid.iter().any(|u| *u);
        if settled {
            assert!(
                last_words.iter().all(|n| *n == 1),
                "every actor finished, yet last words committed {last_words:?} times"
            );
        }
    }
}

/// The actors whose acknowledgements complete an epoch's first part.
fn first_tier(actors: usize) -> Vec<usize> {
    (0..actors).step_by(2).collect()
}

prop_state_machine! {
    #[test]
    fn the_checkpoint_tracker_follows_the_protocol_model(sequential 1..48 => Tracker);
}
