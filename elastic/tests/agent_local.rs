//! `rekindle run` end to end on one host (standalone and static rendezvous), with real
//! worker processes.

mod common;

use std::time::Duration;

use common::{field, pid_alive, rekindle, wait_pid_gone, WORKER};

const T: Duration = Duration::from_secs(60);

#[test]
fn standalone_sets_torchrun_env_and_logs_per_attempt() {
    let logs = tempfile::tempdir().unwrap();
    let script_path = logs.path().join("show-env.sh");
    let script = r#"#!/bin/sh
echo "env RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER=$MASTER_ADDR:$MASTER_PORT JOB=$REKINDLE_JOB ROUND=$REKINDLE_ROUND RESTARTS=$REKINDLE_RESTART_COUNT EF=$REKINDLE_ERROR_FILE ARGS=$*"
"#;
    std::fs::write(&script_path, script).unwrap();
    std::fs::set_permissions(
        &script_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--rdzv-id",
            "envjob",
            "--log-dir",
            logs.path().to_str().unwrap(),
            "--use-local-rank-arg",
            script_path.to_str().unwrap(),
            "tail",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let out = a.output();
    for r in 0..3 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("[rank {r}] env RANK={r} ")))
            .unwrap_or_else(|| panic!("no env line of rank {r}:\n{out}"));
        assert_eq!(field(line, "LOCAL_RANK"), Some(r.to_string().as_str()));
        assert_eq!(field(line, "WORLD_SIZE"), Some("3"));
        assert_eq!(field(line, "LOCAL_WORLD_SIZE"), Some("3"));
        assert_eq!(field(line, "GROUP_RANK"), Some("0"));
        assert_eq!(field(line, "JOB"), Some("envjob"));
        assert_eq!(field(line, "ROUND"), Some("0"));
        assert_eq!(field(line, "RESTARTS"), Some("0"));
        assert!(field(line, "MASTER").unwrap().starts_with("127.0.0.1:"));
        assert!(
            line.ends_with(&format!("ARGS=--local_rank={r} tail")),
            "{line}"
        );
        let ef = field(line, "EF").unwrap();
        assert!(ef.ends_with(&format!("attempt_0/{r}/error.json")), "{ef}");
        // The per-attempt log holds the line without the prefix.
        let log = std::path::Path::new(ef).with_file_name("stdout.log");
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.starts_with(&format!("env RANK={r} ")), "{text}");
    }
}

#[test]
fn workers_meet_in_the_embedded_store() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "barrier",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let ok = a
        .output()
        .lines()
        .filter(|l| l.contains("barrier ok"))
        .count();
    assert_eq!(ok, 4, "{}", a.output());
}

#[test]
fn failure_restarts_count_and_the_root_cause_is_reported() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "fail",
            "0.2",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 1, "{}", a.output());
    let out = a.output();
    assert_eq!(out.matches("restarting workers").count(), 2, "{out}");
    let last = out.lines().last().unwrap();
    assert!(
        last.contains("failed after 2 restart(s); 1 worker(s) failed; root cause: rank 1 (local rank 1, node rank 0, attempt 2) failed with exit code 3: fail: rank 1 gives up"),
        "{out}"
    );
}

#[test]
fn a_failure_then_success_exits_zero() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "fail-once",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let out = a.output();
    assert!(out.contains("root cause: rank 1"), "{out}");
    assert_eq!(out.matches("barrier ok").count(), 2, "{out}");
    assert!(
        out.contains("round=1"),
        "the restart runs in a new round: {out}"
    );
}

#[test]
fn sigterm_is_forwarded_with_the_grace_period() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--grace-period",
            "20",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "hold",
        ],
        &[],
    );
    a.wait_for("[rank 0] ready", T).unwrap();
    a.wait_for("[rank 1] ready", T).unwrap();
    a.signal(libc::SIGTERM);
    assert_eq!(a.wait_exit(T).unwrap(), 143, "{}", a.output());
    let out = a.output();
    assert!(out.contains("[rank 0] got SIGTERM"), "{out}");
    assert!(out.contains("[rank 1] got SIGTERM"), "{out}");
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace_period() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--grace-period",
            "0.5",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "stubborn",
        ],
        &[],
    );
    let line = a.wait_for("[rank 0] ready", T).unwrap();
    let pid: i32 = field(&line, "pid").unwrap().parse().unwrap();
    a.signal(libc::SIGINT);
    assert_eq!(a.wait_exit(T).unwrap(), 130, "{}", a.output());
    assert!(!pid_alive(pid), "the stubborn worker {pid} survived");
}

#[test]
fn sigkilled_agent_takes_its_workers_along() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "stubborn",
        ],
        &[],
    );
    let line = a.wait_for("[rank 0] ready", T).unwrap();
    let pid: i32 = field(&line, "pid").unwrap().parse().unwrap();
    a.signal(libc::SIGKILL);
    assert_eq!(a.wait_exit(T).unwrap(), 137);
    // The kernel delivers the parent-death signal; wait for the worker to be gone.
    assert!(
        wait_pid_gone(pid, Duration::from_secs(10)),
        "worker {pid} outlived its agent"
    );
}

#[test]
fn static_two_nodes_on_one_host() {
    let logs = tempfile::tempdir().unwrap();
    let port = free_port();
    let node = |rank: &str| {
        rekindle(
            &[
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--log-dir",
                logs.path().to_str().unwrap(),
                WORKER,
                "barrier",
            ],
            &[],
        )
    };
    let mut n0 = node("0");
    // Node 0 binds the master port first (node 1's own local store takes a port-0 port, which
    // must not be the one just freed for node 0).
    n0.wait_for("agent started", T).unwrap();
    let mut n1 = node("1");
    assert_eq!(n0.wait_exit(T).unwrap(), 0, "{}", n0.output());
    assert_eq!(n1.wait_exit(T).unwrap(), 0, "{}", n1.output());
    let all = format!("{}\n{}", n0.output(), n1.output());
    for r in 0..4 {
        assert!(
            all.contains(&format!("barrier ok rank={r} world=4")),
            "rank {r} missing:\n{all}"
        );
    }
    assert!(n1.output().contains("node=1"));
}

/// A port the kernel just handed out on loopback (free again once returned).
fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

#[test]
fn static_one_node_with_another_master_address() {
    // A one-node job's embedded store listens on 127.0.0.1 whatever the master address (it
    // serves no other host); its workers must be sent there. 127.0.0.2 reaches this host too,
    // but nothing listens on it.
    let logs = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut a = rekindle(
        &[
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.2",
            "--master-port",
            &port,
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "barrier",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    for r in 0..2 {
        assert!(
            a.output().contains(&format!("barrier ok rank={r} world=2")),
            "rank {r} missing:\n{}",
            a.output()
        );
    }
}

#[test]
fn bad_flags_exit_2_with_a_message() {
    let mut a = rekindle(&["run", "--nnodes", "3:1", "true"], &[]);
    assert_eq!(a.wait_exit(T).unwrap(), 2);
    assert!(
        a.output().contains("need 1 <= MIN <= MAX"),
        "{}",
        a.output()
    );
    let mut a = rekindle(&["run", "--rdzv-backend", "etcd", "true"], &[]);
    assert_eq!(a.wait_exit(T).unwrap(), 2);
    assert!(a.output().contains("--rdzv-id"), "{}", a.output());
    let mut a = rekindle(&["run", "true"], &[("REKINDLE_NPROC_PER_NODE", "zero")]);
    assert_eq!(a.wait_exit(T).unwrap(), 2);
    assert!(a.output().contains("--nproc-per-node"), "{}", a.output());
}

#[test]
fn missing_program_is_an_agent_error() {
    let logs = tempfile::tempdir().unwrap();
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--log-dir",
            logs.path().to_str().unwrap(),
            "/nonexistent/program",
        ],
        &[],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 4, "{}", a.output());
    assert!(
        a.output().contains("cannot start worker 0"),
        "{}",
        a.output()
    );
}

#[test]
fn ckpt_subcommand_is_mounted() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = rekindle(&["ckpt", "ls", dir.path().to_str().unwrap()], &[]);
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    let missing = dir.path().join("missing");
    let mut a = rekindle(&["ckpt", "verify", missing.to_str().unwrap()], &[]);
    assert_eq!(a.wait_exit(T).unwrap(), 2, "{}", a.output());
    assert!(a.output().contains("rekindle ckpt:"), "{}", a.output());
}
