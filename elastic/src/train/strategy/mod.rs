//! Strategies: how the training state is laid out over the ranks and what one step
//! communicates. The elastic loop ([`Trainer`](super::Trainer)) owns what every way of
//! spreading training shares: identity, rendezvous and membership, forming the group, the step
//! boundary, the sampler, checkpoint scheduling, recovery and preemption. A [`Strategy`] owns
//! what differs:
//!
//! | | DDP ([`DdpStrategy`]) | a pipeline | a parameter server |
//! |---|---|---|---|
//! | layout of the state | replicated | sharded by stage | sharded by server |
//! | one step | all-reduce of the gradients | activations forward, gradients back | push gradients, pull parameters |
//! | re-forming ([`Strategy::sync`]) | the newest replica broadcasts | each layer from the survivor holding it | each shard from its server or its copy |
//! | checkpoint files ([`CheckpointPlan`]) | rank 0 writes all | every stage its shard | every server its shard |
//!
//! The loop calls, per rank:
//! 1. [`Strategy::restore`] once, with the newest valid checkpoint, if any;
//! 2. per group: [`Strategy::holdings`] (published with this rank's generation record, so that
//!    every rank knows what every other rank holds), then [`Strategy::sync`], which brings the
//!    state into the new group's layout (from the survivors' memory first; from
//!    [`Group::newest_checkpoint`] for what no survivor holds) and says where everyone takes
//!    the loop state (step, sampler cursor) from ([`StateSource`]);
//! 3. per step: [`Strategy::step`] with this rank's share of the global batch
//!    ([`Strategy::data_share`]), then [`Strategy::boundary`] (by default one small
//!    all-reduce that keeps the ranks in step); a collective that fails returns
//!    [`StepError::Collective`], and the loop aborts the group (and its
//!    [sub-groups](Group::subgroup)) and re-forms;
//! 4. per checkpoint: [`Strategy::prepare_checkpoint`] on every rank (sharded state), then
//!    [`Strategy::checkpoint`] on every rank that writes ([`Strategy::checkpoint_plan`]);
//! 5. [`Strategy::finish`] once every step is done, in the last group, after the final
//!    checkpoint (a sharded strategy gathers what the program reads at the end);
//! 6. [`Strategy::leave`] when a group ends, however it ends.
//!
//! Steps must be atomic: a step that fails leaves this rank's state as it was before the
//! step, or (when a peer failed after this rank's part was complete) as it is after the step;
//! `sync` then settles on one of the two for the whole group.

mod ddp;
pub mod parameter_server;
pub mod pipeline;

use std::sync::Arc;
use std::time::Duration;

pub use ddp::{DdpStrategy, StepOutput};
pub use parameter_server::{ParameterServer, PsConfig, PsMode};
pub use pipeline::{Batch, PipelineConfig, PipelineModel, PipelineStrategy};
use rekindle_runtime::store::{PrefixStore, Store};
use rekindle_runtime::{Buffer, GroupConfig, JobSecret, ProcessGroup, ReduceOp, TcpOptions};
use rekindle_storage::{AsyncCheckpointer, Checkpoint, Layout, Snapshot, StorageError};

use super::form::Member;

/// An error a step function or a strategy passes through the loop.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one rank's call of [`Strategy::step`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepDone {
    /// Samples of the step over all ranks (for the samples/s figure).
    pub global_samples: u64,
    /// The samples this rank computed the loss over (0: it reports no loss).
    pub loss_samples: u64,
    /// The mean loss over those samples.
    pub loss: f32,
}

/// Why a strategy's step or sync did not complete.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A collective failed (a peer died, left, or was silent past the deadline): the loop
    /// aborts the group and re-forms it. `silent` names the (parent-group) ranks that were
    /// silent past the deadline, which the loop asks their agents to replace.
    #[error("{during}: {source}")]
    Collective {
        /// What the strategy was doing.
        during: &'static str,
        /// Ranks of the parent group silent past the deadline (empty: none known).
        silent: Vec<usize>,
        /// The backend's error.
        #[source]
        source: Box<rekindle_runtime::Error>,
    },
    /// The program's step function failed (not a fault: the loop stops with the error).
    #[error("the step function failed: {0}")]
    Program(#[source] BoxError),
    /// The model, optimizer or layout refused the state (a program error).
    #[error("{what}: {reason}")]
    State {
        /// What was being done.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Reading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[source] Box<StorageError>),
}

impl From<StorageError> for StepError {
    fn from(e: StorageError) -> StepError {
        StepError::Checkpoint(Box::new(e))
    }
}

impl StepError {
    /// A [`StepError::State`].
    pub fn state(what: &'static str, reason: impl std::fmt::Display) -> StepError {
        StepError::State {
            what,
            reason: reason.to_string(),
        }
    }

    /// A failed collective of the parent group: the ranks a timeout waited on are the silent
    /// ones.
    pub fn collective(during: &'static str, source: rekindle_runtime::Error) -> StepError {
        let silent = match &source {
            rekindle_runtime::Error::Timeout { waiting_on, .. } => waiting_on.clone(),
            _ => Vec::new(),
        };
        StepError::Collective {
            during,
            silent,
            source: Box::new(source),
        }
    }
}

/// Where every rank takes the loop's own state (step, epoch, sampler cursor) from after
/// [`Strategy::sync`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateSource {
    /// From this rank's memory (broadcast to the others).
    Rank(usize),
    /// From the checkpoint [`Group::newest_checkpoint`] returns: the strategy rolled the
    /// whole state back to it, because some of the newest state was held by no survivor.
    Checkpoint,
    /// From `rank`'s memory, then moved forward to `step`: every rank plans and commits the
    /// sampler's steps from `rank`'s step up to `step` without computing them, because the
    /// strategy's state already holds their updates. For a strategy whose ranks do not take
    /// their steps together ([`Strategy::boundary`]), where the step the state is at may be
    /// one no rank stopped at; `rank`'s step must not be past `step`.
    Advance {
        /// The rank whose step and sampler are taken.
        rank: usize,
        /// The step every rank moves to.
        step: u64,
    },
}

/// What the ranks agree on at a step boundary ([`Strategy::boundary`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Boundary {
    /// The sample-weighted mean loss of the step (`None`: no rank reported one).
    pub loss: Option<f64>,
    /// A rank is stopping on a signal: every rank stops at this boundary (and checkpoints
    /// sharded state together).
    pub stop: bool,
}

/// Who writes the files of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointPlan {
    /// Every rank holds the same state; rank 0 writes it (in the background). On preemption
    /// the stopping node's local rank 0 writes it too, so a node with its own disk keeps it.
    Replicated,
    /// Every rank writes its own shard and rank 0 commits one manifest (all ranks take part,
    /// in the background).
    Sharded(Layout),
}

/// What a strategy sees of the group it runs in; built by the loop for each generation.
pub struct Group<'a> {
    pub(crate) pg: &'a ProcessGroup,
    pub(crate) round: u64,
    pub(crate) generation: u64,
    pub(crate) members: &'a [Member],
    pub(crate) builder: &'a SubGroupBuilder,
    pub(crate) subgroups: &'a mut Vec<ProcessGroup>,
    pub(crate) checkpoints: Option<Arc<AsyncCheckpointer>>,
    pub(crate) newest: Option<Option<Arc<Checkpoint>>>,
    pub(crate) wait: Duration,
    pub(crate) max_steps: u64,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("round", &self.round)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Group<'_> {
    /// The group of every rank.
    pub fn pg(&self) -> &ProcessGroup {
        self.pg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    /// The agent's rendezvous round.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The generation within the round (see [`form`](super::form)).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Every rank's record of this generation, in rank order: its step, whether it holds
    /// state, and what it holds ([`Member::holds`], from [`Strategy::holdings`]).
    pub fn members(&self) -> &[Member] {
        self.members
    }

    /// The step the run ends at (`max_steps` of [`Trainer::run`](super::Trainer::run)).
    pub fn max_steps(&self) -> u64 {
        self.max_steps
    }

    /// How long to wait for a collective's result: longer than the backend's own deadline,
    /// so that the backend's error, which names the silent ranks, comes first.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The rank whose state is the newest: the highest step among the ranks that hold state,
    /// then the lowest rank; `None` when no rank holds state.
    pub fn newest(&self) -> Option<usize> {
        self.members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.has_state)
            .max_by(|(ra, a), (rb, b)| a.step.cmp(&b.step).then(rb.cmp(ra)))
            .map(|(r, _)| r)
    }

    /// Builds a group over `ranks` (ranks of this group, ascending, including this one), for
    /// a strategy that communicates within subsets: the ranks that hold one pipeline stage,
    /// the servers of a parameter server. Every rank in `ranks` must call it with the same
    /// `name` and `ranks`, at the same point. It lives under this generation's store prefix,
    /// and the loop aborts it with the parent group. Errors map sub-group ranks back to
    /// parent ranks with [`SubGroup::error`].
    pub fn subgroup(&mut self, name: &str, ranks: &[usize]) -> Result<SubGroup, StepError> {
        let me = self.rank();
        let bad = |reason: String| StepError::State {
            what: "building a sub-group",
            reason,
        };
        if name.is_empty() || name.contains('/') {
            return Err(bad(format!("sub-group name {name:?} (non-empty, no '/')")));
        }
        if ranks.windows(2).any(|w| w[0] >= w[1]) || ranks.iter().any(|&r| r >= self.world_size()) {
            return Err(bad(format!(
                "ranks {ranks:?} must be ascending ranks of a group of {}",
                self.world_size()
            )));
        }
        let Some(local) = ranks.iter().position(|&r| r == me) else {
            return Err(bad(format!(
                "rank {me} is not in sub-group {name} {ranks:?}"
            )));
        };
        let pg =
            self.builder
                .build(name, local, ranks.len())
                .map_err(|e| StepError::Collective {
                    during: "building a sub-group",
                    silent: Vec::new(),
                    source: Box::new(e),
                })?;
        self.subgroups.push(pg.clone());
        Ok(SubGroup {
            pg,
            ranks: ranks.to_vec(),
        })
    }

    /// The loop's step boundary: one all-reduce of `[loss sum, loss samples, ranks stopping]`
    /// over the whole group, giving the sample-weighted mean loss and whether any rank is
    /// stopping on a signal. The default of [`Strategy::boundary`].
    pub fn step_boundary(&self, done: &StepDone, stopping: bool) -> Result<Boundary, StepError> {
        let n = done.loss_samples as f64;
        let values = vec![done.loss as f64 * n, n, f64::from(u8::from(stopping))];
        let out = self
            .pg
            .all_reduce(Buffer::from(values), ReduceOp::Sum)
            .wait(self.wait)
            .map_err(|e| StepError::collective("the step boundary", e))?;
        match out.as_slice::<f64>() {
            Some(&[s, n, stop]) => Ok(Boundary {
                loss: (n > 0.0).then(|| s / n),
                stop: stop > 0.0,
            }),
            _ => Err(StepError::state(
                "the step boundary",
                "the all-reduce returned the wrong shape",
            )),
        }
    }

    /// The newest committed checkpoint that verifies, for the state that no surviving rank
    /// holds; `None` without a checkpoint directory or a valid checkpoint. A collective: every
    /// rank calls it at the same point, and every rank gets the same checkpoint (each rank
    /// first waits for its own save in flight, then the ranks agree on the newest committed
    /// step; checkpoints of sharded state need a directory every rank sees). The answer is
    /// kept for the rest of the group's life.
    pub fn newest_checkpoint(&mut self) -> Result<Option<Arc<Checkpoint>>, StepError> {
        if let Some(known) = &self.newest {
            return Ok(known.clone());
        }
        let seen = match &self.checkpoints {
            Some(writer) => {
                if let Err(e) = writer.flush(self.wait) {
                    tracing::warn!(error = %e, "the checkpoint in flight failed");
                }
                writer
                    .dir()
                    .committed_steps()?
                    .last()
                    .map_or(-1, |&s| s as i64)
            }
            None => -1,
        };
        let agreed = self
            .pg
            .all_reduce(Buffer::from(vec![seen]), ReduceOp::Max)
            .wait(self.wait)
            .map_err(|e| StepError::collective("agreeing on the newest checkpoint", e))?;
        let agreed = match agreed.as_slice::<i64>() {
            Some(&[s]) => s,
            _ => {
                return Err(StepError::state(
                    "agreeing on the newest checkpoint",
                    "bad reply",
                ))
            }
        };
        let found = match (&self.checkpoints, agreed) {
            (Some(writer), s) if s >= 0 => {
                super::checkpoint::newest_valid(writer.dir().root(), Some(s as u64))?.map(Arc::new)
            }
            _ => None,
        };
        self.newest = Some(found.clone());
        Ok(found)
    }
}

/// A group over a subset of the ranks, built by [`Group::subgroup`].
#[derive(Debug, Clone)]
pub struct SubGroup {
    pg: ProcessGroup,
    ranks: Vec<usize>,
}

impl SubGroup {
    /// The sub-group (its ranks are positions in [`SubGroup::ranks`]).
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The parent ranks of the sub-group's ranks.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// A failed collective of this sub-group, with the silent ranks named as parent ranks.
    pub fn error(&self, during: &'static str, source: rekindle_runtime::Error) -> StepError {
        let silent = match &source {
            rekindle_runtime::Error::Timeout { waiting_on, .. } => waiting_on
                .iter()
                .filter_map(|&r| self.ranks.get(r).copied())
                .collect(),
            _ => Vec::new(),
        };
        StepError::Collective {
            during,
            silent,
            source: Box::new(source),
        }
    }
}

/// Builds the sub-groups of one generation: the parent's job, round, secret and options,
/// under `pg/sub/<name>/` of the generation's store.
pub(crate) struct SubGroupBuilder {
    pub job: String,
    pub round: u64,
    pub store: Arc<dyn Store>,
    pub secret: JobSecret,
    pub tcp: TcpOptions,
    pub backend: crate::train::CollectiveBackend,
    pub local_rank: usize,
    pub op_timeout: Duration,
    pub bootstrap_timeout: Duration,
}

impl SubGroupBuilder {
    fn build(
        &self,
        name: &str,
        rank: usize,
        world_size: usize,
    ) -> rekindle_runtime::Result<ProcessGroup> {
        let config = GroupConfig {
            // A job name of its own: the handshake keeps the parent's connections and every
            // other sub-group's apart.
            job: format!("{}#{name}", self.job),
            round: self.round,
            rank,
            world_size,
            store: Arc::new(PrefixStore::new(
                self.store.clone(),
                format!("pg/sub/{name}/"),
            )),
            secret: self.secret.clone(),
            op_timeout: self.op_timeout,
            bootstrap_timeout: self.bootstrap_timeout,
        };
        self.backend.group(config, &self.tcp, self.local_rank)
    }
}

/// How the training state is laid out over the ranks and what one step communicates. See the
/// [module docs](self) for when the loop calls what.
pub trait Strategy {
    /// What the program's step function returns each step (DDP: the gradients).
    type Output;

    /// A short name for logs ("ddp", "pipeline", ...).
    fn name(&self) -> &'static str;

    /// Loads this rank's part of the state from `checkpoint` (the loop has restored its own
    /// state, the step and the sampler, from it). `rank` of `world_size` is this process's
    /// place when it starts; the layout may still change when the first group forms.
    fn restore(
        &mut self,
        checkpoint: &Checkpoint,
        rank: usize,
        world_size: usize,
    ) -> Result<(), StepError>;

    /// What this rank holds, as JSON published with its generation record
    /// ([`Member::holds`]); the default says nothing beyond step and `has_state`.
    fn holdings(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// Brings the state into the layout of `group` (just formed) and says where every rank
    /// takes the loop state (step, epoch, sampler cursor) from: a rank whose state the
    /// strategy settled on, or the newest checkpoint when it rolled back to it. Every rank
    /// calls it and must return the same answer.
    fn sync(&mut self, group: &mut Group<'_>) -> Result<StateSource, StepError>;

    /// Which share of each global batch this rank computes, as `(share, shares)`: the batch
    /// is split into `shares` contiguous parts. `None`: this rank takes no data. The default
    /// is one share per rank.
    fn data_share(&self, rank: usize, world_size: usize) -> Option<(usize, usize)> {
        Some((rank, world_size))
    }

    /// One training step. `input.indices` is this rank's share; `step_fn` is the program's.
    /// Atomic: on error this rank's state is as before the step (or, if only a peer failed
    /// after this rank's part completed, as after it).
    fn step(
        &mut self,
        group: &mut Group<'_>,
        input: &super::StepInput<'_>,
        step_fn: &mut dyn FnMut(&super::StepInput<'_>) -> Result<Self::Output, BoxError>,
    ) -> Result<StepDone, StepError>;

    /// The step boundary, after this rank's step `done` was committed; `stopping` says
    /// whether this rank got a termination signal. The default is
    /// [`Group::step_boundary`], one all-reduce over the whole group, which keeps the ranks in
    /// step. A strategy whose ranks take their steps at their own pace (an asynchronous
    /// parameter server) overrides it: it must still make every rank see `stop` at the same
    /// step, and every rank still passes every step number in order.
    fn boundary(
        &mut self,
        group: &mut Group<'_>,
        done: &StepDone,
        stopping: bool,
    ) -> Result<Boundary, StepError> {
        group.step_boundary(done, stopping)
    }

    /// Called on every rank before [`Strategy::checkpoint`] for a
    /// [`CheckpointPlan::Sharded`] checkpoint (every rank at the same step: a periodic one,
    /// the one at a stop on a signal, and the final one before [`Strategy::finish`]), for a
    /// strategy that must move state between ranks first (the pieces of a tensor split over
    /// ranks gathered on the rank that writes it; ranks that do not end their steps together
    /// brought together before the final or stopping checkpoint, which blocks every rank
    /// until all have written). Only called when the run has a checkpoint directory. The
    /// default does nothing.
    fn prepare_checkpoint(&mut self, _group: &mut Group<'_>) -> Result<(), StepError> {
        Ok(())
    }

    /// Checks that the ranks agree (DDP: bit-identical parameters); called every
    /// `check_parameters_every` steps. The default checks nothing.
    fn verify(&mut self, _group: &mut Group<'_>) -> Result<(), StepError> {
        Ok(())
    }

    /// Who writes checkpoint files in a group of `world_size`.
    fn checkpoint_plan(&self, world_size: usize) -> CheckpointPlan;

    /// Adds this rank's tensors to a checkpoint: groups `model` (parameters) and `state`
    /// (everything else), as plain names. Called on rank 0 for [`CheckpointPlan::Replicated`]
    /// and on every rank for [`CheckpointPlan::Sharded`].
    fn checkpoint(&self, snapshot: &mut Snapshot) -> Result<(), StepError>;

    /// Called on every rank of the group that completed the last step, once every step is
    /// done (after the final checkpoint of sharded state), while the group is still formed:
    /// a strategy whose state is spread over the ranks gathers here what the program reads
    /// after [`Trainer::run`](super::Trainer::run) returns (a pipeline: the whole model on
    /// rank 0). A collective that fails re-forms the group and calls it again. The default
    /// does nothing.
    fn finish(&mut self, _group: &mut Group<'_>) -> Result<(), StepError> {
        Ok(())
    }

    /// Whether [`finish`](Self::finish) has completed since the last step; while it has not,
    /// a rank that has taken every step still forms a group to run it. The default says yes.
    fn finished(&self) -> bool {
        true
    }

    /// The group ended (failed, re-assigned or done): drop what belongs to it.
    fn leave(&mut self) {}
}
