//! [`ElasticSampler`]: a global cursor over the epoch's permutation, split per step among the
//! ranks of whatever world is current.

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::{check_rank, epoch_permutation, SamplerError, SamplerResult};
use crate::collectives::segment;

/// What an [`ElasticSampler`] samples: fixed for the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticConfig {
    /// The number of samples in the dataset.
    pub len: usize,
    /// Samples per step over all ranks; each rank's share follows from the world size.
    pub global_batch: usize,
    /// The seed shared by every rank.
    pub seed: u64,
    /// Whether to shuffle each epoch (with [`epoch_permutation`]); otherwise the order is
    /// `0..len`.
    pub shuffle: bool,
    /// Whether the last, short step of an epoch is dropped (its samples are not read that
    /// epoch); otherwise it is a step with fewer than `global_batch` samples.
    pub drop_last: bool,
}

impl ElasticConfig {
    /// A config with seed 0, shuffling and no `drop_last`.
    pub fn new(len: usize, global_batch: usize) -> Self {
        ElasticConfig {
            len,
            global_batch,
            seed: 0,
            shuffle: true,
            drop_last: false,
        }
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets shuffling.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Sets `drop_last`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The number of samples read per epoch: `len`, or with `drop_last` the largest multiple
    /// of `global_batch` not above it.
    pub fn epoch_len(&self) -> usize {
        if self.drop_last {
            self.len - self.len % self.global_batch.max(1)
        } else {
            self.len
        }
    }

    /// The number of steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.epoch_len().div_ceil(self.global_batch.max(1))
    }

    /// The positions (in the epoch's order) of the step that starts at `cursor`, or `None`
    /// when the epoch is finished. A pure function of the config and the cursor.
    pub fn step_range(&self, cursor: usize) -> Option<Range<usize>> {
        let end = self.epoch_len();
        (cursor < end).then(|| cursor..(cursor + self.global_batch).min(end))
    }

    fn validate(&self) -> SamplerResult<()> {
        if self.global_batch == 0 {
            return Err(SamplerError::InvalidConfig {
                reason: "global_batch must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Everything that decides which samples come next: the epoch and the number of samples of
/// it already consumed. `seed` and `len` are kept to refuse restoring into a sampler of
/// another dataset or seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ElasticState {
    /// The seed of the sampler that saved the state.
    pub seed: u64,
    /// The dataset length of the sampler that saved the state.
    pub len: u64,
    /// The current epoch.
    pub epoch: u64,
    /// The number of samples of the epoch's order consumed by committed steps.
    pub cursor: u64,
}

impl ElasticState {
    /// The names under which [`to_tensors`](Self::to_tensors) stores the fields.
    pub const NAMES: [&'static str; 4] = [
        "sampler.seed",
        "sampler.len",
        "sampler.epoch",
        "sampler.cursor",
    ];

    fn fields(&self) -> [u64; 4] {
        [self.seed, self.len, self.epoch, self.cursor]
    }

    /// The state as named tensors (one i64 scalar per field, the u64 bit-cast so every value
    /// survives exactly), for checkpoints and for broadcast to a new rank.
    pub fn to_tensors(&self) -> candle_core::Result<Vec<(String, Tensor)>> {
        Self::NAMES
            .iter()
            .zip(self.fields())
            .map(|(name, v)| Ok((name.to_string(), Tensor::new(v as i64, &Device::Cpu)?)))
            .collect()
    }

    /// The state from tensors written by [`to_tensors`](Self::to_tensors); other names are
    /// ignored.
    pub fn from_tensors(tensors: &[(String, Tensor)]) -> SamplerResult<Self> {
        let mut out = [0u64; 4];
        for (slot, name) in out.iter_mut().zip(Self::NAMES) {
            let (_, t) = tensors.iter().find(|(n, _)| n == name).ok_or_else(|| {
                SamplerError::StateMismatch {
                    reason: format!("tensor {name:?} is missing"),
                }
            })?;
            let bad = |reason: String| SamplerError::StateMismatch {
                reason: format!("tensor {name:?}: {reason}"),
            };
            if t.dtype() != candle_core::DType::I64 || t.elem_count() != 1 {
                return Err(bad(format!(
                    "expected one i64, got {:?} {:?}",
                    t.dtype(),
                    t.dims()
                )));
            }
            let v = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<i64>())
                .map_err(|e| bad(e.to_string()))?;
            *slot = v[0] as u64;
        }
        Ok(ElasticState {
            seed: out[0],
            len: out[1],
            epoch: out[2],
            cursor: out[3],
        })
    }
}

/// One step as planned from the sampler's cursor: the global positions it covers and their
/// dataset indices. Every rank plans the same step; each reads its
/// [`rank_indices`](Self::rank_indices) for the current world size. Only
/// [`ElasticSampler::commit`] moves the cursor, so a step that fails is planned again, whole,
/// for the next world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedStep {
    epoch: u64,
    positions: Range<usize>,
    indices: Vec<usize>,
}

impl PlannedStep {
    /// The epoch the step belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The positions of the step in the epoch's order (`cursor..cursor + len`).
    pub fn positions(&self) -> Range<usize> {
        self.positions.clone()
    }

    /// The number of samples of the step over all ranks.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True when the step has no samples (never returned by [`ElasticSampler::plan`]).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Every dataset index of the step, in rank order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// Which of the step's samples rank `rank` of `world_size` reads: its
    /// [`segment`] of the step.
    pub fn rank_range(&self, world_size: usize, rank: usize) -> SamplerResult<Range<usize>> {
        check_rank(world_size, rank)?;
        Ok(segment(self.indices.len(), world_size, rank))
    }

    /// The dataset indices rank `rank` of `world_size` reads (possibly none, when the step is
    /// shorter than the world).
    pub fn rank_indices(&self, world_size: usize, rank: usize) -> SamplerResult<&[usize]> {
        Ok(&self.indices[self.rank_range(world_size, rank)?])
    }
}

/// The elastic sampler: see the [module docs](super).
#[derive(Debug, Clone)]
pub struct ElasticSampler {
    config: ElasticConfig,
    epoch: u64,
    cursor: usize,
    order: Vec<usize>,
}

impl ElasticSampler {
    /// A sampler at the start of epoch 0. Fails if `global_batch` is 0.
    pub fn new(config: ElasticConfig) -> SamplerResult<Self> {
        config.validate()?;
        let mut s = ElasticSampler {
            config,
            epoch: 0,
            cursor: 0,
            order: Vec::new(),
        };
        s.set_epoch(0);
        Ok(s)
    }

    /// A sampler resumed at `state`. Fails if the state was saved by a sampler of another
    /// dataset length or seed, or its cursor is past the epoch.
    pub fn from_state(config: ElasticConfig, state: ElasticState) -> SamplerResult<Self> {
        let mut s = Self::new(config)?;
        s.restore(state)?;
        Ok(s)
    }

    /// The configuration.
    pub fn config(&self) -> &ElasticConfig {
        &self.config
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples of the current epoch consumed by committed steps.
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    /// Samples of the current epoch not yet consumed.
    pub fn remaining(&self) -> usize {
        self.config.epoch_len().saturating_sub(self.cursor)
    }

    /// True when every step of the epoch has been committed.
    pub fn epoch_done(&self) -> bool {
        self.remaining() == 0
    }

    /// Moves to the start of `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.cursor = 0;
        self.order = if self.config.shuffle {
            epoch_permutation(self.config.len, self.config.seed, epoch)
        } else {
            (0..self.config.len).collect()
        };
    }

    /// The current state.
    pub fn state(&self) -> ElasticState {
        ElasticState {
            seed: self.config.seed,
            len: self.config.len as u64,
            epoch: self.epoch,
            cursor: self.cursor as u64,
        }
    }

    /// Moves to `state` (saved by a sampler of the same dataset length and seed).
    pub fn restore(&mut self, state: ElasticState) -> SamplerResult<()> {
        if state.seed != self.config.seed || state.len != self.config.len as u64 {
            return Err(SamplerError::StateMismatch {
                reason: format!(
                    "state has seed {} len {}, sampler has seed {} len {}",
                    state.seed, state.len, self.config.seed, self.config.len
                ),
            });
        }
        let cursor = usize::try_from(state.cursor)
            .ok()
            .filter(|&c| c <= self.config.epoch_len())
            .ok_or_else(|| SamplerError::StateMismatch {
                reason: format!(
                    "cursor {} is past the epoch length {}",
                    state.cursor,
                    self.config.epoch_len()
                ),
            })?;
        if state.epoch != self.epoch || self.order.len() != self.config.len {
            self.set_epoch(state.epoch);
        }
        self.cursor = cursor;
        Ok(())
    }

    /// The next step from the cursor, or `None` when the epoch is finished. Planning does not
    /// move the cursor.
    pub fn plan(&self) -> Option<PlannedStep> {
        let positions = self.config.step_range(self.cursor)?;
        Some(PlannedStep {
            epoch: self.epoch,
            indices: self.order[positions.clone()].to_vec(),
            positions,
        })
    }

    /// Marks `step` as consumed: the cursor moves past it. Fails with
    /// [`SamplerError::StaleStep`] if `step` was not planned at the current position.
    pub fn commit(&mut self, step: &PlannedStep) -> SamplerResult<()> {
        if step.epoch != self.epoch || step.positions.start != self.cursor {
            return Err(SamplerError::StaleStep {
                planned_epoch: step.epoch,
                planned_cursor: step.positions.start as u64,
                epoch: self.epoch,
                cursor: self.cursor as u64,
            });
        }
        self.cursor = step.positions.end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_ranges() {
        // (len, global_batch, drop_last, cursor) -> range
        type Row = (usize, usize, bool, usize, Option<Range<usize>>);
        let table: &[Row] = &[
            (10, 4, false, 0, Some(0..4)),
            (10, 4, false, 4, Some(4..8)),
            (10, 4, false, 8, Some(8..10)),
            (10, 4, false, 10, None),
            (10, 4, true, 4, Some(4..8)),
            (10, 4, true, 8, None),
            (10, 4, false, 5, Some(5..9)),
            (3, 8, false, 0, Some(0..3)),
            (3, 8, true, 0, None),
            (0, 8, false, 0, None),
        ];
        for (len, gb, drop_last, cursor, want) in table.iter().cloned() {
            let cfg = ElasticConfig::new(len, gb).drop_last(drop_last);
            assert_eq!(
                cfg.step_range(cursor),
                want,
                "{len} {gb} {drop_last} {cursor}"
            );
        }
        assert_eq!(ElasticConfig::new(10, 4).steps_per_epoch(), 3);
        assert_eq!(
            ElasticConfig::new(10, 4).drop_last(true).steps_per_epoch(),
            2
        );
    }

    #[test]
    fn rank_shares_follow_the_world() {
        let s = ElasticSampler::new(ElasticConfig::new(20, 7).shuffle(false)).unwrap();
        let step = s.plan().unwrap();
        // (world, rank) -> indices
        let table: &[(usize, usize, &[usize])] = &[
            (1, 0, &[0, 1, 2, 3, 4, 5, 6]),
            (2, 0, &[0, 1, 2, 3]),
            (2, 1, &[4, 5, 6]),
            (3, 0, &[0, 1, 2]),
            (3, 1, &[3, 4]),
            (3, 2, &[5, 6]),
            (8, 7, &[]),
            (8, 6, &[6]),
        ];
        for &(world, rank, want) in table {
            assert_eq!(
                step.rank_indices(world, rank).unwrap(),
                want,
                "{world} {rank}"
            );
        }
        assert!(step.rank_indices(2, 2).is_err());
    }

    #[test]
    fn resize_mid_epoch_splits_the_remainder() {
        let mut s = ElasticSampler::new(ElasticConfig::new(10, 4).shuffle(false)).unwrap();
        let a = s.plan().unwrap();
        assert_eq!(a.rank_indices(2, 1).unwrap(), &[2, 3]);
        s.commit(&a).unwrap();
        // Interrupted at world 2, re-planned at world 3: the same samples, split three ways.
        let b = s.plan().unwrap();
        assert_eq!(b.rank_indices(2, 0).unwrap(), &[4, 5]);
        let b2 = s.plan().unwrap();
        assert_eq!(b, b2);
        assert_eq!(b2.rank_indices(3, 0).unwrap(), &[4, 5]);
        assert_eq!(b2.rank_indices(3, 1).unwrap(), &[6]);
        assert_eq!(b2.rank_indices(3, 2).unwrap(), &[7]);
        s.commit(&b2).unwrap();
        assert_eq!(
            s.commit(&b),
            Err(SamplerError::StaleStep {
                planned_epoch: 0,
                planned_cursor: 4,
                epoch: 0,
                cursor: 8,
            })
        );
        let c = s.plan().unwrap();
        assert_eq!(c.indices(), &[8, 9]);
        s.commit(&c).unwrap();
        assert!(s.epoch_done());
        assert!(s.plan().is_none());
    }

    #[test]
    fn state_round_trips_through_tensors() {
        let mut s = ElasticSampler::new(ElasticConfig::new(1000, 64).seed(u64::MAX)).unwrap();
        s.set_epoch(3);
        let step = s.plan().unwrap();
        s.commit(&step).unwrap();
        let tensors = s.state().to_tensors().unwrap();
        let state = ElasticState::from_tensors(&tensors).unwrap();
        assert_eq!(state, s.state());
        let r = ElasticSampler::from_state(s.config().clone(), state).unwrap();
        assert_eq!(r.plan(), s.plan());
        assert!(ElasticSampler::from_state(ElasticConfig::new(1000, 64), state).is_err());
        let mut past = state;
        past.cursor = 1001;
        assert!(ElasticSampler::from_state(s.config().clone(), past).is_err());
        assert!(ElasticState::from_tensors(&tensors[1..]).is_err());
    }

    #[test]
    fn zero_global_batch_is_refused() {
        assert!(ElasticSampler::new(ElasticConfig::new(10, 0)).is_err());
    }
}
