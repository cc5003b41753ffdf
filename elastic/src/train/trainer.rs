//! [`Trainer`]: the loop of the [module docs](super), in the order of its numbered steps:
//!
//! 1. restore: [`Trainer::with_strategy`];
//! 2. form: [`Trainer::run`] and `join`;
//! 3. sync: `train_in_group` and `run_group`;
//! 4. train: `train_steps` and the step boundary ([`Strategy::boundary`]);
//! 5. recover: `fault` and `evict`, then back to 2;
//! 6. preemption: `stop_group` inside a group, `preempt` outside.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_nn::VarMap;
use rekindle_runtime::ddp::broadcast_state;
use rekindle_runtime::optim::Optimizer;
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler, ElasticState, PlannedStep};
use rekindle_runtime::store::{PrefixStore, Store};
use rekindle_runtime::{GroupConfig, JobSecret, ProcessGroup};
use rekindle_storage::{Layout, Snapshot};

use super::audit::{AuditLine, SampleAudit};
use super::checkpoint::{self, Checkpoints};
use super::env::{Assignment, WorkerEnv};
use super::form::{current_generation, evict_key, join_generation, Member};
use super::liveness::{EvictionNotice, LivenessWriter};
use super::metrics::MetricsWriter;
use super::progress::{Progress, StepLine, StepRate};
use super::strategy::{
    BoxError, CheckpointPlan, DdpStrategy, Group, StateSource, StepError, Strategy, SubGroupBuilder,
};
use super::{signal, ElasticOptions, TrainError};
use crate::membership::{MembershipEvent, WorkerMembership};

/// What the step function gets: this rank's share of the step's global batch.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The step being computed (0-based: the number of steps completed before it).
    pub step: u64,
    /// The epoch.
    pub epoch: u64,
    /// The dataset indices of this rank's samples (may be empty).
    pub indices: &'a [usize],
    /// This rank in the current group.
    pub rank: usize,
    /// The current world size.
    pub world_size: usize,
}

/// How [`Trainer::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// Every step was taken.
    Finished,
    /// SIGTERM or SIGINT: the rank stopped at a step boundary (after a checkpoint of it, if
    /// there is a checkpoint dir: see [`CheckpointPlan`] for who writes it).
    Preempted {
        /// The signal.
        signal: i32,
    },
}

/// What [`Trainer::run`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// How it ended.
    pub end: RunEnd,
    /// The step reached.
    pub step: u64,
    /// The epoch reached.
    pub epoch: u64,
    /// This process's rank at the end.
    pub rank: usize,
    /// The world size at the end.
    pub world_size: usize,
    /// The step of the checkpoint this process resumed from, if it did.
    pub resumed_from: Option<u64>,
    /// Groups this process formed (1 without faults).
    pub groups_formed: u64,
    /// Steps whose work was discarded because a collective failed.
    pub steps_discarded: u64,
    /// The last checkpoint this process committed.
    pub last_checkpoint: Option<u64>,
}

/// How often a rank building its group checks for a newer generation or round.
const BOOTSTRAP_POLL: Duration = Duration::from_millis(50);

/// The name under which the step count travels with the loop's state.
const STEP_TENSOR: &str = "trainer.step";

/// The elastic training loop over one [`Strategy`] (DDP by default) and one sampler. See the
/// [module docs](super).
pub struct Trainer<S: Strategy = DdpStrategy> {
    env: WorkerEnv,
    strategy: S,
    sampler: ElasticSampler,
    options: ElasticOptions,
    step: u64,
    has_state: bool,
    resumed_from: Option<u64>,
    checkpoints: Option<Checkpoints>,
    groups_formed: u64,
    steps_discarded: u64,
    progress: Option<Progress>,
    rate: StepRate,
    audit: Option<SampleAudit>,
    metrics: MetricsWriter,
    liveness: LivenessWriter,
}

impl<S: Strategy> std::fmt::Debug for Trainer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("env", &self.env)
            .field("strategy", &self.strategy.name())
            .field("step", &self.step)
            .field("has_state", &self.has_state)
            .finish_non_exhaustive()
    }
}

/// Why a group ended.
enum Interrupt {
    /// A collective failed, or peers are stopping: form the next generation.
    Failed(String),
    /// The agent moved this node to a new round.
    Reassigned(Assignment),
    /// A termination signal reached this rank (the group has checkpointed if it could).
    Signal,
    /// Every step is done.
    Done,
}

/// Reads the agent's membership events up to the next `Assigned` (this worker's place in a
/// new round); the other events need nothing from a worker in the loop.
fn next_assignment(
    membership: &mut Option<WorkerMembership>,
    local_rank: usize,
) -> Option<Assignment> {
    let m = membership.as_mut()?;
    loop {
        match m.poll() {
            Ok(Some(MembershipEvent::Assigned {
                new_round,
                rank_base,
                world_size,
                store,
                store_prefix,
                ..
            })) => {
                return Some(Assignment {
                    round: new_round,
                    rank: rank_base + local_rank,
                    world_size,
                    store_addr: Some(store),
                    store_prefix,
                })
            }
            Ok(Some(ev)) => tracing::debug!(event = ?ev, "membership event"),
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read membership events from the agent");
                return None;
            }
        }
    }
}

impl Trainer<DdpStrategy> {
    /// A DDP trainer over `varmap`'s variables, `optimizer` (built over
    /// [`param_specs`](super::param_specs) of the same map) and the sampler `data` describes.
    /// Restores the newest valid checkpoint of `options.checkpoint_dir`, if any.
    pub fn new(
        env: WorkerEnv,
        varmap: VarMap,
        optimizer: Box<dyn Optimizer>,
        data: ElasticConfig,
        options: ElasticOptions,
    ) -> Result<Trainer<DdpStrategy>, TrainError> {
        let strategy = DdpStrategy::new(varmap, optimizer, options.ddp.clone())?;
        Trainer::with_strategy(env, strategy, data, options)
    }

    /// The model's variables.
    pub fn varmap(&self) -> &VarMap {
        self.strategy.varmap()
    }
}

impl<S: Strategy> Trainer<S> {
    /// A trainer of `strategy` over the sampler `data` describes. Step 1, **restore**: loads
    /// the newest valid checkpoint of `options.checkpoint_dir`, if any (a whole-job restart
    /// resumes there).
    pub fn with_strategy(
        env: WorkerEnv,
        strategy: S,
        data: ElasticConfig,
        options: ElasticOptions,
    ) -> Result<Trainer<S>, TrainError> {
        let rank = env.assignment.rank;
        options.backend.check(env.local_rank)?;
        let sampler = ElasticSampler::new(data).map_err(|e| TrainError::State {
            rank,
            what: "building the sampler",
            reason: e.to_string(),
        })?;
        let checkpoints = match &options.checkpoint_dir {
            Some(dir) => Some(Checkpoints::new(dir, options.keep_checkpoints, rank)?),
            None => None,
        };
        let liveness = LivenessWriter::from_env(env.assignment.round);
        let mut trainer = Trainer {
            env,
            strategy,
            sampler,
            options,
            step: 0,
            has_state: false,
            resumed_from: None,
            checkpoints,
            groups_formed: 0,
            steps_discarded: 0,
            progress: None,
            rate: StepRate::default(),
            audit: SampleAudit::from_env()?,
            metrics: MetricsWriter::from_env(),
            liveness,
        };
        trainer.restore()?;
        trainer.metrics.at_step(trainer.step);
        Ok(trainer)
    }

    fn rank(&self) -> usize {
        self.env.assignment.rank
    }

    /// The step reached so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The strategy.
    pub fn strategy(&self) -> &S {
        &self.strategy
    }

    /// The strategy, mutably (between runs).
    pub fn strategy_mut(&mut self) -> &mut S {
        &mut self.strategy
    }

    /// This worker's place in the job.
    pub fn worker(&self) -> &WorkerEnv {
        &self.env
    }

    fn state_err(&self, what: &'static str, e: impl std::fmt::Display) -> TrainError {
        TrainError::State {
            rank: self.rank(),
            what,
            reason: e.to_string(),
        }
    }

    fn step_err(&self, e: StepError) -> TrainError {
        let rank = self.rank();
        match e {
            StepError::Program(source) => TrainError::Step {
                rank,
                step: self.step,
                source,
            },
            StepError::Checkpoint(source) => TrainError::Checkpoint {
                rank,
                source: *source,
            },
            StepError::State { what, reason } => TrainError::State { rank, what, reason },
            e @ StepError::Collective { .. } => TrainError::State {
                rank,
                what: "a collective outside a group",
                reason: e.to_string(),
            },
        }
    }

    /// Step 1: the newest valid checkpoint, if any: the loop's state, then the strategy's.
    fn restore(&mut self) -> Result<(), TrainError> {
        let rank = self.rank();
        let Some(ck) = &mut self.checkpoints else {
            return Ok(());
        };
        let Some(ckpt) = ck.open_newest_valid()? else {
            return Ok(());
        };
        let sampler = checkpoint::read_sampler(&ckpt, rank)?;
        self.sampler
            .restore(sampler)
            .map_err(|e| self.state_err("restoring the sampler", e))?;
        let world_size = self.env.assignment.world_size;
        self.strategy
            .restore(&ckpt, rank, world_size)
            .map_err(|e| self.step_err(e))?;
        self.step = ckpt.step();
        self.resumed_from = Some(ckpt.step());
        self.has_state = true;
        tracing::info!(rank, step = ckpt.step(), path = %ckpt.path().display(), "resumed from checkpoint");
        eprintln!(
            "rekindle: rank {rank}: resumed from step {} ({})",
            ckpt.step(),
            ckpt.path().display()
        );
        Ok(())
    }

    /// The loop's own state (sampler and step) as named tensors, for the sync broadcast.
    fn export_loop_state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let mut out = self
            .sampler
            .state()
            .to_tensors()
            .map_err(|e| self.state_err("exporting the sampler state", e))?;
        let step = Tensor::new(self.step as i64, &candle_core::Device::Cpu)
            .map_err(|e| self.state_err("exporting the step", e))?;
        out.push((STEP_TENSOR.to_string(), step));
        Ok(out)
    }

    fn import_loop_state(&mut self, state: &[(String, Tensor)]) -> Result<(), TrainError> {
        let sampler = ElasticState::from_tensors(state)
            .map_err(|e| self.state_err("importing the sampler state", e))?;
        self.sampler
            .restore(sampler)
            .map_err(|e| self.state_err("importing the sampler state", e))?;
        self.step = state
            .iter()
            .find(|(n, _)| n == STEP_TENSOR)
            .and_then(|(_, t)| t.to_scalar::<i64>().ok())
            .map(|s| s as u64)
            .ok_or_else(|| self.state_err("importing the step", "no trainer.step tensor"))?;
        Ok(())
    }

    /// The next membership event that asks this worker to move, if the agent sent one.
    fn poll_agent(&mut self) -> Option<Assignment> {
        next_assignment(&mut self.env.membership, self.env.local_rank)
    }

    /// Runs until `max_steps` steps are done (counting those of a checkpoint resumed from)
    /// or a termination signal arrives. `step_fn` computes this rank's part of a step (for
    /// DDP: the gradients of its share); it is called again for a step that was interrupted.
    ///
    /// Step 2, **form**: each pass of the loop joins the current generation of the round with
    /// the other ranks ([`form`](super::form)) and trains in its group until the group ends:
    /// a failed collective (5, **recover**) forms the next generation, a new round from the
    /// agent moves this rank there, and a termination signal (6, **preemption**) stops it.
    pub fn run<E>(
        &mut self,
        max_steps: u64,
        mut step_fn: impl FnMut(&StepInput<'_>) -> Result<S::Output, E>,
    ) -> Result<RunSummary, TrainError>
    where
        E: Into<BoxError>,
    {
        if self.options.handle_signals {
            signal::install().map_err(|e| TrainError::Config {
                reason: format!("cannot install the SIGTERM handler: {e}"),
            })?;
        }
        let mut step_fn = |input: &StepInput<'_>| step_fn(input).map_err(Into::into);
        let mut store = self.env.assignment.connect()?;
        let mut pending: Option<Assignment> = None;
        loop {
            if let Some(a) = pending.take().or_else(|| self.poll_agent()) {
                self.move_to(a);
                store = self.env.assignment.connect()?;
            }
            if let Some(signal) = signal::received().filter(|_| self.options.handle_signals) {
                return self.preempt(signal);
            }
            if self.step >= max_steps && self.strategy.finished() {
                return self.finish(max_steps);
            }
            let Some((generation, members)) = self.join(&store, &mut pending)? else {
                continue;
            };
            let rank = self.rank();
            match self.train_in_group(&store, generation, &members, max_steps, &mut step_fn)? {
                Interrupt::Failed(why) => {
                    tracing::warn!(rank, generation, reason = %why, "group failed; re-forming");
                    self.say(&format!(
                        "rekindle: rank {rank}: {why}; re-forming the group at step {}",
                        self.step
                    ));
                }
                Interrupt::Reassigned(a) => pending = Some(a),
                Interrupt::Signal | Interrupt::Done => {}
            }
        }
    }

    /// Joins the current generation; `None` when a signal or a new round interrupted the
    /// wait (the new round is left in `pending`).
    fn join(
        &mut self,
        store: &Arc<dyn Store>,
        pending: &mut Option<Assignment>,
    ) -> Result<Option<(u64, Vec<Member>)>, TrainError> {
        let Assignment {
            round,
            rank,
            world_size,
            ..
        } = self.env.assignment.clone();
        let me = Member {
            step: self.step,
            has_state: self.has_state,
            pid: std::process::id(),
            node: self.env.node_id.clone(),
            holds: self.strategy.holdings(),
        };
        let handle_signals = self.options.handle_signals;
        let membership = &mut self.env.membership;
        let local_rank = self.env.local_rank;
        join_generation(
            store.as_ref(),
            rank,
            world_size,
            &me,
            self.options.rejoin_timeout,
            round,
            || {
                if handle_signals && signal::received().is_some() {
                    return true;
                }
                if let Some(a) = next_assignment(membership, local_rank) {
                    *pending = Some(a);
                    return true;
                }
                false
            },
        )
    }

    fn say(&self, msg: &str) {
        match &self.progress {
            Some(p) => p.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    fn move_to(&mut self, a: Assignment) {
        tracing::info!(old = ?self.env.assignment, new = ?a, "moving to a new round");
        eprintln!(
            "rekindle: local rank {}: moving to round {} as rank {} of {}",
            self.env.local_rank, a.round, a.rank, a.world_size
        );
        self.liveness.left(a.round);
        self.env.assignment = a;
    }

    /// How long this rank waits for a collective's result. The backend's own deadline
    /// (`op_timeout`, counted from when the operation starts) fails a stuck operation first and
    /// names the silent ranks; waiting no longer than `op_timeout` here would race it and could
    /// end with an error that names nobody, leaving no rank to evict.
    fn collective_wait(&self) -> Duration {
        self.options.op_timeout * 2 + Duration::from_secs(1)
    }

    /// Builds the group of `generation` on a helper thread, so that a newer generation (a
    /// member died before connecting and its replacement arrived) or a new round ends the wait
    /// at once instead of at the bootstrap deadline; an abandoned build ends at that deadline.
    fn build_group(
        &mut self,
        store: &Arc<dyn Store>,
        generation: u64,
    ) -> Result<Result<(ProcessGroup, SubGroupBuilder), Interrupt>, TrainError> {
        let Assignment {
            round,
            rank,
            world_size,
            ..
        } = self.env.assignment.clone();
        let secret = JobSecret::from_env().map_err(|e| TrainError::Config {
            reason: e.to_string(),
        })?;
        let round_id = (round << 32) | (generation & 0xffff_ffff);
        let mut tcp = self.options.tcp.clone();
        if let Some(ip) = self.env.local_addr.filter(|ip| !ip.is_loopback()) {
            tcp.bind_addr = ip;
        }
        let subgroups = SubGroupBuilder {
            job: self.env.job.clone(),
            round: round_id,
            store: store.clone(),
            secret: secret.clone(),
            tcp: tcp.clone(),
            backend: self.options.backend,
            local_rank: self.env.local_rank,
            op_timeout: self.options.op_timeout,
            bootstrap_timeout: self.options.bootstrap_timeout,
        };
        let config = GroupConfig {
            job: self.env.job.clone(),
            round: round_id,
            rank,
            world_size,
            store: Arc::new(PrefixStore::new(store.clone(), "pg/")),
            secret,
            op_timeout: self.options.op_timeout,
            bootstrap_timeout: self.options.bootstrap_timeout,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (backend, local_rank) = (self.options.backend, self.env.local_rank);
        std::thread::Builder::new()
            .name("rekindle-bootstrap".into())
            .spawn(move || {
                let _ = tx.send(backend.group(config, &tcp, local_rank));
            })
            .map_err(|e| TrainError::Config {
                reason: format!("cannot start the bootstrap thread: {e}"),
            })?;
        loop {
            match rx.recv_timeout(BOOTSTRAP_POLL) {
                Ok(Ok(pg)) => return Ok(Ok((pg, subgroups))),
                Ok(Err(e)) => {
                    return Ok(Err(Interrupt::Failed(format!("building the group: {e}"))))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Ok(Err(Interrupt::Failed(
                        "building the group: the builder stopped".into(),
                    )))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(a) = self.poll_agent() {
                return Ok(Err(Interrupt::Reassigned(a)));
            }
            // An unreachable store supersedes nothing: the build's own deadline ends the wait.
            if current_generation(store.as_ref(), rank).is_ok_and(|g| g > generation) {
                return Ok(Err(Interrupt::Failed(format!(
                    "generation {generation} was superseded while its group was being built"
                ))));
            }
        }
    }

    /// Step 3, **sync**, and the group's life: builds the group of `generation`, lets the
    /// strategy bring the state into the group's layout, adopts the loop state of the rank the
    /// strategy names, trains until the group ends, and aborts the group (and its sub-groups)
    /// unless it ended with every step done.
    fn train_in_group(
        &mut self,
        store: &Arc<dyn Store>,
        generation: u64,
        members: &[Member],
        max_steps: u64,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<S::Output, BoxError>,
    ) -> Result<Interrupt, TrainError> {
        let formed_at = Instant::now();
        let round = self.env.assignment.round;
        self.liveness.entered(round, generation);
        let (pg, builder) = match self.build_group(store, generation) {
            Ok(Ok(built)) => built,
            Ok(Err(interrupt)) => {
                self.liveness.left(round);
                return Ok(interrupt);
            }
            Err(e) => {
                self.liveness.left(round);
                return Err(e);
            }
        };
        let mut subgroups = Vec::new();
        let out = self.run_group(
            store,
            &pg,
            &builder,
            &mut subgroups,
            generation,
            members,
            max_steps,
            formed_at,
            step_fn,
        );
        if !matches!(out, Ok(Interrupt::Done)) {
            // Tell the peers now rather than when their next operation times out.
            for sub in &subgroups {
                sub.abort();
            }
            pg.abort();
        }
        self.strategy.leave();
        self.liveness.left(round);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn run_group(
        &mut self,
        store: &Arc<dyn Store>,
        pg: &ProcessGroup,
        builder: &SubGroupBuilder,
        subgroups: &mut Vec<ProcessGroup>,
        generation: u64,
        members: &[Member],
        max_steps: u64,
        formed_at: Instant,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<S::Output, BoxError>,
    ) -> Result<Interrupt, TrainError> {
        let round = self.env.assignment.round;
        let rank = pg.rank();
        let world_size = pg.world_size();
        let wait = self.collective_wait();
        let mut group = Group {
            pg,
            round,
            generation,
            members,
            builder,
            subgroups,
            checkpoints: self.checkpoints.as_ref().map(Checkpoints::writer),
            newest: None,
            wait,
            max_steps,
        };
        let source = match self.strategy.sync(&mut group) {
            Ok(source) => source,
            Err(e) => return self.fault(store, members, e),
        };
        let src = match source {
            StateSource::Rank(src) | StateSource::Advance { rank: src, .. } => {
                let mine = if rank == src {
                    Some(self.export_loop_state()?)
                } else {
                    None
                };
                match broadcast_state(pg, mine, src, wait) {
                    Ok(state) if rank != src => self.import_loop_state(&state)?,
                    Ok(_) => {}
                    Err(rekindle_runtime::ddp::DdpError::Collective { source, .. }) => {
                        return self.fault(
                            store,
                            members,
                            StepError::collective("syncing the step", source),
                        )
                    }
                    Err(e) => return Err(self.state_err("syncing the step", e)),
                }
                match source {
                    StateSource::Advance { step, .. } if step != self.step => {
                        let from = self.step;
                        self.advance_to(step)?;
                        format!("rank {src}, moved on from step {from}")
                    }
                    _ => format!("rank {src}"),
                }
            }
            StateSource::Checkpoint => {
                let ckpt = match group.newest_checkpoint() {
                    Ok(Some(c)) => c,
                    Ok(None) => {
                        return Err(self.state_err(
                            "syncing the step",
                            "the strategy rolled back to a checkpoint, but there is none",
                        ))
                    }
                    Err(e) => return Err(self.step_err(e)),
                };
                let sampler = checkpoint::read_sampler(&ckpt, rank)?;
                self.sampler
                    .restore(sampler)
                    .map_err(|e| self.state_err("restoring the sampler", e))?;
                self.step = ckpt.step();
                format!("checkpoint step-{}", ckpt.step())
            }
        };
        self.has_state = true;
        self.groups_formed += 1;
        if rank == 0 {
            if self.progress.is_none() {
                self.progress = Some(Progress::new(
                    max_steps,
                    self.step,
                    self.options.progress,
                    self.options.loss_csv.as_deref(),
                )?);
            }
            let joiners = members.iter().filter(|m| !m.has_state).count();
            self.say(&format!(
                "rekindle: round {round} generation {generation}: {world_size} rank(s), state \
                 of step {} from {src}{} (formed in {:.1} ms)",
                self.step,
                if joiners > 0 {
                    format!(", {joiners} joined without state")
                } else {
                    String::new()
                },
                formed_at.elapsed().as_secs_f64() * 1e3
            ));
        }
        self.train_steps(store, &mut group, max_steps, step_fn)
    }

    /// Moves the loop state forward to `step` ([`StateSource::Advance`]): plans and commits
    /// the steps in between without computing them (their updates are in the strategy's state
    /// already; they were audited when they were first committed).
    fn advance_to(&mut self, step: u64) -> Result<(), TrainError> {
        if step < self.step {
            return Err(self.state_err(
                "syncing the step",
                format!(
                    "the strategy asked to move the state from step {} back to {step}",
                    self.step
                ),
            ));
        }
        while self.step < step {
            if self.sampler.epoch_done() {
                self.sampler.set_epoch(self.sampler.epoch() + 1);
            }
            let Some(planned) = self.sampler.plan() else {
                return Err(self.state_err("moving the step on", "the epoch has no samples"));
            };
            self.sampler
                .commit(&planned)
                .map_err(|e| self.state_err("moving the step on", e))?;
            self.step += 1;
        }
        Ok(())
    }

    /// A strategy error inside a group: a failed collective ends the group (asking the agents
    /// of the silent ranks to replace them); anything else ends the run.
    fn fault(
        &mut self,
        store: &Arc<dyn Store>,
        members: &[Member],
        e: StepError,
    ) -> Result<Interrupt, TrainError> {
        match e {
            StepError::Collective { ref silent, .. } => {
                self.evict(store, members, silent);
                Ok(Interrupt::Failed(e.to_string()))
            }
            e => Err(self.step_err(e)),
        }
    }

    /// Asks the agents of the ranks that went silent to replace them. The request names this
    /// group, so that the agent can drop it when the rank was only unreachable: alive, it
    /// leaves the group itself when its own collective fails (see [`super::liveness`]).
    fn evict(&self, store: &Arc<dyn Store>, members: &[Member], silent: &[usize]) {
        let (round, generation) = self
            .liveness
            .group()
            .unwrap_or((self.env.assignment.round, 0));
        let notice = EvictionNotice {
            by: self.rank(),
            round,
            generation,
        };
        let Ok(notice) = serde_json::to_vec(&notice) else {
            return;
        };
        let keys: Vec<String> = silent
            .iter()
            .filter_map(|&r| {
                let m = members.get(r).filter(|m| !m.node.is_empty())?;
                tracing::warn!(rank = r, pid = m.pid, node = %m.node, "rank is silent past the deadline; asking its agent to replace it");
                Some(evict_key(&m.node, m.pid))
            })
            .collect();
        if keys.is_empty() {
            return;
        }
        // On a thread of its own: a store this rank cannot reach (it is the one cut off)
        // must not hold up its re-forming; the store's own deadline ends the attempt.
        let store = store.clone();
        let spawned = std::thread::Builder::new()
            .name("rekindle-evict".into())
            .spawn(move || {
                for key in keys {
                    if let Err(e) = store.set(&key, &notice) {
                        tracing::warn!(error = %e, "cannot ask for the silent rank's replacement");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot ask for the silent rank's replacement");
        }
    }

    /// This rank's share of `planned` under the strategy's data split.
    fn share<'p>(
        &self,
        planned: &'p PlannedStep,
        group: &Group<'_>,
    ) -> Result<&'p [usize], TrainError> {
        match self.strategy.data_share(group.rank(), group.world_size()) {
            Some((share, shares)) => planned
                .rank_indices(shares, share)
                .map_err(|e| self.state_err("planning a step", e)),
            None => Ok(&[]),
        }
    }

    /// Step 4, **train**: steps in this group until every step is done, the group fails, the
    /// agent moves the rank, or a signal stops it. Each step: this rank's share of the global
    /// batch, the strategy's step, the sampler's commit, then one small all-reduce at the step
    /// boundary that averages the loss and tells every rank whether one of them is stopping
    /// on a signal (so the group checkpoints together before it shrinks).
    fn train_steps(
        &mut self,
        store: &Arc<dyn Store>,
        group: &mut Group<'_>,
        max_steps: u64,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<S::Output, BoxError>,
    ) -> Result<Interrupt, TrainError> {
        let rank = group.rank();
        let world_size = group.world_size();
        let members = group.members;
        let first_step = self.step;
        while self.step < max_steps {
            if let Some(a) = self.poll_agent() {
                return Ok(Interrupt::Reassigned(a));
            }
            if self.sampler.epoch_done() {
                self.sampler.set_epoch(self.sampler.epoch() + 1);
            }
            let Some(planned) = self.sampler.plan() else {
                return Err(self.state_err("planning a step", "the epoch has no samples"));
            };
            let indices = self.share(&planned, group)?;
            let started = Instant::now();
            let input = StepInput {
                step: self.step,
                epoch: planned.epoch(),
                indices,
                rank,
                world_size,
            };
            let done = match self.strategy.step(group, &input, step_fn) {
                Ok(d) => d,
                Err(e) => {
                    if matches!(e, StepError::Collective { .. }) {
                        self.steps_discarded += 1;
                    }
                    return self.fault(store, members, e);
                }
            };
            self.sampler
                .commit(&planned)
                .map_err(|e| self.state_err("advancing the sampler", e))?;
            if let Some(audit) = &mut self.audit {
                audit.record(&AuditLine {
                    step: self.step,
                    epoch: planned.epoch(),
                    world_size,
                    rank,
                    round: group.round(),
                    generation: group.generation(),
                    indices: planned.indices(),
                });
            }
            self.step += 1;
            self.liveness.beat();
            self.metrics
                .step(self.step, started.elapsed().as_secs_f64());
            if let Some(ck) = &self.checkpoints {
                self.metrics.observe(&ck.writer());
            }
            // The step boundary (after the update: a failure here loses nothing).
            let stopping = self.options.handle_signals && signal::received().is_some();
            let (loss, stop) = match self.strategy.boundary(group, &done, stopping) {
                Ok(b) => (b.loss, b.stop),
                Err(e) => return self.fault(store, members, e),
            };
            if rank == 0 {
                let samples_per_s = self
                    .rate
                    .record(started, Instant::now(), done.global_samples);
                let line = StepLine {
                    step: self.step,
                    epoch: planned.epoch(),
                    loss,
                    samples_per_s,
                    world_size,
                };
                if let Some(p) = &mut self.progress {
                    p.step(&line)?;
                }
            }
            if stop {
                return self.stop_group(store, group, stopping);
            }
            let every = self.options.checkpoint_every;
            if every > 0 && self.step % every == 0 {
                let fresh = self
                    .checkpoints
                    .as_ref()
                    .is_some_and(|c| c.last() != Some(self.step));
                if fresh {
                    if let Err(e) = self.prepare_sharded(group) {
                        return self.fault(store, members, e);
                    }
                }
                self.checkpoint_async(store, group)?;
            }
            let check = self.options.check_parameters_every;
            if check > 0 && self.step % check == 0 {
                if let Err(e) = self.strategy.verify(group) {
                    return self.fault(store, members, e);
                }
            }
        }
        // A group formed only to run `finish` (a failure interrupted it) took no step.
        let stepped = self.step > first_step;
        if let CheckpointPlan::Sharded(_) = self.strategy.checkpoint_plan(world_size) {
            if stepped {
                // Every shard owner is still here: the final checkpoint is written together.
                if let Err(e) = self.prepare_sharded(group) {
                    return self.fault(store, members, e);
                }
                self.checkpoint_sharded_now(store, group)?;
            }
        }
        if let Err(e) = self.strategy.finish(group) {
            return self.fault(store, members, e);
        }
        Ok(Interrupt::Done)
    }

    /// Step 6 inside a group: a rank is stopping on a signal. With sharded state every rank
    /// writes its shard of this step now, while the group still holds every shard; then the
    /// stopping ranks leave and the others re-form without them.
    fn stop_group(
        &mut self,
        store: &Arc<dyn Store>,
        group: &mut Group<'_>,
        stopping: bool,
    ) -> Result<Interrupt, TrainError> {
        if let CheckpointPlan::Sharded(_) = self.strategy.checkpoint_plan(group.world_size()) {
            let saved = match self.prepare_sharded(group) {
                Ok(()) => self.checkpoint_sharded_now(store, group),
                Err(e) => Err(self.step_err(e)),
            };
            if let Err(e) = saved {
                tracing::warn!(error = %e, "the checkpoint at preemption failed");
                eprintln!(
                    "rekindle: rank {}: the checkpoint at preemption failed: {e}",
                    self.rank()
                );
            }
        }
        if stopping {
            Ok(Interrupt::Signal)
        } else {
            Ok(Interrupt::Failed(format!(
                "a rank is stopping on a signal at step {}",
                self.step
            )))
        }
    }

    /// Lets the strategy prepare a sharded checkpoint of the current step (every rank calls it
    /// at the same step); nothing without a checkpoint directory or for replicated state.
    fn prepare_sharded(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        if self.checkpoints.is_none() {
            return Ok(());
        }
        match self.strategy.checkpoint_plan(group.world_size()) {
            CheckpointPlan::Sharded(_) => self.strategy.prepare_checkpoint(group),
            CheckpointPlan::Replicated => Ok(()),
        }
    }

    /// The checkpoint of the current state this rank writes, or `None` when it writes none.
    fn snapshot(
        &self,
        plan: &CheckpointPlan,
        world_size: usize,
    ) -> Result<Option<Snapshot>, TrainError> {
        let rank = self.rank();
        let layout = match plan {
            CheckpointPlan::Replicated if rank != 0 => return Ok(None),
            CheckpointPlan::Replicated => Layout::Replicated,
            CheckpointPlan::Sharded(layout) => layout.clone(),
        };
        let mut snap = checkpoint::loop_snapshot(self.step, &self.sampler, world_size, layout);
        self.strategy
            .checkpoint(&mut snap)
            .map_err(|e| self.step_err(e))?;
        if rank == 0 {
            checkpoint::insert_sampler(&mut snap, &self.sampler, rank)?;
        }
        Ok(Some(snap))
    }

    /// Starts a background checkpoint of the current state.
    fn checkpoint_async(
        &mut self,
        store: &Arc<dyn Store>,
        group: &Group<'_>,
    ) -> Result<(), TrainError> {
        let Some(ck) = &self.checkpoints else {
            return Ok(());
        };
        if ck.last() == Some(self.step) {
            return Ok(());
        }
        let plan = self.strategy.checkpoint_plan(group.world_size());
        let Some(snap) = self.snapshot(&plan, group.world_size())? else {
            return Ok(());
        };
        let coord = match plan {
            CheckpointPlan::Sharded(_) => Some(checkpoint::coordinator(
                store,
                group.generation(),
                group.rank(),
                group.world_size(),
                self.options.bootstrap_timeout,
            )?),
            CheckpointPlan::Replicated => None,
        };
        if let Some(ck) = &mut self.checkpoints {
            let step = snap.state.step;
            match coord {
                Some(coord) => ck.save_sharded_async(snap, coord),
                None => ck.save_async(snap),
            }
            self.metrics.save_started(step, &ck.writer());
        }
        Ok(())
    }

    /// Every rank of the group writes its shard of the current state now.
    fn checkpoint_sharded_now(
        &mut self,
        store: &Arc<dyn Store>,
        group: &Group<'_>,
    ) -> Result<Option<u64>, TrainError> {
        if self.checkpoints.is_none() {
            return Ok(None);
        }
        let plan = self.strategy.checkpoint_plan(group.world_size());
        let Some(snap) = self.snapshot(&plan, group.world_size())? else {
            return Ok(None);
        };
        let coord = checkpoint::coordinator(
            store,
            group.generation(),
            group.rank(),
            group.world_size(),
            self.options.bootstrap_timeout,
        )?;
        match &mut self.checkpoints {
            Some(ck) => ck.save_sharded_now(&snap, &coord).map(Some),
            None => Ok(None),
        }
    }

    /// Commits a checkpoint of replicated state now (this rank writes all of it).
    fn checkpoint_replicated_now(&mut self) -> Result<Option<u64>, TrainError> {
        let world_size = self.env.assignment.world_size;
        let plan = self.strategy.checkpoint_plan(world_size);
        if self.checkpoints.is_none() || plan != CheckpointPlan::Replicated {
            return Ok(None);
        }
        let layout = Layout::Replicated;
        let mut snap = checkpoint::loop_snapshot(self.step, &self.sampler, world_size, layout);
        self.strategy
            .checkpoint(&mut snap)
            .map_err(|e| self.step_err(e))?;
        checkpoint::insert_sampler(&mut snap, &self.sampler, self.rank())?;
        match &mut self.checkpoints {
            Some(ck) => ck.save_now(&snap).map(Some),
            None => Ok(None),
        }
    }

    fn summary(&self, end: RunEnd) -> RunSummary {
        RunSummary {
            end,
            step: self.step,
            epoch: self.sampler.epoch(),
            rank: self.rank(),
            world_size: self.env.assignment.world_size,
            resumed_from: self.resumed_from,
            groups_formed: self.groups_formed,
            steps_discarded: self.steps_discarded,
            last_checkpoint: self.checkpoints.as_ref().and_then(Checkpoints::last),
        }
    }

    /// Every step is done: rank 0 commits the final checkpoint of replicated state (sharded
    /// state was written by the group together).
    fn finish(&mut self, max_steps: u64) -> Result<RunSummary, TrainError> {
        if self.rank() == 0 && self.step >= max_steps {
            self.checkpoint_replicated_now()?;
        }
        if let Some(ck) = &self.checkpoints {
            ck.flush();
            self.metrics.observe(&ck.writer());
        }
        self.metrics.at_step(self.step);
        self.metrics.flush();
        if let Some(p) = &self.progress {
            p.finish();
        }
        Ok(self.summary(RunEnd::Finished))
    }

    /// Step 6, **preemption**: local rank 0 of each node commits a checkpoint of replicated
    /// state (a node with its own disk keeps one); the save in flight is waited for.
    fn preempt(&mut self, signal: i32) -> Result<RunSummary, TrainError> {
        let saved = if self.env.local_rank == 0 && self.has_state {
            self.checkpoint_replicated_now()?
        } else {
            None
        };
        if let Some(ck) = &self.checkpoints {
            ck.flush();
            self.metrics.observe(&ck.writer());
        }
        self.metrics.at_step(self.step);
        self.metrics.flush();
        if let Some(p) = &self.progress {
            p.finish();
        }
        let saved = saved.or_else(|| self.checkpoints.as_ref().and_then(Checkpoints::last));
        eprintln!(
            "rekindle: rank {}: stopping on signal {signal} at step {}{}",
            self.rank(),
            self.step,
            match saved {
                Some(s) if s == self.step => format!("; checkpoint step-{s} committed"),
                _ => String::new(),
            }
        );
        Ok(self.summary(RunEnd::Preempted { signal }))
    }
}
