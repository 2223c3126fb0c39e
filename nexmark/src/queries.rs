//! The Nexmark queries, written with rtflow's builder API. Each takes the event
//! stream (as the source delivers it) and returns its result stream; what it
//! emits is an update stream, and [`crate::reference`] says how its final
//! result reads.
//!
//! The SQL in each function's documentation is the query's definition in the
//! nexmark project (the Flink SQL suite). Where SQL keeps a regular join or a
//! retracting aggregate, the query here keeps the same state in a
//! [`KeyedProcessor`] and lets the watermark bound it.
//!
//! Every partition of the [`NexmarkSource`](crate::NexmarkSource) is in event
//! time order, so the queries declare event time with no delay and no record
//! is ever late.
//!
//! ```
//! use std::time::Duration;
//! use rtflow::prelude::*;
//! use rtflow_nexmark::{queries, GeneratorConfig, NexmarkGenerator, NexmarkSource};
//!
//! let flow = Dataflow::new("q2");
//! let generator = NexmarkGenerator::new(GeneratorConfig::default());
//! let events = flow.source(NexmarkSource::new(generator).partitions(2).events(50_000));
//! let output = MemorySink::new();
//! queries::q2(&events).sink(output.clone());
//! let dir = std::env::temp_dir().join(format!("nexmark-doc-q2-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let query = flow.start(QueryConfig::new("q2").checkpoint_location(dir))?;
//! query.await_termination(Some(Duration::from_secs(60)))?;
//! assert!(output.rows().iter().all(|(auction, _price)| auction % 123 == 0));
//! # Ok::<(), rtflow::RtflowError>(())
//! ```

use std::time::Duration;

use rtflow::operators::process::{ListState, StateDeclarations, ValueState};
use rtflow::operators::Window;
use rtflow::prelude::*;

use crate::model::{Bid, Event, Millis};

/// The windows of q5, q7, q8 and q11: 10 s, sliding by 2 s in q5.
pub const WINDOW: Duration = Duration::from_secs(10);
/// The slide of q5's windows.
pub const SLIDE: Duration = Duration::from_secs(2);
/// q7 and q8's tumbling window, in ms.
const WINDOW_MS: Millis = WINDOW.as_millis() as Millis;

/// Declares the events' own time as event time.
fn with_event_time(events: &Stream<Event>) -> Stream<Event> {
    events.with_watermark(Event::date_time, Duration::ZERO)
}

/// The start of the tumbling 10 s window holding `time`.
pub fn window_start(time: Millis) -> Millis {
    time - time.rem_euclid(WINDOW_MS)
}

/// q0, pass-through: every bid, unchanged.
///
/// ```sql
/// SELECT auction, bidder, price, dateTime, extra FROM bid;
/// ```
pub fn q0(events: &Stream<Event>) -> Stream<Bid> {
    events.flat_map(Event::into_bid)
}

/// q1, currency conversion: every bid with its price in euro cents (rounded
/// down).
///
/// ```sql
/// SELECT auction, bidder, 0.908 * price as price, dateTime, extra FROM bid;
/// ```
///
/// The conversion happens in the `flat_map` that picks the bids: a `map` after
/// it would move every 100-byte bid once more.
pub fn q1(events: &Stream<Event>) -> Stream<Bid> {
    events.flat_map(|event: Event| {
        event.into_bid().map(|bid| Bid {
            price: bid.price * 908 / 1000,
            ..bid
        })
    })
}

/// q2, selection: `(auction, price)` of the bids on every 123rd auction.
///
/// ```sql
/// SELECT auction, price FROM bid WHERE MOD(auction, 123) = 0;
/// ```
pub fn q2(events: &Stream<Event>) -> Stream<(u64, u64)> {
    events
        .flat_map(Event::into_bid)
        .filter(|bid| bid.auction % 123 == 0)
        .map(|bid| (bid.auction, bid.price))
}

/// A seller of q3: id, name, city, state.
type Seller = (u64, String, String, String);

/// q3, local item suggestion: `(name, city, state, auction)` for every auction
/// in category 10 by a seller from Oregon, Idaho or California.
///
/// ```sql
/// SELECT P.name, P.city, P.state, A.id
/// FROM auction AS A INNER JOIN person AS P on A.seller = P.id
/// WHERE A.category = 10 and (P.state = 'OR' OR P.state = 'ID' OR P.state = 'CA');
/// ```
///
/// A regular join: both sides come from one source, tagged and keyed by the
/// person, and a [`LocalItemSuggestion`] keeps the seller and the auctions that
/// came before them. Like the SQL join, its state is never dropped.
pub fn q3(events: &Stream<Event>) -> Stream<(String, String, String, u64)> {
    events
        .flat_map(|event| match event {
            Event::Person(p) if matches!(p.state.as_str(), "OR" | "ID" | "CA") => {
                Some(Either::Left((p.id, p.name, p.city, p.state)))
            }
            Event::Auction(a) if a.category == 10 => Some(Either::Right((a.seller, a.id))),
            _ => None,
        })
        .key_by(|side: &Either<Seller, (u64, u64)>| match side {
            Either::Left((id, ..)) | Either::Right((id, _)) => *id,
        })
        .process(|| LocalItemSuggestion)
}

/// q3's join of sellers (left) and their auctions (right, as `(seller, id)`).
pub struct LocalItemSuggestion;

const SELLER: ValueState<(String, String, String)> = ValueState::new("seller");
const EARLY_AUCTIONS: ListState<u64> = ListState::new("early-auctions");

impl KeyedProcessor<u64, Either<Seller, (u64, u64)>, (String, String, String, u64)>
    for LocalItemSuggestion
{
    fn init(&mut self, states: &mut StateDeclarations<'_, u64>) -> Result<()> {
        states.declare(&SELLER)?;
        states.declare(&EARLY_AUCTIONS)
    }

    fn handle_input(
        &mut self,
        _seller: &u64,
        side: Either<Seller, (u64, u64)>,
        ctx: &mut ProcessContext<'_, '_, u64, (String, String, String, u64)>,
    ) -> Result<()> {
        match side {
            Either::Left((_, name, city, state)) => {
                for auction in ctx.list(&EARLY_AUCTIONS).clear() {
                    ctx.emit((name.clone(), city.clone(), state.clone(), auction))?;
                }
                ctx.value(&SELLER).set((name, city, state));
                Ok(())
            }
            Either::Right((_, auction)) => match ctx.value(&SELLER).get().cloned() {
                Some((name, city, state)) => ctx.emit((name, city, state, auction)),
                None => {
                    ctx.list(&EARLY_AUCTIONS).push(auction);
                    Ok(())
                }
            },
        }
    }
}

/// An auction as q4 needs it: id, category, opening and closing time.
type AuctionSpan = (u64, u64, Millis, Millis);
/// A bid as q4 needs it: auction, price, time.
type BidPrice = (u64, u64, Millis);

/// q4, average price per category: `(category, average)` of the winning
/// price of the auctions of each category, the winning price being the
/// highest bid made while the auction was open; updated whenever one changes.
///
/// ```sql
/// SELECT Q.category, AVG(Q.final)
/// FROM (
///     SELECT MAX(B.price) AS final, A.category
///     FROM auction A, bid B
///     WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires
///     GROUP BY A.id, A.category
/// ) Q
/// GROUP BY Q.category;
/// ```
///
/// The inner query is a [`WinningBids`] per auction, which emits how each new
/// highest bid changes its category's sum and count (the retraction of the
/// old maximum and the addition of the new one, in one record); the outer one
/// sums those changes per category with `reduce`.
pub fn q4(events: &Stream<Event>) -> Stream<(u64, f64)> {
    with_event_time(events)
        .flat_map(|event| match event {
            Event::Auction(a) => Some(Either::Left((a.id, a.category, a.date_time, a.expires))),
            Event::Bid(b) => Some(Either::Right((b.auction, b.price, b.date_time))),
            Event::Person(_) => None,
        })
        .key_by(|side: &Either<AuctionSpan, BidPrice>| match side {
            Either::Left((id, ..)) | Either::Right((id, ..)) => *id,
        })
        .process(|| WinningBids)
        .key_by(|(category, _, _)| *category)
        .reduce(|total, change| (total.0, total.1 + change.1, total.2 + change.2))
        .map(|(category, (_, sum, count))| (category, sum as f64 / count as f64))
}

/// q4's inner query, per auction: its highest bid while it is open, emitted
/// as `(category, price increase, 1 for the first bid else 0)`.
pub struct WinningBids;

/// The auction: category, opening and closing time.
const AUCTION: ValueState<(u64, Millis, Millis)> = ValueState::new("auction");
const HIGHEST: ValueState<u64> = ValueState::new("highest");
/// Bids that came before their auction (another partition was ahead): time, price.
const EARLY_BIDS: ListState<(Millis, u64)> = ListState::new("early-bids");

impl WinningBids {
    /// Takes a bid of an open auction; emits the change if it is the highest.
    fn bid(
        (category, opens, closes): (u64, Millis, Millis),
        (time, price): (Millis, u64),
        ctx: &mut ProcessContext<'_, '_, u64, (u64, u64, u64)>,
    ) -> Result<()> {
        if time < opens || time > closes {
            return Ok(());
        }
        let highest = ctx.value(&HIGHEST).get().copied();
        if highest.is_some_and(|highest| price <= highest) {
            return Ok(());
        }
        ctx.value(&HIGHEST).set(price);
        let first = u64::from(highest.is_none());
        ctx.emit((category, price - highest.unwrap_or(0), first))
    }
}

impl KeyedProcessor<u64, Either<AuctionSpan, BidPrice>, (u64, u64, u64)> for WinningBids {
    fn init(&mut self, states: &mut StateDeclarations<'_, u64>) -> Result<()> {
        states.declare(&AUCTION)?;
        states.declare(&HIGHEST)?;
        states.declare(&EARLY_BIDS)
    }

    fn handle_input(
        &mut self,
        _auction: &u64,
        side: Either<AuctionSpan, BidPrice>,
        ctx: &mut ProcessContext<'_, '_, u64, (u64, u64, u64)>,
    ) -> Result<()> {
        match side {
            Either::Left((_, category, opens, closes)) => {
                let auction = (category, opens, closes);
                ctx.value(&AUCTION).set(auction);
                // Once the watermark passes the close, no bid it takes can come.
                ctx.register_timer(Timer::EventTime(closes + 1));
                for bid in ctx.list(&EARLY_BIDS).clear() {
                    Self::bid(auction, bid, ctx)?;
                }
                Ok(())
            }
            Either::Right((_, price, time)) => match ctx.value(&AUCTION).get().copied() {
                Some(auction) => Self::bid(auction, (time, price), ctx),
                None => {
                    ctx.list(&EARLY_BIDS).push((time, price));
                    // An auction this bid counts for opens by its time.
                    ctx.register_timer(Timer::EventTime(time + 1));
                    Ok(())
                }
            },
        }
    }

    fn on_timer(
        &mut self,
        _auction: &u64,
        timer: Timer,
        ctx: &mut ProcessContext<'_, '_, u64, (u64, u64, u64)>,
    ) -> Result<()> {
        let watermark = timer.time();
        let early = ctx.list(&EARLY_BIDS).clear();
        let waiting = early.into_iter().filter(|(time, _)| *time >= watermark);
        ctx.list(&EARLY_BIDS).set(waiting);
        if ctx
            .value(&AUCTION)
            .get()
            .is_some_and(|(_, _, closes)| *closes < watermark)
        {
            ctx.value(&AUCTION).clear();
            ctx.value(&HIGHEST).clear();
        }
        Ok(())
    }
}

/// q5, hot items: `(auction, window, bids)` for the auctions with the most
/// bids in each 10 s window sliding by 2 s, whenever one reaches the most.
///
/// ```sql
/// SELECT AuctionBids.auction, AuctionBids.num
///  FROM (
///    SELECT B1.auction, count(*) AS num,
///        HOP_START(B1.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND) AS starttime,
///        HOP_END(B1.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND) AS endtime
///    FROM bid B1
///    GROUP BY B1.auction, HOP(B1.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND)
///  ) AS AuctionBids
///  JOIN (
///    SELECT max(CountBids.num) AS maxn, CountBids.starttime, CountBids.endtime
///    FROM (
///      SELECT count(*) AS num,
///        HOP_START(B2.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND) AS starttime,
///        HOP_END(B2.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND) AS endtime
///      FROM bid B2
///      GROUP BY B2.auction, HOP(B2.dateTime, INTERVAL '2' SECOND, INTERVAL '10' SECOND)
///      ) AS CountBids
///    GROUP BY CountBids.starttime, CountBids.endtime
///  ) AS MaxBids
///  ON AuctionBids.starttime = MaxBids.starttime AND
///     AuctionBids.endtime = MaxBids.endtime AND
///     AuctionBids.num >= MaxBids.maxn;
/// ```
///
/// A sliding-window count per auction, then [`WindowLeaders`] by count per
/// window.
pub fn q5(events: &Stream<Event>) -> Stream<(u64, Window, u64)> {
    with_event_time(events)
        // Only the auction goes on: the rest of the bid is dropped before the
        // shuffle, on the thread that made it.
        .flat_map(|event| event.into_bid().map(|bid| bid.auction))
        .key_by(|auction| *auction)
        .window(Window::sliding(WINDOW, SLIDE))
        .count()
        // By the window's start, which tells its end too: hashing half the
        // bytes of a window makes this shuffle cheaper.
        .key_by(|(_, window, _)| window.start)
        .process(|| WindowLeaders::by(|(_, _, bids): &(u64, Window, u64)| *bids))
}

/// q7, highest bid: the bids with the highest price of each tumbling 10 s
/// window, whenever one reaches the highest.
///
/// ```sql
/// SELECT B.auction, B.price, B.bidder, B.dateTime, B.extra
/// from bid B
/// JOIN (
///   SELECT MAX(B1.price) AS maxprice, TUMBLE_ROWTIME(B1.dateTime, INTERVAL '10' SECOND) as dateTime
///   FROM bid B1
///   GROUP BY TUMBLE(B1.dateTime, INTERVAL '10' SECOND)
/// ) B1
/// ON B.price = B1.maxprice
/// WHERE B.dateTime BETWEEN B1.dateTime  - INTERVAL '10' SECOND AND B1.dateTime;
/// ```
///
/// Bids keyed by their window, and [`WindowLeaders`] by price per window.
pub fn q7(events: &Stream<Event>) -> Stream<Bid> {
    with_event_time(events)
        .flat_map(Event::into_bid)
        .key_by(|bid| window_start(bid.date_time))
        .process(|| WindowLeaders::by(|bid: &Bid| bid.price))
}

/// q5's and q7's maximum per window, keyed by the window's start: passes on
/// the records whose measure reaches the highest of their window so far, and
/// forgets the window once the watermark passes its end.
pub struct WindowLeaders<T> {
    measure: fn(&T) -> u64,
}

impl<T> WindowLeaders<T> {
    /// Leaders by `measure`.
    pub fn by(measure: fn(&T) -> u64) -> Self {
        Self { measure }
    }
}

const LEADING: ValueState<u64> = ValueState::new("leading");

impl<T: Data> KeyedProcessor<Millis, T, T> for WindowLeaders<T> {
    fn init(&mut self, states: &mut StateDeclarations<'_, Millis>) -> Result<()> {
        states.declare(&LEADING)
    }

    fn handle_input(
        &mut self,
        start: &Millis,
        record: T,
        ctx: &mut ProcessContext<'_, '_, Millis, T>,
    ) -> Result<()> {
        let leading = ctx.value(&LEADING).get().copied();
        if leading.is_none() {
            // The window's records stop coming once the watermark passes its end.
            ctx.register_timer(Timer::EventTime(start + WINDOW_MS));
        }
        let measure = (self.measure)(&record);
        if leading.is_some_and(|leading| measure < leading) {
            return Ok(());
        }
        ctx.value(&LEADING).set(measure);
        ctx.emit(record)
    }

    fn on_timer(
        &mut self,
        _start: &Millis,
        _timer: Timer,
        ctx: &mut ProcessContext<'_, '_, Millis, T>,
    ) -> Result<()> {
        ctx.value(&LEADING).clear();
        Ok(())
    }
}

/// q8, monitor new users: `(id, name, window start)` of the people who put up
/// an auction in the same tumbling 10 s window as they registered, once each.
///
/// ```sql
/// SELECT P.id, P.name, P.starttime
/// FROM (
///   SELECT P.id, P.name,
///          TUMBLE_START(P.dateTime, INTERVAL '10' SECOND) AS starttime,
///          TUMBLE_END(P.dateTime, INTERVAL '10' SECOND) AS endtime
///   FROM person P
///   GROUP BY P.id, P.name, TUMBLE(P.dateTime, INTERVAL '10' SECOND)
/// ) P
/// JOIN (
///   SELECT A.seller,
///          TUMBLE_START(A.dateTime, INTERVAL '10' SECOND) AS starttime,
///          TUMBLE_END(A.dateTime, INTERVAL '10' SECOND) AS endtime
///   FROM auction A
///   GROUP BY A.seller, TUMBLE(A.dateTime, INTERVAL '10' SECOND)
/// ) A
/// ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime;
/// ```
///
/// A windowed join: people and auctions keyed by `(person, window)`, and a
/// [`NewSellers`] per key, whose state the end of the window drops.
pub fn q8(events: &Stream<Event>) -> Stream<(u64, String, Millis)> {
    with_event_time(events)
        .flat_map(|event| match event {
            Event::Person(p) => Some(Either::Left((p.id, p.name, p.date_time))),
            Event::Auction(a) => Some(Either::Right((a.seller, a.date_time))),
            Event::Bid(_) => None,
        })
        .key_by(
            |side: &Either<(u64, String, Millis), (u64, Millis)>| match side {
                Either::Left((id, _, time)) | Either::Right((id, time)) => {
                    (*id, window_start(*time))
                }
            },
        )
        .process(|| NewSellers)
}

/// q8's join per `(person, window start)`: a person (left) and their
/// auctions (right).
pub struct NewSellers;

const NAME: ValueState<String> = ValueState::new("name");
const SELLS: ValueState<bool> = ValueState::new("sells");

impl
    KeyedProcessor<
        (u64, Millis),
        Either<(u64, String, Millis), (u64, Millis)>,
        (u64, String, Millis),
    > for NewSellers
{
    fn init(&mut self, states: &mut StateDeclarations<'_, (u64, Millis)>) -> Result<()> {
        states.declare(&NAME)?;
        states.declare(&SELLS)
    }

    fn handle_input(
        &mut self,
        &(person, start): &(u64, Millis),
        side: Either<(u64, String, Millis), (u64, Millis)>,
        ctx: &mut ProcessContext<'_, '_, (u64, Millis), (u64, String, Millis)>,
    ) -> Result<()> {
        let sells = ctx.value(&SELLS).get().is_some();
        let name = ctx.value(&NAME).get().cloned();
        if !sells && name.is_none() {
            ctx.register_timer(Timer::EventTime(start + WINDOW_MS));
        }
        match side {
            Either::Left((_, name, _)) => {
                if sells {
                    ctx.emit((person, name.clone(), start))?;
                }
                ctx.value(&NAME).set(name);
            }
            Either::Right(_) if sells => {}
            Either::Right(_) => {
                ctx.value(&SELLS).set(true);
                if let Some(name) = name {
                    ctx.emit((person, name, start))?;
                }
            }
        }
        Ok(())
    }

    fn on_timer(
        &mut self,
        _key: &(u64, Millis),
        _timer: Timer,
        ctx: &mut ProcessContext<'_, '_, (u64, Millis), (u64, String, Millis)>,
    ) -> Result<()> {
        ctx.value(&NAME).clear();
        ctx.value(&SELLS).clear();
        Ok(())
    }
}

/// q11, user sessions: `(bidder, session, bids)` for every session of each
/// bidder, a session ending after 10 s without a bid; updated with every bid.
///
/// ```sql
/// SELECT
///     B.bidder,
///     count(*) as bid_count,
///     SESSION_START(B.dateTime, INTERVAL '10' SECOND) as starttime,
///     SESSION_END(B.dateTime, INTERVAL '10' SECOND) as endtime
/// FROM bid B
/// GROUP BY B.bidder, SESSION(B.dateTime, INTERVAL '10' SECOND);
/// ```
pub fn q11(events: &Stream<Event>) -> Stream<(u64, Window, u64)> {
    with_event_time(events)
        .flat_map(|event| event.into_bid().map(|bid| bid.bidder))
        .key_by(|bidder| *bidder)
        .window(Window::session(WINDOW))
        .count()
}
