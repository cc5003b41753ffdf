//! Helpers shared by the runtime's integration tests: ranks as threads over one store.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use rekindle_runtime::store::{InMemoryStore, Store};
use rekindle_runtime::{GroupConfig, JobSecret, ProcessGroup, TcpOptions};

/// Generous per-wait timeout: the op deadline (below) is what bounds operations.
pub const WAIT: Duration = Duration::from_secs(30);

pub fn config(
    job: &str,
    round: u64,
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
) -> GroupConfig {
    GroupConfig {
        job: job.to_string(),
        round,
        rank,
        world_size: world,
        store,
        secret: JobSecret::new("test-secret").unwrap(),
        op_timeout: Duration::from_secs(20),
        bootstrap_timeout: Duration::from_secs(20),
    }
}

/// Runs `body(rank, group)` on `world` threads that form one TCP group, returning the results
/// in rank order.
pub fn run_ranks<T: Send + 'static>(
    job: &str,
    world: usize,
    opts: TcpOptions,
    body: impl Fn(usize, ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, opts, job) =
                (store.clone(), body.clone(), opts.clone(), job.to_string());
            std::thread::spawn(move || {
                let pg = ProcessGroup::tcp(config(&job, 0, rank, world, store), opts)
                    .unwrap_or_else(|e| panic!("rank {rank}: forming the group: {e}"));
                body(rank, pg)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        .collect()
}
