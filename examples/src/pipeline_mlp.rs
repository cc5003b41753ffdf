//! The example MLP ([`crate::mlp`]) as a pipeline model: layer `k` is `fc{k+1}` followed by a
//! ReLU (none after the last), with the same parameter names and initial values as
//! [`Mlp`](crate::mlp::Mlp), so a pipeline run and a single-process run start from the same
//! parameters and their checkpoints hold the same tensor names.
//!
//! For machines with fewer cores than stages, [`Emulated`] adds to every layer a wait that
//! stands in for its compute (forward `f` ms, backward `2f` ms) without taking a core, so the
//! idle time of a schedule can be measured when the stages cannot all compute at once.

use std::time::Duration;

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Module, Shape, Tensor};
use candle_nn::Linear;
use rekindle_elastic::train::strategy::pipeline::PipelineModel;
use rekindle_elastic::train::strategy::BoxError;
use rekindle_runtime::optim::ParamSpec;

use crate::mlp::{linear_init, MlpConfig};

/// The MLP's layers, for [`PipelineStrategy`](rekindle_elastic::train::strategy::PipelineStrategy).
#[derive(Debug, Clone)]
pub struct MlpPipeline {
    dims: Vec<(usize, usize)>,
    seed: u64,
    emulate: Option<Emulated>,
}

impl MlpPipeline {
    /// The layers of an MLP of `config`, initialised from `seed` like [`crate::mlp::Mlp`].
    pub fn new(config: &MlpConfig, seed: u64) -> MlpPipeline {
        MlpPipeline {
            dims: config.layers(),
            seed,
            emulate: None,
        }
    }

    /// Adds an emulated compute time to every layer.
    pub fn with_emulated(mut self, e: Emulated) -> MlpPipeline {
        self.emulate = Some(e);
        self
    }
}

impl PipelineModel for MlpPipeline {
    fn layers(&self) -> usize {
        self.dims.len()
    }

    fn params(&self, layer: usize) -> Vec<ParamSpec> {
        let (i, o) = self.dims[layer];
        vec![
            ParamSpec::new(format!("fc{}.weight", layer + 1), &[o, i]),
            ParamSpec::new(format!("fc{}.bias", layer + 1), &[o]),
        ]
    }

    fn init(&self, layer: usize) -> Result<Vec<Tensor>, BoxError> {
        let (i, o) = self.dims[layer];
        let (w, b) = linear_init(self.seed, layer, i, o);
        let dev = candle_core::Device::Cpu;
        Ok(vec![
            Tensor::from_vec(w, (o, i), &dev)?,
            Tensor::from_vec(b, o, &dev)?,
        ])
    }

    fn layer(&self, layer: usize, params: &[Tensor]) -> Result<Box<dyn Module + Send>, BoxError> {
        let [w, b] = params else {
            return Err(format!("layer {layer} takes 2 parameters, got {}", params.len()).into());
        };
        Ok(Box::new(MlpLayer {
            linear: Linear::new(w.clone(), Some(b.clone())),
            relu: layer + 1 < self.dims.len(),
            emulate: self.emulate,
        }))
    }

    fn output_shape(&self, layer: usize, samples: usize) -> Vec<usize> {
        vec![samples, self.dims[layer].1]
    }

    fn loss(&self, output: &Tensor, targets: &Tensor) -> Result<Tensor, BoxError> {
        Ok(candle_nn::loss::cross_entropy(output, targets)?)
    }
}

struct MlpLayer {
    linear: Linear,
    relu: bool,
    emulate: Option<Emulated>,
}

impl Module for MlpLayer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.linear.forward(x)?;
        if self.relu {
            h = h.relu()?;
        }
        match self.emulate {
            Some(e) => h.apply_op1(e),
            None => Ok(h),
        }
    }
}

/// An identity op that waits `forward_ms` in the forward pass and `2 * forward_ms` in the
/// backward pass: a layer's compute time, emulated without a core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Emulated {
    /// Milliseconds per forward pass (the backward pass waits twice as long).
    pub forward_ms: f64,
}

impl CustomOp1 for Emulated {
    fn name(&self) -> &'static str {
        "emulated-compute"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        std::thread::sleep(Duration::from_secs_f64(self.forward_ms / 1e3));
        let CpuStorage::F32(v) = storage else {
            return Err(candle_core::Error::Msg("emulated compute takes f32".into()));
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg(
                "emulated compute takes a contiguous tensor".into(),
            ));
        };
        Ok((
            CpuStorage::F32(v[start..end].to_vec()),
            layout.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        std::thread::sleep(Duration::from_secs_f64(2.0 * self.forward_ms / 1e3));
        Ok(Some(grad.to_dtype(DType::F32)?))
    }
}
