//! Stream-stream joins on a key with an event-time range: a left row at `tl`
//! and a right row at `tr` with the same key join when
//! `tl - before <= tr <= tl + after` ([`JoinWindow`]).
//!
//! The runtime's operators have one input, so the builder tags each side's
//! records ([`Either`]), unions the two streams, shuffles the union by the join
//! key (`repartition_by`, so a clustered query repartitions it through the
//! cluster) and runs one [`StreamJoin`] that handles both sides: a symmetric hash
//! join. Each row first probes the other side's rows of its key and emits every
//! pair in range, then is buffered for the rows still to come; so every pair is
//! emitted once, by whichever of its rows arrives second.
//!
//! The watermark `w` (the minimum over both inputs) bounds the state: no row
//! earlier than `w` is to come, so a left row at `tl` is dropped once
//! `tl + after < w` and a right row at `tr` once `tr + before < w`: no future row
//! of the other side could match them. Rows behind the watermark are dropped as
//! late. The left outer join emits `(left, None)` for a left row that matched
//! nothing when it is dropped, stamped with the end of its range; the right
//! outer join is a left outer join with the sides swapped (and the window
//! mirrored), emitting `(None, right)`. The full outer join emits both: it
//! buffers its right rows with whether they matched too ([`FullRows`]), so its
//! state is not the other joins' [`Rows`], whose checkpointed form stays as it
//! was. All joins
//! drop a slice of the expired rows' keys at the watermark and the rest a few
//! per record (or per idle flush) after it, so the records behind a watermark
//! that expires many keys do not wait for all of them; the outer joins hold
//! the watermark they pass on at the earliest row still to go, so no unmatched
//! row is late downstream.

use std::sync::Arc;
use std::time::Duration;

use rtflow_runtime::state::{KeyedState, Table};
use rtflow_runtime::{
    Collector, Data, EventTime, Operator, OperatorContext, Record, RecordMeta, Result, Stream,
};
use serde::{Deserialize, Serialize};

use crate::aggregate::{StateKey, StateValue};
use crate::expiry::{Expiries, EVICT_PER_RECORD, EVICT_PER_WATERMARK};
use crate::lateness::Lateness;
use crate::map::Map;

/// The kind (allowlist and checkpoint name) of the inner stream-stream join.
pub const STREAM_JOIN: &str = "stream_join";
/// The kind of the left outer stream-stream join.
pub const STREAM_LEFT_JOIN: &str = "stream_left_join";
/// The kind of the right outer stream-stream join.
pub const STREAM_RIGHT_JOIN: &str = "stream_right_join";
/// The kind of the full outer stream-stream join.
pub const STREAM_FULL_JOIN: &str = "stream_full_join";

/// The name of the buffered rows within a join operator.
const ROWS: &str = "rows";

/// A record of either input of a two-input operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Either<L, R> {
    Left(L),
    Right(R),
}

/// The event-time range condition of a stream-stream join: a right row at `tr`
/// matches a left row at `tl` when `tl - before <= tr <= tl + after`.
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::JoinWindow;
/// let window = JoinWindow::between(Duration::from_secs(5), Duration::from_secs(60));
/// assert!(window.contains(10_000, 5_000));
/// assert!(window.contains(10_000, 70_000));
/// assert!(!window.contains(10_000, 4_999));
/// assert!(!window.contains(10_000, 70_001));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinWindow {
    /// How far before the left row a right row may be (ms).
    pub before: i64,
    /// How far after the left row a right row may be (ms).
    pub after: i64,
}

impl JoinWindow {
    /// Right rows from `before` before to `after` after the left row's event time.
    pub fn between(before: Duration, after: Duration) -> Self {
        Self {
            before: before.as_millis() as i64,
            after: after.as_millis() as i64,
        }
    }

    /// Whether a right row at `right` matches a left row at `left`.
    #[inline]
    pub fn contains(&self, left: EventTime, right: EventTime) -> bool {
        left.saturating_sub(self.before) <= right && right <= left.saturating_add(self.after)
    }

    /// The same condition with the sides swapped: a right outer join runs as
    /// a left outer join with the right side on the left.
    fn mirrored(self) -> Self {
        Self {
            before: self.after,
            after: self.before,
        }
    }

    /// The last event time a right row matching a left row at `left` can have.
    fn left_expiry(&self, left: EventTime) -> EventTime {
        left.saturating_add(self.after)
    }

    /// The last event time a left row matching a right row at `right` can have.
    fn right_expiry(&self, right: EventTime) -> EventTime {
        right.saturating_add(self.before)
    }
}

/// A buffered row, and whether it matched: every left row, and the right rows
/// of a full outer join.
#[derive(Serialize, Deserialize)]
pub struct TrackedRow<T> {
    time: EventTime,
    value: T,
    matched: bool,
}

/// A buffered row of either side, as a join's state holds it.
pub trait BufferedRow<T> {
    /// A row at `time`, `matched` by a row buffered before it or not.
    fn new(time: EventTime, value: T, matched: bool) -> Self;

    fn time(&self) -> EventTime;

    fn value(&self) -> &T;

    /// A row of the other side matched it.
    fn set_matched(&mut self);

    /// Its value if it matched nothing; `None` if it matched or its join does
    /// not track whether it did.
    fn into_unmatched(self) -> Option<T>;
}

impl<T> BufferedRow<T> for TrackedRow<T> {
    #[inline]
    fn new(time: EventTime, value: T, matched: bool) -> Self {
        Self {
            time,
            value,
            matched,
        }
    }

    #[inline]
    fn time(&self) -> EventTime {
        self.time
    }

    #[inline]
    fn value(&self) -> &T {
        &self.value
    }

    #[inline]
    fn set_matched(&mut self) {
        self.matched = true;
    }

    #[inline]
    fn into_unmatched(self) -> Option<T> {
        (!self.matched).then_some(self.value)
    }
}

/// A right row of the inner, left and right joins: whether it matched is never
/// asked.
impl<T> BufferedRow<T> for (EventTime, T) {
    #[inline]
    fn new(time: EventTime, value: T, _matched: bool) -> Self {
        (time, value)
    }

    #[inline]
    fn time(&self) -> EventTime {
        self.0
    }

    #[inline]
    fn value(&self) -> &T {
        &self.1
    }

    #[inline]
    fn set_matched(&mut self) {}

    #[inline]
    fn into_unmatched(self) -> Option<T> {
        None
    }
}

/// The rows of one key still waiting for matches, in arrival order, as a
/// join's state holds them: [`Rows`], or [`FullRows`] for the full outer join.
pub trait Buffer<L, R>: Default + StateValue {
    /// A buffered right row.
    type Right: BufferedRow<R>;

    fn left(&self) -> &[TrackedRow<L>];

    fn right(&self) -> &[Self::Right];

    /// Both sides, to probe, add to and evict.
    fn sides_mut(&mut self) -> (&mut Vec<TrackedRow<L>>, &mut Vec<Self::Right>);
}

/// The buffered rows of one key of the inner, left and right joins. Its name,
/// type parameters and encoding are those their checkpoints hold: do not
/// change them.
#[derive(Serialize, Deserialize)]
pub struct Rows<L, R> {
    left: Vec<TrackedRow<L>>,
    right: Vec<(EventTime, R)>,
}

/// The buffered rows of one key of the full outer join: the right rows also
/// carry whether they matched.
#[derive(Serialize, Deserialize)]
pub struct FullRows<L, R> {
    left: Vec<TrackedRow<L>>,
    right: Vec<TrackedRow<R>>,
}

impl<L, R> Default for Rows<L, R> {
    fn default() -> Self {
        Self {
            left: Vec::new(),
            right: Vec::new(),
        }
    }
}

impl<L: StateValue, R: StateValue> Buffer<L, R> for Rows<L, R> {
    type Right = (EventTime, R);

    fn left(&self) -> &[TrackedRow<L>] {
        &self.left
    }

    fn right(&self) -> &[Self::Right] {
        &self.right
    }

    fn sides_mut(&mut self) -> (&mut Vec<TrackedRow<L>>, &mut Vec<Self::Right>) {
        (&mut self.left, &mut self.right)
    }
}

impl<L, R> Default for FullRows<L, R> {
    fn default() -> Self {
        Self {
            left: Vec::new(),
            right: Vec::new(),
        }
    }
}

impl<L: StateValue, R: StateValue> Buffer<L, R> for FullRows<L, R> {
    type Right = TrackedRow<R>;

    fn left(&self) -> &[TrackedRow<L>] {
        &self.left
    }

    fn right(&self) -> &[Self::Right] {
        &self.right
    }

    fn sides_mut(&mut self) -> (&mut Vec<TrackedRow<L>>, &mut Vec<Self::Right>) {
        (&mut self.left, &mut self.right)
    }
}

/// The join operator over the union of both sides, keyed by the join key,
/// buffering the rows of each key as a `B`.
pub struct StreamJoin<K, L, R, Out, B = Rows<L, R>> {
    key: KeyFn<Either<L, R>, K>,
    window: JoinWindow,
    /// Left or full outer join: emit the left rows that never matched, and the
    /// right rows that never did if `B` tracks it (the full join).
    outer: bool,
    /// Makes an output of a pair (both `Some`), or of an unmatched row (outer
    /// joins only).
    output: fn(Option<L>, Option<R>) -> Out,
    rows: KeyedState<K, B>,
    /// When each buffered row expires, built at the first watermark (or at a
    /// restore that has one), so a join without a watermark keeps none.
    expiries: Option<Expiries<K>>,
    lateness: Lateness,
}

impl<K: StateKey, L: StateValue, R: StateValue> StreamJoin<K, L, R, (L, R)> {
    /// Inner join of the rows of both sides with equal `key` within `window`;
    /// `ctx` restores the rows buffered.
    pub fn inner(
        key: KeyFn<Either<L, R>, K>,
        window: JoinWindow,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Self::new(key, window, false, ctx, |left, right| match (left, right) {
            (Some(left), Some(right)) => (left, right),
            _ => unreachable!("an inner join emits pairs only"),
        })
    }
}

impl<K: StateKey, L: StateValue, R: StateValue> StreamJoin<K, L, R, (L, Option<R>)> {
    /// Left outer join of the rows of both sides with equal `key` within
    /// `window`: also emits `(left, None)` for left rows without a match.
    pub fn left_outer(
        key: KeyFn<Either<L, R>, K>,
        window: JoinWindow,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Self::new(key, window, true, ctx, |left, right| {
            (left.expect("a left join emits no right row alone"), right)
        })
    }
}

impl<K: StateKey, L: StateValue, R: StateValue> StreamJoin<K, R, L, (Option<L>, R)> {
    /// Right outer join of the rows of both sides with equal `key` within
    /// `window`, run with the right side as its left (`key` and `window`
    /// mirrored already): also emits `(None, right)` for right rows without a
    /// match.
    pub fn right_outer(
        key: KeyFn<Either<R, L>, K>,
        window: JoinWindow,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Self::new(key, window, true, ctx, |right, left| {
            (left, right.expect("a right join emits no left row alone"))
        })
    }
}

impl<K: StateKey, L: StateValue, R: StateValue>
    StreamJoin<K, L, R, (Option<L>, Option<R>), FullRows<L, R>>
{
    /// Full outer join of the rows of both sides with equal `key` within
    /// `window`: also emits `(Some(left), None)` and `(None, Some(right))` for
    /// the rows of either side without a match.
    pub fn full_outer(
        key: KeyFn<Either<L, R>, K>,
        window: JoinWindow,
        ctx: &OperatorContext,
    ) -> Result<Self> {
        Self::new(key, window, true, ctx, |left, right| (left, right))
    }
}

impl<K, L, R, Out, B> StreamJoin<K, L, R, Out, B>
where
    K: StateKey,
    L: StateValue,
    R: StateValue,
    B: Buffer<L, R>,
{
    fn new(
        key: KeyFn<Either<L, R>, K>,
        window: JoinWindow,
        outer: bool,
        ctx: &OperatorContext,
        output: fn(Option<L>, Option<R>) -> Out,
    ) -> Result<Self> {
        let mut join = Self {
            key,
            window,
            outer,
            output,
            rows: ctx.state.keyed(ROWS)?,
            expiries: None,
            lateness: Lateness::restore(ctx)?,
        };
        let restored = join.lateness.watermark();
        if restored > EventTime::MIN {
            // The checkpoint may hold rows the watermark had passed but that
            // were not evicted yet: they go after the first records or flush.
            let mut expiries = join.schedule_all();
            expiries.expire(restored, 0, |_| {});
            join.expiries = Some(expiries);
        }
        Ok(join)
    }

    /// The expiry schedule of every buffered row.
    fn schedule_all(&self) -> Expiries<K> {
        let state = &self.rows;
        let mut expiries = Expiries::new();
        for (key, rows) in state.iter() {
            for row in rows.left() {
                expiries.schedule(self.window.left_expiry(row.time), key.clone());
            }
            for row in rows.right() {
                expiries.schedule(self.window.right_expiry(row.time()), key.clone());
            }
        }
        expiries
    }

    /// Drops the expired rows of at most `budget` keys; an outer join emits
    /// those that never matched of its preserved sides. An expired row cannot
    /// match a row on time (its range ends before the watermark), so the rest
    /// wait for the records and flushes after the watermark instead of holding
    /// them up; an outer join holds the watermark it passes on back until its
    /// unmatched rows are out ([`Operator::watermark_hold`]).
    fn evict(&mut self, budget: usize, out: &mut Collector<'_, Out>) -> Result<()> {
        let Some(expiries) = &mut self.expiries else {
            return Ok(());
        };
        let (state, lateness) = (&mut self.rows, &self.lateness);
        let (window, outer, output) = (self.window, self.outer, self.output);
        let watermark = lateness.watermark();
        let expired = |time: EventTime| time < watermark;
        let mut emitted = Ok(());
        expiries.expire(watermark, budget, |key| {
            // A key is scheduled once per row: only the first visit finds work.
            let due = state.get(&key).is_some_and(|rows| {
                rows.left()
                    .iter()
                    .any(|row| expired(window.left_expiry(row.time)))
                    || rows
                        .right()
                        .iter()
                        .any(|row| expired(window.right_expiry(row.time())))
            });
            if !due || emitted.is_err() {
                return;
            }
            // Stamped with the end of its range, which the watermark
            // downstream has not passed yet: never late there.
            let mut unmatched = |value: Out, end: EventTime| {
                if emitted.is_ok() {
                    let meta = RecordMeta {
                        event_time: end,
                        ..out.meta()
                    };
                    emitted = out.emit_record(Record { value, meta });
                }
            };
            let rows = state.get_mut(&key).expect("checked above");
            let (left, right) = rows.sides_mut();
            // `output` only makes the outputs of the rows an outer join keeps.
            drop_expired(
                left,
                |time| window.left_expiry(time),
                expired,
                |l, end| {
                    if outer {
                        unmatched(output(Some(l), None), end);
                    }
                },
            );
            drop_expired(
                right,
                |time| window.right_expiry(time),
                expired,
                |r, end| {
                    if outer {
                        unmatched(output(None, Some(r)), end);
                    }
                },
            );
            if left.is_empty() && right.is_empty() {
                state.remove(&key);
            }
        });
        emitted
    }
}

/// Drops the `rows` whose range, ending at `end(time)`, has `expired`, handing
/// the value of each that matched nothing (if its join tracks it) to
/// `unmatched` with the end of its range.
fn drop_expired<T, Row: BufferedRow<T>>(
    rows: &mut Vec<Row>,
    end: impl Fn(EventTime) -> EventTime,
    expired: impl Fn(EventTime) -> bool,
    mut unmatched: impl FnMut(T, EventTime),
) {
    let mut kept = Vec::with_capacity(rows.len());
    for row in rows.drain(..) {
        let end = end(row.time());
        if !expired(end) {
            kept.push(row);
        } else if let Some(value) = row.into_unmatched() {
            unmatched(value, end);
        }
    }
    *rows = kept;
}

/// The timestamps of a pair: the later event time of its rows, so a pair is
/// never behind the watermark of the operator that emits it.
fn pair_meta(meta: RecordMeta, other: EventTime) -> RecordMeta {
    RecordMeta {
        event_time: meta.event_time.max(other),
        ..meta
    }
}

impl<K, L, R, Out, B> Operator<Either<L, R>, Out> for StreamJoin<K, L, R, Out, B>
where
    K: StateKey,
    L: Data + StateValue,
    R: Data + StateValue,
    Out: Data,
    B: Buffer<L, R>,
{
    fn allowlisted() -> bool {
        true
    }

    fn stateful() -> bool {
        true
    }

    fn process(
        &mut self,
        record: Record<Either<L, R>>,
        out: &mut Collector<'_, Out>,
    ) -> Result<()> {
        if self.expiries.as_ref().is_some_and(Expiries::behind) {
            self.evict(EVICT_PER_RECORD, out)?;
        }
        let (meta, time) = (record.meta, record.meta.event_time);
        let key = (self.key)(&record.value);
        if self.lateness.is_late(&key, &meta) {
            out.drop_late();
            return Ok(());
        }
        let (left_rows, right_rows) = self
            .rows
            .get_or_insert_with(key.clone(), B::default)
            .sides_mut();
        let (window, output) = (self.window, self.output);
        let mut matched = false;
        let expiry = match record.value {
            Either::Left(left) => {
                for row in right_rows.iter_mut() {
                    if window.contains(time, row.time()) {
                        matched = true;
                        row.set_matched();
                        out.emit_record(Record {
                            value: output(Some(left.clone()), Some(row.value().clone())),
                            meta: pair_meta(meta, row.time()),
                        })?;
                    }
                }
                left_rows.push(TrackedRow::new(time, left, matched));
                window.left_expiry(time)
            }
            Either::Right(right) => {
                for row in left_rows.iter_mut() {
                    if window.contains(row.time, time) {
                        matched = true;
                        row.set_matched();
                        out.emit_record(Record {
                            value: output(Some(row.value.clone()), Some(right.clone())),
                            meta: pair_meta(meta, row.time),
                        })?;
                    }
                }
                right_rows.push(B::Right::new(time, right, matched));
                window.right_expiry(time)
            }
        };
        if let Some(expiries) = &mut self.expiries {
            expiries.schedule(expiry, key);
        }
        Ok(())
    }

    fn on_watermark(&mut self, watermark: EventTime, out: &mut Collector<'_, Out>) -> Result<()> {
        if !self.lateness.advance(watermark) {
            return Ok(());
        }
        if self.expiries.is_none() {
            self.expiries = Some(self.schedule_all());
        }
        self.evict(EVICT_PER_WATERMARK, out)
    }

    fn watermark_hold(&self) -> Option<EventTime> {
        // Unmatched rows go out stamped with the end of their range: the
        // watermark waits for the earliest row of either side still to go.
        let expiries = self.expiries.as_ref().filter(|_| self.outer)?;
        let watermark = self.lateness.watermark();
        expiries.earliest().filter(|time| *time < watermark)
    }

    fn on_flush(&mut self, out: &mut Collector<'_, Out>) -> Result<()> {
        // An outer join's held watermark must move on without more records; an
        // inner join's expired rows can wait for them.
        if self.outer && self.expiries.as_ref().is_some_and(Expiries::behind) {
            self.evict(EVICT_PER_WATERMARK, out)?;
        }
        Ok(())
    }

    fn on_close(&mut self, out: &mut Collector<'_, Out>) -> Result<()> {
        self.evict(usize::MAX, out)
    }

    fn tables(&mut self, table: &mut dyn FnMut(&mut dyn Table) -> Result<()>) -> Result<()> {
        table(&mut self.rows)?;
        self.lateness.tables(table)
    }
}

/// Stream-stream joins as builder methods on any stream (the left side).
///
/// Both sides must read distinct sources (real-time mode's rule for unions) and
/// usually declare event time with `with_watermark`; without a watermark the
/// join is correct but keeps every row for ever.
///
/// The sides are shuffled by the join key with
/// [`repartition_by`](Stream::repartition_by): in a clustered query (rtflow's
/// `KafkaCluster`) both cross one repartition topic of the join's own, so
/// every join runs clustered as in one process.
///
/// ```
/// use std::time::Duration;
/// use rtflow_operators::{JoinWindow, StreamJoinExt};
/// use rtflow_runtime::Dataflow;
/// # use rtflow_connectors::{MemorySink, MemorySource};
/// let flow = Dataflow::new("ads");
/// // (ad id, event time in ms)
/// let impressions = flow
///     .source(MemorySource::<(u64, i64)>::new(2))
///     .with_watermark(|(_, time)| *time, Duration::from_secs(10));
/// let clicks = flow
///     .source(MemorySource::<(u64, i64)>::new(2))
///     .with_watermark(|(_, time)| *time, Duration::from_secs(10));
/// // Clicks up to an hour after their impression.
/// let window = JoinWindow::between(Duration::ZERO, Duration::from_secs(3600));
/// impressions
///     .join(&clicks, |(ad, _)| *ad, |(ad, _)| *ad, window)
///     .sink(MemorySink::new());
/// // Impressions without a click within the hour, as `(impression, None)`.
/// impressions
///     .left_join(&clicks, |(ad, _)| *ad, |(ad, _)| *ad, window)
///     .sink(MemorySink::new());
/// // Pairs, impressions without a click and clicks without an impression in
/// // the hour before them, `None` on the side without a match.
/// impressions
///     .full_join(&clicks, |(ad, _)| *ad, |(ad, _)| *ad, window)
///     .sink(MemorySink::new());
/// ```
pub trait StreamJoinExt<L: Data + StateValue>: AsRef<Stream<L>> {
    /// Inner join: `(left, right)` for every pair of rows with equal keys whose
    /// event times `window` relates, as soon as the second of them arrives.
    fn join<R, K>(
        &self,
        right: &impl AsRef<Stream<R>>,
        left_key: impl Fn(&L) -> K + Send + Sync + 'static,
        right_key: impl Fn(&R) -> K + Send + Sync + 'static,
        window: JoinWindow,
    ) -> Stream<(L, R)>
    where
        R: Data + StateValue,
        K: StateKey,
    {
        add_join(
            self.as_ref(),
            right.as_ref(),
            left_key,
            right_key,
            STREAM_JOIN,
            move |key, ctx| StreamJoin::inner(key, window, ctx),
        )
    }

    /// Left outer join: the pairs of [`join`](Self::join) as `(left, Some(right))`,
    /// and `(left, None)` for each left row that matched nothing, once the
    /// watermark passes the end of its range.
    fn left_join<R, K>(
        &self,
        right: &impl AsRef<Stream<R>>,
        left_key: impl Fn(&L) -> K + Send + Sync + 'static,
        right_key: impl Fn(&R) -> K + Send + Sync + 'static,
        window: JoinWindow,
    ) -> Stream<(L, Option<R>)>
    where
        R: Data + StateValue,
        K: StateKey,
    {
        add_join(
            self.as_ref(),
            right.as_ref(),
            left_key,
            right_key,
            STREAM_LEFT_JOIN,
            move |key, ctx| StreamJoin::left_outer(key, window, ctx),
        )
    }

    /// Right outer join: the pairs of [`join`](Self::join) as `(Some(left),
    /// right)`, and `(None, right)` for each right row that matched nothing,
    /// once the watermark passes the end of its range. It runs as a left outer
    /// join with the sides swapped.
    fn right_join<R, K>(
        &self,
        right: &impl AsRef<Stream<R>>,
        left_key: impl Fn(&L) -> K + Send + Sync + 'static,
        right_key: impl Fn(&R) -> K + Send + Sync + 'static,
        window: JoinWindow,
    ) -> Stream<(Option<L>, R)>
    where
        R: Data + StateValue,
        K: StateKey,
    {
        let mirrored = window.mirrored();
        add_join(
            right.as_ref(),
            self.as_ref(),
            right_key,
            left_key,
            STREAM_RIGHT_JOIN,
            move |key, ctx| StreamJoin::right_outer(key, mirrored, ctx),
        )
    }

    /// Full outer join: the pairs of [`join`](Self::join) as `(Some(left),
    /// Some(right))`, `(Some(left), None)` for each left row and `(None,
    /// Some(right))` for each right row that matched nothing, once the
    /// watermark passes the end of its range.
    fn full_join<R, K>(
        &self,
        right: &impl AsRef<Stream<R>>,
        left_key: impl Fn(&L) -> K + Send + Sync + 'static,
        right_key: impl Fn(&R) -> K + Send + Sync + 'static,
        window: JoinWindow,
    ) -> Stream<(Option<L>, Option<R>)>
    where
        R: Data + StateValue,
        K: StateKey,
    {
        add_join(
            self.as_ref(),
            right.as_ref(),
            left_key,
            right_key,
            STREAM_FULL_JOIN,
            move |key, ctx| StreamJoin::full_outer(key, window, ctx),
        )
    }
}

impl<L: Data + StateValue, S: AsRef<Stream<L>>> StreamJoinExt<L> for S {}

type KeyFn<T, K> = Arc<dyn Fn(&T) -> K + Send + Sync>;

/// Adds a join operator of `kind`, which `make` makes from the join key of
/// either side, over both sides tagged (`left` as [`Either::Left`]) and
/// shuffled by that key: the wiring every stream-stream join shares. The
/// tagged union is repartitioned as one stream, so that a clustered query
/// needs one repartition topic per join, whose readers wait for the
/// watermark of both sides' source partitions as one process's join waits
/// for both inputs.
fn add_join<K, L, R, O, Out>(
    left: &Stream<L>,
    right: &Stream<R>,
    left_key: impl Fn(&L) -> K + Send + Sync + 'static,
    right_key: impl Fn(&R) -> K + Send + Sync + 'static,
    kind: &str,
    make: impl Fn(KeyFn<Either<L, R>, K>, &OperatorContext) -> Result<O> + Send + Sync + 'static,
) -> Stream<Out>
where
    K: StateKey,
    L: Data + StateValue,
    R: Data + StateValue,
    Out: Data,
    O: Operator<Either<L, R>, Out>,
{
    let key: KeyFn<Either<L, R>, K> = Arc::new(move |side: &Either<L, R>| match side {
        Either::Left(l) => left_key(l),
        Either::Right(r) => right_key(r),
    });
    let shuffle_key = key.clone();
    let tagged_left = left.transform("map", |_| Map(Either::<L, R>::Left));
    let tagged_right = right.transform("map", |_| Map(Either::<L, R>::Right));
    tagged_left
        .union(&tagged_right)
        .repartition_by(move |side| shuffle_key(side))
        .as_ref()
        .try_transform(kind, move |ctx| make(key.clone(), ctx))
}

#[cfg(test)]
mod tests {
    use rtflow_runtime::tester::{Emitted, OperatorTester};

    use super::Either::{Left, Right};
    use super::*;
    use rtflow_runtime::tester::run;
    use rtflow_runtime::tester::Step::{
        self, Barrier, Flush, LateRecord, Record, Restore, Watermark,
    };

    /// (ad, tag): impressions on the left, clicks on the right.
    type Ad = (u32, char);

    type Row = Either<Ad, Ad>;

    fn ad(row: &Row) -> u32 {
        match row {
            Left((ad, _)) | Right((ad, _)) => *ad,
        }
    }

    /// Clicks up to 10 ms after their impression.
    const WINDOW: JoinWindow = JoinWindow {
        before: 0,
        after: 10,
    };

    type InnerJoin = StreamJoin<u32, Ad, Ad, (Ad, Ad)>;
    type LeftJoin = StreamJoin<u32, Ad, Ad, (Ad, Option<Ad>)>;

    fn inner(ctx: &OperatorContext) -> Result<InnerJoin> {
        StreamJoin::inner(Arc::new(ad), WINDOW, ctx)
    }

    fn left_outer(ctx: &OperatorContext) -> Result<LeftJoin> {
        StreamJoin::left_outer(Arc::new(ad), WINDOW, ctx)
    }

    #[test]
    fn an_inner_join_pairs_rows_in_range_when_the_second_arrives() {
        let steps = [
            Record(Left((1, 'a')), 0),
            Record(Right((1, 'x')), 5),
            Record(Right((2, 'y')), 6),
            Record(Left((2, 'b')), 3),
            Record(Right((1, 'z')), 11),
            Record(Left((1, 'c')), 1),
        ];
        // A pair is stamped with its later row's time; z, at 11, is past the
        // end of a's range.
        let expected = [
            Emitted::Record(((1, 'a'), (1, 'x')), 5),
            Emitted::Record(((2, 'b'), (2, 'y')), 6),
            Emitted::Record(((1, 'c'), (1, 'x')), 5),
            Emitted::Record(((1, 'c'), (1, 'z')), 11),
        ];
        assert_eq!(run(STREAM_JOIN, inner, steps), expected);
    }

    #[test]
    fn a_row_judged_late_on_its_way_is_dropped_before_any_watermark() {
        let steps = [
            Record(Left((1, 'a')), 0),
            LateRecord(Right((1, 'x')), 4),
            Record(Right((1, 'y')), 5),
        ];
        let expected = [Emitted::Record(((1, 'a'), (1, 'y')), 5)];
        assert_eq!(run(STREAM_JOIN, inner, steps), expected);
    }

    #[test]
    fn a_row_behind_the_watermark_is_dropped_though_it_would_match() {
        let steps = [
            Record(Left((1, 'a')), 0),
            Watermark(5),
            Record(Right((1, 'x')), 4),
            Record(Right((1, 'y')), 5),
        ];
        let expected = [
            Emitted::Watermark(5),
            Emitted::Record(((1, 'a'), (1, 'y')), 5),
        ];
        assert_eq!(run(STREAM_JOIN, inner, steps), expected);
    }

    #[test]
    fn a_row_is_deleted_from_the_next_checkpoint_once_the_watermark_passes_its_range() {
        let mut join = OperatorTester::new(STREAM_JOIN, inner).unwrap();
        join.record(Left((1, 'a')), 0).unwrap();
        join.barrier(1).unwrap();
        // The end of its range, 10, is not passed yet.
        join.watermark(10).unwrap();
        let deltas = join.barrier(2).unwrap();
        assert!(deltas.iter().all(|delta| delta.state.name != ROWS));
        join.watermark(11).unwrap();
        let deltas = join.barrier(3).unwrap();
        let rows: Vec<bool> = deltas
            .iter()
            .filter(|delta| delta.state.name == ROWS)
            .flat_map(|delta| &delta.entries)
            .map(|entry| entry.value.is_some())
            .collect();
        assert_eq!(rows, [false], "one key deleted");
    }

    #[test]
    fn a_left_join_emits_an_unmatched_left_row_once_the_watermark_passes_its_range() {
        let steps = [
            Record(Left((1, 'a')), 0),
            Record(Left((2, 'b')), 5),
            Record(Right((2, 'y')), 7),
            Watermark(10),
            Watermark(11),
            Watermark(16),
        ];
        // Stamped with the end of its range, 10: not behind the watermark
        // passed on before it.
        let expected = [
            Emitted::Record(((2, 'b'), Some((2, 'y'))), 7),
            Emitted::Watermark(10),
            Emitted::Record(((1, 'a'), None), 10),
            Emitted::Watermark(11),
            Emitted::Watermark(16),
        ];
        assert_eq!(run(STREAM_LEFT_JOIN, left_outer, steps), expected);
    }

    type RightJoin = StreamJoin<u32, Ad, Ad, (Option<Ad>, Ad)>;

    /// Clicks (the preserved side) on the operator's left, impressions on its
    /// right, as `right_join` wires it.
    fn right_outer(ctx: &OperatorContext) -> Result<RightJoin> {
        StreamJoin::right_outer(Arc::new(ad), WINDOW.mirrored(), ctx)
    }

    #[test]
    fn a_right_join_emits_an_unmatched_right_row_once_the_watermark_passes_its_range() {
        let steps = [
            Record(Left((1, 'x')), 20),
            Record(Right((2, 'a')), 15),
            Record(Left((2, 'y')), 18),
            Watermark(20),
            Watermark(21),
        ];
        // Click 1 at 20 could still meet an impression at 20 until the
        // watermark passes 20; then it goes out alone, at the end of its range.
        let expected = [
            Emitted::Record((Some((2, 'a')), (2, 'y')), 18),
            Emitted::Watermark(20),
            Emitted::Record((None, (1, 'x')), 20),
            Emitted::Watermark(21),
        ];
        assert_eq!(run(STREAM_RIGHT_JOIN, right_outer, steps), expected);
    }

    /// Where among `emitted` each watermark went out, and which.
    fn watermarks_at<T>(emitted: &[Emitted<T>]) -> Vec<(usize, EventTime)> {
        emitted
            .iter()
            .enumerate()
            .filter_map(|(at, e)| match e {
                Emitted::Watermark(watermark) => Some((at, *watermark)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_left_join_holds_the_watermark_until_its_unmatched_rows_went_out() {
        let rows = EVICT_PER_WATERMARK as u32 + 1;
        // After a first watermark, rows are scheduled as they come.
        let lefts = (0..rows).map(|ad| Record(Left((ad, 'a')), 0));
        let steps: Vec<Step<Row>> = [Watermark(0)]
            .into_iter()
            .chain(lefts)
            .chain([Watermark(11), Flush])
            .collect();
        let emitted = run(STREAM_LEFT_JOIN, left_outer, steps);
        // The watermark evicts a slice of the rows and holds at the end of
        // the others' range; the flush sends them and releases it. Which rows
        // go first is the schedule's business.
        let watermarks = watermarks_at(&emitted);
        let slice = EVICT_PER_WATERMARK;
        assert_eq!(watermarks, [(0, 0), (slice + 1, 10), (slice + 3, 11)]);
        let mut unmatched: Vec<u32> = emitted
            .iter()
            .filter_map(|e| match e {
                Emitted::Record(((ad, 'a'), None), 10) => Some(*ad),
                _ => None,
            })
            .collect();
        unmatched.sort();
        assert_eq!(unmatched, (0..rows).collect::<Vec<_>>());
    }

    #[test]
    fn an_inner_join_passes_the_watermark_on_however_many_rows_expire() {
        let rows = EVICT_PER_WATERMARK as u32 + 1;
        let lefts = (0..rows).map(|ad| Record(Left((ad, 'a')), 0));
        let steps: Vec<Step<Row>> = [Watermark(0)]
            .into_iter()
            .chain(lefts)
            .chain([Watermark(11)])
            .collect();
        let expected = [Emitted::Watermark(0), Emitted::Watermark(11)];
        assert_eq!(run(STREAM_JOIN, inner, steps), expected);
    }

    #[test]
    fn a_restored_join_goes_on_from_the_rows_of_the_last_barrier() {
        let steps = [
            Record(Left((1, 'a')), 0),
            Barrier,
            // Lost with the instance: no pair of its own.
            Record(Left((1, 'b')), 2),
            Restore,
            Record(Right((1, 'x')), 5),
        ];
        let expected = [Emitted::Record(((1, 'a'), (1, 'x')), 5)];
        assert_eq!(run(STREAM_JOIN, inner, steps), expected);
    }

    type FullJoin = StreamJoin<u32, Ad, Ad, (Option<Ad>, Option<Ad>), FullRows<Ad, Ad>>;

    fn full_outer(ctx: &OperatorContext) -> Result<FullJoin> {
        StreamJoin::full_outer(Arc::new(ad), WINDOW, ctx)
    }

    #[test]
    fn a_full_join_emits_pairs_and_the_unmatched_rows_of_both_sides_once_their_ranges_pass() {
        let steps = [
            Record(Left((1, 'a')), 0),
            Record(Right((1, 'x')), 5),
            Record(Left((2, 'b')), 3),
            Record(Right((3, 'y')), 4),
            // Past the end of a's range, 10.
            Record(Right((1, 'z')), 12),
            // Matched by a later left row, so never out alone.
            Record(Right((4, 'w')), 20),
            Record(Left((4, 'c')), 15),
            Watermark(5),
            Watermark(13),
            Watermark(14),
            Watermark(26),
        ];
        // An unmatched row is stamped with the end of its range: a left row's
        // time plus 10, a right row's own time (nothing may precede it).
        let expected = [
            Emitted::Record((Some((1, 'a')), Some((1, 'x'))), 5),
            Emitted::Record((Some((4, 'c')), Some((4, 'w'))), 20),
            Emitted::Record((None, Some((3, 'y'))), 4),
            Emitted::Watermark(5),
            Emitted::Record((None, Some((1, 'z'))), 12),
            Emitted::Watermark(13),
            Emitted::Record((Some((2, 'b')), None), 13),
            Emitted::Watermark(14),
            Emitted::Watermark(26),
        ];
        assert_eq!(run(STREAM_FULL_JOIN, full_outer, steps), expected);
    }

    #[test]
    fn a_full_join_holds_the_watermark_until_the_unmatched_rows_of_both_sides_went_out() {
        let rows = EVICT_PER_WATERMARK as u32 + 1;
        // Left rows at 0 and right rows at 10: their ranges all end at 10.
        let row = |ad: u32| match ad % 2 {
            0 => Record(Left((ad, 'a')), 0),
            _ => Record(Right((ad, 'x')), 10),
        };
        let steps: Vec<Step<Row>> = [Watermark(0)]
            .into_iter()
            .chain((0..rows).map(row))
            .chain([Watermark(11), Flush])
            .collect();
        let emitted = run(STREAM_FULL_JOIN, full_outer, steps);
        let watermarks = watermarks_at(&emitted);
        let slice = EVICT_PER_WATERMARK;
        assert_eq!(watermarks, [(0, 0), (slice + 1, 10), (slice + 3, 11)]);
        let mut unmatched: Vec<u32> = emitted
            .iter()
            .filter_map(|e| match e {
                Emitted::Record((Some((ad, 'a')), None), 10) if ad % 2 == 0 => Some(*ad),
                Emitted::Record((None, Some((ad, 'x'))), 10) if ad % 2 == 1 => Some(*ad),
                _ => None,
            })
            .collect();
        unmatched.sort();
        assert_eq!(unmatched, (0..rows).collect::<Vec<_>>());
    }

    #[test]
    fn a_restored_full_join_knows_which_right_rows_matched() {
        let steps = [
            // x is marked matched when a arrives.
            Record(Right((1, 'x')), 5),
            Record(Left((1, 'a')), 0),
            Record(Right((2, 'y')), 4),
            Barrier,
            // Lost with the instance: never out unmatched.
            Record(Left((3, 'c')), 1),
            Restore,
            Watermark(12),
        ];
        let expected = [
            Emitted::Record((Some((1, 'a')), Some((1, 'x'))), 5),
            Emitted::Record((None, Some((2, 'y'))), 4),
            Emitted::Watermark(12),
        ];
        assert_eq!(run(STREAM_FULL_JOIN, full_outer, steps), expected);
    }

    /// The signature and encoding of the rows a barrier checkpoints after
    /// `a` at 0 and `x` at 3, both of key 1.
    fn checkpointed<Out: Send + 'static>(mut join: OperatorTester<Row, Out>) -> (String, Vec<u8>) {
        join.record(Left((1, 'a')), 0).unwrap();
        join.record(Right((1, 'x')), 3).unwrap();
        let deltas = join.barrier(1).unwrap();
        let rows = deltas.iter().find(|d| d.state.name == ROWS).unwrap();
        let value = rows.entries[0].value.clone().unwrap();
        (rows.meta.signature.clone(), value)
    }

    #[test]
    fn the_inner_left_and_right_joins_checkpoint_rows_as_before_and_the_full_join_its_own() {
        // Checkpoints of the inner, left and right joins written before the
        // full join existed must still restore: same signature, same bytes.
        let rows = "(u32, rtflow_operators::join_stream::Rows<(u32, char), (u32, char)>)";
        // One left row (time 0, (1, 'a'), matched), one right row (time 3,
        // zigzag 6, (1, 'x')).
        let matched = vec![1, 0, 1, 97, 1, 1, 6, 1, 120];
        let inner = OperatorTester::new(STREAM_JOIN, inner).unwrap();
        assert_eq!(checkpointed(inner), (rows.to_owned(), matched.clone()));
        let left = OperatorTester::new(STREAM_LEFT_JOIN, left_outer).unwrap();
        assert_eq!(checkpointed(left), (rows.to_owned(), matched));
        // Click 'a' at 0 is on the left, and impression 'x' at 3 is after it.
        let unmatched = vec![1, 0, 1, 97, 0, 1, 6, 1, 120];
        let right = OperatorTester::new(STREAM_RIGHT_JOIN, right_outer).unwrap();
        assert_eq!(checkpointed(right), (rows.to_owned(), unmatched));
        // The full join's right rows carry whether they matched too.
        let full_rows = "(u32, rtflow_operators::join_stream::FullRows<(u32, char), (u32, char)>)";
        let both_matched = vec![1, 0, 1, 97, 1, 1, 6, 1, 120, 1];
        let full = OperatorTester::new(STREAM_FULL_JOIN, full_outer).unwrap();
        assert_eq!(checkpointed(full), (full_rows.to_owned(), both_matched));
    }
}
