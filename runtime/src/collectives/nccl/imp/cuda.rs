//! The CUDA side of the backend, through cudarc's driver `result`/`sys` layers: the device's
//! primary context, one stream, and device scratch memory that host buffers are staged through.
//!
//! Everything here is used from the backend's worker thread only (raw pointers keep these
//! types `!Send`).

use std::ffi::c_int;

use cudarc::driver::{result, sys};

use crate::device::Device;
use crate::error::{Error, Result};

/// Checks, without panicking, that cudarc can load the driver and that `ordinal` exists.
/// cudarc's driver calls panic when libcuda is missing, so this runs before any of them.
pub(crate) fn probe(ordinal: usize) -> Result<()> {
    Device::Cuda(ordinal).ensure_available()?;
    // SAFETY: only tries to dlopen the driver under cudarc's names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            ordinal,
            reason: "cudarc cannot load the CUDA driver library (libcuda.so)".into(),
        });
    }
    Ok(())
}

/// A driver error as text: the call and CUDA's own message.
pub(crate) fn describe(call: &str, e: result::DriverError) -> String {
    format!("{call} failed: {e}")
}

/// The device, its retained primary context (current on the owning thread) and one stream.
pub(crate) struct Gpu {
    pub ordinal: usize,
    dev: sys::CUdevice,
    pub stream: sys::CUstream,
    send: Scratch,
    recv: Scratch,
}

/// A device allocation that grows on demand and is never shrunk while the backend lives.
#[derive(Default)]
struct Scratch {
    ptr: sys::CUdeviceptr,
    cap: usize,
}

/// Smallest scratch allocation; also makes zero-byte requests valid.
const MIN_SCRATCH: usize = 4096;

impl Gpu {
    /// Initialises the driver, makes `ordinal`'s primary context current on this thread and
    /// creates a non-blocking stream. Call [`probe`] first.
    pub fn open(ordinal: usize) -> std::result::Result<Gpu, String> {
        result::init().map_err(|e| describe("cuInit", e))?;
        let dev = result::device::get(ordinal as c_int).map_err(|e| describe("cuDeviceGet", e))?;
        // SAFETY: `dev` came from cuDeviceGet.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| describe("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` is a live primary context; NCCL and the copies below use the context
        // current on this thread.
        if let Err(e) = unsafe { result::ctx::set_current(ctx) } {
            // SAFETY: releases the reference retained above.
            let _ = unsafe { result::primary_ctx::release(dev) };
            return Err(describe("cuCtxSetCurrent", e));
        }
        let stream = match result::stream::create(result::stream::StreamKind::NonBlocking) {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: as above.
                let _ = unsafe { result::primary_ctx::release(dev) };
                return Err(describe("cuStreamCreate", e));
            }
        };
        Ok(Gpu {
            ordinal,
            dev,
            stream,
            send: Scratch::default(),
            recv: Scratch::default(),
        })
    }

    /// True when all work on the stream finished; an error if a kernel or copy failed.
    pub fn stream_done(&self) -> std::result::Result<bool, String> {
        // SAFETY: the stream is live until `release`.
        match unsafe { sys::cuStreamQuery(self.stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(describe("cuStreamQuery", result::DriverError(other))),
        }
    }

    /// Device scratch of at least `bytes` bytes for the op's input (`which = Slot::Send`) or
    /// output. Only called while the stream is idle (at the start of an op), so freeing the
    /// previous, smaller allocation cannot race with work that still uses it.
    pub fn scratch(
        &mut self,
        which: Slot,
        bytes: usize,
    ) -> std::result::Result<sys::CUdeviceptr, String> {
        let s = match which {
            Slot::Send => &mut self.send,
            Slot::Recv => &mut self.recv,
        };
        if s.cap < bytes.max(1) {
            let cap = bytes.max(MIN_SCRATCH).next_power_of_two();
            if s.cap > 0 {
                // SAFETY: `ptr` was allocated by cuMemAlloc and no queued work uses it.
                unsafe { result::free_sync(s.ptr) }.map_err(|e| describe("cuMemFree", e))?;
                s.cap = 0;
            }
            // SAFETY: allocation in the current context.
            s.ptr = unsafe { result::malloc_sync(cap) }
                .map_err(|e| describe(&format!("cuMemAlloc({cap} bytes)"), e))?;
            s.cap = cap;
        }
        Ok(s.ptr)
    }

    /// Enqueues a copy of `src` to device address `dst`. The host memory is pageable, so the
    /// driver has copied it out when this returns and the caller may drop it.
    pub fn upload(&self, dst: sys::CUdeviceptr, src: &[u8]) -> std::result::Result<(), String> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` points into a scratch allocation of at least `src.len()` bytes past it
        // (callers size the scratch for the whole op).
        unsafe { result::memcpy_htod_async(dst, src, self.stream) }
            .map_err(|e| describe("cuMemcpyHtoDAsync", e))
    }

    /// Enqueues a copy of device address `src` into `dst`. Only called once the stream is idle;
    /// the caller then waits for the stream before reading `dst` (a pinned `dst` would make
    /// the copy truly asynchronous).
    pub fn download(
        &self,
        dst: &mut [u8],
        src: sys::CUdeviceptr,
    ) -> std::result::Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` points into a scratch allocation holding at least `dst.len()` bytes.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream) }
            .map_err(|e| describe("cuMemcpyDtoHAsync", e))
    }

    /// Frees the scratch memory and the stream and releases the context when `idle` (no work
    /// can still be running on the stream); otherwise leaks them, since freeing memory that a
    /// stuck kernel still uses would block this thread indefinitely.
    pub fn release(self, idle: bool) {
        if !idle {
            tracing::warn!(
                device = self.ordinal,
                "CUDA stream still busy after the NCCL communicator was aborted; leaking its \
                 scratch memory and stream"
            );
            return;
        }
        for s in [&self.send, &self.recv] {
            if s.cap > 0 {
                // SAFETY: allocated by cuMemAlloc, no work pending on the idle stream.
                let _ = unsafe { result::free_sync(s.ptr) };
            }
        }
        // SAFETY: the stream is idle and not used after this.
        let _ = unsafe { result::stream::destroy(self.stream) };
        // SAFETY: releases the reference retained in `open`.
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

/// Which scratch allocation an op stages through.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Slot {
    /// The input (and in-place output) buffer.
    Send,
    /// A separate output buffer (all-gather, gather, all-to-all).
    Recv,
}
