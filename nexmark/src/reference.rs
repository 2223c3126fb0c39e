//! The queries as plain batch code over all events at once: what each query's
//! answer is, without streaming, watermarks or state. Results that are sets of
//! rows come sorted.
//!
//! A streaming query emits updates; the `final_*` functions read an update
//! stream as the answer it amounts to, so it can be compared with these.
//!
//! ```
//! use rtflow_nexmark::{reference, GeneratorConfig, NexmarkGenerator};
//! let events: Vec<_> = NexmarkGenerator::new(GeneratorConfig::default())
//!     .events(0..10_000)
//!     .collect();
//! let selected = reference::q2(&events);
//! assert!(!selected.is_empty());
//! assert!(selected.iter().all(|(auction, _)| auction % 123 == 0));
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use rtflow::operators::Window;

use crate::model::{Bid, Event, Millis};
use crate::queries::{window_start, SLIDE, WINDOW};

fn bids(events: &[Event]) -> impl Iterator<Item = &Bid> {
    events.iter().filter_map(|event| match event {
        Event::Bid(bid) => Some(bid),
        _ => None,
    })
}

fn sorted<T: Ord>(mut rows: Vec<T>) -> Vec<T> {
    rows.sort();
    rows
}

/// Every bid.
pub fn q0(events: &[Event]) -> Vec<Bid> {
    sorted(bids(events).cloned().collect())
}

/// Every bid, its price in euro cents.
pub fn q1(events: &[Event]) -> Vec<Bid> {
    sorted(
        bids(events)
            .map(|bid| Bid {
                price: bid.price * 908 / 1000,
                ..bid.clone()
            })
            .collect(),
    )
}

/// `(auction, price)` of the bids on every 123rd auction.
pub fn q2(events: &[Event]) -> Vec<(u64, u64)> {
    sorted(
        bids(events)
            .filter(|bid| bid.auction % 123 == 0)
            .map(|bid| (bid.auction, bid.price))
            .collect(),
    )
}

/// `(name, city, state, auction)` of the category-10 auctions of sellers in
/// Oregon, Idaho or California.
pub fn q3(events: &[Event]) -> Vec<(String, String, String, u64)> {
    let sellers: HashMap<u64, (&str, &str, &str)> = events
        .iter()
        .filter_map(|event| match event {
            Event::Person(p) if matches!(p.state.as_str(), "OR" | "ID" | "CA") => {
                Some((p.id, (p.name.as_str(), p.city.as_str(), p.state.as_str())))
            }
            _ => None,
        })
        .collect();
    let mut rows = Vec::new();
    for event in events {
        if let Event::Auction(a) = event {
            if let (10, Some((name, city, state))) = (a.category, sellers.get(&a.seller)) {
                rows.push((name.to_string(), city.to_string(), state.to_string(), a.id));
            }
        }
    }
    sorted(rows)
}

/// Per category, the average over its auctions of the highest bid made while
/// the auction was open (auctions without such a bid do not count).
pub fn q4(events: &[Event]) -> BTreeMap<u64, f64> {
    let auctions: HashMap<u64, (u64, Millis, Millis)> = events
        .iter()
        .filter_map(|event| match event {
            Event::Auction(a) => Some((a.id, (a.category, a.date_time, a.expires))),
            _ => None,
        })
        .collect();
    let mut highest: HashMap<u64, u64> = HashMap::new();
    for bid in bids(events) {
        if let Some((_, opens, closes)) = auctions.get(&bid.auction) {
            if (*opens..=*closes).contains(&bid.date_time) {
                let price = highest.entry(bid.auction).or_default();
                *price = (*price).max(bid.price);
            }
        }
    }
    let mut per_category: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for (auction, price) in highest {
        let (sum, count) = per_category.entry(auctions[&auction].0).or_default();
        *sum += price;
        *count += 1;
    }
    per_category
        .into_iter()
        .map(|(category, (sum, count))| (category, sum as f64 / count as f64))
        .collect()
}

/// Per 10 s window sliding by 2 s: the most bids an auction got, and the
/// auctions that got them.
pub fn q5(events: &[Event]) -> BTreeMap<Window, (u64, BTreeSet<u64>)> {
    let (size, slide) = (WINDOW.as_millis() as Millis, SLIDE.as_millis() as Millis);
    let mut counts: HashMap<(Window, u64), u64> = HashMap::new();
    for bid in bids(events) {
        let last = bid.date_time - bid.date_time.rem_euclid(slide);
        for start in (0..size / slide).map(|i| last - i * slide) {
            let window = Window {
                start,
                end: start + size,
            };
            *counts.entry((window, bid.auction)).or_default() += 1;
        }
    }
    final_q5(
        counts
            .into_iter()
            .map(|((window, auction), bids)| (auction, window, bids)),
    )
}

/// q5's answer from its update stream: per window, the highest count emitted
/// and the auctions emitted with it.
pub fn final_q5(
    rows: impl IntoIterator<Item = (u64, Window, u64)>,
) -> BTreeMap<Window, (u64, BTreeSet<u64>)> {
    let mut most: BTreeMap<Window, (u64, BTreeSet<u64>)> = BTreeMap::new();
    for (auction, window, bids) in rows {
        let (highest, auctions) = most.entry(window).or_default();
        if bids > *highest {
            *highest = bids;
            auctions.clear();
        }
        if bids == *highest {
            auctions.insert(auction);
        }
    }
    most
}

/// Per tumbling 10 s window (by its start): the bids with the highest price.
pub fn q7(events: &[Event]) -> BTreeMap<Millis, Vec<Bid>> {
    final_q7(bids(events).cloned())
}

/// q7's answer from its update stream: per window, the emitted bids with the
/// highest price, sorted.
pub fn final_q7(bids: impl IntoIterator<Item = Bid>) -> BTreeMap<Millis, Vec<Bid>> {
    let mut highest: BTreeMap<Millis, Vec<Bid>> = BTreeMap::new();
    for bid in bids {
        let leaders = highest.entry(window_start(bid.date_time)).or_default();
        match leaders.first() {
            Some(leader) if leader.price > bid.price => {}
            Some(leader) if leader.price == bid.price => leaders.push(bid),
            _ => *leaders = vec![bid],
        }
    }
    for leaders in highest.values_mut() {
        leaders.sort();
    }
    highest
}

/// `(id, name, window start)` of the people who put up an auction in the
/// tumbling 10 s window they registered in.
pub fn q8(events: &[Event]) -> Vec<(u64, String, Millis)> {
    let sellers: HashSet<(u64, Millis)> = events
        .iter()
        .filter_map(|event| match event {
            Event::Auction(a) => Some((a.seller, window_start(a.date_time))),
            _ => None,
        })
        .collect();
    let mut rows = Vec::new();
    for event in events {
        if let Event::Person(p) = event {
            let start = window_start(p.date_time);
            if sellers.contains(&(p.id, start)) {
                rows.push((p.id, p.name.clone(), start));
            }
        }
    }
    sorted(rows)
}

/// Per bidder and session (bids less than 10 s apart, ending 10 s after the
/// last): the number of bids.
pub fn q11(events: &[Event]) -> BTreeMap<(u64, Window), u64> {
    let gap = WINDOW.as_millis() as Millis;
    let mut times: BTreeMap<u64, Vec<Millis>> = BTreeMap::new();
    for bid in bids(events) {
        times.entry(bid.bidder).or_default().push(bid.date_time);
    }
    let mut sessions = BTreeMap::new();
    for (bidder, mut times) in times {
        times.sort_unstable();
        let mut start = 0;
        for i in 1..=times.len() {
            if i == times.len() || times[i] - times[i - 1] >= gap {
                let window = Window {
                    start: times[start],
                    end: times[i - 1] + gap,
                };
                sessions.insert((bidder, window), (i - start) as u64);
                start = i;
            }
        }
    }
    sessions
}

/// q11's answer from its update stream: the sessions no other emitted session
/// of their bidder contains (sessions only grow and merge), each with its
/// last count.
pub fn final_q11(
    rows: impl IntoIterator<Item = (u64, Window, u64)>,
) -> BTreeMap<(u64, Window), u64> {
    let mut latest: BTreeMap<(u64, Window), u64> = BTreeMap::new();
    for (bidder, window, bids) in rows {
        let count = latest.entry((bidder, window)).or_default();
        *count = (*count).max(bids);
    }
    let mut per_bidder: BTreeMap<u64, Vec<Window>> = BTreeMap::new();
    for (bidder, window) in latest.keys() {
        per_bidder.entry(*bidder).or_default().push(*window);
    }
    latest.retain(|(bidder, window), _| {
        !per_bidder[bidder]
            .iter()
            .any(|other| other != window && other.start <= window.start && window.end <= other.end)
    });
    latest
}

/// The last value emitted per key: the answer of an update stream of
/// `(key, value)`, such as q4's.
pub fn latest<K: Ord, V>(rows: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, V> {
    rows.into_iter().collect()
}
