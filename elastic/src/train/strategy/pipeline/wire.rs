//! Named tensors and activations over a process group's point-to-point operations.
//!
//! A set of named tensors travels as two messages: the sizes (`[header bytes, data bytes]`,
//! i64), then one byte buffer holding a JSON header (`[{"name", "dtype", "shape"}, ...]`)
//! followed by the tensors' little-endian elements, in header order. Only `f32` and `i64`
//! tensors travel (parameters, optimizer moments, the optimizer's step count).

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use rekindle_runtime::{Buffer, ProcessGroup, Work};
use serde::{Deserialize, Serialize};

use super::super::StepError;

#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<usize>,
}

fn bad(during: &'static str, reason: impl std::fmt::Display) -> StepError {
    StepError::state(during, reason)
}

/// Issues the sends of `tensors` to `peer`; the caller waits on the returned works.
pub(crate) fn send_tensors(
    pg: &ProcessGroup,
    peer: usize,
    tensors: &[(String, Tensor)],
) -> Result<[Work; 2], StepError> {
    const DURING: &str = "sending layer state";
    let mut header = Vec::with_capacity(tensors.len());
    let mut data: Vec<u8> = Vec::new();
    for (name, t) in tensors {
        let shape = t.dims().to_vec();
        let t = t
            .to_device(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .map_err(|e| bad(DURING, format!("{name}: {e}")))?;
        let dtype = match t.dtype() {
            DType::I64 => {
                let v = t
                    .to_vec1::<i64>()
                    .map_err(|e| bad(DURING, format!("{name}: {e}")))?;
                v.iter()
                    .for_each(|x| data.extend_from_slice(&x.to_le_bytes()));
                "i64"
            }
            _ => {
                let v = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| bad(DURING, format!("{name}: {e}")))?;
                v.iter()
                    .for_each(|x| data.extend_from_slice(&x.to_le_bytes()));
                "f32"
            }
        };
        header.push(Entry {
            name: name.clone(),
            dtype: dtype.into(),
            shape,
        });
    }
    let mut payload = serde_json::to_vec(&header).map_err(|e| bad(DURING, e))?;
    let sizes = vec![payload.len() as i64, data.len() as i64];
    payload.extend_from_slice(&data);
    Ok([
        pg.send(Buffer::from(sizes), peer),
        pg.send(Buffer::from(payload), peer),
    ])
}

/// Receives what [`send_tensors`] sent from `peer`, waiting at most `wait` for each message.
pub(crate) fn recv_tensors(
    pg: &ProcessGroup,
    peer: usize,
    wait: Duration,
) -> Result<Vec<(String, Tensor)>, StepError> {
    const DURING: &str = "receiving layer state";
    let sizes = pg
        .recv(Buffer::zeros(rekindle_runtime::DType::I64, 2), peer)
        .wait(wait)
        .map_err(|e| StepError::collective(DURING, e))?;
    let (head, body) = match sizes.as_slice::<i64>() {
        Some(&[h, d]) if h >= 0 && d >= 0 => (h as usize, d as usize),
        _ => return Err(bad(DURING, "bad sizes")),
    };
    let payload = pg
        .recv(
            Buffer::zeros(rekindle_runtime::DType::U8, head + body),
            peer,
        )
        .wait(wait)
        .map_err(|e| StepError::collective(DURING, e))?;
    let bytes = payload.as_bytes();
    let header: Vec<Entry> = serde_json::from_slice(&bytes[..head]).map_err(|e| bad(DURING, e))?;
    let mut at = head;
    let mut out = Vec::with_capacity(header.len());
    for e in header {
        let n: usize = e.shape.iter().product();
        let t = match e.dtype.as_str() {
            "i64" => {
                let raw = bytes
                    .get(at..at + 8 * n)
                    .ok_or_else(|| bad(DURING, format!("{}: truncated", e.name)))?;
                at += 8 * n;
                let v: Vec<i64> = raw
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect();
                Tensor::from_vec(v, e.shape.as_slice(), &Device::Cpu)
            }
            "f32" => {
                let raw = bytes
                    .get(at..at + 4 * n)
                    .ok_or_else(|| bad(DURING, format!("{}: truncated", e.name)))?;
                at += 4 * n;
                Tensor::from_vec(f32s(raw), e.shape.as_slice(), &Device::Cpu)
            }
            other => return Err(bad(DURING, format!("{}: dtype {other}", e.name))),
        }
        .map_err(|err| bad(DURING, format!("{}: {err}", e.name)))?;
        out.push((e.name, t));
    }
    Ok(out)
}

/// Little-endian f32s from bytes (a whole number of them).
pub(crate) fn f32s(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The elements of `t` as f32, row-major.
pub(crate) fn to_f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
