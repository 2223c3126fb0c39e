//! What a test does to a running dataflow, step by step, and the strategies that
//! generate such schedules: inputs, their partitions, the points where the sources
//! catch up (interleavings), checkpoints and crashes.

use std::collections::hash_map::DefaultHasher;
use std::fmt::{self, Debug};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use proptest::collection::{vec, SizeRange};
use proptest::prelude::*;
use rtflow_runtime::EventTime;

/// One step of a test schedule, as [`DataflowHarness::apply`] carries it out.
///
/// [`DataflowHarness::apply`]: super::DataflowHarness::apply
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step<T> {
    /// Append `value` to source partition `partition`; with `event_time`, that is
    /// its event time (ms), else the time it is pushed.
    Push {
        partition: usize,
        value: T,
        event_time: Option<EventTime>,
    },
    /// Wait until the sources have read every record pushed so far. Without it,
    /// records of different partitions interleave as the threads run; with it,
    /// everything before it is read before anything after it.
    Settle,
    /// End an epoch and wait until its checkpoint is committed.
    Checkpoint,
    /// Kill the query (no final checkpoint) and restart it from the last
    /// committed checkpoint.
    Crash,
}

impl<T> Step<T> {
    /// A push with the time it happens as event time.
    ///
    /// ```
    /// use rtflow::testing::Step;
    /// assert_eq!(format!("{:?}", Step::push(1, "a")), r#"push(1, "a")"#);
    /// ```
    pub fn push(partition: usize, value: T) -> Self {
        Self::Push {
            partition,
            value,
            event_time: None,
        }
    }
}

/// Compact, so a minimal failing schedule reads as a script.
impl<T: Debug> Debug for Step<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Push {
                partition,
                value,
                event_time: None,
            } => write!(f, "push({partition}, {value:?})"),
            Step::Push {
                partition,
                value,
                event_time: Some(time),
            } => write!(f, "push({partition}, {value:?} @ {time})"),
            Step::Settle => f.write_str("settle"),
            Step::Checkpoint => f.write_str("checkpoint"),
            Step::Crash => f.write_str("crash"),
        }
    }
}

/// Schedules of `len` steps over `partitions` source partitions: mostly pushes of
/// `values` to random partitions, with settle points, checkpoints and crashes
/// between them (weights 10 : 2 : 2 : 2). Shrinking drops steps, simplifies
/// values and moves pushes to lower partitions.
///
/// ```
/// use proptest::prelude::*;
/// use proptest::strategy::ValueTree;
/// use proptest::test_runner::TestRunner;
/// use rtflow::testing::{schedule, Step};
///
/// let steps = schedule(0u8..10, 3, 50)
///     .new_tree(&mut TestRunner::deterministic())
///     .unwrap()
///     .current();
/// assert_eq!(steps.len(), 50);
/// assert!(steps.iter().all(|step| match step {
///     Step::Push { partition, .. } => *partition < 3,
///     _ => true,
/// }));
/// ```
///
/// # Panics
///
/// If `partitions` is 0.
pub fn schedule<S>(
    values: S,
    partitions: usize,
    len: impl Into<SizeRange>,
) -> impl Strategy<Value = Vec<Step<S::Value>>>
where
    S: Strategy + 'static,
    S::Value: Clone + Debug,
{
    assert!(partitions > 0, "a source has at least one partition");
    let step = prop_oneof![
        10 => (0..partitions, values).prop_map(|(partition, value)| Step::push(partition, value)),
        2 => Just(Step::Settle),
        2 => Just(Step::Checkpoint),
        2 => Just(Step::Crash),
    ];
    vec(step, len)
}

/// Rewrites the pushes of `schedule` so that every key lives in one partition:
/// a random partitioning of the keys over `partitions`, as a Kafka topic keyed by
/// `key` would hold them. Each key's records then have one order, the order they
/// were pushed in, for properties that compare per key in order.
///
/// ```
/// use proptest::strategy::{Strategy, ValueTree};
/// use proptest::test_runner::TestRunner;
/// use rtflow::testing::{pin_keys, schedule, Step};
///
/// let pinned = pin_keys(schedule((0u8..4, 0u32..100), 3, 40), 3, |(key, _)| *key);
/// let steps = pinned.new_tree(&mut TestRunner::deterministic()).unwrap().current();
/// let mut home = std::collections::HashMap::new();
/// for step in steps {
///     if let Step::Push { partition, value: (key, _), .. } = step {
///         assert_eq!(*home.entry(key).or_insert(partition), partition);
///     }
/// }
/// ```
pub fn pin_keys<T, K, S>(
    schedule: S,
    partitions: usize,
    key: impl Fn(&T) -> K + Send + Sync + 'static,
) -> impl Strategy<Value = Vec<Step<T>>>
where
    S: Strategy<Value = Vec<Step<T>>>,
    T: Clone + Debug,
    K: Hash,
{
    assert!(partitions > 0, "a source has at least one partition");
    let key = Arc::new(key);
    (schedule, any::<u64>()).prop_map(move |(steps, salt)| {
        steps
            .into_iter()
            .map(|step| match step {
                Step::Push {
                    value, event_time, ..
                } => {
                    let mut hasher = DefaultHasher::new();
                    (salt, key(&value)).hash(&mut hasher);
                    Step::Push {
                        partition: (hasher.finish() % partitions as u64) as usize,
                        value,
                        event_time,
                    }
                }
                other => other,
            })
            .collect()
    })
}
