//! Element types of collective buffers.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::{Error, Result};

/// The element types the collectives move and reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The short name (`f32`, `bf16`, ...), as parsed by `FromStr`.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// True for the floating-point dtypes.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// A stable one-byte code used on the wire.
    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
            DType::I32 => 5,
            DType::I64 => 6,
            DType::U8 => 7,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Accepts the short names and torch's (`float32`, `float`, `half`, `bfloat16`, `int64`, ...).
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "u8" | "uint8" | "byte" => DType::U8,
            _ => {
                return Err(Error::InvalidDType {
                    input: s.to_string(),
                })
            }
        })
    }
}

/// A Rust type that is the element of one [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
        }
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert!("f8".parse::<DType>().is_err());
        let codes: std::collections::HashSet<u8> = DType::ALL.iter().map(|d| d.code()).collect();
        assert_eq!(codes.len(), DType::ALL.len());
    }
}
