//! [`Trainer`]: the loop of the [module docs](super).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use rekindle_runtime::ddp::{broadcast_state, Ddp, DdpError};
use rekindle_runtime::optim::Optimizer;
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler, ElasticState};
use rekindle_runtime::store::{PrefixStore, Store};
use rekindle_runtime::{Buffer, GroupConfig, JobSecret, ProcessGroup, ReduceOp};
use rekindle_storage::{
    AsyncCheckpointer, Checkpoint, CheckpointDir, LoadOptions, RetentionPolicy, Snapshot,
    StorageError, TrainingState,
};

use super::env::{Assignment, WorkerEnv};
use super::form::{current_generation, evict_key, join_generation, Member};
use super::progress::{Progress, StepLine};
use super::{param_specs, signal, ElasticOptions, TrainError};
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

/// What the step function returns.
#[derive(Debug)]
pub struct StepOutput {
    grads: Option<GradStore>,
    samples: usize,
    loss: Option<f32>,
}

impl StepOutput {
    /// Gradients of a loss averaged over `samples` samples.
    pub fn new(grads: GradStore, samples: usize) -> StepOutput {
        StepOutput {
            grads: Some(grads),
            samples,
            loss: None,
        }
    }

    /// Nothing to contribute (this rank got no samples); it still takes part in the step.
    pub fn empty() -> StepOutput {
        StepOutput {
            grads: None,
            samples: 0,
            loss: None,
        }
    }

    /// Reports the batch's mean loss: the loop shows the sample-weighted mean over ranks.
    pub fn with_loss(mut self, loss: f32) -> StepOutput {
        self.loss = Some(loss);
        self
    }
}

/// How [`Trainer::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// Every step was taken.
    Finished,
    /// SIGTERM or SIGINT: the rank stopped at a step boundary (local rank 0 committed a
    /// checkpoint of it, if there is a checkpoint dir).
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

/// The name under which the step count travels with the state.
const STEP_TENSOR: &str = "trainer.step";
/// Checkpoint group of the parameters.
const MODEL_GROUP: &str = "model";
/// Checkpoint group of optimizer and sampler state.
const STATE_GROUP: &str = "state";

/// The elastic training loop over one model, optimizer and sampler. See the
/// [module docs](super).
pub struct Trainer {
    env: WorkerEnv,
    varmap: VarMap,
    vars: Vec<(String, Var)>,
    optimizer: Box<dyn Optimizer>,
    sampler: ElasticSampler,
    options: ElasticOptions,
    step: u64,
    has_state: bool,
    resumed_from: Option<u64>,
    checkpoints: Option<AsyncCheckpointer>,
    last_checkpoint: Option<u64>,
    groups_formed: u64,
    steps_discarded: u64,
    progress: Option<Progress>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("env", &self.env)
            .field("step", &self.step)
            .field("has_state", &self.has_state)
            .finish_non_exhaustive()
    }
}

/// Why a group ended.
enum Interrupt {
    /// A collective failed: form the next generation.
    Failed(String),
    /// The agent moved this node to a new round.
    Reassigned(Assignment),
    /// A termination signal.
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

impl Trainer {
    /// A trainer over `varmap`'s variables, `optimizer` (built over [`param_specs`] of the
    /// same map) and the sampler `data` describes. Restores the newest valid checkpoint of
    /// `options.checkpoint_dir`, if there is one.
    pub fn new(
        env: WorkerEnv,
        varmap: VarMap,
        optimizer: Box<dyn Optimizer>,
        data: ElasticConfig,
        options: ElasticOptions,
    ) -> Result<Trainer, TrainError> {
        let rank = env.assignment.rank;
        let config = |reason: String| TrainError::Config { reason };
        if options.ddp.mode != rekindle_runtime::ddp::StepMode::Atomic {
            return Err(config(
                "live recovery needs atomic DDP steps (DdpOptions::mode = Atomic)".into(),
            ));
        }
        if optimizer.params() != param_specs(&varmap)?.as_slice() {
            return Err(config(
                "the optimizer must be built over train::param_specs(&varmap) (the model's \
                 parameters sorted by name)"
                    .into(),
            ));
        }
        let mut vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| config("the VarMap's lock is poisoned".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let sampler = ElasticSampler::new(data).map_err(|e| TrainError::State {
            rank,
            what: "building the sampler",
            reason: e.to_string(),
        })?;
        let checkpoints = match &options.checkpoint_dir {
            Some(dir) => {
                let ck = |source| TrainError::Checkpoint { rank, source };
                let policy = RetentionPolicy::last(options.keep_checkpoints.max(1)).map_err(ck)?;
                let dir = CheckpointDir::new(dir.clone())
                    .map_err(ck)?
                    .with_retention(policy);
                Some(AsyncCheckpointer::new(dir))
            }
            None => None,
        };
        let mut trainer = Trainer {
            env,
            varmap,
            vars,
            optimizer,
            sampler,
            options,
            step: 0,
            has_state: false,
            resumed_from: None,
            checkpoints,
            last_checkpoint: None,
            groups_formed: 0,
            steps_discarded: 0,
            progress: None,
        };
        trainer.restore()?;
        Ok(trainer)
    }

    fn rank(&self) -> usize {
        self.env.assignment.rank
    }

    /// The step reached so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model's variables.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
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

    /// Loads the newest valid checkpoint, if there is one.
    fn restore(&mut self) -> Result<(), TrainError> {
        let rank = self.rank();
        let Some(ck) = &self.checkpoints else {
            return Ok(());
        };
        let ckerr = |source| TrainError::Checkpoint { rank, source };
        // The newest checkpoint that verifies; newer ones that do not are moved aside (kept
        // for inspection as `step-N.corrupt-<pid>`), so that the run can commit those steps
        // again.
        let dir = ck.dir();
        let opts = LoadOptions::default();
        let mut corrupt = Vec::new();
        let mut found = None;
        for &step in dir.committed_steps().map_err(ckerr)?.iter().rev() {
            match Checkpoint::open(&dir.step_path(step), &opts) {
                Ok(c) => {
                    found = Some(c);
                    break;
                }
                Err(e @ StorageError::CudaNotCompiled { .. }) => return Err(ckerr(e)),
                Err(e) => {
                    tracing::warn!(step, error = %e, "skipping a checkpoint that does not verify");
                    eprintln!(
                        "rekindle: rank {rank}: checkpoint step-{step} does not verify ({e}); \
                         moving it aside"
                    );
                    corrupt.push(step);
                }
            }
        }
        for step in corrupt {
            let from = dir.step_path(step);
            let to = from.with_file_name(format!("step-{step}.corrupt-{}", std::process::id()));
            // Another rank may have moved it already.
            let _ = std::fs::rename(&from, &to);
        }
        let Some(ckpt) = found else {
            return Ok(());
        };
        for (name, var) in &self.vars {
            let t = ckpt
                .tensor(name)
                .and_then(|t| t.to_candle_on(rekindle_runtime::Device::Cpu))
                .map_err(ckerr)?;
            t.to_device(var.device())
                .and_then(|t| var.set(&t))
                .map_err(|e| self.state_err("restoring a parameter", format!("{name}: {e}")))?;
        }
        let mut rest = Vec::new();
        for name in ckpt.names() {
            if self.vars.iter().any(|(n, _)| n == name) {
                continue;
            }
            let t = ckpt
                .tensor(name)
                .and_then(|t| t.to_candle_on(rekindle_runtime::Device::Cpu))
                .map_err(ckerr)?;
            rest.push((name.to_string(), t));
        }
        self.import_state(&rest, Some(ckpt.step()))?;
        self.resumed_from = Some(ckpt.step());
        self.last_checkpoint = Some(ckpt.step());
        self.has_state = true;
        tracing::info!(rank, step = ckpt.step(), path = %ckpt.path().display(), "resumed from checkpoint");
        eprintln!(
            "rekindle: rank {rank}: resumed from step {} ({})",
            ckpt.step(),
            ckpt.path().display()
        );
        Ok(())
    }

    /// Optimizer and sampler state (and the step) as named tensors.
    fn export_state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let mut out = self
            .optimizer
            .state()
            .map_err(|e| self.state_err("exporting the optimizer state", e))?;
        out.extend(
            self.sampler
                .state()
                .to_tensors()
                .map_err(|e| self.state_err("exporting the sampler state", e))?,
        );
        let step = Tensor::new(self.step as i64, &candle_core::Device::Cpu)
            .map_err(|e| self.state_err("exporting the step", e))?;
        out.push((STEP_TENSOR.to_string(), step));
        Ok(out)
    }

    fn import_state(
        &mut self,
        state: &[(String, Tensor)],
        step: Option<u64>,
    ) -> Result<(), TrainError> {
        self.optimizer
            .load_state(state)
            .map_err(|e| self.state_err("importing the optimizer state", e))?;
        let sampler = ElasticState::from_tensors(state)
            .map_err(|e| self.state_err("importing the sampler state", e))?;
        self.sampler
            .restore(sampler)
            .map_err(|e| self.state_err("importing the sampler state", e))?;
        self.step = match step {
            Some(s) => s,
            None => state
                .iter()
                .find(|(n, _)| n == STEP_TENSOR)
                .and_then(|(_, t)| t.to_scalar::<i64>().ok())
                .map(|s| s as u64)
                .ok_or_else(|| self.state_err("importing the step", "no trainer.step tensor"))?,
        };
        Ok(())
    }

    fn snapshot(&self, world_size: usize) -> Result<Snapshot, TrainError> {
        let rank = self.rank();
        let ckerr = |source| TrainError::Checkpoint { rank, source };
        let mut snap = Snapshot::new(TrainingState {
            step: self.step,
            epoch: self.sampler.epoch(),
            sample_cursor: self.sampler.cursor() as u64,
            world_size,
            ..Default::default()
        });
        snap.insert_varmap(MODEL_GROUP, &self.varmap)
            .map_err(ckerr)?;
        for (name, t) in self.export_state()? {
            if name == STEP_TENSOR {
                continue;
            }
            snap.insert_candle(STATE_GROUP, &name, &t).map_err(ckerr)?;
        }
        Ok(snap)
    }

    /// Starts a background checkpoint of the current state (rank 0).
    fn checkpoint_async(&mut self, world_size: usize) -> Result<(), TrainError> {
        if self.checkpoints.is_none() || self.last_checkpoint == Some(self.step) {
            return Ok(());
        }
        let snap = self.snapshot(world_size)?;
        let Some(ck) = &self.checkpoints else {
            return Ok(());
        };
        match ck.save_owned(snap) {
            Ok(()) => self.last_checkpoint = Some(self.step),
            // The previous save failed: say so and go on training (what was saved before
            // is untouched); the next checkpoint tries again.
            Err(e) => tracing::warn!(step = self.step, error = %e, "checkpoint failed"),
        }
        Ok(())
    }

    /// Commits a checkpoint of the current state now and waits until it is durable.
    fn checkpoint_now(&mut self, world_size: usize) -> Result<Option<u64>, TrainError> {
        let rank = self.rank();
        let Some(ck) = &self.checkpoints else {
            return Ok(None);
        };
        if let Err(e) = ck.flush(Duration::from_secs(600)) {
            tracing::warn!(error = %e, "the checkpoint in flight failed");
        }
        if self.last_checkpoint == Some(self.step) && ck.dir().step_path(self.step).exists() {
            return Ok(Some(self.step));
        }
        let snap = self.snapshot(world_size)?;
        let Some(ck) = &self.checkpoints else {
            return Ok(None);
        };
        match ck.dir().save(&snap) {
            Ok(info) => {
                self.last_checkpoint = Some(info.step);
                Ok(Some(info.step))
            }
            // Another node committed the same step (the state is replicated): done.
            Err(StorageError::AlreadyExists { .. }) => {
                self.last_checkpoint = Some(self.step);
                Ok(Some(self.step))
            }
            Err(source) => Err(TrainError::Checkpoint { rank, source }),
        }
    }

    /// The next membership event that asks this worker to move, if the agent sent one.
    fn poll_agent(&mut self) -> Option<Assignment> {
        next_assignment(&mut self.env.membership, self.env.local_rank)
    }

    /// Runs until `max_steps` steps are done (counting those of a checkpoint resumed from)
    /// or a termination signal arrives. `step_fn` computes this rank's gradients for its
    /// share of a step; it is called again for a step that was interrupted.
    pub fn run<E>(
        &mut self,
        max_steps: u64,
        mut step_fn: impl FnMut(&StepInput<'_>) -> Result<StepOutput, E>,
    ) -> Result<RunSummary, TrainError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if self.options.handle_signals {
            signal::install().map_err(|e| TrainError::Config {
                reason: format!("cannot install the SIGTERM handler: {e}"),
            })?;
        }
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
            if self.step >= max_steps {
                return self.finish(max_steps);
            }
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
            };
            let handle_signals = self.options.handle_signals;
            let mut moved = None;
            let joined = {
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
                            moved = Some(a);
                            return true;
                        }
                        false
                    },
                )?
            };
            let Some((generation, members)) = joined else {
                pending = moved;
                continue;
            };
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
        self.env.assignment = a;
    }

    /// Builds the group of `generation`, syncs the state and trains until the group ends.
    fn train_in_group<E>(
        &mut self,
        store: &Arc<dyn Store>,
        generation: u64,
        members: &[Member],
        max_steps: u64,
        step_fn: &mut impl FnMut(&StepInput<'_>) -> Result<StepOutput, E>,
    ) -> Result<Interrupt, TrainError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let Assignment {
            round,
            rank,
            world_size,
            ..
        } = self.env.assignment.clone();
        let formed_at = Instant::now();
        let secret = JobSecret::from_env().map_err(|e| TrainError::Config {
            reason: e.to_string(),
        })?;
        let group = GroupConfig {
            job: self.env.job.clone(),
            round: (round << 32) | (generation & 0xffff_ffff),
            rank,
            world_size,
            store: Arc::new(PrefixStore::new(store.clone(), "pg/")),
            secret,
            op_timeout: self.options.op_timeout,
            bootstrap_timeout: self.options.bootstrap_timeout,
        };
        let mut tcp = self.options.tcp.clone();
        if let Some(ip) = self.env.local_addr.filter(|ip| !ip.is_loopback()) {
            tcp.bind_addr = ip;
        }
        // Build the group on a helper thread, so that a newer generation (a member died
        // before connecting and its replacement arrived) or a new round ends the wait at once
        // instead of at the bootstrap deadline; an abandoned build ends at that deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("rekindle-bootstrap".into())
            .spawn(move || {
                let _ = tx.send(ProcessGroup::tcp(group, tcp));
            })
            .map_err(|e| TrainError::Config {
                reason: format!("cannot start the bootstrap thread: {e}"),
            })?;
        let pg = loop {
            match rx.recv_timeout(BOOTSTRAP_POLL) {
                Ok(Ok(pg)) => break pg,
                Ok(Err(e)) => return Ok(Interrupt::Failed(format!("building the group: {e}"))),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Ok(Interrupt::Failed(
                        "building the group: the builder stopped".into(),
                    ))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(a) = self.poll_agent() {
                return Ok(Interrupt::Reassigned(a));
            }
            if current_generation(store.as_ref(), rank)? > generation {
                return Ok(Interrupt::Failed(format!(
                    "generation {generation} was superseded while its group was being built"
                )));
            }
        };
        // The newest state wins: the highest step, then the lowest rank. Without any state,
        // rank 0's (seeded) initial state.
        let src = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.has_state)
            .max_by(|(ra, a), (rb, b)| a.step.cmp(&b.step).then(rb.cmp(ra)))
            .map(|(r, _)| r)
            .unwrap_or(0);
        let mut ddp_options = self.options.ddp.clone();
        ddp_options.timeout = ddp_options.timeout.max(self.collective_wait());
        let mut ddp = match Ddp::with_root(&self.varmap, pg, ddp_options, src) {
            Ok(d) => d,
            Err(e @ DdpError::Collective { .. }) => {
                return Ok(Interrupt::Failed(format!("syncing parameters: {e}")))
            }
            Err(e) => return Err(self.state_err("building DDP", e)),
        };
        let mine = if rank == src {
            Some(self.export_state()?)
        } else {
            None
        };
        match broadcast_state(ddp.process_group(), mine, src, self.collective_wait()) {
            Ok(state) => {
                if rank != src {
                    self.import_state(&state, None)?;
                }
            }
            Err(e @ DdpError::Collective { .. }) => {
                ddp.process_group().abort();
                return Ok(Interrupt::Failed(format!("syncing state: {e}")));
            }
            Err(e) => return Err(self.state_err("syncing state", e)),
        }
        self.has_state = true;
        self.groups_formed += 1;
        if rank == 0 && self.progress.is_none() {
            self.progress = Some(Progress::new(
                max_steps,
                self.step,
                self.options.progress,
                self.options.loss_csv.as_deref(),
            )?);
        }
        if rank == 0 {
            let joiners = members.iter().filter(|m| !m.has_state).count();
            self.say(&format!(
                "rekindle: round {round} generation {generation}: {world_size} rank(s), state \
                 of step {} from rank {src}{} (formed in {:.1} ms)",
                self.step,
                if joiners > 0 {
                    format!(", {joiners} joined without state")
                } else {
                    String::new()
                },
                formed_at.elapsed().as_secs_f64() * 1e3
            ));
        }
        let out = self.train_steps(store, members, &mut ddp, max_steps, step_fn);
        if !matches!(out, Ok(Interrupt::Done)) {
            // Tell the peers now rather than when their next operation times out.
            ddp.process_group().abort();
        }
        out
    }

    /// How long this rank waits for a collective's result. The backend's own deadline
    /// (`op_timeout`, counted from when the operation starts) fails a stuck operation first and
    /// names the silent ranks; waiting no longer than `op_timeout` here would race it and could
    /// end with an error that names nobody, leaving no rank to evict.
    fn collective_wait(&self) -> Duration {
        self.options.op_timeout * 2 + Duration::from_secs(1)
    }

    /// Asks the agents of the ranks that went silent to replace them.
    fn evict(&self, store: &Arc<dyn Store>, members: &[Member], silent: &[usize]) {
        for &r in silent {
            let Some(m) = members.get(r).filter(|m| !m.node.is_empty()) else {
                continue;
            };
            tracing::warn!(rank = r, pid = m.pid, node = %m.node, "rank is silent past the deadline; asking its agent to replace it");
            if let Err(e) = store.set(
                &evict_key(&m.node, m.pid),
                self.rank().to_string().as_bytes(),
            ) {
                tracing::warn!(error = %e, "cannot ask for the silent rank's replacement");
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn train_steps<E>(
        &mut self,
        store: &Arc<dyn Store>,
        members: &[Member],
        ddp: &mut Ddp,
        max_steps: u64,
        step_fn: &mut impl FnMut(&StepInput<'_>) -> Result<StepOutput, E>,
    ) -> Result<Interrupt, TrainError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let rank = ddp.process_group().rank();
        let world_size = ddp.process_group().world_size();
        while self.step < max_steps {
            if let Some(a) = self.poll_agent() {
                return Ok(Interrupt::Reassigned(a));
            }
            if signal::received().is_some() && self.options.handle_signals {
                return Ok(Interrupt::Signal);
            }
            if self.sampler.epoch_done() {
                self.sampler.set_epoch(self.sampler.epoch() + 1);
            }
            let Some(planned) = self.sampler.plan() else {
                return Err(self.state_err("planning a step", "the epoch has no samples"));
            };
            let indices = planned
                .rank_indices(world_size, rank)
                .map_err(|e| self.state_err("planning a step", e))?;
            let started = Instant::now();
            let input = StepInput {
                step: self.step,
                epoch: planned.epoch(),
                indices,
                rank,
                world_size,
            };
            let out = step_fn(&input).map_err(|e| TrainError::Step {
                rank,
                step: self.step,
                source: e.into(),
            })?;
            let report = match ddp.step(out.grads.as_ref(), out.samples, self.optimizer.as_mut()) {
                Ok(r) => r,
                Err(e @ DdpError::Collective { .. }) => {
                    self.steps_discarded += 1;
                    if let DdpError::Collective {
                        source: rekindle_runtime::Error::Timeout { waiting_on, .. },
                        ..
                    } = &e
                    {
                        self.evict(store, members, waiting_on);
                    }
                    return Ok(Interrupt::Failed(e.to_string()));
                }
                Err(e) => return Err(self.state_err("the DDP step", e)),
            };
            self.sampler
                .commit(&planned)
                .map_err(|e| self.state_err("advancing the sampler", e))?;
            self.step += 1;
            // The loss, averaged over the ranks' samples (after the update: a failure here
            // loses nothing).
            let (sum, n) = match out.loss {
                Some(l) => (l as f64 * out.samples as f64, out.samples as f64),
                None => (0.0, 0.0),
            };
            let loss = match ddp
                .process_group()
                .all_reduce(Buffer::from(vec![sum, n]), ReduceOp::Sum)
                .wait(self.collective_wait())
            {
                Ok(b) => match b.as_slice::<f64>() {
                    Some(&[s, n]) if n > 0.0 => Some(s / n),
                    _ => None,
                },
                Err(e) => {
                    if let rekindle_runtime::Error::Timeout { waiting_on, .. } = &e {
                        self.evict(store, members, waiting_on);
                    }
                    return Ok(Interrupt::Failed(e.to_string()));
                }
            };
            if rank == 0 {
                let secs = started.elapsed().as_secs_f64().max(1e-9);
                let line = StepLine {
                    step: self.step,
                    epoch: planned.epoch(),
                    loss,
                    samples_per_s: report.global_samples as f64 / secs,
                    world_size,
                };
                if let Some(p) = &mut self.progress {
                    p.step(&line)?;
                }
                let every = self.options.checkpoint_every;
                if every > 0 && self.step % every == 0 {
                    self.checkpoint_async(world_size)?;
                }
            }
            let check = self.options.check_parameters_every;
            if check > 0 && self.step % check == 0 {
                match ddp.check_parameters() {
                    Ok(_) => {}
                    Err(e @ DdpError::Collective { .. }) => {
                        return Ok(Interrupt::Failed(e.to_string()))
                    }
                    Err(e) => return Err(self.state_err("checking parameters", e)),
                }
            }
        }
        Ok(Interrupt::Done)
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
            last_checkpoint: self.last_checkpoint,
        }
    }

    fn finish(&mut self, max_steps: u64) -> Result<RunSummary, TrainError> {
        let world_size = self.env.assignment.world_size;
        if self.rank() == 0 && self.step >= max_steps {
            self.checkpoint_now(world_size)?;
        } else if let Some(ck) = &self.checkpoints {
            if let Err(e) = ck.flush(Duration::from_secs(600)) {
                tracing::warn!(error = %e, "the checkpoint in flight failed");
            }
        }
        if let Some(p) = &self.progress {
            p.finish();
        }
        Ok(self.summary(RunEnd::Finished))
    }

    fn preempt(&mut self, signal: i32) -> Result<RunSummary, TrainError> {
        let world_size = self.env.assignment.world_size;
        let saved = if self.env.local_rank == 0 && self.has_state {
            self.checkpoint_now(world_size)?
        } else {
            if let Some(ck) = &self.checkpoints {
                if let Err(e) = ck.flush(Duration::from_secs(600)) {
                    tracing::warn!(error = %e, "the checkpoint in flight failed");
                }
            }
            None
        };
        if let Some(p) = &self.progress {
            p.finish();
        }
        eprintln!(
            "rekindle: rank {}: stopping on signal {signal} at step {}{}",
            self.rank(),
            self.step,
            match saved {
                Some(s) => format!("; checkpoint step-{s} committed"),
                None => String::new(),
            }
        );
        Ok(self.summary(RunEnd::Preempted { signal }))
    }
}
