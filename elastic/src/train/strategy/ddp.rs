//! [`DdpStrategy`]: every rank holds the whole model and optimizer; a step all-reduces the
//! gradients (bucketed, atomic) and every rank applies the same update.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use rekindle_runtime::ddp::{broadcast_state, Ddp, DdpError, DdpOptions, StepMode};
use rekindle_runtime::optim::Optimizer;
use rekindle_storage::{Checkpoint, Snapshot};

use super::{BoxError, CheckpointPlan, Group, StateSource, StepDone, StepError, Strategy};
use crate::train::{param_specs, StepInput, TrainError, MODEL_GROUP, STATE_GROUP};

/// What the step function of a DDP job returns.
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

    /// The gradients (`None` for [`StepOutput::empty`]).
    pub fn grads(&self) -> Option<&GradStore> {
        self.grads.as_ref()
    }

    /// The samples the loss was averaged over.
    pub fn samples(&self) -> usize {
        self.samples
    }

    /// The reported mean loss, if any.
    pub fn loss(&self) -> Option<f32> {
        self.loss
    }
}

/// Distributed data parallel: the model (a candle `VarMap`) and the optimizer replicated on
/// every rank. Re-forming, the rank with the newest state broadcasts parameters and optimizer
/// state; a checkpoint is written by rank 0 alone.
pub struct DdpStrategy {
    varmap: VarMap,
    vars: Vec<(String, Var)>,
    optimizer: Box<dyn Optimizer>,
    options: DdpOptions,
    ddp: Option<Ddp>,
}

impl std::fmt::Debug for DdpStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpStrategy")
            .field("params", &self.vars.len())
            .field("options", &self.options)
            .field("in_group", &self.ddp.is_some())
            .finish()
    }
}

fn ddp_err(during: &'static str, e: DdpError) -> StepError {
    match e {
        DdpError::Collective { source, .. } => StepError::collective(during, source),
        e => StepError::state(during, e),
    }
}

impl DdpStrategy {
    /// DDP over `varmap`'s variables, updated by `optimizer`, which must be built over
    /// [`param_specs`]`(&varmap)` (the parameters sorted by name). The step mode must be
    /// [`StepMode::Atomic`]: a failed step must leave the state untouched.
    pub fn new(
        varmap: VarMap,
        optimizer: Box<dyn Optimizer>,
        options: DdpOptions,
    ) -> Result<DdpStrategy, TrainError> {
        let config = |reason: String| TrainError::Config { reason };
        if options.mode != StepMode::Atomic {
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
        Ok(DdpStrategy {
            varmap,
            vars,
            optimizer,
            options,
            ddp: None,
        })
    }

    /// The model's variables.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }
}

impl Strategy for DdpStrategy {
    type Output = StepOutput;

    fn name(&self) -> &'static str {
        "ddp"
    }

    fn restore(&mut self, ckpt: &Checkpoint, _rank: usize, _world: usize) -> Result<(), StepError> {
        for (name, var) in &self.vars {
            let t = ckpt
                .tensor(name)
                .and_then(|t| t.to_candle_on(rekindle_runtime::Device::Cpu))?;
            t.to_device(var.device())
                .and_then(|t| var.set(&t))
                .map_err(|e| StepError::state("restoring a parameter", format!("{name}: {e}")))?;
        }
        let mut rest = Vec::new();
        for name in ckpt.names() {
            if self.vars.iter().any(|(n, _)| n == name) {
                continue;
            }
            let t = ckpt
                .tensor(name)
                .and_then(|t| t.to_candle_on(rekindle_runtime::Device::Cpu))?;
            rest.push((name.to_string(), t));
        }
        self.optimizer
            .load_state(&rest)
            .map_err(|e| StepError::state("restoring the optimizer state", e))
    }

    fn sync(&mut self, group: &mut Group<'_>) -> Result<StateSource, StepError> {
        // The newest state wins; without any, rank 0's (seeded) initial state.
        let src = group.newest().unwrap_or(0);
        let mut options = self.options.clone();
        options.timeout = options.timeout.max(group.wait());
        let ddp = Ddp::with_root(&self.varmap, group.pg().clone(), options, src)
            .map_err(|e| ddp_err("syncing parameters", e))?;
        let mine = if group.rank() == src {
            Some(
                self.optimizer
                    .state()
                    .map_err(|e| StepError::state("exporting the optimizer state", e))?,
            )
        } else {
            None
        };
        let state = broadcast_state(group.pg(), mine, src, group.wait())
            .map_err(|e| ddp_err("syncing the optimizer state", e))?;
        if group.rank() != src {
            self.optimizer
                .load_state(&state)
                .map_err(|e| StepError::state("importing the optimizer state", e))?;
        }
        self.ddp = Some(ddp);
        Ok(StateSource::Rank(src))
    }

    fn step(
        &mut self,
        _group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<StepOutput, BoxError>,
    ) -> Result<StepDone, StepError> {
        let out = step_fn(input).map_err(StepError::Program)?;
        let Some(ddp) = self.ddp.as_mut() else {
            return Err(StepError::state("the DDP step", "no group"));
        };
        let report = ddp
            .step(out.grads.as_ref(), out.samples, self.optimizer.as_mut())
            .map_err(|e| ddp_err("the DDP step", e))?;
        Ok(StepDone {
            global_samples: report.global_samples,
            loss_samples: if out.loss.is_some() {
                out.samples as u64
            } else {
                0
            },
            loss: out.loss.unwrap_or(0.0),
        })
    }

    fn verify(&mut self, _group: &mut Group<'_>) -> Result<(), StepError> {
        match &self.ddp {
            Some(ddp) => ddp
                .check_parameters()
                .map(|_| ())
                .map_err(|e| ddp_err("checking parameters", e)),
            None => Ok(()),
        }
    }

    fn checkpoint_plan(&self, _world_size: usize) -> CheckpointPlan {
        CheckpointPlan::Replicated
    }

    fn checkpoint(&self, snap: &mut Snapshot) -> Result<(), StepError> {
        snap.insert_varmap(MODEL_GROUP, &self.varmap)?;
        let state: Vec<(String, Tensor)> = self
            .optimizer
            .state()
            .map_err(|e| StepError::state("exporting the optimizer state", e))?;
        for (name, t) in state {
            snap.insert_candle(STATE_GROUP, &name, &t)?;
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.ddp = None;
    }
}
