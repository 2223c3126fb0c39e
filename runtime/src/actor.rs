//! The two loops an actor thread runs for the whole life of a query: a source
//! actor polls its reader, every other actor reads its mailbox lanes. Both push
//! into the actor's chain of operators and flush once nothing more is waiting.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Select, TryRecvError};
use rtflow_checkpoint::{ActorId, Offsets};

use crate::cancel::Cancel;
use crate::cluster::handover::{Bound, Handovers};
use crate::connector::{
    Progress, ReaderHandover, SourceOutput, SourceReader, SourceStatus, SourceWaker,
};
use crate::error::{Result, RtflowError};
use crate::guard::{self, Place};
use crate::inputs::{Alignment, IdleStep, Inputs};
use crate::metrics::OperatorMetrics;
use crate::operator::{Emit, SnapshotBuffer};
use crate::record::{Data, Epoch, Message};
use crate::state::StateSnapshot;

/// How long an idle actor waits before looking at its stop and cancel flags again.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// The most messages an actor takes from its lanes before flushing its output.
const DRAIN_BUDGET: usize = 64;

/// What an actor tells the coordinator about checkpoints.
pub(crate) enum Report {
    /// The actor passed the barrier of `epoch` on, with its state changes; a source
    /// adds its offsets.
    Barrier {
        actor: ActorId,
        epoch: Epoch,
        offsets: Offsets,
        snapshot: StateSnapshot,
    },
    /// The actor's input ended (or the query stopped); a source's offsets stand
    /// for every later epoch, its state changes go into the next one.
    Finished {
        actor: ActorId,
        offsets: Offsets,
        snapshot: StateSnapshot,
    },
}

/// A barrier passed on but not yet acknowledged: its snapshots are incomplete.
pub(crate) struct Unacked {
    epoch: Epoch,
    offsets: Offsets,
}

/// How many entries an incomplete snapshot encodes between two looks at the
/// mailbox: what a record arriving meanwhile waits for at most. Under load a
/// key of a large map costs 1-1.5 µs (cache and TLB misses), so 32 keys hold a
/// record up some 50 µs; 256 held records of a checkpoint window up 300-500 µs.
const SNAPSHOT_SLICE: usize = 32;

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
    /// For source actors: the waker handed to the reader, bound to this thread.
    pub(crate) waker: Option<SourceWaker>,
    /// Set when the query fails: every actor exits at once, without output.
    pub(crate) cancel: Cancel,
    /// Set by `stop()`: sources end their streams, the rest drains.
    pub(crate) stop: Arc<AtomicBool>,
    /// The most records a source reader returns per poll.
    pub(crate) max_records: usize,
    /// For source actors: the query-wide number of the source's partition 0, and
    /// the reader's first partition (see [`SourceOutput::set_partition`]).
    pub(crate) partition_base: u32,
    pub(crate) first_partition: u32,
    /// The source's record counter (source actors only).
    pub(crate) source_metrics: Option<Arc<OperatorMetrics>>,
    /// Where this actor's stateful operators and sinks put their snapshots.
    pub(crate) snapshots: SnapshotBuffer,
    /// The actor's chain of operators: blamed for a panic that no place of
    /// it claims.
    pub(crate) chain: Place,
    /// The run's handovers, which the actor meets at barriers.
    pub(crate) handovers: Arc<Handovers>,
    /// For a source actor: which reader of which source it is.
    pub(crate) reading: Option<Reading>,
}

/// A source reader's part in the run's handovers.
#[derive(Clone)]
pub(crate) struct Reading {
    pub(crate) uid: String,
    pub(crate) subtask: usize,
    pub(crate) partitions: Vec<usize>,
}

impl Reading {
    /// At `epoch`'s barrier, once the reader told where the epoch ends:
    /// changes the reader's partitions as a handover at it says.
    fn hand_over<T>(
        &mut self,
        bound: Option<Arc<Bound>>,
        place: &Place,
        reader: &mut dyn SourceReader<T>,
    ) -> Result<()> {
        let Some(bound) = bound else {
            return Ok(());
        };
        let after = bound.read_by(&self.uid, self.subtask);
        let starts_over = bound.reach.starts_over;
        if after != self.partitions || starts_over {
            let change = ReaderHandover {
                partitions: after,
                start_offsets: &bound.handover.offsets,
                starts_over,
            };
            place.run("SourceReader::hand_over", || reader.hand_over(&change))?;
            self.partitions = after.to_vec();
        }
        Ok(())
    }
}

impl ActorEnv {
    /// Runs the actor's loop; a panic in it becomes the error of the place
    /// it came from (see [`guard`](crate::guard)), so that the actor aborts
    /// its chain and fails like any other.
    fn caught(&self, actor_loop: impl FnOnce() -> Result<()>) -> Result<()> {
        guard::catch(actor_loop).unwrap_or_else(|panic| Err(guard::blamed(&*panic, &self.chain)))
    }

    fn check_cancel(&self) -> Result<()> {
        if self.cancel.is_raised() {
            Err(RtflowError::Cancelled)
        } else {
            Ok(())
        }
    }

    fn take_snapshot(&self) -> StateSnapshot {
        let mut snapshot = self.snapshots.lock().expect("snapshots are never poisoned");
        std::mem::take(&mut *snapshot)
    }

    /// Passes the barrier of `epoch` on. Once the snapshots the actor's operators
    /// took on the way are complete, acknowledges it with them: at once, or
    /// through [`continue_snapshot`](Self::continue_snapshot) between records.
    /// An earlier barrier still unacknowledged is settled first.
    fn barrier<T>(
        &self,
        epoch: Epoch,
        offsets: Offsets,
        unacked: &mut Option<Unacked>,
        emit: &mut dyn Emit<T>,
    ) -> Result<()> {
        self.continue_snapshot(unacked, usize::MAX, emit)?;
        emit.barrier(epoch)?;
        *unacked = Some(Unacked { epoch, offsets });
        self.continue_snapshot(unacked, 0, emit)
    }

    /// Continues the snapshots of the unacknowledged barrier by about `budget`
    /// entries (`usize::MAX`: to the end), and acknowledges it once they are
    /// complete.
    fn continue_snapshot<T>(
        &self,
        unacked: &mut Option<Unacked>,
        budget: usize,
        emit: &mut dyn Emit<T>,
    ) -> Result<()> {
        if unacked.is_none() {
            return Ok(());
        }
        while !emit.continue_snapshot(budget)? {
            if budget != usize::MAX {
                return Ok(());
            }
        }
        let Unacked { epoch, offsets } = unacked.take().expect("checked above");
        (self.report)(Report::Barrier {
            actor: self.actor,
            epoch,
            offsets,
            snapshot: self.take_snapshot(),
        });
        Ok(())
    }

    /// Ends the actor's output (its last snapshot included), reports it finished,
    /// then lets its sink wait for the final commit.
    fn end<T>(
        &self,
        offsets: impl FnOnce() -> Offsets,
        unacked: &mut Option<Unacked>,
        emit: &mut dyn Emit<T>,
    ) -> Result<()> {
        self.continue_snapshot(unacked, usize::MAX, emit)?;
        emit.end()?;
        // The end's snapshot goes with the last report: complete it now.
        while !emit.continue_snapshot(usize::MAX)? {}
        (self.report)(Report::Finished {
            actor: self.actor,
            offsets: offsets(),
            snapshot: self.take_snapshot(),
        });
        emit.finish()
    }
}

/// Runs a source actor until its input ends, the query stops, or it fails.
pub(crate) fn run_source<T: Data>(
    place: &Place,
    reader: Box<dyn SourceReader<T>>,
    mut emit: Box<dyn Emit<T>>,
    env: ActorEnv,
) -> Result<()> {
    let result = env.caught(|| source_loop(place, reader, &mut *emit, &env));
    if let Err(error) = &result {
        emit.abort(error);
    }
    result
}

fn source_loop<T: Data>(
    place: &Place,
    mut reader: Box<dyn SourceReader<T>>,
    emit: &mut dyn Emit<T>,
    env: &ActorEnv,
) -> Result<()> {
    if let Some(waker) = &env.waker {
        waker.bind_current_thread();
    }
    let mut out =
        SourceOutput::for_reader(env.max_records, env.partition_base, env.first_partition);
    let mut unacked = None;
    let mut reading = env.reading.clone();
    loop {
        env.check_cancel()?;
        if env.stop.load(Ordering::Relaxed) {
            return env.end(|| reader.offsets(), &mut unacked, emit);
        }
        // Between two polls every record read so far has been emitted, so the
        // reader's offsets are exactly where the epoch ends.
        for epoch in env.barriers.iter().flat_map(|b| b.try_iter()) {
            let offsets = reader.offsets();
            reader.on_barrier(epoch);
            // Before the barrier is acknowledged: a reader that cannot take
            // the handover fails the epoch, which then never commits.
            if let Some(reading) = &mut reading {
                reading.hand_over(env.handovers.at(epoch), place, &mut *reader)?;
            }
            env.barrier(epoch, offsets, &mut unacked, emit)?;
        }
        env.continue_snapshot(&mut unacked, SNAPSHOT_SLICE, emit)?;
        let status = place.watch(|| reader.poll(&mut out, IDLE_WAIT))?;
        if !out.is_empty() {
            let read = out.drain_into(emit)?;
            if let Some(metrics) = &env.source_metrics {
                metrics.add(0, read as u64);
            }
        }
        match out.take_progress() {
            Some(Progress::Watermark(watermark)) => emit.watermark(watermark)?,
            Some(Progress::Idle) => emit.idle()?,
            None => {}
        }
        // Also when idle: a sink learns of asynchronous failures when flushed.
        emit.flush()?;
        if status == SourceStatus::Finished {
            return env.end(|| reader.offsets(), &mut unacked, emit);
        }
    }
}

/// Runs an actor that reads mailbox lanes until every lane ends or it fails.
pub(crate) fn run_inbox<T: Data>(
    lanes: Vec<Receiver<Message<T>>>,
    mut emit: Box<dyn Emit<T>>,
    env: ActorEnv,
) -> Result<()> {
    let result = env.caught(|| inbox_loop(&lanes, &mut *emit, &env));
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
    let mut unacked = None;
    loop {
        env.check_cancel()?;
        let mut budget = DRAIN_BUDGET;
        let mut lanes_changed = false;
        // An incomplete snapshot is worked on whenever no message waits.
        let wait = if unacked.is_some() {
            Duration::ZERO
        } else {
            IDLE_WAIT
        };
        // One lane (a forward edge) is waited on directly: a plain receive wakes
        // faster than a select.
        if let [lane] = lanes {
            let message = match lane.recv_timeout(wait) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => {
                    emit.flush()?;
                    env.continue_snapshot(&mut unacked, SNAPSHOT_SLICE, emit)?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Err(RtflowError::Cancelled),
            };
            budget -= 1;
            match handle(0, message, &mut inputs, &mut unacked, emit, env)? {
                Step::Continue | Step::LanesChanged => {}
                Step::Finished => return env.end(Offsets::new, &mut unacked, emit),
            }
        } else if select.ready_timeout(wait).is_err() {
            emit.flush()?;
            env.continue_snapshot(&mut unacked, SNAPSHOT_SLICE, emit)?;
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
                match handle(lane, message, &mut inputs, &mut unacked, emit, env)? {
                    Step::Continue => {}
                    Step::LanesChanged => lanes_changed = true,
                    Step::Finished => return env.end(Offsets::new, &mut unacked, emit),
                }
            }
            if !received {
                break;
            }
        }
        emit.flush()?;
        env.continue_snapshot(&mut unacked, SNAPSHOT_SLICE, emit)?;
        if lanes_changed {
            select = readable_lanes(lanes, &inputs);
        }
    }
}

fn handle<T>(
    lane: usize,
    message: Message<T>,
    inputs: &mut Inputs,
    unacked: &mut Option<Unacked>,
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
        Message::Idle => {
            match inputs.on_idle(lane) {
                Some(IdleStep::Watermark(advanced)) => emit.watermark(advanced)?,
                Some(IdleStep::Idle) => emit.idle()?,
                None => {}
            }
            Ok(Step::Continue)
        }
        Message::Barrier(epoch) => {
            if let Alignment::Aligned(epoch) = inputs.on_barrier(lane, epoch) {
                env.barrier(epoch, Offsets::new(), unacked, emit)?;
                if env.handovers.at(epoch).is_some_and(|b| b.reach.starts_over) {
                    inputs.start_over();
                }
            }
            Ok(Step::LanesChanged)
        }
        Message::End => {
            let stopping = env.stop.load(Ordering::Relaxed);
            let (all_ended, aligned, watermark) = inputs.on_end(lane, stopping);
            if all_ended {
                return Ok(Step::Finished);
            }
            if let Some(epoch) = aligned {
                env.barrier(epoch, Offsets::new(), unacked, emit)?;
            }
            if let Some(watermark) = watermark {
                emit.watermark(watermark)?;
            }
            Ok(Step::LanesChanged)
        }
    }
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
