//! The example model and data: an MLP classifier (784-1024-1024-10 by default) initialised from
//! a seeded generator, and a generated, learnable dataset labelled by a fixed random teacher
//! network, produced lazily per index so a dataset of any length costs no memory.
//!
//! Everything is a pure function of its seed: every process of a job builds the same initial
//! parameters and the same sample `i`, whatever the batch it falls in.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, VarMap};
use rand::RngCore;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// A generator keyed by `seed` on stream `stream`: sample `i` and parameter `k` each get
/// their own stream, so they do not depend on one another.
fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut r = ChaCha8Rng::from_seed(key);
    r.set_stream(stream);
    r
}

/// A uniform f32 in `[0, 1)` from the top 24 bits of one output.
fn unit(r: &mut ChaCha8Rng) -> f32 {
    (r.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// `n` uniform values in `[-bound, bound)`.
fn uniform(r: &mut ChaCha8Rng, n: usize, bound: f32) -> Vec<f32> {
    (0..n).map(|_| (unit(r) * 2.0 - 1.0) * bound).collect()
}

/// `n` standard normal values (Box-Muller, in f64, rounded to f32).
fn normals(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = ((r.next_u64() >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
        let u2 = (r.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = 2.0 * std::f64::consts::PI * u2;
        out.push((radius * angle.cos()) as f32);
        out.push((radius * angle.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// The layer sizes of an [`Mlp`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpConfig {
    /// Input features.
    pub input: usize,
    /// Hidden layer widths.
    pub hidden: Vec<usize>,
    /// Output classes.
    pub classes: usize,
}

impl Default for MlpConfig {
    /// 784-1024-1024-10.
    fn default() -> Self {
        MlpConfig {
            input: 784,
            hidden: vec![1024, 1024],
            classes: 10,
        }
    }
}

impl MlpConfig {
    /// Parses `784-1024-1024-10` (at least input and output).
    pub fn parse(s: &str) -> Result<Self> {
        let sizes = s
            .split('-')
            .map(|p| p.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .with_context(|| format!("layer sizes {s:?} must be numbers joined by '-'"))?;
        if sizes.len() < 2 || sizes.contains(&0) {
            bail!("layer sizes {s:?}: need at least an input and an output size, none 0");
        }
        Ok(MlpConfig {
            input: sizes[0],
            hidden: sizes[1..sizes.len() - 1].to_vec(),
            classes: sizes[sizes.len() - 1],
        })
    }

    /// Every layer's (inputs, outputs).
    pub fn layers(&self) -> Vec<(usize, usize)> {
        let mut dims = vec![self.input];
        dims.extend(&self.hidden);
        dims.push(self.classes);
        dims.windows(2).map(|w| (w[0], w[1])).collect()
    }

    /// The number of parameters.
    pub fn param_count(&self) -> usize {
        self.layers().iter().map(|(i, o)| i * o + o).sum()
    }
}

/// The initial weight (`outputs x inputs`, row-major) and bias of layer `k` (0-based) of an
/// [`Mlp`] seeded with `seed`: uniform in `+-1/sqrt(inputs)` like torch's `nn.Linear`, from
/// streams `2k` and `2k + 1` of the seed's generator.
pub fn linear_init(seed: u64, k: usize, inputs: usize, outputs: usize) -> (Vec<f32>, Vec<f32>) {
    let bound = 1.0 / (inputs as f32).sqrt();
    (
        uniform(&mut rng(seed, 2 * k as u64), outputs * inputs, bound),
        uniform(&mut rng(seed, 2 * k as u64 + 1), outputs, bound),
    )
}

/// Layer `k` (0-based) of an [`Mlp`]: the variables `fc{k+1}.weight` (outputs x inputs) and
/// `fc{k+1}.bias` in `varmap` (which must not hold them yet), on `device`, initialised like
/// torch's `nn.Linear` (uniform in `+-1/sqrt(inputs)`) from a ChaCha8 generator keyed by `seed`,
/// one stream per parameter ([`linear_init`]). A model split over devices builds each layer on
/// its own device and still has exactly the parameters of the unsplit [`Mlp`].
pub fn seeded_linear(
    varmap: &VarMap,
    k: usize,
    inputs: usize,
    outputs: usize,
    seed: u64,
    device: &Device,
) -> Result<Linear> {
    let mut data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?;
    let (w, b) = linear_init(seed, k, inputs, outputs);
    let mut make = |name: String, shape: &[usize], values: Vec<f32>| -> Result<Tensor> {
        if data.contains_key(&name) {
            bail!("the VarMap already holds {name:?}");
        }
        let var = Var::from_tensor(&Tensor::from_vec(values, shape, device)?)?;
        let t = var.as_tensor().clone();
        data.insert(name, var);
        Ok(t)
    };
    let w = make(format!("fc{}.weight", k + 1), &[outputs, inputs], w)?;
    let b = make(format!("fc{}.bias", k + 1), &[outputs], b)?;
    Ok(Linear::new(w, Some(b)))
}

/// A ReLU MLP whose layers are `fc1`, `fc2`, ... with parameters `fcK.weight` (outputs x
/// inputs) and `fcK.bias`, stored as variables of a [`VarMap`].
#[derive(Debug, Clone)]
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// Creates the variables in `varmap` (which must not hold them yet), initialised like
    /// torch's `nn.Linear` (weights and biases uniform in `+-1/sqrt(inputs)`) from a ChaCha8
    /// generator keyed by `seed`, one stream per parameter.
    pub fn new(config: &MlpConfig, varmap: &VarMap, seed: u64, device: &Device) -> Result<Self> {
        let layers = config
            .layers()
            .into_iter()
            .enumerate()
            .map(|(k, (inputs, outputs))| seeded_linear(varmap, k, inputs, outputs, seed, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp { layers })
    }

    /// The logits for a batch `[n, input]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    /// The mean cross-entropy of the batch.
    pub fn loss(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::loss::cross_entropy(&self.forward(x)?, labels)?)
    }
}

/// A labelled batch.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Inputs `[n, input]`, f32.
    pub x: Tensor,
    /// Labels `[n]`, u32.
    pub y: Tensor,
}

/// `len` samples: inputs are standard normal vectors (sample `i` from stream `i` of the
/// seed's generator), labels the argmax of a fixed random teacher `input-32-classes` tanh
/// network (from the same seed's generator at streams past the end of the samples). A student
/// MLP can learn it, so the loss falls from about `ln(classes)`.
#[derive(Debug, Clone)]
pub struct TeacherDataset {
    len: usize,
    seed: u64,
    input: usize,
    classes: usize,
    /// `[TEACHER_HIDDEN, input]`, row-major.
    w1: Vec<f32>,
    b1: Vec<f32>,
    /// `[classes, TEACHER_HIDDEN]`, row-major.
    w2: Vec<f32>,
    b2: Vec<f32>,
}

const TEACHER_HIDDEN: usize = 32;

/// A dot product with a fixed summation order (8 lanes, then the lanes in order), so it is
/// vectorised and gives the same bits everywhere.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    acc.iter().fold(s, |t, v| t + v)
}

impl TeacherDataset {
    /// A dataset of `len` samples of `input` features and `classes` classes.
    pub fn new(len: usize, input: usize, classes: usize, seed: u64) -> Result<Self> {
        if input == 0 || classes < 2 {
            bail!("a teacher dataset needs at least 1 input and 2 classes");
        }
        let base = len as u64;
        let b1 = (input as f32).sqrt().recip() * 3.0;
        let b2 = (TEACHER_HIDDEN as f32).sqrt().recip() * 3.0;
        Ok(TeacherDataset {
            len,
            seed,
            input,
            classes,
            w1: uniform(&mut rng(seed, base), TEACHER_HIDDEN * input, b1),
            b1: uniform(&mut rng(seed, base + 1), TEACHER_HIDDEN, 0.5),
            w2: uniform(&mut rng(seed, base + 2), classes * TEACHER_HIDDEN, b2),
            b2: uniform(&mut rng(seed, base + 3), classes, 0.1),
        })
    }

    /// The number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the dataset is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Input features per sample.
    pub fn input(&self) -> usize {
        self.input
    }

    /// Sample `i`'s inputs and label.
    pub fn sample(&self, i: usize) -> Result<(Vec<f32>, u32)> {
        if i >= self.len {
            bail!("sample {i} is out of range for a dataset of {}", self.len);
        }
        let x = normals(&mut rng(self.seed, i as u64), self.input);
        let hidden: Vec<f32> = (0..TEACHER_HIDDEN)
            .map(|h| (dot(&self.w1[h * self.input..(h + 1) * self.input], &x) + self.b1[h]).tanh())
            .collect();
        let mut best = (0u32, f32::NEG_INFINITY);
        for c in 0..self.classes {
            let z = dot(
                &self.w2[c * TEACHER_HIDDEN..(c + 1) * TEACHER_HIDDEN],
                &hidden,
            ) + self.b2[c];
            if z > best.1 {
                best = (c as u32, z);
            }
        }
        Ok((x, best.0))
    }

    /// The samples at `indices`, as tensors on `device`.
    pub fn batch(&self, indices: &[usize], device: &Device) -> Result<Batch> {
        let mut xs = Vec::with_capacity(indices.len() * self.input);
        let mut ys = Vec::with_capacity(indices.len());
        for &i in indices {
            let (x, y) = self.sample(i)?;
            xs.extend(x);
            ys.push(y);
        }
        Ok(Batch {
            x: Tensor::from_vec(xs, (indices.len(), self.input), device)?,
            y: Tensor::from_vec(ys, indices.len(), device)?,
        })
    }
}

/// The sha256 (lower-case hex) of the parameters' bytes: every variable in name order, its
/// elements as little-endian f32.
pub fn params_sha256(varmap: &VarMap) -> Result<String> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?;
    let sorted: std::collections::BTreeMap<&String, &Var> = data.iter().collect();
    let mut h = Sha256::new();
    for var in sorted.values() {
        let v = var
            .as_tensor()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for x in v {
            h.update(x.to_le_bytes());
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The variables of `varmap` by name (a copy of the map, sharing the variables).
pub fn named_vars(varmap: &VarMap) -> Result<HashMap<String, Var>> {
    Ok(varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?
        .clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_seeded_and_named() {
        let cfg = MlpConfig::parse("6-5-3").unwrap();
        assert_eq!(cfg.param_count(), 6 * 5 + 5 + 5 * 3 + 3);
        let a = VarMap::new();
        let b = VarMap::new();
        Mlp::new(&cfg, &a, 1, &Device::Cpu).unwrap();
        Mlp::new(&cfg, &b, 1, &Device::Cpu).unwrap();
        let c = VarMap::new();
        Mlp::new(&cfg, &c, 2, &Device::Cpu).unwrap();
        assert_eq!(params_sha256(&a).unwrap(), params_sha256(&b).unwrap());
        assert_ne!(params_sha256(&a).unwrap(), params_sha256(&c).unwrap());
        let mut names: Vec<String> = named_vars(&a).unwrap().into_keys().collect();
        names.sort();
        assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);
        let w = named_vars(&a).unwrap()["fc1.weight"].as_tensor().clone();
        assert_eq!(w.dims(), &[5, 6]);
        let max = w
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(max <= 1.0 / 6f32.sqrt());
        assert!(Mlp::new(&cfg, &a, 1, &Device::Cpu).is_err(), "names taken");
        assert!(MlpConfig::parse("784").is_err());
        assert!(MlpConfig::parse("784-x-10").is_err());
        assert_eq!(
            MlpConfig::parse("784-1024-1024-10").unwrap(),
            MlpConfig::default()
        );
    }

    #[test]
    fn samples_are_pure_functions_of_the_index() {
        let d = TeacherDataset::new(1000, 20, 4, 9).unwrap();
        assert_eq!(d.sample(17).unwrap(), d.sample(17).unwrap());
        assert_ne!(d.sample(17).unwrap().0, d.sample(18).unwrap().0);
        assert!(d.sample(1000).is_err());
        let b = d.batch(&[3, 17], &Device::Cpu).unwrap();
        assert_eq!(b.x.dims(), &[2, 20]);
        let row: Vec<f32> = b.x.get(1).unwrap().to_vec1().unwrap();
        assert_eq!(row, d.sample(17).unwrap().0);
        // Roughly standard normal inputs, and every class used.
        let xs: Vec<f32> = (0..200).flat_map(|i| d.sample(i).unwrap().0).collect();
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / xs.len() as f32;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
        let mut seen = [0; 4];
        for i in 0..1000 {
            seen[d.sample(i).unwrap().1 as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 20), "{seen:?}");
    }

    #[test]
    fn the_loss_falls() {
        let cfg = MlpConfig::parse("32-64-4").unwrap();
        let d = TeacherDataset::new(4096, 32, 4, 3).unwrap();
        let varmap = VarMap::new();
        let model = Mlp::new(&cfg, &varmap, 3, &Device::Cpu).unwrap();
        let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.1).unwrap();
        use candle_nn::Optimizer;
        let mut losses = Vec::new();
        for step in 0..120 {
            let idx: Vec<usize> = (0..64).map(|j| (step * 64 + j) % d.len()).collect();
            let b = d.batch(&idx, &Device::Cpu).unwrap();
            let loss = model.loss(&b.x, &b.y).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            opt.backward_step(&loss).unwrap();
        }
        let first: f32 = losses[..10].iter().sum::<f32>() / 10.0;
        let last: f32 = losses[110..].iter().sum::<f32>() / 10.0;
        assert!(last < 0.7 * first, "loss {first} -> {last}");
    }
}
