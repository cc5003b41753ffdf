//! [`ProcessGroup`]: the collective API a training program uses, over one [`Backend`].

use std::sync::Arc;
use std::time::Duration;

use crate::buffer::Buffer;
use crate::collectives::{Backend, Collective, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::secret::JobSecret;
use crate::store::Store;

/// The store prefix under which a group of job `job` in rendezvous round `round` bootstraps.
/// Unique per (job, round), so a rebuilt group never reads a previous round's addresses.
pub fn group_prefix(job: &str, round: u64) -> String {
    format!("rekindle/{job}/round/{round}/pg/")
}

/// Who this process is and how its group finds its peers.
#[derive(Clone)]
pub struct GroupConfig {
    /// The job id; part of every handshake.
    pub job: String,
    /// The rendezvous round; part of every handshake and of the store prefix.
    pub round: u64,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The bootstrap store, shared by all ranks.
    pub store: Arc<dyn Store>,
    /// The job secret.
    pub secret: JobSecret,
    /// Deadline of each operation, from the moment it starts running.
    pub op_timeout: Duration,
    /// Deadline for forming the group (publishing, connecting, authenticating).
    pub bootstrap_timeout: Duration,
}

impl std::fmt::Debug for GroupConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupConfig")
            .field("job", &self.job)
            .field("round", &self.round)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("op_timeout", &self.op_timeout)
            .field("bootstrap_timeout", &self.bootstrap_timeout)
            .finish_non_exhaustive()
    }
}

impl GroupConfig {
    /// A config with the default deadlines (operations 60 s, bootstrap 60 s) and the secret
    /// from the environment (see [`JobSecret::from_env`]).
    pub fn new(
        job: impl Into<String>,
        round: u64,
        rank: usize,
        world_size: usize,
        store: Arc<dyn Store>,
    ) -> Result<Self> {
        let cfg = GroupConfig {
            job: job.into(),
            round,
            rank,
            world_size,
            store,
            secret: JobSecret::from_env()?,
            op_timeout: Duration::from_secs(60),
            bootstrap_timeout: Duration::from_secs(60),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks rank, world size and job id.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "process group",
            reason,
        };
        if self.world_size == 0 {
            return Err(bad("world_size must be at least 1".into()));
        }
        if self.rank >= self.world_size {
            return Err(bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            )));
        }
        if self.job.is_empty() || self.job.len() > 255 {
            return Err(bad("the job id must be 1 to 255 bytes".into()));
        }
        Ok(())
    }

    /// The store prefix of this (job, round), see [`group_prefix`].
    pub fn prefix(&self) -> String {
        group_prefix(&self.job, self.round)
    }
}

/// A group of ranks running collectives through one backend.
///
/// Every method issues the operation asynchronously and returns a [`Work`]; operations run in
/// issue order. Semantics of each are those of [`Collective`]'s variants.
///
/// ```
/// use std::sync::Arc;
/// use rekindle_runtime::{Buffer, ProcessGroup, ReduceOp, GroupConfig, TcpOptions};
/// use rekindle_runtime::store::InMemoryStore;
/// use std::time::Duration;
///
/// let store = Arc::new(InMemoryStore::new());
/// let handles: Vec<_> = (0..2).map(|rank| {
///     let store = store.clone();
///     std::thread::spawn(move || {
///         let cfg = GroupConfig::new("doc", 0, rank, 2, store).unwrap();
///         let pg = ProcessGroup::tcp(cfg, TcpOptions::default()).unwrap();
///         let buf = Buffer::from(vec![rank as f32 + 1.0; 4]);
///         let out = pg.all_reduce(buf, ReduceOp::Sum).wait(Duration::from_secs(10)).unwrap();
///         out.into_vec::<f32>().unwrap()
///     })
/// }).collect();
/// for h in handles {
///     assert_eq!(h.join().unwrap(), vec![3.0; 4]);
/// }
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend.name())
            .field("rank", &self.backend.rank())
            .field("world_size", &self.backend.world_size())
            .finish()
    }
}

impl ProcessGroup {
    /// A group over an existing backend.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        ProcessGroup { backend }
    }

    /// Forms a group over the TCP backend (blocks until every rank connected, or the
    /// bootstrap deadline). The built-in default secret is refused
    /// ([`Error::DefaultSecretOffLoopback`]) when the group would listen on or advertise an
    /// address off loopback.
    pub fn tcp(config: GroupConfig, options: crate::TcpOptions) -> Result<Self> {
        let mut addrs = vec![options.bind_addr];
        addrs.extend(options.advertise_addr);
        config.secret.check_exposure(&addrs)?;
        Ok(Self::new(Arc::new(crate::TcpBackend::new(
            config, options,
        )?)))
    }

    /// Forms a group over the NCCL backend on `device` (an error without the `nccl` feature).
    pub fn nccl(config: GroupConfig, device: crate::Device) -> Result<Self> {
        Ok(Self::new(Arc::new(crate::NcclBackend::new(
            config, device,
        )?)))
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }
    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }
    /// See [`Collective::AllReduce`].
    pub fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work {
        self.backend.submit(Collective::AllReduce { buf, op })
    }
    /// See [`Collective::Broadcast`].
    pub fn broadcast(&self, buf: Buffer, root: usize) -> Work {
        self.backend.submit(Collective::Broadcast { buf, root })
    }
    /// See [`Collective::Reduce`].
    pub fn reduce(&self, buf: Buffer, op: ReduceOp, root: usize) -> Work {
        self.backend.submit(Collective::Reduce { buf, op, root })
    }
    /// See [`Collective::AllGather`].
    pub fn all_gather(&self, buf: Buffer) -> Work {
        self.backend
            .submit(Collective::AllGather { buf, out: None })
    }
    /// [`ProcessGroup::all_gather`] into a caller's buffer (reused across steps).
    pub fn all_gather_into(&self, buf: Buffer, out: Buffer) -> Work {
        self.backend.submit(Collective::AllGather {
            buf,
            out: Some(out),
        })
    }
    /// See [`Collective::ReduceScatter`].
    pub fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work {
        self.backend
            .submit(Collective::ReduceScatter { buf, op, out: None })
    }
    /// [`ProcessGroup::reduce_scatter`] into a caller's buffer.
    pub fn reduce_scatter_into(&self, buf: Buffer, op: ReduceOp, out: Buffer) -> Work {
        self.backend.submit(Collective::ReduceScatter {
            buf,
            op,
            out: Some(out),
        })
    }
    /// See [`Collective::Scatter`].
    pub fn scatter(&self, buf: Buffer, root: usize) -> Work {
        self.backend.submit(Collective::Scatter { buf, root })
    }
    /// See [`Collective::Gather`].
    pub fn gather(&self, buf: Buffer, root: usize) -> Work {
        self.backend.submit(Collective::Gather {
            buf,
            root,
            out: None,
        })
    }
    /// [`ProcessGroup::gather`] into a caller's buffer on the root.
    pub fn gather_into(&self, buf: Buffer, root: usize, out: Buffer) -> Work {
        self.backend.submit(Collective::Gather {
            buf,
            root,
            out: Some(out),
        })
    }
    /// See [`Collective::AllToAll`].
    pub fn all_to_all(&self, buf: Buffer) -> Work {
        self.backend.submit(Collective::AllToAll { buf, out: None })
    }
    /// [`ProcessGroup::all_to_all`] into a caller's buffer.
    pub fn all_to_all_into(&self, buf: Buffer, out: Buffer) -> Work {
        self.backend.submit(Collective::AllToAll {
            buf,
            out: Some(out),
        })
    }
    /// See [`Collective::Send`].
    pub fn send(&self, buf: Buffer, peer: usize) -> Work {
        self.backend.submit(Collective::Send { buf, peer })
    }
    /// See [`Collective::Recv`].
    pub fn recv(&self, buf: Buffer, peer: usize) -> Work {
        self.backend.submit(Collective::Recv { buf, peer })
    }
    /// See [`Collective::Barrier`].
    pub fn barrier(&self) -> Work {
        self.backend.submit(Collective::Barrier)
    }
    /// Fails everything in flight and queued, and closes the transport (bounded in time).
    pub fn abort(&self) {
        self.backend.abort()
    }
    /// The first failure, if the group is broken and must be rebuilt.
    pub fn error(&self) -> Option<Error> {
        self.backend.error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::InMemoryStore;

    fn config(secret: JobSecret) -> GroupConfig {
        let mut c = GroupConfig::new("exposure", 0, 0, 1, Arc::new(InMemoryStore::new())).unwrap();
        c.secret = secret;
        c
    }

    #[test]
    fn the_default_secret_is_refused_off_loopback() {
        let everywhere = crate::TcpOptions {
            bind_addr: "0.0.0.0".parse().unwrap(),
            ..Default::default()
        };
        let e = ProcessGroup::tcp(config(JobSecret::default_single_host()), everywhere.clone())
            .unwrap_err();
        assert!(
            matches!(&e, Error::DefaultSecretOffLoopback { addr } if addr == "0.0.0.0"),
            "{e}"
        );
        let advertised = crate::TcpOptions {
            advertise_addr: Some("192.0.2.1".parse().unwrap()),
            ..Default::default()
        };
        let e =
            ProcessGroup::tcp(config(JobSecret::default_single_host()), advertised).unwrap_err();
        assert!(matches!(e, Error::DefaultSecretOffLoopback { .. }), "{e}");
        let pg = ProcessGroup::tcp(config(JobSecret::new("real").unwrap()), everywhere).unwrap();
        assert_eq!(pg.world_size(), 1);
        let pg = ProcessGroup::tcp(
            config(JobSecret::default_single_host()),
            crate::TcpOptions::default(),
        )
        .unwrap();
        assert_eq!(pg.rank(), 0);
    }
}
