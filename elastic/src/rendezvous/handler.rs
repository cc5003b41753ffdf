//! The rendezvous handler: the I/O loop around [`decide`](super::state::decide).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::store::{Store, StoreError};

use super::backend::RendezvousBackend;
use super::state::{self, Action, Context, NodeInfo, RendezvousState, Settings};
use super::store_backend::now_ms;
use crate::membership::Membership;

/// Why a rendezvous call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RendezvousError {
    /// The job has finished (or was closed); nobody may join.
    #[error("job {job:?} is closed: it has already finished")]
    Closed {
        /// The job id.
        job: String,
    },
    /// The round did not complete before the join timeout.
    #[error(
        "rendezvous of job {job:?} timed out after {waited:?}: round {round} has {joined} node(s), \
         needs at least {min_nodes}"
    )]
    Timeout {
        /// The job id.
        job: String,
        /// How long the node waited.
        waited: Duration,
        /// The open round.
        round: u64,
        /// How many nodes had joined it.
        joined: usize,
        /// The minimum.
        min_nodes: usize,
    },
    /// The store could not be reached, even after retrying until the join deadline.
    #[error("cannot reach the {backend} rendezvous store at {endpoint} (retried for {retried:?}): {reason}")]
    Connection {
        /// The backend name.
        backend: &'static str,
        /// Where the store is.
        endpoint: String,
        /// How long the handler retried.
        retried: Duration,
        /// The last failure.
        reason: String,
    },
    /// The store refused the credentials.
    #[error("the {backend} rendezvous store at {endpoint} refused the credentials: {reason}")]
    Unauthorized {
        /// The backend name.
        backend: &'static str,
        /// Where the store is.
        endpoint: String,
        /// The store's words.
        reason: String,
    },
    /// The shared state is unreadable or the store failed otherwise.
    #[error("rendezvous state of job {job:?}: {reason}")]
    State {
        /// The job id.
        job: String,
        /// What is wrong.
        reason: String,
    },
    /// Bad settings (for example `min_nodes > max_nodes`).
    #[error("invalid rendezvous settings: {0}")]
    Settings(String),
    /// [`RendezvousHandler::shutdown`] was called.
    #[error("the rendezvous handler was shut down")]
    Shutdown,
}

/// The outcome of a completed rendezvous for this node.
#[derive(Clone)]
pub struct RendezvousInfo {
    /// The job id.
    pub job: String,
    /// The round.
    pub round: u64,
    /// This node's rank among the nodes.
    pub rank: usize,
    /// Number of nodes in the round.
    pub world_size: usize,
    /// The nodes in rank order.
    pub participants: Vec<NodeInfo>,
    /// A store for this round's keys (`/rekindle/<job>/r<round>/`; on etcd bound to the job
    /// lease), for example for the process group's bootstrap.
    pub store: Arc<dyn Store>,
}

impl std::fmt::Debug for RendezvousInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousInfo")
            .field("job", &self.job)
            .field("round", &self.round)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("participants", &self.participants)
            .finish()
    }
}

/// What an agent (or a training loop) calls to take part in rendezvous.
pub trait RendezvousHandler: Send + Sync {
    /// Joins the next round and returns once it is complete. Blocks at most the join timeout.
    /// A closed job is [`RendezvousError::Closed`].
    fn next_rendezvous(&self) -> Result<RendezvousInfo, RendezvousError>;

    /// Nodes waiting for a round that a re-formed round could take in (0 if none or full).
    fn num_nodes_waiting(&self) -> Result<usize, RendezvousError>;

    /// Marks the job finished: later calls of every node, and late joiners, get `Closed`.
    fn set_closed(&self) -> Result<(), RendezvousError>;

    /// True if the job is closed.
    fn is_closed(&self) -> Result<bool, RendezvousError>;

    /// Leaves: removes this node's liveness record at once. Later calls fail with `Shutdown`.
    fn shutdown(&self) -> Result<(), RendezvousError>;

    /// The membership stream of the last completed round (see [`Membership`]).
    fn membership(&self) -> Result<Membership, RendezvousError>;
}

/// Options of the [`DynamicRendezvousHandler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandlerOptions {
    /// Round sizes and the last-call window.
    pub settings: Settings,
    /// How long `next_rendezvous` may take, retries included.
    pub join_timeout: Duration,
}

impl HandlerOptions {
    /// `min..=max` nodes, a 1 s last call and a 600 s join timeout; errors if `min` is 0 or
    /// larger than `max`.
    pub fn new(min_nodes: usize, max_nodes: usize) -> Result<Self, RendezvousError> {
        if min_nodes == 0 || min_nodes > max_nodes {
            return Err(RendezvousError::Settings(format!(
                "nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX"
            )));
        }
        Ok(HandlerOptions {
            settings: Settings {
                min_nodes,
                max_nodes,
                last_call: Duration::from_secs(1),
            },
            join_timeout: Duration::from_secs(600),
        })
    }
}

/// The rendezvous handler over a [`RendezvousBackend`].
pub struct DynamicRendezvousHandler {
    backend: Arc<dyn RendezvousBackend>,
    node: NodeInfo,
    opts: HandlerOptions,
    last: Mutex<Option<(u64, Vec<String>)>>,
    registered: AtomicBool,
    shut: AtomicBool,
}

impl std::fmt::Debug for DynamicRendezvousHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamicRendezvousHandler")
            .field("job", &self.backend.job())
            .field("node", &self.node.id)
            .finish()
    }
}

fn decode(job: &str, raw: Option<&[u8]>) -> Result<Option<RendezvousState>, RendezvousError> {
    raw.map(|b| {
        serde_json::from_slice(b).map_err(|e| RendezvousError::State {
            job: job.to_string(),
            reason: format!("cannot decode the state: {e}"),
        })
    })
    .transpose()
}

impl DynamicRendezvousHandler {
    /// A handler for `node` on `backend`.
    pub fn new(backend: Arc<dyn RendezvousBackend>, node: NodeInfo, opts: HandlerOptions) -> Self {
        DynamicRendezvousHandler {
            backend,
            node,
            opts,
            last: Mutex::new(None),
            registered: AtomicBool::new(false),
            shut: AtomicBool::new(false),
        }
    }

    /// The node this handler joins as.
    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn RendezvousBackend> {
        &self.backend
    }

    /// The options.
    pub fn options(&self) -> &HandlerOptions {
        &self.opts
    }

    fn job(&self) -> String {
        self.backend.job().to_string()
    }

    /// Maps a store error; `Ok(())` means "retry after the backoff".
    fn retry_or_fail(
        &self,
        e: StoreError,
        start: Instant,
        deadline: Instant,
        backoff: &mut Duration,
    ) -> Result<(), RendezvousError> {
        match e {
            StoreError::Connection { reason, .. } if Instant::now() < deadline => {
                tracing::warn!(backend = self.backend.name(), endpoint = %self.backend.endpoint(),
                    %reason, "rendezvous store unreachable; retrying");
                let left = deadline.saturating_duration_since(Instant::now());
                if *backoff >= left {
                    // The last try: wait out the deadline, then report the connection failure.
                    std::thread::sleep(left);
                    return Err(RendezvousError::Connection {
                        backend: self.backend.name(),
                        endpoint: self.backend.endpoint(),
                        retried: start.elapsed(),
                        reason,
                    });
                }
                std::thread::sleep(*backoff);
                *backoff = (*backoff * 2).min(Duration::from_secs(2));
                Ok(())
            }
            StoreError::Connection { reason, .. } => Err(RendezvousError::Connection {
                backend: self.backend.name(),
                endpoint: self.backend.endpoint(),
                retried: start.elapsed(),
                reason,
            }),
            StoreError::Unauthorized { reason, .. } => Err(RendezvousError::Unauthorized {
                backend: self.backend.name(),
                endpoint: self.backend.endpoint(),
                reason,
            }),
            other => Err(RendezvousError::State {
                job: self.job(),
                reason: other.to_string(),
            }),
        }
    }

    fn check_open(&self) -> Result<(), RendezvousError> {
        if self.shut.load(Ordering::Acquire) {
            Err(RendezvousError::Shutdown)
        } else {
            Ok(())
        }
    }

    /// Runs `f` until it succeeds, retrying connection failures until `timeout` passes.
    fn with_retry<T>(
        &self,
        timeout: Duration,
        mut f: impl FnMut() -> Result<T, StoreError>,
    ) -> Result<T, RendezvousError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = Duration::from_millis(50);
        loop {
            match f() {
                Ok(v) => return Ok(v),
                Err(e) => self.retry_or_fail(e, start, deadline, &mut backoff)?,
            }
        }
    }
}

impl RendezvousHandler for DynamicRendezvousHandler {
    fn next_rendezvous(&self) -> Result<RendezvousInfo, RendezvousError> {
        self.check_open()?;
        let job = self.job();
        let start = Instant::now();
        let deadline = start + self.opts.join_timeout;
        let prev_round = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(r, _)| *r);
        let mut backoff = Duration::from_millis(50);
        let mut last_reason = "";
        let mut last_seen = (0u64, 0usize);
        loop {
            self.check_open()?;
            if Instant::now() >= deadline {
                return Err(RendezvousError::Timeout {
                    job,
                    waited: start.elapsed(),
                    round: last_seen.0,
                    joined: last_seen.1,
                    min_nodes: self.opts.settings.min_nodes,
                });
            }
            if !self.registered.load(Ordering::Acquire) || self.backend.liveness_lost() {
                match self.backend.register(&self.node.id) {
                    Ok(()) => self.registered.store(true, Ordering::Release),
                    Err(e) => self.retry_or_fail(e, start, deadline, &mut backoff)?,
                }
                continue;
            }
            let snap = match self.backend.snapshot() {
                Ok(s) => s,
                Err(e) => {
                    self.retry_or_fail(e, start, deadline, &mut backoff)?;
                    continue;
                }
            };
            if !snap.alive.contains(&self.node.id) {
                // Our liveness record expired (the store was away for longer than the TTL).
                self.registered.store(false, Ordering::Release);
                continue;
            }
            let st = decode(&job, snap.state.as_deref())?;
            if let Some(s) = &st {
                last_seen = (s.round, s.participants.len());
            }
            let now = now_ms();
            let ctx = Context {
                now_ms: now,
                me: &self.node,
                prev_round,
                alive: &snap.alive,
                finished: snap.finished,
            };
            let d = state::decide(st.as_ref(), &ctx, &self.opts.settings);
            if d.reason != last_reason {
                tracing::debug!(job = %job, node = %self.node.id, reason = d.reason, "rendezvous");
                last_reason = d.reason;
            }
            match d.action {
                Action::Done(a) => {
                    let store = self
                        .backend
                        .job_store(&format!("r{}/", a.round))
                        .map_err(|e| RendezvousError::State {
                            job: job.clone(),
                            reason: e.to_string(),
                        })?;
                    *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((
                        a.round,
                        a.participants.iter().map(|n| n.id.clone()).collect(),
                    ));
                    return Ok(RendezvousInfo {
                        job,
                        round: a.round,
                        rank: a.rank,
                        world_size: a.participants.len(),
                        participants: a.participants,
                        store,
                    });
                }
                Action::Closed => return Err(RendezvousError::Closed { job }),
                Action::Write(new) => {
                    let bytes = serde_json::to_vec(&new).map_err(|e| RendezvousError::State {
                        job: job.clone(),
                        reason: e.to_string(),
                    })?;
                    // A conflict means someone else wrote first: decide again on fresh state.
                    if let Err(e) = self.backend.set_state(&bytes, &snap.token) {
                        self.retry_or_fail(e, start, deadline, &mut backoff)?;
                    }
                }
                Action::Wait { until_ms } => {
                    let until = until_ms
                        .map(|u| Instant::now() + Duration::from_millis(u.saturating_sub(now)))
                        .unwrap_or(deadline)
                        .min(deadline);
                    if let Err(e) = self.backend.wait_for_change(&snap.token, until) {
                        self.retry_or_fail(e, start, deadline, &mut backoff)?;
                    }
                }
            }
        }
    }

    fn num_nodes_waiting(&self) -> Result<usize, RendezvousError> {
        self.check_open()?;
        let snap = self.with_retry(self.backend_timeout(), || self.backend.snapshot())?;
        let st = decode(&self.job(), snap.state.as_deref())?;
        Ok(st
            .map(|s| state::nodes_waiting(&s, &snap.alive, &self.opts.settings))
            .unwrap_or(0))
    }

    fn set_closed(&self) -> Result<(), RendezvousError> {
        let job = self.job();
        let record = serde_json::json!({
            "job": job,
            "finished_at_ms": now_ms(),
            "by": self.node.id,
        })
        .to_string();
        self.with_retry(self.backend_timeout(), || {
            self.backend.mark_finished(record.as_bytes())
        })?;
        loop {
            let snap = self.with_retry(self.backend_timeout(), || self.backend.snapshot())?;
            let st = decode(&job, snap.state.as_deref())?;
            if st.as_ref().is_some_and(|s| s.closed) {
                return Ok(());
            }
            let bytes = serde_json::to_vec(&state::close(st.as_ref())).map_err(|e| {
                RendezvousError::State {
                    job: job.clone(),
                    reason: e.to_string(),
                }
            })?;
            if self.with_retry(self.backend_timeout(), || {
                self.backend.set_state(&bytes, &snap.token)
            })? {
                return Ok(());
            }
        }
    }

    fn is_closed(&self) -> Result<bool, RendezvousError> {
        let snap = self.with_retry(self.backend_timeout(), || self.backend.snapshot())?;
        let st = decode(&self.job(), snap.state.as_deref())?;
        Ok(snap.finished || st.is_some_and(|s| s.closed))
    }

    fn shutdown(&self) -> Result<(), RendezvousError> {
        if self.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.with_retry(self.backend_timeout(), || self.backend.leave())
    }

    fn membership(&self) -> Result<Membership, RendezvousError> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some((round, members)) = last else {
            return Err(RendezvousError::State {
                job: self.job(),
                reason: "no round has completed yet".into(),
            });
        };
        Ok(Membership::watch(
            self.backend.clone(),
            round,
            members,
            self.opts.settings,
        ))
    }
}

impl DynamicRendezvousHandler {
    /// The retry budget for calls other than `next_rendezvous`.
    fn backend_timeout(&self) -> Duration {
        self.opts.join_timeout.min(Duration::from_secs(30))
    }
}
