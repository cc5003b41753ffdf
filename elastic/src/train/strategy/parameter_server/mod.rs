//! [`ParameterServer`]: the first `K` ranks of a group serve the parameters, the others work.
//!
//! **Layout.** The parameters (sorted by name) are sharded over the servers by a
//! [`ShardMap`]: cut into `K` equal contiguous parts, large tensors split, small ones whole.
//! Server `k` holds its shard's values and an optimizer over them (built by the program's
//! [`OptimizerFactory`]), and, with two servers or more, an in-memory copy of its
//! predecessor's shard (server `k - 1`'s, cyclically), updated with the same gradients in the
//! same order, so that losing one server loses no step ([`PsConfig::copies`]; without the
//! copies a lost shard comes from the newest checkpoint). Workers hold the whole model (the
//! program's `VarMap`) as last pulled.
//!
//! **Synchronous mode** ([`PsMode::Sync`]): a step's global batch is split among the live
//! workers in contiguous shares (worker `j` of `W` takes share `j`, as rank `j` of a DDP job
//! of `W` ranks would). Each worker pushes to every server its share's gradients times its
//! sample count; each server waits for every worker's push, sums them in worker order,
//! applies the optimizer to its shard with the sum divided by the step's sample count (DDP's
//! mean), forwards the sum to its copy holder, and replies to every worker with the new
//! values (the pull). The result is a deterministic function of the data and the world size,
//! bit-identical run to run, and equal to DDP's up to the order of the gradient sum.
//!
//! **Asynchronous mode** ([`PsMode::Async`]): each step's whole global batch is a *ticket*
//! computed by one worker. Server 0 deals tickets in step order; a worker computes its ticket
//! from the parameters of its last pull, pushes it to every server with the version each
//! shard had then, and gets fresh parameters and its next ticket back, without waiting for
//! any other worker. A server applies each push when it arrives. A push more than
//! `staleness` versions behind its shard (updates applied since the worker's pull) is not
//! applied: the worker waits for the fresh parameters of the reply and computes the same
//! batch again. Servers count the staleness of every push ([`ParameterServer::staleness`]).
//! The loop's step is the ticket number: every rank passes every step in order, a worker
//! at once through the tickets dealt to others, a server when the ticket has been applied to
//! its shard and its copy; the step boundary is no collective ([`Strategy::boundary`]). A
//! stop on a signal is agreed through server 0, which stops dealing at a step every rank
//! learns from the messages and then stops at.
//!
//! **Exactly once.** Synchronous: as DDP, each step's batch is applied once (a step some
//! servers applied when a rank failed is undone from the values kept before it, or kept
//! when every shard has it). Asynchronous: each ticket's update is applied exactly once to
//! each shard: a shard records the tickets it applied, ignores a ticket pushed again, and
//! after a failure the tickets some shard lacks are dealt again (to whichever worker asks);
//! their gradients may then differ between shards, computed from different parameters.
//!
//! **Re-forming** ([`Strategy::sync`]): the servers are again the first `K` ranks; each shard
//! comes from the rank holding it (the server, or the copy on the next server), or from the
//! newest checkpoint when no rank does (see [`plan`] for the decision), and every worker
//! gets the whole model. Workers that joined get a share of the next step; those that left
//! leave their share to the others (the global batch is the same, split among fewer).
//!
//! **Checkpoints** are sharded: each server writes the tensors of its shard, whole, under
//! their own names (a tensor split over servers is gathered on the first of them), with the
//! optimizer state under the names a single-device optimizer uses, and rank 0 commits one
//! manifest; a DDP job or a single process loads it as its own. Asynchronous checkpoints
//! also record each shard's applied tickets: a checkpoint of step `t` holds every update of
//! the tickets before `t` and some after it, which a job resuming from it does not apply
//! again.

mod async_mode;
mod links;
pub mod plan;
mod shard;
pub mod shard_map;
mod sync_mode;
mod tensors;
pub mod tickets;
pub mod wire;

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use rekindle_runtime::ddp::broadcast_state;
use rekindle_runtime::optim::{ParamSpec, STEP_NAME};
use rekindle_runtime::{Buffer, ReduceOp};
use rekindle_storage::{Checkpoint, HostTensor, Layout, Snapshot};

use self::async_mode::AsyncServer;
use self::links::{copy_of, Links, Role};
use self::plan::{CheckpointView, Holdings, LoopSource, MemberView, Pace, PlanError, ShardSource};
pub use self::shard::OptimizerFactory;
use self::shard::{Shard, VALUES};
use self::shard_map::ShardMap;
use self::tickets::{Applied, Dealer, Staleness};
use super::{
    Boundary, BoxError, CheckpointPlan, Group, StateSource, StepDone, StepError, StepOutput,
    Strategy,
};
use crate::train::{param_specs, StepInput, TrainError, MODEL_GROUP, STATE_GROUP};

/// How the servers apply the workers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsMode {
    /// Every step waits for every live worker; see the [module docs](self).
    Sync,
    /// Every push is applied when it arrives; see the [module docs](self).
    Async {
        /// The most versions a push may be behind its shard and still be applied (`None`:
        /// no bound).
        staleness: Option<u64>,
    },
}

/// Settings of a [`ParameterServer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsConfig {
    /// The number of servers (the first ranks of each group).
    pub servers: usize,
    /// Synchronous or asynchronous.
    pub mode: PsMode,
    /// Tensors with fewer elements are never split over servers. Default 65536.
    pub min_split: usize,
    /// With two servers or more, each server keeps an in-memory copy of its predecessor's
    /// shard, so that losing one server loses no step (default). Off, no server keeps a
    /// copy: each server link carries `4P / K` bytes less each way per step (the copy
    /// traffic), and a lost server's shard comes from the newest checkpoint (synchronous:
    /// every shard does, and the job goes back to that checkpoint's step; asynchronous: the
    /// tickets the checkpoint's shard lacks are dealt again).
    pub copies: bool,
}

impl PsConfig {
    /// `servers` servers in `mode`, with the in-memory copies on.
    pub fn new(servers: usize, mode: PsMode) -> PsConfig {
        PsConfig {
            servers,
            mode,
            min_split: 1 << 16,
            copies: true,
        }
    }
}

/// "No ticket": a worker with nothing left to compute.
const NONE: u64 = u64::MAX;

/// What a rank knows within one group.
struct InGroup {
    role: Role,
    links: Links,
    /// Worker: the ticket it computes next ([`NONE`] when none is left).
    ticket: u64,
    /// Worker: each shard's version as last pulled.
    bases: Vec<u64>,
    /// Worker: it told every server it has nothing more to push.
    done_sent: bool,
    /// Server 0, asynchronous: the dealer and what it dealt to each worker for its ticket.
    dealer: Option<Dealer>,
    dealt: HashMap<usize, (u64, u64)>,
    /// Asynchronous server: the loss and samples of each ticket applied in this group.
    losses: HashMap<u64, (u32, f32)>,
    /// Asynchronous server: its threads.
    server: Option<AsyncServer>,
    /// The step at which every rank stops ([`wire::NO_STOP`] until agreed).
    stop_at: u64,
    /// This rank got a termination signal and asked to stop.
    stop_asked: bool,
    /// The step of the last [`Strategy::step`] call.
    last_step: u64,
    /// The run's last step.
    max_steps: u64,
}

/// A piece of a split tensor for a checkpoint: the parameter, its range, and the tensors it
/// came in (empty: this server's own).
type PieceFrom = (usize, std::ops::Range<usize>, Vec<(String, Tensor)>);

/// A whole tensor gathered for a checkpoint: values and moments (by moment name).
#[derive(Debug, Clone)]
struct Gathered {
    param: usize,
    values: Vec<f32>,
    moments: Vec<(String, Vec<f32>)>,
}

/// The parameter-server strategy. See the [module docs](self).
pub struct ParameterServer {
    varmap: VarMap,
    vars: Vec<Var>,
    map: ShardMap,
    factory: OptimizerFactory,
    config: PsConfig,
    primary: Option<Shard>,
    copy: Option<Shard>,
    group: Option<InGroup>,
    stats: Staleness,
    gathered: Vec<Gathered>,
    /// Every rank's variables hold the whole model of the current step.
    finished: bool,
}

impl std::fmt::Debug for ParameterServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParameterServer")
            .field("config", &self.config)
            .field("params", &self.vars.len())
            .field("primary", &self.primary)
            .field("copy", &self.copy)
            .field("role", &self.group.as_ref().map(|g| g.role))
            .finish()
    }
}

fn bad_config(reason: impl Into<String>) -> TrainError {
    TrainError::Config {
        reason: reason.into(),
    }
}

/// A candle or storage failure while moving state (the program's or the data's fault).
fn state_err(what: &'static str) -> impl Fn(String) -> StepError {
    move |reason| StepError::State { what, reason }
}

impl ParameterServer {
    /// A parameter server over `varmap`'s variables (the same initial values on every rank,
    /// as a seeded model gives), whose servers update their shards with optimizers built by
    /// `optimizer`.
    pub fn new(
        varmap: VarMap,
        optimizer: OptimizerFactory,
        config: PsConfig,
    ) -> Result<ParameterServer, TrainError> {
        if config.servers == 0 {
            return Err(bad_config("a parameter server needs at least one server"));
        }
        let specs = param_specs(&varmap)?;
        let map = ShardMap::new(&specs, config.servers, config.min_split)
            .map_err(|e| bad_config(e.to_string()))?;
        let vars: Vec<Var> = {
            let data = varmap
                .data()
                .lock()
                .map_err(|_| bad_config("the VarMap's lock is poisoned"))?;
            specs
                .iter()
                .map(|s| data.get(&s.name).cloned())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad_config("the VarMap changed while it was read"))?
        };
        // The optimizer must accept the shards' pieces.
        for k in 0..config.servers {
            optimizer(map.piece_specs(k))
                .map_err(|e| bad_config(format!("the optimizer factory: {e}")))?;
        }
        Ok(ParameterServer {
            varmap,
            vars,
            map,
            factory: optimizer,
            config,
            primary: None,
            copy: None,
            group: None,
            stats: Staleness::default(),
            gathered: Vec::new(),
            finished: true,
        })
    }

    /// The model's variables (a worker's as last pulled; every rank's whole model after the
    /// run finished).
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The shard map.
    pub fn shard_map(&self) -> &ShardMap {
        &self.map
    }

    /// The settings.
    pub fn config(&self) -> &PsConfig {
        &self.config
    }

    /// The staleness of the pushes this rank applied (as a server, asynchronous mode) since
    /// it started.
    pub fn staleness(&self) -> &Staleness {
        &self.stats
    }

    /// This rank's role in its current (or last) group.
    pub fn role(&self) -> Option<Role> {
        self.group.as_ref().map(|g| g.role)
    }

    fn asynchronous(&self) -> bool {
        matches!(self.config.mode, PsMode::Async { .. })
    }

    fn bound(&self) -> Option<u64> {
        match self.config.mode {
            PsMode::Async { staleness } => staleness,
            PsMode::Sync => None,
        }
    }

    fn in_group(&mut self) -> Result<&mut InGroup, StepError> {
        self.group
            .as_mut()
            .ok_or_else(|| StepError::state("a parameter-server step", "no group"))
    }

    /// Shard `k`'s values, taken from the variables.
    fn values_from_vars(&self, k: usize) -> Result<Vec<f32>, StepError> {
        let mut out = Vec::with_capacity(self.map.shard_len(k));
        for p in self.map.pieces(k) {
            tensors::with_f32(self.vars[p.param].as_tensor(), |x| {
                out.extend_from_slice(&x[p.range.clone()])
            })
            .map_err(|e| StepError::state("reading the parameters", e))?;
        }
        Ok(out)
    }

    /// Writes shard `k`'s values into the variables.
    fn values_to_vars(&self, k: usize, values: &[f32]) -> Result<(), StepError> {
        let mut at = 0;
        for p in self.map.pieces(k) {
            let len = p.range.len();
            let src = values.get(at..at + len).ok_or_else(|| {
                StepError::state("writing the parameters", "the shard is too short")
            })?;
            tensors::update_f32(&self.vars[p.param], |x| {
                x[p.range.clone()].copy_from_slice(src)
            })
            .map_err(|e| StepError::state("writing the parameters", e))?;
            at += len;
        }
        Ok(())
    }

    /// The shard `k` as named tensors from a checkpoint written by any job of the same model
    /// (a parameter server of any number of servers, DDP, a single process).
    fn shard_from_checkpoint(
        &self,
        ckpt: &Checkpoint,
        k: usize,
    ) -> Result<Vec<(String, Tensor)>, StepError> {
        let read = |name: &str| -> Result<Vec<f32>, StepError> {
            ckpt.tensor(name)?
                .to_candle_on(rekindle_runtime::Device::Cpu)
                .map_err(StepError::from)?
                .to_dtype(candle_core::DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| StepError::state("reading a checkpoint", format!("{name}: {e}")))
        };
        let names = ckpt.names();
        let mut values = Vec::with_capacity(self.map.shard_len(k));
        let mut out = Vec::new();
        for p in self.map.pieces(k) {
            let spec = &self.map.specs()[p.param];
            let whole = read(&spec.name)?;
            if whole.len() != spec.len() {
                return Err(StepError::state(
                    "reading a checkpoint",
                    format!(
                        "{} has {} elements, the model {}",
                        spec.name,
                        whole.len(),
                        spec.len()
                    ),
                ));
            }
            values.extend_from_slice(&whole[p.range.clone()]);
            let prefix = format!("optim.{}.", spec.name);
            for n in &names {
                let Some(moment) = n.strip_prefix(&prefix).filter(|m| !m.contains('.')) else {
                    continue;
                };
                let m = read(n)?;
                if m.len() != spec.len() {
                    continue;
                }
                let shape = self.map.piece_shape(p);
                let t = Tensor::from_slice(
                    &m[p.range.clone()],
                    shape.as_slice(),
                    &candle_core::Device::Cpu,
                )
                .map_err(|e| StepError::state("reading a checkpoint", e))?;
                out.push((format!("optim.{}.{moment}", self.map.piece_name(p)), t));
            }
        }
        let steps = match ckpt.tensor(STEP_NAME) {
            Ok(t) => t
                .to_candle_on(rekindle_runtime::Device::Cpu)?
                .to_scalar::<i64>()
                .map_err(|e| StepError::state("reading a checkpoint", e))?,
            Err(_) => ckpt.step() as i64,
        };
        out.push((
            STEP_NAME.to_string(),
            Tensor::new(steps, &candle_core::Device::Cpu)
                .map_err(|e| StepError::state("reading a checkpoint", e))?,
        ));
        out.push((
            VALUES.to_string(),
            Tensor::from_slice(&values, values.len(), &candle_core::Device::Cpu)
                .map_err(|e| StepError::state("reading a checkpoint", e))?,
        ));
        Ok(out)
    }

    /// What an asynchronous checkpoint says shard `k` had applied (`None`: not recorded
    /// for a map of this many servers).
    fn applied_in_checkpoint(&self, ckpt: &Checkpoint, k: usize) -> Option<Applied> {
        let servers = ckpt
            .tensor("ps.servers")
            .ok()?
            .to_candle_on(rekindle_runtime::Device::Cpu)
            .ok()?
            .to_scalar::<i64>()
            .ok()?;
        if servers as usize != self.config.servers {
            return None;
        }
        let v = ckpt
            .tensor(&format!("ps.shard.{k}.applied"))
            .ok()?
            .to_candle_on(rekindle_runtime::Device::Cpu)
            .ok()?
            .to_vec1::<i64>()
            .ok()?;
        let (first, rest) = v.split_first()?;
        Some(Applied::new(*first as u64, rest.iter().map(|&t| t as u64)))
    }

    fn checkpoint_view(&self, ckpt: &Checkpoint) -> CheckpointView {
        CheckpointView {
            step: ckpt.step(),
            applied: (0..self.config.servers)
                .map(|k| self.applied_in_checkpoint(ckpt, k))
                .collect(),
        }
    }

    /// A shard from its state: version from the optimizer's step count, position from the
    /// plan.
    fn build_shard(
        &self,
        k: usize,
        copy: bool,
        state: &[(String, Tensor)],
        step: u64,
        applied: &Applied,
    ) -> Result<Shard, StepError> {
        let mut shard = Shard::from_state(&self.map, k, copy, state, &self.factory)?;
        shard.at = step;
        shard.applied = applied.clone();
        Ok(shard)
    }

    /// The version of a shard's state (its optimizer's step count; 0 when fresh).
    fn version_of(state: &[(String, Tensor)]) -> u64 {
        state
            .iter()
            .find(|(n, _)| n == STEP_NAME)
            .and_then(|(_, t)| t.to_scalar::<i64>().ok())
            .map_or(0, |s| s as u64)
    }

    /// The state of shard `k` from this rank's memory: the primary or the copy.
    fn export_held(&self, k: usize, undo: bool) -> Result<Vec<(String, Tensor)>, StepError> {
        [&self.primary, &self.copy]
            .into_iter()
            .flatten()
            .find(|s| s.index == k)
            .ok_or_else(|| {
                StepError::state("syncing the shards", format!("shard {k} is not held here"))
            })?
            .export(undo)
    }

    /// A fresh shard state from the program's initial parameters.
    fn init_state(&self, k: usize) -> Result<Vec<(String, Tensor)>, StepError> {
        let values = self.values_from_vars(k)?;
        let t = Tensor::from_slice(&values, values.len(), &candle_core::Device::Cpu)
            .map_err(|e| StepError::state("initialising a shard", e))?;
        Ok(vec![(VALUES.to_string(), t)])
    }

    /// Gathers every server's shard onto every rank's variables (an all-reduce of the
    /// values' bits, each element from its one server), so that the whole model is
    /// everywhere at the end.
    fn gather_all(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        let total: usize = self.map.specs().iter().map(ParamSpec::len).sum();
        let mut bits = vec![0i32; total];
        if let Some(shard) = &self.primary {
            let starts = self.param_starts();
            let mut at = 0;
            for p in self.map.pieces(shard.index) {
                let base = starts[p.param] + p.range.start;
                for (i, v) in shard.values[at..at + p.range.len()].iter().enumerate() {
                    bits[base + i] = v.to_bits() as i32;
                }
                at += p.range.len();
            }
        }
        let work = group.pg().all_reduce(Buffer::from(bits), ReduceOp::Sum);
        let out = self.serve_until(group, work, "gathering the parameters")?;
        let bits = out
            .into_vec::<i32>()
            .map_err(|_| StepError::state("gathering the parameters", "not i32"))?;
        let starts = self.param_starts();
        for (p, var) in self.vars.iter().enumerate() {
            let src = &bits[starts[p]..starts[p + 1]];
            tensors::update_f32(var, |x| {
                for (d, s) in x.iter_mut().zip(src) {
                    *d = f32::from_bits(*s as u32);
                }
            })
            .map_err(|e| StepError::state("gathering the parameters", e))?;
        }
        Ok(())
    }

    /// Asynchronous, once this group's steps are over (the last step, or the agreed stop):
    /// every worker tells the servers it is done, and every rank meets in one all-reduce
    /// while the servers go on serving, so that no worker still waits for a reply when a
    /// checkpoint that blocks every rank starts. Nothing otherwise.
    fn drain(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        let Some(g) = &self.group else {
            return Ok(());
        };
        if !self.asynchronous() || g.last_step + 1 < g.max_steps.min(g.stop_at) {
            return Ok(());
        }
        if let Role::Worker(_) = g.role {
            self.send_done(group)?;
        }
        let work = group
            .pg()
            .all_reduce(Buffer::from(vec![0i32]), ReduceOp::Sum);
        self.serve_until(group, work, "ending the asynchronous steps")?;
        Ok(())
    }

    /// Where each parameter starts in the flat range of all parameters (and the end).
    fn param_starts(&self) -> Vec<usize> {
        let mut out = vec![0];
        for s in self.map.specs() {
            out.push(out[out.len() - 1] + s.len());
        }
        out
    }

    /// Waits for `work`; an asynchronous server keeps serving its workers meanwhile.
    fn serve_until(
        &mut self,
        group: &mut Group<'_>,
        mut work: rekindle_runtime::Work,
        during: &'static str,
    ) -> Result<Buffer, StepError> {
        let serving = self.group.as_ref().is_some_and(|g| g.server.is_some());
        if serving {
            let deadline = std::time::Instant::now() + group.wait();
            while !work.is_completed() && std::time::Instant::now() < deadline {
                if let Err(e) = self.serve_once(std::time::Duration::from_millis(2)) {
                    // A peer that finished first closes its links: not a failure if the
                    // collective completes.
                    return work.wait(group.wait()).map_err(|_| e);
                }
            }
        }
        work.wait(group.wait())
            .map_err(|e| StepError::collective(during, e))
    }

    /// Rank 0's account of where the state came from.
    fn report(&self, group: &Group<'_>, plan: &plan::Plan) {
        if group.rank() != 0 {
            return;
        }
        let sources: Vec<String> = plan
            .shards
            .iter()
            .enumerate()
            .map(|(k, s)| match s {
                ShardSource::Rank { rank, undo } => {
                    let kind = if *rank == k { "server" } else { "copy on rank" };
                    let undo = if *undo { ", last update undone" } else { "" };
                    format!("shard {k} from {kind} {rank}{undo}")
                }
                ShardSource::Checkpoint => format!("shard {k} from the checkpoint"),
                ShardSource::Init => format!("shard {k} initial"),
            })
            .collect();
        let mode = if self.asynchronous() { "async" } else { "sync" };
        eprintln!(
            "rekindle: parameter server ({mode}): {} server(s), {} worker(s), step {}; {}",
            self.config.servers,
            group.world_size() - self.config.servers,
            plan.step,
            sources.join(", ")
        );
    }
}

impl Strategy for ParameterServer {
    type Output = StepOutput;

    fn name(&self) -> &'static str {
        "parameter-server"
    }

    fn restore(&mut self, ckpt: &Checkpoint, rank: usize, _world: usize) -> Result<(), StepError> {
        // Every rank takes the whole model (a worker's first pull, the fingerprint of a run
        // that has nothing left to do).
        for k in 0..self.config.servers {
            let state = self.shard_from_checkpoint(ckpt, k)?;
            let values = state
                .iter()
                .find(|(n, _)| n == VALUES)
                .and_then(|(_, t)| t.to_vec1::<f32>().ok())
                .unwrap_or_default();
            self.values_to_vars(k, &values)?;
            let servers = self.config.servers;
            let mine = rank < servers
                && (rank == k || copy_of(rank, servers, self.config.copies) == Some(k));
            if !mine {
                continue;
            }
            let applied = self
                .applied_in_checkpoint(ckpt, k)
                .filter(|_| self.asynchronous())
                .unwrap_or_else(|| Applied::new(ckpt.step(), []));
            let shard = self.build_shard(k, rank != k, &state, ckpt.step(), &applied)?;
            if rank == k {
                self.primary = Some(shard);
            } else {
                self.copy = Some(shard);
            }
        }
        Ok(())
    }

    fn holdings(&self) -> serde_json::Value {
        let asynchronous = self.asynchronous();
        let shards: Vec<_> = [&self.primary, &self.copy]
            .into_iter()
            .flatten()
            .map(|s| s.holding(asynchronous))
            .collect();
        if shards.is_empty() {
            return serde_json::Value::Null;
        }
        let h = Holdings {
            servers: self.config.servers,
            shards,
        };
        serde_json::json!({ "ps": h })
    }

    fn sync(&mut self, group: &mut Group<'_>) -> Result<StateSource, StepError> {
        let servers = self.config.servers;
        let world = group.world_size();
        let rank = group.rank();
        if world <= servers {
            return Err(StepError::state(
                "forming the parameter server",
                format!(
                    "{servers} server(s) need at least {} ranks, the group has {world}",
                    servers + 1
                ),
            ));
        }
        let views: Vec<MemberView> = group
            .members()
            .iter()
            .map(|m| MemberView {
                has_state: m.has_state,
                step: m.step,
                holdings: m
                    .holds
                    .get("ps")
                    .and_then(|v| serde_json::from_value(v.clone()).ok()),
            })
            .collect();
        let pace = if self.asynchronous() {
            Pace::Async
        } else {
            Pace::Sync
        };
        let mut ckpt = None;
        let plan = match plan::plan(&views, servers, pace, None) {
            Ok(p) => p,
            Err(PlanError::Lost { shards }) => {
                let Some(c) = group.newest_checkpoint()? else {
                    let why = if self.config.copies && servers > 1 {
                        "a server and the copy on the next server are both gone"
                    } else {
                        "their server is gone and no server keeps a copy"
                    };
                    return Err(StepError::state(
                        "re-forming the parameter server",
                        format!(
                            "shard(s) {shards:?} are lost: no rank holds them ({why}) and \
                             there is no checkpoint"
                        ),
                    ));
                };
                let view = self.checkpoint_view(&c);
                ckpt = Some(c);
                plan::plan(&views, servers, pace, Some(&view))
                    .map_err(|e| StepError::state("re-forming the parameter server", e))?
            }
            Err(e) => return Err(StepError::state("re-forming the parameter server", e)),
        };
        let role = Role::of(rank, servers);
        // Move every shard's state to every rank; servers keep theirs, workers the values.
        let mut primary = None;
        let mut copy = None;
        let mut versions = vec![0u64; servers];
        for (k, version) in versions.iter_mut().enumerate() {
            let state = match plan.shards[k] {
                ShardSource::Rank { rank: src, undo } => {
                    let mine = (rank == src)
                        .then(|| self.export_held(k, undo))
                        .transpose()?;
                    broadcast_state(group.pg(), mine, src, group.wait()).map_err(|e| match e {
                        rekindle_runtime::ddp::DdpError::Collective { source, .. } => {
                            StepError::collective("moving a shard", source)
                        }
                        e => StepError::state("moving a shard", e),
                    })?
                }
                ShardSource::Checkpoint => match &ckpt {
                    Some(c) => self.shard_from_checkpoint(c, k)?,
                    None => {
                        return Err(StepError::state("moving a shard", "no checkpoint"));
                    }
                },
                ShardSource::Init => self.init_state(k)?,
            };
            *version = Self::version_of(&state);
            match role {
                Role::Server(s) if s == k => {
                    primary =
                        Some(self.build_shard(k, false, &state, plan.step, &plan.applied[k])?);
                }
                Role::Server(s) if copy_of(s, servers, self.config.copies) == Some(k) => {
                    copy = Some(self.build_shard(k, true, &state, plan.step, &plan.applied[k])?);
                }
                Role::Server(_) => {}
                Role::Worker(_) => {
                    let values = state
                        .iter()
                        .find(|(n, _)| n == VALUES)
                        .and_then(|(_, t)| t.to_vec1::<f32>().ok())
                        .ok_or_else(|| StepError::state("moving a shard", "no values"))?;
                    self.values_to_vars(k, &values)?;
                }
            }
        }
        self.primary = primary;
        self.copy = copy;
        self.report(group, &plan);
        let links = Links::build(group, servers, self.config.copies)?;
        let workers = world - servers;
        let max_steps = group.max_steps();
        let mut g = InGroup {
            role,
            links,
            ticket: NONE,
            bases: versions,
            done_sent: false,
            dealer: None,
            dealt: HashMap::new(),
            losses: HashMap::new(),
            server: None,
            stop_at: wire::NO_STOP,
            stop_asked: false,
            last_step: plan.step,
            max_steps,
        };
        if self.asynchronous() {
            // Every rank deals the first tickets the same way; server 0 goes on dealing.
            let mut dealer = Dealer::new(plan.step, &plan.applied);
            for j in 0..workers {
                let t = dealer.deal();
                if role == Role::Worker(j) {
                    g.ticket = if t < max_steps { t } else { NONE };
                }
            }
            if role == Role::Server(0) {
                g.dealer = Some(dealer);
            }
            if let Role::Server(k) = role {
                g.server = Some(AsyncServer::start(
                    &g.links,
                    &self.map,
                    k,
                    servers,
                    workers,
                    group.wait(),
                )?);
            }
        }
        self.group = Some(g);
        Ok(match plan.loop_source {
            LoopSource::Rank(r) => StateSource::Rank(r),
            LoopSource::Advance { rank, step } => StateSource::Advance { rank, step },
            LoopSource::Checkpoint => StateSource::Checkpoint,
        })
    }

    fn data_share(&self, rank: usize, world_size: usize) -> Option<(usize, usize)> {
        let servers = self.config.servers;
        if rank < servers || world_size <= servers {
            return None;
        }
        if self.asynchronous() {
            Some((0, 1))
        } else {
            Some((rank - servers, world_size - servers))
        }
    }

    fn step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<StepOutput, BoxError>,
    ) -> Result<StepDone, StepError> {
        self.finished = false;
        let g = self.in_group()?;
        g.last_step = input.step;
        let role = g.role;
        match (role, self.asynchronous()) {
            (Role::Worker(_), false) => self.sync_worker_step(group, input, step_fn),
            (Role::Server(k), false) => self.sync_server_step(group, input, k),
            (Role::Worker(_), true) => self.async_worker_step(group, input, step_fn),
            (Role::Server(_), true) => self.async_server_step(group, input.step),
        }
    }

    fn boundary(
        &mut self,
        group: &mut Group<'_>,
        done: &StepDone,
        stopping: bool,
    ) -> Result<Boundary, StepError> {
        if !self.asynchronous() {
            return group.step_boundary(done, stopping);
        }
        self.async_boundary(group, done, stopping)
    }

    fn finish(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        if self.asynchronous() {
            if let Some(Role::Worker(_)) = self.role() {
                self.send_done(group)?;
            }
        }
        self.gather_all(group)?;
        self.finished = true;
        Ok(())
    }

    fn finished(&self) -> bool {
        self.finished
    }

    fn prepare_checkpoint(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        self.gathered.clear();
        self.drain(group)?;
        let Some(g) = &self.group else {
            return Ok(());
        };
        let (Role::Server(me), Some(link)) = (g.role, g.links.servers.clone()) else {
            return Ok(());
        };
        let split = self.map.split_params();
        if split.is_empty() {
            return Ok(());
        }
        let Some(shard) = &self.primary else {
            return Ok(());
        };
        // My pieces of tensors another server writes, as named tensors.
        let state = shard.optimizer_state()?;
        let mut mine = Vec::new();
        let mut at = 0;
        for p in self.map.pieces(me) {
            let len = p.range.len();
            if split.contains(&p.param) && self.map.writer(p.param) != me {
                let name = self.map.piece_name(p);
                let t =
                    Tensor::from_slice(&shard.values[at..at + len], len, &candle_core::Device::Cpu)
                        .map_err(|e| StepError::state("preparing a checkpoint", e))?;
                mine.push((format!("v.{name}"), t));
                let prefix = format!("optim.{name}.");
                for (n, t) in &state {
                    if let Some(m) = n.strip_prefix(&prefix) {
                        let flat = t
                            .flatten_all()
                            .map_err(|e| StepError::state("preparing a checkpoint", e))?;
                        mine.push((format!("m.{m}.{name}"), flat));
                    }
                }
            }
            at += len;
        }
        // Whole tensors this server writes, starting with its own pieces.
        let mut gathered: Vec<Gathered> = Vec::new();
        for &param in &split {
            if self.map.writer(param) != me {
                continue;
            }
            let len = self.map.specs()[param].len();
            gathered.push(Gathered {
                param,
                values: vec![0.0; len],
                moments: Vec::new(),
            });
        }
        let mut pieces: Vec<PieceFrom> = Vec::new();
        for k in 0..self.config.servers {
            let sends = self
                .map
                .pieces(k)
                .iter()
                .any(|p| split.contains(&p.param) && self.map.writer(p.param) != k);
            if !sends {
                continue;
            }
            let part = if k == me { Some(mine.clone()) } else { None };
            let got = broadcast_state(link.pg(), part, k, group.wait()).map_err(|e| match e {
                rekindle_runtime::ddp::DdpError::Collective { source, .. } => {
                    link.error("gathering split tensors", source)
                }
                e => StepError::state("gathering split tensors", e),
            })?;
            for p in self.map.pieces(k) {
                if self.map.writer(p.param) == me && split.contains(&p.param) {
                    pieces.push((p.param, p.range.clone(), got.clone()));
                }
            }
        }
        // My own pieces of the tensors I write.
        let own: Vec<(String, Tensor)> = {
            let mut v = Vec::new();
            let mut at = 0;
            for p in self.map.pieces(me) {
                let len = p.range.len();
                if split.contains(&p.param) && self.map.writer(p.param) == me {
                    let name = self.map.piece_name(p);
                    let t = Tensor::from_slice(
                        &shard.values[at..at + len],
                        len,
                        &candle_core::Device::Cpu,
                    )
                    .map_err(|e| StepError::state("preparing a checkpoint", e))?;
                    v.push((format!("v.{name}"), t));
                    let prefix = format!("optim.{name}.");
                    for (n, t) in &state {
                        if let Some(m) = n.strip_prefix(&prefix) {
                            let flat = t
                                .flatten_all()
                                .map_err(|e| StepError::state("preparing a checkpoint", e))?;
                            v.push((format!("m.{m}.{name}"), flat));
                        }
                    }
                    pieces.push((p.param, p.range.clone(), Vec::new()));
                }
                at += len;
            }
            v
        };
        for (param, range, from) in pieces {
            let source = if from.is_empty() { &own } else { &from };
            let name = self.map.piece_name(&shard_map::Piece {
                param,
                range: range.clone(),
            });
            let Some(whole) = gathered.iter_mut().find(|g| g.param == param) else {
                continue;
            };
            let err = state_err("gathering split tensors");
            for (n, t) in source {
                let v = t.to_vec1::<f32>().map_err(|e| err(e.to_string()))?;
                if *n == format!("v.{name}") {
                    whole.values[range.clone()].copy_from_slice(&v);
                } else if let Some(m) = n
                    .strip_prefix("m.")
                    .and_then(|r| r.strip_suffix(&format!(".{name}")))
                {
                    let len = whole.values.len();
                    let slot = match whole.moments.iter_mut().find(|(mm, _)| mm == m) {
                        Some(s) => s,
                        None => {
                            whole.moments.push((m.to_string(), vec![0.0; len]));
                            let last = whole.moments.len() - 1;
                            &mut whole.moments[last]
                        }
                    };
                    slot.1[range.clone()].copy_from_slice(&v);
                }
            }
        }
        self.gathered = gathered;
        Ok(())
    }

    fn checkpoint_plan(&self, world_size: usize) -> CheckpointPlan {
        CheckpointPlan::Sharded(Layout::Custom {
            name: "parameter-server".into(),
            shards: world_size,
        })
    }

    fn checkpoint(&self, snap: &mut Snapshot) -> Result<(), StepError> {
        let Some(shard) = &self.primary else {
            return Ok(());
        };
        if !matches!(self.role(), Some(Role::Server(_))) {
            return Ok(());
        }
        let k = shard.index;
        let state = shard.optimizer_state()?;
        let cpu = rekindle_runtime::Device::Cpu;
        let mut at = 0;
        for p in self.map.pieces(k) {
            let len = p.range.len();
            let spec = &self.map.specs()[p.param];
            if self.map.is_whole(p) {
                snap.insert_in(
                    MODEL_GROUP,
                    &spec.name,
                    cpu,
                    HostTensor::from_slice(&spec.shape, &shard.values[at..at + len])?,
                )?;
                let prefix = format!("optim.{}.", spec.name);
                for (n, t) in &state {
                    if n.strip_prefix(&prefix).is_some_and(|m| !m.contains('.')) {
                        snap.insert_candle(STATE_GROUP, n, t)?;
                    }
                }
            } else if self.map.writer(p.param) == k {
                let Some(whole) = self.gathered.iter().find(|g| g.param == p.param) else {
                    return Err(StepError::state(
                        "writing a checkpoint",
                        format!("{} was not gathered", spec.name),
                    ));
                };
                snap.insert_in(
                    MODEL_GROUP,
                    &spec.name,
                    cpu,
                    HostTensor::from_slice(&spec.shape, &whole.values)?,
                )?;
                for (m, v) in &whole.moments {
                    snap.insert_in(
                        STATE_GROUP,
                        &format!("optim.{}.{m}", spec.name),
                        cpu,
                        HostTensor::from_slice(&spec.shape, v)?,
                    )?;
                }
            }
            at += len;
        }
        if k == 0 {
            let steps = shard.optimizer_steps() as i64;
            snap.insert_in(
                STATE_GROUP,
                STEP_NAME,
                cpu,
                HostTensor::from_slice(&[], &[steps])?,
            )?;
            snap.insert_in(
                STATE_GROUP,
                "ps.servers",
                cpu,
                HostTensor::from_slice(&[], &[self.config.servers as i64])?,
            )?;
        }
        if self.asynchronous() {
            let mut applied = vec![shard.applied.prefix() as i64];
            applied.extend(shard.applied.beyond().iter().map(|&t| t as i64));
            snap.insert_in(
                STATE_GROUP,
                &format!("ps.shard.{k}.applied"),
                cpu,
                HostTensor::from_slice(&[applied.len()], &applied)?,
            )?;
        }
        Ok(())
    }

    fn leave(&mut self) {
        if let Some(g) = self.group.take() {
            g.links.abort();
            if let Some(s) = g.server {
                s.stop();
            }
        }
    }
}
