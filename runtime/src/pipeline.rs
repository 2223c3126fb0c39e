//! Declarative pipelines, as Lakeflow's: sinks created once by name
//! ([`Pipeline::create_sink`]), real-time update flows that write into them
//! ([`Pipeline::update_flow`]), each flow a query of its own with its own
//! trigger and checkpoint location, and one [`RunningPipeline`] handle that
//! starts, stops and watches them all. The flows of a pipeline share its task
//! slots, and start all or none.
//!
//! ```
//! use rtflow_runtime::pipeline::Pipeline;
//! use rtflow_runtime::{Dataflow, Result, Sink, Source};
//!
//! fn shop(
//!     orders: impl Source<u64>,
//!     refunds: impl Source<u64>,
//!     alerts: impl Sink<u64>,
//! ) -> Result<()> {
//!     let mut pipeline = Pipeline::new("shop").checkpoint_root("/tmp/rtflow/shop").task_slots(8);
//!     let amounts = pipeline.create_sink("amounts", alerts);
//!     pipeline.update_flow("orders", &amounts, |config| config, move |flow: &Dataflow| {
//!         flow.source(orders)
//!     });
//!     pipeline.update_flow("refunds", &amounts, |config| config, move |flow: &Dataflow| {
//!         flow.source(refunds)
//!     });
//!     let running = pipeline.start()?;
//!     for (flow, progress) in running.last_progress() {
//!         println!("{flow}: {:?}", progress.map(|p| p.num_input_rows));
//!     }
//!     running.stop()
//! }
//! ```

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::{QueryConfig, Trigger};
use crate::connector::{Sink, SinkContext, SinkWriter};
use crate::dataflow::{Dataflow, Stream};
use crate::error::{Result, RtflowError};
use crate::guard;
use crate::progress::StreamingQueryProgress;
use crate::query::{Prepared, Start, StreamingQuery};
use crate::record::Data;
use crate::shutdown::{StopRequest, Stoppable};

/// A sink created once in a pipeline, which any of its flows write into: each
/// flow opens writers of its own on it.
pub struct NamedSink<T> {
    name: String,
    kind: String,
    supports_real_time: bool,
    allowlisted: bool,
    sink: Arc<Mutex<Box<dyn Sink<T>>>>,
}

impl<T> Clone for NamedSink<T> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            kind: self.kind.clone(),
            supports_real_time: self.supports_real_time,
            allowlisted: self.allowlisted,
            sink: self.sink.clone(),
        }
    }
}

impl<T> NamedSink<T> {
    /// The name the sink was created under.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<T: Data> Sink<T> for NamedSink<T> {
    fn kind(&self) -> &str {
        &self.kind
    }

    fn description(&self) -> String {
        let sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        format!("{} ({})", self.name, sink.description())
    }

    fn supports_real_time(&self) -> bool {
        self.supports_real_time
    }

    fn allowlisted(&self) -> bool {
        self.allowlisted
    }

    fn writer(&self, ctx: &SinkContext) -> Result<Box<dyn SinkWriter<T>>> {
        let sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        sink.writer(ctx)
    }
}

/// One update flow: how to build its dataflow, and its query's settings.
struct Flow {
    name: String,
    config: QueryConfig,
    build: Box<dyn FnOnce(&Dataflow)>,
}

/// A pipeline under construction.
pub struct Pipeline {
    name: String,
    checkpoint_root: Option<PathBuf>,
    task_slots: usize,
    sinks: BTreeSet<String>,
    flows: Vec<Flow>,
    /// Misuse found while building, reported by `start`.
    errors: Vec<String>,
}

/// A flow's checkpoint interval unless its configuration sets another:
/// Lakeflow's default `pipelines.trigger.interval`.
const DEFAULT_FLOW_INTERVAL: Duration = Duration::from_secs(300);

impl Pipeline {
    /// An empty pipeline with [`QueryConfig::DEFAULT_TASK_SLOTS`] slots.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            checkpoint_root: None,
            task_slots: QueryConfig::DEFAULT_TASK_SLOTS,
            sinks: BTreeSet::new(),
            flows: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Where the flows keep their checkpoints: each under `root/<flow name>`.
    pub fn checkpoint_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.checkpoint_root = Some(root.into());
        self
    }

    /// The task slots all the pipeline's flows share.
    pub fn task_slots(mut self, slots: usize) -> Self {
        self.task_slots = slots;
        self
    }

    /// Creates the sink `name`, which flows then write into.
    pub fn create_sink<T: Data>(&mut self, name: &str, sink: impl Sink<T>) -> NamedSink<T> {
        if !self.sinks.insert(name.to_owned()) {
            self.errors
                .push(format!("the pipeline has two sinks named '{name}'"));
        }
        NamedSink {
            name: name.to_owned(),
            kind: sink.kind().to_owned(),
            supports_real_time: sink.supports_real_time(),
            allowlisted: sink.allowlisted(),
            sink: Arc::new(Mutex::new(Box::new(sink))),
        }
    }

    /// Adds the real-time update flow `name`: the stream `build` makes is
    /// written into `target`. Its query is named after the flow, checkpoints
    /// under the pipeline's root every 5 minutes, and takes what `configure`
    /// changes (a trigger, metrics, parallelism; not the checkpoint location
    /// or the task slots, which the pipeline sets).
    pub fn update_flow<T: Data>(
        &mut self,
        name: &str,
        target: &NamedSink<T>,
        configure: impl FnOnce(QueryConfig) -> QueryConfig,
        build: impl FnOnce(&Dataflow) -> Stream<T> + 'static,
    ) {
        if self.flows.iter().any(|flow| flow.name == name) {
            self.errors
                .push(format!("the pipeline has two flows named '{name}'"));
        }
        if !self.sinks.contains(target.name()) {
            self.errors.push(format!(
                "flow '{name}' writes into sink '{}', which this pipeline did not create",
                target.name()
            ));
        }
        let base = QueryConfig::new(name).trigger(Trigger::real_time(DEFAULT_FLOW_INTERVAL));
        let target = target.clone();
        self.flows.push(Flow {
            name: name.to_owned(),
            config: configure(base),
            build: Box::new(move |flow| build(flow).sink(target)),
        });
    }

    /// Starts every flow, all or none. First every flow passes its
    /// start-time checks (its build closure, validation, trigger, checkpoint
    /// location) and together they fit the pipeline's task slots
    /// (`INSUFFICIENT_TASK_SLOTS` otherwise); then every flow is wired (its
    /// operators made and started, its readers and writers opened) without
    /// running; only then do they all run. A flow that fails any step fails
    /// the start with its error, and no flow has read or written a record or
    /// written a checkpoint.
    pub fn start(self) -> Result<RunningPipeline> {
        if let Some(error) = self.errors.first() {
            return Err(RtflowError::InvalidDataflow(format!(
                "pipeline '{}': {error}",
                self.name
            )));
        }
        let Some(root) = self.checkpoint_root else {
            return Err(RtflowError::CheckpointLocationRequired);
        };
        let mut prepared = Vec::with_capacity(self.flows.len());
        for flow in self.flows {
            let config = flow
                .config
                .checkpoint_location(root.join(&flow.name))
                .task_slots(self.task_slots);
            let dataflow = Dataflow::new(&flow.name);
            let built_by = format!("pipeline '{}', flow '{}'", self.name, flow.name);
            guard::building(&built_by, || {
                (flow.build)(&dataflow);
                Ok(())
            })?;
            prepared.push((flow.name, dataflow.prepare(config)?));
        }
        check_slots(&self.name, self.task_slots, &prepared)?;
        let mut held = Vec::with_capacity(prepared.len());
        for (flow, prepared) in prepared {
            // Dropping the flows held so far abandons them: none has run.
            held.push((flow, StreamingQuery::launch(prepared, Start::Held)?));
        }
        let running = RunningPipeline {
            name: self.name,
            flows: held,
        };
        for (flow, query) in &running.flows {
            if let Err(error) = query.release() {
                tracing::warn!(
                    pipeline = %running.name,
                    %flow,
                    %error,
                    "a flow could not start: stopping the others"
                );
                let _ = running.stop();
                return Err(error);
            }
        }
        Ok(running)
    }
}

/// Whether the flows fit the pipeline's `slots` together.
fn check_slots(pipeline: &str, slots: usize, flows: &[(String, Prepared)]) -> Result<()> {
    let needed: usize = flows.iter().map(|(_, flow)| flow.task_slots()).sum();
    if needed <= slots {
        return Ok(());
    }
    let mut left = slots;
    let mut first_short = None;
    let mut needs = Vec::with_capacity(flows.len());
    for (name, flow) in flows {
        let wants = flow.task_slots();
        if wants > left && first_short.is_none() {
            first_short = Some(format!("flow '{name}' does not fit in the {left} left"));
        }
        left = left.saturating_sub(wants);
        needs.push(format!("flow '{name}' {wants}"));
    }
    Err(RtflowError::InsufficientTaskSlots {
        whose: format!("pipeline '{pipeline}' ({})", needs.join(", ")),
        needed,
        available: slots,
        fix: format!(
            "{}: raise Pipeline::task_slots({needed}) or lower the parallelism of its flows",
            first_short.expect("some flow falls short when the sum does")
        ),
    })
}

/// The flows of a started pipeline.
pub struct RunningPipeline {
    name: String,
    flows: Vec<(String, StreamingQuery)>,
}

impl RunningPipeline {
    /// The pipeline's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Every flow with its query, in the order they were added.
    pub fn flows(&self) -> impl Iterator<Item = (&str, &StreamingQuery)> {
        self.flows
            .iter()
            .map(|(name, query)| (name.as_str(), query))
    }

    /// The query of flow `name`.
    pub fn flow(&self, name: &str) -> Option<&StreamingQuery> {
        self.flows().find(|(flow, _)| *flow == name).map(|(_, q)| q)
    }

    /// The task slots the flows occupy, of the pipeline's.
    pub fn task_slots_used(&self) -> usize {
        self.flows.iter().map(|(_, query)| query.task_slots()).sum()
    }

    /// Every flow's latest progress report.
    pub fn last_progress(&self) -> Vec<(&str, Option<StreamingQueryProgress>)> {
        self.flows()
            .map(|(name, query)| (name, query.last_progress()))
            .collect()
    }

    /// Whether any flow still runs.
    pub fn is_active(&self) -> bool {
        self.flows.iter().any(|(_, query)| query.is_active())
    }

    /// The flows that failed, with their errors.
    pub fn exceptions(&self) -> Vec<(&str, RtflowError)> {
        self.flows()
            .filter_map(|(name, query)| query.exception().map(|error| (name, error)))
            .collect()
    }

    /// Stops every flow (each drains what it read), the last added first.
    pub fn stop(&self) -> Result<()> {
        let mut first_error = None;
        for (_, query) in self.flows.iter().rev() {
            if let Err(error) = query.stop() {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits until every flow terminated, at most `timeout`; returns whether
    /// they did, or the first flow's failure.
    pub fn await_termination(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        for (_, query) in &self.flows {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !query.await_termination(left)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Stoppable for RunningPipeline {
    /// Asks every flow to stop, as [`stop`](Self::stop) does.
    fn stop_request(&self) -> StopRequest {
        let flows: Vec<StopRequest> = self
            .flows
            .iter()
            .map(|(_, query)| query.stop_request())
            .collect();
        StopRequest::new(move || flows.iter().for_each(StopRequest::send))
    }
}
