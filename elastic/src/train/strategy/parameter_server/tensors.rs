//! Moving `f32` elements between candle variables and flat buffers: in place for contiguous
//! CPU variables, through a host copy otherwise.

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor, Var};

/// Calls `f` with the tensor's elements as one contiguous `f32` slice (borrowed for a
/// contiguous f32 CPU tensor, copied otherwise).
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

struct InPlace<F> {
    f: RefCell<Option<F>>,
}

impl<F: FnOnce(&mut [f32])> candle_core::InplaceOp1 for InPlace<F> {
    fn name(&self) -> &'static str {
        "rekindle-ps-write"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            return Err(candle_core::Error::Msg(
                "in-place write needs a contiguous f32 tensor".into(),
            ));
        };
        match self.f.borrow_mut().take() {
            Some(f) => {
                f(&mut data[start..end]);
                Ok(())
            }
            None => Err(candle_core::Error::Msg("in-place write ran twice".into())),
        }
    }
}

/// Calls `f` with the variable's elements as a mutable `f32` slice and keeps what it wrote.
pub fn update_f32(var: &Var, f: impl FnOnce(&mut [f32])) -> candle_core::Result<()> {
    let t = var.as_tensor();
    if t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous() {
        return t.inplace_op1(&InPlace {
            f: RefCell::new(Some(f)),
        });
    }
    let mut v = t
        .to_dtype(DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    f(&mut v);
    let back = Tensor::from_vec(v, t.dims(), &candle_core::Device::Cpu)?
        .to_dtype(t.dtype())?
        .to_device(t.device())?;
    var.set(&back)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_in_place() {
        let v = Var::from_tensor(
            &Tensor::from_vec(
                vec![1.0f32, 2.0, 3.0, 4.0],
                (2, 2),
                &candle_core::Device::Cpu,
            )
            .unwrap(),
        )
        .unwrap();
        update_f32(&v, |x| x[1..3].copy_from_slice(&[7.0, 8.0])).unwrap();
        let got = with_f32(v.as_tensor(), |x| x.to_vec()).unwrap();
        assert_eq!(got, vec![1.0, 7.0, 8.0, 4.0]);
        // A transposed view is read through a copy, in logical order.
        let t = v.as_tensor().t().unwrap();
        assert_eq!(
            with_f32(&t, |x| x.to_vec()).unwrap(),
            vec![1.0, 8.0, 7.0, 4.0]
        );
    }
}
