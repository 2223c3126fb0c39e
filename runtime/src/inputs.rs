//! Per-lane bookkeeping of an actor's inputs: the output watermark is the minimum
//! over its lanes, and a barrier is forwarded once every lane has delivered it
//! (aligned checkpoints). Pure logic, no I/O: the actor loop acts on its answers.

use crate::record::{Epoch, EventTime};

/// What a barrier on one lane asks the actor to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alignment {
    /// Stop reading that lane until the other lanes deliver the barrier too.
    Wait,
    /// Every open lane delivered the barrier: forward it and read all lanes again.
    Aligned(Epoch),
}

/// What the actor passes on after a lane went idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdleStep {
    /// The other lanes' minimum advanced.
    Watermark(EventTime),
    /// Every open lane is idle: the actor's output is idle too.
    Idle,
}

/// The state of an actor's input lanes.
#[derive(Debug)]
pub(crate) struct Inputs {
    watermarks: Vec<EventTime>,
    ended: Vec<bool>,
    /// Lanes left out of the watermark until their next one.
    idle: Vec<bool>,
    /// Ended lanes that keep holding the watermark at their last one: they ended
    /// because the query is stopping, and a restart continues them.
    held: Vec<bool>,
    output_idle: bool,
    output_watermark: EventTime,
    /// The epoch being aligned and which lanes have delivered its barrier.
    aligning: Option<(Epoch, Vec<bool>)>,
}

impl Inputs {
    pub(crate) fn new(lanes: usize) -> Self {
        Self {
            watermarks: vec![EventTime::MIN; lanes],
            ended: vec![false; lanes],
            idle: vec![false; lanes],
            held: vec![false; lanes],
            output_idle: false,
            output_watermark: EventTime::MIN,
            aligning: None,
        }
    }

    /// Event time starts over, as in a new run: every open lane's watermark
    /// is unknown again, idle ones included, and none is passed on until
    /// each tells a watermark or that it is idle. A lane left idle would let
    /// the others' watermarks past the records it is about to deliver.
    pub(crate) fn start_over(&mut self) {
        self.watermarks.fill(EventTime::MIN);
        self.idle.fill(false);
        self.output_watermark = EventTime::MIN;
        self.output_idle = false;
    }

    /// Whether the actor should read `lane` now.
    pub(crate) fn readable(&self, lane: usize) -> bool {
        !self.ended[lane]
            && !self
                .aligning
                .as_ref()
                .is_some_and(|(_, arrived)| arrived[lane])
    }

    /// A watermark arrived on `lane`; returns the output watermark if it advanced,
    /// or if the output was idle and is active again.
    pub(crate) fn on_watermark(&mut self, lane: usize, watermark: EventTime) -> Option<EventTime> {
        self.idle[lane] = false;
        if watermark > self.watermarks[lane] {
            self.watermarks[lane] = watermark;
        }
        let woke = std::mem::take(&mut self.output_idle);
        match self.advance_watermark() {
            None if woke => Some(self.output_watermark),
            advanced => advanced,
        }
    }

    /// `lane` declared itself idle.
    pub(crate) fn on_idle(&mut self, lane: usize) -> Option<IdleStep> {
        self.idle[lane] = true;
        let all_idle = (0..self.idle.len()).all(|l| self.idle[l] || self.ended[l]);
        if all_idle {
            return (!std::mem::replace(&mut self.output_idle, true)).then_some(IdleStep::Idle);
        }
        self.advance_watermark().map(IdleStep::Watermark)
    }

    /// A barrier arrived on `lane`.
    pub(crate) fn on_barrier(&mut self, lane: usize, epoch: Epoch) -> Alignment {
        let lanes = self.ended.len();
        let (aligning, arrived) = self
            .aligning
            .get_or_insert_with(|| (epoch, vec![false; lanes]));
        debug_assert_eq!(
            *aligning, epoch,
            "a blocked lane cannot deliver the next barrier"
        );
        arrived[lane] = true;
        self.try_align()
    }

    /// `lane` ended. Returns whether every lane has ended, a barrier the end
    /// completed, and a watermark the end advanced. A lane ended by a stopping
    /// query keeps holding the watermark: letting the other lanes' run ahead
    /// would close windows and fire timers a restarted query would not have yet.
    pub(crate) fn on_end(
        &mut self,
        lane: usize,
        stopping: bool,
    ) -> (bool, Option<Epoch>, Option<EventTime>) {
        self.ended[lane] = true;
        self.held[lane] = stopping;
        let all_ended = self.ended.iter().all(|e| *e);
        if all_ended {
            return (true, None, None);
        }
        let aligned = match self.aligning {
            Some(_) => match self.try_align() {
                Alignment::Aligned(epoch) => Some(epoch),
                Alignment::Wait => None,
            },
            None => None,
        };
        (false, aligned, self.advance_watermark())
    }

    fn try_align(&mut self) -> Alignment {
        let Some((epoch, arrived)) = &self.aligning else {
            return Alignment::Wait;
        };
        let complete = arrived
            .iter()
            .zip(&self.ended)
            .all(|(arrived, ended)| *arrived || *ended);
        if !complete {
            return Alignment::Wait;
        }
        let epoch = *epoch;
        self.aligning = None;
        Alignment::Aligned(epoch)
    }

    fn advance_watermark(&mut self) -> Option<EventTime> {
        let min = (0..self.watermarks.len())
            .filter(|lane| (!self.ended[*lane] || self.held[*lane]) && !self.idle[*lane])
            .map(|lane| self.watermarks[lane])
            .min()?;
        (min > self.output_watermark).then(|| {
            self.output_watermark = min;
            min
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_is_the_minimum_over_lanes_and_never_regresses() {
        let mut inputs = Inputs::new(2);
        assert_eq!(inputs.on_watermark(0, 10), None, "lane 1 holds it back");
        assert_eq!(inputs.on_watermark(1, 5), Some(5));
        assert_eq!(inputs.on_watermark(1, 20), Some(10));
        assert_eq!(
            inputs.on_watermark(0, 8),
            None,
            "a lane going back changes nothing"
        );
        assert_eq!(inputs.on_watermark(0, 30), Some(20));
    }

    #[test]
    fn starting_over_forgets_every_lanes_watermark_until_each_tells_again() {
        let mut inputs = Inputs::new(3);
        inputs.on_watermark(0, 50);
        inputs.on_idle(2);
        assert_eq!(inputs.on_watermark(1, 40), Some(40));
        inputs.start_over();
        assert_eq!(
            inputs.on_watermark(0, 30),
            None,
            "lane 1 told nothing since"
        );
        assert_eq!(inputs.on_watermark(1, 20), None, "nor lane 2, idle before");
        assert_eq!(
            inputs.on_idle(2),
            Some(IdleStep::Watermark(20)),
            "lower, as a new run's"
        );
    }

    #[test]
    fn an_idle_lane_stops_holding_the_watermark_back_until_it_speaks_again() {
        let mut inputs = Inputs::new(3);
        inputs.on_watermark(0, 50);
        inputs.on_watermark(1, 40);
        assert_eq!(inputs.on_idle(2), Some(IdleStep::Watermark(40)));
        assert_eq!(inputs.on_watermark(1, 60), Some(50));
        assert_eq!(
            inputs.on_watermark(2, 10),
            None,
            "back, behind: no regression"
        );
        assert_eq!(inputs.on_watermark(0, 70), None, "lane 2 at 10 holds it");
        assert_eq!(inputs.on_watermark(2, 65), Some(60));
    }

    #[test]
    fn all_lanes_idle_make_the_output_idle_once() {
        let mut inputs = Inputs::new(2);
        inputs.on_watermark(0, 5);
        inputs.on_watermark(1, 7);
        assert_eq!(inputs.on_idle(0), Some(IdleStep::Watermark(7)));
        assert_eq!(inputs.on_idle(1), Some(IdleStep::Idle));
        assert_eq!(inputs.on_idle(1), None);
        assert_eq!(
            inputs.on_watermark(0, 6),
            Some(7),
            "active again: the output watermark is announced again"
        );
    }

    #[test]
    fn an_ended_lane_stops_holding_the_watermark_back() {
        let mut inputs = Inputs::new(2);
        inputs.on_watermark(0, 50);
        assert_eq!(inputs.on_end(1, false), (false, None, Some(50)));
        assert_eq!(inputs.on_end(0, false), (true, None, None));
    }

    #[test]
    fn a_lane_ended_by_a_stop_keeps_holding_the_watermark() {
        let mut inputs = Inputs::new(3);
        inputs.on_watermark(0, 50);
        inputs.on_watermark(1, 20);
        inputs.on_watermark(2, 90);
        assert_eq!(inputs.on_end(1, true), (false, None, None));
        assert_eq!(
            inputs.on_watermark(0, 70),
            None,
            "lane 1 still holds it at 20"
        );
        assert_eq!(inputs.on_end(2, true), (false, None, None));
        assert_eq!(inputs.on_end(0, true), (true, None, None));
    }

    #[test]
    fn barrier_blocks_each_lane_until_all_lanes_deliver_it() {
        let mut inputs = Inputs::new(3);
        assert_eq!(inputs.on_barrier(1, 7), Alignment::Wait);
        assert!(!inputs.readable(1));
        assert!(inputs.readable(0) && inputs.readable(2));
        assert_eq!(inputs.on_barrier(0, 7), Alignment::Wait);
        assert_eq!(inputs.on_barrier(2, 7), Alignment::Aligned(7));
        assert!((0..3).all(|lane| inputs.readable(lane)));
        assert_eq!(inputs.on_barrier(2, 8), Alignment::Wait);
    }

    #[test]
    fn an_ending_lane_completes_a_pending_alignment() {
        let mut inputs = Inputs::new(2);
        assert_eq!(inputs.on_barrier(0, 3), Alignment::Wait);
        assert_eq!(inputs.on_end(1, false), (false, Some(3), None));
        assert!(inputs.readable(0));
        assert!(!inputs.readable(1));
    }

    #[test]
    fn single_lane_aligns_at_once() {
        let mut inputs = Inputs::new(1);
        assert_eq!(inputs.on_barrier(0, 1), Alignment::Aligned(1));
    }
}
