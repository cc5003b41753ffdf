//! The scenarios: each row of the targets table (docs/chaos.md), plus the fault kinds that
//! have no row of their own and the mixed soak.
//!
//! A [`Scenario`] says what job it runs ([`Scenario::setup`]), how the faulty run is compared
//! with the fault-free one ([`Compare`]), what it injects and when ([`Scenario::plan`], a pure
//! function of the seed), and what it checks beyond the common invariants. [`all`] lists them;
//! [`run`] runs one against a [`Workload`], so a new strategy's program gets every scenario
//! by becoming a workload (see [`crate::workload`]).

use std::time::{Duration, Instant};

use rand::Rng;
use rekindle_elastic::testing::{field, Proc, SpawnOptions};
use rekindle_storage::failpoint::SAVE_STAGES;

use crate::cluster::{ClusterError, JobSpec, Rdzv};
use crate::fault::{pick, rng, spread, Damage, Fault, Planned};
use crate::invariants;
use crate::report::{Check, Report};
use crate::runner::{self, Options, Run, RunError};
use crate::workload::{Settings, Workload};

/// How a faulty run is compared with the fault-free run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compare {
    /// Bit-identical parameters (the world size never changes).
    Fingerprint,
    /// The final loss within the stated tolerance (the world size changes).
    Loss,
}

/// A scenario of the chaos harness (see the module docs).
pub trait Scenario: Sync {
    /// The name `chaos --scenario` takes.
    fn name(&self) -> &'static str;
    /// One line: what it does.
    fn about(&self) -> &'static str;
    /// One line: what must hold (the goal of its row in the targets table).
    fn goal(&self) -> &'static str;
    /// Faults injected without `--faults`.
    fn default_faults(&self) -> usize;
    /// The job and the settings of the run, for `faults` faults.
    fn setup(&self, faults: usize) -> (JobSpec, Settings);
    /// The schedule (pure in the seed).
    fn plan(&self, seed: u64, faults: usize, spec: &JobSpec, settings: &Settings) -> Vec<Planned>;
    /// How the result is compared with the fault-free run.
    fn compare(&self) -> Compare {
        Compare::Fingerprint
    }
    /// True when it cuts or slows links (namespaces only).
    fn needs_namespaces(&self) -> bool {
        false
    }
    /// True when the sample audit must be there (not only checked when present).
    fn audit_required(&self) -> bool {
        false
    }
    /// Whether it can run `workload`; the reason if not.
    fn check(&self, _workload: &Workload) -> Result<(), String> {
        Ok(())
    }
    /// Starts the job and injects the plan (the default), or a flow of its own.
    fn drive(&self, run: &mut Run) -> Result<(), ClusterError> {
        run.start_and_execute()
    }
    /// Checks of its own after the run.
    fn extra_checks(&self, _run: &Run) -> Vec<Check> {
        Vec::new()
    }
}

/// Every scenario, in the order of the targets table.
pub fn all() -> Vec<&'static dyn Scenario> {
    vec![
        &KillWorker,
        &KillNode,
        &HangWorker,
        &Preempt,
        &KillDuringCommit,
        &CorruptCheckpoint,
        &EtcdRestart,
        &PartitionShort,
        &PartitionLong,
        &PartitionLongFixed,
        &PARTITION_STATIC,
        &PARTITION_STATIC_45S,
        &Resize,
        &StrangerData,
        &StrangerStore,
        &SlowLink,
        &AddNode,
        &Mixed,
        &K8S_PODS,
        &K8S_PODS_FIXED,
    ]
}

/// The scenario called `name`.
pub fn by_name(name: &str) -> Option<&'static dyn Scenario> {
    all().into_iter().find(|s| s.name() == name)
}

/// Runs the scenario `name` (see [`runner::run`]).
pub fn run(name: &str, workload: &Workload, opts: &Options) -> Result<Report, RunError> {
    let s = by_name(name).ok_or_else(|| RunError::Unsupported {
        scenario: name.into(),
        reason: "no such scenario (chaos --list)".into(),
    })?;
    runner::run(s, workload, opts)
}

fn needs_checkpoints(w: &Workload) -> Result<(), String> {
    if w.uses("{checkpoint_dir}") {
        Ok(())
    } else {
        Err("the program must checkpoint into {checkpoint_dir} (pass it in its arguments)".into())
    }
}

fn settings(steps: u64, checkpoint_every: u64, op_timeout: f64) -> Settings {
    Settings {
        steps,
        checkpoint_every,
        op_timeout,
    }
}

/// One planned fault per step drawn by [`spread`] in `lo..hi`.
fn each(
    seed: u64,
    n: usize,
    lo: u64,
    hi: u64,
    mut make: impl FnMut(&mut rand_chacha::ChaCha8Rng, usize) -> Fault,
) -> Vec<Planned> {
    let mut r = rng(seed);
    let steps = spread(&mut r, n, lo, hi);
    steps
        .into_iter()
        .enumerate()
        .map(|(i, at_step)| Planned {
            at_step,
            faults: vec![make(&mut r, i)],
        })
        .collect()
}

/// The first line of the log after `since` containing `needle`, as seconds after `since`.
fn secs_to(run: &Run, since: Instant, needle: &str) -> Option<f64> {
    run.cluster
        .find_after(since, &[needle])
        .map(|l| l.at.saturating_duration_since(since).as_secs_f64())
}

/// The partition invariants: nobody was killed as silent who had not been stopped by the
/// harness, and no restart was spent (no process failed).
fn nobody_killed(run: &Run) -> Vec<Check> {
    let (restarts, healthy) = crate::runner::restarts_and_evictions(run);
    vec![
        Check::new(
            "no-healthy-killed",
            healthy == 0,
            format!("{healthy} healthy process(es) killed as silent"),
        ),
        Check::new(
            "no-restart-spent",
            restarts == 0,
            format!("{restarts} restart(s) spent"),
        ),
    ]
}

/// Lines after `since` containing `needle`.
fn count_after(run: &Run, since: Instant, needle: &str) -> usize {
    run.cluster
        .log()
        .iter()
        .filter(|l| l.at >= since && l.text.contains(needle))
        .count()
}

/// SIGKILL a random worker at a random step.
pub struct KillWorker;

impl Scenario for KillWorker {
    fn name(&self) -> &'static str {
        "kill-worker"
    }
    fn about(&self) -> &'static str {
        "SIGKILL a random worker of a 2-rank job at a random step, N times"
    }
    fn goal(&self) -> &'static str {
        "every kill recovered, 0 hangs, fingerprint equal to the fault-free run's"
    }
    fn default_faults(&self) -> usize {
        3
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::standalone(2);
        spec.max_restarts = faults as u32 + 2;
        (spec, settings(300 + 40 * faults as u64, 100, 30.0))
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nproc = spec.nproc_per_node;
        each(seed, n, 30, s.steps - 30, |r, _| Fault::KillWorker {
            node: 0,
            local_rank: r.gen_range(0..nproc),
        })
    }
}

/// SIGKILL a whole node of a 3-node elastic etcd job, then start it again.
pub struct KillNode;

impl Scenario for KillNode {
    fn name(&self) -> &'static str {
        "kill-node"
    }
    fn about(&self) -> &'static str {
        "SIGKILL an agent and its worker (a node) of a 3-node etcd job, --nnodes 2:3; restart it"
    }
    fn goal(&self) -> &'static str {
        "the 2 left go on within 2 x lease TTL; the node rejoins when restarted"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        (
            JobSpec::etcd(3, "2:3"),
            settings(1200 + 600 * faults as u64, 100, 30.0),
        )
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, n, 100, s.steps - 500, |r, _| Fault::KillNode {
            node: r.gen_range(0..nodes),
            restart: true,
        })
    }
    fn compare(&self) -> Compare {
        Compare::Loss
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let ttl = match &run.cluster.spec().rdzv {
            Rdzv::Etcd { lease_ttl, .. } => *lease_ttl as f64,
            _ => 0.0,
        };
        let mut out = Vec::new();
        for inj in &run.injected {
            let Fault::KillNode { node, .. } = inj.fault else {
                continue;
            };
            // The survivors' next step: the first step line of another node after the kill.
            let next = run
                .cluster
                .progress()
                .iter()
                .find(|(t, _)| *t > inj.at)
                .map(|(t, _)| t.saturating_duration_since(inj.at).as_secs_f64());
            out.push(Check::new(
                "survivors-go-on",
                next.is_some_and(|s| s <= 2.0 * ttl),
                format!(
                    "node {node} killed; next step after {} (bound 2 x TTL = {:.1} s)",
                    next.map_or("never".into(), |s| format!("{s:.2} s")),
                    2.0 * ttl
                ),
            ));
        }
        for (node, at) in &run.restarts {
            let rejoined = secs_to(run, *at, ": 3 rank(s)");
            out.push(Check::new(
                "node-rejoins",
                rejoined.is_some(),
                format!(
                    "node {node} restarted; group of 3 formed {}",
                    rejoined.map_or("never".into(), |s| format!("{s:.2} s later"))
                ),
            ));
        }
        out
    }
}

/// SIGSTOP a worker: caught by the collective deadline and replaced.
pub struct HangWorker;

impl Scenario for HangWorker {
    fn name(&self) -> &'static str {
        "hang-worker"
    }
    fn about(&self) -> &'static str {
        "SIGSTOP a random worker of a 2-rank job for 10 s (collective deadline 2 s)"
    }
    fn goal(&self) -> &'static str {
        "detected by the deadline, the group re-forms without it, it is replaced; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::standalone(2);
        spec.max_restarts = faults as u32 + 2;
        (spec, settings(600 + 200 * faults as u64, 100, 2.0))
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nproc = spec.nproc_per_node;
        // Stopped for longer than the survivor's wait (twice the deadline plus a second).
        let secs = s.op_timeout * 2.0 + 6.0;
        each(seed, n, 50, s.steps - 100, |r, _| Fault::HangWorker {
            node: 0,
            local_rank: r.gen_range(0..nproc),
            secs,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        // The collective that the stopped rank misses fails at the deadline; its agent sees the
        // process stopped and kills it at once: killed and replaced within the deadline plus
        // a second.
        let bound = run.cluster.settings().op_timeout + 1.0;
        run.injected
            .iter()
            .map(|inj| {
                let killed = secs_to(run, inj.at, "stopped responding");
                let replaced = secs_to(run, inj.at, "restarting rank");
                Check::new(
                    "hang-detected",
                    replaced.is_some_and(|s| s <= bound) && killed.is_some(),
                    format!(
                        "stopped rank killed after {}, replaced after {} (bound {bound:.1} s)",
                        killed.map_or("never".into(), |s| format!("{s:.2} s")),
                        replaced.map_or("never".into(), |s| format!("{s:.2} s"))
                    ),
                )
            })
            .collect()
    }
}

/// SIGTERM to a node of a 2-node elastic job (spot preemption).
pub struct Preempt;

impl Scenario for Preempt {
    fn name(&self) -> &'static str {
        "preempt"
    }
    fn about(&self) -> &'static str {
        "SIGTERM (spot preemption) to one node of a 2-node etcd job, --nnodes 1:2, grace 30 s"
    }
    fn goal(&self) -> &'static str {
        "checkpoint committed within the grace period, clean leave, the other continues"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        (JobSpec::etcd(2, "1:2"), settings(1500, 100, 30.0))
    }
    fn plan(&self, seed: u64, _n: usize, spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, 1, 200, 600, |r, _| Fault::Preempt {
            node: r.gen_range(0..nodes),
        })
    }
    fn compare(&self) -> Compare {
        Compare::Loss
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let grace = run.cluster.spec().grace_period;
        let mut out = Vec::new();
        for inj in &run.injected {
            let Fault::Preempt { node } = inj.fault else {
                continue;
            };
            let saved = run
                .cluster
                .log()
                .iter()
                .find(|l| {
                    l.at >= inj.at
                        && l.node == node
                        && l.text.contains("stopping on signal")
                        && l.text.contains("committed")
                })
                .map(|l| {
                    (
                        l.at.saturating_duration_since(inj.at).as_secs_f64(),
                        l.text.clone(),
                    )
                });
            out.push(Check::new(
                "checkpoint-in-grace",
                saved.as_ref().is_some_and(|(s, _)| *s <= grace),
                saved.map_or("no checkpoint on the signal".into(), |(s, l)| {
                    format!("{s:.2} s after SIGTERM (grace {grace} s): {l}")
                }),
            ));
            let others_on = run.cluster.log().iter().any(|l| {
                l.at > inj.at && l.node != node && crate::cluster::step_of(&l.text).is_some()
            });
            out.push(Check::new(
                "others-continue",
                others_on,
                if others_on {
                    "the other node trained on"
                } else {
                    "no step on the other node after the preemption"
                },
            ));
        }
        out
    }
}

/// Every process killed while rank 0 commits a checkpoint, at each commit stage.
pub struct KillDuringCommit;

impl Scenario for KillDuringCommit {
    fn name(&self) -> &'static str {
        "kill-during-commit"
    }
    fn about(&self) -> &'static str {
        "kill every process of a 2-rank job while rank 0 commits a checkpoint, paused at a commit stage (storage failpoints)"
    }
    fn goal(&self) -> &'static str {
        "old or new checkpoint valid, never a corrupt latest; fingerprint equal after resuming"
    }
    fn default_faults(&self) -> usize {
        SAVE_STAGES.len()
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        (
            JobSpec::standalone(2),
            settings(50 * (faults as u64 + 3), 50, 30.0),
        )
    }
    fn plan(&self, seed: u64, n: usize, _spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        // Every stage once, in order, when n covers them; else n stages drawn by the seed.
        let stages: Vec<&str> = if n >= SAVE_STAGES.len() {
            SAVE_STAGES.to_vec()
        } else {
            let mut r = rng(seed);
            let mut v: Vec<&str> = SAVE_STAGES.to_vec();
            while v.len() > n {
                let i = r.gen_range(0..v.len());
                v.remove(i);
            }
            v
        };
        stages
            .into_iter()
            .map(|stage| Planned {
                at_step: 0,
                faults: vec![Fault::KillDuringCommit {
                    stage: stage.into(),
                }],
            })
            .collect()
    }
    fn check(&self, w: &Workload) -> Result<(), String> {
        needs_checkpoints(w)?;
        if w.has_failpoints() {
            Ok(())
        } else {
            Err(format!(
                "{} was built without the storage failpoints: cargo build --workspace --bins --features rekindle-storage/failpoints",
                w.program.display()
            ))
        }
    }
    fn drive(&self, run: &mut Run) -> Result<(), ClusterError> {
        const FAILPOINT: &str = rekindle_storage::failpoint::FAILPOINT_ENV;
        let plan = run.plan.clone();
        for entry in &plan {
            for fault in &entry.faults {
                let Fault::KillDuringCommit { stage } = fault else {
                    continue;
                };
                run.cluster.set_env(FAILPOINT, &format!("{stage}=pause"));
                run.cluster.start_all()?;
                let t_start = Instant::now();
                let reached = run.cluster.wait_line_after(
                    t_start,
                    &[&format!("REKINDLE_FAILPOINT_REACHED {stage}")],
                    run.hang_after,
                );
                let Some(line) = reached else {
                    run.checks.push(Check::fail(
                        "commit-stage-reached",
                        format!("rank 0 never reached {stage}"),
                    ));
                    return Ok(());
                };
                let step_before = run.cluster.step();
                run.cluster.kill_all(Duration::from_secs(30))?;
                let dir = run.cluster.files().checkpoint_dir.clone();
                run.checks.push(match invariants::newest_verifies(&dir) {
                    Ok(s) => Check::pass(
                        "newest-valid",
                        format!(
                            "killed at {stage}: newest committed checkpoint {}",
                            s.map_or("none".into(), |s| format!("step-{s} verifies"))
                        ),
                    ),
                    Err(e) => Check::fail("newest-valid", format!("killed at {stage}: {e}")),
                });
                run.injected.push(runner::Injected {
                    fault: fault.clone(),
                    at: line.at,
                    healed: None,
                    step_before,
                    recovered: true,
                });
            }
        }
        run.cluster.unset_env(FAILPOINT);
        run.cluster.start_all()?;
        Ok(())
    }
}

/// The newest checkpoint damaged while the job is down.
pub struct CorruptCheckpoint;

impl Scenario for CorruptCheckpoint {
    fn name(&self) -> &'static str {
        "corrupt-checkpoint"
    }
    fn about(&self) -> &'static str {
        "kill every rank of a 2-rank job, flip a byte in or truncate the newest checkpoint, start again"
    }
    fn goal(&self) -> &'static str {
        "previous checkpoint loaded, warning given; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        2
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        (
            JobSpec::standalone(2),
            settings(600 + 300 * faults as u64, 100, 30.0),
        )
    }
    fn plan(&self, seed: u64, n: usize, _spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        // Past two checkpoints, and each after the next one since the last damage.
        each(seed, n, 250, s.steps - 150, |r, i| {
            Fault::CorruptCheckpoint {
                damage: if (i + r.gen_range(0..2usize)) % 2 == 0 {
                    Damage::Flip
                } else {
                    Damage::Truncate
                },
            }
        })
    }
    fn check(&self, w: &Workload) -> Result<(), String> {
        needs_checkpoints(w)
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let damaged: Vec<&Check> = run.checks.iter().filter(|c| c.name == "damaged").collect();
        run.injected
            .iter()
            .zip(damaged)
            .map(|(inj, d)| {
                let previous = d.detail.rsplit("step-").next().unwrap_or("");
                let warned = secs_to(run, inj.at, "does not verify").is_some();
                let resumed = secs_to(run, inj.at, &format!("resumed from step {previous} "));
                Check::new(
                    "previous-loaded",
                    warned && resumed.is_some(),
                    format!(
                        "{}: warning {}, resumed from step {previous} {}",
                        d.detail,
                        if warned { "given" } else { "missing" },
                        if resumed.is_some() { "yes" } else { "no" }
                    ),
                )
            })
            .collect()
    }
}

/// etcd stopped for 10 s under a 2-node job.
pub struct EtcdRestart;

impl Scenario for EtcdRestart {
    fn name(&self) -> &'static str {
        "etcd-restart"
    }
    fn about(&self) -> &'static str {
        "stop etcd for 10 s under a fixed 2-node etcd job, then start it again"
    }
    fn goal(&self) -> &'static str {
        "training continues or pauses, then resumes; nothing lost; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(2, "2");
        spec.rdzv = Rdzv::Etcd {
            nnodes: "2".into(),
            lease_ttl: 3,
        };
        (spec, settings(1500 + 500 * faults as u64, 100, 30.0))
    }
    fn plan(&self, seed: u64, n: usize, _spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        each(seed, n, 100, s.steps / 2, |_, _| Fault::EtcdDown {
            secs: 10.0,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let reformed = run
            .injected
            .first()
            .map_or(0, |i| count_after(run, i.at, "re-forming the group"));
        vec![Check::new(
            "nothing-lost",
            reformed == 0,
            format!("{reformed} group re-formation(s) after etcd went down"),
        )]
    }
}

/// A node cut off for less than the collective deadline.
pub struct PartitionShort;

impl Scenario for PartitionShort {
    fn name(&self) -> &'static str {
        "partition-short"
    }
    fn about(&self) -> &'static str {
        "cut one node of a fixed 2-node etcd job off for 2 s (collective deadline 6 s, lease TTL 5 s)"
    }
    fn goal(&self) -> &'static str {
        "no re-form; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn needs_namespaces(&self) -> bool {
        true
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(2, "2");
        spec.rdzv = Rdzv::Etcd {
            nnodes: "2".into(),
            lease_ttl: 5,
        };
        (spec, settings(1200 + 300 * faults as u64, 100, 6.0))
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, n, 100, s.steps - 300, |r, _| Fault::Partition {
            node: r.gen_range(0..nodes),
            secs: 2.0,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(first) = run.injected.first() else {
            return Vec::new();
        };
        let reforms = count_after(run, first.at, "re-forming")
            + count_after(run, first.at, "membership changed");
        let mut checks = vec![Check::new(
            "no-re-form",
            reforms == 0,
            format!("{reforms} re-formation line(s) after the cut"),
        )];
        checks.extend(nobody_killed(run));
        checks
    }
}

/// A node of an elastic job cut off for longer than the deadline and the lease TTL.
pub struct PartitionLong;

impl Scenario for PartitionLong {
    fn name(&self) -> &'static str {
        "partition-long"
    }
    fn about(&self) -> &'static str {
        "cut one node of a 3-node etcd job (--nnodes 2:3) off for 6 s (deadline 3 s, lease TTL 2 s), then heal"
    }
    fn goal(&self) -> &'static str {
        "the two go on without it, it stops training and rejoins after healing; nobody killed, no restart spent; loss within tolerance"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn needs_namespaces(&self) -> bool {
        true
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(3, "2:3");
        spec.max_restarts = 6;
        // Enough steps that the two left are still training when the link comes back.
        (spec, settings(8000, 500, 3.0))
    }
    fn plan(&self, seed: u64, _n: usize, spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, 1, 100, 300, |r, _| Fault::Partition {
            node: r.gen_range(0..nodes),
            secs: 6.0,
        })
    }
    fn compare(&self) -> Compare {
        Compare::Loss
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(inj) = run.injected.first() else {
            return Vec::new();
        };
        let healed = inj.healed.unwrap_or(inj.at);
        let without = run
            .cluster
            .log()
            .iter()
            .any(|l| l.at > inj.at && l.at < healed && l.text.contains(": 2 rank(s)"));
        let rejoined = secs_to(run, healed, ": 3 rank(s)");
        let mut checks = nobody_killed(run);
        checks.extend([
            Check::new(
                "re-form-without-it",
                without,
                if without {
                    "a group of 2 formed while the node was cut off"
                } else {
                    "no group of 2 while the node was cut off"
                },
            ),
            Check::new(
                "rejoin-after-heal",
                rejoined.is_some(),
                rejoined.map_or("no group of 3 after healing".into(), |s| {
                    format!("group of 3 {s:.2} s after healing")
                }),
            ),
        ]);
        checks
    }
}

/// A node of a fixed-size job cut off for longer than the deadline.
pub struct PartitionLongFixed;

impl Scenario for PartitionLongFixed {
    fn name(&self) -> &'static str {
        "partition-long-fixed"
    }
    fn about(&self) -> &'static str {
        "cut one node of a fixed 3-node etcd job off from the others and etcd for 8 s (deadline 3 s, lease TTL 2 s), then heal"
    }
    fn goal(&self) -> &'static str {
        "the others wait; the group re-forms after healing; nobody killed, no restart spent; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn needs_namespaces(&self) -> bool {
        true
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(3, "3");
        spec.max_restarts = 6;
        (spec, settings(1500, 100, 3.0))
    }
    fn plan(&self, seed: u64, _n: usize, spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, 1, 100, 300, |r, _| Fault::Partition {
            node: r.gen_range(0..nodes),
            secs: 8.0,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(inj) = run.injected.first() else {
            return Vec::new();
        };
        let healed = inj.healed.unwrap_or(inj.at);
        let formed = secs_to(run, healed, ": 3 rank(s)");
        let smaller = run
            .cluster
            .log()
            .iter()
            .any(|l| l.at > inj.at && l.text.contains(": 2 rank(s)"));
        let mut checks = nobody_killed(run);
        checks.extend([
            Check::new(
                "others-wait",
                !smaller,
                if smaller {
                    "a group of 2 formed without the cut-off node"
                } else {
                    "no group formed without the cut-off node"
                },
            ),
            Check::new(
                "re-form-after-heal",
                formed.is_some(),
                formed.map_or("no group formed after healing".into(), |s| {
                    format!("group of 3 formed {s:.2} s after healing")
                }),
            ),
        ]);
        checks
    }
}

/// A node of a static 2-node job (node 0's embedded store) cut off for longer than the
/// collective deadline: both ranks time out and report each other.
pub struct PartitionStatic {
    name: &'static str,
    cut: f64,
    op_timeout: f64,
}

/// `partition-static`: cut 8 s, deadline 3 s (the CI selection).
pub const PARTITION_STATIC: PartitionStatic = PartitionStatic {
    name: "partition-static",
    cut: 8.0,
    op_timeout: 3.0,
};

/// `partition-static-45s`: cut 45 s, deadline 30 s (the defaults of a real job).
pub const PARTITION_STATIC_45S: PartitionStatic = PartitionStatic {
    name: "partition-static-45s",
    cut: 45.0,
    op_timeout: 30.0,
};

impl Scenario for PartitionStatic {
    fn name(&self) -> &'static str {
        self.name
    }
    fn about(&self) -> &'static str {
        if self.cut > 10.0 {
            "cut node 1 of a static 2-node job (one worker each) off for 45 s (deadline 30 s), then heal"
        } else {
            "cut node 1 of a static 2-node job (one worker each) off for 8 s (deadline 3 s), then heal"
        }
    }
    fn goal(&self) -> &'static str {
        "no worker killed, no restart spent; the group re-forms after healing; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn needs_namespaces(&self) -> bool {
        true
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::standalone(1);
        spec.nodes = 2;
        spec.rdzv = Rdzv::Static;
        (spec, settings(1500, 100, self.op_timeout))
    }
    fn plan(&self, seed: u64, _n: usize, _spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        let cut = self.cut;
        each(seed, 1, 100, 300, |_, _| Fault::Partition {
            node: 1,
            secs: cut,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(inj) = run.injected.first() else {
            return Vec::new();
        };
        let healed = inj.healed.unwrap_or(inj.at);
        let formed = secs_to(run, healed, ": 2 rank(s)");
        let mut checks = nobody_killed(run);
        checks.push(Check::new(
            "re-form-after-heal",
            formed.is_some(),
            formed.map_or("no group formed after healing".into(), |s| {
                format!("group of 2 formed {s:.2} s after healing")
            }),
        ));
        checks
    }
}

/// 4 ranks, one preempted mid-epoch, a new node mid-epoch.
pub struct Resize;

impl Scenario for Resize {
    fn name(&self) -> &'static str {
        "resize"
    }
    fn about(&self) -> &'static str {
        "a 4-node etcd job (--nnodes 3:4): one node preempted mid-epoch (4 -> 3), a new node added mid-epoch (3 -> 4)"
    }
    fn goal(&self) -> &'static str {
        "every sample exactly once per epoch; loss within tolerance"
    }
    fn default_faults(&self) -> usize {
        2
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        (JobSpec::etcd(4, "3:4"), settings(1000, 100, 30.0))
    }
    fn plan(&self, seed: u64, _n: usize, spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        let mut r = rng(seed);
        // Mid-epoch: away from the 64-step epoch boundaries of the bundled ddp.
        let mid = |r: &mut rand_chacha::ChaCha8Rng, epoch: u64| epoch * 64 + r.gen_range(16..48);
        let ea = r.gen_range(2..5);
        let a = mid(&mut r, ea);
        let eb = r.gen_range(7..10);
        let b = mid(&mut r, eb);
        vec![
            Planned {
                at_step: a,
                faults: vec![Fault::Preempt {
                    node: r.gen_range(1..spec.nodes),
                }],
            },
            Planned {
                at_step: b,
                faults: vec![Fault::AddNode],
            },
        ]
    }
    fn compare(&self) -> Compare {
        Compare::Loss
    }
    fn audit_required(&self) -> bool {
        true
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let sizes = group_sizes(run);
        let ok = sizes.windows(3).any(|w| w == [4, 3, 4]);
        vec![Check::new(
            "sizes",
            ok,
            format!("group sizes in order: {sizes:?}"),
        )]
    }
}

/// The group sizes in the order the job formed them (rank 0's `N rank(s)` lines).
fn group_sizes(run: &Run) -> Vec<usize> {
    let mut sizes: Vec<usize> = Vec::new();
    for l in run.cluster.log() {
        let Some(n) = l
            .text
            .split(" rank(s)")
            .next()
            .and_then(|h| h.rsplit(": ").next())
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if sizes.last() != Some(&n) {
            sizes.push(n);
        }
    }
    sizes
}

/// The Kubernetes workload (`examples/k8s/train.yaml`) as pods in network namespaces (see
/// [`crate::k8s`]): with `resize`, scale down by deleting the highest-index pod, then scale up
/// by adding one; without, two pods train to the end undisturbed.
pub struct K8sPods {
    resize: bool,
}

/// `k8s-pods`: scale down, then up.
pub const K8S_PODS: K8sPods = K8sPods { resize: true };

/// `k8s-pods-fixed`: two pods, no fault.
pub const K8S_PODS_FIXED: K8sPods = K8sPods { resize: false };

impl Scenario for K8sPods {
    fn name(&self) -> &'static str {
        if self.resize {
            "k8s-pods"
        } else {
            "k8s-pods-fixed"
        }
    }
    fn about(&self) -> &'static str {
        if self.resize {
            "examples/k8s/train.yaml's training pods (their own command line and environment, the Downward API values filled in) as 2 pods against etcd; the highest-index pod deleted mid-run (SIGTERM: scale down), a third pod added (scale up); run with --workload k8s"
        } else {
            "examples/k8s/train.yaml's training pods as 2 pods against etcd, undisturbed; run with --workload k8s"
        }
    }
    fn goal(&self) -> &'static str {
        if self.resize {
            "the job finishes; group sizes 4, 2, 4; no sample twice in an epoch; loss within tolerance"
        } else {
            "the job finishes with the fingerprint of the same ranks on one host"
        }
    }
    fn default_faults(&self) -> usize {
        if self.resize {
            2
        } else {
            0
        }
    }
    fn needs_namespaces(&self) -> bool {
        // Every pod's agent listens on the manifest's own health port.
        true
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        let pod = crate::k8s::PodTemplate::load().ok();
        let nproc = pod
            .as_ref()
            .and_then(|p| {
                p.agent_args
                    .iter()
                    .find_map(|a| a.strip_prefix("--nproc-per-node="))
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(1);
        let mut spec = JobSpec::etcd(2, "1:4");
        spec.nproc_per_node = nproc;
        spec.pod = pod;
        (spec, settings(240, 100, 30.0))
    }
    fn plan(&self, seed: u64, _n: usize, _spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        if !self.resize {
            return Vec::new();
        }
        let mut r = rng(seed);
        vec![
            Planned {
                at_step: r.gen_range(30..50),
                faults: vec![Fault::Preempt { node: 1 }],
            },
            Planned {
                at_step: r.gen_range(110..130),
                faults: vec![Fault::AddNode],
            },
        ]
    }
    fn compare(&self) -> Compare {
        if self.resize {
            Compare::Loss
        } else {
            Compare::Fingerprint
        }
    }
    fn audit_required(&self) -> bool {
        true
    }
    fn check(&self, workload: &Workload) -> Result<(), String> {
        crate::k8s::PodTemplate::load().map_err(|e| e.to_string())?;
        if workload.name != "k8s" {
            return Err("k8s-pods runs the manifest's own program: use --workload k8s".into());
        }
        Ok(())
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let sizes = group_sizes(run);
        let per_pod = run.cluster.spec().nproc_per_node;
        if !self.resize {
            // The manifest's range is elastic; the fingerprint compared is that of the full
            // group, so the run must have formed it once and kept it.
            let want = [2 * per_pod];
            return vec![Check::new(
                "one-full-group",
                sizes == want,
                format!("group sizes in order: {sizes:?} (want {want:?})"),
            )];
        }
        let want = [2 * per_pod, per_pod, 2 * per_pod];
        let ok = sizes.windows(3).any(|w| w == want);
        vec![Check::new(
            "scaled-down-and-up",
            ok,
            format!("group sizes in order: {sizes:?} (want {want:?} in a row)"),
        )]
    }
}

/// The `chaos-stranger` process, on a host of its own in namespace mode.
fn stranger(run: &mut Run, args: &[String]) -> Result<Proc, ClusterError> {
    let bin = rekindle_elastic::testing::workspace_bin("chaos-stranger")
        .map_err(|e| ClusterError::Unsupported(format!("the chaos-stranger binary: {e}")))?;
    let mut cmd = run.cluster.outsider_command(&bin)?;
    cmd.args(args)
        // Not the job's secret.
        .env("REKINDLE_SECRET", "a-stranger-does-not-know-the-secret");
    // Its own tag: it is no process of the job, and ending it must not end the job.
    let opts = SpawnOptions {
        name: Some("stranger".into()),
        ..SpawnOptions::default()
    };
    Ok(Proc::spawn_with(cmd, &opts)?)
}

fn stranger_outcomes(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .filter(|l| l.starts_with("stranger "))
        .filter_map(|l| {
            Some((
                field(l, "target")?.to_string(),
                field(l, "outcome")?.to_string(),
            ))
        })
        .collect()
}

/// A foreign process connects to the collectives' ports with a wrong secret.
pub struct StrangerData;

impl Scenario for StrangerData {
    fn name(&self) -> &'static str {
        "stranger-data"
    }
    fn about(&self) -> &'static str {
        "a foreign process with a wrong secret connects to every collective port the moment it is published, while workers are killed to re-form the group"
    }
    fn goal(&self) -> &'static str {
        "refused and logged, results unchanged"
    }
    fn default_faults(&self) -> usize {
        3
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(2, "2");
        spec.max_restarts = faults as u32 + 2;
        (spec, settings(600 + 100 * faults as u64, 100, 30.0))
    }
    fn plan(&self, seed: u64, n: usize, _spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        each(seed, n, 50, s.steps - 100, |r, _| Fault::KillWorker {
            node: r.gen_range(0..2),
            local_rank: 0,
        })
    }
    fn drive(&self, run: &mut Run) -> Result<(), ClusterError> {
        let endpoint = run
            .cluster
            .etcd()
            .map(|e| e.endpoint())
            .ok_or_else(|| ClusterError::Unsupported("the job uses no etcd".into()))?;
        let args = vec![
            "data".to_string(),
            "--etcd".into(),
            endpoint,
            "--job".into(),
            run.cluster.job().to_string(),
        ];
        let mut s = stranger(run, &args)?;
        s.wait_for("stranger watching", run.hang_after)?;
        run.start_and_execute()?;
        let exits = run.cluster.finish(Duration::from_secs(600));
        drop(exits);
        s.signal(libc::SIGTERM);
        let _ = s.wait_exit(Duration::from_secs(10));
        let lines: Vec<String> = s.lines().into_iter().map(|l| l.text).collect();
        let outcomes = stranger_outcomes(&lines);
        let accepted = outcomes.iter().filter(|(_, o)| o == "accepted").count();
        let by_secret = outcomes
            .iter()
            .filter(|(_, o)| o == "refused-secret")
            .count();
        let logged = run
            .cluster
            .log()
            .iter()
            .filter(|l| l.text.contains("refused a connection") && l.text.contains("secret"))
            .count();
        run.checks.push(Check::new(
            "stranger-refused",
            accepted == 0 && !outcomes.is_empty(),
            format!(
                "{} attempt(s): {by_secret} refused by the handshake (wrong secret), {} found no listener or were reset, {accepted} accepted",
                outcomes.len(),
                outcomes.len() - by_secret - accepted
            ),
        ));
        run.checks.push(Check::new(
            "stranger-reached-handshake",
            by_secret > 0,
            format!("{by_secret} attempt(s) reached a listener and were refused"),
        ));
        run.checks.push(Check::new(
            "stranger-logged",
            by_secret == 0 || logged > 0,
            format!("{logged} refusal line(s) in the job's log"),
        ));
        Ok(())
    }
}

/// A foreign process connects to the embedded store with a wrong secret.
pub struct StrangerStore;

impl Scenario for StrangerStore {
    fn name(&self) -> &'static str {
        "stranger-store"
    }
    fn about(&self) -> &'static str {
        "a foreign process with a wrong secret connects to node 0's embedded store of a static 2-node job and tries to write and read"
    }
    fn goal(&self) -> &'static str {
        "refused and logged, results unchanged"
    }
    fn default_faults(&self) -> usize {
        0
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::standalone(1);
        spec.nodes = 2;
        spec.rdzv = Rdzv::Static;
        (spec, settings(1500, 100, 30.0))
    }
    fn plan(&self, _seed: u64, _n: usize, _spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        Vec::new()
    }
    fn drive(&self, run: &mut Run) -> Result<(), ClusterError> {
        run.cluster.start_all()?;
        let hang = run.hang_after;
        let w = run
            .cluster
            .wait_until(hang, |c| {
                c.workers().into_iter().find_map(|w| {
                    crate::cluster::environ(w.pid)
                        .get("REKINDLE_STORE")
                        .cloned()
                })
            })
            .ok_or_else(|| ClusterError::Unsupported("no worker showed its store".into()))?;
        run.cluster.wait_step(100, hang);
        let mut s = stranger(run, &["store".into(), "--addr".into(), w.clone()])?;
        let code = s.wait_exit(Duration::from_secs(60)).ok();
        let lines: Vec<String> = s.lines().into_iter().map(|l| l.text).collect();
        let outcomes = stranger_outcomes(&lines);
        let refused =
            !outcomes.is_empty() && outcomes.iter().all(|(_, o)| o.starts_with("refused"));
        run.checks.push(Check::new(
            "store-refused",
            refused,
            format!("stranger exit {code:?}: {}", lines.join(" | ")),
        ));
        // The store logs the refusal after sending it: the line may come after the
        // stranger's exit.
        let logged = run
            .cluster
            .wait_until(Duration::from_secs(10), |c| {
                c.log()
                    .iter()
                    .any(|l| l.text.contains("refused") && l.text.contains("store"))
                    .then_some(())
            })
            .is_some();
        run.checks.push(Check::new(
            "store-logged",
            logged,
            if logged {
                "the agent logged the refusal"
            } else {
                "no refusal in the agent's log"
            },
        ));
        Ok(())
    }
}

/// A node's link slowed with `tc tbf`.
pub struct SlowLink;

impl Scenario for SlowLink {
    fn name(&self) -> &'static str {
        "slow-link"
    }
    fn about(&self) -> &'static str {
        "limit one node of a fixed 2-node etcd job (lease TTL 5 s) to 20 mbit/s (tc tbf) for 4 s"
    }
    fn goal(&self) -> &'static str {
        "training slows and goes on; no re-form; fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn needs_namespaces(&self) -> bool {
        true
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(2, "2");
        // The lease keep-alives share the slowed link with the collectives.
        spec.rdzv = Rdzv::Etcd {
            nnodes: "2".into(),
            lease_ttl: 5,
        };
        (spec, settings(1200 + 300 * faults as u64, 100, 30.0))
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        each(seed, n, 100, s.steps - 300, |r, _| Fault::SlowLink {
            node: r.gen_range(0..nodes),
            rate: "20mbit".into(),
            secs: 4.0,
        })
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(first) = run.injected.first() else {
            return Vec::new();
        };
        let reforms = count_after(run, first.at, "re-forming");
        vec![Check::new(
            "no-re-form",
            reforms == 0,
            format!("{reforms} re-formation(s) while slowed"),
        )]
    }
}

/// A node joins a running elastic job.
pub struct AddNode;

impl Scenario for AddNode {
    fn name(&self) -> &'static str {
        "add-node"
    }
    fn about(&self) -> &'static str {
        "start a third node mid-run in a 2-node etcd job, --nnodes 2:3"
    }
    fn goal(&self) -> &'static str {
        "the group grows to 3 without restarting the others; loss within tolerance"
    }
    fn default_faults(&self) -> usize {
        1
    }
    fn setup(&self, _faults: usize) -> (JobSpec, Settings) {
        (JobSpec::etcd(2, "2:3"), settings(1200, 100, 30.0))
    }
    fn plan(&self, seed: u64, _n: usize, _spec: &JobSpec, _s: &Settings) -> Vec<Planned> {
        each(seed, 1, 100, 400, |_, _| Fault::AddNode)
    }
    fn compare(&self) -> Compare {
        Compare::Loss
    }
    fn extra_checks(&self, run: &Run) -> Vec<Check> {
        let Some(inj) = run.injected.first() else {
            return Vec::new();
        };
        let grown = secs_to(run, inj.at, ": 3 rank(s)");
        let stopped = count_after(run, inj.at, "stopping workers to re-form");
        vec![Check::new(
            "grown",
            grown.is_some() && stopped == 0,
            format!(
                "group of 3 {}; {stopped} node(s) stopped their workers",
                grown.map_or("never formed".into(), |s| format!("formed {s:.2} s later"))
            ),
        )]
    }
}

/// A long random mix of faults that keep the world size (the soak).
pub struct Mixed;

impl Scenario for Mixed {
    fn name(&self) -> &'static str {
        "mixed"
    }
    fn about(&self) -> &'static str {
        "a random mix on a fixed 2-node etcd job: worker kills, hangs, node kills (restarted), etcd restarts, short partitions and slow links (namespaces only), sometimes two at once"
    }
    fn goal(&self) -> &'static str {
        "every fault recovered, 0 hangs, fingerprint equal"
    }
    fn default_faults(&self) -> usize {
        6
    }
    fn setup(&self, faults: usize) -> (JobSpec, Settings) {
        let mut spec = JobSpec::etcd(2, "2");
        spec.max_restarts = 3 * faults as u32 + 5;
        spec.rdzv = Rdzv::Etcd {
            nnodes: "2".into(),
            lease_ttl: 5,
        };
        // Steps take about a millisecond, and the job trains on through most faults while the
        // harness waits out their seconds: 1500 steps per fault keep the job running until the
        // schedule's end.
        (spec, settings(400 + 1500 * faults as u64, 100, 4.0))
    }
    fn plan(&self, seed: u64, n: usize, spec: &JobSpec, s: &Settings) -> Vec<Planned> {
        let nodes = spec.nodes;
        // The network kinds are drawn only where they can run; the draw itself does not
        // depend on the machine, so a seed names one schedule per mode.
        let netns = crate::cluster::NetMode::detect() == crate::cluster::NetMode::Namespaces;
        let one = move |r: &mut rand_chacha::ChaCha8Rng| -> Fault {
            let node = r.gen_range(0..nodes);
            let kinds: &[&str] = if netns {
                &[
                    "kill-worker",
                    "hang-worker",
                    "kill-node",
                    "etcd-down",
                    "partition",
                    "slow-link",
                ]
            } else {
                &["kill-worker", "hang-worker", "kill-node", "etcd-down"]
            };
            match pick(r, kinds).copied().unwrap_or("kill-worker") {
                "hang-worker" => Fault::HangWorker {
                    node,
                    local_rank: 0,
                    secs: 6.0,
                },
                "kill-node" => Fault::KillNode {
                    node,
                    restart: true,
                },
                "etcd-down" => Fault::EtcdDown { secs: 3.0 },
                "partition" => Fault::Partition { node, secs: 1.5 },
                "slow-link" => Fault::SlowLink {
                    node,
                    rate: "20mbit".into(),
                    secs: 2.0,
                },
                _ => Fault::KillWorker {
                    node,
                    local_rank: 0,
                },
            }
        };
        let mut r = rng(seed);
        let steps = spread(&mut r, n, 40, s.steps - 60);
        let mut plan = Vec::new();
        let mut j = 0;
        while j < steps.len() {
            let at_step = steps[j];
            let mut faults = vec![one(&mut r)];
            j += 1;
            // Sometimes two at once (each counts as a fault), of different kinds.
            if j < steps.len() && r.gen_bool(0.2) {
                let second = one(&mut r);
                if second.kind() != faults[0].kind() {
                    faults.push(second);
                    j += 1;
                }
            }
            plan.push(Planned { at_step, faults });
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        let names: Vec<&str> = all().iter().map(|s| s.name()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        for n in names {
            assert_eq!(by_name(n).map(|s| s.name()), Some(n));
        }
        assert!(by_name("no-such").is_none());
    }

    #[test]
    fn every_plan_is_a_pure_function_of_the_seed_and_fits_the_run() {
        for s in all() {
            let n = s.default_faults().max(3);
            let (spec, settings) = s.setup(n);
            let a = s.plan(11, n, &spec, &settings);
            let b = s.plan(11, n, &spec, &settings);
            assert_eq!(a, b, "{}", s.name());
            for p in &a {
                assert!(p.at_step < settings.steps, "{}: {p:?}", s.name());
                assert!(!p.faults.is_empty());
            }
            assert!(
                a.windows(2).all(|w| w[0].at_step <= w[1].at_step),
                "{}: {a:?}",
                s.name()
            );
        }
    }

    #[test]
    fn the_soak_plan_has_the_faults_asked_for() {
        let (spec, settings) = Mixed.setup(100);
        let plan = Mixed.plan(5, 100, &spec, &settings);
        let total: usize = plan.iter().map(|p| p.faults.len()).sum();
        assert_eq!(total, 100);
        assert!(plan.iter().any(|p| p.faults.len() == 2), "some at once");
        let kinds: std::collections::BTreeSet<&str> = plan
            .iter()
            .flat_map(|p| p.faults.iter().map(Fault::kind))
            .collect();
        assert!(kinds.len() >= 4, "{kinds:?}");
    }

    #[test]
    fn resize_faults_land_mid_epoch() {
        let (spec, settings) = Resize.setup(2);
        for seed in 0..20 {
            let plan = Resize.plan(seed, 2, &spec, &settings);
            assert_eq!(plan.len(), 2);
            for p in &plan {
                assert!((16..48).contains(&(p.at_step % 64)), "{p:?}");
            }
            assert!(matches!(plan[0].faults[0], Fault::Preempt { node } if node >= 1));
            assert_eq!(plan[1].faults[0], Fault::AddNode);
        }
    }

    #[test]
    fn commit_stages_are_all_covered_or_drawn() {
        let (spec, settings) = KillDuringCommit.setup(9);
        let all_stages = KillDuringCommit.plan(1, 9, &spec, &settings);
        assert_eq!(all_stages.len(), SAVE_STAGES.len());
        let some = KillDuringCommit.plan(1, 3, &spec, &settings);
        assert_eq!(some.len(), 3);
        assert_ne!(
            some,
            KillDuringCommit.plan(2, 3, &spec, &settings),
            "another seed, other stages"
        );
    }
}
