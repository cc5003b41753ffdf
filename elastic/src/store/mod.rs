//! The two [`Store`](rekindle_runtime::store::Store) implementations of this crate: etcd v3
//! ([`EtcdStore`]) and the embedded TCP store ([`TcpStoreServer`] and [`TcpStoreClient`]).
//! Both pass `rekindle_runtime::store::testing::conformance` unchanged.

mod etcd;
mod tcp;

pub(crate) use etcd::get_prefix_opts;
pub use etcd::EtcdStore;
pub use tcp::{ServerError, TcpStoreClient, TcpStoreServer, DEFAULT_OP_TIMEOUT};
