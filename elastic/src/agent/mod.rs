//! The agent behind `rekindle run`: one per node, it joins the rendezvous, starts the node's
//! workers with torchrun's environment, watches them and the membership, and restarts or
//! stops them.
//!
//! States of one attempt: rendezvous, then workers healthy; then one of
//! - all workers exited 0: the job is closed (late joiners exit 0) and the agent succeeds;
//! - a worker failed: the others are stopped, the earliest failure is the root cause, and the
//!   agent restarts (counted against `max_restarts`) or gives up;
//! - membership changed (a peer was lost, a node waits, a new round opened): the workers are
//!   stopped and the node re-joins; this is not counted as a restart;
//! - SIGTERM/SIGINT/SIGHUP: forwarded to the workers, grace period, SIGKILL, exit `128+N`.

mod signals;
mod worker;

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rekindle_runtime::store::{Store, StoreError};

use crate::errorfile::{read_error_file, ERROR_FILE_ENV, TORCHELASTIC_ERROR_FILE_ENV};
use crate::etcd::EtcdConfig;
use crate::membership::{
    Membership, MembershipEvent, MembershipPublisher, AGENT_STORE_ENV, MEMBERSHIP_PREFIX_ENV,
};
use crate::rendezvous::{
    DynamicRendezvousHandler, EtcdBackend, EtcdBackendOptions, HandlerOptions, NodeInfo,
    RendezvousBackend, RendezvousError, RendezvousHandler, RendezvousInfo, Settings, StoreBackend,
};
use crate::store::{ServerError, TcpStoreClient, TcpStoreServer};
use crate::train::{ELASTIC_KEY_ENV, LOCAL_ADDR_ENV, MEMBERSHIP_NEXT_ENV};
use worker::{describe, Event, Worker, WorkerSpec};

/// The agent's exit codes (also those of `rekindle run`).
pub mod exit_code {
    /// The workers succeeded, or the job had already finished when this node arrived.
    pub const SUCCESS: i32 = 0;
    /// Workers failed and `--max-restarts` was used up.
    pub const WORKERS_FAILED: i32 = 1;
    /// Bad command line or configuration.
    pub const USAGE: i32 = 2;
    /// Rendezvous failed: timeout, store unreachable, credentials refused.
    pub const RENDEZVOUS: i32 = 3;
    /// The agent itself failed (cannot start workers, bind its store, write logs).
    pub const AGENT: i32 = 4;
    /// Stopped by signal `n` (after forwarding it to the workers): `128 + n`.
    pub const fn signal(n: i32) -> i32 {
        128 + n
    }
}

/// How nodes find each other.
#[derive(Debug, Clone)]
pub enum RdzvConfig {
    /// Fixed membership as in torch.distributed.launch: `nnodes` nodes, this one is
    /// `node_rank`; node 0 hosts the store at `master_addr:master_port`.
    Static {
        /// Number of nodes.
        nnodes: usize,
        /// This node's rank.
        node_rank: usize,
        /// Where node 0 is.
        master_addr: String,
        /// Node 0's store port; `None` (one node only) picks a free port.
        master_port: Option<u16>,
    },
    /// One node, the store on a free local port, a generated job id.
    Standalone,
    /// Dynamic rendezvous on etcd v3.
    Etcd(Box<EtcdRdzv>),
}

/// Settings of an etcd rendezvous.
#[derive(Debug, Clone)]
pub struct EtcdRdzv {
    /// The cluster.
    pub etcd: EtcdConfig,
    /// The job id (required).
    pub job: String,
    /// Round sizes.
    pub min_nodes: usize,
    /// Round sizes.
    pub max_nodes: usize,
    /// The last-call window.
    pub last_call: Duration,
    /// How long joining may take, retries included.
    pub join_timeout: Duration,
    /// Lease TTL (liveness).
    pub lease_ttl: Duration,
    /// How long the job-finished record is kept.
    pub finished_retention: Duration,
}

/// Everything the agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The program and its arguments.
    pub entrypoint: Vec<String>,
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// The rendezvous.
    pub rdzv: RdzvConfig,
    /// Job id for static and standalone runs (generated if `None`).
    pub job: Option<String>,
    /// Restarts after worker failures before giving up.
    pub max_restarts: u32,
    /// How often the agent checks workers and membership.
    pub monitor_interval: Duration,
    /// Where per-attempt logs go (a temp dir if `None`).
    pub log_dir: Option<PathBuf>,
    /// Pass `--local_rank=N` after the program, as torch.distributed.launch does.
    pub use_local_rank_arg: bool,
    /// SIGTERM-to-SIGKILL grace period.
    pub grace_period: Duration,
    /// The address other nodes reach this node at (etcd runs).
    pub local_addr: Option<String>,
    /// Forward SIGTERM/SIGINT/SIGHUP to the workers (the CLI does; tests may not).
    pub handle_signals: bool,
}

/// One worker failure.
#[derive(Debug, Clone)]
pub struct WorkerFailure {
    /// Global rank.
    pub rank: usize,
    /// Local rank.
    pub local_rank: usize,
    /// The node's rank in the round.
    pub node_rank: usize,
    /// The attempt.
    pub attempt: u32,
    /// `exit code N` or `signal N (NAME)`.
    pub status: String,
    /// When, in seconds since the Unix epoch (the error file's time if it has one).
    pub timestamp: f64,
    /// The error file's message, if the worker wrote one.
    pub message: Option<String>,
    /// The error file's path.
    pub error_file: PathBuf,
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} (local rank {}, node rank {}, attempt {}) failed with {}",
            self.rank, self.local_rank, self.node_rank, self.attempt, self.status
        )?;
        match &self.message {
            Some(m) => write!(f, ": {m}"),
            None => write!(f, " (no error file at {})", self.error_file.display()),
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone)]
pub enum AgentOutcome {
    /// Every worker exited 0.
    Succeeded {
        /// Attempts started.
        attempts: u32,
        /// Restarts after failures.
        restarts: u32,
    },
    /// The job had finished before this node joined.
    AlreadyFinished {
        /// The job id.
        job: String,
    },
    /// Workers failed and the restarts were used up.
    Failed {
        /// The earliest failure of the last attempt.
        root_cause: WorkerFailure,
        /// Every failure of the last attempt.
        failures: Vec<WorkerFailure>,
        /// Restarts used.
        restarts: u32,
    },
    /// The agent was stopped by a signal.
    Signalled {
        /// The signal.
        signal: i32,
    },
}

impl AgentOutcome {
    /// The exit code for this outcome (see [`exit_code`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentOutcome::Succeeded { .. } | AgentOutcome::AlreadyFinished { .. } => {
                exit_code::SUCCESS
            }
            AgentOutcome::Failed { .. } => exit_code::WORKERS_FAILED,
            AgentOutcome::Signalled { signal } => exit_code::signal(*signal),
        }
    }
}

/// Why the agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The embedded store could not start.
    #[error(transparent)]
    StoreServer(#[from] ServerError),
    /// The agent's own store failed.
    #[error("the agent's store: {0}")]
    Store(#[from] StoreError),
    /// A worker could not be started.
    #[error("cannot start worker {local_rank} ({program}): {source}")]
    Spawn {
        /// The local rank.
        local_rank: usize,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The log dir could not be created.
    #[error("cannot create the log dir {path}: {source}")]
    LogDir {
        /// The dir.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The configuration is invalid.
    #[error("{0}")]
    Config(String),
}

impl AgentError {
    /// The exit code for this error (see [`exit_code`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Rendezvous(_) => exit_code::RENDEZVOUS,
            AgentError::Config(_) => exit_code::USAGE,
            _ => exit_code::AGENT,
        }
    }
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    if getrandom::getrandom(&mut b).is_err() {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = t.to_le_bytes()[..bytes.min(16)].to_vec();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What one completed rendezvous gives this node.
struct Round {
    round: u64,
    node_rank: usize,
    nnodes: usize,
    rank_base: usize,
    world_size: usize,
    master_addr: String,
    master_port: u16,
    membership: Option<Membership>,
}

enum Rdzv {
    Static {
        nnodes: usize,
        node_rank: usize,
        master_addr: String,
        master_port: u16,
    },
    Dynamic {
        handler: Arc<DynamicRendezvousHandler>,
    },
}

/// Splits `host:port`.
fn split_addr(addr: &str) -> Option<(String, u16)> {
    let (h, p) = addr.rsplit_once(':')?;
    Some((h.trim_matches(['[', ']']).to_string(), p.parse().ok()?))
}

fn round_from_info(info: &RendezvousInfo, me: &NodeInfo, membership: Option<Membership>) -> Round {
    let rank_base = info.participants[..info.rank]
        .iter()
        .map(|n| n.nproc as usize)
        .sum();
    let world_size = info.participants.iter().map(|n| n.nproc as usize).sum();
    let (master_addr, master_port) = info
        .participants
        .first()
        .and_then(|n| n.store_addr.as_deref())
        .and_then(split_addr)
        .unwrap_or_else(|| (me.host.clone(), 0));
    Round {
        round: info.round,
        node_rank: info.rank,
        nnodes: info.world_size,
        rank_base,
        world_size,
        master_addr,
        master_port,
        membership,
    }
}

/// The running agent's fixed parts.
struct Agent {
    cfg: AgentConfig,
    job: String,
    node: NodeInfo,
    backend_name: &'static str,
    endpoint: String,
    log_root: PathBuf,
    agent_store: Arc<dyn Store>,
    agent_store_addr: String,
    events: Receiver<Event>,
    tx: Sender<Event>,
    rdzv: Rdzv,
    _server: TcpStoreServer,
}

/// Runs the agent until the job succeeds, fails for good, or a signal stops it.
pub fn run(cfg: AgentConfig) -> Result<AgentOutcome, AgentError> {
    if cfg.entrypoint.is_empty() {
        return Err(AgentError::Config("no program to run was given".into()));
    }
    if cfg.nproc_per_node == 0 {
        return Err(AgentError::Config(
            "--nproc-per-node must be at least 1".into(),
        ));
    }
    let (tx, events) = std::sync::mpsc::channel();
    if cfg.handle_signals {
        signals::forward_signals(tx.clone())
            .map_err(|e| AgentError::Config(format!("cannot install signal handlers: {e}")))?;
    }
    let mut agent = Agent::start(cfg, tx, events)?;
    let out = agent.run_loop();
    if let Rdzv::Dynamic { handler } = &agent.rdzv {
        if let Err(e) = handler.shutdown() {
            tracing::warn!(error = %e, "could not leave the rendezvous cleanly");
        }
    }
    out
}

impl Agent {
    fn start(
        cfg: AgentConfig,
        tx: Sender<Event>,
        events: Receiver<Event>,
    ) -> Result<Self, AgentError> {
        let host = match (&cfg.local_addr, &cfg.rdzv) {
            (Some(a), _) => a.clone(),
            (None, RdzvConfig::Standalone) => "127.0.0.1".into(),
            (None, RdzvConfig::Static { nnodes: 1, .. }) => "127.0.0.1".into(),
            (None, _) => hostname(),
        };
        let bind: std::net::SocketAddr = match &cfg.rdzv {
            RdzvConfig::Static {
                nnodes,
                node_rank: 0,
                master_port,
                ..
            } if *nnodes > 1 => ([0, 0, 0, 0], master_port.unwrap_or(0)).into(),
            RdzvConfig::Static {
                node_rank: 0,
                master_port,
                ..
            } => ([127, 0, 0, 1], master_port.unwrap_or(0)).into(),
            RdzvConfig::Etcd(_) if host != "127.0.0.1" && host != "localhost" => {
                ([0, 0, 0, 0], 0).into()
            }
            _ => ([127, 0, 0, 1], 0).into(),
        };
        let server = TcpStoreServer::bind(bind)?;
        let port = server.local_addr().port();
        let local_store_addr = format!("127.0.0.1:{port}");
        let agent_store: Arc<dyn Store> = Arc::new(TcpStoreClient::connect(&local_store_addr)?);
        let node = NodeInfo {
            id: format!(
                "{}-{}-{}",
                sanitize(&host),
                std::process::id(),
                random_hex(3)
            ),
            host: host.clone(),
            nproc: cfg.nproc_per_node,
            store_addr: Some(format!("{host}:{port}")),
        };
        let (job, rdzv, backend_name, endpoint) = match &cfg.rdzv {
            RdzvConfig::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
            } => {
                if *node_rank >= *nnodes {
                    return Err(AgentError::Config(format!(
                        "--node-rank {node_rank} is not below --nnodes {nnodes}"
                    )));
                }
                let master_port = master_port.unwrap_or(port);
                let job = cfg
                    .job
                    .clone()
                    .unwrap_or_else(|| sanitize(&format!("static-{master_addr}-{master_port}")));
                let endpoint = format!("{master_addr}:{master_port}");
                (
                    job,
                    Rdzv::Static {
                        nnodes: *nnodes,
                        node_rank: *node_rank,
                        master_addr: master_addr.clone(),
                        master_port,
                    },
                    "static",
                    endpoint,
                )
            }
            RdzvConfig::Standalone => {
                let job = cfg
                    .job
                    .clone()
                    .unwrap_or_else(|| format!("standalone-{}", random_hex(4)));
                crate::rendezvous::validate_job_id(&job).map_err(AgentError::Config)?;
                let backend: Arc<dyn RendezvousBackend> = Arc::new(StoreBackend::new(
                    agent_store.clone(),
                    &local_store_addr,
                    &job,
                    Duration::from_secs(5),
                ));
                let mut opts = HandlerOptions::new(1, 1)?;
                opts.settings.last_call = Duration::ZERO;
                opts.join_timeout = Duration::from_secs(30);
                let handler = DynamicRendezvousHandler::new(backend, node.clone(), opts);
                (
                    job,
                    Rdzv::Dynamic {
                        handler: Arc::new(handler),
                    },
                    "standalone",
                    local_store_addr.clone(),
                )
            }
            RdzvConfig::Etcd(e) => {
                crate::rendezvous::validate_job_id(&e.job)
                    .map_err(|r| AgentError::Config(format!("--rdzv-id: {r}")))?;
                let backend = connect_etcd(e)?;
                let opts = HandlerOptions {
                    settings: Settings {
                        min_nodes: e.min_nodes,
                        max_nodes: e.max_nodes,
                        last_call: e.last_call,
                    },
                    join_timeout: e.join_timeout,
                };
                HandlerOptions::new(e.min_nodes, e.max_nodes)?;
                let handler = DynamicRendezvousHandler::new(Arc::new(backend), node.clone(), opts);
                (
                    e.job.clone(),
                    Rdzv::Dynamic {
                        handler: Arc::new(handler),
                    },
                    "etcd",
                    e.etcd.endpoint_string(),
                )
            }
        };
        let log_root = cfg
            .log_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("rekindle-logs"))
            .join(&job)
            .join(&node.id);
        std::fs::create_dir_all(&log_root).map_err(|source| AgentError::LogDir {
            path: log_root.clone(),
            source,
        })?;
        tracing::info!(job = %job, node = %node.id, backend = backend_name, endpoint = %endpoint,
            logs = %log_root.display(), "agent started");
        Ok(Agent {
            cfg,
            job,
            node,
            backend_name,
            endpoint,
            log_root,
            agent_store,
            agent_store_addr: local_store_addr,
            events,
            tx,
            rdzv,
            _server: server,
        })
    }

    /// Joins the next round. Signals that arrive meanwhile end the wait at once.
    fn next_round(&mut self, attempt: u32) -> Result<Result<Round, i32>, RendezvousError> {
        match &self.rdzv {
            Rdzv::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
            } => {
                let nproc = self.cfg.nproc_per_node as usize;
                Ok(Ok(Round {
                    round: attempt as u64,
                    node_rank: *node_rank,
                    nnodes: *nnodes,
                    rank_base: node_rank * nproc,
                    world_size: nnodes * nproc,
                    master_addr: master_addr.clone(),
                    master_port: *master_port,
                    membership: None,
                }))
            }
            Rdzv::Dynamic { handler } => {
                let (h, tx) = (handler.clone(), self.tx.clone());
                std::thread::spawn(move || {
                    let r = h.next_rendezvous();
                    let _ = tx.send(Event::Rendezvous(Box::new(r)));
                });
                loop {
                    match self.events.recv() {
                        Ok(Event::Rendezvous(r)) => {
                            let info = (*r)?;
                            let membership = handler.membership().ok();
                            return Ok(Ok(round_from_info(&info, &self.node, membership)));
                        }
                        Ok(Event::Signal(s)) => {
                            let _ = handler.shutdown();
                            return Ok(Err(s));
                        }
                        Ok(_) => {}
                        Err(_) => return Err(RendezvousError::Shutdown),
                    }
                }
            }
        }
    }

    /// The round's store as workers open it ([`crate::store::connect`]): etcd itself when the
    /// rendezvous backend offers it (then no node is a single point of failure), else node 0's
    /// embedded store.
    fn round_store_addr(&self, round: &Round) -> String {
        if let Rdzv::Dynamic { handler } = &self.rdzv {
            if let Some(addr) = handler.backend().worker_store_addr() {
                return addr;
            }
        }
        format!("{}:{}", round.master_addr, round.master_port)
    }

    /// The key prefix of round `round` in the round's store.
    fn round_prefix(&self, round: u64) -> String {
        format!("/rekindle/{}/r{round}/", self.job)
    }

    /// The key a worker using the elastic loop sets in the agent's store (see
    /// [`ELASTIC_KEY_ENV`]).
    fn elastic_key(&self, attempt: u32, local_rank: usize) -> String {
        format!("/rekindle/{}/elastic/{attempt}/{local_rank}", self.job)
    }

    /// True if the worker at `local_rank` said it recovers in place.
    fn is_elastic(&self, attempt: u32, local_rank: usize) -> bool {
        matches!(
            self.agent_store.get(&self.elastic_key(attempt, local_rank)),
            Ok(Some(_))
        )
    }

    /// Starts a replacement for the worker at `local_rank`, with the current round's
    /// environment; it reads membership events from index `membership_next` on.
    fn restart_worker(
        &self,
        round: &Round,
        attempt: u32,
        restarts: u32,
        local_rank: usize,
        membership_next: u64,
    ) -> Result<Worker, AgentError> {
        let mut specs = self.worker_specs(round, attempt, restarts);
        let mut spec = specs.swap_remove(local_rank);
        spec.dir = self
            .log_root
            .join(format!("attempt_{attempt}"))
            .join(format!("{local_rank}.restart{restarts}"));
        spec.error_file = spec.dir.join("error.json");
        let ef = spec.error_file.display().to_string();
        for (k, v) in &mut spec.env {
            if k == MEMBERSHIP_NEXT_ENV {
                *v = membership_next.to_string();
            } else if k == ERROR_FILE_ENV || k == TORCHELASTIC_ERROR_FILE_ENV {
                *v = ef.clone();
            }
        }
        worker::spawn(&spec, self.tx.clone()).map_err(|source| AgentError::Spawn {
            local_rank,
            program: spec.argv[0].clone(),
            source,
        })
    }

    fn worker_specs(&self, round: &Round, attempt: u32, restarts: u32) -> Vec<WorkerSpec> {
        let nproc = self.cfg.nproc_per_node as usize;
        let prefix = self.round_prefix(round.round);
        let membership_prefix = format!("/rekindle/{}/membership/{attempt}/", self.job);
        (0..nproc)
            .map(|local| {
                let rank = round.rank_base + local;
                let dir = self
                    .log_root
                    .join(format!("attempt_{attempt}"))
                    .join(local.to_string());
                let error_file = dir.join("error.json");
                let mut argv = self.cfg.entrypoint.clone();
                if self.cfg.use_local_rank_arg {
                    argv.insert(1, format!("--local_rank={local}"));
                }
                let ef = error_file.display().to_string();
                let env: Vec<(String, String)> = [
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", local.to_string()),
                    ("WORLD_SIZE", round.world_size.to_string()),
                    ("LOCAL_WORLD_SIZE", nproc.to_string()),
                    ("GROUP_RANK", round.node_rank.to_string()),
                    ("GROUP_WORLD_SIZE", round.nnodes.to_string()),
                    ("ROLE_RANK", rank.to_string()),
                    ("ROLE_WORLD_SIZE", round.world_size.to_string()),
                    ("ROLE_NAME", "default".to_string()),
                    ("MASTER_ADDR", round.master_addr.clone()),
                    ("MASTER_PORT", round.master_port.to_string()),
                    ("TORCHELASTIC_RUN_ID", self.job.clone()),
                    ("TORCHELASTIC_RESTART_COUNT", restarts.to_string()),
                    (
                        "TORCHELASTIC_MAX_RESTARTS",
                        self.cfg.max_restarts.to_string(),
                    ),
                    (TORCHELASTIC_ERROR_FILE_ENV, ef.clone()),
                    ("REKINDLE_JOB", self.job.clone()),
                    ("REKINDLE_ROUND", round.round.to_string()),
                    ("REKINDLE_RESTART_COUNT", restarts.to_string()),
                    ("REKINDLE_MAX_RESTARTS", self.cfg.max_restarts.to_string()),
                    ("REKINDLE_ATTEMPT", attempt.to_string()),
                    ("REKINDLE_NODE_ID", self.node.id.clone()),
                    ("REKINDLE_RDZV_BACKEND", self.backend_name.to_string()),
                    ("REKINDLE_RDZV_ENDPOINT", self.endpoint.clone()),
                    (ERROR_FILE_ENV, ef),
                    ("REKINDLE_STORE", self.round_store_addr(round)),
                    ("REKINDLE_STORE_PREFIX", prefix.clone()),
                    (AGENT_STORE_ENV, self.agent_store_addr.clone()),
                    (MEMBERSHIP_PREFIX_ENV, membership_prefix.clone()),
                    (MEMBERSHIP_NEXT_ENV, "0".to_string()),
                    (ELASTIC_KEY_ENV, self.elastic_key(attempt, local)),
                    (LOCAL_ADDR_ENV, self.node.host.clone()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                WorkerSpec {
                    local_rank: local,
                    global_rank: rank,
                    argv,
                    env,
                    dir,
                    error_file,
                }
            })
            .collect()
    }

    fn failure(&self, w: &Worker, round: &Round, attempt: u32) -> Option<WorkerFailure> {
        let (status, at) = w.exit?;
        if status.success() {
            return None;
        }
        let rec = read_error_file(&w.error_file);
        // Exits caused by the agent's own SIGTERM are not failures, unless the worker said why.
        if w.stopped && rec.is_none() {
            return None;
        }
        Some(WorkerFailure {
            rank: w.global_rank,
            local_rank: w.local_rank,
            node_rank: round.node_rank,
            attempt,
            status: describe(&status),
            timestamp: rec
                .as_ref()
                .map(|r| r.timestamp)
                .filter(|t| *t > 0.0)
                .unwrap_or_else(|| unix_secs(at)),
            message: rec.map(|r| r.message),
            error_file: w.error_file.clone(),
        })
    }

    fn run_loop(&mut self) -> Result<AgentOutcome, AgentError> {
        let mut attempt: u32 = 0;
        let mut restarts: u32 = 0;
        loop {
            let mut round = match self.next_round(attempt) {
                Ok(Ok(r)) => r,
                Ok(Err(signal)) => return Ok(AgentOutcome::Signalled { signal }),
                Err(RendezvousError::Closed { job }) => {
                    eprintln!("rekindle: job {job:?} has already finished; nothing to do");
                    return Ok(AgentOutcome::AlreadyFinished { job });
                }
                Err(e) => return Err(e.into()),
            };
            tracing::info!(job = %self.job, round = round.round, node_rank = round.node_rank,
                nnodes = round.nnodes, world_size = round.world_size, attempt, restarts,
                "starting workers");
            let specs = self.worker_specs(&round, attempt, restarts);
            let mut workers = Vec::with_capacity(specs.len());
            for spec in &specs {
                match worker::spawn(spec, self.tx.clone()) {
                    Ok(w) => workers.push(w),
                    Err(source) => {
                        worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                        return Err(AgentError::Spawn {
                            local_rank: spec.local_rank,
                            program: spec.argv[0].clone(),
                            source,
                        });
                    }
                }
            }
            let mut publisher = MembershipPublisher::new(
                self.agent_store.clone(),
                &format!("/rekindle/{}/membership/{attempt}/", self.job),
            );
            let end = self.monitor(
                &mut workers,
                &mut round,
                &mut publisher,
                attempt,
                &mut restarts,
            );
            match end {
                AttemptEnd::Closed(job) => {
                    eprintln!("rekindle: job {job:?} finished while this node re-formed");
                    worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                    return Ok(AgentOutcome::AlreadyFinished { job });
                }
                AttemptEnd::RendezvousFailed(e) => {
                    worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                    return Err(e.into());
                }
                AttemptEnd::Succeeded => {
                    self.linger_for_peers(&round);
                    if let Rdzv::Dynamic { handler } = &self.rdzv {
                        if let Err(e) = handler.set_closed() {
                            tracing::warn!(error = %e, "could not mark the job finished");
                        }
                    }
                    tracing::info!(job = %self.job, attempt, restarts, "workers succeeded");
                    return Ok(AgentOutcome::Succeeded {
                        attempts: attempt + 1,
                        restarts,
                    });
                }
                AttemptEnd::Signal(signal) => {
                    eprintln!(
                        "rekindle: received {}; forwarding it to the workers (grace period {:?})",
                        worker::signal_name(signal),
                        self.cfg.grace_period
                    );
                    worker::signal_all(&workers, signal);
                    worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                    return Ok(AgentOutcome::Signalled { signal });
                }
                AttemptEnd::Reform(ev) => {
                    tracing::info!(job = %self.job, event = ?ev, "membership changed: re-forming");
                    eprintln!("rekindle: membership changed ({ev:?}); stopping workers to re-form");
                    let signals =
                        worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                    if let Some(s) = signals.first() {
                        return Ok(AgentOutcome::Signalled { signal: *s });
                    }
                    attempt += 1;
                }
                AttemptEnd::Failed => {
                    let signals =
                        worker::stop_all(&mut workers, &self.events, self.cfg.grace_period, |_| {});
                    let mut failures: Vec<WorkerFailure> = workers
                        .iter()
                        .filter_map(|w| self.failure(w, &round, attempt))
                        .collect();
                    failures.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
                    let Some(root) = failures.first().cloned() else {
                        return Err(AgentError::Config(
                            "a failure without a failed worker".into(),
                        ));
                    };
                    eprintln!("rekindle: root cause: {root}");
                    if let Some(s) = signals.first() {
                        return Ok(AgentOutcome::Signalled { signal: *s });
                    }
                    if restarts < self.cfg.max_restarts {
                        restarts += 1;
                        attempt += 1;
                        eprintln!(
                            "rekindle: restarting workers (restart {restarts} of {})",
                            self.cfg.max_restarts
                        );
                        continue;
                    }
                    eprintln!(
                        "rekindle: giving up after {restarts} restart(s) (--max-restarts {})",
                        self.cfg.max_restarts
                    );
                    return Ok(AgentOutcome::Failed {
                        root_cause: root,
                        failures,
                        restarts,
                    });
                }
            }
        }
    }

    /// The round's store lives in node 0's agent and other nodes' workers may still be using
    /// it: every node reports success there, and node 0 keeps serving until all have (at most
    /// the grace period).
    fn linger_for_peers(&self, round: &Round) {
        if round.nnodes <= 1 {
            return;
        }
        let master = format!("{}:{}", round.master_addr, round.master_port);
        let prefix = format!("/rekindle/{}/r{}/agents-done/", self.job, round.round);
        let store = match TcpStoreClient::connect_with_timeout(&master, Duration::from_secs(5)) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%master, error = %e, "cannot report success to node 0");
                return;
            }
        };
        if let Err(e) = store.set(&format!("{prefix}{}", round.node_rank), b"1") {
            tracing::warn!(%master, error = %e, "cannot report success to node 0");
            return;
        }
        if round.node_rank == 0 {
            let keys: Vec<String> = (0..round.nnodes).map(|r| format!("{prefix}{r}")).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(e) = store.wait(&refs, self.cfg.grace_period) {
                tracing::warn!(error = %e, "not every node reported success; exiting anyway");
            }
        }
    }

    /// Watches the workers and the membership until the attempt ends. Workers that use the
    /// elastic loop (they set their [`ELASTIC_KEY_ENV`] key) are recovered in place: a failed
    /// one is restarted alone, and on a membership change the node re-joins the rendezvous
    /// while they keep training, then tells them their new ranks ([`MembershipEvent::Assigned`]).
    fn monitor(
        &self,
        workers: &mut [Worker],
        round: &mut Round,
        publisher: &mut MembershipPublisher,
        attempt: u32,
        restarts: &mut u32,
    ) -> AttemptEnd {
        let interval = self.cfg.monitor_interval.max(Duration::from_millis(10));
        let mut reforming = false;
        let evictions = Evictions::start(self.node.id.clone(), interval);
        loop {
            evictions.update(self, workers, round);
            match self.events.recv_timeout(interval) {
                Ok(Event::Exited {
                    local_rank,
                    status,
                    at,
                }) => {
                    let Some(i) = workers
                        .iter()
                        .position(|w| w.local_rank == local_rank && w.exit.is_none())
                    else {
                        continue;
                    };
                    workers[i].exit = Some((status, at));
                    if !status.success() {
                        eprintln!(
                            "rekindle: rank {} (local rank {local_rank}) exited with {}",
                            workers[i].global_rank,
                            describe(&status)
                        );
                        if !self.is_elastic(attempt, local_rank)
                            || *restarts >= self.cfg.max_restarts
                        {
                            return AttemptEnd::Failed;
                        }
                        *restarts += 1;
                        match self.restart_worker(
                            round,
                            attempt,
                            *restarts,
                            local_rank,
                            publisher.next_index(),
                        ) {
                            Ok(w) => {
                                eprintln!(
                                    "rekindle: restarting rank {} alone (restart {} of {}); \
                                     the other ranks keep their state",
                                    w.global_rank, restarts, self.cfg.max_restarts
                                );
                                workers[i] = w;
                                continue;
                            }
                            Err(e) => {
                                eprintln!("rekindle: {e}");
                                return AttemptEnd::Failed;
                            }
                        }
                    }
                    if workers.iter().all(|w| w.exit.is_some()) {
                        return AttemptEnd::Succeeded;
                    }
                }
                Ok(Event::Signal(s)) => return AttemptEnd::Signal(s),
                Ok(Event::Rendezvous(r)) if reforming => {
                    reforming = false;
                    match *r {
                        Ok(info) => {
                            let membership = match &self.rdzv {
                                Rdzv::Dynamic { handler } => handler.membership().ok(),
                                Rdzv::Static { .. } => None,
                            };
                            let new = round_from_info(&info, &self.node, membership);
                            let ev = MembershipEvent::Assigned {
                                round: round.round,
                                new_round: new.round,
                                rank_base: new.rank_base,
                                world_size: new.world_size,
                                store: self.round_store_addr(&new),
                                store_prefix: self.round_prefix(new.round),
                            };
                            if let Err(e) = publisher.publish(&ev) {
                                tracing::warn!(error = %e, "cannot tell the workers their new ranks");
                            }
                            eprintln!(
                                "rekindle: re-formed into round {} (node {} of {}, ranks {}..{} \
                                 of {}) without stopping the workers",
                                new.round,
                                new.node_rank,
                                new.nnodes,
                                new.rank_base,
                                new.rank_base + workers.len(),
                                new.world_size
                            );
                            *round = new;
                        }
                        Err(RendezvousError::Closed { job }) => return AttemptEnd::Closed(job),
                        Err(e) => return AttemptEnd::RendezvousFailed(e),
                    }
                }
                Ok(Event::Rendezvous(_)) => {}
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return AttemptEnd::Signal(libc::SIGTERM),
            }
            if reforming {
                continue;
            }
            if let Some(m) = &round.membership {
                while let Some(ev) = m.poll() {
                    if let Err(e) = publisher.publish(&ev) {
                        tracing::warn!(error = %e, "cannot publish a membership event to the workers");
                    }
                    if !ev.needs_reform() {
                        continue;
                    }
                    let live_elastic = workers
                        .iter()
                        .filter(|w| w.exit.is_none())
                        .all(|w| self.is_elastic(attempt, w.local_rank));
                    let Rdzv::Dynamic { handler } = &self.rdzv else {
                        return AttemptEnd::Reform(ev);
                    };
                    if !live_elastic {
                        return AttemptEnd::Reform(ev);
                    }
                    tracing::info!(job = %self.job, event = ?ev, "membership changed: re-forming with the workers running");
                    eprintln!(
                        "rekindle: membership changed ({ev:?}); re-forming while the workers train"
                    );
                    let (h, tx) = (handler.clone(), self.tx.clone());
                    std::thread::spawn(move || {
                        let r = h.next_rendezvous();
                        let _ = tx.send(Event::Rendezvous(Box::new(r)));
                    });
                    reforming = true;
                    break;
                }
            }
        }
    }
}

/// What the eviction watcher looks at; the monitor loop keeps it current.
#[derive(Debug, Clone, Default)]
struct EvictTargets {
    store_addr: String,
    prefix: String,
    /// `(global rank, pid)` of the live workers.
    workers: Vec<(usize, i32)>,
}

/// Kills workers that the elastic loop reported silent past the collective deadline (see
/// `train::form::evict_key`), reading the round's store every monitor interval on its own
/// thread, so that a slow or unreachable store never delays the agent's own loop.
struct Evictions {
    targets: Arc<std::sync::Mutex<EvictTargets>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Evictions {
    fn start(node: String, interval: Duration) -> Evictions {
        use std::sync::atomic::Ordering;
        let targets = Arc::new(std::sync::Mutex::new(EvictTargets::default()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (t, st) = (targets.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("rekindle-evictions".into())
            .spawn(move || {
                let mut conn: Option<(String, Arc<dyn Store>)> = None;
                let mut retry_at = Instant::now();
                while !st.load(Ordering::Acquire) {
                    std::thread::sleep(interval);
                    let now = t.lock().map(|g| g.clone()).unwrap_or_default();
                    if now.workers.is_empty() || now.store_addr.is_empty() {
                        continue;
                    }
                    if conn
                        .as_ref()
                        .map(|(a, _)| a != &now.store_addr)
                        .unwrap_or(true)
                    {
                        if Instant::now() < retry_at {
                            continue;
                        }
                        match crate::store::connect(&now.store_addr) {
                            Ok(c) => conn = Some((now.store_addr.clone(), c)),
                            Err(_) => {
                                retry_at = Instant::now() + Duration::from_secs(2);
                                continue;
                            }
                        }
                    }
                    let Some((_, store)) = &conn else { continue };
                    for (rank, pid) in &now.workers {
                        let key = format!(
                            "{}{}",
                            now.prefix,
                            crate::train::form::evict_key(&node, *pid as u32)
                        );
                        if let Ok(Some(by)) = store.get(&key) {
                            eprintln!(
                                "rekindle: rank {rank} (pid {pid}) stopped responding (reported \
                                 by rank {}); killing it so that it is replaced",
                                String::from_utf8_lossy(&by)
                            );
                            // SAFETY: kill(2) on our own child; SIGKILL also ends a stopped
                            // process.
                            unsafe {
                                libc::kill(*pid, libc::SIGKILL);
                            }
                            let _ = store.delete_prefix(&key);
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the eviction watcher");
        }
        Evictions { targets, stop }
    }

    fn update(&self, agent: &Agent, workers: &[Worker], round: &Round) {
        let t = EvictTargets {
            store_addr: agent.round_store_addr(round),
            prefix: agent.round_prefix(round.round),
            workers: workers
                .iter()
                .filter(|w| w.exit.is_none())
                .map(|w| (w.global_rank, w.pid))
                .collect(),
        };
        if let Ok(mut g) = self.targets.lock() {
            *g = t;
        }
    }
}

impl Drop for Evictions {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
    }
}

enum AttemptEnd {
    Succeeded,
    Closed(String),
    RendezvousFailed(RendezvousError),
    Failed,
    Reform(MembershipEvent),
    Signal(i32),
}

/// Connects the etcd backend, retrying an unreachable cluster until the join timeout.
fn connect_etcd(e: &EtcdRdzv) -> Result<EtcdBackend, AgentError> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(100);
    let opts = EtcdBackendOptions {
        lease_ttl: e.lease_ttl,
        finished_retention: e.finished_retention,
    };
    loop {
        match EtcdBackend::connect(&e.etcd, &e.job, opts.clone()) {
            Ok(b) => return Ok(b),
            Err(StoreError::Connection { reason, endpoint })
                if start.elapsed() + backoff < e.join_timeout =>
            {
                tracing::warn!(%endpoint, %reason, "etcd unreachable; retrying");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(StoreError::Connection { reason, endpoint }) => {
                return Err(RendezvousError::Connection {
                    backend: "etcd",
                    endpoint,
                    retried: start.elapsed(),
                    reason,
                }
                .into())
            }
            Err(StoreError::Unauthorized { reason, endpoint }) => {
                return Err(RendezvousError::Unauthorized {
                    backend: "etcd",
                    endpoint,
                    reason,
                }
                .into())
            }
            Err(other) => return Err(AgentError::Config(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split() {
        assert_eq!(split_addr("h:12"), Some(("h".into(), 12)));
        assert_eq!(split_addr("[::1]:5"), Some(("::1".into(), 5)));
        assert_eq!(split_addr("nope"), None);
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code::signal(libc::SIGTERM), 143);
        let e = AgentError::Rendezvous(RendezvousError::Shutdown);
        assert_eq!(e.exit_code(), exit_code::RENDEZVOUS);
        assert_eq!(AgentError::Config("x".into()).exit_code(), exit_code::USAGE);
    }
}
