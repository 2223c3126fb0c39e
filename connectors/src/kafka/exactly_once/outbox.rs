//! The protocol of the transactional writer, without I/O: which transaction each
//! message goes in, when each transaction commits, and what a restart re-sends.
//!
//! A producer has one transaction open at a time, but the next epoch's records
//! arrive before the previous epoch's checkpoint is durable. So an ended epoch
//! waits in the open transaction until its checkpoint commits; the epochs that
//! end behind it wait unsent, in order; the outbox keeps only messages not
//! sent yet. Until an epoch's transaction commits, every checkpoint holds its
//! messages (in the writer's files, [`super::spill`]): a restart from any of
//! them can write them again if, and only if, the commit record for them is
//! missing. That is
//! also why a barrier does not wait for the broker to acknowledge the epoch's
//! messages (a pre-commit): what the commit cannot deliver, a restart sends
//! again from the checkpoint, and the commit itself waits for them.

use std::collections::{HashMap, VecDeque};

use rtflow_runtime::{Epoch, Result};
use serde::{Deserialize, Serialize};

use crate::kafka::KafkaMessage;

/// The transactions of one producer: Kafka's, or an in-memory log in the tests.
pub(crate) trait Transactions {
    /// Sends `message` in the open transaction, beginning one if none is open.
    fn send(&mut self, message: &KafkaMessage) -> Result<()>;

    /// Commits the open transaction together with a commit record saying that
    /// writer `id` committed `epoch`, whose checkpoints run `run` wrote.
    fn commit(&mut self, id: &str, epoch: Epoch, run: &str) -> Result<()>;
}

/// Where an epoch's output ends, which decides the checkpoint it commits with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum End {
    /// The barrier of this epoch: it commits with the epoch's checkpoint.
    Barrier(Epoch),
    /// The end of the input, after this epoch's barrier (or the restored epoch):
    /// it commits with the first checkpoint after that epoch, the query's final one.
    Input { after: Epoch },
}

impl End {
    /// Whether the output is published once the checkpoint of `epoch` committed.
    pub(crate) fn covered_by(self, epoch: Epoch) -> bool {
        match self {
            End::Barrier(end) => end <= epoch,
            End::Input { after } => epoch > after,
        }
    }

    /// The epoch the commit record names when the checkpoint of `committed`
    /// publishes this output: a later restart compares it with `covered_by`.
    fn record(self, committed: Epoch) -> Epoch {
        match self {
            End::Barrier(end) => end,
            End::Input { .. } => committed,
        }
    }
}

/// One ended epoch's output, not yet committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Ended {
    pub(crate) end: End,
    pub(crate) messages: Vec<KafkaMessage>,
}

/// Every ended epoch whose transaction had not committed at a barrier, oldest
/// first: what a restart writes again unless its commit record says it
/// committed. Checkpoints hold it in files ([`super::spill`]); those of
/// earlier versions held it whole, and a restart still reads them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Pending {
    pub(crate) ended: Vec<Ended>,
}

/// The messages of one writer between their arrival and their commit. Only
/// messages not sent yet are kept: every message is in the writer's files
/// ([`super::spill`]) until its epoch commits, and a restart sends them
/// from there.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    /// Ended epochs waiting for their checkpoint, oldest first. The first is in
    /// the producer's transaction; the others are not sent yet.
    ended: VecDeque<Waiting>,
    /// The running epoch's messages held back while an ended epoch waits.
    held: Vec<KafkaMessage>,
    /// Whether the running epoch has output, sent or held.
    running: bool,
    /// The last epoch whose barrier passed, or the restored epoch.
    last_barrier: Epoch,
}

/// An ended epoch waiting for its checkpoint, and its messages if they are not
/// sent yet (none once it is the producer's open transaction).
#[derive(Debug)]
struct Waiting {
    end: End,
    unsent: Vec<KafkaMessage>,
}

impl Outbox {
    /// An outbox continuing after the checkpoint of `restored`.
    pub(crate) fn after(restored: Option<Epoch>) -> Self {
        Self {
            last_barrier: restored.unwrap_or(0),
            ..Self::default()
        }
    }

    /// A record's message: sent at once unless an ended epoch waits before it.
    pub(crate) fn write(
        &mut self,
        message: KafkaMessage,
        tx: &mut impl Transactions,
    ) -> Result<()> {
        if self.ended.is_empty() {
            tx.send(&message)?;
        } else {
            self.held.push(message);
        }
        self.running = true;
        Ok(())
    }

    /// Ends the running epoch at its barrier (`Some`) or at the end of the input
    /// (`None`); returns where it ended if it had output, which waits for its
    /// checkpoint from now on.
    pub(crate) fn end_epoch(&mut self, barrier: Option<Epoch>) -> Option<End> {
        let end = match barrier {
            Some(epoch) => End::Barrier(epoch),
            None => End::Input {
                after: self.last_barrier,
            },
        };
        if let Some(epoch) = barrier {
            self.last_barrier = epoch;
        }
        if !std::mem::take(&mut self.running) {
            return None;
        }
        self.ended.push_back(Waiting {
            end,
            unsent: std::mem::take(&mut self.held),
        });
        Some(end)
    }

    /// The checkpoint of `epoch`, written by run `run`, is durable: commits every
    /// ended epoch it covers, each in its own transaction, then starts sending
    /// what waited behind them.
    pub(crate) fn committed(
        &mut self,
        epoch: Epoch,
        id: &str,
        run: &str,
        tx: &mut impl Transactions,
    ) -> Result<()> {
        let mut committed_any = false;
        while self.ended.front().is_some_and(|e| e.end.covered_by(epoch)) {
            let waiting = self.ended.pop_front().expect("front exists");
            for message in &waiting.unsent {
                tx.send(message)?;
            }
            tx.commit(id, waiting.end.record(epoch), run)?;
            committed_any = true;
        }
        if !committed_any {
            return Ok(());
        }
        let next = match self.ended.front_mut() {
            Some(next) => &mut next.unsent,
            None => &mut self.held,
        };
        for message in std::mem::take(next) {
            tx.send(&message)?;
        }
        Ok(())
    }
}

/// Writes again, once, what a crash kept from committing: the ended epochs in
/// the checkpoint restored from `epoch` whose commit record is missing from
/// `committed` (the last epoch committed under each writer id). `restored` is
/// by the writer id that checkpointed it.
pub(crate) fn resolve(
    restored: &[(String, Pending)],
    epoch: Epoch,
    run: &str,
    committed: &HashMap<String, Epoch>,
    tx: &mut impl Transactions,
) -> Result<Vec<(String, Ended)>> {
    let mut rewritten = Vec::new();
    for (id, pending) in restored {
        let last = committed.get(id).copied();
        for ended in &pending.ended {
            if last.is_some_and(|last| ended.end.covered_by(last)) {
                continue;
            }
            for message in &ended.messages {
                tx.send(message)?;
            }
            tx.commit(id, ended.end.record(epoch), run)?;
            rewritten.push((id.clone(), ended.clone()));
        }
    }
    Ok(rewritten)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A broker's view of one writer id's transactions: what committed, and what
    /// a crash aborts.
    #[derive(Default)]
    struct Log {
        open: Vec<KafkaMessage>,
        visible: Vec<KafkaMessage>,
        records: HashMap<String, Epoch>,
    }

    impl Transactions for Log {
        fn send(&mut self, message: &KafkaMessage) -> Result<()> {
            self.open.push(message.clone());
            Ok(())
        }

        fn commit(&mut self, id: &str, epoch: Epoch, _run: &str) -> Result<()> {
            assert!(!self.open.is_empty(), "an empty transaction committed");
            self.visible.append(&mut self.open);
            let previous = self.records.insert(id.to_string(), epoch);
            assert!(previous.is_none_or(|p| p < epoch), "commit records regress");
            Ok(())
        }
    }

    impl Log {
        /// The fencing of a restarted producer aborts the open transaction.
        fn crash(&mut self) {
            self.open.clear();
        }
    }

    fn message(n: u64) -> KafkaMessage {
        KafkaMessage::new(n.to_string())
    }

    #[derive(Debug, Clone, Copy)]
    enum Step {
        Write,
        Barrier,
        /// The oldest acknowledged epoch's manifest becomes durable.
        Durable,
        /// The writer learns of the oldest durable epoch it was not told of.
        Notify,
        Crash,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => Just(Step::Write),
            2 => Just(Step::Barrier),
            2 => Just(Step::Durable),
            2 => Just(Step::Notify),
            1 => Just(Step::Crash),
        ]
    }

    /// The writer's files as [`super::super::spill`] keeps them: every message,
    /// by ended epoch, until the epoch commits.
    #[derive(Default)]
    struct Files {
        running: Vec<KafkaMessage>,
        ended: Vec<Ended>,
    }

    impl Files {
        fn end_epoch(&mut self, end: Option<End>) -> Pending {
            if let Some(end) = end {
                let messages = std::mem::take(&mut self.running);
                self.ended.push(Ended { end, messages });
            }
            Pending {
                ended: self.ended.clone(),
            }
        }

        fn committed(&mut self, epoch: Epoch) {
            self.ended.retain(|ended| !ended.end.covered_by(epoch));
        }
    }

    /// One writer, its files, its checkpoints and its replaying source, driven
    /// through any interleaving of records, barriers, durable manifests,
    /// commit notifications and crashes.
    struct Run {
        log: Log,
        outbox: Outbox,
        files: Files,
        /// The next record the source emits.
        position: u64,
        epoch: Epoch,
        /// Acknowledged epochs: the writer's state and the source position.
        acked: VecDeque<(Epoch, Pending, u64)>,
        durable: Option<(Epoch, Pending, u64)>,
        unnotified: VecDeque<Epoch>,
    }

    const ID: &str = "writer-0";
    const RUN: &str = "run-0";

    impl Run {
        fn new() -> Self {
            Self {
                log: Log::default(),
                outbox: Outbox::after(None),
                files: Files::default(),
                position: 0,
                epoch: 0,
                acked: VecDeque::new(),
                durable: None,
                unnotified: VecDeque::new(),
            }
        }

        fn apply(&mut self, step: Step) {
            match step {
                Step::Write => {
                    self.files.running.push(message(self.position));
                    self.outbox
                        .write(message(self.position), &mut self.log)
                        .unwrap();
                    self.position += 1;
                }
                Step::Barrier => {
                    self.epoch += 1;
                    let end = self.outbox.end_epoch(Some(self.epoch));
                    let pending = self.files.end_epoch(end);
                    self.acked.push_back((self.epoch, pending, self.position));
                }
                Step::Durable => {
                    if let Some(checkpoint) = self.acked.pop_front() {
                        self.unnotified.push_back(checkpoint.0);
                        self.durable = Some(checkpoint);
                    }
                }
                Step::Notify => {
                    if let Some(epoch) = self.unnotified.pop_front() {
                        self.outbox
                            .committed(epoch, ID, RUN, &mut self.log)
                            .unwrap();
                        self.files.committed(epoch);
                    }
                }
                Step::Crash => self.restart(),
            }
        }

        fn restart(&mut self) {
            self.log.crash();
            let (epoch, pending, position) =
                self.durable.clone().unwrap_or((0, Pending::default(), 0));
            let committed = self.log.records.clone();
            resolve(
                &[(ID.to_string(), pending)],
                epoch,
                RUN,
                &committed,
                &mut self.log,
            )
            .unwrap();
            self.outbox = Outbox::after(self.durable.as_ref().map(|d| d.0));
            self.files = Files::default();
            self.position = position;
            self.epoch = epoch;
            self.acked.clear();
            self.unnotified.clear();
        }

        /// The input ends; `crash` strikes after the final manifest is durable
        /// and before the writer hears of it, and the restart ends at once.
        fn finish(&mut self, crash: bool) {
            let end = self.outbox.end_epoch(None);
            let pending = self.files.end_epoch(end);
            while !self.acked.is_empty() {
                self.apply(Step::Durable);
            }
            self.epoch += 1;
            self.durable = Some((self.epoch, pending, self.position));
            self.unnotified.push_back(self.epoch);
            if crash {
                self.restart();
                assert_eq!(
                    self.outbox.end_epoch(None),
                    None,
                    "nothing replays after the end"
                );
                return;
            }
            while !self.unnotified.is_empty() {
                self.apply(Step::Notify);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Whatever the interleaving and wherever the crashes, the committed
        /// output is every record exactly once, in order.
        #[test]
        fn every_record_commits_exactly_once(
            steps in prop::collection::vec(step(), 0..80),
            crash_at_end in any::<bool>(),
        ) {
            let mut run = Run::new();
            for step in steps {
                run.apply(step);
            }
            run.finish(crash_at_end);
            let expected: Vec<_> = (0..run.position).map(message).collect();
            prop_assert_eq!(&run.log.visible, &expected);
            prop_assert!(run.log.open.is_empty());
        }
    }

    #[test]
    fn an_epoch_ending_before_the_previous_commits_waits_unsent() {
        let mut log = Log::default();
        let mut outbox = Outbox::after(None);
        outbox.write(message(0), &mut log).unwrap();
        outbox.end_epoch(Some(1));
        outbox.write(message(1), &mut log).unwrap();
        outbox.end_epoch(Some(2));
        assert_eq!(log.open, vec![message(0)]);
        assert_eq!(
            outbox.ended.iter().map(|w| w.end).collect::<Vec<_>>(),
            vec![End::Barrier(1), End::Barrier(2)],
            "epoch 1 still waits for its checkpoint when epoch 2 ends"
        );
        assert!(
            outbox.ended[0].unsent.is_empty(),
            "epoch 1 is sent: only the files keep it"
        );
        assert_eq!(outbox.ended[1].unsent, vec![message(1)]);
        outbox.committed(1, ID, RUN, &mut log).unwrap();
        assert_eq!(log.visible, vec![message(0)]);
        assert_eq!(log.open, vec![message(1)]);
        outbox.committed(2, ID, RUN, &mut log).unwrap();
        assert_eq!(log.visible, vec![message(0), message(1)]);
        assert_eq!(log.records[ID], 2);
    }

    #[test]
    fn a_restart_rewrites_only_the_epochs_without_a_commit_record() {
        let pending = Pending {
            ended: vec![
                Ended {
                    end: End::Barrier(4),
                    messages: vec![message(4)],
                },
                Ended {
                    end: End::Barrier(5),
                    messages: vec![message(5)],
                },
            ],
        };
        let mut log = Log::default();
        let committed = HashMap::from([(ID.to_string(), 4)]);
        let rewritten =
            resolve(&[(ID.to_string(), pending)], 5, RUN, &committed, &mut log).unwrap();
        assert_eq!(rewritten.len(), 1);
        assert_eq!(log.visible, vec![message(5)]);
        assert_eq!(log.records[ID], 5);
    }
}
