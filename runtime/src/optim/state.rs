//! Conversions between optimizer state and named tensors.

use candle_core::{DType, Device, Tensor};

use super::{OptimError, OptimResult, ParamSpec, STEP_NAME};

fn state_err(name: &str, reason: impl std::fmt::Display) -> OptimError {
    OptimError::State {
        name: name.to_string(),
        reason: reason.to_string(),
    }
}

/// The step count as an i64 scalar (bit-cast, so every u64 round-trips).
pub(super) fn step_tensor(step: u64) -> OptimResult<(String, Tensor)> {
    let t = Tensor::new(step as i64, &Device::Cpu).map_err(|e| state_err(STEP_NAME, e))?;
    Ok((STEP_NAME.to_string(), t))
}

/// A moment as an f32 tensor of the parameter's shape.
pub(super) fn moment_tensor(
    name: String,
    spec: &ParamSpec,
    data: &[f32],
) -> OptimResult<(String, Tensor)> {
    let t = Tensor::from_slice(data, spec.shape.as_slice(), &Device::Cpu)
        .map_err(|e| state_err(&name, e))?;
    Ok((name, t))
}

fn find<'a>(state: &'a [(String, Tensor)], name: &str) -> Option<&'a Tensor> {
    state.iter().find(|(n, _)| n == name).map(|(_, t)| t)
}

/// The step count from the state.
pub(super) fn read_step(state: &[(String, Tensor)]) -> OptimResult<u64> {
    let t = find(state, STEP_NAME).ok_or_else(|| state_err(STEP_NAME, "missing"))?;
    if t.dtype() != DType::I64 || t.elem_count() != 1 {
        return Err(state_err(
            STEP_NAME,
            format!("expected one i64, got {:?} {:?}", t.dtype(), t.dims()),
        ));
    }
    let v: i64 = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<i64>())
        .map_err(|e| state_err(STEP_NAME, e))?[0];
    Ok(v as u64)
}

/// A moment from the state, checked against the parameter's shape; `None` when absent.
pub(super) fn read_moment(
    state: &[(String, Tensor)],
    name: &str,
    spec: &ParamSpec,
) -> OptimResult<Option<Vec<f32>>> {
    let Some(t) = find(state, name) else {
        return Ok(None);
    };
    if t.dtype() != DType::F32 || t.dims() != spec.shape.as_slice() {
        return Err(state_err(
            name,
            format!(
                "expected f32 {:?}, got {:?} {:?}",
                spec.shape,
                t.dtype(),
                t.dims()
            ),
        ));
    }
    let v = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| state_err(name, e))?;
    Ok(Some(v))
}

/// A moment that must be present.
pub(super) fn require_moment(
    state: &[(String, Tensor)],
    name: &str,
    spec: &ParamSpec,
) -> OptimResult<Vec<f32>> {
    read_moment(state, name, spec)?.ok_or_else(|| state_err(name, "missing"))
}
