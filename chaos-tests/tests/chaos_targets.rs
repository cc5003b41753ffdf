//! The targets table of docs/chaos.md, one test per row: each runs the scenario through the
//! harness against the bundled `ddp` (real agents, workers, etcd; each node in its own network
//! and mount namespace as root) and requires every invariant to hold. The long versions (100
//! kills, every commit stage) are `#[ignore]`d: `cargo test --workspace --test
//! chaos_targets -- --ignored`, or `scripts/chaos-soak.sh`.

use rekindle_chaos_tests::cluster::NetMode;
use rekindle_chaos_tests::fault::Fault;
use rekindle_chaos_tests::report::Report;
use rekindle_chaos_tests::runner::{Options, RunError};
use rekindle_chaos_tests::{scenario, workload};

/// Runs `name` with `seed` (and `faults`, or the scenario's default); `None` when it needs
/// network namespaces and this is not root.
fn run(name: &str, seed: u64, faults: Option<usize>) -> Option<Report> {
    let ddp = workload::ddp().expect("the ddp binary (cargo build --workspace --bins)");
    let mut opts = Options::new(seed);
    opts.faults = faults;
    let needs_ns = scenario::by_name(name).is_some_and(|s| s.needs_namespaces());
    match scenario::run(name, &ddp, &opts) {
        Ok(report) => {
            eprintln!("{}", report.table());
            assert!(report.passed, "{}", report.table());
            Some(report)
        }
        Err(RunError::Unsupported { .. }) if needs_ns && opts.mode == NetMode::Loopback => {
            eprintln!("skipped {name}: it needs network namespaces (root)");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn sigkill_a_random_worker_three_times() {
    let r = run("kill-worker", 1, Some(3)).unwrap();
    assert_eq!(
        (r.totals.faults, r.totals.recovered, r.totals.hangs),
        (3, 3, 0)
    );
}

#[test]
#[ignore = "the full target (100 kills, about a minute): run with --ignored"]
fn sigkill_a_random_worker_100_times() {
    let r = run("kill-worker", 100, Some(100)).unwrap();
    assert_eq!((r.totals.recovered, r.totals.hangs), (100, 0));
    let median = r.totals.median_next_step_s.unwrap();
    eprintln!("median time from a kill to the next step: {median:.3} s");
}

#[test]
fn sigkill_a_node_of_three_and_restart_it() {
    let r = run("kill-node", 2, None).unwrap();
    assert!(r.checks.iter().any(|c| c.name == "node-rejoins" && c.held));
}

#[test]
fn sigstop_a_worker() {
    run("hang-worker", 3, None);
}

#[test]
fn sigterm_preempts_a_node() {
    run("preempt", 4, None);
}

#[test]
fn kill_during_a_checkpoint_commit_at_three_stages() {
    let r = run("kill-during-commit", 5, Some(3)).unwrap();
    assert_eq!(
        r.checks.iter().filter(|c| c.name == "newest-valid").count(),
        3
    );
}

#[test]
#[ignore = "every one of the nine commit stages (about a minute): run with --ignored"]
fn kill_during_a_checkpoint_commit_at_every_stage() {
    run("kill-during-commit", 5, None);
}

#[test]
fn corrupt_or_truncate_the_newest_checkpoint() {
    let r = run("corrupt-checkpoint", 6, Some(2)).unwrap();
    assert_eq!(
        r.checks
            .iter()
            .filter(|c| c.name == "previous-loaded" && c.held)
            .count(),
        2
    );
}

#[test]
fn etcd_stopped_for_ten_seconds() {
    run("etcd-restart", 7, None);
}

#[test]
fn partition_shorter_than_the_deadline() {
    run("partition-short", 8, None);
}

/// Zero healthy processes killed and zero restarts spent (the partition targets), beyond the
/// scenario's own checks that say the same.
fn nobody_killed(r: &Report) {
    assert_eq!(
        (r.totals.healthy_killed, r.totals.restarts_spent),
        (0, 0),
        "{}",
        r.table()
    );
}

#[test]
fn partition_longer_than_the_deadline_and_the_lease() {
    if let Some(r) = run("partition-long", 9, None) {
        nobody_killed(&r);
    }
}

#[test]
fn partition_longer_than_the_deadline_at_a_fixed_size() {
    if let Some(r) = run("partition-long-fixed", 10, None) {
        nobody_killed(&r);
    }
}

#[test]
fn partition_of_a_static_job_longer_than_the_deadline() {
    if let Some(r) = run("partition-static", 20, None) {
        nobody_killed(&r);
    }
}

#[test]
#[ignore = "the issue's own figures (45 s cut, 30 s deadline; about a minute): run with --ignored"]
fn partition_of_a_static_job_for_45_s_with_a_30_s_deadline() {
    if let Some(r) = run("partition-static-45s", 21, None) {
        nobody_killed(&r);
    }
}

#[test]
fn resize_four_three_four_mid_epoch() {
    run("resize", 11, None);
}

#[test]
fn a_stranger_on_the_collective_ports() {
    run("stranger-data", 12, None);
}

#[test]
fn a_stranger_on_the_store_port() {
    run("stranger-store", 13, None);
}

#[test]
fn a_slow_link() {
    run("slow-link", 14, None);
}

#[test]
fn a_node_added_mid_run() {
    run("add-node", 15, None);
}

#[test]
fn a_short_mixed_schedule() {
    run("mixed", 16, Some(4));
}

#[test]
fn a_node_killed_and_its_new_worker_killed_at_once() {
    // Seed 1926 starts with a node killed (and restarted) and its worker killed in one
    // entry: the kill is aimed at the worker the restarted node starts.
    let name = "mixed";
    let s = scenario::by_name(name).unwrap();
    let (spec, settings) = s.setup(3);
    if NetMode::detect() == NetMode::Namespaces {
        let plan = s.plan(1926, 3, &spec, &settings);
        assert!(
            matches!(
                &plan[0].faults[..],
                [
                    Fault::KillNode {
                        node: 1,
                        restart: true
                    },
                    Fault::KillWorker { node: 1, .. }
                ]
            ),
            "{plan:?}"
        );
    }
    let r = run(name, 1926, Some(3)).unwrap();
    assert_eq!((r.totals.faults, r.totals.hangs), (3, 0));
}
