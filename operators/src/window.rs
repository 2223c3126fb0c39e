//! Windowed aggregations per key: after `key_by`, records are grouped by key and by
//! event-time window (tumbling, sliding or session), and every record emits the
//! updated aggregate of each `(key, window)` it falls into at once (update output
//! mode), as `(key, window, aggregate)`.
//!
//! Windows close with the operator's input watermark, as in Spark: a window whose
//! end is at or behind the watermark takes no more records and its state is
//! evicted, a few keys' windows at each watermark and record, so that a watermark
//! closing the windows of many keys does not hold the records up. A record whose
//! windows have all closed is late: it is dropped and counted
//! (`rtflow_late_records_total`). Session windows follow the same rule
//! with one refinement, explained at [`Window::session`].
//!
//! Every open window lives in keyed state (one entry per key, holding that key's
//! open windows), so it is checkpointed incrementally and restored exactly; the
//! operator's own watermark is checkpointed too, so a restored instance neither
//! reopens a window it had closed nor accepts a record it would have dropped.
//!
//! ```
//! use std::time::Duration;
//! use rtflow_operators::{Window, WindowExt};
//! use rtflow_runtime::Dataflow;
//! # use rtflow_connectors::{MemorySink, MemorySource};
//! let flow = Dataflow::new("clicks");
//! // (user, page, event time in ms)
//! let clicks = flow
//!     .source(MemorySource::<(String, String, i64)>::new(1))
//!     .with_watermark(|(_, _, time)| *time, Duration::from_secs(5));
//! let by_user = clicks.key_by(|(user, _, _)| user.clone());
//! by_user
//!     .window(Window::sliding(Duration::from_secs(10), Duration::from_secs(2)))
//!     .count()
//!     .sink(MemorySink::new());
//! by_user
//!     .window(Window::session(Duration::from_secs(30)))
//!     .max(|(_, _, time)| *time)
//!     .sink(MemorySink::new());
//! ```

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ops::AddAssign;
use std::sync::Arc;
use std::time::Duration;

use rtflow_runtime::record::EventTime;
use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{
    Collector, Data, KeyedStream, Operator, OperatorContext, Record, Result, Stream,
};
use serde::{Deserialize, Serialize};

use crate::aggregate::{StateKey, StateValue};
use crate::expiry::{Expiries, EVICT_PER_WATERMARK};
use crate::lateness::Lateness;

/// A window of event time: `[start, end)`, in milliseconds since the Unix epoch.
///
/// Its associated functions say how records are assigned to windows:
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::Window;
/// let minutes = Window::tumbling(Duration::from_secs(60));
/// let hop = Window::sliding(Duration::from_secs(10), Duration::from_secs(2));
/// let visits = Window::session(Duration::from_secs(30 * 60));
/// # let _ = (minutes, hop, visits);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    /// The first millisecond in the window.
    pub start: EventTime,
    /// The first millisecond after it.
    pub end: EventTime,
}

impl Window {
    /// Back-to-back windows of `size`, aligned to multiples of `size` since the
    /// Unix epoch: each record falls into exactly one.
    ///
    /// # Panics
    ///
    /// If `size` is shorter than a millisecond.
    pub fn tumbling(size: Duration) -> Windowing {
        Self::sliding(size, size)
    }

    /// Windows of `size` starting every `slide` (aligned to multiples of `slide`
    /// since the Unix epoch): each record falls into `size / slide` of them
    /// (rounded up or down, by where it lies), and updates each.
    ///
    /// # Panics
    ///
    /// If `size` or `slide` is shorter than a millisecond, or `slide` is longer
    /// than `size` (records would fall between windows).
    pub fn sliding(size: Duration, slide: Duration) -> Windowing {
        let (size, slide) = (millis(size, "window size"), millis(slide, "window slide"));
        assert!(
            slide <= size,
            "a window slide ({slide} ms) longer than the window ({size} ms) would leave records \
             outside every window"
        );
        Windowing(Assigner::Sliding { size, slide })
    }

    /// Per-key sessions of activity: a record opens `[time, time + gap)`, and
    /// windows that overlap merge into one, so a session ends once its key has
    /// been silent for `gap`. Records `gap` or more apart are in different
    /// sessions.
    ///
    /// A session closes when the watermark reaches its end. A record is late when
    /// its event time is behind the watermark: such a record could belong to a
    /// session that has already closed, which merging it into a new one would
    /// split in two. Records at or after the watermark never touch a closed
    /// session, so the open sessions are always those a batch run over the
    /// accepted records would find.
    ///
    /// # Panics
    ///
    /// If `gap` is shorter than a millisecond.
    pub fn session(gap: Duration) -> Windowing {
        Windowing(Assigner::Session {
            gap: millis(gap, "session gap"),
        })
    }
}

/// Whole milliseconds of a window parameter, which must be at least one.
fn millis(duration: Duration, what: &str) -> i64 {
    let ms = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
    assert!(ms > 0, "the {what} must be at least 1 ms, not {duration:?}");
    ms
}

/// How records are assigned to windows: made by [`Window::tumbling`],
/// [`Window::sliding`] and [`Window::session`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windowing(Assigner);

impl Windowing {
    /// Every window of a batch run over `records` (key, event time, value),
    /// with the values of its records: what the windowed
    /// operators' final updates add up to when no record is late. A batch
    /// reference for tests.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow_operators::Window;
    /// let sessions = Window::session(Duration::from_millis(10))
    ///     .assign_batch([("a", 0, 'x'), ("a", 5, 'y'), ("a", 30, 'z')]);
    /// let windows: Vec<_> = sessions.into_iter().collect();
    /// assert_eq!(windows, [
    ///     (("a", Window { start: 0, end: 15 }), vec!['x', 'y']),
    ///     (("a", Window { start: 30, end: 40 }), vec!['z']),
    /// ]);
    /// ```
    pub fn assign_batch<K: Ord + Clone, V: Clone>(
        &self,
        records: impl IntoIterator<Item = (K, EventTime, V)>,
    ) -> BTreeMap<(K, Window), Vec<V>> {
        let mut windows: BTreeMap<(K, Window), Vec<V>> = BTreeMap::new();
        match self.0 {
            Assigner::Sliding { size, slide } => {
                for (key, time, value) in records {
                    // Every window start, a multiple of the slide, in
                    // (time - size, time].
                    let mut start = time - time.rem_euclid(slide);
                    while start > time - size {
                        let window = Window {
                            start,
                            end: start + size,
                        };
                        windows
                            .entry((key.clone(), window))
                            .or_default()
                            .push(value.clone());
                        start -= slide;
                    }
                }
            }
            Assigner::Session { gap } => {
                let mut by_key: BTreeMap<K, Vec<(EventTime, V)>> = BTreeMap::new();
                for (key, time, value) in records {
                    by_key.entry(key).or_default().push((time, value));
                }
                for (key, mut rows) in by_key {
                    rows.sort_by_key(|(time, _)| *time);
                    let mut session: Option<(Window, Vec<V>)> = None;
                    for (time, value) in rows {
                        match &mut session {
                            Some((window, values)) if time < window.end => {
                                window.end = window.end.max(time + gap);
                                values.push(value);
                            }
                            _ => {
                                if let Some((window, values)) = session.take() {
                                    windows.insert((key.clone(), window), values);
                                }
                                let window = Window {
                                    start: time,
                                    end: time + gap,
                                };
                                session = Some((window, vec![value]));
                            }
                        }
                    }
                    if let Some((window, values)) = session {
                        windows.insert((key, window), values);
                    }
                }
            }
        }
        windows
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Assigner {
    /// Tumbling windows are sliding ones whose slide is their size.
    Sliding {
        size: i64,
        slide: i64,
    },
    Session {
        gap: i64,
    },
}

/// A user-defined aggregate over the records of a window.
///
/// `merge` combines the accumulators of two session windows that a record joined
/// into one. `result` is read only from accumulators that took at least one
/// record.
///
/// ```
/// use rtflow_operators::AggregateFunction;
///
/// /// The distinct pages a user visited.
/// struct DistinctPages;
///
/// impl AggregateFunction<(String, String)> for DistinctPages {
///     type Acc = std::collections::BTreeSet<String>;
///     type Out = usize;
///
///     fn create(&self) -> Self::Acc {
///         Default::default()
///     }
///     fn add(&self, pages: &mut Self::Acc, (_, page): &(String, String)) {
///         pages.insert(page.clone());
///     }
///     fn merge(&self, pages: &mut Self::Acc, other: Self::Acc) {
///         pages.extend(other);
///     }
///     fn result(&self, pages: &Self::Acc) -> usize {
///         pages.len()
///     }
/// }
/// ```
pub trait AggregateFunction<T>: Send + Sync + 'static {
    /// The per-window accumulator, kept in checkpointed state.
    type Acc: StateValue;
    /// What each update emits.
    type Out: Data;

    /// The accumulator of an empty window.
    fn create(&self) -> Self::Acc;
    /// Folds a record into `acc`.
    fn add(&self, acc: &mut Self::Acc, record: &T);
    /// Folds another window's accumulator into `acc` (session windows merging).
    fn merge(&self, acc: &mut Self::Acc, other: Self::Acc);
    /// The aggregate of the records folded into `acc`.
    fn result(&self, acc: &Self::Acc) -> Self::Out;
}

/// Windowed aggregations as builder methods on a keyed stream.
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::{StreamExt, Window, WindowExt};
/// use rtflow_runtime::Dataflow;
/// # use rtflow_connectors::{MemorySink, MemorySource};
/// let flow = Dataflow::new("spend");
/// // (user, cents, event time in ms)
/// let purchases = flow
///     .source(MemorySource::<(u32, u64, i64)>::new(2))
///     .with_watermark(|(_, _, time)| *time, Duration::from_secs(1));
/// purchases
///     .key_by(|(user, _, _)| *user)
///     .window(Window::tumbling(Duration::from_secs(60)))
///     .sum(|(_, cents, _)| *cents)
///     .map(|(user, window, cents)| format!("{user} spent {cents} from {}", window.start))
///     .sink(MemorySink::new());
/// ```
pub trait WindowExt<K, T> {
    /// Groups the records of each key into windows; aggregate them with the
    /// returned builder.
    fn window(&self, windowing: Windowing) -> WindowedStream<K, T>;
}

impl<K: StateKey, T: Data> WindowExt<K, T> for KeyedStream<K, T> {
    fn window(&self, windowing: Windowing) -> WindowedStream<K, T> {
        WindowedStream {
            stream: self.as_ref().clone(),
            key: self.key_fn(),
            windowing,
        }
    }
}

type KeyFn<T, K> = Arc<dyn Fn(&T) -> K + Send + Sync>;

/// A keyed stream grouped into windows (see [`WindowExt::window`]): pick the
/// aggregate.
pub struct WindowedStream<K, T> {
    stream: Stream<T>,
    key: KeyFn<T, K>,
    windowing: Windowing,
}

impl<K: StateKey, T: Data> WindowedStream<K, T> {
    /// Records per key and window.
    pub fn count(&self) -> Stream<(K, Window, u64)> {
        self.build("window_count", Count)
    }

    /// The sum of `value` per key and window.
    pub fn sum<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, Window, N)>
    where
        N: StateValue + Data + Copy + Default + AddAssign,
    {
        self.build("window_sum", Sum(value, PhantomData))
    }

    /// The least `value` per key and window.
    pub fn min<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, Window, N)>
    where
        N: StateValue + Data + Copy + PartialOrd,
    {
        self.build("window_min", Extreme::new(value, |new, old| new < old))
    }

    /// The greatest `value` per key and window.
    pub fn max<N>(&self, value: impl Fn(&T) -> N + Send + Sync + 'static) -> Stream<(K, Window, N)>
    where
        N: StateValue + Data + Copy + PartialOrd,
    {
        self.build("window_max", Extreme::new(value, |new, old| new > old))
    }

    /// The mean of `value` per key and window.
    pub fn avg(
        &self,
        value: impl Fn(&T) -> f64 + Send + Sync + 'static,
    ) -> Stream<(K, Window, f64)> {
        self.build("window_avg", Avg(value))
    }

    /// A user-defined aggregate per key and window.
    pub fn aggregate<A: AggregateFunction<T>>(&self, aggregate: A) -> Stream<(K, Window, A::Out)> {
        self.build("window_aggregate", aggregate)
    }

    fn build<A: AggregateFunction<T>>(
        &self,
        kind: &str,
        aggregate: A,
    ) -> Stream<(K, Window, A::Out)> {
        let (key, windowing, aggregate) = (self.key.clone(), self.windowing, Arc::new(aggregate));
        self.stream.try_transform(kind, move |ctx| {
            WindowAggregate::new(key.clone(), windowing.0, aggregate.clone(), ctx)
        })
    }
}

struct Count;

impl<T> AggregateFunction<T> for Count {
    type Acc = u64;
    type Out = u64;

    fn create(&self) -> u64 {
        0
    }
    fn add(&self, count: &mut u64, _: &T) {
        *count += 1;
    }
    fn merge(&self, count: &mut u64, other: u64) {
        *count += other;
    }
    fn result(&self, count: &u64) -> u64 {
        *count
    }
}

/// `PhantomData<fn() -> N>`: the value type is named by the impl, not stored.
struct Sum<F, N>(F, PhantomData<fn() -> N>);

impl<T, N, F> AggregateFunction<T> for Sum<F, N>
where
    F: Fn(&T) -> N + Send + Sync + 'static,
    N: StateValue + Data + Copy + Default + AddAssign,
{
    type Acc = N;
    type Out = N;

    fn create(&self) -> N {
        N::default()
    }
    fn add(&self, sum: &mut N, record: &T) {
        *sum += (self.0)(record);
    }
    fn merge(&self, sum: &mut N, other: N) {
        *sum += other;
    }
    fn result(&self, sum: &N) -> N {
        *sum
    }
}

/// `min` or `max`: keeps the value for which `replaces(new, old)` holds.
struct Extreme<F, N> {
    value: F,
    replaces: fn(&N, &N) -> bool,
}

impl<F, N> Extreme<F, N> {
    fn new(value: F, replaces: fn(&N, &N) -> bool) -> Self {
        Self { value, replaces }
    }

    fn offer(&self, current: &mut Option<N>, candidate: N) {
        match current {
            Some(old) if !(self.replaces)(&candidate, old) => {}
            _ => *current = Some(candidate),
        }
    }
}

impl<T, N, F> AggregateFunction<T> for Extreme<F, N>
where
    F: Fn(&T) -> N + Send + Sync + 'static,
    N: StateValue + Data + Copy + PartialOrd,
{
    /// `None` only while the window is empty.
    type Acc = Option<N>;
    type Out = N;

    fn create(&self) -> Option<N> {
        None
    }
    fn add(&self, current: &mut Option<N>, record: &T) {
        self.offer(current, (self.value)(record));
    }
    fn merge(&self, current: &mut Option<N>, other: Option<N>) {
        if let Some(other) = other {
            self.offer(current, other);
        }
    }
    fn result(&self, current: &Option<N>) -> N {
        current.expect("results are read after a record was added")
    }
}

struct Avg<F>(F);

impl<T, F> AggregateFunction<T> for Avg<F>
where
    F: Fn(&T) -> f64 + Send + Sync + 'static,
{
    /// Sum and count.
    type Acc = (f64, u64);
    type Out = f64;

    fn create(&self) -> (f64, u64) {
        (0.0, 0)
    }
    fn add(&self, (sum, count): &mut (f64, u64), record: &T) {
        *sum += (self.0)(record);
        *count += 1;
    }
    fn merge(&self, (sum, count): &mut (f64, u64), (other_sum, other_count): (f64, u64)) {
        *sum += other_sum;
        *count += other_count;
    }
    fn result(&self, (sum, count): &(f64, u64)) -> f64 {
        sum / *count as f64
    }
}

/// The open windows of one key with their accumulators, sorted by start. Windows
/// of one key never overlap for sessions and all have one size for sliding
/// windows, so they are sorted by end too.
type Panes<Acc> = Vec<(Window, Acc)>;

/// The names of the operator's states.
const WINDOWS: &str = "windows";

/// The windowed-aggregate operator.
struct WindowAggregate<K, T, A: AggregateFunction<T>> {
    key: KeyFn<T, K>,
    windowing: Assigner,
    aggregate: Arc<A>,
    windows: KeyedState<K, Panes<A::Acc>>,
    /// The watermark this instance closed windows at, checkpointed.
    lateness: Lateness,
    /// Keys by the end of a window they opened: which keys to look at when the
    /// watermark passes that end. Rebuilt from the windows on start; an entry
    /// whose window merged into a longer session is looked at and passed over.
    expiry: Expiries<K>,
}

impl<K, T, A> WindowAggregate<K, T, A>
where
    K: StateKey,
    T: Data,
    A: AggregateFunction<T>,
{
    /// An instance whose open windows `ctx` restores; those the restored
    /// watermark closed are evicted now.
    fn new(
        key: KeyFn<T, K>,
        windowing: Assigner,
        aggregate: Arc<A>,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        let windows: KeyedState<K, Panes<A::Acc>> = ctx.state.keyed(WINDOWS)?;
        let mut expiry = Expiries::new();
        for (key, panes) in windows.iter() {
            for (window, _) in panes {
                expiry.schedule(window.end, key.clone());
            }
        }
        let mut operator = Self {
            key,
            windowing,
            aggregate,
            windows,
            lateness: Lateness::restore(ctx)?,
            expiry,
        };
        operator.evict(usize::MAX);
        Ok(operator)
    }

    /// Adds `record` to its open sliding windows and emits their aggregates.
    fn add_sliding(
        &mut self,
        key: K,
        record: &Record<T>,
        (size, slide): (i64, i64),
        out: &mut Collector<'_, (K, Window, A::Out)>,
    ) -> Result<()> {
        let time = record.meta.event_time;
        let last = time - time.rem_euclid(slide);
        // Windows containing `time` start at `last`, `last - slide`, ... down to
        // the first start after `time - size`. Only the open ones take the record.
        let count = (size - (time - last) + slide - 1) / slide;
        let watermark = self.lateness.watermark_of(&key, &record.meta);
        let mut starts = (0..count)
            .rev()
            .map(|i| last - i * slide)
            .filter(|start| start.saturating_add(size) > watermark)
            .peekable();
        if starts.peek().is_none() {
            out.drop_late();
            return Ok(());
        }
        let panes = self.windows.get_or_insert_with(key.clone(), Vec::new);
        for start in starts {
            let window = Window {
                start,
                end: start.saturating_add(size),
            };
            let at = panes.partition_point(|(w, _)| w.start < start);
            if !matches!(panes.get(at), Some((w, _)) if *w == window) {
                panes.insert(at, (window, self.aggregate.create()));
                self.expiry.schedule(window.end, key.clone());
            }
            let acc = &mut panes[at].1;
            self.aggregate.add(acc, &record.value);
            out.emit((key.clone(), window, self.aggregate.result(acc)))?;
        }
        Ok(())
    }

    /// Adds `record` to its session, merging the sessions it bridges, and emits
    /// the session's aggregate.
    fn add_session(
        &mut self,
        key: K,
        record: &Record<T>,
        gap: i64,
        out: &mut Collector<'_, (K, Window, A::Out)>,
    ) -> Result<()> {
        let time = record.meta.event_time;
        if self.lateness.is_late(&key, &record.meta) {
            out.drop_late();
            return Ok(());
        }
        let panes = self.windows.get_or_insert_with(key.clone(), Vec::new);
        let mut window = Window {
            start: time,
            end: time.saturating_add(gap),
        };
        // The sessions the new one overlaps are consecutive: sessions of a key are
        // disjoint and sorted.
        let first = panes.partition_point(|(w, _)| w.end <= window.start);
        let last = panes.partition_point(|(w, _)| w.start < window.end);
        let mut acc = None;
        let mut merged_end = None;
        for (merged, other) in panes.drain(first..last) {
            window.start = window.start.min(merged.start);
            window.end = window.end.max(merged.end);
            merged_end = merged_end.max(Some(merged.end));
            match &mut acc {
                None => acc = Some(other),
                Some(acc) => self.aggregate.merge(acc, other),
            }
        }
        // Every session has an expiry entry at its end; one that grew needs one at
        // its new end.
        if merged_end != Some(window.end) {
            self.expiry.schedule(window.end, key.clone());
        }
        let mut acc = acc.unwrap_or_else(|| self.aggregate.create());
        self.aggregate.add(&mut acc, &record.value);
        let result = self.aggregate.result(&acc);
        panes.insert(first, (window, acc));
        out.emit((key, window, result))
    }

    /// Drops the closed windows (ending at or before the watermark) of at most
    /// `budget` keys. Evicting them all at once held up the records behind a
    /// watermark that closed a window of many keys (q5 at 100,000 events/s:
    /// 2-6 ms at every slide), so the rest are left for the next records.
    fn evict(&mut self, budget: usize) {
        let watermark = self.lateness.watermark();
        let state = &mut self.windows;
        self.expiry
            .expire(watermark.saturating_add(1), budget, |key| {
                // Only a key whose earliest window closed is touched: reading it
                // does not mark it changed for the next checkpoint.
                let closed = state
                    .get(&key)
                    .and_then(|panes| panes.first())
                    .is_some_and(|(w, _)| w.end <= watermark);
                if !closed {
                    return;
                }
                let panes = state.get_mut(&key).expect("checked above");
                let open = panes.partition_point(|(w, _)| w.end <= watermark);
                panes.drain(..open);
                if panes.is_empty() {
                    state.remove(&key);
                }
            });
    }

    /// Keys evicted per record while closed windows are left: as many as the
    /// windows one record can open, so eviction keeps up with any input.
    fn evict_per_record(&self) -> usize {
        match self.windowing {
            Assigner::Sliding { size, slide } => (size / slide) as usize + 1,
            Assigner::Session { .. } => 2,
        }
    }
}

impl<K, T, A> Operator<T, (K, Window, A::Out)> for WindowAggregate<K, T, A>
where
    K: StateKey,
    T: Data,
    A: AggregateFunction<T>,
{
    fn allowlisted() -> bool {
        true
    }

    fn stateful() -> bool {
        true
    }

    #[inline]
    fn process(
        &mut self,
        record: Record<T>,
        out: &mut Collector<'_, (K, Window, A::Out)>,
    ) -> Result<()> {
        let key = (self.key)(&record.value);
        match self.windowing {
            Assigner::Sliding { size, slide } => {
                self.add_sliding(key, &record, (size, slide), out)?
            }
            Assigner::Session { gap } => self.add_session(key, &record, gap, out)?,
        }
        if self.expiry.behind() {
            self.evict(self.evict_per_record());
        }
        Ok(())
    }

    fn on_watermark(
        &mut self,
        watermark: EventTime,
        _out: &mut Collector<'_, (K, Window, A::Out)>,
    ) -> Result<()> {
        if self.lateness.advance(watermark) {
            self.evict(EVICT_PER_WATERMARK);
        }
        Ok(())
    }

    fn on_close(&mut self, _out: &mut Collector<'_, (K, Window, A::Out)>) -> Result<()> {
        self.evict(usize::MAX);
        Ok(())
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        table(&mut self.windows)?;
        self.lateness.tables(table)
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use rtflow_runtime::tester::{Emitted, OperatorTester};

    use super::*;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{self, Barrier, LateRecord, Record, Restore, Watermark};

    /// Counts per user and window: the output of `window(windowing).count()`.
    type Counts = Vec<Emitted<(String, Window, u64)>>;

    type Tester = OperatorTester<&'static str, (String, Window, u64)>;

    fn count_windows(
        windowing: Windowing,
    ) -> impl Fn(&OperatorContext) -> Result<WindowAggregate<String, &'static str, Count>> {
        let user: KeyFn<&'static str, String> = Arc::new(|user| user.to_string());
        move |ctx| WindowAggregate::new(user.clone(), windowing.0, Arc::new(Count), ctx)
    }

    fn counts(windowing: Windowing, steps: impl IntoIterator<Item = Step<&'static str>>) -> Counts {
        run("window_count", count_windows(windowing), steps)
    }

    fn update(
        user: &str,
        window: Range<i64>,
        count: u64,
        time: EventTime,
    ) -> Emitted<(String, Window, u64)> {
        let window = Window {
            start: window.start,
            end: window.end,
        };
        Emitted::Record((user.to_owned(), window, count), time)
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn tumbling_windows_count_each_users_records_per_window() {
        let steps = [
            Record("ann", 1),
            Record("ann", 9),
            Record("bob", 7),
            Watermark(8),
            Record("ann", 10),
        ];
        let expected = [
            update("ann", 0..10, 1, 1),
            update("ann", 0..10, 2, 9),
            update("bob", 0..10, 1, 7),
            Emitted::Watermark(8),
            update("ann", 10..20, 1, 10),
        ];
        assert_eq!(counts(Window::tumbling(ms(10)), steps), expected);
    }

    #[test]
    fn a_record_judged_late_on_its_way_opens_and_updates_no_window() {
        let steps = || {
            [
                Record("ann", 1),
                LateRecord("ann", 2),
                LateRecord("bob", 3),
                Record("ann", 4),
            ]
        };
        let expected = [update("ann", 0..10, 1, 1), update("ann", 0..10, 2, 4)];
        assert_eq!(counts(Window::tumbling(ms(10)), steps()), expected);
        let sessions = counts(Window::session(ms(10)), steps());
        assert_eq!(
            sessions.len(),
            2,
            "two records of ann in one session: {sessions:?}"
        );
    }

    #[test]
    fn a_sliding_record_updates_every_window_it_falls_into_earliest_first() {
        let steps = [Record("ann", 7), Record("ann", 12)];
        let expected = [
            update("ann", 0..10, 1, 7),
            update("ann", 5..15, 1, 7),
            update("ann", 5..15, 2, 12),
            update("ann", 10..20, 1, 12),
        ];
        assert_eq!(counts(Window::sliding(ms(10), ms(5)), steps), expected);
    }

    #[test]
    fn a_sliding_record_behind_the_watermark_still_updates_its_open_windows() {
        let steps = [Record("ann", 7), Watermark(10), Record("ann", 8)];
        let expected = [
            update("ann", 0..10, 1, 7),
            update("ann", 5..15, 1, 7),
            Emitted::Watermark(10),
            update("ann", 5..15, 2, 8),
        ];
        assert_eq!(counts(Window::sliding(ms(10), ms(5)), steps), expected);
    }

    #[test]
    fn sessions_merge_when_a_record_bridges_them() {
        let steps = [
            Record("ann", 0),
            Record("ann", 30),
            Record("ann", 5),
            // Exactly a gap after the last record: a session of its own.
            Record("ann", 15),
            Record("ann", 22),
        ];
        let expected = [
            update("ann", 0..10, 1, 0),
            update("ann", 30..40, 1, 30),
            update("ann", 0..15, 2, 5),
            update("ann", 15..25, 1, 15),
            update("ann", 15..40, 3, 22),
        ];
        assert_eq!(counts(Window::session(ms(10)), steps), expected);
    }

    #[test]
    fn a_late_record_is_dropped_once_its_windows_closed() {
        let steps = [
            Record("ann", 5),
            Watermark(10),
            Record("ann", 9),
            Record("ann", 10),
        ];
        let expected = [
            update("ann", 0..10, 1, 5),
            Emitted::Watermark(10),
            update("ann", 10..20, 1, 10),
        ];
        assert_eq!(counts(Window::tumbling(ms(10)), steps), expected);
    }

    #[test]
    fn a_session_record_behind_the_watermark_is_dropped_though_its_session_is_open() {
        // It could belong to a session that closed: merging it would split it.
        let steps = [
            Record("ann", 10),
            Watermark(15),
            Record("ann", 14),
            Record("ann", 15),
        ];
        let expected = [
            update("ann", 10..20, 1, 10),
            Emitted::Watermark(15),
            update("ann", 10..25, 2, 15),
        ];
        assert_eq!(counts(Window::session(ms(10)), steps), expected);
    }

    #[test]
    fn a_closed_window_is_deleted_from_the_next_checkpoint() {
        let mut windows =
            Tester::new("window_count", count_windows(Window::tumbling(ms(10)))).unwrap();
        windows.record("ann", 5).unwrap();
        windows.record("bob", 15).unwrap();
        // Whether each entry of the windows state a barrier writes is an
        // update (or a deletion).
        let written = |windows: &mut Tester, epoch| -> Vec<bool> {
            let deltas = windows.barrier(epoch).unwrap();
            deltas
                .iter()
                .filter(|delta| delta.state.name == WINDOWS)
                .flat_map(|delta| &delta.entries)
                .map(|entry| entry.value.is_some())
                .collect()
        };
        assert_eq!(written(&mut windows, 1), [true, true]);
        windows.watermark(10).unwrap();
        // Only ann's window closed; bob's is left alone.
        assert_eq!(written(&mut windows, 2), [false]);
    }

    #[test]
    fn a_restored_instance_goes_on_from_the_windows_of_the_last_barrier() {
        let steps = [
            Record("ann", 5),
            Record("ann", 15),
            Watermark(10),
            Barrier,
            // Lost with the instance; its source replays it.
            Record("ann", 16),
            Restore,
            // Its window closed before the barrier: late, not a new window.
            Record("ann", 9),
            Record("ann", 16),
        ];
        let expected = [
            update("ann", 0..10, 1, 5),
            update("ann", 10..20, 1, 15),
            Emitted::Watermark(10),
            update("ann", 10..20, 2, 16),
            update("ann", 10..20, 2, 16),
        ];
        assert_eq!(counts(Window::tumbling(ms(10)), steps), expected);
    }
}
