//! Running one collective on the worker thread: stage the host buffer to the device, enqueue
//! the NCCL call(s) on the backend's stream, poll to completion, copy the result back.
//!
//! Every op starts with an idle stream (the previous op was waited for), so the uploads of
//! pageable host memory return at once and scratch memory can be resized safely. The result is
//! only downloaded after the stream and the communicator reported completion, so no wait here
//! can block on a peer. Scatter, gather and all-to-all are grouped `ncclSend`/`ncclRecv`
//! (`ncclGroupStart`/`ncclGroupEnd`); zero-length pieces are skipped on both sides, which agree
//! on every length. Uneven reduce-scatter pads each rank's segment to the largest one.

use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::sys::{cudaStream_t, ncclDataType_t, ncclRedOp_t};

use super::comm::{poll_until, Comm, Stop};
use super::cuda::{Gpu, Slot};
use super::library::{NcclLib, Status, REMOTE_ERROR, SYSTEM_ERROR};
use super::plan::{self, nccl_dtype, nccl_op};
use super::queue::Execute;
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
struct Bounds<'a> {
    started: Instant,
    deadline: Instant,
    abort: &'a AtomicBool,
}

fn dptr(p: CUdeviceptr) -> *mut c_void {
    p as usize as *mut c_void
}

/// Elements `range` of `buf` as a new buffer.
fn slice(buf: &Buffer, range: std::ops::Range<usize>) -> Buffer {
    let w = buf.dtype().size_in_bytes();
    let mut out = Buffer::zeros(buf.dtype(), range.len());
    out.as_bytes_mut()
        .copy_from_slice(&buf.as_bytes()[range.start * w..range.end * w]);
    out
}

impl Execute for Exec {
    /// Runs `op` within the op deadline, watching `abort`. Errors name this rank, the op and,
    /// where the op has a single peer, that peer.
    fn execute(&mut self, op: Collective, abort: &AtomicBool) -> Result<Buffer, Error> {
        let (rank, name) = (self.rank, op.name());
        let waiting_on = plan::waiting_on(&op, rank, self.world);
        let peer = plan::single_peer(&op, rank);
        let started = Instant::now();
        let bounds = Bounds {
            started,
            deadline: started + self.op_timeout,
            abort,
        };
        self.dispatch(op, &bounds).map_err(|stop| match stop {
            Stop::Aborted => Error::Aborted { rank },
            Stop::TimedOut(elapsed) => Error::Timeout {
                rank,
                op: name,
                elapsed,
                waiting_on,
            },
            Stop::Failed { status, message } => match (peer, status) {
                (Some(peer), Some(SYSTEM_ERROR | REMOTE_ERROR)) => Error::PeerLost {
                    rank,
                    peer,
                    op: name,
                    reason: message,
                },
                _ => Error::Nccl {
                    rank,
                    message: format!("{name}: {message}"),
                },
            },
        })
    }
}

impl Exec {
    fn lib(&self) -> &'static NcclLib {
        self.comm.lib()
    }

    fn stream(&self) -> cudaStream_t {
        self.gpu.stream.cast()
    }

    fn check(&self, call: &str, status: Status) -> Result<(), Stop> {
        self.comm.check(call, status)
    }

    fn scratch(&mut self, slot: Slot, bytes: usize) -> Result<CUdeviceptr, Stop> {
        self.gpu.scratch(slot, bytes).map_err(Stop::cuda)
    }

    fn upload(&self, dst: CUdeviceptr, src: &[u8]) -> Result<(), Stop> {
        self.gpu.upload(dst, src).map_err(Stop::cuda)
    }

    /// Waits until the communicator has no call in progress and the stream is idle.
    fn finish(&self, b: &Bounds<'_>) -> Result<(), Stop> {
        poll_until(b.started, b.deadline, b.abort, || {
            if !self.comm.ready()? {
                return Ok(false);
            }
            self.gpu.stream_done().map_err(Stop::cuda)
        })
    }

    /// Copies device memory into `dst` once the stream is idle, and waits for the copy.
    fn download(&self, dst: &mut [u8], src: CUdeviceptr, b: &Bounds<'_>) -> Result<(), Stop> {
        self.gpu.download(dst, src).map_err(Stop::cuda)?;
        self.finish(b)
    }

    /// Issues the calls made by `calls` as one NCCL group. `ncclGroupEnd` is always called,
    /// so a failed call inside still closes the group.
    fn grouped(&self, calls: impl FnOnce(&Self) -> Result<(), Stop>) -> Result<(), Stop> {
        // SAFETY: group calls take no arguments; this thread owns the communicator.
        let status = unsafe { (self.lib().group_start)() };
        self.check("ncclGroupStart", status)?;
        let issued = calls(self);
        // SAFETY: as above; closes the group opened here.
        let status = unsafe { (self.lib().group_end)() };
        issued?;
        self.check("ncclGroupEnd", status)
    }

    fn send(
        &self,
        src: CUdeviceptr,
        count: usize,
        dt: ncclDataType_t,
        peer: usize,
    ) -> Result<(), Stop> {
        // SAFETY: `src` holds `count` elements of `dt` in this context's scratch memory.
        let status = unsafe {
            (self.lib().send)(
                dptr(src),
                count,
                dt,
                peer as i32,
                self.comm.raw(),
                self.stream(),
            )
        };
        self.check("ncclSend", status)
    }

    fn recv(
        &self,
        dst: CUdeviceptr,
        count: usize,
        dt: ncclDataType_t,
        peer: usize,
    ) -> Result<(), Stop> {
        // SAFETY: `dst` has room for `count` elements of `dt` in this context's scratch memory.
        let status = unsafe {
            (self.lib().recv)(
                dptr(dst),
                count,
                dt,
                peer as i32,
                self.comm.raw(),
                self.stream(),
            )
        };
        self.check("ncclRecv", status)
    }

    fn all_reduce_in_place(
        &self,
        dev: CUdeviceptr,
        count: usize,
        dt: ncclDataType_t,
        op: ncclRedOp_t,
    ) -> Result<(), Stop> {
        // SAFETY: in place on `count` elements of `dt` at `dev`.
        let status = unsafe {
            (self.lib().all_reduce)(
                dptr(dev),
                dptr(dev),
                count,
                dt,
                op,
                self.comm.raw(),
                self.stream(),
            )
        };
        self.check("ncclAllReduce", status)
    }

    fn dispatch(&mut self, op: Collective, b: &Bounds<'_>) -> Result<Buffer, Stop> {
        let (rank, world) = (self.rank, self.world);
        match op {
            Collective::AllReduce { mut buf, op } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                self.upload(dev, buf.as_bytes())?;
                self.all_reduce_in_place(dev, buf.len(), dt, nccl_op(op))?;
                self.finish(b)?;
                self.download(buf.as_bytes_mut(), dev, b)?;
                Ok(buf)
            }
            Collective::Broadcast { mut buf, root } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                if rank == root {
                    self.upload(dev, buf.as_bytes())?;
                }
                // SAFETY: in place on `buf.len()` elements at `dev`.
                let status = unsafe {
                    (self.lib().broadcast)(
                        dptr(dev),
                        dptr(dev),
                        buf.len(),
                        dt,
                        root as i32,
                        self.comm.raw(),
                        self.stream(),
                    )
                };
                self.check("ncclBroadcast", status)?;
                self.finish(b)?;
                if rank != root {
                    self.download(buf.as_bytes_mut(), dev, b)?;
                }
                Ok(buf)
            }
            Collective::Reduce { mut buf, op, root } => {
                if buf.is_empty() {
                    return Ok(buf);
                }
                let dt = nccl_dtype(buf.dtype());
                let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                self.upload(dev, buf.as_bytes())?;
                // SAFETY: in place on `buf.len()` elements at `dev` (written on the root only).
                let status = unsafe {
                    (self.lib().reduce)(
                        dptr(dev),
                        dptr(dev),
                        buf.len(),
                        dt,
                        nccl_op(op),
                        root as i32,
                        self.comm.raw(),
                        self.stream(),
                    )
                };
                self.check("ncclReduce", status)?;
                self.finish(b)?;
                if rank == root {
                    self.download(buf.as_bytes_mut(), dev, b)?;
                }
                Ok(buf)
            }
            Collective::AllGather { buf, out } => {
                let n = buf.len();
                let mut out = output(out, buf.dtype(), n * world, "all_gather").map_err(|e| {
                    Stop::Failed {
                        status: None,
                        message: e.to_string(),
                    }
                })?;
                if n == 0 {
                    return Ok(out);
                }
                let dt = nccl_dtype(buf.dtype());
                let piece = buf.size_in_bytes();
                let dev = self.scratch(Slot::Recv, piece * world)?;
                let mine = dev + (rank * piece) as CUdeviceptr;
                self.upload(mine, buf.as_bytes())?;
                // SAFETY: in-place all-gather: the send buffer is this rank's piece of the
                // `n * world` element receive buffer.
                let status = unsafe {
                    (self.lib().all_gather)(
                        dptr(mine),
                        dptr(dev),
                        n,
                        dt,
                        self.comm.raw(),
                        self.stream(),
                    )
                };
                self.check("ncclAllGather", status)?;
                self.finish(b)?;
                self.download(out.as_bytes_mut(), dev, b)?;
                Ok(out)
            }
            Collective::ReduceScatter { buf, op, out } => {
                let mine = segment(buf.len(), world, rank);
                let mut out =
                    output(out, buf.dtype(), mine.len(), "reduce_scatter").map_err(|e| {
                        Stop::Failed {
                            status: None,
                            message: e.to_string(),
                        }
                    })?;
                if buf.is_empty() {
                    return Ok(out);
                }
                let dt = nccl_dtype(buf.dtype());
                let w = buf.dtype().size_in_bytes();
                let (chunk, placed) = plan::padded_segments(buf.len(), world);
                let dev = self.scratch(Slot::Send, chunk * world * w)?;
                if chunk * world == buf.len() {
                    self.upload(dev, buf.as_bytes())?;
                } else {
                    for (seg, at) in &placed {
                        let bytes = &buf.as_bytes()[seg.start * w..seg.end * w];
                        self.upload(dev + (at * w) as CUdeviceptr, bytes)?;
                    }
                }
                let recv = dev + (rank * chunk * w) as CUdeviceptr;
                // SAFETY: in-place reduce-scatter over `chunk * world` elements at `dev`; this
                // rank's result is the chunk at `recv`.
                let status = unsafe {
                    (self.lib().reduce_scatter)(
                        dptr(dev),
                        dptr(recv),
                        chunk,
                        dt,
                        nccl_op(op),
                        self.comm.raw(),
                        self.stream(),
                    )
                };
                self.check("ncclReduceScatter", status)?;
                self.finish(b)?;
                self.download(out.as_bytes_mut(), recv, b)?;
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
                        let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                        self.upload(dev, buf.as_bytes())?;
                        self.grouped(|x| {
                            for r in others {
                                let seg = segment(count, world, r);
                                x.send(dev + (seg.start * w) as CUdeviceptr, seg.len(), dt, r)?;
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
                    let dev = self.scratch(Slot::Recv, buf.size_in_bytes())?;
                    self.recv(dev, buf.len(), dt, root)?;
                    self.finish(b)?;
                    self.download(buf.as_bytes_mut(), dev, b)?;
                    Ok(buf)
                }
            }
            Collective::Gather { buf, root, out } => {
                let n = buf.len();
                let dt = nccl_dtype(buf.dtype());
                if rank != root {
                    if n > 0 {
                        let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                        self.upload(dev, buf.as_bytes())?;
                        self.send(dev, n, dt, root)?;
                        self.finish(b)?;
                    }
                    return Ok(buf);
                }
                let piece = buf.size_in_bytes();
                let mut out =
                    output(out, buf.dtype(), n * world, "gather").map_err(|e| Stop::Failed {
                        status: None,
                        message: e.to_string(),
                    })?;
                if n == 0 {
                    return Ok(out);
                }
                if world > 1 {
                    let dev = self.scratch(Slot::Recv, piece * world)?;
                    self.grouped(|x| {
                        for r in (0..world).filter(|&r| r != rank) {
                            x.recv(dev + (r * piece) as CUdeviceptr, n, dt, r)?;
                        }
                        Ok(())
                    })?;
                    self.finish(b)?;
                    self.download(out.as_bytes_mut(), dev, b)?;
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
                let mut out = output(out, buf.dtype(), len * world, "all_to_all").map_err(|e| {
                    Stop::Failed {
                        status: None,
                        message: e.to_string(),
                    }
                })?;
                let sends: Vec<usize> = (0..world)
                    .filter(|&r| r != rank && !segment(count, world, r).is_empty())
                    .collect();
                let receives = world > 1 && len > 0;
                if !sends.is_empty() || receives {
                    let src = self.scratch(Slot::Send, buf.size_in_bytes())?;
                    let dst = self.scratch(Slot::Recv, len * world * w)?;
                    self.upload(src, buf.as_bytes())?;
                    self.grouped(|x| {
                        for &r in &sends {
                            let seg = segment(count, world, r);
                            x.send(src + (seg.start * w) as CUdeviceptr, seg.len(), dt, r)?;
                        }
                        if receives {
                            for r in (0..world).filter(|&r| r != rank) {
                                x.recv(dst + (r * len * w) as CUdeviceptr, len, dt, r)?;
                            }
                        }
                        Ok(())
                    })?;
                    self.finish(b)?;
                    if receives {
                        self.download(out.as_bytes_mut(), dst, b)?;
                    }
                }
                let own = segment(count, world, rank);
                out.as_bytes_mut()[rank * len * w..(rank + 1) * len * w]
                    .copy_from_slice(&buf.as_bytes()[own.start * w..own.end * w]);
                Ok(out)
            }
            Collective::Send { buf, peer } => {
                if !buf.is_empty() {
                    let dev = self.scratch(Slot::Send, buf.size_in_bytes())?;
                    self.upload(dev, buf.as_bytes())?;
                    self.send(dev, buf.len(), nccl_dtype(buf.dtype()), peer)?;
                    self.finish(b)?;
                }
                Ok(buf)
            }
            Collective::Recv { mut buf, peer } => {
                if !buf.is_empty() {
                    let dev = self.scratch(Slot::Recv, buf.size_in_bytes())?;
                    self.recv(dev, buf.len(), nccl_dtype(buf.dtype()), peer)?;
                    self.finish(b)?;
                    self.download(buf.as_bytes_mut(), dev, b)?;
                }
                Ok(buf)
            }
            Collective::Barrier => {
                // A one-byte all-reduce: it completes only once every rank contributed.
                let dev = self.scratch(Slot::Send, 1)?;
                self.all_reduce_in_place(dev, 1, ncclDataType_t::ncclUint8, ncclRedOp_t::ncclMax)?;
                self.finish(b)?;
                Ok(Buffer::U8(Vec::new()))
            }
        }
    }
}
