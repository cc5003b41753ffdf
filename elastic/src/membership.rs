//! The membership stream: what changes in a job while a round runs.
//!
//! In-process, [`Membership`] (from [`RendezvousHandler::membership`]) watches the rendezvous
//! backend and yields [`MembershipEvent`]s on a channel: [`Membership::poll`] never blocks,
//! [`Membership::next_timeout`] waits with a bound. A training loop checks it at each step
//! boundary and re-forms on `PeerLost` or `NodeWaiting`.
//!
//! Worker processes launched by `rekindle run` read the same events through
//! [`WorkerMembership`]: the agent appends each event to its embedded store under
//! `REKINDLE_MEMBERSHIP_PREFIX` as keys `0`, `1`, ... and the worker waits for the next key
//! (the store answers when it is written; nothing polls).
//!
//! [`RendezvousHandler::membership`]: crate::rendezvous::RendezvousHandler::membership

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::store::{Store, StoreError, StoreResult};
use serde::{Deserialize, Serialize};

use crate::rendezvous::state::{observe, Observation};
use crate::rendezvous::{RendezvousBackend, RendezvousState, Settings};

/// A change in the job's membership, seen by a member of `round`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MembershipEvent {
    /// A member of the round is gone (its lease expired or it left).
    PeerLost {
        /// The round.
        round: u64,
        /// The lost node's id.
        node: String,
    },
    /// Nodes wait to join, and a re-formed round could take them.
    NodeWaiting {
        /// The round.
        round: u64,
        /// How many.
        waiting: usize,
    },
    /// A newer round has opened (a member asked to re-form).
    NewRound {
        /// The observer's round.
        round: u64,
        /// The new round.
        new_round: u64,
    },
    /// The job is closed (finished).
    JobClosed {
        /// The round.
        round: u64,
    },
    /// The agent re-formed its node into a new round without stopping its workers (they use
    /// the elastic loop): each worker's new rank is `rank_base + LOCAL_RANK`.
    Assigned {
        /// The round the workers were in.
        round: u64,
        /// The new round.
        new_round: u64,
        /// The global rank of this node's local rank 0.
        rank_base: usize,
        /// The new world size.
        world_size: usize,
        /// The new round's store, `host:port`.
        store: String,
        /// The new round's key prefix in that store.
        store_prefix: String,
    },
}

impl MembershipEvent {
    /// The round the event was seen in.
    pub fn round(&self) -> u64 {
        match self {
            MembershipEvent::PeerLost { round, .. }
            | MembershipEvent::NodeWaiting { round, .. }
            | MembershipEvent::NewRound { round, .. }
            | MembershipEvent::Assigned { round, .. }
            | MembershipEvent::JobClosed { round } => *round,
        }
    }

    /// True for events after which the round should re-form (all but `JobClosed`).
    pub fn needs_reform(&self) -> bool {
        !matches!(self, MembershipEvent::JobClosed { .. })
    }
}

/// Events for the change from `seen` to `now`. Once the job is closed only that is
/// reported: its nodes leave as they finish (a node closes the job before its record goes),
/// and a member gone from a finished job is not a loss to re-form around.
pub(crate) fn diff(round: u64, seen: &Observation, now: &Observation) -> Vec<MembershipEvent> {
    let mut out = Vec::new();
    if now.closed {
        if !seen.closed {
            out.push(MembershipEvent::JobClosed { round });
        }
        return out;
    }
    for node in now.lost.difference(&seen.lost) {
        out.push(MembershipEvent::PeerLost {
            round,
            node: node.clone(),
        });
    }
    if now.waiting > 0 && now.waiting != seen.waiting {
        out.push(MembershipEvent::NodeWaiting {
            round,
            waiting: now.waiting,
        });
    }
    if let Some(new_round) = now.newer_round {
        if seen.newer_round != Some(new_round) {
            out.push(MembershipEvent::NewRound { round, new_round });
        }
    }
    out
}

/// How often the watcher re-checks its stop flag while nothing changes.
const WATCH_SLICE: Duration = Duration::from_millis(500);

/// The membership stream of one round. Dropping it stops the watcher (within
/// `WATCH_SLICE` (500 ms) plus one store round trip, in the background).
pub struct Membership {
    round: u64,
    rx: Mutex<Receiver<MembershipEvent>>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("round", &self.round)
            .finish()
    }
}

impl Membership {
    /// Watches `backend` as a member of `round` whose members are `members` (node ids).
    pub fn watch(
        backend: Arc<dyn RendezvousBackend>,
        round: u64,
        members: Vec<String>,
        settings: Settings,
    ) -> Membership {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("rekindle-membership".into())
                .spawn(move || watch_loop(backend, round, members, settings, tx, stop))
                .ok();
        }
        Membership {
            round,
            rx: Mutex::new(rx),
            stop,
        }
    }

    /// The round this stream watches.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The next event if one is ready; never blocks.
    pub fn poll(&self) -> Option<MembershipEvent> {
        self.rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_recv()
            .ok()
    }

    /// The next event, waiting at most `timeout`.
    pub fn next_timeout(&self, timeout: Duration) -> Option<MembershipEvent> {
        self.rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .recv_timeout(timeout)
            .ok()
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn watch_loop(
    backend: Arc<dyn RendezvousBackend>,
    round: u64,
    members: Vec<String>,
    settings: Settings,
    tx: Sender<MembershipEvent>,
    stop: Arc<AtomicBool>,
) {
    let mut seen = Observation {
        lost: BTreeSet::new(),
        ..Default::default()
    };
    let mut backoff = Duration::from_millis(50);
    while !stop.load(Ordering::Acquire) {
        let snap = match backend.snapshot() {
            Ok(s) => s,
            Err(_) => {
                // The store is unreachable: no event (a member is lost only when its lease
                // expires, which etcd decides, not us). Try again shortly.
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let st: Option<RendezvousState> = snap
            .state
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok());
        let now = observe(
            st.as_ref(),
            snap.finished,
            round,
            &members,
            &snap.alive,
            &settings,
        );
        for ev in diff(round, &seen, &now) {
            if tx.send(ev).is_err() {
                return;
            }
        }
        seen = now;
        if backend
            .wait_for_change(&snap.token, Instant::now() + WATCH_SLICE)
            .is_err()
        {
            std::thread::sleep(backoff);
        }
    }
}

/// Env var: the agent's embedded store (`host:port`).
pub const AGENT_STORE_ENV: &str = "REKINDLE_AGENT_STORE";
/// Env var: the key prefix of this attempt's membership events in the agent's store.
pub const MEMBERSHIP_PREFIX_ENV: &str = "REKINDLE_MEMBERSHIP_PREFIX";

/// Appends membership events for workers to read (used by the agent).
pub struct MembershipPublisher {
    store: Arc<dyn Store>,
    prefix: String,
    next: u64,
}

impl std::fmt::Debug for MembershipPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipPublisher")
            .field("prefix", &self.prefix)
            .field("next", &self.next)
            .finish()
    }
}

impl MembershipPublisher {
    /// Publishes under `prefix` in `store`.
    pub fn new(store: Arc<dyn Store>, prefix: &str) -> Self {
        MembershipPublisher {
            store,
            prefix: prefix.to_string(),
            next: 0,
        }
    }

    /// The index the next event will get.
    pub fn next_index(&self) -> u64 {
        self.next
    }

    /// Appends `ev` as the next key.
    pub fn publish(&mut self, ev: &MembershipEvent) -> StoreResult<()> {
        let body = serde_json::to_vec(ev).map_err(|e| StoreError::Backend {
            op: "publish membership",
            reason: e.to_string(),
        })?;
        self.store
            .set(&format!("{}{}", self.prefix, self.next), &body)?;
        self.next += 1;
        Ok(())
    }
}

/// A worker's view of the membership stream, read from its agent's store.
pub struct WorkerMembership {
    store: Arc<dyn Store>,
    prefix: String,
    next: u64,
}

impl std::fmt::Debug for WorkerMembership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMembership")
            .field("prefix", &self.prefix)
            .field("next", &self.next)
            .finish()
    }
}

impl WorkerMembership {
    /// Connects to the agent named by `REKINDLE_AGENT_STORE` and `REKINDLE_MEMBERSHIP_PREFIX`,
    /// with the job secret from the environment. `Ok(None)` if the process was not launched by
    /// `rekindle run`.
    pub fn from_env() -> StoreResult<Option<Self>> {
        let (Ok(addr), Ok(prefix)) = (
            std::env::var(AGENT_STORE_ENV),
            std::env::var(MEMBERSHIP_PREFIX_ENV),
        ) else {
            return Ok(None);
        };
        let store = crate::store::connect(&addr)?;
        Ok(Some(Self::new(store, &prefix)))
    }

    /// Reads events under `prefix` in `store`.
    pub fn new(store: Arc<dyn Store>, prefix: &str) -> Self {
        WorkerMembership {
            store,
            prefix: prefix.to_string(),
            next: 0,
        }
    }

    /// Starts reading at event `next` (a restarted worker skips what its predecessor read).
    pub fn skip_to(&mut self, next: u64) {
        self.next = next;
    }

    /// The index of the next event to read.
    pub fn next_index(&self) -> u64 {
        self.next
    }

    fn parse(&mut self, raw: &[u8]) -> StoreResult<MembershipEvent> {
        let key = format!("{}{}", self.prefix, self.next);
        let ev = serde_json::from_slice(raw).map_err(|e| StoreError::InvalidValue {
            key,
            reason: e.to_string(),
        })?;
        self.next += 1;
        Ok(ev)
    }

    /// The next event if one has been published; one store round trip, no waiting.
    pub fn poll(&mut self) -> StoreResult<Option<MembershipEvent>> {
        match self.store.get(&format!("{}{}", self.prefix, self.next))? {
            Some(raw) => self.parse(&raw).map(Some),
            None => Ok(None),
        }
    }

    /// The next event, waiting at most `timeout` (`Ok(None)` when none came).
    pub fn next_timeout(&mut self, timeout: Duration) -> StoreResult<Option<MembershipEvent>> {
        let key = format!("{}{}", self.prefix, self.next);
        match self.store.wait(&[&key], timeout) {
            Ok(mut v) => {
                let raw = v.pop().unwrap_or_default();
                self.parse(&raw).map(Some)
            }
            Err(StoreError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rekindle_runtime::store::InMemoryStore;

    fn set(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn diff_reports_each_change_once() {
        let none = Observation::default();
        let lost_b = Observation {
            lost: set(&["b"]),
            ..Default::default()
        };
        assert_eq!(
            diff(3, &none, &lost_b),
            vec![MembershipEvent::PeerLost {
                round: 3,
                node: "b".into()
            }]
        );
        assert!(diff(3, &lost_b, &lost_b).is_empty());
        let more = Observation {
            lost: set(&["b"]),
            waiting: 2,
            newer_round: Some(4),
            closed: false,
        };
        assert_eq!(
            diff(3, &lost_b, &more),
            vec![
                MembershipEvent::NodeWaiting {
                    round: 3,
                    waiting: 2
                },
                MembershipEvent::NewRound {
                    round: 3,
                    new_round: 4
                },
            ]
        );
        let closed = Observation {
            closed: true,
            ..more.clone()
        };
        assert_eq!(
            diff(3, &more, &closed),
            vec![MembershipEvent::JobClosed { round: 3 }]
        );
        assert!(diff(3, &closed, &closed).is_empty());
    }

    #[test]
    fn a_member_gone_from_a_closed_job_is_not_lost() {
        // The first node to finish closes the job, then its record goes: a watcher that sees
        // both at once must not re-form around it.
        let none = Observation::default();
        let finished_and_gone = Observation {
            lost: set(&["a"]),
            closed: true,
            ..Default::default()
        };
        assert_eq!(
            diff(0, &none, &finished_and_gone),
            vec![MembershipEvent::JobClosed { round: 0 }]
        );
    }

    #[test]
    fn worker_reads_what_the_agent_publishes() {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let mut publisher = MembershipPublisher::new(store.clone(), "m/0/");
        let mut worker = WorkerMembership::new(store, "m/0/");
        assert_eq!(worker.poll().unwrap(), None);
        let ev = MembershipEvent::NodeWaiting {
            round: 1,
            waiting: 1,
        };
        publisher.publish(&ev).unwrap();
        publisher
            .publish(&MembershipEvent::JobClosed { round: 1 })
            .unwrap();
        assert_eq!(worker.poll().unwrap(), Some(ev));
        assert_eq!(
            worker.next_timeout(Duration::from_secs(1)).unwrap(),
            Some(MembershipEvent::JobClosed { round: 1 })
        );
        assert_eq!(
            worker.next_timeout(Duration::from_millis(10)).unwrap(),
            None
        );
    }

    #[test]
    fn events_serialise_with_a_kind_tag() {
        let ev = MembershipEvent::PeerLost {
            round: 2,
            node: "n".into(),
        };
        let json = serde_json::to_string(&ev).unwrap();
        assert_eq!(json, r#"{"kind":"peer_lost","round":2,"node":"n"}"#);
    }
}
