//! Asynchronous saves: snapshot (copy), return, write in the background.
//!
//! At most one save is in flight: the next `save` first waits for it. The copy is made only
//! after that wait, into the buffers of the previous snapshot when the layout is unchanged, so
//! memory is bounded by one extra copy of the state (the snapshot being written), and after
//! the first save no new memory is allocated or faulted in. The caller stalls for the wait (if
//! the previous save is still running) plus the copy, which runs on every core with streaming
//! stores, into buffers backed by huge pages where the kernel allows (see
//! [`rekindle_runtime::bulk_copy`]).

use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rekindle_runtime::bulk_copy::{advise_huge_pages, copy_bytes};

use crate::dir::CheckpointDir;
use crate::error::{Result, StorageError};
use crate::save::CommitInfo;
use crate::shard::ShardCoordinator;
use crate::snapshot::Snapshot;
use crate::tensor::HostTensor;

/// The default bound on waiting for the save in flight.
pub const DEFAULT_ASYNC_TIMEOUT: Duration = Duration::from_secs(600);

struct InFlight {
    step: u64,
    rx: Receiver<(Result<CommitInfo>, Snapshot)>,
}

#[derive(Default)]
struct State {
    in_flight: Option<InFlight>,
    spare: Option<Snapshot>,
    last: Option<CommitInfo>,
}

/// Saves checkpoints of a [`CheckpointDir`] in the background, one at a time.
pub struct AsyncCheckpointer {
    dir: Arc<CheckpointDir>,
    state: Mutex<State>,
    timeout: Duration,
}

impl std::fmt::Debug for AsyncCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCheckpointer")
            .field("root", &self.dir.root())
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn same_layout(a: &Snapshot, b: &Snapshot) -> bool {
    a.len() == b.len()
        && a.entries().iter().zip(b.entries()).all(|(x, y)| {
            x.name == y.name
                && x.group == y.group
                && x.tensor.dtype() == y.tensor.dtype()
                && x.tensor.shape() == y.tensor.shape()
        })
}

/// Copies `src` into `dst` (same layout) on every core.
fn parallel_copy(dst: &mut Snapshot, src: &Snapshot) {
    dst.state = src.state.clone();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Split by bytes, not tensors, so one huge tensor does not serialise the copy.
    let mut jobs: Vec<(&mut [u8], &[u8])> = Vec::new();
    let piece = (src.size_in_bytes() as usize / threads / 4).max(1 << 20);
    for (d, s) in dst.entries_mut().iter_mut().zip(src.entries()) {
        for (dc, sc) in d
            .tensor
            .as_bytes_mut()
            .chunks_mut(piece)
            .zip(s.tensor.as_bytes().chunks(piece))
        {
            jobs.push((dc, sc));
        }
    }
    let per = jobs.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let mut rest = jobs.as_mut_slice();
        while !rest.is_empty() {
            let (mine, tail) = rest.split_at_mut(per.min(rest.len()));
            rest = tail;
            s.spawn(move || {
                for (d, src) in mine.iter_mut() {
                    copy_bytes(d, src);
                }
            });
        }
    });
}

/// Zero-filled buffers of `live`'s layout, not yet touched (so still unbacked), advised to use
/// huge pages, for the first copy.
fn fresh_like(live: &Snapshot) -> Result<Snapshot> {
    let mut fresh = Snapshot::new(live.state.clone());
    for e in live.entries() {
        let mut t = HostTensor::zeros(e.tensor.dtype(), e.tensor.shape());
        advise_huge_pages(t.as_bytes_mut());
        fresh.insert_in(&e.group, &e.name, e.device, t)?;
    }
    Ok(fresh)
}

impl AsyncCheckpointer {
    /// Saves into `dir`; waits for a save in flight at most [`DEFAULT_ASYNC_TIMEOUT`].
    pub fn new(dir: CheckpointDir) -> AsyncCheckpointer {
        AsyncCheckpointer {
            dir: Arc::new(dir),
            state: Mutex::new(State::default()),
            timeout: DEFAULT_ASYNC_TIMEOUT,
        }
    }

    /// Sets the bound on waiting for the save in flight (in `save`, `flush` and drop).
    pub fn with_timeout(mut self, timeout: Duration) -> AsyncCheckpointer {
        self.timeout = timeout;
        self
    }

    /// The directory saved into.
    pub fn dir(&self) -> &CheckpointDir {
        &self.dir
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| StorageError::WriterGone)
    }

    /// Waits for the save in flight; returns its outcome (the error of a failed save as
    /// [`StorageError::AsyncSaveFailed`]).
    fn wait_in_flight(&self, st: &mut State, timeout: Duration) -> Result<Option<CommitInfo>> {
        let Some(f) = st.in_flight.take() else {
            return Ok(None);
        };
        match f.rx.recv_timeout(timeout) {
            Ok((result, snapshot)) => {
                st.spare = Some(snapshot);
                match result {
                    Ok(info) => {
                        st.last = Some(info.clone());
                        Ok(Some(info))
                    }
                    Err(e) => Err(StorageError::AsyncSaveFailed {
                        step: f.step,
                        source: Box::new(e),
                    }),
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let step = f.step;
                st.in_flight = Some(f);
                Err(StorageError::AsyncTimeout { step, timeout })
            }
            Err(RecvTimeoutError::Disconnected) => Err(StorageError::WriterGone),
        }
    }

    /// Copies `live` and saves the copy in the background; returns once the copy is made.
    /// A save still in flight is waited for first. If that save failed, its error is returned
    /// and `live` is not saved (call again to save it).
    pub fn save(&self, live: &Snapshot) -> Result<()> {
        let mut st = self.lock()?;
        self.wait_in_flight(&mut st, self.timeout)?;
        let mut snapshot = match st.spare.take() {
            Some(spare) if same_layout(&spare, live) => spare,
            _ => fresh_like(live)?,
        };
        parallel_copy(&mut snapshot, live);
        self.start(&mut st, snapshot);
        Ok(())
    }

    /// Saves a snapshot the caller has already copied (or no longer needs), without copying.
    pub fn save_owned(&self, snapshot: Snapshot) -> Result<()> {
        let mut st = self.lock()?;
        self.wait_in_flight(&mut st, self.timeout)?;
        self.start(&mut st, snapshot);
        Ok(())
    }

    /// Saves this rank's shard of a sharded checkpoint in the background (see
    /// [`CheckpointDir::save_sharded`]): the snapshot is not copied, and rank 0 of `coord`
    /// commits the manifest once every rank's shard is durable. A save still in flight is
    /// waited for first, as in [`save`](Self::save).
    pub fn save_sharded_owned(&self, snapshot: Snapshot, coord: ShardCoordinator) -> Result<()> {
        let mut st = self.lock()?;
        self.wait_in_flight(&mut st, self.timeout)?;
        self.start_with(&mut st, snapshot, Some(coord));
        Ok(())
    }

    fn start(&self, st: &mut State, snapshot: Snapshot) {
        self.start_with(st, snapshot, None)
    }

    fn start_with(&self, st: &mut State, snapshot: Snapshot, coord: Option<ShardCoordinator>) {
        let (tx, rx) = mpsc::channel();
        let dir = Arc::clone(&self.dir);
        let step = snapshot.state.step;
        std::thread::spawn(move || {
            let result = match &coord {
                Some(c) => dir.save_sharded(&snapshot, c),
                None => dir.save(&snapshot),
            };
            let _ = tx.send((result, snapshot));
        });
        st.in_flight = Some(InFlight { step, rx });
    }

    /// True while a save is being written.
    pub fn in_flight(&self) -> bool {
        self.lock().map(|s| s.in_flight.is_some()).unwrap_or(false)
    }

    /// Waits (at most `timeout`) until the save in flight is durable; for shutdown and
    /// SIGTERM. Returns what it committed, or `None` when nothing was in flight.
    pub fn flush(&self, timeout: Duration) -> Result<Option<CommitInfo>> {
        let mut st = self.lock()?;
        self.wait_in_flight(&mut st, timeout)
    }

    /// The last save known to have committed.
    pub fn last_commit(&self) -> Option<CommitInfo> {
        self.lock().ok().and_then(|s| s.last.clone())
    }
}

impl Drop for AsyncCheckpointer {
    /// Waits for the save in flight, at most the configured timeout, and logs its failure.
    fn drop(&mut self) {
        let start = Instant::now();
        if let Ok(mut st) = self.state.lock() {
            if let Err(e) = self.wait_in_flight(&mut st, self.timeout) {
                tracing::warn!(error = %e, waited = ?start.elapsed(), "checkpoint save in flight at drop did not complete");
            }
        }
    }
}
