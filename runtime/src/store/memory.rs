//! A store in one process's memory, for ranks run as threads.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{parse_counter, CasOutcome, Store, StoreError, StoreResult};

/// A [`Store`] held in memory; share it between threads with `Arc`. Waiters are woken by a
/// condition variable, not by polling.
#[derive(Debug, Default)]
pub struct InMemoryStore {
    map: Mutex<BTreeMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl InMemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-updated (every update is a
        // single insert or remove), so a poisoned lock is still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for InMemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str) -> StoreResult<Option<Vec<u8>>> {
        Ok(self.lock().get(key).cloned())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<Vec<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(**k))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(keys.iter().map(|k| map[*k].clone()).collect());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Timeout { missing, timeout });
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        let mut map = self.lock();
        let old = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let new = old.wrapping_add(delta);
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
    ) -> StoreResult<CasOutcome> {
        let mut map = self.lock();
        let current = map.get(key).map(|v| v.as_slice());
        if current != expected {
            return Ok(CasOutcome::Current(current.map(|v| v.to_vec())));
        }
        map.insert(key.to_string(), value.to_vec());
        drop(map);
        self.changed.notify_all();
        Ok(CasOutcome::Swapped)
    }

    fn delete_prefix(&self, prefix: &str) -> StoreResult<u64> {
        let mut map = self.lock();
        let doomed: Vec<String> = map
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &doomed {
            map.remove(k);
        }
        Ok(doomed.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conforms() {
        let store = std::sync::Arc::new(InMemoryStore::new());
        super::super::testing::conformance(store).unwrap();
    }
}
