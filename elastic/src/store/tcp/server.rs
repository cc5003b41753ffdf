//! The embedded store's server: a map in memory served over TCP on tokio.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rekindle_runtime::store::CasOutcome;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};

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
/// ```
/// use rekindle_elastic::store::{TcpStoreClient, TcpStoreServer};
/// use rekindle_runtime::store::Store;
///
/// let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
/// let client = TcpStoreClient::connect(&server.local_addr().to_string()).unwrap();
/// client.set("k", b"v").unwrap();
/// assert_eq!(client.get("k").unwrap(), Some(b"v".to_vec()));
/// ```
pub struct TcpStoreServer {
    addr: SocketAddr,
    _rt: IoRuntime,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`TcpStoreServer::local_addr`]) and starts
    /// serving. An address in use is a [`ServerError::Bind`], never a silent fallback.
    pub fn bind(addr: SocketAddr) -> Result<Self, ServerError> {
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
        let shared = Arc::new(Shared::default());
        handle.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(serve_connection(stream, shared.clone()));
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
            _rt: rt,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(256);
    let writer = tokio::spawn(async move {
        while let Some(body) = rx.recv().await {
            let mut frame = (body.len() as u32).to_be_bytes().to_vec();
            frame.extend_from_slice(&body);
            if wr.write_all(&frame).await.is_err() {
                break;
            }
        }
    });
    loop {
        let mut len = [0u8; 4];
        if rd.read_exact(&mut len).await.is_err() {
            break;
        }
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_FRAME {
            tracing::warn!(
                len,
                "embedded store: frame too large, closing the connection"
            );
            break;
        }
        let mut body = vec![0u8; len];
        if rd.read_exact(&mut body).await.is_err() {
            break;
        }
        let shared = shared.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let (id, resp) = match decode_request(&body) {
                Ok((id, req)) => (id, shared.handle(req).await),
                Err((id, why)) => (id, Response::BadRequest(why)),
            };
            let _ = tx.send(encode_response(id, &resp)).await;
        });
    }
    drop(tx);
    let _ = writer.await;
}
