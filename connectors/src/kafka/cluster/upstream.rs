//! Reading a repartition before its writers commit, and committing only what
//! they committed.
//!
//! The writers of a repartition whose records come from the source topics
//! produce each frame at once into their process's [`Tier::Sourced`]
//! transaction, and its readers read it `read_uncommitted`: a record reaches
//! the next stage, in whatever process, within milliseconds. What the readers
//! pass on may then belong to a transaction that aborts (its process died and
//! was fenced, or the brokers refused its commit). So the process's
//! [`Tier::Repartitioned`] transaction, which commits the readers' offsets and
//! the keyed state they fed, commits only once every message they read has
//! ended committed ([`Upstream::verify`]): it waits until each partition's last
//! stable offset passes what was read, reads the same range `read_committed`,
//! and compares counts of the messages that count ([`counted`]: all but the
//! marks of batch ticks). A shortfall fails the commit: the run rolls back to
//! its last commit, as a restart does, and its readers skip the aborted messages
//! the check found ([`Skip`]), as a `read_committed` reader would; below the
//! last stable offset when they start ([`Upstream::stable_offsets`]) they
//! read `read_committed` (`exchange`).
//!
//! [`Verified`] and [`Skip`] decide what to check and skip and do no I/O;
//! [`Upstream`] does the reading.
//!
//! [`Tier::Sourced`]: super::Tier::Sourced
//! [`Tier::Repartitioned`]: super::Tier::Repartitioned

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Headers;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use rtflow_runtime::{Result, RtflowError};

use super::link::{EndsExpected, TopicPartition};
use super::{lock, ClusterSettings};
use crate::kafka::closing::ClosingConsumer;

/// Separates a partition's offset label from what its reader tells of its
/// reads (`<label>#lineage`, `#from`, `#read`).
pub(crate) const READ_MARK: char = '#';

/// The header of a message that the check of a commit does not count: a
/// writer's mark of a batch tick, which decides how long a reader holds a
/// partition back and nothing else. Each barrier writes one to every
/// partition, so an idle process's transaction holds messages too; a reader
/// that read only such marks of one that aborted needs no rollback.
pub(crate) const UNCOUNTED: &str = "rtflow-uncounted";

/// Whether `message` counts toward what a reader read and what committed.
pub(crate) fn counted(message: &impl Message) -> bool {
    (message.headers())
        .is_none_or(|headers| !(0..headers.count()).any(|i| headers.get(i).key == UNCOUNTED))
}

/// The longest pause between two looks at a partition's last stable offset.
const STABLE_ASK_EVERY: Duration = Duration::from_millis(5);

/// Numbers every lineage of reads in the process.
static LINEAGES: AtomicI64 = AtomicI64::new(1);

/// A number no reader of the process used before.
pub(crate) fn new_lineage() -> i64 {
    LINEAGES.fetch_add(1, Ordering::Relaxed)
}

/// What a reader read of one partition since it took it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reads {
    /// New for every time a reader takes the partition on.
    pub(crate) lineage: i64,
    /// The offset it began at.
    pub(crate) from: i64,
    /// The messages it passed on since...
    pub(crate) read: i64,
    /// ...up to here: its next offset.
    pub(crate) position: i64,
}

/// What a commit checks of one partition: that `expected` messages of
/// `[start, end)` committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Check {
    pub(crate) start: i64,
    pub(crate) end: i64,
    pub(crate) expected: i64,
}

/// The reads of a run that its commits verified, by partition.
#[derive(Default)]
pub(crate) struct Verified(BTreeMap<TopicPartition, Reads>);

impl Verified {
    /// What to check of `reads`: the messages read since the last verified
    /// commit of the same lineage, or since the lineage began. None when
    /// nothing was read since.
    pub(crate) fn check(&self, partition: &TopicPartition, reads: &Reads) -> Option<Check> {
        let (start, before) = match self.0.get(partition) {
            Some(last) if last.lineage == reads.lineage => (last.position, last.read),
            _ => (reads.from, 0),
        };
        (reads.position > start).then_some(Check {
            start,
            end: reads.position,
            expected: reads.read - before,
        })
    }

    /// `reads` committed.
    pub(crate) fn passed(&mut self, partition: TopicPartition, reads: Reads) {
        self.0.insert(partition, reads);
    }
}

/// The messages of a partition that ended aborted, below the offset up to
/// which that is known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Skip {
    /// Every transaction below it had ended when it was read.
    until: i64,
    /// The messages below `until` that committed, from the first checked.
    committed: BTreeSet<i64>,
    /// The first offset checked: below it nothing is known.
    from: i64,
}

impl Skip {
    /// Whether a reader passes over the message at `offset`.
    pub(crate) fn skips(&self, offset: i64) -> bool {
        (self.from..self.until).contains(&offset) && !self.committed.contains(&offset)
    }

    /// Whether a reader at `position` is past every message skipped.
    pub(crate) fn is_behind(&self, position: i64) -> bool {
        position >= self.until
    }
}

/// What the process knows of the transactions its readers read from: the
/// aborted messages to skip, kept from run to run.
pub(crate) struct Upstream {
    settings: Arc<ClusterSettings>,
    skips: Mutex<BTreeMap<TopicPartition, Skip>>,
    /// Asks the partitions' last stable offsets, kept from commit to commit:
    /// a new client's first answer waits for its connections (6-60 ms at
    /// 10,000 records/s, each commit's longest wait).
    stable: Mutex<Option<ClosingConsumer<EndsExpected>>>,
    /// The next count's consumer, made and connected after the last count,
    /// off the commit's way, for the same reason.
    next_counter: Arc<Mutex<Option<ClosingConsumer<EndsExpected>>>>,
}

/// How one partition's check went.
#[derive(Default)]
struct Count {
    committed: BTreeSet<i64>,
    ended: bool,
}

impl Upstream {
    pub(crate) fn new(settings: Arc<ClusterSettings>) -> Self {
        Self {
            settings,
            skips: Mutex::default(),
            stable: Mutex::default(),
            next_counter: Arc::default(),
        }
    }

    /// The aborted messages the readers of `partition` pass over.
    pub(crate) fn skip_of(&self, partition: &TopicPartition) -> Option<Skip> {
        lock(&self.skips).get(partition).cloned()
    }

    fn error(&self, message: impl std::fmt::Display) -> RtflowError {
        RtflowError::Checkpoint(format!(
            "cluster {} of query '{}': {message}",
            self.settings.bootstrap_servers, self.settings.query
        ))
    }

    /// Waits until every message of `checks` has ended committed or
    /// aborted, and fails if one the readers passed on aborted: the skips
    /// then name every aborted message up to where the check read.
    pub(crate) fn verify(&self, checks: &[(TopicPartition, Check)]) -> Result<()> {
        tracing::debug!(?checks, "checking what was read before it committed");
        if checks.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let stable = self.with_stable_asker(|asker| {
            self.await_stable(asker, checks, started + self.settings.upstream_timeout())
        })?;
        let stable_after = started.elapsed();
        // A consumer of its own for each count: a partition's end of file
        // then comes after every committed message below the stable offsets
        // awaited, never from an earlier read (one consumer sought back
        // from check to check counted ends of files left from the last).
        let consumer = match lock(&self.next_counter).take() {
            Some(consumer) => consumer,
            None => checker(&self.settings).map_err(|e| self.error(e))?,
        };
        let counts = self.count(
            &consumer,
            checks,
            &stable,
            Instant::now() + self.settings.operation_timeout,
        )?;
        self.prepare_next_counter(checks);
        tracing::debug!(?stable_after, counted_after = ?started.elapsed(), "checked");
        let mut skips = lock(&self.skips);
        let mut short = Vec::new();
        for ((partition, check), until) in checks.iter().zip(&stable) {
            let count = &counts[partition];
            let committed = count.committed.range(..check.end).count() as i64;
            if committed == check.expected {
                if skips.get(partition).is_some_and(|s| s.is_behind(check.end)) {
                    skips.remove(partition);
                }
                continue;
            }
            short.push(format!(
                "{}-{}: {committed} of the {} messages read in [{}, {}) committed",
                partition.0, partition.1, check.expected, check.start, check.end
            ));
            skips.insert(
                partition.clone(),
                Skip {
                    until: *until,
                    committed: count.committed.clone(),
                    from: check.start,
                },
            );
        }
        if short.is_empty() {
            return Ok(());
        }
        Err(self.error(format!(
            "records read before their transaction ended belong to one that aborted ({}); \
             the run starts over from its last commit without them",
            short.join("; ")
        )))
    }

    /// The last stable offset of each of `partitions`, as of now: a reader
    /// that takes one on below it reads up to it `read_committed`, past any
    /// transaction that aborted there (a rolled-back run's own, or one no
    /// check of the process found), instead of rolling back on it again.
    pub(crate) fn stable_offsets(&self, partitions: &[TopicPartition]) -> Result<Vec<i64>> {
        let told = self.with_stable_asker(|asker| self.ask_stable(asker, partitions.iter()))?;
        (partitions.iter().zip(told))
            .map(|((topic, partition), told)| {
                told.ok_or_else(|| {
                    self.stable_failed(&format!("none told for {topic}-{partition}"))
                })
            })
            .collect()
    }

    /// Runs `ask` with the client kept to ask last stable offsets, made if
    /// there is none. One whose asking failed is not kept: the next asks a
    /// new one.
    fn with_stable_asker<T>(
        &self,
        ask: impl FnOnce(&BaseConsumer<EndsExpected>) -> Result<T>,
    ) -> Result<T> {
        let mut asking = lock(&self.stable);
        let asker = match asking.take() {
            Some(asker) => asker,
            None => checker(&self.settings).map_err(|e| self.error(e))?,
        };
        let answer = ask(&asker)?;
        *asking = Some(asker);
        Ok(answer)
    }

    /// The last stable offset of each of `partitions`, if told. The latest
    /// offset a `read_committed` client is told is the last stable one;
    /// asked as a time (the latest), every partition of a broker is asked
    /// in one request.
    fn ask_stable<'a>(
        &self,
        asker: &BaseConsumer<EndsExpected>,
        partitions: impl Iterator<Item = &'a TopicPartition> + Clone,
    ) -> Result<Vec<Option<i64>>> {
        let mut asked = TopicPartitionList::new();
        for (topic, partition) in partitions.clone() {
            asked
                .add_partition_offset(topic, *partition, Offset::End)
                .map_err(|e| self.error(e))?;
        }
        let told = asker
            .offsets_for_times(asked, self.settings.operation_timeout)
            .map_err(|e| self.stable_failed(&e))?;
        partitions
            .map(|(topic, partition)| {
                let Some(told) = told.find_partition(topic, *partition) else {
                    return Ok(None);
                };
                told.error().map_err(|e| self.stable_failed(&e))?;
                Ok(match told.offset() {
                    Offset::Offset(offset) => Some(offset),
                    _ => None,
                })
            })
            .collect()
    }

    fn stable_failed(&self, error: &dyn std::fmt::Display) -> RtflowError {
        self.error(format!(
            "could not read a partition's last stable offset: {error}"
        ))
    }

    /// Makes the next count's consumer on a thread of its own, connected to
    /// the leaders of the partitions of `checks` (which the next check most
    /// likely reads again). A commit that comes before it is ready makes
    /// its own.
    fn prepare_next_counter(&self, checks: &[(TopicPartition, Check)]) {
        // The thread keeps only what it needs: the settings would keep the
        // process's changelog copies open past the query's end, and a query
        // started again in the process could not open them.
        let (config, timeout) = (
            checker_config(&self.settings),
            self.settings.operation_timeout,
        );
        let slot = self.next_counter.clone();
        let mut partitions = TopicPartitionList::new();
        for (partition, _) in checks {
            let _ = partitions.add_partition_offset(&partition.0, partition.1, Offset::End);
        }
        let prepare = move || {
            let Ok(consumer) = checker_of(&config) else {
                return;
            };
            // Any answer will do: asking connects.
            let _ = consumer.offsets_for_times(partitions, timeout);
            *lock(&slot) = Some(consumer);
        };
        let _ = std::thread::Builder::new()
            .name("rtflow-check-prepare".into())
            .spawn(prepare);
    }

    /// Waits until each partition's last stable offset reaches its check's
    /// end: every transaction that wrote what was read has ended. Returns
    /// those offsets.
    fn await_stable(
        &self,
        consumer: &BaseConsumer<EndsExpected>,
        checks: &[(TopicPartition, Check)],
        deadline: Instant,
    ) -> Result<Vec<i64>> {
        let mut stable = vec![i64::MIN; checks.len()];
        let mut pause = Duration::from_millis(1);
        loop {
            let asked: Vec<usize> = (0..checks.len())
                .filter(|i| stable[*i] < checks[*i].1.end)
                .collect();
            let told = self.ask_stable(consumer, asked.iter().map(|i| &checks[*i].0))?;
            for (i, told) in asked.into_iter().zip(told) {
                if let Some(offset) = told {
                    stable[i] = offset;
                }
            }
            let open: Vec<String> = (checks.iter().zip(&stable))
                .filter(|((_, check), stable)| **stable < check.end)
                .map(|((p, _), _)| format!("{}-{}", p.0, p.1))
                .collect();
            if open.is_empty() {
                return Ok(stable);
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!(
                    "transactions of the processes that wrote {} stayed open for {:?} \
                     (a batch duration and the operation timeout)",
                    open.join(", "),
                    self.settings.upstream_timeout()
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(STABLE_ASK_EVERY);
        }
    }

    /// Reads each partition `read_committed` from its check's start to its
    /// end: the offsets below its `stable` offset that committed.
    fn count(
        &self,
        consumer: &BaseConsumer<EndsExpected>,
        checks: &[(TopicPartition, Check)],
        stable: &[i64],
        deadline: Instant,
    ) -> Result<BTreeMap<TopicPartition, Count>> {
        let mut list = TopicPartitionList::new();
        let mut counts: BTreeMap<TopicPartition, Count> = BTreeMap::new();
        for (partition, check) in checks {
            list.add_partition_offset(&partition.0, partition.1, Offset::Offset(check.start))
                .map_err(|e| self.error(e))?;
            counts.insert(partition.clone(), Count::default());
        }
        let until: BTreeMap<&TopicPartition, i64> = (checks.iter().map(|(p, _)| p))
            .zip(stable.iter().copied())
            .collect();
        // Assigned after the stable offsets passed the ends: a partition's
        // end of file comes after every committed message below them.
        let failed = |e: KafkaError| self.error(format!("could not read what was read: {e}"));
        consumer.assign(&list).map_err(failed)?;
        while counts.values().any(|count| !count.ended) {
            if Instant::now() >= deadline {
                return Err(self.error(format!(
                    "could not read back what the readers read within {:?}",
                    self.settings.operation_timeout
                )));
            }
            match consumer.poll(Duration::from_millis(100)) {
                None => {}
                Some(Ok(message)) => {
                    let partition = (message.topic().to_owned(), message.partition());
                    if let (Some(count), Some(until)) =
                        (counts.get_mut(&partition), until.get(&partition))
                    {
                        if message.offset() >= *until {
                            count.ended = true;
                        } else if counted(&message) {
                            count.committed.insert(message.offset());
                        }
                    }
                }
                Some(Err(KafkaError::PartitionEOF(number))) => {
                    for (partition, count) in &mut counts {
                        if partition.1 == number {
                            count.ended = true;
                        }
                    }
                }
                Some(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) => {}
                Some(Err(e)) => return Err(failed(e)),
            }
        }
        Ok(counts)
    }
}

/// A `read_committed` consumer that reads partitions to their ends.
fn checker(
    settings: &ClusterSettings,
) -> std::result::Result<ClosingConsumer<EndsExpected>, String> {
    checker_of(&checker_config(settings))
}

fn checker_config(settings: &ClusterSettings) -> ClientConfig {
    let mut config = settings.committed_reader(&settings.group());
    config
        .set("enable.partition.eof", "true")
        // A partition's end of file comes with a fetch that found nothing,
        // which the broker holds this long: the check, and so exactly-once
        // output, waits for it at every commit.
        .set("fetch.wait.max.ms", "1");
    config
}

fn checker_of(config: &ClientConfig) -> std::result::Result<ClosingConsumer<EndsExpected>, String> {
    let consumer: BaseConsumer<EndsExpected> = config
        .create_with_context(EndsExpected)
        .map_err(|e| format!("could not create a consumer: {e}"))?;
    Ok(ClosingConsumer::new(consumer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition() -> TopicPartition {
        ("rtflow-q-0-repartition".to_owned(), 2)
    }

    fn reads(lineage: i64, from: i64, read: i64, position: i64) -> Reads {
        Reads {
            lineage,
            from,
            read,
            position,
        }
    }

    #[test]
    fn a_check_covers_what_was_read_since_the_last_verified_commit() {
        let mut verified = Verified::default();
        let first = reads(1, 100, 7, 110);
        let check = verified.check(&partition(), &first).unwrap();
        assert_eq!(
            check,
            Check {
                start: 100,
                end: 110,
                expected: 7
            }
        );
        verified.passed(partition(), first);
        let second = reads(1, 100, 12, 118);
        let check = verified.check(&partition(), &second).unwrap();
        assert_eq!(
            check,
            Check {
                start: 110,
                end: 118,
                expected: 5
            }
        );
        assert_eq!(verified.check(&partition(), &first), None, "nothing new");
    }

    #[test]
    fn a_partition_taken_on_again_is_checked_from_where_its_new_reader_began() {
        let mut verified = Verified::default();
        verified.passed(partition(), reads(1, 100, 30, 150));
        let again = reads(2, 100, 4, 120);
        let check = verified.check(&partition(), &again).unwrap();
        assert_eq!(
            check,
            Check {
                start: 100,
                end: 120,
                expected: 4
            }
        );
    }

    #[test]
    fn a_reader_skips_what_aborted_below_where_the_check_read_and_nothing_else() {
        let skip = Skip {
            until: 20,
            committed: [10, 12, 19].into(),
            from: 10,
        };
        let skipped: Vec<i64> = (5..25).filter(|o| skip.skips(*o)).collect();
        assert_eq!(skipped, [11, 13, 14, 15, 16, 17, 18]);
        assert!(!skip.is_behind(19) && skip.is_behind(20));
    }
}
