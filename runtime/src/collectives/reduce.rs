//! Reduction operators and their element-wise kernels.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// How values from different ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum; a NaN anywhere gives NaN.
    Min,
    /// Maximum; a NaN anywhere gives NaN.
    Max,
    /// Sum divided by the world size (integers: truncating division), computed once by the rank
    /// that finishes each element's sum, so every rank gets identical bits.
    Avg,
}

impl ReduceOp {
    /// Every op, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => {
                return Err(Error::InvalidReduceOp {
                    input: s.to_string(),
                })
            }
        })
    }
}

/// Element arithmetic for the kernels.
trait Arith: bytemuck::Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
}

macro_rules! float_arith {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if b > a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                a / n as $t
            }
        }
    };
}
float_arith!(f32);
float_arith!(f64);

macro_rules! half_arith {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                <$t>::from_f32(<f32 as Arith>::min(a.to_f32(), b.to_f32()))
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                <$t>::from_f32(<f32 as Arith>::max(a.to_f32(), b.to_f32()))
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
        }
    };
}
half_arith!(f16);
half_arith!(bf16);

macro_rules! int_arith {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                a / (n as $t)
            }
        }
    };
}
int_arith!(i32);
int_arith!(i64);
int_arith!(u8);

#[inline(always)]
fn zip_apply<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

/// One monomorphised loop per operator, so the compiler can vectorise it.
fn combine_typed<T: Arith>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply(dst, src, T::add),
        ReduceOp::Prod => zip_apply(dst, src, T::mul),
        ReduceOp::Min => zip_apply(dst, src, T::min),
        ReduceOp::Max => zip_apply(dst, src, T::max),
    }
}

fn aligned_for<T>(bytes: &[u8]) -> bool {
    (bytes.as_ptr() as usize) % std::mem::align_of::<T>() == 0
}

fn combine_bytes<T: Arith>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let w = std::mem::size_of::<T>();
    let n = dst.len().min(src.len()) / w * w;
    let (dst, src) = (&mut dst[..n], &src[..n]);
    if aligned_for::<T>(dst) && aligned_for::<T>(src) {
        combine_typed::<T>(op, bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    } else {
        // Misaligned views are never produced by the backends, which keep element alignment.
        combine_unaligned::<T>(op, dst, src, w);
    }
}

fn combine_unaligned<T: Arith>(op: ReduceOp, dst: &mut [u8], src: &[u8], w: usize) {
    for (d, s) in dst.chunks_exact_mut(w).zip(src.chunks_exact(w)) {
        let mut a = [bytemuck::pod_read_unaligned::<T>(d)];
        let b = [bytemuck::pod_read_unaligned::<T>(s)];
        combine_typed(op, &mut a, &b);
        d.copy_from_slice(bytemuck::bytes_of(&a[0]));
    }
}

/// `dst[i] = op(dst[i], src[i])` over raw native-endian bytes of `dtype`. `Avg` combines as a
/// sum; apply [`finish_avg`] once at the end. Lengths must be equal multiples of the element
/// size; extra bytes are ignored.
pub fn combine(op: ReduceOp, dtype: DType, dst: &mut [u8], src: &[u8]) {
    match dtype {
        DType::F32 => combine_bytes::<f32>(op, dst, src),
        DType::F64 => combine_bytes::<f64>(op, dst, src),
        DType::F16 => combine_bytes::<f16>(op, dst, src),
        DType::BF16 => combine_bytes::<bf16>(op, dst, src),
        DType::I32 => combine_bytes::<i32>(op, dst, src),
        DType::I64 => combine_bytes::<i64>(op, dst, src),
        DType::U8 => combine_bytes::<u8>(op, dst, src),
    }
}

fn finish_typed<T: Arith>(buf: &mut [u8], n: usize) {
    let w = std::mem::size_of::<T>();
    let len = buf.len() / w * w;
    let buf = &mut buf[..len];
    if aligned_for::<T>(buf) {
        let v: &mut [T] = bytemuck::cast_slice_mut(buf);
        v.iter_mut().for_each(|x| *x = T::div_n(*x, n));
    } else {
        for c in buf.chunks_exact_mut(w) {
            let x = T::div_n(bytemuck::pod_read_unaligned::<T>(c), n);
            c.copy_from_slice(bytemuck::bytes_of(&x));
        }
    }
}

/// Divides every element by `world` if `op` is [`ReduceOp::Avg`]; a no-op otherwise.
pub fn finish_avg(op: ReduceOp, dtype: DType, buf: &mut [u8], world: usize) {
    if op != ReduceOp::Avg || world <= 1 {
        return;
    }
    match dtype {
        DType::F32 => finish_typed::<f32>(buf, world),
        DType::F64 => finish_typed::<f64>(buf, world),
        DType::F16 => finish_typed::<f16>(buf, world),
        DType::BF16 => finish_typed::<bf16>(buf, world),
        DType::I32 => finish_typed::<i32>(buf, world),
        DType::I64 => finish_typed::<i64>(buf, world),
        DType::U8 => finish_typed::<u8>(buf, world),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels() {
        let mut a = vec![1.0f32, 5.0, f32::NAN];
        let b = vec![2.0f32, 3.0, 1.0];
        combine(
            ReduceOp::Min,
            DType::F32,
            bytemuck::cast_slice_mut(&mut a),
            bytemuck::cast_slice(&b),
        );
        assert_eq!(a[..2], [1.0, 3.0]);
        assert!(a[2].is_nan());
        let mut x = vec![250u8, 3];
        combine(ReduceOp::Sum, DType::U8, &mut x, &[10, 4]);
        assert_eq!(x, vec![4, 7]);
        let mut y = vec![7i64, -9];
        finish_avg(
            ReduceOp::Avg,
            DType::I64,
            bytemuck::cast_slice_mut(&mut y),
            2,
        );
        assert_eq!(y, vec![3, -4]);
        // Unaligned views give the same result.
        let mut raw = [0u8; 9];
        raw[1..5].copy_from_slice(&2.5f32.to_ne_bytes());
        let src = 1.5f32.to_ne_bytes();
        combine(ReduceOp::Prod, DType::F32, &mut raw[1..5], &src);
        assert_eq!(f32::from_ne_bytes(raw[1..5].try_into().unwrap()), 3.75);
        assert_eq!("MEAN".parse::<ReduceOp>().unwrap(), ReduceOp::Avg);
        assert!("xor".parse::<ReduceOp>().is_err());
    }
}
