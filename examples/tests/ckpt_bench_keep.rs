//! `ckpt_bench --keep --dir D` leaves its checkpoint in D itself, so `rekindle ckpt verify D`
//! checks it; without `--keep` nothing is left behind.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::Finished as Output;
use rekindle_storage::cli::{run_to, CkptArgs, CkptCommand, Outcome};

/// The longest one run may take.
const T: Duration = Duration::from_secs(300);

fn bench(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt_bench"));
    cmd.args(["--size-mib", "1", "--tensors", "2", "--repeat", "1"])
        .args(args);
    rekindle_elastic::testing::run(cmd, T).expect("run ckpt_bench")
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn verify(path: &Path) -> (Outcome, String) {
    let mut out = Vec::new();
    let args = CkptArgs {
        command: CkptCommand::Verify {
            path: path.to_path_buf(),
        },
    };
    let o = run_to(&args, &mut out).expect("verify runs");
    (o, String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn keep_leaves_a_verifiable_checkpoint_in_the_given_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("kept");
    let out = bench(&["--keep", "--dir", d.to_str().unwrap()]);
    let text = out.stdout.as_str();
    assert!(out.success(), "{text}{}", out.stderr);
    // One repetition: a sync save of step 1, then async saves of steps 2 and 3; the last
    // stays, next to the checkpoint directory's lock file.
    assert_eq!(
        entries(&d),
        vec![".rekindle-ckpt.lock".to_string(), "step-3".to_string()],
        "{text}"
    );
    assert!(
        text.contains(&format!("rekindle ckpt verify {}", d.display())),
        "{text}"
    );
    let (outcome, report) = verify(&d);
    assert_eq!(outcome, Outcome::Ok, "{report}");

    // A second run into the same directory is refused: it would mix two runs' checkpoints.
    let again = bench(&["--keep", "--dir", d.to_str().unwrap()]);
    assert!(!again.success());
    assert!(
        again.stderr.contains("already holds checkpoints"),
        "{}",
        again.stderr
    );
}

#[test]
fn without_keep_the_directory_is_left_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let out = bench(&["--dir", tmp.path().to_str().unwrap()]);
    assert!(out.success(), "{}", out.stderr);
    assert!(entries(tmp.path()).is_empty(), "{:?}", entries(tmp.path()));
}
