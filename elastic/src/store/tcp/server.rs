//! The embedded store's server: a map in memory served over TCP on tokio, to holders of the
//! job secret only (see [`super::auth`]), with bounded frames and connections.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::CasOutcome;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use super::auth::{self, Direction};
use super::protocol::{decode_request, encode_response, Request, Response, MAX_FRAME};
use crate::io_runtime::IoRuntime;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("cannot bind the embedded store to {addr}: {source}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The runtime could not be started.
    #[error("cannot start the embedded store's runtime: {0}")]
    Runtime(std::io::Error),
    /// The built-in default secret would serve an address off loopback.
    #[error("the embedded store at {addr}: {source}")]
    Secret {
        /// The address it was to listen on.
        addr: SocketAddr,
        /// The refusal.
        source: rekindle_runtime::Error,
    },
}

/// The server's bounds: what a client, authenticated or not, can make it hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections open at once, authenticated or still in the handshake; more are closed
    /// as soon as they are accepted. Default 4096.
    pub max_connections: usize,
    /// Connections still in the handshake at once (a stranger can hold at most these, each
    /// for at most `handshake_timeout`). Default 128.
    pub max_handshakes: usize,
    /// How long a client has to complete the handshake. Default 5 s.
    pub handshake_timeout: Duration,
    /// The largest request body accepted; a bigger one closes the connection. Default
    /// [`MAX_FRAME`] (16 MiB).
    pub max_frame: usize,
    /// Requests of one connection being served at once; the server reads no more from that
    /// connection until one is answered. Default 1024.
    pub max_in_flight: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 4096,
            max_handshakes: 128,
            handshake_timeout: Duration::from_secs(5),
            max_frame: MAX_FRAME,
            max_in_flight: 1024,
        }
    }
}

#[derive(Default)]
struct Shared {
    map: Mutex<BTreeMap<String, Vec<u8>>>,
    changed: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // Every update is a single insert or remove, so a poisoned map is still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn values(&self, keys: &[String]) -> Result<Vec<Vec<u8>>, Vec<String>> {
        let map = self.lock();
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !map.contains_key(*k))
            .cloned()
            .collect();
        if missing.is_empty() {
            Ok(keys.iter().map(|k| map[k].clone()).collect())
        } else {
            Err(missing)
        }
    }

    async fn handle(&self, req: Request) -> Response {
        match req {
            Request::Set { key, value } => {
                self.lock().insert(key, value);
                self.changed.notify_waiters();
                Response::Done
            }
            Request::Get { key } => Response::Value(self.lock().get(&key).cloned()),
            Request::Wait { keys, timeout_ms } => self.wait(keys, timeout_ms).await,
            Request::Add { key, delta } => {
                let mut map = self.lock();
                let old = match map.get(&key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.parse::<i64>().ok())
                    {
                        Some(n) => n,
                        None => {
                            return Response::InvalidValue {
                                key,
                                reason: "not a decimal integer".into(),
                            }
                        }
                    },
                };
                let new = old.wrapping_add(delta);
                map.insert(key, new.to_string().into_bytes());
                drop(map);
                self.changed.notify_waiters();
                Response::Counter(new)
            }
            Request::Cas {
                key,
                expected,
                value,
            } => {
                let mut map = self.lock();
                let current = map.get(&key);
                if current != expected.as_ref() {
                    return Response::Cas(CasOutcome::Current(current.cloned()));
                }
                map.insert(key, value);
                drop(map);
                self.changed.notify_waiters();
                Response::Cas(CasOutcome::Swapped)
            }
            Request::DeletePrefix { prefix } => {
                let mut map = self.lock();
                let doomed: Vec<String> = map
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in &doomed {
                    map.remove(k);
                }
                Response::Deleted(doomed.len() as u64)
            }
        }
    }

    /// Waits server-side: every change wakes the waiters, which re-check their keys.
    async fn wait(&self, keys: Vec<String>, timeout_ms: u64) -> Response {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a change between check and await is not lost.
            notified.as_mut().enable();
            match self.values(&keys) {
                Ok(values) => return Response::Values(values),
                Err(missing) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(deadline) => {
                            return match self.values(&keys) {
                                Ok(values) => Response::Values(values),
                                Err(missing) => Response::Timeout { missing, timeout_ms },
                            };
                        }
                    }
                    let _ = missing;
                }
            }
        }
    }
}

/// The embedded store server. It serves until dropped; dropping it closes every connection.
///
/// Every connection must first prove that it holds the job secret (an HMAC handshake over
/// fresh nonces, as [`TcpStoreClient`](crate::store::TcpStoreClient) does it), and every frame
/// after that carries a MAC; a connection that fails either is closed before any request of it
/// is served.
///
/// ```
/// use rekindle_elastic::store::{TcpStoreClient, TcpStoreServer};
/// use rekindle_runtime::secret::JobSecret;
/// use rekindle_runtime::store::Store;
///
/// let secret = JobSecret::new("job secret").unwrap();
/// let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret).unwrap();
/// let client = TcpStoreClient::connect(&server.local_addr().to_string(), &secret).unwrap();
/// client.set("k", b"v").unwrap();
/// assert_eq!(client.get("k").unwrap(), Some(b"v".to_vec()));
/// ```
pub struct TcpStoreServer {
    addr: SocketAddr,
    refused: Arc<AtomicU64>,
    _rt: IoRuntime,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

/// What every connection task shares.
struct Context {
    shared: Shared,
    secret: JobSecret,
    limits: ServerLimits,
    handshakes: Arc<Semaphore>,
    refused: Arc<AtomicU64>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`TcpStoreServer::local_addr`]) and serves
    /// the holders of `secret` with the default [`ServerLimits`]. An address in use is a
    /// [`ServerError::Bind`], never a silent fallback; the built-in default secret on an
    /// address off loopback is a [`ServerError::Secret`].
    pub fn bind(addr: SocketAddr, secret: &JobSecret) -> Result<Self, ServerError> {
        Self::bind_with(addr, secret, ServerLimits::default())
    }

    /// [`TcpStoreServer::bind`] with explicit limits.
    pub fn bind_with(
        addr: SocketAddr,
        secret: &JobSecret,
        limits: ServerLimits,
    ) -> Result<Self, ServerError> {
        secret
            .check_exposure(&[addr.ip()])
            .map_err(|source| ServerError::Secret { addr, source })?;
        let std_listener =
            StdListener::bind(addr).map_err(|source| ServerError::Bind { addr, source })?;
        let local = std_listener
            .local_addr()
            .map_err(|source| ServerError::Bind { addr, source })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|source| ServerError::Bind { addr, source })?;
        let rt = IoRuntime::new("rekindle-store-srv", 1).map_err(ServerError::Runtime)?;
        let handle = rt
            .handle()
            .ok_or_else(|| ServerError::Runtime(std::io::Error::other("runtime gone")))?
            .clone();
        let listener = {
            let _guard = handle.enter();
            tokio::net::TcpListener::from_std(std_listener)
                .map_err(|source| ServerError::Bind { addr, source })?
        };
        let refused = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(Semaphore::new(limits.max_connections));
        let ctx = Arc::new(Context {
            shared: Shared::default(),
            secret: secret.clone(),
            handshakes: Arc::new(Semaphore::new(limits.max_handshakes)),
            limits,
            refused: refused.clone(),
        });
        handle.spawn(async move {
            let mut warned_at: Option<Instant> = None;
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let permits = connections
                            .clone()
                            .try_acquire_owned()
                            .ok()
                            .zip(ctx.handshakes.clone().try_acquire_owned().ok());
                        let Some((conn, handshake)) = permits else {
                            ctx.refused.fetch_add(1, Ordering::Relaxed);
                            if warned_at.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                                tracing::warn!(%peer, "embedded store: too many connections; closing new ones");
                                warned_at = Some(Instant::now());
                            }
                            drop(stream);
                            continue;
                        };
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(serve_connection(stream, peer, ctx.clone(), conn, handshake));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "embedded store: accept failed");
                        // Out of file descriptors and similar: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(TcpStoreServer {
            addr: local,
            refused,
            _rt: rt,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections closed so far without being served: failed handshakes, forged or
    /// oversized frames, and connections over the limits.
    pub fn refused_connections(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    ctx: Arc<Context>,
    _conn: OwnedSemaphorePermit,
    handshake: OwnedSemaphorePermit,
) {
    let session = match tokio::time::timeout(
        ctx.limits.handshake_timeout,
        auth::accept(&mut stream, &ctx.secret),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            ctx.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, reason = %e, "embedded store: connection refused");
            return;
        }
        Err(_) => {
            ctx.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, "embedded store: no handshake within the deadline; closing");
            return;
        }
    };
    drop(handshake);
    let session = Arc::new(session);
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(256);
    let writer = {
        let session = session.clone();
        tokio::spawn(async move {
            let mut seq = 0u64;
            while let Some(body) = rx.recv().await {
                let frame = auth::seal_frame(&session, Direction::Response, seq, &body);
                seq += 1;
                if wr.write_all(&frame).await.is_err() {
                    break;
                }
            }
        })
    };
    let in_flight = Arc::new(Semaphore::new(ctx.limits.max_in_flight.max(1)));
    let mut seq = 0u64;
    loop {
        let body = match auth::read_frame(
            &mut rd,
            &session,
            Direction::Request,
            seq,
            ctx.limits.max_frame,
        )
        .await
        {
            Ok(b) => b,
            Err(auth::FrameError::Io(_)) => break,
            Err(e) => {
                ctx.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, reason = %e, "embedded store: closing the connection");
                break;
            }
        };
        seq += 1;
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        let ctx = ctx.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let (id, resp) = match decode_request(&body) {
                Ok((id, req)) => (id, ctx.shared.handle(req).await),
                Err((id, why)) => (id, Response::BadRequest(why)),
            };
            let _ = tx.send(encode_response(id, &resp)).await;
            drop(permit);
        });
    }
    drop(tx);
    let _ = writer.await;
}
