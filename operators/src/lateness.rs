//! The input watermark a stateful operator instance judges late records by
//! (windows, deduplication, stream joins), checkpointed with the state it bounds.
//!
//! After a restore, lateness must be judged as it was at the barrier: a key the
//! checkpoint no longer holds was evicted because the watermark had passed it,
//! and a replayed record of that key must be late again rather than let through
//! as new. The query's restored watermark cannot serve: it is the sinks' lowest
//! at the barrier, which can trail the operator's own input watermark.
//!
//! So each instance checkpoints the watermark it received. Watermarks travel in
//! band and every instance after a shuffle reads every upstream lane, so at an
//! aligned barrier all instances hold the same one. After a parallelism change
//! an instance restores the least of the old instances' watermarks (all of
//! them, not only those of the old instances it replaces: its keys may come
//! from any); the least never drops a record the old instances would have
//! taken.

use rtflow_runtime::state::{StateSnapshot, SubtaskState, Table};
use rtflow_runtime::{EventTime, OperatorContext, Result};

/// The name of an operator instance's watermark within its operator.
const WATERMARK: &str = "watermark";

pub(crate) struct Lateness {
    /// The watermark received so far; `EventTime::MIN` before the first.
    current: EventTime,
    state: SubtaskState<EventTime>,
}

impl Lateness {
    pub(crate) fn restore(ctx: &OperatorContext) -> Result<Self> {
        let restored = ctx
            .state
            .restored_by_every_subtask::<EventTime>(WATERMARK)?;
        let mut state = ctx.state.per_subtask(WATERMARK)?;
        let current = restored.iter().map(|(_, watermark)| *watermark).min();
        if let Some(watermark) = current {
            state.set(watermark);
        }
        Ok(Self {
            current: current.unwrap_or(EventTime::MIN),
            state,
        })
    }

    /// The watermark: records before it are late.
    #[inline]
    pub(crate) fn watermark(&self) -> EventTime {
        self.current
    }

    /// Whether a record at `time` is behind the watermark.
    #[inline]
    pub(crate) fn is_late(&self, time: EventTime) -> bool {
        time < self.current
    }

    /// Takes `watermark` if it is ahead; returns whether it was.
    pub(crate) fn advance(&mut self, watermark: EventTime) -> bool {
        if watermark <= self.current {
            return false;
        }
        self.current = watermark;
        self.state.set(watermark);
        true
    }
}

impl Table for Lateness {
    fn begin_snapshot(&mut self, out: &mut StateSnapshot) -> Result<()> {
        self.state.snapshot(out)
    }
}
