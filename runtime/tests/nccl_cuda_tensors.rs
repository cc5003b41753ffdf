//! The NCCL backend on candle CUDA tensors (features `nccl` and `cuda`), run where a GPU is:
//! all-reduce, broadcast and all-gather of device tensors with closed-form results, on one
//! rank and on several ranks as threads (sharing a GPU when NCCL allows it), right after candle
//! kernels that produce the input (ordering through the event on candle's stream), and a few
//! steps of a model trained on `cuda:0` whose gradients are all-reduced on the device.
//!
//! Without a GPU each test prints "not run" and returns; with `REKINDLE_REQUIRE_GPU=1` (set by
//! `scripts/gpu-check.sh`) it fails instead.
#![cfg(all(feature = "nccl", feature = "cuda"))]

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device as CandleDevice, Tensor};
use rekindle_runtime::store::InMemoryStore;
use rekindle_runtime::{cuda_device_count, Device, Error, GroupConfig, NcclBackend, ReduceOp};

const WAIT: Duration = Duration::from_secs(60);

fn not_run<T>(why: impl std::fmt::Display) -> Option<T> {
    assert!(
        std::env::var_os("REKINDLE_REQUIRE_GPU").is_none(),
        "REKINDLE_REQUIRE_GPU is set but {why}"
    );
    eprintln!("not run: {why}");
    None
}

fn gpus() -> Option<usize> {
    let n = cuda_device_count();
    if n == 0 {
        return not_run("no CUDA device or driver");
    }
    match NcclBackend::library_version() {
        Ok(_) => Some(n),
        Err(e) => not_run(e),
    }
}

/// Runs `body(rank, backend, candle device)` on `world` threads; rank r uses GPU `r % gpus`.
fn on_ranks<T: Send + 'static>(
    job: &str,
    world: usize,
    gpus: usize,
    body: impl Fn(usize, Arc<NcclBackend>, CandleDevice) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(InMemoryStore::new());
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, job) = (store.clone(), body.clone(), job.to_string());
            std::thread::spawn(move || {
                let mut cfg = GroupConfig::new(&job, 0, rank, world, store).unwrap();
                cfg.op_timeout = Duration::from_secs(20);
                let ordinal = rank % gpus;
                let nccl = Arc::new(NcclBackend::new(cfg, Device::Cuda(ordinal)).unwrap());
                let dev = CandleDevice::new_cuda(ordinal).unwrap();
                body(rank, nccl, dev)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

#[test]
fn one_rank_tensors_keep_their_values_and_bad_tensors_are_refused() {
    let Some(gpus) = gpus() else {
        return;
    };
    on_ranks("tensor-one", 1, gpus, |_, nccl, dev| {
        for dtype in [
            DType::F32,
            DType::BF16,
            DType::F16,
            DType::F64,
            DType::I64,
            DType::U8,
        ] {
            // Produced by a kernel just before: the op must wait for it on the device.
            let t = Tensor::arange(0u32, 4099, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                nccl.all_reduce_tensor(&t, op).wait(WAIT).unwrap();
            }
            nccl.broadcast_tensor(&t, 0).wait(WAIT).unwrap();
            let (all, work) = nccl.all_gather_tensor(&t).unwrap();
            work.wait(WAIT).unwrap();
            for got in [&t, &all] {
                let got = got.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
                assert_eq!(got, want, "{dtype:?}");
            }
        }
        let cpu = Tensor::zeros(4, DType::F32, &CandleDevice::Cpu).unwrap();
        let err = nccl
            .all_reduce_tensor(&cpu, ReduceOp::Sum)
            .wait(WAIT)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let strided = Tensor::zeros((4, 4), DType::F32, &dev)
            .unwrap()
            .t()
            .unwrap();
        let err = nccl
            .all_reduce_tensor(&strided, ReduceOp::Sum)
            .wait(WAIT)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let t = Tensor::zeros(4, DType::F32, &dev).unwrap();
        let err = nccl.broadcast_tensor(&t, 3).wait(WAIT).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        use rekindle_runtime::Backend;
        assert!(
            nccl.error().is_none(),
            "refused tensors do not break the group"
        );
    });
}

#[test]
fn several_ranks_reduce_broadcast_and_gather_device_tensors() {
    let Some(gpus) = gpus() else {
        return;
    };
    let world = if NcclBackend::several_ranks_per_gpu() {
        4
    } else if gpus >= 2 {
        gpus.min(4)
    } else {
        not_run::<()>(
            "several ranks need 2 GPUs or NCCL 2.30.3+ with NCCL_MULTI_RANK_GPU_ENABLE=1",
        );
        return;
    };
    on_ranks("tensor-multi", world, gpus, move |rank, nccl, dev| {
        let n = 1 << 16;
        let r = rank as f32 + 1.0;
        let t = (Tensor::ones(n, DType::F32, &dev).unwrap() * r as f64).unwrap();
        nccl.all_reduce_tensor(&t, ReduceOp::Sum)
            .wait(WAIT)
            .unwrap();
        let w = world as f32;
        let sum = w * (w + 1.0) / 2.0;
        assert_eq!(t.to_vec1::<f32>().unwrap(), vec![sum; n]);
        let b = (Tensor::ones(7, DType::I64, &dev).unwrap() * rank as f64).unwrap();
        nccl.broadcast_tensor(&b, 1).wait(WAIT).unwrap();
        assert_eq!(b.to_vec1::<i64>().unwrap(), vec![1; 7]);
        let mine = (Tensor::ones(3, DType::BF16, &dev).unwrap() * rank as f64).unwrap();
        let (all, work) = nccl.all_gather_tensor(&mine).unwrap();
        work.wait(WAIT).unwrap();
        let got = all.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let want: Vec<f32> = (0..world).flat_map(|q| [q as f32; 3]).collect();
        assert_eq!(got, want);
    });
}

#[test]
fn training_steps_on_cuda_with_gradients_reduced_on_the_device() {
    let Some(gpus) = gpus() else {
        return;
    };
    // y = 3x - 1 by least squares on two ranks' halves of the data; each rank's gradient is
    // all-reduced (avg) on the device, so both keep identical parameters.
    let world = if NcclBackend::several_ranks_per_gpu() || gpus >= 2 {
        2
    } else {
        1
    };
    let params = on_ranks("tensor-train", world, gpus, move |rank, nccl, dev| {
        let xs: Vec<f32> = (0..64).map(|i| (i * world + rank) as f32 / 64.0).collect();
        let ys: Vec<f32> = xs.iter().map(|x| 3.0 * x - 1.0).collect();
        let x = Tensor::from_vec(xs, 64, &dev).unwrap();
        let y = Tensor::from_vec(ys, 64, &dev).unwrap();
        let w = candle_core::Var::zeros(1, DType::F32, &dev).unwrap();
        let b = candle_core::Var::zeros(1, DType::F32, &dev).unwrap();
        let mut losses = Vec::new();
        for _ in 0..200 {
            let pred = x
                .broadcast_mul(w.as_tensor())
                .unwrap()
                .broadcast_add(b.as_tensor())
                .unwrap();
            let loss = (pred - &y).unwrap().sqr().unwrap().mean_all().unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let grads = loss.backward().unwrap();
            for var in [&w, &b] {
                let g = grads.get(var.as_tensor()).unwrap().contiguous().unwrap();
                nccl.all_reduce_tensor(&g, ReduceOp::Avg)
                    .wait(WAIT)
                    .unwrap();
                var.set(&(var.as_tensor() - (g * 0.5).unwrap()).unwrap())
                    .unwrap();
            }
        }
        assert!(
            losses[199] < losses[0] / 100.0,
            "{} -> {}",
            losses[0],
            losses[199]
        );
        let w = w.as_tensor().to_vec1::<f32>().unwrap()[0];
        let b = b.as_tensor().to_vec1::<f32>().unwrap()[0];
        (w, b)
    });
    for &(w, b) in &params {
        assert!(
            (w - 3.0).abs() < 0.05 && (b + 1.0).abs() < 0.05,
            "w {w}, b {b}"
        );
        assert_eq!((w, b), params[0], "ranks diverged");
    }
}
