//! Tests of a dataflow that sums what each user spent, with rtflow::testing.

use proptest::prelude::*;
use rtflow::prelude::*;
use rtflow::testing::{check, pin_keys, reference, schedule, DataflowHarness};

/// The dataflow under test: what each user spent so far, updated per purchase.
fn spend_per_user(purchases: Stream<(String, i64)>) -> Stream<(String, i64)> {
    purchases
        .filter(|(_, cents)| *cents > 0)
        .key_by(|(user, _): &(String, i64)| user.clone())
        .sum(|(_, cents)| *cents)
}

/// Random purchases: a user and an amount, refunds (negative) included.
fn purchases() -> impl Strategy<Value = (String, i64)> {
    (
        prop::sample::select(vec!["ann", "bob", "cy"]),
        -100i64..1000,
    )
        .prop_map(|(user, cents)| (user.to_string(), cents))
}

fn user(purchase: &(String, i64)) -> String {
    purchase.0.clone()
}

fn cents(purchase: &(String, i64)) -> i64 {
    purchase.1
}

#[test]
fn spend_is_exactly_once_across_crashes() {
    // Up to 30 steps: purchases pushed to 2 partitions (each user's to one of
    // them, as a topic keyed by user), with settle points, checkpoints and
    // crashes in between.
    let schedules = pin_keys(schedule(purchases(), 2, 0..30), 2, user);
    check("spend per user", 32, schedules, |steps| {
        let mut harness =
            DataflowHarness::new("spend", 2, |_, purchases| spend_per_user(purchases));
        // Runs every step, then ends the input and waits for the final checkpoint.
        harness.run(&steps)?;

        // The batch reference: the same purchases, filtered, summed in order.
        let paid: Vec<_> = harness
            .input_values()
            .into_iter()
            .filter(|purchase| cents(purchase) > 0)
            .collect();
        // Every update committed exactly once, each user's in order.
        reference::assert_same_per_key(
            harness.committed(),
            reference::running_sums(paid.clone(), user, cents),
        )?;
        // The checkpointed state holds the totals.
        reference::assert_same_map(
            &harness.state("sum-0", "accumulators")?,
            &reference::sums(paid, user, cents),
        )?;
        Ok(())
    });
}

#[test]
fn a_crash_replays_only_what_came_after_the_last_checkpoint() -> rtflow::Result<()> {
    let mut harness =
        DataflowHarness::new("spend-crash", 1, |_, purchases| spend_per_user(purchases));
    harness.start()?;
    harness.push(0, ("ann".into(), 5))?;
    harness.settle()?; // the source has read it
    harness.checkpoint()?; // and a checkpoint holds it
    harness.push(0, ("ann".into(), 7))?;
    harness.settle()?;
    harness.crash()?; // 7 was summed, but no checkpoint holds it
    let state = harness.state::<String, i64>("sum-0", "accumulators")?;
    assert_eq!(state, [("ann".to_string(), 5)].into());

    harness.finish()?; // restarts from the checkpoint: 7 is summed again
    let updates = harness.committed();
    assert_eq!(updates, [("ann".to_string(), 5), ("ann".to_string(), 12)]);
    Ok(())
}
