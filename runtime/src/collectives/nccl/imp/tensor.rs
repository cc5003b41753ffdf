//! Collectives on candle CUDA tensors (features `nccl` and `cuda`): NCCL reads and writes the
//! tensor's own device memory, with no host copy and no staging.
//!
//! Ordering: when an op is issued, an event is recorded on the tensor's candle stream, after
//! whatever candle has queued there (the kernels that computed the tensor); the backend's
//! stream waits for that event on the device before NCCL starts, so the host never waits for
//! candle's work. The op's [`Work`](crate::Work) completes once NCCL's kernels have finished;
//! until then the tensor must not be read or written by candle (the backend keeps the tensor
//! alive until then, so dropping it early is safe).
//!
//! Only the pointer and the stream come from candle (through the `cudarc` it re-exports);
//! the backend's own NCCL and driver calls do not go through cudarc.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{self as cu, DevicePtrMut};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, DType as CandleDType, DeviceLocation, InplaceOp1, Layout, Tensor};

use super::comm::Stop;
use super::ops::{Bounds, Exec};
use super::plan::nccl_op;
use super::sys::{self, as_void, CuDevicePtr, CuEvent, DataType};
use crate::buffer::Buffer;
use crate::collectives::ReduceOp;
use crate::error::{Error, Result};

/// What a device op does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// In place on the tensor.
    AllReduce(ReduceOp),
    /// In place on the tensor, from `root`.
    Broadcast(usize),
    /// From the tensor into a new tensor of `world` times its length.
    AllGather,
}

/// A collective on device memory, ready to run on the backend's stream.
pub(crate) struct DeviceOp {
    kind: Kind,
    /// The input (and in-place output).
    src: CuDevicePtr,
    /// The output of an out-of-place op.
    dst: Option<CuDevicePtr>,
    count: usize,
    dtype: DataType,
    /// Recorded on candle's stream after the tensors' pending work.
    ready: cu::CudaEvent,
    /// The tensors whose memory the op uses, kept alive until it completed.
    _keep: Vec<Tensor>,
}

impl DeviceOp {
    /// The op's name, as in errors.
    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::AllReduce(_) => "all_reduce_tensor",
            Kind::Broadcast(_) => "broadcast_tensor",
            Kind::AllGather => "all_gather_tensor",
        }
    }

    /// The one peer the op exchanges data with from `rank`, if there is exactly one.
    pub fn single_peer(&self, rank: usize) -> Option<usize> {
        match self.kind {
            Kind::Broadcast(root) if root != rank => Some(root),
            _ => None,
        }
    }
}

/// NCCL's element type for a candle dtype, `None` for those NCCL has no type for.
pub(crate) fn nccl_dtype(d: CandleDType) -> Option<DataType> {
    Some(match d {
        CandleDType::U8 => sys::UINT8,
        CandleDType::U32 => sys::UINT32,
        CandleDType::I32 => sys::INT32,
        CandleDType::I64 => sys::INT64,
        CandleDType::F16 => sys::FLOAT16,
        CandleDType::BF16 => sys::BFLOAT16,
        CandleDType::F32 => sys::FLOAT32,
        CandleDType::F64 => sys::FLOAT64,
        _ => return None,
    })
}

/// A tensor's device memory, as found by [`Grab`].
struct Grabbed {
    ptr: CuDevicePtr,
    count: usize,
    dtype: DataType,
    ready: cu::CudaEvent,
}

/// Reads a contiguous CUDA tensor's device address under candle's storage lock (an in-place
/// op, so candle hands over the storage mutably) and records the ready event on its stream.
struct Grab {
    op: &'static str,
    found: RefCell<Option<std::result::Result<Grabbed, String>>>,
}

impl Grab {
    fn run(op: &'static str, tensor: &Tensor) -> std::result::Result<Grabbed, String> {
        let grab = Grab {
            op,
            found: RefCell::new(None),
        };
        tensor.inplace_op1(&grab).map_err(|e| e.to_string())?;
        grab.found
            .into_inner()
            .unwrap_or_else(|| Err("candle did not run the op on the tensor's storage".into()))
    }

    fn grab(storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<Grabbed, String> {
        if !layout.is_contiguous() {
            return Err("the tensor is not contiguous (call .contiguous() first)".into());
        }
        let dtype = storage.dtype();
        let nccl = nccl_dtype(dtype).ok_or_else(|| format!("NCCL has no type for {dtype:?}"))?;
        let stream = storage.device.cuda_stream();
        let width = dtype.size_in_bytes();
        macro_rules! base {
            ($($variant:ident),*) => {
                match &mut storage.slice {
                    $(CudaStorageSlice::$variant(s) => s.device_ptr_mut(&stream).0,)*
                    _ => return Err(format!("NCCL has no type for {dtype:?}")),
                }
            };
        }
        let base = base!(U8, U32, I32, I64, F16, BF16, F32, F64);
        let ready = stream
            .record_event(Some(cu::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| format!("recording an event on candle's stream: {e}"))?;
        Ok(Grabbed {
            ptr: base + (layout.start_offset() * width) as CuDevicePtr,
            count: layout.shape().elem_count(),
            dtype: nccl,
            ready,
        })
    }
}

impl InplaceOp1 for Grab {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *self.found.borrow_mut() = Some(Err("the tensor is on the CPU, not on CUDA".into()));
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        *self.found.borrow_mut() = Some(Grab::grab(storage, layout));
        Ok(())
    }
}

/// Builds the device op `kind` over `tensor`, which must be a contiguous tensor on CUDA device
/// `ordinal`; an all-gather also allocates its output (`world` times the input) and returns it.
pub(crate) fn prepare(
    kind: Kind,
    tensor: &Tensor,
    ordinal: usize,
    world: usize,
) -> Result<(DeviceOp, Option<Tensor>)> {
    let name = match kind {
        Kind::AllReduce(_) => "all_reduce_tensor",
        Kind::Broadcast(_) => "broadcast_tensor",
        Kind::AllGather => "all_gather_tensor",
    };
    let bad = |reason: String| Error::InvalidArgument { op: name, reason };
    match tensor.device().location() {
        DeviceLocation::Cuda { gpu_id } if gpu_id == ordinal => {}
        other => {
            return Err(bad(format!(
                "the tensor is on {other:?}, the group on cuda:{ordinal}"
            )))
        }
    }
    if let Kind::Broadcast(root) = kind {
        if root >= world {
            return Err(bad(format!("root {root} is not below world_size {world}")));
        }
    }
    let input = Grab::run(name, tensor).map_err(bad)?;
    let mut keep = vec![tensor.clone()];
    let (dst, out, ready) = match kind {
        Kind::AllGather => {
            let n = input.count;
            let out = Tensor::zeros(n * world, tensor.dtype(), tensor.device())
                .map_err(|e| bad(format!("allocating the {}-element output: {e}", n * world)))?;
            // Grabbed after the input, so its event also covers the input's pending work.
            let output = Grab::run(name, &out).map_err(bad)?;
            keep.push(out.clone());
            (Some(output.ptr), Some(out), output.ready)
        }
        _ => (None, None, input.ready),
    };
    let op = DeviceOp {
        kind,
        src: input.ptr,
        dst,
        count: input.count,
        dtype: input.dtype,
        ready,
        _keep: keep,
    };
    Ok((op, out))
}

impl Exec {
    /// Runs a device op: the backend's stream waits for candle's event, NCCL runs on the
    /// tensors' memory, and the op ends when the stream is idle again.
    pub(crate) fn device(
        &mut self,
        op: DeviceOp,
        b: &Bounds<'_>,
    ) -> std::result::Result<Buffer, Stop> {
        if op.count > 0 {
            self.gpu
                .wait_event(op.ready.cu_event() as CuEvent)
                .map_err(Stop::cuda)?;
            let src = as_void(op.src);
            match op.kind {
                Kind::AllReduce(reduce) => {
                    self.all_reduce(src, src, op.count, op.dtype, nccl_op(reduce))?
                }
                Kind::Broadcast(root) => self.broadcast(src, src, op.count, op.dtype, root)?,
                Kind::AllGather => {
                    let dst = op.dst.map(as_void).unwrap_or(src);
                    self.all_gather(src, dst, op.count, op.dtype)?
                }
            }
            self.finish(b)?;
        }
        Ok(Buffer::U8(Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_dtypes_map_to_nccl_types() {
        assert_eq!(nccl_dtype(CandleDType::F32), Some(sys::FLOAT32));
        assert_eq!(nccl_dtype(CandleDType::BF16), Some(sys::BFLOAT16));
        assert_eq!(nccl_dtype(CandleDType::U32), Some(sys::UINT32));
        assert_eq!(nccl_dtype(CandleDType::I16), None);
    }

    #[test]
    fn cpu_tensors_are_refused_with_a_typed_error() {
        let t = Tensor::zeros(4, CandleDType::F32, &candle_core::Device::Cpu).unwrap();
        let err = prepare(Kind::AllReduce(ReduceOp::Sum), &t, 0, 1)
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    op: "all_reduce_tensor",
                    ..
                }
            ),
            "{err}"
        );
    }
}
