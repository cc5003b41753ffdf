//! The embedded store's client: requests multiplexed over one authenticated TCP connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::{CasOutcome, Store, StoreError, StoreResult};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

use super::auth::{self, Direction, HandshakeError};
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

/// How long data sent to the server may stay unacknowledged before the kernel gives up on
/// the connection (`TCP_USER_TIMEOUT`). Idle connections are unaffected; a connection into a
/// partition fails after this long instead of retransmitting at doubling intervals, so the
/// first request after the heal goes over a new connection at once.
const UNACKED_LIMIT: Duration = Duration::from_secs(3);

/// The longest one connection attempt takes before a new one is made (a SYN lost in a
/// partition is retried by a fresh attempt, not by the kernel's doubling timer).
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

/// Sets [`UNACKED_LIMIT`] on `stream`; a failure only leaves the kernel's default.
fn limit_unacked(stream: &tokio::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let ms = UNACKED_LIMIT.as_millis() as libc::c_uint;
    // SAFETY: setsockopt on a socket this stream owns, with a pointer to a live c_uint and
    // its size.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot set TCP_USER_TIMEOUT");
    }
}

/// A [`Store`] client of a [`TcpStoreServer`](super::TcpStoreServer).
///
/// Requests from many threads share one connection and do not wait for each other (a long
/// `wait` does not delay a `set`). A broken connection fails the requests in flight with
/// [`StoreError::Connection`]; the next request reconnects. Each connection first proves that
/// this client holds the job secret and checks that the server does too; a server that refuses
/// the secret, or cannot prove it holds it, is a [`StoreError::Unauthorized`].
pub struct TcpStoreClient {
    endpoint: String,
    secret: JobSecret,
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
    /// Connects to `endpoint` (`host:port`) as a holder of `secret`, with
    /// [`DEFAULT_OP_TIMEOUT`].
    pub fn connect(endpoint: &str, secret: &JobSecret) -> StoreResult<Self> {
        Self::connect_with_timeout(endpoint, secret, DEFAULT_OP_TIMEOUT)
    }

    /// Connects to `endpoint` as a holder of `secret`; connecting (handshake included) and
    /// each non-waiting request are bounded by `op_timeout` (a `wait` by its own timeout plus
    /// `op_timeout`). The built-in default secret is refused for a server off loopback.
    pub fn connect_with_timeout(
        endpoint: &str,
        secret: &JobSecret,
        op_timeout: Duration,
    ) -> StoreResult<Self> {
        let rt = IoRuntime::new("rekindle-store-cli", 1).map_err(|e| StoreError::Backend {
            op: "connect",
            reason: format!("cannot start the client runtime: {e}"),
        })?;
        let client = TcpStoreClient {
            endpoint: endpoint.to_string(),
            secret: secret.clone(),
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
        let secret = self.secret.clone();
        // The server may not be up yet (workers of other nodes start at the same time as the
        // agent that hosts it): refused connections are retried until the timeout.
        let connected =
            self.rt
                .call(
                    async move {
                        let mut backoff = Duration::from_millis(10);
                        let mut stream = loop {
                            let attempt = tokio::time::timeout(
                                CONNECT_ATTEMPT,
                                tokio::net::TcpStream::connect(&endpoint),
                            );
                            match attempt.await {
                                // No answer to the SYN: try again with a new one.
                                Err(_) => {}
                                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                                    tokio::time::sleep(backoff).await;
                                    backoff = (backoff * 2).min(Duration::from_millis(500));
                                }
                                Ok(Err(e)) => return Err(HandshakeError::Io(e.to_string())),
                                Ok(Ok(s)) => break s,
                            }
                        };
                        limit_unacked(&stream);
                        if let Ok(peer) = stream.peer_addr() {
                            if let Err(e) = secret.check_exposure(&[peer.ip()]) {
                                return Err(HandshakeError::Exposed(e.to_string()));
                            }
                        }
                        let session = auth::connect(&mut stream, &secret).await?;
                        Ok((stream, session))
                    },
                    Instant::now() + self.op_timeout,
                )
                .map_err(|e| match e {
                    CallError::Timeout => self
                        .connection_error(format!("connect timed out after {:?}", self.op_timeout)),
                    CallError::Shutdown => StoreError::Closed,
                })?;
        let (stream, session) = connected.map_err(|e| match e {
            HandshakeError::Refused(why) => StoreError::Unauthorized {
                endpoint: self.endpoint.clone(),
                reason: why.to_string(),
            },
            HandshakeError::Exposed(why) => StoreError::Backend {
                op: "connect",
                reason: why,
            },
            other => self.connection_error(other.to_string()),
        })?;
        let _ = stream.set_nodelay(true);
        let handle = self.rt.handle().ok_or(StoreError::Closed)?;
        let session = Arc::new(session);
        let (mut rd, mut wr) = stream.into_split();
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(256);
        let pending: Pending = Arc::default();
        let broken = Arc::new(AtomicBool::new(false));
        {
            let broken = broken.clone();
            let session = session.clone();
            handle.spawn(async move {
                let mut seq = 0u64;
                while let Some(body) = rx.recv().await {
                    let frame = auth::seal_frame(&session, Direction::Request, seq, &body);
                    seq += 1;
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
                let mut seq = 0u64;
                loop {
                    let body = match auth::read_frame(
                        &mut rd,
                        &session,
                        Direction::Response,
                        seq,
                        MAX_FRAME,
                    )
                    .await
                    {
                        Ok(b) => b,
                        Err(auth::FrameError::Io(_)) => break,
                        Err(e) => {
                            tracing::warn!(reason = %e, "embedded store client: dropping the connection");
                            break;
                        }
                    };
                    seq += 1;
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
                // An answer this late says the connection is stuck: the next request makes a
                // new one.
                conn.broken.store(true, Ordering::Release);
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
    use super::super::{ServerError, TcpStoreServer};
    use super::*;

    fn secret() -> JobSecret {
        JobSecret::new("client tests").unwrap()
    }

    fn server() -> TcpStoreServer {
        TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret()).unwrap()
    }

    fn client(s: &TcpStoreServer) -> TcpStoreClient {
        TcpStoreClient::connect(&s.local_addr().to_string(), &secret()).unwrap()
    }

    #[test]
    fn conforms() {
        let s = server();
        rekindle_runtime::store::testing::conformance(Arc::new(client(&s))).unwrap();
    }

    #[test]
    fn two_clients_see_each_other_and_wait_is_woken() {
        let s = server();
        let a = client(&s);
        let b = Arc::new(client(&s));
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
            let c = TcpStoreClient::connect(&addr, &secret()).unwrap();
            c.set("k", b"v").unwrap();
            assert_eq!(c.get("k").unwrap(), Some(b"v".to_vec()));
            drop(c);
        });
    }

    #[test]
    fn server_gone_is_a_connection_error() {
        let s = server();
        let addr = s.local_addr().to_string();
        let c =
            TcpStoreClient::connect_with_timeout(&addr, &secret(), Duration::from_secs(2)).unwrap();
        c.set("k", b"v").unwrap();
        drop(s);
        let err = c.get("k").unwrap_err();
        assert!(matches!(err, StoreError::Connection { .. }), "{err:?}");
    }

    #[test]
    fn bind_in_use_is_an_error() {
        let s = server();
        let err = TcpStoreServer::bind(s.local_addr(), &secret()).unwrap_err();
        assert!(err.to_string().contains("cannot bind"), "{err}");
    }

    #[test]
    fn a_client_with_another_secret_is_unauthorized() {
        let s = server();
        let other = JobSecret::new("not the job's").unwrap();
        let err = TcpStoreClient::connect(&s.local_addr().to_string(), &other).unwrap_err();
        assert!(matches!(err, StoreError::Unauthorized { .. }), "{err:?}");
        // The server counts the refusal as it closes, just after answering.
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.refused_connections() != 1 {
            assert!(Instant::now() < deadline, "the refusal was not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_default_secret_is_refused_off_loopback() {
        let err = TcpStoreServer::bind(
            "0.0.0.0:0".parse().unwrap(),
            &JobSecret::default_single_host(),
        )
        .unwrap_err();
        assert!(matches!(err, ServerError::Secret { .. }), "{err}");
        assert!(err.to_string().contains("REKINDLE_SECRET_FILE"), "{err}");
        let s = TcpStoreServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            &JobSecret::default_single_host(),
        )
        .unwrap();
        let c = TcpStoreClient::connect(
            &s.local_addr().to_string(),
            &JobSecret::default_single_host(),
        )
        .unwrap();
        c.set("k", b"v").unwrap();
    }
}
