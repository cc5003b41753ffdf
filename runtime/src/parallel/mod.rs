//! Parallelism inside one process: [`DataParallel`] replicates a model over several devices
//! and splits each batch between the replicas (torch's `nn.DataParallel`); [`ModelParallel`]
//! places the layers of a sequential model on different devices and moves the activations
//! between them (the model-parallel tutorial's `ToyModel`, generalised).
//!
//! `DataParallel` is the legacy path, kept for single-process programs: one process drives
//! every device, so Python-style interpreter and scatter/gather costs aside, it still copies
//! the parameters out to every replica each step and reduces every gradient onto the first
//! device. Distributed data parallel ([`crate::ddp`], one process per device) scales better and
//! recovers from failures; prefer it.
//!
//! Both work with candle tensors on any device. A CPU build has only the CPU: several "devices"
//! are then the CPU more than once (replicas run on threads of their own; the stages of a
//! model-parallel model simply run in turn). Replicas on threads of one process share its
//! allocator: call [`keep_freed_memory`] at the start of such a program.
//!
//! ```
//! use candle_core::{Device, DType, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use rekindle_runtime::parallel::DataParallel;
//!
//! let dp = DataParallel::new(vec![Device::Cpu, Device::Cpu], |varmap: &VarMap, device: &Device| {
//!     candle_nn::linear(4, 1, VarBuilder::from_varmap(varmap, DType::F32, device).pp("fc"))
//! })
//! .unwrap();
//! let x = Tensor::ones((6, 4), DType::F32, &Device::Cpu).unwrap();
//! let y = Tensor::zeros((6, 1), DType::F32, &Device::Cpu).unwrap();
//! let out = dp
//!     .forward_backward(&x, &y, |m, x, y| (m.forward(x)? - y)?.sqr()?.mean_all())
//!     .unwrap();
//! assert_eq!(out.samples, 6);
//! assert_eq!(out.per_replica, vec![3, 3]);
//! ```

mod allocator;
mod data_parallel;
mod model_parallel;

pub use allocator::keep_freed_memory;
pub use data_parallel::{chunk_sizes, DataParallel, DpStep};
pub use model_parallel::{Layer, ModelParallel};

/// Why a [`DataParallel`] or [`ModelParallel`] call failed.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// The arguments do not describe a valid layout.
    #[error("invalid parallel layout: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },
    /// Building the model of a replica or a layer failed.
    #[error("building {what}: {message}")]
    Build {
        /// The replica or layer.
        what: String,
        /// The builder's error.
        message: String,
    },
    /// A tensor operation failed.
    #[error("replica {replica}: {during}: {source}")]
    Tensor {
        /// The replica (or stage) it failed on.
        replica: usize,
        /// What was being done.
        during: &'static str,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// A replica's thread panicked (a bug in the model's code).
    #[error("replica {replica}'s thread panicked")]
    Panicked {
        /// The replica.
        replica: usize,
    },
}
