//! Collective operations: the [`Backend`] trait, its operations, and asynchronous [`Work`].
//!
//! A backend executes operations in the order they were issued, one group-wide stream like a
//! NCCL stream: `submit` returns at once with a [`Work`] handle, and [`Work::wait`] blocks until
//! the operation finished, failed, or the caller's timeout passed. Buffers are owned: an
//! operation takes its [`Buffer`] by value and `wait` hands the result back.
//!
//! Element counts are split among ranks with [`segment`]: rank `i` of `n` owns
//! `count / n + (i < count % n)` elements, so any count works, including 0 and counts not
//! divisible by the world size.

pub mod check;
pub mod nccl;
pub mod reduce;
pub mod tcp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::buffer::Buffer;
use crate::error::{Error, Result};

pub use reduce::ReduceOp;

/// Bytes this process's TCP backends handed to their peers (sockets and shared-memory rings).
static BYTES_SENT: AtomicU64 = AtomicU64::new(0);

/// Bytes this process's TCP backends have sent to peers since it started, every group
/// together (payload, sealing and framing excluded).
pub fn bytes_sent() -> u64 {
    BYTES_SENT.load(Ordering::Relaxed)
}

pub(crate) fn count_sent(n: usize) {
    BYTES_SENT.fetch_add(n as u64, Ordering::Relaxed);
}

/// The element range `start..start + len` that rank `rank` of `world` owns out of `count`.
pub fn segment(count: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let base = count / world;
    let extra = count % world;
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start..start + len
}

/// One collective operation with its buffers. See each `ProcessGroup` method for the contract.
#[derive(Debug)]
pub enum Collective {
    /// Every rank ends with the reduction of all ranks' buffers.
    AllReduce {
        /// Input and output.
        buf: Buffer,
        /// The reduction.
        op: ReduceOp,
    },
    /// Every rank ends with `root`'s buffer; all buffers have the same length.
    Broadcast {
        /// Input on the root, output elsewhere.
        buf: Buffer,
        /// The source rank.
        root: usize,
    },
    /// `root` ends with the reduction; other ranks' buffers are used as scratch.
    Reduce {
        /// Input, and output on the root.
        buf: Buffer,
        /// The reduction.
        op: ReduceOp,
        /// The destination rank.
        root: usize,
    },
    /// Every rank ends with the concatenation of all ranks' buffers (equal lengths), in rank order.
    AllGather {
        /// This rank's contribution.
        buf: Buffer,
        /// A buffer to write the result into (dtype of `buf`, `world * len` elements), reused
        /// across calls to spare the allocation; `None` allocates one.
        out: Option<Buffer>,
    },
    /// Every rank ends with its [`segment`] of the reduction of all ranks' buffers.
    ReduceScatter {
        /// This rank's full-length input.
        buf: Buffer,
        /// The reduction.
        op: ReduceOp,
        /// A buffer for the result (this rank's segment length), or `None` to allocate one.
        out: Option<Buffer>,
    },
    /// Rank `i` receives [`segment`] `i` of the root's buffer. On the root `buf` is the whole
    /// input; elsewhere it is the output, whose length must be that rank's segment length.
    Scatter {
        /// Input on the root, output elsewhere.
        buf: Buffer,
        /// The source rank.
        root: usize,
    },
    /// `root` ends with the concatenation of all ranks' buffers (equal lengths); other ranks
    /// get their buffer back.
    Gather {
        /// This rank's contribution.
        buf: Buffer,
        /// The destination rank.
        root: usize,
        /// On the root, a buffer for the result (`world * len` elements), or `None` to
        /// allocate one; ignored elsewhere.
        out: Option<Buffer>,
    },
    /// Segment `j` of every rank's buffer goes to rank `j`; rank `r` ends with the
    /// concatenation, in rank order, of segment `r` of every rank's buffer. All ranks pass
    /// buffers of the same length.
    AllToAll {
        /// This rank's input.
        buf: Buffer,
        /// A buffer for the result (`world` times this rank's segment length), or `None` to
        /// allocate one.
        out: Option<Buffer>,
    },
    /// Sends `buf` to `peer`, which must issue a matching `Recv` of the same length and dtype.
    Send {
        /// The data.
        buf: Buffer,
        /// The destination rank.
        peer: usize,
    },
    /// Receives into `buf` from `peer`.
    Recv {
        /// The output; its length and dtype must match the sender's.
        buf: Buffer,
        /// The source rank.
        peer: usize,
    },
    /// Returns once every rank has entered the barrier.
    Barrier,
}

impl Collective {
    /// The operation's name, as used in errors and by `collectives_perf --op`.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::Scatter { .. } => "scatter",
            Collective::Gather { .. } => "gather",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
            Collective::Barrier => "barrier",
        }
    }
}

/// A handle on an issued operation.
#[derive(Debug)]
pub struct Work {
    rx: WorkRx,
    op: &'static str,
    rank: usize,
}

#[derive(Debug)]
enum WorkRx {
    Pending(mpsc::Receiver<Result<Buffer>>),
    Ready(Option<Result<Buffer>>),
}

/// The sending half of a [`Work`]: the backend completes it exactly once.
#[derive(Debug)]
pub struct WorkSender(mpsc::SyncSender<Result<Buffer>>);

impl WorkSender {
    /// Completes the work. A caller that dropped its handle is not an error.
    pub fn complete(self, result: Result<Buffer>) {
        let _ = self.0.send(result);
    }
}

impl Work {
    /// A pending handle and the sender that completes it.
    pub fn pending(op: &'static str, rank: usize) -> (Work, WorkSender) {
        let (tx, rx) = mpsc::sync_channel(1);
        (
            Work {
                rx: WorkRx::Pending(rx),
                op,
                rank,
            },
            WorkSender(tx),
        )
    }

    /// A handle that is already complete (used for errors found at issue time).
    pub fn ready(op: &'static str, rank: usize, result: Result<Buffer>) -> Work {
        Work {
            rx: WorkRx::Ready(Some(result)),
            op,
            rank,
        }
    }

    /// The operation's name.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Waits up to `timeout` for the result. On timeout the operation keeps running (its own
    /// deadline still bounds it) and the error is [`Error::Timeout`]; the buffer is lost to the
    /// caller in that case, as the backend still owns it.
    pub fn wait(self, timeout: Duration) -> Result<Buffer> {
        let start = Instant::now();
        match self.rx {
            WorkRx::Ready(mut r) => r.take().unwrap_or(Err(Error::Aborted { rank: self.rank })),
            WorkRx::Pending(rx) => match spin_then_recv(&rx, timeout) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::Timeout {
                    rank: self.rank,
                    op: self.op,
                    elapsed: start.elapsed(),
                    waiting_on: Vec::new(),
                }),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    Err(Error::Aborted { rank: self.rank })
                }
            },
        }
    }

    /// True if the result is available (`wait` would not block).
    pub fn is_completed(&mut self) -> bool {
        match &mut self.rx {
            WorkRx::Ready(_) => true,
            WorkRx::Pending(rx) => match rx.try_recv() {
                Ok(r) => {
                    self.rx = WorkRx::Ready(Some(r));
                    true
                }
                Err(mpsc::TryRecvError::Empty) => false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.rx = WorkRx::Ready(Some(Err(Error::Aborted { rank: self.rank })));
                    true
                }
            },
        }
    }
}

/// Checks that a caller's output buffer has the result's dtype and length.
pub(crate) fn check_output(
    out: Option<&Buffer>,
    dtype: crate::DType,
    len: usize,
    op: &'static str,
) -> Result<()> {
    match out {
        Some(b) if b.dtype() != dtype || b.len() != len => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "the output buffer is {} x {}, the result is {dtype} x {len}",
                b.dtype(),
                b.len()
            ),
        }),
        _ => Ok(()),
    }
}

/// The output buffer of an operation: the caller's `out` if it fits (else
/// [`Error::InvalidArgument`]), or a new zeroed one.
pub(crate) fn output(
    out: Option<Buffer>,
    dtype: crate::DType,
    len: usize,
    op: &'static str,
) -> Result<Buffer> {
    check_output(out.as_ref(), dtype, len, op)?;
    Ok(out.unwrap_or_else(|| Buffer::zeros(dtype, len)))
}

/// How long [`Work::wait`] checks for a result before it sleeps: a collective of a few KiB
/// completes in tens of microseconds, less than a sleeping thread takes to wake.
const WAIT_SPIN: Duration = Duration::from_micros(200);

fn spin_then_recv<T>(
    rx: &mpsc::Receiver<T>,
    timeout: Duration,
) -> std::result::Result<T, mpsc::RecvTimeoutError> {
    let start = Instant::now();
    while start.elapsed() < WAIT_SPIN.min(timeout) {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(mpsc::TryRecvError::Disconnected) => {
                return Err(mpsc::RecvTimeoutError::Disconnected)
            }
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    rx.recv_timeout(timeout.saturating_sub(start.elapsed()))
}

/// A communication backend: the transport and algorithms behind a [`crate::ProcessGroup`].
///
/// Contract for implementations:
/// - `submit` never blocks on the network; operations run in issue order;
/// - every operation is bounded by the backend's operation deadline: a dead peer fails it with
///   [`Error::PeerLost`] naming that peer, a hung one with [`Error::Timeout`];
/// - after any failure the backend is broken: queued and later operations fail with
///   [`Error::GroupBroken`] (or the failure itself), and the group must be rebuilt;
/// - `abort` returns within about a second and fails everything in flight or queued with
///   [`Error::Aborted`];
/// - the same inputs on the same world size give bit-identical outputs.
pub trait Backend: Send + Sync {
    /// The backend's name (`tcp`, `nccl`).
    fn name(&self) -> &'static str;
    /// This process's rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Issues an operation.
    fn submit(&self, op: Collective) -> Work;
    /// Fails every in-flight and queued operation and closes the transport.
    fn abort(&self);
    /// The first failure, if the backend is broken.
    fn error(&self) -> Option<Error>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_tile_the_count() {
        for count in [0usize, 1, 2, 5, 7, 64, 1001] {
            for world in 1..=6 {
                let mut next = 0;
                for r in 0..world {
                    let s = segment(count, world, r);
                    assert_eq!(s.start, next);
                    assert!(s.len() == count / world || s.len() == count / world + 1);
                    next = s.end;
                }
                assert_eq!(next, count);
            }
        }
    }
}
