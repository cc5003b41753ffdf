//! Optimizers whose whole state is named tensors, so it can be checkpointed and broadcast to
//! a replacement rank.
//!
//! An optimizer knows its parameters by name and shape ([`ParamSpec`]) and updates flat `f32`
//! slices in place: a step is [`Optimizer::begin_step`] followed by one
//! [`Optimizer::update`] per parameter, in any order, which lets data-parallel training update
//! each gradient bucket as soon as its all-reduce finishes. [`Optimizer::state`] exports the
//! step count and every moment as named tensors (`optim.step`, `optim.<param>.<moment>`);
//! [`Optimizer::load_state`] imports them, after which training continues bit-identically.
//!
//! ```
//! use rekindle_runtime::optim::{Optimizer, ParamSpec, Sgd, SgdConfig};
//!
//! let specs = vec![ParamSpec::new("w", &[2])];
//! let mut opt = Sgd::new(SgdConfig::new(0.5), specs).unwrap();
//! let mut w = vec![1.0f32, 2.0];
//! opt.step(&mut [&mut w[..]], &[&[2.0, -2.0][..]]).unwrap();
//! assert_eq!(w, vec![0.0, 3.0]);
//! ```

mod adamw;
mod sgd;
mod state;
pub(crate) mod tensor_io;
mod vars;

pub use adamw::{AdamW, AdamWConfig};
pub use sgd::{Sgd, SgdConfig};
pub use tensor_io::{update_f32, with_f32};
pub use vars::{specs_of, step_vars};

use candle_core::Tensor;

/// The name of the step-count tensor in an optimizer's state.
pub const STEP_NAME: &str = "optim.step";

/// The name of moment `moment` of parameter `param` in an optimizer's state.
pub fn moment_name(param: &str, moment: &str) -> String {
    format!("optim.{param}.{moment}")
}

/// A parameter as an optimizer sees it: its name and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// The parameter's name (a `VarMap` key).
    pub name: String,
    /// The parameter's shape.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// A spec from a name and a shape.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the parameter has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why an optimizer call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// A hyperparameter is out of range.
    #[error("invalid optimizer configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// Two parameters have the same name.
    #[error("parameter {name:?} is listed twice")]
    DuplicateParam {
        /// The name.
        name: String,
    },
    /// `update` was called with an index past the parameter list.
    #[error("no parameter with index {index} (the optimizer has {count})")]
    UnknownParam {
        /// The index given.
        index: usize,
        /// The number of parameters.
        count: usize,
    },
    /// A parameter or gradient slice has the wrong length.
    #[error("parameter {name:?}: param has {param} elements and grad {grad}, expected {expected}")]
    LengthMismatch {
        /// The parameter.
        name: String,
        /// Elements of the parameter slice given.
        param: usize,
        /// Elements of the gradient slice given.
        grad: usize,
        /// Elements of the parameter.
        expected: usize,
    },
    /// Reading a gradient or writing a parameter tensor failed.
    #[error("tensor operation on {name:?} failed: {message}")]
    Tensor {
        /// The parameter.
        name: String,
        /// candle's message.
        message: String,
    },
    /// An imported state tensor is missing or does not fit.
    #[error("optimizer state {name:?}: {reason}")]
    State {
        /// The tensor name.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

/// The result of optimizer calls.
pub type OptimResult<T> = std::result::Result<T, OptimError>;

/// An optimizer over named flat `f32` parameters. See the [module docs](self).
pub trait Optimizer: Send {
    /// The parameters, in the order `update` indexes them.
    fn params(&self) -> &[ParamSpec];

    /// Steps started so far (torch's `step` state).
    fn step_count(&self) -> u64;

    /// Starts a step: the step count grows by one, and this step's updates use the new count.
    fn begin_step(&mut self);

    /// Updates parameter `index` in place from its gradient, for the step begun last. Each
    /// parameter is updated at most once per step.
    fn update(&mut self, index: usize, param: &mut [f32], grad: &[f32]) -> OptimResult<()> {
        self.update_scaled(index, param, grad, 1.0)
    }

    /// [`update`](Self::update) with the gradient `grad * scale` (element by element, in f32),
    /// which saves data-parallel training a pass over the gradients to average them. A scale
    /// of 1 gives exactly `update`'s result.
    fn update_scaled(
        &mut self,
        index: usize,
        param: &mut [f32],
        grad: &[f32],
        scale: f32,
    ) -> OptimResult<()>;

    /// The learning rate.
    fn lr(&self) -> f64;

    /// Sets the learning rate (for schedules; not part of the state).
    fn set_lr(&mut self, lr: f64);

    /// The state as named tensors on the CPU: [`STEP_NAME`] (an i64 scalar) and each moment
    /// (f32, the parameter's shape) under [`moment_name`].
    fn state(&self) -> OptimResult<Vec<(String, Tensor)>>;

    /// Replaces the state with tensors exported by [`state`](Self::state) of an optimizer of
    /// the same kind over the same parameters. Fails, leaving the state unchanged, if a
    /// required tensor is missing or has the wrong dtype or shape; other names are ignored.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> OptimResult<()>;

    /// One whole step: `begin_step`, then `update` of every parameter, in order.
    fn step(&mut self, params: &mut [&mut [f32]], grads: &[&[f32]]) -> OptimResult<()> {
        let count = self.params().len();
        if params.len() != count || grads.len() != count {
            return Err(OptimError::InvalidConfig {
                reason: format!(
                    "step got {} params and {} grads for {count} parameters",
                    params.len(),
                    grads.len()
                ),
            });
        }
        self.begin_step();
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            self.update(i, p, g)?;
        }
        Ok(())
    }
}

/// Checks an `update` call's index and lengths; returns the parameter's spec.
fn check_update<'a>(
    params: &'a [ParamSpec],
    index: usize,
    param: &[f32],
    grad: &[f32],
) -> OptimResult<&'a ParamSpec> {
    let spec = params.get(index).ok_or(OptimError::UnknownParam {
        index,
        count: params.len(),
    })?;
    if param.len() != spec.len() || grad.len() != spec.len() {
        return Err(OptimError::LengthMismatch {
            name: spec.name.clone(),
            param: param.len(),
            grad: grad.len(),
            expected: spec.len(),
        });
    }
    Ok(spec)
}

fn check_specs(params: &[ParamSpec]) -> OptimResult<()> {
    let mut names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(OptimError::DuplicateParam {
            name: w[0].to_string(),
        });
    }
    Ok(())
}

fn check_hyper(name: &str, value: f64, ok: bool) -> OptimResult<()> {
    if !ok || !value.is_finite() {
        return Err(OptimError::InvalidConfig {
            reason: format!("{name} = {value} is out of range"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(len: usize) -> Vec<ParamSpec> {
        vec![ParamSpec::new("w", &[len])]
    }

    fn run(opt: &mut dyn Optimizer, p: &mut [f32], grads: &[f32]) -> Vec<f32> {
        grads
            .iter()
            .map(|&g| {
                let grad = vec![g; p.len()];
                opt.step(&mut [&mut *p], &[&grad[..]]).unwrap();
                p[0]
            })
            .collect()
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                ((*g as f64) - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn sgd_closed_form() {
        // (config, p0, grads, p after each step)
        let table: Vec<(SgdConfig, f32, Vec<f32>, Vec<f64>)> = vec![
            (SgdConfig::new(0.1), 1.0, vec![0.5, 0.5], vec![0.95, 0.9]),
            // buf_t = 1 + 0.9 buf_{t-1}: 1, 1.9, 2.71
            (
                SgdConfig::new(0.1).momentum(0.9),
                0.0,
                vec![1.0; 3],
                vec![-0.1, -0.29, -0.561],
            ),
            // d_t = 1 + 0.9 buf_t: 1.9, 2.71
            (
                SgdConfig::new(0.1).momentum(0.9).nesterov(true),
                0.0,
                vec![1.0; 2],
                vec![-0.19, -0.461],
            ),
            // first step takes g undamped, then buf = 0.9 buf + 0.5 g: 1, 1.4
            (
                SgdConfig::new(1.0).momentum(0.9).dampening(0.5),
                0.0,
                vec![1.0; 2],
                vec![-1.0, -2.4],
            ),
            // p_t = (1 - lr wd)^t with a zero gradient
            (
                SgdConfig::new(0.5).weight_decay(0.1),
                1.0,
                vec![0.0; 3],
                vec![0.95, 0.9025, 0.857375],
            ),
        ];
        for (cfg, p0, grads, want) in table {
            let mut opt = Sgd::new(cfg, one(3)).unwrap();
            let mut p = vec![p0; 3];
            close(&run(&mut opt, &mut p, &grads), &want);
            assert!(p.iter().all(|&x| x == p[0]));
            assert_eq!(opt.step_count(), grads.len() as u64);
        }
    }

    /// torch's AdamW recurrence in f64.
    fn adamw_reference(c: AdamWConfig, p0: f64, grads: &[f64]) -> Vec<f64> {
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        let mut out = Vec::new();
        for (i, &g) in grads.iter().enumerate() {
            let t = i as f64 + 1.0;
            p *= 1.0 - c.lr * c.weight_decay;
            m = c.beta1 * m + (1.0 - c.beta1) * g;
            v = c.beta2 * v + (1.0 - c.beta2) * g * g;
            let denom = v.sqrt() / (1.0 - c.beta2.powf(t)).sqrt() + c.eps;
            p -= c.lr / (1.0 - c.beta1.powf(t)) * m / denom;
            out.push(p);
        }
        out
    }

    #[test]
    fn adamw_closed_form() {
        // A constant gradient without decay moves by lr * g / (|g| + eps) per step.
        let c = AdamWConfig::new(0.1).weight_decay(0.0);
        let mut opt = AdamW::new(c, one(2)).unwrap();
        let mut p = vec![1.0f32; 2];
        let step = 0.1 * 2.0 / (2.0 + 1e-8);
        close(
            &run(&mut opt, &mut p, &[2.0; 3]),
            &[1.0 - step, 1.0 - 2.0 * step, 1.0 - 3.0 * step],
        );
        // Varying gradients, weight decay, non-default betas.
        let c = AdamWConfig::new(0.01)
            .betas(0.8, 0.99)
            .weight_decay(0.1)
            .eps(1e-6);
        let grads = [1.0, -2.0, 0.5, 0.0, 3.0];
        let mut opt = AdamW::new(c, one(1)).unwrap();
        let mut p = vec![0.5f32];
        let got = run(&mut opt, &mut p, &grads.map(|g| g as f32));
        close(&got, &adamw_reference(c, 0.5, &grads));
    }

    fn grads_at(step: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((step * 31 + i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect()
    }

    fn resume_is_bit_identical(make: &dyn Fn() -> Box<dyn Optimizer>) {
        let len = 5;
        let specs = make().params().to_vec();
        let train =
            |opt: &mut dyn Optimizer, ps: &mut [Vec<f32>], steps: std::ops::Range<usize>| {
                for s in steps {
                    let gs: Vec<Vec<f32>> = (0..ps.len()).map(|k| grads_at(s + k, len)).collect();
                    let mut pr: Vec<&mut [f32]> = ps.iter_mut().map(|p| &mut p[..]).collect();
                    let gr: Vec<&[f32]> = gs.iter().map(|g| &g[..]).collect();
                    opt.step(&mut pr, &gr).unwrap();
                }
            };
        let init = || vec![vec![0.25f32; len]; specs.len()];
        let mut a = make();
        let mut pa = init();
        train(a.as_mut(), &mut pa, 0..10);

        let mut b = make();
        let mut pb = init();
        train(b.as_mut(), &mut pb, 0..4);
        let state = b.state().unwrap();
        drop(b);
        let mut c = make();
        c.load_state(&state).unwrap();
        assert_eq!(c.step_count(), 4);
        train(c.as_mut(), &mut pb, 4..10);
        let bits =
            |p: &[Vec<f32>]| -> Vec<u32> { p.iter().flatten().map(|x| x.to_bits()).collect() };
        assert_eq!(bits(&pa), bits(&pb));
        assert_eq!(a.state().unwrap().len(), c.state().unwrap().len());
    }

    fn two() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("a.weight", &[5]),
            ParamSpec::new("b.bias", &[5]),
        ]
    }

    #[test]
    fn export_import_continue_is_bit_identical() {
        resume_is_bit_identical(&|| {
            Box::new(Sgd::new(SgdConfig::new(0.1).momentum(0.9).weight_decay(0.01), two()).unwrap())
        });
        resume_is_bit_identical(&|| {
            Box::new(Sgd::new(SgdConfig::new(0.1).momentum(0.9).nesterov(true), two()).unwrap())
        });
        resume_is_bit_identical(&|| Box::new(AdamW::new(AdamWConfig::new(0.01), two()).unwrap()));
    }

    #[test]
    fn state_names_and_shapes() {
        let specs = vec![ParamSpec::new("fc.weight", &[2, 3])];
        let mut opt = AdamW::new(AdamWConfig::default(), specs.clone()).unwrap();
        opt.step(&mut [&mut [0.0; 6][..]], &[&[1.0; 6][..]])
            .unwrap();
        let state = opt.state().unwrap();
        let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "optim.step",
                "optim.fc.weight.exp_avg",
                "optim.fc.weight.exp_avg_sq"
            ]
        );
        assert_eq!(state[1].1.dims(), &[2, 3]);

        // A wrong shape or a missing moment is refused and leaves the state alone.
        let mut other = AdamW::new(
            AdamWConfig::default(),
            vec![ParamSpec::new("fc.weight", &[6])],
        )
        .unwrap();
        assert!(matches!(
            other.load_state(&state),
            Err(OptimError::State { .. })
        ));
        assert_eq!(other.step_count(), 0);
        assert!(opt.load_state(&state[..2]).is_err());
        assert!(opt.load_state(&state[1..]).is_err());

        // SGD without momentum has only the step count; with momentum, after a step, a buffer.
        let mut sgd = Sgd::new(SgdConfig::new(0.1), specs.clone()).unwrap();
        assert_eq!(sgd.state().unwrap().len(), 1);
        sgd.load_state(&state).unwrap();
        assert_eq!(sgd.step_count(), 1);
        let mut sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.5), specs).unwrap();
        sgd.step(&mut [&mut [0.0; 6][..]], &[&[1.0; 6][..]])
            .unwrap();
        assert_eq!(sgd.state().unwrap()[1].0, "optim.fc.weight.momentum_buffer");
    }

    #[test]
    fn scaled_update_is_the_update_of_the_scaled_gradient() {
        let makes: [fn() -> Box<dyn Optimizer>; 2] = [
            || {
                Box::new(
                    Sgd::new(SgdConfig::new(0.1).momentum(0.9).weight_decay(0.1), one(4)).unwrap(),
                )
            },
            || Box::new(AdamW::new(AdamWConfig::new(0.01), one(4)).unwrap()),
        ];
        for make in makes {
            let (mut a, mut b) = (make(), make());
            let (mut pa, mut pb) = (vec![0.5f32; 4], vec![0.5f32; 4]);
            for s in 0..3 {
                let g = grads_at(s, 4);
                let scaled: Vec<f32> = g.iter().map(|x| x * 0.25).collect();
                a.begin_step();
                a.update_scaled(0, &mut pa, &g, 0.25).unwrap();
                b.begin_step();
                b.update(0, &mut pb, &scaled).unwrap();
            }
            assert_eq!(pa, pb);
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(Sgd::new(SgdConfig::new(-1.0), one(1)).is_err());
        assert!(Sgd::new(SgdConfig::new(0.1).nesterov(true), one(1)).is_err());
        assert!(AdamW::new(AdamWConfig::default().betas(1.0, 0.9), one(1)).is_err());
        assert!(AdamW::new(AdamWConfig::new(f64::NAN), one(1)).is_err());
        let dup = vec![ParamSpec::new("w", &[1]), ParamSpec::new("w", &[2])];
        assert_eq!(
            Sgd::new(SgdConfig::new(0.1), dup).unwrap_err(),
            OptimError::DuplicateParam { name: "w".into() }
        );
        let mut opt = Sgd::new(SgdConfig::new(0.1), one(2)).unwrap();
        opt.begin_step();
        assert!(matches!(
            opt.update(0, &mut [0.0; 3], &[0.0; 2]),
            Err(OptimError::LengthMismatch { .. })
        ));
        assert!(matches!(
            opt.update(1, &mut [0.0; 2], &[0.0; 2]),
            Err(OptimError::UnknownParam { index: 1, count: 1 })
        ));
        assert!(opt.step(&mut [], &[]).is_err());
    }
}
