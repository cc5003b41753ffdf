//! The manifest: `manifest.json` in a `step-<N>/` directory, written last. Its presence after
//! the rename is what makes a checkpoint exist. docs/checkpoint-format.md documents each field.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The value of the manifest's `format` field.
pub const FORMAT_NAME: &str = "rekindle-checkpoint";
/// The format version this build writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// How the state was split over ranks when it was saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Layout {
    /// Every rank held the same state; rank 0 wrote it.
    #[default]
    Replicated,
    /// `stages` pipeline stages; stage `s` was written by rank `s`.
    Pipeline {
        /// The number of stages.
        stages: usize,
    },
    /// Any other split over `shards` writers, named by the application.
    Custom {
        /// The application's name for the layout.
        name: String,
        /// The number of writers.
        shards: usize,
    },
}

/// Everything besides tensors that decides the next step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainingState {
    /// The number of optimizer steps taken.
    pub step: u64,
    /// The current epoch.
    pub epoch: u64,
    /// The global sample cursor within the epoch (samples consumed by all ranks together).
    pub sample_cursor: u64,
    /// Named random-generator states, opaque bytes (hex in the manifest).
    #[serde(with = "hex_map")]
    pub rng: BTreeMap<String, Vec<u8>>,
    /// The world size at save.
    pub world_size: usize,
    /// The parallel layout at save.
    pub layout: Layout,
    /// Application metadata, any JSON.
    pub user: BTreeMap<String, serde_json::Value>,
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Size in bytes.
    pub size: u64,
    /// XXH3-64 of the whole file, 16 hex digits.
    pub xxh3: String,
    /// The rank that wrote it.
    pub rank: usize,
}

/// Where one tensor is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The file (relative to the checkpoint directory) that holds it.
    pub file: String,
    /// Its safetensors dtype name.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte offsets `[begin, end)` relative to the file's data section, as in the file header.
    pub data_offsets: [u64; 2],
    /// XXH3-64 of the tensor's bytes, 16 hex digits, for lazy per-tensor verification.
    pub xxh3: String,
    /// The device the tensor lived on at save (`cpu`, `cuda:N`), the input of map-location.
    pub device: String,
    /// The rank that wrote it.
    pub rank: usize,
}

/// The manifest of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version, [`FORMAT_VERSION`] for this build.
    pub format_version: u32,
    /// The training state.
    #[serde(flatten)]
    pub state: TrainingState,
    /// Milliseconds since the Unix epoch when the manifest was written.
    pub created_unix_ms: u64,
    /// Every file, by name relative to the checkpoint directory.
    pub files: BTreeMap<String, FileEntry>,
    /// Every tensor, by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

impl Manifest {
    /// Parses a manifest, checking the format name and version first so that a manifest from
    /// a newer rekindle gets [`StorageError::UnsupportedFormatVersion`], not a field error.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let invalid = |reason: String| StorageError::InvalidManifest {
            path: path.to_path_buf(),
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| invalid(format!("malformed JSON: {e}")))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT_NAME) {
            return Err(invalid(format!("the format field is not {FORMAT_NAME:?}")));
        }
        let version = value
            .get("format_version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| invalid("no integer format_version".into()))?;
        if version > FORMAT_VERSION as u64 {
            return Err(StorageError::UnsupportedFormatVersion {
                path: path.to_path_buf(),
                found: version.min(u32::MAX as u64) as u32,
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest =
            serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
        for (name, t) in &manifest.tensors {
            if !manifest.files.contains_key(&t.file) {
                return Err(invalid(format!(
                    "tensor {name:?} is in {:?}, which the manifest does not list",
                    t.file
                )));
            }
        }
        for file in manifest.files.keys() {
            if file.contains('/') || file.starts_with('.') || file == MANIFEST_FILE {
                return Err(invalid(format!(
                    "file name {file:?} is not a plain file name"
                )));
            }
        }
        Ok(manifest)
    }

    /// The manifest as pretty JSON.
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

mod hex_map {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        m: &BTreeMap<String, Vec<u8>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let hex: BTreeMap<&str, String> = m
            .iter()
            .map(|(k, v)| (k.as_str(), v.iter().map(|b| format!("{b:02x}")).collect()))
            .collect();
        hex.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Vec<u8>>, D::Error> {
        let hex = BTreeMap::<String, String>::deserialize(d)?;
        hex.into_iter()
            .map(|(k, v)| {
                let bytes = (0..v.len())
                    .step_by(2)
                    .map(|i| v.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
                    .collect::<Option<Vec<u8>>>()
                    .filter(|_| v.len() % 2 == 0)
                    .ok_or_else(|| serde::de::Error::custom(format!("rng {k:?} is not hex")))?;
                Ok((k, bytes))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let mut state = TrainingState {
            step: 7,
            epoch: 1,
            sample_cursor: 4096,
            world_size: 2,
            layout: Layout::Pipeline { stages: 2 },
            ..Default::default()
        };
        state.rng.insert("data".into(), vec![0, 1, 254, 255]);
        state.user.insert("lr".into(), serde_json::json!(0.001));
        let mut files = BTreeMap::new();
        files.insert(
            "model.safetensors".into(),
            FileEntry {
                size: 100,
                xxh3: "00112233445566ff".into(),
                rank: 0,
            },
        );
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "w".into(),
            TensorEntry {
                file: "model.safetensors".into(),
                dtype: "F32".into(),
                shape: vec![2],
                data_offsets: [0, 8],
                xxh3: "0000000000000000".into(),
                device: "cuda:1".into(),
                rank: 0,
            },
        );
        Manifest {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            state,
            created_unix_ms: 1,
            files,
            tensors,
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        let json = m.to_json();
        assert_eq!(Manifest::parse(Path::new("m"), &json).unwrap(), m);
        let text = String::from_utf8(json).unwrap();
        assert!(text.contains("\"data\": \"0001feff\""), "{text}");
        assert!(text.contains("\"kind\": \"pipeline\""), "{text}");
    }

    #[test]
    fn rejects_newer_versions_and_bad_json() {
        let mut v: serde_json::Value = serde_json::from_slice(&sample().to_json()).unwrap();
        v["format_version"] = serde_json::json!(FORMAT_VERSION + 1);
        v["files"] = serde_json::json!("a field a newer version changed");
        let err = Manifest::parse(Path::new("m.json"), v.to_string().as_bytes()).unwrap_err();
        assert!(
            matches!(err, StorageError::UnsupportedFormatVersion { found, .. } if found == FORMAT_VERSION + 1),
            "{err}"
        );
        let err = Manifest::parse(Path::new("m.json"), b"{not json").unwrap_err();
        assert!(matches!(err, StorageError::InvalidManifest { .. }), "{err}");
        let mut v: serde_json::Value = serde_json::from_slice(&sample().to_json()).unwrap();
        v["tensors"]["w"]["file"] = serde_json::json!("other.safetensors");
        let err = Manifest::parse(Path::new("m.json"), v.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("does not list"), "{err}");
    }
}
