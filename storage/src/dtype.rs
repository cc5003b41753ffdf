//! The element types a checkpoint stores, with their safetensors and candle names.

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, StorageError};

/// A stored element type. The names on disk are safetensors' (`F32`, `BF16`, `BOOL`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorDType {
    /// 64-bit IEEE float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit IEEE float.
    F32,
    /// 32-bit signed integer.
    I32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean, one byte per element (0 or 1).
    Bool,
}

impl TensorDType {
    /// Every dtype, widest first (the order tensors are laid out in a file, which keeps each
    /// one aligned to its element size).
    pub const ALL: [TensorDType; 8] = [
        TensorDType::F64,
        TensorDType::I64,
        TensorDType::F32,
        TensorDType::I32,
        TensorDType::F16,
        TensorDType::BF16,
        TensorDType::U8,
        TensorDType::Bool,
    ];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            TensorDType::F64 | TensorDType::I64 => 8,
            TensorDType::F32 | TensorDType::I32 => 4,
            TensorDType::F16 | TensorDType::BF16 => 2,
            TensorDType::U8 | TensorDType::Bool => 1,
        }
    }

    /// The safetensors name (`F32`, `BF16`, `BOOL`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            TensorDType::F64 => "F64",
            TensorDType::I64 => "I64",
            TensorDType::F32 => "F32",
            TensorDType::I32 => "I32",
            TensorDType::F16 => "F16",
            TensorDType::BF16 => "BF16",
            TensorDType::U8 => "U8",
            TensorDType::Bool => "BOOL",
        }
    }

    /// The dtype of a safetensors name, or `None` for one this crate does not store.
    pub fn from_safetensors_name(name: &str) -> Option<TensorDType> {
        TensorDType::ALL
            .into_iter()
            .find(|d| d.safetensors_name() == name)
    }

    /// The runtime dtype of the same element, if the collectives have one (not `bool`).
    pub fn to_runtime(self) -> Option<rekindle_runtime::DType> {
        use rekindle_runtime::DType as R;
        Some(match self {
            TensorDType::F64 => R::F64,
            TensorDType::I64 => R::I64,
            TensorDType::F32 => R::F32,
            TensorDType::I32 => R::I32,
            TensorDType::F16 => R::F16,
            TensorDType::BF16 => R::BF16,
            TensorDType::U8 => R::U8,
            TensorDType::Bool => return None,
        })
    }

    /// The stored dtype of a runtime dtype.
    pub fn from_runtime(d: rekindle_runtime::DType) -> TensorDType {
        use rekindle_runtime::DType as R;
        match d {
            R::F64 => TensorDType::F64,
            R::I64 => TensorDType::I64,
            R::F32 => TensorDType::F32,
            R::I32 => TensorDType::I32,
            R::F16 => TensorDType::F16,
            R::BF16 => TensorDType::BF16,
            R::U8 => TensorDType::U8,
        }
    }

    /// The candle dtype a tensor of this dtype becomes (`bool` becomes `u8`, candle has no
    /// boolean type).
    pub fn to_candle(self) -> candle_core::DType {
        use candle_core::DType as C;
        match self {
            TensorDType::F64 => C::F64,
            TensorDType::I64 => C::I64,
            TensorDType::F32 => C::F32,
            TensorDType::I32 => C::I32,
            TensorDType::F16 => C::F16,
            TensorDType::BF16 => C::BF16,
            TensorDType::U8 | TensorDType::Bool => C::U8,
        }
    }

    /// The stored dtype of a candle dtype; `name` is used in the error for the ones this crate
    /// does not store (u32, i16, the 8-, 6- and 4-bit floats).
    pub fn from_candle(d: candle_core::DType, name: &str) -> Result<TensorDType> {
        use candle_core::DType as C;
        Ok(match d {
            C::F64 => TensorDType::F64,
            C::I64 => TensorDType::I64,
            C::F32 => TensorDType::F32,
            C::I32 => TensorDType::I32,
            C::F16 => TensorDType::F16,
            C::BF16 => TensorDType::BF16,
            C::U8 => TensorDType::U8,
            other => {
                return Err(StorageError::UnsupportedDType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
    }
}

impl fmt::Display for TensorDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

impl FromStr for TensorDType {
    type Err = StorageError;

    /// Accepts safetensors names and the short lower-case ones (`f32`, `bool`, ...).
    fn from_str(s: &str) -> Result<Self> {
        TensorDType::from_safetensors_name(&s.trim().to_ascii_uppercase()).ok_or_else(|| {
            StorageError::UnsupportedDType {
                name: String::new(),
                dtype: s.to_string(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in TensorDType::ALL {
            assert_eq!(
                TensorDType::from_safetensors_name(d.safetensors_name()),
                Some(d)
            );
            assert_eq!(
                d.to_string().to_lowercase().parse::<TensorDType>().unwrap(),
                d
            );
            if let Some(r) = d.to_runtime() {
                assert_eq!(TensorDType::from_runtime(r), d);
                assert_eq!(r.size_in_bytes(), d.size_in_bytes());
            }
        }
        assert_eq!(TensorDType::from_safetensors_name("U32"), None);
        assert!(TensorDType::from_candle(candle_core::DType::U32, "x").is_err());
    }

    #[test]
    fn all_is_widest_first() {
        let sizes: Vec<usize> = TensorDType::ALL.iter().map(|d| d.size_in_bytes()).collect();
        assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
    }
}
