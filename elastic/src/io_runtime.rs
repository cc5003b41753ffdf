//! A tokio runtime on dedicated threads, driven from synchronous code.
//!
//! The [`Store`](rekindle_runtime::store::Store) trait is synchronous and may be called from any
//! thread, including a thread that is itself running a tokio runtime, where `block_on` would
//! panic. Network clients therefore own a small runtime of their own: the caller spawns the
//! future onto it and waits on a plain channel with a deadline, so no caller thread ever enters
//! tokio and no wait is unbounded.

use std::future::Future;
use std::time::{Duration, Instant};

/// Why [`IoRuntime::call`] produced no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallError {
    /// The deadline passed first.
    Timeout,
    /// The runtime is shutting down.
    Shutdown,
}

/// A multi-threaded tokio runtime with `threads` workers, shut down in the background on drop
/// (dropping a runtime from inside another runtime's thread would panic otherwise).
pub(crate) struct IoRuntime {
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for IoRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IoRuntime")
    }
}

impl IoRuntime {
    /// Starts the runtime; threads are named `name`.
    pub(crate) fn new(name: &str, threads: usize) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name(name)
            .enable_all()
            .build()?;
        Ok(IoRuntime { rt: Some(rt) })
    }

    /// The runtime's handle, to spawn background tasks.
    pub(crate) fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.rt.as_ref().map(|rt| rt.handle())
    }

    /// Runs `fut` on the runtime and waits for its output until `deadline`. The future is also
    /// bounded by the deadline on the runtime side, so an abandoned call does not linger.
    pub(crate) fn call<F, T>(&self, fut: F, deadline: Instant) -> Result<T, CallError>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let handle = self.handle().ok_or(CallError::Shutdown)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let budget = deadline.saturating_duration_since(Instant::now());
        handle.spawn(async move {
            if let Ok(v) = tokio::time::timeout(budget, fut).await {
                let _ = tx.send(v);
            }
        });
        // A little slack so that a future finishing right at the deadline still delivers.
        let wait = budget + Duration::from_millis(20);
        match rx.recv_timeout(wait) {
            Ok(v) => Ok(v),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(CallError::Timeout),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                if Instant::now() >= deadline {
                    Err(CallError::Timeout)
                } else {
                    Err(CallError::Shutdown)
                }
            }
        }
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_returns_value_and_times_out() {
        let rt = IoRuntime::new("t", 1).unwrap();
        let v = rt.call(async { 7 }, Instant::now() + Duration::from_secs(5));
        assert_eq!(v, Ok(7));
        let t0 = Instant::now();
        let v = rt.call(
            async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                1
            },
            Instant::now() + Duration::from_millis(100),
        );
        assert_eq!(v, Err(CallError::Timeout));
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn usable_and_droppable_inside_another_runtime() {
        let outer = tokio::runtime::Runtime::new().unwrap();
        outer.block_on(async {
            let rt = IoRuntime::new("t", 1).unwrap();
            let v = rt.call(async { 3 }, Instant::now() + Duration::from_secs(5));
            assert_eq!(v, Ok(3));
            drop(rt);
        });
    }
}
