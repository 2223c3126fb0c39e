//! Which processes left the cluster without a word, so that the ones that
//! stay fence them (see [`link::fence`](super::link::fence)).
//!
//! A process that stops leaves the group after its last commit; one that dies
//! is dropped by the group only when its session times out, and the
//! transaction it left open holds back every partition it wrote to until the
//! broker times that out too. Each survivor compares the group's members at
//! the start of every run with those it saw before, and the first of the live
//! instances by name fences those gone since at once: fencers of one
//! transactional id would only wait on each other. Fencing a process that
//! stopped cleanly is harmless: it has nothing open.

use std::collections::BTreeSet;
use std::time::Duration;

use rdkafka::consumer::BaseConsumer;
use rtflow_runtime::{Result, RtflowError};

use super::shape::{instance_of, list_group};
use super::ClusterSettings;

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
}

/// The instances that are members of any of `groups` now.
pub(crate) fn live_instances(
    settings: &ClusterSettings,
    client: &BaseConsumer,
    groups: &[String],
    timeout: Duration,
) -> Result<BTreeSet<String>> {
    let mut live = BTreeSet::new();
    for group in groups {
        let list = list_group(client, group, timeout).map_err(|e| {
            RtflowError::InvalidConfiguration(format!(
                "KafkaCluster {}: could not list the members of group '{group}': {e}",
                settings.bootstrap_servers
            ))
        })?;
        let members = list.groups().iter().flat_map(|group| group.members());
        live.extend(members.filter_map(|m| instance_of(m.client_id()).map(str::to_owned)));
    }
    Ok(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
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
