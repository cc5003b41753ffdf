//! rekindle-chaos-tests: the chaos harness. It launches real `rekindle run` jobs (real agents,
//! real worker processes, a real etcd or the embedded store) on several nodes of this machine
//! and attacks them: it kills workers and whole nodes, hangs workers, preempts nodes, kills a
//! job while it commits a checkpoint, damages checkpoints, stops etcd, cuts and slows links,
//! adds nodes and lets strangers knock on the job's ports. After each run it checks the
//! invariants (exit codes, the fault-free fingerprint or loss, every sample once per epoch,
//! etcd left clean, no orphan process, namespace or shared-memory file, every checkpoint
//! valid) and reports each fault with its detection and recovery times.
//!
//! - [`workload`]: the program under test (the bundled `ddp`, or any program printing
//!   `final_step=<N> params_sha256=<hex>`); the extension point for new strategies;
//! - [`cluster`]: the job's nodes, each in its own network namespace as root;
//! - [`fault`]: the faults and their seeded schedules;
//! - [`scenario`]: the scenarios (one per row of the targets table in docs/chaos.md);
//! - [`runner`]: runs a scenario and builds the [`report::Report`];
//! - [`invariants`], [`audit`]: the checks;
//! - the `chaos` binary: `chaos --list`, `chaos --scenario NAME --seed S [-- PROGRAM ARGS]`.
//!
//! ```no_run
//! use rekindle_chaos_tests::{runner::Options, scenario, workload};
//!
//! let ddp = workload::ddp()?;
//! let report = scenario::run("kill-worker", &ddp, &Options::new(7))?;
//! println!("{}", report.table());
//! assert!(report.passed, "{:?}", report.reason);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod audit;
pub mod cluster;
pub mod fault;
pub mod invariants;
pub mod k8s;
mod plot;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod workload;

/// The `pid=` of the newest `rank=<rank> pid=<pid>` line of `job` (what the `ddp` example
/// prints at start).
pub fn rank_pid(job: &rekindle_elastic::testing::Proc, rank: usize) -> Option<i32> {
    let tag = format!("] rank={rank} pid=");
    job.lines()
        .iter()
        .rev()
        .find(|l| l.text.contains(&tag))
        .and_then(|l| rekindle_elastic::testing::field(&l.text, "pid"))
        .and_then(|p| p.parse().ok())
}
