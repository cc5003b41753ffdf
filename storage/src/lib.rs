//! rekindle-storage: checkpoints as plain safetensors files with a manifest, committed
//! atomically, verified on load, mapped onto any device.
//!
//! A checkpoint is a directory `step-<N>/` holding one safetensors file per group and writer
//! and a `manifest.json` written last; it exists only once the directory has been renamed into
//! place (see [`save`] for the protocol and docs/checkpoint-format.md for the format).
//!
//! ```
//! use rekindle_runtime::Device;
//! use rekindle_storage::{
//!     CheckpointDir, HostTensor, LoadOptions, MapLocation, Snapshot, TensorSource, TrainingState,
//! };
//!
//! let root = tempfile::tempdir().unwrap();
//! let dir = CheckpointDir::new(root.path()).unwrap();
//!
//! // Save step 10: the training state plus named tensors in two files.
//! let mut snap = Snapshot::new(TrainingState { step: 10, epoch: 1, sample_cursor: 2560, ..Default::default() });
//! snap.insert("fc.weight", HostTensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap()).unwrap();
//! snap.insert_in("optimizer", "fc.weight.m", Device::Cuda(1), HostTensor::zeros(rekindle_storage::TensorDType::F32, &[2, 2])).unwrap();
//! dir.save(&snap).unwrap();
//!
//! // Load the newest valid checkpoint; tensors saved on cuda:1 go to the CPU.
//! let opts = LoadOptions::default().map_location("cuda:* -> cpu".parse::<MapLocation>().unwrap());
//! let ckpt = dir.load_latest(&opts).unwrap();
//! assert_eq!(ckpt.state().sample_cursor, 2560);
//! let w = ckpt.tensor("fc.weight").unwrap(); // borrowed from the mmap, no copy
//! assert_eq!(w.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
//! assert_eq!(ckpt.tensor("fc.weight.m").unwrap().device(), Device::Cpu);
//! ```

#![warn(missing_docs)]

pub mod async_save;
pub mod candle_io;
pub mod checksum;
pub mod cli;
pub mod dir;
pub mod dtype;
pub mod error;
pub mod failpoint;
mod fsio;
pub mod keys;
pub mod load;
pub mod manifest;
pub mod map_location;
pub mod retention;
pub mod safetensors_file;
pub mod save;
pub mod shard;
pub mod snapshot;
pub mod tensor;

pub use async_save::AsyncCheckpointer;
pub use candle_io::{load_varmap, tensor_to_host, VarMapLoad};
pub use dir::CheckpointDir;
pub use dtype::TensorDType;
pub use error::{Result, StorageError};
pub use keys::normalize_key;
pub use load::{Checkpoint, LoadOptions, SafetensorsFile, TensorRef, TensorSource, Verify};
pub use manifest::{Layout, Manifest, TrainingState, FORMAT_VERSION};
pub use map_location::{DevicePattern, MapLocation};
pub use retention::{plan_retention, RetentionPolicy};
pub use save::CommitInfo;
pub use shard::ShardCoordinator;
pub use snapshot::{Snapshot, SnapshotEntry};
pub use tensor::HostTensor;
