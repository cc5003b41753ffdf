//! Save and load: every dtype, the manifest's training state, zero-copy views, map-location,
//! newest-valid fallback, retention, async saves, candle VarMaps.

mod common;

use std::time::Duration;

use candle_core::{DType, Device as CDevice, Tensor};
use candle_nn::VarMap;
use common::{snapshot, state, tensor};
use rekindle_runtime::Device;
use rekindle_storage::{
    load_varmap, AsyncCheckpointer, Checkpoint, CheckpointDir, LoadOptions, MapLocation,
    RetentionPolicy, Snapshot, StorageError, TensorDType, Verify,
};

#[test]
fn every_dtype_round_trips_with_state() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let snap = snapshot(5);
    let info = dir.save(&snap).unwrap();
    assert_eq!(info.path, root.path().join("step-5"));
    assert!(info.path.join("model.safetensors").is_file());
    assert!(info.path.join("optimizer.safetensors").is_file());
    assert!(info.path.join("manifest.json").is_file());

    let ckpt = dir.load_step(5, &LoadOptions::default()).unwrap();
    assert_eq!(ckpt.state(), &state(5));
    assert_eq!(ckpt.names().len(), snap.len());
    for e in snap.entries() {
        let t = ckpt.tensor(&e.name).unwrap();
        assert_eq!(t.dtype(), e.tensor.dtype(), "{}", e.name);
        assert_eq!(t.shape(), e.tensor.shape());
        assert_eq!(t.bytes(), e.tensor.as_bytes(), "{}", e.name);
        assert_eq!(t.to_host().unwrap(), e.tensor);
    }
    let m = ckpt.manifest();
    assert_eq!(m.tensors["w.f32.exp_avg"].device, "cuda:1");
    assert_eq!(m.files.len(), 2);
    assert_eq!(
        ckpt.tensor("w.i64").unwrap().as_slice::<i64>().unwrap()[0],
        5 + 1 - 100 - (1 << 40) + 100
    );
    assert!(matches!(
        dir.save(&snap),
        Err(StorageError::AlreadyExists { .. })
    ));
}

#[test]
fn cpu_loads_borrow_the_mapping() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let mut snap = Snapshot::new(state(1));
    snap.insert("big", tensor(TensorDType::F32, &[1024, 256], 0))
        .unwrap();
    snap.insert("small", tensor(TensorDType::U8, &[3], 0))
        .unwrap();
    snap.insert("half", tensor(TensorDType::BF16, &[7], 0))
        .unwrap();
    dir.save(&snap).unwrap();
    let ckpt = dir
        .load_latest(&LoadOptions::default().verify(Verify::Structure))
        .unwrap();
    let a = ckpt.tensor("big").unwrap();
    let b = ckpt.tensor("big").unwrap();
    // The same bytes twice: a view of the mapping, not a copy per call.
    assert_eq!(a.bytes().as_ptr(), b.bytes().as_ptr());
    let file_len = std::fs::metadata(root.path().join("step-1/model.safetensors"))
        .unwrap()
        .len();
    let base = a.bytes().as_ptr() as usize - (file_len as usize - 1024 * 256 * 4 - 7 * 2 - 3);
    assert_eq!(
        base % 4096,
        0,
        "tensor bytes lie in a page-aligned mapping of the file"
    );
    for name in ["big", "half", "small"] {
        let t = ckpt.tensor(name).unwrap();
        assert_eq!(
            t.bytes().as_ptr() as usize % t.dtype().size_in_bytes(),
            0,
            "{name}"
        );
    }
    assert_eq!(a.as_slice::<f32>().unwrap()[1000], (1000 % 251) as f32);
    let rows = a.narrow_rows(10, 2).unwrap();
    assert_eq!(rows.shape(), &[2, 256]);
    assert_eq!(rows.as_slice::<f32>().unwrap()[0], (2560 % 251) as f32);
    assert!(a.narrow_rows(1023, 2).is_err());
}

#[test]
fn map_location_applies_per_tensor() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    dir.save(&snapshot(2)).unwrap();
    let table: MapLocation = "cuda:1 -> cpu".parse().unwrap();
    let ckpt = dir
        .load_latest(&LoadOptions::default().map_location(table))
        .unwrap();
    assert_eq!(ckpt.tensor("w.f32.exp_avg").unwrap().device(), Device::Cpu);
    let f = MapLocation::from_fn(|_, saved| if saved.is_cuda() { Device::Cpu } else { saved });
    let ckpt = dir
        .load_latest(&LoadOptions::default().map_location(f))
        .unwrap();
    assert_eq!(
        ckpt.tensor("w.f32.exp_avg_sq").unwrap().device(),
        Device::Cpu
    );
    assert_eq!(ckpt.tensor("w.f32").unwrap().device(), Device::Cpu);
    // Keeping tensors on their saved device (cuda:1) needs CUDA support.
    let keep: MapLocation = "cpu -> cpu".parse().unwrap();
    let err = dir
        .load_latest(&LoadOptions::default().map_location(keep))
        .unwrap_err();
    if cfg!(feature = "cuda") {
        return;
    }
    match err {
        StorageError::CudaNotCompiled {
            tensor,
            device,
            feature,
            path,
        } => {
            assert_eq!(feature, "cuda");
            assert_eq!(device, Device::Cuda(1));
            assert!(tensor.ends_with("exp_avg") || tensor.ends_with("exp_avg_sq"));
            assert!(path.ends_with("step-2"));
        }
        e => panic!("expected CudaNotCompiled, got {e}"),
    }
    let err = dir
        .load_latest(&LoadOptions::default().map_location(MapLocation::Device(Device::Cuda(0))))
        .unwrap_err();
    assert!(err.to_string().contains("`cuda` feature"), "{err}");
}

#[test]
fn newest_corrupt_checkpoint_falls_back_to_previous() {
    common::init_tracing();
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    dir.save(&snapshot(1)).unwrap();
    dir.save(&snapshot(2)).unwrap();
    let f = root.path().join("step-2/model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    let ckpt = dir.load_latest(&LoadOptions::default()).unwrap();
    assert_eq!(ckpt.step(), 1);
    // A given step is loaded or fails; it never falls back.
    assert!(matches!(
        dir.load_step(2, &LoadOptions::default()),
        Err(StorageError::ChecksumMismatch { .. })
    ));
    assert!(matches!(
        dir.load_step(3, &LoadOptions::default()),
        Err(StorageError::StepNotFound { step: 3, .. })
    ));
    // Per-tensor verification catches the flipped tensor only when it is read.
    let lazy = dir
        .load_step(2, &LoadOptions::default().verify(Verify::PerTensor))
        .unwrap();
    assert!(lazy.tensor("w.f64").is_ok());
    let bad: Vec<_> = lazy
        .names()
        .into_iter()
        .filter(|n| lazy.tensor(n).is_err())
        .collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    std::fs::remove_file(root.path().join("step-1/manifest.json")).unwrap();
    assert!(matches!(
        dir.load_latest(&LoadOptions::default()),
        Err(StorageError::NoValidCheckpoint { skipped: 1, .. })
    ));
}

#[test]
fn retention_keeps_last_k_and_every_mth() {
    let root = tempfile::tempdir().unwrap();
    let policy = RetentionPolicy::last(2).unwrap().and_every(4).unwrap();
    let dir = CheckpointDir::new(root.path())
        .unwrap()
        .with_retention(policy);
    for step in 1..=9 {
        dir.save(&snapshot(step)).unwrap();
    }
    assert_eq!(dir.committed_steps().unwrap(), vec![4, 8, 9]);
    // Corrupt the two newest: pruning keeps the newest valid one (4) besides the last two.
    let plain = CheckpointDir::new(root.path()).unwrap();
    for s in [8, 9] {
        std::fs::write(
            root.path().join(format!("step-{s}/model.safetensors")),
            b"junk",
        )
        .unwrap();
    }
    assert_eq!(
        plain.prune(&RetentionPolicy::last(1).unwrap()).unwrap(),
        vec![8]
    );
    assert_eq!(plain.committed_steps().unwrap(), vec![4, 9]);
    assert_eq!(
        plain.load_latest(&LoadOptions::default()).unwrap().step(),
        4
    );
}

#[test]
fn async_saves_one_at_a_time_and_flush() {
    let root = tempfile::tempdir().unwrap();
    let saver = AsyncCheckpointer::new(CheckpointDir::new(root.path()).unwrap());
    let mut live = snapshot(1);
    saver.save(&live).unwrap();
    for step in 2..=4 {
        live.state = state(step);
        saver.save(&live).unwrap();
    }
    let last = saver.flush(Duration::from_secs(60)).unwrap().unwrap();
    assert_eq!(last.step, 4);
    assert!(!saver.in_flight());
    assert_eq!(saver.flush(Duration::from_secs(1)).unwrap(), None);
    let dir = saver.dir();
    assert_eq!(dir.committed_steps().unwrap(), vec![1, 2, 3, 4]);
    for step in 1..=4 {
        let c = dir.load_step(step, &LoadOptions::default()).unwrap();
        assert_eq!(c.state(), &state(step));
        assert_eq!(
            c.tensor("w.u8").unwrap().bytes(),
            live.get("w.u8").unwrap().tensor.as_bytes()
        );
    }
    // A failed background save is reported by the next call.
    live.state = state(4);
    saver.save(&live).unwrap();
    let err = saver.flush(Duration::from_secs(60)).unwrap_err();
    assert!(
        matches!(&err, StorageError::AsyncSaveFailed { step: 4, source } if matches!(**source, StorageError::AlreadyExists { .. })),
        "{err}"
    );
}

#[test]
fn async_saves_of_large_tensors_hold_the_state_of_their_call() {
    // Tensors above the streaming-copy threshold, of odd lengths, each save from the same live
    // state changed between calls: every checkpoint must hold the bytes of its own call, not
    // those of a later change to the live state or of the reused snapshot buffers.
    let root = tempfile::tempdir().unwrap();
    let saver = AsyncCheckpointer::new(CheckpointDir::new(root.path()).unwrap());
    let fill = |step: u64, n: usize| -> Vec<u8> {
        (0..n)
            .map(|i| ((i as u64 * 7 + step * 13) % 251) as u8)
            .collect()
    };
    let sizes = [(3 << 20) + 13, (1 << 20) + 4095, 999];
    let mut live = Snapshot::new(state(1));
    for (k, n) in sizes.iter().enumerate() {
        let t = rekindle_storage::HostTensor::from_bytes(TensorDType::U8, &[*n], &fill(1, *n));
        live.insert(&format!("t{k}"), t.unwrap()).unwrap();
    }
    for step in 1..=3u64 {
        live.state = state(step);
        for (k, n) in sizes.iter().enumerate() {
            let t = live.tensor_mut(&format!("t{k}")).unwrap();
            t.as_bytes_mut().copy_from_slice(&fill(step, *n));
        }
        saver.save(&live).unwrap();
        // Change the live state at once, while the save is being written.
        for k in 0..sizes.len() {
            live.tensor_mut(&format!("t{k}"))
                .unwrap()
                .as_bytes_mut()
                .fill(0xEE);
        }
    }
    saver.flush(Duration::from_secs(60)).unwrap();
    for step in 1..=3u64 {
        let c = saver
            .dir()
            .load_step(step, &LoadOptions::default())
            .unwrap();
        for (k, n) in sizes.iter().enumerate() {
            let t = c.tensor(&format!("t{k}")).unwrap();
            assert!(
                t.bytes() == fill(step, *n).as_slice(),
                "step {step} tensor t{k}"
            );
        }
    }
}

#[test]
fn varmap_round_trips_through_candle() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let vm = VarMap::new();
    let init = candle_nn::Init::Const(0.0);
    let w = vm
        .get((4, 3), "layer.weight", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    let b = vm
        .get(4, "layer.bias", init, DType::F64, &CDevice::Cpu)
        .unwrap();
    let wv: Vec<f32> = (0..12).map(|i| i as f32 * 0.25).collect();
    vm.data().lock().unwrap()["layer.weight"]
        .set(&Tensor::from_slice(&wv, (4, 3), &CDevice::Cpu).unwrap())
        .unwrap();
    vm.data().lock().unwrap()["layer.bias"]
        .set(&Tensor::new(&[1.0f64, -2.0, 3.0, -4.0], &CDevice::Cpu).unwrap())
        .unwrap();
    let moment = (w.clone() * 2.0).unwrap();
    let mut snap = Snapshot::new(state(3));
    snap.insert_varmap("model", &vm).unwrap();
    snap.insert_candle("optimizer", "layer.weight.exp_avg", &moment)
        .unwrap();
    drop((w, b));
    dir.save(&snap).unwrap();

    let fresh = VarMap::new();
    fresh
        .get((4, 3), "layer.weight", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    fresh
        .get(4, "layer.bias", init, DType::F64, &CDevice::Cpu)
        .unwrap();
    let ckpt = dir.load_latest(&LoadOptions::default()).unwrap();
    let report = load_varmap(&ckpt, &fresh).unwrap();
    assert_eq!(report.loaded, vec!["layer.bias", "layer.weight"]);
    assert_eq!(report.unused, vec!["layer.weight.exp_avg"]);
    let data = fresh.data().lock().unwrap();
    assert_eq!(
        data["layer.weight"]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        wv
    );
    assert_eq!(
        data["layer.bias"].to_vec1::<f64>().unwrap(),
        vec![1.0, -2.0, 3.0, -4.0]
    );
    let m = ckpt
        .tensor("layer.weight.exp_avg")
        .unwrap()
        .to_candle()
        .unwrap();
    assert_eq!(m.flatten_all().unwrap().to_vec1::<f32>().unwrap()[5], 2.5);
    drop(data);
    let wrong = VarMap::new();
    wrong
        .get((3, 4), "layer.weight", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    let err = load_varmap(&ckpt, &wrong).unwrap_err();
    assert!(
        matches!(err, StorageError::TensorMismatch { ref name, .. } if name == "layer.weight"),
        "{err}"
    );
    let missing = VarMap::new();
    missing
        .get(2, "other", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    assert!(matches!(
        load_varmap(&ckpt, &missing),
        Err(StorageError::TensorNotFound { .. })
    ));
    let _ = Checkpoint::open(ckpt.path(), &LoadOptions::default()).unwrap();
}
