//! The embedded TCP store: a [`Store`](rekindle_runtime::store::Store) served by the agent of
//! node rank 0 so that single-host and `--standalone` runs need no etcd.
//!
//! The server keeps the map in memory; `wait` is answered by the server when the keys appear
//! (every change wakes the waiters), never by the client polling. Frames are a big-endian
//! `u32` length and a body; requests carry an id so that many share one connection.

mod client;
mod protocol;
mod server;

pub use client::{TcpStoreClient, DEFAULT_OP_TIMEOUT};
pub use server::{ServerError, TcpStoreServer};
