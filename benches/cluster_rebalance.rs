//! What a rebalance costs: how long the keys of a clustered query stall
//! while a process joins and leaves.
//!
//! Processes `p0` and `p1` count `--keys` (default 40) keys, each updated
//! every 250 ms, under a read_committed watch. Once they have settled (no
//! run started for 8 s), `p2` starts (2 -> 3 processes); once all three have
//! settled, `p2` stops cleanly through a stop file of its own (3 -> 2), and
//! the two settle again. Each process's status file names the input and
//! repartition partitions its run owns. A key is read from input partition
//! `k % 6` and counted in the repartition partition of its key group
//! (`stable_hash`, `key_group`, as `repartition_by` computes it), so the keys
//! of each transition split into those that stayed (both partitions with
//! the process that had them) and those that moved (either partition went
//! to another process, which reads or counts the key from its next run on).
//! Reported per transition and split:
//! each key's longest gap between consecutive updates from the change of
//! membership until the processes settled, p50 / p99 / max over the keys,
//! beside the longest gap of any key in the seconds before `p2` starts and
//! twice the batch duration (issue #30's bound for keys that do not move).
//! Median and range of `--runs` (default 3); JSON lines on stdout, a summary
//! on stderr.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster_rebalance
//! cargo bench --bench cluster_rebalance -- --bootstrap 127.0.0.1:9092 --keys 40 --runs 3
//! ```

#[path = "common/cluster.rs"]
mod cluster;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cluster::*;

fn main() -> BenchResult<()> {
    main_of(|args: PacedArgs| {
        eprintln!(
            "command: cargo bench --bench cluster_rebalance -- --bootstrap {} --keys {} --runs {}",
            args.common.bootstrap, args.keys, args.common.runs,
        );
        rebalances(&args)
    })
}

/// The changes of membership of the rebalance measurement: `p2` joins
/// (2 -> 3 processes), then leaves (3 -> 2).
const TRANSITIONS: [&str; 2] = ["join", "leave"];
/// How the keys of a transition split: their input and repartition
/// partitions both stayed with their processes, or one of them moved.
const SPLITS: [&str; 2] = ["stayed", "moved"];

/// One run of the rebalance measurement.
struct Rebalance {
    /// Per transition and split, each key's longest gap between consecutive
    /// updates from the change of membership until the processes settled,
    /// in seconds.
    gaps: [[Vec<f64>; 2]; 2],
    /// The longest gap of any key in the seconds before `p2` joins.
    steady: f64,
}

/// Which process's current run owns each partition of the input and of the
/// repartition topic.
struct Owners {
    input: HashMap<i32, String>,
    repartition: HashMap<i32, String>,
}

fn owners(processes: &Processes, instances: &[&str]) -> BenchResult<Owners> {
    let mut owners = Owners {
        input: HashMap::new(),
        repartition: HashMap::new(),
    };
    for instance in instances {
        let status = processes.status(instance);
        for partition in status.input {
            owners.input.insert(partition, (*instance).to_owned());
        }
        for partition in status.repartition {
            owners.repartition.insert(partition, (*instance).to_owned());
        }
    }
    for (topic, owned) in [
        ("input", &owners.input),
        ("repartition", &owners.repartition),
    ] {
        if owned.len() != PARTITIONS as usize {
            return Err(
                format!("the processes own {owned:?} of {PARTITIONS} {topic} partitions").into(),
            );
        }
    }
    Ok(owners)
}

/// The repartition partition of key `k` in the query of [`build`]: its key
/// group's, as `repartition_by` and the exchange compute it.
fn repartition_partition(key: &str, key_groups: usize) -> i32 {
    let group = rtflow::runtime::key_groups::key_group(
        rtflow::runtime::key_groups::stable_hash(key),
        key_groups,
    );
    (group % PARTITIONS as usize) as i32
}

/// Processes `p0` and `p1` count keys updated every [`TICK`]; once
/// they settle, `p2` joins, and once all three settle, `p2` stops cleanly.
fn rebalance(args: &PacedArgs) -> BenchResult<Rebalance> {
    let topics = Topics::create(&args.common.bootstrap, "rebalance")?;
    let key_groups = config(&topics.query).max_key_groups;
    let mut processes = Processes::new(&args.common.bootstrap, &topics)?;
    let (stop, pacer) = pace(&args.common.bootstrap, &topics.input, args.keys);
    let (two, three) = (["p0", "p1"], ["p0", "p1", "p2"]);
    for p in two {
        processes.spawn(p)?;
    }
    let mut watch = Watch::new(&args.common.bootstrap, &topics.output)?;
    watch.settle(&mut processes, &two)?;
    let before = owners(&processes, &two)?;
    let joined = Instant::now();
    processes.spawn("p2")?;
    watch.settle(&mut processes, &three)?;
    let between = owners(&processes, &three)?;
    let left = Instant::now();
    processes.tell_to_stop("p2")?;
    watch.settle(&mut processes, &two)?;
    let after = owners(&processes, &two)?;
    let end = Instant::now();
    stop.store(true, Ordering::SeqCst);
    pacer.join().map_err(|_| "the pacer panicked")??;
    processes.stop()?;
    topics.delete(&args.common.bootstrap)?;

    let transition = |from: Instant, to: Instant, was: &Owners, is: &Owners| {
        let mut split: [Vec<f64>; 2] = Default::default();
        for k in 0..args.keys {
            let key = format!("k{k}");
            let input = (k % PARTITIONS as u64) as i32;
            let partition = repartition_partition(&key, key_groups);
            let moved = was.input[&input] != is.input[&input]
                || was.repartition[&partition] != is.repartition[&partition];
            split[usize::from(moved)].push(watch.longest_gap(&key, from, to));
        }
        split
    };
    Ok(Rebalance {
        gaps: [
            transition(joined, left, &before, &between),
            transition(left, end, &between, &after),
        ],
        steady: watch.steady(joined - SETTLED + Duration::from_secs(1), joined),
    })
}

/// `--runs` runs of 2 -> 3 -> 2 processes.
fn rebalances(args: &PacedArgs) -> BenchResult<Vec<String>> {
    let mut summary = Vec::new();
    let runs = (0..args.common.runs)
        .map(|_| rebalance(args))
        .collect::<BenchResult<Vec<_>>>()?;
    let target = 2.0 * COMMIT_INTERVAL.as_secs_f64();
    let steady = Spread::of(runs.iter().map(|r| r.steady));
    summary.push(format!(
        "rebalance, {} keys updated every {} ms, batch {} ms: a key's longest gap in s \
         while p2 joins (2 -> 3) and leaves (3 -> 2), median (range) of {} runs; \
         target {target:.2} s (twice the batch), before the join {}",
        args.keys,
        TICK.as_millis(),
        COMMIT_INTERVAL.as_millis(),
        args.common.runs,
        steady.text(2)
    ));
    summary.push(format!(
        "{:<28}{:>8}{:>22}{:>22}{:>22}",
        "keys", "count", "p50", "p99", "max"
    ));
    for (t, transition) in TRANSITIONS.into_iter().enumerate() {
        for (s, keys) in SPLITS.into_iter().enumerate() {
            // A run may move no key (or every key) of a transition.
            let gaps: Vec<Vec<f64>> = runs
                .iter()
                .map(|r| r.gaps[t][s].clone())
                .filter(|gaps| !gaps.is_empty())
                .collect();
            if gaps.is_empty() {
                continue;
            }
            let count = Spread::of(gaps.iter().map(|gaps| gaps.len() as f64));
            let (ran, gaps) = (gaps.len(), Gaps::of(gaps));
            println!(
                "{{\"bench\":\"cluster_rebalance\",\"pipeline\":\"rebalance\",\
                 \"transition\":\"{transition}\",\"keys\":\"{keys}\",\"runs\":{ran},\
                 \"batch_s\":{:.2},\"target_s\":{target:.2},{},{},{}}}",
                COMMIT_INTERVAL.as_secs_f64(),
                count.json("key_count", 0),
                gaps.json("gap"),
                steady.json("steady_max_gap_s", 2),
            );
            summary.push(format!(
                "{:<28}{:>8}{}",
                format!("{transition}, {keys}"),
                count.text(0),
                gaps.columns()
            ));
        }
    }
    Ok(summary)
}
