//! The CUDA driver calls the backend makes, loaded from `libcuda.so.1` with `dlopen`: nothing
//! is linked, so the backend builds without a toolkit and shares one process with candle's
//! CUDA backend (which links the driver: `dlopen` then returns the same library).
//!
//! Symbols are the ABI names `cuda.h` maps its API names to (`cuStreamDestroy` is
//! `cuStreamDestroy_v2`, and so on); every one of them exists in CUDA 11.2 and newer drivers.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, PoisonError};

use super::sys::{CuContext, CuDevice, CuDevicePtr, CuEvent, CuResult, CuStream, CUDA_SUCCESS};

type Init = unsafe extern "C" fn(c_uint) -> CuResult;
type DeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult;
type PrimaryCtxRetain = unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult;
type PrimaryCtxRelease = unsafe extern "C" fn(CuDevice) -> CuResult;
type CtxSetCurrent = unsafe extern "C" fn(CuContext) -> CuResult;
type StreamCreate = unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult;
type StreamFn = unsafe extern "C" fn(CuStream) -> CuResult;
type StreamWaitEvent = unsafe extern "C" fn(CuStream, CuEvent, c_uint) -> CuResult;
type MemAllocAsync = unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult;
type MemFreeAsync = unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult;
type MemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult;
type MemFreeHost = unsafe extern "C" fn(*mut c_void) -> CuResult;
type MemcpyHtoDAsync =
    unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult;
type MemcpyDtoHAsync = unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult;
type GetErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The driver functions the backend calls. The tensor ops of the `cuda` feature record their
/// events through candle (on candle's stream) and make the backend's stream wait on them with
/// `stream_wait_event`; the rest serve every build.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Driver {
    _lib: libloading::Library,
    pub init: Init,
    pub device_get: DeviceGet,
    pub device_get_attribute: DeviceGetAttribute,
    pub primary_ctx_retain: PrimaryCtxRetain,
    pub primary_ctx_release: PrimaryCtxRelease,
    pub ctx_set_current: CtxSetCurrent,
    pub stream_create: StreamCreate,
    pub stream_destroy: StreamFn,
    pub stream_query: StreamFn,
    pub stream_wait_event: StreamWaitEvent,
    pub mem_alloc_async: MemAllocAsync,
    pub mem_free_async: MemFreeAsync,
    pub mem_host_alloc: MemHostAlloc,
    pub mem_free_host: MemFreeHost,
    pub memcpy_htod_async: MemcpyHtoDAsync,
    pub memcpy_dtoh_async: MemcpyDtoHAsync,
    get_error_name: GetErrorName,
}

impl Driver {
    /// `Ok(())` for `CUDA_SUCCESS`, otherwise `"<call> failed: CUDA_ERROR_... (<code>)"`.
    pub fn check(&self, call: &str, rc: CuResult) -> Result<(), String> {
        if rc == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call} failed: {}", self.error_name(rc)))
        }
    }

    /// The driver's name for a result code, with the code.
    pub fn error_name(&self, rc: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string, or fails for unknown
        // codes and leaves `p` null.
        let named = unsafe { (self.get_error_name)(rc, &mut p) } == CUDA_SUCCESS && !p.is_null();
        if named {
            // SAFETY: a static NUL-terminated string from the driver.
            let name = unsafe { CStr::from_ptr(p) }.to_string_lossy();
            format!("{name} ({rc})")
        } else {
            format!("CUresult {rc}")
        }
    }
}

/// The process-wide driver table, loaded on first use; a failure is not kept (a later call
/// tries again).
pub(crate) fn driver() -> Result<&'static Driver, String> {
    static DRIVER: Mutex<Option<&'static Driver>> = Mutex::new(None);
    let mut slot = DRIVER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(d) = *slot {
        return Ok(d);
    }
    let mut failures = Vec::new();
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                let d: &'static Driver = Box::leak(Box::new(bind(lib, name)?));
                *slot = Some(d);
                return Ok(d);
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "cannot load the CUDA driver library: {}",
        failures.join("; ")
    ))
}

fn bind(lib: libloading::Library, path: &str) -> Result<Driver, String> {
    fn sym<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T, String> {
        let cname = format!("{name}\0");
        // SAFETY: every `T` used below is the C signature of that symbol in cuda.h.
        unsafe { lib.get::<T>(cname.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{path} has no symbol {name} (CUDA 11.2 or newer is needed): {e}"))
    }
    Ok(Driver {
        init: sym(&lib, path, "cuInit")?,
        device_get: sym(&lib, path, "cuDeviceGet")?,
        device_get_attribute: sym(&lib, path, "cuDeviceGetAttribute")?,
        primary_ctx_retain: sym(&lib, path, "cuDevicePrimaryCtxRetain")?,
        primary_ctx_release: sym(&lib, path, "cuDevicePrimaryCtxRelease_v2")?,
        ctx_set_current: sym(&lib, path, "cuCtxSetCurrent")?,
        stream_create: sym(&lib, path, "cuStreamCreate")?,
        stream_destroy: sym(&lib, path, "cuStreamDestroy_v2")?,
        stream_query: sym(&lib, path, "cuStreamQuery")?,
        stream_wait_event: sym(&lib, path, "cuStreamWaitEvent")?,
        mem_alloc_async: sym(&lib, path, "cuMemAllocAsync")?,
        mem_free_async: sym(&lib, path, "cuMemFreeAsync")?,
        mem_host_alloc: sym(&lib, path, "cuMemHostAlloc")?,
        mem_free_host: sym(&lib, path, "cuMemFreeHost")?,
        memcpy_htod_async: sym(&lib, path, "cuMemcpyHtoDAsync_v2")?,
        memcpy_dtoh_async: sym(&lib, path, "cuMemcpyDtoHAsync_v2")?,
        get_error_name: sym(&lib, path, "cuGetErrorName")?,
        _lib: lib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_loading_is_an_error_not_a_panic() {
        match driver() {
            Ok(d) => assert!(d.error_name(1).contains("CUDA_ERROR_INVALID_VALUE")),
            Err(e) => assert!(e.contains("libcuda.so.1"), "{e}"),
        }
    }

    #[test]
    fn a_library_without_the_driver_symbols_is_refused() {
        // SAFETY: libc has no initialisers with preconditions.
        let lib = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        let err = bind(lib, "libc.so.6").err().unwrap();
        assert!(err.contains("cuInit"), "{err}");
    }
}
