//! A local stand-in for a store on another node: it accepts PyTorch's clients at once and
//! forwards their bytes to the real server as soon as it learns where that is.
//!
//! On nodes other than node 0 the agent starts its workers before node 0 has published its
//! server's address; the proxy lets it do so without waiting. A client's first bytes are kept
//! until the address is known (or the client leaves), then everything is copied both ways.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::TorchStoreError;
use crate::io_runtime::IoRuntime;

/// Looks the real server up, waiting at most the given time; `Err` says why it is not known
/// yet (it is retried while a client waits).
pub type Resolve = Arc<dyn Fn(Duration) -> Result<SocketAddr, String> + Send + Sync>;

/// How long one lookup may block before it is retried (a client that left meanwhile is
/// noticed between lookups).
const LOOKUP_SLICE: Duration = Duration::from_secs(2);

/// The most bytes kept from a client before the server is known (PyTorch's client sends 10
/// and then waits for an answer).
const MAX_EARLY_BYTES: usize = 64 << 10;

/// A forwarding endpoint for PyTorch's TCPStore clients. Serves until dropped; dropping it
/// closes every connection.
pub struct TorchStoreProxy {
    addr: SocketAddr,
    _rt: IoRuntime,
}

impl std::fmt::Debug for TorchStoreProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStoreProxy")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TorchStoreProxy {
    /// Listens on `addr` and forwards each connection to the server `resolve` finds. At most
    /// `max_connections` are served at once.
    pub fn bind(
        addr: SocketAddr,
        resolve: Resolve,
        max_connections: usize,
    ) -> Result<Self, TorchStoreError> {
        let bind_err = |source| TorchStoreError::Bind { addr, source };
        let std_listener = StdListener::bind(addr).map_err(bind_err)?;
        let local = std_listener.local_addr().map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let rt = IoRuntime::new("rekindle-torch-proxy", 1).map_err(TorchStoreError::Runtime)?;
        let handle = rt
            .handle()
            .ok_or_else(|| TorchStoreError::Runtime(std::io::Error::other("runtime gone")))?
            .clone();
        let listener = {
            let _guard = handle.enter();
            tokio::net::TcpListener::from_std(std_listener).map_err(bind_err)?
        };
        let upstream = Arc::new(tokio::sync::Mutex::new(None::<SocketAddr>));
        let conns = Arc::new(AtomicUsize::new(0));
        handle.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        if conns.load(Ordering::Acquire) >= max_connections {
                            continue;
                        }
                        conns.fetch_add(1, Ordering::AcqRel);
                        let _ = stream.set_nodelay(true);
                        let (upstream, resolve, conns) =
                            (upstream.clone(), resolve.clone(), conns.clone());
                        tokio::spawn(async move {
                            if let Err(e) = forward(stream, upstream, resolve).await {
                                tracing::debug!(error = %e, "PyTorch store proxy: connection ended");
                            }
                            conns.fetch_sub(1, Ordering::AcqRel);
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "PyTorch store proxy: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(TorchStoreProxy {
            addr: local,
            _rt: rt,
        })
    }

    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn forward(
    mut client: TcpStream,
    upstream: Arc<tokio::sync::Mutex<Option<SocketAddr>>>,
    resolve: Resolve,
) -> std::io::Result<()> {
    let mut early = Vec::new();
    let target = loop {
        // One lookup at a time; the others wait for its result.
        let mut known = tokio::select! {
            g = upstream.lock() => g,
            r = client.read_buf(&mut early) => {
                if r? == 0 || early.len() > MAX_EARLY_BYTES {
                    return Ok(());
                }
                continue;
            }
        };
        if let Some(a) = *known {
            break a;
        }
        let r = resolve.clone();
        let lookup = tokio::task::spawn_blocking(move || r(LOOKUP_SLICE));
        tokio::pin!(lookup);
        let found = loop {
            tokio::select! {
                res = &mut lookup => break res.map_err(std::io::Error::other)?,
                r = client.read_buf(&mut early) => {
                    if r? == 0 || early.len() > MAX_EARLY_BYTES {
                        return Ok(());
                    }
                }
            }
        };
        match found {
            Ok(a) => {
                *known = Some(a);
                break a;
            }
            Err(why) => {
                drop(known);
                tracing::debug!(%why, "PyTorch store proxy: server not known yet");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    r = client.read_buf(&mut early) => {
                        if r? == 0 || early.len() > MAX_EARLY_BYTES {
                            return Ok(());
                        }
                    }
                }
            }
        }
    };
    let mut server = TcpStream::connect(target).await?;
    let _ = server.set_nodelay(true);
    server.write_all(&early).await?;
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}
