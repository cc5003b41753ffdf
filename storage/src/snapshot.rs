//! A snapshot: the training state and named host tensors, grouped into files.

use std::collections::HashSet;
use std::path::PathBuf;

use rekindle_runtime::Device;

use crate::error::{Result, StorageError};
use crate::manifest::TrainingState;
use crate::tensor::HostTensor;

/// The file group used when none is given.
pub const DEFAULT_GROUP: &str = "model";

/// One tensor of a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotEntry {
    /// The tensor's name, unique in the checkpoint.
    pub name: String,
    /// The file group (`model`, `optimizer`, ...): tensors of one group and rank share a file.
    pub group: String,
    /// The device the tensor lived on, recorded for map-location.
    pub device: Device,
    /// The bytes.
    pub tensor: HostTensor,
}

/// What one rank saves: the training state and its tensors. A snapshot owns its bytes, so the
/// live state may change as soon as it is built.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The training state recorded in the manifest.
    pub state: TrainingState,
    entries: Vec<SnapshotEntry>,
    names: HashSet<String>,
}

/// Checks that a group name makes a plain file name.
fn check_group(group: &str) -> Result<()> {
    let ok = !group.is_empty()
        && !group.starts_with('.')
        && group
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StorageError::InvalidArgument {
            reason: format!("group name {group:?} must be non-empty ASCII letters, digits, _ - . and not start with ."),
        })
    }
}

impl Snapshot {
    /// An empty snapshot of `state`.
    pub fn new(state: TrainingState) -> Snapshot {
        Snapshot {
            state,
            ..Default::default()
        }
    }

    /// Adds a host tensor to the default group (`model`).
    pub fn insert(&mut self, name: &str, tensor: HostTensor) -> Result<()> {
        self.insert_in(DEFAULT_GROUP, name, Device::Cpu, tensor)
    }

    /// Adds a tensor to `group`, recording the device it came from. Fails on a duplicate name
    /// or a group name that is not a plain file name.
    pub fn insert_in(
        &mut self,
        group: &str,
        name: &str,
        device: Device,
        tensor: HostTensor,
    ) -> Result<()> {
        check_group(group)?;
        if name.is_empty() || name == "__metadata__" {
            return Err(StorageError::InvalidArgument {
                reason: format!("tensor name {name:?} is reserved"),
            });
        }
        if !self.names.insert(name.to_string()) {
            return Err(StorageError::DuplicateTensor {
                name: name.to_string(),
                path: PathBuf::from("<snapshot>"),
            });
        }
        self.entries.push(SnapshotEntry {
            name: name.to_string(),
            group: group.to_string(),
            device,
            tensor,
        });
        Ok(())
    }

    /// The tensors, in insertion order.
    pub fn entries(&self) -> &[SnapshotEntry] {
        &self.entries
    }

    /// The tensors, mutable (dtype and shape stay as they are).
    pub(crate) fn entries_mut(&mut self) -> &mut [SnapshotEntry] {
        &mut self.entries
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The total size of the tensors in bytes.
    pub fn size_in_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| e.tensor.size_in_bytes() as u64)
            .sum()
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&SnapshotEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// A tensor by name, to update a long-lived snapshot in place between saves (its dtype
    /// and shape cannot change).
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut HostTensor> {
        self.entries
            .iter_mut()
            .find(|e| e.name == name)
            .map(|e| &mut e.tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::TensorDType;

    #[test]
    fn rejects_duplicates_and_bad_groups() {
        let mut s = Snapshot::default();
        let t = HostTensor::zeros(TensorDType::F32, &[2]);
        s.insert("a", t.clone()).unwrap();
        assert!(matches!(
            s.insert("a", t.clone()),
            Err(StorageError::DuplicateTensor { .. })
        ));
        for g in ["", ".hidden", "a/b", "x y"] {
            assert!(s.insert_in(g, "b", Device::Cpu, t.clone()).is_err(), "{g}");
        }
        s.insert_in("optimizer", "m.a", Device::Cuda(1), t).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s.size_in_bytes(), 16);
        assert_eq!(s.get("m.a").unwrap().device, Device::Cuda(1));
    }
}
