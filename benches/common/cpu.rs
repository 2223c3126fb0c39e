//! Where a bench's CPU goes: the time this process's threads ran, by thread
//! name, and that of the local Kafka broker, read from Linux's `/proc`.
//!
//! Threads are grouped by name with a trailing number dropped, so that
//! `rdk:broker1` and `rdk:broker2` add up. Unnamed threads carry the
//! process's name. On a 2-core machine that the broker shares, what a
//! pipeline spends per record is what its neighbours wait for.

use std::collections::BTreeMap;
use std::fs;
use std::time::Instant;

/// Clock ticks per second of `/proc`'s CPU times (`USER_HZ`), 100 on every
/// Linux architecture rtflow builds for.
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU times at one instant.
pub struct Sample {
    at: Instant,
    /// Ticks run per thread id, with the thread's name.
    threads: BTreeMap<String, (String, u64)>,
    /// Ticks run by every local broker process.
    broker: u64,
}

/// CPU used between two samples, in percent of one core.
pub struct Usage {
    pub process: f64,
    pub broker: f64,
    pub by_thread: BTreeMap<String, f64>,
}

impl Sample {
    pub fn now() -> Self {
        let mut threads = BTreeMap::new();
        for entry in fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Some(times) = times(&entry.path().join("stat")) {
                threads.insert(entry.file_name().to_string_lossy().into_owned(), times);
            }
        }
        Self {
            at: Instant::now(),
            threads,
            broker: broker_ticks(),
        }
    }

    /// What ran between `earlier` and this sample.
    pub fn since(&self, earlier: &Sample) -> Usage {
        let seconds = self.at.duration_since(earlier.at).as_secs_f64().max(1e-9);
        let percent = |ticks: u64| ticks as f64 / TICKS_PER_SECOND / seconds * 100.0;
        let mut by_thread = BTreeMap::<String, f64>::new();
        for (id, (name, ticks)) in &self.threads {
            let before = earlier.threads.get(id).map_or(0, |(_, ticks)| *ticks);
            let group = name.trim_end_matches(|c: char| c.is_ascii_digit());
            *by_thread.entry(group.to_owned()).or_default() +=
                percent(ticks.saturating_sub(before));
        }
        Usage {
            process: by_thread.values().sum(),
            broker: percent(self.broker.saturating_sub(earlier.broker)),
            by_thread,
        }
    }
}

/// A thread's or process's name and user plus system ticks, from its `stat`.
fn times(stat: &std::path::Path) -> Option<(String, u64)> {
    let stat = fs::read_to_string(stat).ok()?;
    // The name, in parentheses, may hold spaces and parentheses itself.
    let (head, tail) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = tail.split_whitespace().collect();
    // utime and stime are the 14th and 15th fields, the 12th and 13th after
    // the name.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((name, ticks))
}

/// The ticks of every process running a Kafka broker on this machine.
fn broker_ticks() -> u64 {
    let mut ticks = 0;
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let is_broker = fs::read(entry.path().join("cmdline"))
            .is_ok_and(|cmdline| cmdline.windows(11).any(|w| w == b"kafka.Kafka"));
        if is_broker {
            ticks += times(&entry.path().join("stat")).map_or(0, |(_, t)| t);
        }
    }
    ticks
}
