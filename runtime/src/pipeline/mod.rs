//! Pipeline parallelism, the pure part: how layers are split into stages ([`partition`]),
//! which ranks hold which stage when `D` replicas of an `S`-stage pipeline share a group
//! ([`Grid`]), and in which order a stage runs the forward and backward passes of its
//! micro-batches ([`Schedule`], [`actions`]), with a simulator of the schedules' idle time
//! ([`simulate`]). No I/O: the elastic loop's pipeline strategy runs these plans over process
//! groups.
//!
//! ```
//! use rekindle_runtime::pipeline::{actions, ideal_bubble, partition, simulate, Action, Schedule};
//!
//! // Six layers, the third twice as heavy, over three stages of cost 2, 3 and 2.
//! let stages = partition(&[1.0, 1.0, 2.0, 1.0, 1.0, 1.0], 3).unwrap();
//! assert_eq!(stages, vec![0..2, 2..4, 4..6]);
//!
//! // 1F1B on the first of 2 stages with 4 micro-batches: one warm-up forward, then
//! // alternating, then the last backward.
//! use Action::{Backward as B, Forward as F};
//! assert_eq!(
//!     actions(Schedule::OneFOneB, 2, 0, 4),
//!     vec![F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]
//! );
//!
//! // With uniform costs both schedules idle (S-1)/(M+S-1) of the time.
//! let t = simulate(Schedule::OneFOneB, 4, 8, 1.0, 2.0).unwrap();
//! assert!((t.bubble() - ideal_bubble(4, 8)).abs() < 1e-12);
//! ```

mod grid;
mod partition;
mod schedule;

pub use grid::{Grid, Place};
pub use partition::{partition, partition_costs};
pub use schedule::{actions, ideal_bubble, peak_in_flight, simulate, Action, Schedule, Timeline};

/// Why a pipeline plan cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// Fewer layers than stages, or no stage at all.
    #[error("cannot split {layers} layer(s) into {stages} stage(s) (need 1 <= stages <= layers)")]
    Stages {
        /// The stages asked for.
        stages: usize,
        /// The layers there are.
        layers: usize,
    },
    /// A layer's cost is negative or not a number.
    #[error("layer {layer} has cost {cost}: costs must be finite and >= 0")]
    Cost {
        /// The layer.
        layer: usize,
        /// Its cost.
        cost: f64,
    },
    /// A cost list whose length is not the number of layers.
    #[error("{given} cost(s) given for {layers} layer(s)")]
    CostCount {
        /// Costs given.
        given: usize,
        /// Layers.
        layers: usize,
    },
    /// A grid that does not fit the ranks.
    #[error("{replicas} replica(s) of {stages} stage(s) do not fit {world} rank(s)")]
    Grid {
        /// Replicas asked for.
        replicas: usize,
        /// Stages per replica.
        stages: usize,
        /// Ranks.
        world: usize,
    },
    /// No micro-batches.
    #[error("a pipeline step needs at least one micro-batch")]
    MicroBatches,
    /// A world size that cannot hold a pipeline.
    #[error("a pipeline needs at least one rank (world size {world})")]
    World {
        /// The world size.
        world: usize,
    },
    /// An unknown schedule name.
    #[error("unknown pipeline schedule {input:?}: expected gpipe or 1f1b")]
    Schedule {
        /// The text given.
        input: String,
    },
}
