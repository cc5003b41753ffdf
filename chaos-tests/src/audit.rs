//! The sample audit: every sample of every epoch consumed exactly once.
//!
//! With `REKINDLE_SAMPLE_AUDIT=<dir>` set, every rank of the elastic loop appends one JSON line
//! per committed step to `<dir>/samples-<pid>.jsonl`:
//!
//! ```text
//! {"step":S,"epoch":E,"world_size":W,"rank":R,"round":R0,"generation":G,"indices":[i0,i1,...]}
//! ```
//!
//! where `S` is the 0-based step just completed and `indices` the dataset indices of the step's
//! whole global batch. [`check`] holds the records to the contract: records of one step agree
//! (a step redone after a restart from a checkpoint must consume the same samples); the steps
//! are contiguous; no index appears twice within an epoch; and an epoch the run went past
//! covers every index of the dataset exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The environment variable that turns the audit on.
pub const AUDIT_ENV: &str = "REKINDLE_SAMPLE_AUDIT";

/// One audit line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// The 0-based step just completed.
    pub step: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The world size it ran at.
    pub world_size: usize,
    /// The rank that wrote the line.
    pub rank: usize,
    /// The rendezvous round.
    pub round: u64,
    /// The group generation.
    pub generation: u64,
    /// The dataset indices of the step's whole global batch.
    pub indices: Vec<u64>,
}

/// Why the audit files could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// A file or the directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line is not an audit record.
    #[error("{path}:{line}: not an audit record: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// Why.
        reason: String,
    },
}

/// A broken rule of the contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "rule", rename_all = "kebab-case")]
pub enum Violation {
    /// Two records of one step disagree on the epoch or the indices.
    StepDisagrees {
        /// The step.
        step: u64,
    },
    /// Steps are missing between the first and the last.
    Gap {
        /// The first missing step.
        from: u64,
        /// The last missing step.
        to: u64,
    },
    /// An index was consumed twice within an epoch.
    Duplicate {
        /// The epoch.
        epoch: u64,
        /// The index.
        index: u64,
        /// The two steps that consumed it.
        steps: (u64, u64),
    },
    /// A completed epoch did not consume every index.
    Missing {
        /// The epoch.
        epoch: u64,
        /// How many indices were never consumed.
        count: usize,
        /// The smallest of them.
        first: u64,
    },
    /// An index outside the dataset.
    OutOfRange {
        /// The step.
        step: u64,
        /// The index.
        index: u64,
    },
    /// An epoch number went down from one step to the next.
    EpochBackwards {
        /// The step where it did.
        step: u64,
    },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::StepDisagrees { step } => {
                write!(f, "the records of step {step} disagree")
            }
            Violation::Gap { from, to } => write!(f, "steps {from}..={to} are missing"),
            Violation::Duplicate {
                epoch,
                index,
                steps,
            } => write!(
                f,
                "epoch {epoch}: sample {index} consumed twice (steps {} and {})",
                steps.0, steps.1
            ),
            Violation::Missing {
                epoch,
                count,
                first,
            } => write!(
                f,
                "epoch {epoch}: {count} sample(s) never consumed (the first is {first})"
            ),
            Violation::OutOfRange { step, index } => {
                write!(f, "step {step}: sample {index} is outside the dataset")
            }
            Violation::EpochBackwards { step } => {
                write!(f, "step {step}: the epoch went backwards")
            }
        }
    }
}

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AuditSummary {
    /// Records read.
    pub records: usize,
    /// The first and last step recorded.
    pub steps: Option<(u64, u64)>,
    /// Epochs checked for complete coverage.
    pub complete_epochs: Vec<u64>,
    /// World sizes seen.
    pub world_sizes: Vec<usize>,
    /// Every broken rule (at most one per kind and epoch is listed for duplicates).
    pub violations: Vec<Violation>,
}

impl AuditSummary {
    /// True when no rule was broken.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Reads every `samples-*.jsonl` file of `dir` (none is an empty list).
pub fn read_dir(dir: &Path) -> Result<Vec<AuditRecord>, AuditError> {
    let io = |path: &Path, source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut records = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(records),
        Err(e) => return Err(io(dir, e)),
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("samples-") && n.ends_with(".jsonl"))
        })
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            // A process killed mid-write leaves a partial last line; that step was not
            // recorded by it, and its peers' records still count.
            let last = i + 1 == text.lines().count() && !text.ends_with('\n');
            match serde_json::from_str::<AuditRecord>(line) {
                Ok(r) => records.push(r),
                Err(_) if last => {}
                Err(e) => {
                    return Err(AuditError::Parse {
                        path: path.clone(),
                        line: i + 1,
                        reason: e.to_string(),
                    })
                }
            }
        }
    }
    Ok(records)
}

/// Checks `records` against the contract (see the module docs) for a dataset of
/// `dataset_len` samples.
pub fn check(records: &[AuditRecord], dataset_len: u64) -> AuditSummary {
    let mut summary = AuditSummary {
        records: records.len(),
        ..AuditSummary::default()
    };
    // One (epoch, indices) per step; the rest must agree with it.
    let mut steps: BTreeMap<u64, (u64, &[u64])> = BTreeMap::new();
    let mut disagreeing = BTreeSet::new();
    let mut sizes = BTreeSet::new();
    for r in records {
        sizes.insert(r.world_size);
        match steps.get(&r.step) {
            None => {
                steps.insert(r.step, (r.epoch, &r.indices));
            }
            Some((e, idx)) => {
                if *e != r.epoch || *idx != r.indices.as_slice() {
                    disagreeing.insert(r.step);
                }
            }
        }
    }
    summary.world_sizes = sizes.into_iter().collect();
    summary.violations.extend(
        disagreeing
            .into_iter()
            .map(|step| Violation::StepDisagrees { step }),
    );
    let (Some(&first), Some(&last)) = (steps.keys().next(), steps.keys().next_back()) else {
        return summary;
    };
    summary.steps = Some((first, last));
    let mut prev: Option<u64> = None;
    for &s in steps.keys() {
        if let Some(p) = prev {
            if s > p + 1 {
                summary.violations.push(Violation::Gap {
                    from: p + 1,
                    to: s - 1,
                });
            }
        }
        prev = Some(s);
    }
    // Per epoch: who consumed each index.
    let mut epochs: BTreeMap<u64, BTreeMap<u64, u64>> = BTreeMap::new();
    let mut dup_reported = BTreeSet::new();
    let mut last_epoch = None;
    for (&step, &(epoch, indices)) in &steps {
        if last_epoch.is_some_and(|e| epoch < e) {
            summary.violations.push(Violation::EpochBackwards { step });
        }
        last_epoch = Some(epoch);
        let seen = epochs.entry(epoch).or_default();
        for &index in indices {
            if index >= dataset_len {
                summary
                    .violations
                    .push(Violation::OutOfRange { step, index });
                continue;
            }
            if let Some(&earlier) = seen.get(&index) {
                if dup_reported.insert(epoch) {
                    summary.violations.push(Violation::Duplicate {
                        epoch,
                        index,
                        steps: (earlier, step),
                    });
                }
            } else {
                seen.insert(index, step);
            }
        }
    }
    // An epoch is complete when a later one was recorded; it can be checked for coverage
    // when the records cover its start (it is not the first epoch seen, or step 0 is there).
    let first_epoch = steps.get(&first).map(|(e, _)| *e);
    let epoch_list: Vec<u64> = epochs.keys().copied().collect();
    for (i, &epoch) in epoch_list.iter().enumerate() {
        let later = i + 1 < epoch_list.len();
        let starts_covered = Some(epoch) != first_epoch || first == 0;
        if !(later && starts_covered) {
            continue;
        }
        summary.complete_epochs.push(epoch);
        let seen = &epochs[&epoch];
        if (seen.len() as u64) < dataset_len {
            let first_missing = (0..dataset_len)
                .find(|i| !seen.contains_key(i))
                .unwrap_or(0);
            summary.violations.push(Violation::Missing {
                epoch,
                count: dataset_len as usize - seen.len(),
                first: first_missing,
            });
        }
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of `steps` steps over a dataset of `len` with a global batch of `batch`,
    /// shuffled per epoch by a fixed permutation, recorded by `world` ranks.
    fn run(len: u64, batch: u64, steps: u64, world: usize) -> Vec<AuditRecord> {
        let per_epoch = len / batch;
        let mut out = Vec::new();
        for step in 0..steps {
            let epoch = step / per_epoch;
            let k = step % per_epoch;
            // A bijection of 0..len that changes with the epoch.
            let indices: Vec<u64> = (k * batch..(k + 1) * batch)
                .map(|i| (i * 7 + epoch * 3) % len)
                .collect();
            for rank in 0..world {
                out.push(AuditRecord {
                    step,
                    epoch,
                    world_size: world,
                    rank,
                    round: 0,
                    generation: 0,
                    indices: indices.clone(),
                });
            }
        }
        out
    }

    #[test]
    fn a_clean_run_passes_and_counts_its_complete_epochs() {
        // 16 samples, batch 4: 4 steps per epoch; 10 steps = epochs 0, 1 complete, 2 partial.
        let s = check(&run(16, 4, 10, 2), 16);
        assert!(s.ok(), "{:?}", s.violations);
        assert_eq!(s.records, 20);
        assert_eq!(s.steps, Some((0, 9)));
        assert_eq!(s.complete_epochs, vec![0, 1]);
        assert_eq!(s.world_sizes, vec![2]);
    }

    #[test]
    fn a_step_redone_with_the_same_samples_is_fine_but_not_with_others() {
        let mut r = run(16, 4, 8, 1);
        r.push(r[5].clone());
        assert!(check(&r, 16).ok());
        let mut other = r[5].clone();
        other.indices[0] = (other.indices[0] + 1) % 16;
        r.push(other);
        assert_eq!(
            check(&r, 16).violations,
            vec![Violation::StepDisagrees { step: 5 }]
        );
    }

    #[test]
    fn a_missing_step_is_a_gap_and_leaves_its_epoch_short() {
        let r: Vec<_> = run(16, 4, 8, 1)
            .into_iter()
            .filter(|r| r.step != 2)
            .collect();
        let v = check(&r, 16).violations;
        assert_eq!(v[0], Violation::Gap { from: 2, to: 2 });
        assert!(
            matches!(
                v[1],
                Violation::Missing {
                    epoch: 0,
                    count: 4,
                    ..
                }
            ),
            "{v:?}"
        );
    }

    #[test]
    fn a_sample_consumed_twice_in_an_epoch_is_named() {
        let mut r = run(16, 4, 8, 1);
        // Step 1 takes one of step 0's samples instead of its own.
        let stolen = r[0].indices[2];
        r[1].indices[0] = stolen;
        let v = check(&r, 16).violations;
        assert!(
            v.contains(&Violation::Duplicate {
                epoch: 0,
                index: stolen,
                steps: (0, 1)
            }),
            "{v:?}"
        );
        assert!(v.iter().any(|x| matches!(
            x,
            Violation::Missing {
                epoch: 0,
                count: 1,
                ..
            }
        )));
    }

    #[test]
    fn indices_outside_the_dataset_and_backward_epochs_are_violations() {
        let mut r = run(16, 4, 8, 1);
        r[3].indices[1] = 99;
        r[6].epoch = 0;
        let v = check(&r, 16).violations;
        assert!(v.contains(&Violation::OutOfRange { step: 3, index: 99 }));
        assert!(v.contains(&Violation::EpochBackwards { step: 6 }), "{v:?}");
    }

    #[test]
    fn resharding_to_another_world_size_keeps_the_global_batches() {
        // Steps 0-5 at world 4, 6-11 at world 3 (the same global batches): still clean.
        let mut r: Vec<_> = run(16, 4, 6, 4);
        r.extend(run(16, 4, 12, 3).into_iter().filter(|x| x.step >= 6));
        let s = check(&r, 16);
        assert!(s.ok(), "{:?}", s.violations);
        assert_eq!(s.world_sizes, vec![3, 4]);
        assert_eq!(s.complete_epochs, vec![0, 1]);
    }

    #[test]
    fn an_audit_starting_mid_epoch_does_not_check_that_epoch() {
        let r: Vec<_> = run(16, 4, 12, 1)
            .into_iter()
            .filter(|r| r.step >= 2)
            .collect();
        let s = check(&r, 16);
        assert!(s.ok(), "{:?}", s.violations);
        assert_eq!(s.complete_epochs, vec![1]);
    }

    #[test]
    fn files_are_read_and_a_torn_last_line_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let recs = run(16, 4, 3, 1);
        let mut text: String = recs
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        text.push_str("{\"step\":3,\"epo");
        std::fs::write(dir.path().join("samples-11.jsonl"), &text).unwrap();
        std::fs::write(dir.path().join("other.txt"), "not audit").unwrap();
        assert_eq!(read_dir(dir.path()).unwrap(), recs);
        std::fs::write(dir.path().join("samples-12.jsonl"), "garbage\n").unwrap();
        assert!(matches!(
            read_dir(dir.path()),
            Err(AuditError::Parse { line: 1, .. })
        ));
        assert_eq!(read_dir(&dir.path().join("none")).unwrap(), vec![]);
    }
}
