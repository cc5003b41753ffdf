//! Durable file-system steps of the commit protocol: exclusive creation, fsync of files and
//! directories, rename without replacing, and the directory lock that makes stale-temp-dir
//! cleanup safe.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Result, StorageError};

/// Creates `path`, failing if it exists.
pub(crate) fn create_new(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| StorageError::io("create", path, e))
}

/// Writes `bytes` to `file` (named `path` in errors).
pub(crate) fn write_all(file: &mut File, path: &Path, bytes: &[u8]) -> Result<()> {
    file.write_all(bytes)
        .map_err(|e| StorageError::io("write", path, e))
}

/// Flushes `file`'s data and metadata to stable storage.
pub(crate) fn fsync_file(file: &File, path: &Path) -> Result<()> {
    file.sync_all()
        .map_err(|e| StorageError::io("fsync", path, e))
}

/// Reserves `len` bytes for `file` up front, so a full disk fails the save before any data is
/// copied and the filesystem can allocate the file in one extent. Filesystems without
/// `fallocate` are fine: the writes allocate as they go.
pub(crate) fn preallocate(file: &File, path: &Path, len: u64) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open; mode 0 only allocates blocks.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => Ok(()),
        _ => Err(StorageError::io("allocate", path, err)),
    }
}

/// Asks the kernel to start writing `len` bytes at `offset` back to disk now, without waiting;
/// the fsync that follows then has less left to do. Advisory: failures are ignored (the fsync
/// reports real errors).
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open; sync_file_range only schedules I/O on it.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Flushes a directory's entries (new names, renames) to stable storage.
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    let dir = File::open(path).map_err(|e| StorageError::io("open directory", path, e))?;
    dir.sync_all()
        .map_err(|e| StorageError::io("fsync directory", path, e))
}

/// Creates `path` with `bytes` and fsyncs it.
pub(crate) fn write_durable(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = create_new(path)?;
    write_all(&mut f, path, bytes)?;
    fsync_file(&f, path)
}

/// Renames `from` to `to`, failing with [`StorageError::AlreadyExists`] if `to` exists (a
/// plain rename would silently replace an empty directory).
pub(crate) fn rename_no_replace(from: &Path, to: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let cstr = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| StorageError::InvalidArgument {
            reason: format!("path {} contains a NUL byte", p.display()),
        })
    };
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: both arguments are valid NUL-terminated paths; AT_FDCWD resolves them relative to
    // the working directory like rename(2).
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EEXIST) | Some(libc::ENOTEMPTY) => Err(StorageError::AlreadyExists {
            path: to.to_path_buf(),
        }),
        // Filesystems without RENAME_NOREPLACE: check, then rename (the directory lock keeps
        // other rekindle savers out of the gap).
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            if to.exists() {
                return Err(StorageError::AlreadyExists {
                    path: to.to_path_buf(),
                });
            }
            std::fs::rename(from, to).map_err(|e| StorageError::io("rename", from, e))
        }
        _ => Err(StorageError::io("rename", from, err)),
    }
}

/// A name suffix unique within this host: process id, time and a counter.
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!(
        "{}-{:x}-{}",
        std::process::id(),
        nanos,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// An exclusive `flock` on the checkpoint root's lock file, held for the whole of a save or a
/// retention pass. The kernel drops it when the holder dies, so a crashed save never blocks the
/// next one, and whoever holds it knows that every temp dir it did not create is stale.
pub(crate) struct DirLock {
    _file: File,
}

/// The lock file's name inside the checkpoint root.
pub(crate) const LOCK_FILE: &str = ".rekindle-ckpt.lock";

impl DirLock {
    /// Takes the lock, waiting at most `timeout`.
    pub(crate) fn acquire(root: &Path, timeout: Duration) -> Result<DirLock> {
        use std::os::fd::AsRawFd;
        let path: PathBuf = root.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StorageError::io("open lock", &path, e))?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(1);
        loop {
            // SAFETY: the descriptor is open for the duration of the call.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(DirLock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(StorageError::io("lock", &path, err));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StorageError::LockTimeout { path, timeout });
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }
}
