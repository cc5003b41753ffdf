//! The storage error type.

use std::path::PathBuf;
use std::time::Duration;

/// Every failure the storage crate reports. Variants that concern a file carry its path, so a
/// log line says which checkpoint, file or tensor is at fault.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An I/O call failed for a reason without a variant of its own.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `write`, `fsync`, `rename`, ...).
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The filesystem is full (ENOSPC, EDQUOT or EFBIG) while writing.
    #[error("no space left while writing {path} ({source}); the previous checkpoint is untouched")]
    NoSpace {
        /// The file being written.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The OS refused access (EACCES or EPERM).
    #[error("permission denied: {op} {path}")]
    PermissionDenied {
        /// What was being done.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
    },
    /// A file is shorter or longer than its manifest or header says.
    #[error("{path} is {actual} bytes, expected {expected} (truncated or partially written?)")]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// The size recorded in the manifest or implied by the header.
        expected: u64,
        /// The size on disk.
        actual: u64,
    },
    /// A file's or tensor's checksum does not match the manifest.
    #[error("checksum mismatch in {path}{}: expected xxh3 {expected:016x}, got {actual:016x}", tensor.as_ref().map(|t| format!(" (tensor {t:?})")).unwrap_or_default())]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor, for per-tensor checks.
        tensor: Option<String>,
        /// The checksum recorded in the manifest.
        expected: u64,
        /// The checksum of the bytes read.
        actual: u64,
    },
    /// A safetensors header is not valid: length beyond the file, malformed JSON, bad offsets.
    #[error("invalid safetensors header in {path}: {reason}")]
    InvalidHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A manifest cannot be read as JSON of the expected shape.
    #[error("invalid manifest {path}: {reason}")]
    InvalidManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The manifest was written by a newer rekindle with a format this build cannot read.
    #[error(
        "{path} has checkpoint format version {found}; this build reads versions up to {supported}"
    )]
    UnsupportedFormatVersion {
        /// The manifest file.
        path: PathBuf,
        /// The version in the manifest.
        found: u32,
        /// The newest version this build reads.
        supported: u32,
    },
    /// A file listed in the manifest (a shard) is missing from the checkpoint directory.
    #[error("{path} is listed in the manifest but missing (shard of rank {rank})")]
    MissingFile {
        /// The file that should exist.
        path: PathBuf,
        /// The rank that wrote it.
        rank: usize,
    },
    /// A directory does not hold a committed checkpoint (no manifest).
    #[error("{path} is not a committed checkpoint (no manifest)")]
    NotACheckpoint {
        /// The directory.
        path: PathBuf,
    },
    /// No checkpoint in the directory passes verification.
    #[error("no valid checkpoint in {dir} ({skipped} corrupt or partial ones skipped)")]
    NoValidCheckpoint {
        /// The checkpoint root.
        dir: PathBuf,
        /// How many committed checkpoints failed verification.
        skipped: usize,
    },
    /// The requested step has no committed checkpoint.
    #[error("no checkpoint for step {step} in {dir}")]
    StepNotFound {
        /// The checkpoint root.
        dir: PathBuf,
        /// The step asked for.
        step: u64,
    },
    /// A checkpoint for this step is already committed; checkpoints are immutable.
    #[error("checkpoint {path} already exists")]
    AlreadyExists {
        /// The committed directory.
        path: PathBuf,
    },
    /// A tensor name is not in the checkpoint or file.
    #[error("tensor {name:?} is not in {path}")]
    TensorNotFound {
        /// The name asked for (after key normalisation).
        name: String,
        /// The checkpoint or file.
        path: PathBuf,
    },
    /// Two tensors have the same name (in a snapshot, across shards, or after stripping
    /// `module.` prefixes).
    #[error("duplicate tensor name {name:?} in {path}")]
    DuplicateTensor {
        /// The name.
        name: String,
        /// The checkpoint, file or snapshot.
        path: PathBuf,
    },
    /// A tensor's bytes do not match its dtype and shape, or a model's variable has another
    /// shape or dtype than the stored tensor.
    #[error("tensor {name:?}: {reason}")]
    TensorMismatch {
        /// The tensor.
        name: String,
        /// What does not match.
        reason: String,
    },
    /// A dtype this crate does not store (safetensors name or candle dtype).
    #[error("unsupported dtype {dtype} for tensor {name:?}")]
    UnsupportedDType {
        /// The tensor.
        name: String,
        /// The dtype as named by its source.
        dtype: String,
    },
    /// A map-location sends a tensor to CUDA but this build has no CUDA support.
    #[error("tensor {tensor:?} of {path} maps to {device}, but rekindle-storage was built without the `{feature}` feature")]
    CudaNotCompiled {
        /// The checkpoint or file.
        path: PathBuf,
        /// The first tensor that maps to CUDA.
        tensor: String,
        /// Where it maps.
        device: rekindle_runtime::Device,
        /// The cargo feature that enables CUDA targets.
        feature: &'static str,
    },
    /// A map-location table could not be parsed.
    #[error("invalid map-location {input:?}: {reason}")]
    InvalidMapLocation {
        /// The text given.
        input: String,
        /// What is wrong.
        reason: String,
    },
    /// Candle failed (building a tensor, moving it to a device, setting a variable).
    #[error("candle error for tensor {name:?}: {source}")]
    Candle {
        /// The tensor.
        name: String,
        /// Candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// A store operation of a sharded save failed.
    #[error("sharded save of step {step} on rank {rank}: store failure: {source}")]
    Store {
        /// The step being saved.
        step: u64,
        /// This process's rank.
        rank: usize,
        /// The store's error.
        #[source]
        source: rekindle_runtime::store::StoreError,
    },
    /// Ranks of a sharded save did not report durable shards before the deadline.
    #[error("sharded save of step {step}: ranks {missing:?} did not report durable shards within {timeout:?}")]
    ShardTimeout {
        /// The step being saved.
        step: u64,
        /// The ranks that did not report.
        missing: Vec<usize>,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A rank of a sharded save reported that writing its shard failed.
    #[error("sharded save of step {step}: rank {rank} failed: {reason}")]
    ShardFailed {
        /// The step being saved.
        step: u64,
        /// The rank that failed.
        rank: usize,
        /// Its error message.
        reason: String,
    },
    /// An asynchronous save did not finish before the deadline.
    #[error("the checkpoint save in flight (step {step}) did not finish within {timeout:?}")]
    AsyncTimeout {
        /// The step of the save in flight.
        step: u64,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A previous asynchronous save failed; reported by the next `save` or `flush`.
    #[error("asynchronous save of step {step} failed: {source}")]
    AsyncSaveFailed {
        /// The step that failed.
        step: u64,
        /// Why.
        #[source]
        source: Box<StorageError>,
    },
    /// The background writer of an asynchronous checkpointer is gone (it panicked).
    #[error("the background checkpoint writer stopped unexpectedly")]
    WriterGone,
    /// An argument is out of range (for example `keep_last = 0`).
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },
    /// Another save holds the checkpoint directory's lock and did not release it in time.
    #[error("checkpoint directory lock {path} is still held by another save after {timeout:?}")]
    LockTimeout {
        /// The lock file.
        path: PathBuf,
        /// How long this save waited.
        timeout: Duration,
    },
    /// A failpoint stopped the save (crash-safety tests only).
    #[error("failpoint {name} triggered")]
    Failpoint {
        /// The failpoint.
        name: &'static str,
    },
}

/// The result of storage operations.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

impl StorageError {
    /// Classifies an I/O error for `path`: full disks and refused permissions get their own
    /// variants, the rest is [`StorageError::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => {
                StorageError::NoSpace { path, source }
            }
            Some(libc::EACCES) | Some(libc::EPERM) => StorageError::PermissionDenied { op, path },
            _ if source.kind() == std::io::ErrorKind::PermissionDenied => {
                StorageError::PermissionDenied { op, path }
            }
            _ => StorageError::Io { op, path, source },
        }
    }

    /// True when the error says the data on disk is damaged or incomplete (as opposed to an
    /// environment problem such as a refused permission).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            StorageError::SizeMismatch { .. }
                | StorageError::ChecksumMismatch { .. }
                | StorageError::InvalidHeader { .. }
                | StorageError::InvalidManifest { .. }
                | StorageError::MissingFile { .. }
                | StorageError::NotACheckpoint { .. }
                | StorageError::TensorMismatch { .. }
        )
    }
}
