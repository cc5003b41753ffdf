//! Which rank holds which stage: `D` data-parallel replicas of an `S`-stage pipeline.

use super::PipelineError;

/// Where a rank sits in a [`Grid`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Stage `stage` of replica `replica`.
    Stage {
        /// The data-parallel replica (which share of each global batch it computes).
        replica: usize,
        /// The pipeline stage.
        stage: usize,
    },
    /// A rank the grid has no room for: it holds no layers and takes no data.
    Idle,
}

/// `replicas` copies of a pipeline of `stages` stages over the ranks of a group: rank
/// `replica * stages + stage` holds `stage` of `replica`; ranks past `replicas * stages` are
/// idle. The ranks holding one stage across the replicas all-reduce its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    replicas: usize,
    stages: usize,
    world: usize,
}

impl Grid {
    /// A grid of `replicas x stages` over `world` ranks.
    pub fn new(replicas: usize, stages: usize, world: usize) -> Result<Grid, PipelineError> {
        if world == 0 {
            return Err(PipelineError::World { world });
        }
        if replicas == 0 || stages == 0 || replicas * stages > world {
            return Err(PipelineError::Grid {
                replicas,
                stages,
                world,
            });
        }
        Ok(Grid {
            replicas,
            stages,
            world,
        })
    }

    /// The grid a group of `world` ranks forms for a pipeline of `stages` stages over
    /// `layers` layers: as many replicas as whole pipelines fit (at least one), each as long
    /// as the ranks allow (`world / replicas` stages, at most one per layer). So a pipeline
    /// that loses a rank goes on with one stage fewer, and a replacement brings the stage
    /// back; `2 x 2` that loses a rank becomes `1 x 3`.
    pub fn for_world(world: usize, stages: usize, layers: usize) -> Result<Grid, PipelineError> {
        if world == 0 {
            return Err(PipelineError::World { world });
        }
        if stages == 0 || layers == 0 {
            return Err(PipelineError::Stages { stages, layers });
        }
        let replicas = (world / stages).max(1);
        let stages = (world / replicas).min(layers);
        Grid::new(replicas, stages, world)
    }

    /// The number of replicas.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The number of stages of each replica.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Where `rank` sits.
    pub fn place(&self, rank: usize) -> Place {
        if rank >= self.replicas * self.stages {
            return Place::Idle;
        }
        Place::Stage {
            replica: rank / self.stages,
            stage: rank % self.stages,
        }
    }

    /// The rank holding `stage` of `replica`.
    pub fn rank(&self, replica: usize, stage: usize) -> usize {
        replica * self.stages + stage
    }

    /// The ranks holding `stage`, one per replica, ascending.
    pub fn stage_ranks(&self, stage: usize) -> Vec<usize> {
        (0..self.replicas).map(|d| self.rank(d, stage)).collect()
    }

    /// The stage whose in-memory copy `stage` keeps: the previous one, cyclically (stage 0
    /// keeps the last), so every stage's copy is on a neighbour; `None` with one stage.
    pub fn copy_of(&self, stage: usize) -> Option<usize> {
        (self.stages > 1).then(|| (stage + self.stages - 1) % self.stages)
    }

    /// The stage that keeps `stage`'s copy (the next one, cyclically); `None` with one stage.
    pub fn copy_holder(&self, stage: usize) -> Option<usize> {
        (self.stages > 1).then(|| (stage + 1) % self.stages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_for_world_sizes() {
        // (world, stages asked, layers) -> (replicas, stages)
        let cases = [
            ((1, 1, 4), (1, 1)),
            ((3, 3, 6), (1, 3)),
            ((2, 3, 6), (1, 2)), // a stage lost: re-partitioned over two
            ((1, 3, 6), (1, 1)),
            ((4, 2, 6), (2, 2)),
            ((3, 2, 6), (1, 3)), // 2 x 2 that lost a rank
            ((5, 2, 6), (2, 2)), // one idle rank
            ((6, 2, 6), (3, 2)),
            ((4, 4, 2), (1, 2)), // at most one stage per layer, two idle ranks
        ];
        for ((world, stages, layers), (d, s)) in cases {
            let g = Grid::for_world(world, stages, layers).unwrap();
            assert_eq!(
                (g.replicas(), g.stages()),
                (d, s),
                "{world} {stages} {layers}"
            );
        }
        assert!(Grid::for_world(0, 2, 2).is_err());
        assert!(Grid::for_world(2, 0, 2).is_err());
        assert!(Grid::new(2, 2, 3).is_err());
    }

    #[test]
    fn places_and_neighbours() {
        let g = Grid::for_world(5, 2, 6).unwrap();
        let places: Vec<Place> = (0..5).map(|r| g.place(r)).collect();
        assert_eq!(
            places,
            vec![
                Place::Stage {
                    replica: 0,
                    stage: 0
                },
                Place::Stage {
                    replica: 0,
                    stage: 1
                },
                Place::Stage {
                    replica: 1,
                    stage: 0
                },
                Place::Stage {
                    replica: 1,
                    stage: 1
                },
                Place::Idle,
            ]
        );
        assert_eq!(g.stage_ranks(1), vec![1, 3]);
        assert_eq!(g.rank(1, 0), 2);
        let three = Grid::new(1, 3, 3).unwrap();
        assert_eq!(
            (0..3).map(|s| three.copy_of(s)).collect::<Vec<_>>(),
            vec![Some(2), Some(0), Some(1)]
        );
        assert_eq!(
            (0..3).map(|s| three.copy_holder(s)).collect::<Vec<_>>(),
            vec![Some(1), Some(2), Some(0)]
        );
        assert_eq!(Grid::new(1, 1, 1).unwrap().copy_of(0), None);
    }
}
