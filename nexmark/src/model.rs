//! The Nexmark events: people register, sell items in auctions, and bid on them.
//!
//! The fields and their names follow the model of the reference generator
//! (nexmark-flink's `Person`, `Auction` and `Bid`); times are event times in
//! milliseconds since the Unix epoch, prices are in cents.

use serde::{Deserialize, Serialize};

/// Event time in milliseconds since the Unix epoch.
pub type Millis = i64;

/// A new user of the auction site.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Person {
    pub id: u64,
    pub name: String,
    pub email_address: String,
    pub credit_card: String,
    pub city: String,
    pub state: String,
    pub date_time: Millis,
    /// Padding that brings the person to 200 bytes on average.
    pub extra: String,
}

/// An item put up for auction by `seller` from `date_time` until `expires`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Auction {
    pub id: u64,
    pub item_name: String,
    pub description: String,
    pub initial_bid: u64,
    pub reserve: u64,
    pub date_time: Millis,
    pub expires: Millis,
    pub seller: u64,
    pub category: u64,
    /// Padding that brings the auction to 500 bytes on average.
    pub extra: String,
}

/// A bid of `bidder` on `auction`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Bid {
    pub auction: u64,
    pub bidder: u64,
    pub price: u64,
    pub date_time: Millis,
    /// Padding that brings the bid to 100 bytes on average.
    pub extra: String,
}

/// One event of the stream: 2% people, 6% auctions, 92% bids.
///
/// People and auctions are boxed: they are rare and large, and unboxed they
/// would triple the size of every bid as it travels through the dataflow.
///
/// ```
/// use rtflow_nexmark::{Bid, Event};
/// let bid = Event::Bid(Bid { auction: 1000, bidder: 1001, price: 250, date_time: 7, extra: String::new() });
/// assert_eq!(bid.date_time(), 7);
/// assert_eq!(bid.into_bid().map(|bid| bid.price), Some(250));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    Person(Box<Person>),
    Auction(Box<Auction>),
    Bid(Bid),
}

impl Event {
    /// When the event happened.
    pub fn date_time(&self) -> Millis {
        match self {
            Event::Person(person) => person.date_time,
            Event::Auction(auction) => auction.date_time,
            Event::Bid(bid) => bid.date_time,
        }
    }

    /// The bid, if the event is one.
    pub fn into_bid(self) -> Option<Bid> {
        match self {
            Event::Bid(bid) => Some(bid),
            _ => None,
        }
    }
}
