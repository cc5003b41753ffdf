//! Running one collective on the worker thread: stage the host buffer to the device, enqueue
//! the NCCL call(s) on the backend's stream, poll to completion, copy the result back.
//!
//! Every op starts with an idle stream (the previous op was waited for), so scratch memory can
//! be resized safely. Host data goes through pinned staging memory, so uploads and downloads
//! are asynchronous copies whose completion is polled within the op deadline like the NCCL
//! call itself: no wait here can block on a peer or on stuck device work. Scatter, gather and
//! all-to-all are grouped `ncclSend`/`ncclRecv` (`ncclGroupStart`/`ncclGroupEnd`); zero-length
//! pieces are skipped on both sides, which agree on every length. Uneven reduce-scatter pads
//! each rank's segment to the largest one.

use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use super::comm::{poll_until, Comm, Stop};
use super::cuda::{Gpu, Slot};
use super::library::NcclLib;
use super::plan::{self, nccl_dtype, nccl_op};
use super::queue::{Execute, Job};
use super::sys::{self, as_void, DataType, RedOp, Status};
use crate::buffer::Buffer;
use crate::collectives::{output, segment, Collective};
use crate::error::Error;

/// The state an op runs against: owned by the worker thread.
pub(crate) struct Exec {
    pub rank: usize,
    pub world: usize,
    pub gpu: Gpu,
    pub comm: Comm,
    pub op_timeout: Duration,
}

/// The bounds of one op.
pub(crate) struct Bounds<'a> {
    pub started: Instant,
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
}

/// Elements `range` of `buf` as a new buffer.
fn slice(buf: &Buffer, range: std::ops::Range<usize>) -> Buffer {
    let w = buf.dtype().size_in_bytes();
    let mut out = Buffer::zeros(buf.dtype(), range.len());
    out.as_bytes_mut()
        .copy_from_slice(&buf.as_bytes()[range.start * w..range.end * w]);
    out
}

fn invalid(e: Error) -> Stop {
    Stop::Failed {
        status: None,
        message: e.to_string(),
    }
}

impl Execute for Exec {
    /// Runs `job` within the op deadline, watching `abort`; see [`plan::op_error`] for what a
    /// failure becomes.
    fn execute(&mut self, job: Job, abort: &AtomicBool) -> Result<Buffer, Error> {
        let rank = self.rank;
        let (name, peer) = job.describe(rank);
        let started = Instant::now();
        let bounds = Bounds {
            started,
            deadline: started + self.op_timeout,
            abort,
        };
        let result = match job {
            Job::Host(op) => self.dispatch(op, &bounds),
            #[cfg(feature = "cuda")]
            Job::Device(op) => self.device(op, &bounds),
        };
        result.map_err(|stop| plan::op_error(rank, name, peer, started.elapsed(), stop))
    }
}

impl Exec {
    pub(crate) fn lib(&self) -> &'static NcclLib {
        self.comm.lib()
    }

    pub(crate) fn check(&self, call: &str, status: Status) -> Result<(), Stop> {
        self.comm.check(call, status)
    }

    fn reserve(&mut self, slot: Slot, bytes: usize) -> Result<(), Stop> {
        self.gpu.reserve(slot, bytes).map_err(Stop::cuda)
    }

    /// The device address `offset` bytes into scratch area `slot`.
    fn at(&self, slot: Slot, offset: usize) -> *mut c_void {
        as_void(self.gpu.at(slot, offset))
    }

    fn upload(&mut self, slot: Slot, offset: usize, src: &[u8]) -> Result<(), Stop> {
        self.gpu.upload(slot, offset, src).map_err(Stop::cuda)
    }

    /// Waits until the communicator has no call in progress and the stream is idle.
    pub(crate) fn finish(&self, b: &Bounds<'_>) -> Result<(), Stop> {
        poll_until(b.started, b.deadline, b.abort, || {
            if !self.comm.ready()? {
                return Ok(false);
            }
            self.gpu.stream_done().map_err(Stop::cuda)
        })
    }

    /// Copies `dst.len()` bytes at `offset` in scratch area `slot` into `dst`: an asynchronous
    /// copy to the pinned mirror, a bounded wait for it, then a host copy.
    fn download(
        &self,
        dst: &mut [u8],
        slot: Slot,
        offset: usize,
        b: &Bounds<'_>,
    ) -> Result<(), Stop> {
        self.gpu
            .start_download(slot, offset, dst.len())
            .map_err(Stop::cuda)?;
        self.finish(b)?;
        self.gpu
            .take_download(slot, offset, dst)
            .map_err(Stop::cuda)
    }

    /// Issues the calls made by `calls` as one NCCL group. `ncclGroupEnd` is always called,
    /// so a failed call inside still closes the group.
    pub(crate) fn grouped(
        &self,
        calls: impl FnOnce(&Self) -> Result<(), Stop>,
    ) -> Result<(), Stop> {
        // SAFETY: group calls take no arguments; this thread owns the communicator.
        let status = unsafe { (self.lib().group_start)() };
        self.check("ncclGroupStart", status)?;
        let issued = calls(self);
        // SAFETY: as above; closes the group opened here.
        let status = unsafe { (self.lib().group_end)() };
        issued?;
        self.check("ncclGroupEnd", status)
    }

    /// `ncclSend` of `count` elements of `dt` at device address `src`.
    pub(crate) fn send(
        &self,
        src: *const c_void,
        count: usize,
        dt: DataType,
        peer: usize,
    ) -> Result<(), Stop> {
        // SAFETY: `src` holds `count` elements of `dt` in this context's device memory.
        let status = unsafe {
            (self.lib().send)(
                src,
                count,
                dt,
                peer as i32,
                self.comm.raw(),
                self.gpu.stream(),
            )
        };
        self.check("ncclSend", status)
    }

    /// `ncclRecv` of `count` elements of `dt` into device address `dst`.
    pub(crate) fn recv(
        &self,
        dst: *mut c_void,
        count: usize,
        dt: DataType,
        peer: usize,
    ) -> Result<(), Stop> {
        // SAFETY: `dst` has room for `count` elements of `dt` in this context's device memory.
        let status = unsafe {
            (self.lib().recv)(
                dst,
                count,
                dt,
                peer as i32,
                self.comm.raw(),
                self.gpu.stream(),
            )
        };
        self.check("ncclRecv", status)
    }

    /// `ncclAllReduce` from `src` to `dst` (equal for in place).
    pub(crate) fn all_reduce(
        &self,
        src: *const c_void,
        dst: *mut c_void,
        count: usize,
        dt: DataType,
        op: RedOp,
    ) -> Result<(), Stop> {
        // SAFETY: `src` and `dst` hold `count` elements of `dt` in device memory.
        let status = unsafe {
            (self.lib().all_reduce)(src, dst, count, dt, op, self.comm.raw(), self.gpu.stream())
        };
        self.check("ncclAllReduce", status)
    }

    /// `ncclBroadcast` from `root`'s `src` to every rank's `dst`.
    pub(crate) fn broadcast(
        &self,
        src: *const c_void,
        dst: *mut c_void,
        count: usize,
        dt: DataType,
        root: usize,
    ) -> Result<(), Stop> {
        // SAFETY: `src` and `dst` hold `count` elements of `dt` in device memory.
        let status = unsafe {
            (self.lib().broadcast)(
                src,
                dst,
                count,
                dt,
                root as i32,
                self.comm.raw(),
                self.gpu.stream(),
            )
        };
        self.check("ncclBroadcast", status)
    }

    /// `ncclAllGather` of `count` elements per rank from `src` into `dst`.
    pub(crate) fn all_gather(
        &self,
        src: *const c_void,
        dst: *mut c_void,
        count: usize,
        dt: DataType,
    ) -> Result<(), Stop> {
        // SAFETY: `src` holds `count` elements and `dst` `count * world` elements of `dt`.
        let status = unsafe {
            (self.lib().all_gather)(src, dst, count, dt, self.comm.raw(), self.gpu.stream())
        };
        self.check("ncclAllGather", status)
    }

    fn dispatch(&mut self, op: Collective, b: &Bounds<'_>) -> Result<Buffer, Stop> {
        let (rank, world) = (self.rank, self.world);
        match op {
            Collective::AllReduce { mut buf, op } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                self.reserve(Slot::Send, buf.size_in_bytes())?;
                self.upload(Slot::Send, 0, buf.as_bytes())?;
                let dev = self.at(Slot::Send, 0);
                self.all_reduce(dev, dev, buf.len(), dt, nccl_op(op))?;
                self.download(buf.as_bytes_mut(), Slot::Send, 0, b)?;
                Ok(buf)
            }
            Collective::Broadcast { mut buf, root } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                self.reserve(Slot::Send, buf.size_in_bytes())?;
                if rank == root {
                    self.upload(Slot::Send, 0, buf.as_bytes())?;
                }
                let dev = self.at(Slot::Send, 0);
                self.broadcast(dev, dev, buf.len(), dt, root)?;
                if rank == root {
                    self.finish(b)?;
                } else {
                    self.download(buf.as_bytes_mut(), Slot::Send, 0, b)?;
                }
                Ok(buf)
            }
            Collective::Reduce { mut buf, op, root } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                self.reserve(Slot::Send, buf.size_in_bytes())?;
                self.upload(Slot::Send, 0, buf.as_bytes())?;
                let dev = self.at(Slot::Send, 0);
                // SAFETY: in place on `buf.len()` elements at `dev` (written on the root only).
                let status = unsafe {
                    (self.lib().reduce)(
                        dev,
                        dev,
                        buf.len(),
                        dt,
                        nccl_op(op),
                        root as i32,
                        self.comm.raw(),
                        self.gpu.stream(),
                    )
                };
                self.check("ncclReduce", status)?;
                if rank == root {
                    self.download(buf.as_bytes_mut(), Slot::Send, 0, b)?;
                } else {
                    self.finish(b)?;
                }
                Ok(buf)
            }
            Collective::AllGather { buf, out } => {
                let n = buf.len();
                let mut out = output(out, buf.dtype(), n * world, "all_gather").map_err(invalid)?;
                if n == 0 {
                    return Ok(out);
                }
                let dt = nccl_dtype(buf.dtype());
                let piece = buf.size_in_bytes();
                self.reserve(Slot::Recv, piece * world)?;
                self.upload(Slot::Recv, rank * piece, buf.as_bytes())?;
                // In place: the send buffer is this rank's piece of the receive buffer.
                self.all_gather(
                    self.at(Slot::Recv, rank * piece),
                    self.at(Slot::Recv, 0),
                    n,
                    dt,
                )?;
                self.download(out.as_bytes_mut(), Slot::Recv, 0, b)?;
                Ok(out)
            }
            Collective::ReduceScatter { buf, op, out } => {
                let mine = segment(buf.len(), world, rank);
                let mut out =
                    output(out, buf.dtype(), mine.len(), "reduce_scatter").map_err(invalid)?;
                if buf.is_empty() {
                    return Ok(out);
                }
                let dt = nccl_dtype(buf.dtype());
                let w = buf.dtype().size_in_bytes();
                let (chunk, placed) = plan::padded_segments(buf.len(), world);
                self.reserve(Slot::Send, chunk * world * w)?;
                if chunk * world == buf.len() {
                    self.upload(Slot::Send, 0, buf.as_bytes())?;
                } else {
                    for (seg, at) in &placed {
                        let bytes = &buf.as_bytes()[seg.start * w..seg.end * w];
                        self.upload(Slot::Send, at * w, bytes)?;
                    }
                }
                let recv_at = rank * chunk * w;
                // SAFETY: in-place reduce-scatter over `chunk * world` elements of the send
                // area; this rank's result is the chunk at `recv_at`.
                let status = unsafe {
                    (self.lib().reduce_scatter)(
                        self.at(Slot::Send, 0),
                        self.at(Slot::Send, recv_at),
                        chunk,
                        dt,
                        nccl_op(op),
                        self.comm.raw(),
                        self.gpu.stream(),
                    )
                };
                self.check("ncclReduceScatter", status)?;
                self.download(out.as_bytes_mut(), Slot::Send, recv_at, b)?;
                Ok(out)
            }
            Collective::Scatter { mut buf, root } => {
                let dt = nccl_dtype(buf.dtype());
                let w = buf.dtype().size_in_bytes();
                if rank == root {
                    let count = buf.len();
                    let others =
                        (0..world).filter(|&r| r != rank && !segment(count, world, r).is_empty());
                    if others.clone().next().is_some() {
                        self.reserve(Slot::Send, buf.size_in_bytes())?;
                        self.upload(Slot::Send, 0, buf.as_bytes())?;
                        self.grouped(|x| {
                            for r in others {
                                let seg = segment(count, world, r);
                                x.send(x.at(Slot::Send, seg.start * w), seg.len(), dt, r)?;
                            }
                            Ok(())
                        })?;
                        self.finish(b)?;
                    }
                    Ok(slice(&buf, segment(count, world, rank)))
                } else {
                    if buf.is_empty() {
                        return Ok(buf);
                    }
                    self.reserve(Slot::Recv, buf.size_in_bytes())?;
                    self.recv(self.at(Slot::Recv, 0), buf.len(), dt, root)?;
                    self.download(buf.as_bytes_mut(), Slot::Recv, 0, b)?;
                    Ok(buf)
                }
            }
            Collective::Gather { buf, root, out } => {
                let n = buf.len();
                let dt = nccl_dtype(buf.dtype());
                if rank != root {
                    if n > 0 {
                        self.reserve(Slot::Send, buf.size_in_bytes())?;
                        self.upload(Slot::Send, 0, buf.as_bytes())?;
                        self.send(self.at(Slot::Send, 0), n, dt, root)?;
                        self.finish(b)?;
                    }
                    return Ok(buf);
                }
                let piece = buf.size_in_bytes();
                let mut out = output(out, buf.dtype(), n * world, "gather").map_err(invalid)?;
                if n == 0 {
                    return Ok(out);
                }
                if world > 1 {
                    self.reserve(Slot::Recv, piece * world)?;
                    self.grouped(|x| {
                        for r in (0..world).filter(|&r| r != rank) {
                            x.recv(x.at(Slot::Recv, r * piece), n, dt, r)?;
                        }
                        Ok(())
                    })?;
                    self.download(out.as_bytes_mut(), Slot::Recv, 0, b)?;
                }
                out.as_bytes_mut()[rank * piece..(rank + 1) * piece]
                    .copy_from_slice(buf.as_bytes());
                Ok(out)
            }
            Collective::AllToAll { buf, out } => {
                let count = buf.len();
                let dt = nccl_dtype(buf.dtype());
                let w = buf.dtype().size_in_bytes();
                // Rank r receives segment r of every rank's buffer: `len` elements from each.
                let len = segment(count, world, rank).len();
                let mut out =
                    output(out, buf.dtype(), len * world, "all_to_all").map_err(invalid)?;
                let sends: Vec<usize> = (0..world)
                    .filter(|&r| r != rank && !segment(count, world, r).is_empty())
                    .collect();
                let receives = world > 1 && len > 0;
                if !sends.is_empty() || receives {
                    self.reserve(Slot::Send, buf.size_in_bytes())?;
                    self.reserve(Slot::Recv, len * world * w)?;
                    self.upload(Slot::Send, 0, buf.as_bytes())?;
                    self.grouped(|x| {
                        for &r in &sends {
                            let seg = segment(count, world, r);
                            x.send(x.at(Slot::Send, seg.start * w), seg.len(), dt, r)?;
                        }
                        if receives {
                            for r in (0..world).filter(|&r| r != rank) {
                                x.recv(x.at(Slot::Recv, r * len * w), len, dt, r)?;
                            }
                        }
                        Ok(())
                    })?;
                    if receives {
                        self.download(out.as_bytes_mut(), Slot::Recv, 0, b)?;
                    } else {
                        self.finish(b)?;
                    }
                }
                let own = segment(count, world, rank);
                out.as_bytes_mut()[rank * len * w..(rank + 1) * len * w]
                    .copy_from_slice(&buf.as_bytes()[own.start * w..own.end * w]);
                Ok(out)
            }
            Collective::Send { buf, peer } => {
                if !buf.is_empty() {
                    self.reserve(Slot::Send, buf.size_in_bytes())?;
                    self.upload(Slot::Send, 0, buf.as_bytes())?;
                    self.send(
                        self.at(Slot::Send, 0),
                        buf.len(),
                        nccl_dtype(buf.dtype()),
                        peer,
                    )?;
                    self.finish(b)?;
                }
                Ok(buf)
            }
            Collective::Recv { mut buf, peer } => {
                if !buf.is_empty() {
                    self.reserve(Slot::Recv, buf.size_in_bytes())?;
                    self.recv(
                        self.at(Slot::Recv, 0),
                        buf.len(),
                        nccl_dtype(buf.dtype()),
                        peer,
                    )?;
                    self.download(buf.as_bytes_mut(), Slot::Recv, 0, b)?;
                }
                Ok(buf)
            }
            Collective::Barrier => {
                // A one-byte all-reduce: it completes only once every rank contributed.
                self.reserve(Slot::Send, 1)?;
                let dev = self.at(Slot::Send, 0);
                self.all_reduce(dev, dev, 1, sys::UINT8, sys::MAX)?;
                self.finish(b)?;
                Ok(Buffer::U8(Vec::new()))
            }
        }
    }
}
