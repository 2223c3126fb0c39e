//! [`KafkaCluster`]: one query run by several processes, on the Kafka cluster
//! its users already run, as Kafka Streams does.
//!
//! Every process runs the same dataflow under the same query name. They join
//! the query's consumer group (`rtflow-<query>`, cooperative-sticky
//! assignment), which shares out the partitions of the source topics, and
//! its second group (`rtflow-<query>-repartition`), which shares out those of
//! the first repartition topic: one group would balance only the sum of the
//! two, and could leave a process all of one stage and none of the other.
//! Whoever owns partition `p` of the first repartition topic owns partition
//! `p` of every later one (`ClusterSettings::co_partitioned`). A process runs
//! its dataflow for the partitions it owns:
//!
//! - each `repartition_by` writes each record to the partition of its key
//!   group in the stage's repartition topic (`exchange`); the stage after it
//!   reads the partitions the process owns, with the watermark in band;
//! - each checkpoint commits as one Kafka transaction of the process (`link`):
//!   its output, its repartition records, the changelog records of its keyed
//!   state (`changelog`, a compacted topic partitioned like the repartition
//!   topic) and its input offsets, committed to the group; the writers'
//!   records are produced into it while the epoch runs (`transactions`);
//! - when the group moves partitions, the process stops its run with a final
//!   checkpoint before it lets them go (inside the rebalance), and starts a
//!   new run for what it then owns, restoring offsets from the group and keyed
//!   state from the changelog (`runner`);
//! - a process that died is fenced by those that stay as soon as the group
//!   drops it, or by the next to start if it died alone, so that the
//!   transaction it left open is aborted at once (`departures`, with the
//!   instances in a compacted topic, `compacted`);
//! - processes check that they run the same dataflow (`shape`);
//! - with standby replicas, a process keeps warm copies of changelog
//!   partitions others own, so that a failover restores only a tail
//!   (`standby`).

mod changelog;
mod compacted;
mod departures;
mod exchange;
mod link;
mod local;
mod retries;
mod runner;
mod second_tier;
mod settle;
mod shape;
mod standby;
mod transactions;
mod upstream;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use rtflow_runtime::{Dataflow, QueryConfig, Result, RtflowError};

use super::Options;
pub use link::RestoreStats;
pub use runner::ClusteredQuery;

pub(crate) use link::transactions_of;
pub(crate) use transactions::{Staging, Tier};

/// Separates a repartition partition's offset label from the upstream source
/// partition whose watermark a label holds.
const WATERMARK_MARK: char = '@';

/// Locks `mutex`, also after a thread panicked holding it: what it guards
/// stays consistent between statements, and a panic fails the run anyway.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long apart a request refused while a group's coordinator moves is
/// made again.
const COORDINATOR_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Makes `request` again, every [`COORDINATOR_RETRY_PAUSE`] for up to
/// `timeout`, while it is refused because a group's coordinator moves.
fn while_coordinator_moves<T>(
    timeout: Duration,
    mut request: impl FnMut() -> KafkaResult<T>,
) -> KafkaResult<T> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match request() {
            Err(e) if coordinator_moving(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(COORDINATOR_RETRY_PAUSE)
            }
            answered => return answered,
        }
    }
}

/// Whether `error` says a group's coordinator is moving or loading (a broker
/// died or restarted): the request is answered once it has, a few seconds
/// later in a replicated cluster.
fn coordinator_moving(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::NotCoordinator
                | RDKafkaErrorCode::CoordinatorLoadInProgress
                | RDKafkaErrorCode::CoordinatorNotAvailable
        )
    )
}

/// How often at most the writers of a repartition tell event time between
/// barriers, unless told otherwise ([`KafkaCluster::watermark_interval`]).
const DEFAULT_WATERMARK_INTERVAL: Duration = Duration::from_millis(50);

/// Runs a query in several processes that share it through a Kafka cluster.
///
/// Any dataflow that runs in one process runs here, with `repartition_by`
/// where it would `key_by`: any number of repartitions, stream-stream joins,
/// `drop_duplicates`, windows, keyed processors and broadcast joins after any
/// of them. Records that cross a repartition are serde types.
///
/// ```no_run
/// use rtflow_connectors::kafka::{KafkaCluster, KafkaMessage, KafkaRecord, KafkaSink, KafkaSource};
/// use rtflow_operators::KeyedStreamExt;
/// use rtflow_runtime::QueryConfig;
/// // Run this in every process; each counts the clicks of the users it is given.
/// let query = KafkaCluster::new("127.0.0.1:9092")
///     .instance("host-a")
///     .repartition_partitions(6)
///     .start(QueryConfig::new("clicks-per-user"), |flow| {
///         flow.source(KafkaSource::new("127.0.0.1:9092").subscribe(["clicks"]))
///             .repartition_by(|click: &KafkaRecord| click.key_str().into_owned())
///             .count()
///             .sink(KafkaSink::new(
///                 "127.0.0.1:9092",
///                 "clicks-per-user",
///                 |(user, clicks): &(String, u64)| KafkaMessage::new(format!("{user}:{clicks}")),
///             ));
///         Ok(())
///     })?;
/// query.stop()?;
/// # Ok::<(), rtflow_runtime::RtflowError>(())
/// ```
#[derive(Debug, Clone)]
pub struct KafkaCluster {
    bootstrap_servers: String,
    instance: Option<String>,
    repartition_partitions: Option<usize>,
    session_timeout: Duration,
    restore_timeout: Duration,
    retry_timeout: Duration,
    standby_replicas: usize,
    static_membership: bool,
    rack: Option<String>,
    watermark_interval: Duration,
    options: Options,
}

impl KafkaCluster {
    /// A cluster on the Kafka brokers at `bootstrap_servers`.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            instance: None,
            repartition_partitions: None,
            session_timeout: Duration::from_secs(6),
            restore_timeout: Duration::from_secs(300),
            retry_timeout: Duration::from_secs(300),
            standby_replicas: 0,
            static_membership: true,
            rack: None,
            watermark_interval: DEFAULT_WATERMARK_INTERVAL,
            options: Options::default(),
        }
    }

    /// The process's lasting name in the cluster (by default one made anew at
    /// each start). A process restarted under the same name fences its
    /// previous incarnation at once: the transaction that one left open is
    /// aborted, rather than timed out.
    ///
    /// A named process is also a static member of the query's groups
    /// (Kafka's `group.instance.id`; see
    /// [`static_membership`](Self::static_membership)): restarted under its
    /// name within the session timeout, it takes back the partitions it had
    /// without a rebalance, and the other processes run on untouched.
    pub fn instance(mut self, name: impl Into<String>) -> Self {
        self.instance = Some(name.into());
        self
    }

    /// Whether a process named by [`instance`](Self::instance) is a static
    /// member of the query's groups (KIP-345); yes by default.
    ///
    /// A static member that dies keeps its partitions until its session
    /// times out, as any member does; restarted under its name before then,
    /// it rejoins in place of its dead incarnation and gets the same
    /// partitions back at once, with no rebalance of the others. A process
    /// that stops ([`ClusteredQuery::stop`]) leaves the groups all the same,
    /// so that its partitions move on at once. Turned off, a restarted
    /// process joins as a newcomer: its partitions move twice (when the
    /// group drops the dead incarnation, then when the new one joins).
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .instance("host-a")
    ///     .static_membership(false)
    ///     .start(QueryConfig::new("clicks-per-user"), |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn static_membership(mut self, on: bool) -> Self {
        self.static_membership = on;
        self
    }

    /// How many partitions each repartition topic (and the changelog) has;
    /// by default one per key group (`QueryConfig::max_key_groups`). It
    /// bounds how many processes share the stages after the first
    /// repartition. Fixed for the query's life: it decides where each key's
    /// state lives.
    pub fn repartition_partitions(mut self, partitions: usize) -> Self {
        self.repartition_partitions = Some(partitions.max(1));
        self
    }

    /// How soon the group notices a process that died and moves its
    /// partitions (Kafka's `session.timeout.ms`); 6 s by default.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How long a run may take to restore its keyed state from the changelog
    /// before it fails with `CHECKPOINT_FAILED`; 5 minutes by default. A
    /// restore reads each changelog partition it takes to its end, and
    /// where a transaction is still open there (left by a process that died
    /// and was not fenced) it waits for that transaction to end: what was
    /// committed after it is hidden until then, and a restore without it
    /// would resume the committed offsets with older state. A restore that
    /// times out fails its run with `CHECKPOINT_FAILED`, which is restarted
    /// for the [`retry_timeout`](Self::retry_timeout).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .instance("host-a")
    ///     .restore_timeout(Duration::from_secs(60))
    ///     .start(QueryConfig::new("clicks-per-user"), |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn restore_timeout(mut self, timeout: Duration) -> Self {
        self.restore_timeout = timeout;
        self
    }

    /// How long a process goes on restarting runs that fail on the cluster
    /// itself (`CHECKPOINT_FAILED`: a restore or commit that could not reach
    /// a broker, a partition leader or coordinator that moved) before it
    /// gives up; 5 minutes by default, as Kafka Streams' `task.timeout.ms`.
    /// After a broker's crash such failures pass once Kafka has recovered.
    /// Each attempt waits twice as long as the one before, from 100 ms up
    /// to 5 s. Any other failure ends the process after three failed runs
    /// in a row, and so do these once the timeout has passed (at once with
    /// a timeout of zero).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .instance("host-a")
    ///     .retry_timeout(Duration::from_secs(60))
    ///     .start(QueryConfig::new("clicks-per-user"), |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn retry_timeout(mut self, timeout: Duration) -> Self {
        self.retry_timeout = timeout;
        self
    }

    /// How many processes besides its owner keep a warm copy of each
    /// changelog partition (Kafka Streams' `num.standby.replicas`); none by
    /// default. A process that takes a partition over after a failure then
    /// restores it from its copy and reads only the changelog written since,
    /// instead of the whole partition. The copies live at the query's
    /// checkpoint location, which this needs; each costs the process a
    /// consumer of the changelog and the partition's state in memory.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let config = QueryConfig::new("clicks-per-user").checkpoint_location("/var/lib/rtflow/clicks");
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .instance("host-a")
    ///     .standby_replicas(1)
    ///     .start(config, |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn standby_replicas(mut self, replicas: usize) -> Self {
        self.standby_replicas = replicas;
        self
    }

    /// The rack (or availability zone) the process runs in, as Kafka
    /// Streams' `rack.aware.assignment.tags`: standby replicas go to
    /// processes in racks other than their owner's, and other than each
    /// other's, as far as the racks of the live processes allow, so that
    /// losing a rack leaves a warm copy of every partition it owned. The
    /// process's group members announce it as their `client.rack`. A
    /// process without one counts as a rack of its own.
    ///
    /// ```no_run
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let config = QueryConfig::new("clicks-per-user").checkpoint_location("/var/lib/rtflow/clicks");
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .instance("host-a")
    ///     .rack("eu-west-1a")
    ///     .standby_replicas(1)
    ///     .start(config, |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn rack(mut self, rack: impl Into<String>) -> Self {
        self.rack = Some(rack.into());
        self
    }

    /// How often at most the writers of a repartition tell its readers how
    /// far event time went between two barriers; 50 ms by default (as
    /// Flink's `pipeline.auto-watermark-interval`, 200 ms there). Windows
    /// and timers after a repartition fire within about this of the event
    /// time passing them, whatever the batch duration. Each time, every
    /// process tells every repartition partition: one small message each.
    ///
    /// Zero tells nothing between barriers: event time crosses a
    /// repartition once per batch, at each barrier, as the records'
    /// offsets commit.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use rtflow_connectors::kafka::KafkaCluster;
    /// use rtflow_runtime::QueryConfig;
    /// let query = KafkaCluster::new("127.0.0.1:9092")
    ///     .watermark_interval(Duration::from_millis(200))
    ///     .start(QueryConfig::new("clicks-per-user"), |flow| Ok(()))?;
    /// # Ok::<(), rtflow_runtime::RtflowError>(())
    /// ```
    pub fn watermark_interval(mut self, interval: Duration) -> Self {
        self.watermark_interval = interval;
        self
    }

    /// Sets a librdkafka setting for every client of the cluster:
    /// `.option("kafka.<key>", value)`.
    pub fn option(mut self, key: &str, value: impl ToString) -> Self {
        self.options.set(key, &value.to_string());
        self
    }

    /// Joins the query's group and runs `build`'s dataflow for the partitions
    /// this process is given, until [`ClusteredQuery::stop`]. `build` is
    /// called for every run: at the start, and again whenever the group moves
    /// partitions to or from the process.
    ///
    /// A `build` that panics or fails fails the start (the first call, on
    /// this thread) or the process's part of the query (a later call, on its
    /// runner), naming the query; [`ClusteredQuery::exception`] keeps it.
    ///
    /// Checkpoints commit into Kafka, so `config` needs no checkpoint
    /// location. Given one (of this process alone), the process keeps there a
    /// copy of each changelog partition it restored, and a later restore of
    /// the partition reads only the changelog after it.
    pub fn start<F>(self, config: QueryConfig, build: F) -> Result<ClusteredQuery>
    where
        F: Fn(&Dataflow) -> Result<()> + Send + 'static,
    {
        let batch_duration = config.trigger.batch_duration()?;
        self.options.client_config("KafkaCluster", &[])?;
        if self.standby_replicas > 0 && config.checkpoint_location.is_none() {
            return Err(RtflowError::InvalidConfiguration(format!(
                "KafkaCluster: {} standby replicas need a checkpoint location, where the \
                 process keeps its copies of the changelog",
                self.standby_replicas
            )));
        }
        if self.restore_timeout.is_zero() {
            return Err(RtflowError::InvalidConfiguration(
                "KafkaCluster: a restore timeout of zero fails every restore that has \
                 changelog to read; give it at least the time a restore takes"
                    .into(),
            ));
        }
        let static_member = self.static_membership && self.instance.is_some();
        let settings = ClusterSettings {
            query: config.name.clone(),
            bootstrap_servers: self.bootstrap_servers,
            instance: self
                .instance
                .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()),
            static_member,
            rack: self.rack,
            repartition_partitions: self.repartition_partitions.unwrap_or(config.max_key_groups),
            key_groups: config.max_key_groups,
            session_timeout: self.session_timeout,
            batch_duration,
            watermark_interval: (!self.watermark_interval.is_zero())
                .then_some(self.watermark_interval),
            transaction_timeout: (batch_duration * 3).max(Duration::from_secs(10)),
            operation_timeout: Duration::from_secs(30),
            restore_timeout: self.restore_timeout,
            retry_timeout: self.retry_timeout,
            standby_replicas: self.standby_replicas,
            copies: config
                .checkpoint_location
                .as_deref()
                .map(local::LocalCopies::open)
                .transpose()?,
            options: self.options,
        };
        if settings.query.is_empty() {
            return Err(RtflowError::InvalidConfiguration(
                "a clustered query needs a name: its processes find each other by it".into(),
            ));
        }
        runner::start(Arc::new(settings), config, build)
    }
}

/// What every part of a process's cluster shares.
pub(crate) struct ClusterSettings {
    pub(crate) query: String,
    pub(crate) bootstrap_servers: String,
    pub(crate) instance: String,
    /// Whether the process joins the groups as a static member, under its
    /// instance name.
    pub(crate) static_member: bool,
    /// The rack the process runs in, if it was told.
    pub(crate) rack: Option<String>,
    pub(crate) repartition_partitions: usize,
    pub(crate) key_groups: usize,
    pub(crate) session_timeout: Duration,
    /// The trigger's batch duration: how far apart each process commits.
    pub(crate) batch_duration: Duration,
    /// How often at most writers tell event time between barriers; `None`:
    /// only at barriers.
    pub(crate) watermark_interval: Option<Duration>,
    pub(crate) transaction_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) restore_timeout: Duration,
    /// How long runs that fail on the cluster are restarted (`retries`).
    pub(crate) retry_timeout: Duration,
    /// How many processes besides a changelog partition's owner keep a
    /// warm copy of it (`standby`).
    pub(crate) standby_replicas: usize,
    /// Local copies of changelog partitions, kept at the checkpoint location
    /// when the query has one.
    pub(crate) copies: Option<local::LocalCopies>,
    options: Options,
}

impl ClusterSettings {
    /// Settings of a query `q-1` on a broker nobody listens on, with
    /// `options`, for unit tests.
    #[cfg(test)]
    pub(crate) fn for_tests(options: Options) -> Self {
        Self {
            query: "q-1".into(),
            bootstrap_servers: "127.0.0.1:1".into(),
            instance: "a".into(),
            static_member: false,
            rack: None,
            repartition_partitions: 4,
            key_groups: 8,
            session_timeout: Duration::from_secs(6),
            batch_duration: Duration::from_secs(1),
            watermark_interval: Some(DEFAULT_WATERMARK_INTERVAL),
            transaction_timeout: Duration::from_secs(10),
            operation_timeout: Duration::from_secs(30),
            restore_timeout: Duration::from_secs(300),
            retry_timeout: Duration::from_secs(300),
            standby_replicas: 0,
            copies: None,
            options,
        }
    }

    /// The consumer group of the query's processes, which shares out the
    /// source topics' partitions.
    pub(crate) fn group(&self) -> String {
        format!("rtflow-{}", self.query)
    }

    /// The group whose offsets of `topic` the process commits: the stage
    /// after the repartition has a group of its own, so that each stage's
    /// partitions are spread evenly over the processes (one group balances
    /// only the sum of all its topics' partitions).
    pub(crate) fn group_of(&self, topic: &str) -> String {
        if self.is_repartition_topic(topic) {
            format!("{}-repartition", self.group())
        } else {
            self.group()
        }
    }

    pub(crate) fn repartition_topic(&self, stage: usize) -> String {
        format!("rtflow-{}-{stage}-repartition", self.query)
    }

    pub(crate) fn is_repartition_topic(&self, topic: &str) -> bool {
        self.repartition_stage(topic).is_some()
    }

    /// The stage whose repartition topic `topic` is.
    pub(crate) fn repartition_stage(&self, topic: &str) -> Option<usize> {
        topic
            .strip_prefix(&format!("rtflow-{}-", self.query))?
            .strip_suffix("-repartition")?
            .parse()
            .ok()
    }

    /// The partitions a process owns, given those the groups `assigned` it,
    /// in a dataflow of `stages` repartitions. The repartition group assigns
    /// only stage 0's topic; whoever owns its partition `p` owns partition
    /// `p` of every later stage too, so each key group's state stays in one
    /// process whichever stage keys by it, without an assignor of rtflow's
    /// own.
    pub(crate) fn co_partitioned(
        &self,
        assigned: &BTreeSet<(String, i32)>,
        stages: usize,
    ) -> BTreeSet<(String, i32)> {
        let first = self.repartition_topic(0);
        let mut owned = assigned.clone();
        for (_, partition) in assigned.iter().filter(|(topic, _)| *topic == first) {
            owned.extend((1..stages).map(|stage| (self.repartition_topic(stage), *partition)));
        }
        owned
    }

    pub(crate) fn changelog_topic(&self) -> String {
        format!("rtflow-{}-changelog", self.query)
    }

    pub(crate) fn shapes_topic(&self) -> String {
        format!("rtflow-{}-shapes", self.query)
    }

    /// The compacted topic naming the instances that ran the query and may
    /// have left a transaction open (`departures`).
    pub(crate) fn instances_topic(&self) -> String {
        format!("rtflow-{}-instances", self.query)
    }

    /// The transactional id of the process named `instance`, for `lane` of
    /// `tier`.
    pub(crate) fn transactional_id_of(&self, instance: &str, tier: Tier, lane: usize) -> String {
        // '#' keeps them apart from any other instance's first id.
        match (tier, lane) {
            (Tier::Sourced, 0) => format!("rtflow-{}-{instance}", self.query),
            (Tier::Sourced, lane) => format!("rtflow-{}-{instance}#sourced-{lane}", self.query),
            (Tier::Repartitioned, _) => format!("rtflow-{}-{instance}#repartitioned", self.query),
        }
    }

    /// The configuration of a consumer of `group` that sees only committed
    /// transactions, and so also fetches only stable committed offsets
    /// (librdkafka's `require_stable` follows `isolation.level`), and
    /// commits nothing itself.
    pub(crate) fn committed_reader(&self, group: &str) -> ClientConfig {
        let mut config = self.client_config();
        config
            .set("group.id", group)
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false");
        config
    }

    /// A client that is told partitions' high watermarks, past transactions
    /// still open or whose markers are on their way.
    pub(crate) fn uncommitted_reader(&self) -> ClientConfig {
        let mut config = self.client_config();
        config.set("isolation.level", "read_uncommitted");
        config
    }

    /// How long a commit waits for the transactions its readers read from
    /// to end: a reader that took its barrier late read records of another
    /// process's next epoch, whose first transaction commits at that
    /// process's next barrier, up to a batch duration away.
    pub(crate) fn upstream_timeout(&self) -> Duration {
        self.batch_duration + self.operation_timeout
    }

    /// A client configuration: the brokers, then the user's options.
    pub(crate) fn client_config(&self) -> ClientConfig {
        self.options
            .client_config(
                "KafkaCluster",
                &[("bootstrap.servers", &self.bootstrap_servers)],
            )
            .expect("options were checked at start")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_coordinator_moving_is_told_apart_from_other_refusals() {
        for code in [
            RDKafkaErrorCode::NotCoordinator,
            RDKafkaErrorCode::CoordinatorLoadInProgress,
            RDKafkaErrorCode::CoordinatorNotAvailable,
        ] {
            assert!(coordinator_moving(&KafkaError::MetadataFetch(code)));
            assert!(coordinator_moving(&KafkaError::GroupListFetch(code)));
        }
        for code in [
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::GroupAuthorizationFailed,
        ] {
            assert!(!coordinator_moving(&KafkaError::MetadataFetch(code)));
        }
    }

    fn settings() -> ClusterSettings {
        ClusterSettings::for_tests(Options::default())
    }

    #[test]
    fn standby_replicas_without_a_checkpoint_location_are_refused() {
        let error = KafkaCluster::new("127.0.0.1:1")
            .standby_replicas(1)
            .start(QueryConfig::new("q"), |_| Ok(()))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(error.error_class(), "INVALID_CONFIGURATION", "{error}");
        assert!(error.to_string().contains("checkpoint location"), "{error}");
    }

    #[test]
    fn a_restore_timeout_of_zero_is_refused() {
        let error = KafkaCluster::new("127.0.0.1:1")
            .restore_timeout(Duration::ZERO)
            .start(QueryConfig::new("q"), |_| Ok(()))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(error.error_class(), "INVALID_CONFIGURATION", "{error}");
        assert!(error.to_string().contains("restore timeout"), "{error}");
    }

    #[test]
    fn repartition_topics_name_their_stage() {
        let settings = settings();
        assert_eq!(
            settings.repartition_stage("rtflow-q-1-0-repartition"),
            Some(0)
        );
        assert_eq!(
            settings.repartition_stage("rtflow-q-1-12-repartition"),
            Some(12)
        );
        assert_eq!(settings.repartition_stage("rtflow-q-1-changelog"), None);
        assert_eq!(settings.repartition_stage("rtflow-q-2-0-repartition"), None);
        assert_eq!(settings.repartition_stage("orders"), None);
        assert_eq!(
            settings.group_of("rtflow-q-1-3-repartition"),
            "rtflow-q-1-repartition"
        );
        assert_eq!(settings.group_of("orders"), "rtflow-q-1");
    }

    #[test]
    fn the_owner_of_a_first_stage_partition_owns_that_partition_of_every_stage() {
        let settings = settings();
        let assigned: BTreeSet<(String, i32)> = [
            ("orders".to_owned(), 0),
            ("orders".to_owned(), 3),
            ("rtflow-q-1-0-repartition".to_owned(), 1),
            ("rtflow-q-1-0-repartition".to_owned(), 2),
        ]
        .into_iter()
        .collect();
        let owned = settings.co_partitioned(&assigned, 3);
        let expected: BTreeSet<(String, i32)> = assigned
            .iter()
            .cloned()
            .chain([1, 2].into_iter().flat_map(|p| {
                [
                    ("rtflow-q-1-1-repartition".to_owned(), p),
                    ("rtflow-q-1-2-repartition".to_owned(), p),
                ]
            }))
            .collect();
        assert_eq!(owned, expected);
        assert_eq!(settings.co_partitioned(&assigned, 1), assigned);
    }
}
