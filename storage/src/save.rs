//! Writing checkpoints: tensor files, the manifest, and the atomic commit.
//!
//! The commit protocol, in order (each step is a failpoint, see [`crate::failpoint`]):
//! 1. take the root's lock and delete stale `.tmp-*` / `.trash-*` entries (their writers are
//!    dead: a live writer would hold the lock);
//! 2. create `.tmp-step-<N>-<unique>/` beside the target;
//! 3. write every safetensors file and fsync it;
//! 4. write `manifest.json` last and fsync it;
//! 5. fsync the temp dir;
//! 6. rename it to `step-<N>/` (never replacing an existing one);
//! 7. fsync the root.
//!
//! Until step 6 completes there is no `step-<N>/`; after it, the directory holds every file and
//! the manifest. A crash anywhere leaves either the old set of checkpoints or the new one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::checksum::{digests, file_checksum, to_hex};
use crate::error::{Result, StorageError};
use crate::failpoint::hit;
use crate::fsio::{self, DirLock};
use crate::manifest::{
    FileEntry, Manifest, TensorEntry, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE,
};
use crate::safetensors_file::{encode_header, file_order};
use crate::snapshot::{Snapshot, SnapshotEntry};
use crate::tensor::HostTensor;

/// The prefix of a checkpoint directory's name: `step-<N>`.
pub const STEP_PREFIX: &str = "step-";
/// The prefix of in-progress save directories.
pub(crate) const TMP_PREFIX: &str = ".tmp-step-";
/// The prefix of checkpoints being deleted by retention.
pub(crate) const TRASH_PREFIX: &str = ".trash-step-";

/// The directory name of step `step`'s checkpoint.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step}")
}

/// The step of a directory name `step-<N>`, if it is one.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The file a rank writes for a group: `<group>.safetensors` when one rank writes the whole
/// checkpoint, else `<group>-<rank>-of-<writers>.safetensors` (five digits each).
pub fn shard_file_name(group: &str, rank: usize, writers: usize) -> String {
    if writers <= 1 {
        format!("{group}.safetensors")
    } else {
        format!("{group}-{rank:05}-of-{writers:05}.safetensors")
    }
}

/// What a successful save produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitInfo {
    /// The step saved.
    pub step: u64,
    /// The committed `step-<N>/` directory.
    pub path: PathBuf,
    /// Bytes this process wrote (tensor files and, on rank 0, the manifest).
    pub bytes_written: u64,
    /// Steps deleted by retention after the commit.
    pub deleted: Vec<u64>,
}

/// A file written and synced, with its manifest entries.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct WrittenFiles {
    pub(crate) files: BTreeMap<String, FileEntry>,
    pub(crate) tensors: BTreeMap<String, TensorEntry>,
}

impl WrittenFiles {
    pub(crate) fn bytes(&self) -> u64 {
        self.files.values().map(|f| f.size).sum()
    }
}

/// Writes `entries` as the safetensors file `dir/name`, fsyncs it, and returns its entries.
/// The checksums are computed while the fsync waits for the disk.
fn write_file(
    dir: &Path,
    name: &str,
    entries: &[&SnapshotEntry],
    rank: usize,
    step: u64,
) -> Result<WrittenFiles> {
    let path = dir.join(name);
    let mut list: Vec<(&str, &HostTensor)> = entries
        .iter()
        .map(|e| (e.name.as_str(), &e.tensor))
        .collect();
    file_order(&mut list);
    let mut metadata = BTreeMap::new();
    // Hugging Face loaders expect a `format` entry; `pt` is what they accept everywhere.
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("rekindle.step".to_string(), step.to_string());
    let header = encode_header(&list, &metadata);
    let data_start = header.len() as u64;
    // Copy into the page cache on two cores, starting writeback of each tensor as soon as it
    // is written; then hash on every core while the fsync waits for the disk.
    let mut at = Vec::with_capacity(list.len());
    let mut offset = data_start;
    for (_, t) in &list {
        at.push(offset);
        offset += t.size_in_bytes() as u64;
    }
    let mut file = fsio::create_new(&path)?;
    fsio::preallocate(&file, &path, offset)?;
    fsio::write_all(&mut file, &path, &header)?;
    let half = list.len().div_ceil(2);
    write_parallel(&file, &path, &list[..half], &at[..half])?;
    hit("storage::save::file_partial")?;
    write_parallel(&file, &path, &list[half..], &at[half..])?;
    hit("storage::save::file_written")?;
    let pieces: Vec<&[u8]> = std::iter::once(header.as_slice())
        .chain(list.iter().map(|(_, t)| t.as_bytes()))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (synced, sums) = std::thread::scope(|s| {
        let sync = s.spawn(|| fsio::fsync_file(&file, &path));
        let sums = digests(&pieces, threads);
        (sync.join(), sums)
    });
    synced.unwrap_or_else(|_| {
        Err(StorageError::io(
            "fsync",
            &path,
            std::io::Error::other("fsync thread panicked"),
        ))
    })?;
    let (header_sum, tensor_sums) = (sums[0], sums[1..].to_vec());
    let file_sum = file_checksum(header_sum, &tensor_sums);
    let mut out = WrittenFiles {
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
    };
    let mut offset = 0u64;
    let device_of: BTreeMap<&str, String> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.device.to_string()))
        .collect();
    for ((tname, t), sum) in list.iter().zip(tensor_sums) {
        let end = offset + t.size_in_bytes() as u64;
        out.tensors.insert(
            tname.to_string(),
            TensorEntry {
                file: name.to_string(),
                dtype: t.dtype().safetensors_name().to_string(),
                shape: t.shape().to_vec(),
                data_offsets: [offset, end],
                xxh3: to_hex(sum),
                device: device_of
                    .get(tname)
                    .cloned()
                    .unwrap_or_else(|| "cpu".into()),
                rank,
            },
        );
        offset = end;
    }
    out.files.insert(
        name.to_string(),
        FileEntry {
            size: data_start + offset,
            xxh3: to_hex(file_sum),
            rank,
        },
    );
    Ok(out)
}

/// Writes tensors at their file offsets on two threads (copying into the page cache is
/// memory-bound; two cores copy faster than one), starting writeback of each one.
fn write_parallel(
    file: &std::fs::File,
    path: &Path,
    list: &[(&str, &HostTensor)],
    at: &[u64],
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    const WRITERS: usize = 2;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..WRITERS)
            .map(|k| {
                s.spawn(move || -> Result<()> {
                    for i in (k..list.len()).step_by(WRITERS) {
                        let bytes = list[i].1.as_bytes();
                        file.write_all_at(bytes, at[i])
                            .map_err(|e| StorageError::io("write", path, e))?;
                        fsio::start_writeback(file, at[i], bytes.len() as u64);
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| {
                Err(StorageError::io(
                    "write",
                    path,
                    std::io::Error::other("writer thread panicked"),
                ))
            })
        })
    })
}

/// Writes one rank's tensors into `dir`, one file per group.
pub(crate) fn write_rank_files(
    dir: &Path,
    snapshot: &Snapshot,
    rank: usize,
    writers: usize,
) -> Result<WrittenFiles> {
    let mut groups: BTreeMap<&str, Vec<&SnapshotEntry>> = BTreeMap::new();
    for e in snapshot.entries() {
        groups.entry(e.group.as_str()).or_default().push(e);
    }
    let mut all = WrittenFiles {
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
    };
    for (group, entries) in groups {
        let name = shard_file_name(group, rank, writers);
        let w = write_file(dir, &name, &entries, rank, snapshot.state.step)?;
        all.files.extend(w.files);
        all.tensors.extend(w.tensors);
    }
    hit("storage::save::files_synced")?;
    Ok(all)
}

/// Merges the written files of every rank, refusing duplicate tensor or file names.
pub(crate) fn merge(parts: Vec<WrittenFiles>, tmp: &Path) -> Result<WrittenFiles> {
    let mut all = WrittenFiles {
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
    };
    for part in parts {
        for (name, f) in part.files {
            if all.files.insert(name.clone(), f).is_some() {
                return Err(StorageError::InvalidArgument {
                    reason: format!("two ranks wrote the file {name}"),
                });
            }
        }
        for (name, t) in part.tensors {
            if all.tensors.insert(name.clone(), t).is_some() {
                return Err(StorageError::DuplicateTensor {
                    name,
                    path: tmp.to_path_buf(),
                });
            }
        }
    }
    Ok(all)
}

/// Holds the root's lock for one save and owns its temp dir until the commit.
pub(crate) struct SaveTxn {
    root: PathBuf,
    step: u64,
    tmp: PathBuf,
    lock: Option<DirLock>,
    committed: bool,
}

impl SaveTxn {
    /// Locks the root, refuses an existing `step-<N>/`, cleans stale temp dirs and creates a
    /// fresh one.
    pub(crate) fn begin(root: &Path, step: u64, lock_timeout: Duration) -> Result<SaveTxn> {
        let lock = DirLock::acquire(root, lock_timeout)?;
        let target = root.join(step_dir_name(step));
        if target.exists() {
            return Err(StorageError::AlreadyExists { path: target });
        }
        clean_stale(root)?;
        hit("storage::save::stale_cleaned")?;
        let tmp = root.join(format!("{TMP_PREFIX}{step}-{}", fsio::unique_suffix()));
        std::fs::create_dir(&tmp).map_err(|e| StorageError::io("create directory", &tmp, e))?;
        let txn = SaveTxn {
            root: root.to_path_buf(),
            step,
            tmp,
            lock: Some(lock),
            committed: false,
        };
        hit("storage::save::tmp_created")?;
        Ok(txn)
    }

    /// The temp dir files are written into.
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Writes the manifest last, syncs, renames into place and syncs the root. Returns the
    /// committed directory, the manifest's size, and the root's lock (still held, for
    /// retention).
    pub(crate) fn commit(
        mut self,
        state: &crate::manifest::TrainingState,
        written: WrittenFiles,
    ) -> Result<(PathBuf, u64, Option<DirLock>)> {
        let manifest = Manifest {
            format: FORMAT_NAME.to_string(),
            format_version: FORMAT_VERSION,
            state: state.clone(),
            created_unix_ms: fsio::unix_ms(),
            files: written.files,
            tensors: written.tensors,
        };
        let json = manifest.to_json();
        fsio::write_durable(&self.tmp.join(MANIFEST_FILE), &json)?;
        hit("storage::save::manifest_written")?;
        fsio::fsync_dir(&self.tmp)?;
        hit("storage::save::tmp_dir_synced")?;
        let target = self.root.join(step_dir_name(self.step));
        fsio::rename_no_replace(&self.tmp, &target)?;
        self.committed = true;
        hit("storage::save::renamed")?;
        fsio::fsync_dir(&self.root)?;
        hit("storage::save::parent_synced")?;
        Ok((target, json.len() as u64, self.lock.take()))
    }
}

impl Drop for SaveTxn {
    /// A save that did not commit removes its temp dir (best effort: what is left is stale and
    /// the next save removes it).
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Removes temp and trash entries of interrupted saves and deletions. Only called with the
/// root's lock held, so none of them belongs to a live writer.
fn clean_stale(root: &Path) -> Result<()> {
    let rd = std::fs::read_dir(root).map_err(|e| StorageError::io("read directory", root, e))?;
    for entry in rd {
        let entry = entry.map_err(|e| StorageError::io("read directory", root, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(TMP_PREFIX) || name.starts_with(TRASH_PREFIX) {
            let p = entry.path();
            tracing::info!(path = %p.display(), "removing the leftover of an interrupted save");
            std::fs::remove_dir_all(&p).map_err(|e| StorageError::io("remove", &p, e))?;
        }
    }
    Ok(())
}

/// Saves a whole snapshot from one process (replicated state, rank 0), committing it
/// atomically; returns the committed path, the bytes written and the root's lock.
pub(crate) fn save_single(
    root: &Path,
    snapshot: &Snapshot,
    lock_timeout: Duration,
) -> Result<(PathBuf, u64, Option<DirLock>)> {
    let txn = SaveTxn::begin(root, snapshot.state.step, lock_timeout)?;
    let written = write_rank_files(txn.tmp(), snapshot, 0, 1)?;
    let bytes = written.bytes();
    let (path, manifest_bytes, lock) = txn.commit(&snapshot.state, written)?;
    Ok((path, bytes + manifest_bytes, lock))
}

/// The time left before `deadline`, or zero.
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names() {
        assert_eq!(step_dir_name(12), "step-12");
        assert_eq!(parse_step_dir_name("step-12"), Some(12));
        for bad in ["step-", "step-1a", "step--1", "steps-1", ".tmp-step-1"] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
        assert_eq!(shard_file_name("model", 0, 1), "model.safetensors");
        assert_eq!(
            shard_file_name("model", 1, 4),
            "model-00001-of-00004.safetensors"
        );
    }
}
