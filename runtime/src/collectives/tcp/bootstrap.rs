//! Forming the mesh: every rank listens on port 0, publishes its address under the group's
//! (job, round) prefix, connects to every lower rank and accepts every higher one.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::handshake::{self, Channel, Identity};
use super::seal::{Keys, WireMode};
use super::shm::{self, Negotiated, ShmPair};
use super::{PeerTransport, TcpOptions};
use crate::error::{Error, Result};
use crate::process_group::GroupConfig;
use crate::store::{PrefixStore, Store};

/// The two authenticated connections to one peer.
pub(crate) struct PeerLinks {
    /// Operation bytes (only doorbells when `shm` is set).
    pub data: TcpStream,
    /// Liveness notices.
    pub ctrl: TcpStream,
    /// Shared-memory rings, for a peer on this host.
    pub shm: Option<ShmPair>,
    /// The data connection's frame keys.
    pub data_keys: Keys,
    /// The control connection's frame keys.
    pub ctrl_keys: Keys,
    /// What the pair moves bytes over, and why.
    pub transport: PeerTransport,
}

/// The connected peers; `None` at this rank's own index.
pub(crate) type Peers = Vec<Option<PeerLinks>>;

/// One authenticated connection and its frame keys.
type Conn = (TcpStream, Keys);
type Slots = Vec<[Option<Conn>; 2]>;
type Rings = Vec<Option<(Option<ShmPair>, PeerTransport)>>;

/// After the data connection's handshake, both sides negotiate shared-memory rings on it
/// (within a handshake timeout, which bounds how long a ring file exists before it is
/// unlinked).
fn negotiate(
    (s, keys): &mut Conn,
    me: usize,
    peer: usize,
    opts: &TcpOptions,
    deadline: Instant,
) -> std::result::Result<(Option<ShmPair>, PeerTransport), String> {
    let left = deadline
        .min(Instant::now() + HANDSHAKE_TIMEOUT)
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).ok();
    s.set_write_timeout(Some(left)).ok();
    let dir = opts.shared_memory.then_some(opts.shm_dir.as_path());
    let r = shm::negotiate(s, keys, dir, opts.shm_ring_bytes.div_ceil(8) * 8)
        .map_err(|e| format!("negotiating shared memory: {e}"));
    s.set_read_timeout(None).ok();
    s.set_write_timeout(None).ok();
    Ok(match r? {
        Negotiated::Rings(pair) => (Some(pair), PeerTransport::SharedMemory),
        Negotiated::Tcp { why, warn } => {
            if warn {
                tracing::warn!(
                    rank = me,
                    peer,
                    "shared memory with rank {peer} is unavailable, using TCP: {why}"
                );
            } else {
                tracing::debug!(rank = me, peer, "rank {peer} is reached over TCP: {why}");
            }
            (None, PeerTransport::Tcp { why })
        }
    })
}

/// How long one accepted connection may take to complete its handshake, so a silent stranger
/// cannot hold up the group for the whole bootstrap deadline.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Forms the mesh, sealing frames as `wire` says; also returns how many connections were
/// refused by the handshake.
pub(crate) fn form_mesh(
    cfg: &GroupConfig,
    opts: &TcpOptions,
    wire: WireMode,
) -> Result<(Peers, usize)> {
    let deadline = Instant::now() + cfg.bootstrap_timeout;
    let (rank, world) = (cfg.rank, cfg.world_size);
    let fail = |reason: String| Error::Bootstrap {
        rank,
        prefix: cfg.prefix(),
        reason,
    };
    let mut slots: Slots = (0..world).map(|_| [None, None]).collect();
    if world == 1 {
        return Ok(((0..world).map(|_| None).collect(), 0));
    }
    if opts.shared_memory {
        shm::sweep(&opts.shm_dir);
    }
    let listener = TcpListener::bind((opts.bind_addr, 0))
        .map_err(|e| fail(format!("binding {}:0: {e}", opts.bind_addr)))?;
    let port = listener
        .local_addr()
        .map_err(|e| fail(format!("reading the listening address: {e}")))?
        .port();
    let advertise = match opts.advertise_addr {
        Some(a) => a,
        None if opts.bind_addr.is_unspecified() => IpAddr::from([127, 0, 0, 1]),
        None => opts.bind_addr,
    };
    let store = PrefixStore::new(cfg.store.clone(), cfg.prefix());
    store
        .set(
            &format!("addr/{rank}"),
            SocketAddr::new(advertise, port).to_string().as_bytes(),
        )
        .map_err(|e| fail(format!("publishing the address: {e}")))?;

    // Accept the higher ranks on a thread while this one connects to the lower ranks.
    let accepted: Arc<Mutex<Slots>> =
        Arc::new(Mutex::new((0..world).map(|_| [None, None]).collect()));
    let rings: Arc<Mutex<Rings>> = Arc::new(Mutex::new((0..world).map(|_| None).collect()));
    let acceptor = {
        let accepted = accepted.clone();
        let rings = rings.clone();
        let opts = opts.clone();
        let (job, secret, round, wire) = (cfg.job.clone(), cfg.secret.clone(), cfg.round, wire);
        std::thread::Builder::new()
            .name(format!("rekindle-accept-{rank}"))
            .spawn(move || {
                let me = Identity {
                    job: &job,
                    round,
                    rank,
                    world,
                    secret: &secret,
                    wire,
                };
                accept_higher(listener, &me, &accepted, &rings, &opts, deadline)
            })
            .map_err(|e| fail(format!("spawning the acceptor: {e}")))?
    };

    let lower: Vec<String> = (0..rank).map(|p| format!("addr/{p}")).collect();
    let keys: Vec<&str> = lower.iter().map(String::as_str).collect();
    let connected = store
        .wait(&keys, deadline.saturating_duration_since(Instant::now()))
        .map_err(|e| fail(format!("waiting for the lower ranks' addresses: {e}")))
        .and_then(|addrs| {
            let me = Identity {
                job: &cfg.job,
                round: cfg.round,
                rank,
                world,
                secret: &cfg.secret,
                wire,
            };
            for (p, addr) in addrs.iter().enumerate() {
                let addr = String::from_utf8_lossy(addr).to_string();
                for channel in [Channel::Data, Channel::Control] {
                    let mut conn =
                        connect_lower(&addr, &me, p, channel, deadline).map_err(|reason| {
                            fail(format!("connecting to rank {p} at {addr}: {reason}"))
                        })?;
                    if channel == Channel::Data {
                        let ring = negotiate(&mut conn, rank, p, opts, deadline)
                            .map_err(|reason| fail(format!("rank {p}: {reason}")))?;
                        rings.lock().unwrap_or_else(|x| x.into_inner())[p] = Some(ring);
                    }
                    slots[p][channel as usize] = Some(conn);
                }
            }
            Ok(())
        });
    let accepted_result = acceptor
        .join()
        .unwrap_or_else(|_| Err("the acceptor thread panicked".into()));
    connected?;
    let refused = accepted_result.map_err(fail)?;
    let mut accepted = accepted.lock().unwrap_or_else(|p| p.into_inner());
    let mut rings = rings.lock().unwrap_or_else(|p| p.into_inner());
    let mut peers: Peers = Vec::with_capacity(world);
    for (p, (mine, theirs)) in slots.iter_mut().zip(accepted.iter_mut()).enumerate() {
        let take = |i: usize, mine: &mut [Option<Conn>; 2], theirs: &mut [Option<Conn>; 2]| {
            mine[i].take().or_else(|| theirs[i].take())
        };
        let data = take(0, mine, theirs);
        let ctrl = take(1, mine, theirs);
        match (data, ctrl, rings[p].take()) {
            (Some((data, data_keys)), Some((ctrl, ctrl_keys)), Some((shm, transport))) => {
                for s in [&data, &ctrl] {
                    s.set_nodelay(true)
                        .and_then(|_| s.set_nonblocking(true))
                        .map_err(|e| fail(format!("configuring the socket of rank {p}: {e}")))?;
                    if let Some(bytes) = opts.socket_buffer_bytes {
                        super::link::set_buffer_sizes(s, bytes);
                    }
                }
                peers.push(Some(PeerLinks {
                    data,
                    ctrl,
                    shm,
                    data_keys,
                    ctrl_keys,
                    transport,
                }));
            }
            _ if p == rank => peers.push(None),
            _ => return Err(fail(format!("rank {p} is not fully connected"))),
        }
    }
    Ok((peers, refused))
}

fn connect_lower(
    addr: &str,
    me: &Identity<'_>,
    target: usize,
    channel: Channel,
    deadline: Instant,
) -> std::result::Result<Conn, String> {
    let sock: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr:?} in the store: {e}"))?;
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("deadline passed".into());
        }
        match TcpStream::connect_timeout(&sock, left) {
            Ok(mut s) => {
                let keys = handshake::connect(&mut s, me, target, channel, deadline)?;
                return Ok((s, keys));
            }
            // The listener is bound before the address is published, so a refusal means the
            // peer's process is gone or restarting; retry until the deadline.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn accept_higher(
    listener: TcpListener,
    me: &Identity<'_>,
    accepted: &Mutex<Slots>,
    rings: &Mutex<Rings>,
    opts: &TcpOptions,
    deadline: Instant,
) -> std::result::Result<usize, String> {
    let expected = 2 * (me.world - me.rank - 1);
    let (mut have, mut refused) = (0, 0);
    if expected == 0 {
        return Ok(0);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    while have < expected {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let missing: Vec<usize> = {
                let a = accepted.lock().unwrap_or_else(|p| p.into_inner());
                (me.rank + 1..me.world)
                    .filter(|p| a[*p].iter().any(Option::is_none))
                    .collect()
            };
            return Err(format!(
                "ranks {missing:?} did not connect before the deadline"
            ));
        }
        if !super::link::wait_readable(&listener, left.min(Duration::from_millis(100))) {
            continue;
        }
        let (mut s, addr) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(format!("accept: {e}")),
        };
        if s.set_nonblocking(false).is_err() {
            continue;
        }
        let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let taken = |p: usize, c: Channel| {
            accepted.lock().unwrap_or_else(|x| x.into_inner())[p][c as usize].is_some()
        };
        match handshake::accept(&mut s, me, taken, hs_deadline) {
            Ok((p, c, keys)) => {
                let mut conn = (s, keys);
                if c == Channel::Data {
                    match negotiate(&mut conn, me.rank, p, opts, hs_deadline) {
                        Ok(ring) => rings.lock().unwrap_or_else(|x| x.into_inner())[p] = Some(ring),
                        Err(reason) => {
                            tracing::warn!(
                                rank = me.rank,
                                peer = p,
                                "dropped a connection: {reason}"
                            );
                            continue;
                        }
                    }
                }
                accepted.lock().unwrap_or_else(|x| x.into_inner())[p][c as usize] = Some(conn);
                have += 1;
            }
            Err(reason) => {
                refused += 1;
                tracing::warn!(
                    rank = me.rank,
                    job = me.job,
                    round = me.round,
                    peer_addr = %addr,
                    "refused a connection: {reason}"
                );
            }
        }
    }
    Ok(refused)
}
