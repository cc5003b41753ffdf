//! The runtime's error type.

use std::time::Duration;

/// Every failure the runtime reports. Variants carry the rank, peer, key or path involved, so a
/// log line says what failed and where. `Clone` because one failure of a group fails every
/// operation queued behind it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A device string such as `cuda:x` could not be parsed.
    #[error("invalid device {input:?}: expected `cpu`, `cuda` or `cuda:N`")]
    InvalidDevice {
        /// The text that was given.
        input: String,
    },
    /// A dtype name was not recognised.
    #[error("invalid dtype {input:?}: expected one of f32, f64, f16, bf16, i32, i64, u8")]
    InvalidDType {
        /// The text that was given.
        input: String,
    },
    /// A reduce op name was not recognised.
    #[error("invalid reduce op {input:?}: expected one of sum, prod, min, max, avg")]
    InvalidReduceOp {
        /// The text that was given.
        input: String,
    },
    /// The requested CUDA device does not exist or CUDA is not usable here.
    #[error("CUDA device {ordinal} is not available: {reason}")]
    CudaUnavailable {
        /// The device ordinal that was asked for.
        ordinal: usize,
        /// Why it is not usable.
        reason: String,
    },
    /// rekindle was built without the `nccl` feature.
    #[error("rekindle-runtime was not compiled with NCCL support (enable the `nccl` feature)")]
    NotCompiledWithNccl,
    /// The NCCL library reported an error.
    #[error("NCCL error on rank {rank}: {message}")]
    Nccl {
        /// This process's rank.
        rank: usize,
        /// NCCL's description of the failure.
        message: String,
    },
    /// The arguments of an operation are inconsistent (wrong dtype, length, root, rank).
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A peer closed its connection or its process died.
    #[error("rank {rank}: peer rank {peer} was lost during {op}: {reason}")]
    PeerLost {
        /// This process's rank.
        rank: usize,
        /// The rank that was lost.
        peer: usize,
        /// The operation that noticed.
        op: &'static str,
        /// What the transport saw (EOF, reset, ...).
        reason: String,
    },
    /// A peer died or its connection broke during a collective, but the backend cannot tell
    /// which peer (NCCL reports a remote or system error for a collective without the rank).
    /// The group is broken and must be re-formed; the rendezvous, not this error, says who is
    /// gone, so nobody is to be evicted on it alone.
    #[error("rank {rank}: a peer was lost during {op} (the backend cannot tell which): {reason}")]
    PeerLostUnidentified {
        /// This process's rank.
        rank: usize,
        /// The operation that noticed.
        op: &'static str,
        /// What the transport reported.
        reason: String,
    },
    /// An operation did not complete within its deadline; `waiting_on` names the peers it still
    /// expected data from or could not send to, and is empty when the backend cannot tell
    /// (an NCCL collective): the group has then failed, but no peer is known to be at fault.
    #[error("rank {rank}: {op} timed out after {elapsed:?} waiting on ranks {waiting_on:?}")]
    Timeout {
        /// This process's rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// How long it waited.
        elapsed: Duration,
        /// The peers it was waiting on.
        waiting_on: Vec<usize>,
    },
    /// The group was aborted; every queued and in-flight operation fails with this.
    #[error("rank {rank}: process group aborted")]
    Aborted {
        /// This process's rank.
        rank: usize,
    },
    /// An earlier operation failed; the group is unusable and must be rebuilt.
    #[error("rank {rank}: process group is broken by an earlier failure: {cause}")]
    GroupBroken {
        /// This process's rank.
        rank: usize,
        /// The first failure.
        cause: Box<Error>,
    },
    /// A peer sent data that does not match the operation issued here (different op, size,
    /// dtype or sequence number): the ranks issued collectives in a different order.
    #[error("rank {rank}: peer rank {peer} is out of step during {op}: {reason}")]
    Mismatch {
        /// This process's rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The operation.
        op: &'static str,
        /// What differs.
        reason: String,
    },
    /// A connection failed the authentication handshake.
    #[error("handshake with {addr} failed: {reason}")]
    Handshake {
        /// The remote address.
        addr: String,
        /// Why it was refused.
        reason: String,
    },
    /// The group could not be formed before its deadline.
    #[error("rank {rank}: bootstrap of group {prefix:?} failed: {reason}")]
    Bootstrap {
        /// This process's rank.
        rank: usize,
        /// The store prefix of the group.
        prefix: String,
        /// What went wrong.
        reason: String,
    },
    /// The job secret could not be read.
    #[error("cannot read the job secret from {source_desc}: {reason}")]
    Secret {
        /// Where it was read from.
        source_desc: String,
        /// Why it failed.
        reason: String,
    },
    /// The built-in default secret was about to be used off loopback.
    #[error(
        "the built-in default job secret is for single-host runs only, but {addr} is not a \
         loopback address: give every process of the job the same secret with \
         REKINDLE_SECRET_FILE=<file holding it> (or REKINDLE_SECRET=<secret>)"
    )]
    DefaultSecretOffLoopback {
        /// The first non-loopback address.
        addr: String,
    },
    /// A store operation failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// An I/O error outside a collective (binding a socket, spawning a thread).
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        message: String,
    },
}

impl Error {
    /// An [`Error::Io`] from an `std::io::Error` with a context string.
    pub fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }
}

/// The runtime's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
