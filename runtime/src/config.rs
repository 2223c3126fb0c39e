//! Query configuration: trigger, output mode, checkpoint location and runtime sizes.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, RtflowError};
use crate::progress::StreamingQueryListener;

/// How a query emits results. Real-time mode supports only [`OutputMode::Update`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputMode {
    /// Only rows that will never change again.
    Append,
    /// Every row as soon as it changes (the real-time mode).
    #[default]
    Update,
    /// The whole result table after every change.
    Complete,
}

impl fmt::Display for OutputMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Append => "Append",
            Self::Update => "Update",
            Self::Complete => "Complete",
        })
    }
}

/// The trigger of a real-time query: its batch duration is the checkpoint interval,
/// never a latency target.
///
/// ```
/// use std::time::Duration;
/// use rtflow_runtime::Trigger;
/// let a = Trigger::real_time("30 seconds");
/// let b = Trigger::real_time(Duration::from_secs(30));
/// let c = Trigger::real_time(30_000u64);
/// assert_eq!(a.batch_duration().unwrap(), b.batch_duration().unwrap());
/// assert_eq!(b.batch_duration().unwrap(), c.batch_duration().unwrap());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trigger {
    interval: Interval,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Interval {
    Text(String),
    Exact(Duration),
}

impl Trigger {
    /// A real-time trigger with the given batch duration: a Spark-style string
    /// ("5 minutes"), a [`Duration`], or milliseconds.
    pub fn real_time(batch_duration: impl Into<TriggerInterval>) -> Self {
        Self {
            interval: batch_duration.into().0,
        }
    }

    /// The batch duration, parsed. Fails for malformed, non-positive or month-based
    /// intervals.
    pub fn batch_duration(&self) -> Result<Duration> {
        let invalid = |reason: String| RtflowError::InvalidTriggerInterval {
            interval: self.to_string(),
            reason,
        };
        let duration = match &self.interval {
            Interval::Text(text) => parse_interval(text).map_err(invalid)?,
            Interval::Exact(duration) => *duration,
        };
        if duration.is_zero() {
            return Err(invalid("the batch duration must be positive".into()));
        }
        Ok(duration)
    }
}

impl Default for Trigger {
    fn default() -> Self {
        Self::real_time(Duration::from_secs(5 * 60))
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.interval {
            Interval::Text(text) => f.write_str(text),
            Interval::Exact(duration) => write!(f, "{} ms", duration.as_millis()),
        }
    }
}

/// Anything [`Trigger::real_time`] accepts as a batch duration.
pub struct TriggerInterval(Interval);

impl From<&str> for TriggerInterval {
    fn from(text: &str) -> Self {
        Self(Interval::Text(text.to_owned()))
    }
}

impl From<String> for TriggerInterval {
    fn from(text: String) -> Self {
        Self(Interval::Text(text))
    }
}

impl From<Duration> for TriggerInterval {
    fn from(duration: Duration) -> Self {
        Self(Interval::Exact(duration))
    }
}

impl From<u64> for TriggerInterval {
    fn from(millis: u64) -> Self {
        Self(Interval::Exact(Duration::from_millis(millis)))
    }
}

/// Parses a Spark-style interval: "30 seconds", "5 minutes", "1 hour",
/// "interval 1 minute 30 seconds", "250 ms". Months and years are rejected because
/// their length varies; so are negative and zero totals.
///
/// ```
/// use std::time::Duration;
/// use rtflow_runtime::config::parse_interval;
/// assert_eq!(parse_interval("1 minute 30 seconds"), Ok(Duration::from_secs(90)));
/// assert!(parse_interval("1 month").unwrap_err().contains("month"));
/// ```
pub fn parse_interval(text: &str) -> std::result::Result<Duration, String> {
    let mut words = text.split_whitespace().peekable();
    if words
        .peek()
        .is_some_and(|w| w.eq_ignore_ascii_case("interval"))
    {
        words.next();
    }
    let mut total_nanos: f64 = 0.0;
    let mut terms = 0;
    while let Some(number) = words.next() {
        let value: f64 = number.parse().map_err(|_| {
            format!("'{number}' is not a number; write e.g. \"30 seconds\" or \"5 minutes\"")
        })?;
        let unit = words
            .next()
            .ok_or_else(|| format!("'{number}' has no unit; write e.g. \"{number} seconds\""))?;
        total_nanos += value * unit_nanos(unit)?;
        terms += 1;
    }
    if terms == 0 {
        return Err("the interval is empty; write e.g. \"5 minutes\"".into());
    }
    if total_nanos <= 0.0 {
        return Err("the batch duration must be positive".into());
    }
    Ok(Duration::from_nanos(total_nanos.round() as u64))
}

fn unit_nanos(unit: &str) -> std::result::Result<f64, String> {
    const SECOND: f64 = 1e9;
    let nanos = match unit.to_ascii_lowercase().as_str() {
        "week" | "weeks" => 7.0 * 86_400.0 * SECOND,
        "day" | "days" => 86_400.0 * SECOND,
        "hour" | "hours" | "h" => 3_600.0 * SECOND,
        "minute" | "minutes" | "min" | "mins" => 60.0 * SECOND,
        "second" | "seconds" | "sec" | "secs" | "s" => SECOND,
        "millisecond" | "milliseconds" | "ms" => 1e6,
        "microsecond" | "microseconds" | "us" => 1e3,
        "month" | "months" | "year" | "years" => {
            return Err(format!(
                "month-based units ('{unit}') have no fixed length; use days, hours, \
                 minutes or seconds"
            ))
        }
        _ => {
            return Err(format!(
                "unknown unit '{unit}'; use milliseconds, seconds, minutes, hours, days or weeks"
            ))
        }
    };
    Ok(nanos)
}

/// Everything a query needs besides its dataflow.
///
/// ```
/// use rtflow_runtime::{OutputMode, QueryConfig, Trigger};
/// let config = QueryConfig::new("clicks")
///     .checkpoint_location("/tmp/rtflow/clicks")
///     .output_mode(OutputMode::Update)
///     .trigger(Trigger::real_time("30 seconds"))
///     .task_slots(16);
/// assert_eq!(config.name, "clicks");
/// ```
#[derive(Debug, Clone)]
pub struct QueryConfig {
    /// The query's name, used in thread names, errors and metrics.
    pub name: String,
    /// Where checkpoints are kept. `Dataflow::start` requires it
    /// (`CHECKPOINT_LOCATION_REQUIRED`); a clustered query checkpoints into
    /// Kafka and needs none, but keeps local changelog copies here if given.
    pub checkpoint_location: Option<PathBuf>,
    /// How many committed checkpoints are kept. Default 3.
    pub checkpoints_retained: usize,
    /// Must be [`OutputMode::Update`].
    pub output_mode: OutputMode,
    /// The real-time trigger; its batch duration is the checkpoint interval.
    pub trigger: Trigger,
    /// The shortest batch duration accepted. Default 5000 ms.
    pub min_batch_duration: Duration,
    /// Whether operators and sinks are checked against the real-time allowlist.
    pub allowlist_check: bool,
    /// How many long-running actors the query may hold (one thread each).
    /// Default [`QueryConfig::DEFAULT_TASK_SLOTS`].
    pub task_slots: usize,
    /// Capacity of each mailbox lane, in messages. Default 64.
    pub mailbox_capacity: usize,
    /// The most records one data message carries. Default 256.
    pub max_records_per_message: usize,
    /// Parallelism of operators after a shuffle. Default: the number of CPU cores.
    pub default_parallelism: usize,
    /// Key groups a shuffle hashes keys into (the unit of state redistribution).
    /// Default 128.
    pub max_key_groups: usize,
    /// Fuse forward-connected operators of equal parallelism into one actor.
    /// Default true.
    pub operator_chaining: bool,
    /// Where to serve Prometheus `/metrics`, if anywhere. Queries naming the same
    /// address share one endpoint.
    pub metrics_address: Option<SocketAddr>,
    /// The longest time between two progress reports. Default 5 s.
    pub progress_interval: Duration,
    /// How long `start()` waits for the query's operators to be made and
    /// started (factories, `on_start`, state restored, readers and writers
    /// opened) before it gives up with `START_TIMEOUT`. Default 10 minutes.
    pub start_timeout: Duration,
    /// The CPUs the query's coordinator and actors, and the threads they start,
    /// may run on. Default `None`: the OS places them.
    pub cpu_affinity: Option<Vec<usize>>,
    /// Told when the query starts, reports progress and terminates.
    pub listeners: Listeners,
}

/// The listeners of a query.
#[derive(Clone, Default)]
pub struct Listeners(pub(crate) Vec<Arc<dyn StreamingQueryListener>>);

impl fmt::Debug for Listeners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} listener(s)", self.0.len())
    }
}

impl QueryConfig {
    /// Task slots when none are configured: enough for every example, including a
    /// shuffle stage on each side, on a small machine.
    pub const DEFAULT_TASK_SLOTS: usize = 64;

    /// A configuration with defaults and the given query name.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            checkpoint_location: None,
            checkpoints_retained: 3,
            output_mode: OutputMode::Update,
            trigger: Trigger::default(),
            min_batch_duration: Duration::from_millis(5000),
            allowlist_check: true,
            task_slots: Self::DEFAULT_TASK_SLOTS,
            mailbox_capacity: 64,
            max_records_per_message: 256,
            default_parallelism: std::thread::available_parallelism().map_or(2, |n| n.get()),
            max_key_groups: 128,
            operator_chaining: true,
            metrics_address: None,
            progress_interval: Duration::from_secs(5),
            start_timeout: Duration::from_secs(600),
            cpu_affinity: None,
            listeners: Listeners::default(),
        }
    }

    /// Sets the checkpoint location.
    pub fn checkpoint_location(mut self, path: impl Into<PathBuf>) -> Self {
        self.checkpoint_location = Some(path.into());
        self
    }

    /// Sets how many committed checkpoints are kept.
    pub fn checkpoints_retained(mut self, count: usize) -> Self {
        self.checkpoints_retained = count;
        self
    }

    /// Sets the output mode.
    pub fn output_mode(mut self, mode: OutputMode) -> Self {
        self.output_mode = mode;
        self
    }

    /// Sets the trigger.
    pub fn trigger(mut self, trigger: Trigger) -> Self {
        self.trigger = trigger;
        self
    }

    /// Sets the shortest accepted batch duration.
    pub fn min_batch_duration(mut self, duration: Duration) -> Self {
        self.min_batch_duration = duration;
        self
    }

    /// Turns the allowlist check on or off.
    pub fn allowlist_check(mut self, enabled: bool) -> Self {
        self.allowlist_check = enabled;
        self
    }

    /// Sets the number of task slots.
    pub fn task_slots(mut self, slots: usize) -> Self {
        self.task_slots = slots;
        self
    }

    /// Sets the capacity of each mailbox lane, in messages.
    pub fn mailbox_capacity(mut self, messages: usize) -> Self {
        self.mailbox_capacity = messages;
        self
    }

    /// Sets the most records one data message carries.
    pub fn max_records_per_message(mut self, records: usize) -> Self {
        self.max_records_per_message = records;
        self
    }

    /// Sets the parallelism of operators after a shuffle.
    pub fn default_parallelism(mut self, parallelism: usize) -> Self {
        self.default_parallelism = parallelism;
        self
    }

    /// Sets the number of key groups.
    pub fn max_key_groups(mut self, groups: usize) -> Self {
        self.max_key_groups = groups;
        self
    }

    /// Turns operator chaining on or off.
    pub fn operator_chaining(mut self, enabled: bool) -> Self {
        self.operator_chaining = enabled;
        self
    }

    /// Serves Prometheus `/metrics` on `address`.
    pub fn metrics_address(mut self, address: SocketAddr) -> Self {
        self.metrics_address = Some(address);
        self
    }

    /// Sets the longest time between two progress reports.
    pub fn progress_interval(mut self, interval: Duration) -> Self {
        self.progress_interval = interval;
        self
    }

    /// Sets how long `start()` waits for the operators to be made and
    /// started: user code that never returns from a factory or `on_start`
    /// then fails the start with `START_TIMEOUT` instead of holding it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rtflow_runtime::QueryConfig;
    /// let config = QueryConfig::new("orders").start_timeout(Duration::from_secs(30));
    /// assert_eq!(config.start_timeout, Duration::from_secs(30));
    /// ```
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Runs the query's coordinator and actors, and the threads they start
    /// (compaction, Kafka clients), only on `cpus` (Linux).
    ///
    /// On a VM, waking a thread on an idle vCPU can take a millisecond; a
    /// low-rate query whose actors share one CPU hands records over without
    /// such wake-ups, so its tail latency drops (the README's checkpoint
    /// section measures it). A query that needs more than those CPUs' time
    /// runs slower for it.
    ///
    /// ```
    /// use rtflow_runtime::QueryConfig;
    /// let config = QueryConfig::new("alerts")
    ///     .checkpoint_location("/tmp/rtflow/alerts")
    ///     .cpu_affinity([0]);
    /// assert_eq!(config.cpu_affinity, Some(vec![0]));
    /// ```
    pub fn cpu_affinity(mut self, cpus: impl IntoIterator<Item = usize>) -> Self {
        self.cpu_affinity = Some(cpus.into_iter().collect());
        self
    }

    /// Adds a listener.
    pub fn listener(mut self, listener: Arc<dyn StreamingQueryListener>) -> Self {
        self.listeners.0.push(listener);
        self
    }

    /// Checks the settings that do not depend on the dataflow, in the order Spark
    /// reports them, and returns the batch duration.
    pub fn validate(&self) -> Result<Duration> {
        self.check(true)
    }

    /// [`validate`](Self::validate), for a query that needs a checkpoint
    /// location or (clustered: it checkpoints into its cluster) does not.
    pub(crate) fn check(&self, needs_location: bool) -> Result<Duration> {
        if self.output_mode != OutputMode::Update {
            return Err(RtflowError::OutputModeNotSupported {
                mode: self.output_mode.to_string(),
            });
        }
        if needs_location && self.checkpoint_location.is_none() {
            return Err(RtflowError::CheckpointLocationRequired);
        }
        let batch_duration = self.trigger.batch_duration()?;
        if batch_duration < self.min_batch_duration {
            return Err(RtflowError::InvalidTriggerInterval {
                interval: self.trigger.to_string(),
                reason: format!(
                    "the batch duration must be at least {} ms (min_batch_duration); \
                     it is the checkpoint interval, not a latency target",
                    self.min_batch_duration.as_millis()
                ),
            });
        }
        if self.progress_interval.is_zero() {
            return Err(RtflowError::InvalidConfiguration(
                "progress_interval must be positive".into(),
            ));
        }
        for (name, value) in [
            ("task_slots", self.task_slots),
            ("mailbox_capacity", self.mailbox_capacity),
            ("max_records_per_message", self.max_records_per_message),
            ("default_parallelism", self.default_parallelism),
            ("max_key_groups", self.max_key_groups),
            ("checkpoints_retained", self.checkpoints_retained),
        ] {
            if value == 0 {
                return Err(RtflowError::InvalidConfiguration(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        if let Some(cpus) = &self.cpu_affinity {
            crate::placement::check(cpus)?;
        }
        Ok(batch_duration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_spark_style_intervals() {
        let cases = [
            ("30 seconds", 30_000),
            ("5 minutes", 300_000),
            ("1 hour", 3_600_000),
            ("1 day", 86_400_000),
            ("interval 1 minute 30 seconds", 90_000),
            ("250 milliseconds", 250),
            ("250 ms", 250),
            ("1.5 seconds", 1_500),
            ("2 MINUTES", 120_000),
        ];
        for (text, millis) in cases {
            assert_eq!(
                parse_interval(text),
                Ok(Duration::from_millis(millis)),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_bad_intervals() {
        for (text, reason) in [
            ("1 month", "month-based"),
            ("2 years", "month-based"),
            ("0 seconds", "positive"),
            ("-5 minutes", "positive"),
            ("five minutes", "not a number"),
            ("5", "no unit"),
            ("5 fortnights", "unknown unit"),
            ("", "empty"),
        ] {
            let err = parse_interval(text).unwrap_err();
            assert!(err.contains(reason), "{text}: {err}");
        }
    }

    #[test]
    fn validation_reports_spark_error_classes() {
        let ok = QueryConfig::new("q").checkpoint_location("/tmp/x");
        assert!(ok.validate().is_ok());
        let class = |c: QueryConfig| c.validate().unwrap_err().error_class();
        assert_eq!(
            class(ok.clone().output_mode(OutputMode::Append)),
            "STREAMING_REAL_TIME_MODE.OUTPUT_MODE_NOT_SUPPORTED"
        );
        assert_eq!(class(QueryConfig::new("q")), "CHECKPOINT_LOCATION_REQUIRED");
        for trigger in [
            Trigger::real_time("1 second"),
            Trigger::real_time("1 month"),
            Trigger::real_time(0u64),
        ] {
            assert_eq!(
                class(ok.clone().trigger(trigger)),
                "INVALID_STREAMING_REAL_TIME_MODE_TRIGGER_INTERVAL"
            );
        }
        assert!(ok
            .clone()
            .trigger(Trigger::real_time("1 second"))
            .min_batch_duration(Duration::from_millis(500))
            .validate()
            .is_ok());
        assert_eq!(
            class(ok.clone().mailbox_capacity(0)),
            "INVALID_CONFIGURATION"
        );
    }
}
