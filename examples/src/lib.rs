//! Shared helpers of the example programs.
pub mod mlp;
pub mod pipeline_mlp;
