//! The TCP backend: rekindle's CPU collectives, the role Gloo plays for PyTorch.
//!
//! Forming a group ([`TcpBackend::new`]): each rank listens on an ephemeral port, publishes its
//! address in the store under the group's (job, round) prefix, and connects to every other rank
//! (`bootstrap`); every connection is authenticated with the job secret (`handshake`), and
//! every frame after that is sealed with keys from the handshake (`seal`, `wire`). Pairs on one
//! host move bytes through shared-memory rings (`shm`). Operations are then queued to one
//! worker thread per group, which runs them in issue order: `algorithms` turns each into a
//! `plan` of lanes, which the `engine` runs, moving bytes with the `pump`s over each peer's
//! `transport`; liveness travels on separate control connections (`control`).
//!
//! Failure semantics: a peer whose process dies closes its sockets, which every rank's engine
//! watches (even sockets the current operation does not use), so in-flight and queued
//! operations fail with [`Error::PeerLost`] naming it as soon as the kernel reports the close;
//! a hung peer is caught by the operation deadline ([`Error::Timeout`]); [`Backend::abort`]
//! shuts every socket down, which wakes the worker at once.

mod algorithms;
mod bootstrap;
mod control;
mod engine;
mod handshake;
mod link;
mod plan;
mod pump;
mod seal;
mod shm;
mod sigbus;
mod transport;
mod wire;
mod write_mode;

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub use seal::{WireMode, WIRE_ENV};

use crate::collectives::{Backend, Collective, Work, WorkSender};
use crate::error::{Error, Result};
use crate::process_group::GroupConfig;

/// Tuning knobs of the TCP backend.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// The address to listen on (default 127.0.0.1; use the node's address, or 0.0.0.0 with
    /// `advertise_addr`, for multi-node groups).
    pub bind_addr: IpAddr,
    /// The address peers connect to, if not `bind_addr` (default: `bind_addr`, or 127.0.0.1
    /// when that is unspecified).
    pub advertise_addr: Option<IpAddr>,
    /// The largest chunk an algorithm moves as a unit; ring and chain algorithms pipeline
    /// chunks. Small values exercise many chunks in tests. Default 256 KiB.
    pub max_segment_bytes: usize,
    /// All-reduces up to this many bytes use the latency-optimised direct algorithm.
    /// Default 32 KiB.
    pub small_message_bytes: usize,
    /// Socket send/receive buffer size to ask the kernel for, for the data and control
    /// connections (`None`: the kernel's default).
    pub socket_buffer_bytes: Option<usize>,
    /// Every rank sends a heartbeat on its control connections this often, from its own
    /// thread, so that when an operation times out the rank that went silent (a stopped or
    /// wedged process) is named rather than the live ranks blocked behind it. Default 100 ms.
    pub heartbeat_interval: Duration,
    /// Move bytes between ranks on the same host through shared-memory rings (the pair's TCP
    /// connections then carry only doorbells and liveness). Pairs on different hosts always
    /// use TCP. Default true.
    pub shared_memory: bool,
    /// Bytes of each shared-memory ring (one per direction of a pair). Default 4 MiB; a
    /// group of n local ranks needs `2 n (n - 1)` rings in `shm_dir` while it forms.
    pub shm_ring_bytes: usize,
    /// The directory the ring files are created in (a tmpfs). Every rank of a host must use
    /// the same one. Default `/dev/shm`.
    pub shm_dir: PathBuf,
    /// How frames after the handshake are protected; every rank must use the same mode.
    /// `None` (the default): the mode named by `REKINDLE_WIRE` (`mac` or `encrypt`) if set,
    /// else [`WireMode::Mac`].
    pub wire: Option<WireMode>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            bind_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            advertise_addr: None,
            max_segment_bytes: 256 * 1024,
            small_message_bytes: 32 * 1024,
            socket_buffer_bytes: None,
            heartbeat_interval: Duration::from_millis(100),
            shared_memory: true,
            shm_ring_bytes: 4 << 20,
            shm_dir: PathBuf::from("/dev/shm"),
            wire: None,
        }
    }
}

/// What a pair of ranks moves its bytes over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerTransport {
    /// Shared-memory rings (same host).
    SharedMemory,
    /// The TCP data connection, and why not shared memory (another host, shared memory off,
    /// or a problem this rank also logged as a warning, such as a full ring directory).
    Tcp {
        /// Why the pair does not use shared memory.
        why: String,
    },
}

struct Job {
    op: Collective,
    done: WorkSender,
}

struct Shared {
    rank: usize,
    aborted: Arc<AtomicBool>,
    error: Mutex<Option<Error>>,
    /// Second handles on every socket, so `abort` can shut them down under the worker.
    sockets: Vec<TcpStream>,
    /// The sending halves of the control connections, for heartbeats and notices.
    control: control::ControlLinks,
}

impl Shared {
    fn error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_error(&self, e: &Error) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e.clone());
        }
    }

    fn shutdown(&self) {
        self.aborted.store(true, Ordering::Release);
        for s in &self.sockets {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The TCP backend. See the module docs for how it forms, runs and fails.
pub struct TcpBackend {
    rank: usize,
    world: usize,
    queue: Option<mpsc::Sender<Job>>,
    /// Signalled when the worker has said goodbye and exited.
    exited: Mutex<mpsc::Receiver<()>>,
    shared: Arc<Shared>,
    refused: usize,
    transports: Vec<(usize, PeerTransport)>,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl TcpBackend {
    /// Forms the group: blocks until every rank is connected and authenticated, or fails with
    /// [`Error::Bootstrap`] at the config's bootstrap deadline.
    pub fn new(config: GroupConfig, options: TcpOptions) -> Result<Self> {
        config.validate()?;
        let invalid = |reason: String| Error::InvalidArgument {
            op: "tcp backend",
            reason,
        };
        if options.max_segment_bytes == 0 {
            return Err(invalid("max_segment_bytes must be positive".into()));
        }
        if options.shared_memory && !(64..=1 << 30).contains(&options.shm_ring_bytes) {
            return Err(invalid(format!(
                "shm_ring_bytes must be between 64 bytes and 1 GiB, not {}",
                options.shm_ring_bytes
            )));
        }
        let wire = match options.wire {
            Some(w) => w,
            None => WireMode::from_env()?.unwrap_or_default(),
        };
        let (rank, world) = (config.rank, config.world_size);
        let (links, refused) = bootstrap::form_mesh(&config, &options, wire)?;
        let transports = links
            .iter()
            .enumerate()
            .filter_map(|(p, l)| Some((p, l.as_ref()?.transport.clone())))
            .collect();
        let sockets = links
            .iter()
            .flatten()
            .flat_map(|l| [l.data.try_clone(), l.ctrl.try_clone()])
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::io("cloning socket handles", &e))?;
        let aborted = Arc::new(AtomicBool::new(false));
        let control: control::ControlLinks = Arc::new(Mutex::new(Vec::new()));
        let silence = options.heartbeat_interval * 5;
        let mesh = engine::Mesh::new(
            rank,
            world,
            links,
            aborted.clone(),
            control.clone(),
            silence,
        )?;
        let shared = Arc::new(Shared {
            rank,
            aborted,
            error: Mutex::new(None),
            sockets,
            control,
        });
        let (queue, jobs) = mpsc::channel::<Job>();
        let (exited_tx, exited) = mpsc::sync_channel::<()>(1);
        let (stop_heartbeat, heartbeat_stopped) = mpsc::channel::<()>();
        let hb_shared = shared.clone();
        let interval = options.heartbeat_interval;
        std::thread::Builder::new()
            .name(format!("rekindle-heartbeat-{rank}"))
            .spawn(move || heartbeat(hb_shared, heartbeat_stopped, interval))
            .map_err(|e| Error::io("spawning the heartbeat thread", &e))?;
        let worker_shared = shared.clone();
        let op_timeout = config.op_timeout;
        std::thread::Builder::new()
            .name(format!("rekindle-tcp-{rank}"))
            .spawn(move || {
                worker(mesh, jobs, worker_shared, options, op_timeout);
                drop(stop_heartbeat);
                let _ = exited_tx.send(());
            })
            .map_err(|e| Error::io("spawning the collective worker", &e))?;
        Ok(TcpBackend {
            rank,
            world,
            queue: Some(queue),
            exited: Mutex::new(exited),
            shared,
            refused,
            transports,
        })
    }

    /// How many incoming connections the handshake refused while the group formed (wrong
    /// secret, job, round or rank).
    pub fn refused_connections(&self) -> usize {
        self.refused
    }

    /// What this rank moves bytes to each peer over, in rank order (this rank left out).
    pub fn peer_transports(&self) -> &[(usize, PeerTransport)] {
        &self.transports
    }
}

/// Sends a heartbeat every `interval` until the worker exits (the stop channel closes) or the
/// group is aborted.
fn heartbeat(shared: Arc<Shared>, stop: mpsc::Receiver<()>, interval: Duration) {
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(interval) {
        if shared.aborted.load(Ordering::Acquire) {
            return;
        }
        control::broadcast(&shared.control, wire::Control::Heartbeat);
    }
}

/// How long the idle worker checks its queue before it sleeps: operations issued back to back
/// (a barrier, then a small all-reduce) then start without a thread wake-up.
const IDLE_SPIN: Duration = Duration::from_micros(200);

fn next_job(jobs: &mpsc::Receiver<Job>) -> Option<Job> {
    let start = Instant::now();
    while start.elapsed() < IDLE_SPIN {
        match jobs.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    jobs.recv().ok()
}

fn worker(
    mut mesh: engine::Mesh,
    jobs: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
    options: TcpOptions,
    op_timeout: Duration,
) {
    while let Some(job) = next_job(&jobs) {
        let rank = shared.rank;
        if shared.aborted.load(Ordering::Acquire) {
            job.done.complete(Err(Error::Aborted { rank }));
            continue;
        }
        if let Some(cause) = shared.error() {
            job.done.complete(Err(Error::GroupBroken {
                rank,
                cause: Box::new(cause),
            }));
            continue;
        }
        let deadline = Instant::now() + op_timeout;
        let result = algorithms::execute(&mut mesh, &options, job.op, deadline);
        if let Err(e) = &result {
            // Argument errors are found before anything is sent: the group stays usable.
            if !matches!(e, Error::InvalidArgument { .. }) {
                tracing::warn!(rank, "collective failed: {e}");
                shared.set_error(e);
                let (lost, cause) = match e {
                    Error::PeerLost { peer, .. } => (Some(*peer), wire::Cause::Lost),
                    Error::Timeout { waiting_on, .. } => {
                        (waiting_on.first().copied(), wire::Cause::Timeout)
                    }
                    Error::Mismatch { peer, .. } => (Some(*peer), wire::Cause::Mismatch),
                    _ => (None, wire::Cause::Other),
                };
                mesh.notify_failure(lost, cause);
            }
        }
        job.done.complete(result);
    }
    if !shared.aborted.load(Ordering::Acquire) {
        mesh.goodbye();
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn submit(&self, op: Collective) -> Work {
        let name = op.name();
        if self.shared.aborted.load(Ordering::Acquire) {
            return Work::ready(name, self.rank, Err(Error::Aborted { rank: self.rank }));
        }
        let (work, done) = Work::pending(name, self.rank);
        let job = Job { op, done };
        let unsent = match &self.queue {
            Some(q) => q.send(job).err().map(|mpsc::SendError(job)| job),
            None => Some(job),
        };
        if let Some(job) = unsent {
            job.done.complete(Err(Error::Aborted { rank: self.rank }));
        }
        work
    }

    fn abort(&self) {
        tracing::info!(rank = self.rank, "aborting the process group");
        self.shared.set_error(&Error::Aborted { rank: self.rank });
        self.shared.shutdown();
    }

    fn error(&self) -> Option<Error> {
        self.shared.error()
    }
}

/// How long dropping a backend waits for its worker to finish queued operations and say
/// goodbye to the peers.
const DROP_GRACE: Duration = Duration::from_secs(2);

impl Drop for TcpBackend {
    fn drop(&mut self) {
        // An orderly leave: the worker finishes what is queued, tells every peer goodbye (so
        // they do not take this rank for dead) and exits. If that takes longer than the grace
        // period, the sockets are shut down, which ends it at once.
        drop(self.queue.take());
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        if exited.recv_timeout(DROP_GRACE).is_err() {
            self.shared.shutdown();
        }
    }
}
