//! The coordinator's decisions about epochs, free of actix and I/O: what the
//! acknowledgements of an epoch make of its manifest, and which
//! `checkpoint_now` requests an epoch answers.

use rtflow_checkpoint::{Delta, Offsets};

use crate::progress::SourceOffsets;
use crate::record::{Epoch, EventTime};

/// What an actor acknowledges an epoch with.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Ack {
    /// A source's offsets where the epoch ends.
    pub(crate) offsets: Offsets,
    pub(crate) deltas: Vec<Delta>,
    /// For an actor ending in a sink: its watermark at the barrier (`Some(None)`
    /// before its first).
    pub(crate) sink_watermark: Option<Option<EventTime>>,
}

/// What the acknowledgements of an epoch put in its manifest.
#[derive(Debug, PartialEq)]
pub(crate) struct Assembled {
    /// Every source's offsets, by source uid, over all its readers.
    pub(crate) sources: SourceOffsets,
    /// The query's watermark at the barrier: the lowest any sink had reached;
    /// none while a sink had none.
    pub(crate) watermark: Option<EventTime>,
    pub(crate) deltas: Vec<Delta>,
}

/// Assembles an epoch from `acks`, one per actor; `sources[actor]` names the
/// source uid of a source actor.
pub(crate) fn assemble<'a>(
    sources: impl IntoIterator<Item = Option<&'a str>>,
    acks: Vec<Ack>,
) -> Assembled {
    let mut assembled = Assembled {
        sources: SourceOffsets::new(),
        watermark: None,
        deltas: Vec::new(),
    };
    let mut lowest = Some(EventTime::MAX);
    for (source, ack) in sources.into_iter().zip(acks) {
        if let Some(uid) = source {
            assembled
                .sources
                .entry(uid.to_owned())
                .or_default()
                .extend(ack.offsets);
        }
        if let Some(sink) = ack.sink_watermark {
            lowest = lowest.zip(sink).map(|(a, b)| a.min(b));
        }
        assembled.deltas.extend(ack.deltas);
    }
    assembled.watermark = lowest.filter(|w| *w != EventTime::MAX);
    assembled
}

/// `checkpoint_now` requests: each is answered by the first epoch triggered
/// after it, once that epoch committed.
#[derive(Debug)]
pub(crate) struct Requests<R> {
    waiting: Vec<(Option<Epoch>, R)>,
}

impl<R> Default for Requests<R> {
    fn default() -> Self {
        Self {
            waiting: Vec::new(),
        }
    }
}

/// What serving the requests decided.
#[derive(Debug, PartialEq)]
pub(crate) struct Served<R> {
    /// The requests answered, each with its epoch.
    pub(crate) answered: Vec<(R, Epoch)>,
    /// Whether an epoch must be triggered for requests that wait for one.
    pub(crate) trigger: bool,
}

impl<R> Requests<R> {
    /// A new request, waiting for the next epoch triggered.
    pub(crate) fn push(&mut self, reply: R) {
        self.waiting.push((None, reply));
    }

    /// `epoch` was triggered: it answers the requests that had no epoch yet.
    pub(crate) fn triggered(&mut self, epoch: Epoch) {
        for (answer, _) in &mut self.waiting {
            answer.get_or_insert(epoch);
        }
    }

    /// After `committed` (the last epoch committed) and with every actor
    /// `finished` and no epoch in flight or not: the requests answered, and
    /// whether to trigger an epoch for those that still wait for one. Once
    /// every actor ended no epoch follows, so the last one answers them all.
    pub(crate) fn serve(&mut self, committed: Option<Epoch>, finished: bool) -> Served<R> {
        let mut answered = Vec::new();
        let mut waiting = Vec::new();
        for (answer, reply) in self.waiting.drain(..) {
            match answer {
                Some(epoch) if Some(epoch) <= committed => answered.push((reply, epoch)),
                _ => waiting.push((answer, reply)),
            }
        }
        self.waiting = waiting;
        let unassigned = self.waiting.iter().any(|(answer, _)| answer.is_none());
        if !unassigned {
            return Served {
                answered,
                trigger: false,
            };
        }
        if !finished {
            return Served {
                answered,
                trigger: true,
            };
        }
        if let Some(last) = committed {
            answered.extend(self.waiting.drain(..).map(|(_, reply)| (reply, last)));
        }
        Served {
            answered,
            trigger: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(offsets: &[(&str, i64)], sink_watermark: Option<Option<EventTime>>) -> Ack {
        Ack {
            offsets: offsets.iter().map(|(p, o)| (p.to_string(), *o)).collect(),
            deltas: Vec::new(),
            sink_watermark,
        }
    }

    #[test]
    fn an_epoch_takes_every_sources_offsets_and_the_lowest_sink_watermark() {
        // Actors: two readers of source "kafka-0", a map, two sinks.
        let sources = [Some("kafka-0"), Some("kafka-0"), None, None, None];
        let acks = vec![
            ack(&[("t-0", 10)], None),
            ack(&[("t-1", 7)], None),
            ack(&[], None),
            ack(&[], Some(Some(500))),
            ack(&[], Some(Some(300))),
        ];
        let assembled = assemble(sources, acks);
        let offsets = &assembled.sources["kafka-0"];
        assert_eq!(offsets.len(), 2);
        assert_eq!((offsets["t-0"], offsets["t-1"]), (10, 7));
        assert_eq!(assembled.watermark, Some(300));
    }

    #[test]
    fn the_watermark_is_none_while_a_sink_has_none_or_there_is_no_sink() {
        let sources = [Some("memory-0"), None, None];
        let acks = vec![
            ack(&[("0", 1)], None),
            ack(&[], Some(Some(500))),
            ack(&[], Some(None)),
        ];
        assert_eq!(assemble(sources, acks).watermark, None);
        let acks = vec![ack(&[("0", 1)], None)];
        assert_eq!(assemble([Some("memory-0")], acks).watermark, None);
    }

    /// (committed, finished) -> (answered, trigger), after the requests and
    /// triggers of each step.
    #[test]
    fn a_request_is_answered_by_the_first_epoch_triggered_after_it_once_committed() {
        let mut requests = Requests::default();
        requests.push("a");
        let served = requests.serve(None, false);
        assert_eq!(
            served,
            Served {
                answered: vec![],
                trigger: true
            }
        );
        requests.triggered(4);
        requests.push("b");
        assert_eq!(
            requests.serve(Some(3), false),
            Served {
                answered: vec![],
                trigger: true
            },
            "b still needs an epoch of its own"
        );
        requests.triggered(5);
        assert_eq!(
            requests.serve(Some(4), false),
            Served {
                answered: vec![("a", 4)],
                trigger: false
            }
        );
        assert_eq!(
            requests.serve(Some(5), false),
            Served {
                answered: vec![("b", 5)],
                trigger: false
            }
        );
    }

    #[test]
    fn once_every_actor_ended_the_last_epoch_answers_every_request() {
        let mut requests = Requests::default();
        requests.push("late");
        assert_eq!(
            requests.serve(Some(9), true),
            Served {
                answered: vec![("late", 9)],
                trigger: false
            }
        );
        requests.push("never");
        assert_eq!(
            requests.serve(None, true),
            Served {
                answered: vec![],
                trigger: false
            },
            "nothing ever committed: nothing to answer with"
        );
    }
}
