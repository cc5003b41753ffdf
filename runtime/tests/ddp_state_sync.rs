//! A rank that starts with nothing receives parameters, optimizer state and the sampler
//! cursor from a survivor, and the group continues exactly as if it had been there all along.

mod common;

use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use common::run_ranks;
use rekindle_runtime::ddp::{broadcast_state, Ddp, DdpOptions};
use rekindle_runtime::optim::{AdamW, AdamWConfig, Optimizer};
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler, ElasticState};
use rekindle_runtime::TcpOptions;

const WAIT: Duration = Duration::from_secs(30);

fn varmap(seed: f32) -> VarMap {
    let vm = VarMap::new();
    let mut data = vm.data().lock().unwrap();
    for (name, n) in [("w", 6usize), ("b", 3)] {
        let v: Vec<f32> = (0..n).map(|i| (i as f32 + seed).sin()).collect();
        let t = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
        data.insert(name.to_string(), Var::from_tensor(&t).unwrap());
    }
    drop(data);
    vm
}

/// A loss whose gradient depends on the parameters and on the sample indices.
fn grads(vm: &VarMap, idx: &[usize]) -> candle_core::backprop::GradStore {
    let data = vm.data().lock().unwrap();
    let k: f32 = idx.iter().map(|&i| i as f32 * 0.01).sum::<f32>() / idx.len().max(1) as f32;
    let w = data["w"].as_tensor();
    let b = data["b"].as_tensor();
    let loss = ((w.sqr().unwrap().sum_all().unwrap() * f64::from(k)).unwrap()
        + b.sum_all().unwrap().sqr().unwrap())
    .unwrap();
    loss.backward().unwrap()
}

/// `steps` DDP steps of the elastic sampler's batches.
fn train(
    ddp: &mut Ddp,
    vm: &VarMap,
    opt: &mut dyn Optimizer,
    sampler: &mut ElasticSampler,
    steps: usize,
) {
    let (world, rank) = (ddp.process_group().world_size(), ddp.process_group().rank());
    for _ in 0..steps {
        let step = sampler.plan().unwrap();
        let mine = step.rank_indices(world, rank).unwrap();
        let g = (!mine.is_empty()).then(|| grads(vm, mine));
        ddp.step(g.as_ref(), mine.len(), opt).unwrap();
        sampler.commit(&step).unwrap();
    }
}

#[test]
fn a_fresh_rank_takes_the_state_by_broadcast() {
    let config = ElasticConfig::new(64, 6).seed(4);
    // Uninterrupted: 2 ranks, 7 steps.
    let cfg = config.clone();
    let want = run_ranks("sync-ref", 2, TcpOptions::default(), move |_, pg| {
        let vm = varmap(0.0);
        let mut ddp = Ddp::new(&vm, pg, DdpOptions::default()).unwrap();
        let mut opt = AdamW::new(AdamWConfig::new(0.05), ddp.param_specs()).unwrap();
        let mut sampler = ElasticSampler::new(cfg.clone()).unwrap();
        train(&mut ddp, &vm, &mut opt, &mut sampler, 7);
        ddp.params_fingerprint().unwrap()
    });

    // Rank 1 trains 4 steps, is "replaced" by a process with other parameters, no optimizer
    // state and a fresh sampler, which takes everything from rank 0 and trains 3 more.
    let cfg = config.clone();
    let got = run_ranks("sync-new", 2, TcpOptions::default(), move |rank, pg| {
        let vm = varmap(0.0);
        let mut ddp = Ddp::new(&vm, pg.clone(), DdpOptions::default()).unwrap();
        let mut opt = AdamW::new(AdamWConfig::new(0.05), ddp.param_specs()).unwrap();
        let mut sampler = ElasticSampler::new(cfg.clone()).unwrap();
        train(&mut ddp, &vm, &mut opt, &mut sampler, 4);
        if rank == 1 {
            let fresh = varmap(5.0);
            ddp = Ddp::from_vars(
                fresh.data().lock().unwrap().clone().into_iter().collect(),
                pg.clone(),
                DdpOptions::default(),
            )
            .unwrap();
            opt = AdamW::new(AdamWConfig::new(0.05), ddp.param_specs()).unwrap();
            sampler = ElasticSampler::new(cfg.clone()).unwrap();
            ddp.broadcast_parameters(0).unwrap();
            let state = broadcast_state(&pg, None, 0, WAIT).unwrap();
            opt.load_state(&state).unwrap();
            sampler
                .restore(ElasticState::from_tensors(&state).unwrap())
                .unwrap();
            assert_eq!(sampler.cursor(), 24);
            train(&mut ddp, &fresh, &mut opt, &mut sampler, 3);
        } else {
            // Rank 0 takes part in the new rank's Ddp::new (layout check, broadcast) too.
            ddp.set_process_group(pg.clone());
            let layout = Ddp::from_vars(
                vm.data().lock().unwrap().clone().into_iter().collect(),
                pg.clone(),
                DdpOptions::default(),
            )
            .unwrap();
            drop(layout);
            ddp.broadcast_parameters(0).unwrap();
            let mut state = opt.state().unwrap();
            state.extend(sampler.state().to_tensors().unwrap());
            broadcast_state(&pg, Some(state), 0, WAIT).unwrap();
            train(&mut ddp, &vm, &mut opt, &mut sampler, 3);
        }
        ddp.check_parameters().unwrap();
        ddp.params_fingerprint().unwrap()
    });
    assert_eq!(got, want);
}
