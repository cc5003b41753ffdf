//! Samplers: which dataset indices each rank reads, epoch by epoch.
//!
//! Two samplers share one permutation ([`epoch_permutation`]):
//!
//! - [`DistributedSampler`] has the semantics of `torch.utils.data.DistributedSampler`: a
//!   fixed world size, every rank reading `num_samples` indices per epoch, the epoch padded by
//!   repeating indices from its start (or cut with `drop_last`) so that every rank reads the
//!   same number.
//! - [`ElasticSampler`] is for jobs whose world size changes mid-epoch. Its whole state is the
//!   epoch and the global sample cursor ([`ElasticState`]); every step takes the next
//!   `global_batch` indices of the epoch's permutation from the cursor and splits them among
//!   the ranks of the current world with [`crate::segment`]. A step that is interrupted is
//!   simply not committed, so every index of an epoch is consumed exactly once whatever the
//!   world sizes and failures were.
//!
//! ```
//! use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler};
//!
//! let mut s = ElasticSampler::new(ElasticConfig::new(10, 4).seed(7)).unwrap();
//! // Two ranks: rank 0 reads 2 of the first 4 indices, rank 1 the other 2.
//! let step = s.plan().unwrap();
//! assert_eq!(step.len(), 4);
//! let r0 = step.rank_indices(2, 0).unwrap();
//! let r1 = step.rank_indices(2, 1).unwrap();
//! assert_eq!((r0.len(), r1.len()), (2, 2));
//! s.commit(&step).unwrap();
//! // The world shrinks to one rank: it reads the next 4.
//! let step = s.plan().unwrap();
//! assert_eq!(step.rank_indices(1, 0).unwrap().len(), 4);
//! ```

mod distributed;
mod elastic;
mod permutation;

pub use distributed::DistributedSampler;
pub use elastic::{ElasticConfig, ElasticSampler, ElasticState, PlannedStep};
pub use permutation::epoch_permutation;

/// Why a sampler call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    /// The world size is 0 or the rank is not below it.
    #[error("invalid rank {rank} for world size {world_size}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// A configuration value is out of range.
    #[error("invalid sampler configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// A planned step does not belong to the sampler's current position (it was planned
    /// before another step was committed, or in another epoch).
    #[error(
        "stale step: planned at epoch {planned_epoch} cursor {planned_cursor}, \
         sampler is at epoch {epoch} cursor {cursor}"
    )]
    StaleStep {
        /// The epoch the step was planned in.
        planned_epoch: u64,
        /// The cursor the step was planned at.
        planned_cursor: u64,
        /// The sampler's epoch.
        epoch: u64,
        /// The sampler's cursor.
        cursor: u64,
    },
    /// A saved state does not fit this sampler's configuration.
    #[error("state does not fit the sampler: {reason}")]
    StateMismatch {
        /// What differs.
        reason: String,
    },
}

/// The result of sampler calls.
pub type SamplerResult<T> = std::result::Result<T, SamplerError>;

fn check_rank(world_size: usize, rank: usize) -> SamplerResult<()> {
    if world_size == 0 || rank >= world_size {
        return Err(SamplerError::InvalidRank { rank, world_size });
    }
    Ok(())
}
