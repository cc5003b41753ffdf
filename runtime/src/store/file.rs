//! A store in a directory, for processes on one host (torch's `FileStore`).

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{parse_counter, CasOutcome, Store, StoreError, StoreResult};

/// A [`Store`] whose keys are files in one directory shared by every process of a job on the
/// host. Writes are atomic (temp file + rename); read-modify-write operations hold an exclusive
/// `flock` on a lock file. `wait` re-checks with a short backoff (1 ms growing to 20 ms), since a
/// plain directory offers no portable change notification; that bounds its extra latency.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

fn backend(op: &'static str, path: &Path, e: std::io::Error) -> StoreError {
    StoreError::Backend {
        op,
        reason: format!("{}: {e}", path.display()),
    }
}

/// Hex-encodes a key so any UTF-8 key is a valid file name.
fn encode(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode(name: &str) -> Option<String> {
    if name.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..name.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(name.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

struct FileLock(fs::File);

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: the fd is open for the life of self.0.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl FileStore {
    /// A store in `dir`, created if missing.
    pub fn new(dir: impl Into<PathBuf>) -> StoreResult<Self> {
        let dir = dir.into();
        fs::create_dir_all(dir.join("keys")).map_err(|e| backend("open", &dir, e))?;
        Ok(FileStore { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join("keys").join(encode(key))
    }

    fn lock(&self, op: &'static str) -> StoreResult<FileLock> {
        let path = self.dir.join("lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| backend(op, &path, e))?;
        // SAFETY: the fd is valid; LOCK_EX blocks only while another holder runs one short
        // read-modify-write.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(backend(op, &path, std::io::Error::last_os_error()));
        }
        Ok(FileLock(f))
    }

    fn write(&self, op: &'static str, key: &str, value: &[u8]) -> StoreResult<()> {
        let path = self.path(key);
        let tmp = self.dir.join(format!(
            "tmp.{}.{:?}.{}",
            std::process::id(),
            std::thread::current().id(),
            encode(key)
        ));
        let mut f = fs::File::create(&tmp).map_err(|e| backend(op, &tmp, e))?;
        f.write_all(value).map_err(|e| backend(op, &tmp, e))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(|e| backend(op, &path, e))
    }

    fn read(&self, op: &'static str, key: &str) -> StoreResult<Option<Vec<u8>>> {
        let path = self.path(key);
        match fs::read(&path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(backend(op, &path, e)),
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.write("set", key, value)
    }

    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        self.read("get", key)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(1);
        let mut found: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        loop {
            for (slot, key) in found.iter_mut().zip(keys) {
                if slot.is_none() {
                    *slot = self.read("wait", key)?;
                }
            }
            if found.iter().all(Option::is_some) {
                return Ok(found.into_iter().flatten().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = keys
                    .iter()
                    .zip(&found)
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| k.to_string())
                    .collect();
                return Err(StoreError::Timeout { missing, timeout });
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        let _lock = self.lock("add")?;
        let old = match self.read("add", key)? {
            Some(v) => parse_counter(key, &v)?,
            None => 0,
        };
        let new = old.wrapping_add(delta);
        self.write("add", key, new.to_string().as_bytes())?;
        Ok(new)
    }

    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        let _lock = self.lock("compare_and_set")?;
        let current = self.read("compare_and_set", key)?;
        if current.as_deref() != expected {
            return Ok(CasOutcome::Current(current));
        }
        self.write("compare_and_set", key, value)?;
        Ok(CasOutcome::Swapped)
    }

    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        let _lock = self.lock("delete_prefix")?;
        let dir = self.dir.join("keys");
        let entries = fs::read_dir(&dir).map_err(|e| backend("delete_prefix", &dir, e))?;
        let mut n = 0;
        for entry in entries {
            let entry = entry.map_err(|e| backend("delete_prefix", &dir, e))?;
            let name = entry.file_name();
            let Some(key) = name.to_str().and_then(decode) else {
                continue;
            };
            if key.starts_with(prefix) {
                match fs::remove_file(entry.path()) {
                    Ok(()) => n += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(backend("delete_prefix", &entry.path(), e)),
                }
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conforms() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(FileStore::new(dir.path()).unwrap());
        super::super::testing::conformance(store).unwrap();
    }

    #[test]
    fn two_handles_share_state() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileStore::new(dir.path()).unwrap();
        let b = FileStore::new(dir.path()).unwrap();
        a.set("x/y", b"1").unwrap();
        assert_eq!(b.get("x/y").unwrap(), Some(b"1".to_vec()));
        assert_eq!(decode(&encode("a/b:c")).as_deref(), Some("a/b:c"));
    }
}
