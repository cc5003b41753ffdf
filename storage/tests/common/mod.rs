//! Fixtures shared by the storage integration tests.
#![allow(dead_code)]

use rekindle_runtime::Device;
use rekindle_storage::{HostTensor, Layout, Snapshot, TensorDType, TrainingState};

/// A training state with every field set, derived from `step`.
pub fn state(step: u64) -> TrainingState {
    let mut s = TrainingState {
        step,
        epoch: step / 10,
        sample_cursor: step * 256,
        world_size: 1,
        layout: Layout::Replicated,
        ..Default::default()
    };
    s.rng.insert("torch".into(), step.to_le_bytes().to_vec());
    s.user.insert("lr".into(), serde_json::json!(0.5));
    s
}

/// A tensor of `dtype` whose element `i` is `(i + seed) % 251` (exact in every dtype;
/// `bool` takes it modulo 2).
pub fn tensor(dtype: TensorDType, shape: &[usize], seed: usize) -> HostTensor {
    let n: usize = shape.iter().product();
    let v = |i: usize| (i + seed) % 251;
    match dtype {
        TensorDType::F32 => {
            HostTensor::from_slice(shape, &(0..n).map(|i| v(i) as f32).collect::<Vec<_>>())
        }
        TensorDType::F64 => {
            HostTensor::from_slice(shape, &(0..n).map(|i| v(i) as f64).collect::<Vec<_>>())
        }
        TensorDType::F16 => HostTensor::from_slice(
            shape,
            &(0..n)
                .map(|i| half::f16::from_f64(v(i) as f64))
                .collect::<Vec<_>>(),
        ),
        TensorDType::BF16 => HostTensor::from_slice(
            shape,
            &(0..n)
                .map(|i| half::bf16::from_f64(v(i) as f64))
                .collect::<Vec<_>>(),
        ),
        TensorDType::I32 => HostTensor::from_slice(
            shape,
            &(0..n).map(|i| v(i) as i32 - 100).collect::<Vec<_>>(),
        ),
        TensorDType::I64 => HostTensor::from_slice(
            shape,
            &(0..n).map(|i| v(i) as i64 - (1 << 40)).collect::<Vec<_>>(),
        ),
        TensorDType::U8 => {
            HostTensor::from_slice(shape, &(0..n).map(|i| v(i) as u8).collect::<Vec<_>>())
        }
        TensorDType::Bool => {
            HostTensor::from_bools(shape, &(0..n).map(|i| v(i) % 2 == 1).collect::<Vec<_>>())
        }
    }
    .unwrap()
}

/// A snapshot of `step` with one tensor of every dtype in `model` and two f32 moments saved on
/// `cuda:1` in `optimizer`.
pub fn snapshot(step: u64) -> Snapshot {
    let mut s = Snapshot::new(state(step));
    for (i, d) in TensorDType::ALL.into_iter().enumerate() {
        s.insert(
            &format!("w.{}", d.safetensors_name().to_lowercase()),
            tensor(d, &[3, 5], i + step as usize),
        )
        .unwrap();
    }
    for m in ["exp_avg", "exp_avg_sq"] {
        s.insert_in(
            "optimizer",
            &format!("w.f32.{m}"),
            Device::Cuda(1),
            tensor(TensorDType::F32, &[3, 5], 7),
        )
        .unwrap();
    }
    s
}

/// Sets up `tracing` output for a test (once).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
}
