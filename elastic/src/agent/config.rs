//! What the agent is told: the program, the rendezvous, the limits (built by the CLI from the
//! flags, see [`crate::cli`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::etcd::EtcdConfig;

/// How nodes find each other.
#[derive(Debug, Clone)]
pub enum RdzvConfig {
    /// Fixed membership as in torch.distributed.launch: `nnodes` nodes, this one is
    /// `node_rank`; node 0 hosts the store at `master_addr:master_port`.
    Static {
        /// Number of nodes.
        nnodes: usize,
        /// This node's rank.
        node_rank: usize,
        /// Where node 0 is.
        master_addr: String,
        /// Node 0's store port; `None` (one node only) picks a free port.
        master_port: Option<u16>,
    },
    /// One node, the store on a free local port, a generated job id.
    Standalone,
    /// Dynamic rendezvous on etcd v3.
    Etcd(Box<EtcdRdzv>),
}

/// Settings of an etcd rendezvous.
#[derive(Debug, Clone)]
pub struct EtcdRdzv {
    /// The cluster.
    pub etcd: EtcdConfig,
    /// The file the etcd password was read from, if it came from one: workers read it there.
    /// Without it, an agent with etcd credentials writes the password to a file of its own
    /// (mode 0600, removed when the agent exits) for its workers.
    pub password_file: Option<PathBuf>,
    /// The job id (required).
    pub job: String,
    /// Round sizes.
    pub min_nodes: usize,
    /// Round sizes.
    pub max_nodes: usize,
    /// The last-call window.
    pub last_call: Duration,
    /// How long joining may take, retries included.
    pub join_timeout: Duration,
    /// Lease TTL (liveness).
    pub lease_ttl: Duration,
    /// How long the job-finished record is kept.
    pub finished_retention: Duration,
}

/// Everything the agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The program and its arguments.
    pub entrypoint: Vec<String>,
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// The rendezvous.
    pub rdzv: RdzvConfig,
    /// Job id for static and standalone runs (generated if `None`).
    pub job: Option<String>,
    /// Restarts after worker failures before giving up.
    pub max_restarts: u32,
    /// How often the agent checks workers and membership.
    pub monitor_interval: Duration,
    /// Where per-attempt logs go (a temp dir if `None`).
    pub log_dir: Option<PathBuf>,
    /// Pass `--local_rank=N` after the program, as torch.distributed.launch does.
    pub use_local_rank_arg: bool,
    /// SIGTERM-to-SIGKILL grace period.
    pub grace_period: Duration,
    /// The address other nodes reach this node at (etcd runs).
    pub local_addr: Option<String>,
    /// Forward SIGTERM/SIGINT/SIGHUP to the workers (the CLI does; tests may not).
    pub handle_signals: bool,
    /// The port of the HTTP endpoint (health, status, metrics); 0 picks a free port; `None`
    /// serves none.
    pub health_port: Option<u16>,
}

impl AgentConfig {
    /// Checks what needs no I/O: a program, at least one worker, a node rank below the node
    /// count. The error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.entrypoint.is_empty() {
            return Err("no program to run was given".into());
        }
        if self.nproc_per_node == 0 {
            return Err("--nproc-per-node must be at least 1".into());
        }
        if let RdzvConfig::Static {
            nnodes, node_rank, ..
        } = &self.rdzv
        {
            if node_rank >= nnodes {
                return Err(format!(
                    "--node-rank {node_rank} is not below --nnodes {nnodes}"
                ));
            }
        }
        if let Some(job) = &self.job {
            crate::rendezvous::validate_job_id(job).map_err(|e| format!("--rdzv-id: {e}"))?;
        }
        if let RdzvConfig::Etcd(e) = &self.rdzv {
            crate::rendezvous::validate_job_id(&e.job).map_err(|r| format!("--rdzv-id: {r}"))?;
        }
        Ok(())
    }
}
