//! One step's forward and backward passes on one stage, in the schedule's order:
//! activations go forward and gradients backward over the neighbour links, every receive
//! bounded by the group's deadline, and the parameters' gradients are summed over the
//! micro-batches in micro-batch order.

use std::ops::Range;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::{DType, Device, Tensor, Var};
use rekindle_runtime::optim::with_f32;
use rekindle_runtime::pipeline::{actions, Action, Schedule};
use rekindle_runtime::{Buffer, Work};

use super::shard::Shard;
use super::wire::to_f32s;
use super::{Batch, PipelineModel};
use crate::train::strategy::{StepError, SubGroup};

/// The sub-groups a stage talks to its neighbours over, one per direction and pair of
/// adjacent stages, so that each carries messages one way in one order and no schedule can
/// deadlock on the backend's per-group queue.
#[derive(Debug, Default)]
pub(crate) struct Links {
    /// Activations from the previous stage (it is rank 0 of the pair).
    pub act_in: Option<SubGroup>,
    /// Activations to the next stage (this stage is rank 0).
    pub act_out: Option<SubGroup>,
    /// Gradients from the next stage (this stage is rank 0).
    pub grad_in: Option<SubGroup>,
    /// Gradients to the previous stage (it is rank 0).
    pub grad_out: Option<SubGroup>,
    /// The ranks holding this stage in every replica (only with two replicas or more).
    pub stage: Option<SubGroup>,
}

/// What the passes of one step produced.
pub(crate) struct Passes {
    /// The summed gradient of each parameter (the loss summed over samples).
    pub grads: Vec<Vec<f32>>,
    /// The loss summed over this replica's samples (last stage only).
    pub loss_sum: f64,
    /// Unix time of the first pass's start and the last pass's end (seconds).
    pub first_start: f64,
    /// See `first_start`.
    pub last_end: f64,
    /// Time spent computing (waiting for a message is not counted).
    pub busy: Duration,
    /// The most micro-batches held between their forward and backward passes.
    pub peak_in_flight: usize,
    /// The bytes of stage inputs and outputs held at that peak.
    pub peak_activation_bytes: usize,
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn program(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StepError {
    StepError::Program(e.into())
}

fn link<'a>(l: &'a Option<SubGroup>, what: &'static str) -> Result<&'a SubGroup, StepError> {
    l.as_ref()
        .ok_or_else(|| StepError::state("a pipeline step", format!("no {what} link")))
}

fn recv(
    sub: &SubGroup,
    peer: usize,
    shape: &[usize],
    wait: Duration,
    during: &'static str,
) -> Result<Tensor, StepError> {
    let n: usize = shape.iter().product();
    let buf = sub
        .pg()
        .recv(Buffer::zeros(rekindle_runtime::DType::F32, n), peer)
        .wait(wait)
        .map_err(|e| sub.error(during, e))?;
    let v = buf
        .into_vec::<f32>()
        .map_err(|_| StepError::state(during, "not f32"))?;
    Tensor::from_vec(v, shape, &Device::Cpu).map_err(program)
}

/// What one in-flight micro-batch keeps: the stage input (as a variable, to get its
/// gradient) and the output (the scaled loss on the last stage).
struct InFlight {
    input: Option<Var>,
    output: Tensor,
    bytes: usize,
}

/// The step's passes on `stage` of `stages`. `micro` are the micro-batches' ranges within
/// this replica's share of the batch; `batch` is that share (on the first and last stage).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_passes(
    model: &dyn PipelineModel,
    shard: &Shard,
    links: &Links,
    schedule: Schedule,
    stages: usize,
    stage: usize,
    micro: &[Range<usize>],
    batch: Option<&Batch>,
    wait: Duration,
) -> Result<Passes, StepError> {
    let first = stage == 0;
    let last = stage + 1 == stages;
    let mut grads: Vec<Vec<f32>> = shard.specs.iter().map(|s| vec![0.0; s.len()]).collect();
    let mut flight: Vec<Option<InFlight>> = (0..micro.len()).map(|_| None).collect();
    let mut sends: Vec<(Work, &SubGroup, &'static str)> = Vec::new();
    let mut out = Passes {
        grads: Vec::new(),
        loss_sum: 0.0,
        first_start: 0.0,
        last_end: 0.0,
        busy: Duration::ZERO,
        peak_in_flight: 0,
        peak_activation_bytes: 0,
    };
    let (mut live, mut live_bytes) = (0usize, 0usize);
    let batch_part = |r: &Range<usize>| -> Result<&Batch, StepError> {
        batch.ok_or_else(|| {
            StepError::state(
                "a pipeline step",
                format!("no batch for samples {r:?} on stage {stage}"),
            )
        })
    };
    for (i, action) in actions(schedule, stages, stage, micro.len())
        .into_iter()
        .enumerate()
    {
        match action {
            Action::Forward(m) => {
                let r = &micro[m];
                let (input, x) = if first {
                    let x = batch_part(r)?
                        .inputs
                        .narrow(0, r.start, r.len())
                        .map_err(program)?;
                    (None, x)
                } else {
                    let shape = model.output_shape(shard.layers.start - 1, r.len());
                    let t = recv(
                        link(&links.act_in, "previous-stage")?,
                        0,
                        &shape,
                        wait,
                        "receiving activations",
                    )?;
                    let v = Var::from_tensor(&t).map_err(program)?;
                    let x = v.as_tensor().clone();
                    (Some(v), x)
                };
                let t0 = Instant::now();
                if i == 0 {
                    out.first_start = unix_now();
                }
                let h = shard.forward(&x).map_err(program)?;
                let bytes = 4 * (x.elem_count() + h.elem_count());
                let output = if last {
                    let y = batch_part(r)?
                        .targets
                        .narrow(0, r.start, r.len())
                        .map_err(program)?;
                    let loss = model.loss(&h, &y).map_err(StepError::Program)?;
                    let value = loss
                        .to_dtype(DType::F64)
                        .and_then(|l| l.to_scalar::<f64>())
                        .map_err(program)?;
                    out.loss_sum += value * r.len() as f64;
                    // The loss summed over the micro-batch's samples; the update divides by
                    // the global batch.
                    (loss * r.len() as f64).map_err(program)?
                } else {
                    let data = to_f32s(&h).map_err(program)?;
                    let to = link(&links.act_out, "next-stage")?;
                    sends.push((
                        to.pg().send(Buffer::from(data), 1),
                        to,
                        "sending activations",
                    ));
                    h
                };
                out.busy += t0.elapsed();
                out.last_end = unix_now();
                flight[m] = Some(InFlight {
                    input,
                    output,
                    bytes,
                });
                live += 1;
                live_bytes += bytes;
                if live > out.peak_in_flight {
                    out.peak_in_flight = live;
                }
                out.peak_activation_bytes = out.peak_activation_bytes.max(live_bytes);
            }
            Action::Backward(m) => {
                let Some(f) = flight[m].take() else {
                    return Err(StepError::state(
                        "a pipeline step",
                        format!("backward pass of micro-batch {m} before its forward pass"),
                    ));
                };
                let upstream = if last {
                    None
                } else {
                    Some(recv(
                        link(&links.grad_in, "next-stage")?,
                        1,
                        f.output.dims(),
                        wait,
                        "receiving gradients",
                    )?)
                };
                let t0 = Instant::now();
                let store = match upstream {
                    None => f.output.backward(),
                    Some(g) => (&f.output * &g)
                        .and_then(|p| p.sum_all())
                        .and_then(|s| s.backward()),
                }
                .map_err(program)?;
                for (acc, var) in grads.iter_mut().zip(&shard.vars) {
                    if let Some(g) = store.get(var.as_tensor()) {
                        with_f32(g, |g| {
                            for (a, b) in acc.iter_mut().zip(g) {
                                *a += b;
                            }
                        })
                        .map_err(program)?;
                    }
                }
                if let Some(input) = &f.input {
                    let g = match store.get(input.as_tensor()) {
                        Some(g) => to_f32s(g).map_err(program)?,
                        None => vec![0.0; input.elem_count()],
                    };
                    let to = link(&links.grad_out, "previous-stage")?;
                    sends.push((to.pg().send(Buffer::from(g), 0), to, "sending gradients"));
                }
                out.busy += t0.elapsed();
                out.last_end = unix_now();
                live -= 1;
                live_bytes -= f.bytes;
            }
        }
    }
    for (work, sub, during) in sends {
        work.wait(wait).map_err(|e| sub.error(during, e))?;
    }
    out.grads = grads;
    Ok(out)
}
