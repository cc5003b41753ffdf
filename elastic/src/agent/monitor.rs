//! The monitor loop: the I/O around the [`Machine`]. It turns what happens (worker exits,
//! signals, rendezvous results, membership events, eviction requests, time) into inputs, and
//! carries out the machine's actions: spawning, signalling and reaping workers, joining the
//! rendezvous, publishing events, printing.
//!
//! This loop is the only place that signals or reaps a worker (see [`super::process`]).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rekindle_runtime::store::Store;

use super::events::Event;
use super::evictions::{judge, EvictionRequest, EvictionWatcher, Observation, Targets, Verdict};
use super::http::FailureKind;
use super::machine::{Action, End, Input, Machine, Params, WorkerExit, WorkerSlot};
use super::outcome::{AgentError, AgentOutcome};
use super::process::{self, Child, Exit, WorkerSpec};
use super::round::Round;
use super::spec::{agents_done_prefix, membership_prefix, round_prefix};
use super::start::{Agent, Rdzv};
use crate::errorfile::read_error_file;
use crate::membership::{Membership, MembershipEvent, MembershipPublisher};
use crate::rendezvous::{RendezvousError, RendezvousHandler};
use crate::store::TcpStoreClient;
use crate::train::liveness::{Liveness, LIVENESS_FILE_ENV};
use crate::train::metrics::METRICS_FILE_ENV;

/// The file a worker writes its figures to, next to its error file.
fn metrics_file(error_file: &Path) -> PathBuf {
    error_file.with_file_name("metrics.json")
}

/// The file a worker keeps its liveness record in, next to its error file.
fn liveness_file(error_file: &Path) -> PathBuf {
    error_file.with_file_name("liveness")
}

/// How long a worker reported silent may go without a beat, still in the group the report
/// names, before it counts as stuck. A rank that is alive but was unreachable fails its own
/// collective within about a step of its reporter, and then leaves that group.
const EVICTION_GRACE: Duration = Duration::from_secs(2);

/// A request the monitor has not judged yet: what the worker's record said when it came.
struct PendingEviction {
    req: EvictionRequest,
    arrived: Instant,
    first: Option<Liveness>,
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The monitor's I/O state around the machine.
pub(crate) struct Monitor {
    agent: Agent,
    tx: Sender<Event>,
    events: Receiver<Event>,
    interval: Duration,
    /// Started workers not yet reaped, by pid.
    children: HashMap<i32, Child>,
    /// The membership stream of the round the workers are in.
    membership: Option<Membership>,
    /// The stream of the round the last rendezvous completed, until the workers move there.
    next_membership: Option<Membership>,
    publisher: Option<MembershipPublisher>,
    evictions: EvictionWatcher,
    /// Eviction requests waiting for a verdict.
    pending_evictions: Vec<PendingEviction>,
    /// Inputs that actions produced, fed before anything else.
    queue: VecDeque<Input>,
    /// The error behind [`End::Error`].
    error: Option<AgentError>,
    /// The last round counted in the endpoint's rounds.
    counted_round: Option<u64>,
}

impl Monitor {
    pub(crate) fn new(agent: Agent, tx: Sender<Event>, events: Receiver<Event>) -> Monitor {
        let interval = agent.cfg.monitor_interval.max(Duration::from_millis(10));
        let evictions = EvictionWatcher::start(
            agent.node.id.clone(),
            interval,
            agent.secret.clone(),
            tx.clone(),
        );
        Monitor {
            agent,
            tx,
            events,
            interval,
            children: HashMap::new(),
            membership: None,
            next_membership: None,
            publisher: None,
            evictions,
            pending_evictions: Vec::new(),
            queue: VecDeque::new(),
            error: None,
            counted_round: None,
        }
    }

    /// Runs the machine to its end.
    pub(crate) fn run(mut self) -> Result<AgentOutcome, AgentError> {
        let mut machine = Machine::new(Params {
            max_restarts: self.agent.cfg.max_restarts,
            grace: self.agent.cfg.grace_period,
            dynamic: matches!(self.agent.rdzv, Rdzv::Dynamic { .. }),
        });
        let mut actions = machine.start();
        let mut status = machine.status();
        let end = loop {
            if let Some(end) = actions.drain(..).find_map(|a| self.execute(&machine, a)) {
                break end;
            }
            if machine.status() != status {
                status = machine.status();
                tracing::debug!(?status, "agent state");
            }
            self.report(&machine);
            self.watch_evictions(&machine);
            self.judge_evictions(&machine);
            let input = match self.queue.pop_front() {
                Some(i) => i,
                None => match self.membership_input(&machine) {
                    Some(i) => i,
                    None => self.wait(&machine),
                },
            };
            actions = machine.handle(Instant::now(), input);
        };
        let out = match end {
            End::Outcome(o) => Ok(o),
            End::Error => Err(self.error.take().unwrap_or_else(|| AgentError::Internal {
                what: "the run failed without an error".into(),
            })),
            End::Internal(what) => Err(AgentError::Internal { what }),
        };
        if let Rdzv::Dynamic { handler } = &self.agent.rdzv {
            if let Err(e) = handler.shutdown() {
                tracing::warn!(error = %e, "could not leave the rendezvous cleanly");
            }
        }
        out
    }

    /// Tells the HTTP endpoint (if any) the machine's state; the loop turned.
    fn report(&mut self, m: &Machine) {
        let Some(health) = &self.agent.health else {
            return;
        };
        let status = m.status();
        let new_round = status.round.filter(|r| Some(*r) != self.counted_round);
        if new_round.is_some() {
            self.counted_round = new_round;
        }
        let live: Vec<PathBuf> = m
            .workers()
            .iter()
            .filter(|w| w.exit.is_none())
            .map(|w| metrics_file(&w.error_file))
            .collect();
        let node_rank = m.round().map(|r| r.node_rank);
        health.update(|s| {
            s.heartbeat = Instant::now();
            s.rounds += u64::from(new_round.is_some());
            s.status = Some(status);
            s.node_rank = node_rank;
            s.live_files = live;
        });
    }

    /// Carries out one action; `Some` when the run is over.
    fn execute(&mut self, m: &Machine, action: Action) -> Option<End> {
        match action {
            Action::Join { attempt } => self.join(attempt),
            Action::Rejoin => self.rendezvous_in_background(),
            Action::Leave => {
                if let Rdzv::Dynamic { handler } = &self.agent.rdzv {
                    let _ = handler.shutdown();
                }
            }
            Action::StartWorkers {
                round,
                attempt,
                restarts,
            } => self.start_workers(&round, attempt, restarts),
            Action::RestartWorker {
                local_rank,
                restarts,
            } => self.restart_worker(m, local_rank, restarts),
            Action::Signal {
                local_ranks,
                signal,
            } => self.signal(m, &local_ranks, signal),
            Action::Publish(ev) => self.publish(&ev, "cannot publish a membership event"),
            Action::Assign { from_round, to } => {
                self.membership = self.next_membership.take();
                let ev = MembershipEvent::Assigned {
                    round: from_round,
                    new_round: to.round,
                    rank_base: to.rank_base,
                    world_size: to.world_size,
                    store: self.agent.round_store_addr(&to),
                    store_prefix: round_prefix(&self.agent.job, to.round),
                };
                self.publish(&ev, "cannot tell the workers their new ranks");
            }
            Action::Say(line) => eprintln!("rekindle: {line}"),
            Action::ReportSuccess { round } => {
                self.linger_for_peers(&round);
                if let Rdzv::Dynamic { handler } = &self.agent.rdzv {
                    if let Err(e) = handler.set_closed() {
                        tracing::warn!(error = %e, "could not mark the job finished");
                    }
                }
                tracing::info!(job = %self.agent.job, attempt = m.attempt(), "workers succeeded");
            }
            Action::Finish(end) => return Some(end),
        }
        None
    }

    fn join(&mut self, attempt: u32) {
        match &self.agent.rdzv {
            Rdzv::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
            } => {
                let round = Round::fixed(
                    attempt,
                    *nnodes,
                    *node_rank,
                    self.agent.cfg.nproc_per_node as usize,
                    (master_addr, *master_port),
                );
                self.queue.push_back(Input::RoundReady(round));
            }
            Rdzv::Dynamic { .. } => self.rendezvous_in_background(),
        }
    }

    /// Runs `next_rendezvous` on a helper thread; its result comes back as an event, so
    /// signals are handled meanwhile.
    fn rendezvous_in_background(&mut self) {
        if let Rdzv::Dynamic { handler } = &self.agent.rdzv {
            let (h, tx) = (handler.clone(), self.tx.clone());
            std::thread::spawn(move || {
                let r = h.next_rendezvous();
                let _ = tx.send(Event::Rendezvous(Box::new(r)));
            });
        }
    }

    fn start_workers(&mut self, round: &Round, attempt: u32, restarts: u32) {
        tracing::info!(job = %self.agent.job, round = round.round, node_rank = round.node_rank,
            nnodes = round.nnodes, world_size = round.world_size, attempt, restarts,
            "starting workers");
        if let Err(e) = self.agent.start_torch_store(round) {
            self.error = Some(e);
            self.queue.push_back(Input::SpawnFailed {
                started: Vec::new(),
            });
            return;
        }
        if self.next_membership.is_some() {
            self.membership = self.next_membership.take();
        }
        self.publisher = Some(MembershipPublisher::new(
            self.agent.agent_store.clone(),
            &membership_prefix(&self.agent.job, attempt),
        ));
        let store = self.agent.round_store_addr(round);
        let specs = self
            .agent
            .spec_context()
            .specs(round, &store, attempt, restarts);
        let mut started = Vec::with_capacity(specs.len());
        for spec in &specs {
            match self.spawn(spec) {
                Ok(slot) => started.push(slot),
                Err(e) => {
                    self.error = Some(e);
                    self.queue.push_back(Input::SpawnFailed { started });
                    return;
                }
            }
        }
        self.queue.push_back(Input::WorkersStarted(started));
    }

    fn restart_worker(&mut self, m: &Machine, local_rank: usize, restarts: u32) {
        let Some(round) = m.round().cloned() else {
            return self.queue.push_back(Input::RestartFailed {
                reason: "no round to restart a worker in".into(),
            });
        };
        let next = self.publisher.as_ref().map_or(0, |p| p.next_index());
        let store = self.agent.round_store_addr(&round);
        let spec = self.agent.spec_context().restart(
            &round,
            &store,
            m.attempt(),
            restarts,
            local_rank,
            next,
        );
        let input = match self.spawn(&spec) {
            Ok(slot) => Input::WorkerRestarted(slot),
            Err(e) => Input::RestartFailed {
                reason: e.to_string(),
            },
        };
        self.queue.push_back(input);
    }

    fn spawn(&mut self, spec: &WorkerSpec) -> Result<WorkerSlot, AgentError> {
        let mut spec = spec.clone();
        spec.env.push((
            METRICS_FILE_ENV.to_string(),
            metrics_file(&spec.error_file).display().to_string(),
        ));
        // A predecessor's record must not speak for the new worker.
        let _ = std::fs::remove_file(liveness_file(&spec.error_file));
        spec.env.push((
            LIVENESS_FILE_ENV.to_string(),
            liveness_file(&spec.error_file).display().to_string(),
        ));
        let spec = &spec;
        let child = process::spawn(spec, self.tx.clone()).map_err(|source| AgentError::Spawn {
            local_rank: spec.local_rank,
            program: spec.argv.first().cloned().unwrap_or_default(),
            source,
        })?;
        let pid = child.pid();
        self.children.insert(pid, child);
        if let Some(h) = &self.agent.health {
            h.update(|s| s.all_files.push(metrics_file(&spec.error_file)));
        }
        Ok(WorkerSlot {
            local_rank: spec.local_rank,
            global_rank: spec.global_rank,
            pid,
            error_file: spec.error_file.clone(),
            exit: None,
            stopped: false,
        })
    }

    fn signal(&mut self, m: &Machine, local_ranks: &[usize], signal: i32) {
        for w in m
            .workers()
            .iter()
            .filter(|w| local_ranks.contains(&w.local_rank))
        {
            if let Some(child) = self.children.get(&w.pid) {
                if let Err(e) = child.signal_group(signal) {
                    tracing::debug!(rank = w.global_rank, error = %e, "signal not sent");
                }
            }
        }
    }

    fn publish(&mut self, ev: &MembershipEvent, what: &'static str) {
        if let Some(p) = &mut self.publisher {
            if let Err(e) = p.publish(ev) {
                tracing::warn!(error = %e, "{what}");
            }
        }
    }

    fn watch_evictions(&self, m: &Machine) {
        let targets = match m.round() {
            Some(round) => Targets {
                store_addr: self.agent.round_store_addr(round),
                prefix: round_prefix(&self.agent.job, round.round),
                pids: m
                    .workers()
                    .iter()
                    .filter(|w| w.exit.is_none())
                    .map(|w| w.pid)
                    .collect(),
            },
            None => Targets::default(),
        };
        self.evictions.update(targets);
    }

    /// Judges the waiting eviction requests from what this agent sees of its workers (see
    /// [`judge`]); each verdict other than [`Verdict::Wait`] becomes an input.
    fn judge_evictions(&mut self, m: &Machine) {
        let now = Instant::now();
        let pending = std::mem::take(&mut self.pending_evictions);
        for p in pending {
            let slot = m
                .workers()
                .iter()
                .find(|w| w.pid == p.req.pid && w.exit.is_none());
            let Some(slot) = slot else {
                // Exited (and replaced, or not): nothing to judge.
                continue;
            };
            let obs = Observation {
                stopped: self.children.get(&p.req.pid).is_some_and(Child::stopped),
                liveness: Liveness::read(&liveness_file(&slot.error_file)),
            };
            match judge(&p.req, p.first, obs, now - p.arrived, EVICTION_GRACE) {
                Verdict::Wait => self.pending_evictions.push(p),
                verdict => {
                    tracing::info!(pid = p.req.pid, by = %p.req.by, group = ?p.req.group, ?verdict, "eviction request judged");
                    self.queue.push_back(Input::Evict {
                        req: p.req,
                        verdict,
                    });
                }
            }
        }
    }

    /// Takes a request in for judging (a second one for the same worker adds nothing).
    fn take_eviction(&mut self, m: &Machine, req: EvictionRequest) {
        if self.pending_evictions.iter().any(|p| p.req.pid == req.pid) {
            return;
        }
        let first = m
            .workers()
            .iter()
            .find(|w| w.pid == req.pid && w.exit.is_none())
            .and_then(|w| Liveness::read(&liveness_file(&w.error_file)));
        self.pending_evictions.push(PendingEviction {
            req,
            arrived: Instant::now(),
            first,
        });
        self.judge_evictions(m);
    }

    /// The next membership event of the workers' round, if the machine wants one.
    fn membership_input(&self, m: &Machine) -> Option<Input> {
        if !m.wants_membership() {
            return None;
        }
        let event = self.membership.as_ref()?.poll()?;
        let live_elastic = m
            .workers()
            .iter()
            .filter(|w| w.exit.is_none())
            .all(|w| self.agent.is_elastic(m.attempt(), w.local_rank));
        Some(Input::Membership {
            event,
            live_elastic,
        })
    }

    /// Waits for the next event, at most one monitor interval (less before a deadline of the
    /// machine's).
    fn wait(&mut self, m: &Machine) -> Input {
        let mut timeout = self.interval;
        if !self.pending_evictions.is_empty() {
            // Look at the reported workers again soon: a stuck one is killed at its grace.
            timeout = timeout.min(Duration::from_millis(50));
        }
        if let Some(d) = m.deadline() {
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
        }
        match self.events.recv_timeout(timeout) {
            Ok(ev) => self.input(m, ev),
            Err(RecvTimeoutError::Timeout) => Input::Tick,
            // The monitor holds a sender itself, so this cannot happen; stop as on SIGTERM.
            Err(RecvTimeoutError::Disconnected) => Input::Signal(libc::SIGTERM),
        }
    }

    fn input(&mut self, m: &Machine, ev: Event) -> Input {
        match ev {
            Event::Exited {
                pid,
                local_rank,
                exit,
                at,
            } => {
                // Reaped here, after every signal the machine sent it: the pid is free from now.
                if let Some(mut child) = self.children.remove(&pid) {
                    child.reap();
                }
                let failed = !exit.success();
                let record = failed
                    .then(|| {
                        m.workers()
                            .iter()
                            .find(|w| w.pid == pid)
                            .and_then(|w| read_error_file(&w.error_file))
                    })
                    .flatten();
                let elastic = failed && self.agent.is_elastic(m.attempt(), local_rank);
                let in_round = matches!(m.status().phase, "running" | "reforming");
                if let (true, Some(h)) = (failed && in_round, &self.agent.health) {
                    let kind = match exit {
                        Exit::Signal(_) => FailureKind::Signal,
                        Exit::Code(_) => FailureKind::ExitCode,
                    };
                    h.update(|s| match kind {
                        FailureKind::Signal => s.signal_failures += 1,
                        FailureKind::ExitCode => s.exit_code_failures += 1,
                    });
                }
                Input::Exited {
                    pid,
                    exit: WorkerExit {
                        exit,
                        at: unix_secs(at),
                        record,
                    },
                    elastic,
                }
            }
            Event::Signal(s) => Input::Signal(s),
            Event::Rendezvous(r) => match *r {
                Ok(info) => {
                    if let Rdzv::Dynamic { handler } = &self.agent.rdzv {
                        self.next_membership = handler.membership().ok();
                    }
                    Input::RoundReady(Round::from_info(&info, &self.agent.node))
                }
                Err(RendezvousError::Closed { job }) => Input::RendezvousClosed { job },
                Err(e) => {
                    self.error = Some(e.into());
                    Input::RendezvousFailed
                }
            },
            Event::Evict(req) => {
                self.take_eviction(m, req);
                self.queue.pop_front().unwrap_or(Input::Tick)
            }
        }
    }

    /// The round's store lives in node 0's agent and other nodes' workers may still be using
    /// it: every node reports success there, and node 0 keeps serving until all have (at most
    /// the grace period).
    fn linger_for_peers(&self, round: &Round) {
        if round.nnodes <= 1 {
            return;
        }
        let master = round.master();
        let prefix = agents_done_prefix(&self.agent.job, round.round);
        let store = match TcpStoreClient::connect_with_timeout(
            &master,
            &self.agent.secret,
            Duration::from_secs(5),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%master, error = %e, "cannot report success to node 0");
                return;
            }
        };
        if let Err(e) = store.set(&format!("{prefix}{}", round.node_rank), b"1") {
            tracing::warn!(%master, error = %e, "cannot report success to node 0");
            return;
        }
        if round.node_rank == 0 {
            let keys: Vec<String> = (0..round.nnodes).map(|r| format!("{prefix}{r}")).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(e) = store.wait(&refs, self.agent.cfg.grace_period) {
                tracing::warn!(error = %e, "not every node reported success; exiting anyway");
            }
        }
    }
}
