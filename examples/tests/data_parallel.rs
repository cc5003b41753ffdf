//! The `data_parallel` example: it trains over 2 and 3 CPU replicas, the same run twice gives
//! the same parameters, a PyTorch `DataParallel` state dict (keys with `module.`) loads, and
//! checkpoints hold the names without the prefix.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::Finished as Output;
use rekindle_storage::{Checkpoint, LoadOptions};

/// The longest one run may take.
const T: Duration = Duration::from_secs(300);

const LAYERS: &str = "32-64-10";

fn run(extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_data_parallel"));
    cmd.args([
        "--layers",
        LAYERS,
        "--dataset",
        "4096",
        "--batch",
        "96",
        "--seed",
        "3",
        "--log-every",
        "5",
    ])
    .args(extra);
    rekindle_elastic::testing::run(cmd, T).expect("running data_parallel")
}

fn text(out: &Output) -> String {
    format!("{}\n{}", out.stdout, out.stderr)
}

/// `(final step, params_sha256)` of a run that must have succeeded.
fn finished(out: &Output) -> (u64, String) {
    assert!(out.success(), "data_parallel failed:\n{}", text(out));
    let stdout = out.stdout.as_str();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("final_step="))
        .unwrap_or_else(|| panic!("no final line:\n{}", text(out)));
    let mut f = line.split_whitespace();
    let step = f
        .next()
        .and_then(|s| s.strip_prefix("final_step="))
        .unwrap();
    let sha = f
        .next()
        .and_then(|s| s.strip_prefix("params_sha256="))
        .unwrap();
    (step.parse().unwrap(), sha.to_string())
}

fn losses(out: &Output) -> Vec<f32> {
    out.stdout
        .as_str()
        .lines()
        .filter_map(|l| l.split("loss=").nth(1))
        .map(|v| v.trim().parse().unwrap())
        .collect()
}

#[test]
fn two_and_three_replicas_train_and_repeat_bit_identically() {
    for devices in ["cpu,cpu", "cpu,cpu,cpu"] {
        let a = run(&["--devices", devices, "--steps", "30"]);
        let b = run(&["--devices", devices, "--steps", "30"]);
        assert_eq!(finished(&a), finished(&b), "{devices}: the same run twice");
        assert_eq!(finished(&a).0, 30);
        let l = losses(&a);
        assert!(
            l.last().unwrap() < &(l[0] * 0.9),
            "{devices}: the loss falls: {l:?}"
        );
        assert!(
            text(&a).contains("every replica is on the CPU"),
            "a CPU build says so:\n{}",
            text(&a)
        );
    }
}

/// A state dict as `torch.save(model.state_dict())` of an `nn.DataParallel(Mlp)` would name
/// it, written as safetensors: `module.fc1.weight`, ...
fn write_torch_dp_state_dict(path: &Path) -> Vec<(String, Vec<f32>)> {
    let dims = [(32usize, 64usize), (64, 10)];
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (k, (i, o)) in dims.iter().enumerate() {
        let w: Vec<f32> = (0..i * o).map(|x| ((x % 17) as f32 - 8.0) / 64.0).collect();
        let b: Vec<f32> = (0..*o).map(|x| (x as f32) / 128.0).collect();
        tensors.push((format!("module.fc{}.weight", k + 1), vec![*o, *i], w));
        tensors.push((format!("module.fc{}.bias", k + 1), vec![*o], b));
    }
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, shape, _), b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    tensors
        .into_iter()
        .map(|(n, _, v)| (n.trim_start_matches("module.").to_string(), v))
        .collect()
}

#[test]
fn a_pytorch_data_parallel_state_dict_loads_and_checkpoints_drop_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("dp_state_dict.safetensors");
    let want = write_torch_dp_state_dict(&state);
    let ck = dir.path().join("ckpt");
    let out = run(&[
        "--devices",
        "cpu,cpu",
        "--steps",
        "0",
        "--init-from",
        state.to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]);
    assert_eq!(finished(&out).0, 0);
    assert!(text(&out).contains("initialised from"), "{}", text(&out));
    let ckpt = Checkpoint::open(&ck.join("step-0"), &LoadOptions::default()).unwrap();
    let names = ckpt.names();
    assert!(
        names.iter().all(|n| !n.starts_with("module.")),
        "no prefix in the checkpoint: {names:?}"
    );
    for (name, values) in want {
        let t = ckpt.tensor(&name).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), values.as_slice(), "{name}");
    }
}

#[test]
fn bad_devices_are_refused() {
    for bad in ["", "gpu7", "cpu,,cpu"] {
        let out = run(&["--devices", bad, "--steps", "1"]);
        assert!(!out.success(), "--devices {bad:?} was accepted");
        assert!(out.stderr.contains("device"), "{}", text(&out));
    }
}
