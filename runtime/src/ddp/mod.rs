//! Distributed data parallel training over candle: every rank holds a replica of the model,
//! computes gradients on its share of the global batch, and the replicas stay identical
//! because every rank applies the same averaged gradient.
//!
//! [`Ddp`] takes the parameters of a `candle_nn::VarMap` sorted by name (the map's own order
//! differs between processes), broadcasts them from rank 0, and plans gradient buckets like
//! torch ([`plan_buckets`]: reverse name order, first bucket 1 MB, then `bucket_cap_mb`).
//! [`Ddp::step`] then, for each bucket in turn, flattens the gradients (each rank's scaled by
//! its sample count) and issues the bucket's asynchronous all-reduce before flattening the
//! next, so communication overlaps the remaining flattening; the sum is divided by the global
//! sample count (carried as one extra element of the first bucket, so ranks with different
//! numbers of samples, or none, average correctly) and handed to the optimizer
//! ([`crate::optim`]), which updates the parameters in place.
//!
//! Failure semantics: with [`StepMode::Atomic`] (the default) nothing is updated before every
//! bucket's all-reduce succeeded, so a step that fails leaves parameters and optimizer state
//! exactly as they were: a survivor can discard the step and retry it in a new group. With
//! [`StepMode::Overlapped`] each bucket is unflattened and updated as soon as its all-reduce
//! is back, overlapping the optimizer with the remaining communication; a failure then leaves
//! the parameters partly updated and the rank must take its state from a peer or a checkpoint.
//!
//! ```no_run
//! use candle_core::{Device, DType, Tensor};
//! use candle_nn::{VarMap, Module};
//! use rekindle_runtime::ddp::{Ddp, DdpOptions};
//! use rekindle_runtime::optim::{Sgd, SgdConfig};
//! # fn run(pg: rekindle_runtime::ProcessGroup, x: Tensor, y: Tensor) -> Result<(), Box<dyn std::error::Error>> {
//! let varmap = VarMap::new();
//! let model = candle_nn::linear(784, 10, candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("fc"))?;
//! let mut ddp = Ddp::new(&varmap, pg, DdpOptions::default())?;
//! let mut opt = Sgd::new(SgdConfig::new(0.1), ddp.param_specs())?;
//! let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
//! ddp.step(Some(&loss.backward()?), x.dim(0)?, &mut opt)?;
//! # Ok(()) }
//! ```

mod bucket;
mod data_parallel;
mod state_sync;

use std::time::Duration;

pub use bucket::{plan_buckets, BucketPlan, Member};
pub use data_parallel::{Ddp, StepReport};
pub use state_sync::broadcast_state;

use crate::optim::OptimError;

/// When parameters are updated relative to the buckets' all-reduces. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepMode {
    /// Update only after every bucket is reduced: a failed step changes nothing.
    #[default]
    Atomic,
    /// Update each bucket as soon as it is reduced: faster, but a failed step leaves a partial
    /// update behind.
    Overlapped,
}

/// Settings of [`Ddp`].
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// Size limit of every bucket but the first, in MiB (torch's `bucket_cap_mb`, default 25).
    pub bucket_cap_mb: f64,
    /// Size limit of the first bucket, in MiB (default 1, torch's `_DEFAULT_FIRST_BUCKET_BYTES`).
    pub first_bucket_mb: f64,
    /// How long to wait for each collective before giving up with an error (default 120 s;
    /// the backend's own operation deadline usually fires first).
    pub timeout: Duration,
    /// See [`StepMode`].
    pub mode: StepMode,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            timeout: Duration::from_secs(120),
            mode: StepMode::Atomic,
        }
    }
}

/// Why a DDP call failed.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (peer lost, timeout, abort): the group is broken and must be
    /// rebuilt; accumulated gradients are lost.
    #[error("rank {rank}: DDP {during} failed: {source}")]
    Collective {
        /// This rank.
        rank: usize,
        /// What DDP was doing.
        during: &'static str,
        /// The runtime's error.
        #[source]
        source: crate::Error,
    },
    /// A tensor operation failed.
    #[error("rank {rank}: tensor operation on {param:?} failed: {message}")]
    Tensor {
        /// This rank.
        rank: usize,
        /// The parameter involved.
        param: String,
        /// candle's message.
        message: String,
    },
    /// The optimizer refused an update.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The ranks do not hold the same parameter names and shapes.
    #[error("rank {rank}: the ranks' models differ (parameter names or shapes): {reason}")]
    LayoutMismatch {
        /// This rank.
        rank: usize,
        /// What was seen.
        reason: String,
    },
    /// The parameters are not bit-identical across ranks.
    #[error(
        "rank {rank}: parameters differ across ranks (fingerprint here {local:#x}, \
         min {min:#x}, max {max:#x})"
    )]
    ParamsDiverged {
        /// This rank.
        rank: usize,
        /// This rank's fingerprint.
        local: u64,
        /// The smallest fingerprint of any rank.
        min: u64,
        /// The largest fingerprint of any rank.
        max: u64,
    },
    /// No rank contributed a sample to the step.
    #[error("rank {rank}: the step has no samples on any rank")]
    NoSamples {
        /// This rank.
        rank: usize,
    },
    /// The arguments do not fit (an optimizer over other parameters, too many samples).
    #[error("rank {rank}: invalid DDP argument: {reason}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
}

/// The result of DDP calls.
pub type DdpResult<T> = std::result::Result<T, DdpError>;
