//! The timers of the keyed process operator: registered per key in checkpointed
//! keyed state, and indexed by time in memory so that firing the due ones costs a
//! look at the earliest entry. The index is rebuilt from the keyed state on start,
//! so restored timers fire as if the query had never stopped.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{EventTime, Result, StateContext};
use serde::{Deserialize, Serialize};

use crate::StateKey;

/// Wall-clock time in milliseconds since the Unix epoch.
pub type ProcessingTime = i64;

/// A timer of one key, as registered with
/// [`ProcessContext::register_timer`](super::ProcessContext::register_timer) and
/// handed to [`KeyedProcessor::on_timer`](super::KeyedProcessor::on_timer).
///
/// ```
/// use rtflow_operators::process::Timer;
/// let timeout = Timer::EventTime(60_000);
/// assert_eq!(timeout.time(), 60_000);
/// assert!(Timer::EventTime(1) < Timer::ProcessingTime(0), "ordered by domain, then time");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Timer {
    /// Fires once the watermark reaches this event time (ms).
    EventTime(EventTime),
    /// Fires once the wall clock reaches this time (ms since the Unix epoch).
    ProcessingTime(ProcessingTime),
}

impl Timer {
    /// When the timer is due, in its domain.
    pub fn time(self) -> i64 {
        match self {
            Timer::EventTime(time) | Timer::ProcessingTime(time) => time,
        }
    }
}

/// What is pending for one key; stored in the checkpoint.
#[derive(Serialize, Deserialize, Default)]
struct KeyTimers {
    event: BTreeSet<EventTime>,
    processing: BTreeSet<ProcessingTime>,
    /// When the key's earliest TTL expires: its expired state is deleted then.
    sweep: Option<ProcessingTime>,
}

impl KeyTimers {
    fn is_empty(&self) -> bool {
        self.event.is_empty() && self.processing.is_empty() && self.sweep.is_none()
    }
}

/// The three queues a key can wait in.
#[derive(Clone, Copy)]
pub(crate) enum Queue {
    Event,
    Processing,
    Sweep,
}

/// Keys by due time, for one queue.
struct Index<K>(BTreeMap<i64, HashSet<K>>);

impl<K: StateKey> Index<K> {
    fn add(&mut self, time: i64, key: K) {
        self.0.entry(time).or_default().insert(key);
    }

    fn remove(&mut self, time: i64, key: &K) {
        if let Some(keys) = self.0.get_mut(&time) {
            keys.remove(key);
            if keys.is_empty() {
                self.0.remove(&time);
            }
        }
    }

    /// Takes one key due at or before `upto`, earliest first.
    fn pop(&mut self, upto: i64) -> Option<(i64, K)> {
        let mut earliest = self.0.first_entry()?;
        let time = *earliest.key();
        if time > upto {
            return None;
        }
        let keys = earliest.get_mut();
        let key = keys.iter().next().cloned().expect("empty sets are removed");
        keys.remove(&key);
        if keys.is_empty() {
            earliest.remove();
        }
        Some((time, key))
    }
}

/// Every key's timers: checkpointed per key, indexed by time.
pub(crate) struct Timers<K> {
    rows: KeyedState<K, KeyTimers>,
    event: Index<K>,
    processing: Index<K>,
    sweeps: Index<K>,
}

/// The timers' name among the operator's states.
const TIMERS: &str = "timers";

impl<K: StateKey> Timers<K> {
    /// Claims the timers' state and indexes what the checkpoint restored.
    pub(crate) fn start(ctx: &StateContext) -> Result<Self> {
        let rows: KeyedState<K, KeyTimers> = ctx.keyed(TIMERS)?;
        let mut timers = Self {
            rows,
            event: Index(BTreeMap::new()),
            processing: Index(BTreeMap::new()),
            sweeps: Index(BTreeMap::new()),
        };
        let mut restored = Vec::new();
        for (key, row) in timers.rows.iter() {
            restored.extend(row.event.iter().map(|t| (Queue::Event, *t, key.clone())));
            restored.extend(
                row.processing
                    .iter()
                    .map(|t| (Queue::Processing, *t, key.clone())),
            );
            restored.extend(row.sweep.map(|t| (Queue::Sweep, t, key.clone())));
        }
        for (queue, time, key) in restored {
            timers.index(queue).add(time, key);
        }
        Ok(timers)
    }

    fn index(&mut self, queue: Queue) -> &mut Index<K> {
        match queue {
            Queue::Event => &mut self.event,
            Queue::Processing => &mut self.processing,
            Queue::Sweep => &mut self.sweeps,
        }
    }

    /// Registers `timer` for `key`; registering it twice keeps one.
    pub(crate) fn register(&mut self, key: &K, timer: Timer) {
        let row = self
            .rows
            .get_or_insert_with(key.clone(), KeyTimers::default);
        let (added, queue) = match timer {
            Timer::EventTime(time) => (row.event.insert(time), Queue::Event),
            Timer::ProcessingTime(time) => (row.processing.insert(time), Queue::Processing),
        };
        if added {
            self.index(queue).add(timer.time(), key.clone());
        }
    }

    /// Deletes `timer` of `key`, if registered.
    pub(crate) fn delete(&mut self, key: &K, timer: Timer) {
        let registered = self.rows.get(key).is_some_and(|row| match timer {
            Timer::EventTime(time) => row.event.contains(&time),
            Timer::ProcessingTime(time) => row.processing.contains(&time),
        });
        if registered {
            let queue = match timer {
                Timer::EventTime(_) => Queue::Event,
                Timer::ProcessingTime(_) => Queue::Processing,
            };
            self.unregister(key, queue, timer.time());
            self.index(queue).remove(timer.time(), key);
        }
    }

    /// The timers of `key`, event-time ones first, each domain in time order.
    pub(crate) fn list(&self, key: &K) -> Vec<Timer> {
        self.rows.get(key).map_or_else(Vec::new, |row| {
            let event = row.event.iter().map(|t| Timer::EventTime(*t));
            let processing = row.processing.iter().map(|t| Timer::ProcessingTime(*t));
            event.chain(processing).collect()
        })
    }

    /// Makes sure `key`'s state is swept of expired values at `expires` or
    /// earlier; one sweep per key is pending at a time.
    pub(crate) fn schedule_sweep(&mut self, key: &K, expires: ProcessingTime) {
        let pending = self.rows.get(key).and_then(|row| row.sweep);
        if pending.is_some_and(|at| at <= expires) {
            return;
        }
        if let Some(at) = pending {
            self.sweeps.remove(at, key);
        }
        self.rows
            .get_or_insert_with(key.clone(), KeyTimers::default)
            .sweep = Some(expires);
        self.sweeps.add(expires, key.clone());
    }

    /// Takes the earliest entry of `queue` due at or before `upto`, removing it
    /// from its key's timers.
    pub(crate) fn pop(&mut self, queue: Queue, upto: i64) -> Option<(i64, K)> {
        let (time, key) = self.index(queue).pop(upto)?;
        self.unregister(&key, queue, time);
        Some((time, key))
    }

    /// Removes one entry from `key`'s row, and the row once it is empty, so keys
    /// without timers cost nothing.
    fn unregister(&mut self, key: &K, queue: Queue, time: i64) {
        let Some(row) = self.rows.get_mut(key) else {
            return;
        };
        match queue {
            Queue::Event => {
                row.event.remove(&time);
            }
            Queue::Processing => {
                row.processing.remove(&time);
            }
            Queue::Sweep => row.sweep = None,
        }
        if row.is_empty() {
            self.rows.remove(key);
        }
    }

    /// The timers' keyed storage, which the operator declares as a table.
    pub(crate) fn table(&mut self) -> &mut dyn Table {
        &mut self.rows
    }
}
