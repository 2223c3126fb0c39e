//! Clients that look things up in the cluster, one per configuration, kept
//! for the life of the process.
//!
//! A new librdkafka client takes some 50 ms to connect and answer its first
//! request. Every start of a query paid that for each source (which
//! partitions it reads) and each sink writer (whether its topic exists), and
//! a clustered run for each group whose committed offsets it resumes from;
//! a clustered query starts a run at every rebalance, where it sat in the
//! pause of every key. A kept client answers from its connection in a
//! millisecond.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaResult;
use rdkafka::ClientConfig;

/// A configuration's settings, as the key of its client.
type Settings = Vec<(String, String)>;

static CLIENTS: Mutex<BTreeMap<Settings, Arc<BaseConsumer>>> = Mutex::new(BTreeMap::new());

/// How many clients are kept at most: a configuration made anew for every
/// query (a client id with a run's id in it) must not keep one each for
/// ever.
const MAX_CLIENTS: usize = 16;

fn settings(config: &ClientConfig) -> Settings {
    config
        .config_map()
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

/// The kept client of `config`, made on its first use.
pub(super) fn client(config: &ClientConfig) -> KafkaResult<Arc<BaseConsumer>> {
    let settings = settings(config);
    let mut clients = CLIENTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(client) = clients.get(&settings) {
        return Ok(client.clone());
    }
    let client = Arc::new(config.create::<BaseConsumer>()?);
    // Closed once the lock is let go: a close takes a tenth of a second.
    let evicted = (clients.len() >= MAX_CLIENTS)
        .then(|| clients.pop_first())
        .flatten();
    clients.insert(settings, client.clone());
    drop(clients);
    drop(evicted);
    Ok(client)
}

/// Stops keeping the client of `config`, whose request failed: the next
/// use makes a new one.
pub(super) fn forget(config: &ClientConfig) {
    // Closed once the lock is let go, as in `client`.
    let forgotten = CLIENTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&settings(config));
    drop(forgotten);
}
