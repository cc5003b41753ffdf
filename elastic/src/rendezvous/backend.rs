//! The storage under the rendezvous: read a snapshot, compare-and-set the state, wait for a
//! change, and keep this node's liveness record.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use rekindle_runtime::store::{Store, StoreResult};

/// The compare-and-set token of a snapshot: the state write succeeds only if nothing changed
/// the state since this snapshot was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token(pub(crate) TokenKind);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TokenKind {
    /// etcd: the state key's `mod_revision` (0: absent) and the snapshot's store revision.
    Etcd { state_rev: i64, revision: i64 },
    /// A generic store: the state bytes read and the change generation.
    Store {
        value: Option<Vec<u8>>,
        generation: i64,
    },
}

/// One consistent read of a job's rendezvous data.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The encoded state, if any node has written one.
    pub state: Option<Vec<u8>>,
    /// The token for [`RendezvousBackend::set_state`] and [`RendezvousBackend::wait_for_change`].
    pub token: Token,
    /// Ids of the nodes whose liveness record is current.
    pub alive: BTreeSet<String>,
    /// The job-finished record is present.
    pub finished: bool,
}

/// Storage for one job's rendezvous.
///
/// Errors are [`StoreError`](rekindle_runtime::store::StoreError)s: `Connection` means the
/// store could not be reached (callers retry until their deadline), `Unauthorized` means the
/// credentials were refused (callers give up at once).
pub trait RendezvousBackend: Send + Sync {
    /// A short name for messages (`etcd`, `store`).
    fn name(&self) -> &'static str;

    /// Where the store is, for messages and for workers.
    fn endpoint(&self) -> String;

    /// The job id.
    fn job(&self) -> &str;

    /// Starts this node's liveness record (and keeps it alive in the background). Calling it
    /// again after the record was lost creates a new one.
    fn register(&self, node_id: &str) -> StoreResult<()>;

    /// True if this node's liveness record expired behind its back (for example the store was
    /// unreachable for longer than the TTL): the node must [`register`](Self::register) again.
    fn liveness_lost(&self) -> bool;

    /// Reads the state, the live nodes and the finished record at once.
    fn snapshot(&self) -> StoreResult<Snapshot>;

    /// Writes `state` if nothing changed it since the snapshot of `token`; false on conflict.
    fn set_state(&self, state: &[u8], token: &Token) -> StoreResult<bool>;

    /// Returns once the state, the set of live nodes or the finished record may have changed
    /// since the snapshot of `token`, or at `deadline`, whichever is first.
    fn wait_for_change(&self, token: &Token, deadline: Instant) -> StoreResult<()>;

    /// Writes the job-finished record, kept for the backend's retention.
    fn mark_finished(&self, record: &[u8]) -> StoreResult<()>;

    /// Removes this node's liveness record at once (survivors need not wait for the TTL).
    fn leave(&self) -> StoreResult<()>;

    /// A store for the job's own keys under `prefix` (inside the job's namespace and, on etcd,
    /// bound to the job's lease).
    fn job_store(&self, prefix: &str) -> StoreResult<Arc<dyn Store>>;

    /// The address (for [`crate::store::connect`]) of a store the job's workers can open
    /// themselves and that outlives any single node, if the backend has one: on etcd, the
    /// cluster with the job's lease and the agent's credentials (the password as a file path,
    /// TLS as file paths). `None`: workers use node 0's embedded store.
    fn worker_store_addr(&self) -> Option<String> {
        None
    }
}
