//! Loading the NCCL shared library and the table of functions the backend calls.
//!
//! cudarc's own loader (`cudarc::nccl::sys::culib`) searches `libnccl.so`, `libnccl.so.1`,
//! `libnccl.so.12` and similar names, but not `libnccl.so.2`, the soname every NCCL 2.x release
//! ships: the `libnccl2` Debian package and the `nvidia-nccl-cu12` wheel contain only that name
//! (`libnccl.so` comes with the development package). It also panics when nothing is found, and
//! a library already opened under another name does not satisfy its `dlopen`, since the dynamic
//! linker matches names and sonames only. So the backend opens the library itself, resolves the
//! symbols it needs once, and reports a missing library, symbol or too old a version as an
//! error. The types (`ncclComm_t`, `ncclUniqueId`, `ncclConfig_t`, the enums) are cudarc's.
//!
//! Status codes are taken as plain integers: a newer library may return a code this build does
//! not know, which must not be read into a Rust enum.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId,
};

/// The environment variable that names the NCCL library file to load instead of searching,
/// for installs outside the loader's path (such as a wheel's
/// `site-packages/nvidia/nccl/lib/libnccl.so.2`).
pub const NCCL_LIBRARY_ENV: &str = "REKINDLE_NCCL_LIBRARY";

/// NCCL's status code (`ncclResult_t`).
pub(crate) type Status = c_int;
/// `ncclSuccess`.
pub(crate) const SUCCESS: Status = 0;
/// `ncclInProgress`: a non-blocking call is still running.
pub(crate) const IN_PROGRESS: Status = 7;
/// `ncclSystemError`: a socket or system call failed (typically a peer that went away).
pub(crate) const SYSTEM_ERROR: Status = 2;
/// `ncclRemoteError`: a peer reported a failure or vanished.
pub(crate) const REMOTE_ERROR: Status = 6;

/// The oldest NCCL with non-blocking communicators (`ncclConfig_t.blocking`).
pub(crate) const MIN_VERSION: c_int = 21400;

/// The version of the `ncclConfig_t` layout cudarc's bindings describe (NCCL 2.30); a library
/// reads only the part of the struct it knows (`size` tells it how much was passed).
pub(crate) const CONFIG_VERSION: u32 = 23000;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> Status;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> Status;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> Status;
type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut Status) -> Status;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> Status;
type GetErrorString = unsafe extern "C" fn(Status) -> *const c_char;
type GetLastError = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type Send = unsafe extern "C" fn(
    *const c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type Recv = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> Status;
type Group = unsafe extern "C" fn() -> Status;

/// The loaded library and the functions the backend uses. Lives for the whole process: NCCL
/// starts threads and must never be unloaded.
pub(crate) struct NcclLib {
    _lib: libloading::Library,
    /// The file name or path it was loaded from.
    pub path: String,
    /// NCCL's version code (`22105` is 2.21.5).
    pub version: c_int,
    pub get_unique_id: GetUniqueId,
    pub comm_init_rank_config: CommInitRankConfig,
    pub comm_get_async_error: CommGetAsyncError,
    pub comm_abort: CommFn,
    pub comm_finalize: CommFn,
    pub comm_destroy: CommFn,
    get_error_string: GetErrorString,
    get_last_error: Option<GetLastError>,
    pub all_reduce: AllReduce,
    pub broadcast: Broadcast,
    pub reduce: Reduce,
    pub all_gather: AllGather,
    /// Same signature as `ncclAllReduce` (the count is the per-rank receive count).
    pub reduce_scatter: AllReduce,
    pub send: Send,
    pub recv: Recv,
    pub group_start: Group,
    pub group_end: Group,
}

impl NcclLib {
    /// NCCL's name for a status code.
    pub fn status_name(&self, status: Status) -> String {
        // SAFETY: ncclGetErrorString accepts any code and returns a static C string (or null).
        let p = unsafe { (self.get_error_string)(status) };
        if p.is_null() {
            return format!("NCCL status {status}");
        }
        // SAFETY: non-null pointers from ncclGetErrorString are NUL-terminated static strings.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{s} (NCCL status {status})")
    }

    /// NCCL's last error message for `comm` (empty when the library has none).
    ///
    /// # Safety
    /// `comm` must be null or a communicator of this library that was not destroyed.
    pub unsafe fn last_error(&self, comm: ncclComm_t) -> String {
        let Some(f) = self.get_last_error else {
            return String::new();
        };
        let p = f(comm);
        if p.is_null() {
            return String::new();
        }
        CStr::from_ptr(p).to_string_lossy().trim().to_string()
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }
}

/// `22105` as `2.21.5` (NCCL's encoding since 2.9: major*10000 + minor*100 + patch).
pub(crate) fn version_string(code: c_int) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}

/// The process-wide NCCL library, loaded on first use; the error says what was tried.
pub(crate) fn nccl() -> Result<&'static NcclLib, String> {
    static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(|| load_first(&candidates()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The names to try, in order: the file named by [`NCCL_LIBRARY_ENV`] alone when it is set,
/// otherwise the soname, the development name, and cudarc's list.
pub(crate) fn candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(NCCL_LIBRARY_ENV).filter(|p| !p.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    let mut names = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Opens the first candidate that loads and checks it.
pub(crate) fn load_first(candidates: &[String]) -> Result<NcclLib, String> {
    let mut failures = Vec::new();
    for name in candidates {
        // SAFETY: loading NCCL runs its static initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib, name),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "cannot load the NCCL library (set {NCCL_LIBRARY_ENV} to its path to choose one); tried {}",
        failures.join("; ")
    ))
}

fn bind(lib: libloading::Library, path: &str) -> Result<NcclLib, String> {
    fn sym<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T, String> {
        let cname = format!("{name}\0");
        // SAFETY: every `T` used below is the C signature of the symbol of that name in nccl.h.
        unsafe { lib.get::<T>(cname.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{path} has no symbol {name} (NCCL 2.14 or newer is needed): {e}"))
    }
    let get_version: GetVersion = sym(&lib, path, "ncclGetVersion")?;
    let mut version: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    let status = unsafe { get_version(&mut version) };
    if status != SUCCESS {
        return Err(format!(
            "{path}: ncclGetVersion failed with NCCL status {status}"
        ));
    }
    if version < MIN_VERSION {
        return Err(format!(
            "{path} is NCCL {}, but non-blocking communicators need NCCL {} or newer",
            version_string(version),
            version_string(MIN_VERSION)
        ));
    }
    let get_last_error = sym::<GetLastError>(&lib, path, "ncclGetLastError").ok();
    Ok(NcclLib {
        path: path.to_string(),
        version,
        get_unique_id: sym(&lib, path, "ncclGetUniqueId")?,
        comm_init_rank_config: sym(&lib, path, "ncclCommInitRankConfig")?,
        comm_get_async_error: sym(&lib, path, "ncclCommGetAsyncError")?,
        comm_abort: sym(&lib, path, "ncclCommAbort")?,
        comm_finalize: sym(&lib, path, "ncclCommFinalize")?,
        comm_destroy: sym(&lib, path, "ncclCommDestroy")?,
        get_error_string: sym(&lib, path, "ncclGetErrorString")?,
        get_last_error,
        all_reduce: sym(&lib, path, "ncclAllReduce")?,
        broadcast: sym(&lib, path, "ncclBroadcast")?,
        reduce: sym(&lib, path, "ncclReduce")?,
        all_gather: sym(&lib, path, "ncclAllGather")?,
        reduce_scatter: sym(&lib, path, "ncclReduceScatter")?,
        send: sym(&lib, path, "ncclSend")?,
        recv: sym(&lib, path, "ncclRecv")?,
        group_start: sym(&lib, path, "ncclGroupStart")?,
        group_end: sym(&lib, path, "ncclGroupEnd")?,
        _lib: lib,
    })
}

/// A non-blocking communicator configuration: every field NCCL's initializer leaves undefined
/// stays undefined (`NCCL_CONFIG_UNDEF_INT`, null), except `blocking = 0`.
pub(crate) fn nonblocking_config() -> ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_like_nccl_prints_them() {
        assert_eq!(version_string(22105), "2.21.5");
        assert_eq!(version_string(23000), "2.30.0");
        assert_eq!(version_string(2804), "2.8.4");
    }

    #[test]
    fn the_soname_is_searched_first() {
        if std::env::var_os(NCCL_LIBRARY_ENV).is_some() {
            return;
        }
        let names = candidates();
        assert_eq!(names[0], "libnccl.so.2");
        assert!(names.iter().any(|n| n == "libnccl.so"));
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir
            .path()
            .join("libnccl.so.2")
            .to_string_lossy()
            .into_owned();
        let err = load_first(std::slice::from_ref(&missing)).err().unwrap();
        assert!(err.contains(&missing), "{err}");
        assert!(err.contains(NCCL_LIBRARY_ENV), "{err}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused() {
        // libc loads everywhere and has no ncclGetVersion.
        let err = load_first(&["libc.so.6".to_string()]).err().unwrap();
        assert!(err.contains("ncclGetVersion"), "{err}");
    }

    #[test]
    fn config_is_nonblocking_and_sized() {
        let c = nonblocking_config();
        assert_eq!(c.blocking, 0);
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(c.minCTAs, c_int::MIN);
    }
}
