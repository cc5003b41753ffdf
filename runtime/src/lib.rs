//! rekindle-runtime: devices, dtypes, the bootstrap [`store`], and process groups over
//! collective backends (TCP on CPUs, NCCL on GPUs).
//!
//! A [`ProcessGroup`] is formed by every rank of a job with the same [`GroupConfig`] job,
//! round and store; it issues collectives asynchronously and every one of them is bounded by a
//! deadline. A dead peer makes operations fail with [`Error::PeerLost`] naming it; the group is
//! then rebuilt under the next round.

#![warn(missing_docs)]

pub mod buffer;
pub mod bulk_copy;
pub mod collectives;
pub mod ddp;
pub mod device;
pub mod dtype;
pub mod error;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod process_group;
pub mod sampler;
pub mod secret;
pub mod store;

pub use buffer::Buffer;
pub use collectives::nccl::NcclBackend;
pub use collectives::tcp::{PeerTransport, TcpBackend, TcpOptions, WireMode};
pub use collectives::{segment, Backend, Collective, ReduceOp, Work};
pub use device::{cuda_device_count, Device};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use process_group::{group_prefix, GroupConfig, ProcessGroup};
pub use secret::JobSecret;
