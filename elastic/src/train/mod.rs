//! The elastic training loop: what a DDP program calls to keep training while ranks die,
//! hang, are preempted or come back.
//!
//! ```no_run
//! use candle_nn::VarMap;
//! use rekindle_elastic::train::{self, ElasticOptions, StepOutput, Trainer};
//! use rekindle_runtime::optim::{Sgd, SgdConfig};
//! use rekindle_runtime::sampler::ElasticConfig;
//! # fn model_loss(_: &[usize]) -> anyhow::Result<(candle_core::backprop::GradStore, f32)> {
//! #     anyhow::bail!("the model goes here")
//! # }
//! # fn main() -> anyhow::Result<()> {
//! let worker = train::init()?; // RANK, WORLD_SIZE, the job's store: what `rekindle run` set
//! let varmap = VarMap::new(); // ... the model's variables, seeded
//! let optimizer = Sgd::new(SgdConfig::new(0.05).momentum(0.9), train::param_specs(&varmap)?)?;
//! let data = ElasticConfig::new(60_000, 512).seed(7);
//! let mut options = ElasticOptions::default();
//! options.checkpoint_dir = Some("ckpt".into());
//! options.checkpoint_every = 50;
//! let mut trainer = Trainer::new(worker, varmap, Box::new(optimizer), data, options)?;
//! let summary = trainer.run(1_000, |input| {
//!     let (grads, loss) = model_loss(input.indices)?;
//!     Ok::<_, anyhow::Error>(StepOutput::new(grads, input.indices.len()).with_loss(loss))
//! })?;
//! println!("final_step={}", summary.step);
//! # Ok(()) }
//! ```
//!
//! What [`Trainer::run`] does, per rank. The loop is the same for every way of spreading
//! training; a [`Strategy`] says how the state is laid out over the ranks and what a step
//! communicates ([`DdpStrategy`], the default, replicates the model; see [`strategy`]).
//! 1. **Restore**: the newest valid checkpoint of `checkpoint_dir`, if any (a whole-job
//!    restart resumes there); newer checkpoints that do not verify are reported and moved
//!    aside.
//! 2. **Form** a group with the other ranks of the round ([`form`]): a generation number in
//!    the job's store; a rank that was a member of the current generation (it failed, or it
//!    replaces a process that was) opens the next one, and everyone waits until every rank
//!    of the round has joined it, each publishing its step and what it holds. Then the TCP
//!    group is built under a store prefix unique to (round, generation); strategies build
//!    sub-groups under it.
//! 3. **Sync**: the strategy brings the state into the group's layout from the survivors'
//!    memory (DDP: the rank with the newest state, the highest step and then the lowest rank,
//!    broadcasts parameters and optimizer state), from the newest checkpoint for what no
//!    survivor holds, and names the rank whose step and sampler cursor everyone adopts.
//! 4. **Train**: each step takes this rank's share of the global batch from the
//!    [`ElasticSampler`] at the global cursor, runs the strategy's step (DDP: the step
//!    function's gradients all-reduced, [`Ddp`], atomic steps) and commits the sampler; one
//!    small all-reduce at the step boundary averages the loss and says whether a rank is
//!    stopping on a signal. Every `checkpoint_every` steps the writers the strategy names
//!    commit a checkpoint in the background (DDP: rank 0).
//! 5. **Recover**: when a collective fails (a peer died, hung past the operation deadline,
//!    or left), the group and its sub-groups are aborted and the interrupted step discarded
//!    (atomic steps leave the state untouched); the agents of ranks silent past the deadline
//!    are asked to replace them, and the rank goes back to 2. When the agent re-forms the node
//!    into a new round (a node joined or was lost), the rank moves there at the next step
//!    boundary, with its new rank and world size, and resharding follows from the cursor.
//! 6. **Preemption**: on SIGTERM or SIGINT the group stops at the next step boundary; sharded
//!    state is checkpointed by every rank together, replicated state by local rank 0 of each
//!    stopping node; the stopping ranks' `run` returns [`RunEnd::Preempted`] and the others
//!    re-form without them.
//!
//! With a fixed world size the result does not depend on the faults: a run whose ranks are
//! killed and replaced ends with parameters bit-identical to an undisturbed run.
//!
//! [`ElasticSampler`]: rekindle_runtime::sampler::ElasticSampler
//! [`Ddp`]: rekindle_runtime::ddp::Ddp
//! [`Strategy`]: strategy::Strategy
//! [`DdpStrategy`]: strategy::DdpStrategy

mod audit;
mod checkpoint;
mod env;
pub mod form;
pub mod liveness;
pub mod metrics;
mod progress;
mod signal;
pub mod strategy;
mod trainer;

use std::path::PathBuf;
use std::time::Duration;

use candle_nn::VarMap;
use rekindle_runtime::ddp::DdpOptions;
use rekindle_runtime::optim::ParamSpec;
use rekindle_runtime::TcpOptions;

pub use audit::SAMPLE_AUDIT_ENV;
pub use env::{Assignment, WorkerEnv, ELASTIC_KEY_ENV, LOCAL_ADDR_ENV, MEMBERSHIP_NEXT_ENV};
pub use strategy::{Boundary, DdpStrategy, StateSource, StepOutput, Strategy};
pub use trainer::{RunEnd, RunSummary, StepInput, Trainer};

pub(crate) use checkpoint::{MODEL_GROUP, STATE_GROUP};

/// Reads this worker's place in the job from the environment `rekindle run` sets (see
/// [`WorkerEnv::from_env`]); a process started by hand is a job of one rank.
pub fn init() -> Result<WorkerEnv, TrainError> {
    WorkerEnv::from_env()
}

/// The parameters of `varmap` sorted by name, as the optimizer given to [`Trainer::new`]
/// must be built over them.
pub fn param_specs(varmap: &VarMap) -> Result<Vec<ParamSpec>, TrainError> {
    let vars = varmap.data().lock().map_err(|_| TrainError::Config {
        reason: "the VarMap's lock is poisoned".into(),
    })?;
    let mut specs: Vec<ParamSpec> = vars
        .iter()
        .map(|(n, v)| ParamSpec::new(n.clone(), v.dims()))
        .collect();
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(specs)
}

/// Settings of the elastic loop.
#[derive(Debug, Clone)]
pub struct ElasticOptions {
    /// Where checkpoints go and where a restart resumes from (`None`: no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Rank 0 commits a checkpoint (in the background) every this many steps; 0: only at the
    /// end and on preemption.
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest valid one is never deleted). Default 3.
    pub keep_checkpoints: usize,
    /// DDP settings (buckets, step mode). The step mode must stay `Atomic` for live recovery.
    pub ddp: DdpOptions,
    /// The collective backend of the loop's groups and sub-groups. Default TCP.
    pub backend: CollectiveBackend,
    /// TCP backend settings.
    pub tcp: TcpOptions,
    /// Deadline of each collective: a peer silent for longer is treated as lost. Default 30 s.
    pub op_timeout: Duration,
    /// Deadline for building the group once every rank has joined. Default 30 s.
    pub bootstrap_timeout: Duration,
    /// How long a rank waits for the group to re-form (a lost rank to be restarted, or the
    /// agent to re-form the round) before giving up. Default 300 s.
    pub rejoin_timeout: Duration,
    /// Show a progress bar on rank 0 (drawn only when stderr is a terminal). Default true.
    pub progress: bool,
    /// Rank 0 appends `step,epoch,loss,samples_per_s,world_size,unix_time` per step here.
    pub loss_csv: Option<PathBuf>,
    /// Check every this many steps that the ranks' parameters are bit-identical; 0: never.
    pub check_parameters_every: u64,
    /// Stop at the next step boundary on SIGTERM/SIGINT (and checkpoint). Default true.
    pub handle_signals: bool,
}

impl Default for ElasticOptions {
    fn default() -> Self {
        ElasticOptions {
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            ddp: DdpOptions::default(),
            backend: CollectiveBackend::Tcp,
            tcp: TcpOptions::default(),
            op_timeout: Duration::from_secs(30),
            bootstrap_timeout: Duration::from_secs(30),
            rejoin_timeout: Duration::from_secs(300),
            progress: true,
            loss_csv: None,
            check_parameters_every: 0,
            handle_signals: true,
        }
    }
}

/// The collective backend the elastic loop builds its groups on, every round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveBackend {
    /// The TCP backend (shared-memory rings between ranks of one host).
    #[default]
    Tcp,
    /// NCCL on `cuda:LOCAL_RANK`: a build with the `nccl` feature, a CUDA device for every
    /// local rank and an NCCL library this process can load. Host buffers (the DDP strategy's
    /// flattened gradients) are staged through the device; a membership change aborts the
    /// communicator and the next round builds a new one over the store.
    Nccl,
}

impl CollectiveBackend {
    /// The backend's name (`tcp`, `nccl`).
    pub fn name(&self) -> &'static str {
        match self {
            CollectiveBackend::Tcp => "tcp",
            CollectiveBackend::Nccl => "nccl",
        }
    }

    /// The device the groups of local rank `local_rank` use.
    pub fn device(&self, local_rank: usize) -> rekindle_runtime::Device {
        match self {
            CollectiveBackend::Tcp => rekindle_runtime::Device::Cpu,
            CollectiveBackend::Nccl => rekindle_runtime::Device::Cuda(local_rank),
        }
    }

    /// Builds a group of `config` on this backend: TCP with `tcp`, NCCL on the device of
    /// `local_rank`.
    pub(crate) fn group(
        &self,
        config: rekindle_runtime::GroupConfig,
        tcp: &TcpOptions,
        local_rank: usize,
    ) -> rekindle_runtime::Result<rekindle_runtime::ProcessGroup> {
        match self {
            CollectiveBackend::Tcp => rekindle_runtime::ProcessGroup::tcp(config, tcp.clone()),
            CollectiveBackend::Nccl => {
                rekindle_runtime::ProcessGroup::nccl(config, self.device(local_rank))
            }
        }
    }

    /// Checks, before any group is built, that local rank `local_rank` can use the backend:
    /// for NCCL, that this build has it, that `cuda:LOCAL_RANK` is there and that the NCCL
    /// library loads. A failure is a [`TrainError::Config`] (the loop would otherwise fail to
    /// build every generation's group until its deadlines ran out).
    pub fn check(&self, local_rank: usize) -> Result<(), TrainError> {
        if *self == CollectiveBackend::Tcp {
            return Ok(());
        }
        let config = |reason: String| TrainError::Config {
            reason: format!("--backend nccl on local rank {local_rank}: {reason}"),
        };
        if !cfg!(feature = "nccl") {
            return Err(config(
                "this build has no NCCL support: build with `--features nccl` \
                 (rekindle-elastic/nccl), or use --backend tcp"
                    .into(),
            ));
        }
        self.device(local_rank)
            .ensure_available()
            .map_err(|e| config(e.to_string()))?;
        #[cfg(feature = "nccl")]
        rekindle_runtime::NcclBackend::library_version().map_err(|e| config(e.to_string()))?;
        Ok(())
    }
}

impl std::fmt::Display for CollectiveBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CollectiveBackend {
    type Err = TrainError;

    /// `tcp` (also `gloo`, the name PyTorch's CPU backend goes by) or `nccl`,
    /// case-insensitively.
    fn from_str(s: &str) -> Result<Self, TrainError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" | "gloo" => Ok(CollectiveBackend::Tcp),
            "nccl" => Ok(CollectiveBackend::Nccl),
            _ => Err(TrainError::Config {
                reason: format!("unknown collective backend {s:?} (tcp or nccl)"),
            }),
        }
    }
}

/// Why the elastic loop stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The environment or the options are invalid.
    #[error("invalid elastic-training setup: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// An environment variable has a bad value.
    #[error("environment variable {name}={value:?}: {reason}")]
    Env {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The job's store failed.
    #[error("rank {rank}: the job store failed during {during}: {source}")]
    Store {
        /// This rank.
        rank: usize,
        /// What the loop was doing.
        during: &'static str,
        /// The store's error.
        #[source]
        source: rekindle_runtime::store::StoreError,
    },
    /// The group did not re-form within `rejoin_timeout`.
    #[error(
        "rank {rank}: the group of round {round} did not re-form within {waited:?} \
         (generation {generation}, ranks still missing: {missing:?})"
    )]
    RejoinTimeout {
        /// This rank.
        rank: usize,
        /// The round.
        round: u64,
        /// The generation waited for.
        generation: u64,
        /// How long it waited.
        waited: Duration,
        /// The ranks that never joined.
        missing: Vec<usize>,
    },
    /// The step function failed (not a collective: the program's own error).
    #[error("rank {rank}: the step function failed at step {step}: {source}")]
    Step {
        /// This rank.
        rank: usize,
        /// The step.
        step: u64,
        /// The program's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The model, optimizer or sampler refused the state (a program error, not a fault).
    #[error("rank {rank}: {what}: {reason}")]
    State {
        /// This rank.
        rank: usize,
        /// What was being done.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a checkpoint failed.
    #[error("rank {rank}: checkpoint: {source}")]
    Checkpoint {
        /// This rank.
        rank: usize,
        /// The storage error.
        #[source]
        source: rekindle_storage::StorageError,
    },
    /// Writing the loss CSV failed.
    #[error("cannot write the loss CSV {path}: {source}")]
    LossCsv {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_by_name_and_refuse_others() {
        for (s, b) in [
            ("tcp", CollectiveBackend::Tcp),
            (" Gloo ", CollectiveBackend::Tcp),
            ("NCCL", CollectiveBackend::Nccl),
        ] {
            assert_eq!(s.parse::<CollectiveBackend>().unwrap(), b, "{s}");
        }
        assert!(matches!(
            "mpi".parse::<CollectiveBackend>(),
            Err(TrainError::Config { .. })
        ));
        assert_eq!(CollectiveBackend::Nccl.to_string(), "nccl");
        assert_eq!(
            CollectiveBackend::Nccl.device(3),
            rekindle_runtime::Device::Cuda(3)
        );
        assert_eq!(CollectiveBackend::default(), CollectiveBackend::Tcp);
    }

    #[test]
    fn nccl_is_refused_up_front_where_it_cannot_run() {
        assert!(CollectiveBackend::Tcp.check(0).is_ok());
        // No build here has both a GPU and the driver: NCCL is refused with its reason.
        if rekindle_runtime::cuda_device_count() == 0 {
            let e = CollectiveBackend::Nccl.check(0).unwrap_err().to_string();
            assert!(e.contains("--backend nccl on local rank 0"), "{e}");
        }
    }
}
