//! Starting the agent: the job secret and where it may be used, this node's store, its
//! identity, the rendezvous, the log dir. Everything here is fixed for the agent's life.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::{Store, StoreError};

use super::config::{AgentConfig, EtcdRdzv, RdzvConfig};
use super::http::{HealthServer, Snapshot};
use super::outcome::AgentError;
use super::round::Round;
use super::spec::{elastic_key, SpecContext};
use crate::rendezvous::{
    DynamicRendezvousHandler, EtcdBackend, EtcdBackendOptions, HandlerOptions, NodeInfo,
    RendezvousBackend, RendezvousError, Settings, StoreBackend,
};
use crate::store::{TcpStoreClient, TcpStoreServer};
use crate::torch_store::{RoundSite, TorchBootstrap};

/// How this node joins rounds.
pub(crate) enum Rdzv {
    /// Fixed membership: round `k` is attempt `k`.
    Static {
        nnodes: usize,
        node_rank: usize,
        master_addr: String,
        master_port: u16,
    },
    /// A rendezvous handler (embedded store or etcd).
    Dynamic {
        handler: Arc<DynamicRendezvousHandler>,
    },
}

/// The running agent's fixed parts.
pub(crate) struct Agent {
    pub cfg: AgentConfig,
    pub job: String,
    pub node: NodeInfo,
    pub backend_name: &'static str,
    pub endpoint: String,
    pub log_root: PathBuf,
    pub secret: JobSecret,
    pub agent_store: Arc<dyn Store>,
    pub agent_store_addr: String,
    pub rdzv: Rdzv,
    /// The PyTorch TCPStore of the current round (see [`crate::torch_store`]).
    pub torch: TorchBootstrap,
    /// The HTTP endpoint, with `--health-port`.
    pub health: Option<HealthServer>,
    _server: TcpStoreServer,
    /// Holds the etcd password file written for the workers (removed on drop).
    _private: Option<tempfile::TempDir>,
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

/// True if `host` (an address or a name) resolves to loopback addresses only. A name that
/// does not resolve is not loopback.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
        return ip.is_loopback();
    }
    if host == "localhost" {
        return true;
    }
    match (host, 0).to_socket_addrs() {
        Ok(addrs) => {
            let ips: Vec<SocketAddr> = addrs.collect();
            !ips.is_empty() && ips.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// Refuses the built-in default secret when any of `hosts` (the addresses this node listens
/// on, advertises or connects to for the job) is off loopback.
pub(crate) fn check_secret(secret: &JobSecret, hosts: &[&str]) -> Result<(), AgentError> {
    if !secret.is_default() {
        return Ok(());
    }
    match hosts.iter().find(|h| !is_loopback_host(h)) {
        Some(h) => Err(AgentError::Secret(
            rekindle_runtime::Error::DefaultSecretOffLoopback {
                addr: h.to_string(),
            },
        )),
        None => Ok(()),
    }
}

/// The address other nodes reach this node at.
fn node_host(cfg: &AgentConfig) -> String {
    match (&cfg.local_addr, &cfg.rdzv) {
        (Some(a), _) => a.clone(),
        (None, RdzvConfig::Standalone) => "127.0.0.1".into(),
        (None, RdzvConfig::Static { nnodes: 1, .. }) => "127.0.0.1".into(),
        // Every node on this host: stay on loopback.
        (None, RdzvConfig::Static { master_addr, .. }) if is_loopback_host(master_addr) => {
            "127.0.0.1".into()
        }
        (None, _) => hostname(),
    }
}

/// Where this node's embedded store listens: node 0 of a static job across hosts, and every
/// etcd node off loopback, serve other hosts; everything else stays on loopback.
fn store_bind(cfg: &AgentConfig, host: &str) -> SocketAddr {
    let local = is_loopback_host(host);
    match &cfg.rdzv {
        RdzvConfig::Static {
            nnodes,
            node_rank: 0,
            master_port,
            master_addr,
        } if *nnodes > 1 && !(local && is_loopback_host(master_addr)) => {
            ([0, 0, 0, 0], master_port.unwrap_or(0)).into()
        }
        RdzvConfig::Static {
            node_rank: 0,
            master_port,
            ..
        } => ([127, 0, 0, 1], master_port.unwrap_or(0)).into(),
        RdzvConfig::Etcd(_) if !local => ([0, 0, 0, 0], 0).into(),
        _ => ([127, 0, 0, 1], 0).into(),
    }
}

/// Writes `password` to a file of its own (mode 0600, in a 0700 dir removed when the agent
/// exits) so that workers can read it without it being in their environment.
fn write_password(password: &str) -> Result<(tempfile::TempDir, PathBuf), AgentError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = tempfile::Builder::new()
        .prefix("rekindle-etcd-")
        .tempdir()
        .map_err(|source| AgentError::File {
            path: std::env::temp_dir(),
            source,
        })?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).map_err(
        |source| AgentError::File {
            path: dir.path().to_path_buf(),
            source,
        },
    )?;
    let path = dir.path().join("password");
    let file_err = |source| AgentError::File {
        path: path.clone(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(file_err)?;
    f.write_all(password.as_bytes()).map_err(file_err)?;
    Ok((dir, path))
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

impl Agent {
    /// Reads the job secret, binds this node's store and sets up the rendezvous.
    pub(crate) fn start(cfg: AgentConfig) -> Result<Agent, AgentError> {
        cfg.validate().map_err(AgentError::usage)?;
        let secret = JobSecret::from_env()?;
        let host = node_host(&cfg);
        let bind = store_bind(&cfg, &host);
        let bind_ip = bind.ip().to_string();
        let mut exposed: Vec<&str> = vec![&host, &bind_ip];
        if let RdzvConfig::Static { master_addr, .. } = &cfg.rdzv {
            exposed.push(master_addr);
        }
        check_secret(&secret, &exposed)?;
        let server = TcpStoreServer::bind(bind, &secret)?;
        let port = server.local_addr().port();
        let local_store_addr = format!("127.0.0.1:{port}");
        let agent_store: Arc<dyn Store> =
            Arc::new(TcpStoreClient::connect(&local_store_addr, &secret)?);
        let node = NodeInfo {
            id: format!(
                "{}-{}-{}",
                sanitize(&host),
                std::process::id(),
                random_hex(3)
            ),
            host: host.clone(),
            nproc: cfg.nproc_per_node,
            // Where other nodes reach the store: loopback if it listens there only.
            store_addr: Some(if bind.ip().is_loopback() {
                local_store_addr.clone()
            } else {
                format!("{host}:{port}")
            }),
        };
        let mut private = None;
        let (job, rdzv, backend_name, endpoint) = match &cfg.rdzv {
            RdzvConfig::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
            } => {
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
                let mut e = e.clone();
                if let Some(tls) = &mut e.etcd.tls {
                    for p in [&mut tls.ca, &mut tls.cert, &mut tls.key]
                        .into_iter()
                        .flatten()
                    {
                        *p = absolute(p);
                    }
                }
                let password_file = match (&e.etcd.user, &e.password_file) {
                    (None, _) => None,
                    (Some(_), Some(f)) => Some(absolute(f)),
                    (Some((_, password)), None) => {
                        let (dir, path) = write_password(password)?;
                        private = Some(dir);
                        Some(path)
                    }
                };
                let opts = HandlerOptions {
                    settings: Settings {
                        min_nodes: e.min_nodes,
                        max_nodes: e.max_nodes,
                        last_call: e.last_call,
                    },
                    join_timeout: e.join_timeout,
                };
                HandlerOptions::new(e.min_nodes, e.max_nodes)?;
                let mut backend = connect_etcd(&e)?;
                if let Some(f) = password_file {
                    backend = backend.with_password_file(f);
                }
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
        std::fs::create_dir_all(&log_root).map_err(|source| AgentError::File {
            path: log_root.clone(),
            source,
        })?;
        tracing::info!(job = %job, node = %node.id, backend = backend_name, endpoint = %endpoint,
            logs = %log_root.display(), "agent started");
        let health = match cfg.health_port {
            Some(port) => Some(start_health(&cfg, &host, port, &job, &node.id)?),
            None => None,
        };
        Ok(Agent {
            cfg,
            job,
            node,
            backend_name,
            endpoint,
            log_root,
            secret,
            agent_store,
            agent_store_addr: local_store_addr,
            rdzv,
            torch: TorchBootstrap::new(),
            health,
            _server: server,
            _private: private,
        })
    }

    /// The round's store as workers open it ([`crate::store::connect`]): etcd itself when the
    /// rendezvous backend offers it (then no node is a single point of failure), else node 0's
    /// embedded store. A static job of one node keeps that store on loopback
    /// ([`store_bind`]) whatever its master address, so its workers open it there.
    pub(crate) fn round_store_addr(&self, round: &Round) -> String {
        match &self.rdzv {
            Rdzv::Dynamic { handler } => {
                if let Some(addr) = handler.backend().worker_store_addr() {
                    return addr;
                }
            }
            Rdzv::Static { nnodes: 1, .. } => return self.agent_store_addr.clone(),
            _ => {}
        }
        round.master()
    }

    /// True if the worker at `local_rank` of `attempt` said it recovers in place.
    pub(crate) fn is_elastic(&self, attempt: u32, local_rank: usize) -> bool {
        matches!(
            self.agent_store
                .get(&elastic_key(&self.job, attempt, local_rank)),
            Ok(Some(_))
        )
    }

    /// What every worker spec of this node shares.
    pub(crate) fn spec_context(&self) -> SpecContext<'_> {
        SpecContext {
            job: &self.job,
            node: &self.node,
            entrypoint: &self.cfg.entrypoint,
            use_local_rank_arg: self.cfg.use_local_rank_arg,
            nproc: self.cfg.nproc_per_node as usize,
            max_restarts: self.cfg.max_restarts,
            backend_name: self.backend_name,
            endpoint: &self.endpoint,
            log_root: &self.log_root,
            agent_store_addr: &self.agent_store_addr,
            torch_env: self.torch.worker_env(),
        }
    }

    /// Starts the PyTorch TCPStore of `round` (a fresh one for every round, so restarted
    /// workers never read a previous round's keys): node 0 serves it and publishes its address
    /// in the round's store, the other nodes proxy to it on loopback.
    pub(crate) fn start_torch_store(&mut self, round: &Round) -> Result<(), AgentError> {
        let round_store = self.round_store_addr(round);
        let round_prefix = super::spec::round_prefix(&self.job, round.round);
        self.torch.start_round(&RoundSite {
            node_rank: round.node_rank,
            nnodes: round.nnodes,
            master_addr: &round.master_addr,
            round_store: &round_store,
            round_prefix: &round_prefix,
            secret: &self.secret,
        })?;
        Ok(())
    }
}

/// Where the HTTP endpoint listens: loopback when this node's address is, else every
/// interface (as the store of a node that serves other hosts).
fn health_bind(host: &str, port: u16) -> SocketAddr {
    if is_loopback_host(host) {
        ([127, 0, 0, 1], port).into()
    } else {
        ([0, 0, 0, 0], port).into()
    }
}

/// Starts the HTTP endpoint and prints where it listens.
fn start_health(
    cfg: &AgentConfig,
    host: &str,
    port: u16,
    job: &str,
    node_id: &str,
) -> Result<HealthServer, AgentError> {
    let bind = health_bind(host, port);
    let server = HealthServer::start(
        bind,
        Snapshot {
            job: job.to_string(),
            node_id: node_id.to_string(),
            heartbeat: Instant::now(),
            stuck_after: cfg.grace_period + super::http::STUCK_MARGIN,
            status: None,
            node_rank: None,
            rounds: 0,
            exit_code_failures: 0,
            signal_failures: 0,
            live_files: Vec::new(),
            all_files: Vec::new(),
        },
    )
    .map_err(|source| AgentError::Health { addr: bind, source })?;
    eprintln!(
        "rekindle: health endpoint on http://{}/ (/healthz /readyz /status /metrics)",
        server.local_addr()
    );
    Ok(server)
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
            Err(other) => {
                return Err(RendezvousError::State {
                    job: e.job.clone(),
                    reason: other.to_string(),
                }
                .into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rdzv: RdzvConfig, local_addr: Option<&str>) -> AgentConfig {
        AgentConfig {
            entrypoint: vec!["p".into()],
            nproc_per_node: 1,
            rdzv,
            job: None,
            max_restarts: 0,
            monitor_interval: Duration::from_millis(100),
            log_dir: None,
            use_local_rank_arg: false,
            grace_period: Duration::from_secs(1),
            local_addr: local_addr.map(str::to_string),
            handle_signals: false,
            health_port: None,
        }
    }

    fn fixed(nnodes: usize, node_rank: usize, master: &str) -> RdzvConfig {
        RdzvConfig::Static {
            nnodes,
            node_rank,
            master_addr: master.into(),
            master_port: Some(29400),
        }
    }

    #[test]
    fn loopback_hosts() {
        for h in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in ["10.1.2.3", "0.0.0.0", "::"] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn where_the_store_listens() {
        let table: Vec<(AgentConfig, &str)> = vec![
            (cfg(RdzvConfig::Standalone, None), "127.0.0.1:0"),
            (cfg(fixed(1, 0, "127.0.0.1"), None), "127.0.0.1:29400"),
            // Two nodes on this host.
            (cfg(fixed(2, 0, "127.0.0.1"), None), "127.0.0.1:29400"),
            (cfg(fixed(2, 0, "10.0.0.1"), None), "0.0.0.0:29400"),
            (
                cfg(fixed(2, 0, "127.0.0.1"), Some("10.0.0.1")),
                "0.0.0.0:29400",
            ),
            // Only node 0 serves the job.
            (cfg(fixed(2, 1, "10.0.0.1"), None), "127.0.0.1:0"),
        ];
        for (c, want) in table {
            let host = node_host(&c);
            assert_eq!(store_bind(&c, &host).to_string(), want, "{:?}", c.rdzv);
        }
    }

    #[test]
    fn the_default_secret_is_for_loopback_only() {
        let d = JobSecret::default_single_host();
        assert!(check_secret(&d, &["127.0.0.1", "localhost"]).is_ok());
        let e = check_secret(&d, &["127.0.0.1", "10.0.0.7"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let msg = e.to_string();
        assert!(
            msg.contains("10.0.0.7") && msg.contains("REKINDLE_SECRET_FILE"),
            "{msg}"
        );
        let real = JobSecret::new("s").unwrap();
        assert!(check_secret(&real, &["10.0.0.7", "0.0.0.0"]).is_ok());
    }

    #[test]
    fn an_inline_password_goes_to_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, path) = write_password("pw").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "pw");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let dmode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(dmode & 0o077, 0, "the dir is private");
        drop(dir);
        assert!(!path.exists(), "removed with the agent");
    }
}
