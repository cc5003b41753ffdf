//! Pure decisions of the NCCL backend: type and op mapping, argument checks, and the device
//! layouts of the ops NCCL has no direct equivalent for (uneven reduce-scatter).

use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};

use crate::collectives::{segment, Collective, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// NCCL's element type for a dtype.
pub(crate) fn nccl_dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// NCCL's reduction for an op (`ncclAvg` since NCCL 2.10).
pub(crate) fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
    }
}

/// Checks what can be checked locally before an op is queued: roots and peers in range, no
/// send or receive to oneself. Lengths that must agree across ranks cannot be checked here;
/// a mismatch ends in the op deadline.
pub(crate) fn validate(op: &Collective, rank: usize, world: usize) -> Result<()> {
    let name = op.name();
    let bad = |reason: String| Err(Error::InvalidArgument { op: name, reason });
    match op {
        Collective::Broadcast { root, .. }
        | Collective::Reduce { root, .. }
        | Collective::Scatter { root, .. }
        | Collective::Gather { root, .. }
            if *root >= world =>
        {
            bad(format!("root {root} is not below world_size {world}"))
        }
        Collective::Send { peer, .. } | Collective::Recv { peer, .. } if *peer >= world => {
            bad(format!("peer {peer} is not below world_size {world}"))
        }
        Collective::Send { peer, .. } | Collective::Recv { peer, .. } if *peer == rank => {
            bad(format!("rank {rank} cannot {name} to or from itself"))
        }
        Collective::AllGather { buf, out } => {
            crate::collectives::check_output(out.as_ref(), buf.dtype(), buf.len() * world, name)
        }
        Collective::ReduceScatter { buf, out, .. } => crate::collectives::check_output(
            out.as_ref(),
            buf.dtype(),
            crate::collectives::segment(buf.len(), world, rank).len(),
            name,
        ),
        Collective::Gather { buf, out, root } if *root == rank => {
            crate::collectives::check_output(out.as_ref(), buf.dtype(), buf.len() * world, name)
        }
        Collective::AllToAll { buf, out } => crate::collectives::check_output(
            out.as_ref(),
            buf.dtype(),
            crate::collectives::segment(buf.len(), world, rank).len() * world,
            name,
        ),
        _ => Ok(()),
    }
}

/// The ranks an op waits on, for timeout errors: the one peer of point-to-point and rooted
/// ops on non-root ranks, otherwise every other rank.
pub(crate) fn waiting_on(op: &Collective, rank: usize, world: usize) -> Vec<usize> {
    match single_peer(op, rank) {
        Some(p) => vec![p],
        None => (0..world).filter(|&r| r != rank).collect(),
    }
}

/// The only peer an op exchanges data with from this rank, if there is exactly one.
pub(crate) fn single_peer(op: &Collective, rank: usize) -> Option<usize> {
    match op {
        Collective::Send { peer, .. } | Collective::Recv { peer, .. } => Some(*peer),
        Collective::Scatter { root, .. } | Collective::Gather { root, .. } if *root != rank => {
            Some(*root)
        }
        _ => None,
    }
}

/// Reduce-scatter layout: NCCL's reduce-scatter needs equal pieces, so each rank's
/// [`segment`] is placed at a multiple of the largest segment's length (`chunk`) and the gaps
/// are padding that is reduced but never read back. Returns `chunk` and, per rank, the element
/// range of the input and the element offset it is placed at.
pub(crate) fn padded_segments(
    count: usize,
    world: usize,
) -> (usize, Vec<(std::ops::Range<usize>, usize)>) {
    let chunk = segment(count, world, 0).len();
    let placed = (0..world)
        .map(|r| (segment(count, world, r), r * chunk))
        .collect();
    (chunk, placed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::Buffer;

    #[test]
    fn every_dtype_and_op_maps_to_a_distinct_nccl_value() {
        let types: std::collections::HashSet<u32> =
            DType::ALL.iter().map(|&d| nccl_dtype(d) as u32).collect();
        assert_eq!(types.len(), DType::ALL.len());
        let ops: std::collections::HashSet<u32> =
            ReduceOp::ALL.iter().map(|&o| nccl_op(o) as u32).collect();
        assert_eq!(ops.len(), ReduceOp::ALL.len());
        assert_eq!(nccl_dtype(DType::BF16), ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_op(ReduceOp::Avg), ncclRedOp_t::ncclAvg);
    }

    #[test]
    fn bad_roots_and_peers_are_refused() {
        let b = || Buffer::zeros(DType::F32, 2);
        let cases = [
            (Collective::Broadcast { buf: b(), root: 3 }, false),
            (Collective::Broadcast { buf: b(), root: 2 }, true),
            (
                Collective::Gather {
                    buf: b(),
                    root: 5,
                    out: None,
                },
                false,
            ),
            (Collective::Scatter { buf: b(), root: 0 }, true),
            (
                Collective::Reduce {
                    buf: b(),
                    op: ReduceOp::Sum,
                    root: 9,
                },
                false,
            ),
            (Collective::Send { buf: b(), peer: 1 }, false),
            (Collective::Recv { buf: b(), peer: 0 }, true),
            (Collective::Recv { buf: b(), peer: 3 }, false),
            (Collective::Barrier, true),
        ];
        for (op, ok) in cases {
            let name = op.name();
            let r = validate(&op, 1, 3);
            assert_eq!(r.is_ok(), ok, "{name}: {r:?}");
            if let Err(e) = r {
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            }
        }
    }

    #[test]
    fn peers_named_in_timeouts() {
        let b = || Buffer::zeros(DType::U8, 1);
        assert_eq!(
            waiting_on(&Collective::Send { buf: b(), peer: 2 }, 0, 4),
            vec![2]
        );
        assert_eq!(
            waiting_on(
                &Collective::Gather {
                    buf: b(),
                    root: 3,
                    out: None
                },
                1,
                4
            ),
            vec![3]
        );
        assert_eq!(
            waiting_on(
                &Collective::Gather {
                    buf: b(),
                    root: 1,
                    out: None
                },
                1,
                4
            ),
            vec![0, 2, 3]
        );
        assert_eq!(waiting_on(&Collective::Barrier, 2, 4), vec![0, 1, 3]);
    }

    #[test]
    fn padded_segments_cover_the_input_in_disjoint_chunks() {
        for count in [0usize, 1, 5, 8, 13, 1001] {
            for world in 1..=5 {
                let (chunk, placed) = padded_segments(count, world);
                assert_eq!(placed.len(), world);
                let mut next = 0;
                for (r, (seg, at)) in placed.iter().enumerate() {
                    assert_eq!(*seg, segment(count, world, r));
                    assert_eq!(seg.start, next);
                    next = seg.end;
                    assert!(seg.len() <= chunk);
                    assert_eq!(*at, r * chunk);
                }
                assert_eq!(next, count);
                assert!(chunk * world < count + world);
            }
        }
    }
}
