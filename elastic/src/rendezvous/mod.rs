//! Rendezvous: nodes of a job agree on a round, its members and their ranks.
//!
//! Split as in torchelastic: the [`RendezvousHandler`] is what an agent calls; the decisions
//! are the pure functions of [`state`]; the [`RendezvousBackend`] stores the shared state
//! (etcd v3 in [`EtcdBackend`], any [`Store`](rekindle_runtime::store::Store) in
//! [`StoreBackend`]).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use rekindle_elastic::rendezvous::*;
//! use rekindle_runtime::store::InMemoryStore;
//!
//! let store = Arc::new(InMemoryStore::new());
//! let backend = Arc::new(StoreBackend::new(store, "memory", "job-1", Duration::from_secs(5)));
//! let node = NodeInfo { id: "n0".into(), host: "localhost".into(), nproc: 1, store_addr: None };
//! let opts = HandlerOptions::new(1, 1).unwrap();
//! let handler = DynamicRendezvousHandler::new(backend, node, opts);
//! let info = handler.next_rendezvous().unwrap();
//! assert_eq!((info.round, info.rank, info.world_size), (0, 0, 1));
//! handler.shutdown().unwrap();
//! ```

mod backend;
mod etcd_backend;
mod handler;
pub mod state;
mod store_backend;

pub use backend::{RendezvousBackend, Snapshot, Token};
pub use etcd_backend::{validate_job_id, EtcdBackend, EtcdBackendOptions, MIN_LEASE_TTL};
pub use handler::{
    DynamicRendezvousHandler, HandlerOptions, RendezvousError, RendezvousHandler, RendezvousInfo,
};
pub use state::{NodeInfo, RendezvousState, Settings};
pub use store_backend::StoreBackend;
