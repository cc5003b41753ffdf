//! Stochastic gradient descent with momentum, weight decay and Nesterov, as torch's `SGD`.

use candle_core::Tensor;

use super::state::{moment_tensor, read_moment, read_step, step_tensor};
use super::{
    check_hyper, check_specs, check_update, moment_name, OptimResult, Optimizer, ParamSpec,
};

/// Hyperparameters of [`Sgd`], with torch's meaning.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the momentum buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`g + weight_decay * p`).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Sets the momentum.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    pub fn dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Sets the weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets Nesterov momentum.
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    fn validate(&self) -> OptimResult<()> {
        check_hyper("lr", self.lr, self.lr >= 0.0)?;
        check_hyper("momentum", self.momentum, self.momentum >= 0.0)?;
        check_hyper("dampening", self.dampening, true)?;
        check_hyper("weight_decay", self.weight_decay, self.weight_decay >= 0.0)?;
        let nesterov_ok = !self.nesterov || (self.momentum > 0.0 && self.dampening == 0.0);
        check_hyper(
            "momentum (nesterov needs momentum > 0, dampening 0)",
            self.momentum,
            nesterov_ok,
        )
    }
}

/// SGD as torch computes it, per element in f32:
///
/// ```text
/// g = grad + weight_decay * p
/// buf = g                                   (first step)
/// buf = momentum * buf + (1 - dampening) * g (later steps)
/// g = g + momentum * buf   if nesterov,   g = buf   otherwise (when momentum > 0)
/// p = p - lr * g
/// ```
///
/// State: [`super::STEP_NAME`] and `optim.<param>.momentum_buffer` for every parameter that
/// has one (after its first update with momentum).
#[derive(Debug, Clone)]
pub struct Sgd {
    config: SgdConfig,
    params: Vec<ParamSpec>,
    buffers: Vec<Option<Vec<f32>>>,
    step: u64,
}

const MOMENTUM: &str = "momentum_buffer";

impl Sgd {
    /// An optimizer over `params` (unique names). Fails on out-of-range hyperparameters.
    pub fn new(config: SgdConfig, params: Vec<ParamSpec>) -> OptimResult<Self> {
        config.validate()?;
        check_specs(&params)?;
        Ok(Sgd {
            config,
            buffers: vec![None; params.len()],
            params,
            step: 0,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }
}

impl Optimizer for Sgd {
    fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn begin_step(&mut self) {
        self.step += 1;
    }

    fn update_scaled(
        &mut self,
        index: usize,
        param: &mut [f32],
        grad: &[f32],
        scale: f32,
    ) -> OptimResult<()> {
        check_update(&self.params, index, param, grad)?;
        let c = self.config;
        let lr = c.lr as f32;
        let wd = c.weight_decay as f32;
        let mom = c.momentum as f32;
        let keep = (1.0 - c.dampening) as f32;
        if c.momentum == 0.0 {
            for (p, &g) in param.iter_mut().zip(grad) {
                let g = g * scale;
                let g = if wd != 0.0 { g + wd * *p } else { g };
                *p -= lr * g;
            }
            return Ok(());
        }
        let slot = &mut self.buffers[index];
        let first = slot.is_none();
        let buf = slot.get_or_insert_with(|| vec![0.0; grad.len()]);
        for ((p, &g), b) in param.iter_mut().zip(grad).zip(buf.iter_mut()) {
            let g = g * scale;
            let g = if wd != 0.0 { g + wd * *p } else { g };
            *b = if first { g } else { mom * *b + keep * g };
            let d = if c.nesterov { g + mom * *b } else { *b };
            *p -= lr * d;
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state(&self) -> OptimResult<Vec<(String, Tensor)>> {
        let mut out = vec![step_tensor(self.step)?];
        for (spec, buf) in self.params.iter().zip(&self.buffers) {
            if let Some(buf) = buf {
                out.push(moment_tensor(moment_name(&spec.name, MOMENTUM), spec, buf)?);
            }
        }
        Ok(out)
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> OptimResult<()> {
        let step = read_step(state)?;
        let buffers = self
            .params
            .iter()
            .map(|spec| read_moment(state, &moment_name(&spec.name, MOMENTUM), spec))
            .collect::<OptimResult<Vec<_>>>()?;
        self.step = step;
        self.buffers = buffers;
        Ok(())
    }
}
