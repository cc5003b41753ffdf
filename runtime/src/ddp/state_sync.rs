//! Sending named-tensor state (optimizer moments, sampler cursor) from one rank to all, for a
//! rank that joins or replaces another and has no state of its own.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use super::{DdpError, DdpResult};
use crate::buffer::Buffer;
use crate::process_group::ProcessGroup;

fn invalid(rank: usize, reason: impl Into<String>) -> DdpError {
    DdpError::InvalidArgument {
        rank,
        reason: reason.into(),
    }
}

fn wait(pg: &ProcessGroup, work: crate::Work, timeout: Duration) -> DdpResult<Buffer> {
    work.wait(timeout).map_err(|source| DdpError::Collective {
        rank: pg.rank(),
        during: "state broadcast",
        source,
    })
}

fn tensor_err(rank: usize, name: &str, e: candle_core::Error) -> DdpError {
    DdpError::Tensor {
        rank,
        param: name.to_string(),
        message: e.to_string(),
    }
}

/// One line per tensor: `name\tdtype\tdim,dim,...`.
fn header(rank: usize, state: &[(String, Tensor)]) -> DdpResult<String> {
    let mut h = String::new();
    for (name, t) in state {
        if name.is_empty() || name.contains(['\t', '\n']) {
            return Err(invalid(
                rank,
                format!("tensor name {name:?} is empty or has a tab or newline"),
            ));
        }
        let dtype = match t.dtype() {
            DType::F32 => "f32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            other => {
                return Err(invalid(
                    rank,
                    format!(
                        "tensor {name:?} has dtype {other:?}; state tensors are f32, i64 or u8"
                    ),
                ))
            }
        };
        let dims: Vec<String> = t.dims().iter().map(|d| d.to_string()).collect();
        h.push_str(&format!("{name}\t{dtype}\t{}\n", dims.join(",")));
    }
    Ok(h)
}

fn parse_header(rank: usize, h: &str) -> DdpResult<Vec<(String, DType, Vec<usize>)>> {
    h.lines()
        .map(|line| {
            let bad = || invalid(rank, format!("malformed state header line {line:?}"));
            let mut parts = line.split('\t');
            let (Some(name), Some(dtype), Some(dims), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(bad());
            };
            let dtype = match dtype {
                "f32" => DType::F32,
                "i64" => DType::I64,
                "u8" => DType::U8,
                _ => return Err(bad()),
            };
            let dims = if dims.is_empty() {
                Vec::new()
            } else {
                dims.split(',')
                    .map(|d| d.parse::<usize>().map_err(|_| bad()))
                    .collect::<DdpResult<Vec<_>>>()?
            };
            Ok((name.to_string(), dtype, dims))
        })
        .collect()
}

fn to_buffer(rank: usize, name: &str, t: &Tensor) -> DdpResult<Buffer> {
    let flat = t
        .flatten_all()
        .and_then(|f| f.to_device(&Device::Cpu))
        .map_err(|e| tensor_err(rank, name, e))?;
    let buf = match t.dtype() {
        DType::F32 => flat.to_vec1::<f32>().map(Buffer::from),
        DType::I64 => flat.to_vec1::<i64>().map(Buffer::from),
        _ => flat.to_vec1::<u8>().map(Buffer::from),
    };
    buf.map_err(|e| tensor_err(rank, name, e))
}

/// Broadcasts named tensors (f32, i64 or u8, any shapes) from `root` to every rank: the root
/// passes `Some(state)`, the others `None` (they need not know names or shapes); every rank
/// gets the root's tensors back, on the CPU, in the root's order. Every rank must call it at
/// the same point of its collective sequence. Each collective waits at most `timeout`.
pub fn broadcast_state(
    pg: &ProcessGroup,
    state: Option<Vec<(String, Tensor)>>,
    root: usize,
    timeout: Duration,
) -> DdpResult<Vec<(String, Tensor)>> {
    let rank = pg.rank();
    let is_root = rank == root;
    let state = match (is_root, state) {
        (true, Some(s)) => Some(s),
        (true, None) => return Err(invalid(rank, "the root must pass its state")),
        (false, _) => None,
    };
    // 1. the header's length, 2. the header, 3. every tensor.
    let text = match &state {
        Some(s) => header(rank, s)?,
        None => String::new(),
    };
    let len = wait(
        pg,
        pg.broadcast(Buffer::from(vec![text.len() as i64]), root),
        timeout,
    )?;
    let len = match len.as_slice::<i64>() {
        Some(&[n]) if n >= 0 => n as usize,
        _ => return Err(invalid(rank, "the state header length did not arrive")),
    };
    let mut bytes = text.into_bytes();
    bytes.resize(len, 0);
    let bytes = wait(pg, pg.broadcast(Buffer::from(bytes), root), timeout)?
        .into_vec::<u8>()
        .map_err(|_| invalid(rank, "the state header is not bytes"))?;
    let text =
        String::from_utf8(bytes).map_err(|_| invalid(rank, "the state header is not UTF-8"))?;
    let layout = parse_header(rank, &text)?;

    let mut works = Vec::with_capacity(layout.len());
    for (i, (name, dtype, dims)) in layout.iter().enumerate() {
        let n: usize = dims.iter().product();
        let buf = match &state {
            Some(s) => to_buffer(rank, name, &s[i].1)?,
            None => Buffer::zeros(
                match dtype {
                    DType::F32 => crate::DType::F32,
                    DType::I64 => crate::DType::I64,
                    _ => crate::DType::U8,
                },
                n,
            ),
        };
        works.push(pg.broadcast(buf, root));
    }
    let mut out = Vec::with_capacity(layout.len());
    for ((name, _, dims), work) in layout.into_iter().zip(works) {
        let buf = wait(pg, work, timeout)?;
        let t = match buf {
            Buffer::F32(v) => Tensor::from_vec(v, dims.as_slice(), &Device::Cpu),
            Buffer::I64(v) => Tensor::from_vec(v, dims.as_slice(), &Device::Cpu),
            Buffer::U8(v) => Tensor::from_vec(v, dims.as_slice(), &Device::Cpu),
            other => {
                return Err(invalid(
                    rank,
                    format!("tensor {name:?} came back as {:?}", other.dtype()),
                ))
            }
        }
        .map_err(|e| tensor_err(rank, &name, e))?;
        out.push((name, t));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let state = vec![
            (
                "optim.step".to_string(),
                Tensor::new(3i64, &Device::Cpu).unwrap(),
            ),
            (
                "optim.w.exp_avg".to_string(),
                Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
            ),
        ];
        let h = header(0, &state).unwrap();
        assert_eq!(h, "optim.step\ti64\t\noptim.w.exp_avg\tf32\t2,3\n");
        let parsed = parse_header(0, &h).unwrap();
        assert_eq!(parsed[0], ("optim.step".to_string(), DType::I64, vec![]));
        assert_eq!(
            parsed[1],
            ("optim.w.exp_avg".to_string(), DType::F32, vec![2, 3])
        );
        assert!(parse_header(0, "a\tf16\t2\n").is_err());
        let bad = vec![("a\tb".to_string(), Tensor::new(1i64, &Device::Cpu).unwrap())];
        assert!(header(0, &bad).is_err());
    }
}
