//! The named states of the keyed process operator: value, list and map state per
//! key, each an own [`KeyedState`] (so each is checkpointed incrementally and its
//! types are checked on restore), with an optional time to live.
//!
//! TTL runs in **processing time**, as in Spark's transformWithState and Flink's
//! state TTL: a write stamps what it wrote with `now + ttl` (wall clock), reads
//! no longer see it once that time passed, and a per-key sweep deletes it from
//! the state (and so from the next checkpoint) soon after. Reads do not extend
//! the TTL. Expiry times are absolute, so time the query is down counts too.

use std::any::Any;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::time::Duration;

use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{Result, StateContext};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::timers::{ProcessingTime, Timers};
use crate::{StateKey, StateValue};

/// The declaration of a named state of kind `S` ([`ValueState`], [`ListState`] or
/// [`MapState`]): declare it in
/// [`KeyedProcessor::init`](super::KeyedProcessor::init), then use it through the
/// [`ProcessContext`](super::ProcessContext). A `const` is the natural home.
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::process::{ListState, MapState, ValueState};
///
/// const COUNT: ValueState<u64> = ValueState::new("count");
/// const RECENT: ListState<String> = ListState::new("recent").with_ttl(Duration::from_secs(60));
/// const PER_PAGE: MapState<String, u32> = MapState::new("per-page");
/// assert_eq!(RECENT.name(), "recent");
/// assert_eq!(RECENT.ttl(), Some(Duration::from_secs(60)));
/// assert_eq!(COUNT.ttl(), None);
/// # let _ = PER_PAGE;
/// ```
pub struct StateSpec<S> {
    name: &'static str,
    ttl: Option<Duration>,
    _kind: PhantomData<fn() -> S>,
}

impl<S> StateSpec<S> {
    /// A state called `name`, unique within its operator, without TTL.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            ttl: None,
            _kind: PhantomData,
        }
    }

    /// Values written expire `ttl` later, in processing time.
    pub const fn with_ttl(self, ttl: Duration) -> Self {
        Self {
            ttl: Some(ttl),
            ..self
        }
    }

    /// The state's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// How long written values live, if they expire.
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl
    }
}

/// One value of type `V` per key.
pub type ValueState<V> = StateSpec<ValueKind<V>>;
/// A list of `V` per key; with a TTL every element expires on its own.
pub type ListState<V> = StateSpec<ListKind<V>>;
/// A map from `UK` to `UV` per key, ordered by `UK`; with a TTL every entry
/// expires on its own.
pub type MapState<UK, UV> = StateSpec<MapKind<UK, UV>>;

/// The kind of a [`ValueState`].
pub struct ValueKind<V>(PhantomData<fn() -> V>);
/// The kind of a [`ListState`].
pub struct ListKind<V>(PhantomData<fn() -> V>);
/// The kind of a [`MapState`].
pub struct MapKind<UK, UV>(PhantomData<fn() -> (UK, UV)>);

/// What a kind of state stores per key.
pub trait StateKind: 'static {
    /// The stored form (values stamped with their expiry).
    #[doc(hidden)]
    type Cell: Cell;
    /// The prefix of the state's name in checkpoints.
    #[doc(hidden)]
    const KIND: &'static str;
}

impl<V: StateValue> StateKind for ValueKind<V> {
    type Cell = Stamped<V>;
    const KIND: &'static str = "value";
}

impl<V: StateValue> StateKind for ListKind<V> {
    type Cell = Vec<Stamped<V>>;
    const KIND: &'static str = "list";
}

impl<UK, UV> StateKind for MapKind<UK, UV>
where
    UK: Ord + StateValue,
    UV: StateValue,
{
    type Cell = BTreeMap<UK, Stamped<UV>>;
    const KIND: &'static str = "map";
}

/// A stored value and when it expires (processing time, ms), if its state has a TTL.
#[doc(hidden)]
#[derive(Serialize, Deserialize)]
pub struct Stamped<V> {
    value: V,
    expires: Option<ProcessingTime>,
}

impl<V> Stamped<V> {
    fn live(&self, now: ProcessingTime) -> bool {
        self.expires.is_none_or(|expires| expires > now)
    }
}

/// What one key holds in one state, as far as expiry goes.
#[doc(hidden)]
pub trait Cell: Serialize + DeserializeOwned + Send + 'static {
    /// The earliest expiry of what is held.
    fn next_expiry(&self) -> Option<ProcessingTime>;
    /// Drops what expired at `now`; returns whether anything is left.
    fn drop_expired(&mut self, now: ProcessingTime) -> bool;
}

impl<V: StateValue> Cell for Stamped<V> {
    fn next_expiry(&self) -> Option<ProcessingTime> {
        self.expires
    }

    fn drop_expired(&mut self, now: ProcessingTime) -> bool {
        self.live(now)
    }
}

impl<V: StateValue> Cell for Vec<Stamped<V>> {
    fn next_expiry(&self) -> Option<ProcessingTime> {
        self.iter().filter_map(|s| s.expires).min()
    }

    fn drop_expired(&mut self, now: ProcessingTime) -> bool {
        self.retain(|s| s.live(now));
        !self.is_empty()
    }
}

impl<UK: Ord + StateValue, UV: StateValue> Cell for BTreeMap<UK, Stamped<UV>> {
    fn next_expiry(&self) -> Option<ProcessingTime> {
        self.values().filter_map(|s| s.expires).min()
    }

    fn drop_expired(&mut self, now: ProcessingTime) -> bool {
        self.retain(|_, s| s.live(now));
        !self.is_empty()
    }
}

/// A declared state with its keyed storage.
pub(crate) struct Declared<K, C> {
    name: &'static str,
    ttl: Option<i64>,
    state: KeyedState<K, C>,
}

impl<K: StateKey, C: Cell> Declared<K, C> {
    pub(crate) fn claim<S>(ctx: &StateContext, spec: &StateSpec<S>) -> Result<Self>
    where
        S: StateKind<Cell = C>,
    {
        Ok(Self {
            name: spec.name,
            ttl: spec.ttl.map(|ttl| ttl.as_millis() as i64),
            state: ctx.keyed(&format!("{}/{}", S::KIND, spec.name))?,
        })
    }

    /// Access for `key` at processing time `now`.
    pub(crate) fn slot<'a>(
        &'a mut self,
        key: &'a K,
        timers: &'a mut Timers<K>,
        now: ProcessingTime,
    ) -> Slot<'a, K, C> {
        Slot {
            state: &mut self.state,
            key,
            ttl: self.ttl,
            now,
            timers,
        }
    }
}

/// A declared state whatever its types, for the operator's list of states.
pub(crate) trait AnyState<K>: Send {
    fn name(&self) -> &'static str;
    fn as_any(&mut self) -> &mut dyn Any;
    /// Its keyed storage, which the operator declares as a table.
    fn table(&mut self) -> &mut dyn Table;
    /// Deletes what of `key` expired at `now`; returns the next expiry left.
    fn sweep(&mut self, key: &K, now: ProcessingTime) -> Option<ProcessingTime>;
}

impl<K: StateKey, C: Cell> AnyState<K> for Declared<K, C> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn as_any(&mut self) -> &mut dyn Any {
        self
    }

    fn table(&mut self) -> &mut dyn Table {
        &mut self.state
    }

    fn sweep(&mut self, key: &K, now: ProcessingTime) -> Option<ProcessingTime> {
        self.ttl?;
        let expired = self
            .state
            .get(key)?
            .next_expiry()
            .is_some_and(|expires| expires <= now);
        // Only a key that really lost something counts as changed.
        if expired {
            let left = self.state.get_mut(key).is_some_and(|c| c.drop_expired(now));
            if !left {
                self.state.remove(key);
            }
        }
        self.state.get(key)?.next_expiry()
    }
}

/// One key's place in one state, for the accessors.
pub(crate) struct Slot<'a, K, C> {
    state: &'a mut KeyedState<K, C>,
    key: &'a K,
    ttl: Option<i64>,
    now: ProcessingTime,
    timers: &'a mut Timers<K>,
}

impl<K: StateKey, C: Cell> Slot<'_, K, C> {
    /// Stamps `value` for a write now, scheduling the sweep that deletes it.
    fn stamp<V>(&mut self, value: V) -> Stamped<V> {
        let expires = self.ttl.map(|ttl| self.now.saturating_add(ttl));
        if let Some(expires) = expires {
            self.timers.schedule_sweep(self.key, expires);
        }
        Stamped { value, expires }
    }

    fn cell(&self) -> Option<&C> {
        self.state.get(self.key)
    }
}

/// The current key's value in a [`ValueState`], from
/// [`ProcessContext::value`](super::ProcessContext::value).
pub struct ValueAccess<'a, K, V>(pub(crate) Slot<'a, K, Stamped<V>>);

impl<K: StateKey, V: StateValue> ValueAccess<'_, K, V> {
    /// The value, unless none was set or it expired.
    pub fn get(&self) -> Option<&V> {
        let now = self.0.now;
        self.0.cell().filter(|s| s.live(now)).map(|s| &s.value)
    }

    /// Sets the value (and restarts its TTL).
    pub fn set(&mut self, value: V) {
        let stamped = self.0.stamp(value);
        self.0.state.insert(self.0.key.clone(), stamped);
    }

    /// Deletes the value, returning it unless it had expired.
    pub fn clear(&mut self) -> Option<V> {
        let now = self.0.now;
        self.0
            .state
            .remove(self.0.key)
            .filter(|s| s.live(now))
            .map(|s| s.value)
    }
}

/// The current key's list in a [`ListState`], from
/// [`ProcessContext::list`](super::ProcessContext::list).
pub struct ListAccess<'a, K, V>(pub(crate) Slot<'a, K, Vec<Stamped<V>>>);

impl<K: StateKey, V: StateValue> ListAccess<'_, K, V> {
    /// The elements that have not expired, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &V> {
        let now = self.0.now;
        self.0
            .cell()
            .into_iter()
            .flatten()
            .filter(move |s| s.live(now))
            .map(|s| &s.value)
    }

    /// The number of elements that have not expired.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether no element is left.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// Appends `value`, with a TTL of its own.
    pub fn push(&mut self, value: V) {
        let stamped = self.0.stamp(value);
        self.0
            .state
            .get_or_insert_with(self.0.key.clone(), Vec::new)
            .push(stamped);
    }

    /// Replaces the list with `values`; an empty list deletes the key's state.
    pub fn set(&mut self, values: impl IntoIterator<Item = V>) {
        let list: Vec<_> = values.into_iter().map(|v| self.0.stamp(v)).collect();
        if list.is_empty() {
            self.0.state.remove(self.0.key);
        } else {
            self.0.state.insert(self.0.key.clone(), list);
        }
    }

    /// Deletes the list, returning the elements that had not expired.
    pub fn clear(&mut self) -> Vec<V> {
        let now = self.0.now;
        let list = self.0.state.remove(self.0.key).unwrap_or_default();
        list.into_iter()
            .filter(|s| s.live(now))
            .map(|s| s.value)
            .collect()
    }
}

/// The current key's map in a [`MapState`], from
/// [`ProcessContext::map`](super::ProcessContext::map).
pub struct MapAccess<'a, K, UK, UV>(pub(crate) Slot<'a, K, BTreeMap<UK, Stamped<UV>>>);

impl<K: StateKey, UK: Ord + StateValue, UV: StateValue> MapAccess<'_, K, UK, UV> {
    /// The value under `user_key`, unless absent or expired.
    pub fn get(&self, user_key: &UK) -> Option<&UV> {
        let now = self.0.now;
        self.0
            .cell()?
            .get(user_key)
            .filter(|s| s.live(now))
            .map(|s| &s.value)
    }

    /// Whether `user_key` has a value that has not expired.
    pub fn contains_key(&self, user_key: &UK) -> bool {
        self.get(user_key).is_some()
    }

    /// The entries that have not expired, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&UK, &UV)> {
        let now = self.0.now;
        self.0
            .cell()
            .into_iter()
            .flatten()
            .filter(move |(_, s)| s.live(now))
            .map(|(k, s)| (k, &s.value))
    }

    /// The number of entries that have not expired.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether no entry is left.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// Sets the value under `user_key` (with a TTL of its own), returning the
    /// previous one unless it had expired.
    pub fn insert(&mut self, user_key: UK, value: UV) -> Option<UV> {
        let (stamped, now) = (self.0.stamp(value), self.0.now);
        self.0
            .state
            .get_or_insert_with(self.0.key.clone(), BTreeMap::new)
            .insert(user_key, stamped)
            .filter(|s| s.live(now))
            .map(|s| s.value)
    }

    /// Deletes `user_key`, returning its value unless it had expired; the last
    /// entry takes the key's state with it.
    pub fn remove(&mut self, user_key: &UK) -> Option<UV> {
        let now = self.0.now;
        self.cell_contains(user_key).then_some(())?;
        let map = self.0.state.get_mut(self.0.key)?;
        let removed = map.remove(user_key);
        if map.is_empty() {
            self.0.state.remove(self.0.key);
        }
        removed.filter(|s| s.live(now)).map(|s| s.value)
    }

    /// Deletes every entry.
    pub fn clear(&mut self) {
        self.0.state.remove(self.0.key);
    }

    /// Whether the stored map has `user_key`, expired or not (so a miss does not
    /// mark the key changed).
    fn cell_contains(&self, user_key: &UK) -> bool {
        self.0.cell().is_some_and(|map| map.contains_key(user_key))
    }
}
