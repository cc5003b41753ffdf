//! Elastic DDP under faults: real `rekindle run` agents, real `ddp` worker processes, real
//! signals, a real etcd. Each faulty run is compared with the same run without faults: at a
//! fixed world size the final parameters must be bit-identical.

use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::EtcdServer;
use rekindle_elastic::testing::{kill, run, workspace_bin, Proc};

const T: Duration = Duration::from_secs(120);
const STEPS: u64 = 1500;

/// A small model so that 1500 steps take a couple of seconds.
fn model_args(steps: u64) -> Vec<String> {
    [
        "--steps",
        &steps.to_string(),
        "--layers",
        "64-128-10",
        "--batch",
        "64",
        "--dataset",
        "4096",
        "--seed",
        "3",
        "--log-every",
        "50",
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn ddp() -> String {
    workspace_bin("ddp").unwrap().display().to_string()
}

fn rekindle() -> std::path::PathBuf {
    workspace_bin("rekindle").unwrap()
}

/// `rekindle args...`, its output read line by line.
fn spawn(args: &[String]) -> Proc {
    let mut cmd = std::process::Command::new(rekindle());
    cmd.args(args);
    Proc::spawn(cmd).unwrap()
}

/// The job's `final_step=<N> params_sha256=<hex>` line as `(N, hex)`.
fn final_fingerprint(job: &Proc) -> Option<(u64, String)> {
    rekindle_elastic::testing::final_fingerprint(job).map(|f| (f.step, f.sha256))
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `rekindle run --standalone --nproc-per-node N [agent args] ddp [model args] [extra]`.
fn standalone(nproc: usize, agent: &[&str], extra: &[String], logs: &Path) -> Proc {
    let mut args = strings(&["run", "--standalone", "--nproc-per-node"]);
    args.push(nproc.to_string());
    args.extend(strings(&["--log-dir", logs.to_str().unwrap()]));
    args.extend(strings(agent));
    args.push(ddp());
    args.extend(model_args(STEPS));
    args.extend(extra.iter().cloned());
    spawn(&args)
}

fn step_line(at_least: u64) -> impl Fn(&str) -> bool {
    move |l: &str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix("step="))
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= at_least)
    }
}

/// The fingerprint of an undisturbed run on `nproc` ranks (computed once per world size).
fn reference(nproc: usize) -> String {
    static CACHE: OnceLock<Mutex<Vec<(usize, String)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    if let Some((_, f)) = c.iter().find(|(n, _)| *n == nproc) {
        return f.clone();
    }
    let logs = tempfile::tempdir().unwrap();
    let mut job = standalone(nproc, &[], &[], logs.path());
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let (step, f) = final_fingerprint(&job).expect("a final_step line");
    assert_eq!(step, STEPS);
    c.push((nproc, f.clone()));
    f
}

fn kill_rank_and_compare(nproc: usize, victim: usize) {
    let expected = reference(nproc);
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let extra = strings(&[
        "--checkpoint-dir",
        ck.path().to_str().unwrap(),
        "--checkpoint-every",
        "200",
    ]);
    let mut job = standalone(nproc, &["--max-restarts", "3"], &extra, logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    let pid = rank_pid(&job, victim).expect("the victim's pid");
    kill(pid, libc::SIGKILL);
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let out = job.output();
    assert!(
        out.contains(&format!("restarting rank {victim} alone")),
        "the agent restarted only the victim:\n{out}"
    );
    assert!(
        out.contains("generation 1:"),
        "the group re-formed once:\n{out}"
    );
    assert!(
        !out.contains("stopping workers to re-form"),
        "the survivors were not restarted:\n{out}"
    );
    let (step, got) = final_fingerprint(&job).expect("a final_step line");
    assert_eq!(step, STEPS);
    assert_eq!(
        got, expected,
        "a faulty run must end with the fault-free parameters"
    );
}

#[test]
fn killing_one_of_two_ranks_keeps_the_fault_free_result() {
    kill_rank_and_compare(2, 1);
}

#[test]
fn killing_rank_0_of_three_keeps_the_fault_free_result() {
    // Rank 0 writes the checkpoints and the progress; its replacement takes over both.
    kill_rank_and_compare(3, 0);
}

#[test]
fn sigterm_commits_a_checkpoint_and_the_next_run_resumes_there() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let extra = strings(&["--checkpoint-dir", ck.path().to_str().unwrap()]);
    let mut job = standalone(2, &["--grace-period", "30"], &extra, logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    job.signal(libc::SIGTERM);
    assert_eq!(
        job.wait_exit(T).ok(),
        Some(128 + libc::SIGTERM),
        "{}",
        job.output()
    );
    let out = job.output();
    let line = out
        .lines()
        .find(|l| l.contains("checkpoint step-") && l.contains("committed"))
        .unwrap_or_else(|| panic!("no checkpoint on SIGTERM:\n{out}"));
    let saved: u64 = line
        .split("checkpoint step-")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    // The step in flight when the signal came may be discarded (a peer stopped first).
    assert!((99..STEPS).contains(&saved), "{line}");
    assert!(dir_has_step(ck.path(), saved));

    let mut resumed = standalone(2, &[], &extra, logs.path());
    assert_eq!(resumed.wait_exit(T).ok(), Some(0), "{}", resumed.output());
    let out = resumed.output();
    assert!(
        out.contains(&format!("resumed from step {saved}")),
        "resumed where it stopped:\n{out}"
    );
    assert_eq!(final_fingerprint(&resumed).unwrap(), (STEPS, expected));
}

fn dir_has_step(dir: &Path, step: u64) -> bool {
    std::fs::read_dir(dir).unwrap().flatten().any(|e| {
        e.file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<u64>().ok())
            == Some(step)
    })
}

#[test]
fn a_whole_job_killed_resumes_from_the_newest_checkpoint() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let extra = strings(&[
        "--checkpoint-dir",
        ck.path().to_str().unwrap(),
        "--checkpoint-every",
        "100",
    ]);
    let mut job = standalone(2, &[], &extra, logs.path());
    job.wait_line(T, step_line(450))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    let workers = [rank_pid(&job, 0).unwrap(), rank_pid(&job, 1).unwrap()];
    wait_for_checkpoint(ck.path(), 400);
    // Every process of the job at once, as a lost machine would.
    kill(job.pid(), libc::SIGKILL);
    for pid in workers {
        kill(pid, libc::SIGKILL);
    }
    assert_eq!(job.wait_exit(T).ok(), Some(128 + libc::SIGKILL));

    let mut resumed = standalone(2, &[], &extra, logs.path());
    assert_eq!(resumed.wait_exit(T).ok(), Some(0), "{}", resumed.output());
    let out = resumed.output();
    let from: u64 = out
        .lines()
        .find_map(|l| l.split("resumed from step ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no resume line:\n{out}"));
    assert!(from >= 400 && from % 100 == 0, "resumed from {from}");
    assert_eq!(final_fingerprint(&resumed).unwrap(), (STEPS, expected));
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn node(args: &[String], logs: &Path) -> Proc {
    let mut all = strings(&["run", "--nproc-per-node", "1", "--log-dir"]);
    all.push(logs.to_str().unwrap().to_string());
    all.extend(args.iter().cloned());
    all.push(ddp());
    all.extend(model_args(STEPS));
    spawn(&all)
}

#[test]
fn two_static_nodes_train_like_one_node_with_two_ranks() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let static_args = |rank: &str| {
        strings(&[
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
        ])
    };
    let mut a = node(&static_args("0"), logs.path());
    let mut b = node(&static_args("1"), logs.path());
    assert_eq!(a.wait_exit(T).ok(), Some(0), "{}", a.output());
    assert_eq!(b.wait_exit(T).ok(), Some(0), "{}", b.output());
    assert_eq!(final_fingerprint(&a).unwrap(), (STEPS, expected));
}

/// The two nodes' jobs, rank 0's node first (each worker prints its rank when it starts).
fn rank0_first<'a>(a: &'a mut Proc, b: &'a mut Proc) -> (&'a mut Proc, &'a mut Proc) {
    a.wait_line(T, |l| l.contains("] rank=")).unwrap();
    b.wait_line(T, |l| l.contains("] rank=")).unwrap();
    if rank_pid(a, 0).is_some() {
        (a, b)
    } else {
        (b, a)
    }
}

fn etcd_node(etcd: &str, job: &str, nnodes: &str, logs: &Path) -> Proc {
    node(
        &strings(&[
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            etcd,
            "--rdzv-id",
            job,
            "--nnodes",
            nnodes,
            "--rdzv-conf",
            "last_call_timeout=0.2,lease_ttl=2",
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "3",
        ]),
        logs,
    )
}

#[test]
fn two_etcd_nodes_train_like_one_node_and_a_killed_worker_rejoins() {
    let expected = reference(2);
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "etcd-two", "2", logs.path());
    let mut b = etcd_node(&etcd.endpoint(), "etcd-two", "2", logs.path());
    let (leader, victim_job) = rank0_first(&mut a, &mut b);
    leader
        .wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", leader.output()));
    let pid = rank_pid(victim_job, 1).expect("rank 1's pid");
    kill(pid, libc::SIGKILL);
    victim_job
        .wait_line(T, |l| l.contains("restarting rank 1 alone"))
        .unwrap_or_else(|_| panic!("no restart:\n{}", victim_job.output()));
    assert_eq!(a.wait_exit(T).ok(), Some(0), "{}", a.output());
    assert_eq!(b.wait_exit(T).ok(), Some(0), "{}", b.output());
    let f = final_fingerprint(&a)
        .or_else(|| final_fingerprint(&b))
        .expect("rank 0 printed the fingerprint");
    assert_eq!(f, (STEPS, expected));
}

#[test]
fn a_node_added_mid_run_is_taken_in_without_restarting_the_first() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "grow", "1:2", logs.path());
    a.wait_line(T, step_line(200))
        .unwrap_or_else(|_| panic!("no progress:\n{}", a.output()));
    let mut b = etcd_node(&etcd.endpoint(), "grow", "1:2", logs.path());
    a.wait_line(T, |l| l.contains("re-formed into round"))
        .unwrap_or_else(|_| panic!("no re-formation:\n{}", a.output()));
    assert_eq!(a.wait_exit(T).ok(), Some(0), "{}", a.output());
    assert_eq!(b.wait_exit(T).ok(), Some(0), "{}", b.output());
    let out = format!("{}\n{}", a.output(), b.output());
    assert!(
        out.contains(": 2 rank(s), state of step"),
        "the grown group formed with the first node's state:\n{out}"
    );
    assert!(
        !a.output().contains("stopping workers to re-form"),
        "the first node's worker kept running:\n{out}"
    );
    let f = final_fingerprint(&a).or_else(|| final_fingerprint(&b));
    assert_eq!(f.map(|(s, _)| s), Some(STEPS));
}

#[test]
fn a_hung_rank_is_replaced_after_the_deadline_and_the_result_is_unchanged() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let extra = strings(&["--op-timeout", "2"]);
    let mut job = standalone(2, &["--max-restarts", "3"], &extra, logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    let pid = rank_pid(&job, 1).expect("rank 1's pid");
    kill(pid, libc::SIGSTOP);
    job.wait_line(T, |l| l.contains("stopped responding (reported by rank 0)"))
        .unwrap_or_else(|_| panic!("the silent rank was not named:\n{}", job.output()));
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let out = job.output();
    assert!(out.contains("restarting rank 1 alone"), "{out}");
    assert_eq!(final_fingerprint(&job).unwrap(), (STEPS, expected));
}

#[test]
fn a_preempted_node_checkpoints_and_leaves_while_the_other_goes_on() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "shrink", "1:2", logs.path());
    let mut b = etcd_node(&etcd.endpoint(), "shrink", "1:2", logs.path());
    let (stays, leaves) = rank0_first(&mut a, &mut b);
    stays
        .wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", stays.output()));
    leaves.signal(libc::SIGTERM);
    assert_eq!(
        leaves.wait_exit(T).ok(),
        Some(128 + libc::SIGTERM),
        "{}",
        leaves.output()
    );
    assert!(
        leaves.output().contains("stopping on signal 15"),
        "{}",
        leaves.output()
    );
    stays
        .wait_line(T, |l| l.contains("re-formed into round"))
        .unwrap_or_else(|_| panic!("no re-formation:\n{}", stays.output()));
    assert_eq!(stays.wait_exit(T).ok(), Some(0), "{}", stays.output());
    let out = stays.output();
    assert!(out.contains(": 1 rank(s), state of step"), "{out}");
    assert_eq!(final_fingerprint(stays).map(|(s, _)| s), Some(STEPS));
}

#[test]
fn a_lost_node_is_dropped_and_the_other_goes_on_at_the_smaller_size() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "lose", "1:2", logs.path());
    let mut b = etcd_node(&etcd.endpoint(), "lose", "1:2", logs.path());
    let (stays, lost) = rank0_first(&mut a, &mut b);
    stays
        .wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", stays.output()));
    let worker = rank_pid(lost, 1).unwrap();
    kill(lost.pid(), libc::SIGKILL);
    kill(worker, libc::SIGKILL);
    assert_eq!(lost.wait_exit(T).ok(), Some(128 + libc::SIGKILL));
    stays
        .wait_line(T, |l| l.contains("re-formed into round"))
        .unwrap_or_else(|_| panic!("no re-formation:\n{}", stays.output()));
    assert_eq!(stays.wait_exit(T).ok(), Some(0), "{}", stays.output());
    let out = stays.output();
    assert!(out.contains(": 1 rank(s), state of step"), "{out}");
    assert!(!out.contains("stopping workers to re-form"), "{out}");
    assert_eq!(final_fingerprint(stays).map(|(s, _)| s), Some(STEPS));
}

#[test]
fn a_lost_node_is_waited_for_when_the_size_is_fixed_and_its_replacement_gets_the_state() {
    let expected = reference(2);
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "fixed", "2", logs.path());
    let mut b = etcd_node(&etcd.endpoint(), "fixed", "2", logs.path());
    let (stays, lost) = rank0_first(&mut a, &mut b);
    stays
        .wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", stays.output()));
    let worker = rank_pid(lost, 1).unwrap();
    kill(lost.pid(), libc::SIGKILL);
    kill(worker, libc::SIGKILL);
    assert_eq!(lost.wait_exit(T).ok(), Some(128 + libc::SIGKILL));
    // The survivor's agent sees the node gone and waits for a second node.
    stays
        .wait_line(T, |l| l.contains("membership changed"))
        .unwrap_or_else(|_| panic!("the loss was not seen:\n{}", stays.output()));
    let mut replacement = etcd_node(&etcd.endpoint(), "fixed", "2", logs.path());
    stays
        .wait_line(T, |l| l.contains("re-formed into round"))
        .unwrap_or_else(|_| panic!("no re-formation:\n{}", stays.output()));
    assert_eq!(stays.wait_exit(T).ok(), Some(0), "{}", stays.output());
    assert_eq!(
        replacement.wait_exit(T).ok(),
        Some(0),
        "{}",
        replacement.output()
    );
    let out = format!("{}\n{}", stays.output(), replacement.output());
    assert!(out.contains(": 2 rank(s), state of step"), "{out}");
    assert!(
        !out.contains(": 1 rank(s)"),
        "the group never shrank:\n{out}"
    );
    let f = final_fingerprint(stays).or_else(|| final_fingerprint(&replacement));
    assert_eq!(f, Some((STEPS, expected)), "{out}");
}

#[test]
fn replacements_killed_while_they_join_still_end_with_the_fault_free_result() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let mut job = standalone(2, &["--max-restarts", "5"], &[], logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    // Kill rank 1, then each replacement as soon as it says it started: during its
    // start-up, its joining, or its first steps.
    for kill_no in 1..=4 {
        let pid = rank_pid(&job, 1).expect("rank 1's pid");
        kill(pid, libc::SIGKILL);
        if kill_no < 4 {
            job.next_line(T, |l| l.contains("] rank=1 pid="))
                .unwrap_or_else(|_| panic!("no replacement:\n{}", job.output()));
        }
    }
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let out = job.output();
    assert!(out.contains("restart 4 of 5"), "{out}");
    assert_eq!(final_fingerprint(&job).unwrap(), (STEPS, expected));
}

#[test]
fn with_etcd_losing_node_0_does_not_take_the_store_down() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_node(&etcd.endpoint(), "lose0", "1:2", logs.path());
    let mut b = etcd_node(&etcd.endpoint(), "lose0", "1:2", logs.path());
    let (lost, stays) = rank0_first(&mut a, &mut b);
    lost.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", lost.output()));
    // Node 0 (the first node of the round, whose agent also serves MASTER_ADDR) goes away.
    let worker = rank_pid(lost, 0).unwrap();
    kill(lost.pid(), libc::SIGKILL);
    kill(worker, libc::SIGKILL);
    assert_eq!(lost.wait_exit(T).ok(), Some(128 + libc::SIGKILL));
    stays
        .wait_line(T, |l| l.contains("re-formed into round"))
        .unwrap_or_else(|_| panic!("no re-formation:\n{}", stays.output()));
    assert_eq!(stays.wait_exit(T).ok(), Some(0), "{}", stays.output());
    let out = stays.output();
    assert!(out.contains(": 1 rank(s), state of step"), "{out}");
    assert!(
        !out.contains("resumed from step"),
        "live state, no checkpoint:\n{out}"
    );
    assert!(!out.contains("stopping workers to re-form"), "{out}");
    assert_eq!(final_fingerprint(stays).map(|(s, _)| s), Some(STEPS));
}

#[test]
fn bad_launcher_environment_is_a_clear_error() {
    let cases: [(&[(&str, &str)], &str); 3] = [
        (&[("RANK", "3"), ("WORLD_SIZE", "2")], "RANK"),
        (&[("RANK", "0"), ("WORLD_SIZE", "two")], "WORLD_SIZE"),
        (&[("RANK", "1"), ("WORLD_SIZE", "2")], "REKINDLE_STORE"),
    ];
    for (env, named) in cases {
        let mut cmd = std::process::Command::new(ddp());
        cmd.args(model_args(10))
            .env_remove("REKINDLE_STORE")
            .envs(env.iter().copied());
        let out = run(cmd, T).unwrap();
        let err = &out.stderr;
        assert_eq!(out.code, 1, "{env:?}: {err}");
        assert!(err.contains(named), "{env:?} should name {named}: {err}");
    }
}

/// Waits (up to `T`) until the checkpoint of `step` is committed under `dir`: checkpoints are
/// written in the background, so on a loaded machine one may still be in flight some steps
/// later.
fn wait_for_checkpoint(dir: &Path, step: u64) {
    let deadline = std::time::Instant::now() + T;
    while !dir_has_step(dir, step) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(dir_has_step(dir, step), "checkpoint {step} committed");
}

#[test]
fn a_corrupt_newest_checkpoint_is_skipped_and_the_result_is_unchanged() {
    let expected = reference(2);
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let extra = strings(&[
        "--checkpoint-dir",
        ck.path().to_str().unwrap(),
        "--checkpoint-every",
        "100",
    ]);
    let mut job = standalone(2, &[], &extra, logs.path());
    job.wait_line(T, step_line(450))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    let workers = [rank_pid(&job, 0).unwrap(), rank_pid(&job, 1).unwrap()];
    wait_for_checkpoint(ck.path(), 400);
    kill(job.pid(), libc::SIGKILL);
    for pid in workers {
        kill(pid, libc::SIGKILL);
    }
    assert_eq!(job.wait_exit(T).ok(), Some(128 + libc::SIGKILL));
    // Flip one byte in the middle of every tensor file of the newest checkpoint.
    let newest = (0..=STEPS)
        .rev()
        .find(|s| dir_has_step(ck.path(), *s))
        .expect("a checkpoint");
    assert!(newest >= 400, "newest checkpoint {newest}");
    let step_dir = ck.path().join(format!("step-{newest}"));
    let mut flipped = 0;
    for entry in std::fs::read_dir(&step_dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let mut bytes = std::fs::read(&path).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            std::fs::write(&path, bytes).unwrap();
            flipped += 1;
        }
    }
    assert!(flipped > 0, "no tensor file in {}", step_dir.display());

    let mut resumed = standalone(2, &[], &extra, logs.path());
    assert_eq!(resumed.wait_exit(T).ok(), Some(0), "{}", resumed.output());
    let out = resumed.output();
    assert!(
        out.contains(&format!("resumed from step {}", newest - 100)),
        "resumed from the previous checkpoint:\n{out}"
    );
    assert!(
        out.contains("does not verify"),
        "the corruption was reported:\n{out}"
    );
    let aside = std::fs::read_dir(ck.path()).unwrap().flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .starts_with(&format!("step-{newest}.corrupt-"))
    });
    assert!(aside, "the corrupt checkpoint was moved aside, not deleted");
    assert_eq!(final_fingerprint(&resumed).unwrap(), (STEPS, expected));
}
