//! The DDP job exactly as users run it (`rekindle run --standalone --nproc-per-node 2
//! --max-restarts 3 ddp --steps 300 --seed 7 --checkpoint-dir D --checkpoint-every 50`, the
//! full 784-1024-1024-10 model): a run with a worker SIGKILLed ends with the same parameters
//! as an undisturbed one. The fingerprint itself depends on the CPU's SIMD kernels (it was
//! `5c4a2398...` on one machine, `3817237b...` on an AVX-512 one), so the test compares the
//! two runs of one machine.

use std::time::Duration;

use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::{final_fingerprint, kill, workspace_bin, Proc};

const T: Duration = Duration::from_secs(600);

fn job(ck: &std::path::Path, logs: &std::path::Path) -> Proc {
    let args: Vec<String> = [
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--log-dir",
        logs.to_str().unwrap(),
        workspace_bin("ddp").unwrap().to_str().unwrap(),
        "--steps",
        "300",
        "--seed",
        "7",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "50",
        "--log-every",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut cmd = std::process::Command::new(workspace_bin("rekindle").unwrap());
    cmd.args(&args);
    Proc::spawn(cmd).unwrap()
}

#[test]
fn the_ddp_job_ends_with_the_same_parameters_with_and_without_a_sigkill() {
    let (ck, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut clean = job(ck.path(), logs.path());
    assert_eq!(clean.wait_exit(T).unwrap(), 0, "{}", clean.output());
    let expected = final_fingerprint(&clean).expect("a final_step line");
    assert_eq!(expected.step, 300);
    eprintln!("fault-free: {expected}");

    let (ck, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut faulty = job(ck.path(), logs.path());
    faulty.wait_for("step=120 ", T).unwrap();
    let victim = rank_pid(&faulty, 1).expect("rank 1's pid");
    kill(victim, libc::SIGKILL);
    assert_eq!(faulty.wait_exit(T).unwrap(), 0, "{}", faulty.output());
    let out = faulty.output();
    assert!(out.contains("generation 1:"), "the group re-formed:\n{out}");
    assert_eq!(final_fingerprint(&faulty), Some(expected));
}

#[test]
fn a_job_asking_for_a_backend_it_cannot_use_stops_at_once_with_the_reason() {
    // A CPU build (or a machine without a GPU): `--backend nccl` is refused before any group
    // is built, instead of failing every generation's bootstrap until the deadlines run out.
    let logs = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(workspace_bin("rekindle").unwrap());
    cmd.args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        logs.path().to_str().unwrap(),
        workspace_bin("ddp").unwrap().to_str().unwrap(),
        "--backend",
        "nccl",
        "--layers",
        "8-8-2",
        "--dataset",
        "256",
        "--batch",
        "32",
        "--steps",
        "5",
    ]);
    let mut job = Proc::spawn(cmd).unwrap();
    let code = job.wait_exit(Duration::from_secs(120)).unwrap();
    assert_ne!(code, 0);
    let text: String = job
        .lines()
        .iter()
        .map(|l| format!("{}\n", l.text))
        .collect();
    assert!(text.contains("--backend nccl on local rank"), "{text}");
    assert!(!text.contains("final_step="), "{text}");
}
