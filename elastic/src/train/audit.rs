//! The sample audit: a record of which samples each committed step consumed, so that a test or
//! the chaos harness can check that every sample of every epoch was used exactly once, whatever
//! failed, re-formed or resized in between.
//!
//! With `REKINDLE_SAMPLE_AUDIT=<dir>` set, every rank appends one JSON line per committed step
//! to `<dir>/samples-<pid>.jsonl`:
//!
//! ```text
//! {"step":S,"epoch":E,"world_size":W,"rank":R,"round":R0,"generation":G,"indices":[i0,i1,...]}
//! ```
//!
//! `step` is the 0-based step just completed and `indices` the dataset indices of the step's
//! whole global batch (every rank's share, in order). Ranks that commit the same step write the
//! same `epoch` and `indices`; a checker groups lines by step.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::TrainError;

/// The environment variable naming the audit directory.
pub const SAMPLE_AUDIT_ENV: &str = "REKINDLE_SAMPLE_AUDIT";

/// One committed step, as written to the audit file.
#[derive(Debug, Serialize)]
pub(crate) struct AuditLine<'a> {
    pub step: u64,
    pub epoch: u64,
    pub world_size: usize,
    pub rank: usize,
    pub round: u64,
    pub generation: u64,
    pub indices: &'a [usize],
}

/// An open audit file (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct SampleAudit {
    path: PathBuf,
    file: File,
    failed: bool,
}

impl SampleAudit {
    /// Opens this process's audit file when `REKINDLE_SAMPLE_AUDIT` is set.
    pub fn from_env() -> Result<Option<SampleAudit>, TrainError> {
        match std::env::var_os(SAMPLE_AUDIT_ENV) {
            Some(dir) if !dir.is_empty() => SampleAudit::open(Path::new(&dir)).map(Some),
            _ => Ok(None),
        }
    }

    /// Opens (appending) `dir/samples-<pid>.jsonl`; `dir` must exist.
    pub fn open(dir: &Path) -> Result<SampleAudit, TrainError> {
        let env_err = |reason: String| TrainError::Env {
            name: SAMPLE_AUDIT_ENV,
            value: dir.display().to_string(),
            reason,
        };
        if !dir.is_dir() {
            return Err(env_err("not a directory".into()));
        }
        let path = dir.join(format!("samples-{}.jsonl", std::process::id()));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| env_err(format!("cannot open {}: {e}", path.display())))?;
        Ok(SampleAudit {
            path,
            file,
            failed: false,
        })
    }

    /// Appends one line. A failed write is reported once and the audit stops: it is evidence
    /// for a checker, never a reason to stop training.
    pub fn record(&mut self, line: &AuditLine<'_>) {
        if self.failed {
            return;
        }
        let mut bytes = match serde_json::to_vec(line) {
            Ok(b) => b,
            Err(e) => {
                self.fail(&e.to_string());
                return;
            }
        };
        bytes.push(b'\n');
        // One write of the whole line on an O_APPEND file: lines never interleave.
        if let Err(e) = self.file.write_all(&bytes) {
            self.fail(&e.to_string());
        }
    }

    fn fail(&mut self, why: &str) {
        self.failed = true;
        tracing::warn!(path = %self.path.display(), error = why, "the sample audit stopped");
        eprintln!(
            "rekindle: the sample audit {} stopped: {why}",
            self.path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_appended_as_json() {
        let dir = tempfile::tempdir().unwrap();
        let mut audit = SampleAudit::open(dir.path()).unwrap();
        for step in 0..2u64 {
            audit.record(&AuditLine {
                step,
                epoch: 0,
                world_size: 2,
                rank: 1,
                round: 0,
                generation: 3,
                indices: &[4, 2, step as usize],
            });
        }
        let path = dir
            .path()
            .join(format!("samples-{}.jsonl", std::process::id()));
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["step"], 1);
        assert_eq!(lines[1]["generation"], 3);
        assert_eq!(lines[1]["indices"], serde_json::json!([4, 2, 1]));
    }

    #[test]
    fn a_missing_directory_is_an_env_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = SampleAudit::open(&dir.path().join("nope")).unwrap_err();
        assert!(
            matches!(
                err,
                TrainError::Env {
                    name: SAMPLE_AUDIT_ENV,
                    ..
                }
            ),
            "{err}"
        );
    }
}
