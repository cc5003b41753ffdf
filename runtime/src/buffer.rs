//! Owned, typed host buffers: what collectives take and give back.
//!
//! Operations take a [`Buffer`] by value and return it (or a new one) from `Work::wait`, so an
//! asynchronous operation owns its memory while it runs and no lifetime ties the caller.

use half::{bf16, f16};

use crate::dtype::{DType, Element};

/// A contiguous host buffer of one dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i32 elements.
    I32(Vec<i32>),
    /// i64 elements.
    I64(Vec<i64>),
    /// u8 elements.
    U8(Vec<u8>),
}

/// Applies `$body` to the typed vector inside a buffer, binding it as `$v`.
macro_rules! with_vec {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            Buffer::F32($v) => $body,
            Buffer::F64($v) => $body,
            Buffer::F16($v) => $body,
            Buffer::BF16($v) => $body,
            Buffer::I32($v) => $body,
            Buffer::I64($v) => $body,
            Buffer::U8($v) => $body,
        }
    };
}

impl Buffer {
    /// A zero-filled buffer of `len` elements.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F64 => Buffer::F64(vec![0.0; len]),
            DType::F16 => Buffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => Buffer::BF16(vec![bf16::ZERO; len]),
            DType::I32 => Buffer::I32(vec![0; len]),
            DType::I64 => Buffer::I64(vec![0; len]),
            DType::U8 => Buffer::U8(vec![0; len]),
        }
    }

    /// A buffer whose element `i` is `f(i)` converted to the dtype (floats exactly for small
    /// integers, integers by truncation, u8 wrapping).
    pub fn from_fn(dtype: DType, len: usize, f: impl Fn(usize) -> f64) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32((0..len).map(|i| f(i) as f32).collect()),
            DType::F64 => Buffer::F64((0..len).map(&f).collect()),
            DType::F16 => Buffer::F16((0..len).map(|i| f16::from_f64(f(i))).collect()),
            DType::BF16 => Buffer::BF16((0..len).map(|i| bf16::from_f64(f(i))).collect()),
            DType::I32 => Buffer::I32((0..len).map(|i| f(i) as i64 as i32).collect()),
            DType::I64 => Buffer::I64((0..len).map(|i| f(i) as i64).collect()),
            DType::U8 => Buffer::U8((0..len).map(|i| f(i) as i64 as u8).collect()),
        }
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
            Buffer::F16(_) => DType::F16,
            Buffer::BF16(_) => DType::BF16,
            Buffer::I32(_) => DType::I32,
            Buffer::I64(_) => DType::I64,
            Buffer::U8(_) => DType::U8,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        with_vec!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// The raw bytes, native-endian.
    pub fn as_bytes(&self) -> &[u8] {
        with_vec!(self, v => bytemuck::cast_slice(v.as_slice()))
    }

    /// The raw bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        with_vec!(self, v => bytemuck::cast_slice_mut(v.as_mut_slice()))
    }

    /// Element `i` as f64 (for checks and printing).
    pub fn get_f64(&self, i: usize) -> Option<f64> {
        Some(match self {
            Buffer::F32(v) => *v.get(i)? as f64,
            Buffer::F64(v) => *v.get(i)?,
            Buffer::F16(v) => v.get(i)?.to_f64(),
            Buffer::BF16(v) => v.get(i)?.to_f64(),
            Buffer::I32(v) => *v.get(i)? as f64,
            Buffer::I64(v) => *v.get(i)? as f64,
            Buffer::U8(v) => *v.get(i)? as f64,
        })
    }

    /// The elements as a typed slice, if the dtype is `T`'s.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (self.dtype() == T::DTYPE).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements as a typed vector, if the dtype is `T`'s; otherwise the buffer back.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>, Buffer> {
        if self.dtype() != T::DTYPE {
            return Err(self);
        }
        with_vec!(self, v => Ok(bytemuck::allocation::cast_vec(v)))
    }
}

macro_rules! impl_from_vec {
    ($($t:ty => $var:ident),*) => {$(
        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Buffer {
                Buffer::$var(v)
            }
        }
    )*};
}
impl_from_vec!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i32 => I32, i64 => I64, u8 => U8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_round_trip() {
        let b = Buffer::from(vec![1.0f32, 2.0, 3.0]);
        assert_eq!(b.dtype(), DType::F32);
        assert_eq!(b.size_in_bytes(), 12);
        assert_eq!(b.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0]);
        assert!(b.as_slice::<i32>().is_none());
        let b = b.into_vec::<i32>().unwrap_err();
        assert_eq!(b.into_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        for d in DType::ALL {
            let b = Buffer::from_fn(d, 5, |i| i as f64);
            assert_eq!(b.dtype(), d);
            assert_eq!(b.get_f64(4), Some(4.0));
            assert_eq!(Buffer::zeros(d, 3).size_in_bytes(), 3 * d.size_in_bytes());
        }
    }
}
