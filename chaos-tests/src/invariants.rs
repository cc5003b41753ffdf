//! The invariants checked after every run.

use std::path::Path;
use std::time::{Duration, Instant};

use rekindle_elastic::testing::Fingerprint;
use rekindle_storage::{Checkpoint, CheckpointDir, LoadOptions};

use crate::audit;
use crate::cluster::Cluster;
use crate::report::Check;

/// The stated tolerance of the final loss after resizes: the mean loss of the last
/// [`LOSS_WINDOW`] steps may differ from the fault-free run's by this fraction of it (plus
/// 0.01 absolute). A resize changes the reduction order, so the parameters drift apart in
/// their last bits; the loss does not.
pub const LOSS_TOLERANCE: f64 = 0.10;

/// Steps averaged for the final loss.
pub const LOSS_WINDOW: usize = 50;

/// Every agent exited 0, or with the code the harness's own fault implies (137 for a killed
/// node, 143 for a preempted one).
pub fn exits(results: &[(usize, Option<i32>, Option<i32>)]) -> Check {
    let bad: Vec<String> = results
        .iter()
        .filter(|(_, code, expected)| *code != Some(expected.unwrap_or(0)))
        .map(|(node, code, expected)| {
            format!(
                "node {node} exited {} (expected {})",
                code.map_or("-".into(), |c| c.to_string()),
                expected.unwrap_or(0)
            )
        })
        .collect();
    Check::new(
        "exit",
        bad.is_empty(),
        if bad.is_empty() {
            format!("{} agent(s) exited as expected", results.len())
        } else {
            bad.join("; ")
        },
    )
}

/// The run printed the same fingerprint as the fault-free run.
pub fn fingerprint(got: Option<&Fingerprint>, expected: &Fingerprint) -> Check {
    match got {
        None => Check::fail("fingerprint", "no final_step line"),
        Some(g) if g == expected => Check::pass("fingerprint", format!("{g}")),
        Some(g) => Check::fail(
            "fingerprint",
            format!("{g}, the fault-free run gave {expected}"),
        ),
    }
}

/// The mean loss of the last [`LOSS_WINDOW`] steps of `rows` (`(step, loss)`, the last row
/// of a step wins).
pub fn final_loss(rows: &[(u64, f64)]) -> Option<f64> {
    let mut by_step = std::collections::BTreeMap::new();
    for (s, l) in rows {
        by_step.insert(*s, *l);
    }
    let last: Vec<f64> = by_step.values().rev().take(LOSS_WINDOW).copied().collect();
    (!last.is_empty()).then(|| last.iter().sum::<f64>() / last.len() as f64)
}

/// The final loss is within [`LOSS_TOLERANCE`] of the fault-free run's.
pub fn loss(got: Option<f64>, reference: Option<f64>) -> Check {
    match (got, reference) {
        (Some(g), Some(r)) => {
            let bound = LOSS_TOLERANCE * r.abs() + 0.01;
            Check::new(
                "loss",
                (g - r).abs() <= bound,
                format!(
                    "final loss {g:.4}, fault-free {r:.4} (tolerance {bound:.4}: {}% + 0.01)",
                    LOSS_TOLERANCE * 100.0
                ),
            )
        }
        _ => Check::fail("loss", "no loss recorded"),
    }
}

/// Every sample of every epoch consumed exactly once. Without any audit record the check
/// holds only when `required` is false (the program does not write the audit).
pub fn samples(dir: &Path, dataset_len: Option<u64>, required: bool) -> Check {
    let records = match audit::read_dir(dir) {
        Ok(r) => r,
        Err(e) => return Check::fail("samples", e.to_string()),
    };
    let Some(len) = dataset_len else {
        return Check::new(
            "samples",
            !required,
            "not checked: the dataset length of the program is not known (--dataset)",
        );
    };
    if records.is_empty() {
        return Check::new(
            "samples",
            !required,
            format!(
                "not checked: the program wrote no sample audit ({})",
                audit::AUDIT_ENV
            ),
        );
    }
    let s = audit::check(&records, len);
    let (first, last) = s.steps.unwrap_or((0, 0));
    let detail = format!(
        "{} records, steps {first}..={last}, epochs checked {:?}, world sizes {:?}",
        s.records, s.complete_epochs, s.world_sizes
    );
    if s.ok() {
        Check::pass("samples", detail)
    } else {
        let v: Vec<String> = s.violations.iter().take(5).map(|v| v.to_string()).collect();
        Check::fail("samples", format!("{}; {detail}", v.join("; ")))
    }
}

/// Nothing left under the job's etcd prefix but the finished record, within `timeout` (keys
/// on the job lease go one lease TTL after the last node).
pub fn etcd_clean(cluster: &Cluster, timeout: Duration) -> Check {
    let deadline = Instant::now() + timeout;
    loop {
        match cluster.etcd_keys() {
            Err(e) => return Check::fail("etcd-clean", e.to_string()),
            Ok(keys) => {
                let extra: Vec<&String> = keys.iter().filter(|k| *k != "finished").collect();
                let finished = keys.iter().any(|k| k == "finished");
                if extra.is_empty() || Instant::now() >= deadline {
                    return Check::new(
                        "etcd-clean",
                        extra.is_empty() && finished,
                        if !finished {
                            format!("no finished record; keys {keys:?}")
                        } else if extra.is_empty() {
                            "only the job's finished record is left".into()
                        } else {
                            format!("left after {timeout:?}: {extra:?}")
                        },
                    );
                }
            }
        }
        // etcd has no wait for a key's disappearance by expiry short of a watch per key:
        // look again shortly.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every committed checkpoint verifies (checksums of every file).
pub fn checkpoints(dir: &Path) -> Check {
    let steps = match CheckpointDir::new(dir).and_then(|d| d.committed_steps().map(|s| (d, s))) {
        Ok(x) => x,
        Err(e) => return Check::fail("checkpoints", e.to_string()),
    };
    let (d, steps) = steps;
    let bad: Vec<String> = steps
        .iter()
        .filter_map(|s| {
            Checkpoint::open(&d.step_path(*s), &LoadOptions::default())
                .err()
                .map(|e| format!("step-{s}: {e}"))
        })
        .collect();
    Check::new(
        "checkpoints",
        bad.is_empty(),
        if bad.is_empty() {
            format!("{} committed checkpoint(s) verify", steps.len())
        } else {
            bad.join("; ")
        },
    )
}

/// The newest committed checkpoint verifies (`None` when there is none).
pub fn newest_verifies(dir: &Path) -> Result<Option<u64>, String> {
    let d = CheckpointDir::new(dir).map_err(|e| e.to_string())?;
    let steps = d.committed_steps().map_err(|e| e.to_string())?;
    match steps.last() {
        None => Ok(None),
        Some(&s) => Checkpoint::open(&d.step_path(s), &LoadOptions::default())
            .map(|_| Some(s))
            .map_err(|e| format!("step-{s}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_held_to_what_the_faults_imply() {
        assert!(exits(&[(0, Some(0), None), (1, Some(137), Some(137))]).held);
        let c = exits(&[(0, Some(1), None), (1, None, Some(143))]);
        assert!(!c.held);
        assert_eq!(
            c.detail,
            "node 0 exited 1 (expected 0); node 1 exited - (expected 143)"
        );
    }

    #[test]
    fn final_loss_averages_the_last_steps_keeping_redone_steps_once() {
        let mut rows: Vec<(u64, f64)> = (1..=100).map(|s| (s, s as f64)).collect();
        rows.push((100, 100.0));
        // Steps 51..=100: mean 75.5.
        assert_eq!(final_loss(&rows), Some(75.5));
        assert_eq!(final_loss(&[]), None);
        assert!(loss(Some(1.05), Some(1.0)).held);
        assert!(!loss(Some(1.2), Some(1.0)).held);
        assert!(!loss(None, Some(1.0)).held);
    }

    #[test]
    fn fingerprints_compare() {
        let f = |h: &str| Fingerprint {
            step: 10,
            sha256: h.repeat(64),
        };
        assert!(fingerprint(Some(&f("a")), &f("a")).held);
        assert!(!fingerprint(Some(&f("b")), &f("a")).held);
        assert!(!fingerprint(None, &f("a")).held);
    }

    #[test]
    fn samples_without_records_hold_only_when_not_required() {
        let dir = tempfile::tempdir().unwrap();
        assert!(samples(dir.path(), Some(16), false).held);
        assert!(!samples(dir.path(), Some(16), true).held);
        assert!(!samples(dir.path(), None, true).held);
    }

    #[test]
    fn an_empty_checkpoint_dir_verifies() {
        let dir = tempfile::tempdir().unwrap();
        assert!(checkpoints(dir.path()).held);
        assert_eq!(newest_verifies(dir.path()), Ok(None));
    }
}
