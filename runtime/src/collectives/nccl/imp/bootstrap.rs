//! Forming a communicator over the store, and cleaning up after a round that failed.
//!
//! Rank 0 creates the NCCL unique id and sets it in the store under
//! `<group prefix>nccl/unique_id`; the others wait for it within the bootstrap deadline. A new
//! round uses a new prefix, so a rebuilt group never reads a stale id.
//!
//! `ncclGetUniqueId` starts NCCL's bootstrap root: a detached thread and a listening socket
//! in rank 0's process, which end only once every rank of the communicator has checked in. When
//! a round fails before that (a rank died, the deadline passed, the group was aborted), they
//! would stay for the life of the process, one pair per failed round. [`release_root`] ends
//! them: it connects to the root as a rank would and sends a check-in the root refuses, after
//! which the root closes its socket and its thread returns. The unique id holds the root's
//! address and the handshake magic (NCCL's `ncclBootstrapHandle`: a `uint64_t` magic then a
//! `sockaddr_in`/`sockaddr_in6`, the layout of every release since 2.16).

use std::ffi::c_int;
use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream};
use std::time::{Duration, Instant};

use super::library::NcclLib;
use super::sys::{UniqueId, SUCCESS, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use crate::process_group::GroupConfig;

/// The store key, under the group prefix, of the NCCL unique id.
pub(crate) const UNIQUE_ID_KEY: &str = "nccl/unique_id";

/// NCCL's `ncclSocketTypeBootstrap`, sent in the socket handshake.
const SOCKET_TYPE_BOOTSTRAP: i32 = 1;

/// The first NCCL whose root checks a rank's index before using it (2.30.3): a check-in with
/// rank -1 ends it cleanly. Older roots are ended by a message longer than any check-in,
/// which leaves the root's accepted socket open (one descriptor per released root).
const CLEAN_RELEASE_VERSION: c_int = 23003;

/// How long [`release_root`] may take to connect and send.
pub(crate) const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Rank 0 creates the unique id and publishes it; the others wait for it until `deadline`.
/// On rank 0 an id that could not be published is released before the error is returned.
pub(crate) fn unique_id(
    config: &GroupConfig,
    lib: &NcclLib,
    deadline: Instant,
) -> Result<UniqueId> {
    if config.rank == 0 {
        let key = format!("{}{UNIQUE_ID_KEY}", config.prefix());
        let mut id = UniqueId::zeroed();
        // SAFETY: ncclGetUniqueId writes one ncclUniqueId.
        let status = unsafe { (lib.get_unique_id)(&mut id) };
        if status != SUCCESS {
            return Err(Error::Nccl {
                rank: config.rank,
                message: format!("ncclGetUniqueId: {}", lib.status_name(status)),
            });
        }
        if let Err(e) = config.store.set(&key, &id.to_bytes()) {
            release(&id, lib.version);
            return Err(e.into());
        }
        Ok(id)
    } else {
        fetch_unique_id(config, deadline)
    }
}

/// Waits until `deadline` for the unique id rank 0 publishes under this group's prefix; an
/// id of another round or generation (another prefix) is never read.
pub(crate) fn fetch_unique_id(config: &GroupConfig, deadline: Instant) -> Result<UniqueId> {
    let key = format!("{}{UNIQUE_ID_KEY}", config.prefix());
    let bootstrap = |reason: String| Error::Bootstrap {
        rank: config.rank,
        prefix: config.prefix(),
        reason,
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let values = config
        .store
        .wait(&[key.as_str()], left)
        .map_err(|e| match e {
            crate::store::StoreError::Timeout { .. } => bootstrap(format!(
                "rank 0 did not publish the NCCL unique id ({key}) within {:?}: {e}",
                config.bootstrap_timeout
            )),
            other => Error::Store(other),
        })?;
    let bytes = values.into_iter().next().unwrap_or_default();
    UniqueId::from_bytes(&bytes).ok_or_else(|| {
        bootstrap(format!(
            "{key} holds {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL unique id",
            bytes.len()
        ))
    })
}

/// Releases the root of `id` (see [`release_root`]), logging the outcome.
pub(crate) fn release(id: &UniqueId, version: c_int) {
    let Some(root) = root_of(id) else {
        tracing::warn!("the NCCL unique id holds no root address; its bootstrap root is left");
        return;
    };
    match release_root(&root, version, RELEASE_TIMEOUT) {
        Ok(()) => tracing::debug!(root = %root.addr, "released the NCCL bootstrap root"),
        Err(e) => tracing::debug!(root = %root.addr, "NCCL bootstrap root not released: {e}"),
    }
}

/// Where NCCL's bootstrap root of a unique id listens, and its handshake magic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Root {
    /// The magic every bootstrap connection starts with.
    pub magic: u64,
    /// The root's listening address.
    pub addr: SocketAddr,
}

/// Reads the root out of a unique id; `None` when the id holds no IPv4 or IPv6 address (an id
/// from `NCCL_COMM_ID`, or a layout this code does not know).
pub(crate) fn root_of(id: &UniqueId) -> Option<Root> {
    const AF_INET: u16 = 2;
    const AF_INET6: u16 = 10;
    let b = id.to_bytes();
    let magic = u64::from_ne_bytes(b[0..8].try_into().ok()?);
    let sa = &b[8..];
    let family = u16::from_ne_bytes([sa[0], sa[1]]);
    let port = u16::from_be_bytes([sa[2], sa[3]]);
    let addr = match family {
        AF_INET => {
            let ip: [u8; 4] = sa[4..8].try_into().ok()?;
            SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port))
        }
        AF_INET6 => {
            let flow = u32::from_be_bytes(sa[4..8].try_into().ok()?);
            let ip: [u8; 16] = sa[8..24].try_into().ok()?;
            let scope = u32::from_ne_bytes(sa[24..28].try_into().ok()?);
            SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, flow, scope))
        }
        _ => return None,
    };
    (port != 0).then_some(Root { magic, addr })
}

/// The bytes that end a root of NCCL `version` once connected: the socket handshake (magic,
/// socket type) then a check-in the root refuses (see [`CLEAN_RELEASE_VERSION`]).
pub(crate) fn release_message(magic: u64, version: c_int) -> Vec<u8> {
    let mut out = Vec::with_capacity(36);
    out.extend_from_slice(&magic.to_ne_bytes());
    out.extend_from_slice(&SOCKET_TYPE_BOOTSTRAP.to_ne_bytes());
    if version >= CLEAN_RELEASE_VERSION {
        // A 20-byte check-in: rank -1 of 1 rank, root 0 of 1, offset 0. The root reads the
        // five leading ints of its `extInfo`, finds rank -1 out of range, closes and returns.
        out.extend_from_slice(&20i32.to_ne_bytes());
        for v in [-1i32, 1, 0, 1, 0] {
            out.extend_from_slice(&v.to_ne_bytes());
        }
    } else {
        // A length above any check-in's: the root reports a truncated message and returns.
        out.extend_from_slice(&i32::MAX.to_ne_bytes());
    }
    out
}

/// Connects to `root` and sends [`release_message`], within `timeout`. An error means the
/// root could not be reached (it already ended, for one) or the send failed.
pub(crate) fn release_root(root: &Root, version: c_int, timeout: Duration) -> std::io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&root.addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(&release_message(root.magic, version))?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    /// A unique id laid out as NCCL's `ncclBootstrapHandle` for `addr`.
    fn id_for(magic: u64, addr: SocketAddr) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..8].copy_from_slice(&magic.to_ne_bytes());
        match addr {
            SocketAddr::V4(a) => {
                b[8..10].copy_from_slice(&2u16.to_ne_bytes());
                b[10..12].copy_from_slice(&a.port().to_be_bytes());
                b[12..16].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[8..10].copy_from_slice(&10u16.to_ne_bytes());
                b[10..12].copy_from_slice(&a.port().to_be_bytes());
                b[12..16].copy_from_slice(&a.flowinfo().to_be_bytes());
                b[16..32].copy_from_slice(&a.ip().octets());
                b[32..36].copy_from_slice(&a.scope_id().to_ne_bytes());
            }
        }
        UniqueId::from_bytes(&b).unwrap()
    }

    #[test]
    fn the_root_is_read_out_of_the_unique_id() {
        let v4: SocketAddr = "10.1.2.3:41000".parse().unwrap();
        let v6: SocketAddr = "[fe80::1:2]:5000".parse().unwrap();
        for addr in [v4, v6] {
            let root = root_of(&id_for(0xfeed_beef_0123_4567, addr)).unwrap();
            assert_eq!(root.addr, addr);
            assert_eq!(root.magic, 0xfeed_beef_0123_4567);
        }
        assert_eq!(root_of(&UniqueId::zeroed()), None, "no family");
        let mut b = id_for(1, v4).to_bytes();
        b[10] = 0;
        b[11] = 0;
        assert_eq!(root_of(&UniqueId::from_bytes(&b).unwrap()), None, "port 0");
    }

    fn ints(bytes: &[u8]) -> Vec<i32> {
        bytes
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn release_messages_follow_the_root_protocol_of_each_version() {
        let magic = 0x0102_0304_0506_0708u64;
        let new = release_message(magic, 23003);
        assert_eq!(new[..8], magic.to_ne_bytes());
        assert_eq!(ints(&new[8..]), vec![1, 20, -1, 1, 0, 1, 0]);
        let old = release_message(magic, 22105);
        assert_eq!(old[..8], magic.to_ne_bytes());
        assert_eq!(ints(&old[8..]), vec![1, i32::MAX]);
    }

    #[test]
    fn a_release_reaches_a_listening_root() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let root = root_of(&id_for(77, listener.local_addr().unwrap())).unwrap();
        release_root(&root, 23007, Duration::from_secs(5)).unwrap();
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        conn.read_to_end(&mut got).unwrap();
        assert_eq!(got, release_message(77, 23007));
    }

    /// The names of this process's threads.
    fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .map(|n| n.trim().to_string())
            .collect()
    }

    fn roots_running() -> usize {
        thread_names()
            .iter()
            .filter(|n| n.starts_with("NCCL Bootstrap"))
            .count()
    }

    /// Runs where an NCCL library loads (`ncclGetUniqueId` needs no GPU): a real root is
    /// started, found listening, released, and then gone. NCCL names its threads only with
    /// `NCCL_SET_THREAD_NAME=1`; with it, the root's thread is checked too.
    #[test]
    fn a_real_nccl_root_is_released_thread_and_port() {
        let lib = match super::super::library::nccl() {
            Ok(lib) => lib,
            Err(e) => {
                eprintln!("not run: {e}");
                return;
            }
        };
        let named = std::env::var("NCCL_SET_THREAD_NAME").is_ok_and(|v| v == "1");
        // Both release messages: this library's, and the one for roots older than 2.30.3
        // (which every root since 2.16 also refuses).
        for version in [lib.version, CLEAN_RELEASE_VERSION - 1] {
            let before = roots_running();
            let mut id = UniqueId::zeroed();
            // SAFETY: writes one ncclUniqueId.
            let status = unsafe { (lib.get_unique_id)(&mut id) };
            assert_eq!(status, SUCCESS, "{}", lib.status_name(status));
            let root = root_of(&id).expect("an address in the unique id");
            drop(TcpStream::connect_timeout(&root.addr, Duration::from_secs(5)).expect("listens"));
            if named {
                assert!(roots_running() > before, "{:?}", thread_names());
            }
            release(&id, version);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let port_closed =
                    TcpStream::connect_timeout(&root.addr, Duration::from_secs(1)).is_err();
                if port_closed && (!named || roots_running() == before) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "release for NCCL {version}: the root still runs: port closed \
                     {port_closed}, threads {:?}",
                    thread_names()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn config(
        rank: usize,
        round: u64,
        store: std::sync::Arc<crate::store::InMemoryStore>,
    ) -> GroupConfig {
        let mut cfg = GroupConfig::new("nccl-bootstrap", round, rank, 2, store).unwrap();
        cfg.bootstrap_timeout = Duration::from_millis(300);
        cfg
    }

    #[test]
    fn each_round_reads_only_its_own_unique_id() {
        use crate::store::Store;
        let store = std::sync::Arc::new(crate::store::InMemoryStore::new());
        let mut id = UniqueId::zeroed();
        id.internal[0] = 42;
        let round3 = format!("{}{UNIQUE_ID_KEY}", config(0, 3, store.clone()).prefix());
        store.set(&round3, &id.to_bytes()).unwrap();
        let soon = || Instant::now() + Duration::from_millis(300);
        let got = fetch_unique_id(&config(1, 3, store.clone()), soon()).unwrap();
        assert_eq!(got.internal[0], 42);
        // Round 4 (or generation 4 of the loop's encoding) finds nothing: a timeout, not
        // round 3's stale id.
        let err = fetch_unique_id(&config(1, 4, store.clone()), soon()).unwrap_err();
        assert!(matches!(err, Error::Bootstrap { rank: 1, .. }), "{err}");
        store.set(&round3.replace("/3/", "/4/"), b"short").unwrap();
        let err = fetch_unique_id(&config(1, 4, store), soon()).unwrap_err();
        assert!(err.to_string().contains("5 bytes"), "{err}");
    }

    #[test]
    fn releasing_a_root_that_is_gone_is_an_error_not_a_hang() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let started = Instant::now();
        let root = root_of(&id_for(1, addr)).unwrap();
        assert!(release_root(&root, 23007, Duration::from_secs(2)).is_err());
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
