//! A [`Store`] on etcd v3.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use rekindle_runtime::store::{CasOutcome, Store, StoreError, StoreResult};

use crate::etcd::{EtcdConfig, EtcdConn};

/// A [`Store`] whose keys live in etcd under a prefix, optionally bound to a lease.
///
/// - `wait` reads the keys in one transaction, then watches the missing ones from the next
///   revision: no polling, and a key set between the read and the watch is not missed;
/// - `add` is a compare-and-swap on the key's `mod_revision`, retried on contention;
/// - `compare_and_set` is one transaction comparing the value (or `version == 0` for absent);
/// - with a lease ([`EtcdStore::with_lease`]) every key written is bound to it, so the keys of
///   a dead job vanish when the lease expires.
///
/// Connection failures are [`StoreError::Connection`]; refused credentials are
/// [`StoreError::Unauthorized`]. `wait` retries through a lost connection until its timeout;
/// `get` and `set` (idempotent) until the request timeout; `add` and `compare_and_set` fail
/// at once, since an attempt may have been applied.
#[derive(Debug, Clone)]
pub struct EtcdStore {
    conn: Arc<EtcdConn>,
    prefix: String,
    lease: Option<i64>,
}

impl EtcdStore {
    /// Connects to the cluster in `cfg`; every key is stored as `prefix + key`.
    pub fn connect(cfg: &EtcdConfig, prefix: &str) -> StoreResult<Self> {
        Ok(Self::from_conn(
            Arc::new(EtcdConn::connect(cfg)?),
            prefix,
            None,
        ))
    }

    pub(crate) fn from_conn(conn: Arc<EtcdConn>, prefix: &str, lease: Option<i64>) -> Self {
        EtcdStore {
            conn,
            prefix: prefix.to_string(),
            lease,
        }
    }

    /// The same store with every write bound to `lease`.
    pub fn with_lease(mut self, lease: i64) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The same connection under another prefix (appended to this one).
    pub fn sub_store(&self, prefix: &str) -> EtcdStore {
        EtcdStore {
            conn: self.conn.clone(),
            prefix: format!("{}{prefix}", self.prefix),
            lease: self.lease,
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn put_options(&self) -> Option<PutOptions> {
        self.lease.map(|l| PutOptions::new().with_lease(l))
    }
}

/// One attempt at `wait`: `Ok(Err(missing))` when the timeout passed.
async fn wait_once(
    mut client: etcd_client::Client,
    keys: Vec<String>,
    deadline: tokio::time::Instant,
) -> Result<Result<Vec<Vec<u8>>, Vec<String>>, etcd_client::Error> {
    let ops: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(k.clone(), None)).collect();
    let resp = client.txn(Txn::new().and_then(ops)).await?;
    let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
    let mut found: Vec<Option<Vec<u8>>> = resp
        .op_responses()
        .into_iter()
        .map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        })
        .collect();
    found.resize(keys.len(), None);
    let missing = |found: &[Option<Vec<u8>>]| -> Vec<String> {
        keys.iter()
            .zip(found)
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.clone())
            .collect()
    };
    let first_missing = missing(&found);
    if first_missing.is_empty() {
        return Ok(Ok(found.into_iter().flatten().collect()));
    }
    let opts = || Some(WatchOptions::new().with_start_revision(rev + 1));
    let mut stream = client.watch(first_missing[0].clone(), opts()).await?;
    for k in &first_missing[1..] {
        stream.watch(k.clone(), opts()).await?;
    }
    loop {
        let msg = match tokio::time::timeout_at(deadline, stream.message()).await {
            Err(_) => return Ok(Err(missing(&found))),
            Ok(m) => m?,
        };
        let Some(msg) = msg else {
            return Err(etcd_client::Error::WatchError(
                "the watch stream ended".into(),
            ));
        };
        if msg.canceled() {
            return Err(etcd_client::Error::WatchError(format!(
                "the watch was cancelled: {}",
                msg.cancel_reason()
            )));
        }
        for ev in msg.events() {
            if ev.event_type() != EventType::Put {
                continue;
            }
            if let Some(kv) = ev.kv() {
                for (k, slot) in keys.iter().zip(found.iter_mut()) {
                    if slot.is_none() && kv.key() == k.as_bytes() {
                        *slot = Some(kv.value().to_vec());
                    }
                }
            }
        }
        if found.iter().all(|v| v.is_some()) {
            return Ok(Ok(found.into_iter().flatten().collect()));
        }
    }
}

impl EtcdStore {
    /// Runs an idempotent operation again while the cluster is unreachable (a member
    /// restarting, a leader election), until the request timeout.
    fn retrying<T>(&self, mut f: impl FnMut() -> StoreResult<T>) -> StoreResult<T> {
        let deadline = Instant::now() + self.conn.timeout;
        let mut backoff = Duration::from_millis(50);
        loop {
            match f() {
                Err(StoreError::Connection { .. }) if Instant::now() + backoff < deadline => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                other => return other,
            }
        }
    }
}

impl Store for EtcdStore {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.retrying(|| {
            let (k, v, o) = (self.key(key), value.to_vec(), self.put_options());
            self.conn.call("set", move |mut c| async move {
                c.put(k, v, o).await.map(|_| ())
            })
        })
    }

    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        self.retrying(|| {
            let k = self.key(key);
            self.conn.call("get", move |mut c| async move {
                let r = c.get(k, None).await?;
                Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
            })
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let mut backoff = Duration::from_millis(50);
        loop {
            let keys = full.clone();
            let tokio_deadline =
                tokio::time::Instant::now() + deadline.saturating_duration_since(Instant::now());
            let out = self
                .conn
                .call_until("wait", deadline + self.conn.timeout, move |c| {
                    wait_once(c, keys, tokio_deadline)
                });
            match out {
                Ok(Ok(values)) => return Ok(values),
                Ok(Err(missing)) => {
                    return Err(StoreError::Timeout {
                        missing: missing
                            .into_iter()
                            .map(|k| k[self.prefix.len()..].to_string())
                            .collect(),
                        timeout,
                    })
                }
                Err(StoreError::Connection { .. }) if Instant::now() + backoff < deadline => {
                    // The cluster is restarting or a member is gone: retry the read-then-watch
                    // until the caller's timeout.
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        let k = self.key(key);
        let o = self.put_options();
        let shown = key.to_string();
        self.conn
            .call("add", move |mut c| async move {
                loop {
                    let r = c.get(k.clone(), None).await?;
                    let (old, rev) = match r.kvs().first() {
                        None => (0, 0),
                        Some(kv) => match std::str::from_utf8(kv.value())
                            .ok()
                            .and_then(|s| s.trim().parse::<i64>().ok())
                        {
                            Some(n) => (n, kv.mod_revision()),
                            None => return Ok(Err(shown)),
                        },
                    };
                    let new = old.wrapping_add(delta);
                    let cmp = if rev == 0 {
                        Compare::version(k.clone(), CompareOp::Equal, 0)
                    } else {
                        Compare::mod_revision(k.clone(), CompareOp::Equal, rev)
                    };
                    let txn = Txn::new().when([cmp]).and_then([TxnOp::put(
                        k.clone(),
                        new.to_string(),
                        o.clone(),
                    )]);
                    if c.txn(txn).await?.succeeded() {
                        return Ok(Ok(new));
                    }
                }
            })?
            .map_err(|key| StoreError::InvalidValue {
                key,
                reason: "not a decimal integer".into(),
            })
    }

    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        let k = self.key(key);
        let o = self.put_options();
        let (expected, value) = (expected.map(|e| e.to_vec()), value.to_vec());
        self.conn.call("compare_and_set", move |mut c| async move {
            let cmp = match expected {
                None => Compare::version(k.clone(), CompareOp::Equal, 0),
                Some(e) => Compare::value(k.clone(), CompareOp::Equal, e),
            };
            let txn = Txn::new()
                .when([cmp])
                .and_then([TxnOp::put(k.clone(), value, o)])
                .or_else([TxnOp::get(k.clone(), None)]);
            let r = c.txn(txn).await?;
            if r.succeeded() {
                return Ok(CasOutcome::Swapped);
            }
            let current = r.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(g) => Some(g.kvs().first().map(|kv| kv.value().to_vec())),
                _ => None,
            });
            Ok(CasOutcome::Current(current.flatten()))
        })
    }

    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        let k = self.key(prefix);
        self.conn.call("delete_prefix", move |mut c| async move {
            let opts = if k.is_empty() {
                DeleteOptions::new().with_all_keys()
            } else {
                DeleteOptions::new().with_prefix()
            };
            let r = c.delete(k, Some(opts)).await?;
            Ok(r.deleted().max(0) as u64)
        })
    }
}

/// Reads every key and value under `prefix` (used by the rendezvous backend and tests).
pub(crate) fn get_prefix_opts() -> GetOptions {
    GetOptions::new().with_prefix()
}
