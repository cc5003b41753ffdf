//! The NCCL backend, behind the `nccl` feature.
//!
//! Without the feature the type still exists and [`NcclBackend::new`] returns
//! [`Error::NotCompiledWithNccl`](crate::Error::NotCompiledWithNccl), so code that selects a
//! backend at run time compiles everywhere.

#[cfg(feature = "nccl")]
mod imp;

#[cfg(feature = "nccl")]
pub use imp::{NcclBackend, NCCL_LIBRARY_ENV};

#[cfg(not(feature = "nccl"))]
mod disabled {
    use crate::collectives::{Backend, Collective, Work};
    use crate::device::Device;
    use crate::error::{Error, Result};
    use crate::process_group::GroupConfig;

    /// The NCCL backend; this build has no NCCL support, so it cannot be constructed.
    #[derive(Debug)]
    pub struct NcclBackend {
        never: std::convert::Infallible,
    }

    impl NcclBackend {
        /// Always [`Error::NotCompiledWithNccl`] in this build.
        pub fn new(_config: GroupConfig, _device: Device) -> Result<Self> {
            Err(Error::NotCompiledWithNccl)
        }
    }

    impl Backend for NcclBackend {
        fn name(&self) -> &'static str {
            match self.never {}
        }
        fn rank(&self) -> usize {
            match self.never {}
        }
        fn world_size(&self) -> usize {
            match self.never {}
        }
        fn submit(&self, _op: Collective) -> Work {
            match self.never {}
        }
        fn abort(&self) {
            match self.never {}
        }
        fn error(&self) -> Option<Error> {
            match self.never {}
        }
    }
}

#[cfg(not(feature = "nccl"))]
pub use disabled::NcclBackend;
