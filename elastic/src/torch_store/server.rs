//! The TCPStore server: [`StoreState`] served over TCP on a tokio runtime of its own.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};

use super::protocol::{parse, Limits};
use super::state::{ConnId, Replies, StoreState};
use super::TorchStoreError;
use crate::io_runtime::IoRuntime;

/// How to reach a connection from another connection's task: its wake-up channel and a way
/// to close it.
struct Peer {
    wake: mpsc::Sender<Vec<u8>>,
    kill: Arc<Notify>,
}

struct Shared {
    state: Mutex<(StoreState, HashMap<ConnId, Peer>)>,
    limits: Limits,
    conns: AtomicUsize,
    next_id: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, (StoreState, HashMap<ConnId, Peer>)> {
        // A panic cannot leave the state half-updated in a way later requests would trip on
        // (each request is checked before it changes anything), so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A server of PyTorch's TCPStore protocol, for `init_process_group("env://")` under `rekindle
/// run`. It serves until dropped; dropping it closes every connection.
///
/// Its keys are its own: they share nothing with the job's rendezvous store. The protocol has
/// no authentication (PyTorch's own server has none either), so bind it to the narrowest
/// address the job allows.
///
/// ```
/// use rekindle_elastic::torch_store::{Limits, TorchStoreServer};
///
/// let server = TorchStoreServer::bind("127.0.0.1:0".parse().unwrap(), Limits::default()).unwrap();
/// assert_ne!(server.local_addr().port(), 0);
/// ```
pub struct TorchStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _rt: IoRuntime,
}

impl std::fmt::Debug for TorchStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TorchStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`TorchStoreServer::local_addr`]) and starts
    /// serving. An address in use is a [`TorchStoreError::Bind`].
    pub fn bind(addr: SocketAddr, limits: Limits) -> Result<Self, TorchStoreError> {
        let bind_err = |source| TorchStoreError::Bind { addr, source };
        let std_listener = StdListener::bind(addr).map_err(bind_err)?;
        let local = std_listener.local_addr().map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let rt = IoRuntime::new("rekindle-torch-store", 1).map_err(TorchStoreError::Runtime)?;
        let handle = rt
            .handle()
            .ok_or_else(|| TorchStoreError::Runtime(std::io::Error::other("runtime gone")))?
            .clone();
        let listener = {
            let _guard = handle.enter();
            tokio::net::TcpListener::from_std(std_listener).map_err(bind_err)?
        };
        let shared = Arc::new(Shared {
            state: Mutex::new((StoreState::new(limits.clone()), HashMap::new())),
            limits,
            conns: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        });
        let s = shared.clone();
        handle.spawn(async move {
            let mut refused_logged = false;
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        if s.conns.load(Ordering::Acquire) >= s.limits.max_connections {
                            if !refused_logged {
                                tracing::warn!(%peer, max = s.limits.max_connections,
                                    "PyTorch store: too many connections; closing new ones");
                                refused_logged = true;
                            }
                            drop(stream);
                            continue;
                        }
                        s.conns.fetch_add(1, Ordering::AcqRel);
                        let _ = stream.set_nodelay(true);
                        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
                        tokio::spawn(serve(stream, s.clone(), id));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "PyTorch store: accept failed");
                        // Out of file descriptors and similar: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(TorchStoreServer {
            addr: local,
            shared,
            _rt: rt,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The number of keys held (queues not counted).
    pub fn num_keys(&self) -> usize {
        self.shared.lock().0.len()
    }

    /// The number of connections being served.
    pub fn connections(&self) -> usize {
        self.shared.conns.load(Ordering::Acquire)
    }
}

/// Serves one connection until it closes, faults, or the server is dropped.
async fn serve(stream: TcpStream, shared: Arc<Shared>, id: ConnId) {
    let peer = stream.peer_addr().ok();
    let (mut rd, mut wr) = stream.into_split();
    // At most one wait is pending per connection, so one slot would do; a few more cost nothing.
    let (wake_tx, mut wake_rx) = mpsc::channel::<Vec<u8>>(8);
    let kill = Arc::new(Notify::new());
    shared.lock().1.insert(
        id,
        Peer {
            wake: wake_tx,
            kill: kill.clone(),
        },
    );
    let mut inbuf: Vec<u8> = Vec::with_capacity(4096);
    let mut start = 0usize;
    let mut out: Vec<u8> = Vec::new();
    'conn: loop {
        tokio::select! {
            r = rd.read_buf(&mut inbuf) => match r {
                Ok(0) | Err(_) => break 'conn,
                Ok(_) => {}
            },
            Some(bytes) = wake_rx.recv() => out.extend_from_slice(&bytes),
            _ = kill.notified() => break 'conn,
        }
        loop {
            let (cmd, used) = match parse(&inbuf[start..], &shared.limits) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(?peer, error = %e, "PyTorch store: closing a connection");
                    break 'conn;
                }
            };
            start += used;
            let mut replies: Replies = Vec::new();
            let fault = {
                let mut g = shared.lock();
                let (state, peers) = &mut *g;
                let r = state.apply(id, cmd, &mut replies);
                replies.retain(|(to, bytes)| {
                    if *to == id {
                        return true;
                    }
                    if let Some(p) = peers.get(to) {
                        if p.wake.try_send(bytes.clone()).is_err() {
                            // It does not read its answers: it cannot be served correctly.
                            p.kill.notify_one();
                        }
                    }
                    false
                });
                r.err()
            };
            // Wake-ups sent to this connection before this request was applied come first
            // (a wait satisfied just before its cancel is answered, then the cancel).
            while let Ok(bytes) = wake_rx.try_recv() {
                out.extend_from_slice(&bytes);
            }
            for (_, bytes) in replies {
                out.extend_from_slice(&bytes);
            }
            if let Some(f) = fault {
                tracing::warn!(?peer, error = %f, "PyTorch store: closing a connection");
                if !out.is_empty() {
                    let _ = wr.write_all(&out).await;
                }
                break 'conn;
            }
        }
        if start == inbuf.len() {
            inbuf.clear();
            start = 0;
        } else if start > inbuf.len() / 2 {
            inbuf.drain(..start);
            start = 0;
        }
        if !out.is_empty() {
            tokio::select! {
                r = wr.write_all(&out) => if r.is_err() { break 'conn },
                _ = kill.notified() => break 'conn,
            }
            out.clear();
        }
    }
    let mut g = shared.lock();
    g.0.disconnect(id);
    g.1.remove(&id);
    drop(g);
    shared.conns.fetch_sub(1, Ordering::AcqRel);
}
