//! The `rekindle` command line: `rekindle run` with torchrun-compatible flags.
//!
//! Every flag has an env fallback (`REKINDLE_` + the flag name in upper case with `_`), and
//! torchrun's underscore spellings (`--nproc_per_node`) are accepted as aliases. Bad values are
//! errors with a one-line message and exit code 2, never silent defaults.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::agent::{self, exit_code, AgentConfig, AgentOutcome, EtcdRdzv, RdzvConfig};
use crate::etcd::{EtcdConfig, EtcdTls};

/// rekindle: a checkpoint-aware, fault-tolerant, elastic training runtime.
#[derive(Debug, Parser)]
#[command(name = "rekindle", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a training program on this node: rendezvous, start workers, restart on failure.
    Run(Box<RunArgs>),
    /// Inspect checkpoints: `ls`, `inspect`, `verify` (from rekindle-storage).
    Ckpt(rekindle_storage::cli::CkptArgs),
}

/// The rendezvous backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// etcd v3 (dynamic membership, `--nnodes MIN:MAX`).
    Etcd,
    /// Fixed membership (`--nnodes N --node-rank R --master-addr --master-port`).
    Static,
    /// One node, nothing to set up.
    Standalone,
}

/// `rekindle run` flags.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Workers per node: a number, `cpu` (one per CPU core), `gpu` (one per GPU, error if
    /// none) or `auto` (GPUs if any, else CPU cores).
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        env = "REKINDLE_NPROC_PER_NODE",
        default_value = "1"
    )]
    pub nproc_per_node: String,
    /// Number of nodes: `N`, or `MIN:MAX` for an elastic etcd run.
    #[arg(long, env = "REKINDLE_NNODES", default_value = "1")]
    pub nnodes: String,
    /// This node's rank (static rendezvous).
    #[arg(
        long = "node-rank",
        visible_alias = "node_rank",
        env = "REKINDLE_NODE_RANK",
        default_value_t = 0
    )]
    pub node_rank: usize,
    /// Node 0's address (static rendezvous).
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        env = "REKINDLE_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Node 0's store port (static rendezvous; required with more than one node, a free port
    /// otherwise: there is no fixed default port).
    #[arg(
        long = "master-port",
        visible_alias = "master_port",
        env = "REKINDLE_MASTER_PORT"
    )]
    pub master_port: Option<u16>,
    /// The rendezvous backend (default: static, or standalone with `--standalone`).
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        env = "REKINDLE_RDZV_BACKEND",
        value_enum
    )]
    pub rdzv_backend: Option<Backend>,
    /// etcd endpoints, `host:port[,host:port...]`.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        env = "REKINDLE_RDZV_ENDPOINT"
    )]
    pub rdzv_endpoint: Option<String>,
    /// The job id; required for etcd, unique per job (two jobs with one id would join each
    /// other).
    #[arg(long = "rdzv-id", visible_alias = "rdzv_id", env = "REKINDLE_RDZV_ID")]
    pub rdzv_id: Option<String>,
    /// Backend settings `key=value,...`: join_timeout, last_call_timeout, lease_ttl,
    /// finished_retention, read_timeout (seconds); user, password, password_file; cacert,
    /// cert, key (PEM files).
    #[arg(
        long = "rdzv-conf",
        visible_alias = "rdzv_conf",
        env = "REKINDLE_RDZV_CONF"
    )]
    pub rdzv_conf: Option<String>,
    /// Restarts after worker failures before giving up (membership changes do not count).
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        env = "REKINDLE_MAX_RESTARTS",
        default_value_t = 0
    )]
    pub max_restarts: u32,
    /// How often the agent checks workers and membership, in seconds.
    #[arg(long = "monitor-interval", visible_alias = "monitor_interval", env = "REKINDLE_MONITOR_INTERVAL", default_value = "0.1", value_parser = parse_secs)]
    pub monitor_interval: Duration,
    /// One node, a free local port, a generated job id.
    #[arg(long, env = "REKINDLE_STANDALONE")]
    pub standalone: bool,
    /// Where per-attempt logs go (default: a dir under the system temp dir).
    #[arg(long = "log-dir", visible_alias = "log_dir", env = "REKINDLE_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// Pass `--local_rank=N` after the program, as torch.distributed.launch does.
    #[arg(long = "use-local-rank-arg", env = "REKINDLE_USE_LOCAL_RANK_ARG")]
    pub use_local_rank_arg: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long = "grace-period", env = "REKINDLE_GRACE_PERIOD", default_value = "30", value_parser = parse_secs)]
    pub grace_period: Duration,
    /// The address other nodes reach this node at (default: the host name).
    #[arg(
        long = "local-addr",
        visible_alias = "local_addr",
        env = "REKINDLE_LOCAL_ADDR"
    )]
    pub local_addr: Option<String>,
    /// Serve liveness (`/healthz`), readiness (`/readyz`), a JSON status (`/status`) and
    /// Prometheus metrics (`/metrics`) over HTTP on this port (0: a free port, printed at
    /// start). Listens on loopback unless this node's address is off loopback.
    #[arg(
        long = "health-port",
        visible_alias = "health_port",
        env = "REKINDLE_HEALTH_PORT"
    )]
    pub health_port: Option<u16>,
    /// The program to run and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    pub entrypoint: Vec<String>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("{s:?} is not a non-negative number of seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Parses `--nnodes`: `N` or `MIN:MAX` with `1 <= MIN <= MAX`.
pub fn parse_nnodes(s: &str) -> Result<(usize, usize), String> {
    let num = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|_| format!("--nnodes {s:?}: {t:?} is not a whole number"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let n = num(s)?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        return Err(format!("--nnodes {s:?}: need 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}

/// Parses `--nproc-per-node`.
pub fn parse_nproc(s: &str) -> Result<u32, String> {
    let cpus = || {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1)
    };
    match s {
        "cpu" => Ok(cpus()),
        "gpu" => match rekindle_runtime::cuda_device_count() {
            0 => Err("--nproc-per-node gpu: no CUDA device found".into()),
            n => Ok(n as u32),
        },
        "auto" => match rekindle_runtime::cuda_device_count() {
            0 => Ok(cpus()),
            n => Ok(n as u32),
        },
        _ => match s.parse::<u32>() {
            Ok(0) => Err("--nproc-per-node must be at least 1".into()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!(
                "--nproc-per-node {s:?}: expected a number, cpu, gpu or auto"
            )),
        },
    }
}

/// The parsed `--rdzv-conf`.
#[derive(Debug, Clone, PartialEq)]
pub struct RdzvConf {
    /// Join timeout.
    pub join_timeout: Duration,
    /// Last-call window.
    pub last_call: Duration,
    /// Lease TTL.
    pub lease_ttl: Duration,
    /// Retention of the finished record.
    pub finished_retention: Duration,
    /// etcd request timeout.
    pub read_timeout: Duration,
    /// Credentials.
    pub user: Option<(String, String)>,
    /// The file the password was read from (`password_file`), so workers can read it too.
    pub password_file: Option<PathBuf>,
    /// TLS files.
    pub tls: Option<EtcdTls>,
}

/// The keys `--rdzv-conf` accepts.
pub const RDZV_CONF_KEYS: &[&str] = &[
    "join_timeout",
    "last_call_timeout",
    "lease_ttl",
    "finished_retention",
    "read_timeout",
    "user",
    "password",
    "password_file",
    "cacert",
    "cert",
    "key",
];

/// Parses `--rdzv-conf key=value,...`.
pub fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, String> {
    let mut c = RdzvConf {
        join_timeout: Duration::from_secs(600),
        last_call: Duration::from_secs(1),
        lease_ttl: Duration::from_secs(5),
        finished_retention: Duration::from_secs(600),
        read_timeout: Duration::from_secs(5),
        user: None,
        password_file: None,
        tls: None,
    };
    let (mut user, mut password) = (None::<String>, None::<String>);
    let mut tls = EtcdTls::default();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            return Err(format!("--rdzv-conf: {item:?} is not key=value"));
        };
        let (k, v) = (k.trim(), v.trim());
        let secs = |v: &str| parse_secs(v).map_err(|e| format!("--rdzv-conf {k}: {e}"));
        match k {
            "join_timeout" | "timeout" => c.join_timeout = secs(v)?,
            "last_call_timeout" => c.last_call = secs(v)?,
            "lease_ttl" => {
                c.lease_ttl = secs(v)?;
                if c.lease_ttl < crate::rendezvous::MIN_LEASE_TTL {
                    return Err(format!(
                        "--rdzv-conf lease_ttl: at least {:?} (etcd's minimum)",
                        crate::rendezvous::MIN_LEASE_TTL
                    ));
                }
            }
            "finished_retention" => c.finished_retention = secs(v)?,
            "read_timeout" => c.read_timeout = secs(v)?,
            "user" => user = Some(v.to_string()),
            "password" => {
                password = Some(v.to_string());
                c.password_file = None;
            }
            "password_file" => {
                let p = std::fs::read_to_string(v)
                    .map_err(|e| format!("--rdzv-conf password_file {v:?}: {e}"))?;
                password = Some(p.trim_end_matches(['\n', '\r']).to_string());
                c.password_file = Some(v.into());
            }
            "cacert" => tls.ca = Some(v.into()),
            "cert" => tls.cert = Some(v.into()),
            "key" => tls.key = Some(v.into()),
            _ => {
                return Err(format!(
                    "--rdzv-conf: unknown key {k:?} (known: {})",
                    RDZV_CONF_KEYS.join(", ")
                ))
            }
        }
    }
    c.user = match (user, password) {
        (Some(u), Some(p)) => Some((u, p)),
        (None, None) => None,
        (Some(_), None) => return Err("--rdzv-conf: user without password".into()),
        (None, Some(_)) => return Err("--rdzv-conf: password without user".into()),
    };
    if tls != EtcdTls::default() {
        c.tls = Some(tls);
    }
    Ok(c)
}

impl RunArgs {
    /// Checks the flags and builds the agent's configuration.
    pub fn to_config(&self) -> Result<AgentConfig, String> {
        let nproc = parse_nproc(&self.nproc_per_node)?;
        let (min, max) = parse_nnodes(&self.nnodes)?;
        let backend = match (self.rdzv_backend, self.standalone) {
            (Some(Backend::Standalone) | None, true) => Backend::Standalone,
            (Some(b), true) => {
                return Err(format!("--standalone conflicts with --rdzv-backend {b:?}"))
            }
            (Some(b), false) => b,
            (None, false) => Backend::Static,
        };
        let conf = parse_rdzv_conf(self.rdzv_conf.as_deref().unwrap_or(""))?;
        let rdzv = match backend {
            Backend::Standalone => {
                if max != 1 {
                    return Err(format!(
                        "--standalone runs one node, but --nnodes is {}",
                        self.nnodes
                    ));
                }
                RdzvConfig::Standalone
            }
            Backend::Static => {
                if min != max {
                    return Err(format!(
                        "static rendezvous needs a fixed --nnodes, not {} (use --rdzv-backend etcd for MIN:MAX)",
                        self.nnodes
                    ));
                }
                if self.node_rank >= max {
                    return Err(format!(
                        "--node-rank {} must be below --nnodes {max}",
                        self.node_rank
                    ));
                }
                if max > 1 && self.master_port.is_none() {
                    return Err(
                        "static rendezvous with more than one node needs --master-port".into(),
                    );
                }
                if self.master_port == Some(0) && max > 1 {
                    return Err("--master-port 0: the other nodes could not find node 0".into());
                }
                RdzvConfig::Static {
                    nnodes: max,
                    node_rank: self.node_rank,
                    master_addr: self.master_addr.clone(),
                    master_port: self.master_port,
                }
            }
            Backend::Etcd => {
                let Some(job) = self.rdzv_id.clone() else {
                    return Err(
                        "--rdzv-backend etcd needs --rdzv-id: a job id unique to this job \
                                (two jobs with one id would join each other)"
                            .into(),
                    );
                };
                crate::rendezvous::validate_job_id(&job).map_err(|e| format!("--rdzv-id: {e}"))?;
                let Some(endpoint) = self.rdzv_endpoint.clone() else {
                    return Err("--rdzv-backend etcd needs --rdzv-endpoint host:port".into());
                };
                let endpoints: Vec<String> = endpoint
                    .split(',')
                    .map(|e| e.trim().to_string())
                    .filter(|e| !e.is_empty())
                    .collect();
                if endpoints.is_empty() {
                    return Err("--rdzv-endpoint is empty".into());
                }
                let mut etcd = EtcdConfig::new(endpoints);
                etcd.user = conf.user.clone();
                etcd.tls = conf.tls.clone();
                etcd.request_timeout = conf.read_timeout;
                RdzvConfig::Etcd(Box::new(EtcdRdzv {
                    etcd,
                    password_file: conf.password_file.clone(),
                    job,
                    min_nodes: min,
                    max_nodes: max,
                    last_call: conf.last_call,
                    join_timeout: conf.join_timeout,
                    lease_ttl: conf.lease_ttl,
                    finished_retention: conf.finished_retention,
                }))
            }
        };
        if let Some(id) = &self.rdzv_id {
            crate::rendezvous::validate_job_id(id).map_err(|e| format!("--rdzv-id: {e}"))?;
        }
        Ok(AgentConfig {
            entrypoint: self.entrypoint.clone(),
            nproc_per_node: nproc,
            rdzv,
            job: self.rdzv_id.clone(),
            max_restarts: self.max_restarts,
            monitor_interval: self.monitor_interval,
            log_dir: self.log_dir.clone(),
            use_local_rank_arg: self.use_local_rank_arg,
            grace_period: self.grace_period,
            local_addr: self.local_addr.clone(),
            handle_signals: true,
            health_port: self.health_port,
        })
    }
}

/// Runs `rekindle ckpt ...` and returns the process exit code: 0 success, 1 a checkpoint did
/// not verify, 2 the command could not run.
pub fn ckpt(args: &rekindle_storage::cli::CkptArgs) -> i32 {
    let mut out = std::io::stdout().lock();
    match rekindle_storage::cli::run_to(args, &mut out) {
        Ok(o) => i32::from(o.code()),
        Err(e) => {
            let _ = std::io::Write::flush(&mut out);
            eprintln!("rekindle ckpt: {e}");
            exit_code::USAGE
        }
    }
}

/// Runs `rekindle run` and returns the process exit code (see [`exit_code`]).
pub fn run(args: &RunArgs) -> i32 {
    let cfg = match args.to_config() {
        Ok(c) => c,
        Err(msg) => {
            eprintln!("rekindle run: {msg}");
            return exit_code::USAGE;
        }
    };
    match agent::run(cfg) {
        Ok(out) => {
            match &out {
                AgentOutcome::Failed {
                    root_cause,
                    failures,
                    restarts,
                } => {
                    eprintln!(
                        "rekindle run: failed after {restarts} restart(s); {} worker(s) failed; root cause: {root_cause}",
                        failures.len()
                    );
                }
                AgentOutcome::Signalled { signal } => {
                    eprintln!("rekindle run: stopped by signal {signal}");
                }
                AgentOutcome::Succeeded { .. } | AgentOutcome::AlreadyFinished { .. } => {}
            }
            out.exit_code()
        }
        Err(e) => {
            eprintln!("rekindle run: {e}");
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<RunArgs, clap::Error> {
        let mut full = vec!["rekindle", "run"];
        full.extend_from_slice(v);
        Cli::try_parse_from(full).map(|c| match c.command {
            Command::Run(a) => *a,
            Command::Ckpt(_) => panic!("not a run command"),
        })
    }

    #[test]
    fn nnodes() {
        assert_eq!(parse_nnodes("2"), Ok((2, 2)));
        assert_eq!(parse_nnodes("1:4"), Ok((1, 4)));
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("3:2").is_err());
        assert!(parse_nnodes("a:2").is_err());
        assert!(parse_nnodes("").is_err());
    }

    #[test]
    fn nproc() {
        assert_eq!(parse_nproc("3"), Ok(3));
        assert!(parse_nproc("0").is_err());
        assert!(parse_nproc("many").is_err());
        assert!(parse_nproc("cpu").unwrap() >= 1);
    }

    #[test]
    fn rdzv_conf() {
        let c = parse_rdzv_conf(
            "join_timeout=5, last_call_timeout=0.5,user=u,password=p,cacert=/ca.pem",
        )
        .unwrap();
        assert_eq!(c.join_timeout, Duration::from_secs(5));
        assert_eq!(c.last_call, Duration::from_millis(500));
        assert_eq!(c.user, Some(("u".into(), "p".into())));
        assert_eq!(c.tls.unwrap().ca, Some("/ca.pem".into()));
        assert!(parse_rdzv_conf("bogus=1")
            .unwrap_err()
            .contains("unknown key"));
        assert!(parse_rdzv_conf("user=u")
            .unwrap_err()
            .contains("without password"));
        assert!(parse_rdzv_conf("lease_ttl=1")
            .unwrap_err()
            .contains("at least"));
        assert!(parse_rdzv_conf("join_timeout=-1").is_err());
        assert!(parse_rdzv_conf("join_timeout").is_err());
    }

    #[test]
    fn flags_and_aliases() {
        let a = args(&["--nproc_per_node", "2", "--nnodes=1", "prog", "--flag", "x"]).unwrap();
        assert_eq!(a.entrypoint, vec!["prog", "--flag", "x"]);
        let cfg = a.to_config().unwrap();
        assert_eq!(cfg.nproc_per_node, 2);
        assert!(matches!(cfg.rdzv, RdzvConfig::Static { nnodes: 1, .. }));
        assert!(
            args(&["--nproc-per-node", "2"]).is_err(),
            "a program is required"
        );
        assert!(args(&["--rdzv-backend", "etcd-v2", "p"]).is_err());
    }

    #[test]
    fn bad_combinations_are_errors() {
        let e = args(&["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "p"])
            .unwrap()
            .to_config();
        assert!(e.unwrap_err().contains("--rdzv-id"));
        let e = args(&["--rdzv-backend", "etcd", "--rdzv-id", "j", "p"])
            .unwrap()
            .to_config();
        assert!(e.unwrap_err().contains("--rdzv-endpoint"));
        let e = args(&["--nnodes", "2", "p"]).unwrap().to_config();
        assert!(e.unwrap_err().contains("--master-port"));
        let e = args(&[
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--master-port",
            "5",
            "p",
        ])
        .unwrap()
        .to_config();
        assert!(e.unwrap_err().contains("--node-rank"));
        let e = args(&["--nnodes", "1:2", "p"]).unwrap().to_config();
        assert!(e.unwrap_err().contains("fixed --nnodes"));
        let e = args(&["--standalone", "--nnodes", "2", "p"])
            .unwrap()
            .to_config();
        assert!(e.unwrap_err().contains("one node"));
        let e = args(&[
            "--rdzv-backend",
            "etcd",
            "--rdzv-id",
            "a/b",
            "--rdzv-endpoint",
            "h:1",
            "p",
        ])
        .unwrap()
        .to_config();
        assert!(e.unwrap_err().contains("--rdzv-id"));
        let ok = args(&[
            "--rdzv-backend",
            "etcd",
            "--rdzv-id",
            "j1",
            "--rdzv-endpoint",
            "h:1,h:2",
            "--nnodes",
            "2:4",
            "p",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        let RdzvConfig::Etcd(e) = ok.rdzv else {
            panic!()
        };
        assert_eq!((e.min_nodes, e.max_nodes), (2, 4));
        assert_eq!(e.etcd.endpoints.len(), 2);
    }

    #[test]
    fn bad_numbers_are_clap_errors() {
        assert!(args(&["--max-restarts", "-1", "p"]).is_err());
        assert!(args(&["--monitor-interval", "x", "p"]).is_err());
        assert!(args(&["--master-port", "70000", "p"]).is_err());
    }
}
