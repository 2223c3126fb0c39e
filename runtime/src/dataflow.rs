//! The builder: [`Dataflow`] owns the graph under construction, [`Stream`] is
//! a handle on one edge of it, [`KeyedStream`] one after a `key_by`.

use std::cell::RefCell;
use std::hash::Hash;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::cluster::repartition::{self, Decode, Encode};
use crate::cluster::ClusterLink;
use crate::config::QueryConfig;
use crate::connector::{Sink, Source};
use crate::dispatch::{KeyHash, Partitioning};
use crate::error::Result;
use crate::graph::{Edge, Graph, Node, NodeId, RepartitionEnds, WITH_WATERMARK};
use crate::key_groups::stable_hash;
use crate::operator::{Operator, OperatorContext};
use crate::query::{Prepared, Start, StreamingQuery};
use crate::record::{Data, EventTime};
use crate::watermark::AssignWatermarks;
use crate::wiring::{Body, OperatorNode, PortOf, SinkNode, SourceNode};

/// A dataflow under construction: add sources, transform their streams, end them in
/// sinks, then [`start`](Dataflow::start) it as a query.
///
/// ```no_run
/// use rtflow_runtime::{Dataflow, QueryConfig};
/// # fn build(flow: &Dataflow) {}
/// let flow = Dataflow::new("clicks");
/// build(&flow);
/// let query = flow.start(QueryConfig::new("clicks").checkpoint_location("/tmp/clicks"))?;
/// query.stop()?;
/// # Ok::<(), rtflow_runtime::RtflowError>(())
/// ```
pub struct Dataflow {
    name: String,
    graph: Rc<RefCell<Graph>>,
}

impl Dataflow {
    /// An empty dataflow.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            graph: Rc::default(),
        }
    }

    /// The dataflow's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A dataflow run by one process of a cluster: its sources read the
    /// partitions `link` assigns to the process, and each
    /// [`repartition_by`](Stream::repartition_by) goes through the cluster.
    /// Cluster runners (rtflow-connectors' Kafka cluster) build with it.
    pub fn clustered(name: impl Into<String>, link: Arc<dyn ClusterLink>) -> Self {
        let flow = Self::new(name);
        flow.graph.borrow_mut().cluster = Some(link);
        flow
    }

    /// Adds a source; one source actor runs per source partition.
    pub fn source<T: Data>(&self, source: impl Source<T>) -> Stream<T> {
        let kind = source.kind().to_owned();
        let body = Body::Source(
            Box::new(SourceNode::new(source)),
            Arc::new(PortOf::<T>::new()),
        );
        let id = self.graph.borrow_mut().add(&kind, body, Vec::new());
        Stream::new(self.graph.clone(), vec![(id, Partitioning::Forward)])
    }

    /// Validates and plans the dataflow without starting it, and describes its
    /// shape: one line per step (kind, uid, inputs) and the key-group count.
    /// The processes of a clustered query compare shapes, since they must run
    /// the same dataflow.
    ///
    /// ```no_run
    /// use rtflow_runtime::{Dataflow, QueryConfig};
    /// # fn build(flow: &Dataflow) {}
    /// let flow = Dataflow::new("clicks");
    /// build(&flow);
    /// for step in flow.shape(&QueryConfig::new("clicks").checkpoint_location("/tmp/clicks"))? {
    ///     println!("{step}"); // step 0: source of 2 partitions 'kafka-0' (kafka) reading []
    /// }
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn shape(self, config: &QueryConfig) -> Result<Vec<String>> {
        let graph = self.graph.take();
        config.check(graph.cluster.is_none())?;
        crate::plan::validate(&graph, config)?;
        let plan = crate::plan::Plan::new(graph, config)?;
        Ok(plan.shape(config))
    }

    /// Validates the dataflow and configuration, starts one long-running actor per
    /// operator instance, and returns the running query.
    pub fn start(self, config: QueryConfig) -> Result<StreamingQuery> {
        StreamingQuery::launch(self.prepare(config)?, Start::Now)
    }

    /// Runs the start-time checks of [`start`](Self::start), and starts nothing.
    pub(crate) fn prepare(self, config: QueryConfig) -> Result<Prepared> {
        Prepared::new(self.graph.take(), config)
    }
}

/// A handle on one stream of a dataflow under construction.
pub struct Stream<T> {
    graph: Rc<RefCell<Graph>>,
    /// Where the stream's records come from: one producer, or several after `union`,
    /// each with how its records are spread over the next operator's instances.
    ports: Vec<(NodeId, Partitioning)>,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for Stream<T> {
    fn clone(&self) -> Self {
        Self {
            graph: self.graph.clone(),
            ports: self.ports.clone(),
            _type: PhantomData,
        }
    }
}

impl<T: Data> Stream<T> {
    fn new(graph: Rc<RefCell<Graph>>, ports: Vec<(NodeId, Partitioning)>) -> Self {
        Self {
            graph,
            ports,
            _type: PhantomData,
        }
    }

    fn inputs(&self) -> Vec<Edge> {
        self.ports
            .iter()
            .map(|(from, partitioning)| Edge {
                from: *from,
                partitioning: partitioning.clone(),
            })
            .collect()
    }

    fn with_partitioning(&self, partitioning: Partitioning) -> Self {
        let ports = self
            .ports
            .iter()
            .map(|(from, _)| (*from, partitioning.clone()))
            .collect();
        Self::new(self.graph.clone(), ports)
    }

    /// The node producing this stream, or a builder error when it is a union.
    fn with_producer(&self, what: &str, change: impl FnOnce(&mut Node)) {
        let mut graph = self.graph.borrow_mut();
        match self.ports.as_slice() {
            [(id, _)] => change(&mut graph.nodes[*id]),
            _ => graph.errors.push(format!(
                "{what} applies to the output of one operator, not to a union; \
                 set it on each input of the union instead"
            )),
        }
    }

    /// Adds an operator of family `kind` (its name in metrics, errors and state)
    /// whose instances `factory` makes, one per subtask. Operators of
    /// rtflow-operators are built with it; one of your own is outside the
    /// real-time allowlist ([`Operator::allowlisted`]) unless the check is
    /// disabled.
    pub fn transform<U: Data, O, F>(&self, kind: &str, factory: F) -> Stream<U>
    where
        O: Operator<T, U>,
        F: Fn(&OperatorContext) -> O + Send + Sync + 'static,
    {
        self.try_transform(kind, move |ctx| Ok(factory(ctx)))
    }

    /// Like [`transform`](Self::transform), for operators whose making can
    /// fail: one that claims its state from `ctx.state` when made, and so holds
    /// it from the start (see [`crate::state`]).
    pub fn try_transform<U: Data, O, F>(&self, kind: &str, factory: F) -> Stream<U>
    where
        O: Operator<T, U>,
        F: Fn(&OperatorContext) -> Result<O> + Send + Sync + 'static,
    {
        let body = Body::Operator(
            Box::new(OperatorNode::<T, U, O, F>::new(factory)),
            Arc::new(PortOf::<U>::new()),
        );
        let id = self.graph.borrow_mut().add(kind, body, self.inputs());
        Stream::new(self.graph.clone(), vec![(id, Partitioning::Forward)])
    }

    /// Names the operator that produces this stream (in metrics, errors and threads).
    pub fn name(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.with_producer("name", |node| node.name = name);
        self
    }

    /// Sets the stable id the operator producing this stream keeps its checkpointed
    /// state under (Flink's `uid`), so a restart after the dataflow changed finds
    /// it. Without one, the id is the operator's kind and its rank among operators
    /// of that kind.
    pub fn uid(self, uid: impl Into<String>) -> Self {
        let uid = uid.into();
        self.with_producer("uid", |node| node.uid = uid);
        self
    }

    /// Sets how many instances of the operator producing this stream run.
    pub fn parallelism(self, parallelism: usize) -> Self {
        if parallelism == 0 {
            self.graph
                .borrow_mut()
                .errors
                .push("parallelism must be at least 1".into());
        }
        self.with_producer("parallelism", |node| node.parallelism = Some(parallelism));
        self
    }

    /// Merges streams of the same type. The inputs must read distinct sources.
    pub fn union(&self, other: &Stream<T>) -> Stream<T> {
        let mut ports = self.ports.clone();
        ports.extend(other.ports.iter().cloned());
        self.graph
            .borrow_mut()
            .unions
            .push(ports.iter().map(|(id, _)| *id).collect());
        Stream::new(self.graph.clone(), ports)
    }

    /// Shuffles records by key: all records with the same key reach the same
    /// instance of the next operator, in the order they were sent.
    pub fn key_by<K: Hash, F>(&self, key: F) -> KeyedStream<K, T>
    where
        F: Fn(&T) -> K + Send + Sync + 'static,
    {
        let key = Arc::new(key);
        let hash_key = key.clone();
        let key_hash: KeyHash<T> = Arc::new(move |value: &T| stable_hash(&hash_key(value)));
        KeyedStream {
            stream: self.with_partitioning(Partitioning::hash(key_hash)),
            key,
        }
    }

    /// Like [`key_by`](Self::key_by), and also across the processes of a
    /// clustered query: there the records go through a repartition topic of
    /// the cluster, encoded with serde, so that each key reaches the process
    /// that owns its key group, with the watermark in band. In a query of one
    /// process it is `key_by`.
    ///
    /// A clustered query may repartition any number of times, one after
    /// another (a count per user, then by the count's bucket) or side by side:
    /// each `repartition_by` is a stage with a topic of its own, and a
    /// process owns the same partitions of every stage's topic, so keyed
    /// state after any of them stays with its key group. Stream joins and
    /// `drop_duplicates` shuffle with it, so they run clustered too; only a
    /// `key_by` is refused there (`INVALID_DATAFLOW`), since it shuffles
    /// within one process.
    ///
    /// ```no_run
    /// use rtflow_runtime::{Dataflow, Stream};
    /// # fn words(flow: &Dataflow) -> Stream<String> { unimplemented!() }
    /// let flow = Dataflow::new("words");
    /// let by_word = words(&flow).repartition_by(|word: &String| word.clone());
    /// ```
    pub fn repartition_by<K: Hash, F>(&self, key: F) -> KeyedStream<K, T>
    where
        F: Fn(&T) -> K + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
    {
        let cluster = self.graph.borrow().cluster.clone();
        let Some(link) = cluster else {
            return self.key_by(key);
        };
        let stage = {
            let mut graph = self.graph.borrow_mut();
            graph.repartitions += 1;
            graph.repartitions - 1
        };
        let (sink, source) = match link.exchange(stage) {
            Ok(pair) => pair,
            Err(error) => {
                self.graph.borrow_mut().errors.push(error.to_string());
                return self.key_by(key);
            }
        };
        let key = Arc::new(key);
        let hash_key = key.clone();
        let key_hash = Arc::new(move |value: &T| stable_hash(&hash_key(value)));
        self.transform(repartition::ENCODE, move |_| Encode {
            key_hash: key_hash.clone(),
        })
        .sink(sink);
        let flow = Dataflow {
            name: String::new(),
            graph: self.graph.clone(),
        };
        let read_back = flow.source(source);
        {
            let mut graph = self.graph.borrow_mut();
            // The sink just added, then the source.
            let reader = graph.nodes.len() - 1;
            let ends = RepartitionEnds {
                writer: reader - 1,
                reader,
                stage,
            };
            graph.repartition_ends.push(ends);
        }
        let decoded = read_back.transform(repartition::DECODE, |_| Decode::<T>(PhantomData));
        let keyed = decoded.key_by(move |value: &T| key(value));
        keyed
            .stream
            .graph
            .borrow_mut()
            .exchanges
            .extend(keyed.stream.ports.iter().cloned());
        keyed
    }

    /// Deals records to the next operator's instances in turn.
    pub fn rebalance(&self) -> Stream<T> {
        self.with_partitioning(Partitioning::RoundRobin)
    }

    /// Sends every record to every instance of the next operator.
    pub fn broadcast(&self) -> Stream<T> {
        self.with_partitioning(Partitioning::Broadcast)
    }

    /// Declares event time: `event_time` reads it from each record (ms). The
    /// watermark is the minimum over the source's partitions of the largest event
    /// time each delivered, minus `delay`; it travels with the records, in real
    /// time. It must come before any shuffle.
    pub fn with_watermark<F>(&self, event_time: F, delay: Duration) -> Stream<T>
    where
        F: Fn(&T) -> EventTime + Send + Sync + 'static,
    {
        self.watermark(Arc::new(event_time), delay, None)
    }

    /// Like [`with_watermark`](Self::with_watermark), but a partition that
    /// delivered nothing for `idle_timeout` stops holding the watermark back.
    pub fn with_watermark_idle<F>(
        &self,
        event_time: F,
        delay: Duration,
        idle_timeout: Duration,
    ) -> Stream<T>
    where
        F: Fn(&T) -> EventTime + Send + Sync + 'static,
    {
        self.watermark(Arc::new(event_time), delay, Some(idle_timeout))
    }

    fn watermark(
        &self,
        event_time: Arc<dyn Fn(&T) -> EventTime + Send + Sync>,
        delay: Duration,
        idle_timeout: Option<Duration>,
    ) -> Stream<T> {
        let stream = self.transform(WITH_WATERMARK, move |_| AssignWatermarks {
            event_time: event_time.clone(),
            delay,
            idle_timeout,
            tracker: None,
            mark_behind: false,
        });
        stream.with_producer(WITH_WATERMARK, |node| node.watermark_delay = Some(delay));
        stream
    }

    /// Ends the stream in a sink; one sink actor runs per instance.
    pub fn sink(&self, sink: impl Sink<T>) {
        let kind = sink.kind().to_owned();
        let body = Body::Sink(Box::new(SinkNode::new(sink)));
        self.graph.borrow_mut().add(&kind, body, self.inputs());
    }
}

impl<T> AsRef<Stream<T>> for Stream<T> {
    fn as_ref(&self) -> &Stream<T> {
        self
    }
}

/// A stream shuffled by key (see [`Stream::key_by`]); keyed operators build on it.
pub struct KeyedStream<K, T> {
    stream: Stream<T>,
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
}

impl<K, T: Data> KeyedStream<K, T> {
    /// The key function, for keyed operators.
    pub fn key_fn(&self) -> Arc<dyn Fn(&T) -> K + Send + Sync> {
        self.key.clone()
    }

    /// Ends the stream in a sink: each key's records reach one sink instance.
    pub fn sink(&self, sink: impl Sink<T>) {
        self.stream.sink(sink)
    }
}

impl<K, T> AsRef<Stream<T>> for KeyedStream<K, T> {
    fn as_ref(&self) -> &Stream<T> {
        &self.stream
    }
}
