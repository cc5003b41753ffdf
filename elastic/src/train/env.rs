//! A worker's place in the job, from the environment `rekindle run` sets.

use std::net::IpAddr;
use std::sync::Arc;

use rekindle_runtime::store::{InMemoryStore, PrefixStore, Store};

use super::TrainError;
use crate::membership::{WorkerMembership, AGENT_STORE_ENV, MEMBERSHIP_PREFIX_ENV};

/// Env var: the key a worker using the elastic loop sets in its agent's store, so that the
/// agent restarts only this worker when it fails and keeps it running when the round
/// re-forms (set by `rekindle run`).
pub const ELASTIC_KEY_ENV: &str = "REKINDLE_ELASTIC_KEY";
/// Env var: the index of the first membership event this worker should read (a restarted
/// worker skips the events its predecessor saw).
pub const MEMBERSHIP_NEXT_ENV: &str = "REKINDLE_MEMBERSHIP_NEXT";
/// Env var: the address other nodes reach this node at (collectives bind there).
pub const LOCAL_ADDR_ENV: &str = "REKINDLE_LOCAL_ADDR";

/// Where a rank is in the current round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The agent's rendezvous round.
    pub round: u64,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The round's store (`host:port` of an embedded store, or `etcd://...`: see
    /// [`crate::store::connect`]); `None` for a job of one process started by hand.
    pub store_addr: Option<String>,
    /// The round's key prefix in that store.
    pub store_prefix: String,
}

impl Assignment {
    /// Connects to the round's store, under the round's prefix: node 0's embedded store with
    /// the job secret from the environment, or etcd with the credentials the address names
    /// (see [`crate::store::connect`]).
    pub fn connect(&self) -> Result<Arc<dyn Store>, TrainError> {
        let inner: Arc<dyn Store> = match &self.store_addr {
            Some(addr) => crate::store::connect(addr).map_err(|source| TrainError::Store {
                rank: self.rank,
                during: "connecting to the round's store",
                source,
            })?,
            None => Arc::new(InMemoryStore::new()),
        };
        Ok(Arc::new(PrefixStore::new(inner, self.store_prefix.clone())))
    }
}

/// This worker's identity and its link to the agent.
pub struct WorkerEnv {
    /// The job id.
    pub job: String,
    /// The rank on this node (fixed for the life of the process).
    pub local_rank: usize,
    /// The current round, rank and world size.
    pub assignment: Assignment,
    /// The address collectives bind to, when the node has one other nodes reach.
    pub local_addr: Option<IpAddr>,
    /// The agent's node id (`REKINDLE_NODE_ID`; empty without an agent).
    pub node_id: String,
    pub(crate) membership: Option<WorkerMembership>,
}

impl std::fmt::Debug for WorkerEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerEnv")
            .field("job", &self.job)
            .field("local_rank", &self.local_rank)
            .field("assignment", &self.assignment)
            .field("agent", &self.membership.is_some())
            .finish()
    }
}

fn var(name: &'static str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn parse<T: std::str::FromStr>(name: &'static str, default: Option<T>) -> Result<T, TrainError> {
    match (var(name), default) {
        (Some(v), _) => v.parse().map_err(|_| TrainError::Env {
            name,
            value: v,
            reason: "not a valid number".into(),
        }),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(TrainError::Env {
            name,
            value: String::new(),
            reason: "is not set (RANK is, so the other launcher variables must be too)".into(),
        }),
    }
}

impl WorkerEnv {
    /// A job of one process, no agent: world size 1, an in-memory store.
    pub fn single(job: &str) -> WorkerEnv {
        WorkerEnv {
            job: job.to_string(),
            local_rank: 0,
            assignment: Assignment {
                round: 0,
                rank: 0,
                world_size: 1,
                store_addr: None,
                store_prefix: String::new(),
            },
            local_addr: None,
            node_id: String::new(),
            membership: None,
        }
    }

    /// Reads `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `REKINDLE_JOB`, `REKINDLE_ROUND`,
    /// `REKINDLE_STORE` and `REKINDLE_STORE_PREFIX`; with `REKINDLE_AGENT_STORE` and
    /// `REKINDLE_MEMBERSHIP_PREFIX` it also follows the agent's membership events and, with
    /// `REKINDLE_ELASTIC_KEY`, tells the agent that this worker recovers in place. Without
    /// `RANK` the process is a job of one ([`WorkerEnv::single`]).
    pub fn from_env() -> Result<WorkerEnv, TrainError> {
        if var("RANK").is_none() {
            return Ok(Self::single(
                &var("REKINDLE_JOB").unwrap_or_else(|| "single".into()),
            ));
        }
        let rank: usize = parse("RANK", None)?;
        let world_size: usize = parse("WORLD_SIZE", None)?;
        if world_size == 0 || rank >= world_size {
            return Err(TrainError::Env {
                name: "RANK",
                value: rank.to_string(),
                reason: format!("must be below WORLD_SIZE={world_size}"),
            });
        }
        let local_rank: usize = parse("LOCAL_RANK", Some(0))?;
        let round: u64 = parse("REKINDLE_ROUND", Some(0))?;
        let store_addr = match (var("REKINDLE_STORE"), world_size) {
            (Some(s), _) => Some(s),
            (None, 1) => None,
            (None, _) => {
                return Err(TrainError::Env {
                    name: "REKINDLE_STORE",
                    value: String::new(),
                    reason: "is not set; a job of several ranks needs the round's store \
                             (start it with `rekindle run`)"
                        .into(),
                })
            }
        };
        let job = var("REKINDLE_JOB")
            .or_else(|| var("TORCHELASTIC_RUN_ID"))
            .unwrap_or_else(|| "job".into());
        let local_addr = match var(LOCAL_ADDR_ENV) {
            Some(a) => match a.parse::<IpAddr>() {
                Ok(ip) => Some(ip),
                Err(_) => resolve(&a),
            },
            None => None,
        };
        let membership = match (var(AGENT_STORE_ENV), var(MEMBERSHIP_PREFIX_ENV)) {
            (Some(addr), Some(prefix)) => {
                let store: Arc<dyn Store> =
                    crate::store::connect(&addr).map_err(|source| TrainError::Store {
                        rank,
                        during: "connecting to the agent's store",
                        source,
                    })?;
                if let Some(key) = var(ELASTIC_KEY_ENV) {
                    store
                        .set(&key, std::process::id().to_string().as_bytes())
                        .map_err(|source| TrainError::Store {
                            rank,
                            during: "registering with the agent",
                            source,
                        })?;
                }
                let mut m = WorkerMembership::new(store, &prefix);
                m.skip_to(parse(MEMBERSHIP_NEXT_ENV, Some(0))?);
                Some(m)
            }
            _ => None,
        };
        Ok(WorkerEnv {
            job,
            local_rank,
            assignment: Assignment {
                round,
                rank,
                world_size,
                store_addr,
                store_prefix: var("REKINDLE_STORE_PREFIX").unwrap_or_default(),
            },
            local_addr,
            node_id: var("REKINDLE_NODE_ID").unwrap_or_default(),
            membership,
        })
    }
}

fn resolve(host: &str) -> Option<IpAddr> {
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .ok()?
        .map(|a| a.ip())
        .find(|ip| ip.is_ipv4())
}
