//! [`ModelParallel`]: the layers of a sequential model on several devices of one process.

use std::ops::Range;

use candle_core::{Device, Module, Tensor};

use super::ParallelError;

/// A layer of a [`ModelParallel`] model.
pub type Layer = Box<dyn Module + Send + Sync>;

/// A sequential model whose layers are split into stages, stage `s` on device `s`: the input
/// moves to the first stage's device, and each stage's output to the next stage's device
/// (candle records the copies, so the backward pass runs through them and every parameter's
/// gradient lands on its own device). The seed's `ToyModel` is `Linear(10, 10)` and `ReLU` on
/// `cuda:0`, then `Linear(10, 5)` on `cuda:1`: three layers split at layer 2.
///
/// ```
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use rekindle_runtime::parallel::{Layer, ModelParallel};
///
/// let varmap = VarMap::new();
/// let devices = vec![Device::Cpu, Device::Cpu]; // cuda:0, cuda:1 on a GPU build
/// let model = ModelParallel::new(devices, &[2], 3, |i, device: &Device| -> candle_core::Result<Layer> {
///     let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
///     Ok(match i {
///         0 => Box::new(candle_nn::linear(10, 10, vb.pp("net1"))?),
///         1 => Box::new(candle_nn::Activation::Relu),
///         _ => Box::new(candle_nn::linear(10, 5, vb.pp("net2"))?),
///     })
/// })
/// .unwrap();
/// let y = model.forward(&Tensor::ones((4, 10), DType::F32, &Device::Cpu).unwrap()).unwrap();
/// assert_eq!(y.dims(), &[4, 5]);
/// ```
pub struct ModelParallel {
    layers: Vec<Layer>,
    devices: Vec<Device>,
    stages: Vec<Range<usize>>,
}

impl std::fmt::Debug for ModelParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelParallel")
            .field("devices", &self.devices)
            .field("stages", &self.stages)
            .finish()
    }
}

/// The layer ranges of the stages that start at 0 and at each of `split_at`.
fn stage_ranges(n_layers: usize, split_at: &[usize]) -> Result<Vec<Range<usize>>, ParallelError> {
    let mut bounds = vec![0];
    for &at in split_at {
        if at <= *bounds.last().unwrap_or(&0) || at >= n_layers {
            return Err(ParallelError::InvalidArgument {
                reason: format!(
                    "split points {split_at:?} must be ascending layer indices in 1..{n_layers}"
                ),
            });
        }
        bounds.push(at);
    }
    bounds.push(n_layers);
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

impl ModelParallel {
    /// A model of `n_layers` layers split into `split_at.len() + 1` stages, stage `s` on
    /// `devices[s]`; stage `s` starts at layer `split_at[s - 1]`. `build(i, device)` creates
    /// layer `i`, with its variables on `device`.
    pub fn new<E: std::fmt::Display>(
        devices: Vec<Device>,
        split_at: &[usize],
        n_layers: usize,
        mut build: impl FnMut(usize, &Device) -> Result<Layer, E>,
    ) -> Result<ModelParallel, ParallelError> {
        if n_layers == 0 {
            return Err(ParallelError::InvalidArgument {
                reason: "a model needs at least one layer".into(),
            });
        }
        let stages = stage_ranges(n_layers, split_at)?;
        if stages.len() != devices.len() {
            return Err(ParallelError::InvalidArgument {
                reason: format!(
                    "{} stage(s) (split at {split_at:?}) but {} device(s)",
                    stages.len(),
                    devices.len()
                ),
            });
        }
        let mut layers = Vec::with_capacity(n_layers);
        for (stage, range) in stages.iter().enumerate() {
            for i in range.clone() {
                let layer = build(i, &devices[stage]).map_err(|e| ParallelError::Build {
                    what: format!("layer {i} on {:?}", devices[stage]),
                    message: e.to_string(),
                })?;
                layers.push(layer);
            }
        }
        Ok(ModelParallel {
            layers,
            devices,
            stages,
        })
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.stages.len()
    }

    /// The layers of stage `s`.
    pub fn stage_layers(&self, s: usize) -> Option<Range<usize>> {
        self.stages.get(s).cloned()
    }

    /// The device of stage `s`.
    pub fn device(&self, s: usize) -> Option<&Device> {
        self.devices.get(s)
    }

    /// The output of the last stage (on its device) for `x`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (range, device) in self.stages.iter().zip(&self.devices) {
            h = h.to_device(device)?;
            for layer in &self.layers[range.clone()] {
                h = layer.forward(&h)?;
            }
        }
        Ok(h)
    }
}

impl Module for ModelParallel {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ModelParallel::forward(self, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_follow_the_split_points() {
        assert_eq!(stage_ranges(3, &[2]).unwrap(), vec![0..2, 2..3]);
        assert_eq!(stage_ranges(3, &[]).unwrap(), vec![0..3]);
        assert_eq!(stage_ranges(5, &[1, 3]).unwrap(), vec![0..1, 1..3, 3..5]);
        for bad in [&[0][..], &[3], &[2, 2], &[2, 1]] {
            assert!(stage_ranges(3, bad).is_err(), "{bad:?}");
        }
    }
}
