//! An unchanged PyTorch DDP script (`examples/torch/ddp_train.py`: gloo, `env://`) under
//! `rekindle run`: standalone, two static nodes, two etcd nodes, and a worker SIGKILLed with
//! `--max-restarts 1`, each of which must end with the parameters torchrun's run of the same
//! script ends with; and a node joining a running etcd job (a re-form onto a new store).
//!
//! The tests need a Python with `torch` (`REKINDLE_TORCH_PYTHON`, default `python3`); without
//! one each prints why and passes. `scripts/test-torch.sh` installs torch in a virtualenv and
//! runs them.
#![cfg(feature = "test-etcd")]

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{field, rekindle, Proc};
use rekindle_elastic::testing::EtcdServer;

/// Python with torch starts slowly on a loaded machine (tens of seconds to import torch).
const T: Duration = Duration::from_secs(600);
const STEPS: &str = "12";

fn script() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/torch/ddp_train.py")
        .display()
        .to_string()
}

/// The Python to use, or `None` (with the reason printed) when it cannot import torch.
fn python() -> Option<String> {
    static PY: OnceLock<Option<String>> = OnceLock::new();
    PY.get_or_init(|| {
        let py = std::env::var("REKINDLE_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
        let probe = Command::new(&py)
            .args([
                "-c",
                "import torch.distributed as d; assert d.is_available() and d.is_gloo_available()",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        match probe {
            Ok(s) if s.success() => Some(py),
            Ok(_) => {
                println!(
                    "skipping: {py} cannot import torch with gloo (see scripts/test-torch.sh)"
                );
                None
            }
            Err(e) => {
                println!("skipping: cannot run {py}: {e} (see scripts/test-torch.sh)");
                None
            }
        }
    })
    .clone()
}

/// The environment every run gets: one thread per process (so results do not depend on how
/// many cores a rank sees) and gloo on loopback (every rank is on this host).
const ENV: &[(&str, &str)] = &[("OMP_NUM_THREADS", "1"), ("GLOO_SOCKET_IFNAME", "lo")];

fn fingerprint(output: &str) -> String {
    let fps: Vec<&str> = output
        .lines()
        .filter_map(|l| l.split("fingerprint ").nth(1))
        .collect();
    assert_eq!(fps.len(), 1, "expected one fingerprint:\n{output}");
    fps[0].trim().to_string()
}

/// torchrun's result for 2 ranks, computed once.
fn reference(py: &str) -> String {
    static FP: OnceLock<String> = OnceLock::new();
    FP.get_or_init(|| {
        let out = Command::new(py)
            .args([
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                &script(),
                "--steps",
                STEPS,
            ])
            .envs(ENV.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run torchrun");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "torchrun failed:\n{text}");
        fingerprint(&text)
    })
    .clone()
}

/// Starts `rekindle args...` with [`ENV`]. Dropping it kills the agent and everything
/// carrying its tag, so no Python worker outlives a failed test.
fn agent(args: &[&str]) -> Proc {
    rekindle(args, ENV)
}

fn run_args<'a>(logs: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["run", "--log-dir", logs];
    v.extend_from_slice(rest);
    v
}

#[test]
fn standalone_two_ranks_match_torchrun() {
    let Some(py) = python() else { return };
    let want = reference(&py);
    let logs = tempfile::tempdir().unwrap();
    let script = script();
    let args = run_args(
        logs.path().to_str().unwrap(),
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            &py,
            &script,
            "--steps",
            STEPS,
        ],
    );
    let mut a = agent(&args);
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let out = a.output();
    assert_eq!(fingerprint(&out), want, "{out}");
    assert!(out.contains("joined rank=1 world=2 backend=gloo"), "{out}");
}

#[test]
fn static_two_nodes_match_torchrun() {
    let Some(py) = python() else { return };
    let want = reference(&py);
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let script = script();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let node = |rank: &str| {
        let rest = [
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            &py,
            &script,
            "--steps",
            STEPS,
        ];
        agent(&run_args(l, &rest))
    };
    let mut n0 = node("0");
    // Node 0 binds the master port before node 1 takes any port.
    n0.wait_for("agent started", T).unwrap();
    let mut n1 = node("1");
    assert_eq!(n0.wait_exit(T).unwrap(), 0, "{}", n0.output());
    assert_eq!(n1.wait_exit(T).unwrap(), 0, "{}", n1.output());
    assert_eq!(fingerprint(&n0.output()), want, "{}", n0.output());
    assert!(n1.output().contains("joined rank=1 world=2"));
}

#[test]
fn etcd_two_nodes_match_torchrun() {
    let Some(py) = python() else { return };
    let want = reference(&py);
    let etcd = EtcdServer::start().unwrap();
    let endpoint = etcd.endpoint();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let script = script();
    let node = || {
        let rest = [
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "torchddp",
            "--nnodes",
            "2",
            "--rdzv-conf",
            "last_call_timeout=0.2,lease_ttl=2",
            "--local-addr",
            "127.0.0.1",
            &py,
            &script,
            "--steps",
            STEPS,
        ];
        agent(&run_args(l, &rest))
    };
    let (mut a, mut b) = (node(), node());
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert_eq!(b.wait_exit(T).unwrap(), 0, "{}", b.output());
    let all = format!("{}\n{}", a.output(), b.output());
    assert_eq!(fingerprint(&all), want, "{all}");
}

#[test]
fn a_killed_worker_is_restarted_and_the_run_ends_with_torchruns_parameters() {
    let Some(py) = python() else { return };
    let want = reference(&py);
    let logs = tempfile::tempdir().unwrap();
    let ckpt = tempfile::tempdir().unwrap();
    let script = script();
    let rest = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        &py,
        &script,
        "--steps",
        STEPS,
        "--checkpoint-dir",
        ckpt.path().to_str().unwrap(),
        "--checkpoint-every",
        "5",
        // Slow enough that the kill lands between the first checkpoint and the end.
        "--min-step-time",
        "0.5",
    ];
    let mut a = agent(&run_args(logs.path().to_str().unwrap(), &rest));
    let started = a.wait_for("started rank=1 ", T).unwrap();
    let pid: i32 = field(&started, "pid").unwrap().parse().unwrap();
    a.wait_for("step 6 rank 1 ", T).unwrap();
    // SAFETY: kill(2) on a worker of the agent this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = Instant::now();
    a.wait_for("restarting workers (restart 1 of 1)", T)
        .unwrap();
    let restart = killed.elapsed();
    let line = a.wait_for("restart=1", T).unwrap();
    let up = killed.elapsed();
    println!(
        "kill to restart decision {:.3} s, kill to a restarted worker's first line {:.3} s ({line})",
        restart.as_secs_f64(),
        up.as_secs_f64()
    );
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let out = a.output();
    assert!(out.contains("resumed rank=0 step=5"), "{out}");
    assert_eq!(fingerprint(&out), want, "{out}");
}

#[test]
fn a_node_joining_an_etcd_job_re_forms_it_with_a_fresh_store() {
    let Some(py) = python() else { return };
    let etcd = EtcdServer::start().unwrap();
    let endpoint = etcd.endpoint();
    let logs = tempfile::tempdir().unwrap();
    let ckpt = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let script = script();
    let node = || {
        let rest = [
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "torchgrow",
            "--nnodes",
            "1:2",
            "--rdzv-conf",
            "last_call_timeout=0.2,lease_ttl=2",
            "--local-addr",
            "127.0.0.1",
            &py,
            &script,
            "--steps",
            "16",
            "--checkpoint-dir",
            ckpt.path().to_str().unwrap(),
            "--checkpoint-every",
            "2",
            "--min-step-time",
            "0.5",
        ];
        agent(&run_args(l, &rest))
    };
    let mut a = node();
    a.wait_for("joined rank=0 world=1", T).unwrap();
    a.wait_for("step 3 rank 0 ", T).unwrap();
    // A second node arrives: the running node stops its workers, both join a round of two,
    // and the workers start again on that round's new store, resuming from the checkpoint.
    let mut b = node();
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert_eq!(b.wait_exit(T).unwrap(), 0, "{}", b.output());
    let all = format!("{}\n{}", a.output(), b.output());
    assert!(a.output().contains("membership changed"), "{all}");
    for r in 0..2 {
        assert!(all.contains(&format!("joined rank={r} world=2")), "{all}");
    }
    assert!(all.contains("resumed rank=0 step="), "{all}");
    fingerprint(&all);
}
