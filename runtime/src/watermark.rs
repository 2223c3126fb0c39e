//! Event-time watermarks at the source, as real-time mode computes them: the
//! largest event time seen per source partition, the minimum of those over the
//! partitions an instance reads, minus the declared delay. A partition that has
//! not delivered anything holds the watermark back, unless an idle timeout lets
//! the others go on without it; when all of an instance's partitions are idle it
//! declares its stream idle, so downstream watermarks stop waiting for it. The
//! watermark never moves backwards, also not below the one restored from a
//! checkpoint.
//!
//! [`WatermarkTracker`] is the logic, free of I/O and clocks (time is passed in);
//! `AssignWatermarks` is the `with_watermark` operator around it.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::operator::{Collector, Operator, OperatorContext};
use crate::record::{EventTime, Nanos, Record};

/// What a watermark generator tells the streams after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Signal {
    /// No record with an earlier event time is expected any more.
    Watermark(EventTime),
    /// Every partition is idle: downstream watermarks should not wait for them.
    Idle,
}

/// Per-partition event-time maxima and the watermark they allow.
#[derive(Debug, Clone)]
pub struct WatermarkTracker {
    /// For every source partition read, by partition number: `slots[p]` is its
    /// index in `max` (`usize::MAX` for partitions not read here).
    slots: Vec<usize>,
    /// Largest event time per partition read, `None` until it delivers a record.
    max: Vec<Option<EventTime>>,
    /// When each partition last delivered a record.
    last_seen: Vec<Nanos>,
    delay: i64,
    idle_timeout: Option<Nanos>,
    /// The last watermark handed out.
    current: Option<EventTime>,
    /// Whether every partition was idle at the last call.
    idle: bool,
}

impl WatermarkTracker {
    /// A tracker for the source partitions `partitions`, with `delay` between the
    /// event times seen and the watermark, starting at `floor` (a restored
    /// watermark) if given; `now` starts every partition's idle clock.
    pub fn new(
        partitions: &[u32],
        delay: Duration,
        idle_timeout: Option<Duration>,
        floor: Option<EventTime>,
        now: Nanos,
    ) -> Self {
        let mut slots = vec![usize::MAX; partitions.iter().max().map_or(0, |p| *p as usize + 1)];
        for (slot, partition) in partitions.iter().enumerate() {
            slots[*partition as usize] = slot;
        }
        Self {
            slots,
            max: vec![None; partitions.len()],
            last_seen: vec![now; partitions.len()],
            delay: delay.as_millis() as i64,
            idle_timeout: idle_timeout.map(|t| t.as_nanos() as Nanos),
            current: floor,
            idle: false,
        }
    }

    /// A record of `partition` with `event_time` arrived at `now`. Records of
    /// partitions the tracker does not know are taken as their own partition's.
    #[inline]
    pub fn observe(&mut self, partition: u32, event_time: EventTime, now: Nanos) {
        let Some(slot) = self.slot(partition) else {
            return;
        };
        let max = &mut self.max[slot];
        if max.is_none_or(|m| event_time > m) {
            *max = Some(event_time);
        }
        self.last_seen[slot] = now;
    }

    /// Whether a record of `partition` at `event_time` is behind the
    /// partition's own watermark: the largest event time it delivered so far,
    /// minus the delay, or the watermark handed out if that is later.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow_runtime::watermark::WatermarkTracker;
    /// let mut tracker = WatermarkTracker::new(&[0, 1], Duration::from_millis(10), None, None, 0);
    /// tracker.observe(0, 100, 0);
    /// assert!(!tracker.is_behind(0, 90), "within the delay");
    /// assert!(tracker.is_behind(0, 89));
    /// assert!(!tracker.is_behind(1, 20), "partition 1 is its own");
    /// ```
    /// Stops waiting for the source partitions not in `partitions`, which
    /// no longer reach it (the process let them go: another reads them on);
    /// the others keep what they delivered.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow_runtime::watermark::{Signal, WatermarkTracker};
    /// let mut tracker = WatermarkTracker::new(&[0, 1], Duration::ZERO, None, None, 0);
    /// tracker.observe(0, 50, 0);
    /// assert_eq!(tracker.advance(0), None, "partition 1 has delivered nothing");
    /// tracker.retain(&[0]);
    /// assert_eq!(tracker.advance(0), Some(Signal::Watermark(50)));
    /// ```
    pub fn retain(&mut self, partitions: &[u32]) {
        let mut kept = Vec::new();
        for (partition, slot) in self.slots.iter_mut().enumerate() {
            if *slot == usize::MAX {
                continue;
            }
            if partitions.contains(&(partition as u32)) {
                kept.push(*slot);
                *slot = kept.len() - 1;
            } else {
                *slot = usize::MAX;
            }
        }
        self.max = kept.iter().map(|slot| self.max[*slot]).collect();
        self.last_seen = kept.iter().map(|slot| self.last_seen[*slot]).collect();
    }

    #[inline]
    pub fn is_behind(&self, partition: u32, event_time: EventTime) -> bool {
        let own = self
            .slot(partition)
            .and_then(|slot| self.max[slot])
            .map(|max| max.saturating_sub(self.delay));
        own.max(self.current).is_some_and(|w| event_time < w)
    }

    #[inline]
    fn slot(&self, partition: u32) -> Option<usize> {
        self.slots
            .get(partition as usize)
            .copied()
            .filter(|s| *s != usize::MAX)
    }

    /// What to tell downstream at `now`: the watermark if it advanced (or, after
    /// an idle spell, to say the stream is active again), or that every partition
    /// went idle.
    pub fn advance(&mut self, now: Nanos) -> Option<Signal> {
        let mut min: Option<EventTime> = None;
        let (mut any_active, mut waiting) = (false, false);
        for slot in 0..self.max.len() {
            let active = self
                .idle_timeout
                .is_none_or(|timeout| now.saturating_sub(self.last_seen[slot]) < timeout);
            if !active {
                continue;
            }
            any_active = true;
            match self.max[slot] {
                Some(max) => min = Some(min.map_or(max, |m| m.min(max))),
                // An active partition that delivered nothing holds everything back.
                None => waiting = true,
            }
        }
        if !any_active {
            // What the partitions allow that went silent together is passed on
            // before the stream is declared idle, or it would wait for new data.
            let seen = self.max.iter().flatten().min().copied();
            if let Some(watermark) =
                seen.and_then(|max| self.raise_to(max.saturating_sub(self.delay)))
            {
                return Some(Signal::Watermark(watermark));
            }
            return (!std::mem::replace(&mut self.idle, true)).then_some(Signal::Idle);
        }
        let woke = std::mem::take(&mut self.idle);
        if waiting {
            return None;
        }
        if let Some(watermark) = self.raise_to(min?.saturating_sub(self.delay)) {
            return Some(Signal::Watermark(watermark));
        }
        // Back from idle: announcing the watermark again makes the stream count.
        woke.then_some(self.current)
            .flatten()
            .map(Signal::Watermark)
    }

    /// Moves the watermark up to `candidate`, if that is ahead of it.
    fn raise_to(&mut self, candidate: EventTime) -> Option<EventTime> {
        let ahead = self.current.is_none_or(|current| candidate > current);
        ahead.then(|| *self.current.insert(candidate))
    }

    /// The last watermark handed out (or the floor).
    pub fn current(&self) -> Option<EventTime> {
        self.current
    }
}

/// The `with_watermark` operator: sets each record's event time and emits the
/// source watermark whenever it advanced, once per drained batch.
pub(crate) struct AssignWatermarks<T> {
    pub(crate) event_time: Arc<dyn Fn(&T) -> EventTime + Send + Sync>,
    pub(crate) delay: Duration,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) tracker: Option<WatermarkTracker>,
    /// Whether to mark records behind their partition's watermark
    /// (`RecordMeta::behind`): only a clustered query's repartition reads it.
    pub(crate) mark_behind: bool,
}

impl<T: Send + 'static> Operator<T, T> for AssignWatermarks<T> {
    fn allowlisted() -> bool {
        true
    }

    fn on_start(&mut self, ctx: &OperatorContext) -> Result<()> {
        self.tracker = Some(WatermarkTracker::new(
            &ctx.source_partitions,
            self.delay,
            self.idle_timeout,
            ctx.state.restored_watermark(),
            crate::record::now_nanos(),
        ));
        self.mark_behind = ctx.state.is_clustered();
        Ok(())
    }

    #[inline]
    fn process(&mut self, mut record: Record<T>, out: &mut Collector<'_, T>) -> Result<()> {
        record.meta.event_time = (self.event_time)(&record.value);
        let tracker = self
            .tracker
            .as_mut()
            .expect("started before the first record");
        let (partition, event_time) = (record.meta.partition, record.meta.event_time);
        if self.mark_behind {
            record.meta.behind = tracker.is_behind(partition, event_time);
        }
        tracker.observe(partition, event_time, record.meta.ingest_time);
        out.emit_record(record)
    }

    fn on_hand_over(&mut self, ctx: &OperatorContext, starts_over: bool) -> Result<()> {
        if starts_over {
            return self.on_start(ctx);
        }
        let tracker = self.tracker.as_mut().expect("started");
        tracker.retain(&ctx.source_partitions);
        Ok(())
    }

    fn on_flush(&mut self, out: &mut Collector<'_, T>) -> Result<()> {
        let tracker = self.tracker.as_mut().expect("started");
        match tracker.advance(crate::record::now_nanos()) {
            Some(Signal::Watermark(watermark)) => out.watermark(watermark),
            Some(Signal::Idle) => out.idle(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn w(watermark: EventTime) -> Option<Signal> {
        Some(Signal::Watermark(watermark))
    }

    fn tracker(partitions: &[u32], idle: Option<u64>) -> WatermarkTracker {
        WatermarkTracker::new(
            partitions,
            Duration::from_millis(10),
            idle.map(Duration::from_millis),
            None,
            0,
        )
    }

    #[test]
    fn the_watermark_is_the_minimum_of_the_partition_maxima_minus_the_delay() {
        let mut t = tracker(&[0, 2], None);
        t.observe(0, 100, MS);
        assert_eq!(t.advance(MS), None, "partition 2 delivered nothing yet");
        t.observe(2, 50, MS);
        assert_eq!(t.advance(MS), w(40));
        t.observe(2, 70, MS);
        t.observe(0, 60, MS);
        assert_eq!(t.advance(MS), w(60), "max of 0 stays 100; min is 70");
    }

    #[test]
    fn a_slow_partition_holds_the_watermark_back() {
        let mut t = tracker(&[0, 1], None);
        t.observe(0, 1_000, MS);
        t.observe(1, 10, MS);
        assert_eq!(t.advance(MS), w(0));
        for time in (1_100..5_000).step_by(100) {
            t.observe(0, time, 2 * MS);
        }
        assert_eq!(t.advance(2 * MS), None, "partition 1 is still at 10");
        t.observe(1, 500, 3 * MS);
        assert_eq!(t.advance(3 * MS), w(490));
    }

    #[test]
    fn an_idle_timeout_releases_a_silent_partition() {
        let mut t = tracker(&[0, 1], Some(100));
        t.observe(0, 1_000, MS);
        assert_eq!(t.advance(50 * MS), None, "partition 1 is not idle yet");
        t.observe(0, 2_000, 150 * MS);
        assert_eq!(t.advance(150 * MS), w(1_990), "partition 1 idle since 0");
        t.observe(1, 500, 160 * MS);
        assert_eq!(
            t.advance(160 * MS),
            None,
            "active again, and never backwards"
        );
        assert_eq!(t.current(), Some(1_990));
    }

    #[test]
    fn every_partition_idle_declares_the_stream_idle_once_until_data_returns() {
        let mut t = tracker(&[0, 1], Some(100));
        t.observe(0, 300, MS);
        t.observe(1, 700, MS);
        assert_eq!(t.advance(MS), w(290));
        assert_eq!(t.advance(500 * MS), Some(Signal::Idle));
        assert_eq!(t.advance(600 * MS), None);
        t.observe(1, 800, 700 * MS);
        assert_eq!(t.advance(700 * MS), w(790), "partition 0 is still idle");
        assert_eq!(t.advance(900 * MS), Some(Signal::Idle));
        t.observe(0, 100, 950 * MS);
        assert_eq!(
            t.advance(950 * MS),
            w(790),
            "active again: announced, not moved back"
        );
    }

    #[test]
    fn partitions_going_idle_together_pass_on_their_watermark_first() {
        let mut t = tracker(&[0, 1], Some(100));
        t.observe(0, 1_000, 0);
        assert_eq!(t.advance(50 * MS), None, "partition 1 may still deliver");
        assert_eq!(
            t.advance(200 * MS),
            w(990),
            "both idle: what partition 0 allows"
        );
        assert_eq!(t.advance(210 * MS), Some(Signal::Idle));
        assert_eq!(t.advance(220 * MS), None);
    }

    #[test]
    fn the_watermark_is_monotone_and_starts_at_the_restored_floor() {
        let mut t = WatermarkTracker::new(&[0], Duration::ZERO, None, Some(1_000), 0);
        t.observe(0, 400, MS);
        assert_eq!(t.advance(MS), None, "below the restored watermark");
        t.observe(0, 1_500, MS);
        assert_eq!(t.advance(MS), w(1_500));
        t.observe(0, 1_200, MS);
        assert_eq!(t.advance(MS), None);
        assert_eq!(t.current(), Some(1_500));
    }
}
