//! The rendezvous backend on any [`Store`] (the embedded TCP store for `--standalone` and
//! single-host runs).
//!
//! A plain store has no leases, so liveness is a heartbeat: every registered node rewrites
//! `hb/<node id>` with the wall clock every TTL/3, and a node is alive while its heartbeat is
//! younger than the TTL. Node ids are listed in `nodes` (a JSON array kept with
//! compare-and-set). Each successful state write bumps the counter `gen` and sets `gen/<n>`,
//! and waiters wait for `gen/<n+1>`: the store answers when it appears, no polling. A silent
//! death is noticed at the next liveness check, at most TTL/2 after the heartbeat went stale.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rekindle_runtime::store::{CasOutcome, PrefixStore, Store, StoreError, StoreResult};

use super::backend::{RendezvousBackend, Snapshot, Token, TokenKind};

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    wake: std::sync::mpsc::Sender<()>,
}

/// A rendezvous backend over a [`Store`], keys under `rekindle/<job>/`.
pub struct StoreBackend {
    store: Arc<dyn Store>,
    endpoint: String,
    job: String,
    prefix: String,
    ttl: Duration,
    node: Mutex<Option<String>>,
    heartbeat: Mutex<Option<Heartbeat>>,
    lost: Arc<AtomicBool>,
}

impl std::fmt::Debug for StoreBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBackend")
            .field("endpoint", &self.endpoint)
            .field("job", &self.job)
            .finish()
    }
}

impl StoreBackend {
    /// A backend for job `job` on `store`; `endpoint` names the store in messages; nodes are
    /// alive while their heartbeat is younger than `ttl`.
    pub fn new(store: Arc<dyn Store>, endpoint: &str, job: &str, ttl: Duration) -> Self {
        StoreBackend {
            store,
            endpoint: endpoint.to_string(),
            job: job.to_string(),
            prefix: format!("/rekindle/{job}/"),
            ttl: ttl.max(Duration::from_millis(300)),
            node: Mutex::new(None),
            heartbeat: Mutex::new(None),
            lost: Arc::new(AtomicBool::new(false)),
        }
    }

    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    fn registry(&self) -> StoreResult<(Option<Vec<u8>>, Vec<String>)> {
        let raw = self.store.get(&self.key("nodes"))?;
        let ids = match &raw {
            None => Vec::new(),
            Some(v) => serde_json::from_slice(v).map_err(|e| StoreError::InvalidValue {
                key: self.key("nodes"),
                reason: e.to_string(),
            })?,
        };
        Ok((raw, ids))
    }

    fn bump(&self) -> StoreResult<()> {
        let g = self.store.add(&self.key("gen"), 1)?;
        self.store.set(&self.key(&format!("gen/{g}")), b"")
    }

    fn stop_heartbeat(&self) {
        let hb = self
            .heartbeat
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(mut hb) = hb {
            hb.stop.store(true, Ordering::Release);
            let _ = hb.wake.send(());
            if let Some(t) = hb.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl RendezvousBackend for StoreBackend {
    fn name(&self) -> &'static str {
        "store"
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn job(&self) -> &str {
        &self.job
    }

    fn register(&self, node_id: &str) -> StoreResult<()> {
        self.stop_heartbeat();
        let hb_key = self.key(&format!("hb/{node_id}"));
        self.store.set(&hb_key, now_ms().to_string().as_bytes())?;
        loop {
            let (raw, mut ids) = self.registry()?;
            if ids.iter().any(|i| i == node_id) {
                break;
            }
            ids.push(node_id.to_string());
            let new = serde_json::to_vec(&ids).map_err(|e| StoreError::Backend {
                op: "register",
                reason: e.to_string(),
            })?;
            if self
                .store
                .compare_and_set(&self.key("nodes"), raw.as_deref(), &new)?
                == CasOutcome::Swapped
            {
                break;
            }
        }
        self.bump()?;
        *self.node.lock().unwrap_or_else(|p| p.into_inner()) = Some(node_id.to_string());
        self.lost.store(false, Ordering::Release);
        let stop = Arc::new(AtomicBool::new(false));
        let (wake, sleeper) = std::sync::mpsc::channel::<()>();
        let thread = {
            let (store, stop, lost, every) = (
                self.store.clone(),
                stop.clone(),
                self.lost.clone(),
                self.ttl / 3,
            );
            let ttl = self.ttl;
            std::thread::Builder::new()
                .name("rekindle-heartbeat".into())
                .spawn(move || {
                    let mut last_ok = Instant::now();
                    while !stop.load(Ordering::Acquire) {
                        // The channel doubles as an interruptible timer: a message or a
                        // disconnect ends the sleep early on stop.
                        if !matches!(
                            sleeper.recv_timeout(every),
                            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                        ) {
                            break;
                        }
                        match store.set(&hb_key, now_ms().to_string().as_bytes()) {
                            Ok(()) => last_ok = Instant::now(),
                            Err(_) if last_ok.elapsed() > ttl => {
                                lost.store(true, Ordering::Release)
                            }
                            Err(_) => {}
                        }
                    }
                })
                .map_err(|e| StoreError::Backend {
                    op: "register",
                    reason: format!("cannot start the heartbeat thread: {e}"),
                })?
        };
        *self.heartbeat.lock().unwrap_or_else(|p| p.into_inner()) = Some(Heartbeat {
            stop,
            thread: Some(thread),
            wake,
        });
        Ok(())
    }

    fn liveness_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn snapshot(&self) -> StoreResult<Snapshot> {
        let generation = self.store.add(&self.key("gen"), 0)?;
        // Liveness before the state and the finished record: a node closes the job before its
        // record goes, so a snapshot that misses a finished node also sees the job closed.
        let (_, ids) = self.registry()?;
        let now = now_ms();
        let ttl = self.ttl.as_millis() as u64;
        let mut alive = BTreeSet::new();
        for id in ids {
            if let Some(v) = self.store.get(&self.key(&format!("hb/{id}")))? {
                let at: u64 = std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                if now.saturating_sub(at) < ttl {
                    alive.insert(id);
                }
            }
        }
        let state = self.store.get(&self.key("state"))?;
        let finished = self.store.get(&self.key("finished"))?.is_some();
        Ok(Snapshot {
            token: Token(TokenKind::Store {
                value: state.clone(),
                generation,
            }),
            state,
            alive,
            finished,
        })
    }

    fn set_state(&self, state: &[u8], token: &Token) -> StoreResult<bool> {
        let TokenKind::Store { value, .. } = &token.0 else {
            return Err(StoreError::Backend {
                op: "set the rendezvous state",
                reason: "a token of another backend".into(),
            });
        };
        let out = self
            .store
            .compare_and_set(&self.key("state"), value.as_deref(), state)?;
        if out == CasOutcome::Swapped {
            self.bump()?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn wait_for_change(&self, token: &Token, deadline: Instant) -> StoreResult<()> {
        let TokenKind::Store { generation, .. } = &token.0 else {
            return Err(StoreError::Backend {
                op: "wait for a rendezvous change",
                reason: "a token of another backend".into(),
            });
        };
        // Liveness changes are not events in a plain store: wake at least every TTL/2 to
        // re-check heartbeats.
        let until = deadline.min(Instant::now() + self.ttl / 2);
        let timeout = until.saturating_duration_since(Instant::now());
        match self
            .store
            .wait(&[&self.key(&format!("gen/{}", generation + 1))], timeout)
        {
            Ok(_) | Err(StoreError::Timeout { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn mark_finished(&self, record: &[u8]) -> StoreResult<()> {
        self.store.set(&self.key("finished"), record)?;
        self.bump()
    }

    fn leave(&self) -> StoreResult<()> {
        self.stop_heartbeat();
        let node = self.node.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(id) = node {
            // A heartbeat at the epoch is stale for everyone at once.
            self.store.set(&self.key(&format!("hb/{id}")), b"0")?;
            self.bump()?;
        }
        Ok(())
    }

    fn job_store(&self, prefix: &str) -> StoreResult<Arc<dyn Store>> {
        Ok(Arc::new(PrefixStore::new(
            self.store.clone(),
            self.key(prefix),
        )))
    }
}

impl Drop for StoreBackend {
    fn drop(&mut self) {
        self.stop_heartbeat();
    }
}
