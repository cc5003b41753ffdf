//! Several hosts on one machine: Linux network namespaces joined by a bridge (root only).
//!
//! A [`Network`] is a private switch (a namespace holding a bridge) and hosts, each a network
//! namespace with its own IPv4 address on the bridge through a veth pair, and, for hosts that
//! run workers, its own `/dev/shm` (a small tmpfs bind-mounted over `/dev/shm` in a private
//! mount namespace), so that two hosts cannot talk through shared memory either. Cutting a
//! host's link ([`Network::link_down`]) is a partition; [`Network::shape`] slows a link with
//! `tc tbf`. Every name carries the network's random id; namespaces, links and mounts are
//! removed by [`Network::teardown`] or on drop, also after a failure.
//!
//! [`Netns::run`] runs a closure on a thread that entered a namespace, so a test can open
//! sockets inside a host (to pick a free port there, or to talk to a server only the hosts
//! reach) without giving the root namespace an address in the test's range.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a namespace or link operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// Network namespaces need root.
    #[error("network namespaces need root (running as uid {uid})")]
    NotRoot {
        /// The effective uid.
        uid: u32,
    },
    /// A command failed.
    #[error("`{command}` failed: {reason}")]
    Command {
        /// The command line.
        command: String,
        /// Its stderr, or the OS error.
        reason: String,
    },
    /// Entering a namespace on a thread failed.
    #[error("cannot enter network namespace {name}: {reason}")]
    Enter {
        /// The namespace.
        name: String,
        /// The OS error.
        reason: String,
    },
    /// A host index out of range.
    #[error("no host {index} (the network has {hosts})")]
    NoHost {
        /// The index asked for.
        index: usize,
        /// Hosts in the network.
        hosts: usize,
    },
    /// A temp dir could not be made.
    #[error("cannot prepare a host dir: {0}")]
    Io(#[from] std::io::Error),
}

/// True when running as root (network namespaces are available).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn sh(program: &str, args: &[&str]) -> Result<String, NetnsError> {
    let command = format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetnsError::Command {
            command: command.clone(),
            reason: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(NetnsError::Command {
            command,
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The names of the network namespaces that exist now.
pub fn list_namespaces() -> Vec<String> {
    match std::fs::read_dir("/run/netns") {
        Ok(dir) => dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    deleted: bool,
}

impl Netns {
    /// Creates the namespace `name` with its loopback up.
    pub fn create(name: &str) -> Result<Netns, NetnsError> {
        if !is_root() {
            // SAFETY: geteuid has no preconditions.
            return Err(NetnsError::NotRoot {
                uid: unsafe { libc::geteuid() },
            });
        }
        sh("ip", &["netns", "add", name])?;
        let ns = Netns {
            name: name.to_string(),
            deleted: false,
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip -n <name> args...`.
    pub fn ip(&self, args: &[&str]) -> Result<String, NetnsError> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        sh("ip", &all)
    }

    /// Runs `tc -n <name> args...`.
    pub fn tc(&self, args: &[&str]) -> Result<String, NetnsError> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        sh("tc", &all)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`, which execs, so
    /// the child's pid is the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Runs `f` on a new thread that has entered the namespace; sockets it opens live there.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        let path = format!("/run/netns/{}", self.name);
        let enter_err = |reason: String| NetnsError::Enter {
            name: self.name.clone(),
            reason,
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).map_err(|e| enter_err(e.to_string()))?;
                // SAFETY: setns(2) on an open namespace file; it affects only this thread,
                // which ends after `f`.
                let r = unsafe {
                    libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET)
                };
                if r != 0 {
                    return Err(enter_err(std::io::Error::last_os_error().to_string()));
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|_| Err(enter_err("the thread panicked".into())))
        })
    }

    /// Deletes the namespace (also done on drop).
    pub fn delete(&mut self) -> Result<(), NetnsError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        sh("ip", &["netns", "del", &self.name]).map(|_| ())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.delete();
    }
}

/// A tmpfs mounted on a temp dir, unmounted on drop.
#[derive(Debug)]
struct Tmpfs {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl Tmpfs {
    fn mount(size: &str) -> Result<Tmpfs, NetnsError> {
        let dir = tempfile::Builder::new().prefix("rekindle-shm-").tempdir()?;
        let path = dir.path().to_string_lossy().into_owned();
        sh(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=1777"),
                "tmpfs",
                &path,
            ],
        )?;
        Ok(Tmpfs { dir, mounted: true })
    }

    fn unmount(&mut self) -> Result<(), NetnsError> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        sh("umount", &["-l", &self.dir.path().to_string_lossy()]).map(|_| ())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = self.unmount();
    }
}

/// One host of a [`Network`].
#[derive(Debug)]
pub struct Host {
    ns: Netns,
    addr: Ipv4Addr,
    link: String,
    peer: String,
    shm: Option<Tmpfs>,
}

impl Host {
    /// The host's namespace.
    pub fn netns(&self) -> &Netns {
        &self.ns
    }

    /// The host's address on the network.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The host's end of its link (inside its namespace).
    pub fn link(&self) -> &str {
        &self.link
    }

    /// The directory that is this host's `/dev/shm`, if it has a private one.
    pub fn shm_dir(&self) -> Option<&Path> {
        self.shm.as_ref().map(|t| t.dir.path())
    }

    /// A command that runs `program` on this host: in its network namespace and, with a
    /// private `/dev/shm`, in a private mount namespace where the host's tmpfs is `/dev/shm`.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        match &self.shm {
            None => self.ns.command(program),
            Some(shm) => {
                let mut c = self.ns.command("unshare");
                c.args(["-m", "--propagation", "private", "sh", "-c"])
                    .arg(r#"mount --bind "$0" /dev/shm && exec "$@""#)
                    .arg(shm.dir.path())
                    .arg(program);
                c
            }
        }
    }
}

/// What a new host gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// A host that runs workers: a private `/dev/shm` of 64 MiB.
    Worker,
    /// A service (etcd): the network namespace only.
    Service,
}

/// A private switch and its hosts (see the module docs).
#[derive(Debug)]
pub struct Network {
    id: String,
    switch: Netns,
    hosts: Vec<Host>,
    torn_down: bool,
}

/// The bridge inside the switch namespace.
const BRIDGE: &str = "br0";

/// The size of a worker host's `/dev/shm`.
pub const SHM_SIZE: &str = "64m";

impl Network {
    /// Creates an empty network whose namespaces are named `<prefix>-<random id>-...`.
    pub fn new(prefix: &str) -> Result<Network, NetnsError> {
        let mut salt = [0u8; 3];
        let _ = getrandom::getrandom(&mut salt);
        let id = format!("{prefix}-{:02x}{:02x}{:02x}", salt[0], salt[1], salt[2]);
        let switch = Netns::create(&format!("{id}-sw"))?;
        switch.ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        switch.ip(&["link", "set", BRIDGE, "up"])?;
        Ok(Network {
            id,
            switch,
            hosts: Vec::new(),
            torn_down: false,
        })
    }

    /// The network's id (the prefix of every namespace name).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Adds a host (10.0.0.N/16 with N = its index + 1, up to 65000 hosts) and returns its
    /// index.
    pub fn add_host(&mut self, kind: HostKind) -> Result<usize, NetnsError> {
        let i = self.hosts.len();
        let ns = Netns::create(&format!("{}-h{i}", self.id))?;
        let n = i as u32 + 1;
        let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 0)) + n);
        let (link, peer) = ("eth0".to_string(), format!("p{i}"));
        self.switch.ip(&[
            "link",
            "add",
            &peer,
            "type",
            "veth",
            "peer",
            "name",
            &link,
            "netns",
            ns.name(),
        ])?;
        self.switch.ip(&["link", "set", &peer, "master", BRIDGE])?;
        self.switch.ip(&["link", "set", &peer, "up"])?;
        ns.ip(&["addr", "add", &format!("{addr}/16"), "dev", &link])?;
        ns.ip(&["link", "set", &link, "up"])?;
        let shm = match kind {
            HostKind::Worker => Some(Tmpfs::mount(SHM_SIZE)?),
            HostKind::Service => None,
        };
        self.hosts.push(Host {
            ns,
            addr,
            link,
            peer,
            shm,
        });
        Ok(i)
    }

    /// The hosts, in the order they were added.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> Result<&Host, NetnsError> {
        self.hosts.get(i).ok_or(NetnsError::NoHost {
            index: i,
            hosts: self.hosts.len(),
        })
    }

    /// Cuts host `i` off the network (its link down, both ends).
    pub fn link_down(&self, i: usize) -> Result<(), NetnsError> {
        let h = self.host(i)?;
        h.ns.ip(&["link", "set", &h.link, "down"])?;
        self.switch
            .ip(&["link", "set", &h.peer, "down"])
            .map(|_| ())
    }

    /// Reconnects host `i`.
    pub fn link_up(&self, i: usize) -> Result<(), NetnsError> {
        let h = self.host(i)?;
        self.switch.ip(&["link", "set", &h.peer, "up"])?;
        h.ns.ip(&["link", "set", &h.link, "up"]).map(|_| ())
    }

    /// Limits host `i`'s link to `rate` (a `tc` rate such as `100mbit`) in both directions,
    /// with a token bucket (`tc tbf`; burst 64 KiB, 50 ms of queue).
    pub fn shape(&self, i: usize, rate: &str) -> Result<(), NetnsError> {
        let h = self.host(i)?;
        let tbf = [
            "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms",
        ];
        let mut args = vec!["qdisc", "replace", "dev", h.link.as_str()];
        args.extend_from_slice(&tbf);
        h.ns.tc(&args)?;
        let mut args = vec!["qdisc", "replace", "dev", h.peer.as_str()];
        args.extend_from_slice(&tbf);
        self.switch.tc(&args).map(|_| ())
    }

    /// Removes the limit of [`Network::shape`].
    pub fn unshape(&self, i: usize) -> Result<(), NetnsError> {
        let h = self.host(i)?;
        h.ns.tc(&["qdisc", "del", "dev", &h.link, "root"])?;
        self.switch
            .tc(&["qdisc", "del", "dev", &h.peer, "root"])
            .map(|_| ())
    }

    /// The files left in the hosts' private `/dev/shm` dirs.
    pub fn shm_leftovers(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for h in &self.hosts {
            if let Some(dir) = h.shm_dir() {
                if let Ok(rd) = std::fs::read_dir(dir) {
                    out.extend(rd.flatten().map(|e| e.path()));
                }
            }
        }
        out
    }

    /// Deletes every namespace (links go with them) and unmounts the hosts' tmpfs; returns
    /// the names of namespaces of this network that still exist afterwards (none on success).
    /// Stop the processes running in the hosts first.
    pub fn teardown(&mut self) -> Vec<String> {
        if !self.torn_down {
            self.torn_down = true;
            for h in &mut self.hosts {
                let _ = h.ns.delete();
                if let Some(shm) = &mut h.shm {
                    let _ = shm.unmount();
                }
            }
            let _ = self.switch.delete();
        }
        let prefix = format!("{}-", self.id);
        list_namespaces()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn connect(net: &Network, from: usize, addr: std::net::SocketAddr) -> bool {
        net.host(from)
            .unwrap()
            .netns()
            .run(|| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok())
            .unwrap()
    }

    #[test]
    fn hosts_reach_each_other_until_a_link_is_cut_and_everything_is_removed() {
        if !is_root() {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        let mut net = Network::new("rkt").unwrap();
        let a = net.add_host(HostKind::Worker).unwrap();
        let b = net.add_host(HostKind::Service).unwrap();
        let listener = net
            .host(b)
            .unwrap()
            .netns()
            .run(|| std::net::TcpListener::bind((net.hosts[b].addr(), 0)))
            .unwrap()
            .unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(connect(&net, a, addr));
        // The root namespace has no route into the network.
        assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_err());
        net.link_down(a).unwrap();
        assert!(!connect(&net, a, addr));
        net.link_up(a).unwrap();
        assert!(connect(&net, a, addr));
        net.shape(a, "10mbit").unwrap();
        assert!(connect(&net, a, addr));
        net.unshape(a).unwrap();

        // The worker host's /dev/shm is its own.
        let shm = net.host(a).unwrap().shm_dir().unwrap().to_path_buf();
        let out = net
            .host(a)
            .unwrap()
            .command("sh")
            .args(["-c", "echo x > /dev/shm/rekindle-probe && ls /dev/shm"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert!(shm.join("rekindle-probe").exists());
        assert!(!Path::new("/dev/shm/rekindle-probe").exists());
        assert_eq!(net.shm_leftovers(), vec![shm.join("rekindle-probe")]);

        drop(listener);
        let id = net.id().to_string();
        assert!(net.teardown().is_empty());
        assert!(!list_namespaces().iter().any(|n| n.starts_with(&id)));
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        assert!(!mounts.contains(shm.to_str().unwrap()), "{mounts}");
    }
}
