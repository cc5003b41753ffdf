//! A set of consecutive layers with their parameters and optimizer: a stage's own layers
//! (with the modules that run them) or the copy of a neighbour's.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Module, Tensor, Var};
use rekindle_runtime::optim::{update_f32, Optimizer, ParamSpec, STEP_NAME};
use rekindle_storage::Checkpoint;

use super::{OptimizerFactory, PipelineModel};
use crate::train::strategy::StepError;

/// Consecutive layers' parameters (as candle variables), their optimizer, and (for a stage's
/// own layers) the modules that run them.
pub(crate) struct Shard {
    /// The layers.
    pub layers: Range<usize>,
    /// Every parameter, layer by layer, in each layer's order.
    pub specs: Vec<ParamSpec>,
    /// The variables, in `specs` order.
    pub vars: Vec<Var>,
    /// Over `specs`.
    pub optimizer: Box<dyn Optimizer>,
    /// One per layer; empty for a copy.
    pub modules: Vec<Box<dyn Module + Send>>,
}

fn state_err(what: &'static str) -> impl Fn(String) -> StepError {
    move |reason| StepError::State { what, reason }
}

/// Whether `name` is a moment of parameter `param` (`optim.<param>.<moment>`).
fn is_moment_of(name: &str, param: &str) -> bool {
    name.strip_prefix("optim.")
        .and_then(|r| r.strip_prefix(param))
        .and_then(|r| r.strip_prefix('.'))
        .is_some_and(|m| !m.is_empty() && !m.contains('.'))
}

impl Shard {
    /// Builds the shard of `layers` from named tensors holding every parameter, its
    /// optimizer moments and the optimizer's step count; with `named = None`, from the
    /// model's initial values and a fresh optimizer.
    pub fn build(
        model: &dyn PipelineModel,
        new_optimizer: &OptimizerFactory,
        layers: Range<usize>,
        named: Option<&HashMap<String, Tensor>>,
        with_modules: bool,
    ) -> Result<Shard, StepError> {
        let err = state_err("building a pipeline stage");
        let mut specs = Vec::new();
        let mut vars = Vec::new();
        let mut per_layer: Vec<Vec<Tensor>> = Vec::new();
        for layer in layers.clone() {
            let layer_specs = model.params(layer);
            let values: Vec<Tensor> = match named {
                None => {
                    let init = model
                        .init(layer)
                        .map_err(|e| err(format!("initialising layer {layer}: {e}")))?;
                    if init.len() != layer_specs.len() {
                        return Err(err(format!(
                            "layer {layer}: init gave {} tensors for {} parameters",
                            init.len(),
                            layer_specs.len()
                        )));
                    }
                    init
                }
                Some(named) => layer_specs
                    .iter()
                    .map(|s| {
                        named.get(&s.name).cloned().ok_or_else(|| {
                            err(format!(
                                "no value for parameter {} of layer {layer}",
                                s.name
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            };
            let mut tensors = Vec::with_capacity(values.len());
            for (spec, value) in layer_specs.iter().zip(values) {
                if value.dims() != spec.shape.as_slice() {
                    return Err(err(format!(
                        "parameter {} has shape {:?}, the model says {:?}",
                        spec.name,
                        value.dims(),
                        spec.shape
                    )));
                }
                // A copy of its own: the variable is updated in place.
                let var = value
                    .to_dtype(DType::F32)
                    .and_then(|t| t.to_device(&Device::Cpu))
                    .and_then(|t| t.copy())
                    .and_then(|t| Var::from_tensor(&t))
                    .map_err(|e| err(format!("{}: {e}", spec.name)))?;
                tensors.push(var.as_tensor().clone());
                vars.push(var);
            }
            specs.extend(layer_specs);
            per_layer.push(tensors);
        }
        let mut optimizer = new_optimizer(specs.clone())
            .map_err(|e| err(format!("building the optimizer: {e}")))?;
        if let Some(named) = named {
            let mut state: Vec<(String, Tensor)> = named
                .iter()
                .filter(|(n, _)| specs.iter().any(|s| is_moment_of(n, &s.name)))
                .map(|(n, t)| (n.clone(), t.clone()))
                .collect();
            let step = named
                .get(STEP_NAME)
                .ok_or_else(|| err(format!("no {STEP_NAME}")))?;
            state.push((STEP_NAME.to_string(), step.clone()));
            optimizer
                .load_state(&state)
                .map_err(|e| err(format!("loading the optimizer state: {e}")))?;
        }
        let mut modules = Vec::new();
        if with_modules {
            for (layer, tensors) in layers.clone().zip(&per_layer) {
                modules.push(
                    model
                        .layer(layer, tensors)
                        .map_err(|e| err(format!("building layer {layer}: {e}")))?,
                );
            }
        }
        Ok(Shard {
            layers,
            specs,
            vars,
            optimizer,
            modules,
        })
    }

    /// The parameters, optimizer moments and step count of `layers` (which this shard holds),
    /// as named tensors of their own.
    pub fn export(
        &self,
        model: &dyn PipelineModel,
        layers: &[usize],
    ) -> Result<Vec<(String, Tensor)>, StepError> {
        let err = state_err("exporting layer state");
        let state = self.optimizer.state().map_err(|e| err(e.to_string()))?;
        let mut out = Vec::new();
        for &layer in layers {
            for spec in model.params(layer) {
                let i = self
                    .specs
                    .iter()
                    .position(|s| s.name == spec.name)
                    .ok_or_else(|| err(format!("parameter {} is not held", spec.name)))?;
                let t = self.vars[i]
                    .as_tensor()
                    .copy()
                    .map_err(|e| err(format!("{}: {e}", spec.name)))?;
                out.push((spec.name.clone(), t));
                out.extend(
                    state
                        .iter()
                        .filter(|(n, _)| is_moment_of(n, &spec.name))
                        .cloned(),
                );
            }
        }
        if let Some(step) = state.iter().find(|(n, _)| n == STEP_NAME) {
            out.push(step.clone());
        }
        Ok(out)
    }

    /// One optimizer step with `grads` (one per parameter, in `specs` order) times `scale`.
    pub fn apply(&mut self, grads: &[Vec<f32>], scale: f32) -> Result<(), StepError> {
        let err = state_err("the optimizer step");
        if grads.len() != self.vars.len() {
            return Err(err(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.vars.len()
            )));
        }
        self.optimizer.begin_step();
        for (i, (var, g)) in self.vars.iter().zip(grads).enumerate() {
            let mut result = Ok(());
            let optimizer = &mut self.optimizer;
            update_f32(var, |p| {
                result = optimizer.update_scaled(i, p, g, scale);
                Ok(())
            })
            .map_err(|e| err(format!("{}: {e}", self.specs[i].name)))?;
            result.map_err(|e| err(e.to_string()))?;
        }
        Ok(())
    }

    /// The number of parameter elements.
    pub fn elements(&self) -> usize {
        self.specs.iter().map(ParamSpec::len).sum()
    }

    /// Bytes of the parameters and of the optimizer state.
    pub fn bytes(&self) -> (usize, usize) {
        let params = 4 * self.elements();
        let optimizer = self
            .optimizer
            .state()
            .map(|s| {
                s.iter()
                    .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
                    .sum()
            })
            .unwrap_or(0);
        (params, optimizer)
    }

    /// Runs the stage's layers.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for m in &self.modules {
            h = m.forward(&h)?;
        }
        Ok(h)
    }
}

/// The named tensors of `layers` in `ckpt`: parameters, their optimizer moments and the
/// optimizer's step count.
pub(crate) fn read_layers(
    ckpt: &Checkpoint,
    model: &dyn PipelineModel,
    layers: impl Iterator<Item = usize>,
) -> Result<HashMap<String, Tensor>, StepError> {
    let mut out = HashMap::new();
    let names = ckpt.names();
    let mut get = |name: &str| -> Result<(), StepError> {
        let t = ckpt
            .tensor(name)?
            .to_candle_on(rekindle_runtime::Device::Cpu)?;
        out.insert(name.to_string(), t);
        Ok(())
    };
    for layer in layers {
        for spec in model.params(layer) {
            get(&spec.name)?;
            for n in names.iter().filter(|n| is_moment_of(n, &spec.name)) {
                get(n)?;
            }
        }
    }
    get(STEP_NAME)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moment_names() {
        assert!(is_moment_of("optim.fc1.weight.exp_avg", "fc1.weight"));
        assert!(!is_moment_of("optim.fc1.weight", "fc1.weight"));
        assert!(!is_moment_of("optim.fc1.weight.x.y", "fc1.weight"));
        assert!(!is_moment_of("optim.fc1.weightx.m", "fc1.weight"));
        assert!(!is_moment_of("fc1.weight.m", "fc1.weight"));
    }
}
