//! What each worker is started with: its command line, torchrun's environment and rekindle's
//! own variables, its log dir; and the store keys the agent and its workers share.

use std::path::Path;

use super::process::WorkerSpec;
use super::round::Round;
use crate::errorfile::{ERROR_FILE_ENV, TORCHELASTIC_ERROR_FILE_ENV};
use crate::membership::{AGENT_STORE_ENV, MEMBERSHIP_PREFIX_ENV};
use crate::rendezvous::NodeInfo;
use crate::train::{ELASTIC_KEY_ENV, LOCAL_ADDR_ENV, MEMBERSHIP_NEXT_ENV};

/// The agent's `--rdzv-conf` from the environment, which workers do not inherit.
pub(crate) const RDZV_CONF_ENV: &str = "REKINDLE_RDZV_CONF";

/// The key prefix of round `round` in the round's store.
pub(crate) fn round_prefix(job: &str, round: u64) -> String {
    format!("/rekindle/{job}/r{round}/")
}

/// Where attempt `attempt`'s membership events go in the agent's store.
pub(crate) fn membership_prefix(job: &str, attempt: u32) -> String {
    format!("/rekindle/{job}/membership/{attempt}/")
}

/// The key a worker using the elastic loop sets in the agent's store (see
/// [`ELASTIC_KEY_ENV`]).
pub(crate) fn elastic_key(job: &str, attempt: u32, local_rank: usize) -> String {
    format!("/rekindle/{job}/elastic/{attempt}/{local_rank}")
}

/// Where success is reported to node 0 when a round ends.
pub(crate) fn agents_done_prefix(job: &str, round: u64) -> String {
    format!("/rekindle/{job}/r{round}/agents-done/")
}

/// The node's fixed facts that go into every worker's spec.
pub(crate) struct SpecContext<'a> {
    pub job: &'a str,
    pub node: &'a NodeInfo,
    pub entrypoint: &'a [String],
    pub use_local_rank_arg: bool,
    pub nproc: usize,
    pub max_restarts: u32,
    pub backend_name: &'a str,
    pub endpoint: &'a str,
    pub log_root: &'a Path,
    pub agent_store_addr: &'a str,
    /// `MASTER_ADDR`, `MASTER_PORT` and the other variables of the round's PyTorch store.
    pub torch_env: &'a [(String, String)],
}

impl SpecContext<'_> {
    /// The specs of every local rank of `attempt` in `round`, whose store workers open at
    /// `round_store`.
    pub fn specs(
        &self,
        round: &Round,
        round_store: &str,
        attempt: u32,
        restarts: u32,
    ) -> Vec<WorkerSpec> {
        (0..self.nproc)
            .map(|local| self.spec(round, round_store, attempt, restarts, local))
            .collect()
    }

    /// The spec of a replacement for `local_rank` started after `restarts` restarts, which
    /// reads membership events from index `membership_next` on; its logs go to
    /// `attempt_<k>/<local rank>.restart<n>`.
    pub fn restart(
        &self,
        round: &Round,
        round_store: &str,
        attempt: u32,
        restarts: u32,
        local_rank: usize,
        membership_next: u64,
    ) -> WorkerSpec {
        let mut spec = self.spec(round, round_store, attempt, restarts, local_rank);
        spec.dir = self
            .log_root
            .join(format!("attempt_{attempt}"))
            .join(format!("{local_rank}.restart{restarts}"));
        spec.error_file = spec.dir.join("error.json");
        let ef = spec.error_file.display().to_string();
        for (k, v) in &mut spec.env {
            if k == MEMBERSHIP_NEXT_ENV {
                *v = membership_next.to_string();
            } else if k == ERROR_FILE_ENV || k == TORCHELASTIC_ERROR_FILE_ENV {
                *v = ef.clone();
            }
        }
        spec
    }

    fn spec(
        &self,
        round: &Round,
        round_store: &str,
        attempt: u32,
        restarts: u32,
        local: usize,
    ) -> WorkerSpec {
        let rank = round.rank_base + local;
        let dir = self
            .log_root
            .join(format!("attempt_{attempt}"))
            .join(local.to_string());
        let error_file = dir.join("error.json");
        let mut argv = self.entrypoint.to_vec();
        if self.use_local_rank_arg {
            argv.insert(1, format!("--local_rank={local}"));
        }
        let ef = error_file.display().to_string();
        let env: Vec<(String, String)> = [
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("WORLD_SIZE", round.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc.to_string()),
            ("GROUP_RANK", round.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", round.nnodes.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", round.world_size.to_string()),
            ("ROLE_NAME", "default".to_string()),
            ("TORCHELASTIC_RUN_ID", self.job.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", restarts.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            (TORCHELASTIC_ERROR_FILE_ENV, ef.clone()),
            ("REKINDLE_JOB", self.job.to_string()),
            ("REKINDLE_ROUND", round.round.to_string()),
            ("REKINDLE_RESTART_COUNT", restarts.to_string()),
            ("REKINDLE_MAX_RESTARTS", self.max_restarts.to_string()),
            ("REKINDLE_ATTEMPT", attempt.to_string()),
            ("REKINDLE_NODE_ID", self.node.id.clone()),
            ("REKINDLE_RDZV_BACKEND", self.backend_name.to_string()),
            ("REKINDLE_RDZV_ENDPOINT", self.endpoint.to_string()),
            (ERROR_FILE_ENV, ef),
            ("REKINDLE_STORE", round_store.to_string()),
            ("REKINDLE_STORE_PREFIX", round_prefix(self.job, round.round)),
            (AGENT_STORE_ENV, self.agent_store_addr.to_string()),
            (MEMBERSHIP_PREFIX_ENV, membership_prefix(self.job, attempt)),
            (MEMBERSHIP_NEXT_ENV, "0".to_string()),
            (ELASTIC_KEY_ENV, elastic_key(self.job, attempt, local)),
            (LOCAL_ADDR_ENV, self.node.host.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(self.torch_env.iter().cloned())
        .collect();
        WorkerSpec {
            local_rank: local,
            global_rank: rank,
            argv,
            env,
            // It may hold the etcd password; workers get the credentials as a file instead.
            unset: vec![RDZV_CONF_ENV.to_string()],
            dir,
            error_file,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(spec: &'a WorkerSpec, k: &str) -> &'a str {
        spec.env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{k} is not set"))
    }

    #[test]
    fn each_local_rank_gets_its_place_and_a_replacement_its_own_dir() {
        let node = NodeInfo {
            id: "n1".into(),
            host: "10.0.0.2".into(),
            nproc: 2,
            store_addr: None,
        };
        let entry = vec!["prog".to_string(), "--x".to_string()];
        let ctx = SpecContext {
            job: "j",
            node: &node,
            entrypoint: &entry,
            use_local_rank_arg: true,
            nproc: 2,
            max_restarts: 3,
            backend_name: "static",
            endpoint: "m:1",
            log_root: Path::new("/logs"),
            agent_store_addr: "127.0.0.1:9",
            torch_env: &[
                ("MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
                ("MASTER_PORT".to_string(), "4567".to_string()),
            ],
        };
        let round = Round::fixed(1, 2, 1, 2, ("m", 1));
        let specs = ctx.specs(&round, "m:1", 1, 0);
        assert_eq!(specs.len(), 2);
        let s = &specs[1];
        assert_eq!(s.argv, vec!["prog", "--local_rank=1", "--x"]);
        assert_eq!((env(s, "RANK"), env(s, "WORLD_SIZE")), ("3", "4"));
        assert_eq!(env(s, "REKINDLE_STORE_PREFIX"), "/rekindle/j/r1/");
        assert_eq!(
            (env(s, "MASTER_ADDR"), env(s, "MASTER_PORT")),
            ("127.0.0.1", "4567")
        );
        assert_eq!(env(s, "REKINDLE_ELASTIC_KEY"), "/rekindle/j/elastic/1/1");
        assert_eq!(s.dir, Path::new("/logs/attempt_1/1"));
        assert_eq!(s.unset, vec!["REKINDLE_RDZV_CONF"]);
        let r = ctx.restart(&round, "m:1", 1, 2, 1, 5);
        assert_eq!(r.dir, Path::new("/logs/attempt_1/1.restart2"));
        assert_eq!(env(&r, "REKINDLE_MEMBERSHIP_NEXT"), "5");
        assert_eq!(env(&r, "REKINDLE_RESTART_COUNT"), "2");
        assert_eq!(
            env(&r, "REKINDLE_ERROR_FILE"),
            "/logs/attempt_1/1.restart2/error.json"
        );
    }
}
