//! The bootstrap key-value store.
//!
//! Process groups exchange addresses (TCP) or unique ids (NCCL) through a [`Store`]. The trait is
//! deliberately small so the in-memory store here, the [`FileStore`] for processes on one host,
//! and the etcd and embedded TCP stores of `rekindle-elastic` all plug in unchanged. Every call
//! that can block takes a timeout.
//!
//! ```
//! use std::time::Duration;
//! use rekindle_runtime::store::{InMemoryStore, Store};
//!
//! let store = InMemoryStore::new();
//! store.set("a", b"1").unwrap();
//! assert_eq!(store.add("n", 5).unwrap(), 5);
//! let got = store.wait(&["a", "n"], Duration::from_secs(1)).unwrap();
//! assert_eq!(got, vec![b"1".to_vec(), b"5".to_vec()]);
//! ```

mod file;
mod memory;
mod prefix;
pub mod testing;

use std::time::Duration;

pub use file::FileStore;
pub use memory::InMemoryStore;
pub use prefix::PrefixStore;

/// Why a store operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// `wait` gave up: these keys were still missing when the timeout passed.
    #[error("timed out after {timeout:?} waiting for store keys {missing:?}")]
    Timeout {
        /// The keys that did not appear.
        missing: Vec<String>,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The store could not be reached.
    #[error("cannot reach store at {endpoint}: {reason}")]
    Connection {
        /// Where the store is.
        endpoint: String,
        /// What failed.
        reason: String,
    },
    /// The store refused the credentials.
    #[error("store at {endpoint} refused the credentials: {reason}")]
    Unauthorized {
        /// Where the store is.
        endpoint: String,
        /// The server's words.
        reason: String,
    },
    /// A value is not what the operation needs (for example `add` on a non-integer).
    #[error("store key {key:?} holds an invalid value: {reason}")]
    InvalidValue {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The store has been shut down.
    #[error("store is closed")]
    Closed,
    /// Any other backend failure (I/O, protocol).
    #[error("store backend failure during {op}: {reason}")]
    Backend {
        /// The store operation.
        op: &'static str,
        /// What failed.
        reason: String,
    },
}

/// The result of store operations.
pub type StoreResult<T> = std::result::Result<T, StoreError>;

/// The outcome of [`Store::compare_and_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CasOutcome {
    /// The key held the expected value (or was absent, when `None` was expected) and now holds
    /// the new one.
    Swapped,
    /// The key held something else, returned here (`None`: absent); nothing was written.
    Current(Option<Vec<u8>>),
}

/// A key-value store shared by the members of a job.
///
/// Contract, for every implementation:
/// - keys are UTF-8 strings; `/` separates levels but has no other meaning;
/// - `set` overwrites; a value set is visible to every later `get` of any client;
/// - `add` treats a missing key as 0 and stores the decimal text of the new value, so `get`
///   returns e.g. `b"5"`; it is atomic across clients;
/// - `wait` returns the values of all keys once every one exists, or
///   [`StoreError::Timeout`] naming the missing ones; it never blocks past its timeout by more
///   than one round trip to the store;
/// - methods may be called from any thread, including from inside an async runtime.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`.
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()>;

    /// The value of `key`, or `None` if absent.
    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>>;

    /// Waits until every key exists and returns their values in order.
    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>>;

    /// Adds `delta` to the integer at `key` (0 if absent) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> StoreResult<i64>;

    /// Sets `key` to `value` only if it currently holds `expected` (`None`: only if absent).
    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome>;

    /// Deletes every key that starts with `prefix`; returns how many were deleted.
    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64>;
}

impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        (**self).get(key)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        (**self).wait(keys, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        (**self).add(key, delta)
    }
    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        (**self).compare_and_set(key, expected, value)
    }
    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        (**self).delete_prefix(prefix)
    }
}

/// Parses the decimal integer that `add` stores.
pub(crate) fn parse_counter(key: &str, value: &[u8]) -> StoreResult<i64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| StoreError::InvalidValue {
            key: key.to_string(),
            reason: "not a decimal integer".into(),
        })
}
