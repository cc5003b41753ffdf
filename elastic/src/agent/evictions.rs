//! Evictions: a worker's peers report it silent past the collective deadline (see
//! `train::form::evict_key`), and this node's agent replaces it.
//!
//! Three parts: the [`EvictionWatcher`] thread reads the requests from the round's store every
//! monitor interval (so a slow or unreachable store never delays the monitor loop) and hands
//! each one to the monitor as an event; [`judge`] is the pure verdict on a request from what
//! the agent sees of its own worker (process state and liveness record), so that a rank that
//! is alive but was unreachable (a partition: both sides report each other) is never killed;
//! [`decide`] is the state machine's check that the worker still runs. The kill itself is the
//! monitor's, like every signal to a worker (see [`super::process`]), so it can never reach a
//! reaped, recycled pid.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::Store;

use super::events::Event;
use super::machine::WorkerSlot;
use crate::train::liveness::{EvictionNotice, Liveness};

/// A peer's request to replace one of this node's workers: the key `evict/<node>/<pid>` of
/// the round's store, whose value names the reporting rank and the group in which the worker
/// was silent (an [`EvictionNotice`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EvictionRequest {
    /// The worker's pid.
    pub pid: i32,
    /// The rank that reported it (as written by the reporter).
    pub by: String,
    /// The round and generation of the group in which it was silent (`None`: a value that
    /// does not say, which is judged by the worker's progress alone).
    pub group: Option<(u64, u64)>,
}

impl EvictionRequest {
    /// The request for `pid` whose stored value is `raw`.
    pub(crate) fn parse(pid: i32, raw: &[u8]) -> EvictionRequest {
        match serde_json::from_slice::<EvictionNotice>(raw) {
            Ok(n) => EvictionRequest {
                pid,
                by: n.by.to_string(),
                group: Some((n.round, n.generation)),
            },
            Err(_) => EvictionRequest {
                pid,
                by: String::from_utf8_lossy(raw).into_owned(),
                group: None,
            },
        }
    }
}

/// What the agent sees of the worker a request names, when it looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observation {
    /// The process is stopped (SIGSTOP, or held by a debugger): it cannot take part in
    /// anything until someone continues it.
    pub stopped: bool,
    /// Its liveness record, if it keeps one (see [`crate::train::liveness`]).
    pub liveness: Option<Liveness>,
}

/// The verdict on a request, given what the agent saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Kill the worker (it is replaced like a worker that died); the reason is printed.
    Kill(String),
    /// Drop the request: the worker is alive and not stuck in that group. A partition makes
    /// both sides report each other; only the rank's own agent can tell, and it leaves a
    /// healthy rank alone (whether the group goes on without it is the rendezvous' call).
    Drop(String),
    /// Look again at the next turn of the monitor loop.
    Wait,
}

/// Judges `req`, which arrived `waited` ago, when the worker's record read `first` then and
/// reads `now.liveness` now. A stopped worker is killed at once. A worker that has joined a
/// newer group, or left the group the request names, or whose beat moved since the request
/// arrived, is alive and is left alone. A worker still in that group without a beat for
/// `grace` is stuck, and killed.
pub(crate) fn judge(
    req: &EvictionRequest,
    first: Option<Liveness>,
    now: Observation,
    waited: Duration,
    grace: Duration,
) -> Verdict {
    if now.stopped {
        return Verdict::Kill("it is stopped".into());
    }
    if let Some(l) = now.liveness {
        if let Some((round, generation)) = req.group {
            if (l.round, l.generation) > (round, generation) {
                return Verdict::Drop(format!(
                    "it has moved on to round {} generation {} since it was silent in round \
                     {round} generation {generation}",
                    l.round, l.generation
                ));
            }
            if !l.in_group || (l.round, l.generation) < (round, generation) {
                return Verdict::Drop(format!(
                    "it left round {round} generation {generation} itself (alive, only \
                     unreachable)"
                ));
            }
        }
        if first.is_some_and(|f| f.beat != l.beat) {
            return Verdict::Drop("it is making progress".into());
        }
    }
    if waited >= grace {
        return Verdict::Kill(format!(
            "it made no progress for {:.1} s after the report",
            waited.as_secs_f64()
        ));
    }
    Verdict::Wait
}

/// What the agent does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EvictionDecision {
    /// SIGKILL the worker at this local rank (it is then replaced like a worker that died).
    Kill {
        /// The worker's local rank.
        local_rank: usize,
        /// Its global rank, for the message.
        rank: usize,
    },
    /// Nothing to do: no running worker has that pid (it already exited, or the request is
    /// about a predecessor).
    Ignore,
}

/// The decision on `req` given this node's workers.
pub(crate) fn decide(req: &EvictionRequest, workers: &[WorkerSlot]) -> EvictionDecision {
    match workers
        .iter()
        .find(|w| w.pid == req.pid && w.exit.is_none())
    {
        Some(w) => EvictionDecision::Kill {
            local_rank: w.local_rank,
            rank: w.global_rank,
        },
        None => EvictionDecision::Ignore,
    }
}

/// What the watcher looks at; the monitor loop keeps it current.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Targets {
    /// The round's store, as [`crate::store::connect_with`] opens it.
    pub store_addr: String,
    /// The round's key prefix.
    pub prefix: String,
    /// The pids of the running workers.
    pub pids: Vec<i32>,
}

/// Reads eviction requests on its own thread until dropped.
pub(crate) struct EvictionWatcher {
    targets: Arc<Mutex<Targets>>,
    stop: Arc<AtomicBool>,
}

impl EvictionWatcher {
    /// Starts the watcher of node `node`: every `interval` it reads the requests for the
    /// current targets and sends each one found on `events` (and deletes it).
    pub(crate) fn start(
        node: String,
        interval: Duration,
        secret: JobSecret,
        events: Sender<Event>,
    ) -> EvictionWatcher {
        let targets = Arc::new(Mutex::new(Targets::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, st) = (targets.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("rekindle-evictions".into())
            .spawn(move || {
                let mut conn: Option<(String, Arc<dyn Store>)> = None;
                let mut retry_at = Instant::now();
                while !st.load(Ordering::Acquire) {
                    std::thread::sleep(interval);
                    let now = t.lock().map(|g| g.clone()).unwrap_or_default();
                    if now.pids.is_empty() || now.store_addr.is_empty() {
                        continue;
                    }
                    if conn.as_ref().is_none_or(|(a, _)| a != &now.store_addr) {
                        if Instant::now() < retry_at {
                            continue;
                        }
                        match crate::store::connect_with(&now.store_addr, &secret) {
                            Ok(c) => conn = Some((now.store_addr.clone(), c)),
                            Err(_) => {
                                retry_at = Instant::now() + Duration::from_secs(2);
                                continue;
                            }
                        }
                    }
                    let Some((_, store)) = &conn else { continue };
                    for pid in &now.pids {
                        let key = format!(
                            "{}{}",
                            now.prefix,
                            crate::train::form::evict_key(&node, *pid as u32)
                        );
                        if let Ok(Some(raw)) = store.get(&key) {
                            let req = EvictionRequest::parse(*pid, &raw);
                            if events.send(Event::Evict(req)).is_err() {
                                return;
                            }
                            let _ = store.delete_prefix(&key);
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the eviction watcher");
        }
        EvictionWatcher { targets, stop }
    }

    /// Sets what to watch.
    pub(crate) fn update(&self, targets: Targets) {
        if let Ok(mut g) = self.targets.lock() {
            if *g != targets {
                *g = targets;
            }
        }
    }
}

impl Drop for EvictionWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::machine::WorkerExit;
    use crate::agent::process::Exit;

    fn slot(local_rank: usize, pid: i32, exited: bool) -> WorkerSlot {
        WorkerSlot {
            local_rank,
            global_rank: 10 + local_rank,
            pid,
            error_file: "/e".into(),
            exit: exited.then_some(WorkerExit {
                exit: Exit::Signal(9),
                at: 0.0,
                record: None,
            }),
            stopped: false,
        }
    }

    #[test]
    fn only_a_running_worker_with_that_pid_is_killed() {
        let workers = [slot(0, 100, false), slot(1, 101, true)];
        let req = |pid| EvictionRequest {
            pid,
            by: "3".into(),
            group: Some((0, 0)),
        };
        let table = [
            (
                100,
                EvictionDecision::Kill {
                    local_rank: 0,
                    rank: 10,
                },
            ),
            // Exited already (its replacement has another pid).
            (101, EvictionDecision::Ignore),
            // Not one of ours.
            (555, EvictionDecision::Ignore),
        ];
        for (pid, want) in table {
            assert_eq!(decide(&req(pid), &workers), want, "pid {pid}");
        }
    }

    fn live(round: u64, generation: u64, in_group: bool, beat: u64) -> Option<Liveness> {
        Some(Liveness {
            round,
            generation,
            in_group,
            beat,
        })
    }

    #[test]
    fn only_stopped_or_stuck_workers_are_killed() {
        let req = EvictionRequest {
            pid: 7,
            by: "0".into(),
            group: Some((2, 5)),
        };
        let grace = Duration::from_secs(2);
        let (early, late) = (Duration::from_millis(100), Duration::from_secs(3));
        let obs = |stopped, liveness| Observation { stopped, liveness };
        let kill = |v: &Verdict| matches!(v, Verdict::Kill(_));
        let drop = |v: &Verdict| matches!(v, Verdict::Drop(_));
        // (first record, observation now, waited, expected)
        type Case = (
            Option<Liveness>,
            Observation,
            Duration,
            fn(&Verdict) -> bool,
        );
        let wait: fn(&Verdict) -> bool = |v| *v == Verdict::Wait;
        let table: Vec<(&str, Case)> = vec![
            (
                "stopped: at once",
                (
                    live(2, 5, true, 9),
                    obs(true, live(2, 5, true, 9)),
                    early,
                    kill,
                ),
            ),
            ("stopped, no record", (None, obs(true, None), early, kill)),
            (
                "in a newer generation",
                (
                    live(2, 6, true, 1),
                    obs(false, live(2, 6, true, 1)),
                    late,
                    drop,
                ),
            ),
            (
                "in a newer round",
                (
                    live(3, 0, true, 1),
                    obs(false, live(3, 0, true, 1)),
                    late,
                    drop,
                ),
            ),
            (
                "left that generation itself",
                (
                    live(2, 5, false, 9),
                    obs(false, live(2, 5, false, 9)),
                    late,
                    drop,
                ),
            ),
            (
                "not yet in it (record behind)",
                (
                    live(2, 4, true, 9),
                    obs(false, live(2, 4, true, 9)),
                    late,
                    drop,
                ),
            ),
            (
                "still in it, beat moved",
                (
                    live(2, 5, true, 9),
                    obs(false, live(2, 5, true, 10)),
                    early,
                    drop,
                ),
            ),
            (
                "still in it, no beat, within grace",
                (
                    live(2, 5, true, 9),
                    obs(false, live(2, 5, true, 9)),
                    early,
                    wait,
                ),
            ),
            (
                "still in it, no beat, past grace",
                (
                    live(2, 5, true, 9),
                    obs(false, live(2, 5, true, 9)),
                    late,
                    kill,
                ),
            ),
            (
                "no record, within grace",
                (None, obs(false, None), early, wait),
            ),
            (
                "no record, past grace",
                (None, obs(false, None), late, kill),
            ),
        ];
        for (what, (first, now, waited, want)) in table {
            let v = judge(&req, first, now, waited, grace);
            assert!(want(&v), "{what}: got {v:?}");
        }
        // A request that names no group is judged by the beat alone.
        let bare = EvictionRequest {
            group: None,
            ..req.clone()
        };
        let v = judge(
            &bare,
            live(9, 9, false, 1),
            obs(false, live(9, 9, false, 1)),
            late,
            grace,
        );
        assert!(kill(&v), "{v:?}");
        let v = judge(
            &bare,
            live(9, 9, false, 1),
            obs(false, live(9, 9, false, 2)),
            early,
            grace,
        );
        assert!(drop(&v), "{v:?}");
    }

    #[test]
    fn requests_are_parsed_with_or_without_a_group() {
        let notice = serde_json::to_vec(&EvictionNotice {
            by: 3,
            round: 1,
            generation: 4,
        })
        .unwrap();
        assert_eq!(
            EvictionRequest::parse(10, &notice),
            EvictionRequest {
                pid: 10,
                by: "3".into(),
                group: Some((1, 4)),
            }
        );
        assert_eq!(EvictionRequest::parse(10, b"2").group, None);
    }
}
