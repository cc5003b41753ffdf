//! Owned host tensors: named bytes with a dtype and a shape.

use rekindle_runtime::{Buffer, Element};

use crate::dtype::TensorDType;
use crate::error::{Result, StorageError};

/// The bytes of a [`HostTensor`], always aligned to 8 bytes so typed views of every dtype are
/// possible without copying.
#[derive(Debug, Clone, PartialEq)]
enum Data {
    /// Backed by 64-bit words; `len` bytes of them are used.
    Words { words: Vec<u64>, len: usize },
    /// A runtime buffer moved in as it is (its vector is aligned to its element).
    Buffer(Buffer),
}

/// A contiguous tensor in host memory: dtype, shape (row-major) and bytes (little-endian).
/// This is what a snapshot holds and what is written to a safetensors file.
#[derive(Debug, Clone)]
pub struct HostTensor {
    dtype: TensorDType,
    shape: Vec<usize>,
    data: Data,
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl HostTensor {
    /// A zero-filled tensor.
    pub fn zeros(dtype: TensorDType, shape: &[usize]) -> HostTensor {
        let len = numel(shape) * dtype.size_in_bytes();
        HostTensor {
            dtype,
            shape: shape.to_vec(),
            data: Data::Words {
                words: vec![0; len.div_ceil(8)],
                len,
            },
        }
    }

    /// A tensor holding a copy of `bytes`, which must be exactly `numel * element size` long.
    pub fn from_bytes(dtype: TensorDType, shape: &[usize], bytes: &[u8]) -> Result<HostTensor> {
        let mut t = HostTensor::zeros(dtype, shape);
        if bytes.len() != t.size_in_bytes() {
            return Err(StorageError::TensorMismatch {
                name: String::new(),
                reason: format!(
                    "{} bytes given for {dtype} of shape {shape:?} ({} expected)",
                    bytes.len(),
                    t.size_in_bytes()
                ),
            });
        }
        t.as_bytes_mut().copy_from_slice(bytes);
        Ok(t)
    }

    /// A tensor holding a copy of typed elements.
    pub fn from_slice<T: Element>(shape: &[usize], values: &[T]) -> Result<HostTensor> {
        HostTensor::from_bytes(
            TensorDType::from_runtime(T::DTYPE),
            shape,
            bytemuck::cast_slice(values),
        )
    }

    /// A boolean tensor (stored one byte per element, 0 or 1).
    pub fn from_bools(shape: &[usize], values: &[bool]) -> Result<HostTensor> {
        let bytes: Vec<u8> = values.iter().map(|&b| b as u8).collect();
        HostTensor::from_bytes(TensorDType::Bool, shape, &bytes)
    }

    /// Takes a runtime [`Buffer`] without copying it.
    pub fn from_buffer(buffer: Buffer, shape: &[usize]) -> Result<HostTensor> {
        if buffer.len() != numel(shape) {
            return Err(StorageError::TensorMismatch {
                name: String::new(),
                reason: format!(
                    "buffer of {} elements given for shape {shape:?}",
                    buffer.len()
                ),
            });
        }
        Ok(HostTensor {
            dtype: TensorDType::from_runtime(buffer.dtype()),
            shape: shape.to_vec(),
            data: Data::Buffer(buffer),
        })
    }

    /// The dtype.
    pub fn dtype(&self) -> TensorDType {
        self.dtype
    }

    /// The shape (row-major).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// The size in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.as_bytes().len()
    }

    /// The bytes, little-endian, row-major.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            Data::Words { words, len } => &bytemuck::cast_slice(words.as_slice())[..*len],
            Data::Buffer(b) => b.as_bytes(),
        }
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            Data::Words { words, len } => {
                &mut bytemuck::cast_slice_mut(words.as_mut_slice())[..*len]
            }
            Data::Buffer(b) => b.as_bytes_mut(),
        }
    }

    /// The elements as a typed slice, if `T` is the dtype's element.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (TensorDType::from_runtime(T::DTYPE) == self.dtype)
            .then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// Overwrites this tensor's bytes with `src`'s when dtype and shape agree (the snapshot
    /// buffers of asynchronous saves are reused this way); returns false otherwise.
    pub fn copy_from_if_same_layout(&mut self, src: &HostTensor) -> bool {
        if self.dtype != src.dtype || self.shape != src.shape {
            return false;
        }
        self.as_bytes_mut().copy_from_slice(src.as_bytes());
        true
    }
}

impl PartialEq for HostTensor {
    /// Equal when dtype, shape and bytes are.
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.as_bytes() == other.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_agree() {
        let a = HostTensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let b =
            HostTensor::from_buffer(Buffer::from(vec![1.0f32, 2.0, 3.0, 4.0]), &[2, 2]).unwrap();
        assert_eq!(a.as_bytes(), b.as_bytes());
        assert_eq!(a.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(a.as_slice::<i32>().is_none());
        assert_eq!(a.size_in_bytes(), 16);
        let c = HostTensor::from_bools(&[3], &[true, false, true]).unwrap();
        assert_eq!(c.as_bytes(), &[1, 0, 1]);
        assert_eq!(c.as_bytes().as_ptr() as usize % 8, 0);
        assert!(HostTensor::from_bytes(TensorDType::F32, &[3], &[0; 8]).is_err());
        assert!(HostTensor::from_buffer(Buffer::from(vec![1u8]), &[2]).is_err());
    }

    #[test]
    fn copy_respects_layout() {
        let src = HostTensor::from_slice(&[2], &[7i64, 8]).unwrap();
        let mut dst = HostTensor::zeros(TensorDType::I64, &[2]);
        assert!(dst.copy_from_if_same_layout(&src));
        assert_eq!(dst, src);
        let mut other = HostTensor::zeros(TensorDType::I64, &[3]);
        assert!(!other.copy_from_if_same_layout(&src));
    }
}
