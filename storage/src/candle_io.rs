//! Candle tensors in and out: snapshots of a `VarMap` (and any named candle tensors such as
//! optimizer moments), and restoring a `VarMap` from a checkpoint or a bare file.
//!
//! Candle's CPU tensors own their memory, so building one from a mapped tensor copies it once;
//! the [`TensorRef`] itself is the zero-copy view.

use candle_core::{Tensor, WithDType};
use candle_nn::VarMap;
use rekindle_runtime::{Buffer, Device};

use crate::dtype::TensorDType;
use crate::error::{Result, StorageError};
use crate::load::{TensorRef, TensorSource};
use crate::snapshot::Snapshot;
use crate::tensor::HostTensor;

fn candle_err(name: &str) -> impl FnOnce(candle_core::Error) -> StorageError + '_ {
    move |source| StorageError::Candle {
        name: name.to_string(),
        source,
    }
}

/// The candle device for a rekindle device. CUDA needs the `cuda` feature; without it this
/// is [`StorageError::CudaNotCompiled`].
pub fn candle_device(device: Device, tensor: &str) -> Result<candle_core::Device> {
    match device {
        Device::Cpu => Ok(candle_core::Device::Cpu),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => candle_core::Device::new_cuda(n).map_err(candle_err(tensor)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(StorageError::CudaNotCompiled {
            path: std::path::PathBuf::from("<candle>"),
            tensor: tensor.to_string(),
            device,
            feature: "cuda",
        }),
    }
}

/// The rekindle device of a candle device.
pub fn rekindle_device(device: &candle_core::Device) -> Device {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => Device::Cuda(gpu_id),
        _ => Device::Cpu,
    }
}

fn to_buffer<T: WithDType>(t: &Tensor, name: &str) -> Result<Vec<T>> {
    t.flatten_all()
        .and_then(|f| f.to_vec1::<T>())
        .map_err(candle_err(name))
}

/// Copies a candle tensor (any device, any layout) into host memory, once.
pub fn tensor_to_host(name: &str, t: &Tensor) -> Result<HostTensor> {
    let dtype = TensorDType::from_candle(t.dtype(), name)?;
    let buffer = match dtype {
        TensorDType::F32 => Buffer::F32(to_buffer(t, name)?),
        TensorDType::F64 => Buffer::F64(to_buffer(t, name)?),
        TensorDType::F16 => Buffer::F16(to_buffer(t, name)?),
        TensorDType::BF16 => Buffer::BF16(to_buffer(t, name)?),
        TensorDType::I32 => Buffer::I32(to_buffer(t, name)?),
        TensorDType::I64 => Buffer::I64(to_buffer(t, name)?),
        TensorDType::U8 | TensorDType::Bool => Buffer::U8(to_buffer(t, name)?),
    };
    HostTensor::from_buffer(buffer, t.dims()).map_err(|e| match e {
        StorageError::TensorMismatch { reason, .. } => StorageError::TensorMismatch {
            name: name.to_string(),
            reason,
        },
        e => e,
    })
}

impl Snapshot {
    /// Adds a candle tensor to `group`, copying it to host memory and recording its device.
    pub fn insert_candle(&mut self, group: &str, name: &str, t: &Tensor) -> Result<()> {
        let host = tensor_to_host(name, t)?;
        self.insert_in(group, name, rekindle_device(t.device()), host)
    }

    /// Adds every variable of `varmap` to `group`, in name order (a `VarMap`'s own order
    /// differs between processes).
    pub fn insert_varmap(&mut self, group: &str, varmap: &VarMap) -> Result<()> {
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| StorageError::InvalidArgument {
                reason: "the VarMap's lock is poisoned".into(),
            })?;
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        for name in names {
            self.insert_candle(group, name, vars[name].as_tensor())?;
        }
        Ok(())
    }
}

impl TensorRef<'_> {
    /// A candle tensor on the device the map-location chose (or on `device`, when given),
    /// built from a copy of the mapped bytes. A `bool` tensor becomes `u8`.
    pub fn to_candle(&self) -> Result<Tensor> {
        self.to_candle_on(self.device())
    }

    /// A candle tensor on `device`.
    pub fn to_candle_on(&self, device: Device) -> Result<Tensor> {
        let dev = candle_device(device, self.name())?;
        Tensor::from_raw_buffer(self.bytes(), self.dtype().to_candle(), self.shape(), &dev)
            .map_err(candle_err(self.name()))
    }
}

/// What [`load_varmap`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VarMapLoad {
    /// Variables set from the source.
    pub loaded: Vec<String>,
    /// Tensors of the source no variable asked for (optimizer state, other stages' tensors).
    pub unused: Vec<String>,
}

/// Sets every variable of `varmap` from the tensor of the same name in `source` (names as
/// loaded, i.e. after key normalisation). Each variable keeps its device: the map-location
/// decides where the source's tensors go when they are materialised on their own, and a
/// variable already lives somewhere. Fails on a missing tensor or a dtype or shape mismatch,
/// naming it.
pub fn load_varmap(source: &dyn TensorSource, varmap: &VarMap) -> Result<VarMapLoad> {
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| StorageError::InvalidArgument {
            reason: "the VarMap's lock is poisoned".into(),
        })?;
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut report = VarMapLoad::default();
    for name in names {
        let var = &vars[name];
        let t = source.tensor(name)?;
        if t.dtype().to_candle() != var.dtype() || t.shape() != var.dims() {
            return Err(StorageError::TensorMismatch {
                name: name.clone(),
                reason: format!(
                    "stored {} {:?} in {}, the model has {:?} {:?}",
                    t.dtype(),
                    t.shape(),
                    source.source_path().display(),
                    var.dtype(),
                    var.dims()
                ),
            });
        }
        let value = t.to_candle_on(rekindle_device(var.device()))?;
        var.set(&value).map_err(candle_err(name))?;
        report.loaded.push(name.clone());
    }
    report.unused = source
        .names()
        .into_iter()
        .filter(|n| !vars.contains_key(*n))
        .map(str::to_string)
        .collect();
    Ok(report)
}
