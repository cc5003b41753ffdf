//! A real etcd server for tests and benchmarks.
//!
//! [`EtcdServer::start`] runs `/usr/bin/etcd` (or `$REKINDLE_ETCD_BIN`) on 127.0.0.1 with a
//! fresh temp data dir and stops it (kill, then wait) when dropped; [`EtcdServer::start_in`]
//! runs it on a host of its own in a [`Network`](super::netns::Network).
//!
//! etcd cannot be told to listen on port 0 and report the port it got, so the ports are chosen
//! the only way left: bind two listeners on port 0, note their ports, close them, and start
//! etcd on those ports. Another process may grab a port in between; etcd then exits with
//! "address already in use" and the start is retried with new ports (up to
//! [`START_ATTEMPTS`] times). Readiness is read from etcd's own log line ("serving ... client
//! requests"), not polled.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How many times a start is retried after a port clash.
pub const START_ATTEMPTS: usize = 5;

/// How long a start may take before it is an error.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Why the test etcd could not be started.
#[derive(Debug, thiserror::Error)]
pub enum EtcdServerError {
    /// The binary could not be run.
    #[error("cannot run {bin}: {source}")]
    Spawn {
        /// The etcd binary.
        bin: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// etcd exited or did not become ready in time.
    #[error("etcd did not become ready ({reason}); last log lines:\n{log}")]
    NotReady {
        /// What happened.
        reason: String,
        /// etcd's last log lines.
        log: String,
    },
    /// A temp dir or port could not be had.
    #[error("cannot prepare etcd: {0}")]
    Io(#[from] std::io::Error),
    /// Setting up authentication failed.
    #[error("cannot enable etcd authentication: {0}")]
    Auth(String),
}

/// A running etcd server that is stopped on drop.
pub struct EtcdServer {
    child: Option<Child>,
    addr: IpAddr,
    netns: Option<String>,
    client_port: u16,
    peer_port: u16,
    data_dir: tempfile::TempDir,
    log: Arc<Mutex<Vec<String>>>,
}

impl std::fmt::Debug for EtcdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdServer")
            .field("endpoint", &self.endpoint())
            .finish()
    }
}

fn etcd_bin() -> String {
    std::env::var("REKINDLE_ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".to_string())
}

fn two_free_ports(addr: IpAddr) -> std::io::Result<(u16, u16)> {
    let a = TcpListener::bind((addr, 0))?;
    let b = TcpListener::bind((addr, 0))?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

impl EtcdServer {
    /// Starts etcd on free ports of 127.0.0.1 with a temp data dir and waits until it serves
    /// clients.
    pub fn start() -> Result<Self, EtcdServerError> {
        Self::start_on(IpAddr::V4(Ipv4Addr::LOCALHOST), None)
    }

    /// Starts etcd inside the network namespace `ns`, listening on `addr` (an address of
    /// that namespace), on ports that are free there.
    pub fn start_in(ns: &super::netns::Netns, addr: Ipv4Addr) -> Result<Self, EtcdServerError> {
        Self::start_on(IpAddr::V4(addr), Some(ns))
    }

    fn start_on(addr: IpAddr, ns: Option<&super::netns::Netns>) -> Result<Self, EtcdServerError> {
        let mut data_dir = tempfile::Builder::new()
            .prefix("rekindle-etcd-")
            .tempdir()?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let (client_port, peer_port) = match ns {
                None => two_free_ports(addr)?,
                Some(ns) => ns
                    .run(|| two_free_ports(addr))
                    .map_err(|e| std::io::Error::other(e.to_string()))??,
            };
            let mut server = EtcdServer {
                child: None,
                addr,
                netns: ns.map(|n| n.name().to_string()),
                client_port,
                peer_port,
                data_dir,
                log: Arc::default(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(EtcdServerError::NotReady { reason, log })
                    if log.contains("address already in use") =>
                {
                    last = Some(EtcdServerError::NotReady { reason, log });
                    data_dir = std::mem::replace(&mut server.data_dir, tempfile::tempdir()?);
                    // A failed first start may leave a half-made member dir behind.
                    let member = data_dir.path().join("member");
                    let _ = std::fs::remove_dir_all(member);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(EtcdServerError::NotReady {
            reason: "no free ports".into(),
            log: String::new(),
        }))
    }

    /// Starts etcd with authentication enabled: user `root` with `root_password` has the root
    /// role. Clients without these credentials are refused.
    pub fn start_with_auth(root_password: &str) -> Result<Self, EtcdServerError> {
        let server = Self::start()?;
        let endpoint = format!("http://{}", server.endpoint());
        let password = root_password.to_string();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let mut c = etcd_client::Client::connect([endpoint], None).await?;
            c.user_add("root", password, None).await?;
            c.user_grant_role("root", "root").await?;
            c.auth_enable().await?;
            Ok::<_, etcd_client::Error>(())
        })
        .map_err(|e| EtcdServerError::Auth(e.to_string()))?;
        Ok(server)
    }

    fn spawn(&mut self) -> Result<(), EtcdServerError> {
        let bin = etcd_bin();
        let client = format!("http://{}", self.endpoint());
        let peer = format!("http://{}:{}", self.addr, self.peer_port);
        let mut cmd = match &self.netns {
            None => Command::new(&bin),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&bin);
                c
            }
        };
        let mut child = cmd
            .arg("--name")
            .arg("default")
            .arg("--data-dir")
            .arg(self.data_dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("default={peer}"))
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| EtcdServerError::Spawn {
                bin: bin.clone(),
                source,
            })?;
        let Some(stderr) = child.stderr.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(EtcdServerError::NotReady {
                reason: "no stderr pipe".into(),
                log: String::new(),
            });
        };
        let (ready_tx, ready_rx) = mpsc::channel::<bool>();
        let log = self.log.clone();
        // Drains etcd's log for the whole life of the process (a full pipe would stall etcd)
        // and reports readiness once.
        std::thread::spawn(move || {
            let mut told = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if !told && line.contains("client requests on") {
                    told = true;
                    let _ = ready_tx.send(true);
                }
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                log.push(line);
                if log.len() > 200 {
                    log.remove(0);
                }
            }
            let _ = ready_tx.send(false);
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let ready = ready_rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        if ready == Ok(true) {
            self.child = Some(child);
            return Ok(());
        }
        let _ = child.kill();
        let _ = child.wait();
        // The log thread ends once the pipe closes; wait for its last word.
        let _ = ready_rx.recv_timeout(Duration::from_secs(2));
        Err(EtcdServerError::NotReady {
            reason: match ready {
                Ok(_) => "etcd exited".into(),
                Err(_) => format!("not serving after {START_TIMEOUT:?}"),
            },
            log: self.log_tail(),
        })
    }

    /// etcd's last log lines.
    pub fn log_tail(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .join("\n")
    }

    /// The client endpoint, `address:port` (`127.0.0.1:port` unless started in a namespace).
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.addr, self.client_port)
    }

    /// The network namespace etcd runs in, if any.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// etcd's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data dir.
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir.path().join("data")
    }

    /// Stops etcd with SIGKILL and reaps it. Data survives for [`EtcdServer::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Starts etcd again on the same ports and data (after [`EtcdServer::stop`]).
    pub fn restart(&mut self) -> Result<(), EtcdServerError> {
        self.stop();
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.spawn()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
