//! Loading: manifest and files checked, tensors mapped from disk without copying.
//!
//! [`Checkpoint::open`] reads the manifest, memory-maps every file, checks sizes and headers
//! against the manifest, verifies checksums as [`Verify`] says, and resolves each tensor's
//! target device with the [`MapLocation`]. [`Checkpoint::tensor`] then hands out a
//! [`TensorRef`] that borrows the bytes from the mapping: nothing is read from disk until it
//! is touched, so a rank that needs a few tensors reads only those.
//!
//! Committed checkpoints are immutable; the mappings rely on that (a file changed underneath
//! a live mapping changes what the mapping shows).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rekindle_runtime::{Device, Element};

use crate::checksum::{file_checksum_of, from_hex, xxh3};
use crate::dtype::TensorDType;
use crate::error::{Result, StorageError};
use crate::keys::normalize_key;
use crate::manifest::{Manifest, TrainingState, MANIFEST_FILE};
use crate::map_location::MapLocation;
use crate::safetensors_file::{parse_header, Header};
use crate::tensor::HostTensor;

/// How much of a checkpoint is checked against its checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// Every file is hashed at open (reads everything once).
    #[default]
    Full,
    /// Each tensor is hashed when it is read (for ranks that read only some tensors).
    PerTensor,
    /// Sizes and headers only.
    Structure,
}

/// How to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where tensors go (default: the CPU).
    pub map_location: MapLocation,
    /// What is verified (default: [`Verify::Full`]).
    pub verify: Verify,
    /// Strip `module.` prefixes from names (default: on). See [`crate::keys`].
    pub normalize_keys: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            map_location: MapLocation::default(),
            verify: Verify::Full,
            normalize_keys: true,
        }
    }
}

impl LoadOptions {
    /// The options with another map-location.
    pub fn map_location(mut self, m: MapLocation) -> Self {
        self.map_location = m;
        self
    }

    /// The options with another verification level.
    pub fn verify(mut self, v: Verify) -> Self {
        self.verify = v;
        self
    }

    /// The options with key normalisation on or off.
    pub fn normalize_keys(mut self, on: bool) -> Self {
        self.normalize_keys = on;
        self
    }
}

/// A tensor borrowed from a mapped file: no bytes are copied.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    name: &'a str,
    stored_name: &'a str,
    dtype: TensorDType,
    shape: Vec<usize>,
    bytes: &'a [u8],
    device: Device,
}

impl<'a> TensorRef<'a> {
    /// The name as loaded (after key normalisation).
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The name as stored in the file.
    pub fn stored_name(&self) -> &'a str {
        self.stored_name
    }

    /// The dtype.
    pub fn dtype(&self) -> TensorDType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The device the map-location sends this tensor to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The bytes, straight from the mapping.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The elements as a typed slice of the mapping, if `T` is the dtype's element and the bytes
    /// are aligned for it (always so for files rekindle writes; other writers may misalign).
    pub fn as_slice<T: Element>(&self) -> Option<&'a [T]> {
        if TensorDType::from_runtime(T::DTYPE) != self.dtype {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }

    /// A copy in host memory.
    pub fn to_host(&self) -> Result<HostTensor> {
        HostTensor::from_bytes(self.dtype, &self.shape, self.bytes)
    }

    /// Rows `start..start + len` of the first dimension, still borrowed (a contiguous piece of
    /// the bytes): how a rank reads its slice of a replicated tensor.
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<TensorRef<'a>> {
        let rows = *self
            .shape
            .first()
            .ok_or_else(|| StorageError::TensorMismatch {
                name: self.name.to_string(),
                reason: "a scalar has no rows to narrow".into(),
            })?;
        if start.checked_add(len).is_none_or(|end| end > rows) {
            return Err(StorageError::TensorMismatch {
                name: self.name.to_string(),
                reason: format!(
                    "rows {start}..{} are outside 0..{rows}",
                    start.saturating_add(len)
                ),
            });
        }
        let row_bytes = self.bytes.len().checked_div(rows).unwrap_or(0);
        let mut shape = self.shape.clone();
        shape[0] = len;
        Ok(TensorRef {
            bytes: &self.bytes[start * row_bytes..(start + len) * row_bytes],
            shape,
            ..self.clone()
        })
    }
}

/// Anything tensors can be read from by name: a [`Checkpoint`] or a bare [`SafetensorsFile`].
pub trait TensorSource {
    /// The checkpoint directory or file, for messages.
    fn source_path(&self) -> &Path;
    /// The tensor names as loaded (after key normalisation), sorted.
    fn names(&self) -> Vec<&str>;
    /// A tensor by its loaded name; [`StorageError::TensorNotFound`] if absent.
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>>;
}

/// A memory-mapped safetensors file with its parsed header.
#[derive(Debug)]
pub(crate) struct MappedFile {
    pub(crate) path: PathBuf,
    map: Mmap,
    pub(crate) header: Header,
}

impl MappedFile {
    /// Maps `path`; when `expected` is given the size must match it first. `rank` names the
    /// writer in a [`StorageError::MissingFile`].
    pub(crate) fn open(path: &Path, expected: Option<u64>, rank: Option<usize>) -> Result<Self> {
        let file = File::open(path).map_err(|e| match (e.kind(), rank) {
            (std::io::ErrorKind::NotFound, Some(rank)) => StorageError::MissingFile {
                path: path.to_path_buf(),
                rank,
            },
            _ => StorageError::io("open", path, e),
        })?;
        let len = file
            .metadata()
            .map_err(|e| StorageError::io("stat", path, e))?
            .len();
        if let Some(expected) = expected {
            if len != expected {
                return Err(StorageError::SizeMismatch {
                    path: path.to_path_buf(),
                    expected,
                    actual: len,
                });
            }
        }
        if len < 8 {
            return Err(StorageError::InvalidHeader {
                path: path.to_path_buf(),
                reason: format!("file is {len} bytes, shorter than the 8-byte header length"),
            });
        }
        // SAFETY: committed checkpoint files are never modified in place (saves write new
        // directories; retention renames whole directories away before deleting), so the
        // mapping's contents do not change while it lives.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| StorageError::io("mmap", path, e))?;
        let header = parse_header(path, &map, len)?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    /// The whole file.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes of tensor `i` of the header.
    fn tensor_bytes(&self, i: usize) -> &[u8] {
        let t = &self.header.tensors[i];
        let start = (self.header.data_start + t.data_offsets.0) as usize;
        let end = (self.header.data_start + t.data_offsets.1) as usize;
        &self.map[start..end]
    }
}

/// Where a loaded name lives.
#[derive(Debug, Clone)]
struct Located {
    stored: String,
    file: String,
    index: usize,
    device: Device,
    checksum: Option<u64>,
}

/// Builds the loaded-name index, normalising keys and resolving devices.
fn build_index(
    path: &Path,
    files: &BTreeMap<String, MappedFile>,
    saved_device: impl Fn(&str) -> Result<Device>,
    checksum: impl Fn(&str) -> Option<u64>,
    opts: &LoadOptions,
) -> Result<BTreeMap<String, Located>> {
    let mut index = BTreeMap::new();
    for (file_name, f) in files {
        for (i, t) in f.header.tensors.iter().enumerate() {
            let name = if opts.normalize_keys {
                normalize_key(&t.name)
            } else {
                t.name.as_str()
            };
            let device = opts.map_location.resolve(name, saved_device(&t.name)?);
            let loc = Located {
                stored: t.name.clone(),
                file: file_name.clone(),
                index: i,
                device,
                checksum: checksum(&t.name),
            };
            if index.insert(name.to_string(), loc).is_some() {
                return Err(StorageError::DuplicateTensor {
                    name: name.to_string(),
                    path: path.to_path_buf(),
                });
            }
        }
    }
    check_devices(path, &index)?;
    Ok(index)
}

/// Without the `cuda` feature a CUDA target is an error at open, naming the first tensor.
fn check_devices(path: &Path, index: &BTreeMap<String, Located>) -> Result<()> {
    if cfg!(feature = "cuda") {
        return Ok(());
    }
    match index.iter().find(|(_, l)| l.device.is_cuda()) {
        Some((name, l)) => Err(StorageError::CudaNotCompiled {
            path: path.to_path_buf(),
            tensor: name.clone(),
            device: l.device,
            feature: "cuda",
        }),
        None => Ok(()),
    }
}

fn tensor_ref<'a>(
    source: &'a Path,
    files: &'a BTreeMap<String, MappedFile>,
    index: &'a BTreeMap<String, Located>,
    name: &str,
    verify_tensor: bool,
) -> Result<TensorRef<'a>> {
    let (loaded, loc) = index
        .get_key_value(name)
        .ok_or_else(|| StorageError::TensorNotFound {
            name: name.to_string(),
            path: source.to_path_buf(),
        })?;
    let file = &files[&loc.file];
    let info = &file.header.tensors[loc.index];
    let bytes = file.tensor_bytes(loc.index);
    if verify_tensor {
        if let Some(expected) = loc.checksum {
            let actual = xxh3(bytes);
            if actual != expected {
                return Err(StorageError::ChecksumMismatch {
                    path: file.path.clone(),
                    tensor: Some(loc.stored.clone()),
                    expected,
                    actual,
                });
            }
        }
    }
    Ok(TensorRef {
        name: loaded,
        stored_name: &loc.stored,
        dtype: info.dtype,
        shape: info.shape.clone(),
        bytes,
        device: loc.device,
    })
}

/// A committed checkpoint, opened and checked.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    files: BTreeMap<String, MappedFile>,
    index: BTreeMap<String, Located>,
    verify: Verify,
}

impl Checkpoint {
    /// Opens the checkpoint directory `dir` (a `step-<N>/`). Fails with a typed error naming
    /// the file when the manifest is missing, malformed or of a newer version, a file is
    /// missing or has the wrong size, a header is invalid or disagrees with the manifest, or a
    /// checksum does not match (with [`Verify::Full`]); and with
    /// [`StorageError::CudaNotCompiled`] when the map-location sends a tensor to CUDA in a
    /// build without the `cuda` feature.
    pub fn open(dir: &Path, opts: &LoadOptions) -> Result<Checkpoint> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&manifest_path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StorageError::NotACheckpoint {
                path: dir.to_path_buf(),
            },
            _ => StorageError::io("read", &manifest_path, e),
        })?;
        let manifest = Manifest::parse(&manifest_path, &bytes)?;
        let mut files = BTreeMap::new();
        for (name, entry) in &manifest.files {
            let f = MappedFile::open(&dir.join(name), Some(entry.size), Some(entry.rank))?;
            files.insert(name.clone(), f);
        }
        check_against_manifest(&manifest_path, &manifest, &files)?;
        if opts.verify == Verify::Full {
            verify_files(&manifest, &files)?;
        }
        let saved = |name: &str| -> Result<Device> {
            let text = &manifest.tensors[name].device;
            text.parse().map_err(|_| StorageError::InvalidManifest {
                path: manifest_path.clone(),
                reason: format!("tensor {name:?} has invalid device {text:?}"),
            })
        };
        let checksum = |name: &str| from_hex(&manifest.tensors[name].xxh3);
        let index = build_index(dir, &files, saved, checksum, opts)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            manifest,
            files,
            index,
            verify: opts.verify,
        })
    }

    /// The checkpoint directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The training state.
    pub fn state(&self) -> &TrainingState {
        &self.manifest.state
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.manifest.state.step
    }

    /// Hashes every file again and compares with the manifest.
    pub fn verify_all(&self) -> Result<()> {
        verify_files(&self.manifest, &self.files)
    }

    /// The names (as loaded) of the tensors written by `rank`.
    pub fn names_of_rank(&self, rank: usize) -> Vec<&str> {
        self.index
            .iter()
            .filter(|(_, l)| self.manifest.tensors[&l.stored].rank == rank)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// The total size of the checkpoint's files in bytes.
    pub fn data_bytes(&self) -> u64 {
        self.manifest.files.values().map(|f| f.size).sum()
    }

    /// The tensor names as loaded (after key normalisation), sorted.
    pub fn names(&self) -> Vec<&str> {
        self.index.keys().map(String::as_str).collect()
    }

    /// Borrows a tensor from the mapping; with [`Verify::PerTensor`] its checksum is checked
    /// on every call. [`StorageError::TensorNotFound`] if absent.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        tensor_ref(
            &self.dir,
            &self.files,
            &self.index,
            name,
            self.verify == Verify::PerTensor,
        )
    }
}

impl TensorSource for Checkpoint {
    fn source_path(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<&str> {
        Checkpoint::names(self)
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        Checkpoint::tensor(self, name)
    }
}

/// Checks that every header lists exactly the manifest's tensors with the same dtype, shape
/// and offsets.
fn check_against_manifest(
    manifest_path: &Path,
    manifest: &Manifest,
    files: &BTreeMap<String, MappedFile>,
) -> Result<()> {
    let mut per_file: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, t) in &manifest.tensors {
        *per_file.entry(t.file.as_str()).or_default() += 1;
        let f = &files[&t.file];
        let found = f.header.tensors.iter().find(|h| &h.name == name);
        let ok = found.is_some_and(|h| {
            h.dtype.safetensors_name() == t.dtype
                && h.shape == t.shape
                && [h.data_offsets.0, h.data_offsets.1] == t.data_offsets
        });
        if !ok {
            return Err(StorageError::InvalidManifest {
                path: manifest_path.to_path_buf(),
                reason: format!(
                    "tensor {name:?} does not match the header of {}",
                    f.path.display()
                ),
            });
        }
    }
    for (name, f) in files {
        let listed = per_file.get(name.as_str()).copied().unwrap_or(0);
        if listed != f.header.tensors.len() {
            return Err(StorageError::InvalidManifest {
                path: manifest_path.to_path_buf(),
                reason: format!(
                    "{} holds {} tensors, the manifest lists {listed}",
                    f.path.display(),
                    f.header.tensors.len()
                ),
            });
        }
    }
    Ok(())
}

/// Hashes every file (in parallel over the available cores) and compares with the manifest.
fn verify_files(manifest: &Manifest, files: &BTreeMap<String, MappedFile>) -> Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, f) in files {
        let want = &manifest.files[name].xxh3;
        let expected = from_hex(want).ok_or_else(|| StorageError::InvalidManifest {
            path: f.path.clone(),
            reason: format!("checksum {want:?} is not 16 hex digits"),
        })?;
        let offsets: Vec<(u64, u64)> = f.header.tensors.iter().map(|t| t.data_offsets).collect();
        let actual = file_checksum_of(f.bytes(), f.header.data_start as usize, &offsets, threads);
        if actual != expected {
            return Err(StorageError::ChecksumMismatch {
                path: f.path.clone(),
                tensor: None,
                expected,
                actual,
            });
        }
    }
    Ok(())
}

/// A bare `.safetensors` file (from rekindle, Python `safetensors`, Hugging Face, PyTorch
/// exports), mapped and checked. There is no manifest, so there is nothing to verify beyond
/// the header, and every tensor counts as saved on the CPU for map-location.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    files: BTreeMap<String, MappedFile>,
    index: BTreeMap<String, Located>,
}

impl SafetensorsFile {
    /// Maps and checks `path`.
    pub fn open(path: &Path, opts: &LoadOptions) -> Result<SafetensorsFile> {
        let f = MappedFile::open(path, None, None)?;
        let mut files = BTreeMap::new();
        files.insert(String::new(), f);
        let index = build_index(path, &files, |_| Ok(Device::Cpu), |_| None, opts)?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            files,
            index,
        })
    }

    /// The `__metadata__` map of the header.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.files[""].header.metadata
    }

    /// The tensor names as loaded (after key normalisation), sorted.
    pub fn names(&self) -> Vec<&str> {
        self.index.keys().map(String::as_str).collect()
    }

    /// Borrows a tensor from the mapping; [`StorageError::TensorNotFound`] if absent.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        tensor_ref(&self.path, &self.files, &self.index, name, false)
    }
}

impl TensorSource for SafetensorsFile {
    fn source_path(&self) -> &Path {
        &self.path
    }

    fn names(&self) -> Vec<&str> {
        SafetensorsFile::names(self)
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        SafetensorsFile::tensor(self, name)
    }
}
