//! Retention: which old checkpoints to delete. The decision is a pure function; deleting
//! renames the directory out of the `step-<N>` namespace first, so a half-deleted checkpoint
//! never looks like one.

use std::collections::BTreeSet;
use std::path::Path;

use crate::error::{Result, StorageError};
use crate::failpoint::hit;
use crate::fsio;
use crate::save::{step_dir_name, TRASH_PREFIX};

/// Which checkpoints to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Keep the newest `keep_last` checkpoints (at least 1).
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of this.
    pub keep_every: Option<u64>,
}

impl RetentionPolicy {
    /// Keeps the newest `keep_last`.
    pub fn last(keep_last: usize) -> Result<RetentionPolicy> {
        if keep_last == 0 {
            return Err(StorageError::InvalidArgument {
                reason: "keep_last must be at least 1".into(),
            });
        }
        Ok(RetentionPolicy {
            keep_last,
            keep_every: None,
        })
    }

    /// Also keeps every step that is a multiple of `every` (at least 1).
    pub fn and_every(mut self, every: u64) -> Result<RetentionPolicy> {
        if every == 0 {
            return Err(StorageError::InvalidArgument {
                reason: "keep_every must be at least 1".into(),
            });
        }
        self.keep_every = Some(every);
        Ok(self)
    }
}

/// The steps to delete among the committed `steps`, given the newest one known to be valid.
/// Kept: the newest `keep_last` steps, every multiple of `keep_every`, and `newest_valid`
/// whatever the policy says (so corrupt newer checkpoints never push out the one a restart
/// would use). Without a known valid checkpoint nothing is deleted.
pub fn plan_retention(
    steps: &[u64],
    newest_valid: Option<u64>,
    policy: &RetentionPolicy,
) -> Vec<u64> {
    let Some(valid) = newest_valid else {
        return Vec::new();
    };
    let sorted: BTreeSet<u64> = steps.iter().copied().collect();
    let keep_last: BTreeSet<u64> = sorted
        .iter()
        .rev()
        .take(policy.keep_last.max(1))
        .copied()
        .collect();
    sorted
        .into_iter()
        .filter(|&s| {
            !(keep_last.contains(&s)
                || s == valid
                || policy.keep_every.is_some_and(|m| m > 0 && s % m == 0))
        })
        .collect()
}

/// Deletes checkpoint `step` under `root`: rename to a trash name, fsync the root, remove.
/// Called with the root's lock held.
pub(crate) fn delete_step(root: &Path, step: u64) -> Result<()> {
    let from = root.join(step_dir_name(step));
    let to = root.join(format!("{TRASH_PREFIX}{step}-{}", fsio::unique_suffix()));
    fsio::rename_no_replace(&from, &to)?;
    fsio::fsync_dir(root)?;
    hit("storage::retention::trashed")?;
    std::fs::remove_dir_all(&to).map_err(|e| StorageError::io("remove", &to, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let p = |k, m: Option<u64>| RetentionPolicy {
            keep_last: k,
            keep_every: m,
        };
        let steps = [10, 20, 30, 40, 50];
        /// (committed steps, newest valid, policy, steps to delete)
        type Case<'a> = (&'a [u64], Option<u64>, RetentionPolicy, &'a [u64]);
        let cases: &[Case] = &[
            (&steps, Some(50), p(2, None), &[10, 20, 30]),
            (&steps, Some(50), p(5, None), &[]),
            (&steps, Some(50), p(9, None), &[]),
            (&steps, Some(50), p(1, Some(20)), &[10, 30]),
            // The newest two are corrupt: the newest valid one survives keep_last = 2.
            (&steps, Some(30), p(2, None), &[10, 20]),
            (&steps, Some(10), p(1, None), &[20, 30, 40]),
            (&steps, None, p(1, None), &[]),
            (&[], Some(1), p(1, None), &[]),
            (&[3, 1, 2], Some(3), p(1, None), &[1, 2]),
        ];
        for (steps, valid, policy, want) in cases {
            assert_eq!(
                plan_retention(steps, *valid, policy),
                want.to_vec(),
                "{steps:?} valid={valid:?} {policy:?}"
            );
        }
        assert!(RetentionPolicy::last(0).is_err());
        assert!(RetentionPolicy::last(1).unwrap().and_every(0).is_err());
    }
}
