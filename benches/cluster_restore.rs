//! How long a process takes to restore keyed state from the changelog.
//!
//! One process counts an input of `--keys` (default 200,000) distinct
//! 100-byte keys, one record each, and stops; a process under a fresh
//! instance name then starts the same query (`source -> map ->
//! with_watermark -> repartition_by(key) -> count -> KafkaSink`), restores
//! the whole keyed state from the changelog, and reports what
//! `ClusteredQuery::last_restore` says it read and how long it took, from
//! which seconds per GB of changelog follow. The processes have no checkpoint
//! location, hence no local copies of the changelog: the restore reads all
//! of it from Kafka (`local_bytes` is 0). Each of `--runs` (default 3)
//! restores prints one JSON line on stdout and a summary line on stderr.
//!
//! ```text
//! scripts/kafka.sh start
//! cargo bench --bench cluster_restore
//! cargo bench --bench cluster_restore -- --bootstrap 127.0.0.1:9092 --keys 1000000 --runs 1
//! ```

#[path = "common/cluster.rs"]
mod cluster;

use std::time::{Duration, Instant};

use clap::Parser;
use cluster::*;

#[derive(Parser)]
#[command(about = "Restore of a KafkaCluster query's keyed state from its changelog")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Distinct keys (one record each) of the restored state.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    keys: u64,
}

fn main() -> BenchResult<()> {
    main_of(|args: Args| {
        eprintln!(
            "command: cargo bench --bench cluster_restore -- --bootstrap {} --keys {} --runs {}",
            args.common.bootstrap, args.keys, args.common.runs,
        );
        (0..args.common.runs).map(|_| restored(&args)).collect()
    })
}

/// The size of a key of the restore measurement's input.
const RESTORE_KEY_BYTES: usize = 100;

/// The restore measurement.
struct Restore {
    /// The output of the first process, which counted the input.
    counted: Output,
    /// The second process: spawn -> its run restored the whole state.
    restored_after: Duration,
    status: Status,
}

fn restore(args: &Args) -> BenchResult<Restore> {
    let topics = Topics::create(&args.common.bootstrap, "restore")?;
    produce(&args.common.bootstrap, &topics.input, args.keys, |i| {
        format!("k{i:0>width$}", width = RESTORE_KEY_BYTES - 1)
    })?;
    let mut processes = Processes::new(&args.common.bootstrap, &topics)?;
    let spawned = Instant::now();
    processes.spawn("counter")?;
    let counted = await_output(
        &args.common.bootstrap,
        &topics.output,
        args.keys,
        spawned,
        &mut processes,
    )?;
    processes.stop()?;

    let spawned = Instant::now();
    processes.spawn("restorer")?;
    // Alone in both groups, it owns every input and repartition partition.
    let status = loop {
        let status = processes.status("restorer");
        if status.restored_partitions == 2 * PARTITIONS as usize {
            break status;
        }
        processes.check()?;
        if spawned.elapsed() > RUN_TIMEOUT {
            return Err(format!(
                "the restorer did not restore in {RUN_TIMEOUT:?} ({status:?}):\n{}",
                logs(&processes.dir)
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let restored_after = spawned.elapsed();
    processes.stop()?;
    topics.delete(&args.common.bootstrap)?;
    Ok(Restore {
        counted,
        restored_after,
        status,
    })
}

/// One restore; its summary line.
fn restored(args: &Args) -> BenchResult<String> {
    let restore = restore(args)?;
    let status = &restore.status;
    let seconds = status.restore.as_secs_f64();
    let gb = status.changelog_bytes as f64 / 1e9;
    println!(
        "{{\"bench\":\"cluster_restore\",\"pipeline\":\"restore\",\"keys\":{},\
         \"key_bytes\":{RESTORE_KEY_BYTES},\"partitions\":{},\"changelog_bytes\":{},\
         \"local_bytes\":{},\"restore_s\":{seconds:.3},\"s_per_gb\":{:.2},\"restored_after_spawn_s\":{:.3},\
         \"count_records_per_s\":{:.0},\"duplicates\":{}}}",
        args.keys,
        status.restored_partitions,
        status.changelog_bytes,
        status.local_bytes,
        seconds / gb,
        restore.restored_after.as_secs_f64(),
        rate(args.keys, restore.counted.last),
        restore.counted.duplicates,
    );
    Ok(format!(
        "restore: {} keys of {RESTORE_KEY_BYTES} bytes, {:.1} MB of changelog over {} \
         partitions in {seconds:.3} s: {:.1} s/GB",
        args.keys,
        status.changelog_bytes as f64 / 1e6,
        status.restored_partitions,
        seconds / gb
    ))
}
