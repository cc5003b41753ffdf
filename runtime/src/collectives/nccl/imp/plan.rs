//! Pure decisions of the NCCL backend: type and op mapping, argument checks, the device
//! layouts of the ops NCCL has no direct equivalent for (uneven reduce-scatter), and what a
//! failed op means for the caller (which peers a timeout waited on, which failures are a lost
//! peer).

use std::time::Duration;

use super::comm::Stop;
use super::sys::{self, DataType, RedOp, Status};
use crate::collectives::{segment, Collective, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// NCCL's element type for a dtype.
pub(crate) fn nccl_dtype(d: DType) -> DataType {
    match d {
        DType::F32 => sys::FLOAT32,
        DType::F64 => sys::FLOAT64,
        DType::F16 => sys::FLOAT16,
        DType::BF16 => sys::BFLOAT16,
        DType::I32 => sys::INT32,
        DType::I64 => sys::INT64,
        DType::U8 => sys::UINT8,
    }
}

/// NCCL's reduction for an op (`ncclAvg` since NCCL 2.10).
pub(crate) fn nccl_op(op: ReduceOp) -> RedOp {
    match op {
        ReduceOp::Sum => sys::SUM,
        ReduceOp::Prod => sys::PROD,
        ReduceOp::Min => sys::MIN,
        ReduceOp::Max => sys::MAX,
        ReduceOp::Avg => sys::AVG,
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

/// The only peer an op exchanges data with from this rank, if there is exactly one: the peer
/// of point-to-point ops and the root of rooted ops on other ranks. Timeouts name it as the
/// rank waited on; for other ops they name nobody, since NCCL does not say which peer a
/// collective is stuck on, and naming every other rank would have healthy peers replaced.
pub(crate) fn single_peer(op: &Collective, rank: usize) -> Option<usize> {
    match op {
        Collective::Send { peer, .. } | Collective::Recv { peer, .. } => Some(*peer),
        Collective::Scatter { root, .. }
        | Collective::Gather { root, .. }
        | Collective::Broadcast { root, .. }
        | Collective::Reduce { root, .. }
            if *root != rank =>
        {
            Some(*root)
        }
        _ => None,
    }
}

/// What the caller of a failed op is told, from why its wait stopped:
/// - an abort is [`Error::Aborted`];
/// - the op deadline, or NCCL's own `ncclTimeout`, is [`Error::Timeout`] naming `peer` when
///   the op has a single one, nobody otherwise;
/// - `ncclRemoteError` and `ncclSystemError` (a peer died, a connection broke) are
///   [`Error::PeerLost`] naming `peer`, or [`Error::PeerLostUnidentified`] when NCCL cannot say
///   which peer;
/// - any other failure is [`Error::Nccl`].
pub(crate) fn op_error(
    rank: usize,
    op: &'static str,
    peer: Option<usize>,
    elapsed: Duration,
    stop: Stop,
) -> Error {
    match stop {
        Stop::Aborted => Error::Aborted { rank },
        Stop::TimedOut(elapsed) => Error::Timeout {
            rank,
            op,
            elapsed,
            waiting_on: peer.into_iter().collect(),
        },
        Stop::Failed {
            status: Some(sys::TIMEOUT),
            ..
        } => Error::Timeout {
            rank,
            op,
            elapsed,
            waiting_on: peer.into_iter().collect(),
        },
        Stop::Failed {
            status: Some(status),
            message,
        } if peer_failure(status) => match peer {
            Some(peer) => Error::PeerLost {
                rank,
                peer,
                op,
                reason: message,
            },
            None => Error::PeerLostUnidentified {
                rank,
                op,
                reason: message,
            },
        },
        Stop::Failed { message, .. } => Error::Nccl {
            rank,
            message: format!("{op}: {message}"),
        },
    }
}

/// True for the NCCL statuses that mean a peer or the connection to it failed.
pub(crate) fn peer_failure(status: Status) -> bool {
    matches!(status, sys::REMOTE_ERROR | sys::SYSTEM_ERROR)
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
        let types: std::collections::HashSet<DataType> =
            DType::ALL.iter().map(|&d| nccl_dtype(d)).collect();
        assert_eq!(types.len(), DType::ALL.len());
        let ops: std::collections::HashSet<RedOp> =
            ReduceOp::ALL.iter().map(|&o| nccl_op(o)).collect();
        assert_eq!(ops.len(), ReduceOp::ALL.len());
        // The values of nccl.h.
        assert_eq!(nccl_dtype(DType::U8), 1);
        assert_eq!(nccl_dtype(DType::F16), 6);
        assert_eq!(nccl_dtype(DType::BF16), 9);
        assert_eq!(nccl_op(ReduceOp::Min), 3);
        assert_eq!(nccl_op(ReduceOp::Avg), 4);
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
    fn only_a_single_peer_is_named_as_waited_on() {
        let b = || Buffer::zeros(DType::U8, 1);
        let gather = |root| Collective::Gather {
            buf: b(),
            root,
            out: None,
        };
        let table: Vec<(Collective, usize, Vec<usize>)> = vec![
            (Collective::Send { buf: b(), peer: 2 }, 0, vec![2]),
            (Collective::Recv { buf: b(), peer: 0 }, 3, vec![0]),
            (gather(3), 1, vec![3]),
            (gather(1), 1, vec![]),
            (Collective::Broadcast { buf: b(), root: 2 }, 0, vec![2]),
            (Collective::Broadcast { buf: b(), root: 0 }, 0, vec![]),
            (
                Collective::AllReduce {
                    buf: b(),
                    op: ReduceOp::Sum,
                },
                2,
                vec![],
            ),
            (
                Collective::AllToAll {
                    buf: b(),
                    out: None,
                },
                0,
                vec![],
            ),
            (Collective::Barrier, 2, vec![]),
        ];
        for (op, rank, want) in table {
            assert_eq!(
                single_peer(&op, rank).into_iter().collect::<Vec<_>>(),
                want,
                "{} on rank {rank}",
                op.name()
            );
        }
    }

    #[test]
    fn failures_map_to_the_errors_the_loop_acts_on() {
        let t = Duration::from_secs(3);
        let failed = |status: Option<Status>| Stop::Failed {
            status,
            message: "boom".into(),
        };
        let e = op_error(1, "all_reduce", None, t, Stop::TimedOut(t));
        assert!(
            matches!(&e, Error::Timeout { waiting_on, rank: 1, .. } if waiting_on.is_empty()),
            "{e}"
        );
        let e = op_error(1, "recv", Some(0), t, Stop::TimedOut(t));
        assert!(
            matches!(&e, Error::Timeout { waiting_on, .. } if waiting_on == &[0]),
            "{e}"
        );
        let e = op_error(1, "all_reduce", None, t, failed(Some(sys::TIMEOUT)));
        assert!(
            matches!(&e, Error::Timeout { waiting_on, elapsed, .. } if waiting_on.is_empty() && *elapsed == t),
            "{e}"
        );
        for status in [sys::REMOTE_ERROR, sys::SYSTEM_ERROR] {
            let e = op_error(1, "send", Some(2), t, failed(Some(status)));
            assert!(
                matches!(
                    &e,
                    Error::PeerLost {
                        peer: 2,
                        rank: 1,
                        op: "send",
                        ..
                    }
                ),
                "{e}"
            );
            let e = op_error(1, "all_gather", None, t, failed(Some(status)));
            assert!(
                matches!(
                    &e,
                    Error::PeerLostUnidentified {
                        rank: 1,
                        op: "all_gather",
                        ..
                    }
                ),
                "{e}"
            );
        }
        for status in [
            Some(sys::INTERNAL_ERROR),
            Some(sys::UNHANDLED_CUDA_ERROR),
            Some(sys::INVALID_USAGE),
            Some(42),
            None,
        ] {
            let e = op_error(1, "send", Some(2), t, failed(status));
            assert!(matches!(&e, Error::Nccl { rank: 1, .. }), "{e}");
            assert!(e.to_string().contains("send: boom"), "{e}");
        }
        assert!(matches!(
            op_error(4, "barrier", None, t, Stop::Aborted),
            Error::Aborted { rank: 4 }
        ));
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
