//! Stepping an optimizer directly over candle variables (single-process training).

use candle_core::backprop::GradStore;
use candle_core::Var;

use super::tensor_io::{update_f32, with_f32};
use super::{OptimError, OptimResult, Optimizer, ParamSpec};

/// The specs of named variables, in the given order.
pub fn specs_of(vars: &[(String, Var)]) -> Vec<ParamSpec> {
    vars.iter()
        .map(|(n, v)| ParamSpec::new(n.clone(), v.dims()))
        .collect()
}

/// One optimizer step over `vars` (in the order of `optimizer.params()`): every variable with
/// a gradient in `grads` is updated in place (on the CPU without copies); variables without
/// one are left alone, as torch skips parameters whose `grad` is `None`.
pub fn step_vars(
    optimizer: &mut dyn Optimizer,
    vars: &[Var],
    grads: &GradStore,
) -> OptimResult<()> {
    if vars.len() != optimizer.params().len() {
        return Err(OptimError::InvalidConfig {
            reason: format!(
                "{} variables for an optimizer over {} parameters",
                vars.len(),
                optimizer.params().len()
            ),
        });
    }
    optimizer.begin_step();
    for (i, var) in vars.iter().enumerate() {
        let Some(grad) = grads.get(var.as_tensor()) else {
            continue;
        };
        let name = optimizer.params()[i].name.clone();
        let tensor_err = |e: candle_core::Error| OptimError::Tensor {
            name: name.clone(),
            message: e.to_string(),
        };
        let mut result = Ok(());
        with_f32(grad, |g| {
            update_f32(var, |p| {
                result = optimizer.update(i, p, g);
                Ok(())
            })
        })
        .map_err(tensor_err)?
        .map_err(tensor_err)?;
        result?;
    }
    Ok(())
}
