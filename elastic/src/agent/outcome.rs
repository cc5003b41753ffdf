//! How a run of the agent ends: its outcomes, its errors and their exit codes.

use std::path::PathBuf;

use rekindle_runtime::store::StoreError;

use crate::rendezvous::RendezvousError;
use crate::store::ServerError;

/// The agent's exit codes (also those of `rekindle run`).
pub mod exit_code {
    /// The workers succeeded, or the job had already finished when this node arrived.
    pub const SUCCESS: i32 = 0;
    /// Workers failed and `--max-restarts` was used up.
    pub const WORKERS_FAILED: i32 = 1;
    /// Bad command line or configuration (a missing or unusable job secret included).
    pub const USAGE: i32 = 2;
    /// Rendezvous failed: timeout, store unreachable, credentials refused.
    pub const RENDEZVOUS: i32 = 3;
    /// The agent could not do its work on this machine: cannot start workers, bind its
    /// store, write logs or install signal handlers.
    pub const AGENT: i32 = 4;
    /// An internal error: rekindle broke one of its own invariants (a bug; the message says
    /// which). Never the user's configuration, the workers or the network.
    pub const INTERNAL: i32 = 5;
    /// Stopped by signal `n` (after forwarding it to the workers): `128 + n`.
    pub const fn signal(n: i32) -> i32 {
        128 + n
    }
}

/// One worker failure.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerFailure {
    /// Global rank.
    pub rank: usize,
    /// Local rank.
    pub local_rank: usize,
    /// The node's rank in the round.
    pub node_rank: usize,
    /// The attempt.
    pub attempt: u32,
    /// `exit code N` or `signal N (NAME)`.
    pub status: String,
    /// When, in seconds since the Unix epoch (the error file's time if it has one).
    pub timestamp: f64,
    /// The error file's message, if the worker wrote one.
    pub message: Option<String>,
    /// The error file's path.
    pub error_file: PathBuf,
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} (local rank {}, node rank {}, attempt {}) failed with {}",
            self.rank, self.local_rank, self.node_rank, self.attempt, self.status
        )?;
        match &self.message {
            Some(m) => write!(f, ": {m}"),
            None => write!(f, " (no error file at {})", self.error_file.display()),
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentOutcome {
    /// Every worker exited 0.
    Succeeded {
        /// Attempts started.
        attempts: u32,
        /// Restarts after failures.
        restarts: u32,
    },
    /// The job had finished before this node joined.
    AlreadyFinished {
        /// The job id.
        job: String,
    },
    /// Workers failed and the restarts were used up.
    Failed {
        /// The earliest failure of the last attempt.
        root_cause: WorkerFailure,
        /// Every failure of the last attempt.
        failures: Vec<WorkerFailure>,
        /// Restarts used.
        restarts: u32,
    },
    /// The agent was stopped by a signal.
    Signalled {
        /// The signal.
        signal: i32,
    },
}

impl AgentOutcome {
    /// The exit code for this outcome (see [`exit_code`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentOutcome::Succeeded { .. } | AgentOutcome::AlreadyFinished { .. } => {
                exit_code::SUCCESS
            }
            AgentOutcome::Failed { .. } => exit_code::WORKERS_FAILED,
            AgentOutcome::Signalled { signal } => exit_code::signal(*signal),
        }
    }
}

/// Why the agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is invalid.
    #[error("{reason}")]
    Usage {
        /// What is wrong, naming the flag.
        reason: String,
    },
    /// The job secret cannot be read, or the built-in default would be used off loopback.
    #[error(transparent)]
    Secret(#[from] rekindle_runtime::Error),
    /// Rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The embedded store could not start.
    #[error(transparent)]
    StoreServer(#[from] ServerError),
    /// The agent's own store failed.
    #[error("the agent's store: {0}")]
    Store(#[from] StoreError),
    /// The store for PyTorch programs could not start.
    #[error(transparent)]
    TorchStore(#[from] crate::torch_store::TorchStoreError),
    /// A worker could not be started.
    #[error("cannot start worker {local_rank} ({program}): {source}")]
    Spawn {
        /// The local rank.
        local_rank: usize,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file the agent needs could not be written (the log dir, the password file).
    #[error("cannot create {path}: {source}")]
    File {
        /// The file or dir.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The HTTP endpoint (`--health-port`) could not listen.
    #[error("cannot serve the health endpoint on {addr}: {source}")]
    Health {
        /// Where it was to listen.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The signal handlers could not be installed.
    #[error("cannot install the signal handlers: {0}")]
    Signals(std::io::Error),
    /// rekindle broke one of its own invariants.
    #[error("internal error (a bug in rekindle; please report it): {what}")]
    Internal {
        /// Which invariant.
        what: String,
    },
}

impl AgentError {
    /// The exit code for this error (see [`exit_code`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Usage { .. } | AgentError::Secret(_) => exit_code::USAGE,
            AgentError::StoreServer(ServerError::Secret { .. }) => exit_code::USAGE,
            AgentError::Rendezvous(RendezvousError::Settings(_)) => exit_code::USAGE,
            AgentError::Rendezvous(_) => exit_code::RENDEZVOUS,
            AgentError::StoreServer(_)
            | AgentError::Store(_)
            | AgentError::TorchStore(_)
            | AgentError::Spawn { .. }
            | AgentError::File { .. }
            | AgentError::Health { .. }
            | AgentError::Signals(_) => exit_code::AGENT,
            AgentError::Internal { .. } => exit_code::INTERNAL,
        }
    }

    pub(crate) fn usage(reason: impl Into<String>) -> Self {
        AgentError::Usage {
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_has_its_code() {
        let io = || std::io::Error::other("x");
        let cases: Vec<(AgentError, i32)> = vec![
            (AgentError::usage("bad flag"), 2),
            (
                AgentError::Secret(rekindle_runtime::Error::DefaultSecretOffLoopback {
                    addr: "10.0.0.1".into(),
                }),
                2,
            ),
            (
                AgentError::Rendezvous(RendezvousError::Settings("min > max".into())),
                2,
            ),
            (AgentError::Rendezvous(RendezvousError::Shutdown), 3),
            (
                AgentError::StoreServer(ServerError::Bind {
                    addr: "127.0.0.1:1".parse().unwrap(),
                    source: io(),
                }),
                4,
            ),
            (AgentError::Store(StoreError::Closed), 4),
            (
                AgentError::Spawn {
                    local_rank: 0,
                    program: "p".into(),
                    source: io(),
                },
                4,
            ),
            (
                AgentError::File {
                    path: "/x".into(),
                    source: io(),
                },
                4,
            ),
            (AgentError::Signals(io()), 4),
            (AgentError::Internal { what: "w".into() }, 5),
        ];
        for (e, code) in cases {
            assert_eq!(e.exit_code(), code, "{e}");
        }
        assert_eq!(exit_code::signal(libc::SIGTERM), 143);
        assert_eq!(
            AgentOutcome::Signalled { signal: 2 }.exit_code(),
            130,
            "SIGINT"
        );
    }
}
