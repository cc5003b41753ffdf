//! The op queue between the backend handle (any thread) and its worker thread: issue order,
//! the first failure breaking the group, abort, and the worker's end.
//!
//! The worker runs [`Queue::run`] with an [`Execute`]r; callers [`Queue::submit`],
//! [`Queue::abort`] and [`Queue::close`]. Every wait of the executor checks
//! [`Queue::abort_flag`], so an abort reaches an op in flight within one poll.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::buffer::Buffer;
use crate::collectives::{Collective, Work, WorkSender};
use crate::error::{Error, Result};

/// One queued operation: a collective on host buffers (staged through the device), or, with
/// the `cuda` feature, one on candle CUDA tensors.
pub(crate) enum Job {
    /// A [`Collective`] on host [`Buffer`]s.
    Host(Collective),
    /// A collective on device memory.
    #[cfg(feature = "cuda")]
    Device(super::tensor::DeviceOp),
}

impl Job {
    /// The op's name and, when it exchanges data with exactly one peer from `rank`, that peer.
    pub fn describe(&self, rank: usize) -> (&'static str, Option<usize>) {
        match self {
            Job::Host(op) => (op.name(), super::plan::single_peer(op, rank)),
            #[cfg(feature = "cuda")]
            Job::Device(op) => (op.name(), op.single_peer(rank)),
        }
    }
}

/// Runs one op to completion, failure, deadline or abort.
pub(crate) trait Execute {
    /// Runs `job`; must return soon after `abort` is raised.
    fn execute(&mut self, job: Job, abort: &AtomicBool) -> Result<Buffer>;
}

/// The queue and the group's failure state.
pub(crate) struct Queue {
    rank: usize,
    /// Raised by `abort`; every wait of the executor checks it.
    abort: AtomicBool,
    state: Mutex<State>,
    /// Signals queue changes (to the worker) and the end of the worker (to `abort`/`drop`).
    changed: Condvar,
}

struct State {
    ops: VecDeque<(Job, WorkSender)>,
    /// The first failure (or `Aborted`); set once, never cleared.
    error: Option<Error>,
    /// No more ops are accepted; the worker drains the queue and shuts down.
    closing: bool,
    /// The worker released its resources and is exiting.
    finished: bool,
}

impl Queue {
    /// An empty, healthy queue of rank `rank`.
    pub fn new(rank: usize) -> Queue {
        Queue {
            rank,
            abort: AtomicBool::new(false),
            state: Mutex::new(State {
                ops: VecDeque::new(),
                error: None,
                closing: false,
                finished: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The flag the executor's waits check.
    pub fn abort_flag(&self) -> &AtomicBool {
        &self.abort
    }

    /// True once abort was requested.
    pub fn is_aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    /// Raises the abort flag without failing anything yet (the worker will).
    pub fn raise_abort(&self) {
        self.abort.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// The first failure, if the group is broken.
    pub fn error(&self) -> Option<Error> {
        self.lock().error.clone()
    }

    /// The error later ops get once the group failed with `first`.
    fn broken(&self, first: &Error) -> Error {
        match first {
            Error::Aborted { rank } => Error::Aborted { rank: *rank },
            e => Error::GroupBroken {
                rank: self.rank,
                cause: Box::new(e.clone()),
            },
        }
    }

    /// Queues `op` (already validated), or fails it at once if the group is broken.
    pub fn submit(&self, op: Job) -> Work {
        let (work, tx) = Work::pending(op.describe(self.rank).0, self.rank);
        let mut st = self.lock();
        if let Some(first) = &st.error {
            let err = self.broken(first);
            drop(st);
            tx.complete(Err(err));
        } else if st.closing {
            drop(st);
            tx.complete(Err(Error::Aborted { rank: self.rank }));
        } else {
            st.ops.push_back((op, tx));
            drop(st);
            self.changed.notify_all();
        }
        work
    }

    /// Records the first failure and fails every queued op with it (as
    /// [`Error::GroupBroken`], or [`Error::Aborted`] after an abort).
    pub fn fail(&self, error: Error) {
        let (queued, first) = {
            let mut st = self.lock();
            let first = st.error.get_or_insert(error).clone();
            let queued: Vec<_> = st.ops.drain(..).collect();
            (queued, first)
        };
        for (_, tx) in queued {
            tx.complete(Err(self.broken(&first)));
        }
        self.changed.notify_all();
    }

    /// Fails everything queued with [`Error::Aborted`], makes the op in flight stop, and waits
    /// at most `bound` for the worker to finish; true if it did.
    pub fn abort(&self, bound: Duration) -> bool {
        self.abort.store(true, Ordering::Release);
        self.fail(Error::Aborted { rank: self.rank });
        self.wait_finished(bound)
    }

    /// Accepts no more ops; the worker finishes the queued ones and then returns from `run`.
    pub fn close(&self) {
        self.lock().closing = true;
        self.changed.notify_all();
    }

    /// Marks the worker as finished (called last by the worker thread).
    pub fn set_finished(&self) {
        self.lock().finished = true;
        self.changed.notify_all();
    }

    /// Waits until the worker finished, at most `bound`; true if it did.
    pub fn wait_finished(&self, bound: Duration) -> bool {
        let st = self.lock();
        let (st, _) = self
            .changed
            .wait_timeout_while(st, bound, |st| !st.finished)
            .unwrap_or_else(PoisonError::into_inner);
        st.finished
    }

    /// The worker loop: runs queued ops in issue order until the queue is closed and empty
    /// (returns true: the communicator is healthy) or an op fails or abort is raised (false;
    /// every queued op has then been failed).
    pub fn run(&self, exec: &mut impl Execute) -> bool {
        loop {
            let next = {
                let mut st = self.lock();
                loop {
                    if self.is_aborted() || st.error.is_some() {
                        break None;
                    }
                    if let Some(item) = st.ops.pop_front() {
                        break Some(item);
                    }
                    if st.closing {
                        return true;
                    }
                    st = self
                        .changed
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            let Some((op, tx)) = next else {
                self.fail(Error::Aborted { rank: self.rank });
                return false;
            };
            let name = op.describe(self.rank).0;
            match exec.execute(op, &self.abort) {
                Ok(buf) => tx.complete(Ok(buf)),
                Err(e) => {
                    tracing::warn!(rank = self.rank, op = name, "NCCL op failed: {e}");
                    // The op's own caller sees the failure itself; queued ops see it as cause.
                    tx.complete(Err(e.clone()));
                    self.fail(e);
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    use crate::collectives::nccl::imp::comm::{poll_until, Stop};
    use crate::collectives::ReduceOp;

    /// Adds 1 to every element (so results show which op produced them), fails the op whose
    /// first element is negative, and holds the op whose first element is 1000 until abort.
    struct Scripted {
        rank: usize,
        ran: Vec<f64>,
    }

    impl Execute for Scripted {
        fn execute(&mut self, op: Job, abort: &AtomicBool) -> Result<Buffer> {
            let Job::Host(Collective::AllReduce { buf, .. }) = op else {
                return Ok(Buffer::U8(Vec::new()));
            };
            let first = buf.get_f64(0).unwrap_or(0.0);
            self.ran.push(first);
            if first < 0.0 {
                return Err(Error::Timeout {
                    rank: self.rank,
                    op: "all_reduce",
                    elapsed: Duration::from_secs(1),
                    waiting_on: vec![1],
                });
            }
            if first == 1000.0 {
                let now = Instant::now();
                let held = poll_until(now, now + Duration::from_secs(60), abort, || Ok(false));
                assert_eq!(held, Err(Stop::Aborted));
                return Err(Error::Aborted { rank: self.rank });
            }
            let v: Vec<f64> = buf.into_vec::<f64>().unwrap();
            Ok(Buffer::from(
                v.into_iter().map(|x| x + 1.0).collect::<Vec<_>>(),
            ))
        }
    }

    fn op(x: f64) -> Job {
        Job::Host(Collective::AllReduce {
            buf: Buffer::from(vec![x; 3]),
            op: ReduceOp::Sum,
        })
    }

    /// Starts a worker thread running the queue; it marks itself finished when `run` returns.
    fn worker(q: &Arc<Queue>) -> std::thread::JoinHandle<(bool, Vec<f64>)> {
        let q = q.clone();
        std::thread::spawn(move || {
            let mut exec = Scripted {
                rank: 0,
                ran: Vec::new(),
            };
            let healthy = q.run(&mut exec);
            q.set_finished();
            (healthy, exec.ran)
        })
    }

    #[test]
    fn ops_run_in_issue_order_and_close_drains_the_queue() {
        let q = Arc::new(Queue::new(0));
        let works: Vec<_> = (0..50).map(|k| q.submit(op(k as f64))).collect();
        let w = worker(&q);
        q.close();
        for (k, work) in works.into_iter().enumerate() {
            let out = work.wait(Duration::from_secs(10)).unwrap();
            assert_eq!(out.into_vec::<f64>().unwrap(), vec![k as f64 + 1.0; 3]);
        }
        let (healthy, ran) = w.join().unwrap();
        assert!(healthy);
        assert_eq!(ran, (0..50).map(|k| k as f64).collect::<Vec<_>>());
        let late = q.submit(op(1.0)).wait(Duration::from_secs(1)).unwrap_err();
        assert!(matches!(late, Error::Aborted { .. }), "{late}");
    }

    #[test]
    fn a_failure_breaks_the_group_for_queued_and_later_ops() {
        let q = Arc::new(Queue::new(0));
        let before = q.submit(op(1.0));
        let failing = q.submit(op(-1.0));
        let queued = q.submit(op(2.0));
        let w = worker(&q);
        assert!(before.wait(Duration::from_secs(10)).is_ok());
        let err = failing.wait(Duration::from_secs(10)).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        for err in [
            queued.wait(Duration::from_secs(10)).unwrap_err(),
            q.submit(op(3.0)).wait(Duration::from_secs(10)).unwrap_err(),
        ] {
            match err {
                Error::GroupBroken { cause, .. } => {
                    assert!(matches!(*cause, Error::Timeout { .. }))
                }
                other => panic!("expected GroupBroken, got {other}"),
            }
        }
        let (healthy, ran) = w.join().unwrap();
        assert!(!healthy);
        assert_eq!(ran, vec![1.0, -1.0], "the queued op must not run");
        assert!(matches!(q.error(), Some(Error::Timeout { .. })));
    }

    #[test]
    fn abort_stops_the_op_in_flight_and_fails_the_queue_quickly() {
        let q = Arc::new(Queue::new(0));
        let held = q.submit(op(1000.0));
        let queued: Vec<_> = (0..10).map(|k| q.submit(op(k as f64))).collect();
        let w = worker(&q);
        // Wait until the held op is running: the queue then holds exactly the ten others.
        let now = Instant::now();
        let abort = AtomicBool::new(false);
        poll_until(now, now + Duration::from_secs(10), &abort, || {
            Ok(q.lock().ops.len() == 10)
        })
        .unwrap();
        let started = Instant::now();
        assert!(q.abort(Duration::from_secs(1)), "the worker did not finish");
        assert!(started.elapsed() < Duration::from_secs(1));
        let err = held.wait(Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, Error::Aborted { .. }), "{err}");
        for work in queued {
            let err = work.wait(Duration::from_secs(1)).unwrap_err();
            assert!(matches!(err, Error::Aborted { .. }), "{err}");
        }
        let err = q.submit(op(1.0)).wait(Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, Error::Aborted { .. }), "{err}");
        let (healthy, ran) = w.join().unwrap();
        assert!(!healthy);
        assert_eq!(ran, vec![1000.0]);
    }

    #[test]
    fn abort_of_an_idle_worker_ends_it() {
        let q = Arc::new(Queue::new(3));
        let w = worker(&q);
        assert!(q.abort(Duration::from_secs(1)));
        assert!(matches!(q.error(), Some(Error::Aborted { rank: 3 })));
        let (healthy, ran) = w.join().unwrap();
        assert!(!healthy);
        assert!(ran.is_empty());
    }
}
