//! Clients that look topics up, one per configuration, kept for the life of
//! the process.
//!
//! A new librdkafka client takes some 50 ms to connect and answer its first
//! metadata request. Every start of a query paid that for each source (which
//! partitions it reads) and each sink writer (whether its topic exists), and a
//! clustered query starts a run at every rebalance: there it sat in the pause
//! of every key. A kept client answers from its connection in a millisecond.

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

/// The kept client of `config`, made on its first use.
pub(super) fn client(config: &ClientConfig) -> KafkaResult<Arc<BaseConsumer>> {
    let settings: Settings = config
        .config_map()
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect();
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
