//! From logical graph to running actors: validate the shape, resolve parallelism,
//! fuse forward chains into actors, count slots, then wire lanes and operators.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use rtflow_checkpoint::Offsets;

use crate::actor::{ActorEnv, Reading};
use crate::cluster::handover::Reach;
use crate::cluster::membership::Membership;
use crate::cluster::CommitOrder;
use crate::config::QueryConfig;
use crate::connector::SinkWiring;
use crate::connector::{SinkContext, SourceContext, SourceWaker};
use crate::dispatch::Partitioning;
use crate::error::{Result, RtflowError};
use crate::graph::{Graph, NodeId, WITH_WATERMARK};
use crate::guard::Place;
use crate::metrics::{MailboxMetrics, QueryMetrics, Role};
use crate::operator::OperatorContext;
use crate::record::Epoch;
use crate::state::{Restored, StateContext};
use crate::wiring::{ActorMain, AnyBox, Body};

/// Checks the dataflow's shape against real-time mode's rules. No I/O.
pub(crate) fn validate(graph: &Graph, config: &QueryConfig) -> Result<()> {
    if let Some(error) = graph.errors.first() {
        return Err(RtflowError::InvalidDataflow(error.clone()));
    }
    let consumers = consumers(graph);
    if !graph.nodes.iter().any(|n| matches!(n.body, Body::Sink(_))) {
        return Err(RtflowError::InvalidDataflow(
            "the dataflow has no sink; end a stream with .sink(...)".into(),
        ));
    }
    for (id, node) in graph.nodes.iter().enumerate() {
        if !matches!(node.body, Body::Sink(_)) && consumers[id].is_empty() {
            return Err(RtflowError::InvalidDataflow(format!(
                "the output of '{}' is never used; end it in a sink or remove it",
                node.name
            )));
        }
    }
    for node in &graph.nodes {
        match &node.body {
            Body::Source(source, _) if !source.supports_real_time() => {
                return Err(RtflowError::InputStreamNotSupported {
                    source_name: node.name.clone(),
                })
            }
            Body::Sink(sink) if !sink.supports_real_time() => {
                return Err(RtflowError::SinkNotSupported {
                    sink: node.kind.clone(),
                })
            }
            _ => {}
        }
    }
    if config.allowlist_check {
        for node in &graph.nodes {
            let (what, allowed) = match &node.body {
                Body::Source(..) => continue,
                Body::Operator(operator, _) => ("operator", operator.allowlisted()),
                Body::Sink(sink) => ("sink", sink.allowlisted()),
            };
            if !allowed {
                return Err(RtflowError::OperatorOrSinkNotInAllowlist {
                    what,
                    name: node.kind.clone(),
                });
            }
        }
    }
    let mut uids = BTreeSet::new();
    if let Some(node) = graph.nodes.iter().find(|n| !uids.insert(&n.uid)) {
        return Err(RtflowError::InvalidDataflow(format!(
            "two operators have the uid '{}'; give each a distinct .uid(...)",
            node.uid
        )));
    }
    let sources = upstream_sources(graph);
    for inputs in &graph.unions {
        let mut seen = BTreeSet::new();
        for input in inputs {
            if let Some(shared) = sources[*input].iter().find(|s| !seen.insert(**s)) {
                return Err(RtflowError::IdenticalSourcesInUnion {
                    source_name: graph.nodes[*shared].name.clone(),
                });
            }
        }
    }
    let mut shuffled = vec![false; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        shuffled[id] = node
            .inputs
            .iter()
            .any(|edge| edge.partitioning.is_shuffle() || shuffled[edge.from]);
        if node.kind == WITH_WATERMARK && shuffled[id] {
            return Err(RtflowError::ShuffleBeforeWatermark {
                operator: node.name.clone(),
            });
        }
    }
    check_shuffles_before_state(graph)?;
    if graph.cluster.is_some() {
        check_clustered(graph)?;
    }
    Ok(())
}

/// A clustered query shuffles only through its repartition topics: a `key_by`
/// within one process would leave each key's state split between processes.
/// Several repartitions are fine: every repartition topic has as many
/// partitions, and a process owns the same partitions of each, so a key group
/// lives in one process whichever stage keys by it.
fn check_clustered(graph: &Graph) -> Result<()> {
    for node in &graph.nodes {
        for edge in node.inputs.iter().filter(|e| e.partitioning.is_shuffle()) {
            let exchange = graph.exchanges.iter().find(|(id, _)| *id == edge.from);
            let message = match exchange {
                None => {
                    "reads a key_by, which shuffles within one process; in a clustered \
                     query shuffle with repartition_by, which reaches every process"
                }
                Some((_, key)) if key.same_as(&edge.partitioning) => continue,
                Some(_) => {
                    "keys the repartitioned stream again, by a key of its own, within \
                     one process: its state would not follow the repartition's \
                     partitions from process to process; repartition it by that key \
                     with repartition_by instead"
                }
            };
            return Err(RtflowError::InvalidDataflow(format!(
                "'{}' {message}",
                node.name
            )));
        }
    }
    Ok(())
}

/// At most one shuffle between a stateful operator and the nearest watermark,
/// stateful operator or source upstream, on every input path.
fn check_shuffles_before_state(graph: &Graph) -> Result<()> {
    // Per node: the most shuffles on a path back to such an anchor.
    let mut shuffles = vec![0; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        let stateful = matches!(&node.body, Body::Operator(operator, _) if operator.stateful());
        let most = node
            .inputs
            .iter()
            .map(|edge| shuffles[edge.from] + usize::from(edge.partitioning.is_shuffle()))
            .max()
            .unwrap_or(0);
        if stateful && most > 1 {
            return Err(RtflowError::MultipleShuffles {
                operator: node.name.clone(),
            });
        }
        let anchor = stateful || node.kind == WITH_WATERMARK;
        shuffles[id] = if anchor { 0 } else { most };
    }
    Ok(())
}

/// For every node, the edges leaving it: (consumer, index of the edge in its inputs).
fn consumers(graph: &Graph) -> Vec<Vec<(NodeId, usize)>> {
    let mut consumers = vec![Vec::new(); graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        for (index, edge) in node.inputs.iter().enumerate() {
            consumers[edge.from].push((id, index));
        }
    }
    consumers
}

/// For every node, the sources it reads from.
fn upstream_sources(graph: &Graph) -> Vec<BTreeSet<NodeId>> {
    let mut sources: Vec<BTreeSet<NodeId>> = Vec::with_capacity(graph.nodes.len());
    for (id, node) in graph.nodes.iter().enumerate() {
        let mut own = BTreeSet::new();
        if matches!(node.body, Body::Source(..)) {
            own.insert(id);
        }
        for edge in &node.inputs {
            own.extend(sources[edge.from].iter().copied());
        }
        sources.push(own);
    }
    sources
}

/// The sending ends of one edge for one upstream actor, in receiver order.
type EdgeLanes = Vec<(AnyBox, Arc<MailboxMetrics>)>;

/// The lanes of a query before they are handed to its actors.
struct Lanes {
    /// `outgoing[node][subtask][consumer edge]`: the actor's sending ends.
    outgoing: Vec<Vec<Vec<EdgeLanes>>>,
    /// `incoming[node][subtask]`: the actor's receiving ends over all its inputs.
    incoming: Vec<Vec<Vec<AnyBox>>>,
}

/// One actor to start: the chain of operators it runs, and its body.
pub(crate) struct ActorSpec {
    pub(crate) label: String,
    pub(crate) subtask: usize,
    pub(crate) main: ActorMain,
    /// For a source actor: its operator's name, and where to send the epochs
    /// the coordinator ends.
    pub(crate) source: Option<(String, Sender<Epoch>)>,
    /// For an actor ending in a sink: where to send the epochs committed.
    pub(crate) commits: Option<Sender<Epoch>>,
    /// In a clustered query, whether the actor's part of each epoch commits
    /// second ([`CommitOrder`]); a chain's nodes all commit in one tier.
    pub(crate) commits_second: bool,
}

/// Where a starting query resumes: the last committed checkpoint's source offsets
/// and state.
pub(crate) struct Resume<'a> {
    pub(crate) query_id: &'a str,
    pub(crate) run_id: &'a str,
    pub(crate) offsets: &'a BTreeMap<String, Offsets>,
    pub(crate) state: Arc<Restored>,
    /// The epoch the first records of this run belong to.
    pub(crate) first_epoch: Epoch,
}

/// A validated graph with parallelism resolved and actors decided.
pub(crate) struct Plan {
    graph: Graph,
    parallelism: Vec<usize>,
    source_partitions: Vec<usize>,
    /// For source nodes: the partitions this process reads, all of them unless
    /// the query is clustered, as each reader reads them.
    read: Vec<Vec<Vec<usize>>>,
    /// For source nodes: the query-wide number of their partition 0. The
    /// partitions of all sources are numbered in one range, in node order.
    partition_base: Vec<u32>,
    consumers: Vec<Vec<(NodeId, usize)>>,
    /// In a clustered query, the nodes that commit second
    /// ([`CommitOrder`]); none otherwise.
    commits_second: Vec<bool>,
    /// The node fused after each node in the same actor, if any.
    chained_next: Vec<Option<NodeId>>,
    chained_prev: Vec<Option<NodeId>>,
}

impl Plan {
    /// Resolves parallelism (asking sources for their partitions), fuses chains and
    /// checks that the query fits its slots.
    pub(crate) fn new(mut graph: Graph, config: &QueryConfig) -> Result<Self> {
        let n = graph.nodes.len();
        let mut parallelism = vec![0; n];
        let mut source_partitions = vec![0; n];
        let mut owned_partitions = vec![Vec::new(); n];
        for id in 0..n {
            let node = &graph.nodes[id];
            parallelism[id] = match &node.body {
                Body::Source(source, _) => {
                    source_partitions[id] = Place::new(Role::Source, &node.name, 0)
                        .run("Source::partitions", || source.partitions())?;
                    if source_partitions[id] == 0 {
                        return Err(RtflowError::source(
                            &node.name,
                            "the source has no partitions",
                        ));
                    }
                    owned_partitions[id] = match &graph.cluster {
                        None => (0..source_partitions[id]).collect(),
                        Some(link) => source.cluster_partitions(&**link).ok_or_else(|| {
                            RtflowError::InvalidDataflow(format!(
                                "source '{}' ({}) cannot be shared out between the \
                                 processes of a clustered query; read a Kafka topic",
                                node.name,
                                source.description()
                            ))
                        })?,
                    };
                    // A process that owns none of the partitions still runs one
                    // idle reader, so that the dataflow keeps its shape.
                    let width = owned_partitions[id].len().max(1);
                    node.parallelism
                        .unwrap_or_else(|| source.readers(width))
                        .clamp(1, width)
                }
                _ => node.parallelism.unwrap_or_else(|| {
                    let all_forward = node.inputs.iter().all(|e| !e.partitioning.is_shuffle());
                    let widest = node.inputs.iter().map(|e| parallelism[e.from]).max();
                    match widest {
                        Some(p) if all_forward => p,
                        _ => config.default_parallelism,
                    }
                }),
            };
        }
        // A forward edge between different parallelisms deals records round-robin.
        for id in 0..n {
            let width = parallelism[id];
            for edge in &mut graph.nodes[id].inputs {
                if matches!(edge.partitioning, Partitioning::Forward)
                    && parallelism[edge.from] != width
                {
                    edge.partitioning = Partitioning::RoundRobin;
                }
            }
        }
        let consumers = consumers(&graph);
        let mut chained_next = vec![None; n];
        let mut chained_prev = vec![None; n];
        if config.operator_chaining {
            for (id, node) in graph.nodes.iter().enumerate() {
                if let [edge] = node.inputs.as_slice() {
                    if matches!(edge.partitioning, Partitioning::Forward)
                        && consumers[edge.from].len() == 1
                    {
                        chained_next[edge.from] = Some(id);
                        chained_prev[id] = Some(edge.from);
                    }
                }
            }
        }
        let partition_base = source_partitions
            .iter()
            .scan(0u32, |next, count| {
                let base = *next;
                *next += *count as u32;
                Some(base)
            })
            .collect();
        let read = (0..n)
            .map(|id| {
                (0..parallelism[id])
                    .map(|reader| {
                        let owned = owned_partitions[id].iter().enumerate();
                        owned
                            .filter(|(i, _)| reader_of(*i, parallelism[id]) == reader)
                            .map(|(_, p)| *p)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let commits_second = match &graph.cluster {
            Some(link) => {
                let second = graph.commits_second();
                link.commit_order(CommitOrder {
                    read_before_commit: (graph.repartition_ends.iter())
                        .filter(|ends| !second[ends.writer])
                        .map(|ends| ends.stage)
                        .collect(),
                    second: (graph.nodes.iter().enumerate())
                        .filter(|(id, node)| second[*id] && matches!(node.body, Body::Source(..)))
                        .map(|(_, node)| node.uid.clone())
                        .collect(),
                });
                second
            }
            None => vec![false; n],
        };
        let plan = Self {
            graph,
            parallelism,
            commits_second,
            source_partitions,
            read,
            partition_base,
            consumers,
            chained_next,
            chained_prev,
        };
        let needed = plan.actor_count();
        if needed > config.task_slots {
            return Err(RtflowError::InsufficientTaskSlots {
                whose: format!("query '{}'", config.name),
                needed,
                available: config.task_slots,
                fix: format!(
                    "raise QueryConfig::task_slots({needed}) or lower the parallelism of the query"
                ),
            });
        }
        Ok(plan)
    }

    /// The dataflow's shape as [`Dataflow::shape`](crate::Dataflow::shape) gives it.
    pub(crate) fn shape(&self, config: &QueryConfig) -> Vec<String> {
        let mut lines = vec![format!("key groups: {}", config.max_key_groups)];
        for (id, node) in self.graph.nodes.iter().enumerate() {
            let inputs = node
                .inputs
                .iter()
                .map(|edge| {
                    let how = match edge.partitioning {
                        Partitioning::Forward | Partitioning::RoundRobin => "forward",
                        Partitioning::Hash(_) => "by key",
                        Partitioning::Broadcast => "broadcast",
                    };
                    format!("{} {how}", self.graph.nodes[edge.from].uid)
                })
                .collect::<Vec<_>>();
            let what = match &node.body {
                Body::Source(..) => {
                    format!("source of {} partitions", self.source_partitions[id])
                }
                Body::Operator(..) => "operator".to_owned(),
                Body::Sink(sink) => format!("sink {}", sink.description()),
            };
            lines.push(format!(
                "step {id}: {what} '{}' ({}) reading [{}]",
                node.uid,
                node.kind,
                inputs.join(", ")
            ));
        }
        lines
    }

    /// The logical graph the plan runs.
    pub(crate) fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The stable ids of the dataflow's sources, which their offsets are
    /// checkpointed under.
    pub(crate) fn source_uids(&self) -> BTreeSet<&str> {
        self.graph
            .nodes
            .iter()
            .filter(|n| matches!(n.body, Body::Source(..)))
            .map(|n| n.uid.as_str())
            .collect()
    }

    /// The source partitions, numbered query-wide, whose records reach `subtask`
    /// of node `id`, over every input (all of a union's): on forward edges only
    /// those of the source subtask feeding it, those of every subtask of this
    /// process otherwise. In a clustered query a process speaks only for the
    /// partitions it reads: a writer of a repartition tells their watermark,
    /// and the others' are told by the processes that read them.
    fn partitions_reaching(&self, id: NodeId, subtask: usize) -> Vec<u32> {
        let mut found = BTreeSet::new();
        self.collect_partitions(id, Some(subtask), &mut found);
        found.into_iter().collect()
    }

    fn collect_partitions(&self, node: NodeId, subtask: Option<usize>, found: &mut BTreeSet<u32>) {
        if matches!(self.graph.nodes[node].body, Body::Source(..)) {
            let base = self.partition_base[node];
            let readers = &self.read[node];
            let read = match subtask {
                Some(subtask) => &readers[subtask..=subtask],
                None => &readers[..],
            };
            found.extend(read.iter().flatten().map(|p| base + *p as u32));
            return;
        }
        for edge in &self.graph.nodes[node].inputs {
            let forward = matches!(edge.partitioning, Partitioning::Forward);
            self.collect_partitions(edge.from, subtask.filter(|_| forward), found);
        }
    }

    /// Where a handover to `after` leaves the readers and the instances
    /// after them: each reader keeps the partitions of its own that `after`
    /// still owns, and the partitions `after` adds are dealt round the
    /// readers by number. Records the change.
    pub(crate) fn hand_over(&mut self, after: &dyn Membership) -> Reach {
        let mut read = self.read.clone();
        let mut starts_over = false;
        for (id, node) in self.graph.nodes.iter().enumerate() {
            let Body::Source(source, _) = &node.body else {
                continue;
            };
            // A source of one process only (a test's) reads on as it did.
            let Some(owned) = source.cluster_partitions(after) else {
                continue;
            };
            let owned: BTreeSet<usize> = owned.into_iter().collect();
            let held: BTreeSet<usize> = read[id].iter().flatten().copied().collect();
            let readers = read[id].len();
            for reader in &mut read[id] {
                reader.retain(|p| owned.contains(p));
            }
            for adopted in owned.difference(&held) {
                read[id][reader_of(*adopted, readers)].push(*adopted);
                starts_over = true;
            }
            for reader in &mut read[id] {
                reader.sort_unstable();
            }
        }
        self.read = read;
        let mut reach = Reach {
            starts_over,
            ..Reach::default()
        };
        for (id, node) in self.graph.nodes.iter().enumerate() {
            for subtask in 0..self.parallelism[id] {
                let key = (node.uid.clone(), subtask);
                if matches!(node.body, Body::Source(..)) {
                    reach.readers.insert(key, self.read[id][subtask].clone());
                } else {
                    reach
                        .reaching
                        .insert(key, self.partitions_reaching(id, subtask));
                }
            }
        }
        reach
    }

    /// The source partitions, numbered query-wide, that feed `id` over all
    /// its subtasks and in every process.
    fn upstream_partition_count(&self, id: NodeId) -> u32 {
        let mut sources = BTreeSet::new();
        self.collect_sources(id, &mut sources);
        sources
            .into_iter()
            .map(|source| self.source_partitions[source] as u32)
            .sum()
    }

    /// The largest delay of the `with_watermark`s on the ways from the
    /// sources to `id`, if every way has one.
    fn watermark_delay_before(&self, id: NodeId) -> Option<Duration> {
        let node = &self.graph.nodes[id];
        if node.watermark_delay.is_some() {
            return node.watermark_delay;
        }
        // A source has no inputs, hence no delay.
        node.inputs
            .iter()
            .map(|edge| self.watermark_delay_before(edge.from))
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    }

    fn collect_sources(&self, node: NodeId, found: &mut BTreeSet<NodeId>) {
        if matches!(self.graph.nodes[node].body, Body::Source(..)) {
            found.insert(node);
        }
        for edge in &self.graph.nodes[node].inputs {
            self.collect_sources(edge.from, found);
        }
    }

    fn heads(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.graph.nodes.len()).filter(|id| self.chained_prev[*id].is_none())
    }

    /// Long-running actors (and so slots) the query needs.
    pub(crate) fn actor_count(&self) -> usize {
        self.heads().map(|head| self.parallelism[head]).sum()
    }

    fn chain(&self, head: NodeId) -> Vec<NodeId> {
        let mut chain = vec![head];
        while let Some(next) = self.chained_next[*chain.last().expect("non-empty")] {
            chain.push(next);
        }
        chain
    }

    /// Makes a bounded lane for every pair of actors joined by an edge that is not
    /// fused into one actor.
    fn lanes(&self, config: &QueryConfig, metrics: &QueryMetrics) -> Lanes {
        let mut outgoing: Vec<Vec<Vec<EdgeLanes>>> = self
            .parallelism
            .iter()
            .map(|p| (0..*p).map(|_| Vec::new()).collect())
            .collect();
        let mut incoming: Vec<Vec<Vec<AnyBox>>> = self
            .parallelism
            .iter()
            .map(|p| (0..*p).map(|_| Vec::new()).collect())
            .collect();
        for (from, node) in self.graph.nodes.iter().enumerate() {
            let Some(port) = node.body.port() else {
                continue;
            };
            for &(to, edge) in &self.consumers[from] {
                if self.chained_prev[to] == Some(from) {
                    continue;
                }
                let consumer = &self.graph.nodes[to];
                let forward = matches!(consumer.inputs[edge].partitioning, Partitioning::Forward);
                for outputs in &mut outgoing[from] {
                    outputs.push(Vec::new());
                }
                for (receiver, inbox) in incoming[to].iter_mut().enumerate() {
                    let mailbox =
                        metrics.mailbox(&consumer.name, receiver, config.mailbox_capacity);
                    for (sender, outputs) in outgoing[from].iter_mut().enumerate() {
                        if forward && sender != receiver {
                            continue;
                        }
                        let (tx, rx) = port.lane(config.mailbox_capacity);
                        outputs
                            .last_mut()
                            .expect("edge added above")
                            .push((tx, mailbox.clone()));
                        inbox.push(rx);
                    }
                }
            }
        }
        Lanes { outgoing, incoming }
    }

    /// Makes every lane, dispatcher, operator instance and reader, and returns the
    /// body of every actor, named.
    pub(crate) fn wire(
        &self,
        config: &QueryConfig,
        metrics: &QueryMetrics,
        env: &ActorEnv,
        resume: &Resume<'_>,
    ) -> Result<Vec<ActorSpec>> {
        let Lanes {
            mut outgoing,
            mut incoming,
        } = self.lanes(config, metrics);
        let mut actors = Vec::with_capacity(self.actor_count());
        for head in self.heads().collect::<Vec<_>>() {
            let chain = self.chain(head);
            let tail = *chain.last().expect("non-empty");
            let label = chain
                .iter()
                .map(|id| self.graph.nodes[*id].name.as_str())
                .collect::<Vec<_>>()
                .join(" -> ");
            for subtask in (0..self.parallelism[head]).rev() {
                let mut emit = self.outputs(tail, subtask, outgoing[tail].pop(), config, env);
                let snapshots = crate::operator::SnapshotBuffer::default();
                let mut commits = None;
                for &id in chain.iter().rev() {
                    let node = &self.graph.nodes[id];
                    let parallelism = self.parallelism[id];
                    let state = StateContext {
                        uid: node.uid.clone(),
                        kind: node.kind.clone(),
                        subtask,
                        parallelism,
                        restored: resume.state.clone(),
                        claims: Arc::default(),
                    };
                    emit = Some(match &node.body {
                        Body::Sink(sink) => {
                            let ctx = SinkContext {
                                query: config.name.clone(),
                                query_id: resume.query_id.to_owned(),
                                run_id: resume.run_id.to_owned(),
                                uid: node.uid.clone(),
                                name: node.name.clone(),
                                subtask,
                                parallelism,
                                batch_duration: config.trigger.batch_duration()?,
                                first_epoch: resume.first_epoch,
                                state,
                                checkpoint_location: config.checkpoint_location.clone(),
                                source_partitions: self.partitions_reaching(id, subtask),
                                upstream_partitions: self.upstream_partition_count(id),
                                watermark_delay: self.watermark_delay_before(id),
                                cluster: (self.graph.cluster.clone())
                                    .map(|link| link as Arc<dyn Membership>),
                                commits_second: self.commits_second[id],
                            };
                            let (sender, receiver) = crossbeam_channel::unbounded();
                            commits = Some(sender);
                            let wiring = SinkWiring {
                                snapshots: snapshots.clone(),
                                commits: receiver,
                                cancel: env.cancel.clone(),
                            };
                            sink.chain(&ctx, &node.name, metrics, wiring)?
                        }
                        Body::Operator(operator, _) => {
                            let ctx = OperatorContext {
                                operator: node.name.clone(),
                                subtask,
                                parallelism,
                                source_partitions: self.partitions_reaching(id, subtask),
                                state,
                            };
                            operator.chain(
                                &ctx,
                                emit.expect("an operator has an output"),
                                metrics,
                                snapshots.clone(),
                            )?
                        }
                        Body::Source(..) => break,
                    });
                }
                let emit = emit.expect("every actor ends in outputs or a sink");
                let node = &self.graph.nodes[head];
                let env = ActorEnv {
                    actor: actors.len(),
                    snapshots,
                    chain: Place::new(Role::Operator, &label, subtask),
                    handovers: resume.state.handovers.clone(),
                    ..env.clone()
                };
                let (main, source) = match &node.body {
                    Body::Source(source, _) => {
                        let waker = SourceWaker::default();
                        let readers = self.parallelism[head];
                        let ctx = SourceContext {
                            subtask,
                            parallelism: readers,
                            partitions: self.read[head][subtask].clone(),
                            start_offsets: resume
                                .offsets
                                .get(&node.uid)
                                .cloned()
                                .unwrap_or_default(),
                            waker: waker.clone(),
                            lag: metrics.source_lag(&node.name, subtask),
                        };
                        let place = Place::new(Role::Source, &node.name, subtask);
                        let reader = source.open(&place, &ctx)?;
                        let (barriers, epochs) = crossbeam_channel::unbounded();
                        let env = ActorEnv {
                            source_metrics: Some(metrics.operator(
                                &node.name,
                                subtask,
                                Role::Source,
                            )),
                            barriers: Some(epochs),
                            waker: Some(waker),
                            partition_base: self.partition_base[head],
                            first_partition: ctx.partitions.first().map_or(0, |p| *p as u32),
                            reading: Some(Reading {
                                uid: node.uid.clone(),
                                subtask,
                                partitions: ctx.partitions.clone(),
                            }),
                            ..env
                        };
                        (
                            source.actor(place, reader, emit, env),
                            Some((node.uid.clone(), barriers)),
                        )
                    }
                    _ => {
                        let upstream = node.inputs[0].from;
                        let port = self.graph.nodes[upstream]
                            .body
                            .port()
                            .expect("an input comes from a node with outputs");
                        let lanes = std::mem::take(&mut incoming[head][subtask]);
                        (port.inbox_actor(lanes, emit, env), None)
                    }
                };
                actors.push(ActorSpec {
                    label: label.clone(),
                    subtask,
                    main,
                    source,
                    commits,
                    commits_second: self.commits_second[head],
                });
            }
        }
        Ok(actors)
    }

    /// The dispatchers of `tail`'s subtask to every consumer, fanned out if several.
    fn outputs(
        &self,
        tail: NodeId,
        subtask: usize,
        lanes: Option<Vec<EdgeLanes>>,
        config: &QueryConfig,
        env: &ActorEnv,
    ) -> Option<AnyBox> {
        let port = self.graph.nodes[tail].body.port()?;
        let mut outputs: Vec<AnyBox> = lanes
            .expect("senders exist for every subtask")
            .into_iter()
            .zip(&self.consumers[tail])
            .map(|(lanes, &(to, edge))| {
                let consumer = &self.graph.nodes[to];
                port.output(
                    lanes,
                    &consumer.inputs[edge].partitioning,
                    Place::new(Role::Operator, &consumer.name, subtask),
                    config.max_key_groups,
                    config.max_records_per_message,
                    env.cancel.clone(),
                )
            })
            .collect();
        Some(if outputs.len() == 1 {
            outputs.pop().expect("one output")
        } else {
            port.fanout(outputs)
        })
    }
}

/// Which of a source's `readers` reads its partition `partition`: partitions are
/// dealt round the readers, so each reads at most one more than another.
fn reader_of(partition: usize, readers: usize) -> usize {
    partition % readers
}
