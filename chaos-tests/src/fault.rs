//! Faults and seeded schedules.
//!
//! A [`Fault`] names what is done to the job and to which node or worker; a [`Planned`] entry
//! injects one or more faults at once when the job reaches a step. Schedules are made by pure
//! functions of a seed ([`rng`], [`spread`], [`pick`]): the same seed gives the same schedule.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// How a checkpoint file is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Damage {
    /// One byte in the middle of every tensor file is flipped.
    Flip,
    /// The largest tensor file is cut to half its length.
    Truncate,
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Fault {
    /// SIGKILL one worker.
    KillWorker {
        /// The node (agent) index.
        node: usize,
        /// The worker's local rank on it.
        local_rank: usize,
    },
    /// SIGKILL a node's agent and its workers at once (a lost machine); restarted once the
    /// others have re-formed when `restart` is set.
    KillNode {
        /// The node.
        node: usize,
        /// Start the node again afterwards.
        restart: bool,
    },
    /// SIGSTOP one worker for `secs` (a hang), then SIGCONT if it is still there (its
    /// agent should have replaced it by then when `secs` is past the collective deadline).
    HangWorker {
        /// The node.
        node: usize,
        /// The worker's local rank.
        local_rank: usize,
        /// Seconds stopped.
        secs: f64,
    },
    /// SIGTERM to a node's agent (spot preemption): checkpoint and leave within the grace
    /// period.
    Preempt {
        /// The node.
        node: usize,
    },
    /// Every process of the job is killed while rank 0 commits a checkpoint, paused at a
    /// commit stage (a storage failpoint); then the job is started again.
    KillDuringCommit {
        /// The stage (one of `rekindle_storage::failpoint::SAVE_STAGES`).
        stage: String,
    },
    /// Every process of the job is killed, the newest checkpoint damaged, and the job started
    /// again.
    CorruptCheckpoint {
        /// How.
        damage: Damage,
    },
    /// etcd is stopped and started again after `secs`.
    EtcdDown {
        /// Seconds down.
        secs: f64,
    },
    /// A node's link is cut for `secs`.
    Partition {
        /// The node.
        node: usize,
        /// Seconds cut.
        secs: f64,
    },
    /// A node's link is limited to `rate` (`tc tbf`) for `secs`.
    SlowLink {
        /// The node.
        node: usize,
        /// The rate (`tc` syntax, such as `20mbit`).
        rate: String,
        /// Seconds slowed.
        secs: f64,
    },
    /// A new node joins the job.
    AddNode,
}

impl Fault {
    /// The kind's name, as in reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillWorker { .. } => "kill-worker",
            Fault::KillNode { .. } => "kill-node",
            Fault::HangWorker { .. } => "hang-worker",
            Fault::Preempt { .. } => "preempt",
            Fault::KillDuringCommit { .. } => "kill-during-commit",
            Fault::CorruptCheckpoint { .. } => "corrupt-checkpoint",
            Fault::EtcdDown { .. } => "etcd-down",
            Fault::Partition { .. } => "partition",
            Fault::SlowLink { .. } => "slow-link",
            Fault::AddNode => "add-node",
        }
    }

    /// The node whose processes (agent or workers) the fault acts on, if it acts on some.
    pub fn process_node(&self) -> Option<usize> {
        match self {
            Fault::KillWorker { node, .. }
            | Fault::KillNode { node, .. }
            | Fault::HangWorker { node, .. }
            | Fault::Preempt { node } => Some(*node),
            _ => None,
        }
    }

    /// What and where, in a few words.
    pub fn target(&self) -> String {
        match self {
            Fault::KillWorker { node, local_rank } => {
                format!("node {node} local rank {local_rank}")
            }
            Fault::HangWorker {
                node,
                local_rank,
                secs,
            } => format!("node {node} local rank {local_rank}, {secs} s"),
            Fault::KillNode { node, restart } => {
                format!("node {node}{}", if *restart { ", restarted" } else { "" })
            }
            Fault::Preempt { node } => format!("node {node}"),
            Fault::KillDuringCommit { stage } => stage.clone(),
            Fault::CorruptCheckpoint { damage } => format!("{damage:?}").to_lowercase(),
            Fault::EtcdDown { secs } => format!("{secs} s"),
            Fault::Partition { node, secs } => format!("node {node}, {secs} s"),
            Fault::SlowLink { node, rate, secs } => format!("node {node}, {rate}, {secs} s"),
            Fault::AddNode => "new node".into(),
        }
    }

    /// Substrings of the job's output that show the fault was noticed (the first one after
    /// the fault is its detection).
    pub fn detection_markers(&self) -> &'static [&'static str] {
        match self {
            Fault::KillWorker { .. } => &[
                "restarting rank",
                "re-forming the group",
                "restarting workers",
            ],
            Fault::KillNode { .. } => &["re-forming", "membership changed", "re-formed into round"],
            Fault::HangWorker { .. } => &["stopped responding", "re-forming the group"],
            Fault::Preempt { .. } => &["stopping on signal"],
            Fault::KillDuringCommit { .. } | Fault::CorruptCheckpoint { .. } => {
                &["does not verify", "resumed from step"]
            }
            Fault::EtcdDown { .. } => &["etcd unreachable", "retrying"],
            Fault::Partition { .. } => &["re-forming", "stopped responding", "membership changed"],
            Fault::SlowLink { .. } => &[],
            Fault::AddNode => &["re-formed into round", "membership changed"],
        }
    }
}

/// Faults injected together when the job reaches a step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Planned {
    /// The step (as the job prints it) at which they are injected.
    pub at_step: u64,
    /// The faults (several: at once).
    pub faults: Vec<Fault>,
}

/// The random source of a schedule: ChaCha8 seeded with `seed` (the same on every platform).
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` steps in `lo..hi`, increasing, one drawn in each of `n` equal slices of the range so
/// that consecutive faults are spread out. Empty for `n == 0` or an empty range.
pub fn spread(rng: &mut ChaCha8Rng, n: usize, lo: u64, hi: u64) -> Vec<u64> {
    if n == 0 || hi <= lo {
        return Vec::new();
    }
    let width = (hi - lo) as f64 / n as f64;
    (0..n)
        .map(|i| {
            let a = lo + (width * i as f64) as u64;
            let b = (lo + (width * (i + 1) as f64) as u64).max(a + 1);
            rng.gen_range(a..b)
        })
        .collect()
}

/// One of `items`, drawn from `rng` (`None` for none).
pub fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> Option<&'a T> {
    if items.is_empty() {
        None
    } else {
        items.get(rng.gen_range(0..items.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_steps_and_another_seed_others() {
        let a = spread(&mut rng(7), 10, 100, 1100);
        let b = spread(&mut rng(7), 10, 100, 1100);
        let c = spread(&mut rng(8), 10, 100, 1100);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 10);
        for (i, s) in a.iter().enumerate() {
            let lo = 100 + 100 * i as u64;
            assert!((lo..lo + 100).contains(s), "step {s} of slice {i}");
        }
        assert!(a.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn degenerate_ranges_give_what_fits() {
        assert!(spread(&mut rng(1), 0, 0, 10).is_empty());
        assert!(spread(&mut rng(1), 3, 10, 10).is_empty());
        // More faults than steps: still increasing-or-equal and inside the range.
        let s = spread(&mut rng(1), 5, 10, 12);
        assert_eq!(s.len(), 5);
        assert!(s.iter().all(|x| (10..13).contains(x)), "{s:?}");
        assert_eq!(pick::<u8>(&mut rng(1), &[]), None);
        assert_eq!(pick(&mut rng(1), &[4]), Some(&4));
    }

    #[test]
    fn faults_serialize_with_their_kind() {
        let f = Fault::Partition { node: 1, secs: 2.5 };
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"kind":"partition","node":1,"secs":2.5}"#
        );
        assert_eq!(f.kind(), "partition");
        assert_eq!(f.target(), "node 1, 2.5 s");
        assert_eq!(
            Fault::CorruptCheckpoint {
                damage: Damage::Truncate
            }
            .target(),
            "truncate"
        );
    }
}
