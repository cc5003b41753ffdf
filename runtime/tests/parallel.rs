//! Parallelism inside one process: DataParallel over 2 and 3 replicas against one device on the
//! same global batch, run-to-run determinism, uneven splits, and a model-parallel model against
//! the same model unsplit. The "devices" are the CPU, several times.

use candle_core::backprop::GradStore;
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Linear, VarMap};
use rekindle_runtime::parallel::{chunk_sizes, DataParallel, Layer, ModelParallel};

const IN: usize = 16;
const HIDDEN: usize = 32;
const OUT: usize = 4;

/// Deterministic pseudo-random values in [-0.5, 0.5) (candle's own init is not seeded).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn var(varmap: &VarMap, name: &str, shape: &[usize], seed: u64, device: &Device) -> Tensor {
    let n = shape.iter().product();
    let v = Var::from_tensor(&Tensor::from_vec(values(n, seed), shape, device).unwrap()).unwrap();
    let t = v.as_tensor().clone();
    varmap.data().lock().unwrap().insert(name.to_string(), v);
    t
}

fn linear(varmap: &VarMap, name: &str, i: usize, o: usize, seed: u64, device: &Device) -> Linear {
    let w = var(varmap, &format!("{name}.weight"), &[o, i], seed, device);
    let b = var(varmap, &format!("{name}.bias"), &[o], seed + 1, device);
    Linear::new(w, Some(b))
}

/// Two linear layers with a ReLU between them.
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(varmap: &VarMap, device: &Device) -> candle_core::Result<Mlp> {
        Ok(Mlp {
            fc1: linear(varmap, "fc1", IN, HIDDEN, 1, device),
            fc2: linear(varmap, "fc2", HIDDEN, OUT, 3, device),
        })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.fc2.forward(&self.fc1.forward(x)?.relu()?)?;
        (h - y)?.sqr()?.mean_all()
    }
}

fn batch(n: usize, seed: u64) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(values(n * IN, seed), (n, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(values(n * OUT, seed + 7), (n, OUT), &Device::Cpu).unwrap();
    (x, y)
}

fn sorted(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn grads_of(varmap: &VarMap, grads: &GradStore) -> Vec<Vec<f32>> {
    sorted(varmap)
        .iter()
        .map(|(n, v)| {
            flat(
                grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("no grad for {n}")),
            )
        })
        .collect()
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b
        .iter()
        .flatten()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(1e-12);
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

fn sgd(varmap: &VarMap, grads: &GradStore, lr: f64) {
    for (_, v) in sorted(varmap) {
        let g = grads.get(v.as_tensor()).unwrap();
        v.set(&(v.as_tensor() - (g * lr).unwrap()).unwrap())
            .unwrap();
    }
}

fn params(varmap: &VarMap) -> Vec<Vec<f32>> {
    sorted(varmap)
        .iter()
        .map(|(_, v)| flat(v.as_tensor()))
        .collect()
}

/// The tolerance of a data-parallel gradient against one device's: the replicas' means are
/// combined in another order than one mean over the whole batch (relative, of the largest).
const DP_TOLERANCE: f32 = 1e-5;

#[test]
fn chunks_follow_torch() {
    assert_eq!(chunk_sizes(12, 3), vec![4, 4, 4]);
    assert_eq!(chunk_sizes(10, 3), vec![4, 4, 2]);
    assert_eq!(chunk_sizes(5, 4), vec![2, 2, 1, 0]);
    assert_eq!(chunk_sizes(2, 3), vec![1, 1, 0]);
}

#[test]
fn data_parallel_matches_one_device_on_the_same_batch() {
    for (replicas, n) in [(2, 64), (3, 64), (3, 10)] {
        let single_map = VarMap::new();
        let single = Mlp::new(&single_map, &Device::Cpu).unwrap();
        let dp = DataParallel::new(vec![Device::Cpu; replicas], |m: &VarMap, d: &Device| {
            Mlp::new(m, d)
        })
        .unwrap();
        assert_eq!(params(dp.varmap()), params(&single_map), "same start");
        for step in 0..10 {
            let (x, y) = batch(n, 100 + step);
            let one = single.loss(&x, &y).unwrap();
            let one_loss = one.to_scalar::<f32>().unwrap();
            let one_grads = one.backward().unwrap();
            let out = dp.forward_backward(&x, &y, |m, x, y| m.loss(x, y)).unwrap();
            assert_eq!(out.per_replica, chunk_sizes(n, replicas));
            let diff = max_rel_diff(
                &grads_of(dp.varmap(), &out.grads),
                &grads_of(&single_map, &one_grads),
            );
            assert!(
                diff < DP_TOLERANCE,
                "{replicas} replicas, batch {n}, step {step}: gradients differ by {diff}"
            );
            assert!((out.loss - one_loss).abs() <= 1e-5 * one_loss.abs().max(1.0));
            sgd(dp.varmap(), &out.grads, 0.1);
            sgd(&single_map, &one_grads, 0.1);
        }
        let diff = max_rel_diff(&params(dp.varmap()), &params(&single_map));
        assert!(
            diff < 1e-4,
            "{replicas} replicas: parameters differ by {diff} after 10 steps"
        );
    }
}

#[test]
fn data_parallel_is_bit_identical_from_run_to_run() {
    let run = || {
        let dp = DataParallel::new(vec![Device::Cpu; 3], |m: &VarMap, d: &Device| {
            Mlp::new(m, d)
        })
        .unwrap();
        for step in 0..5 {
            let (x, y) = batch(31, step);
            let out = dp.forward_backward(&x, &y, |m, x, y| m.loss(x, y)).unwrap();
            sgd(dp.varmap(), &out.grads, 0.1);
        }
        params(dp.varmap())
            .into_iter()
            .flatten()
            .map(f32::to_bits)
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(), run());
}

#[test]
fn data_parallel_refuses_bad_layouts() {
    let none = DataParallel::new(Vec::new(), |m: &VarMap, d: &Device| Mlp::new(m, d));
    assert!(none.is_err());
    let mut calls = 0;
    let odd = DataParallel::new(vec![Device::Cpu; 2], |m: &VarMap, d: &Device| {
        calls += 1;
        if calls == 2 {
            linear(m, "other", 2, 2, 9, d);
        }
        Mlp::new(m, d)
    });
    let err = odd.unwrap_err().to_string();
    assert!(err.contains("other parameters"), "{err}");
    let dp = DataParallel::new(vec![Device::Cpu; 2], |m: &VarMap, d: &Device| {
        Mlp::new(m, d)
    })
    .unwrap();
    let (x, _) = batch(4, 1);
    let (_, y) = batch(5, 1);
    assert!(dp.forward_backward(&x, &y, |m, x, y| m.loss(x, y)).is_err());
}

/// The seed's ToyModel shape, generalised: Linear, ReLU, Linear, ReLU, Linear.
fn toy(varmap: &VarMap, devices: Vec<Device>, split_at: &[usize]) -> ModelParallel {
    let dims = [IN, HIDDEN, HIDDEN, OUT];
    ModelParallel::new(
        devices,
        split_at,
        5,
        |i, device: &Device| -> candle_core::Result<Layer> {
            Ok(if i % 2 == 1 {
                Box::new(candle_nn::Activation::Relu)
            } else {
                let k = i / 2;
                Box::new(linear(
                    varmap,
                    &format!("net{}", k + 1),
                    dims[k],
                    dims[k + 1],
                    10 + 2 * k as u64,
                    device,
                ))
            })
        },
    )
    .unwrap()
}

#[test]
fn model_parallel_matches_the_same_model_unsplit() {
    let split_map = VarMap::new();
    let split = toy(
        &split_map,
        vec![Device::Cpu, Device::Cpu, Device::Cpu],
        &[2, 4],
    );
    let whole_map = VarMap::new();
    let whole = toy(&whole_map, vec![Device::Cpu], &[]);
    assert_eq!(split.stages(), 3);
    assert_eq!(split.stage_layers(1), Some(2..4));
    for step in 0..5 {
        let (x, y) = batch(16, 50 + step);
        let losses: Vec<(f32, GradStore)> = [&split, &whole]
            .iter()
            .map(|m| {
                let l = (m.forward(&x).unwrap() - &y)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .mean_all()
                    .unwrap();
                (l.to_scalar::<f32>().unwrap(), l.backward().unwrap())
            })
            .collect();
        assert_eq!(
            losses[0].0.to_bits(),
            losses[1].0.to_bits(),
            "step {step}: loss"
        );
        assert_eq!(
            grads_of(&split_map, &losses[0].1),
            grads_of(&whole_map, &losses[1].1),
            "step {step}: gradients"
        );
        sgd(&split_map, &losses[0].1, 0.05);
        sgd(&whole_map, &losses[1].1, 0.05);
    }
    assert_eq!(params(&split_map), params(&whole_map));
}

#[test]
fn model_parallel_refuses_bad_splits() {
    let build = |_: usize, _: &Device| -> candle_core::Result<Layer> {
        Ok(Box::new(candle_nn::Activation::Relu))
    };
    for (devices, split) in [(1, &[1][..]), (2, &[]), (2, &[3]), (3, &[2, 1])] {
        let out = ModelParallel::new(vec![Device::Cpu; devices], split, 3, build);
        assert!(out.is_err(), "{devices} devices, split {split:?}");
    }
}
