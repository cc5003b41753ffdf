//! The rendezvous backend on etcd v3: leases for liveness, transactions for compare-and-set,
//! watches for waiting.
//!
//! Keys (all under `/rekindle/<job>/`):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `lease` | the job lease id (decimal) | the job lease |
//! | `state` | the [`RendezvousState`](super::RendezvousState) as JSON | the job lease |
//! | `nodes/<node id>` | the node's id | the node's lease |
//! | `finished` | the job-finished record (JSON) | a lease of TTL = retention, never kept alive |
//! | `r<round>/...` | keys the job's workers write through [`RendezvousBackend::job_store`] | the job lease |
//!
//! The job lease is kept alive by every live node of the job, so the job's state lives while
//! any node does and vanishes one TTL after the last one is gone. A node's own lease is kept
//! alive by that node only; it expires one TTL after the node dies and is revoked at once on
//! a graceful leave.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use rekindle_runtime::store::{Store, StoreError, StoreResult};

use super::backend::{RendezvousBackend, Snapshot, Token, TokenKind};
use crate::etcd::{EtcdConfig, EtcdConn, Redial};
use crate::store::{get_prefix_opts, EtcdStore};

/// The smallest lease TTL etcd grants reliably.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);

/// Options of the etcd backend.
#[derive(Debug, Clone)]
pub struct EtcdBackendOptions {
    /// The TTL of the node and job leases (at least [`MIN_LEASE_TTL`]; rounded up to seconds).
    pub lease_ttl: Duration,
    /// How long the job-finished record is kept.
    pub finished_retention: Duration,
}

impl Default for EtcdBackendOptions {
    fn default() -> Self {
        EtcdBackendOptions {
            lease_ttl: Duration::from_secs(5),
            finished_retention: Duration::from_secs(600),
        }
    }
}

#[derive(Default)]
struct Leases {
    node: Option<i64>,
    job: Option<i64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The etcd rendezvous backend of one job.
pub struct EtcdBackend {
    conn: Arc<EtcdConn>,
    job: String,
    prefix: String,
    opts: EtcdBackendOptions,
    leases: Mutex<Leases>,
    lost: Arc<AtomicBool>,
    /// Endpoints, user and TLS files for the workers' own connections.
    endpoints: Vec<String>,
    user: Option<String>,
    tls: Option<crate::etcd::EtcdTls>,
    /// The file the workers read the user's password from.
    password_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoint", &self.conn.endpoint())
            .field("job", &self.job)
            .finish()
    }
}

/// Checks a job id: non-empty, at most 128 bytes of `[A-Za-z0-9._-]`, so it cannot escape its
/// key prefix.
pub fn validate_job_id(job: &str) -> Result<(), String> {
    if job.is_empty() {
        return Err("the job id is empty".into());
    }
    if job.len() > 128 {
        return Err(format!(
            "the job id is {} bytes long (at most 128)",
            job.len()
        ));
    }
    if let Some(c) = job
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "the job id {job:?} contains {c:?} (allowed: A-Z a-z 0-9 . _ -)"
        ));
    }
    Ok(())
}

fn ttl_secs(d: Duration) -> i64 {
    (d.as_secs_f64().ceil() as i64).max(MIN_LEASE_TTL.as_secs() as i64)
}

/// Keeps lease `id` alive, every third of its TTL, until the task is aborted; sets `lost` when
/// etcd says the lease is gone. After a failed round trip it retries within a quarter of a
/// second on a new connection (see [`Redial`]): after a network partition heals, the renewal
/// must reach etcd before the TTL runs out, not when the old connection's TCP back-off ends.
async fn keep_alive(
    mut client: Client,
    redial: Redial,
    id: i64,
    ttl: Duration,
    lost: Arc<AtomicBool>,
) {
    let interval = ttl / 3;
    let retry_cap = interval.min(Duration::from_millis(250));
    let mut backoff = Duration::from_millis(50);
    // Short at first, so a dial lost in a partition is soon replaced by one after the heal;
    // doubled after each failure, so a slow but working network still gets through.
    let first_dial = interval.min(Duration::from_millis(500));
    let mut dial_timeout = first_dial;
    loop {
        if let Ok((mut keeper, mut stream)) = client.lease_keep_alive(id).await {
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match tokio::time::timeout(interval, stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => backoff = Duration::from_millis(50),
                    Ok(Ok(Some(_))) => {
                        // TTL 0: the lease is gone (expired while etcd was unreachable).
                        lost.store(true, Ordering::Release);
                        return;
                    }
                    _ => break,
                }
                tokio::time::sleep(interval).await;
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(retry_cap);
        match redial.connect(dial_timeout).await {
            Some(fresh) => {
                client = fresh;
                dial_timeout = first_dial;
            }
            None => dial_timeout = (dial_timeout * 2).min(interval),
        }
    }
}

impl EtcdBackend {
    /// Connects to etcd for job `job` (see [`validate_job_id`]).
    pub fn connect(cfg: &EtcdConfig, job: &str, opts: EtcdBackendOptions) -> StoreResult<Self> {
        validate_job_id(job).map_err(|reason| StoreError::InvalidValue {
            key: "job id".into(),
            reason,
        })?;
        Ok(EtcdBackend {
            conn: Arc::new(EtcdConn::connect(cfg)?),
            job: job.to_string(),
            prefix: format!("/rekindle/{job}/"),
            opts,
            leases: Mutex::default(),
            lost: Arc::new(AtomicBool::new(false)),
            endpoints: cfg.endpoints.clone(),
            user: cfg.user.as_ref().map(|(u, _)| u.clone()),
            tls: cfg.tls.clone(),
            password_file: None,
        })
    }

    /// Names the file that holds the etcd user's password, so that the workers can open the
    /// cluster with the same credentials ([`RendezvousBackend::worker_store_addr`]). Without
    /// it, a backend with a user gives the workers no etcd address.
    pub fn with_password_file(mut self, path: std::path::PathBuf) -> Self {
        self.password_file = Some(path);
        self
    }

    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn job_lease(&self) -> StoreResult<i64> {
        self.leases().job.ok_or_else(|| StoreError::Backend {
            op: "job lease",
            reason: "the node is not registered".into(),
        })
    }

    /// Finds the job lease, or creates it if no node holds one.
    fn acquire_job_lease(&self) -> StoreResult<i64> {
        let key = self.key("lease");
        let ttl = ttl_secs(self.opts.lease_ttl);
        self.conn
            .call("acquire the job lease", move |mut c| async move {
                loop {
                    let r = c.get(key.clone(), None).await?;
                    if let Some(kv) = r.kvs().first() {
                        if let Some(id) = std::str::from_utf8(kv.value())
                            .ok()
                            .and_then(|s| s.parse().ok())
                        {
                            return Ok(id);
                        }
                    }
                    let lease = c.lease_grant(ttl, None).await?.id();
                    let txn = Txn::new()
                        .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(
                            key.clone(),
                            lease.to_string(),
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    if c.txn(txn).await?.succeeded() {
                        return Ok(lease);
                    }
                    // Another node created it first: use theirs.
                    let _ = c.lease_revoke(lease).await;
                }
            })
    }
}

impl RendezvousBackend for EtcdBackend {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn endpoint(&self) -> String {
        self.conn.endpoint().to_string()
    }

    fn job(&self) -> &str {
        &self.job
    }

    fn register(&self, node_id: &str) -> StoreResult<()> {
        // Drop what is left of a previous registration.
        {
            let mut l = self.leases();
            for t in l.tasks.drain(..) {
                t.abort();
            }
            l.node = None;
            l.job = None;
        }
        self.lost.store(false, Ordering::Release);
        let ttl = ttl_secs(self.opts.lease_ttl);
        let key = self.key(&format!("nodes/{node_id}"));
        let id = node_id.to_string();
        let node_lease = self
            .conn
            .call("register the node", move |mut c| async move {
                let lease = c.lease_grant(ttl, None).await?.id();
                c.put(key, id, Some(PutOptions::new().with_lease(lease)))
                    .await?;
                Ok(lease)
            })?;
        let job_lease = self.acquire_job_lease()?;
        let handle = self.conn.handle().ok_or(StoreError::Closed)?;
        let mut l = self.leases();
        for lease in [node_lease, job_lease] {
            l.tasks.push(handle.spawn(keep_alive(
                self.conn.client(),
                self.conn.redial(),
                lease,
                self.opts.lease_ttl.max(MIN_LEASE_TTL),
                self.lost.clone(),
            )));
        }
        l.node = Some(node_lease);
        l.job = Some(job_lease);
        Ok(())
    }

    fn liveness_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn snapshot(&self) -> StoreResult<Snapshot> {
        let (state_key, nodes_key, finished_key) =
            (self.key("state"), self.key("nodes/"), self.key("finished"));
        let strip = nodes_key.len();
        self.conn
            .call("read the rendezvous state", move |mut c| async move {
                let txn = Txn::new().and_then([
                    TxnOp::get(state_key, None),
                    TxnOp::get(nodes_key, Some(get_prefix_opts())),
                    TxnOp::get(finished_key, None),
                ]);
                let r = c.txn(txn).await?;
                let revision = r.header().map(|h| h.revision()).unwrap_or(0);
                let mut gets = r.op_responses().into_iter().filter_map(|op| match op {
                    TxnOpResponse::Get(g) => Some(g),
                    _ => None,
                });
                let (Some(state), Some(nodes), Some(finished)) =
                    (gets.next(), gets.next(), gets.next())
                else {
                    return Err(etcd_client::Error::Internal(
                        "short transaction response".into(),
                    ));
                };
                let (state, state_rev) = match state.kvs().first() {
                    Some(kv) => (Some(kv.value().to_vec()), kv.mod_revision()),
                    None => (None, 0),
                };
                let alive = nodes
                    .kvs()
                    .iter()
                    .filter_map(|kv| {
                        std::str::from_utf8(&kv.key()[strip..])
                            .ok()
                            .map(String::from)
                    })
                    .collect::<BTreeSet<_>>();
                Ok(Snapshot {
                    state,
                    token: Token(TokenKind::Etcd {
                        state_rev,
                        revision,
                    }),
                    alive,
                    finished: !finished.kvs().is_empty(),
                })
            })
    }

    fn set_state(&self, state: &[u8], token: &Token) -> StoreResult<bool> {
        let TokenKind::Etcd { state_rev, .. } = token.0 else {
            return Err(StoreError::Backend {
                op: "set the rendezvous state",
                reason: "a token of another backend".into(),
            });
        };
        let lease = self.job_lease()?;
        let key = self.key("state");
        let value = state.to_vec();
        self.conn
            .call("write the rendezvous state", move |mut c| async move {
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        key.clone(),
                        CompareOp::Equal,
                        state_rev,
                    )])
                    .and_then([TxnOp::put(
                        key,
                        value,
                        Some(PutOptions::new().with_lease(lease)),
                    )]);
                Ok(c.txn(txn).await?.succeeded())
            })
    }

    fn wait_for_change(&self, token: &Token, deadline: Instant) -> StoreResult<()> {
        let TokenKind::Etcd { revision, .. } = token.0 else {
            return Err(StoreError::Backend {
                op: "wait for a rendezvous change",
                reason: "a token of another backend".into(),
            });
        };
        let keys = [self.key("state"), self.key("nodes/"), self.key("finished")];
        let budget = deadline.saturating_duration_since(Instant::now());
        if budget.is_zero() {
            return Ok(());
        }
        self.conn.call_until(
            "wait for a rendezvous change",
            deadline + self.conn.timeout,
            move |mut c| async move {
                let from = || WatchOptions::new().with_start_revision(revision + 1);
                let mut stream = c.watch(keys[0].clone(), Some(from())).await?;
                stream
                    .watch(keys[1].clone(), Some(from().with_prefix()))
                    .await?;
                stream.watch(keys[2].clone(), Some(from())).await?;
                let stop = tokio::time::Instant::now() + budget;
                loop {
                    match tokio::time::timeout_at(stop, stream.message()).await {
                        Err(_) => return Ok(()),
                        Ok(Ok(Some(m))) if m.canceled() => {
                            return Err(etcd_client::Error::WatchError(
                                m.cancel_reason().to_string(),
                            ))
                        }
                        Ok(Ok(Some(m))) if !m.events().is_empty() => return Ok(()),
                        Ok(Ok(Some(_))) => {}
                        Ok(Ok(None)) => {
                            return Err(etcd_client::Error::WatchError(
                                "the watch stream ended".into(),
                            ))
                        }
                        Ok(Err(e)) => return Err(e),
                    }
                }
            },
        )
    }

    fn mark_finished(&self, record: &[u8]) -> StoreResult<()> {
        let key = self.key("finished");
        let ttl = ttl_secs(self.opts.finished_retention);
        let value = record.to_vec();
        self.conn
            .call("write the job-finished record", move |mut c| async move {
                let lease = c.lease_grant(ttl, None).await?.id();
                c.put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await?;
                Ok(())
            })
    }

    fn leave(&self) -> StoreResult<()> {
        let node = {
            let mut l = self.leases();
            for t in l.tasks.drain(..) {
                t.abort();
            }
            l.job = None;
            l.node.take()
        };
        match node {
            Some(lease) => self
                .conn
                .call("revoke the node lease", move |mut c| async move {
                    c.lease_revoke(lease).await.map(|_| ())
                }),
            None => Ok(()),
        }
    }

    fn worker_store_addr(&self) -> Option<String> {
        if self.user.is_some() && self.password_file.is_none() {
            return None;
        }
        let lease = self.job_lease().ok()?;
        Some(
            crate::store::EtcdAddress {
                endpoints: self.endpoints.clone(),
                lease: Some(lease),
                user: self.user.clone(),
                password_file: self.password_file.clone(),
                tls: self.tls.clone(),
            }
            .format(),
        )
    }

    fn job_store(&self, prefix: &str) -> StoreResult<Arc<dyn Store>> {
        let lease = self.job_lease()?;
        Ok(Arc::new(EtcdStore::from_conn(
            self.conn.clone(),
            &self.key(prefix),
            Some(lease),
        )))
    }
}

impl Drop for EtcdBackend {
    fn drop(&mut self) {
        for t in self.leases().tasks.drain(..) {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids() {
        assert!(validate_job_id("train-42.a_b").is_ok());
        assert!(validate_job_id("").unwrap_err().contains("empty"));
        assert!(validate_job_id("a/b").unwrap_err().contains("'/'"));
        assert!(validate_job_id(&"x".repeat(129)).is_err());
    }

    #[test]
    fn ttl_is_rounded_up_and_floored() {
        assert_eq!(ttl_secs(Duration::from_millis(100)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(2500)), 3);
    }
}
