//! [`Shard`]: one server's part of the parameters and of the optimizer state, as the server
//! itself or the server keeping its copy holds it.

use candle_core::Tensor;
use rekindle_runtime::optim::{OptimError, Optimizer, STEP_NAME};

use super::plan::Holding;
use super::shard_map::ShardMap;
use super::tickets::Applied;
use crate::train::strategy::StepError;

/// The name of a shard's flat parameter values when its state travels as named tensors.
pub const VALUES: &str = "ps.values";

/// Builds an optimizer over the given parameters (a shard's pieces).
pub type OptimizerFactory = Box<
    dyn Fn(Vec<rekindle_runtime::optim::ParamSpec>) -> Result<Box<dyn Optimizer>, OptimError>
        + Send,
>;

/// Values and optimizer state before the last update (synchronous mode).
struct Saved {
    values: Vec<f32>,
    optimizer: Vec<(String, Tensor)>,
}

/// One shard's state: the pieces' values end to end, the optimizer over them, and which
/// updates they contain.
pub struct Shard {
    /// The shard (server index).
    pub index: usize,
    /// True for the copy a server keeps of its predecessor's shard.
    pub copy: bool,
    /// The pieces' elements, in the map's order.
    pub values: Vec<f32>,
    optimizer: Box<dyn Optimizer>,
    /// Each piece's start in `values`.
    offsets: Vec<usize>,
    /// Synchronous: the step of `values`; asynchronous: unused (see `applied`).
    pub at: u64,
    undo: Option<Saved>,
    /// Asynchronous: the tickets applied.
    pub applied: Applied,
    /// Updates applied (the version workers compute from).
    pub version: u64,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("index", &self.index)
            .field("copy", &self.copy)
            .field("len", &self.values.len())
            .field("at", &self.at)
            .field("undo", &self.undo.is_some())
            .field("applied", &self.applied)
            .field("version", &self.version)
            .finish()
    }
}

fn optim_err(what: &'static str, e: OptimError) -> StepError {
    StepError::state(what, e)
}

impl Shard {
    /// Shard `index` of `map` with `values` and a fresh optimizer from `factory`.
    pub fn new(
        map: &ShardMap,
        index: usize,
        copy: bool,
        values: Vec<f32>,
        factory: &OptimizerFactory,
    ) -> Result<Shard, StepError> {
        let len = map.shard_len(index);
        if values.len() != len {
            return Err(StepError::state(
                "building a shard",
                format!(
                    "shard {index} has {len} elements, got {} values",
                    values.len()
                ),
            ));
        }
        let optimizer = factory(map.piece_specs(index))
            .map_err(|e| optim_err("building a shard's optimizer", e))?;
        let mut offsets = Vec::new();
        let mut at = 0;
        for p in map.pieces(index) {
            offsets.push(at);
            at += p.range.len();
        }
        Ok(Shard {
            index,
            copy,
            values,
            optimizer,
            offsets,
            at: 0,
            undo: None,
            applied: Applied::default(),
            version: 0,
        })
    }

    /// The shard from named tensors ([`Shard::export`]'s, or a checkpoint's pieces); a fresh
    /// optimizer when they have no step count.
    pub fn from_state(
        map: &ShardMap,
        index: usize,
        copy: bool,
        state: &[(String, Tensor)],
        factory: &OptimizerFactory,
    ) -> Result<Shard, StepError> {
        let values = state
            .iter()
            .find(|(n, _)| n == VALUES)
            .ok_or_else(|| StepError::state("importing a shard", "no values"))?
            .1
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| StepError::state("importing a shard", e))?;
        let mut shard = Shard::new(map, index, copy, values, factory)?;
        // Without a step count the optimizer is fresh (a new job's initial values).
        if state.iter().any(|(n, _)| n == STEP_NAME) {
            shard
                .optimizer
                .load_state(state)
                .map_err(|e| optim_err("importing a shard's optimizer state", e))?;
        }
        shard.version = shard.optimizer.step_count();
        Ok(shard)
    }

    /// The values and the optimizer state as named tensors ([`VALUES`] and the optimizer's
    /// names); those before the last update when `undo`.
    pub fn export(&self, undo: bool) -> Result<Vec<(String, Tensor)>, StepError> {
        let (values, mut state) = match (&self.undo, undo) {
            (Some(saved), true) => (&saved.values, saved.optimizer.clone()),
            (None, true) => {
                return Err(StepError::state(
                    "exporting a shard",
                    "no values before the last update are kept",
                ))
            }
            (_, false) => (
                &self.values,
                self.optimizer
                    .state()
                    .map_err(|e| optim_err("exporting a shard's optimizer state", e))?,
            ),
        };
        let t = Tensor::from_slice(values, values.len(), &candle_core::Device::Cpu)
            .map_err(|e| StepError::state("exporting a shard", e))?;
        state.push((VALUES.to_string(), t));
        Ok(state)
    }

    /// The optimizer's state (its names are the pieces').
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>, StepError> {
        self.optimizer
            .state()
            .map_err(|e| optim_err("exporting a shard's optimizer state", e))
    }

    /// The optimizer's step count.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Keeps the current values and optimizer state, so that the next update can be taken
    /// back (synchronous mode).
    pub fn save_undo(&mut self) -> Result<(), StepError> {
        let optimizer = self
            .optimizer
            .state()
            .map_err(|e| optim_err("saving a shard's state", e))?;
        let values = match self.undo.take() {
            Some(mut old) if old.values.len() == self.values.len() => {
                old.values.copy_from_slice(&self.values);
                old.values
            }
            _ => self.values.clone(),
        };
        self.undo = Some(Saved { values, optimizer });
        Ok(())
    }

    /// One optimizer step with gradients `grad` (the shard's length) times `scale`.
    pub fn apply(&mut self, grad: &[f32], scale: f32) -> Result<(), StepError> {
        if grad.len() != self.values.len() {
            return Err(StepError::state(
                "applying an update",
                format!(
                    "shard {} has {} elements, the update {}",
                    self.index,
                    self.values.len(),
                    grad.len()
                ),
            ));
        }
        self.optimizer.begin_step();
        let n = self.offsets.len();
        for i in 0..n {
            let start = self.offsets[i];
            let end = self
                .offsets
                .get(i + 1)
                .copied()
                .unwrap_or(self.values.len());
            self.optimizer
                .update_scaled(i, &mut self.values[start..end], &grad[start..end], scale)
                .map_err(|e| optim_err("applying an update", e))?;
        }
        self.version += 1;
        Ok(())
    }

    /// What this shard is, as published with the generation record.
    pub fn holding(&self, asynchronous: bool) -> Holding {
        if asynchronous {
            Holding {
                shard: self.index,
                copy: self.copy,
                at: self.applied.prefix(),
                undo: false,
                version: self.version,
                beyond: self.applied.beyond(),
            }
        } else {
            Holding {
                shard: self.index,
                copy: self.copy,
                at: self.at,
                undo: self.undo.is_some(),
                version: self.version,
                beyond: Vec::new(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rekindle_runtime::optim::{ParamSpec, Sgd, SgdConfig};

    fn factory() -> OptimizerFactory {
        Box::new(|specs| {
            Ok(Box::new(Sgd::new(
                SgdConfig::new(0.5).momentum(0.5),
                specs,
            )?))
        })
    }

    #[test]
    fn applies_undoes_and_travels() {
        let specs = vec![ParamSpec::new("a", &[2]), ParamSpec::new("b", &[3])];
        let map = ShardMap::new(&specs, 2, 0).unwrap();
        // Shard 0: a and b[0..1]; shard 1: b[1..3].
        let f = factory();
        let mut s = Shard::new(&map, 0, false, vec![1.0, 2.0, 3.0], &f).unwrap();
        s.apply(&[2.0, 2.0, 2.0], 0.5).unwrap();
        // First step: buf = g = 1; p -= 0.5 * 1.
        assert_eq!(s.values, vec![0.5, 1.5, 2.5]);
        s.save_undo().unwrap();
        s.apply(&[2.0, 2.0, 2.0], 0.5).unwrap();
        // buf = 0.5 * 1 + 1 = 1.5; p -= 0.75.
        assert_eq!(s.values, vec![-0.25, 0.75, 1.75]);
        assert_eq!(s.version, 2);
        let before = Shard::from_state(&map, 0, true, &s.export(true).unwrap(), &f).unwrap();
        assert_eq!(before.values, vec![0.5, 1.5, 2.5]);
        assert_eq!(before.version, 1);
        let now = Shard::from_state(&map, 0, false, &s.export(false).unwrap(), &f).unwrap();
        assert_eq!(now.values, s.values);
        assert_eq!(now.version, 2);
        assert!(s.apply(&[1.0], 1.0).is_err(), "wrong length");
        assert!(Shard::new(&map, 1, false, vec![0.0; 3], &f).is_err());
        let n = Shard::new(&map, 1, false, vec![0.0; 2], &f).unwrap();
        assert!(n.export(true).is_err(), "nothing to undo");
    }
}
