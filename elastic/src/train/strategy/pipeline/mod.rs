//! [`PipelineStrategy`]: the model's layers split into stages over the ranks, `D` replicas of
//! an `S`-stage pipeline when there are ranks for more than one ([`Grid`]).
//!
//! Each step, every replica's share of the global batch is cut into micro-batches; the
//! stages run their forward and backward passes in the [`Schedule`]'s order (GPipe or 1F1B),
//! activations travelling forward and gradients backward over one sub-group per direction
//! and pair of neighbouring stages, every receive bounded by the group's deadline. The last
//! stage computes the loss. Each stage sums its parameters' gradients over the micro-batches
//! in micro-batch order (both schedules run backward passes in that order, so they give
//! bit-identical results), all-reduces them with the same stage of the other replicas, and
//! updates its own parameters with its own optimizer.
//!
//! **Neighbour copies.** With [`PipelineConfig::neighbour_copy`] each stage keeps a copy of
//! the previous stage's layers (stage 0 keeps the last one's): every step, once its
//! gradients are final, a stage sends them to the copy's holder, which applies the same
//! optimizer update to the copy, so the copy stays bit-identical to the original at every
//! step for the price of one message the size of the stage's parameters.
//!
//! **Atomic steps.** No stage updates anything before every rank of the group has its
//! step's gradients and its copy's gradients (one small all-reduce, the *agreement*). A
//! failure before the agreement leaves every rank at the step's start; one after it leaves
//! each rank either updated or with the complete gradients at hand, so the group re-forms at
//! the step's end without losing it.
//!
//! **Re-forming** ([`Strategy::sync`]). The layers are partitioned over the new group's
//! stages (balanced by parameter count or by [`PipelineConfig::costs`]); each rank takes
//! each layer of its stage and of the copy it keeps from itself, from the survivor holding it
//! (its stage or its copy), or from the newest checkpoint if that is of the same step, and
//! rolls everything back to the newest checkpoint when some layer is nowhere (see
//! `plan.rs`). A replacement joining brings the stage count back the same way.
//!
//! **Checkpoints** are sharded: each layer is written by one rank holding it (replicas take
//! turns), parameters under their own names, optimizer moments as `optim.<param>.<moment>`,
//! one manifest. Because every tensor is found by name, a checkpoint of `S` stages loads into
//! any other number of stages, into a 2-D layout, or into one process.

mod exec;
mod plan;
mod shard;
mod wire;

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Module, Tensor};
use rekindle_runtime::optim::{OptimError, Optimizer, ParamSpec, STEP_NAME};
use rekindle_runtime::pipeline::{partition, partition_costs};
pub use rekindle_runtime::pipeline::{Grid, Place, Schedule};
use rekindle_runtime::{Buffer, ReduceOp};
use rekindle_storage::{Checkpoint, Layout, Snapshot};

use self::exec::{run_passes, unix_now, Links};
use self::plan::{Holding, Outcome, Source, Target};
use self::shard::{read_layers, Shard};
use super::{BoxError, CheckpointPlan, Group, StateSource, StepDone, StepError, Strategy};
use crate::train::{StepInput, MODEL_GROUP, STATE_GROUP};

/// A model as an ordered list of layers, each a candle module over its own parameters. Every
/// rank must build the same model: the layers' parameters and initial values are pure
/// functions of the model's configuration (and seed).
pub trait PipelineModel: Send {
    /// The number of layers.
    fn layers(&self) -> usize;

    /// Layer `layer`'s parameters, names unique across the model (they are the tensors'
    /// names in checkpoints).
    fn params(&self, layer: usize) -> Vec<ParamSpec>;

    /// Layer `layer`'s initial parameter values, in [`params`](Self::params) order.
    fn init(&self, layer: usize) -> Result<Vec<Tensor>, BoxError>;

    /// Builds layer `layer` over its parameters (candle variables, in
    /// [`params`](Self::params) order): the module maps the previous layer's output to this
    /// layer's.
    fn layer(&self, layer: usize, params: &[Tensor]) -> Result<Box<dyn Module + Send>, BoxError>;

    /// The shape of layer `layer`'s output for a micro-batch of `samples` samples (a stage
    /// allocates the activations it receives with it).
    fn output_shape(&self, layer: usize, samples: usize) -> Vec<usize>;

    /// The mean loss of a micro-batch, from the last layer's output and the targets.
    fn loss(&self, output: &Tensor, targets: &Tensor) -> Result<Tensor, BoxError>;
}

/// Builds an optimizer over a stage's parameters (each stage has its own).
pub type OptimizerFactory =
    Box<dyn Fn(Vec<ParamSpec>) -> Result<Box<dyn Optimizer>, OptimError> + Send>;

/// What the step function of a pipeline job returns: the inputs and targets of this
/// replica's share of the global batch (the indices in [`StepInput::indices`], in order).
/// It is called on the first and the last stage only.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The first layer's input, one sample per row.
    pub inputs: Tensor,
    /// What the loss compares the last layer's output with, one sample per row.
    pub targets: Tensor,
}

impl Batch {
    /// A batch of `inputs` and `targets`.
    pub fn new(inputs: Tensor, targets: Tensor) -> Batch {
        Batch { inputs, targets }
    }
}

/// Settings of a [`PipelineStrategy`].
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineConfig {
    /// Stages per replica (the group holds as many replicas as fit, see
    /// [`Grid::for_world`]).
    pub stages: usize,
    /// Micro-batches per replica per step (fewer when a replica has fewer samples).
    pub micro_batches: usize,
    /// The order of the passes.
    pub schedule: Schedule,
    /// Per-layer costs to balance the stages by (default: parameter counts).
    pub costs: Option<Vec<f64>>,
    /// Keep each stage's copy on its neighbour, updated every step (default true).
    pub neighbour_copy: bool,
    /// Keep each step's timings ([`PipelineStrategy::history`]), for benchmarks.
    pub record_steps: bool,
}

impl PipelineConfig {
    /// `stages` stages, 4 micro-batches, 1F1B, balanced by parameter count, with neighbour
    /// copies.
    pub fn new(stages: usize) -> PipelineConfig {
        PipelineConfig {
            stages,
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            costs: None,
            neighbour_copy: true,
            record_steps: false,
        }
    }

    /// Sets the micro-batches per step.
    pub fn micro_batches(mut self, m: usize) -> PipelineConfig {
        self.micro_batches = m;
        self
    }

    /// Sets the schedule.
    pub fn schedule(mut self, s: Schedule) -> PipelineConfig {
        self.schedule = s;
        self
    }

    /// Balances the stages by these per-layer costs.
    pub fn costs(mut self, costs: Vec<f64>) -> PipelineConfig {
        self.costs = Some(costs);
        self
    }

    /// Turns the neighbour copies on or off.
    pub fn neighbour_copy(mut self, on: bool) -> PipelineConfig {
        self.neighbour_copy = on;
        self
    }

    /// Keeps every step's timings.
    pub fn record_steps(mut self, on: bool) -> PipelineConfig {
        self.record_steps = on;
        self
    }
}

/// One step on one rank, as [`PipelineConfig::record_steps`] keeps it. Times are Unix
/// seconds, comparable between the processes of one host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// The step (0-based).
    pub step: u64,
    /// The rank's stage and replica.
    pub stage: usize,
    /// See `stage`.
    pub replica: usize,
    /// The stages of each replica.
    pub stages: usize,
    /// The micro-batches run.
    pub micro_batches: usize,
    /// When the step began on this rank.
    pub started: f64,
    /// When the first pass started computing.
    pub passes_start: f64,
    /// When the last pass finished computing.
    pub passes_end: f64,
    /// Seconds spent computing passes (not waiting for messages).
    pub busy: f64,
    /// When the step ended (after the update).
    pub ended: f64,
}

/// The memory a stage rank holds, as [`PipelineStrategy::memory`] reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes of the stage's parameters.
    pub params_bytes: usize,
    /// Bytes of the stage's optimizer state.
    pub optimizer_bytes: usize,
    /// Bytes of the neighbour's copy (parameters and optimizer state).
    pub copy_bytes: usize,
    /// The most micro-batches held between their forward and backward passes, over the run.
    pub peak_in_flight: usize,
    /// The bytes of the stage inputs and outputs held at that peak (the intermediate values
    /// of the layers that candle keeps for the backward pass come on top).
    pub peak_activation_bytes: usize,
}

/// How one group's [`Strategy::sync`] went on this rank: where the layers it holds came
/// from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncReport {
    /// The step the group formed at.
    pub step: u64,
    /// Where the loop state came from.
    pub source: StateSource,
    /// The grid's replicas.
    pub replicas: usize,
    /// The grid's stages.
    pub stages: usize,
    /// Layers (of the stage and of the copy) this rank held already.
    pub local: usize,
    /// Layers received from other ranks.
    pub received: usize,
    /// Layers read from the newest checkpoint.
    pub from_checkpoint: usize,
    /// Layers built from the model's initial values.
    pub initial: usize,
}

/// Where this rank sits in the current group.
#[derive(Debug, Clone)]
struct Placement {
    rank: usize,
    grid: Grid,
    ranges: Vec<Range<usize>>,
}

impl Placement {
    fn place(&self) -> Place {
        self.grid.place(self.rank)
    }
}

/// The layers a rank holds in a grid: its stage's and the copy it keeps.
#[derive(Debug, Clone, Default)]
struct Holds {
    live: Option<Range<usize>>,
    copy: Option<Range<usize>>,
}

/// The gradients of the step in flight, complete on this rank, not yet applied.
struct Pending {
    grads: Vec<Vec<f32>>,
    copy: Option<Vec<Vec<f32>>>,
    scale: f32,
}

/// Pipeline parallelism as a [`Strategy`]; see the [module docs](self).
pub struct PipelineStrategy {
    model: Box<dyn PipelineModel>,
    new_optimizer: OptimizerFactory,
    config: PipelineConfig,
    costs: Vec<f64>,
    live: Option<Shard>,
    copy: Option<Shard>,
    step: u64,
    held: bool,
    pending: Option<Pending>,
    placement: Option<Placement>,
    links: Option<Links>,
    history: Vec<StepTimes>,
    peak_in_flight: usize,
    peak_activation_bytes: usize,
    gathered: Option<Vec<(String, Tensor)>>,
    finished: bool,
    syncs: Vec<SyncReport>,
}

impl std::fmt::Debug for PipelineStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineStrategy")
            .field("config", &self.config)
            .field("layers", &self.live.as_ref().map(|s| s.layers.clone()))
            .field("copy", &self.copy.as_ref().map(|s| s.layers.clone()))
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

fn bad_config(reason: impl std::fmt::Display) -> crate::train::TrainError {
    crate::train::TrainError::Config {
        reason: reason.to_string(),
    }
}

impl PipelineStrategy {
    /// A pipeline over `model`'s layers; each stage's optimizer is built by
    /// `new_optimizer` over the stage's parameters.
    pub fn new(
        model: Box<dyn PipelineModel>,
        new_optimizer: OptimizerFactory,
        config: PipelineConfig,
    ) -> Result<PipelineStrategy, crate::train::TrainError> {
        let layers = model.layers();
        if config.stages == 0 || config.stages > layers {
            return Err(bad_config(format!(
                "{} pipeline stage(s) for {layers} layer(s): need 1 <= stages <= layers",
                config.stages
            )));
        }
        if config.micro_batches == 0 {
            return Err(bad_config("a pipeline needs at least one micro-batch"));
        }
        let params: Vec<usize> = (0..layers)
            .map(|l| model.params(l).iter().map(ParamSpec::len).sum())
            .collect();
        let costs = partition_costs(&params, config.costs.as_deref()).map_err(bad_config)?;
        // Checks the costs once (partition refuses negative or NaN ones).
        partition(&costs, config.stages).map_err(bad_config)?;
        Ok(PipelineStrategy {
            model,
            new_optimizer,
            config,
            costs,
            live: None,
            copy: None,
            step: 0,
            held: false,
            pending: None,
            placement: None,
            links: None,
            history: Vec::new(),
            peak_in_flight: 0,
            peak_activation_bytes: 0,
            gathered: None,
            finished: false,
            syncs: Vec::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &PipelineConfig {
        &self.config
    }

    /// The layers this rank's stage holds (`None` before the first group or on an idle rank).
    pub fn layers(&self) -> Option<Range<usize>> {
        self.live.as_ref().map(|s| s.layers.clone())
    }

    /// The layers of the neighbour's copy this rank keeps.
    pub fn copy_layers(&self) -> Option<Range<usize>> {
        self.copy.as_ref().map(|s| s.layers.clone())
    }

    /// The grid of the current (or last) group.
    pub fn grid(&self) -> Option<Grid> {
        self.placement.as_ref().map(|p| p.grid)
    }

    /// The parameters of this rank's stage, by name.
    pub fn stage_parameters(&self) -> Vec<(String, Tensor)> {
        match &self.live {
            Some(s) => s
                .specs
                .iter()
                .zip(&s.vars)
                .map(|(p, v)| (p.name.clone(), v.as_tensor().clone()))
                .collect(),
            None => Vec::new(),
        }
    }

    /// The whole model's parameters, sorted by name: on rank 0 once
    /// [`Trainer::run`](crate::train::Trainer::run) has finished every step (gathered from
    /// the stages in [`Strategy::finish`]); `None` elsewhere.
    pub fn parameters(&self) -> Option<&[(String, Tensor)]> {
        self.gathered.as_deref()
    }

    /// How each group's sync went on this rank, oldest first.
    pub fn syncs(&self) -> &[SyncReport] {
        &self.syncs
    }

    /// Every step's timings, with [`PipelineConfig::record_steps`].
    pub fn history(&self) -> &[StepTimes] {
        &self.history
    }

    /// What this rank holds in memory.
    pub fn memory(&self) -> MemoryReport {
        let (params_bytes, optimizer_bytes) = self.live.as_ref().map_or((0, 0), Shard::bytes);
        let copy_bytes = self.copy.as_ref().map_or(0, |s| s.bytes().0 + s.bytes().1);
        MemoryReport {
            params_bytes,
            optimizer_bytes,
            copy_bytes,
            peak_in_flight: self.peak_in_flight,
            peak_activation_bytes: self.peak_activation_bytes,
        }
    }

    fn grid_for(&self, world: usize) -> Result<(Grid, Vec<Range<usize>>), StepError> {
        let grid = Grid::for_world(world, self.config.stages, self.model.layers())
            .map_err(|e| StepError::state("laying out the pipeline", e))?;
        let ranges = partition(&self.costs, grid.stages())
            .map_err(|e| StepError::state("partitioning the layers", e))?;
        Ok((grid, ranges))
    }

    /// The layers `rank` holds in `grid`: its stage's, and the copy it keeps.
    fn needs(&self, grid: &Grid, ranges: &[Range<usize>], rank: usize) -> Holds {
        match grid.place(rank) {
            Place::Idle => Holds::default(),
            Place::Stage { stage, .. } => Holds {
                live: Some(ranges[stage].clone()),
                copy: if self.config.neighbour_copy {
                    grid.copy_of(stage).map(|s| ranges[s].clone())
                } else {
                    None
                },
            },
        }
    }

    /// The named tensors of `layers`, from this rank's stage or copy.
    fn export(&self, layers: &[usize]) -> Result<Vec<(String, Tensor)>, StepError> {
        let mut out = Vec::new();
        for &layer in layers {
            let shard = [&self.live, &self.copy]
                .into_iter()
                .flatten()
                .find(|s| s.layers.contains(&layer))
                .ok_or_else(|| {
                    StepError::state(
                        "exporting layer state",
                        format!("layer {layer} is not held"),
                    )
                })?;
            out.extend(shard.export(self.model.as_ref(), &[layer])?);
        }
        Ok(out)
    }

    /// Applies the pending gradients to the stage and the copy.
    fn apply_pending(&mut self) -> Result<(), StepError> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        if let Some(live) = &mut self.live {
            live.apply(&p.grads, p.scale)?;
        }
        if let (Some(copy), Some(g)) = (&mut self.copy, &p.copy) {
            copy.apply(g, p.scale)?;
        }
        self.step += 1;
        Ok(())
    }

    /// The agreement: every rank of the group has its step's gradients (and its copy's).
    fn agree(&self, group: &Group<'_>) -> Result<(), StepError> {
        group
            .pg()
            .all_reduce(Buffer::from(vec![1.0f32]), ReduceOp::Sum)
            .wait(group.wait())
            .map(|_| ())
            .map_err(|e| StepError::collective("agreeing on the step's end", e))
    }

    /// Builds the neighbour links and the stage group, every rank in one global order (a
    /// sub-group forms when all its members call for it, so a common order cannot deadlock).
    fn build_links(&self, group: &mut Group<'_>, grid: &Grid) -> Result<Links, StepError> {
        let me = group.rank();
        let mut links = Links::default();
        let (d_me, s_me) = match grid.place(me) {
            Place::Stage { replica, stage } => (replica, stage),
            Place::Idle => return Ok(links),
        };
        for d in 0..grid.replicas() {
            for s in 0..grid.stages().saturating_sub(1) {
                let pair = [grid.rank(d, s), grid.rank(d, s + 1)];
                if d != d_me || (s != s_me && s + 1 != s_me) {
                    continue;
                }
                let a = group.subgroup(&format!("act.{d}.{s}"), &pair)?;
                let g = group.subgroup(&format!("grad.{d}.{s}"), &pair)?;
                if s == s_me {
                    links.act_out = Some(a);
                    links.grad_in = Some(g);
                } else {
                    links.act_in = Some(a);
                    links.grad_out = Some(g);
                }
            }
        }
        if grid.replicas() > 1 {
            links.stage = Some(group.subgroup(&format!("stage.{s_me}"), &grid.stage_ranks(s_me))?);
        }
        Ok(links)
    }

    /// Sends this step's gradients to the holder of this stage's copy and receives the
    /// gradients of the copy this rank keeps (parent group; even stages send first, odd ones
    /// receive first, so the ring cannot deadlock).
    fn exchange_copy(
        &self,
        group: &Group<'_>,
        grid: &Grid,
        replica: usize,
        stage: usize,
        grads: &[Vec<f32>],
    ) -> Result<Option<Vec<Vec<f32>>>, StepError> {
        let (Some(holder), Some(source), Some(copy)) =
            (grid.copy_holder(stage), grid.copy_of(stage), &self.copy)
        else {
            return Ok(None);
        };
        const DURING: &str = "refreshing the neighbour copies";
        let (to, from) = (grid.rank(replica, holder), grid.rank(replica, source));
        let flat: Vec<f32> = grads.iter().flatten().copied().collect();
        let incoming = Buffer::zeros(rekindle_runtime::DType::F32, copy.elements());
        let pg = group.pg();
        let (sent, got) = if stage % 2 == 0 {
            let s = pg.send(Buffer::from(flat), to);
            (s, pg.recv(incoming, from))
        } else {
            let r = pg.recv(incoming, from);
            (pg.send(Buffer::from(flat), to), r)
        };
        let got = got
            .wait(group.wait())
            .map_err(|e| StepError::collective(DURING, e))?;
        sent.wait(group.wait())
            .map_err(|e| StepError::collective(DURING, e))?;
        let flat = got
            .into_vec::<f32>()
            .map_err(|_| StepError::state(DURING, "not f32"))?;
        let mut out = Vec::with_capacity(copy.specs.len());
        let mut at = 0;
        for s in &copy.specs {
            out.push(flat[at..at + s.len()].to_vec());
            at += s.len();
        }
        Ok(Some(out))
    }
}

fn collective(during: &'static str) -> impl Fn(rekindle_runtime::Error) -> StepError {
    move |e| StepError::collective(during, e)
}

impl Strategy for PipelineStrategy {
    type Output = Batch;

    fn name(&self) -> &'static str {
        "pipeline"
    }

    fn restore(
        &mut self,
        ckpt: &Checkpoint,
        rank: usize,
        world_size: usize,
    ) -> Result<(), StepError> {
        let (grid, ranges) = self.grid_for(world_size)?;
        let Holds { live, copy } = self.needs(&grid, &ranges, rank);
        let model = self.model.as_ref();
        let build = |r: Option<Range<usize>>, modules: bool| -> Result<Option<Shard>, StepError> {
            let Some(r) = r else { return Ok(None) };
            let named = read_layers(ckpt, model, r.clone())?;
            Shard::build(model, &self.new_optimizer, r, Some(&named), modules).map(Some)
        };
        self.live = build(live, true)?;
        self.copy = build(copy, false)?;
        self.step = ckpt.step();
        self.pending = None;
        self.held = true;
        Ok(())
    }

    fn holdings(&self) -> serde_json::Value {
        if !self.held {
            return serde_json::Value::Null;
        }
        Holding {
            step: self.step,
            pending: self.pending.is_some(),
            live: self.layers(),
            copy: self.copy_layers(),
        }
        .to_json()
    }

    fn sync(&mut self, group: &mut Group<'_>) -> Result<StateSource, StepError> {
        let (rank, world) = (group.rank(), group.world_size());
        let (grid, ranges) = self.grid_for(world)?;
        let wanted: Vec<Holds> = (0..world).map(|r| self.needs(&grid, &ranges, r)).collect();
        let needs: Vec<Vec<usize>> = wanted
            .iter()
            .map(|h| {
                h.live
                    .iter()
                    .chain(&h.copy)
                    .flat_map(|r| r.clone())
                    .collect()
            })
            .collect();
        let holdings: Vec<Option<Holding>> = group
            .members()
            .iter()
            .map(|m| m.has_state.then(|| Holding::from_json(&m.holds)).flatten())
            .collect();
        let loop_steps: Vec<Option<u64>> = group
            .members()
            .iter()
            .map(|m| m.has_state.then_some(m.step))
            .collect();
        let mut ckpt: Option<std::sync::Arc<Checkpoint>> = None;
        let mut outcome = plan::plan(&holdings, &loop_steps, &needs, None);
        if outcome == Outcome::NeedCheckpoint {
            ckpt = group.newest_checkpoint()?;
            let known = Some(ckpt.as_ref().map(|c| c.step()));
            outcome = plan::plan(&holdings, &loop_steps, &needs, known);
        }
        let plan = match outcome {
            Outcome::Planned(p) => p,
            Outcome::Lost { step, layers } => {
                return Err(StepError::state(
                    "re-forming the pipeline",
                    format!(
                        "layers {layers:?} of step {step} are held by no rank and there is no \
                         checkpoint"
                    ),
                ))
            }
            Outcome::NeedCheckpoint => {
                return Err(StepError::state("re-forming the pipeline", "no plan"))
            }
        };
        // Bring this rank's own state to the plan's step.
        if self.pending.is_some() {
            if plan.target != Target::Checkpoint && self.step + 1 == plan.step {
                self.apply_pending()?;
            } else {
                self.pending = None;
            }
        }
        // Layers from other ranks, in the plan's global order.
        let wait = group.wait();
        let mut named: HashMap<String, Tensor> = HashMap::new();
        let mut sends = Vec::new();
        for (from, to, layers) in &plan.transfers {
            if *from == rank {
                let tensors = self.export(layers)?;
                sends.extend(wire::send_tensors(group.pg(), *to, &tensors)?);
            }
            if *to == rank {
                named.extend(wire::recv_tensors(group.pg(), *from, wait)?);
            }
        }
        for w in sends {
            w.wait(wait).map_err(collective("sending layer state"))?;
        }
        let mine = &plan.sources[rank];
        let local: Vec<usize> = mine
            .iter()
            .filter(|(_, s)| *s == Source::Local)
            .map(|(l, _)| *l)
            .collect();
        named.extend(self.export(&local)?);
        let from_ckpt: Vec<usize> = mine
            .iter()
            .filter(|(_, s)| *s == Source::Checkpoint)
            .map(|(l, _)| *l)
            .collect();
        if !from_ckpt.is_empty() {
            // The plan asked for the newest checkpoint (every rank did, at the same point).
            let Some(c) = ckpt.clone() else {
                return Err(StepError::state("re-forming the pipeline", "no checkpoint"));
            };
            named.extend(read_layers(&c, self.model.as_ref(), from_ckpt.into_iter())?);
        }
        let fresh = mine.iter().any(|(_, s)| *s == Source::Init);
        let Holds {
            live: live_range,
            copy: copy_range,
        } = wanted[rank].clone();
        let model = self.model.as_ref();
        let source = (!fresh).then_some(&named);
        let live = match live_range {
            Some(r) => Some(Shard::build(model, &self.new_optimizer, r, source, true)?),
            None => None,
        };
        let copy = match copy_range {
            Some(r) => Some(Shard::build(model, &self.new_optimizer, r, source, false)?),
            None => None,
        };
        let links = self.build_links(group, &grid)?;
        self.live = live;
        self.copy = copy;
        self.step = plan.step;
        self.pending = None;
        self.held = true;
        self.links = Some(links);
        self.placement = Some(Placement { rank, grid, ranges });
        let source = match plan.target {
            Target::Rank(r) => StateSource::Rank(r),
            Target::Checkpoint => StateSource::Checkpoint,
        };
        let count = |want: fn(&Source) -> bool| mine.iter().filter(|(_, s)| want(s)).count();
        self.syncs.push(SyncReport {
            step: plan.step,
            source,
            replicas: grid.replicas(),
            stages: grid.stages(),
            local: count(|s| *s == Source::Local),
            received: count(|s| matches!(s, Source::Rank(_))),
            from_checkpoint: count(|s| *s == Source::Checkpoint),
            initial: count(|s| *s == Source::Init),
        });
        Ok(source)
    }

    fn data_share(&self, rank: usize, world_size: usize) -> Option<(usize, usize)> {
        let grid = Grid::for_world(world_size, self.config.stages, self.model.layers()).ok()?;
        match grid.place(rank) {
            Place::Stage { replica, .. } => Some((replica, grid.replicas())),
            Place::Idle => None,
        }
    }

    fn step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<Batch, BoxError>,
    ) -> Result<StepDone, StepError> {
        let started = unix_now();
        self.pending = None;
        self.finished = false;
        let placement = self
            .placement
            .clone()
            .ok_or_else(|| StepError::state("a pipeline step", "no group"))?;
        let grid = placement.grid;
        let Place::Stage { replica, stage } = placement.place() else {
            // An idle rank takes part in the agreement only.
            self.agree(group)?;
            return Ok(StepDone::default());
        };
        let stages = grid.stages();
        let (first, last) = (stage == 0, stage + 1 == stages);
        let n = input.indices.len();
        let micro_count = self.config.micro_batches.min(n);
        let micro: Vec<Range<usize>> = (0..micro_count)
            .map(|m| rekindle_runtime::segment(n, micro_count, m))
            .collect();
        let batch = if (first || last) && n > 0 {
            let b = step_fn(input).map_err(StepError::Program)?;
            for (what, t) in [("inputs", &b.inputs), ("targets", &b.targets)] {
                if t.dims().first() != Some(&n) {
                    return Err(StepError::Program(
                        format!(
                            "the batch's {what} have shape {:?}; expected {n} rows",
                            t.dims()
                        )
                        .into(),
                    ));
                }
            }
            Some(b)
        } else {
            None
        };
        let (Some(live), Some(links)) = (&self.live, &self.links) else {
            return Err(StepError::state("a pipeline step", "no stage"));
        };
        let passes = run_passes(
            self.model.as_ref(),
            live,
            links,
            self.config.schedule,
            stages,
            stage,
            &micro,
            batch.as_ref(),
            group.wait(),
        )?;
        let mut grads = passes.grads;
        let total = match &links.stage {
            Some(sub) => {
                const DURING: &str = "all-reducing a stage's gradients";
                let mut flat: Vec<f32> = grads.iter().flatten().copied().collect();
                flat.push(n as f32);
                let sum = sub
                    .pg()
                    .all_reduce(Buffer::from(flat), ReduceOp::Sum)
                    .wait(group.wait())
                    .map_err(|e| sub.error(DURING, e))?
                    .into_vec::<f32>()
                    .map_err(|_| StepError::state(DURING, "not f32"))?;
                let mut at = 0;
                for g in grads.iter_mut() {
                    let len = g.len();
                    g.copy_from_slice(&sum[at..at + len]);
                    at += len;
                }
                sum.get(at).map_or(0, |&t| t.round() as u64)
            }
            None => n as u64,
        };
        let copy = if self.config.neighbour_copy {
            self.exchange_copy(group, &grid, replica, stage, &grads)?
        } else {
            None
        };
        self.pending = Some(Pending {
            grads,
            copy,
            scale: if total > 0 { 1.0 / total as f32 } else { 0.0 },
        });
        self.agree(group)?;
        self.apply_pending()?;
        self.peak_in_flight = self.peak_in_flight.max(passes.peak_in_flight);
        self.peak_activation_bytes = self.peak_activation_bytes.max(passes.peak_activation_bytes);
        if self.config.record_steps {
            self.history.push(StepTimes {
                step: input.step,
                stage,
                replica,
                stages,
                micro_batches: micro_count,
                started,
                passes_start: passes.first_start,
                passes_end: passes.last_end,
                busy: passes.busy.as_secs_f64(),
                ended: unix_now(),
            });
        }
        Ok(StepDone {
            global_samples: total,
            loss_samples: if last { n as u64 } else { 0 },
            loss: if last && n > 0 {
                (passes.loss_sum / n as f64) as f32
            } else {
                0.0
            },
        })
    }

    fn checkpoint_plan(&self, world_size: usize) -> CheckpointPlan {
        match Grid::for_world(world_size, self.config.stages, self.model.layers()) {
            Ok(g) if g.replicas() == 1 => {
                CheckpointPlan::Sharded(Layout::Pipeline { stages: g.stages() })
            }
            Ok(g) => CheckpointPlan::Sharded(Layout::Custom {
                name: format!("pipeline {}x{}", g.replicas(), g.stages()),
                shards: world_size,
            }),
            Err(_) => CheckpointPlan::Sharded(Layout::Pipeline { stages: 1 }),
        }
    }

    fn checkpoint(&self, snap: &mut Snapshot) -> Result<(), StepError> {
        let Some(placement) = &self.placement else {
            return Ok(());
        };
        let grid = placement.grid;
        if let (Place::Stage { replica, .. }, Some(live)) = (placement.place(), &self.live) {
            // Each layer is written by one replica; they take turns.
            let mine: Vec<usize> = live
                .layers
                .clone()
                .filter(|l| l % grid.replicas() == replica)
                .collect();
            let params: Vec<String> = mine
                .iter()
                .flat_map(|&l| self.model.params(l))
                .map(|s| s.name)
                .collect();
            for (name, t) in live.export(self.model.as_ref(), &mine)? {
                if name == STEP_NAME {
                    if placement.rank == 0 {
                        snap.insert_candle(STATE_GROUP, &name, &t)?;
                    }
                } else if params.contains(&name) {
                    snap.insert_candle(MODEL_GROUP, &name, &t)?;
                } else {
                    snap.insert_candle(STATE_GROUP, &name, &t)?;
                }
            }
        }
        snap.state.user.insert(
            "pipeline".into(),
            serde_json::json!({
                "replicas": grid.replicas(),
                "stages": grid.stages(),
                "layers": placement.ranges.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            }),
        );
        Ok(())
    }

    fn finish(&mut self, group: &mut Group<'_>) -> Result<(), StepError> {
        let Some(placement) = self.placement.clone() else {
            self.finished = true;
            return Ok(());
        };
        let grid = placement.grid;
        let rank = group.rank();
        let params_of = |s: &Shard| -> Vec<(String, Tensor)> {
            s.specs
                .iter()
                .zip(&s.vars)
                .map(|(p, v)| (p.name.clone(), v.as_tensor().clone()))
                .collect()
        };
        // Replica 0's stages send their parameters to rank 0, stage by stage.
        let mut sends = Vec::new();
        let mut all = Vec::new();
        if rank == 0 {
            if let Some(live) = &self.live {
                all.extend(params_of(live));
            }
        }
        for stage in 1..grid.stages() {
            let from = grid.rank(0, stage);
            if rank == from {
                if let Some(live) = &self.live {
                    sends.extend(wire::send_tensors(group.pg(), 0, &params_of(live))?);
                }
            }
            if rank == 0 {
                all.extend(wire::recv_tensors(group.pg(), from, group.wait())?);
            }
        }
        for w in sends {
            w.wait(group.wait())
                .map_err(collective("gathering the parameters"))?;
        }
        if rank == 0 {
            all.sort_by(|a, b| a.0.cmp(&b.0));
            self.gathered = Some(all);
        }
        self.finished = true;
        Ok(())
    }

    fn finished(&self) -> bool {
        self.finished
    }

    fn leave(&mut self) {
        self.links = None;
    }
}
