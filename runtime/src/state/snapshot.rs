//! [`StateSnapshot`]: what an actor's stateful operators changed in an epoch,
//! on its way to the checkpoint.

use rtflow_checkpoint::Delta;

use crate::metrics::StateRows;
use crate::record::EventTime;

/// What an actor's stateful operators changed in an epoch; the runtime stores it
/// with the epoch's checkpoint.
#[derive(Default)]
pub struct StateSnapshot {
    deltas: Vec<Delta>,
    /// Keyed changes encoded at the barrier, with their entry counts: cutting
    /// them into entries is left to the coordinator, so the actor goes on with
    /// its records sooner.
    captured: Vec<(usize, Cut)>,
    /// For an actor that ends in a sink: the watermark the sink had reached at the
    /// barrier (`Some(None)` before its first).
    pub(crate) sink_watermark: Option<Option<EventTime>>,
    /// The keyed state of the snapshots begun, summed.
    pub(crate) rows: StateRows,
}

/// Changes encoded at a barrier into one buffer, cut into entries when called.
type Cut = Box<dyn FnOnce() -> Delta + Send>;

impl StateSnapshot {
    pub(super) fn push(&mut self, delta: Delta) {
        if !delta.entries.is_empty() {
            self.deltas.push(delta);
        }
    }

    pub(super) fn capture(&mut self, entries: usize, encode: Cut) {
        if entries > 0 {
            self.captured.push((entries, encode));
        }
    }

    /// Entries written so far (benchmarks and tests).
    pub fn entries(&self) -> usize {
        let encoded: usize = self.deltas.iter().map(|d| d.entries.len()).sum();
        encoded + self.captured.iter().map(|(n, _)| n).sum::<usize>()
    }

    /// The changes as the checkpoint stores them; the captured ones are cut into
    /// entries on the calling thread.
    pub(crate) fn into_deltas(self) -> Vec<Delta> {
        let mut deltas = self.deltas;
        deltas.extend(self.captured.into_iter().map(|(_, cut)| cut()));
        deltas
    }
}
