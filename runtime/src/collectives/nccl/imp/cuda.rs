//! The CUDA side of the backend: the device's primary context, one stream, and the memory host
//! buffers are staged through. Every call here returns without waiting for device work, so no
//! wait of the backend can block behind a stuck kernel:
//! - device scratch memory is stream-ordered (`cuMemAllocAsync`/`cuMemFreeAsync` on the
//!   backend's stream), so growing or freeing it never synchronises the device;
//! - host data goes through pinned staging memory, so copies are truly asynchronous and their
//!   completion is polled with the op's deadline like everything else.
//!
//! Everything here is used from the backend's worker thread only (raw pointers keep these
//! types `!Send`).

use std::ffi::c_void;

use super::driver::{driver, Driver};
use super::sys::{
    CuContext, CuDevice, CuDevicePtr, CuEvent, CuStream, CUDA_ERROR_NOT_READY, CUDA_SUCCESS,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, CU_EVENT_WAIT_DEFAULT, CU_STREAM_NON_BLOCKING,
};
use crate::device::Device;
use crate::error::{Error, Result};

/// Checks, without panicking, that the driver loads and that `ordinal` exists.
pub(crate) fn probe(ordinal: usize) -> Result<()> {
    Device::Cuda(ordinal).ensure_available()?;
    driver()
        .map(|_| ())
        .map_err(|reason| Error::CudaUnavailable { ordinal, reason })
}

/// Which scratch area an op stages through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The input (and in-place output) buffer.
    Send = 0,
    /// A separate output buffer (all-gather, gather, all-to-all).
    Recv = 1,
}

/// A device allocation and the pinned host memory of the same size that mirrors it; both grow
/// on demand and are never shrunk while the backend lives.
struct Scratch {
    dev: CuDevicePtr,
    host: *mut u8,
    cap: usize,
}

impl Scratch {
    const EMPTY: Scratch = Scratch {
        dev: 0,
        host: std::ptr::null_mut(),
        cap: 0,
    };
}

/// Smallest scratch allocation; also makes zero-byte requests valid.
const MIN_SCRATCH: usize = 4096;

/// The device, its retained primary context (current on the owning thread) and one stream.
pub(crate) struct Gpu {
    pub ordinal: usize,
    drv: &'static Driver,
    dev: CuDevice,
    stream: CuStream,
    scratch: [Scratch; 2],
}

impl Gpu {
    /// Initialises the driver, makes `ordinal`'s primary context current on this thread and
    /// creates a non-blocking stream. Call [`probe`] first.
    pub fn open(ordinal: usize) -> std::result::Result<Gpu, String> {
        let drv = driver()?;
        let ordinal_int = i32::try_from(ordinal).map_err(|_| format!("no device {ordinal}"))?;
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            drv.check("cuInit", (drv.init)(0))?;
            let mut dev: CuDevice = 0;
            drv.check("cuDeviceGet", (drv.device_get)(&mut dev, ordinal_int))?;
            let mut pools = 0;
            drv.check(
                "cuDeviceGetAttribute(MEMORY_POOLS_SUPPORTED)",
                (drv.device_get_attribute)(
                    &mut pools,
                    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                    dev,
                ),
            )?;
            if pools == 0 {
                return Err(format!(
                    "device {ordinal} does not support stream-ordered memory (cuMemAllocAsync)"
                ));
            }
            let mut ctx: CuContext = std::ptr::null_mut();
            drv.check(
                "cuDevicePrimaryCtxRetain",
                (drv.primary_ctx_retain)(&mut ctx, dev),
            )?;
            let mut stream: CuStream = std::ptr::null_mut();
            let made = drv
                .check("cuCtxSetCurrent", (drv.ctx_set_current)(ctx))
                .and_then(|()| {
                    drv.check(
                        "cuStreamCreate",
                        (drv.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING),
                    )
                });
            if let Err(e) = made {
                (drv.primary_ctx_release)(dev);
                return Err(e);
            }
            Ok(Gpu {
                ordinal,
                drv,
                dev,
                stream,
                scratch: [Scratch::EMPTY, Scratch::EMPTY],
            })
        }
    }

    /// The stream NCCL and the copies are enqueued on.
    pub fn stream(&self) -> CuStream {
        self.stream
    }

    /// True when all work on the stream finished; an error if a kernel or copy failed.
    pub fn stream_done(&self) -> std::result::Result<bool, String> {
        // SAFETY: the stream is live until `release`.
        match unsafe { (self.drv.stream_query)(self.stream) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(format!("cuStreamQuery failed: {}", self.drv.error_name(rc))),
        }
    }

    /// Makes the stream wait, on the device, for the work recorded in `event` (an event of the
    /// same context, recorded on another stream).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn wait_event(&self, event: CuEvent) -> std::result::Result<(), String> {
        // SAFETY: the caller keeps `event` alive until the wait is enqueued (this call).
        let rc = unsafe { (self.drv.stream_wait_event)(self.stream, event, CU_EVENT_WAIT_DEFAULT) };
        self.drv.check("cuStreamWaitEvent", rc)
    }

    /// Makes scratch area `slot` at least `bytes` long. Called at the start of an op, when
    /// the stream is idle: the pinned memory is then not in use, and the device memory is
    /// freed and allocated in stream order, so nothing here waits for the device.
    pub fn reserve(&mut self, slot: Slot, bytes: usize) -> std::result::Result<(), String> {
        let drv = self.drv;
        let stream = self.stream;
        let s = &mut self.scratch[slot as usize];
        if s.cap >= bytes.max(1) {
            return Ok(());
        }
        let cap = bytes.max(MIN_SCRATCH).next_power_of_two();
        // SAFETY: the old allocations are not used by any queued work (the stream is idle);
        // the new ones are written to locals before being stored.
        unsafe {
            if s.cap > 0 {
                drv.check("cuMemFreeAsync", (drv.mem_free_async)(s.dev, stream))?;
                drv.check("cuMemFreeHost", (drv.mem_free_host)(s.host.cast()))?;
                *s = Scratch::EMPTY;
            }
            let mut host: *mut c_void = std::ptr::null_mut();
            drv.check(
                &format!("cuMemHostAlloc({cap} bytes)"),
                (drv.mem_host_alloc)(&mut host, cap, 0),
            )?;
            let mut dev: CuDevicePtr = 0;
            let rc = (drv.mem_alloc_async)(&mut dev, cap, stream);
            if rc != CUDA_SUCCESS {
                (drv.mem_free_host)(host);
                return Err(format!(
                    "cuMemAllocAsync({cap} bytes) failed: {}",
                    drv.error_name(rc)
                ));
            }
            *s = Scratch {
                dev,
                host: host.cast(),
                cap,
            };
        }
        Ok(())
    }

    /// The device address `offset` bytes into scratch area `slot`.
    pub fn at(&self, slot: Slot, offset: usize) -> CuDevicePtr {
        self.scratch[slot as usize].dev + offset as CuDevicePtr
    }

    fn span(&self, slot: Slot, offset: usize, len: usize) -> std::result::Result<(), String> {
        let cap = self.scratch[slot as usize].cap;
        if offset.checked_add(len).is_some_and(|end| end <= cap) {
            Ok(())
        } else {
            Err(format!(
                "staging {len} bytes at offset {offset} overflows the {cap}-byte scratch area"
            ))
        }
    }

    /// Enqueues a copy of `src` to `offset` bytes into scratch area `slot`, through the pinned
    /// mirror of the area (so the copy is asynchronous and `src` may be dropped at once).
    pub fn upload(
        &mut self,
        slot: Slot,
        offset: usize,
        src: &[u8],
    ) -> std::result::Result<(), String> {
        if src.is_empty() {
            return Ok(());
        }
        self.span(slot, offset, src.len())?;
        let s = &self.scratch[slot as usize];
        // SAFETY: `span` checked that the range lies in both allocations; no queued copy uses
        // this range of the pinned memory (ops stage disjoint ranges and start on an idle stream).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), s.host.add(offset), src.len());
            let rc = (self.drv.memcpy_htod_async)(
                s.dev + offset as CuDevicePtr,
                s.host.add(offset).cast(),
                src.len(),
                self.stream,
            );
            self.drv.check("cuMemcpyHtoDAsync", rc)
        }
    }

    /// Enqueues a copy of `len` bytes at `offset` in scratch area `slot` into its pinned
    /// mirror; [`Gpu::take_download`] reads them once the stream is idle.
    pub fn start_download(
        &self,
        slot: Slot,
        offset: usize,
        len: usize,
    ) -> std::result::Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        self.span(slot, offset, len)?;
        let s = &self.scratch[slot as usize];
        // SAFETY: the range lies in both allocations (checked above).
        let rc = unsafe {
            (self.drv.memcpy_dtoh_async)(
                s.host.add(offset).cast(),
                s.dev + offset as CuDevicePtr,
                len,
                self.stream,
            )
        };
        self.drv.check("cuMemcpyDtoHAsync", rc)
    }

    /// Copies what [`Gpu::start_download`] staged at `offset` into `dst`. Only call once the
    /// stream is idle.
    pub fn take_download(
        &self,
        slot: Slot,
        offset: usize,
        dst: &mut [u8],
    ) -> std::result::Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        self.span(slot, offset, dst.len())?;
        let s = &self.scratch[slot as usize];
        // SAFETY: in bounds (checked above); the copy into it completed (the stream is idle).
        unsafe { std::ptr::copy_nonoverlapping(s.host.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Releases the scratch memory and the stream. The device memory is freed in stream order
    /// and the stream destroyed, neither of which waits for the device; when the stream is not
    /// `idle` (a kernel of an aborted communicator may still hold it), the pinned memory and
    /// the context reference are left to the process, since freeing them could wait for that
    /// kernel.
    pub fn release(self, idle: bool) {
        let drv = self.drv;
        // SAFETY: each handle is live and not used after this.
        unsafe {
            for s in &self.scratch {
                if s.cap > 0 {
                    (drv.mem_free_async)(s.dev, self.stream);
                    if idle {
                        (drv.mem_free_host)(s.host.cast());
                    }
                }
            }
            (drv.stream_destroy)(self.stream);
            if idle {
                (drv.primary_ctx_release)(self.dev);
            }
        }
        if !idle {
            tracing::warn!(
                device = self.ordinal,
                "CUDA stream still busy after the NCCL communicator was aborted; its pinned \
                 staging memory is left allocated"
            );
        }
    }
}
