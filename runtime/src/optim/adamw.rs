//! AdamW (decoupled weight decay), as torch's `AdamW`.

use candle_core::Tensor;

use super::state::{moment_tensor, read_step, require_moment, step_tensor};
use super::{
    check_hyper, check_specs, check_update, moment_name, OptimResult, Optimizer, ParamSpec,
};

/// Hyperparameters of [`AdamW`], with torch's meaning and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// torch's defaults with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        AdamWConfig {
            lr,
            ..Self::default()
        }
    }

    /// Sets the betas.
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    /// Sets epsilon.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    fn validate(&self) -> OptimResult<()> {
        check_hyper("lr", self.lr, self.lr >= 0.0)?;
        check_hyper("beta1", self.beta1, (0.0..1.0).contains(&self.beta1))?;
        check_hyper("beta2", self.beta2, (0.0..1.0).contains(&self.beta2))?;
        check_hyper("eps", self.eps, self.eps >= 0.0)?;
        check_hyper("weight_decay", self.weight_decay, self.weight_decay >= 0.0)
    }
}

/// AdamW as torch computes it (`amsgrad=False`), with step count `t` after `begin_step`; the
/// scalars in f64, the elements in f32:
///
/// ```text
/// p = p * (1 - lr * weight_decay)
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g * g
/// p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// State: [`super::STEP_NAME`], `optim.<param>.exp_avg` (m) and `optim.<param>.exp_avg_sq`
/// (v) for every parameter (zeros before the first step).
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    params: Vec<ParamSpec>,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    step: u64,
}

const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";

impl AdamW {
    /// An optimizer over `params` (unique names). Fails on out-of-range hyperparameters.
    pub fn new(config: AdamWConfig, params: Vec<ParamSpec>) -> OptimResult<Self> {
        config.validate()?;
        check_specs(&params)?;
        let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        Ok(AdamW {
            config,
            exp_avg: zeros.clone(),
            exp_avg_sq: zeros,
            params,
            step: 0,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }
}

impl Optimizer for AdamW {
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
        let t = self.step.max(1) as f64;
        let bc1 = 1.0 - c.beta1.powf(t);
        let bc2_sqrt = (1.0 - c.beta2.powf(t)).sqrt();
        let decay = (1.0 - c.lr * c.weight_decay) as f32;
        let step_size = (c.lr / bc1) as f32;
        let bc2_sqrt = bc2_sqrt as f32;
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        let (k1, k2) = ((1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32);
        let eps = c.eps as f32;
        let m = &mut self.exp_avg[index];
        let v = &mut self.exp_avg_sq[index];
        for (((p, &g), m), v) in param
            .iter_mut()
            .zip(grad)
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            *p *= decay;
            let g = g * scale;
            *m = b1 * *m + k1 * g;
            *v = b2 * *v + k2 * g * g;
            *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
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
        for (i, spec) in self.params.iter().enumerate() {
            out.push(moment_tensor(
                moment_name(&spec.name, EXP_AVG),
                spec,
                &self.exp_avg[i],
            )?);
            out.push(moment_tensor(
                moment_name(&spec.name, EXP_AVG_SQ),
                spec,
                &self.exp_avg_sq[i],
            )?);
        }
        Ok(out)
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> OptimResult<()> {
        let step = read_step(state)?;
        let mut m = Vec::with_capacity(self.params.len());
        let mut v = Vec::with_capacity(self.params.len());
        for spec in &self.params {
            m.push(require_moment(
                state,
                &moment_name(&spec.name, EXP_AVG),
                spec,
            )?);
            v.push(require_moment(
                state,
                &moment_name(&spec.name, EXP_AVG_SQ),
                spec,
            )?);
        }
        self.step = step;
        self.exp_avg = m;
        self.exp_avg_sq = v;
        Ok(())
    }
}
