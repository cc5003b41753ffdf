//! The NCCL backend: one communicator per group, owned by one worker thread.
//!
//! # Design
//! - **One worker thread** owns the CUDA context, the stream, the device scratch memory and the
//!   NCCL communicator: a communicator must not be used from two threads at once, NCCL and the
//!   copies need the context current on the calling thread, and `ncclCommAbort` is called
//!   there too. The thread executes the op queue in issue order, one op at a time, like a NCCL
//!   stream, and never blocks on a peer, so an abort reaches it within one poll.
//! - **Host buffers are staged** through device memory on that stream, via pinned host memory:
//!   upload, the NCCL call(s), download, each an asynchronous copy. With the `cuda` feature,
//!   candle CUDA tensors skip the staging: `NcclBackend::all_reduce_tensor` and its siblings
//!   hand NCCL the tensor's own device memory, ordered after candle's pending work by an event
//!   recorded on candle's stream.
//! - **Never blocking**: the communicator is created non-blocking (`blocking = 0`) and every
//!   wait polls `ncclCommGetAsyncError` and `cuStreamQuery` with short sleeps, bounded by the op
//!   deadline ([`GroupConfig::op_timeout`]) and the abort flag; scratch memory is allocated and
//!   freed in stream order. A dead or hung peer so ends in an error and `ncclCommAbort`, never
//!   a hang.
//! - **Bootstrap**: rank 0 creates the NCCL unique id and sets it in the store under
//!   `<group prefix>nccl/unique_id`; the others wait for it within
//!   [`GroupConfig::bootstrap_timeout`], which also bounds the non-blocking
//!   `ncclCommInitRankConfig`. The prefix is unique per [`GroupConfig::round`] (the elastic
//!   loop encodes round and generation in it), so a rebuilt group never reads a stale id: build
//!   a new backend for each (round, generation) and [`Backend::abort`] or drop the old one. When
//!   a round fails before every rank joined, rank 0 ends NCCL's bootstrap root thread and closes
//!   its port, which NCCL would otherwise keep for the life of the process.
//! - **Security**: NCCL's own bootstrap and transports are not authenticated; the job secret is
//!   not used by this backend, so NCCL groups rely on the cluster network being private.
//! - **Libraries**: NCCL and the CUDA driver are loaded at run time with `dlopen` (see
//!   [`NCCL_LIBRARY_ENV`]) through this module's own declarations of their C API: nothing is
//!   linked, so the backend builds without a toolkit, and shares a build and a process with
//!   candle's CUDA backend. A missing driver, device or library is an error from
//!   [`NcclBackend::new`], never a panic.
//!
//! Reductions are NCCL's: deterministic for a given world size and topology, but not
//! bit-identical to the TCP backend (NCCL's `avg` of floats pre-scales each input by 1/n).

mod bootstrap;
mod comm;
mod cuda;
mod driver;
mod library;
mod ops;
mod plan;
mod queue;
mod sys;
#[cfg(feature = "cuda")]
mod tensor;

use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::collectives::{Backend, Collective, Work};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::process_group::GroupConfig;

use comm::{Comm, Stop};
use cuda::Gpu;
use library::NcclLib;
use ops::Exec;
use queue::{Job, Queue};

pub use library::NCCL_LIBRARY_ENV;

/// How long [`Backend::abort`] waits for the worker to have aborted the communicator.
const ABORT_WAIT: Duration = Duration::from_millis(900);
/// How long a healthy communicator may take to finalise at shutdown before it is aborted.
const FINALIZE_GRACE: Duration = Duration::from_secs(2);
/// How long dropping the backend waits for the worker to finish its queue and shut down.
const DROP_WAIT: Duration = Duration::from_secs(3);
/// Extra time `new` gives the worker beyond the bootstrap deadline to report.
const INIT_SLACK: Duration = Duration::from_secs(5);
/// How long to wait for the stream to drain after an abort before leaking its memory.
const DRAIN_WAIT: Duration = Duration::from_millis(500);

/// The NCCL backend (behind the `nccl` feature): a [`Backend`] over one NCCL communicator on
/// one CUDA device. See the module documentation for how it stages host buffers, bounds every
/// wait and bootstraps through the store.
pub struct NcclBackend {
    rank: usize,
    world: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ordinal: usize,
    queue: Arc<Queue>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("error", &self.queue.error())
            .finish_non_exhaustive()
    }
}

impl NcclBackend {
    /// Forms the group on `device`: checks the driver, device and NCCL library, then rank 0
    /// publishes a fresh NCCL unique id under the group's store prefix, every rank creates its
    /// communicator (non-blocking) and waits for it, all within `config.bootstrap_timeout`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad config or a CPU device;
    /// [`Error::CudaUnavailable`] without a usable CUDA driver or device; [`Error::Nccl`] when
    /// the NCCL library cannot be loaded or the communicator fails; [`Error::Bootstrap`] when the
    /// unique id or the peers do not arrive in time; [`Error::Store`] for store failures.
    pub fn new(config: GroupConfig, device: Device) -> Result<Self> {
        config.validate()?;
        let rank = config.rank;
        let ordinal = match device {
            Device::Cuda(n) => n,
            Device::Cpu => {
                return Err(Error::InvalidArgument {
                    op: "nccl backend",
                    reason: "NCCL needs a CUDA device, not cpu".into(),
                })
            }
        };
        cuda::probe(ordinal)?;
        let lib = library::nccl().map_err(|message| Error::Nccl { rank, message })?;

        let queue = Arc::new(Queue::new(rank));
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let wait_for_init = config.bootstrap_timeout + INIT_SLACK;
        let (prefix, world) = (config.prefix(), config.world_size);
        let worker_queue = queue.clone();
        let worker = std::thread::Builder::new()
            .name(format!("rekindle-nccl-{rank}"))
            .spawn(move || worker_main(worker_queue, config, ordinal, lib, ready_tx))
            .map_err(|e| Error::io("spawning the NCCL worker thread", &e))?;

        match ready_rx.recv_timeout(wait_for_init) {
            Ok(Ok(())) => {
                tracing::info!(
                    rank,
                    world,
                    device = ordinal,
                    nccl = %lib.version_string(),
                    library = %lib.path,
                    "NCCL communicator ready"
                );
                Ok(NcclBackend {
                    rank,
                    world,
                    ordinal,
                    queue,
                    worker: Mutex::new(Some(worker)),
                })
            }
            Ok(Err(e)) => {
                // The worker released everything before reporting and is exiting.
                let _ = worker.join();
                Err(e)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                queue.raise_abort();
                Err(Error::Bootstrap {
                    rank,
                    prefix,
                    reason: format!("the NCCL communicator was not ready after {wait_for_init:?}"),
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = worker.join();
                Err(Error::Nccl {
                    rank,
                    message: "the NCCL worker thread stopped during initialisation".into(),
                })
            }
        }
    }

    /// True when several ranks of one communicator may share a GPU here: the NCCL library
    /// loads, is 2.30.3 or newer, and `NCCL_MULTI_RANK_GPU_ENABLE=1` is set (NCCL refuses
    /// such communicators otherwise). Does not touch CUDA.
    pub fn several_ranks_per_gpu() -> bool {
        let enabled = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
        enabled && library::nccl().is_ok_and(|lib| lib.version >= library::MULTI_RANK_GPU_VERSION)
    }

    /// The version of the NCCL library this process loads (for example `2.21.5`) and where it
    /// was loaded from; an [`Error::Nccl`] when it cannot be loaded. Does not touch CUDA.
    pub fn library_version() -> Result<(String, String)> {
        library::nccl()
            .map(|lib| (lib.version_string(), lib.path.clone()))
            .map_err(|message| Error::Nccl { rank: 0, message })
    }
}

#[cfg(feature = "cuda")]
impl NcclBackend {
    /// Queues an in-place device op on `t`, or fails its `Work` at once for a bad tensor.
    fn submit_in_place(
        &self,
        kind: tensor::Kind,
        name: &'static str,
        t: &candle_core::Tensor,
    ) -> Work {
        match tensor::prepare(kind, t, self.ordinal, self.world) {
            Ok((op, _)) => self.queue.submit(Job::Device(op)),
            Err(e) => Work::ready(name, self.rank, Err(e)),
        }
    }

    /// All-reduces a candle CUDA tensor in place, on the device: every rank ends with the
    /// reduction of all ranks' tensors (same shape and dtype everywhere). NCCL starts after the
    /// work candle has queued on the tensor's stream (an event, no host wait) and reads and
    /// writes the tensor's own memory. The tensor must be contiguous, on this group's device,
    /// of a dtype NCCL has (u8, u32, i32, i64, f16, bf16, f32, f64), and must not be used until
    /// the returned [`Work`] completed. Runs in issue order with the group's other ops, under
    /// the same deadline, abort and failure rules; a bad tensor fails the `Work` with
    /// [`Error::InvalidArgument`] and leaves the group usable.
    pub fn all_reduce_tensor(&self, tensor: &candle_core::Tensor, op: crate::ReduceOp) -> Work {
        self.submit_in_place(tensor::Kind::AllReduce(op), "all_reduce_tensor", tensor)
    }

    /// Broadcasts `root`'s CUDA tensor in place into every rank's tensor of the same shape and
    /// dtype, on the device; see [`NcclBackend::all_reduce_tensor`] for the rules.
    pub fn broadcast_tensor(&self, tensor: &candle_core::Tensor, root: usize) -> Work {
        self.submit_in_place(tensor::Kind::Broadcast(root), "broadcast_tensor", tensor)
    }

    /// All-gathers CUDA tensors of equal length into a new one-dimensional tensor of
    /// `world_size` times that length, in rank order, on the device. The output is returned at
    /// once and holds the result once the [`Work`] completed; see
    /// [`NcclBackend::all_reduce_tensor`] for the rules. Errors that are found before the op
    /// is queued (a tensor not on this group's device, say) are returned here.
    pub fn all_gather_tensor(
        &self,
        tensor: &candle_core::Tensor,
    ) -> Result<(candle_core::Tensor, Work)> {
        let (op, out) = tensor::prepare(tensor::Kind::AllGather, tensor, self.ordinal, self.world)?;
        let work = self.queue.submit(Job::Device(op));
        match out {
            Some(out) => Ok((out, work)),
            None => Err(Error::Nccl {
                rank: self.rank,
                message: "all_gather_tensor allocated no output".into(),
            }),
        }
    }
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn submit(&self, op: Collective) -> Work {
        match plan::validate(&op, self.rank, self.world) {
            Ok(()) => self.queue.submit(Job::Host(op)),
            Err(e) => Work::ready(op.name(), self.rank, Err(e)),
        }
    }

    /// Fails every queued op and the one in flight with [`Error::Aborted`] and has the worker
    /// call `ncclCommAbort`, which stops the communicator's kernels and network proxies.
    /// Returns once the worker has released the communicator or after 900 ms, whichever comes
    /// first (`ncclCommAbort` itself may take longer on a broken network; the worker then
    /// finishes on its own). Idempotent; later ops fail with [`Error::Aborted`].
    fn abort(&self) {
        if !self.queue.abort(ABORT_WAIT) {
            tracing::warn!(
                rank = self.rank,
                "NCCL communicator still aborting after {ABORT_WAIT:?}; continuing"
            );
        }
    }

    fn error(&self) -> Option<Error> {
        self.queue.error()
    }
}

impl Drop for NcclBackend {
    /// Lets the worker finish what is queued, then finalise the communicator; waits a bounded
    /// time (3 s) and leaves the worker to finish on its own after that.
    fn drop(&mut self) {
        self.queue.close();
        let finished = self.queue.wait_finished(DROP_WAIT);
        let handle = self
            .worker
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            if finished {
                let _ = handle.join();
            } else {
                // Abort what is left rather than run it on behalf of nobody.
                self.queue.raise_abort();
            }
        }
    }
}

/// The worker: initialise, run the queue, shut down. Reports the outcome of initialisation on
/// `ready`, after releasing everything if it failed.
fn worker_main(
    queue: Arc<Queue>,
    config: GroupConfig,
    ordinal: usize,
    lib: &'static NcclLib,
    ready: mpsc::SyncSender<Result<()>>,
) {
    let rank = config.rank;
    let body = std::panic::AssertUnwindSafe(|| run_worker(&queue, &config, ordinal, lib, &ready));
    if let Err(panic) = std::panic::catch_unwind(body) {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        let error = Error::Nccl {
            rank,
            message: format!("the NCCL worker thread failed: {what}"),
        };
        let _ = ready.try_send(Err(error.clone()));
        queue.fail(error);
    }
    queue.set_finished();
}

fn run_worker(
    queue: &Queue,
    config: &GroupConfig,
    ordinal: usize,
    lib: &'static NcclLib,
    ready: &mpsc::SyncSender<Result<()>>,
) {
    let rank = config.rank;
    let deadline = Instant::now() + config.bootstrap_timeout;
    let gpu = match Gpu::open(ordinal) {
        Ok(gpu) => gpu,
        Err(reason) => {
            let _ = ready.send(Err(Error::CudaUnavailable { ordinal, reason }));
            return;
        }
    };
    let comm = bootstrap::unique_id(config, lib, deadline).and_then(|id| {
        Comm::init(
            lib,
            id,
            config.world_size,
            rank,
            deadline,
            queue.abort_flag(),
        )
        .map_err(|stop| {
            if rank == 0 {
                // The round failed: end the bootstrap root `ncclGetUniqueId` started.
                bootstrap::release(&id, lib.version);
            }
            init_error(config, stop)
        })
    });
    let comm = match comm {
        Ok(comm) => comm,
        Err(e) => {
            gpu.release(true);
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut exec = Exec {
        rank,
        world: config.world_size,
        gpu,
        comm,
        op_timeout: config.op_timeout,
    };
    if ready.send(Ok(())).is_err() {
        // `new` gave up waiting: nobody will use this communicator.
        queue.raise_abort();
    }

    let healthy = queue.run(&mut exec);

    let Exec { gpu, mut comm, .. } = exec;
    let idle = if healthy {
        comm.shutdown(FINALIZE_GRACE, queue.abort_flag());
        gpu.stream_done().unwrap_or(false)
    } else {
        comm.abort();
        drained(&gpu)
    };
    gpu.release(idle);
}

/// Waits briefly for the stream to become idle after an abort; false if it did not.
fn drained(gpu: &Gpu) -> bool {
    let never = AtomicBool::new(false);
    let now = Instant::now();
    comm::poll_until(now, now + DRAIN_WAIT, &never, || {
        gpu.stream_done().map_err(Stop::cuda)
    })
    .is_ok()
}

fn init_error(config: &GroupConfig, stop: Stop) -> Error {
    match stop {
        Stop::Aborted => Error::Aborted { rank: config.rank },
        Stop::TimedOut(waited) => Error::Bootstrap {
            rank: config.rank,
            prefix: config.prefix(),
            reason: format!(
                "the NCCL communicator of {} ranks was not ready after {waited:?}",
                config.world_size
            ),
        },
        Stop::Failed { message, .. } => Error::Nccl {
            rank: config.rank,
            message: format!("creating the communicator: {message}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::InMemoryStore;

    fn config(rank: usize, world: usize) -> GroupConfig {
        GroupConfig {
            job: "nccl-unit".into(),
            round: 0,
            rank,
            world_size: world,
            store: Arc::new(InMemoryStore::new()),
            secret: crate::JobSecret::from_env().unwrap(),
            op_timeout: Duration::from_secs(5),
            bootstrap_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn without_a_usable_gpu_new_is_a_typed_error() {
        if crate::cuda_device_count() > 0 {
            eprintln!("not run: this machine has a CUDA device");
            return;
        }
        let started = Instant::now();
        let err = NcclBackend::new(config(0, 1), Device::Cuda(0)).unwrap_err();
        assert!(
            matches!(err, Error::CudaUnavailable { ordinal: 0, .. }),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_cpu_device_or_bad_config_is_refused() {
        let err = NcclBackend::new(config(0, 1), Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let err = NcclBackend::new(config(2, 2), Device::Cuda(0)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }

    /// Runs only where an NCCL library loads (for example with `REKINDLE_NCCL_LIBRARY` set to
    /// a wheel's `libnccl.so.2`); NCCL itself loads and answers without a GPU.
    #[test]
    fn an_installed_library_binds_and_fails_cleanly_without_a_gpu() {
        let lib = match library::nccl() {
            Ok(lib) => lib,
            Err(e) => {
                eprintln!("not run: {e}");
                return;
            }
        };
        assert!(
            lib.version >= library::MIN_VERSION,
            "{}",
            lib.version_string()
        );
        let name = lib.status_name(sys::REMOTE_ERROR);
        assert!(name.starts_with("ncclRemoteError (6)"), "{name}");
        let (version, path) = NcclBackend::library_version().unwrap();
        assert_eq!(version, lib.version_string());
        assert_eq!(path, lib.path);
        if crate::cuda_device_count() > 0 {
            return;
        }
        // Without a GPU, communicator set-up fails with an NCCL error, in bounded time.
        let cfg = config(0, 1);
        let abort = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        let started = Instant::now();
        let outcome = bootstrap::unique_id(&cfg, lib, deadline)
            .map_err(|e| e.to_string())
            .and_then(|id| {
                let made = Comm::init(lib, id, 1, 0, deadline, &abort)
                    .map(|_| ())
                    .map_err(|stop| format!("{stop:?}"));
                bootstrap::release(&id, lib.version);
                made
            });
        eprintln!("without a GPU: {outcome:?}");
        assert!(outcome.is_err());
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
