//! Who is in the cluster: which processes left it without a word, so that
//! the ones that stay fence them (see [`link::fence`](super::link::fence)),
//! and which process owns each repartition partition, so that standby
//! replicas go elsewhere.
//!
//! A process that stops leaves the group after its last commit; one that dies
//! is dropped by the group only when its session times out, and the
//! transaction it left open holds back every partition it wrote to until the
//! broker times that out too. Each survivor compares the group's members at
//! the start of every run with those it saw before, and the first of the live
//! instances by name fences those gone since at once: fencers of one
//! transactional id would only wait on each other. Fencing a process that
//! stopped cleanly is harmless: it has nothing open.
//!
//! A process that died while no other ran is in no survivor's memory. So
//! each process, once a member and before its first transaction begins,
//! writes its name in the compacted `rtflow-<query>-instances` topic
//! ([`announce`]), and takes the names written there before as seen
//! ([`recall`]): a newcomer of another name fences the one that died alone,
//! rather than wait for its transaction to time out (three batch durations,
//! at least 10 s). A name fenced, or of a process that stopped, is deleted
//! from the topic, so that the next newcomer does not fence it again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rdkafka::consumer::BaseConsumer;
use rtflow_runtime::{Result, RtflowError};

use super::shape::{instance_of, list_group};
use super::{compacted, ClusterSettings};

/// The instances a process saw in its groups, and which of them are gone.
#[derive(Debug, Default)]
pub(crate) struct Departures {
    known: BTreeSet<String>,
}

impl Departures {
    /// The groups' members are `live` now: the instances seen before and no
    /// longer there, never `me`, for `me` to fence if it comes first of the
    /// live ones.
    pub(crate) fn departed(&mut self, live: BTreeSet<String>, me: &str) -> Vec<String> {
        let fencer = live.first().is_none_or(|first| first.as_str() >= me);
        let gone = self
            .known
            .difference(&live)
            .filter(|instance| fencer && *instance != me)
            .cloned()
            .collect();
        self.known = live;
        gone
    }

    /// Takes `instances` as seen: those not among the live ones at the next
    /// look are gone.
    pub(crate) fn recall(&mut self, instances: impl IntoIterator<Item = String>) {
        self.known.extend(instances);
    }
}

/// Writes this process's name among the query's instances.
pub(crate) fn announce(settings: &ClusterSettings) -> std::result::Result<(), String> {
    let topic = settings.instances_topic();
    compacted::write(settings, &topic, &settings.instance, Some(b"ran"))
}

/// The other instances written among the query's instances.
pub(crate) fn recall(settings: &ClusterSettings) -> std::result::Result<Vec<String>, String> {
    Ok(compacted::read(settings, &settings.instances_topic())?
        .into_keys()
        .map(|name| String::from_utf8_lossy(&name).into_owned())
        .filter(|name| *name != settings.instance)
        .collect())
}

/// Deletes `instance` from the query's instances: it has nothing open.
pub(crate) fn forget(
    settings: &ClusterSettings,
    instance: &str,
) -> std::result::Result<(), String> {
    compacted::write(settings, &settings.instances_topic(), instance, None)
}

/// The members of a clustered query's groups now.
#[derive(Debug, Default)]
pub(crate) struct Members {
    /// The instances that are members of any of the groups.
    pub(crate) live: BTreeSet<String>,
    /// The instance each partition of the first repartition topic is
    /// assigned to, as far as the group's members report it.
    pub(crate) owners: BTreeMap<i32, String>,
    /// The rack of each instance whose members announce one.
    pub(crate) racks: BTreeMap<String, String>,
}

/// The members of `groups` now.
pub(crate) fn members(
    settings: &ClusterSettings,
    client: &BaseConsumer,
    groups: &[String],
    timeout: Duration,
) -> Result<Members> {
    let first = settings.repartition_topic(0);
    let mut found = Members::default();
    for group in groups {
        let list = list_group(client, group, timeout).map_err(|e| {
            RtflowError::InvalidConfiguration(format!(
                "KafkaCluster {}: could not list the members of group '{group}': {e}",
                settings.bootstrap_servers
            ))
        })?;
        for member in list.groups().iter().flat_map(|group| group.members()) {
            let Some(instance) = instance_of(member.client_id()) else {
                continue;
            };
            found.live.insert(instance.to_owned());
            let assigned = member
                .assignment()
                .and_then(|bytes| assigned_partitions(bytes, &first))
                .unwrap_or_default();
            for partition in assigned {
                found.owners.insert(partition, instance.to_owned());
            }
            if let Some(rack) = member.metadata().and_then(subscribed_rack) {
                found.racks.insert(instance.to_owned(), rack);
            }
        }
    }
    Ok(found)
}

/// The consumer protocol's big-endian fields, read in turn; `None` once the
/// bytes run out.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.0.split_at_checked(n)?;
        self.0 = tail;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    /// A string: its length, then its bytes.
    fn string(&mut self) -> Option<&'a [u8]> {
        let length = self.i16()?;
        self.take(length.max(0) as usize)
    }

    /// An array's length, none for a null one.
    fn count(&mut self) -> Option<i32> {
        Some(self.i32()?.max(0))
    }
}

/// The rack a member's subscription announces (`ConsumerProtocolSubscription`
/// from version 3: a version, the topics, user data, the partitions it owns,
/// its generation, then its rack); `None` if it names none or does not
/// parse.
fn subscribed_rack(bytes: &[u8]) -> Option<String> {
    let mut fields = Fields(bytes);
    if fields.i16()? < 3 {
        return None;
    }
    for _ in 0..fields.count()? {
        fields.string()?;
    }
    let user_data = fields.count()?;
    fields.take(user_data as usize)?;
    for _ in 0..fields.count()? {
        fields.string()?;
        let partitions = fields.count()?;
        fields.take(4 * partitions as usize)?;
    }
    let _generation = fields.i32()?;
    // A rack of length -1 is none.
    let length = fields.i16()?;
    let rack = fields.take(usize::try_from(length).ok()?)?;
    String::from_utf8(rack.to_vec()).ok()
}

/// The partitions of `topic` in a member's assignment, as the consumer
/// protocol encodes it (`ConsumerProtocolAssignment`: a version, then per
/// topic its name and partitions, then user data); `None` if it does not
/// parse.
fn assigned_partitions(bytes: &[u8], topic: &str) -> Option<Vec<i32>> {
    let mut fields = Fields(bytes);
    let _version = fields.i16()?;
    let mut partitions = Vec::new();
    for _ in 0..fields.count()? {
        let name = fields.string()?;
        for _ in 0..fields.count()? {
            let partition = fields.i32()?;
            if name == topic.as_bytes() {
                partitions.push(partition);
            }
        }
    }
    Some(partitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// A consumer protocol assignment of `topics`, as Kafka encodes it.
    fn assignment(topics: &[(&str, &[i32])]) -> Vec<u8> {
        let mut bytes = 1i16.to_be_bytes().to_vec();
        bytes.extend((topics.len() as i32).to_be_bytes());
        for (topic, partitions) in topics {
            bytes.extend((topic.len() as i16).to_be_bytes());
            bytes.extend(topic.as_bytes());
            bytes.extend((partitions.len() as i32).to_be_bytes());
            partitions
                .iter()
                .for_each(|p| bytes.extend(p.to_be_bytes()));
        }
        bytes.extend((-1i32).to_be_bytes());
        bytes
    }

    #[test]
    fn a_members_assignment_gives_its_partitions_of_a_topic() {
        let bytes = assignment(&[("orders", &[0, 3]), ("q-0-repartition", &[1, 4, 5])]);
        assert_eq!(
            assigned_partitions(&bytes, "q-0-repartition"),
            Some(vec![1, 4, 5])
        );
        assert_eq!(assigned_partitions(&bytes, "orders"), Some(vec![0, 3]));
        assert_eq!(assigned_partitions(&bytes, "other"), Some(vec![]));
        assert_eq!(
            assigned_partitions(&bytes[..9], "orders"),
            None,
            "cut short"
        );
        assert_eq!(assigned_partitions(&[], "orders"), None);
    }

    /// A consumer protocol subscription of `version` to `topics`, owning
    /// `owned`, in `rack`, as librdkafka encodes it.
    fn subscription(version: i16, owned: &[(&str, &[i32])], rack: Option<&str>) -> Vec<u8> {
        let mut bytes = version.to_be_bytes().to_vec();
        bytes.extend(1i32.to_be_bytes());
        bytes.extend(6i16.to_be_bytes());
        bytes.extend(b"orders");
        bytes.extend(3i32.to_be_bytes());
        bytes.extend(b"abc");
        let owned = assignment(owned);
        bytes.extend(&owned[2..owned.len() - 4]);
        bytes.extend(7i32.to_be_bytes());
        match rack {
            Some(rack) => {
                bytes.extend((rack.len() as i16).to_be_bytes());
                bytes.extend(rack.as_bytes());
            }
            None => bytes.extend((-1i16).to_be_bytes()),
        }
        bytes
    }

    #[test]
    fn a_members_subscription_gives_its_rack() {
        let owned: &[(&str, &[i32])] = &[("orders", &[0, 3]), ("q-0-repartition", &[1])];
        let bytes = subscription(3, owned, Some("eu-west-1a"));
        assert_eq!(subscribed_rack(&bytes).as_deref(), Some("eu-west-1a"));
        assert_eq!(subscribed_rack(&subscription(3, &[], None)), None);
        assert_eq!(
            subscribed_rack(&subscription(2, owned, Some("eu-west-1a"))),
            None,
            "before version 3, what follows is not a rack"
        );
        assert_eq!(
            subscribed_rack(&bytes[..bytes.len() - 1]),
            None,
            "cut short"
        );
    }

    #[test]
    fn an_instance_seen_before_and_missing_now_is_fenced_once() {
        let mut departures = Departures::default();
        assert!(departures.departed(set(&["a", "b", "c"]), "a").is_empty());
        assert_eq!(departures.departed(set(&["a", "c"]), "a"), ["b"]);
        assert!(
            departures.departed(set(&["a", "c"]), "a").is_empty(),
            "once"
        );
    }

    #[test]
    fn an_instance_that_ran_before_this_process_and_is_not_live_is_fenced_once() {
        let mut departures = Departures::default();
        departures.recall(["old".to_owned(), "b".to_owned()]);
        assert_eq!(departures.departed(set(&["a", "b"]), "a"), ["old"]);
        assert!(
            departures.departed(set(&["a", "b"]), "a").is_empty(),
            "once"
        );
        let mut second = Departures::default();
        second.recall(["old".to_owned()]);
        assert!(
            second.departed(set(&["a", "b"]), "b").is_empty(),
            "only the first live instance fences"
        );
    }

    #[test]
    fn only_the_first_live_instance_fences() {
        let mut first = Departures::default();
        let mut second = Departures::default();
        first.departed(set(&["a", "b", "c"]), "a");
        second.departed(set(&["a", "b", "c"]), "c");
        assert_eq!(first.departed(set(&["a", "c"]), "a"), ["b"]);
        assert!(second.departed(set(&["a", "c"]), "c").is_empty());
        assert_eq!(
            second.departed(set(&["c"]), "c"),
            ["a"],
            "the fencer gone, the next takes over"
        );
    }

    #[test]
    fn a_newcomer_is_not_gone_and_the_process_never_fences_itself() {
        let mut departures = Departures::default();
        departures.departed(set(&["b", "c"]), "b");
        assert!(departures.departed(set(&["b", "c", "d"]), "b").is_empty());
        assert!(
            departures.departed(set(&["c", "d"]), "b").is_empty(),
            "a process missing from its own groups (rejoining) fences no one as itself"
        );
        assert_eq!(departures.departed(set(&["b", "d"]), "b"), ["c"]);
    }
}
