//! The `single_device` example as a user runs it: the real binary in temporary directories,
//! checked through its final `final_step=<N> params_sha256=<hex>` line, its log, its loss CSV
//! and the checkpoints it leaves.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::Finished as Output;

use rekindle_runtime::Device;
use rekindle_storage::{CheckpointDir, LoadOptions, Snapshot};

/// A small model and dataset: 16 steps per epoch, so 40 steps cross two epoch boundaries and a
/// resume at step 20 lands mid-epoch.
const SMALL: &[&str] = &[
    "--layers",
    "32-64-4",
    "--batch",
    "32",
    "--samples",
    "512",
    "--lr",
    "0.1",
    "--seed",
    "7",
];

/// The longest one run may take.
const T: Duration = Duration::from_secs(300);

/// Runs the binary in `cwd` with the small configuration plus `extra`, with no CUDA visible so
/// the result is the same on every machine.
fn run(cwd: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_single_device"));
    cmd.args(SMALL)
        .args(extra)
        .current_dir(cwd)
        .env("CUDA_VISIBLE_DEVICES", "");
    rekindle_elastic::testing::run(cmd, T).expect("the single_device binary runs")
}

fn stderr(out: &Output) -> String {
    out.stderr.clone()
}

/// Checks that the run succeeded and printed exactly one `final_step=N params_sha256=H` line;
/// returns (N, H).
fn finished(out: &Output) -> (u64, String) {
    assert!(out.success(), "run failed:\n{}", stderr(out));
    let stdout = out.stdout.clone();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout: {stdout:?}");
    let (step, sha) = lines[0]
        .strip_prefix("final_step=")
        .and_then(|r| r.split_once(" params_sha256="))
        .unwrap_or_else(|| panic!("unexpected final line {:?}", lines[0]));
    assert_eq!(sha.len(), 64);
    assert!(sha.bytes().all(|b| b.is_ascii_hexdigit()));
    (step.parse().unwrap(), sha.to_string())
}

/// Checks that the run failed with a non-zero exit, printed nothing on stdout, and said
/// `needle` (case-insensitively) on stderr.
fn failed(out: &Output, needle: &str) {
    assert!(!out.success(), "run succeeded:\n{}", stderr(out));
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    let err = stderr(out);
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "stderr does not mention {needle:?}:\n{err}"
    );
}

/// The CSV's rows as (step, loss, samples/s).
fn read_csv(path: &Path) -> Vec<(u64, f32, f64)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,loss,samples_per_s"));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 3, "row {l:?}");
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect()
}

/// The fingerprint and loss CSV of 40 uninterrupted steps.
fn straight_run(cwd: &Path) -> (String, Vec<(u64, f32, f64)>) {
    let csv = cwd.join("straight.csv");
    let out = run(cwd, &["--steps", "40", "--loss-csv", csv.to_str().unwrap()]);
    let (step, sha) = finished(&out);
    assert_eq!(step, 40);
    (sha, read_csv(&csv))
}

#[test]
fn stopping_at_20_and_resuming_to_40_matches_a_straight_run() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, straight_csv) = straight_run(tmp.path());
    let ckpt = tmp.path().join("ckpt");
    let csv = tmp.path().join("resumed.csv");
    let common = [
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--checkpoint-every",
        "10",
        "--loss-csv",
        csv.to_str().unwrap(),
    ];

    let first = run(tmp.path(), &[&common[..], &["--steps", "20"]].concat());
    let (step, sha20) = finished(&first);
    assert_eq!(step, 20);
    assert_ne!(sha20, want);
    assert!(stderr(&first).contains("starting from step 0"));
    let dir = CheckpointDir::new(&ckpt).unwrap();
    assert_eq!(dir.committed_steps().unwrap(), [10, 20]);
    let saved = dir.load_latest(&LoadOptions::default()).unwrap();
    // 16 steps per epoch: step 20 is 4 steps of 32 samples into epoch 1.
    assert_eq!(
        (
            saved.step(),
            saved.state().epoch,
            saved.state().sample_cursor
        ),
        (20, 1, 128)
    );
    let mut names = saved.names();
    names.sort_unstable();
    assert!(names.contains(&"fc1.weight") && names.contains(&"sampler.cursor"));
    assert!(names.contains(&"optim.fc1.weight.momentum_buffer"));
    drop(saved);

    let second = run(tmp.path(), &[&common[..], &["--steps", "40"]].concat());
    assert_eq!(finished(&second), (40, want.clone()));
    assert!(
        stderr(&second).contains("resumed from step 20"),
        "{}",
        stderr(&second)
    );
    assert_eq!(dir.committed_steps().unwrap(), [10, 20, 30, 40]);
    // The stitched loss curve is the straight run's, loss for loss.
    let losses = |rows: &[(u64, f32, f64)]| -> Vec<(u64, u32)> {
        rows.iter().map(|r| (r.0, r.1.to_bits())).collect()
    };
    assert_eq!(losses(&read_csv(&csv)), losses(&straight_csv));

    // Another seed trains other parameters, so the fingerprint does tell runs apart (a flag
    // given twice takes the last value).
    let other = run(tmp.path(), &["--seed", "8", "--steps", "40"]);
    assert_ne!(finished(&other).1, want);

    // Resuming at the target step trains nothing and prints the same line.
    let again = run(tmp.path(), &[&common[..], &["--steps", "40"]].concat());
    assert_eq!(finished(&again), (40, want));
    assert!(stderr(&again).contains("nothing to train"));
}

#[test]
fn the_loss_falls() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, rows) = straight_run(tmp.path());
    let steps: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(steps, (1..=40).collect::<Vec<_>>());
    assert!(rows.iter().all(|r| r.1.is_finite() && r.2 > 0.0));
    let mean = |rows: &[(u64, f32, f64)]| rows.iter().map(|r| r.1).sum::<f32>() / 10.0;
    let (first, last) = (mean(&rows[..10]), mean(&rows[30..]));
    // Four classes: the loss starts near ln 4.
    assert!((first - 4f32.ln()).abs() < 0.5, "first {first}");
    assert!(last < 0.8 * first, "loss {first} -> {last}");
}

/// Copies the newest checkpoint of `src` into `dst`, recording the model tensors as saved on
/// `cuda:0` (as a GPU run records them; the optimizer's state lives on the host either way).
fn as_if_saved_on_cuda(src: &Path, dst: &Path) {
    let ckpt = CheckpointDir::new(src)
        .unwrap()
        .load_latest(&LoadOptions::default())
        .unwrap();
    let mut snap = Snapshot::new(ckpt.state().clone());
    for name in ckpt.names() {
        let t = ckpt.tensor(name).unwrap();
        let entry = &ckpt.manifest().tensors[t.stored_name()];
        let group = entry.file.strip_suffix(".safetensors").unwrap();
        let device = if group == "model" {
            Device::Cuda(0)
        } else {
            Device::Cpu
        };
        snap.insert_in(group, name, device, t.to_host().unwrap())
            .unwrap();
    }
    CheckpointDir::new(dst).unwrap().save(&snap).unwrap();
}

#[test]
fn a_checkpoint_recorded_on_cuda_resumes_on_the_cpu_through_the_map_location() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, _) = straight_run(tmp.path());
    let cpu_ckpt = tmp.path().join("cpu");
    let dir_arg = ["--checkpoint-dir", cpu_ckpt.to_str().unwrap()];
    finished(&run(
        tmp.path(),
        &[&dir_arg[..], &["--steps", "20"]].concat(),
    ));

    let resume = |rules: Option<&str>| -> Output {
        let gpu_ckpt = tempfile::tempdir_in(tmp.path()).unwrap();
        as_if_saved_on_cuda(&cpu_ckpt, gpu_ckpt.path());
        let manifest = std::fs::read_to_string(gpu_ckpt.path().join("step-20/manifest.json"))
            .expect("the copied checkpoint is committed");
        assert!(manifest.contains("\"cuda:0\""));
        let mut args = vec![
            "--steps",
            "40",
            "--checkpoint-dir",
            gpu_ckpt.path().to_str().unwrap(),
        ];
        if let Some(r) = rules {
            args.extend(["--map-location", r]);
        }
        let out = run(tmp.path(), &args);
        drop(gpu_ckpt);
        out
    };

    for rules in ["cuda:*->cpu", "cuda:1 -> cuda:1, cuda:0 -> cpu", "cpu"] {
        let out = resume(Some(rules));
        assert_eq!(finished(&out), (40, want.clone()), "{rules}");
        let log = stderr(&out);
        assert!(log.contains("resumed from step 20"), "{log}");
        assert!(log.contains("4 tensors cuda:0 -> cpu"), "{log}");
        assert!(log.contains("9 tensors cpu -> cpu"), "{log}");
    }
    // Without --map-location tensors go to the training device, here the CPU.
    assert_eq!(finished(&resume(None)), (40, want));
    // A table that leaves cuda:0 tensors where they were needs CUDA, which this build lacks
    // (or this run hides): a clean error naming it, not a crash.
    failed(&resume(Some("cpu -> cpu")), "cuda");
    failed(&resume(Some("cuda:0 -> cuda:0")), "cuda");
}

#[test]
fn resuming_with_map_location_cpu_from_a_cpu_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, _) = straight_run(tmp.path());
    let ckpt = tmp.path().join("ckpt");
    let common = [
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--checkpoint-every",
        "0",
        "--map-location",
        "cpu",
    ];
    finished(&run(
        tmp.path(),
        &[&common[..], &["--steps", "20"]].concat(),
    ));
    // --checkpoint-every 0 saves at the end only.
    assert_eq!(
        CheckpointDir::new(&ckpt)
            .unwrap()
            .committed_steps()
            .unwrap(),
        [20]
    );
    let out = run(tmp.path(), &[&common[..], &["--steps", "40"]].concat());
    assert_eq!(finished(&out), (40, want));
    assert!(
        stderr(&out).contains("map-location cpu: 13 tensors cpu -> cpu"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_corrupt_newest_checkpoint_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, straight_csv) = straight_run(tmp.path());
    let ckpt = tmp.path().join("ckpt");
    let csv = tmp.path().join("loss.csv");
    let common = [
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--checkpoint-every",
        "10",
        "--loss-csv",
        csv.to_str().unwrap(),
    ];
    finished(&run(
        tmp.path(),
        &[&common[..], &["--steps", "20"]].concat(),
    ));
    // Flip one bit of the last parameter byte of step 20's model file.
    let model = ckpt.join("step-20/model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&model, bytes).unwrap();

    let out = run(tmp.path(), &[&common[..], &["--steps", "40"]].concat());
    assert_eq!(finished(&out), (40, want));
    let log = stderr(&out);
    assert!(log.contains("resumed from step 10"), "{log}");
    assert!(log.contains("skipped 1 newer checkpoint"), "{log}");
    // Moved aside, kept for inspection; the resumed run wrote step 20 again.
    assert!(ckpt.join("step-20.corrupt/model.safetensors").is_file());
    let dir = CheckpointDir::new(&ckpt).unwrap();
    assert_eq!(dir.committed_steps().unwrap(), [10, 20, 30, 40]);
    dir.load_step(20, &LoadOptions::default()).unwrap();
    // The rows 11..20 of the first run were dropped and written again by the resumed one.
    let bits = |rows: &[(u64, f32, f64)]| -> Vec<(u64, u32)> {
        rows.iter().map(|r| (r.0, r.1.to_bits())).collect()
    };
    assert_eq!(bits(&read_csv(&csv)), bits(&straight_csv));
}

#[test]
fn the_device_choice_is_logged_and_cuda_without_cuda_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    // CUDA_VISIBLE_DEVICES="" hides every GPU, whatever the machine has.
    let auto = run(tmp.path(), &["--steps", "1"]);
    finished(&auto);
    assert!(
        stderr(&auto).contains("device: cpu (auto: no CUDA device: only 0 CUDA device(s)"),
        "{}",
        stderr(&auto)
    );
    let cpu = run(tmp.path(), &["--steps", "1", "--device", "cpu"]);
    assert!(stderr(&cpu).contains("device: cpu (--device cpu)"));
    assert_eq!(finished(&cpu), finished(&auto));
    for device in ["cuda", "cuda:0", "cuda:3"] {
        failed(
            &run(tmp.path(), &["--steps", "1", "--device", device]),
            "cuda",
        );
    }

    // As run on this machine, without hiding anything: auto says why it chose what it chose,
    // and an explicit CUDA request fails unless CUDA is both present and compiled in.
    let plain = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_single_device"));
        cmd.args(SMALL)
            .args(["--steps", "1"])
            .args(extra)
            .current_dir(tmp.path())
            .env_remove("CUDA_VISIBLE_DEVICES");
        rekindle_elastic::testing::run(cmd, T).unwrap()
    };
    let log = stderr(&plain(&[]));
    let usable =
        rekindle_runtime::cuda_device_count() > 0 && candle_core::utils::cuda_is_available();
    if usable {
        assert!(
            log.contains("device: cuda:0 (auto: CUDA device 0 found)"),
            "{log}"
        );
    } else {
        assert!(log.contains("device: cpu (auto: "), "{log}");
        failed(&plain(&["--device", "cuda"]), "cuda");
    }
}

#[test]
fn bad_flags_and_mismatched_resumes_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    failed(&run(tmp.path(), &["--device", "tpu"]), "--device");
    failed(
        &run(tmp.path(), &["--map-location", "cuda:x -> cpu"]),
        "map-location",
    );
    failed(&run(tmp.path(), &["--layers", "32-x-4"]), "layer sizes");
    failed(&run(tmp.path(), &["--samples", "16"]), "--samples 16");

    let ckpt = tmp.path().join("ckpt");
    let dir = ["--checkpoint-dir", ckpt.to_str().unwrap()];
    finished(&run(tmp.path(), &[&dir[..], &["--steps", "5"]].concat()));
    failed(
        &run(
            tmp.path(),
            &[&dir[..], &["--steps", "10", "--layers", "32-16-4"]].concat(),
        ),
        "--layers 32-64-4, this run has --layers 32-16-4",
    );
    failed(
        &run(
            tmp.path(),
            &[&dir[..], &["--steps", "10", "--batch", "16"]].concat(),
        ),
        "--batch",
    );
    // Every checkpoint failing to verify is an error, not a silent fresh start.
    let model = ckpt.join("step-5/model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&model, bytes).unwrap();
    failed(
        &run(tmp.path(), &[&dir[..], &["--steps", "10"]].concat()),
        "no valid checkpoint",
    );
}
