//! The connection to an etcd v3 cluster shared by the [`EtcdStore`](crate::store::EtcdStore)
//! and the etcd rendezvous backend.
//!
//! `etcd-client` is async; this module runs it on a tokio runtime of its own, on dedicated
//! threads, so the synchronous store and rendezvous APIs can
//! be called from any thread, and maps its errors onto [`StoreError`] so that an unreachable
//! cluster reads [`StoreError::Connection`] and refused credentials read
//! [`StoreError::Unauthorized`].

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use rekindle_runtime::store::{StoreError, StoreResult};

use crate::io_runtime::{CallError, IoRuntime};

/// TLS files for an etcd cluster (PEM).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate that signed the server's certificate.
    pub ca: Option<PathBuf>,
    /// The client certificate, for clusters that require client certificates.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

/// How to reach an etcd cluster.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Endpoints, `host:port` or `http(s)://host:port`.
    pub endpoints: Vec<String>,
    /// User name and password, for clusters with authentication enabled.
    pub user: Option<(String, String)>,
    /// TLS files; with TLS, endpoints without a scheme use `https://`.
    pub tls: Option<EtcdTls>,
    /// The bound on each request (and on connecting).
    pub request_timeout: Duration,
}

impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("tls", &self.tls)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl EtcdConfig {
    /// A configuration for `endpoints` with no credentials and a 5 s request timeout.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            user: None,
            tls: None,
            request_timeout: Duration::from_secs(5),
        }
    }

    /// The endpoints as one string, for messages.
    pub fn endpoint_string(&self) -> String {
        self.endpoints.join(",")
    }

    fn urls(&self) -> Vec<String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        self.endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("{scheme}://{e}")
                }
            })
            .collect()
    }

    fn options(&self) -> StoreResult<ConnectOptions> {
        let mut opts = ConnectOptions::new()
            .with_timeout(self.request_timeout)
            .with_connect_timeout(self.request_timeout)
            .with_keep_alive(Duration::from_secs(2), self.request_timeout)
            .with_keep_alive_while_idle(true);
        if let Some((user, password)) = &self.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        if let Some(tls) = &self.tls {
            let read = |p: &PathBuf, what: &str| {
                std::fs::read(p).map_err(|e| StoreError::Connection {
                    endpoint: self.endpoint_string(),
                    reason: format!("cannot read the TLS {what} {}: {e}", p.display()),
                })
            };
            let mut t = TlsOptions::new();
            if let Some(ca) = &tls.ca {
                t = t.ca_certificate(Certificate::from_pem(read(ca, "CA certificate")?));
            }
            match (&tls.cert, &tls.key) {
                (Some(c), Some(k)) => {
                    t = t.identity(Identity::from_pem(read(c, "certificate")?, read(k, "key")?))
                }
                (None, None) => {}
                _ => {
                    return Err(StoreError::Connection {
                        endpoint: self.endpoint_string(),
                        reason: "a TLS client certificate needs both cert and key".into(),
                    })
                }
            }
            opts = opts.with_tls(t);
        }
        Ok(opts)
    }
}

/// Opens a new connection to the cluster, with the options of the first.
///
/// A connection whose peer became unreachable stays open while TCP retransmits with growing
/// back-off, so requests on it can stall for seconds after the network has healed; a task that
/// must get through soon after a heal (a lease's keep-alive) dials again instead.
#[derive(Clone)]
pub(crate) struct Redial {
    urls: Vec<String>,
    opts: ConnectOptions,
}

impl Redial {
    /// A new client, or `None` if it cannot connect (and authenticate) within `timeout`.
    pub(crate) async fn connect(&self, timeout: Duration) -> Option<Client> {
        let opts = self.opts.clone().with_connect_timeout(timeout);
        match tokio::time::timeout(timeout, Client::connect(self.urls.clone(), Some(opts))).await {
            Ok(Ok(c)) => Some(c),
            _ => None,
        }
    }
}

/// A connected etcd client on its own runtime.
pub(crate) struct EtcdConn {
    client: Client,
    redial: Redial,
    endpoint: String,
    pub(crate) timeout: Duration,
    rt: IoRuntime,
}

impl std::fmt::Debug for EtcdConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConn")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl EtcdConn {
    /// Connects. With credentials this authenticates at once, so wrong credentials fail here
    /// with [`StoreError::Unauthorized`]; without, the first request shows whether the cluster
    /// is reachable.
    pub(crate) fn connect(cfg: &EtcdConfig) -> StoreResult<Self> {
        let endpoint = cfg.endpoint_string();
        if cfg.endpoints.is_empty() {
            return Err(StoreError::Connection {
                endpoint,
                reason: "no etcd endpoint given".into(),
            });
        }
        let rt = IoRuntime::new("rekindle-etcd", 1).map_err(|e| StoreError::Backend {
            op: "connect",
            reason: format!("cannot start the etcd client runtime: {e}"),
        })?;
        let opts = cfg.options()?;
        let urls = cfg.urls();
        let redial = Redial {
            urls: urls.clone(),
            opts: opts.clone(),
        };
        let client = rt
            .call(
                async move { Client::connect(urls, Some(opts)).await },
                Instant::now() + cfg.request_timeout,
            )
            .map_err(|e| call_error(&endpoint, "connect", e, cfg.request_timeout))?
            .map_err(|e| map_error(&endpoint, "connect", &e))?;
        Ok(EtcdConn {
            client,
            redial,
            endpoint,
            timeout: cfg.request_timeout,
            rt,
        })
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// What opens a connection of its own to the same cluster (see [`Redial`]).
    pub(crate) fn redial(&self) -> Redial {
        self.redial.clone()
    }

    pub(crate) fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.rt.handle()
    }

    /// Runs `f(client)` bounded by the request timeout.
    pub(crate) fn call<T, F, Fut>(&self, op: &'static str, f: F) -> StoreResult<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.call_until(op, Instant::now() + self.timeout, f)
    }

    /// Runs `f(client)` bounded by `deadline`.
    pub(crate) fn call_until<T, F, Fut>(
        &self,
        op: &'static str,
        deadline: Instant,
        f: F,
    ) -> StoreResult<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let fut = f(self.client.clone());
        let budget = deadline.saturating_duration_since(Instant::now());
        self.rt
            .call(fut, deadline)
            .map_err(|e| call_error(&self.endpoint, op, e, budget))?
            .map_err(|e| map_error(&self.endpoint, op, &e))
    }
}

fn call_error(endpoint: &str, op: &'static str, e: CallError, budget: Duration) -> StoreError {
    match e {
        CallError::Timeout => StoreError::Connection {
            endpoint: endpoint.to_string(),
            reason: format!("{op} got no answer within {budget:?}"),
        },
        CallError::Shutdown => StoreError::Closed,
    }
}

/// Maps an etcd client error onto the store's error kinds.
pub(crate) fn map_error(endpoint: &str, op: &'static str, e: &etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    use tonic_code::*;
    let connection = |reason: String| StoreError::Connection {
        endpoint: endpoint.to_string(),
        reason,
    };
    match e {
        E::GRpcStatus(s) => {
            let mut msg = s.message().to_string();
            let mut src = std::error::Error::source(s);
            while let Some(inner) = src {
                let part = inner.to_string();
                if !msg.contains(&part) {
                    msg = format!("{msg}: {part}");
                }
                src = inner.source();
            }
            let code = s.code() as i32;
            let auth_words = [
                "authentication failed",
                "user name is empty",
                "invalid auth token",
                "permission denied",
            ];
            if code == UNAUTHENTICATED
                || code == PERMISSION_DENIED
                || auth_words.iter().any(|w| msg.contains(w))
            {
                StoreError::Unauthorized {
                    endpoint: endpoint.to_string(),
                    reason: msg,
                }
            } else if code == UNAVAILABLE
                || code == DEADLINE_EXCEEDED
                || code == CANCELLED
                || code == UNKNOWN
            {
                connection(if msg.is_empty() { format!("{e}") } else { msg })
            } else {
                StoreError::Backend {
                    op,
                    reason: format!("etcd refused {op}: {msg}"),
                }
            }
        }
        E::TransportError(_) | E::IoError(_) | E::WatchError(_) | E::LeaseKeepAliveError(_) => {
            connection(e.to_string())
        }
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            connection(format!("bad endpoint: {e}"))
        }
        other => StoreError::Backend {
            op,
            reason: other.to_string(),
        },
    }
}

/// gRPC status codes (tonic's `Code` as integers, so this module need not name tonic).
mod tonic_code {
    pub const CANCELLED: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const PERMISSION_DENIED: i32 = 7;
    pub const UNAVAILABLE: i32 = 14;
    pub const UNAUTHENTICATED: i32 = 16;
}
