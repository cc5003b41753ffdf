//! Evictions: a worker's peers report it silent past the collective deadline (see
//! `train::form::evict_key`), and this node's agent replaces it.
//!
//! Two halves: the [`EvictionWatcher`] thread reads the requests from the round's store every
//! monitor interval (so a slow or unreachable store never delays the monitor loop) and hands
//! each one to the monitor as an event; [`decide`] is the pure decision the state machine
//! takes on it. The kill itself is the monitor's, like every signal to a worker (see
//! [`super::process`]), so it can never reach a reaped, recycled pid.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::Store;

use super::events::Event;
use super::machine::WorkerSlot;

/// A peer's request to replace one of this node's workers: the key `evict/<node>/<pid>` of
/// the round's store, whose value is the reporting rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EvictionRequest {
    /// The worker's pid.
    pub pid: i32,
    /// The rank that reported it (as written by the reporter).
    pub by: String,
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
                        if let Ok(Some(by)) = store.get(&key) {
                            let req = EvictionRequest {
                                pid: *pid,
                                by: String::from_utf8_lossy(&by).into_owned(),
                            };
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
}
