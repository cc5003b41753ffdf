//! The TCP backend (placeholder while the transport lands).
use crate::collectives::{Backend, Collective, Work};
use crate::error::{Error, Result};
use crate::process_group::GroupConfig;

/// Tuning knobs of the TCP backend.
#[derive(Debug, Clone, Default)]
pub struct TcpOptions {}

/// The TCP backend.
#[derive(Debug)]
pub struct TcpBackend {
    rank: usize,
    world: usize,
}

impl TcpBackend {
    /// Forms the group.
    pub fn new(config: GroupConfig, _options: TcpOptions) -> Result<Self> {
        Err(Error::Bootstrap { rank: config.rank, prefix: config.prefix(), reason: "not yet".into() })
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str { "tcp" }
    fn rank(&self) -> usize { self.rank }
    fn world_size(&self) -> usize { self.world }
    fn submit(&self, op: Collective) -> Work { Work::ready(op.name(), self.rank, Err(Error::Aborted { rank: self.rank })) }
    fn abort(&self) {}
    fn error(&self) -> Option<Error> { None }
}
