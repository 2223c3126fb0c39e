//! What a failover costs: how long the keys of a clustered query stall when
//! one of its processes is SIGKILLed.
//!
//! Three processes count `--keys` (default 40) keys, each updated every
//! 250 ms, and a read_committed consumer notes when each key's updates
//! arrive. Once the output flows from all three and their start-up
//! rebalances have settled, process `p1` is SIGKILLed; in the `restart`
//! scenario a process of the same name starts at once, in `gone` none ever
//! does. Reported: the longest gap between a key's consecutive updates from
//! 2 s before the kill to 30 s after it, p50 / p99 / max over the keys (the
//! dead process's open transaction holds back every partition it wrote to,
//! so every key can stall, not only those it owned), beside the longest gap
//! before the kill and the session timeout (6 s) that bounds how soon the
//! group drops a dead process. The processes are static members of the
//! groups (a restart under its name takes its partitions back without a
//! rebalance); `--memberships static,dynamic` measures dynamic members too.
//! Median and range of `--runs` (default 3), the scenarios interleaved; JSON
//! lines on stdout, a summary on stderr.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster_failover
//! cargo bench --bench cluster_failover -- --bootstrap 127.0.0.1:9092 --keys 40 --runs 3 --memberships static,dynamic
//! ```

#[path = "common/cluster.rs"]
mod cluster;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cluster::*;

#[derive(clap::Parser)]
#[command(about = "Stalls of a KafkaCluster query's keys after a process is SIGKILLed")]
struct Args {
    #[command(flatten)]
    paced: PacedArgs,
    /// How the processes join the groups; each is measured, interleaved.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "static")]
    memberships: Vec<Membership>,
}

fn main() -> BenchResult<()> {
    main_of(|args: Args| {
        let memberships: Vec<&str> = args.memberships.iter().map(|m| m.name()).collect();
        eprintln!(
            "command: cargo bench --bench cluster_failover -- --bootstrap {} --keys {} --runs {} \
             --memberships {}",
            args.paced.common.bootstrap,
            args.paced.keys,
            args.paced.common.runs,
            memberships.join(","),
        );
        failovers(&args)
    })
}

/// How long the failover measurement watches the output after the kill.
const FAILOVER_WATCH: Duration = Duration::from_secs(30);

/// What a failover cost: per key, the longest gap between consecutive
/// updates around the kill, in seconds.
struct Failover {
    stalls: Vec<f64>,
    /// The longest gap of any key in the seconds before the kill.
    steady: f64,
}

/// Three processes, members of the groups as `membership` says, count keys
/// updated every [`TICK`]; `p1` is killed, and with `restart` started again
/// at once under its name.
fn failover(args: &PacedArgs, restart: bool, membership: Membership) -> BenchResult<Failover> {
    let scenario = if restart { "restart" } else { "gone" };
    let topics = Topics::create(&args.common.bootstrap, &format!("failover-{scenario}"))?;
    let mut processes = Processes::new(&args.common.bootstrap, &topics)?;
    processes.membership = membership;
    let (stop, pacer) = pace(&args.common.bootstrap, &topics.input, args.keys);
    for p in 0..3 {
        processes.spawn(&format!("p{p}"))?;
    }
    let mut watch = Watch::new(&args.common.bootstrap, &topics.output)?;
    // Every process runs, and the rebalances of their joining have settled.
    watch.settle(&mut processes, &["p0", "p1", "p2"])?;
    let killed = Instant::now();
    processes.kill("p1")?;
    if restart {
        processes.spawn("p1")?;
    }
    watch.read_until(killed + FAILOVER_WATCH, &mut processes)?;
    stop.store(true, Ordering::SeqCst);
    pacer.join().map_err(|_| "the pacer panicked")??;
    processes.stop()?;
    topics.delete(&args.common.bootstrap)?;

    let from = killed - Duration::from_secs(2);
    let end = killed + FAILOVER_WATCH;
    let stalls = (0..args.keys)
        .map(|k| watch.longest_gap(&format!("k{k}"), from, end))
        .collect();
    let steady = watch.steady(killed - SETTLED + Duration::from_secs(2), from);
    Ok(Failover { stalls, steady })
}

/// Each scenario and membership `--runs` times, interleaved.
fn failovers(
    Args {
        paced: args,
        memberships,
    }: &Args,
) -> BenchResult<Vec<String>> {
    let mut summary = Vec::new();
    let cases: Vec<(&str, bool, Membership)> = [("restart", true), ("gone", false)]
        .into_iter()
        .flat_map(|(scenario, restart)| memberships.iter().map(move |m| (scenario, restart, *m)))
        .collect();
    let mut runs: Vec<Vec<Failover>> = cases.iter().map(|_| Vec::new()).collect();
    for _ in 0..args.common.runs {
        for ((_, restart, membership), runs) in cases.iter().zip(&mut runs) {
            runs.push(failover(args, *restart, *membership)?);
        }
    }
    summary.push(format!(
        "failover of 3 processes, {} keys updated every {} ms, session timeout {} s: \
         a key's longest gap in s, median (range) of {} runs",
        args.keys,
        TICK.as_millis(),
        SESSION_TIMEOUT.as_secs(),
        args.common.runs
    ));
    summary.push(format!(
        "{:<28}{:>22}{:>22}{:>22}{:>22}",
        "scenario", "p50", "p99", "max", "before the kill"
    ));
    for ((scenario, _, membership), runs) in cases.iter().zip(&runs) {
        let stalls = Gaps::of(runs.iter().map(|r| r.stalls.clone()));
        let steady = Spread::of(runs.iter().map(|r| r.steady));
        let membership = membership.name();
        println!(
            "{{\"bench\":\"cluster_failover\",\"pipeline\":\"failover\",\"scenario\":\"{scenario}\",\
             \"membership\":\"{membership}\",\"keys\":{},\"runs\":{},\"session_timeout_s\":{},{},{}}}",
            args.keys,
            args.common.runs,
            SESSION_TIMEOUT.as_secs(),
            stalls.json("stall"),
            steady.json("steady_max_gap_s", 2),
        );
        summary.push(format!(
            "{:<28}{}{:>22}",
            format!("SIGKILL, {scenario}, {membership}"),
            stalls.columns(),
            steady.text(2)
        ));
    }
    Ok(summary)
}
