//! Every process of a clustered query must run the same dataflow: otherwise
//! keys, state and offsets would mean different things in different
//! processes. A process names its dataflow's shape by a fingerprint in its
//! client id, which the group's member list shows, and publishes the whole
//! shape in the compacted `rtflow-<query>-shapes` topic under that
//! fingerprint. Before it joins, a process compares its fingerprint with the
//! live members' and, on a difference, fails with `CLUSTER_SHAPE_MISMATCH`
//! naming the first step that differs. It compares them again before its
//! first run, once it is a member itself: two processes starting in the same
//! instant both find the other absent before they join.
//!
//! The shape's first line is the [`CLUSTER_PROTOCOL`] the process speaks, so
//! that processes of two rtflow versions that cannot read each other's
//! repartition words fail the same check, naming the protocols, instead of
//! failing to decode a record in the middle of a run.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::groups::GroupList;
use rtflow_runtime::key_groups::stable_hash;
use rtflow_runtime::{Result, RtflowError};

use super::{compacted, while_coordinator_moves, ClusterSettings};

/// The version of what a query's processes exchange through Kafka: the
/// repartition words (`exchange::Wire`), the watermarks in the offsets'
/// metadata and the changelog's records, and the transactional ids a
/// process fences. Raised with every change to one of them that a process
/// of the version before could not read or would not fence.
///
/// 1 had no line of its own in the shape; 2 added the `Passed` word
/// (2026-12-04); 3 the second lane of first transactions
/// (`#sourced-1`, 2026-12-07), which a process of 2 would not fence when
/// it takes over from one that left.
const CLUSTER_PROTOCOL: u32 = 3;

/// How the shape's first line names the protocol.
const PROTOCOL_LINE: &str = "cluster protocol: ";

/// Separates a member's instance from its fingerprint in its client id.
const FINGERPRINT_MARK: &str = ".shape-";

/// Separates a member's fingerprint from its start in its client id: two
/// processes under one instance name are told apart by it.
const START_MARK: &str = ".start-";

/// A dataflow's shape and its fingerprint.
#[derive(Clone)]
pub(crate) struct Shape {
    pub(crate) lines: Vec<String>,
    pub(crate) fingerprint: String,
}

impl Shape {
    /// The shape of a dataflow whose steps are `steps`
    /// ([`Dataflow::shape`](rtflow_runtime::Dataflow::shape)), spoken in
    /// this version's protocol.
    pub(crate) fn new(steps: Vec<String>) -> Self {
        Self::speaking(CLUSTER_PROTOCOL, steps)
    }

    fn speaking(protocol: u32, steps: Vec<String>) -> Self {
        let lines: Vec<String> = std::iter::once(format!("{PROTOCOL_LINE}{protocol}"))
            .chain(steps)
            .collect();
        let fingerprint = format!("{:016x}", stable_hash(&lines));
        Self { lines, fingerprint }
    }

    /// The client id of a member: its instance, its shape's fingerprint and
    /// `start`, unique to this start of the process.
    pub(crate) fn client_id(&self, settings: &ClusterSettings, start: &str) -> String {
        format!(
            "{}{FINGERPRINT_MARK}{}{START_MARK}{start}",
            settings.instance, self.fingerprint
        )
    }

    /// Publishes the shape under its fingerprint.
    pub(crate) fn publish(&self, settings: &ClusterSettings) -> Result<()> {
        let text = self.lines.join("\n");
        compacted::write(
            settings,
            &settings.shapes_topic(),
            &self.fingerprint,
            Some(text.as_bytes()),
        )
        .map_err(|e| shape_error(format!("could not publish the shape: {e}")))
    }

    /// Fails when a live member of the group runs another dataflow, as
    /// `lister` lists them.
    pub(crate) fn check_members(
        &self,
        settings: &ClusterSettings,
        lister: &BaseConsumer,
    ) -> Result<()> {
        // Fetched first, the metadata spares the list its wait (`list_group`).
        lister
            .fetch_metadata(None, settings.operation_timeout)
            .map_err(|e| shape_error(format!("could not read the cluster's metadata: {e}")))?;
        let groups = list_group(lister, &settings.group(), settings.operation_timeout)
            .map_err(|e| shape_error(format!("could not list the group's members: {e}")))?;
        let other = groups
            .groups()
            .iter()
            .flat_map(|group| group.members())
            .filter_map(|member| {
                let client_id = member.client_id();
                Some((instance_of(client_id)?, fingerprint_of(client_id)?))
            })
            .find(|(_, fingerprint)| *fingerprint != self.fingerprint);
        let Some((member, fingerprint)) = other else {
            return Ok(());
        };
        let theirs = published(settings, fingerprint)?;
        Err(RtflowError::ClusterShapeMismatch {
            member: member.to_owned(),
            difference: difference(&self.lines, theirs.as_deref()),
        })
    }
}

/// The members of `group`, asked again while its coordinator is moving or
/// loading (a broker restarted, a leader moved): a replicated cluster says so
/// for a few seconds at a time.
///
/// A client's first list waits for its first metadata, and librdkafka wakes
/// that wait only on a change of a broker's state, which can come a second
/// after the metadata: a client that fetched metadata before saves that
/// second.
pub(crate) fn list_group<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    group: &str,
    timeout: Duration,
) -> KafkaResult<GroupList> {
    while_coordinator_moves(timeout, || consumer.fetch_group_list(Some(group), timeout))
}

/// The instance a member's client id names.
pub(crate) fn instance_of(client_id: &str) -> Option<&str> {
    client_id
        .split_once(FINGERPRINT_MARK)
        .map(|(instance, _)| instance)
}

/// The shape fingerprint a member's client id names; a process of an
/// earlier version names no start after it.
fn fingerprint_of(client_id: &str) -> Option<&str> {
    let (_, rest) = client_id.split_once(FINGERPRINT_MARK)?;
    Some(
        rest.split_once(START_MARK)
            .map_or(rest, |(fingerprint, _)| fingerprint),
    )
}

fn shape_error(message: impl std::fmt::Display) -> RtflowError {
    RtflowError::InvalidConfiguration(format!("cluster shape check: {message}"))
}

/// The shape published under `fingerprint`, if it can be found.
fn published(settings: &ClusterSettings, fingerprint: &str) -> Result<Option<Vec<String>>> {
    let shapes = compacted::read(settings, &settings.shapes_topic()).map_err(shape_error)?;
    Ok(shapes
        .get(fingerprint.as_bytes())
        .map(|text| with_protocol(String::from_utf8_lossy(text).lines())))
}

/// A published shape's lines, led by its protocol: a process of protocol 1
/// published its steps alone.
fn with_protocol<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut lines = lines.peekable();
    let first = lines
        .peek()
        .filter(|line| line.starts_with(PROTOCOL_LINE))
        .is_none()
        .then(|| format!("{PROTOCOL_LINE}1"));
    first.into_iter().chain(lines.map(str::to_owned)).collect()
}

/// The first line where two shapes differ, said for a user.
fn difference(ours: &[String], theirs: Option<&[String]>) -> String {
    let Some(theirs) = theirs else {
        return "its shape is not published".to_owned();
    };
    let count = ours.len().max(theirs.len());
    (0..count)
        .find_map(|i| match (ours.get(i), theirs.get(i)) {
            (Some(a), Some(b)) if a == b => None,
            (Some(a), Some(b)) => Some(format!("here {a}, there {b}")),
            (Some(a), None) => Some(format!("here {a}, which it lacks")),
            (None, Some(b)) => Some(format!("there {b}, which this one lacks")),
            (None, None) => None,
        })
        .unwrap_or_else(|| "the shapes are the same but their fingerprints differ".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[&str]) -> Vec<String> {
        text.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_first_differing_step_is_named() {
        let ours = lines(&["key groups: 128", "step 1: operator 'count-0' (count)"]);
        let theirs = lines(&["key groups: 128", "step 1: operator 'sum-0' (sum)"]);
        assert_eq!(
            difference(&ours, Some(&theirs)),
            "here step 1: operator 'count-0' (count), there step 1: operator 'sum-0' (sum)"
        );
        assert_eq!(
            difference(&ours[..1], Some(&theirs)),
            "there step 1: operator 'sum-0' (sum), which this one lacks"
        );
    }

    #[test]
    fn a_process_of_another_protocol_is_named_by_its_protocol_first() {
        let steps = lines(&["key groups: 128", "step 1: operator 'count-0' (count)"]);
        let ours = Shape::new(steps.clone());
        let earlier = steps.join("\n");
        let theirs = with_protocol(earlier.lines());
        assert_eq!(
            difference(&ours.lines, Some(&theirs)),
            format!("here cluster protocol: {CLUSTER_PROTOCOL}, there cluster protocol: 1")
        );
        let later = Shape::speaking(CLUSTER_PROTOCOL + 1, steps);
        assert_ne!(ours.fingerprint, later.fingerprint);
        let published = later.lines.join("\n");
        assert_eq!(with_protocol(published.lines()), later.lines);
    }

    #[test]
    fn a_client_id_names_its_instance_and_fingerprint_with_or_without_a_start() {
        for client_id in ["p-0.shape-00ff.start-1a2b", "p-0.shape-00ff"] {
            assert_eq!(instance_of(client_id), Some("p-0"));
            assert_eq!(fingerprint_of(client_id), Some("00ff"), "{client_id}");
        }
    }

    #[test]
    fn the_fingerprint_follows_the_shape() {
        let a = Shape::new(lines(&["step 0", "step 1"]));
        assert_eq!(
            a.fingerprint,
            Shape::new(lines(&["step 0", "step 1"])).fingerprint
        );
        assert_ne!(
            a.fingerprint,
            Shape::new(lines(&["step 0", "step 2"])).fingerprint
        );
    }
}
