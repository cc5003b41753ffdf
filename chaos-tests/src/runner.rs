//! Runs a scenario: the fault-free reference, the faulty run, the faults on schedule, the
//! invariants and the report.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rekindle_elastic::testing::Fingerprint;

use crate::cluster::{Cluster, ClusterError, JobSpec, NetMode, Rdzv};
use crate::fault::{Damage, Fault, Planned};
use crate::invariants;
use crate::report::{Check, FaultRecord, Point, Report, Totals};
use crate::scenario::{Compare, Scenario};
use crate::workload::{Settings, Workload};

/// Why a scenario could not be run (as opposed to an invariant that failed).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The scenario needs what this machine or program does not have.
    #[error("scenario {scenario} cannot run here: {reason}")]
    Unsupported {
        /// The scenario.
        scenario: String,
        /// Why.
        reason: String,
    },
    /// The cluster failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The fault-free reference run failed.
    #[error("the fault-free reference run failed: {0}")]
    Reference(String),
}

/// How to run a scenario.
#[derive(Debug, Clone)]
pub struct Options {
    /// The seed of the schedule.
    pub seed: u64,
    /// Faults to inject (`None`: the scenario's default).
    pub faults: Option<usize>,
    /// Where the nodes run.
    pub mode: NetMode,
    /// A fault after which no step completes within this long is a hang.
    pub hang_after: Duration,
    /// The longest a whole run may take.
    pub run_timeout: Duration,
    /// Where to write the job's whole log (every line of every node, with its time).
    pub log: Option<std::path::PathBuf>,
}

impl Options {
    /// The defaults with `seed`: detected network mode, 60 s hang deadline.
    pub fn new(seed: u64) -> Options {
        Options {
            seed,
            faults: None,
            mode: NetMode::detect(),
            hang_after: Duration::from_secs(60),
            run_timeout: Duration::from_secs(600),
            log: None,
        }
    }
}

/// What the fault-free run gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// Its fingerprint.
    pub fingerprint: Fingerprint,
    /// Its final loss (see [`invariants::final_loss`]).
    pub loss: Option<f64>,
}

/// The fault-free run of `workload` with `settings` on `world` ranks (one standalone node:
/// the result does not depend on how the ranks are spread over nodes), cached per process.
pub fn reference(
    workload: &Workload,
    settings: &Settings,
    world: usize,
    timeout: Duration,
) -> Result<Reference, RunError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Reference>>> = OnceLock::new();
    let key = format!(
        "{}|{:?}|{:?}|{world}",
        workload.program.display(),
        workload.args,
        settings
    );
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(r) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(r.clone());
    }
    let spec = JobSpec::standalone(world);
    let mut c = Cluster::new(
        "reference",
        spec,
        workload.clone(),
        settings.clone(),
        NetMode::Loopback,
    )?;
    c.start_all()?;
    let exits = c.finish(timeout);
    let check = invariants::exits(&exits);
    if !check.held {
        return Err(RunError::Reference(format!(
            "{}; log:\n{}",
            check.detail,
            tail(&c.log_text(), 60)
        )));
    }
    let fingerprint = last_fingerprint(&c).ok_or_else(|| {
        RunError::Reference(format!(
            "no final_step line; log:\n{}",
            tail(&c.log_text(), 60)
        ))
    })?;
    let r = Reference {
        fingerprint,
        loss: run_loss(&c),
    };
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, r.clone());
    Ok(r)
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The last fingerprint line of the job.
pub fn last_fingerprint(c: &Cluster) -> Option<Fingerprint> {
    Fingerprint::last_in(c.log().iter().map(|l| l.text.as_str()))
}

/// The final loss of the job: from the loss CSV, else from `loss=` on the step lines.
pub fn run_loss(c: &Cluster) -> Option<f64> {
    let rows: Vec<(u64, f64)> = c.loss_rows().iter().map(|r| (r.0, r.1)).collect();
    if !rows.is_empty() {
        return invariants::final_loss(&rows);
    }
    let rows: Vec<(u64, f64)> = c
        .log()
        .iter()
        .filter_map(|l| {
            let s = crate::cluster::step_of(&l.text)?;
            let v = rekindle_elastic::testing::field(&l.text, "loss")?
                .parse()
                .ok()?;
            Some((s, v))
        })
        .collect();
    invariants::final_loss(&rows)
}

/// A fault as it was injected.
#[derive(Debug, Clone)]
pub struct Injected {
    /// The fault.
    pub fault: Fault,
    /// When.
    pub at: Instant,
    /// When it was healed (for faults that last).
    pub healed: Option<Instant>,
    /// The step printed last before it.
    pub step_before: Option<u64>,
    /// Whether a step completed (or the job finished) within the hang deadline after it.
    pub recovered: bool,
}

/// A running scenario: the cluster, the schedule and what happened so far. Scenarios with
/// their own flow drive it through its methods.
pub struct Run {
    /// The job.
    pub cluster: Cluster,
    /// The schedule.
    pub plan: Vec<Planned>,
    /// Faults injected so far.
    pub injected: Vec<Injected>,
    /// Checks a scenario's flow made while it ran.
    pub checks: Vec<Check>,
    /// Worker pids the harness stopped (a kill of one of them by its agent is right).
    pub stopped: Vec<i32>,
    /// Instants at which nodes were started again after a kill.
    pub restarts: Vec<(usize, Instant)>,
    /// The hang deadline.
    pub hang_after: Duration,
}

impl Run {
    fn unsupported(&self, reason: impl Into<String>) -> ClusterError {
        ClusterError::Unsupported(reason.into())
    }

    /// Starts the job and injects the plan.
    pub fn start_and_execute(&mut self) -> Result<(), ClusterError> {
        self.cluster.start_all()?;
        self.execute_plan()
    }

    /// Injects every planned entry when the job reaches its step, then waits for recovery.
    pub fn execute_plan(&mut self) -> Result<(), ClusterError> {
        let plan = self.plan.clone();
        for entry in &plan {
            let reached = self.cluster.wait_step(entry.at_step, self.hang_after);
            if reached.is_none_or(|s| s < entry.at_step) {
                // The job ended (or stalled) before the step: the rest is not injected.
                break;
            }
            self.inject_all(&entry.faults)?;
        }
        Ok(())
    }

    /// Injects `faults` at once, heals the ones that last, and waits for the next step.
    pub fn inject_all(&mut self, faults: &[Fault]) -> Result<(), ClusterError> {
        let at = Instant::now();
        let step_before = self.cluster.step();
        let first = self.injected.len();
        let mut heals: Vec<(Duration, usize, Option<i32>)> = Vec::new();
        let mut started_again = Vec::new();
        for f in faults {
            // A fault aimed at the processes of a node killed earlier in this batch is aimed
            // at its new ones: start the node again first (nothing else would before the
            // batch is over, and waiting for its worker would stall the schedule).
            if let Some(node) = f.process_node() {
                let killed = (first..self.injected.len()).find(|&i| {
                    !started_again.contains(&i)
                        && matches!(self.injected[i].fault,
                            Fault::KillNode { node: n, restart: true } if n == node)
                });
                if let Some(i) = killed {
                    self.after(i)?;
                    started_again.push(i);
                }
            }
            let stopped_before = self.stopped.len();
            let lasts = self.inject(f)?;
            let stopped = self.stopped.get(stopped_before).copied();
            self.injected.push(Injected {
                fault: f.clone(),
                at,
                healed: None,
                step_before,
                recovered: false,
            });
            if let Some(d) = lasts {
                heals.push((d, self.injected.len() - 1, stopped));
            }
        }
        heals.sort_by_key(|(d, _, _)| *d);
        for (d, i, stopped) in heals {
            // The fault lasts this long: the job runs (or stalls) meanwhile.
            let until = at + d;
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
            let f = self.injected[i].fault.clone();
            self.heal(&f, stopped)?;
            self.injected[i].healed = Some(Instant::now());
        }
        for i in first..self.injected.len() {
            if !started_again.contains(&i) {
                self.after(i)?;
            }
        }
        let recovered = self
            .cluster
            .wait_until(self.hang_after, |c| {
                let stepped = c.progress().iter().any(|(t, _)| *t > at);
                let done = c.live_nodes().is_empty();
                (stepped || done).then_some(stepped || last_fingerprint(c).is_some())
            })
            .unwrap_or(false);
        for r in &mut self.injected[first..] {
            r.recovered = recovered;
        }
        Ok(())
    }

    fn worker_pid(&mut self, node: usize, local_rank: usize) -> Result<i32, ClusterError> {
        self.cluster
            .wait_worker(node, local_rank, self.hang_after)
            .map(|w| w.pid)
            .ok_or_else(|| {
                self.unsupported(format!(
                    "node {node} has no worker of local rank {local_rank}"
                ))
            })
    }

    /// Injects one fault; returns how long it lasts for faults that are healed later.
    fn inject(&mut self, f: &Fault) -> Result<Option<Duration>, ClusterError> {
        match f {
            Fault::KillWorker { node, local_rank } => {
                let pid = self.worker_pid(*node, *local_rank)?;
                self.cluster.signal_worker(pid, libc::SIGKILL);
            }
            Fault::HangWorker {
                node,
                local_rank,
                secs,
            } => {
                let pid = self.worker_pid(*node, *local_rank)?;
                self.stopped.push(pid);
                self.cluster.signal_worker(pid, libc::SIGSTOP);
                return Ok(Some(Duration::from_secs_f64(*secs)));
            }
            Fault::KillNode { node, .. } => self.cluster.kill_node(*node)?,
            Fault::Preempt { node } => {
                self.cluster
                    .signal_node(*node, libc::SIGTERM, 128 + libc::SIGTERM)?
            }
            Fault::KillDuringCommit { stage } => {
                return Err(self.unsupported(format!(
                    "kill-during-commit ({stage}) is driven by its own scenario flow"
                )))
            }
            Fault::CorruptCheckpoint { damage } => {
                self.cluster.kill_all(Duration::from_secs(30))?;
                let dir = self.cluster.files().checkpoint_dir.clone();
                let (newest, previous) = damage_newest(&dir, *damage)
                    .map_err(|e| self.unsupported(format!("damaging a checkpoint: {e}")))?;
                self.checks.push(Check::pass(
                    "damaged",
                    format!("step-{newest} ({damage:?}); previous step-{previous}"),
                ));
                self.cluster.start_all()?;
            }
            Fault::EtcdDown { secs } => {
                let etcd = self
                    .cluster
                    .etcd()
                    .ok_or_else(|| ClusterError::Unsupported("the job uses no etcd".into()))?;
                etcd.stop();
                return Ok(Some(Duration::from_secs_f64(*secs)));
            }
            Fault::Partition { node, secs } => {
                let host = self.host(*node)?;
                self.net()?.link_down(host)?;
                return Ok(Some(Duration::from_secs_f64(*secs)));
            }
            Fault::SlowLink { node, rate, secs } => {
                let host = self.host(*node)?;
                self.net()?.shape(host, rate)?;
                return Ok(Some(Duration::from_secs_f64(*secs)));
            }
            Fault::AddNode => {
                self.cluster.add_node()?;
            }
        }
        Ok(None)
    }

    fn host(&self, node: usize) -> Result<usize, ClusterError> {
        self.cluster
            .host_of(node)
            .ok_or_else(|| self.unsupported("network faults need network namespaces (root)"))
    }

    fn net(&self) -> Result<&rekindle_elastic::testing::Network, ClusterError> {
        self.cluster
            .network()
            .ok_or_else(|| self.unsupported("network faults need network namespaces (root)"))
    }

    fn heal(&mut self, f: &Fault, stopped: Option<i32>) -> Result<(), ClusterError> {
        match f {
            Fault::HangWorker { .. } => {
                if let Some(pid) = stopped {
                    self.cluster.signal_worker(pid, libc::SIGCONT);
                }
            }
            Fault::EtcdDown { .. } => {
                if let Some(e) = self.cluster.etcd() {
                    e.restart()?;
                }
            }
            Fault::Partition { node, .. } => {
                let host = self.host(*node)?;
                self.net()?.link_up(host)?;
            }
            Fault::SlowLink { node, .. } => {
                let host = self.host(*node)?;
                self.net()?.unshape(host)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// What follows a fault once it is healed: a killed node is started again.
    fn after(&mut self, i: usize) -> Result<(), ClusterError> {
        let Fault::KillNode {
            node,
            restart: true,
        } = self.injected[i].fault.clone()
        else {
            return Ok(());
        };
        let at = self.injected[i].at;
        // Let the node be gone for good first (its agent reaped), and, when the others can
        // go on without it, wait until they did.
        self.cluster.wait_until(self.hang_after, |c| {
            c.agent(node).and_then(|a| a.try_exit())
        });
        if !self.cluster.spec().fixed_size() {
            self.cluster
                .wait_line_after(at, &["re-formed into round"], self.hang_after);
        }
        self.cluster.start_node(node)?;
        self.restarts.push((node, Instant::now()));
        Ok(())
    }
}

/// Damages the newest committed checkpoint under `dir`; returns its step and the previous
/// committed step.
pub fn damage_newest(dir: &std::path::Path, damage: Damage) -> Result<(u64, u64), String> {
    let d = rekindle_storage::CheckpointDir::new(dir).map_err(|e| e.to_string())?;
    let steps = d.committed_steps().map_err(|e| e.to_string())?;
    let [.., previous, newest] = steps[..] else {
        return Err(format!("fewer than two checkpoints: {steps:?}"));
    };
    let step_dir = d.step_path(newest);
    let mut files: Vec<(u64, std::path::PathBuf)> = std::fs::read_dir(&step_dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.len(), p)))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no tensor file in {}", step_dir.display()));
    }
    match damage {
        Damage::Flip => {
            for (_, path) in &files {
                let mut bytes = std::fs::read(path).map_err(|e| e.to_string())?;
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x40;
                std::fs::write(path, bytes).map_err(|e| e.to_string())?;
            }
        }
        Damage::Truncate => {
            let (len, path) = &files[files.len() - 1];
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| e.to_string())?;
            f.set_len(len / 2).map_err(|e| e.to_string())?;
        }
    }
    Ok((newest, previous))
}

/// Runs `scenario` against `workload` and reports. An `Err` means the scenario could not be
/// run at all; a run whose invariants fail is an `Ok` report with `passed == false`.
pub fn run(
    scenario: &dyn Scenario,
    workload: &Workload,
    opts: &Options,
) -> Result<Report, RunError> {
    let unsupported = |reason: String| RunError::Unsupported {
        scenario: scenario.name().into(),
        reason,
    };
    if scenario.needs_namespaces() && opts.mode != NetMode::Namespaces {
        return Err(unsupported(
            "it cuts and slows links: it needs network namespaces (run as root with ip, tc and unshare)"
                .into(),
        ));
    }
    scenario.check(workload).map_err(unsupported)?;
    let faults = opts.faults.unwrap_or(scenario.default_faults());
    let (spec, settings) = scenario.setup(faults);
    let world = spec.world_size();
    let reference = reference(workload, &settings, world, opts.run_timeout)?;
    let plan = scenario.plan(opts.seed, faults, &spec, &settings);
    let cluster = Cluster::new(
        scenario.name(),
        spec.clone(),
        workload.clone(),
        settings.clone(),
        opts.mode,
    )?;
    let mut r = Run {
        cluster,
        plan,
        injected: Vec::new(),
        checks: Vec::new(),
        stopped: Vec::new(),
        restarts: Vec::new(),
        hang_after: opts.hang_after,
    };
    let t_start = Instant::now();
    let driven = scenario.drive(&mut r);
    let exits = r.cluster.finish(opts.run_timeout);
    let wall_s = t_start.elapsed().as_secs_f64();
    let mut checks = Vec::new();
    if let Err(e) = &driven {
        checks.push(Check::fail("driven", e.to_string()));
    }
    let planned: usize = r.plan.iter().map(|p| p.faults.len()).sum();
    if planned > 0 || !r.injected.is_empty() {
        checks.push(Check::new(
            "faults-injected",
            r.injected.len() >= planned,
            format!("{} of {planned} planned", r.injected.len()),
        ));
    }
    let hangs = r.injected.iter().filter(|i| !i.recovered).count();
    checks.push(Check::new(
        "recovered",
        hangs == 0,
        format!(
            "{} of {} fault(s) followed by a completed step within {:?}",
            r.injected.len() - hangs,
            r.injected.len(),
            opts.hang_after
        ),
    ));
    checks.push(invariants::exits(&exits));
    let got = last_fingerprint(&r.cluster);
    // Pods keep their manifest's elastic range; a pod scenario asking for the fingerprint
    // checks itself that the group never changed size.
    let fixed =
        (spec.fixed_size() || spec.pod.is_some()) && scenario.compare() == Compare::Fingerprint;
    if fixed {
        checks.push(invariants::fingerprint(
            got.as_ref(),
            &reference.fingerprint,
        ));
    } else {
        checks.push(Check::new(
            "finished",
            got.as_ref()
                .is_some_and(|f| f.step == reference.fingerprint.step),
            got.as_ref()
                .map_or("no final_step line".into(), |f| f.to_string()),
        ));
        checks.push(invariants::loss(run_loss(&r.cluster), reference.loss));
    }
    checks.push(invariants::samples(
        r.cluster.audit_dir(),
        workload.dataset_len,
        scenario.audit_required(),
    ));
    checks.push(invariants::checkpoints(&r.cluster.files().checkpoint_dir));
    let extra = scenario.extra_checks(&r);
    checks.append(&mut r.checks);
    checks.extend(extra);
    if let Rdzv::Etcd { lease_ttl, .. } = &spec.rdzv {
        let wait = Duration::from_secs(lease_ttl * 3 + 5);
        checks.push(invariants::etcd_clean(&r.cluster, wait));
    }
    let orphans = r.cluster.orphans(Duration::from_secs(10));
    checks.push(Check::new(
        "no-orphans",
        orphans.is_empty(),
        if orphans.is_empty() {
            "no process of the job left".into()
        } else {
            format!("still running: {orphans:?}")
        },
    ));
    let shm = r.cluster.shm_leftovers(Duration::from_secs(2));
    checks.push(Check::new(
        "no-shm-files",
        shm.is_empty(),
        if shm.is_empty() {
            "no shared-memory file left".into()
        } else {
            format!("left: {shm:?}")
        },
    ));
    if let Some(path) = &opts.log {
        let text: String = r
            .cluster
            .log()
            .iter()
            .map(|l| format!("{:.3} [node {}] {}\n", r.cluster.secs(l.at), l.node, l.text))
            .collect();
        if let Err(e) = std::fs::write(path, text) {
            checks.push(Check::new(
                "log-written",
                false,
                format!("cannot write {}: {e}", path.display()),
            ));
        }
    }
    let records = records(&r);
    let (restarts_spent, healthy_killed) = restarts_and_evictions(&r);
    let timeline = timeline(&r.cluster);
    let namespaces = r.cluster.teardown();
    if opts.mode == NetMode::Namespaces {
        checks.push(Check::new(
            "no-namespaces",
            namespaces.is_empty(),
            if namespaces.is_empty() {
                "every namespace of the run deleted".into()
            } else {
                format!("left: {namespaces:?}")
            },
        ));
    }
    let mut report = Report {
        scenario: scenario.name().into(),
        goal: scenario.goal().into(),
        seed: opts.seed,
        workload: workload.name.clone(),
        network: opts.mode.describe().into(),
        world_size: world,
        wall_s,
        totals: Totals::of(&records, restarts_spent, healthy_killed),
        faults: records,
        checks,
        timeline,
        passed: false,
        reason: None,
    };
    report.conclude();
    if !report.passed {
        // The job's own messages, without the step lines that would drown them.
        let lines: Vec<String> = r
            .cluster
            .log()
            .iter()
            .filter(|l| crate::cluster::step_of(&l.text).is_none())
            .map(|l| format!("{:.3} [node {}] {}", r.cluster.secs(l.at), l.node, l.text))
            .collect();
        report.checks.push(Check::pass(
            "log",
            format!("last lines:\n{}", tail(&lines.join("\n"), 60)),
        ));
    }
    Ok(report)
}

/// The fault records: detection from the log, next step and steps lost from the loss CSV
/// (commit times) when there is one, else from the step lines.
fn records(r: &Run) -> Vec<FaultRecord> {
    let c = &r.cluster;
    let (t0, t0_unix) = c.epoch();
    let rows = c.loss_rows();
    r.injected
        .iter()
        .map(|inj| {
            let at_s = c.secs(inj.at);
            let markers = inj.fault.detection_markers();
            // A line after the next batch of faults was injected is that batch's.
            let next_batch = r
                .injected
                .iter()
                .map(|i| i.at)
                .filter(|t| *t > inj.at)
                .min();
            let detected = (!markers.is_empty())
                .then(|| c.find_after(inj.at, markers))
                .flatten()
                .map(|l| l.at)
                .filter(|t| next_batch.is_none_or(|n| *t < n));
            // A step in flight may still complete right after the fault: the next step that
            // counts is the first one after the fault was noticed (or healed, for one that
            // lasts).
            let anchor = [Some(inj.at), detected, inj.healed]
                .into_iter()
                .flatten()
                .max()
                .unwrap_or(inj.at);
            let (next, lost) = if rows.is_empty() {
                let before = c
                    .progress()
                    .iter()
                    .filter(|(t, _)| *t <= anchor)
                    .map(|(_, s)| *s)
                    .max();
                let after = c.progress().iter().find(|(t, _)| *t > anchor);
                (
                    after.map(|(t, _)| t.saturating_duration_since(inj.at).as_secs_f64()),
                    after.and_then(|(_, s)| before.map(|b| b.saturating_sub(*s))),
                )
            } else {
                let unix = |t: Instant| t0_unix + t.saturating_duration_since(t0).as_secs_f64();
                let (fault_unix, anchor_unix) = (unix(inj.at), unix(anchor));
                let before = rows
                    .iter()
                    .filter(|r| r.3 <= anchor_unix)
                    .map(|r| r.0)
                    .max();
                let after = rows.iter().find(|r| r.3 > anchor_unix);
                (
                    after.map(|r| r.3 - fault_unix),
                    after.map(|r| (before.unwrap_or(0) + 1).saturating_sub(r.0)),
                )
            };
            FaultRecord {
                fault: inj.fault.clone(),
                at_s,
                healed_at_s: inj.healed.map(|h| c.secs(h)),
                step_before: inj.step_before,
                detected_after_s: detected
                    .map(|d| d.saturating_duration_since(inj.at).as_secs_f64()),
                next_step_after_s: next,
                steps_lost: lost,
                recovered: inj.recovered,
            }
        })
        .collect()
}

/// Restarts the agents spent, and workers they killed as silent that the harness had not
/// stopped.
pub(crate) fn restarts_and_evictions(r: &Run) -> (usize, usize) {
    let log = r.cluster.log();
    let restarts = log
        .iter()
        .filter(|l| l.text.contains("restarting rank") || l.text.contains("restarting workers"))
        .count();
    let healthy = log
        .iter()
        .filter(|l| l.text.contains("stopped responding") && l.text.contains("killing it"))
        .filter_map(|l| {
            l.text
                .split("(pid ")
                .nth(1)?
                .split(')')
                .next()?
                .parse::<i32>()
                .ok()
        })
        .filter(|pid| !r.stopped.contains(pid))
        .count();
    (restarts, healthy)
}

/// Step against time: the loss CSV's commit times, else the step lines.
fn timeline(c: &Cluster) -> Vec<Point> {
    let (t0, t0_unix) = c.epoch();
    let rows = c.loss_rows();
    if !rows.is_empty() {
        return rows
            .iter()
            .map(|r| Point {
                t: r.3 - t0_unix,
                step: r.0,
            })
            .collect();
    }
    c.progress()
        .iter()
        .map(|(t, s)| Point {
            t: t.saturating_duration_since(t0).as_secs_f64(),
            step: *s,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damage_needs_two_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        assert!(damage_newest(dir.path(), Damage::Flip)
            .unwrap_err()
            .contains("fewer than two"));
    }
}
