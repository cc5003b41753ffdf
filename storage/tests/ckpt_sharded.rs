//! Sharded saves over a real store (ranks as threads, InMemoryStore and FileStore), and
//! resharding on load: S pipeline stages into S' stages or one process, replicated into sharded.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{state, tensor};
use rekindle_runtime::store::{FileStore, InMemoryStore, Store};
use rekindle_runtime::Device;
use rekindle_storage::{
    CheckpointDir, Layout, LoadOptions, ShardCoordinator, Snapshot, StorageError, TensorDType,
    Verify,
};

const LAYERS: usize = 6;

/// Layer `l`'s weight: 4x3 f32 with values from l.
fn layer(l: usize) -> rekindle_storage::HostTensor {
    tensor(TensorDType::F32, &[4, 3], 10 * l)
}

/// Stage `s` of `stages` owns layers `s * LAYERS / stages .. (s + 1) * LAYERS / stages`.
fn owned(s: usize, stages: usize) -> std::ops::Range<usize> {
    s * LAYERS / stages..(s + 1) * LAYERS / stages
}

fn stage_snapshot(step: u64, s: usize, stages: usize) -> Snapshot {
    let mut st = state(step);
    st.world_size = stages;
    st.layout = Layout::Pipeline { stages };
    let mut snap = Snapshot::new(st);
    for l in owned(s, stages) {
        snap.insert_in(
            "model",
            &format!("layers.{l}.weight"),
            Device::Cuda(s),
            layer(l),
        )
        .unwrap();
        snap.insert_in(
            "optimizer",
            &format!("layers.{l}.weight.exp_avg"),
            Device::Cuda(s),
            layer(l + 100),
        )
        .unwrap();
    }
    if s == 0 {
        snap.insert_in(
            "model",
            "embed",
            Device::Cuda(0),
            tensor(TensorDType::BF16, &[8, 2], 1),
        )
        .unwrap();
    }
    snap
}

fn sharded_save(store: Arc<dyn Store>, root: &std::path::Path, step: u64, stages: usize) {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..stages)
            .map(|rank| {
                let store = Arc::clone(&store);
                s.spawn(move || {
                    let dir = CheckpointDir::new(root).unwrap();
                    let c = ShardCoordinator::new(store, rank, stages, Duration::from_secs(30))
                        .unwrap()
                        .with_prefix("job/round-0/");
                    dir.save_sharded(&stage_snapshot(step, rank, stages), &c)
                        .unwrap()
                })
            })
            .collect();
        for h in handles {
            let info = h.join().unwrap();
            assert_eq!(info.path, root.join(format!("step-{step}")));
        }
    });
}

fn check_reshard(root: &std::path::Path, step: u64, saved_stages: usize) {
    let dir = CheckpointDir::new(root).unwrap();
    let ckpt = dir.load_step(step, &LoadOptions::default()).unwrap();
    let m = ckpt.manifest();
    assert_eq!(
        m.state.layout,
        Layout::Pipeline {
            stages: saved_stages
        }
    );
    assert_eq!(m.files.len(), 2 * saved_stages);
    assert!(m
        .files
        .contains_key(&format!("model-00000-of-{saved_stages:05}.safetensors")));
    // Into one process: every layer.
    for l in 0..LAYERS {
        assert_eq!(
            ckpt.tensor(&format!("layers.{l}.weight"))
                .unwrap()
                .to_host()
                .unwrap(),
            layer(l)
        );
    }
    // Into S' stages: each new stage reads only its layers, lazily verified.
    for new_stages in [1, 2, 3] {
        for s in 0..new_stages {
            let lazy = dir
                .load_step(step, &LoadOptions::default().verify(Verify::PerTensor))
                .unwrap();
            for l in owned(s, new_stages) {
                let t = lazy.tensor(&format!("layers.{l}.weight.exp_avg")).unwrap();
                assert_eq!(
                    t.to_host().unwrap(),
                    layer(l + 100),
                    "stage {s}/{new_stages} layer {l}"
                );
            }
        }
    }
    assert_eq!(
        ckpt.names_of_rank(0).len(),
        2 * owned(0, saved_stages).len() + 1
    );
}

#[test]
fn pipeline_stages_over_in_memory_store_reshard() {
    let root = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    sharded_save(Arc::clone(&store), root.path(), 10, 3);
    check_reshard(root.path(), 10, 3);
    sharded_save(store, root.path(), 20, 2);
    check_reshard(root.path(), 20, 2);
}

#[test]
fn pipeline_stages_over_file_store_reshard() {
    let root = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(store_dir.path()).unwrap());
    sharded_save(store, root.path(), 7, 3);
    check_reshard(root.path(), 7, 3);
}

#[test]
fn replicated_checkpoint_loads_into_sharded_layout() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let mut snap = Snapshot::new(state(1));
    snap.insert("w", tensor(TensorDType::F32, &[8, 4], 0))
        .unwrap();
    dir.save(&snap).unwrap();
    let full = snap
        .get("w")
        .unwrap()
        .tensor
        .as_slice::<f32>()
        .unwrap()
        .to_vec();
    for rank in 0..4 {
        let ckpt = dir
            .load_latest(&LoadOptions::default().verify(Verify::PerTensor))
            .unwrap();
        let part = ckpt.tensor("w").unwrap().narrow_rows(rank * 2, 2).unwrap();
        assert_eq!(part.shape(), &[2, 4]);
        assert_eq!(
            part.as_slice::<f32>().unwrap(),
            &full[rank * 8..rank * 8 + 8]
        );
    }
}

#[test]
fn a_missing_rank_times_out_and_nothing_is_committed() {
    let root = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let dir = CheckpointDir::new(root.path()).unwrap();
    // Rank 1 of 2 never shows up.
    let c = ShardCoordinator::new(store, 0, 2, Duration::from_millis(200)).unwrap();
    let err = dir.save_sharded(&stage_snapshot(3, 0, 2), &c).unwrap_err();
    assert!(
        matches!(err, StorageError::ShardTimeout { ref missing, .. } if missing == &vec![1]),
        "{err}"
    );
    assert!(dir.committed_steps().unwrap().is_empty());
    let leftovers: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_failing_rank_fails_every_rank() {
    let root = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    std::thread::scope(|s| {
        let r0 = {
            let store = Arc::clone(&store);
            let root = root.path();
            s.spawn(move || {
                let c = ShardCoordinator::new(store, 0, 2, Duration::from_secs(30)).unwrap();
                CheckpointDir::new(root)
                    .unwrap()
                    .save_sharded(&stage_snapshot(4, 0, 2), &c)
            })
        };
        let r1 = {
            let store = Arc::clone(&store);
            let root = root.path();
            s.spawn(move || {
                let c = ShardCoordinator::new(store, 1, 2, Duration::from_secs(30)).unwrap();
                // Rank 1's shard claims a tensor name rank 0 also writes.
                let mut snap = stage_snapshot(4, 1, 2);
                snap.insert("embed", tensor(TensorDType::F32, &[1], 0))
                    .unwrap();
                CheckpointDir::new(root).unwrap().save_sharded(&snap, &c)
            })
        };
        let e0 = r0.join().unwrap().unwrap_err();
        let e1 = r1.join().unwrap().unwrap_err();
        assert!(
            matches!(e0, StorageError::DuplicateTensor { ref name, .. } if name == "embed"),
            "{e0}"
        );
        assert!(
            matches!(e1, StorageError::ShardFailed { rank: 0, .. }),
            "{e1}"
        );
    });
    assert!(CheckpointDir::new(root.path())
        .unwrap()
        .committed_steps()
        .unwrap()
        .is_empty());
}
