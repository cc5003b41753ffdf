//! rekindle-elastic: rendezvous on etcd v3 or an embedded store, the membership stream, and
//! the agent behind `rekindle run`.
//!
//! - [`store`]: two [`Store`](rekindle_runtime::store::Store)s, [`store::EtcdStore`] and the
//!   embedded TCP store ([`store::TcpStoreServer`], [`store::TcpStoreClient`]);
//! - [`rendezvous`]: the handler, the pure state machine ([`rendezvous::state`]) and the
//!   backends (etcd leases, transactions and watches; or any store);
//! - [`membership`]: peer lost / node waiting / new round / job closed, for training loops
//!   and for workers;
//! - [`train`]: the elastic training loop ([`train::init`], [`train::Trainer`]): re-forms
//!   the group on failure, keeps survivors' state, resumes from checkpoints;
//! - [`agent`] and [`cli`]: `rekindle run`; [`errorfile`]: how workers report failures;
//! - [`torch_store`]: PyTorch's TCPStore protocol, so PyTorch programs run under the agent.
//!
//! A two-node round on the embedded store, as two agents on one host would form it:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use rekindle_elastic::rendezvous::*;
//! use rekindle_elastic::store::{TcpStoreClient, TcpStoreServer};
//!
//! let secret = rekindle_elastic::runtime::secret::JobSecret::new("demo secret").unwrap();
//! let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret).unwrap();
//! let addr = server.local_addr().to_string();
//! let node = |id: &str| {
//!     let client = Arc::new(TcpStoreClient::connect(&addr, &secret).unwrap());
//!     let backend = Arc::new(StoreBackend::new(client, &addr, "demo", Duration::from_secs(5)));
//!     let info = NodeInfo { id: id.into(), host: "127.0.0.1".into(), nproc: 1, store_addr: None };
//!     DynamicRendezvousHandler::new(backend, info, HandlerOptions::new(2, 2).unwrap())
//! };
//! let (a, b) = (node("a"), node("b"));
//! let t = std::thread::spawn(move || b.next_rendezvous().map(|i| i.rank));
//! let info = a.next_rendezvous().unwrap();
//! let rank_b = t.join().unwrap().unwrap();
//! assert_eq!(info.world_size, 2);
//! assert_eq!(info.rank + rank_b, 1); // ranks 0 and 1, in join order
//! ```

#![warn(missing_docs)]

/// The runtime crate (devices, process groups, collectives, DDP, optimizers, samplers), so a
/// training program can depend on this crate alone.
pub use rekindle_runtime as runtime;
/// The storage crate (checkpoints).
pub use rekindle_storage as storage;

pub mod agent;
pub mod cli;
pub mod errorfile;
pub mod etcd;
mod io_runtime;
pub mod membership;
pub mod rendezvous;
pub mod store;
#[cfg(feature = "test-etcd")]
pub mod testing;
pub mod torch_store;
pub mod train;
