//! The second transaction of each epoch, committed beside the next epoch.
//!
//! A process's [`Tier::Repartitioned`] transaction of epoch `x` waits for the
//! first transactions of every process it read from (`upstream`), then
//! commits: tens of milliseconds, more with three processes on two cores.
//! Committed inside the checkpoint, it held the next barrier back: the
//! processes' epochs no longer ended on the same tick, and each one's second
//! transaction waited for others still committing the epoch before. So the
//! checkpoint commits the first transaction and hands the second to a thread
//! of its own ([`SecondTier`]), which commits them in epoch order while the
//! next epoch runs and its first transaction commits.
//!
//! One waits at most: a checkpoint that finds the last one's second
//! transaction still waiting for the one before waits before it hands its
//! own over. A checkpoint that waited for the last one's would hold the next
//! barrier back whenever a second transaction outlasts a batch: the
//! process's readers would take their barriers late, after records of the
//! others' next epochs, and each late epoch's second transaction would wait
//! a batch for those.
//!
//! A second transaction that failed fails the run's next checkpoint (its
//! records are gone from the process's transaction: the run must start over
//! from its last commit), and those handed over after it are dropped. That
//! checkpoint still commits the first transaction
//! (`KafkaLink::commit_sourced`): what the run read of the source topics and
//! wrote from it stands on its own, and other processes may have read those
//! records before it committed. The run's end or handover waits for the
//! last one ([`SecondTier::settle`]).
//!
//! [`Pipeline`] decides what runs when and does no I/O; [`SecondTier`] runs
//! the commits.
//!
//! [`Tier::Repartitioned`]: super::transactions::Tier::Repartitioned

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use rtflow_runtime::{Epoch, Result, RtflowError};

use super::lock;

/// One epoch's second transaction: its check and its commit.
pub(crate) type Commit = Box<dyn FnOnce() -> Result<()> + Send>;

/// The commit handed over and not ended yet, and how the last one ended.
#[derive(Default)]
struct Pipeline {
    waiting: Option<(Epoch, Commit)>,
    /// The thread commits one, outside the lock.
    committing: bool,
    /// Why a commit failed: every later one fails with it.
    failed: Option<RtflowError>,
    closed: bool,
}

impl Pipeline {
    /// Whether a commit handed over has not ended.
    fn busy(&self) -> bool {
        self.waiting.is_some() || self.committing
    }

    /// Takes `commit` of `epoch`, once none waits; drops it after a failed
    /// one.
    fn hand_over(&mut self, epoch: Epoch, commit: Commit) {
        debug_assert!(self.waiting.is_none());
        if self.failed.is_none() {
            self.waiting = Some((epoch, commit));
        }
    }

    /// The next commit for the thread to run, if any.
    fn next(&mut self) -> Option<(Epoch, Commit)> {
        let next = self.waiting.take();
        self.committing = next.is_some();
        next
    }

    /// The commit running ended; one that failed drops the one waiting
    /// behind it, which must not commit.
    fn ended(&mut self, result: Result<()>) {
        self.committing = false;
        if let Err(error) = result {
            self.waiting = None;
            self.failed.get_or_insert(error);
        }
    }

    /// How the commits handed over ended, once none is left.
    fn outcome(&self) -> Result<()> {
        self.failed.clone().map_or(Ok(()), Err)
    }
}

/// Commits each epoch's second transaction on a thread of its own.
pub(crate) struct SecondTier {
    shared: Arc<(Mutex<Pipeline>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl SecondTier {
    pub(crate) fn start() -> Result<Self> {
        let shared: Arc<(Mutex<Pipeline>, Condvar)> = Arc::default();
        let running = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rtflow-second-tier".into())
            .spawn(move || run(&running))
            .map_err(|e| {
                RtflowError::Checkpoint(format!("could not start the second tier's thread: {e}"))
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Hands `commit`, epoch `epoch`'s second transaction, to the thread,
    /// once no other waits there. After a commit that failed it is dropped:
    /// the next [`check`](Self::check) fails.
    pub(crate) fn hand_over(&self, epoch: Epoch, commit: Commit) {
        let (pipeline, changed) = &*self.shared;
        changed
            .wait_while(lock(pipeline), |p| p.waiting.is_some())
            .unwrap_or_else(|p| p.into_inner())
            .hand_over(epoch, commit);
        changed.notify_all();
    }

    /// Fails if a commit handed over failed, without waiting.
    pub(crate) fn check(&self) -> Result<()> {
        lock(&self.shared.0).outcome()
    }

    /// Waits until every commit handed over ended; fails if one failed.
    pub(crate) fn settle(&self) -> Result<()> {
        let (pipeline, changed) = &*self.shared;
        changed
            .wait_while(lock(pipeline), |p| p.busy())
            .unwrap_or_else(|p| p.into_inner())
            .outcome()
    }
}

impl Drop for SecondTier {
    /// Ends the thread once it committed what it was handed.
    fn drop(&mut self) {
        let (pipeline, changed) = &*self.shared;
        lock(pipeline).closed = true;
        changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(shared: &(Mutex<Pipeline>, Condvar)) {
    let (pipeline, changed) = shared;
    let mut guard = lock(pipeline);
    loop {
        if let Some((epoch, commit)) = guard.next() {
            drop(guard);
            // A checkpoint may hand the next one over now.
            changed.notify_all();
            let result = commit();
            if let Err(error) = &result {
                tracing::debug!(epoch, %error, "the second transaction failed");
            }
            guard = lock(pipeline);
            guard.ended(result);
            changed.notify_all();
            continue;
        }
        if guard.closed {
            return;
        }
        guard = changed.wait(guard).unwrap_or_else(|p| p.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn noted(epoch: Epoch, log: &mpsc::Sender<Epoch>, result: Result<()>) -> Commit {
        let log = log.clone();
        Box::new(move || {
            log.send(epoch).unwrap();
            result
        })
    }

    #[test]
    fn commits_run_in_epoch_order_and_settle_waits_for_the_last() {
        let tier = SecondTier::start().unwrap();
        let (log, ran) = mpsc::channel();
        for epoch in 1..=5 {
            tier.hand_over(epoch, noted(epoch, &log, Ok(())));
        }
        tier.settle().unwrap();
        assert_eq!(ran.try_iter().collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    }

    #[test]
    fn one_commit_waits_behind_the_one_committing_and_the_next_waits_to_be_handed_over() {
        let tier = SecondTier::start().unwrap();
        let (release, released) = mpsc::channel::<()>();
        let (log, ran) = mpsc::channel();
        let held = log.clone();
        tier.hand_over(
            1,
            Box::new(move || {
                released.recv().unwrap();
                held.send(1).unwrap();
                Ok(())
            }),
        );
        // The thread takes epoch 1 before epoch 2 can wait behind it.
        std::thread::sleep(Duration::from_millis(50));
        tier.hand_over(2, noted(2, &log, Ok(())));
        std::thread::scope(|scope| {
            let third = scope.spawn(|| tier.hand_over(3, noted(3, &log, Ok(()))));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!third.is_finished(), "epoch 2 waits behind epoch 1");
            release.send(()).unwrap();
            third.join().unwrap();
        });
        tier.settle().unwrap();
        assert_eq!(ran.try_iter().collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn a_failed_commit_fails_every_later_check_and_settle_and_later_ones_are_dropped() {
        let tier = SecondTier::start().unwrap();
        let (log, ran) = mpsc::channel();
        let refused = RtflowError::Checkpoint("refused".into());
        tier.hand_over(1, noted(1, &log, Err(refused.clone())));
        assert_eq!(tier.settle(), Err(refused.clone()));
        assert_eq!(tier.check(), Err(refused.clone()));
        tier.hand_over(2, noted(2, &log, Ok(())));
        assert_eq!(tier.settle(), Err(refused.clone()));
        assert_eq!(tier.check(), Err(refused));
        assert_eq!(
            ran.try_iter().collect::<Vec<_>>(),
            [1],
            "epoch 2 is not committed after a failed epoch 1"
        );
    }

    #[test]
    fn a_commit_waiting_behind_one_that_fails_does_not_run() {
        let tier = SecondTier::start().unwrap();
        let (release, released) = mpsc::channel::<()>();
        tier.hand_over(
            1,
            Box::new(move || {
                released.recv().unwrap();
                Err(RtflowError::Checkpoint("refused".into()))
            }),
        );
        std::thread::sleep(Duration::from_millis(50));
        let (log, ran) = mpsc::channel();
        tier.hand_over(2, noted(2, &log, Ok(())));
        release.send(()).unwrap();
        assert!(tier.settle().is_err());
        assert_eq!(ran.try_iter().count(), 0, "epoch 2 did not commit");
    }

    #[test]
    fn dropping_it_ends_the_commit_handed_over_first() {
        let (log, ran) = mpsc::channel();
        let tier = SecondTier::start().unwrap();
        tier.hand_over(7, noted(7, &log, Ok(())));
        drop(tier);
        assert_eq!(ran.try_iter().collect::<Vec<_>>(), [7]);
    }
}
