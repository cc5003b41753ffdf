//! Finding and loading the NCCL shared library, and the table of functions the backend calls.
//!
//! NCCL 2.x ships under the soname `libnccl.so.2` (the `libnccl2` Debian package and the
//! `nvidia-nccl-cu*` Python wheels have only that name; `libnccl.so` comes with the development
//! package). The library is opened with `dlopen` at run time, so building needs nothing from
//! NVIDIA, and a missing library, symbol or too old a version is an error, never a panic.
//!
//! Search order: the file [`NCCL_LIBRARY_ENV`] names, alone, when it is set; otherwise the
//! loader's path (`libnccl.so.2`, `libnccl.so`), then the `nvidia/nccl/lib/libnccl.so.2` of
//! Python wheels under the environments in sight (`VIRTUAL_ENV`, `CONDA_PREFIX`, the prefixes
//! of `PATH`'s `bin` folders, `PYTHONPATH`, `~/.local`, `/usr/local`, `/usr`). The first
//! library of version [`MIN_VERSION`] or newer wins: an older one found earlier on the
//! loader's path does not hide a newer one in a wheel. A successful load is kept for the life of
//! the process (NCCL starts threads and must never be unloaded); a failure is not, so a later
//! call searches again.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use super::sys::{CommHandle, Config, CuStream, DataType, RedOp, Status, UniqueId, SUCCESS};

/// The environment variable that names the NCCL library file to load instead of searching,
/// for installs outside the loader's path and the places searched (such as a wheel's
/// `site-packages/nvidia/nccl/lib/libnccl.so.2` in an environment that is not active).
pub const NCCL_LIBRARY_ENV: &str = "REKINDLE_NCCL_LIBRARY";

/// The oldest NCCL the backend accepts: 2.18 (non-blocking communicators, `ncclCommFinalize`,
/// `ncclGetLastError`, and the unique-id layout `bootstrap.rs` reads to release a round's
/// bootstrap root).
pub(crate) const MIN_VERSION: c_int = 21800;

/// The first NCCL that runs several ranks of one communicator on one GPU (with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`).
pub(crate) const MULTI_RANK_GPU_VERSION: c_int = 23003;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> Status;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> Status;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut CommHandle, c_int, UniqueId, c_int, *mut Config) -> Status;
type CommGetAsyncError = unsafe extern "C" fn(CommHandle, *mut Status) -> Status;
type CommFn = unsafe extern "C" fn(CommHandle) -> Status;
type GetErrorString = unsafe extern "C" fn(Status) -> *const c_char;
type GetLastError = unsafe extern "C" fn(CommHandle) -> *const c_char;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    RedOp,
    CommHandle,
    CuStream,
) -> Status;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    c_int,
    CommHandle,
    CuStream,
) -> Status;
type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    RedOp,
    c_int,
    CommHandle,
    CuStream,
) -> Status;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    CommHandle,
    CuStream,
) -> Status;
type Send =
    unsafe extern "C" fn(*const c_void, usize, DataType, c_int, CommHandle, CuStream) -> Status;
type Recv =
    unsafe extern "C" fn(*mut c_void, usize, DataType, c_int, CommHandle, CuStream) -> Status;
type Group = unsafe extern "C" fn() -> Status;

/// The loaded library and the functions the backend uses.
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
    get_last_error: GetLastError,
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
        let known = super::sys::status_enum_name(status).unwrap_or("unknown NCCL status");
        if p.is_null() {
            return format!("{known} ({status})");
        }
        // SAFETY: non-null pointers from ncclGetErrorString are NUL-terminated static strings.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{known} ({status}): {s}")
    }

    /// NCCL's last error message for `comm` (empty when the library has none).
    ///
    /// # Safety
    /// `comm` must be null or a communicator of this library that was not destroyed.
    pub unsafe fn last_error(&self, comm: CommHandle) -> String {
        let p = (self.get_last_error)(comm);
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

/// The process-wide NCCL library. Loaded on the first successful call and kept; a failure
/// is returned (saying what was tried) and the next call searches again.
pub(crate) fn nccl() -> Result<&'static NcclLib, String> {
    static LIB: Mutex<Option<&'static NcclLib>> = Mutex::new(None);
    load_once(&LIB, || load_first(&candidates()))
}

/// The value in `slot`, or the result of `load`, kept in `slot` if it succeeded.
fn load_once<T>(
    slot: &Mutex<Option<&'static T>>,
    load: impl FnOnce() -> Result<T, String>,
) -> Result<&'static T, String> {
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(value) = *slot {
        return Ok(value);
    }
    let value: &'static T = Box::leak(Box::new(load()?));
    *slot = Some(value);
    Ok(value)
}

/// The files to try, in order (see the module documentation).
pub(crate) fn candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(NCCL_LIBRARY_ENV).filter(|p| !p.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    let mut names = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    for path in wheel_libraries(&python_prefixes()) {
        let path = path.to_string_lossy().into_owned();
        if !names.contains(&path) {
            names.push(path);
        }
    }
    names
}

/// The environments whose Python packages may hold an NCCL wheel, most specific first:
/// `VIRTUAL_ENV`, `CONDA_PREFIX`, the parent of each `bin` folder on `PATH`, `~/.local`,
/// `/usr/local`, `/usr`; plus `PYTHONPATH`'s folders as they are (marked by a trailing `/`).
pub(crate) fn python_prefixes() -> Vec<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let mut out: Vec<PathBuf> = Vec::new();
    out.extend(var("VIRTUAL_ENV").map(PathBuf::from));
    out.extend(var("CONDA_PREFIX").map(PathBuf::from));
    if let Some(path) = var("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.file_name().is_some_and(|n| n == "bin") {
                out.extend(dir.parent().map(Path::to_path_buf));
            }
        }
    }
    out.extend(var("HOME").map(|h| PathBuf::from(h).join(".local")));
    out.push(PathBuf::from("/usr/local"));
    out.push(PathBuf::from("/usr"));
    if let Some(pp) = var("PYTHONPATH") {
        for dir in std::env::split_paths(&pp) {
            // A PYTHONPATH entry is itself a packages folder: mark it as such.
            let mut marked = dir.into_os_string();
            marked.push("/");
            out.push(PathBuf::from(marked));
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// The `nvidia/nccl/lib/libnccl.so.2` files that exist under the package folders of
/// `prefixes`: `<prefix>/lib/python3*/{site,dist}-packages` and `<prefix>/lib/python3/
/// dist-packages` for an environment prefix, the folder itself for one with a trailing `/`.
pub(crate) fn wheel_libraries(prefixes: &[PathBuf]) -> Vec<PathBuf> {
    const IN_PACKAGES: &str = "nvidia/nccl/lib/libnccl.so.2";
    let mut out = Vec::new();
    for prefix in prefixes {
        let mut package_dirs = Vec::new();
        if prefix.as_os_str().to_string_lossy().ends_with('/') {
            package_dirs.push(prefix.clone());
        } else {
            let lib = prefix.join("lib");
            let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path())
                .collect();
            // Newest Python first (python3.12 before python3.9), then the unversioned one.
            pythons.sort_by_key(|p| {
                let name = p
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                let minor: u32 = name
                    .strip_prefix("python3.")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(0);
                std::cmp::Reverse(minor)
            });
            for py in pythons {
                package_dirs.push(py.join("site-packages"));
                package_dirs.push(py.join("dist-packages"));
            }
        }
        for dir in package_dirs {
            let file = dir.join(IN_PACKAGES);
            if file.is_file() && !out.contains(&file) {
                out.push(file);
            }
        }
    }
    out
}

/// Opens the candidates in order and keeps the first that binds and is new enough; an error
/// lists what each candidate was (missing, not NCCL, too old).
pub(crate) fn load_first(candidates: &[String]) -> Result<NcclLib, String> {
    let mut failures = Vec::new();
    for name in candidates {
        // SAFETY: loading NCCL runs its static initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => match bind(lib, name) {
                Ok(nccl) => return Ok(nccl),
                Err(e) => failures.push(e),
            },
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "cannot load an NCCL library of version {} or newer (set {NCCL_LIBRARY_ENV} to the \
         path of a libnccl.so.2 to choose one); tried {}",
        version_string(MIN_VERSION),
        failures.join("; ")
    ))
}

/// Binds the symbols of an opened library. A library that is too old is left loaded (never
/// unloading NCCL is safer than running its destructors) and reported.
fn bind(lib: libloading::Library, path: &str) -> Result<NcclLib, String> {
    fn sym<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T, String> {
        let cname = format!("{name}\0");
        // SAFETY: every `T` used below is the C signature of the symbol of that name in nccl.h.
        unsafe { lib.get::<T>(cname.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{path} has no symbol {name}: {e}"))
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
        std::mem::forget(lib);
        return Err(format!(
            "{path} is NCCL {}, older than {}",
            version_string(version),
            version_string(MIN_VERSION)
        ));
    }
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
        get_last_error: sym(&lib, path, "ncclGetLastError")?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_like_nccl_prints_them() {
        assert_eq!(version_string(22105), "2.21.5");
        assert_eq!(version_string(23003), "2.30.3");
        assert_eq!(version_string(2804), "2.8.4");
        assert_eq!(version_string(MIN_VERSION), "2.18.0");
    }

    #[test]
    fn the_soname_is_searched_first_and_names_are_unique() {
        if std::env::var_os(NCCL_LIBRARY_ENV).is_some() {
            return;
        }
        let names = candidates();
        assert_eq!(names[..2], ["libnccl.so.2", "libnccl.so"]);
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
    }

    #[test]
    fn wheels_are_found_in_environments_and_pythonpath_folders() {
        let dir = tempfile::tempdir().unwrap();
        let touch = |rel: &str| {
            let p = dir.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"").unwrap();
            p
        };
        let venv_old = touch("venv/lib/python3.9/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let venv_new = touch("venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let debian = touch("usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2");
        let loose = touch("pp/nvidia/nccl/lib/libnccl.so.2");
        touch("empty/lib/python3.11/site-packages/nvidia/cublas/lib/libcublas.so.12");
        let mut pp = dir.path().join("pp").into_os_string();
        pp.push("/");
        let prefixes = [
            dir.path().join("missing"),
            dir.path().join("empty"),
            dir.path().join("venv"),
            dir.path().join("usr"),
            PathBuf::from(pp),
        ];
        assert_eq!(
            wheel_libraries(&prefixes),
            vec![venv_new, venv_old, debian, loose]
        );
        assert!(wheel_libraries(&[]).is_empty());
    }

    #[test]
    fn a_missing_library_is_an_error_that_names_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir
            .path()
            .join("libnccl.so.2")
            .to_string_lossy()
            .into_owned();
        let err = load_first(std::slice::from_ref(&missing)).err().unwrap();
        assert!(err.contains(&missing), "{err}");
        assert!(err.contains(NCCL_LIBRARY_ENV), "{err}");
        assert!(err.contains("2.18.0"), "{err}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused_and_the_next_one_tried() {
        // libc and libm load everywhere and have no ncclGetVersion.
        let err = load_first(&["libc.so.6".to_string(), "libm.so.6".to_string()])
            .err()
            .unwrap();
        assert!(
            err.contains("libc.so.6 has no symbol ncclGetVersion"),
            "{err}"
        );
        assert!(
            err.contains("libm.so.6 has no symbol ncclGetVersion"),
            "{err}"
        );
    }

    #[test]
    fn a_failed_load_is_retried_and_a_success_kept() {
        static SLOT: Mutex<Option<&'static u32>> = Mutex::new(None);
        let mut calls = 0;
        let mut attempt = |ok: bool| {
            load_once(&SLOT, || {
                calls += 1;
                if ok {
                    Ok(calls)
                } else {
                    Err(format!("attempt {calls} failed"))
                }
            })
        };
        assert_eq!(attempt(false), Err("attempt 1 failed".to_string()));
        assert_eq!(attempt(false), Err("attempt 2 failed".to_string()));
        assert_eq!(attempt(true), Ok(&3));
        assert_eq!(attempt(false), Ok(&3), "a loaded library is kept");
        assert_eq!(calls, 3);
    }
}
