//! Shared helpers of the example programs.
pub mod mlp;
