//! The NCCL backend, behind the `nccl` feature.
//!
//! Without the feature the type still exists and [`NcclBackend::new`] returns
//! [`Error::NotCompiledWithNccl`](crate::Error::NotCompiledWithNccl), so code that selects a
//! backend at run time compiles everywhere. With the `cuda` feature as well, the backend also
//! runs collectives on candle CUDA tensors in place on the device
//! (`NcclBackend::all_reduce_tensor` and its siblings).

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

    #[cfg(feature = "cuda")]
    impl NcclBackend {
        /// Never called: this build has no NCCL support, so no backend exists.
        pub fn all_reduce_tensor(&self, _: &candle_core::Tensor, _: crate::ReduceOp) -> Work {
            match self.never {}
        }
        /// Never called: this build has no NCCL support, so no backend exists.
        pub fn broadcast_tensor(&self, _: &candle_core::Tensor, _: usize) -> Work {
            match self.never {}
        }
        /// Never called: this build has no NCCL support, so no backend exists.
        pub fn all_gather_tensor(
            &self,
            _: &candle_core::Tensor,
        ) -> Result<(candle_core::Tensor, Work)> {
            match self.never {}
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
