//! The worker's figures for its agent: the step reached, step and checkpoint times, checkpoint
//! sizes and the bytes its collectives sent. The agent names a file in the worker's log dir
//! ([`METRICS_FILE_ENV`]); the worker rewrites it atomically (a temp file renamed over it) at
//! most every [`WRITE_EVERY`] and when its run ends, and the agent reads it when it is scraped
//! (see `rekindle run --health-port`). Without the variable nothing is written.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rekindle_storage::{AsyncCheckpointer, StorageError};

/// The file the agent reads this worker's figures from.
pub const METRICS_FILE_ENV: &str = "REKINDLE_METRICS_FILE";

/// How often the file is rewritten at most while training.
pub const WRITE_EVERY: Duration = Duration::from_millis(200);

/// What one worker process reports (the file's JSON). Totals count this process only: the
/// agent adds up the files of every worker it started.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkerFigures {
    /// The step reached (a resumed run counts the checkpoint's steps).
    pub step: u64,
    /// Steps this process completed.
    pub steps: u64,
    /// Their wall time, in seconds.
    pub step_seconds_sum: f64,
    /// The last step's wall time, in seconds.
    pub last_step_seconds: f64,
    /// Background checkpoints this process saw committed.
    pub checkpoints: u64,
    /// Their time from the start of the save to the commit being seen, in seconds.
    pub checkpoint_seconds_sum: f64,
    /// Bytes this process wrote for them.
    pub checkpoint_bytes_sum: u64,
    /// Bytes this process wrote for the last one.
    pub last_checkpoint_bytes: u64,
    /// Bytes this process's collectives sent to peers.
    pub collective_bytes: u64,
}

/// Keeps a worker's figures and writes them for the agent.
#[derive(Debug)]
pub(crate) struct MetricsWriter {
    path: Option<PathBuf>,
    figures: WorkerFigures,
    written: Option<Instant>,
    /// The background save in flight: its step and when it started.
    saving: Option<(u64, Instant)>,
}

impl MetricsWriter {
    /// A writer to the file the agent named, if it named one.
    pub(crate) fn from_env() -> MetricsWriter {
        MetricsWriter {
            path: std::env::var_os(METRICS_FILE_ENV)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            figures: WorkerFigures::default(),
            written: None,
            saving: None,
        }
    }

    /// A step ended at `step` after `secs` seconds.
    pub(crate) fn step(&mut self, step: u64, secs: f64) {
        self.figures.step = step;
        self.figures.steps += 1;
        self.figures.step_seconds_sum += secs;
        self.figures.last_step_seconds = secs;
        self.write_due();
    }

    /// The step reached changed without a step (restored, synced from a peer).
    pub(crate) fn at_step(&mut self, step: u64) {
        self.figures.step = step;
    }

    /// A background save of `step` was handed to `writer` (which first waited for the save
    /// before it, if that one was still in flight).
    pub(crate) fn save_started(&mut self, step: u64, writer: &AsyncCheckpointer) {
        if let Some((before, started)) = self.saving.take() {
            if let Some(c) = writer.last_commit().filter(|c| c.step == before) {
                self.committed(started.elapsed().as_secs_f64(), c.bytes_written);
            }
        }
        self.saving = Some((step, Instant::now()));
    }

    /// Counts the save in flight once `writer` has committed it (looked at without waiting,
    /// so the time is right to within a step).
    pub(crate) fn observe(&mut self, writer: &AsyncCheckpointer) {
        let Some((step, started)) = self.saving else {
            return;
        };
        let done = match writer.flush(Duration::ZERO) {
            Ok(Some(c)) => Some(c),
            // Waited for elsewhere (a flush, the next save).
            Ok(None) => writer.last_commit().filter(|c| c.step == step),
            Err(StorageError::AsyncTimeout { .. }) => return,
            Err(e) => {
                tracing::warn!(step, error = %e, "checkpoint failed");
                None
            }
        };
        self.saving = None;
        if let Some(c) = done {
            self.committed(started.elapsed().as_secs_f64(), c.bytes_written);
        }
    }

    fn committed(&mut self, secs: f64, bytes: u64) {
        self.figures.checkpoints += 1;
        self.figures.checkpoint_seconds_sum += secs;
        self.figures.checkpoint_bytes_sum += bytes;
        self.figures.last_checkpoint_bytes = bytes;
    }

    /// Writes the file now.
    pub(crate) fn flush(&mut self) {
        let Some(path) = &self.path else {
            return;
        };
        self.figures.collective_bytes = rekindle_runtime::collectives::bytes_sent();
        if let Err(e) = write_atomic(path, &self.figures) {
            tracing::debug!(path = %path.display(), error = %e, "cannot write the metrics file");
        }
        self.written = Some(Instant::now());
    }

    fn write_due(&mut self) {
        if self.path.is_some() && self.written.is_none_or(|t| t.elapsed() >= WRITE_EVERY) {
            self.flush();
        }
    }
}

/// Writes `figures` to `path` through a temp file in the same dir, so a reader sees the old
/// file or the new one, never part of one.
pub(crate) fn write_atomic(path: &Path, figures: &WorkerFigures) -> std::io::Result<()> {
    let json = serde_json::to_vec(figures).map_err(std::io::Error::other)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}

/// Reads a worker's figures; `None` if the file is missing, larger than 64 KiB or not valid.
pub fn read_figures(path: &Path) -> Option<WorkerFigures> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut buf = Vec::new();
    f.take(64 * 1024 + 1).read_to_end(&mut buf).ok()?;
    if buf.len() > 64 * 1024 {
        return None;
    }
    serde_json::from_slice(&buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_replaced_whole_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.json");
        assert_eq!(read_figures(&path), None);
        let mut w = MetricsWriter {
            path: Some(path.clone()),
            figures: WorkerFigures::default(),
            written: None,
            saving: None,
        };
        w.step(1, 0.5);
        w.step(2, 0.25);
        w.committed(0.5, 10);
        w.committed(0.25, 100);
        w.flush();
        let got = read_figures(&path).unwrap();
        assert_eq!((got.step, got.steps), (2, 2));
        assert_eq!(got.step_seconds_sum, 0.75);
        assert_eq!(got.last_step_seconds, 0.25);
        assert_eq!((got.checkpoints, got.checkpoint_bytes_sum), (2, 110));
        assert_eq!(got.checkpoint_seconds_sum, 0.75);
        assert_eq!(got.last_checkpoint_bytes, 100);
        assert!(!dir.path().join("metrics.json.tmp").exists());
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(read_figures(&path), None);
    }
}
