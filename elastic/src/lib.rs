//! rekindle-elastic: rendezvous (etcd v3 and the embedded store), membership and the agent.

#![warn(missing_docs)]

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
