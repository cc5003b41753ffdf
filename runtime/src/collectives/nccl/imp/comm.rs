//! The NCCL communicator in non-blocking mode, and the bounded polling every wait goes through.
//!
//! With `blocking = 0` no NCCL call blocks the calling thread on peers: initialisation,
//! connection set-up and grouped operations return `ncclInProgress`, and the caller polls
//! `ncclCommGetAsyncError`. Together with polling the stream, that lets every wait check the
//! op deadline and the abort flag, and end with `ncclCommAbort` instead of hanging.
//!
//! A [`Comm`] is owned by the worker thread (the raw pointer keeps it `!Send`); dropping it
//! aborts it, and nothing here panics.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::library::NcclLib;
use super::sys::{CommHandle, Config, Status, UniqueId, IN_PROGRESS, SUCCESS};

/// Why a wait ended without its condition becoming true.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Stop {
    /// The abort flag was raised.
    Aborted,
    /// The deadline passed after waiting this long.
    TimedOut(Duration),
    /// NCCL or CUDA reported a failure.
    Failed {
        /// NCCL's status code, when NCCL reported it.
        status: Option<Status>,
        /// The description.
        message: String,
    },
}

impl Stop {
    /// A CUDA failure (no NCCL status).
    pub fn cuda(message: String) -> Stop {
        Stop::Failed {
            status: None,
            message,
        }
    }
}

/// Polls `ready` until it returns true, with a short spin and then sleeps growing to 1 ms,
/// checking `abort` and `deadline` between polls. `ready` is always called at least once.
pub(crate) fn poll_until(
    started: Instant,
    deadline: Instant,
    abort: &AtomicBool,
    mut ready: impl FnMut() -> Result<bool, Stop>,
) -> Result<(), Stop> {
    let mut round: u32 = 0;
    loop {
        if ready()? {
            return Ok(());
        }
        if abort.load(Ordering::Acquire) {
            return Err(Stop::Aborted);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Stop::TimedOut(now.duration_since(started)));
        }
        round = round.saturating_add(1);
        if round < 64 {
            std::thread::yield_now();
        } else {
            let pause = Duration::from_micros(u64::from((round - 63).min(20)) * 50);
            std::thread::sleep(pause.min(deadline.saturating_duration_since(now)));
        }
    }
}

/// A live NCCL communicator.
pub(crate) struct Comm {
    lib: &'static NcclLib,
    raw: CommHandle,
}

impl Comm {
    /// Starts a non-blocking `ncclCommInitRankConfig` and polls it until it is ready, failed,
    /// aborted or past `deadline`; on anything but success the half-built communicator is
    /// aborted. The CUDA device must be current on this thread.
    pub fn init(
        lib: &'static NcclLib,
        id: UniqueId,
        world: usize,
        rank: usize,
        deadline: Instant,
        abort: &AtomicBool,
    ) -> Result<Comm, Stop> {
        let mut config = Config::nonblocking();
        let mut raw: CommHandle = std::ptr::null_mut();
        let started = Instant::now();
        // SAFETY: `raw` and `config` outlive the call; NCCL copies the config; world and rank
        // were validated (rank < world, both fit an int since they index real processes).
        let status = unsafe {
            (lib.comm_init_rank_config)(&mut raw, world as i32, id, rank as i32, &mut config)
        };
        if raw.is_null() {
            return Err(Stop::Failed {
                status: Some(status),
                message: format!(
                    "ncclCommInitRankConfig returned no communicator: {}",
                    lib.status_name(status)
                ),
            });
        }
        let mut comm = Comm { lib, raw };
        if status != SUCCESS && status != IN_PROGRESS {
            let message = format!("ncclCommInitRankConfig: {}", comm.describe(status));
            comm.abort();
            return Err(Stop::Failed {
                status: Some(status),
                message,
            });
        }
        match poll_until(started, deadline, abort, || comm.ready()) {
            Ok(()) => Ok(comm),
            Err(stop) => {
                comm.abort();
                Err(stop)
            }
        }
    }

    /// The raw handle, for enqueuing operations.
    pub fn raw(&self) -> CommHandle {
        self.raw
    }

    /// The library.
    pub fn lib(&self) -> &'static NcclLib {
        self.lib
    }

    /// `ncclCommGetAsyncError`: `Ok(true)` when the last call completed, `Ok(false)` while it
    /// is in progress, the failure otherwise (also for a communicator already aborted).
    pub fn ready(&self) -> Result<bool, Stop> {
        if self.raw.is_null() {
            return Err(Stop::Failed {
                status: None,
                message: "the NCCL communicator was already aborted".into(),
            });
        }
        let mut state: Status = SUCCESS;
        // SAFETY: `raw` is a live communicator; NCCL writes one status.
        let status = unsafe { (self.lib.comm_get_async_error)(self.raw, &mut state) };
        let state = if status == SUCCESS { state } else { status };
        match state {
            SUCCESS => Ok(true),
            IN_PROGRESS => Ok(false),
            failed => Err(Stop::Failed {
                status: Some(failed),
                message: self.describe(failed),
            }),
        }
    }

    /// A status code with NCCL's last error message for this communicator.
    pub fn describe(&self, status: Status) -> String {
        let name = self.lib.status_name(status);
        // SAFETY: `raw` is null or live.
        let last = unsafe { self.lib.last_error(self.raw) };
        if last.is_empty() {
            name
        } else {
            format!("{name}: {last}")
        }
    }

    /// Checks the immediate result of an enqueue call (`ncclSuccess` or `ncclInProgress`).
    pub fn check(&self, call: &str, status: Status) -> Result<(), Stop> {
        if status == SUCCESS || status == IN_PROGRESS {
            Ok(())
        } else {
            Err(Stop::Failed {
                status: Some(status),
                message: format!("{call}: {}", self.describe(status)),
            })
        }
    }

    /// `ncclCommAbort`: stops every kernel and proxy operation of the communicator and frees
    /// it. Idempotent; failures are logged, never raised.
    pub fn abort(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // SAFETY: `raw` is live and, having been taken out of `self`, never used again.
        let status = unsafe { (self.lib.comm_abort)(raw) };
        if status != SUCCESS {
            tracing::warn!(
                "ncclCommAbort: {} (the communicator is abandoned)",
                self.lib.status_name(status)
            );
        }
    }

    /// Ends a healthy communicator: `ncclCommFinalize` (flushes outstanding work, polled for at
    /// most `grace`) then `ncclCommDestroy`; falls back to [`Comm::abort`] when finalising
    /// fails or takes longer.
    pub fn shutdown(&mut self, grace: Duration, abort: &AtomicBool) {
        if self.raw.is_null() {
            return;
        }
        let started = Instant::now();
        // SAFETY: `raw` is live.
        let status = unsafe { (self.lib.comm_finalize)(self.raw) };
        let finalized = self
            .check("ncclCommFinalize", status)
            .and_then(|()| poll_until(started, started + grace, abort, || self.ready()));
        match finalized {
            Ok(()) => {
                let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
                // SAFETY: finalised, so destroy only frees local resources; `raw` is not used
                // again.
                let status = unsafe { (self.lib.comm_destroy)(raw) };
                if status != SUCCESS {
                    tracing::warn!("ncclCommDestroy: {}", self.lib.status_name(status));
                }
            }
            Err(stop) => {
                tracing::warn!("NCCL communicator did not finalise ({stop:?}); aborting it");
                self.abort();
            }
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_returns_when_ready() {
        let abort = AtomicBool::new(false);
        let now = Instant::now();
        let mut n = 0;
        let r = poll_until(now, now + Duration::from_secs(5), &abort, || {
            n += 1;
            Ok(n == 100)
        });
        assert_eq!(r, Ok(()));
        assert_eq!(n, 100);
    }

    #[test]
    fn poll_stops_at_the_deadline() {
        let abort = AtomicBool::new(false);
        let now = Instant::now();
        let r = poll_until(now, now + Duration::from_millis(30), &abort, || Ok(false));
        match r {
            Err(Stop::TimedOut(waited)) => assert!(waited >= Duration::from_millis(30)),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(now.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn poll_stops_on_abort_and_on_failure() {
        let abort = AtomicBool::new(true);
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        assert_eq!(
            poll_until(now, far, &abort, || Ok(false)),
            Err(Stop::Aborted)
        );
        let abort = AtomicBool::new(false);
        let failed = Stop::cuda("boom".into());
        assert_eq!(
            poll_until(now, far, &abort, || Err(failed.clone())),
            Err(failed)
        );
    }
}
