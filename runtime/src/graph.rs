//! The logical graph a [`Dataflow`](crate::Dataflow) builds: nodes (sources,
//! operators, sinks) in topological order, each with its input edges and how
//! records are spread over them. The planner ([`crate::plan`]) turns it into
//! actors.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::cluster::ClusterLink;
use crate::dispatch::Partitioning;
use crate::progress::SourceDescription;
use crate::wiring::Body;

pub(crate) type NodeId = usize;

/// The operator kind of `with_watermark`, which validation looks for.
pub(crate) const WITH_WATERMARK: &str = "with_watermark";

/// An edge into a node.
#[derive(Clone)]
pub(crate) struct Edge {
    pub(crate) from: NodeId,
    pub(crate) partitioning: Partitioning,
}

/// One operator, source or sink of the logical graph.
pub(crate) struct Node {
    /// Set by the user, or `{kind}-{index in the graph}`; a source's default is
    /// its uid.
    pub(crate) name: String,
    /// The stable id the node's checkpointed state is stored under: set by the
    /// user, or `{kind}-{n}` (`{kind}-sink-{n}`) for the n-th source or operator
    /// (sink) of its kind, which adding or removing nodes of other kinds leaves
    /// unchanged.
    pub(crate) uid: String,
    pub(crate) kind: String,
    pub(crate) body: Body,
    pub(crate) inputs: Vec<Edge>,
    pub(crate) parallelism: Option<usize>,
    /// Event-time delay declared by `with_watermark`.
    pub(crate) watermark_delay: Option<Duration>,
}

/// The graph under construction. Nodes are only ever appended after their inputs,
/// so node order is a topological order.
#[derive(Default)]
pub(crate) struct Graph {
    pub(crate) nodes: Vec<Node>,
    /// The inputs of every `union`, to check that they read distinct sources.
    pub(crate) unions: Vec<Vec<NodeId>>,
    /// Builder misuse, reported when the query starts.
    pub(crate) errors: Vec<String>,
    /// For a clustered query, the process's link to the cluster.
    pub(crate) cluster: Option<Arc<dyn ClusterLink>>,
    /// How many repartitions the builder cut the dataflow at.
    pub(crate) repartitions: usize,
    /// The nodes that decode what a repartition read back, and the key
    /// partitioning each shuffles by: a clustered query may shuffle only
    /// there, and only by the repartition's own key.
    pub(crate) exchanges: Vec<(NodeId, Partitioning)>,
    /// Each repartition: the sink that writes it, the source that reads it
    /// back, and its number.
    pub(crate) repartition_ends: Vec<RepartitionEnds>,
}

/// The two nodes a repartition cuts the dataflow into.
pub(crate) struct RepartitionEnds {
    pub(crate) writer: NodeId,
    pub(crate) reader: NodeId,
    pub(crate) stage: usize,
}

impl Graph {
    /// Which nodes of a clustered query commit second (`true`), after the
    /// repartitions they read, and which first, with the source offsets of
    /// their records. Whatever a repartition's reader reaches commits
    /// second; so does a source some of whose records meet such records (a
    /// union, a join), and everything its records reach: a source's offsets
    /// commit together with all that its records wrote.
    pub(crate) fn commits_second(&self) -> Vec<bool> {
        let readers: BTreeSet<NodeId> = self.repartition_ends.iter().map(|e| e.reader).collect();
        let mut late: BTreeSet<NodeId> = readers.clone();
        loop {
            let mut second = vec![false; self.nodes.len()];
            // Nodes come after their inputs.
            for (id, node) in self.nodes.iter().enumerate() {
                second[id] = late.contains(&id) || node.inputs.iter().any(|e| second[e.from]);
            }
            let mut reaching: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); self.nodes.len()];
            for (id, node) in self.nodes.iter().enumerate() {
                if node.inputs.is_empty() {
                    reaching[id].insert(id);
                }
                for edge in &node.inputs {
                    let from = reaching[edge.from].clone();
                    reaching[id].extend(from);
                }
            }
            let more: BTreeSet<NodeId> = (0..self.nodes.len())
                .filter(|id| second[*id])
                .flat_map(|id| reaching[id].iter().copied())
                .collect();
            if more.is_subset(&late) {
                return second;
            }
            late.extend(more);
        }
    }

    /// Every source, as progress reports name it.
    pub(crate) fn source_descriptions(&self) -> Vec<SourceDescription> {
        self.nodes
            .iter()
            .filter_map(|node| match &node.body {
                Body::Source(source, _) => Some(SourceDescription {
                    name: node.name.clone(),
                    uid: node.uid.clone(),
                    description: source.description(),
                }),
                _ => None,
            })
            .collect()
    }

    /// The description of every sink.
    pub(crate) fn sink_descriptions(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter_map(|node| match &node.body {
                Body::Sink(sink) => Some(sink.description()),
                _ => None,
            })
            .collect()
    }

    /// Appends a node of `kind` after its inputs; returns its id.
    pub(crate) fn add(&mut self, kind: &str, body: Body, inputs: Vec<Edge>) -> NodeId {
        let id = self.nodes.len();
        let is_sink = matches!(body, Body::Sink(_));
        let same_kind = self
            .nodes
            .iter()
            .filter(|n| n.kind == kind && matches!(n.body, Body::Sink(_)) == is_sink)
            .count();
        let uid = if is_sink {
            format!("{kind}-sink-{same_kind}")
        } else {
            format!("{kind}-{same_kind}")
        };
        // A source is named by its uid: its metrics keep their name when steps
        // are added elsewhere in the dataflow.
        let name = match body {
            Body::Source(..) => uid.clone(),
            _ => format!("{kind}-{id}"),
        };
        self.nodes.push(Node {
            name,
            uid,
            kind: kind.to_owned(),
            body,
            inputs,
            parallelism: None,
            watermark_delay: None,
        });
        id
    }
}
