//! The embedded store's client: requests multiplexed over one TCP connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::store::{CasOutcome, Store, StoreError, StoreResult};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::protocol::{
    decode_response, encode_request, response_error, Request, Response, MAX_FRAME,
};
use crate::io_runtime::{CallError, IoRuntime};

/// How long a single non-waiting request may take by default.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

struct Conn {
    writer: mpsc::Sender<Vec<u8>>,
    pending: Pending,
    broken: Arc<AtomicBool>,
}

/// A [`Store`] client of a [`TcpStoreServer`](super::TcpStoreServer).
///
/// Requests from many threads share one connection and do not wait for each other (a long
/// `wait` does not delay a `set`). A broken connection fails the requests in flight with
/// [`StoreError::Connection`]; the next request reconnects.
pub struct TcpStoreClient {
    endpoint: String,
    op_timeout: Duration,
    next_id: AtomicU64,
    conn: Mutex<Option<Arc<Conn>>>,
    rt: IoRuntime,
}

impl std::fmt::Debug for TcpStoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreClient")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl TcpStoreClient {
    /// Connects to `endpoint` (`host:port`) with [`DEFAULT_OP_TIMEOUT`].
    pub fn connect(endpoint: &str) -> StoreResult<Self> {
        Self::connect_with_timeout(endpoint, DEFAULT_OP_TIMEOUT)
    }

    /// Connects to `endpoint`; connecting and each non-waiting request are bounded by
    /// `op_timeout` (a `wait` by its own timeout plus `op_timeout`).
    pub fn connect_with_timeout(endpoint: &str, op_timeout: Duration) -> StoreResult<Self> {
        let rt = IoRuntime::new("rekindle-store-cli", 1).map_err(|e| StoreError::Backend {
            op: "connect",
            reason: format!("cannot start the client runtime: {e}"),
        })?;
        let client = TcpStoreClient {
            endpoint: endpoint.to_string(),
            op_timeout,
            next_id: AtomicU64::new(1),
            conn: Mutex::new(None),
            rt,
        };
        client.conn()?;
        Ok(client)
    }

    /// The endpoint this client talks to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn connection_error(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Connection {
            endpoint: self.endpoint.clone(),
            reason: reason.into(),
        }
    }

    fn conn(&self) -> StoreResult<Arc<Conn>> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref() {
            if !c.broken.load(Ordering::Acquire) {
                return Ok(c.clone());
            }
        }
        let endpoint = self.endpoint.clone();
        // The server may not be up yet (workers of other nodes start at the same time as the
        // agent that hosts it): refused connections are retried until the timeout.
        let stream =
            self.rt
                .call(
                    async move {
                        let mut backoff = Duration::from_millis(10);
                        loop {
                            match tokio::net::TcpStream::connect(&endpoint).await {
                                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                                    tokio::time::sleep(backoff).await;
                                    backoff = (backoff * 2).min(Duration::from_millis(500));
                                }
                                other => return other,
                            }
                        }
                    },
                    Instant::now() + self.op_timeout,
                )
                .map_err(|e| match e {
                    CallError::Timeout => self
                        .connection_error(format!("connect timed out after {:?}", self.op_timeout)),
                    CallError::Shutdown => StoreError::Closed,
                })?
                .map_err(|e| self.connection_error(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let handle = self.rt.handle().ok_or(StoreError::Closed)?;
        let (mut rd, mut wr) = stream.into_split();
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(256);
        let pending: Pending = Arc::default();
        let broken = Arc::new(AtomicBool::new(false));
        {
            let broken = broken.clone();
            handle.spawn(async move {
                while let Some(body) = rx.recv().await {
                    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
                    frame.extend_from_slice(&body);
                    if wr.write_all(&frame).await.is_err() {
                        broken.store(true, Ordering::Release);
                        break;
                    }
                }
            });
        }
        {
            let pending = pending.clone();
            let broken = broken.clone();
            handle.spawn(async move {
                loop {
                    let mut len = [0u8; 4];
                    if rd.read_exact(&mut len).await.is_err() {
                        break;
                    }
                    let len = u32::from_be_bytes(len) as usize;
                    if len > MAX_FRAME {
                        break;
                    }
                    let mut body = vec![0u8; len];
                    if rd.read_exact(&mut body).await.is_err() {
                        break;
                    }
                    let Ok((id, resp)) = decode_response(&body) else {
                        break;
                    };
                    let waiter = pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                    if let Some(w) = waiter {
                        let _ = w.send(resp);
                    }
                }
                broken.store(true, Ordering::Release);
                // Dropping the senders fails every request in flight at once.
                pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
            });
        }
        let conn = Arc::new(Conn {
            writer: tx,
            pending,
            broken,
        });
        *slot = Some(conn.clone());
        Ok(conn)
    }

    fn request(&self, op: &'static str, req: Request, budget: Duration) -> StoreResult<Response> {
        let conn = self.conn()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        conn.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        let body = encode_request(id, &req);
        let writer = conn.writer.clone();
        let out = self.rt.call(
            async move {
                writer.send(body).await.map_err(|_| ())?;
                rx.await.map_err(|_| ())
            },
            Instant::now() + budget,
        );
        match out {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(())) => {
                conn.broken.store(true, Ordering::Release);
                Err(self.connection_error(format!("connection lost during {op}")))
            }
            Err(CallError::Timeout) => {
                conn.pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                Err(self.connection_error(format!("{op} got no answer within {budget:?}")))
            }
            Err(CallError::Shutdown) => Err(StoreError::Closed),
        }
    }
}

impl Store for TcpStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request("set", req, self.op_timeout)? {
            Response::Done => Ok(()),
            other => Err(response_error(other, "set")),
        }
    }

    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        let req = Request::Get {
            key: key.to_string(),
        };
        match self.request("get", req, self.op_timeout)? {
            Response::Value(v) => Ok(v),
            other => Err(response_error(other, "get")),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        };
        match self.request("wait", req, timeout + self.op_timeout)? {
            Response::Values(v) if v.len() == keys.len() => Ok(v),
            other => Err(response_error(other, "wait")),
        }
    }

    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.request("add", req, self.op_timeout)? {
            Response::Counter(n) => Ok(n),
            other => Err(response_error(other, "add")),
        }
    }

    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        let req = Request::Cas {
            key: key.to_string(),
            expected: expected.map(|e| e.to_vec()),
            value: value.to_vec(),
        };
        match self.request("compare_and_set", req, self.op_timeout)? {
            Response::Cas(out) => Ok(out),
            other => Err(response_error(other, "compare_and_set")),
        }
    }

    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        let req = Request::DeletePrefix {
            prefix: prefix.to_string(),
        };
        match self.request("delete_prefix", req, self.op_timeout)? {
            Response::Deleted(n) => Ok(n),
            other => Err(response_error(other, "delete_prefix")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::TcpStoreServer;
    use super::*;

    fn server() -> TcpStoreServer {
        TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap()
    }

    #[test]
    fn conforms() {
        let s = server();
        let c = Arc::new(TcpStoreClient::connect(&s.local_addr().to_string()).unwrap());
        rekindle_runtime::store::testing::conformance(c).unwrap();
    }

    #[test]
    fn two_clients_see_each_other_and_wait_is_woken() {
        let s = server();
        let a = TcpStoreClient::connect(&s.local_addr().to_string()).unwrap();
        let b = Arc::new(TcpStoreClient::connect(&s.local_addr().to_string()).unwrap());
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                b.set("ready", b"1").unwrap();
                b.wait(&["late"], Duration::from_secs(10))
            })
        };
        a.wait(&["ready"], Duration::from_secs(10)).unwrap();
        a.set("late", b"x").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), vec![b"x".to_vec()]);
    }

    #[test]
    fn works_inside_a_tokio_runtime() {
        let s = server();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let addr = s.local_addr().to_string();
        rt.block_on(async move {
            let c = TcpStoreClient::connect(&addr).unwrap();
            c.set("k", b"v").unwrap();
            assert_eq!(c.get("k").unwrap(), Some(b"v".to_vec()));
            drop(c);
        });
    }

    #[test]
    fn server_gone_is_a_connection_error() {
        let s = server();
        let addr = s.local_addr().to_string();
        let c = TcpStoreClient::connect_with_timeout(&addr, Duration::from_secs(2)).unwrap();
        c.set("k", b"v").unwrap();
        drop(s);
        let err = c.get("k").unwrap_err();
        assert!(matches!(err, StoreError::Connection { .. }), "{err:?}");
    }

    #[test]
    fn bind_in_use_is_an_error() {
        let s = server();
        let err = TcpStoreServer::bind(s.local_addr()).unwrap_err();
        assert!(err.to_string().contains("cannot bind"), "{err}");
    }
}
