//! DDP over real TCP groups (ranks as threads) against single-process training on the full
//! batch: the same parameters to fp tolerance, bit-identical across ranks, whatever the split.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, VarMap};
use common::run_ranks;
use rekindle_runtime::ddp::{Ddp, DdpError, DdpOptions, StepMode};
use rekindle_runtime::optim::{AdamW, AdamWConfig, Optimizer, ParamSpec, Sgd, SgdConfig};
use rekindle_runtime::{segment, TcpOptions};

const IN: usize = 5;
const HIDDEN: usize = 8;
const OUT: usize = 3;

/// A two-layer ReLU network whose variables live in a VarMap.
struct Net {
    a: Linear,
    b: Linear,
}

impl Net {
    /// Parameters are a closed-form function of `seed`, so every "process" can build them.
    fn new(varmap: &VarMap, seed: f32) -> Net {
        let mut data = varmap.data().lock().unwrap();
        let mut make = |name: &str, shape: &[usize], k: f32| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i as f32 + k) * 0.731 + seed).sin() * 0.4)
                .collect();
            let var = Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap();
            let t = var.as_tensor().clone();
            data.insert(name.to_string(), var);
            t
        };
        let a = Linear::new(
            make("a.weight", &[HIDDEN, IN], 0.0),
            Some(make("a.bias", &[HIDDEN], 1.0)),
        );
        let b = Linear::new(
            make("b.weight", &[OUT, HIDDEN], 2.0),
            Some(make("b.bias", &[OUT], 3.0)),
        );
        Net { a, b }
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let h = self.a.forward(x).unwrap().relu().unwrap();
        candle_nn::loss::cross_entropy(&self.b.forward(&h).unwrap(), y).unwrap()
    }
}

/// Samples `idx` of a fixed dataset.
fn batch(idx: &[usize]) -> (Tensor, Tensor) {
    let x: Vec<f32> = idx
        .iter()
        .flat_map(|&i| (0..IN).map(move |j| ((i * IN + j) as f32 * 0.37).cos()))
        .collect();
    let y: Vec<u32> = idx.iter().map(|&i| (i % OUT) as u32).collect();
    (
        Tensor::from_vec(x, (idx.len(), IN), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, idx.len(), &Device::Cpu).unwrap(),
    )
}

/// The global batch of step `s`.
fn step_indices(s: usize, global: usize) -> Vec<usize> {
    (0..global).map(|j| (s * global + j) * 7 % 101).collect()
}

fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap.data().lock().unwrap().clone().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn values(varmap: &VarMap) -> Vec<Vec<f32>> {
    sorted_vars(varmap)
        .iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Opt {
    Sgd,
    AdamW,
}

fn make_opt(kind: Opt, specs: Vec<ParamSpec>) -> Box<dyn Optimizer> {
    match kind {
        Opt::Sgd => {
            Box::new(Sgd::new(SgdConfig::new(0.2).momentum(0.9).weight_decay(0.01), specs).unwrap())
        }
        Opt::AdamW => Box::new(AdamW::new(AdamWConfig::new(0.01), specs).unwrap()),
    }
}

/// Single-process training on the full global batch, with the same optimizer code.
fn reference(kind: Opt, steps: usize, global: usize) -> Vec<Vec<f32>> {
    let varmap = VarMap::new();
    let net = Net::new(&varmap, 0.0);
    let vars = sorted_vars(&varmap);
    let specs = vars
        .iter()
        .map(|(n, v)| ParamSpec::new(n, v.dims()))
        .collect();
    let mut opt = make_opt(kind, specs);
    for s in 0..steps {
        let (x, y) = batch(&step_indices(s, global));
        let grads = net.loss(&x, &y).backward().unwrap();
        let mut ps: Vec<Vec<f32>> = values(&varmap);
        let gs: Vec<Vec<f32>> = vars
            .iter()
            .map(|(_, v)| {
                grads
                    .get(v.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        let mut pr: Vec<&mut [f32]> = ps.iter_mut().map(|p| &mut p[..]).collect();
        let gr: Vec<&[f32]> = gs.iter().map(|g| &g[..]).collect();
        opt.step(&mut pr, &gr).unwrap();
        for ((_, v), p) in vars.iter().zip(ps) {
            v.set(&Tensor::from_vec(p, v.dims(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    values(&varmap)
}

struct RankResult {
    params: Vec<Vec<f32>>,
    fingerprint: u64,
}

/// DDP training: rank `r` of `world` holds its segment of each global batch. Rank 0's
/// parameters are the reference's initial ones; other ranks start from other values, which
/// the initial broadcast must overwrite.
fn ddp_run(
    world: usize,
    kind: Opt,
    steps: usize,
    global: usize,
    options: DdpOptions,
) -> Vec<RankResult> {
    let options = Arc::new(options);
    run_ranks("ddp-ref", world, TcpOptions::default(), move |rank, pg| {
        let varmap = VarMap::new();
        let net = Net::new(&varmap, rank as f32 * 10.0);
        let mut ddp = Ddp::new(&varmap, pg, (*options).clone()).unwrap();
        let mut opt = make_opt(kind, ddp.param_specs());
        for s in 0..steps {
            let all = step_indices(s, global);
            let mine = &all[segment(global, world, rank)];
            let grads = (!mine.is_empty()).then(|| {
                let (x, y) = batch(mine);
                net.loss(&x, &y).backward().unwrap()
            });
            let report = ddp.step(grads.as_ref(), mine.len(), opt.as_mut()).unwrap();
            assert_eq!(report.global_samples, global as u64);
        }
        let fingerprint = ddp.check_parameters().unwrap();
        RankResult {
            params: values(&varmap),
            fingerprint,
        }
    })
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) {
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{g} vs {w}");
    }
}

fn assert_ranks_identical(results: &[RankResult]) {
    let bits = |p: &[Vec<f32>]| -> Vec<u32> { p.iter().flatten().map(|x| x.to_bits()).collect() };
    for r in &results[1..] {
        assert_eq!(bits(&r.params), bits(&results[0].params));
        assert_eq!(r.fingerprint, results[0].fingerprint);
    }
}

fn small_buckets() -> DdpOptions {
    // 40 bytes first, then 100: several buckets for this tiny model.
    DdpOptions {
        first_bucket_mb: 40.0 / (1 << 20) as f64,
        bucket_cap_mb: 100.0 / (1 << 20) as f64,
        ..DdpOptions::default()
    }
}

#[test]
fn world_one_matches_the_reference() {
    let want = reference(Opt::Sgd, 6, 12);
    let got = ddp_run(1, Opt::Sgd, 6, 12, DdpOptions::default());
    assert_close(&got[0].params, &want, 1e-5);
}

#[test]
fn uneven_splits_match_the_full_batch() {
    // (world, global batch, optimizer): 10 over 3 is 4 + 3 + 3; 2 over 3 leaves rank 2 empty.
    let table = [
        (2, 12, Opt::Sgd),
        (3, 10, Opt::Sgd),
        (3, 2, Opt::Sgd),
        (3, 10, Opt::AdamW),
    ];
    for (world, global, kind) in table {
        let want = reference(kind, 5, global);
        for options in [DdpOptions::default(), small_buckets()] {
            let got = ddp_run(world, kind, 5, global, options);
            assert_close(&got[0].params, &want, 1e-5);
            assert_ranks_identical(&got);
        }
    }
}

#[test]
fn overlapped_mode_gives_the_same_bits() {
    let atomic = ddp_run(2, Opt::AdamW, 4, 9, small_buckets());
    let overlapped = ddp_run(
        2,
        Opt::AdamW,
        4,
        9,
        DdpOptions {
            mode: StepMode::Overlapped,
            ..small_buckets()
        },
    );
    assert_eq!(atomic[0].fingerprint, overlapped[0].fingerprint);
    assert_eq!(atomic[0].params, overlapped[0].params);
}

#[test]
fn no_sync_accumulates_micro_batches() {
    // Two micro-batches per step (the second uneven), accumulated, then one synchronised
    // step: the full batch's update.
    let global = 11;
    let want = reference(Opt::Sgd, 3, global);
    let got = run_ranks("ddp-nosync", 2, TcpOptions::default(), move |rank, pg| {
        let varmap = VarMap::new();
        let net = Net::new(&varmap, 0.0);
        let mut ddp = Ddp::new(&varmap, pg, small_buckets()).unwrap();
        let mut opt = make_opt(Opt::Sgd, ddp.param_specs());
        for s in 0..3 {
            let all = step_indices(s, global);
            let mine = &all[segment(global, 2, rank)];
            let (first, second) = mine.split_at(2);
            let (x, y) = batch(first);
            ddp.no_sync(&net.loss(&x, &y).backward().unwrap(), first.len())
                .unwrap();
            let (x, y) = batch(second);
            let grads = net.loss(&x, &y).backward().unwrap();
            let r = ddp.step(Some(&grads), second.len(), opt.as_mut()).unwrap();
            assert_eq!((r.global_samples, r.local_samples), (11, mine.len() as u64));
        }
        RankResult {
            fingerprint: ddp.check_parameters().unwrap(),
            params: values(&varmap),
        }
    });
    assert_close(&got[0].params, &want, 1e-5);
    assert_ranks_identical(&got);
}

#[test]
fn divergence_and_layout_mismatch_are_detected() {
    let out = run_ranks("ddp-diverge", 2, TcpOptions::default(), |rank, pg| {
        let varmap = VarMap::new();
        let _net = Net::new(&varmap, 0.0);
        let ddp = Ddp::new(&varmap, pg, DdpOptions::default()).unwrap();
        let before = ddp.check_parameters();
        if rank == 1 {
            let v = &ddp.vars()[0];
            v.set(&(v.as_tensor() + 1e-3).unwrap()).unwrap();
        }
        (before.is_ok(), ddp.check_parameters())
    });
    for (before_ok, after) in out {
        assert!(before_ok);
        assert!(
            matches!(after, Err(DdpError::ParamsDiverged { .. })),
            "{after:?}"
        );
    }

    let out = run_ranks("ddp-layout", 2, TcpOptions::default(), |rank, pg| {
        let varmap = VarMap::new();
        let _net = Net::new(&varmap, 0.0);
        if rank == 1 {
            let extra = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
            varmap.data().lock().unwrap().insert("c.bias".into(), extra);
        }
        Ddp::new(&varmap, pg, DdpOptions::default()).err()
    });
    for e in out {
        assert!(matches!(e, Some(DdpError::LayoutMismatch { .. })), "{e:?}");
    }
}

#[test]
fn a_lost_peer_fails_the_step_and_leaves_the_state_alone() {
    // Both ranks finish the first step before rank 1 goes: aborting as soon as its own
    // share arrived could reset the connection under data rank 0 has not read yet.
    let first_done = Arc::new(std::sync::Barrier::new(2));
    let out = run_ranks("ddp-lost", 2, TcpOptions::default(), move |rank, pg| {
        let varmap = VarMap::new();
        let net = Net::new(&varmap, 0.0);
        let mut ddp = Ddp::new(&varmap, pg.clone(), small_buckets()).unwrap();
        let mut opt = make_opt(Opt::AdamW, ddp.param_specs());
        let (x, y) = batch(&[1, 2, 3]);
        let grads = net.loss(&x, &y).backward().unwrap();
        ddp.step(Some(&grads), 3, opt.as_mut()).unwrap();
        first_done.wait();
        if rank == 1 {
            // This rank is gone before the second step.
            pg.abort();
            return None;
        }
        let before = (
            ddp.params_fingerprint().unwrap(),
            opt.state().unwrap().len(),
            opt.step_count(),
        );
        let err = ddp.step(Some(&grads), 3, opt.as_mut()).unwrap_err();
        let after = (
            ddp.params_fingerprint().unwrap(),
            opt.state().unwrap().len(),
            opt.step_count(),
        );
        Some((err, before == after))
    });
    let (err, unchanged) = out.into_iter().next().unwrap().unwrap();
    assert!(matches!(err, DdpError::Collective { rank: 0, .. }), "{err}");
    assert!(unchanged, "an atomic step that failed changed the state");
}

#[test]
fn an_optimizer_over_other_parameters_is_refused() {
    let out = run_ranks("ddp-badopt", 1, TcpOptions::default(), |_, pg| {
        let varmap = VarMap::new();
        let _net = Net::new(&varmap, 0.0);
        let mut ddp = Ddp::new(&varmap, pg, DdpOptions::default()).unwrap();
        let mut opt = make_opt(Opt::Sgd, vec![ParamSpec::new("a.weight", &[HIDDEN, IN])]);
        ddp.step(None, 0, opt.as_mut()).err()
    });
    assert!(matches!(out[0], Some(DdpError::InvalidArgument { .. })));
}
