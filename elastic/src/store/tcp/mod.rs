//! The embedded TCP store: a [`Store`](rekindle_runtime::store::Store) served by each agent, so
//! that single-host, `--standalone` and static runs need no etcd.
//!
//! The server keeps the map in memory; `wait` is answered by the server when the keys appear
//! (every change wakes the waiters), never by the client polling. A connection starts with a
//! handshake in which both sides prove they hold the job secret (`auth.rs`), and every frame
//! after it is a big-endian `u32` length, a body and a MAC under a key of that connection.
//! Requests carry an id so that many share one connection (`protocol.rs`). Frame sizes and
//! connection counts are bounded ([`ServerLimits`]).

mod auth;
mod client;
mod protocol;
mod server;

pub use client::{TcpStoreClient, DEFAULT_OP_TIMEOUT};
pub use protocol::MAX_FRAME;
pub use server::{ServerError, ServerLimits, TcpStoreServer};
