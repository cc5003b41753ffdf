//! PyTorch programs under `rekindle run`: a server of PyTorch's TCPStore protocol, so that an
//! unchanged script calling `init_process_group(init_method="env://")` finds its store.
//!
//! torchrun runs a TCPStore in its agent and tells the workers to use it
//! (`TORCHELASTIC_USE_AGENT_STORE=True`): then every rank, rank 0 included, is a client of
//! `MASTER_ADDR:MASTER_PORT` and no worker binds a port. rekindle does the same with
//! [`TorchBootstrap`]: each round, node 0's agent starts a fresh [`TorchStoreServer`] on a
//! port of its own (port 0, so never in use) and publishes its address in the round's store;
//! the agent of every other node starts a [`TorchStoreProxy`] on loopback that forwards to it
//! once the address is known, so no agent waits. Workers get `MASTER_ADDR`/`MASTER_PORT` of
//! their node's endpoint.
//!
//! The protocol has no authentication, as PyTorch's own store has none. These keys are apart
//! from the job's own: a client of this server can read and write what the PyTorch programs
//! store (addresses of their process groups, NCCL ids), never rendezvous records, membership
//! or eviction keys. It binds loopback when the round has one node, node 0's own address when
//! that is an IP of the host, and every interface otherwise; proxies bind loopback only.
//! Requests are bounded ([`Limits`]): key and value sizes, keys per request, bytes held, and
//! connections.
//!
//! The pieces: [`protocol`] (the wire format, sans-IO), [`state`] (the store without I/O),
//! [`TorchStoreServer`], [`TorchStoreProxy`], [`TorchBootstrap`] (what the agent calls).

mod bootstrap;
pub mod protocol;
mod proxy;
mod server;
pub mod state;

pub use bootstrap::{RoundSite, TorchBootstrap, ADDR_KEY};
pub use protocol::Limits;
pub use proxy::{Resolve, TorchStoreProxy};
pub use server::TorchStoreServer;

use std::net::SocketAddr;

use rekindle_runtime::store::StoreError;

/// Why a PyTorch store could not be started.
#[derive(Debug, thiserror::Error)]
pub enum TorchStoreError {
    /// The address could not be bound.
    #[error("cannot bind the PyTorch store to {addr}: {source}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Its runtime could not be started.
    #[error("cannot start the PyTorch store's runtime: {0}")]
    Runtime(std::io::Error),
    /// Node 0 could not publish the store's address for the other nodes.
    #[error("cannot publish the PyTorch store's address at {key} in {store}: {source}")]
    Publish {
        /// The round's store.
        store: String,
        /// The key.
        key: String,
        /// The store's error.
        source: StoreError,
    },
}
