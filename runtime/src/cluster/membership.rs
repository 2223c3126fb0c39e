//! What a process of a clustered query is and owns, as the parts that run in
//! it (sources, keyed state) ask: it names no connector or operator, so that
//! those can hold it while the [`ClusterLink`](super::ClusterLink) built on
//! it hands out connectors.

use std::any::Any;

/// A process's membership in the cluster it runs a query in: its name and
/// the partitions and key groups it owns now.
pub trait Membership: Send + Sync + 'static {
    /// The process's name in the cluster, for progress and metrics.
    fn member(&self) -> String;

    /// The partitions this process owns, as `topic-partition`, for progress
    /// reports and metrics.
    fn partitions(&self) -> Vec<String>;

    /// Whether this process owns key group `group`: its keyed state is
    /// restored here, and only here may it be written.
    fn owns_key_group(&self, group: u32) -> bool;

    /// Of the `(topic, partition)`s a source reads, the indexes of those this
    /// process owns now.
    fn owned(&self, partitions: &[(String, i32)]) -> Vec<usize>;

    /// For connectors that look for their own cluster behind the link.
    fn as_any(&self) -> &dyn Any;
}
