//! Elastic pipeline parallelism under faults: real `rekindle run` agents, real `pipeline`
//! worker processes (one per stage), real signals, a real etcd. A killed and replaced stage
//! rank must leave the result bit-identical to an undisturbed run; a stage lost for good is
//! re-partitioned over the ranks left; a checkpoint resumes into another stage count.

use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::EtcdServer;
use rekindle_elastic::testing::{field, kill, workspace_bin, Proc};

const T: Duration = Duration::from_secs(180);
const STEPS: u64 = 400;

/// A small model (5 layers) so that a few hundred steps take a few seconds.
fn model_args(steps: u64, stages: usize) -> Vec<String> {
    [
        "--steps",
        &steps.to_string(),
        "--stages",
        &stages.to_string(),
        "--micro-batches",
        "4",
        "--layers",
        "32-64-64-64-64-10",
        "--batch",
        "64",
        "--dataset",
        "4096",
        "--seed",
        "5",
        "--log-every",
        "25",
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn pipeline() -> String {
    workspace_bin("pipeline").unwrap().display().to_string()
}

fn rekindle() -> std::path::PathBuf {
    workspace_bin("rekindle").unwrap()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `rekindle run --standalone --nproc-per-node N [agent] pipeline [model] [extra]`.
fn standalone(
    nproc: usize,
    stages: usize,
    steps: u64,
    agent: &[&str],
    extra: &[String],
    logs: &Path,
) -> Proc {
    let mut args = strings(&["run", "--standalone", "--nproc-per-node"]);
    args.push(nproc.to_string());
    args.extend(strings(&["--log-dir", logs.to_str().unwrap()]));
    args.extend(strings(agent));
    args.push(pipeline());
    args.extend(model_args(steps, stages));
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

/// The fingerprint of an undisturbed run of `stages` stages on `nproc` ranks, `steps` steps
/// (computed once per setting).
fn reference(nproc: usize, stages: usize, steps: u64) -> String {
    type Cache = Mutex<Vec<((usize, usize, u64), String)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    let key = (nproc, stages, steps);
    if let Some((_, f)) = c.iter().find(|(k, _)| *k == key) {
        return f.clone();
    }
    let logs = tempfile::tempdir().unwrap();
    let mut job = standalone(nproc, stages, steps, &[], &[], logs.path());
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let (step, f) = final_fingerprint(&job).expect("a final_step line");
    assert_eq!(step, steps);
    c.push((key, f.clone()));
    f
}

/// The step rank 0 was at when the group failed, and the step the re-formed group took its
/// state from: equal (or later) when no committed step was lost.
fn steps_around_the_failure(out: &str) -> (u64, u64) {
    let num = |l: &str, key: &str| -> Option<u64> {
        l.split(key)
            .nth(1)?
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let failed = out
        .lines()
        .find(|l| l.starts_with("[rank 0]") && l.contains("re-forming the group at step "))
        .and_then(|l| num(l, "re-forming the group at step "))
        .unwrap_or_else(|| panic!("no failure seen by rank 0:\n{out}"));
    let resumed = out
        .lines()
        .filter(|l| l.contains(" generation ") && l.contains("state of step "))
        .nth(1)
        .and_then(|l| num(l, "state of step "))
        .unwrap_or_else(|| panic!("no re-formed group:\n{out}"));
    (failed, resumed)
}

/// `rekindle` with `args`, its output captured.
fn spawn(args: &[String]) -> Proc {
    let mut cmd = std::process::Command::new(rekindle());
    cmd.args(args);
    Proc::spawn(cmd).unwrap()
}

/// The `(final_step, params_sha256)` of the last fingerprint line `job` printed.
fn final_fingerprint(job: &Proc) -> Option<(u64, String)> {
    rekindle_elastic::testing::final_fingerprint(job).map(|f| (f.step, f.sha256))
}

/// The `layers=` field of rank `rank`'s `memory` line (its stage's layers at the end).
fn final_layers(job: &Proc, rank: usize) -> Option<String> {
    let tag = format!("memory rank={rank} ");
    job.lines()
        .iter()
        .rev()
        .find(|l| l.text.contains(&tag))
        .and_then(|l| field(&l.text, "layers").map(str::to_string))
}

#[test]
fn a_killed_middle_stage_is_replaced_from_its_neighbour_and_the_result_is_unchanged() {
    let expected = reference(3, 3, STEPS);
    let logs = tempfile::tempdir().unwrap();
    let mut job = standalone(3, 3, STEPS, &["--max-restarts", "3"], &[], logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    let pid = rank_pid(&job, 1).expect("the middle stage's pid");
    kill(pid, libc::SIGKILL);
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let out = job.output();
    assert!(out.contains("restarting rank 1 alone"), "{out}");
    assert!(
        out.contains("generation 1:"),
        "the group re-formed once:\n{out}"
    );
    assert!(
        !out.contains("from checkpoint"),
        "no checkpoint was involved (there is none):\n{out}"
    );
    assert_eq!(
        final_fingerprint(&job),
        Some((STEPS, expected)),
        "a faulty run must end with the fault-free parameters:\n{out}"
    );
}

#[test]
fn a_killed_rank_of_two_replicas_of_two_stages_is_replaced_and_the_result_is_unchanged() {
    let expected = reference(4, 2, STEPS);
    let logs = tempfile::tempdir().unwrap();
    let mut job = standalone(4, 2, STEPS, &["--max-restarts", "3"], &[], logs.path());
    job.wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    // Rank 3: the last stage of the second replica.
    let pid = rank_pid(&job, 3).expect("rank 3's pid");
    kill(pid, libc::SIGKILL);
    assert_eq!(job.wait_exit(T).ok(), Some(0), "{}", job.output());
    let out = job.output();
    assert!(out.contains("restarting rank 3 alone"), "{out}");
    let (failed, resumed) = steps_around_the_failure(&out);
    assert!(
        resumed >= failed,
        "steps lost: {failed} -> {resumed}\n{out}"
    );
    assert_eq!(final_fingerprint(&job), Some((STEPS, expected)), "{out}");
}

#[test]
fn two_nodes_of_one_stage_each_train_like_one_node_with_two_ranks() {
    let expected = reference(2, 2, STEPS);
    let logs = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let node = |rank: &str| {
        let mut args = strings(&[
            "run",
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--log-dir",
            logs.path().to_str().unwrap(),
        ]);
        args.push(pipeline());
        args.extend(model_args(STEPS, 2));
        spawn(&args)
    };
    let mut a = node("0");
    let mut b = node("1");
    assert_eq!(a.wait_exit(T).ok(), Some(0), "{}", a.output());
    assert_eq!(b.wait_exit(T).ok(), Some(0), "{}", b.output());
    let f = final_fingerprint(&a).or_else(|| final_fingerprint(&b));
    assert_eq!(f, Some((STEPS, expected)));
}

#[test]
fn a_stage_lost_for_good_is_re_partitioned_and_a_node_joining_brings_it_back() {
    const STEPS: u64 = 1500;
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let node = || {
        let mut args = strings(&[
            "run",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            "pipeline-lose",
            "--nnodes",
            "2:3",
            "--rdzv-conf",
            "last_call_timeout=1,lease_ttl=2",
            "--local-addr",
            "127.0.0.1",
            "--log-dir",
            logs.path().to_str().unwrap(),
        ]);
        args.push(pipeline());
        args.extend(model_args(STEPS, 3));
        spawn(&args)
    };
    let mut nodes = vec![node(), node(), node()];
    for n in nodes.iter_mut() {
        n.wait_line(T, |l| l.contains("] rank="))
            .unwrap_or_else(|_| panic!("no worker:\n{}", n.output()));
    }
    let holder = |nodes: &[Proc], r: usize| nodes.iter().position(|n| rank_pid(n, r).is_some());
    let (first, middle) = (holder(&nodes, 0).unwrap(), holder(&nodes, 1).unwrap());
    nodes[first]
        .wait_line(T, step_line(100))
        .unwrap_or_else(|_| panic!("no progress:\n{}", nodes[first].output()));
    // The middle stage's node goes away for good: two stages go on.
    let worker = rank_pid(&nodes[middle], 1).unwrap();
    kill(nodes[middle].pid(), libc::SIGKILL);
    kill(worker, libc::SIGKILL);
    assert_eq!(nodes[middle].wait_exit(T).ok(), Some(128 + libc::SIGKILL));
    nodes[first]
        .wait_line(T, |l| l.contains(": 2 rank(s), state of step"))
        .unwrap_or_else(|_| panic!("no smaller group:\n{}", nodes[first].output()));
    let (failed, resumed) = steps_around_the_failure(&nodes[first].output());
    assert!(resumed >= failed, "steps lost: {failed} -> {resumed}");
    let at = resumed + 100;
    nodes[first]
        .wait_line(T, step_line(at))
        .unwrap_or_else(|_| panic!("no progress at two stages:\n{}", nodes[first].output()));
    // A node joins: the pipeline goes back to three stages, from the two ranks' memory.
    nodes.push(node());
    nodes[first]
        .next_line(T, |l| l.contains(": 3 rank(s), state of step"))
        .unwrap_or_else(|_| panic!("the group did not grow back:\n{}", nodes[first].output()));
    let mut out = String::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        if i != middle {
            assert_eq!(n.wait_exit(T).ok(), Some(0), "{}", n.output());
            out.push_str(&n.output());
            out.push('\n');
        }
    }
    assert!(
        !out.contains("from checkpoint"),
        "no checkpoint involved:\n{out}"
    );
    let fin = final_fingerprint(&nodes[first]).expect("rank 0 ends the run");
    assert_eq!(fin.0, STEPS);
    // Five layers of 2112, 4160, 4160, 4160 and 650 parameters: 0..2 | 2..5 over two
    // stages, 0..2 | 2..3 | 3..5 over three.
    let rank1 = nodes.iter().find_map(|n| final_layers(n, 1));
    assert_eq!(rank1.as_deref(), Some("2..3"), "{out}");
}

#[test]
fn a_checkpoint_of_two_stages_resumes_in_three() {
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let extra = strings(&["--checkpoint-dir", ck.path().to_str().unwrap()]);
    let mut first = standalone(2, 2, 150, &[], &extra, logs.path());
    assert_eq!(first.wait_exit(T).ok(), Some(0), "{}", first.output());
    let mut resumed = standalone(3, 3, STEPS, &[], &extra, logs.path());
    assert_eq!(resumed.wait_exit(T).ok(), Some(0), "{}", resumed.output());
    let out = resumed.output();
    assert!(out.contains("resumed from step 150"), "{out}");
    // Stage boundaries do not change the arithmetic: the result is that of three stages
    // from the start.
    assert_eq!(
        final_fingerprint(&resumed),
        Some((STEPS, reference(3, 3, STEPS))),
        "{out}"
    );
}
