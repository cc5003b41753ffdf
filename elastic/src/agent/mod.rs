//! The agent behind `rekindle run`: one per node, it joins the rendezvous, starts the node's
//! workers with torchrun's environment, watches them and the membership, and restarts or
//! stops them.
//!
//! How an attempt ends:
//! - all workers exited 0: the job is closed (late joiners exit 0) and the agent succeeds;
//! - a worker failed: the others are stopped, the earliest failure is the root cause, and the
//!   agent restarts (counted against `max_restarts`) or gives up. Workers that use the
//!   elastic loop are instead restarted alone while the others keep training;
//! - membership changed (a peer was lost, a node waits, a new round opened): the workers are
//!   stopped and the node re-joins (not counted as a restart); elastic workers keep training
//!   while the node re-joins, then learn their new ranks;
//! - SIGTERM/SIGINT/SIGHUP: forwarded to the workers, grace period, SIGKILL, exit `128+N`.
//!
//! Where things are:
//!
//! | file | what |
//! |---|---|
//! | `config.rs` | [`AgentConfig`]: what the CLI tells the agent |
//! | `outcome.rs` | [`AgentOutcome`], [`AgentError`], [`exit_code`] |
//! | `start.rs` | start-up: the job secret and where it may be used, this node's store and identity, the rendezvous |
//! | `machine.rs` | every decision, as a state machine without I/O (`now` and an input in, actions out), table-tested |
//! | `monitor.rs` | the I/O loop around the machine: events in, actions carried out |
//! | `process.rs` | worker processes: spawn, output, signal, reap (never a recycled pid) |
//! | `spec.rs` | what each worker is started with (environment, log dirs) and the store keys |
//! | `round.rs` | a completed round as this node sees it |
//! | `evictions.rs` | peers' requests to replace a silent worker: the watcher and the decision |
//! | `signals.rs` | SIGTERM/SIGINT/SIGHUP to the agent become events |
//! | `events.rs` | what the helper threads tell the monitor |
//! | `http.rs` | the HTTP endpoint: liveness, readiness, status, Prometheus metrics |

mod config;
mod events;
mod evictions;
mod http;
mod machine;
mod monitor;
mod outcome;
mod process;
mod round;
mod signals;
mod spec;
mod start;

pub use config::{AgentConfig, EtcdRdzv, RdzvConfig};
pub use outcome::{exit_code, AgentError, AgentOutcome, WorkerFailure};

/// Runs the agent until the job succeeds, fails for good, or a signal stops it.
pub fn run(cfg: AgentConfig) -> Result<AgentOutcome, AgentError> {
    cfg.validate().map_err(AgentError::usage)?;
    let (tx, events) = std::sync::mpsc::channel();
    if cfg.handle_signals {
        signals::forward_signals(tx.clone()).map_err(AgentError::Signals)?;
    }
    let agent = start::Agent::start(cfg)?;
    monitor::Monitor::new(agent, tx, events).run()
}
