//! What the agent's helper threads tell its monitor loop, on one channel.

use std::time::SystemTime;

use super::evictions::EvictionRequest;
use super::process::Exit;
use crate::rendezvous::{RendezvousError, RendezvousInfo};

/// An event on the monitor's channel.
#[derive(Debug)]
pub(crate) enum Event {
    /// A worker exited; it is not reaped yet (the monitor does that).
    Exited {
        pid: i32,
        local_rank: usize,
        exit: Exit,
        at: SystemTime,
    },
    /// The agent received this signal.
    Signal(i32),
    /// A rendezvous running on a helper thread finished.
    Rendezvous(Box<Result<RendezvousInfo, RendezvousError>>),
    /// A peer asked for one of this node's workers to be replaced.
    Evict(EvictionRequest),
}
