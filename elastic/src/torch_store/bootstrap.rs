//! What the agent does for PyTorch programs each round: a fresh store on node 0, a proxy to
//! it on every other node, and the environment that points `init_process_group("env://")`
//! at it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rekindle_runtime::secret::JobSecret;

use super::protocol::Limits;
use super::proxy::{Resolve, TorchStoreProxy};
use super::server::TorchStoreServer;
use super::TorchStoreError;

/// The key, under the round's prefix in the round's store, where node 0 publishes its
/// PyTorch store as `host:port`.
pub const ADDR_KEY: &str = "torch-store";

/// Where one round is, as the agent knows it when the round starts.
#[derive(Debug, Clone)]
pub struct RoundSite<'a> {
    /// This node's rank in the round (0 hosts the store).
    pub node_rank: usize,
    /// Nodes in the round.
    pub nnodes: usize,
    /// Node 0's address as the other nodes reach it (`--master-addr`, or node 0's rendezvous
    /// address).
    pub master_addr: &'a str,
    /// The round's store, as [`crate::store::connect`] opens it.
    pub round_store: &'a str,
    /// The round's key prefix in that store (ends with `/`).
    pub round_prefix: &'a str,
    /// The job secret the round's store is opened with.
    pub secret: &'a JobSecret,
}

enum Endpoint {
    Server(TorchStoreServer),
    Proxy(TorchStoreProxy),
}

/// The PyTorch store of the current round and the worker environment that names it.
///
/// Each round gets a new store, so nothing a previous round's workers wrote (or a straggler of
/// that round still writes) is seen by the next one; this is what PyTorch's own agent does
/// when it restarts workers.
#[derive(Default)]
pub struct TorchBootstrap {
    current: Option<Endpoint>,
    env: Vec<(String, String)>,
}

impl std::fmt::Debug for TorchBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchBootstrap")
            .field("env", &self.env)
            .finish()
    }
}

/// The address to bind node 0's store to: loopback for a one-node round; node 0's own address
/// if it is an IP of this host; every interface otherwise.
fn server_bind(site: &RoundSite<'_>) -> IpAddr {
    if site.nnodes <= 1 {
        return Ipv4Addr::LOCALHOST.into();
    }
    match site.master_addr.parse::<IpAddr>() {
        Ok(ip) if std::net::TcpListener::bind((ip, 0)).is_ok() => ip,
        _ => Ipv4Addr::UNSPECIFIED.into(),
    }
}

impl TorchBootstrap {
    /// Nothing started yet.
    pub fn new() -> Self {
        TorchBootstrap::default()
    }

    /// Starts the store (node 0) or the proxy (other nodes) of a new round, replacing the
    /// previous round's, which closes its connections. Node 0 publishes the store's address in
    /// the round's store when other nodes need it. Never waits for other nodes.
    pub fn start_round(&mut self, site: &RoundSite<'_>) -> Result<(), TorchStoreError> {
        self.current = None;
        let limits = Limits::default();
        let (endpoint, local) = if site.node_rank == 0 {
            let ip = server_bind(site);
            let server = TorchStoreServer::bind(SocketAddr::new(ip, 0), limits)?;
            let port = server.local_addr().port();
            if site.nnodes > 1 {
                let key = format!("{}{ADDR_KEY}", site.round_prefix);
                let value = format!("{}:{port}", site.master_addr);
                crate::store::connect_with(site.round_store, site.secret)
                    .and_then(|s| s.set(&key, value.as_bytes()))
                    .map_err(|source| TorchStoreError::Publish {
                        store: site.round_store.to_string(),
                        key,
                        source,
                    })?;
            }
            let local = if ip.is_unspecified() {
                Ipv4Addr::LOCALHOST.into()
            } else {
                ip
            };
            (Endpoint::Server(server), SocketAddr::new(local, port))
        } else {
            let resolve = resolver(
                site.round_store.to_string(),
                site.secret.clone(),
                format!("{}{ADDR_KEY}", site.round_prefix),
            );
            let proxy = TorchStoreProxy::bind(
                (Ipv4Addr::LOCALHOST, 0).into(),
                resolve,
                limits.max_connections,
            )?;
            let local = proxy.local_addr();
            (Endpoint::Proxy(proxy), local)
        };
        self.current = Some(endpoint);
        self.env = vec![
            ("MASTER_ADDR".into(), local.ip().to_string()),
            ("MASTER_PORT".into(), local.port().to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into()),
            (
                "TORCH_NCCL_ASYNC_ERROR_HANDLING".into(),
                std::env::var("TORCH_NCCL_ASYNC_ERROR_HANDLING").unwrap_or_else(|_| "1".into()),
            ),
        ];
        Ok(())
    }

    /// The variables to give this round's workers (empty before the first round).
    pub fn worker_env(&self) -> &[(String, String)] {
        &self.env
    }

    /// The address workers on this node use (`MASTER_ADDR:MASTER_PORT`).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let a = match self.current.as_ref()? {
            Endpoint::Server(s) => s.local_addr(),
            Endpoint::Proxy(p) => p.local_addr(),
        };
        Some(if a.ip().is_unspecified() {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), a.port())
        } else {
            a
        })
    }
}

/// Reads node 0's published address from the round's store.
fn resolver(store: String, secret: JobSecret, key: String) -> Resolve {
    Arc::new(move |timeout: Duration| {
        let s = crate::store::connect_with(&store, &secret).map_err(|e| e.to_string())?;
        let v = s
            .wait(&[key.as_str()], timeout)
            .map_err(|e| e.to_string())?
            .pop()
            .ok_or_else(|| format!("{key}: no value"))?;
        let text = String::from_utf8(v).map_err(|_| format!("{key}: not text"))?;
        text.to_socket_addrs()
            .map_err(|e| format!("{key}: {text:?}: {e}"))?
            .next()
            .ok_or_else(|| format!("{key}: {text:?} resolves to nothing"))
    })
}
