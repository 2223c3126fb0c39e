//! Type erasure between the typed builder and the untyped plan.
//!
//! The graph stores nodes of different record types side by side. Each node keeps
//! typed closures behind the small traits below; the planner joins them through
//! `AnyBox` values that are downcast back to their one possible type at start-up,
//! never per record.

use std::any::{Any, TypeId};
use std::marker::PhantomData;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use crate::actor::{run_inbox, run_source, ActorEnv};
use crate::cancel::Cancel;
use crate::cluster::membership::Membership;
use crate::cluster::Exchanged;
use crate::connector::{
    Sink, SinkContext, SinkEmit, SinkWiring, Source, SourceContext, SourceReader,
};
use crate::dispatch::{Fanout, Output, Partitioning};
use crate::error::Result;
use crate::guard::Place;
use crate::metrics::{MailboxMetrics, QueryMetrics, Role};
use crate::operator::{Chained, Emit, Operator, OperatorContext, SnapshotBuffer};
use crate::record::{Data, Message};

/// A typed value on its way between two typed closures.
pub(crate) type AnyBox = Box<dyn Any + Send>;

/// The body of one actor thread.
pub(crate) type ActorMain = Box<dyn FnOnce() -> Result<()> + Send>;

/// What a node is, with the typed pieces the planner needs.
pub(crate) enum Body {
    Source(Box<dyn ErasedSource>, Arc<dyn ErasedPort>),
    Operator(Box<dyn ErasedOperator>, Arc<dyn ErasedPort>),
    Sink(Box<dyn ErasedSink>),
}

impl Body {
    /// The type of the node's output edges, if it has any.
    pub(crate) fn port(&self) -> Option<&Arc<dyn ErasedPort>> {
        match self {
            Self::Source(_, port) | Self::Operator(_, port) => Some(port),
            Self::Sink(_) => None,
        }
    }
}

fn unbox<T: 'static>(any: AnyBox) -> T {
    *any.downcast::<T>()
        .expect("the planner joins only nodes of matching record types")
}

pub(crate) trait ErasedSource: Send {
    fn description(&self) -> String;
    fn supports_real_time(&self) -> bool;
    fn partitions(&self) -> Result<usize>;
    fn readers(&self, partitions: usize) -> usize;
    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>>;
    /// The reader of `ctx`'s partitions, for the source at `place`.
    fn open(&self, place: &Place, ctx: &SourceContext) -> Result<AnyBox>;
    fn actor(&self, place: Place, reader: AnyBox, emit: AnyBox, env: ActorEnv) -> ActorMain;
}

pub(crate) struct SourceNode<T> {
    source: Box<dyn Source<T>>,
}

impl<T: Data> SourceNode<T> {
    pub(crate) fn new(source: impl Source<T>) -> Self {
        Self {
            source: Box::new(source),
        }
    }
}

impl<T: Data> ErasedSource for SourceNode<T> {
    fn description(&self) -> String {
        self.source.description()
    }

    fn supports_real_time(&self) -> bool {
        self.source.supports_real_time()
    }

    fn partitions(&self) -> Result<usize> {
        self.source.partitions()
    }

    fn readers(&self, partitions: usize) -> usize {
        self.source.readers(partitions)
    }

    fn cluster_partitions(&self, link: &dyn Membership) -> Option<Vec<usize>> {
        self.source.cluster_partitions(link)
    }

    fn open(&self, place: &Place, ctx: &SourceContext) -> Result<AnyBox> {
        Ok(Box::new(
            place.run("Source::reader", || self.source.reader(ctx))?,
        ))
    }

    fn actor(&self, place: Place, reader: AnyBox, emit: AnyBox, env: ActorEnv) -> ActorMain {
        let reader: Box<dyn SourceReader<T>> = unbox(reader);
        let emit: Box<dyn Emit<T>> = unbox(emit);
        Box::new(move || run_source(&place, reader, emit, env))
    }
}

pub(crate) trait ErasedOperator: Send {
    fn stateful(&self) -> bool;
    fn allowlisted(&self) -> bool;
    fn chain(
        &self,
        ctx: &OperatorContext,
        next: AnyBox,
        metrics: &QueryMetrics,
        snapshots: SnapshotBuffer,
    ) -> Result<AnyBox>;
}

pub(crate) struct OperatorNode<In, Out, O, F> {
    factory: Arc<F>,
    _types: PhantomData<fn(In, O) -> Out>,
}

impl<In, Out, O, F> OperatorNode<In, Out, O, F> {
    pub(crate) fn new(factory: F) -> Self {
        Self {
            factory: Arc::new(factory),
            _types: PhantomData,
        }
    }
}

impl<In, Out, O, F> ErasedOperator for OperatorNode<In, Out, O, F>
where
    In: Data,
    Out: Data,
    O: Operator<In, Out>,
    F: Fn(&OperatorContext) -> Result<O> + Send + Sync + 'static,
{
    fn stateful(&self) -> bool {
        O::stateful()
    }

    fn allowlisted(&self) -> bool {
        O::allowlisted()
    }

    fn chain(
        &self,
        ctx: &OperatorContext,
        next: AnyBox,
        metrics: &QueryMetrics,
        snapshots: SnapshotBuffer,
    ) -> Result<AnyBox> {
        let next: Box<dyn Emit<Out>> = unbox(next);
        let chained = Chained::start(
            &*self.factory,
            Some(self.factory.clone()),
            ctx,
            next,
            metrics.operator(&ctx.operator, ctx.subtask, Role::Operator),
            snapshots,
        )?;
        let emit: Box<dyn Emit<In>> = Box::new(chained);
        Ok(Box::new(emit))
    }
}

pub(crate) trait ErasedSink: Send {
    fn description(&self) -> String;
    fn supports_real_time(&self) -> bool;
    fn allowlisted(&self) -> bool;
    fn chain(
        &self,
        ctx: &SinkContext,
        name: &str,
        metrics: &QueryMetrics,
        wiring: SinkWiring,
    ) -> Result<AnyBox>;
}

pub(crate) struct SinkNode<T> {
    sink: Box<dyn Sink<T>>,
}

impl<T: Data> SinkNode<T> {
    pub(crate) fn new(sink: impl Sink<T>) -> Self {
        Self {
            sink: Box::new(sink),
        }
    }
}

impl<T: Data> ErasedSink for SinkNode<T> {
    fn description(&self) -> String {
        self.sink.description()
    }

    fn supports_real_time(&self) -> bool {
        self.sink.supports_real_time()
    }

    fn allowlisted(&self) -> bool {
        self.sink.allowlisted()
    }

    fn chain(
        &self,
        ctx: &SinkContext,
        name: &str,
        metrics: &QueryMetrics,
        wiring: SinkWiring,
    ) -> Result<AnyBox> {
        let place = Place::new(Role::Sink, name, ctx.subtask);
        let writer = place.run("Sink::writer", || self.sink.writer(ctx))?;
        let role = if TypeId::of::<T>() == TypeId::of::<Exchanged>() {
            Role::Exchange
        } else {
            Role::Sink
        };
        let emit: Box<dyn Emit<T>> = Box::new(SinkEmit::new(
            place,
            writer,
            metrics.latency_recorder(),
            metrics.operator(name, ctx.subtask, role),
            wiring,
            ctx,
        ));
        Ok(Box::new(emit))
    }
}

/// The record type of a node's output edges: makes their channels, dispatchers and
/// the input loop of the actors that read them.
pub(crate) trait ErasedPort: Send + Sync {
    /// A bounded mailbox lane: (sender, receiver).
    fn lane(&self, capacity: usize) -> (AnyBox, AnyBox);
    fn output(
        &self,
        lanes: Vec<(AnyBox, Arc<MailboxMetrics>)>,
        partitioning: &Partitioning,
        consumer: Place,
        max_key_groups: usize,
        max_records: usize,
        cancel: Cancel,
    ) -> AnyBox;
    fn fanout(&self, outputs: Vec<AnyBox>) -> AnyBox;
    fn inbox_actor(&self, lanes: Vec<AnyBox>, emit: AnyBox, env: ActorEnv) -> ActorMain;
}

pub(crate) struct PortOf<T>(PhantomData<fn() -> T>);

impl<T> PortOf<T> {
    pub(crate) fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T: Data> ErasedPort for PortOf<T> {
    fn lane(&self, capacity: usize) -> (AnyBox, AnyBox) {
        let (sender, receiver) = crossbeam_channel::bounded::<Message<T>>(capacity);
        (Box::new(sender), Box::new(receiver))
    }

    fn output(
        &self,
        lanes: Vec<(AnyBox, Arc<MailboxMetrics>)>,
        partitioning: &Partitioning,
        consumer: Place,
        max_key_groups: usize,
        max_records: usize,
        cancel: Cancel,
    ) -> AnyBox {
        let lanes = lanes
            .into_iter()
            .map(|(sender, metrics)| (unbox::<Sender<Message<T>>>(sender), metrics))
            .collect();
        let emit: Box<dyn Emit<T>> = Box::new(Output::new(
            lanes,
            partitioning,
            consumer,
            max_key_groups,
            max_records,
            cancel,
        ));
        Box::new(emit)
    }

    fn fanout(&self, outputs: Vec<AnyBox>) -> AnyBox {
        let outputs: Vec<Box<dyn Emit<T>>> = outputs.into_iter().map(unbox).collect();
        let emit: Box<dyn Emit<T>> = Box::new(Fanout { outputs });
        Box::new(emit)
    }

    fn inbox_actor(&self, lanes: Vec<AnyBox>, emit: AnyBox, env: ActorEnv) -> ActorMain {
        let lanes: Vec<Receiver<Message<T>>> = lanes.into_iter().map(unbox).collect();
        let emit: Box<dyn Emit<T>> = unbox(emit);
        Box::new(move || run_inbox(lanes, emit, env))
    }
}
