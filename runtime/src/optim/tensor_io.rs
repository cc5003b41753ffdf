//! Moving f32 data between candle tensors and flat buffers without extra copies on the CPU.

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor, Var};

/// Calls `f` with the tensor's elements as a contiguous f32 slice: borrowed straight from the
/// storage for a contiguous f32 CPU tensor, copied (converted, moved to the host) otherwise.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&data[start..end]));
        }
    }
    let v = t
        .to_dtype(DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(f(&v))
}

/// An in-place op that hands the storage to a closure once.
struct InPlace<F> {
    f: RefCell<Option<F>>,
}

impl<F: FnOnce(&mut [f32]) -> candle_core::Result<()>> candle_core::InplaceOp1 for InPlace<F> {
    fn name(&self) -> &'static str {
        "rekindle-in-place-f32"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            return Err(candle_core::Error::Msg(
                "in-place update needs a contiguous f32 tensor".into(),
            ));
        };
        match self.f.borrow_mut().take() {
            Some(f) => f(&mut data[start..end]),
            None => Err(candle_core::Error::Msg("in-place op ran twice".into())),
        }
    }
}

/// Calls `f` with the variable's elements as a mutable f32 slice and writes the result back:
/// in place for a contiguous f32 CPU variable, through a host copy and [`Var::set`]
/// otherwise (for example on CUDA).
pub fn update_f32(
    var: &Var,
    f: impl FnOnce(&mut [f32]) -> candle_core::Result<()>,
) -> candle_core::Result<()> {
    let t = var.as_tensor();
    let direct = t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous();
    if direct {
        return t.inplace_op1(&InPlace {
            f: RefCell::new(Some(f)),
        });
    }
    let mut v = t
        .to_dtype(DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    f(&mut v)?;
    let new = Tensor::from_vec(v, t.shape(), &candle_core::Device::Cpu)?
        .to_dtype(t.dtype())?
        .to_device(t.device())?;
    var.set(&new)
}

/// A 64-bit FNV-1a hash of the bits of `data` (word-wise), for the parameter agreement check.
pub(crate) fn hash_f32(mut h: u64, data: &[f32]) -> u64 {
    for x in data {
        h ^= u64::from(x.to_bits());
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The FNV-1a offset basis.
pub(crate) const HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn reads_and_updates_in_place() {
        let var =
            Var::from_tensor(&Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap())
                .unwrap();
        let before = var.as_tensor().clone();
        update_f32(&var, |x| {
            x.iter_mut().for_each(|v| *v *= 10.0);
            Ok(())
        })
        .unwrap();
        let got = with_f32(var.as_tensor(), |x| x.to_vec()).unwrap();
        assert_eq!(got, [10.0, 20.0, 30.0, 40.0]);
        // The variable's storage was written, which every clone of its tensor shares.
        assert_eq!(with_f32(&before, |x| x[0]).unwrap(), 10.0);
        // A non-contiguous view and another dtype go through a copy.
        let tr = var.as_tensor().t().unwrap();
        assert_eq!(
            with_f32(&tr, |x| x.to_vec()).unwrap(),
            [10.0, 30.0, 20.0, 40.0]
        );
        let f64var = Var::from_tensor(&Tensor::new(&[1.0f64, 2.0], &Device::Cpu).unwrap()).unwrap();
        update_f32(&f64var, |x| {
            x[1] = 5.0;
            Ok(())
        })
        .unwrap();
        assert_eq!(f64var.as_tensor().to_vec1::<f64>().unwrap(), [1.0, 5.0]);
    }

    #[test]
    fn hash_sees_every_bit() {
        let a = hash_f32(HASH_START, &[1.0, 2.0]);
        assert_ne!(a, hash_f32(HASH_START, &[2.0, 1.0]));
        assert_ne!(
            a,
            hash_f32(HASH_START, &[1.0, f32::from_bits(2.0f32.to_bits() ^ 1)])
        );
        assert_eq!(a, hash_f32(hash_f32(HASH_START, &[1.0]), &[2.0]));
    }
}
