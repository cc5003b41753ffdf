//! A checkpoint root directory: save, list, load the newest valid checkpoint, prune.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Result, StorageError};
use crate::fsio::DirLock;
use crate::load::{Checkpoint, LoadOptions};
use crate::manifest::MANIFEST_FILE;
use crate::retention::{delete_step, plan_retention, RetentionPolicy};
use crate::save::{parse_step_dir_name, save_single, step_dir_name, CommitInfo};
use crate::shard::{save_sharded, ShardCoordinator};
use crate::snapshot::Snapshot;

/// The default time a save waits for another save of the same root to release the lock.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(600);

/// A directory holding `step-<N>/` checkpoints.
///
/// ```
/// use rekindle_storage::{CheckpointDir, HostTensor, LoadOptions, Snapshot, TensorSource, TrainingState};
///
/// let root = tempfile::tempdir().unwrap();
/// let dir = CheckpointDir::new(root.path()).unwrap();
/// let mut snap = Snapshot::new(TrainingState { step: 3, ..Default::default() });
/// snap.insert("w", HostTensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap()).unwrap();
/// dir.save(&snap).unwrap();
///
/// let ckpt = dir.load_latest(&LoadOptions::default()).unwrap();
/// assert_eq!(ckpt.step(), 3);
/// assert_eq!(ckpt.tensor("w").unwrap().as_slice::<f32>().unwrap(), &[1.0, 2.0]);
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: PathBuf,
    retention: Option<RetentionPolicy>,
    lock_timeout: Duration,
}

impl CheckpointDir {
    /// Uses `root`, creating it if needed.
    pub fn new(root: impl Into<PathBuf>) -> Result<CheckpointDir> {
        let root = root.into();
        std::fs::create_dir_all(&root)
            .map_err(|e| StorageError::io("create directory", &root, e))?;
        Ok(CheckpointDir {
            root,
            retention: None,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        })
    }

    /// Applies `policy` after every successful save.
    pub fn with_retention(mut self, policy: RetentionPolicy) -> CheckpointDir {
        self.retention = Some(policy);
        self
    }

    /// Sets how long a save waits for another save of this root.
    pub fn with_lock_timeout(mut self, timeout: Duration) -> CheckpointDir {
        self.lock_timeout = timeout;
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of step `step`'s checkpoint (whether or not it exists).
    pub fn step_path(&self, step: u64) -> PathBuf {
        self.root.join(step_dir_name(step))
    }

    /// Saves a snapshot written by this process alone (replicated state: call it on rank 0
    /// only). Returns once the checkpoint is committed and durable; on error no `step-<N>/`
    /// appears and the previous checkpoints are untouched.
    pub fn save(&self, snapshot: &Snapshot) -> Result<CommitInfo> {
        let (path, bytes, lock) = save_single(&self.root, snapshot, self.lock_timeout)?;
        let deleted = self.retain(snapshot.state.step, lock)?;
        Ok(CommitInfo {
            step: snapshot.state.step,
            path,
            bytes_written: bytes,
            deleted,
        })
    }

    /// Saves this rank's shard of a checkpoint written by several ranks. Every rank calls it
    /// with its own tensors; rank 0 (which also writes the replicated state it holds) commits
    /// the manifest once every rank has reported its files durable through the store. Each
    /// rank returns once the checkpoint is committed, or with an error by the coordinator's
    /// deadline. The root must be the same directory for every rank (a shared filesystem).
    pub fn save_sharded(
        &self,
        snapshot: &Snapshot,
        coord: &ShardCoordinator,
    ) -> Result<CommitInfo> {
        let (mut info, lock) = save_sharded(&self.root, snapshot, coord, self.lock_timeout)?;
        if coord.rank() == 0 {
            info.deleted = self.retain(snapshot.state.step, lock)?;
        }
        Ok(info)
    }

    fn retain(&self, newest: u64, lock: Option<DirLock>) -> Result<Vec<u64>> {
        let Some(policy) = self.retention else {
            return Ok(Vec::new());
        };
        let steps = self.committed_steps()?;
        let delete = plan_retention(&steps, Some(newest), &policy);
        for &s in &delete {
            delete_step(&self.root, s)?;
        }
        drop(lock);
        Ok(delete)
    }

    /// The steps with a committed checkpoint (a `step-<N>/` holding a manifest), ascending.
    /// Committed does not mean valid: [`CheckpointDir::load_latest`] verifies.
    pub fn committed_steps(&self) -> Result<Vec<u64>> {
        let rd = std::fs::read_dir(&self.root)
            .map_err(|e| StorageError::io("read directory", &self.root, e))?;
        let mut steps = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| StorageError::io("read directory", &self.root, e))?;
            let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
                continue;
            };
            if entry.path().join(MANIFEST_FILE).is_file() {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    /// Opens step `step`'s checkpoint.
    pub fn load_step(&self, step: u64, opts: &LoadOptions) -> Result<Checkpoint> {
        let path = self.step_path(step);
        if !path.join(MANIFEST_FILE).exists() {
            return Err(StorageError::StepNotFound {
                dir: self.root.clone(),
                step,
            });
        }
        Checkpoint::open(&path, opts)
    }

    /// Opens the newest committed checkpoint that passes the verification `opts` asks for. A
    /// newer one that fails is reported with a `tracing` warning naming the problem and skipped.
    /// Errors of the request itself (a CUDA map-location in a build without CUDA) are returned
    /// at once. With no checkpoint at all: [`StorageError::NoValidCheckpoint`] with 0 skipped.
    pub fn load_latest(&self, opts: &LoadOptions) -> Result<Checkpoint> {
        let steps = self.committed_steps()?;
        let mut skipped = 0;
        for &step in steps.iter().rev() {
            match Checkpoint::open(&self.step_path(step), opts) {
                Ok(c) => {
                    if skipped > 0 {
                        tracing::warn!(step, skipped, "resuming from an older checkpoint");
                    }
                    return Ok(c);
                }
                Err(e @ StorageError::CudaNotCompiled { .. }) => return Err(e),
                Err(e) => {
                    tracing::warn!(step, error = %e, "skipping checkpoint that does not verify");
                    skipped += 1;
                }
            }
        }
        Err(StorageError::NoValidCheckpoint {
            dir: self.root.clone(),
            skipped,
        })
    }

    /// Applies `policy` now: the newest checkpoint that verifies fully is kept whatever the
    /// policy says. Returns the deleted steps.
    pub fn prune(&self, policy: &RetentionPolicy) -> Result<Vec<u64>> {
        let lock = DirLock::acquire(&self.root, self.lock_timeout)?;
        let steps = self.committed_steps()?;
        let opts = LoadOptions::default();
        let valid = steps
            .iter()
            .rev()
            .copied()
            .find(|&s| Checkpoint::open(&self.step_path(s), &opts).is_ok());
        let delete = plan_retention(&steps, valid, policy);
        for &s in &delete {
            delete_step(&self.root, s)?;
        }
        drop(lock);
        Ok(delete)
    }
}
