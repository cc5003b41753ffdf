//! The agent's decisions, as a state machine without I/O.
//!
//! [`Machine::handle`] takes the time and one [`Input`] (a worker exited, a signal came, the
//! rendezvous completed, a membership event, an eviction request, a tick) and returns the
//! [`Action`]s to take (start workers, signal them, join the rendezvous, publish an event,
//! print a line, finish). The monitor loop (`monitor.rs`) owns every process, socket and
//! thread: it turns what happens into inputs and carries out the actions. Nothing here blocks,
//! reads a clock or touches the system, so every decision is tested with a table.
//!
//! ```text
//!            +-------------------------- restart (failure, counted) ------------------+
//!            v                                                                        |
//!   Joining --RoundReady/WorkersStarted--> Running --failure, signal, re-form--> Stopping --> Done
//!      ^  \--closed, failed, signal--> Done  |  ^                                     |
//!      |                                     |  +-- in place: restart one worker,     |
//!      |                                     |      re-form while training, evict     |
//!      +----------------------------- re-form (membership changed, not counted) -----+
//! ```
//!
//! Stopping sends SIGTERM to every running worker, SIGKILL after the grace period (at once
//! on a SIGINT), and gives up on workers that outlive SIGKILL by [`KILL_WAIT`].

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::evictions::{decide, EvictionDecision, EvictionRequest, Verdict};
use super::outcome::{AgentOutcome, WorkerFailure};
use super::process::{signal_name, Exit};
use super::round::Round;
use crate::errorfile::ErrorRecord;
use crate::membership::MembershipEvent;

/// How long stopping waits for workers after SIGKILL before giving up on them.
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(10);

/// The machine's fixed settings.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    /// Restarts after failures before giving up.
    pub max_restarts: u32,
    /// SIGTERM to SIGKILL.
    pub grace: Duration,
    /// The rendezvous can re-form while workers train (etcd, standalone), unlike static.
    pub dynamic: bool,
}

/// How a worker ended, as the monitor saw it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkerExit {
    /// Exit code or signal.
    pub exit: Exit,
    /// When the agent saw it, in seconds since the Unix epoch.
    pub at: f64,
    /// What the worker wrote to its error file, if it failed and wrote one.
    pub record: Option<ErrorRecord>,
}

/// One worker as the machine tracks it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkerSlot {
    pub local_rank: usize,
    pub global_rank: usize,
    pub pid: i32,
    pub error_file: PathBuf,
    /// Set once it exited.
    pub exit: Option<WorkerExit>,
    /// It exited after the agent began stopping it.
    pub stopped: bool,
}

impl WorkerSlot {
    fn running(&self) -> bool {
        self.exit.is_none()
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input {
    /// The rendezvous completed: this node's place in the new round.
    RoundReady(Round),
    /// The job is closed (finished): nobody joins.
    RendezvousClosed { job: String },
    /// The rendezvous failed (the monitor keeps the error).
    RendezvousFailed,
    /// The workers of [`Action::StartWorkers`] run.
    WorkersStarted(Vec<WorkerSlot>),
    /// Starting a worker failed (the monitor keeps the error); these had started.
    SpawnFailed { started: Vec<WorkerSlot> },
    /// The replacement of [`Action::RestartWorker`] runs.
    WorkerRestarted(WorkerSlot),
    /// The replacement could not be started.
    RestartFailed { reason: String },
    /// A worker exited. `elastic`: it had said it recovers in place.
    Exited {
        pid: i32,
        exit: WorkerExit,
        elastic: bool,
    },
    /// The agent received a signal.
    Signal(i32),
    /// A membership event of the current round. `live_elastic`: every running worker
    /// recovers in place.
    Membership {
        event: MembershipEvent,
        live_elastic: bool,
    },
    /// A peer asked for one of this node's workers to be replaced, and the monitor judged the
    /// request from what it saw of the worker ([`Verdict::Wait`] is never sent).
    Evict {
        req: EvictionRequest,
        verdict: Verdict,
    },
    /// Time passed.
    Tick,
}

/// What to do.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Join the rendezvous for `attempt` (static rendezvous: the round is known at once).
    Join { attempt: u32 },
    /// Join the next round in the background while the workers train.
    Rejoin,
    /// Leave the rendezvous.
    Leave,
    /// Start every worker of `round`.
    StartWorkers {
        round: Round,
        attempt: u32,
        restarts: u32,
    },
    /// Start a replacement for the worker at `local_rank`, the `restarts`-th restart.
    RestartWorker { local_rank: usize, restarts: u32 },
    /// Send `signal` to the process groups of these running workers.
    Signal {
        local_ranks: Vec<usize>,
        signal: i32,
    },
    /// Tell the workers about a membership event.
    Publish(MembershipEvent),
    /// Tell the workers they now belong to round `to` (they keep running).
    Assign { from_round: u64, to: Round },
    /// Print a line for the user.
    Say(String),
    /// The workers of `round` succeeded: tell the other nodes, close the job.
    ReportSuccess { round: Round },
    /// The run is over.
    Finish(End),
}

/// How the run ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum End {
    /// An outcome.
    Outcome(AgentOutcome),
    /// The error the monitor kept (rendezvous or spawn).
    Error,
    /// An invariant broke.
    Internal(String),
}

/// What comes after the workers are stopped.
#[derive(Debug, Clone, PartialEq)]
enum Then {
    /// A worker failed: restart (counted) or give up.
    Fail,
    /// The membership changed: the next attempt, not counted.
    Reform,
    /// The agent was signalled.
    Signal(i32),
    /// The job finished while this node re-formed.
    Closed(String),
    /// The rendezvous or a spawn failed.
    Error,
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Joining the rendezvous, then starting the workers.
    Joining,
    /// Workers run; `reforming`: a rendezvous runs in the background meanwhile.
    Running { reforming: bool },
    /// Workers are being stopped; `deadline`: SIGKILL (or, after it, giving up).
    Stopping {
        then: Then,
        deadline: Instant,
        killed: bool,
        /// Signals received meanwhile: the first one becomes the outcome.
        signals: Vec<i32>,
    },
    /// Finished.
    Done,
}

/// A summary of the state, for logs (and for anything that reports the agent's health).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Status {
    /// `joining`, `running`, `reforming`, `stopping` or `done`.
    pub phase: &'static str,
    /// The current attempt.
    pub attempt: u32,
    /// Restarts after failures so far.
    pub restarts: u32,
    /// The round the workers are in, once there is one.
    pub round: Option<u64>,
    /// Workers in that round.
    pub world_size: Option<usize>,
    /// Workers of this node still running.
    pub running: usize,
}

/// The agent's state.
#[derive(Debug)]
pub(crate) struct Machine {
    params: Params,
    attempt: u32,
    restarts: u32,
    round: Option<Round>,
    workers: Vec<WorkerSlot>,
    phase: Phase,
}

impl Machine {
    /// A machine before its first rendezvous; [`Machine::start`] gives the first action.
    pub(crate) fn new(params: Params) -> Machine {
        Machine {
            params,
            attempt: 0,
            restarts: 0,
            round: None,
            workers: Vec::new(),
            phase: Phase::Joining,
        }
    }

    /// The first actions.
    pub(crate) fn start(&self) -> Vec<Action> {
        vec![Action::Join {
            attempt: self.attempt,
        }]
    }

    /// The current attempt (restarts and re-forms each start one).
    pub(crate) fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The current round, once one is known.
    pub(crate) fn round(&self) -> Option<&Round> {
        self.round.as_ref()
    }

    /// The workers of the current attempt.
    pub(crate) fn workers(&self) -> &[WorkerSlot] {
        &self.workers
    }

    /// A summary of the state.
    pub(crate) fn status(&self) -> Status {
        Status {
            phase: match self.phase {
                Phase::Joining => "joining",
                Phase::Running { reforming: false } => "running",
                Phase::Running { reforming: true } => "reforming",
                Phase::Stopping { .. } => "stopping",
                Phase::Done => "done",
            },
            attempt: self.attempt,
            restarts: self.restarts,
            round: self.round.as_ref().map(|r| r.round),
            world_size: self.round.as_ref().map(|r| r.world_size),
            running: self.live().len(),
        }
    }

    /// True while membership events matter (workers run and no re-form is under way).
    pub(crate) fn wants_membership(&self) -> bool {
        self.phase == Phase::Running { reforming: false }
    }

    /// True once the run is over.
    #[cfg(test)]
    pub(crate) fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// When the machine next needs a [`Input::Tick`] whatever happens (stopping's deadlines).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Stopping { deadline, .. } => Some(*deadline),
            _ => None,
        }
    }

    /// Takes one input at time `now`; returns what to do, in order.
    pub(crate) fn handle(&mut self, now: Instant, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        match self.phase.clone() {
            Phase::Joining => self.joining(now, input, &mut out),
            Phase::Running { reforming } => self.running(now, reforming, input, &mut out),
            Phase::Stopping { .. } => self.stopping(now, input, &mut out),
            Phase::Done => {}
        }
        self.check_deadline(now, &mut out);
        out
    }

    fn live(&self) -> Vec<usize> {
        self.workers
            .iter()
            .filter(|w| w.running())
            .map(|w| w.local_rank)
            .collect()
    }

    fn finish(&mut self, end: End, out: &mut Vec<Action>) {
        self.phase = Phase::Done;
        out.push(Action::Finish(end));
    }

    fn outcome(&mut self, o: AgentOutcome, out: &mut Vec<Action>) {
        self.finish(End::Outcome(o), out);
    }

    fn join_next(&mut self, out: &mut Vec<Action>) {
        self.attempt += 1;
        self.workers.clear();
        self.phase = Phase::Joining;
        out.push(Action::Join {
            attempt: self.attempt,
        });
    }

    fn joining(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        match input {
            Input::RoundReady(round) => {
                self.round = Some(round.clone());
                out.push(Action::StartWorkers {
                    round,
                    attempt: self.attempt,
                    restarts: self.restarts,
                });
            }
            Input::WorkersStarted(workers) => {
                self.workers = workers;
                self.phase = Phase::Running { reforming: false };
            }
            Input::SpawnFailed { started } => {
                self.workers = started;
                self.stop(now, Then::Error, out);
            }
            Input::RendezvousClosed { job } => {
                out.push(Action::Say(format!(
                    "job {job:?} has already finished; nothing to do"
                )));
                self.outcome(AgentOutcome::AlreadyFinished { job }, out);
            }
            Input::RendezvousFailed => self.finish(End::Error, out),
            Input::Signal(signal) => {
                out.push(Action::Leave);
                self.outcome(AgentOutcome::Signalled { signal }, out);
            }
            _ => {}
        }
    }

    fn running(&mut self, now: Instant, reforming: bool, input: Input, out: &mut Vec<Action>) {
        match input {
            Input::Exited { pid, exit, elastic } => self.exited(now, pid, exit, elastic, out),
            Input::WorkerRestarted(slot) => {
                out.push(Action::Say(format!(
                    "restarting rank {} alone (restart {} of {}); the other ranks keep their state",
                    slot.global_rank, self.restarts, self.params.max_restarts
                )));
                if let Some(w) = self
                    .workers
                    .iter_mut()
                    .find(|w| w.local_rank == slot.local_rank)
                {
                    *w = slot;
                }
            }
            Input::RestartFailed { reason } => {
                out.push(Action::Say(reason));
                self.stop(now, Then::Fail, out);
            }
            Input::Signal(s) => {
                out.push(Action::Say(format!(
                    "received {}; forwarding it to the workers (grace period {:?})",
                    signal_name(s),
                    self.params.grace
                )));
                let live = self.live();
                if !live.is_empty() {
                    out.push(Action::Signal {
                        local_ranks: live,
                        signal: s,
                    });
                }
                self.stop(now, Then::Signal(s), out);
            }
            Input::RoundReady(new) if reforming => {
                self.phase = Phase::Running { reforming: false };
                let from_round = self.round.as_ref().map_or(0, |r| r.round);
                out.push(Action::Assign {
                    from_round,
                    to: new.clone(),
                });
                out.push(Action::Say(format!(
                    "re-formed into round {} (node {} of {}, ranks {}..{} of {}) without \
                     stopping the workers",
                    new.round,
                    new.node_rank,
                    new.nnodes,
                    new.rank_base,
                    new.rank_base + self.workers.len(),
                    new.world_size
                )));
                self.round = Some(new);
            }
            Input::RendezvousClosed { job } if reforming => {
                out.push(Action::Say(format!(
                    "job {job:?} finished while this node re-formed"
                )));
                self.stop(now, Then::Closed(job), out);
            }
            Input::RendezvousFailed if reforming => self.stop(now, Then::Error, out),
            Input::Membership {
                event,
                live_elastic,
            } if !reforming => {
                out.push(Action::Publish(event.clone()));
                if !event.needs_reform() {
                    return;
                }
                if self.params.dynamic && live_elastic {
                    out.push(Action::Say(format!(
                        "membership changed ({event:?}); re-forming while the workers train"
                    )));
                    out.push(Action::Rejoin);
                    self.phase = Phase::Running { reforming: true };
                } else {
                    out.push(Action::Say(format!(
                        "membership changed ({event:?}); stopping workers to re-form"
                    )));
                    self.stop(now, Then::Reform, out);
                }
            }
            Input::Evict { req, verdict } => {
                let EvictionDecision::Kill { local_rank, rank } = decide(&req, &self.workers)
                else {
                    return;
                };
                match verdict {
                    Verdict::Kill(why) => {
                        out.push(Action::Say(format!(
                            "rank {rank} (pid {}) stopped responding (reported by rank {}); {why}: \
                             killing it so that it is replaced",
                            req.pid, req.by
                        )));
                        out.push(Action::Signal {
                            local_ranks: vec![local_rank],
                            signal: libc::SIGKILL,
                        });
                    }
                    Verdict::Drop(why) => out.push(Action::Say(format!(
                        "rank {rank} (pid {}) was reported silent by rank {}; {why}: leaving it \
                         alone",
                        req.pid, req.by
                    ))),
                    Verdict::Wait => {}
                }
            }
            _ => {}
        }
    }

    fn exited(
        &mut self,
        now: Instant,
        pid: i32,
        exit: WorkerExit,
        elastic: bool,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self
            .workers
            .iter_mut()
            .find(|w| w.pid == pid && w.running())
        else {
            return;
        };
        let (local_rank, rank, failed) = (w.local_rank, w.global_rank, !exit.exit.success());
        if failed {
            out.push(Action::Say(format!(
                "rank {rank} (local rank {local_rank}) exited with {}",
                exit.exit
            )));
        }
        w.exit = Some(exit);
        if failed {
            if !elastic || self.restarts >= self.params.max_restarts {
                self.stop(now, Then::Fail, out);
            } else {
                self.restarts += 1;
                out.push(Action::RestartWorker {
                    local_rank,
                    restarts: self.restarts,
                });
            }
            return;
        }
        if self.workers.iter().all(|w| !w.running()) {
            if let Some(round) = self.round.clone() {
                out.push(Action::ReportSuccess { round });
            }
            self.outcome(
                AgentOutcome::Succeeded {
                    attempts: self.attempt + 1,
                    restarts: self.restarts,
                },
                out,
            );
        }
    }

    /// Starts stopping every running worker; `then` decides what follows.
    fn stop(&mut self, now: Instant, then: Then, out: &mut Vec<Action>) {
        let live = self.live();
        if !live.is_empty() {
            out.push(Action::Signal {
                local_ranks: live,
                signal: libc::SIGTERM,
            });
        }
        self.phase = Phase::Stopping {
            then,
            deadline: now + self.params.grace,
            killed: false,
            signals: Vec::new(),
        };
        self.stopped_if_none_left(out);
    }

    fn stopping(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        match input {
            Input::Exited { pid, exit, .. } => {
                if let Some(w) = self
                    .workers
                    .iter_mut()
                    .find(|w| w.pid == pid && w.running())
                {
                    w.exit = Some(exit);
                    w.stopped = true;
                }
                self.stopped_if_none_left(out);
            }
            Input::Signal(s) => {
                if let Phase::Stopping {
                    signals,
                    killed,
                    deadline,
                    ..
                } = &mut self.phase
                {
                    signals.push(s);
                    // Ctrl-C during the grace period: the user does not want to wait.
                    if !*killed && s == libc::SIGINT {
                        *deadline = now;
                    }
                }
            }
            _ => {}
        }
    }

    fn check_deadline(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Phase::Stopping {
            deadline, killed, ..
        } = &self.phase
        else {
            return;
        };
        if now < *deadline {
            return;
        }
        if *killed {
            out.push(Action::Say(format!(
                "workers did not exit {KILL_WAIT:?} after SIGKILL; giving up on them"
            )));
            self.stopped(out);
            return;
        }
        let live = self.live();
        if let Phase::Stopping {
            deadline, killed, ..
        } = &mut self.phase
        {
            *killed = true;
            *deadline = now + KILL_WAIT;
        }
        out.push(Action::Signal {
            local_ranks: live,
            signal: libc::SIGKILL,
        });
    }

    fn stopped_if_none_left(&mut self, out: &mut Vec<Action>) {
        if self.live().is_empty() {
            self.stopped(out);
        }
    }

    /// Every worker is stopped (or given up on): what `then` says comes next.
    fn stopped(&mut self, out: &mut Vec<Action>) {
        let Phase::Stopping { then, signals, .. } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return;
        };
        let signalled = signals.first().copied();
        match then {
            Then::Fail => {
                let mut failures: Vec<WorkerFailure> = self
                    .workers
                    .iter()
                    .filter_map(|w| self.failure(w))
                    .collect();
                failures.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
                let Some(root) = failures.first().cloned() else {
                    return self.finish(
                        End::Internal("a failed attempt without a failed worker".into()),
                        out,
                    );
                };
                out.push(Action::Say(format!("root cause: {root}")));
                if let Some(signal) = signalled {
                    return self.outcome(AgentOutcome::Signalled { signal }, out);
                }
                if self.restarts < self.params.max_restarts {
                    self.restarts += 1;
                    out.push(Action::Say(format!(
                        "restarting workers (restart {} of {})",
                        self.restarts, self.params.max_restarts
                    )));
                    return self.join_next(out);
                }
                out.push(Action::Say(format!(
                    "giving up after {} restart(s) (--max-restarts {})",
                    self.restarts, self.params.max_restarts
                )));
                self.outcome(
                    AgentOutcome::Failed {
                        root_cause: root,
                        failures,
                        restarts: self.restarts,
                    },
                    out,
                );
            }
            Then::Reform => match signalled {
                Some(signal) => self.outcome(AgentOutcome::Signalled { signal }, out),
                None => self.join_next(out),
            },
            Then::Signal(signal) => self.outcome(AgentOutcome::Signalled { signal }, out),
            Then::Closed(job) => self.outcome(AgentOutcome::AlreadyFinished { job }, out),
            Then::Error => self.finish(End::Error, out),
        }
    }

    /// The failure `w` stands for, if any: a non-zero exit, unless the agent's own SIGTERM
    /// caused it and the worker wrote no error file.
    fn failure(&self, w: &WorkerSlot) -> Option<WorkerFailure> {
        let exit = w.exit.as_ref()?;
        if exit.exit.success() || (w.stopped && exit.record.is_none()) {
            return None;
        }
        Some(WorkerFailure {
            rank: w.global_rank,
            local_rank: w.local_rank,
            node_rank: self.round.as_ref().map_or(0, |r| r.node_rank),
            attempt: self.attempt,
            status: exit.exit.to_string(),
            timestamp: exit
                .record
                .as_ref()
                .map(|r| r.timestamp)
                .filter(|t| *t > 0.0)
                .unwrap_or(exit.at),
            message: exit.record.as_ref().map(|r| r.message.clone()),
            error_file: w.error_file.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::{SIGINT, SIGKILL, SIGTERM};

    const GRACE: Duration = Duration::from_secs(30);

    fn machine(max_restarts: u32, dynamic: bool) -> Machine {
        Machine::new(Params {
            max_restarts,
            grace: GRACE,
            dynamic,
        })
    }

    fn round(n: u64) -> Round {
        Round::fixed(n as u32, 1, 0, 2, ("127.0.0.1", 9))
    }

    /// Two workers, pids `base` and `base + 1`.
    fn slots(base: i32) -> Vec<WorkerSlot> {
        (0..2)
            .map(|lr| WorkerSlot {
                local_rank: lr,
                global_rank: lr,
                pid: base + lr as i32,
                error_file: format!("/logs/{lr}/error.json").into(),
                exit: None,
                stopped: false,
            })
            .collect()
    }

    fn exit(code: i32, at: f64) -> WorkerExit {
        WorkerExit {
            exit: Exit::Code(code),
            at,
            record: None,
        }
    }

    fn exited(pid: i32, code: i32, at: f64) -> Input {
        Input::Exited {
            pid,
            exit: exit(code, at),
            elastic: false,
        }
    }

    fn says(actions: &[Action]) -> Vec<&str> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Say(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    fn without_says(actions: Vec<Action>) -> Vec<Action> {
        actions
            .into_iter()
            .filter(|a| !matches!(a, Action::Say(_)))
            .collect()
    }

    fn sig(local_ranks: &[usize], signal: i32) -> Action {
        Action::Signal {
            local_ranks: local_ranks.to_vec(),
            signal,
        }
    }

    /// A machine whose two workers (pids 100, 101) run in round 0.
    fn running(max_restarts: u32, dynamic: bool, t: Instant) -> Machine {
        let mut m = machine(max_restarts, dynamic);
        assert_eq!(m.start(), vec![Action::Join { attempt: 0 }]);
        assert_eq!(
            m.handle(t, Input::RoundReady(round(0))),
            vec![Action::StartWorkers {
                round: round(0),
                attempt: 0,
                restarts: 0
            }]
        );
        assert!(m.handle(t, Input::WorkersStarted(slots(100))).is_empty());
        assert!(m.wants_membership());
        m
    }

    #[test]
    fn all_workers_exiting_zero_succeeds() {
        let t = Instant::now();
        let mut m = running(0, false, t);
        assert!(m.handle(t, exited(101, 0, 1.0)).is_empty());
        assert_eq!(
            m.handle(t, exited(100, 0, 2.0)),
            vec![
                Action::ReportSuccess { round: round(0) },
                Action::Finish(End::Outcome(AgentOutcome::Succeeded {
                    attempts: 1,
                    restarts: 0
                }))
            ]
        );
        assert!(m.done());
    }

    #[test]
    fn a_failure_stops_the_others_then_restarts_and_finally_gives_up() {
        let t = Instant::now();
        let mut m = running(1, false, t);
        let a = m.handle(t, exited(101, 3, 5.0));
        assert_eq!(says(&a), ["rank 1 (local rank 1) exited with exit code 3"]);
        assert_eq!(without_says(a), vec![sig(&[0], SIGTERM)]);
        assert_eq!(m.deadline(), Some(t + GRACE));
        // Rank 0 dies of the SIGTERM without an error file: not a failure.
        let a = m.handle(
            t,
            Input::Exited {
                pid: 100,
                exit: WorkerExit {
                    exit: Exit::Signal(SIGTERM),
                    at: 4.0,
                    record: None,
                },
                elastic: false,
            },
        );
        assert_eq!(
            says(&a),
            [
                "root cause: rank 1 (local rank 1, node rank 0, attempt 0) failed with exit \
                 code 3 (no error file at /logs/1/error.json)",
                "restarting workers (restart 1 of 1)"
            ]
        );
        assert_eq!(without_says(a), vec![Action::Join { attempt: 1 }]);
        m.handle(t, Input::RoundReady(round(1)));
        m.handle(t, Input::WorkersStarted(slots(200)));
        m.handle(t, exited(200, 7, 9.0));
        let a = m.handle(t, exited(201, 0, 9.5));
        assert_eq!(
            says(&a),
            [
                "root cause: rank 0 (local rank 0, node rank 0, attempt 1) failed with exit \
                 code 7 (no error file at /logs/0/error.json)",
                "giving up after 1 restart(s) (--max-restarts 1)"
            ]
        );
        let Some(Action::Finish(End::Outcome(AgentOutcome::Failed {
            root_cause,
            failures,
            restarts,
        }))) = a.last()
        else {
            panic!("{a:?}")
        };
        assert_eq!((root_cause.rank, failures.len(), *restarts), (0, 1, 1));
    }

    #[test]
    fn the_status_follows_the_phases() {
        let t = Instant::now();
        let mut m = machine(2, true);
        assert_eq!(m.status().phase, "joining");
        m.handle(t, Input::RoundReady(round(0)));
        m.handle(t, Input::WorkersStarted(slots(100)));
        assert_eq!(
            m.status(),
            Status {
                phase: "running",
                attempt: 0,
                restarts: 0,
                round: Some(0),
                world_size: Some(2),
                running: 2,
            }
        );
        m.handle(t, exited(100, 1, 1.0));
        assert_eq!((m.status().phase, m.status().running), ("stopping", 1));
        m.handle(t, exited(101, 143, 1.0));
        assert_eq!(
            (m.status().phase, m.status().attempt, m.status().restarts),
            ("joining", 1, 1)
        );
    }

    #[test]
    fn the_earliest_failure_is_the_root_cause() {
        let t = Instant::now();
        let mut m = running(0, false, t);
        m.handle(t, exited(100, 1, 20.0));
        // Rank 1 was stopped, but it wrote an error file saying why, earlier than rank 0.
        let a = m.handle(
            t,
            Input::Exited {
                pid: 101,
                exit: WorkerExit {
                    exit: Exit::Code(2),
                    at: 21.0,
                    record: Some(ErrorRecord {
                        message: "CUDA out of memory".into(),
                        timestamp: 10.0,
                        rank: None,
                        details: None,
                    }),
                },
                elastic: false,
            },
        );
        let Some(Action::Finish(End::Outcome(AgentOutcome::Failed {
            root_cause,
            failures,
            ..
        }))) = a.last()
        else {
            panic!("{a:?}")
        };
        assert_eq!(root_cause.rank, 1);
        assert_eq!(root_cause.message.as_deref(), Some("CUDA out of memory"));
        assert_eq!(failures.len(), 2);
    }

    #[test]
    fn an_elastic_worker_is_restarted_alone_until_the_restarts_run_out() {
        let t = Instant::now();
        let mut m = running(1, true, t);
        let elastic_exit = |pid| Input::Exited {
            pid,
            exit: WorkerExit {
                exit: Exit::Signal(SIGKILL),
                at: 1.0,
                record: None,
            },
            elastic: true,
        };
        let a = m.handle(t, elastic_exit(101));
        assert_eq!(
            without_says(a),
            vec![Action::RestartWorker {
                local_rank: 1,
                restarts: 1
            }]
        );
        let mut replacement = slots(300)[1].clone();
        replacement.pid = 301;
        let a = m.handle(t, Input::WorkerRestarted(replacement));
        assert_eq!(
            says(&a),
            ["restarting rank 1 alone (restart 1 of 1); the other ranks keep their state"]
        );
        // A late report about the old pid changes nothing.
        assert!(m.handle(t, exited(101, 0, 2.0)).is_empty());
        // The next failure is over the limit: everyone stops.
        let a = m.handle(t, elastic_exit(301));
        assert_eq!(without_says(a), vec![sig(&[0], SIGTERM)]);
    }

    #[test]
    fn a_signal_is_forwarded_then_sigterm_grace_sigkill_and_give_up() {
        let t = Instant::now();
        let mut m = running(0, false, t);
        let a = m.handle(t, Input::Signal(libc::SIGHUP));
        assert_eq!(
            says(&a),
            ["received SIGHUP; forwarding it to the workers (grace period 30s)"]
        );
        assert_eq!(
            without_says(a),
            vec![sig(&[0, 1], libc::SIGHUP), sig(&[0, 1], SIGTERM)]
        );
        assert!(m.handle(t + GRACE / 2, Input::Tick).is_empty());
        m.handle(t + GRACE / 2, exited(100, 143, 1.0));
        assert_eq!(
            m.handle(t + GRACE, Input::Tick),
            vec![sig(&[1], SIGKILL)],
            "the grace period is over"
        );
        let a = m.handle(t + GRACE + KILL_WAIT, Input::Tick);
        assert_eq!(
            says(&a),
            ["workers did not exit 10s after SIGKILL; giving up on them"]
        );
        assert_eq!(
            a.last(),
            Some(&Action::Finish(End::Outcome(AgentOutcome::Signalled {
                signal: libc::SIGHUP
            })))
        );
    }

    #[test]
    fn sigint_while_stopping_skips_the_grace_period() {
        let t = Instant::now();
        let mut m = running(0, false, t);
        m.handle(t, Input::Signal(SIGTERM));
        assert_eq!(
            m.handle(t, Input::Signal(SIGINT)),
            vec![sig(&[0, 1], SIGKILL)]
        );
        m.handle(t, exited(100, 0, 1.0));
        assert_eq!(
            m.handle(t, exited(101, 0, 1.0)),
            vec![Action::Finish(End::Outcome(AgentOutcome::Signalled {
                signal: SIGTERM
            }))]
        );
    }

    #[test]
    fn a_signal_while_stopping_for_a_failure_ends_the_run() {
        let t = Instant::now();
        let mut m = running(5, false, t);
        m.handle(t, exited(100, 1, 1.0));
        m.handle(t, Input::Signal(SIGTERM));
        let a = m.handle(t, exited(101, 143, 2.0));
        assert_eq!(
            a.last(),
            Some(&Action::Finish(End::Outcome(AgentOutcome::Signalled {
                signal: SIGTERM
            })))
        );
    }

    #[test]
    fn membership_changes_restart_plain_workers_uncounted() {
        let t = Instant::now();
        let ev = MembershipEvent::NodeWaiting {
            round: 0,
            waiting: 1,
        };
        for (dynamic, live_elastic) in [(false, true), (true, false)] {
            let mut m = running(0, dynamic, t);
            let a = m.handle(
                t,
                Input::Membership {
                    event: ev.clone(),
                    live_elastic,
                },
            );
            assert_eq!(
                without_says(a),
                vec![Action::Publish(ev.clone()), sig(&[0, 1], SIGTERM)]
            );
            m.handle(t, exited(100, 143, 1.0));
            let a = m.handle(t, exited(101, 143, 1.0));
            assert_eq!(a, vec![Action::Join { attempt: 1 }], "not counted");
            assert_eq!(m.attempt(), 1);
        }
    }

    #[test]
    fn elastic_workers_keep_training_while_the_node_reforms() {
        let t = Instant::now();
        let mut m = running(0, true, t);
        let lost = MembershipEvent::PeerLost {
            round: 0,
            node: "b".into(),
        };
        let a = m.handle(
            t,
            Input::Membership {
                event: lost.clone(),
                live_elastic: true,
            },
        );
        assert_eq!(without_says(a), vec![Action::Publish(lost), Action::Rejoin]);
        assert!(
            !m.wants_membership(),
            "events wait until the re-form is done"
        );
        let closed = MembershipEvent::JobClosed { round: 0 };
        assert!(m
            .handle(
                t,
                Input::Membership {
                    event: closed,
                    live_elastic: true
                }
            )
            .is_empty());
        let mut next = round(3);
        next.world_size = 4;
        let a = m.handle(t, Input::RoundReady(next.clone()));
        assert_eq!(
            without_says(a.clone()),
            vec![Action::Assign {
                from_round: 0,
                to: next
            }]
        );
        assert_eq!(
            says(&a),
            ["re-formed into round 3 (node 0 of 1, ranks 0..2 of 4) without stopping the workers"]
        );
        assert_eq!(m.round().map(|r| r.round), Some(3));
        assert!(m.wants_membership());
        // Events that need no re-form are only passed on.
        let closed = MembershipEvent::JobClosed { round: 3 };
        assert_eq!(
            m.handle(
                t,
                Input::Membership {
                    event: closed.clone(),
                    live_elastic: true
                }
            ),
            vec![Action::Publish(closed)]
        );
    }

    #[test]
    fn the_job_closing_while_reforming_stops_the_workers() {
        let t = Instant::now();
        let mut m = running(0, true, t);
        m.handle(
            t,
            Input::Membership {
                event: MembershipEvent::NewRound {
                    round: 0,
                    new_round: 1,
                },
                live_elastic: true,
            },
        );
        let a = m.handle(t, Input::RendezvousClosed { job: "j".into() });
        assert_eq!(without_says(a), vec![sig(&[0, 1], SIGTERM)]);
        m.handle(t, exited(100, 0, 1.0));
        assert_eq!(
            m.handle(t, exited(101, 0, 1.0)),
            vec![Action::Finish(End::Outcome(
                AgentOutcome::AlreadyFinished { job: "j".into() }
            ))]
        );
    }

    #[test]
    fn evictions_kill_only_a_running_worker_of_that_pid() {
        let t = Instant::now();
        let mut m = running(0, true, t);
        let with = |pid, verdict| Input::Evict {
            req: EvictionRequest {
                pid,
                by: "1".into(),
                group: Some((0, 0)),
            },
            verdict,
        };
        let req = |pid| with(pid, Verdict::Kill("it is stopped".into()));
        let a = m.handle(t, req(101));
        assert_eq!(
            says(&a),
            [
                "rank 1 (pid 101) stopped responding (reported by rank 1); it is stopped: \
                 killing it so that it is replaced"
            ]
        );
        assert_eq!(without_says(a), vec![sig(&[1], SIGKILL)]);
        // A dropped request only says why.
        let a = m.handle(t, with(100, Verdict::Drop("it is making progress".into())));
        assert_eq!(
            says(&a),
            [
                "rank 0 (pid 100) was reported silent by rank 1; it is making progress: \
                 leaving it alone"
            ]
        );
        assert!(without_says(a).is_empty());
        assert!(m.handle(t, req(999)).is_empty());
        m.handle(t, exited(100, 0, 1.0));
        assert!(m.handle(t, req(100)).is_empty(), "already exited");
    }

    #[test]
    fn joining_ends_on_a_signal_a_closed_job_or_an_error() {
        let t = Instant::now();
        let mut m = machine(0, true);
        assert_eq!(
            m.handle(t, Input::Signal(SIGTERM)),
            vec![
                Action::Leave,
                Action::Finish(End::Outcome(AgentOutcome::Signalled { signal: SIGTERM }))
            ]
        );
        let mut m = machine(0, true);
        let a = m.handle(t, Input::RendezvousClosed { job: "j".into() });
        assert_eq!(says(&a), ["job \"j\" has already finished; nothing to do"]);
        let mut m = machine(0, true);
        assert_eq!(
            m.handle(t, Input::RendezvousFailed),
            vec![Action::Finish(End::Error)]
        );
    }

    #[test]
    fn a_spawn_failure_stops_the_started_workers_then_reports_the_error() {
        let t = Instant::now();
        let mut m = machine(3, false);
        m.handle(t, Input::RoundReady(round(0)));
        let mut started = slots(100);
        started.truncate(1);
        assert_eq!(
            m.handle(t, Input::SpawnFailed { started }),
            vec![sig(&[0], SIGTERM)]
        );
        assert_eq!(
            m.handle(t, exited(100, 143, 1.0)),
            vec![Action::Finish(End::Error)]
        );
        let mut m = machine(3, false);
        m.handle(t, Input::RoundReady(round(0)));
        assert_eq!(
            m.handle(t, Input::SpawnFailed { started: vec![] }),
            vec![Action::Finish(End::Error)]
        );
    }
}
