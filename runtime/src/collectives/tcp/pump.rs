//! The two pumps: one moves an outgoing lane into its peer's transport, one moves an incoming
//! lane out of it, whatever the transport (TCP frames or a shared-memory ring).

use super::plan::{InLane, Mode, OutLane, Region};
use super::transport::{Delivery, Inbound, LinkError, Outbound, Received};
use super::wire::{Header, HEADER_LEN};
use crate::collectives::reduce::{finish_avg, ReduceOp};
use crate::dtype::DType;

/// Received bytes are copied out of a ring (or out of a decrypted frame) with streaming
/// stores into buffers of at least this size (see [`crate::bulk_copy`]): with the sender's
/// buffer and the rings competing for the last-level cache, such a destination is mostly
/// evicted before the caller reads it. Measured on the project's VM (32 MiB L3): at 16 MiB
/// streaming sped up 2-rank broadcast 1.9x and 2- and 4-rank all-reduce by a quarter; at
/// 1 MiB, which stays in cache, it slowed the all-reduce by a third (docs/benchmarks.md).
const STREAM_REGION_BYTES: usize = 16 << 20;

/// What a pump did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Pumped {
    /// Some segment moved forward.
    pub progressed: bool,
    /// The lane waits on its transport (not on a dependency, and not finished).
    pub blocked: bool,
}

/// Why a lane failed.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The transport failed.
    Link(LinkError),
    /// The peer's header differs from the one expected: the ranks are out of step.
    Mismatch(String),
}

impl From<LinkError> for Fault {
    fn from(e: LinkError) -> Self {
        Fault::Link(e)
    }
}

/// The element type and reduction of the operation, for reducing lanes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reduction {
    pub dtype: DType,
    pub op: ReduceOp,
    pub world: usize,
}

fn check_header(l: &InLane) -> Result<(), Fault> {
    let Some(got) = Header::decode(&l.hdr) else {
        return Err(Fault::Mismatch(
            "the peer sent bytes that are not a rekindle header".into(),
        ));
    };
    if got != l.expect {
        return Err(Fault::Mismatch(format!(
            "expected {}, the peer sent {}",
            l.expect.describe(),
            got.describe()
        )));
    }
    Ok(())
}

/// Moves what has arrived for `l` into place: copies, or reduces (finishing averages once an
/// element's sum is complete).
pub(crate) fn pump_in(
    inb: &mut Inbound,
    l: &mut InLane,
    regions: &[Region],
    red: Reduction,
) -> Result<Pumped, Fault> {
    let mut done = Pumped::default();
    loop {
        let got = if l.seg == 0 {
            let how = Delivery::Copy { streaming: false };
            inb.deliver(&mut l.hdr[l.off..], how)?
        } else {
            let Some(item) = l.items.get(l.seg - 1) else {
                return Ok(done);
            };
            let region = &regions[item.region];
            // SAFETY: the plan's bounds were checked; the region's buffer outlives the run and
            // no other view of these bytes exists during this call.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(region.ptr.add(item.start + l.off), item.len - l.off)
            };
            let how = match item.mode {
                Mode::Copy => Delivery::Copy {
                    streaming: region.len >= STREAM_REGION_BYTES,
                },
                Mode::Reduce | Mode::ReduceFinish => Delivery::Combine {
                    dtype: red.dtype,
                    op: red.op,
                },
            };
            inb.deliver(dst, how)?
        };
        let n = match got {
            Received::Delivered(n) => n,
            Received::Blocked => {
                done.blocked = true;
                return Ok(done);
            }
        };
        done.progressed = true;
        l.off += n;
        if l.seg == 0 {
            if l.off == HEADER_LEN {
                check_header(l)?;
                l.seg = 1;
                l.off = 0;
            }
            continue;
        }
        let item = &l.items[l.seg - 1];
        if l.off == item.len {
            if item.mode == Mode::ReduceFinish {
                let region = &regions[item.region];
                // SAFETY: as above, the whole item.
                let whole =
                    unsafe { std::slice::from_raw_parts_mut(region.ptr.add(item.start), item.len) };
                finish_avg(red.op, red.dtype, whole, red.world);
            }
            l.seg += 1;
            l.off = 0;
        }
    }
}

/// Moves `l`'s bytes into its transport as far as their dependencies allow: a send waits until
/// lane `l.dep` of `in_done` (items processed per incoming lane) has processed its `after`.
pub(crate) fn pump_out(
    out: &mut Outbound,
    l: &mut OutLane,
    regions: &[Region],
    in_done: &[usize],
) -> Result<Pumped, Fault> {
    let mut done = Pumped::default();
    loop {
        let hdr = l.hdr;
        let (src, streaming): (&[u8], bool) = if l.seg == 0 {
            (&hdr[l.off..], false)
        } else {
            let ready = l.items.get(l.seg - 1).filter(|item| {
                l.dep
                    .and_then(|d| in_done.get(d))
                    .is_none_or(|&have| have >= item.after)
            });
            match ready {
                Some(item) => {
                    let region = &regions[item.region];
                    // SAFETY: bounds checked; the bytes are complete input or received data
                    // that nothing writes during the operation.
                    let src = unsafe {
                        std::slice::from_raw_parts(
                            region.ptr.add(item.start + l.off),
                            item.len - l.off,
                        )
                    };
                    (src, l.streaming)
                }
                // Finished, or waiting on a dependency: still push out what the transport
                // holds (a frame's tag), which the peer may need before it can go on.
                None => {
                    let s = out.send(&[], false)?;
                    done.blocked = s.blocked;
                    return Ok(done);
                }
            }
        };
        let len = src.len();
        let s = out.send(src, streaming)?;
        done.progressed |= s.taken > 0;
        l.off += s.taken;
        if s.taken == len {
            l.seg += 1;
            l.off = 0;
        }
        if s.blocked || s.taken < len {
            done.blocked = true;
            return Ok(done);
        }
    }
}
