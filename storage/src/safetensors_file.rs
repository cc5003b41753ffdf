//! Reading and writing the safetensors layout: an 8-byte little-endian header length, a JSON
//! header, then the tensor bytes.
//!
//! The writer lays tensors out widest dtype first, so every tensor starts at a multiple of its
//! element size relative to the data section; the header is padded with spaces so the data
//! section starts at a multiple of 8. Together with a page-aligned mmap this makes every
//! tensor's bytes aligned for a typed view. The parser checks everything the format promises
//! and names the file in every error.

use std::collections::BTreeMap;
use std::path::Path;

use crate::dtype::TensorDType;
use crate::error::{Result, StorageError};
use crate::tensor::HostTensor;

/// Where one tensor lies in a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name as stored (before key normalisation).
    pub name: String,
    /// Its dtype.
    pub dtype: TensorDType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte offsets `[begin, end)` relative to the data section (safetensors' `data_offsets`).
    pub data_offsets: (u64, u64),
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
pub struct Header {
    /// Where the data section starts in the file (8 + header length).
    pub data_start: u64,
    /// The tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` string map, empty when absent.
    pub metadata: BTreeMap<String, String>,
}

impl Header {
    /// The file size the header implies.
    pub fn file_size(&self) -> u64 {
        self.data_start + self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }
}

/// Bytes of the header a writer emits for `tensors` (in the order given) and `metadata`,
/// together with each tensor's `data_offsets`.
pub(crate) fn encode_header(
    tensors: &[(&str, &HostTensor)],
    metadata: &BTreeMap<String, String>,
) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        let end = offset + t.size_in_bytes() as u64;
        map.insert(
            (*name).to_string(),
            serde_json::json!({
                "dtype": t.dtype().safetensors_name(),
                "shape": t.shape(),
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&map).unwrap_or_default();
    // Pad so that 8 + header length is a multiple of 8, as the safetensors writer does.
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Sorts tensors into file order: widest dtype first, then by name.
pub(crate) fn file_order<'a>(tensors: &mut [(&'a str, &'a HostTensor)]) {
    tensors.sort_by(|a, b| {
        b.1.dtype()
            .size_in_bytes()
            .cmp(&a.1.dtype().size_in_bytes())
            .then_with(|| a.0.cmp(b.0))
    });
}

/// Parses and validates the header of a safetensors file whose full contents (or at least its
/// first bytes, with `file_len` the real size) are `bytes`.
pub fn parse_header(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header> {
    let invalid = |reason: String| StorageError::InvalidHeader {
        path: path.to_path_buf(),
        reason,
    };
    if file_len < 8 || bytes.len() < 8 {
        return Err(invalid(format!(
            "file is {file_len} bytes, shorter than the 8-byte header length"
        )));
    }
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&bytes[..8]);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len - 8 {
        return Err(invalid(format!(
            "header length {header_len} goes beyond the end of the {file_len}-byte file"
        )));
    }
    let header_end = 8 + header_len as usize;
    if header_end > bytes.len() {
        return Err(invalid(format!(
            "header length {header_len} is more than the {} bytes read",
            bytes.len() - 8
        )));
    }
    let value: serde_json::Value = serde_json::from_slice(&bytes[8..header_end])
        .map_err(|e| invalid(format!("malformed JSON header: {e}")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(invalid("the JSON header is not an object".into()));
    };
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(map.len());
    for (name, entry) in map {
        if name == "__metadata__" {
            let serde_json::Value::Object(m) = entry else {
                return Err(invalid("__metadata__ is not an object".into()));
            };
            for (k, v) in m {
                let serde_json::Value::String(v) = v else {
                    return Err(invalid(format!(
                        "__metadata__ value of {k:?} is not a string"
                    )));
                };
                metadata.insert(k, v);
            }
            continue;
        }
        tensors.push(parse_entry(&name, &entry).map_err(&invalid)?);
    }
    tensors.sort_by_key(|t| t.data_offsets);
    let mut expected = 0u64;
    for t in &tensors {
        if t.data_offsets.0 != expected {
            return Err(invalid(format!(
                "tensor {:?} starts at {} but the previous one ends at {expected} (holes and overlaps are not allowed)",
                t.name, t.data_offsets.0
            )));
        }
        expected = t.data_offsets.1;
    }
    let data_start = header_end as u64;
    let implied = data_start + expected;
    if implied != file_len {
        return Err(StorageError::SizeMismatch {
            path: path.to_path_buf(),
            expected: implied,
            actual: file_len,
        });
    }
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
}

fn parse_entry(name: &str, entry: &serde_json::Value) -> std::result::Result<TensorInfo, String> {
    let dtype_name = entry
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| format!("tensor {name:?} has no dtype string"))?;
    let dtype = TensorDType::from_safetensors_name(dtype_name)
        .ok_or_else(|| format!("tensor {name:?} has unsupported dtype {dtype_name}"))?;
    let shape = entry
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| format!("tensor {name:?} has no shape array"))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| format!("tensor {name:?} has a non-integer dimension"))?;
    let offsets = entry
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
        .ok_or_else(|| format!("tensor {name:?} has no [begin, end] data_offsets"))?;
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| format!("tensor {name:?} shape {shape:?} overflows"))?;
    let want = numel
        .checked_mul(dtype.size_in_bytes() as u64)
        .ok_or_else(|| format!("tensor {name:?} size overflows"))?;
    if offsets.1 < offsets.0 || offsets.1 - offsets.0 != want {
        return Err(format!(
            "tensor {name:?} of {dtype} {shape:?} needs {want} bytes but data_offsets are {offsets:?}"
        ));
    }
    Ok(TensorInfo {
        name: name.to_string(),
        dtype,
        shape,
        data_offsets: offsets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(tensors: &[(&str, &HostTensor)]) -> Vec<u8> {
        let mut v: Vec<(&str, &HostTensor)> = tensors.to_vec();
        file_order(&mut v);
        let mut out = encode_header(&v, &BTreeMap::new());
        for (_, t) in &v {
            out.extend_from_slice(t.as_bytes());
        }
        out
    }

    #[test]
    fn round_trip_and_alignment() {
        let a = HostTensor::from_slice(&[3], &[1u8, 2, 3]).unwrap();
        let b = HostTensor::from_slice(&[2], &[1.5f64, 2.5]).unwrap();
        let c = HostTensor::from_slice(&[1], &[7i32]).unwrap();
        let bytes = encode(&[("a", &a), ("b", &b), ("c", &c)]);
        let h = parse_header(Path::new("x"), &bytes, bytes.len() as u64).unwrap();
        assert_eq!(h.data_start % 8, 0);
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "c", "a"]);
        for t in &h.tensors {
            assert_eq!(t.data_offsets.0 % t.dtype.size_in_bytes() as u64, 0);
        }
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("b").unwrap().data(), b.as_bytes());
    }

    #[test]
    fn rejects_bad_headers() {
        let a = HostTensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
        let good = encode(&[("a", &a)]);
        let p = Path::new("f.safetensors");
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..5].to_vec(), "shorter than"),
            (
                {
                    let mut v = good.clone();
                    v[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
                    v
                },
                "beyond the end",
            ),
            (
                {
                    let mut v = good.clone();
                    v[8] = b'[';
                    v
                },
                "malformed JSON",
            ),
            (good[..good.len() - 1].to_vec(), "bytes, expected"),
        ];
        for (bytes, want) in cases {
            let err = parse_header(p, &bytes, bytes.len() as u64).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(want) && msg.contains("f.safetensors"), "{msg}");
        }
    }
}
