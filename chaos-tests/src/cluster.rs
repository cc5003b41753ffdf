//! A real `rekindle run` job on several nodes of this machine.
//!
//! A [`Cluster`] starts one agent per node. As root each node is a host of its own in a
//! [`Network`] (its own network namespace and address, its own `/dev/shm`) and etcd runs on
//! a host of its own, so a partition cuts a node off from the others and from etcd; otherwise
//! every node runs on 127.0.0.1 ([`NetMode`] says which). Every process of the job carries the
//! cluster's tag in its environment, so nothing it started can escape the orphan check. The
//! agents' output lines are merged into one log, and the `step=<N>` lines into the progress
//! that faults are timed by.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rekindle_elastic::testing::{
    field, is_root, kill, tagged_pids, wait_tagged_gone, workspace_bin, Bell, EtcdServer, HostKind,
    Network, Proc, ProcError, SpawnOptions,
};

use crate::audit::AUDIT_ENV;
use crate::k8s::{PodFacts, PodTemplate};
use crate::workload::{RunFiles, Settings, Workload};

/// Why the cluster could not do something.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A binary, directory or file problem.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A process could not be started.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// etcd could not be started.
    #[error("etcd: {0}")]
    Etcd(#[from] rekindle_elastic::testing::EtcdServerError),
    /// A namespace operation failed.
    #[error(transparent)]
    Netns(#[from] rekindle_elastic::testing::NetnsError),
    /// The operation needs something this cluster does not have.
    #[error("{0}")]
    Unsupported(String),
    /// Talking to etcd failed.
    #[error("reading etcd: {0}")]
    EtcdRead(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// Where the nodes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetMode {
    /// Each node in its own network and mount namespace (root).
    Namespaces,
    /// Every node on 127.0.0.1.
    Loopback,
}

impl NetMode {
    /// Namespaces when running as root with `ip`, `tc` and `unshare` at hand; loopback
    /// otherwise.
    pub fn detect() -> NetMode {
        let have = |p: &str| {
            std::env::var_os("PATH")
                .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(p).is_file()))
        };
        if is_root() && have("ip") && have("tc") && have("unshare") {
            NetMode::Namespaces
        } else {
            NetMode::Loopback
        }
    }

    /// A sentence for reports.
    pub fn describe(self) -> &'static str {
        match self {
            NetMode::Namespaces => {
                "each node in its own network and mount namespace (own address, own /dev/shm)"
            }
            NetMode::Loopback => "every node on 127.0.0.1 (not root: no network namespaces)",
        }
    }
}

/// How the nodes meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rdzv {
    /// One node, `--standalone`.
    Standalone,
    /// Fixed membership, node 0's embedded store.
    Static,
    /// etcd, `--nnodes <nnodes>` (`N` or `MIN:MAX`), node leases of `lease_ttl` seconds.
    Etcd {
        /// The `--nnodes` value.
        nnodes: String,
        /// The lease TTL in seconds.
        lease_ttl: u64,
    },
}

/// The shape of a job.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// Nodes started at first.
    pub nodes: usize,
    /// Workers per node.
    pub nproc_per_node: usize,
    /// The rendezvous.
    pub rdzv: Rdzv,
    /// `--max-restarts`.
    pub max_restarts: u32,
    /// `--grace-period` in seconds.
    pub grace_period: f64,
    /// Run every node as this Kubernetes pod instead (its own `rekindle run` flags and
    /// environment; see [`crate::k8s`]). The rendezvous must then be etcd.
    pub pod: Option<PodTemplate>,
}

impl JobSpec {
    /// A one-node standalone job of `nproc` workers.
    pub fn standalone(nproc: usize) -> JobSpec {
        JobSpec {
            nodes: 1,
            nproc_per_node: nproc,
            rdzv: Rdzv::Standalone,
            max_restarts: 3,
            grace_period: 30.0,
            pod: None,
        }
    }

    /// An etcd job of `nodes` nodes of one worker each, `--nnodes nnodes`.
    pub fn etcd(nodes: usize, nnodes: &str) -> JobSpec {
        JobSpec {
            nodes,
            nproc_per_node: 1,
            rdzv: Rdzv::Etcd {
                nnodes: nnodes.into(),
                lease_ttl: 2,
            },
            max_restarts: 3,
            grace_period: 30.0,
            pod: None,
        }
    }

    /// The world size at start.
    pub fn world_size(&self) -> usize {
        self.nodes * self.nproc_per_node
    }

    /// True when the world size cannot change (`--nnodes N` or one node).
    pub fn fixed_size(&self) -> bool {
        match &self.rdzv {
            Rdzv::Etcd { nnodes, .. } => !nnodes.contains(':'),
            _ => true,
        }
    }
}

/// A worker process of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// The node.
    pub node: usize,
    /// The pid.
    pub pid: i32,
    /// Its `RANK` when started.
    pub rank: Option<usize>,
    /// Its `LOCAL_RANK`.
    pub local_rank: Option<usize>,
}

/// One line of the merged log.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// When it was read.
    pub at: Instant,
    /// The node whose agent printed it.
    pub node: usize,
    /// The text.
    pub text: String,
}

/// One agent process, current or past.
struct Agent {
    node: usize,
    proc: Proc,
    /// Lines already merged into the log.
    merged: usize,
    /// The exit the harness caused and expects (a kill or a preemption), if any.
    expected_exit: Option<i32>,
}

/// A running job and everything it runs on (see the module docs).
pub struct Cluster {
    spec: JobSpec,
    workload: Workload,
    settings: Settings,
    mode: NetMode,
    job: String,
    secret: String,
    tag: String,
    bell: Bell,
    rekindle: PathBuf,
    /// Agents, current ones last per node.
    agents: Vec<Agent>,
    /// Per node: the index in `agents` of its current agent, if it runs one.
    current: Vec<Option<usize>>,
    /// Per node: its host in `net`.
    hosts: Vec<usize>,
    etcd: Option<EtcdServer>,
    net: Option<Network>,
    static_port: Option<u16>,
    outsider: Option<usize>,
    extra_env: Vec<(String, String)>,
    log: Vec<LogLine>,
    progress: Vec<(Instant, u64)>,
    t0: Instant,
    t0_unix: f64,
    files: RunFiles,
    audit_dir: PathBuf,
    logs_dir: PathBuf,
    shm_before: Vec<String>,
    // Last, so that it outlives the processes and the network.
    dir: tempfile::TempDir,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    let _ = getrandom::getrandom(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn rekindle_shm_files() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(String::from))
                .filter(|n| n.starts_with("rekindle-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

impl Cluster {
    /// Prepares the hosts (and etcd) of a job; starts no agent yet (see
    /// [`Cluster::start_all`]).
    pub fn new(
        name: &str,
        spec: JobSpec,
        workload: Workload,
        settings: Settings,
        mode: NetMode,
    ) -> Result<Cluster, ClusterError> {
        let dir = tempfile::Builder::new()
            .prefix("rekindle-chaos-")
            .tempdir()
            .map_err(io("creating the run dir"))?;
        let files = RunFiles {
            checkpoint_dir: dir.path().join("checkpoints"),
            loss_csv: dir.path().join("loss.csv"),
        };
        let audit_dir = dir.path().join("audit");
        let logs_dir = dir.path().join("logs");
        for d in [&files.checkpoint_dir, &audit_dir, &logs_dir] {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
        }
        let secret = random_hex(32);
        // What a pod finds where its Secret is mounted.
        std::fs::write(dir.path().join("secret"), &secret)
            .map_err(io("writing the secret file"))?;
        let rekindle = workspace_bin("rekindle").map_err(io("finding the rekindle binary"))?;
        let mut net = match mode {
            NetMode::Namespaces => Some(Network::new("rkc")?),
            NetMode::Loopback => None,
        };
        let etcd = match (&spec.rdzv, &mut net) {
            (Rdzv::Etcd { .. }, None) => Some(EtcdServer::start()?),
            (Rdzv::Etcd { .. }, Some(net)) => {
                let h = net.add_host(HostKind::Service)?;
                let host = net.host(h)?;
                Some(EtcdServer::start_in(host.netns(), host.addr())?)
            }
            _ => None,
        };
        let mut c = Cluster {
            job: format!("chaos-{name}-{}", random_hex(4)),
            secret,
            tag: format!("chaos-{}", rekindle_elastic::testing::process::new_tag()),
            bell: Bell::new(),
            rekindle,
            agents: Vec::new(),
            current: Vec::new(),
            hosts: Vec::new(),
            etcd,
            net,
            static_port: None,
            outsider: None,
            extra_env: Vec::new(),
            log: Vec::new(),
            progress: Vec::new(),
            t0: Instant::now(),
            t0_unix: unix_now(),
            files,
            audit_dir,
            logs_dir,
            shm_before: rekindle_shm_files(),
            spec,
            workload,
            settings,
            mode,
            dir,
        };
        for _ in 0..c.spec.nodes {
            c.add_host()?;
        }
        if c.spec.rdzv == Rdzv::Static {
            c.static_port = Some(c.free_port(0)?);
        }
        Ok(c)
    }

    fn add_host(&mut self) -> Result<usize, ClusterError> {
        let node = self.current.len();
        self.current.push(None);
        if let Some(net) = &mut self.net {
            self.hosts.push(net.add_host(HostKind::Worker)?);
        }
        Ok(node)
    }

    /// A port free on node `node`'s address now.
    fn free_port(&self, node: usize) -> Result<u16, ClusterError> {
        let addr = self.node_addr(node)?;
        let bind = move || {
            std::net::TcpListener::bind((addr, 0))
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
        };
        match &self.net {
            None => bind().map_err(io("finding a free port")),
            Some(net) => net
                .host(self.hosts[node])?
                .netns()
                .run(bind)?
                .map_err(io("finding a free port")),
        }
    }

    /// Node `node`'s address.
    pub fn node_addr(&self, node: usize) -> Result<IpAddr, ClusterError> {
        match &self.net {
            None => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            Some(net) => {
                let h = self
                    .hosts
                    .get(node)
                    .ok_or_else(|| ClusterError::Unsupported(format!("no node {node}")))?;
                Ok(IpAddr::V4(net.host(*h)?.addr()))
            }
        }
    }

    /// Where the nodes run.
    pub fn mode(&self) -> NetMode {
        self.mode
    }

    /// The job's shape.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The run's settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The workload.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// The job id.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The job secret the agents and workers were given.
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// The tag every process of the job carries.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The files placeholders name.
    pub fn files(&self) -> &RunFiles {
        &self.files
    }

    /// The sample-audit directory.
    pub fn audit_dir(&self) -> &Path {
        &self.audit_dir
    }

    /// The run directory (logs, checkpoints, audit, loss CSV).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The etcd server, if the job uses one.
    pub fn etcd(&mut self) -> Option<&mut EtcdServer> {
        self.etcd.as_mut()
    }

    /// The network, in namespace mode.
    pub fn network(&self) -> Option<&Network> {
        self.net.as_ref()
    }

    /// Node `node`'s host index in the network.
    pub fn host_of(&self, node: usize) -> Option<usize> {
        self.hosts.get(node).copied()
    }

    /// When the cluster was made, and the same instant as Unix time.
    pub fn epoch(&self) -> (Instant, f64) {
        (self.t0, self.t0_unix)
    }

    /// Seconds from the cluster's start to `at`.
    pub fn secs(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.t0).as_secs_f64()
    }

    /// Adds environment for agents started from now on (such as a failpoint).
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.extra_env.retain(|(k, _)| k != key);
        self.extra_env.push((key.into(), value.into()));
    }

    /// Removes environment set with [`Cluster::set_env`].
    pub fn unset_env(&mut self, key: &str) {
        self.extra_env.retain(|(k, _)| k != key);
    }

    /// A command that runs `program` as a process of another machine on the job's network
    /// (a host of its own in namespace mode; this machine otherwise).
    pub fn outsider_command(
        &mut self,
        program: impl AsRef<std::ffi::OsStr>,
    ) -> Result<Command, ClusterError> {
        let Some(net) = &mut self.net else {
            return Ok(Command::new(program));
        };
        let host = match self.outsider {
            Some(h) => h,
            None => {
                let h = net.add_host(HostKind::Service)?;
                self.outsider = Some(h);
                h
            }
        };
        Ok(net.host(host)?.netns().command(program))
    }

    /// Nodes that exist (started at least once or prepared).
    pub fn nodes(&self) -> usize {
        self.current.len()
    }

    /// Starts the agents of every node.
    pub fn start_all(&mut self) -> Result<(), ClusterError> {
        for node in 0..self.nodes() {
            self.start_node(node)?;
        }
        Ok(())
    }

    /// Adds a node (a new host in namespace mode) and starts its agent; returns its index.
    pub fn add_node(&mut self) -> Result<usize, ClusterError> {
        let node = self.add_host()?;
        self.start_node(node)?;
        Ok(node)
    }

    /// What Kubernetes would give node `node` as a pod.
    fn pod_facts(&self, node: usize) -> Result<PodFacts, ClusterError> {
        Ok(PodFacts {
            pod_ip: self.node_addr(node)?.to_string(),
            job_uid: self.job.clone(),
            etcd_endpoint: self
                .etcd
                .as_ref()
                .map(EtcdServer::endpoint)
                .ok_or_else(|| ClusterError::Unsupported("pods need etcd".into()))?,
            log_dir: self.logs_dir.join(format!("node-{node}")),
            secret_file: self.dir.path().join("secret"),
        })
    }

    fn agent_args(&self, node: usize) -> Result<Vec<String>, ClusterError> {
        let s = |x: &str| x.to_string();
        let spec = &self.spec;
        if let Some(pod) = &spec.pod {
            let mut a = pod.agent_argv(&self.pod_facts(node)?)?;
            a.push(self.workload.program.display().to_string());
            a.extend(self.workload.argv(&self.settings, &self.files));
            return Ok(a);
        }
        let logs = self.logs_dir.join(format!("node-{node}"));
        let mut a = vec![
            s("run"),
            s("--nproc-per-node"),
            spec.nproc_per_node.to_string(),
            s("--max-restarts"),
            spec.max_restarts.to_string(),
            s("--grace-period"),
            spec.grace_period.to_string(),
            s("--log-dir"),
            logs.display().to_string(),
        ];
        // A standalone agent serves its store on 127.0.0.1 and must advertise that address.
        if spec.rdzv != Rdzv::Standalone {
            a.extend([s("--local-addr"), self.node_addr(node)?.to_string()]);
        }
        match &spec.rdzv {
            Rdzv::Standalone => a.extend([s("--standalone"), s("--rdzv-id"), self.job.clone()]),
            Rdzv::Static => {
                let port = self.static_port.unwrap_or(0);
                a.extend([
                    s("--nnodes"),
                    spec.nodes.to_string(),
                    s("--node-rank"),
                    node.to_string(),
                    s("--master-addr"),
                    self.node_addr(0)?.to_string(),
                    s("--master-port"),
                    port.to_string(),
                ]);
            }
            Rdzv::Etcd { nnodes, lease_ttl } => {
                let endpoint = self
                    .etcd
                    .as_ref()
                    .map(EtcdServer::endpoint)
                    .ok_or_else(|| ClusterError::Unsupported("no etcd".into()))?;
                a.extend([
                    s("--rdzv-backend"),
                    s("etcd"),
                    s("--rdzv-endpoint"),
                    endpoint,
                    s("--rdzv-id"),
                    self.job.clone(),
                    s("--nnodes"),
                    nnodes.clone(),
                    s("--rdzv-conf"),
                    format!("last_call_timeout=0.2,lease_ttl={lease_ttl}"),
                ]);
            }
        }
        a.push(self.workload.program.display().to_string());
        a.extend(self.workload.argv(&self.settings, &self.files));
        Ok(a)
    }

    /// Starts (or starts again) node `node`'s agent.
    pub fn start_node(&mut self, node: usize) -> Result<(), ClusterError> {
        if node >= self.nodes() {
            return Err(ClusterError::Unsupported(format!("no node {node}")));
        }
        self.refresh();
        let args = self.agent_args(node)?;
        let mut cmd = match &self.net {
            None => Command::new(&self.rekindle),
            Some(net) => net.host(self.hosts[node])?.command(&self.rekindle),
        };
        cmd.args(&args);
        match &self.spec.pod {
            // The pod's own environment: the secret comes from the file it names.
            Some(pod) => {
                cmd.env_remove("REKINDLE_SECRET")
                    .envs(pod.environment(&self.pod_facts(node)?)?);
            }
            None => {
                cmd.env("REKINDLE_SECRET", &self.secret);
            }
        }
        cmd.env(AUDIT_ENV, &self.audit_dir)
            .env(
                "REKINDLE_LOG",
                "rekindle_elastic=info,rekindle_runtime=warn",
            )
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)));
        let proc = Proc::spawn_with(
            cmd,
            &SpawnOptions {
                name: Some(format!("node {node}")),
                tag: Some(self.tag.clone()),
                own_group: false,
                bell: Some(self.bell.clone()),
            },
        )?;
        self.agents.push(Agent {
            node,
            proc,
            merged: 0,
            expected_exit: None,
        });
        self.current[node] = Some(self.agents.len() - 1);
        Ok(())
    }

    /// Node `node`'s current agent.
    pub fn agent(&self, node: usize) -> Option<&Proc> {
        self.current
            .get(node)
            .copied()
            .flatten()
            .map(|i| &self.agents[i].proc)
    }

    /// Nodes whose current agent still runs.
    pub fn live_nodes(&self) -> Vec<usize> {
        (0..self.nodes())
            .filter(|&n| self.agent(n).is_some_and(|a| a.try_exit().is_none()))
            .collect()
    }

    /// Merges the agents' new lines into the log and the progress.
    pub fn refresh(&mut self) {
        let mut new = Vec::new();
        for a in &mut self.agents {
            let lines = a.proc.lines_from(a.merged);
            a.merged += lines.len();
            new.extend(lines.into_iter().map(|l| LogLine {
                at: l.at,
                node: a.node,
                text: l.text,
            }));
        }
        new.sort_by_key(|l| l.at);
        for l in &new {
            if let Some(step) = step_of(&l.text) {
                self.progress.push((l.at, step));
            }
        }
        self.log.extend(new);
    }

    /// Every line the agents printed so far, in the order read.
    pub fn log(&self) -> &[LogLine] {
        &self.log
    }

    /// The whole log as text, `[node N] line` each, for failure messages.
    pub fn log_text(&self) -> String {
        self.log
            .iter()
            .map(|l| format!("[node {}] {}", l.node, l.text))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `(when, step)` of every `step=<N>` line so far.
    pub fn progress(&self) -> &[(Instant, u64)] {
        &self.progress
    }

    /// The highest step printed so far.
    pub fn step(&self) -> Option<u64> {
        self.progress.iter().map(|(_, s)| *s).max()
    }

    /// Waits (re-evaluating at every line and exit) until `cond` gives a value.
    pub fn wait_until<T>(
        &mut self,
        timeout: Duration,
        mut cond: impl FnMut(&Cluster) -> Option<T>,
    ) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let bell = self.bell.clone();
        loop {
            let seen = bell.rung();
            self.refresh();
            if let Some(v) = cond(self) {
                return Some(v);
            }
            if Instant::now() >= deadline {
                return None;
            }
            bell.wait_past(seen, deadline);
        }
    }

    /// Waits until the job prints step `step` or later, or every agent has exited; the step
    /// reached.
    pub fn wait_step(&mut self, step: u64, timeout: Duration) -> Option<u64> {
        self.wait_until(timeout, |c| {
            c.step().filter(|s| *s >= step).or_else(|| {
                (c.live_nodes().is_empty() && c.nodes() > 0).then_some(c.step().unwrap_or(0))
            })
        })
    }

    /// Waits for a line after `since` containing any of `needles`; returns it.
    pub fn wait_line_after(
        &mut self,
        since: Instant,
        needles: &[&str],
        timeout: Duration,
    ) -> Option<LogLine> {
        self.wait_until(timeout, |c| {
            c.log
                .iter()
                .find(|l| l.at >= since && needles.iter().any(|n| l.text.contains(n)))
                .cloned()
        })
    }

    /// The first line after `since` containing any of `needles`, among those read.
    pub fn find_after(&self, since: Instant, needles: &[&str]) -> Option<&LogLine> {
        self.log
            .iter()
            .find(|l| l.at >= since && needles.iter().any(|n| l.text.contains(n)))
    }

    /// The workers of the live agents (children of the agent processes), with the rank and
    /// local rank they were started with.
    pub fn workers(&self) -> Vec<Worker> {
        let mut out = Vec::new();
        for node in self.live_nodes() {
            let Some(agent) = self.agent(node) else {
                continue;
            };
            for pid in children(agent.pid()) {
                let env = environ(pid);
                out.push(Worker {
                    node,
                    pid,
                    rank: env.get("RANK").and_then(|v| v.parse().ok()),
                    local_rank: env.get("LOCAL_RANK").and_then(|v| v.parse().ok()),
                });
            }
        }
        out
    }

    /// Waits for node `node`'s worker of local rank `local_rank`.
    pub fn wait_worker(
        &mut self,
        node: usize,
        local_rank: usize,
        timeout: Duration,
    ) -> Option<Worker> {
        self.wait_until(timeout, |c| {
            c.workers()
                .into_iter()
                .find(|w| w.node == node && w.local_rank == Some(local_rank))
        })
    }

    /// SIGKILLs node `node`'s agent and its workers at once (a lost machine).
    pub fn kill_node(&mut self, node: usize) -> Result<(), ClusterError> {
        let idx = self.current[node]
            .ok_or_else(|| ClusterError::Unsupported(format!("node {node} runs no agent")))?;
        let pid = self.agents[idx].proc.pid();
        let workers = children(pid);
        self.agents[idx].proc.signal(libc::SIGKILL);
        for w in workers {
            kill(w, libc::SIGKILL);
        }
        self.agents[idx].expected_exit = Some(128 + libc::SIGKILL);
        Ok(())
    }

    /// Sends `sig` to node `node`'s agent; `expected` is the exit that is then right for it.
    pub fn signal_node(
        &mut self,
        node: usize,
        sig: i32,
        expected: i32,
    ) -> Result<(), ClusterError> {
        let idx = self.current[node]
            .ok_or_else(|| ClusterError::Unsupported(format!("node {node} runs no agent")))?;
        self.agents[idx].proc.signal(sig);
        self.agents[idx].expected_exit = Some(expected);
        Ok(())
    }

    /// SIGKILLs every agent and worker of the job and waits for them to be gone.
    pub fn kill_all(&mut self, timeout: Duration) -> Result<(), ClusterError> {
        for node in 0..self.nodes() {
            if self.agent(node).is_some_and(|a| a.try_exit().is_none()) {
                self.kill_node(node)?;
            }
        }
        for a in &mut self.agents {
            let _ = a.proc.wait_exit(timeout);
        }
        let left = wait_tagged_gone(&self.tag, timeout);
        if !left.is_empty() {
            return Err(ClusterError::Unsupported(format!(
                "processes {left:?} of the job survived SIGKILL"
            )));
        }
        self.refresh();
        Ok(())
    }

    /// Waits for every current agent to exit; returns `(node, exit code, expected code)` for
    /// each agent ever started (`None` for one still running at the deadline, which is then
    /// killed).
    pub fn finish(&mut self, timeout: Duration) -> Vec<(usize, Option<i32>, Option<i32>)> {
        let deadline = Instant::now() + timeout;
        for a in &mut self.agents {
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = a.proc.wait_exit(left);
        }
        self.refresh();
        self.agents
            .iter()
            .map(|a| (a.node, a.proc.try_exit(), a.expected_exit))
            .collect()
    }

    /// Processes of the job still alive after `timeout` (none when everything exited).
    pub fn orphans(&self, timeout: Duration) -> Vec<i32> {
        wait_tagged_gone(&self.tag, timeout)
    }

    /// `rekindle-*` files in `/dev/shm` that were not there when the cluster was made and are
    /// still there after `timeout` (in loopback mode; the hosts' own `/dev/shm` in namespace
    /// mode).
    pub fn shm_leftovers(&self, timeout: Duration) -> Vec<String> {
        if let Some(net) = &self.net {
            return net
                .shm_leftovers()
                .iter()
                .map(|p| p.display().to_string())
                .collect();
        }
        // Other jobs on this machine create and unlink such files all the time: a file of
        // this job's left behind is one that stays.
        let deadline = Instant::now() + timeout;
        loop {
            let new: Vec<String> = rekindle_shm_files()
                .into_iter()
                .filter(|f| !self.shm_before.contains(f))
                .collect();
            if new.is_empty() || Instant::now() >= deadline {
                return new;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Deletes the network's namespaces and mounts; returns the namespaces left (none on
    /// success). Stops etcd first.
    pub fn teardown(&mut self) -> Vec<String> {
        for a in &mut self.agents {
            a.proc.kill_tree();
        }
        if let Some(e) = &mut self.etcd {
            e.stop();
        }
        match &mut self.net {
            Some(net) => net.teardown(),
            None => Vec::new(),
        }
    }

    /// The keys under the job's etcd prefix (`/rekindle/<job>/`), without the prefix.
    pub fn etcd_keys(&self) -> Result<Vec<String>, ClusterError> {
        let etcd = self
            .etcd
            .as_ref()
            .ok_or_else(|| ClusterError::Unsupported("the job uses no etcd".into()))?;
        let endpoint = format!("http://{}", etcd.endpoint());
        let prefix = format!("/rekindle/{}/", self.job);
        let read = move || -> Result<Vec<String>, String> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let opts = etcd_client::ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(5));
                let mut c = etcd_client::Client::connect([endpoint], Some(opts))
                    .await
                    .map_err(|e| e.to_string())?;
                let resp = c
                    .get(
                        prefix.as_bytes(),
                        Some(
                            etcd_client::GetOptions::new()
                                .with_prefix()
                                .with_keys_only(),
                        ),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(resp
                    .kvs()
                    .iter()
                    .map(|kv| {
                        String::from_utf8_lossy(kv.key())
                            .trim_start_matches(prefix.as_str())
                            .to_string()
                    })
                    .collect())
            })
        };
        let r = match (&self.net, etcd.netns()) {
            (Some(net), Some(ns)) => {
                let host = net
                    .hosts()
                    .iter()
                    .find(|h| h.netns().name() == ns)
                    .ok_or_else(|| ClusterError::Unsupported("etcd's host is gone".into()))?;
                host.netns().run(read)?
            }
            _ => read(),
        };
        r.map_err(ClusterError::EtcdRead)
    }

    /// Sends `sig` to a worker by pid (one of [`Cluster::workers`]).
    pub fn signal_worker(&self, pid: i32, sig: i32) {
        if self.tagged(pid) {
            kill(pid, sig);
        }
    }

    /// True if `pid` is a live process of this job.
    pub fn tagged(&self, pid: i32) -> bool {
        tagged_pids(&self.tag).contains(&pid)
    }

    /// The loss CSV rows `(step, loss, world_size, unix_time)` written so far.
    pub fn loss_rows(&self) -> Vec<(u64, f64, usize, f64)> {
        let Ok(text) = std::fs::read_to_string(&self.files.loss_csv) else {
            return Vec::new();
        };
        text.lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                Some((
                    f.first()?.parse().ok()?,
                    f.get(2)?.parse().ok()?,
                    f.get(4)?.parse().ok()?,
                    f.get(5)?.parse().ok()?,
                ))
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}

/// The `N` of a `step=<N>` word in a line.
pub fn step_of(line: &str) -> Option<u64> {
    field(line, "step").and_then(|v| v.parse().ok())
}

/// The children of `pid` (from `/proc/<pid>/task/*/children`).
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The environment `pid` was started with.
pub fn environ(pid: i32) -> BTreeMap<String, String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter_map(|kv| {
                    let kv = String::from_utf8_lossy(kv);
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_words_are_parsed() {
        assert_eq!(step_of("[rank 0] step=42 loss=1.0"), Some(42));
        assert_eq!(step_of("[rank 0] final_step=42"), None);
        assert_eq!(step_of("step 42/100"), None);
    }

    #[test]
    fn children_and_environ_of_this_process() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30").env("CHAOS_PROBE", "7");
        let p = Proc::spawn(cmd).unwrap();
        let me = std::process::id() as i32;
        assert!(children(me).contains(&p.pid()));
        // The kernel fills in a new image's environment after the spawner has been let go
        // (exec reports success before the new stack is laid out), so an early read is empty.
        let deadline = Instant::now() + Duration::from_secs(10);
        let probe = loop {
            let env = environ(p.pid());
            if !env.is_empty() || Instant::now() > deadline {
                break env.get("CHAOS_PROBE").cloned();
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(probe.as_deref(), Some("7"));
    }

    #[test]
    fn job_shapes() {
        assert!(JobSpec::standalone(2).fixed_size());
        assert!(JobSpec::etcd(2, "2").fixed_size());
        assert!(!JobSpec::etcd(3, "2:3").fixed_size());
        assert_eq!(JobSpec::etcd(3, "2:3").world_size(), 3);
    }
}
