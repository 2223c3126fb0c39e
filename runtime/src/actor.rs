//! The two loops an actor thread runs for the whole life of a query: a source
//! actor polls its reader, every other actor reads its mailbox lanes. Both push
//! into the actor's chain of operators and flush once nothing more is waiting.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Select, TryRecvError};
use rtflow_checkpoint::{ActorId, Offsets};

use crate::connector::{SourceOutput, SourceReader, SourceStatus};
use crate::error::{Result, RtflowError};
use crate::inputs::{Alignment, Inputs};
use crate::metrics::OperatorMetrics;
use crate::operator::Emit;
use crate::record::{Data, Epoch, Message};

/// How long an idle actor waits before looking at its stop and cancel flags again.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// The most messages an actor takes from its lanes before flushing its output.
const DRAIN_BUDGET: usize = 64;

/// What an actor tells the coordinator about checkpoints.
pub(crate) enum Report {
    /// The actor passed the barrier of `epoch` on; a source adds its offsets.
    Barrier {
        actor: ActorId,
        epoch: Epoch,
        offsets: Offsets,
    },
    /// A source read all its input; these offsets stand for every later epoch.
    Finished { actor: ActorId, offsets: Offsets },
}

/// Delivers reports to the coordinator.
pub(crate) type Reporter = Arc<dyn Fn(Report) + Send + Sync>;

/// What every actor of a query shares with the coordinator.
#[derive(Clone)]
pub(crate) struct ActorEnv {
    /// This actor's index among the query's actors.
    pub(crate) actor: ActorId,
    /// Checkpoint reports to the coordinator.
    pub(crate) report: Reporter,
    /// For source actors: the epochs the coordinator ends, in order.
    pub(crate) barriers: Option<Receiver<Epoch>>,
    /// Set when the query fails: every actor exits at once, without output.
    pub(crate) cancel: Arc<AtomicBool>,
    /// Set by `stop()`: sources end their streams, the rest drains.
    pub(crate) stop: Arc<AtomicBool>,
    /// The most records a source reader returns per poll.
    pub(crate) max_records: usize,
    /// The source's record counter (source actors only).
    pub(crate) source_metrics: Option<Arc<OperatorMetrics>>,
}

impl ActorEnv {
    fn check_cancel(&self) -> Result<()> {
        if self.cancel.load(Ordering::Relaxed) {
            Err(RtflowError::Cancelled)
        } else {
            Ok(())
        }
    }
}

/// Runs a source actor until its input ends, the query stops, or it fails.
pub(crate) fn run_source<T: Data>(
    reader: Box<dyn SourceReader<T>>,
    mut emit: Box<dyn Emit<T>>,
    env: ActorEnv,
) -> Result<()> {
    let result = source_loop(reader, &mut *emit, &env);
    if let Err(error) = &result {
        emit.abort(error);
    }
    result
}

fn source_loop<T: Data>(
    mut reader: Box<dyn SourceReader<T>>,
    emit: &mut dyn Emit<T>,
    env: &ActorEnv,
) -> Result<()> {
    let mut out = SourceOutput::new(env.max_records);
    loop {
        env.check_cancel()?;
        if env.stop.load(Ordering::Relaxed) {
            return emit.end();
        }
        // Between two polls every record read so far has been emitted, so the
        // reader's offsets are exactly where the epoch ends.
        for epoch in env.barriers.iter().flat_map(|b| b.try_iter()) {
            emit.barrier(epoch)?;
            (env.report)(Report::Barrier {
                actor: env.actor,
                epoch,
                offsets: reader.offsets(),
            });
        }
        let status = reader.poll(&mut out, IDLE_WAIT)?;
        if !out.is_empty() {
            let read = out.drain_into(emit)?;
            if let Some(metrics) = &env.source_metrics {
                metrics.add(0, read as u64);
            }
        }
        // Also when idle: a sink learns of asynchronous failures when flushed.
        emit.flush()?;
        if status == SourceStatus::Finished {
            emit.end()?;
            (env.report)(Report::Finished {
                actor: env.actor,
                offsets: reader.offsets(),
            });
            return Ok(());
        }
    }
}

/// Runs an actor that reads mailbox lanes until every lane ends or it fails.
pub(crate) fn run_inbox<T: Data>(
    lanes: Vec<Receiver<Message<T>>>,
    mut emit: Box<dyn Emit<T>>,
    env: ActorEnv,
) -> Result<()> {
    let result = inbox_loop(&lanes, &mut *emit, &env);
    if let Err(error) = &result {
        emit.abort(error);
    }
    result
}

/// What one message did to the actor's inputs.
enum Step {
    Continue,
    /// The set of readable lanes changed (a barrier blocked or released lanes, a lane
    /// ended).
    LanesChanged,
    Finished,
}

fn inbox_loop<T: Data>(
    lanes: &[Receiver<Message<T>>],
    emit: &mut dyn Emit<T>,
    env: &ActorEnv,
) -> Result<()> {
    let mut inputs = Inputs::new(lanes.len());
    let mut select = readable_lanes(lanes, &inputs);
    loop {
        env.check_cancel()?;
        let mut budget = DRAIN_BUDGET;
        let mut lanes_changed = false;
        // One lane (a forward edge) is waited on directly: a plain receive wakes
        // faster than a select.
        if let [lane] = lanes {
            let message = match lane.recv_timeout(IDLE_WAIT) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => {
                    emit.flush()?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Err(RtflowError::Cancelled),
            };
            budget -= 1;
            match handle(0, message, &mut inputs, emit, env)? {
                Step::Continue | Step::LanesChanged => {}
                Step::Finished => return emit.end(),
            }
        } else if select.ready_timeout(IDLE_WAIT).is_err() {
            emit.flush()?;
            continue;
        }
        while budget > 0 {
            let mut received = false;
            for (lane, receiver) in lanes.iter().enumerate() {
                if !inputs.readable(lane) {
                    continue;
                }
                let message = match receiver.try_recv() {
                    Ok(message) => message,
                    Err(TryRecvError::Empty) => continue,
                    // The upstream actor exited without ending its stream: it failed.
                    Err(TryRecvError::Disconnected) => return Err(RtflowError::Cancelled),
                };
                received = true;
                budget = budget.saturating_sub(1);
                match handle(lane, message, &mut inputs, emit, env)? {
                    Step::Continue => {}
                    Step::LanesChanged => lanes_changed = true,
                    Step::Finished => return emit.end(),
                }
            }
            if !received {
                break;
            }
        }
        emit.flush()?;
        if lanes_changed {
            select = readable_lanes(lanes, &inputs);
        }
    }
}

fn handle<T>(
    lane: usize,
    message: Message<T>,
    inputs: &mut Inputs,
    emit: &mut dyn Emit<T>,
    env: &ActorEnv,
) -> Result<Step> {
    match message {
        Message::Data(batch) => {
            for record in batch {
                emit.record(record)?;
            }
            Ok(Step::Continue)
        }
        Message::Watermark(watermark) => {
            if let Some(advanced) = inputs.on_watermark(lane, watermark) {
                emit.watermark(advanced)?;
            }
            Ok(Step::Continue)
        }
        Message::Barrier(epoch) => {
            if let Alignment::Aligned(epoch) = inputs.on_barrier(lane, epoch) {
                pass_barrier(epoch, emit, env)?;
            }
            Ok(Step::LanesChanged)
        }
        Message::End => {
            let (all_ended, aligned, watermark) = inputs.on_end(lane);
            if all_ended {
                return Ok(Step::Finished);
            }
            if let Some(epoch) = aligned {
                pass_barrier(epoch, emit, env)?;
            }
            if let Some(watermark) = watermark {
                emit.watermark(watermark)?;
            }
            Ok(Step::LanesChanged)
        }
    }
}

/// Every input delivered the barrier: pass it on, then acknowledge it.
fn pass_barrier<T>(epoch: Epoch, emit: &mut dyn Emit<T>, env: &ActorEnv) -> Result<()> {
    emit.barrier(epoch)?;
    (env.report)(Report::Barrier {
        actor: env.actor,
        epoch,
        offsets: Offsets::new(),
    });
    Ok(())
}

fn readable_lanes<'a, T>(lanes: &'a [Receiver<Message<T>>], inputs: &Inputs) -> Select<'a> {
    let mut select = Select::new();
    for (lane, receiver) in lanes.iter().enumerate() {
        if inputs.readable(lane) {
            select.recv(receiver);
        }
    }
    select
}
