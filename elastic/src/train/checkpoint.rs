//! The elastic loop's checkpoints: finding the newest one that verifies at start-up (moving
//! aside newer ones that do not), the loop's own state in a checkpoint (step, epoch, sampler
//! cursor), and writing: one writer in the background for replicated state, every rank's shard
//! under one manifest for sharded state.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;
use rekindle_runtime::sampler::{ElasticSampler, ElasticState};
use rekindle_runtime::store::{PrefixStore, Store};
use rekindle_storage::{
    AsyncCheckpointer, Checkpoint, CheckpointDir, Layout, LoadOptions, RetentionPolicy,
    ShardCoordinator, Snapshot, StorageError, TrainingState,
};

use super::TrainError;

/// The checkpoint group of the parameters.
pub(crate) const MODEL_GROUP: &str = "model";
/// The checkpoint group of optimizer and sampler state.
pub(crate) const STATE_GROUP: &str = "state";

/// How long a checkpoint in flight is waited for at shutdown and preemption.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(600);

/// The loop's checkpoint directory and the save in flight.
pub(crate) struct Checkpoints {
    rank: usize,
    writer: Arc<AsyncCheckpointer>,
    /// The step of the last checkpoint this process committed or resumed from.
    last: Option<u64>,
}

impl Checkpoints {
    /// The checkpoints of `dir`, keeping the newest `keep`.
    pub fn new(dir: &Path, keep: usize, rank: usize) -> Result<Checkpoints, TrainError> {
        let ck = |source| TrainError::Checkpoint { rank, source };
        let policy = RetentionPolicy::last(keep.max(1)).map_err(ck)?;
        let dir = CheckpointDir::new(dir.to_path_buf())
            .map_err(ck)?
            .with_retention(policy);
        Ok(Checkpoints {
            rank,
            writer: Arc::new(AsyncCheckpointer::new(dir)),
            last: None,
        })
    }

    fn dir(&self) -> &CheckpointDir {
        self.writer.dir()
    }

    fn err(&self, source: StorageError) -> TrainError {
        TrainError::Checkpoint {
            rank: self.rank,
            source,
        }
    }

    /// The background writer (strategies wait on it before reading the newest checkpoint).
    pub fn writer(&self) -> Arc<AsyncCheckpointer> {
        self.writer.clone()
    }

    /// The step of the last checkpoint committed or resumed from.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Opens the newest checkpoint that verifies. Newer ones that do not are reported and
    /// moved aside (kept for inspection as `step-N.corrupt-<pid>`), so that the run can commit
    /// those steps again.
    pub fn open_newest_valid(&mut self) -> Result<Option<Arc<Checkpoint>>, TrainError> {
        let rank = self.rank;
        let opts = LoadOptions::default();
        let mut corrupt = Vec::new();
        let mut found = None;
        let steps = self.dir().committed_steps().map_err(|e| self.err(e))?;
        for &step in steps.iter().rev() {
            match Checkpoint::open(&self.dir().step_path(step), &opts) {
                Ok(c) => {
                    found = Some(Arc::new(c));
                    break;
                }
                Err(e @ StorageError::CudaNotCompiled { .. }) => return Err(self.err(e)),
                Err(e) => {
                    tracing::warn!(step, error = %e, "skipping a checkpoint that does not verify");
                    eprintln!(
                        "rekindle: rank {rank}: checkpoint step-{step} does not verify ({e}); \
                         moving it aside"
                    );
                    corrupt.push(step);
                }
            }
        }
        for step in corrupt {
            let from = self.dir().step_path(step);
            let to = from.with_file_name(format!("step-{step}.corrupt-{}", std::process::id()));
            // Another rank may have moved it already.
            let _ = std::fs::rename(&from, &to);
        }
        if let Some(c) = &found {
            self.last = Some(c.step());
        }
        Ok(found)
    }

    /// Starts a background save of `snap` (this rank writes the whole checkpoint). A failed
    /// previous save is reported and training goes on: what was saved before is untouched.
    pub fn save_async(&mut self, snap: Snapshot) {
        let step = snap.state.step;
        if self.last == Some(step) {
            return;
        }
        match self.writer.save_owned(snap) {
            Ok(()) => self.last = Some(step),
            Err(e) => tracing::warn!(step, error = %e, "checkpoint failed"),
        }
    }

    /// Starts a background save of this rank's shard `snap`, committed by rank 0 of
    /// `coord` once every shard is durable.
    pub fn save_sharded_async(&mut self, snap: Snapshot, coord: ShardCoordinator) {
        let step = snap.state.step;
        if self.last == Some(step) {
            return;
        }
        match self.writer.save_sharded_owned(snap, coord) {
            Ok(()) => self.last = Some(step),
            Err(e) => tracing::warn!(step, error = %e, "sharded checkpoint failed"),
        }
    }

    /// Waits for the save in flight, reporting its failure.
    pub fn flush(&self) {
        if let Err(e) = self.writer.flush(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "the checkpoint in flight failed");
        }
    }

    /// Commits `snap` now and waits until it is durable (after the save in flight).
    pub fn save_now(&mut self, snap: &Snapshot) -> Result<u64, TrainError> {
        self.flush();
        let step = snap.state.step;
        if self.last == Some(step) && self.dir().step_path(step).exists() {
            return Ok(step);
        }
        match self.dir().save(snap) {
            Ok(info) => {
                self.last = Some(info.step);
                Ok(info.step)
            }
            // Another node committed the same step (the state is replicated): done.
            Err(StorageError::AlreadyExists { .. }) => {
                self.last = Some(step);
                Ok(step)
            }
            Err(source) => Err(self.err(source)),
        }
    }

    /// Saves this rank's shard now, with every other rank of `coord`, and waits until rank 0
    /// committed the manifest.
    pub fn save_sharded_now(
        &mut self,
        snap: &Snapshot,
        coord: &ShardCoordinator,
    ) -> Result<u64, TrainError> {
        self.flush();
        let step = snap.state.step;
        if self.last == Some(step) && self.dir().step_path(step).exists() {
            return Ok(step);
        }
        let info = self
            .dir()
            .save_sharded(snap, coord)
            .map_err(|e| self.err(e))?;
        self.last = Some(info.step);
        Ok(info.step)
    }
}

/// The newest committed checkpoint of `dir` that verifies, at `at_most` or before (newer ones
/// that do not verify are skipped with a warning, and left where they are).
pub(crate) fn newest_valid(
    dir: &Path,
    at_most: Option<u64>,
) -> Result<Option<Checkpoint>, StorageError> {
    let dir = CheckpointDir::new(dir.to_path_buf())?;
    let opts = LoadOptions::default();
    let steps = dir.committed_steps()?;
    for &step in steps
        .iter()
        .rev()
        .filter(|&&s| at_most.is_none_or(|m| s <= m))
    {
        match Checkpoint::open(&dir.step_path(step), &opts) {
            Ok(c) => return Ok(Some(c)),
            Err(e) => {
                tracing::warn!(step, error = %e, "skipping a checkpoint that does not verify")
            }
        }
    }
    Ok(None)
}

/// A shard coordinator for the group of `generation`, under its own keys of the round's store.
pub(crate) fn coordinator(
    store: &Arc<dyn Store>,
    generation: u64,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<ShardCoordinator, TrainError> {
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
        store.clone(),
        format!("ckpt/{generation}/"),
    ));
    ShardCoordinator::new(store, rank, world_size, timeout)
        .map_err(|source| TrainError::Checkpoint { rank, source })
}

/// The loop's own state as it goes into a checkpoint's manifest and `state` group.
pub(crate) fn loop_snapshot(
    step: u64,
    sampler: &ElasticSampler,
    world_size: usize,
    layout: Layout,
) -> Snapshot {
    Snapshot::new(TrainingState {
        step,
        epoch: sampler.epoch(),
        sample_cursor: sampler.cursor() as u64,
        world_size,
        layout,
        ..Default::default()
    })
}

/// Adds the sampler's state to `snap` (rank 0's part of every checkpoint).
pub(crate) fn insert_sampler(
    snap: &mut Snapshot,
    sampler: &ElasticSampler,
    rank: usize,
) -> Result<(), TrainError> {
    let tensors = sampler
        .state()
        .to_tensors()
        .map_err(|e| TrainError::State {
            rank,
            what: "exporting the sampler state",
            reason: e.to_string(),
        })?;
    for (name, t) in tensors {
        snap.insert_candle(STATE_GROUP, &name, &t)
            .map_err(|source| TrainError::Checkpoint { rank, source })?;
    }
    Ok(())
}

/// The sampler state stored in `ckpt`.
pub(crate) fn read_sampler(ckpt: &Checkpoint, rank: usize) -> Result<ElasticState, TrainError> {
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for name in ElasticState::NAMES {
        let t = ckpt
            .tensor(name)
            .and_then(|t| t.to_candle_on(rekindle_runtime::Device::Cpu))
            .map_err(|source| TrainError::Checkpoint { rank, source })?;
        tensors.push((name.to_string(), t));
    }
    ElasticState::from_tensors(&tensors).map_err(|e| TrainError::State {
        rank,
        what: "reading the sampler state of the checkpoint",
        reason: e.to_string(),
    })
}
