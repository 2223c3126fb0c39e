//! Dispatchers: how an actor's output reaches the mailboxes of the next actors
//! (forward, hash, broadcast, round-robin), in batches that never wait to fill.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{SendTimeoutError, Sender, TrySendError};

use crate::cancel::Cancel;
use crate::error::{Result, RtflowError};
use crate::guard::Place;
pub use crate::key_groups::{key_group, stable_hash, subtask_for_key_group};
use crate::metrics::MailboxMetrics;
use crate::operator::Emit;
use crate::record::{Data, Epoch, EventTime, Message, Record};

/// Hashes a record's key for a shuffle.
pub(crate) type KeyHash<T> = Arc<dyn Fn(&T) -> u64 + Send + Sync>;

/// How records on one edge are spread over the receiving actors.
#[derive(Clone)]
pub(crate) enum Partitioning {
    /// Subtask i to subtask i (equal parallelism).
    Forward,
    /// By key group of the key's hash; holds a [`KeyHash`] of the edge's type.
    Hash(Arc<dyn Any + Send + Sync>),
    /// Every record to every receiver.
    Broadcast,
    /// Records dealt to receivers in turn.
    RoundRobin,
}

impl Partitioning {
    pub(crate) fn hash<T: 'static>(key_hash: KeyHash<T>) -> Self {
        Self::Hash(Arc::new(key_hash))
    }

    pub(crate) fn is_shuffle(&self) -> bool {
        !matches!(self, Self::Forward)
    }

    /// Whether both are the same partitioning: the same hash key, or the same
    /// kind of spreading.
    pub(crate) fn same_as(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Hash(a), Self::Hash(b)) => Arc::ptr_eq(a, b),
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

enum Route<T> {
    Single,
    Hash {
        key_hash: KeyHash<T>,
        key_groups: KeyGroups,
        /// The keyed operator the key is for, blamed when the key panics.
        consumer: Box<Place>,
    },
    Broadcast,
    RoundRobin {
        next: usize,
    },
}

/// The lane of each key group, worked out once: `key_group` and
/// `subtask_for_key_group` divide by numbers known only at run time, two
/// integer divisions per record that took a sixth of a shuffling actor's time.
struct KeyGroups {
    /// `key_groups - 1` when the count is a power of two (the default, 128):
    /// the remainder is then a mask.
    mask: Option<u64>,
    count: u64,
    lanes: Box<[u32]>,
}

impl KeyGroups {
    fn new(key_groups: usize, lanes: usize) -> Self {
        Self {
            mask: key_groups
                .is_power_of_two()
                .then_some(key_groups as u64 - 1),
            count: key_groups as u64,
            lanes: (0..key_groups)
                .map(|group| subtask_for_key_group(group, key_groups, lanes) as u32)
                .collect(),
        }
    }

    /// The lane of a key hash: its key group's owner.
    #[inline]
    fn lane(&self, hash: u64) -> usize {
        let group = match self.mask {
            Some(mask) => hash & mask,
            None => hash % self.count,
        };
        self.lanes[group as usize] as usize
    }
}

/// The sending end of one edge for one upstream actor.
pub(crate) struct Output<T> {
    lanes: Vec<Sender<Message<T>>>,
    mailboxes: Vec<Arc<MailboxMetrics>>,
    buffers: Vec<Vec<Record<T>>>,
    route: Route<T>,
    max_records: usize,
    cancel: Cancel,
}

impl<T: Data> Output<T> {
    /// `consumer` is the operator the lanes lead to, with the sending subtask.
    pub(crate) fn new(
        lanes: Vec<(Sender<Message<T>>, Arc<MailboxMetrics>)>,
        partitioning: &Partitioning,
        consumer: Place,
        max_key_groups: usize,
        max_records: usize,
        cancel: Cancel,
    ) -> Self {
        let route = match partitioning {
            _ if lanes.len() == 1 => Route::Single,
            Partitioning::Forward => Route::Single,
            Partitioning::Hash(any) => Route::Hash {
                key_hash: any
                    .downcast_ref::<KeyHash<T>>()
                    .expect("hash partitioning built for the edge's record type")
                    .clone(),
                key_groups: KeyGroups::new(max_key_groups, lanes.len()),
                consumer: Box::new(consumer),
            },
            Partitioning::Broadcast => Route::Broadcast,
            Partitioning::RoundRobin => Route::RoundRobin { next: 0 },
        };
        let (lanes, mailboxes): (Vec<_>, Vec<_>) = lanes.into_iter().unzip();
        Self {
            buffers: lanes
                .iter()
                .map(|_| Vec::with_capacity(max_records))
                .collect(),
            lanes,
            mailboxes,
            route,
            max_records,
            cancel,
        }
    }

    #[inline]
    fn push(&mut self, lane: usize, record: Record<T>) -> Result<()> {
        let buffer = &mut self.buffers[lane];
        buffer.push(record);
        if buffer.len() >= self.max_records {
            self.send_buffer(lane)?;
        }
        Ok(())
    }

    fn send_buffer(&mut self, lane: usize) -> Result<()> {
        let batch = std::mem::replace(
            &mut self.buffers[lane],
            Vec::with_capacity(self.max_records),
        );
        self.send(lane, Message::Data(batch))
    }

    fn flush_buffers(&mut self) -> Result<()> {
        for lane in 0..self.lanes.len() {
            if !self.buffers[lane].is_empty() {
                self.send_buffer(lane)?;
            }
        }
        Ok(())
    }

    /// Blocks while the lane is full (backpressure), waking to notice cancellation.
    fn send(&mut self, lane: usize, message: Message<T>) -> Result<()> {
        let sender = &self.lanes[lane];
        let mailbox = &self.mailboxes[lane];
        match sender.try_send(message) {
            Ok(()) => {}
            Err(TrySendError::Disconnected(_)) => return Err(RtflowError::Cancelled),
            Err(TrySendError::Full(mut message)) => {
                let blocked_since = Instant::now();
                loop {
                    if self.cancel.is_raised() {
                        return Err(RtflowError::Cancelled);
                    }
                    match sender.send_timeout(message, Duration::from_millis(50)) {
                        Ok(()) => break,
                        Err(SendTimeoutError::Timeout(back)) => message = back,
                        Err(SendTimeoutError::Disconnected(_)) => {
                            return Err(RtflowError::Cancelled)
                        }
                    }
                }
                mailbox.add_blocked(blocked_since.elapsed());
            }
        }
        mailbox.observe_depth(sender.len());
        Ok(())
    }

    fn send_to_all(&mut self, message: impl Fn() -> Message<T>) -> Result<()> {
        self.flush_buffers()?;
        for lane in 0..self.lanes.len() {
            self.send(lane, message())?;
        }
        Ok(())
    }
}

impl<T: Data> Emit<T> for Output<T> {
    #[inline]
    fn record(&mut self, record: Record<T>) -> Result<()> {
        let lane = match &mut self.route {
            Route::Single => 0,
            Route::Hash {
                key_hash,
                key_groups,
                consumer,
            } => {
                let watch = consumer.enter();
                let hash = key_hash(&record.value);
                watch.end();
                key_groups.lane(hash)
            }
            Route::RoundRobin { next } => {
                let lane = *next;
                *next = (lane + 1) % self.lanes.len();
                lane
            }
            Route::Broadcast => {
                let last = self.lanes.len() - 1;
                for lane in 0..last {
                    self.push(lane, record.clone())?;
                }
                last
            }
        };
        self.push(lane, record)
    }

    fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.send_to_all(|| Message::Watermark(watermark))
    }

    fn idle(&mut self) -> Result<()> {
        self.send_to_all(|| Message::Idle)
    }

    fn barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.send_to_all(|| Message::Barrier(epoch))
    }

    fn flush(&mut self) -> Result<()> {
        self.flush_buffers()
    }

    fn end(&mut self) -> Result<()> {
        self.send_to_all(|| Message::End)
    }

    fn abort(&mut self, _error: &RtflowError) {}
}

/// One actor output feeding several consumers: each gets every record.
pub(crate) struct Fanout<T> {
    pub(crate) outputs: Vec<Box<dyn Emit<T>>>,
}

impl<T: Data> Emit<T> for Fanout<T> {
    fn record(&mut self, record: Record<T>) -> Result<()> {
        let (last, rest) = self.outputs.split_last_mut().expect("a fanout has outputs");
        for output in rest {
            output.record(record.clone())?;
        }
        last.record(record)
    }

    fn watermark(&mut self, watermark: EventTime) -> Result<()> {
        self.outputs
            .iter_mut()
            .try_for_each(|o| o.watermark(watermark))
    }

    fn idle(&mut self) -> Result<()> {
        self.outputs.iter_mut().try_for_each(|o| o.idle())
    }

    fn barrier(&mut self, epoch: Epoch) -> Result<()> {
        self.outputs.iter_mut().try_for_each(|o| o.barrier(epoch))
    }

    fn continue_snapshot(&mut self, budget: usize) -> Result<bool> {
        let mut done = true;
        for output in &mut self.outputs {
            done &= output.continue_snapshot(budget)?;
        }
        Ok(done)
    }

    fn flush(&mut self) -> Result<()> {
        self.outputs.iter_mut().try_for_each(|o| o.flush())
    }

    fn end(&mut self) -> Result<()> {
        self.outputs.iter_mut().try_for_each(|o| o.end())
    }

    fn abort(&mut self, error: &RtflowError) {
        self.outputs.iter_mut().for_each(|o| o.abort(error));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precomputed_lanes_match_key_group_owners() {
        for (key_groups, lanes) in [(128, 2), (128, 3), (100, 3), (7, 2)] {
            let table = KeyGroups::new(key_groups, lanes);
            for key in 0..1_000u64 {
                let hash = stable_hash(&key);
                let group = key_group(hash, key_groups);
                assert_eq!(
                    table.lane(hash),
                    subtask_for_key_group(group, key_groups, lanes)
                );
            }
        }
    }
}
