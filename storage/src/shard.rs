//! Sharded saves: every shard owner writes its files into rank 0's temp dir, reports them
//! durable through the [`Store`], and rank 0 commits one manifest.
//!
//! Keys, under the coordinator's prefix (give each round of a job its own, e.g. a
//! `PrefixStore` per round): `ckpt/step-<N>/tmpdir` (rank 0: the temp dir's name),
//! `ckpt/step-<N>/shard/<rank>` (each rank: its files and tensors once fsynced, or its error),
//! `ckpt/step-<N>/commit` (rank 0: the outcome). Every wait is bounded by one deadline.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rekindle_runtime::store::{Store, StoreError};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};
use crate::fsio::DirLock;
use crate::save::{
    merge, remaining, step_dir_name, write_rank_files, CommitInfo, SaveTxn, WrittenFiles,
};
use crate::snapshot::Snapshot;

/// How the ranks of one sharded save meet.
#[derive(Clone)]
pub struct ShardCoordinator {
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    prefix: String,
}

impl std::fmt::Debug for ShardCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardCoordinator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl ShardCoordinator {
    /// Rank `rank` of `world_size` shard owners; every wait of a save is bounded by `timeout`
    /// from its start.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ShardCoordinator> {
        if world_size == 0 || rank >= world_size {
            return Err(StorageError::InvalidArgument {
                reason: format!("rank {rank} of world size {world_size}"),
            });
        }
        Ok(ShardCoordinator {
            store,
            rank,
            world_size,
            timeout,
            prefix: String::new(),
        })
    }

    /// Puts the save's keys under `prefix`.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> ShardCoordinator {
        self.prefix = prefix.into();
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of shard owners.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn key(&self, step: u64, what: &str) -> String {
        format!("{}ckpt/{}/{what}", self.prefix, step_dir_name(step))
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Outcome<T> {
    Ok(T),
    Error(String),
}

fn publish<T: Serialize>(c: &ShardCoordinator, step: u64, key: &str, v: &Outcome<T>) -> Result<()> {
    let bytes = serde_json::to_vec(v).unwrap_or_default();
    c.store
        .set(key, &bytes)
        .map_err(|source| StorageError::Store {
            step,
            rank: c.rank,
            source,
        })
}

fn parse<T: for<'de> Deserialize<'de>>(
    c: &ShardCoordinator,
    step: u64,
    key: &str,
    bytes: &[u8],
) -> Result<Outcome<T>> {
    serde_json::from_slice(bytes).map_err(|e| StorageError::Store {
        step,
        rank: c.rank,
        source: StoreError::InvalidValue {
            key: key.to_string(),
            reason: e.to_string(),
        },
    })
}

fn wait_one(c: &ShardCoordinator, step: u64, key: &str, deadline: Instant) -> Result<Vec<u8>> {
    match c.store.wait(&[key], remaining(deadline)) {
        Ok(mut v) => Ok(v.pop().unwrap_or_default()),
        Err(StoreError::Timeout { .. }) => Err(StorageError::ShardTimeout {
            step,
            missing: vec![0],
            timeout: c.timeout,
        }),
        Err(source) => Err(StorageError::Store {
            step,
            rank: c.rank,
            source,
        }),
    }
}

/// One rank's part of a sharded save; see [`crate::CheckpointDir::save_sharded`].
pub(crate) fn save_sharded(
    root: &Path,
    snapshot: &Snapshot,
    c: &ShardCoordinator,
    lock_timeout: Duration,
) -> Result<(CommitInfo, Option<DirLock>)> {
    let step = snapshot.state.step;
    let deadline = Instant::now() + c.timeout;
    if c.rank == 0 {
        rank0(root, snapshot, c, lock_timeout, deadline)
    } else {
        let info = other_rank(root, snapshot, c, deadline)?;
        debug_assert_eq!(info.step, step);
        Ok((info, None))
    }
}

fn rank0(
    root: &Path,
    snapshot: &Snapshot,
    c: &ShardCoordinator,
    lock_timeout: Duration,
    deadline: Instant,
) -> Result<(CommitInfo, Option<DirLock>)> {
    let step = snapshot.state.step;
    let tmp_key = c.key(step, "tmpdir");
    let commit_key = c.key(step, "commit");
    let fail = |e: StorageError| -> StorageError {
        let _ = publish::<String>(c, step, &commit_key, &Outcome::Error(e.to_string()));
        e
    };
    let txn = match SaveTxn::begin(root, step, lock_timeout.min(c.timeout)) {
        Ok(t) => t,
        Err(e) => {
            let _ = publish::<String>(c, step, &tmp_key, &Outcome::Error(e.to_string()));
            return Err(fail(e));
        }
    };
    let tmp_name = txn
        .tmp()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    publish(c, step, &tmp_key, &Outcome::Ok(tmp_name)).map_err(fail)?;
    let own = write_rank_files(txn.tmp(), snapshot, 0, c.world_size).map_err(fail)?;
    let keys: Vec<String> = (1..c.world_size)
        .map(|r| c.key(step, &format!("shard/{r}")))
        .collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = match c.store.wait(&key_refs, remaining(deadline)) {
        Ok(v) => v,
        Err(StoreError::Timeout { missing, .. }) => {
            let missing = missing
                .iter()
                .filter_map(|k| k.rsplit('/').next()?.parse().ok())
                .collect();
            return Err(fail(StorageError::ShardTimeout {
                step,
                missing,
                timeout: c.timeout,
            }));
        }
        Err(source) => {
            return Err(fail(StorageError::Store {
                step,
                rank: 0,
                source,
            }))
        }
    };
    let mut parts = vec![own.clone()];
    for (i, v) in values.iter().enumerate() {
        match parse::<WrittenFiles>(c, step, &keys[i], v).map_err(fail)? {
            Outcome::Ok(w) => parts.push(w),
            Outcome::Error(reason) => {
                return Err(fail(StorageError::ShardFailed {
                    step,
                    rank: i + 1,
                    reason,
                }))
            }
        }
    }
    let merged = merge(parts, txn.tmp()).map_err(fail)?;
    for (name, f) in &merged.files {
        let p = txn.tmp().join(name);
        let len = std::fs::metadata(&p).map(|m| m.len()).map_err(|_| {
            fail(StorageError::MissingFile {
                path: p.clone(),
                rank: f.rank,
            })
        })?;
        if len != f.size {
            return Err(fail(StorageError::SizeMismatch {
                path: p,
                expected: f.size,
                actual: len,
            }));
        }
    }
    let (path, manifest_bytes, lock) = txn.commit(&snapshot.state, merged).map_err(fail)?;
    publish(
        c,
        step,
        &commit_key,
        &Outcome::Ok(path.display().to_string()),
    )?;
    Ok((
        CommitInfo {
            step,
            path,
            bytes_written: own.bytes() + manifest_bytes,
            deleted: Vec::new(),
        },
        lock,
    ))
}

fn other_rank(
    root: &Path,
    snapshot: &Snapshot,
    c: &ShardCoordinator,
    deadline: Instant,
) -> Result<CommitInfo> {
    let step = snapshot.state.step;
    let tmp_key = c.key(step, "tmpdir");
    let shard_key = c.key(step, &format!("shard/{}", c.rank));
    let bytes = wait_one(c, step, &tmp_key, deadline)?;
    let tmp: PathBuf = match parse::<String>(c, step, &tmp_key, &bytes)? {
        Outcome::Ok(name) if !name.contains('/') && !name.is_empty() => root.join(name),
        Outcome::Ok(name) => {
            return Err(StorageError::ShardFailed {
                step,
                rank: 0,
                reason: format!("invalid temp dir name {name:?}"),
            })
        }
        Outcome::Error(reason) => {
            return Err(StorageError::ShardFailed {
                step,
                rank: 0,
                reason,
            })
        }
    };
    let written = match write_rank_files(&tmp, snapshot, c.rank, c.world_size) {
        Ok(w) => w,
        Err(e) => {
            let _ = publish::<WrittenFiles>(c, step, &shard_key, &Outcome::Error(e.to_string()));
            return Err(e);
        }
    };
    publish(c, step, &shard_key, &Outcome::Ok(written.clone()))?;
    let bytes = wait_one(c, step, &c.key(step, "commit"), deadline)?;
    match parse::<String>(c, step, "commit", &bytes)? {
        Outcome::Ok(_) => Ok(CommitInfo {
            step,
            path: root.join(step_dir_name(step)),
            bytes_written: written.bytes(),
            deleted: Vec::new(),
        }),
        Outcome::Error(reason) => Err(StorageError::ShardFailed {
            step,
            rank: 0,
            reason,
        }),
    }
}
