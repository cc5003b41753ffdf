//! A view of a store under a key prefix.

use std::sync::Arc;
use std::time::Duration;

use super::{CasOutcome, Store, StoreResult};

/// Every key is stored as `<prefix>/<key>`. A process group bootstraps under a prefix unique to
/// its (job, round), so keys of an earlier round can never be mistaken for this round's.
#[derive(Clone)]
pub struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl PrefixStore {
    /// A view of `inner` under `prefix` (a trailing `/` is added if missing).
    pub fn new(inner: Arc<dyn Store>, prefix: impl Into<String>) -> Self {
        let mut prefix = prefix.into();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        PrefixStore { inner, prefix }
    }

    /// The prefix, with its trailing `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        self.inner.get(&self.key(key))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout).map_err(|e| match e {
            super::StoreError::Timeout { missing, timeout } => super::StoreError::Timeout {
                missing: missing
                    .into_iter()
                    .map(|k| k.strip_prefix(&self.prefix).unwrap_or(&k).to_string())
                    .collect(),
                timeout,
            },
            other => other,
        })
    }
    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        self.inner.compare_and_set(&self.key(key), expected, value)
    }
    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        self.inner.delete_prefix(&self.key(prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::InMemoryStore;

    #[test]
    fn isolates_prefixes_and_conforms() {
        let base: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let a = PrefixStore::new(base.clone(), "job/a/round/1");
        let b = PrefixStore::new(base.clone(), "job/a/round/2");
        a.set("addr/0", b"x").unwrap();
        assert_eq!(b.get("addr/0").unwrap(), None);
        assert_eq!(
            base.get("job/a/round/1/addr/0").unwrap(),
            Some(b"x".to_vec())
        );
        let err = b.wait(&["addr/0"], Duration::from_millis(10)).unwrap_err();
        assert!(err.to_string().contains("\"addr/0\""), "{err}");
        super::super::testing::conformance(Arc::new(b)).unwrap();
    }
}
