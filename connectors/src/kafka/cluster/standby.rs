//! Standby replicas (Kafka Streams' `num.standby.replicas`): a process keeps
//! warm copies of changelog partitions that other processes own, so that
//! when one of those dies and the group hands its partitions over, the new
//! owner restores from its copy and reads only the changelog's tail.
//!
//! The copies are the local copies a restore keeps anyway (`local`): a
//! thread of the process tails the changelog partitions [`placement`] gives
//! it, read_committed, folds them into images, and saves each one at most
//! every [`SAVE_EVERY`]. A partition the process comes to own is saved and
//! let go before its run restores it, which then finds the copy at the
//! changelog's end, or close to it. An image is a committed prefix of its
//! partition, whenever it was saved, so a restore that finds an older one
//! only reads a longer tail.
//!
//! Which processes keep which partition needs no word between them: the live
//! instances, sorted by name, deal every partition `p` to the `replicas` of
//! them from rank `p` on, its owner skipped, as the group's members report
//! their assignments. A partition whose owner is not known (the report came
//! between two rounds of a rebalance) goes to `replicas + 1` of them, so that
//! it has `replicas` standbys besides its owner whichever process that is,
//! while the cluster has that many. A process keeps its own partitions'
//! copies warm too: the run's state lives in its operators, and the copy a
//! restore saved would otherwise age until the next restore.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use rtflow_runtime::{Result, RtflowError};

use super::local::{self, Image};
use super::ClusterSettings;

/// How often a copy that changed is saved.
pub(crate) const SAVE_EVERY: Duration = Duration::from_secs(2);

/// The changelog partitions (of `partitions`) that instance `me` keeps warm
/// copies of, given the `live` instances, the partitions it `owns`, the
/// `owners` of the others as far as they are known and the `racks` of
/// those that told theirs: its own too, so that a restart of its run (every
/// rebalance that changes its share) also reads only a tail of them.
///
/// Partition `p`'s copies go to the instances from rank `p` on, its owner
/// skipped: first one per rack that holds neither the owner nor a copy yet,
/// then the next ones in rank order. Every process computes the same from
/// the same group, so each knows its own part without asking the others.
pub(crate) fn placement(
    partitions: usize,
    live: &BTreeSet<String>,
    me: &str,
    replicas: usize,
    owns: &BTreeSet<i32>,
    owners: &BTreeMap<i32, String>,
    racks: &BTreeMap<String, String>,
) -> BTreeSet<i32> {
    let mut live: Vec<&str> = live.iter().map(String::as_str).collect();
    if !live.contains(&me) {
        live.push(me);
        live.sort_unstable();
    }
    // An instance without a rack is a rack of its own.
    fn rack_of<'a>(racks: &'a BTreeMap<String, String>, instance: &'a str) -> (bool, &'a str) {
        match racks.get(instance) {
            Some(rack) => (true, rack.as_str()),
            None => (false, instance),
        }
    }
    let keeps = |p: usize| {
        let owner = if owns.contains(&(p as i32)) {
            Some(me)
        } else {
            owners.get(&(p as i32)).map(String::as_str)
        };
        let wanted = if owner.is_some() {
            replicas
        } else {
            replicas + 1
        };
        let candidates: Vec<&str> = (0..live.len())
            .map(|k| live[(p + k) % live.len()])
            .filter(|keeper| Some(*keeper) != owner)
            .collect();
        let mut racks_held: BTreeSet<_> = owner.map(|o| rack_of(racks, o)).into_iter().collect();
        let mut keepers: Vec<&str> = Vec::with_capacity(wanted);
        for &candidate in &candidates {
            if keepers.len() < wanted && racks_held.insert(rack_of(racks, candidate)) {
                keepers.push(candidate);
            }
        }
        for &candidate in &candidates {
            if keepers.len() < wanted && !keepers.contains(&candidate) {
                keepers.push(candidate);
            }
        }
        keepers.contains(&me)
    };
    (0..partitions)
        .filter(|p| keeps(*p))
        .map(|p| p as i32)
        .chain(owns.iter().copied())
        .collect()
}

/// A process's standby thread and how to tell it what to keep.
pub(crate) struct Standby {
    keep: Sender<(BTreeSet<i32>, Sender<()>)>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Standby {
    /// Starts the thread, keeping nothing yet.
    pub(crate) fn start(settings: Arc<ClusterSettings>) -> Result<Self> {
        let consumer: BaseConsumer = settings
            .committed_reader(&format!("{}-standby", settings.group()))
            .create()
            .map_err(|e| {
                RtflowError::InvalidConfiguration(format!(
                    "could not create the standby replicas' consumer: {e}"
                ))
            })?;
        let (keep, told) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("rtflow-standby".into())
            .spawn(move || {
                let mut replicas = Replicas {
                    settings,
                    consumer,
                    images: BTreeMap::new(),
                    saved: Instant::now(),
                    changed: BTreeSet::new(),
                };
                replicas.run(&told, &stopping);
            })
            .map_err(|e| {
                RtflowError::InvalidConfiguration(format!(
                    "could not start the standby replicas' thread: {e}"
                ))
            })?;
        Ok(Self {
            keep,
            stop,
            thread: Some(thread),
        })
    }

    /// Keeps copies of `partitions` from now on; the copies of those let go
    /// are saved before it returns (or after a second at most), for a run
    /// about to restore them.
    pub(crate) fn keep(&self, partitions: BTreeSet<i32>) {
        let (done, saved) = mpsc::channel();
        if self.keep.send((partitions, done)).is_ok() {
            let _ = saved.recv_timeout(Duration::from_secs(1));
        }
    }

    /// Tells the thread to save its copies and end.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        self.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Replicas {
    settings: Arc<ClusterSettings>,
    consumer: BaseConsumer,
    images: BTreeMap<i32, Image>,
    saved: Instant,
    /// The partitions whose images changed since they were last saved.
    changed: BTreeSet<i32>,
}

impl Replicas {
    fn run(&mut self, told: &Receiver<(BTreeSet<i32>, Sender<()>)>, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            if let Some((partitions, done)) = told.try_iter().last() {
                if let Err(error) = self.keep(partitions) {
                    tracing::warn!(%error, "standby replicas: could not change what they keep");
                }
                let _ = done.send(());
            }
            match self.consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    if let (Some(key), Some(image)) =
                        (message.key(), self.images.get_mut(&message.partition()))
                    {
                        image.apply(key, message.payload());
                        image.offset = message.offset() + 1;
                        self.changed.insert(message.partition());
                    }
                }
                Some(Err(error)) => tracing::debug!(%error, "standby replicas: consumer error"),
                None => {}
            }
            if !self.changed.is_empty() && self.saved.elapsed() >= SAVE_EVERY {
                self.save_changed();
            }
        }
        self.save_changed();
    }

    /// Saves and lets go the partitions not in `partitions`, and starts on
    /// those new to it from their local copy, or from the changelog's start.
    fn keep(&mut self, partitions: BTreeSet<i32>) -> Result<()> {
        let changelog = self.settings.changelog_topic();
        let copies = self.settings.copies.as_ref().ok_or_else(|| {
            RtflowError::InvalidConfiguration("standby replicas need a checkpoint location".into())
        })?;
        let gone: Vec<i32> = self
            .images
            .keys()
            .filter(|p| !partitions.contains(p))
            .copied()
            .collect();
        for partition in gone {
            if let Some(mut image) = self.images.remove(&partition) {
                if self.changed.remove(&partition) {
                    copies.save(&changelog, partition, &mut image)?;
                }
            }
        }
        for partition in &partitions {
            if self.images.contains_key(partition) {
                continue;
            }
            let span = self
                .consumer
                .fetch_watermarks(&changelog, *partition, self.settings.operation_timeout)
                .map_err(|e| RtflowError::Checkpoint(format!("standby replicas: {e}")))?;
            let image = local::resume(Some(copies), &changelog, *partition, span);
            self.images.insert(*partition, image);
        }
        let mut list = TopicPartitionList::new();
        for (partition, image) in &self.images {
            list.add_partition_offset(&changelog, *partition, Offset::Offset(image.offset))
                .map_err(|e| RtflowError::Checkpoint(format!("standby replicas: {e}")))?;
        }
        self.consumer
            .assign(&list)
            .map_err(|e| RtflowError::Checkpoint(format!("standby replicas: {e}")))
    }

    /// Saves the images that changed since they were last saved.
    fn save_changed(&mut self) {
        let (Some(copies), changelog) = (
            self.settings.copies.as_ref(),
            self.settings.changelog_topic(),
        ) else {
            return;
        };
        for partition in std::mem::take(&mut self.changed) {
            let Some(image) = self.images.get_mut(&partition) else {
                continue;
            };
            if let Err(error) = copies.save(&changelog, partition, image) {
                tracing::warn!(%error, "standby replicas: could not save a copy");
            }
        }
        self.saved = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// Who keeps each of 6 partitions among `names`, each told what it owns
    /// of `owners`, the others' partitions as `known`, and `racks`.
    fn keepers(
        names: &[&str],
        replicas: usize,
        owners: &BTreeMap<i32, String>,
        known: &BTreeMap<i32, String>,
        racks: &BTreeMap<String, String>,
    ) -> Vec<BTreeSet<String>> {
        (0..6)
            .map(|partition| {
                names
                    .iter()
                    .filter(|me| {
                        let owns = owners
                            .iter()
                            .filter(|(_, owner)| owner == *me)
                            .map(|(p, _)| *p)
                            .collect();
                        placement(6, &live(names), me, replicas, &owns, known, racks)
                            .contains(&partition)
                    })
                    .map(|me| me.to_string())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_partition_has_its_replicas_besides_its_owner() {
        let names = ["a", "b", "c", "d"];
        let owners: BTreeMap<i32, String> = (0..6)
            .map(|p| (p, names[(p as usize * 5 + 1) % 4].to_owned()))
            .collect();
        for replicas in 1..=3 {
            for (partition, kept_by) in
                keepers(&names, replicas, &owners, &owners, &BTreeMap::new())
                    .iter()
                    .enumerate()
            {
                let owner = &owners[&(partition as i32)];
                assert!(kept_by.contains(owner), "its owner keeps {partition}");
                assert_eq!(
                    kept_by.len(),
                    replicas + 1,
                    "{partition}, {replicas} replicas: {kept_by:?}"
                );
            }
        }
    }

    #[test]
    fn copies_go_to_racks_other_than_their_owners_and_each_others() {
        let names = ["a", "b", "c", "d", "e", "f"];
        let racks: BTreeMap<String, String> = names
            .iter()
            .enumerate()
            .map(|(i, name)| (name.to_string(), format!("zone-{}", i / 2)))
            .collect();
        let owners: BTreeMap<i32, String> = (0..6)
            .map(|p| (p, names[(p as usize * 5 + 1) % 6].to_owned()))
            .collect();
        for replicas in 1..=2 {
            for (partition, kept_by) in keepers(&names, replicas, &owners, &owners, &racks)
                .iter()
                .enumerate()
            {
                let zones: BTreeSet<&String> = kept_by.iter().map(|k| &racks[k]).collect();
                assert!(kept_by.contains(&owners[&(partition as i32)]));
                assert_eq!(kept_by.len(), replicas + 1, "{partition}: {kept_by:?}");
                assert_eq!(
                    zones.len(),
                    replicas + 1,
                    "{partition}, {replicas} replicas: every keeper in a zone of its own: {kept_by:?}"
                );
            }
        }
        let two_zones: BTreeMap<String, String> = names
            .iter()
            .map(|name| (name.to_string(), "zone-0".into()))
            .collect();
        for (partition, kept_by) in keepers(&names, 2, &owners, &owners, &two_zones)
            .iter()
            .enumerate()
        {
            assert_eq!(
                kept_by.len(),
                3,
                "one zone: still every copy, {partition}: {kept_by:?}"
            );
        }
    }

    #[test]
    fn a_partition_whose_owner_is_not_known_has_one_keeper_more() {
        let names = ["a", "b", "c"];
        let nobody = BTreeMap::new();
        for replicas in 1..=2 {
            for (partition, kept_by) in
                keepers(&names, replicas, &nobody, &nobody, &BTreeMap::new())
                    .iter()
                    .enumerate()
            {
                assert_eq!(kept_by.len(), replicas + 1, "{partition}: {kept_by:?}");
            }
        }
    }

    #[test]
    fn a_process_keeps_copies_of_what_it_owns_too() {
        let owns = BTreeSet::from([0, 4]);
        let nobody = BTreeMap::new();
        let kept = placement(
            6,
            &live(&["a", "b", "c"]),
            "a",
            0,
            &owns,
            &nobody,
            &BTreeMap::new(),
        );
        assert_eq!(kept, BTreeSet::from([0, 3, 4]), "rank 0 of 3 keeps 0 and 3");
        let alone = placement(6, &live(&[]), "a", 1, &owns, &nobody, &BTreeMap::new());
        assert_eq!(
            alone,
            (0..6).collect(),
            "alone, it is every partition's keeper"
        );
    }

    /// The copy a standby keeps follows its changelog partition, deletions
    /// included, and a standby that picks the partition up again starts
    /// from its copy.
    #[test]
    fn a_standby_copy_follows_its_changelog_partition_to_the_end() {
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

        use crate::kafka::admin::{tests::broker, KafkaAdmin};
        use crate::kafka::cluster::local::LocalCopies;
        use crate::kafka::Options;

        let Some(bootstrap) = broker() else { return };
        let unique = format!(
            "standby-{}-{}",
            std::process::id(),
            super::super::local::now_ms()
        );
        let dir = std::env::temp_dir().join(format!("rtflow-{unique}"));
        let settings = Arc::new(ClusterSettings {
            query: unique,
            bootstrap_servers: bootstrap.clone(),
            repartition_partitions: 2,
            key_groups: 2,
            standby_replicas: 1,
            copies: Some(LocalCopies::open(&dir).unwrap()),
            ..ClusterSettings::for_tests(Options::default())
        });
        let changelog = settings.changelog_topic();
        KafkaAdmin::new(&bootstrap)
            .unwrap()
            .create_compacted_topic_of(&changelog, 2)
            .unwrap();
        let producer: BaseProducer = settings.client_config().create().unwrap();
        let write = |key: &str, value: Option<&str>| {
            let mut record = BaseRecord::<str, str>::to(&changelog).key(key).partition(1);
            if let Some(value) = value {
                record = record.payload(value);
            }
            producer.send(record).unwrap();
            producer.flush(Duration::from_secs(10)).unwrap();
        };
        let standby = Standby::start(settings.clone()).unwrap();
        // Kept, then let go: the copy it saves then.
        let copy_at_end = |end: i64| {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                standby.keep(BTreeSet::from([1]));
                std::thread::sleep(Duration::from_millis(300));
                standby.keep(BTreeSet::new());
                let copies = settings.copies.as_ref().unwrap();
                if let Some(image) = copies.load(&changelog, 1).filter(|i| i.offset == end) {
                    return image;
                }
                assert!(Instant::now() < deadline, "the copy did not reach {end}");
            }
        };
        write("a", Some("1"));
        write("b", Some("2"));
        write("b", None);
        let image = copy_at_end(3);
        assert_eq!(image.records.len(), 1, "b was deleted");
        assert_eq!(image.records[b"a".as_slice()], b"1");
        write("a", Some("3"));
        write("c", Some("4"));
        let image = copy_at_end(5);
        assert_eq!(image.records.len(), 2);
        assert_eq!(image.records[b"a".as_slice()], b"3");
        drop(standby);
        KafkaAdmin::new(&bootstrap)
            .unwrap()
            .delete_topic(&changelog)
            .unwrap();
        drop(settings);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_process_missing_from_the_live_list_counts_itself() {
        let kept = placement(
            4,
            &live(&["b", "c"]),
            "a",
            1,
            &BTreeSet::new(),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert_eq!(kept, BTreeSet::from([0, 2, 3]), "rank 0 of a, b, c");
    }
}
