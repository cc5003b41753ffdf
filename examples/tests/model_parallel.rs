//! The `model_parallel` example: the seed's ToyModel split over two devices trains like the
//! same model unsplit (bit-identical on the CPU), and its checkpoint loads into the unsplit
//! model on one device through a map-location.

use std::process::Command;
use std::time::Duration;

use candle_core::Device;
use candle_nn::VarMap;
use rekindle_elastic::testing::Finished as Output;
use rekindle_examples::mlp::{params_sha256, Mlp, MlpConfig};
use rekindle_storage::{load_varmap, CheckpointDir, LoadOptions, MapLocation};

/// The longest one run may take.
const T: Duration = Duration::from_secs(300);

fn run(extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_model_parallel"));
    cmd.args(["--steps", "60", "--seed", "5", "--dataset", "2000"])
        .args(extra);
    rekindle_elastic::testing::run(cmd, T).expect("running model_parallel")
}

fn text(out: &Output) -> String {
    format!("{}\n{}", out.stdout, out.stderr)
}

fn fingerprint(out: &Output) -> String {
    assert!(out.success(), "model_parallel failed:\n{}", text(out));
    out.stdout
        .as_str()
        .lines()
        .find_map(|l| l.strip_prefix("final_step=60 params_sha256="))
        .unwrap_or_else(|| panic!("no final line:\n{}", text(out)))
        .to_string()
}

#[test]
fn the_toy_model_split_over_two_devices_trains_like_the_unsplit_one() {
    let split = run(&[
        "--layers",
        "10-10-5",
        "--split",
        "1",
        "--devices",
        "cpu,cpu",
    ]);
    let whole = run(&["--layers", "10-10-5", "--split", "", "--devices", "cpu"]);
    assert_eq!(fingerprint(&split), fingerprint(&whole));
    let log = text(&split);
    assert!(log.contains("stage 0 on cpu: layers 0..2"), "{log}");
    assert!(log.contains("stage 1 on cpu: layers 2..3"), "{log}");
    assert!(log.contains("a CPU build"), "{log}");
    let three = run(&[
        "--layers",
        "10-16-16-5",
        "--split",
        "1,2",
        "--devices",
        "cpu,cpu,cpu",
    ]);
    let one = run(&["--layers", "10-16-16-5", "--split", "", "--devices", "cpu"]);
    assert_eq!(fingerprint(&three), fingerprint(&one));
}

#[test]
fn a_split_checkpoint_loads_into_the_model_on_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "--checkpoint-dir",
        dir.path().to_str().unwrap(),
        "--checkpoint-every",
        "20",
    ]);
    let trained = fingerprint(&out);
    let opts =
        LoadOptions::default().map_location(MapLocation::Device(rekindle_runtime::Device::Cpu));
    let ckpt = CheckpointDir::new(dir.path())
        .unwrap()
        .load_latest(&opts)
        .unwrap();
    assert_eq!(ckpt.step(), 60);
    let varmap = VarMap::new();
    let _model = Mlp::new(
        &MlpConfig::parse("10-10-5").unwrap(),
        &varmap,
        0,
        &Device::Cpu,
    )
    .unwrap();
    load_varmap(&ckpt, &varmap).unwrap();
    assert_eq!(params_sha256(&varmap).unwrap(), trained);
}

#[test]
fn a_split_that_does_not_match_the_devices_is_refused() {
    for (split, devices) in [
        ("1", "cpu"),
        ("", "cpu,cpu"),
        ("2", "cpu,cpu"),
        ("x", "cpu,cpu"),
    ] {
        let out = run(&["--split", split, "--devices", devices]);
        assert!(
            !out.success(),
            "--split {split:?} --devices {devices:?} was accepted:\n{}",
            text(&out)
        );
    }
}
