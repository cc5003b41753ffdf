//! The two [`Store`](rekindle_runtime::store::Store) implementations of this crate: etcd v3
//! ([`EtcdStore`]) and the embedded TCP store ([`TcpStoreServer`] and [`TcpStoreClient`]).
//! Both pass `rekindle_runtime::store::testing::conformance` unchanged.

mod etcd;
mod tcp;

pub(crate) use etcd::get_prefix_opts;
pub use etcd::EtcdStore;
pub use tcp::{ServerError, TcpStoreClient, TcpStoreServer, DEFAULT_OP_TIMEOUT};

use std::sync::Arc;

use rekindle_runtime::store::{Store, StoreError, StoreResult};

use crate::etcd::EtcdConfig;

/// The scheme of a store address that names an etcd cluster (see [`connect`]).
pub const ETCD_SCHEME: &str = "etcd://";

/// Opens the store an address names, as `rekindle run` hands it to workers in
/// `REKINDLE_STORE`: `host:port` is an embedded store ([`TcpStoreClient`]);
/// `etcd://host:port[,host:port...][?lease=ID]` is an etcd cluster without authentication or
/// TLS ([`EtcdStore`], every key bound to lease `ID` when given).
pub fn connect(addr: &str) -> StoreResult<Arc<dyn Store>> {
    let Some(rest) = addr.strip_prefix(ETCD_SCHEME) else {
        return Ok(Arc::new(TcpStoreClient::connect(addr)?));
    };
    let (endpoints, query) = rest.split_once('?').unwrap_or((rest, ""));
    let bad = |reason: String| StoreError::InvalidValue {
        key: addr.to_string(),
        reason,
    };
    let endpoints: Vec<&str> = endpoints.split(',').filter(|e| !e.is_empty()).collect();
    if endpoints.is_empty() {
        return Err(bad("no etcd endpoint".into()));
    }
    let mut lease = None;
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        match kv.split_once('=') {
            Some(("lease", v)) => {
                lease = Some(
                    v.parse::<i64>()
                        .map_err(|_| bad(format!("lease {v:?} is not a number")))?,
                )
            }
            _ => return Err(bad(format!("unknown parameter {kv:?}"))),
        }
    }
    let store = EtcdStore::connect(&EtcdConfig::new(endpoints), "")?;
    Ok(Arc::new(match lease {
        Some(l) => store.with_lease(l),
        None => store,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_etcd_addresses_are_typed_errors() {
        for addr in ["etcd://", "etcd://h:1?lease=x", "etcd://h:1?ttl=3"] {
            match connect(addr) {
                Err(StoreError::InvalidValue { key, .. }) => assert_eq!(key, addr),
                Err(other) => panic!("{addr}: unexpected {other}"),
                Ok(_) => panic!("{addr}: accepted"),
            }
        }
    }
}
