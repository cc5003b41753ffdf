//! What one operation moves: a [`Plan`] of lanes, built by the algorithms and run by the
//! engine.
//!
//! Per peer, an outgoing lane of byte ranges to send and an incoming lane of byte ranges to
//! receive, each range either copied in place or reduced into place. A lane's first segment is
//! the operation header ([`Header`]), then one segment per range. A send may depend on an
//! incoming lane having processed a number of ranges, which is how ring and chain algorithms
//! forward a chunk as soon as it arrived (and was reduced).

use super::wire::{Header, HEADER_LEN};
use super::write_mode::Choice;
use crate::buffer::Buffer;
use crate::collectives::reduce::ReduceOp;
use crate::dtype::DType;

/// What to do with a received range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Receive straight into place.
    Copy,
    /// `dst = op(dst, received)`.
    Reduce,
    /// As `Reduce`, then divide by the world size for `Avg`: the element's sum is complete.
    ReduceFinish,
}

/// A raw view of a buffer the caller owns.
pub(crate) struct Region {
    pub ptr: *mut u8,
    pub len: usize,
}

pub(crate) struct SendItem {
    pub region: usize,
    pub start: usize,
    pub len: usize,
    /// The dependency lane must have processed at least this many items first.
    pub after: usize,
}

pub(crate) struct RecvItem {
    pub region: usize,
    pub start: usize,
    pub len: usize,
    pub mode: Mode,
}

/// Bytes to one peer. Segment 0 is the header, segment `i > 0` is `items[i - 1]`.
pub(crate) struct OutLane {
    pub peer: usize,
    pub dep: Option<usize>,
    pub header: Header,
    pub hdr: [u8; HEADER_LEN],
    pub items: Vec<SendItem>,
    /// The segment being sent, and the bytes of it taken by the transport.
    pub seg: usize,
    pub off: usize,
    /// Write into a shared-memory ring with streaming stores (set by the engine, see
    /// [`super::write_mode`]).
    pub streaming: bool,
}

/// Bytes from one peer. Segment 0 is the header, segment `i > 0` is `items[i - 1]`.
pub(crate) struct InLane {
    pub peer: usize,
    pub expect: Header,
    pub hdr: [u8; HEADER_LEN],
    pub items: Vec<RecvItem>,
    /// The segment being received, and the bytes of it delivered.
    pub seg: usize,
    pub off: usize,
}

impl OutLane {
    /// Every segment was taken by the transport.
    pub(crate) fn taken(&self) -> bool {
        self.seg > self.items.len()
    }
}

impl InLane {
    /// Items completely received (and reduced).
    pub(crate) fn items_done(&self) -> usize {
        self.seg.saturating_sub(1)
    }

    /// Every segment was delivered.
    pub(crate) fn done(&self) -> bool {
        self.seg > self.items.len()
    }
}

/// The transfers of one operation. Regions are raw views of buffers the caller owns and keeps
/// alive, unmoved and otherwise untouched, until the engine's `run` returns.
pub(crate) struct Plan {
    /// Zeros sent, and scratch received, to keep each shared-memory lane 8-byte aligned.
    pad: Buffer,
    /// True when every rank takes part (all but send/recv): any lost rank fails it.
    pub group_wide: bool,
    pub regions: Vec<Region>,
    pub outs: Vec<OutLane>,
    pub ins: Vec<InLane>,
    pub dtype: DType,
    pub op: ReduceOp,
    pub world: usize,
    /// How this run writes its large shared-memory lanes (set by the engine).
    pub write_choice: Option<Choice>,
}

impl Plan {
    pub(crate) fn new(dtype: DType, op: ReduceOp, world: usize) -> Plan {
        Plan {
            pad: Buffer::U8(vec![0; 16]),
            group_wide: true,
            regions: Vec::new(),
            outs: Vec::new(),
            ins: Vec::new(),
            dtype,
            op,
            world,
            write_choice: None,
        }
    }

    /// Marks the plan as point-to-point: only its own peers' loss fails it.
    pub(crate) fn point_to_point(&mut self) {
        self.group_wide = false;
    }

    /// True if losing `peer` fails the plan.
    pub(crate) fn needs(&self, peer: usize) -> bool {
        self.group_wide
            || self.ins.iter().any(|l| l.peer == peer)
            || self.outs.iter().any(|l| l.peer == peer)
    }

    /// Registers the plan's own padding buffer (zeros to send, scratch to receive into).
    pub(crate) fn pad_region(&mut self) -> usize {
        let bytes = self.pad.as_bytes_mut();
        self.regions.push(Region {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        });
        self.regions.len() - 1
    }

    /// Registers a buffer; the returned id names it in items.
    pub(crate) fn region(&mut self, buf: &mut Buffer) -> usize {
        let bytes = buf.as_bytes_mut();
        self.regions.push(Region {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        });
        self.regions.len() - 1
    }

    pub(crate) fn out_lane(&mut self, peer: usize, dep: Option<usize>, header: Header) -> usize {
        self.outs.push(OutLane {
            peer,
            dep,
            header,
            hdr: [0; HEADER_LEN],
            items: Vec::new(),
            seg: 0,
            off: 0,
            streaming: false,
        });
        self.outs.len() - 1
    }

    pub(crate) fn in_lane(&mut self, peer: usize, expect: Header) -> usize {
        self.ins.push(InLane {
            peer,
            expect,
            hdr: [0; HEADER_LEN],
            items: Vec::new(),
            seg: 0,
            off: 0,
        });
        self.ins.len() - 1
    }

    /// Queues `len` bytes at `start` of `region` on an outgoing lane, to be sent once the
    /// lane's dependency has processed `after` items.
    pub(crate) fn send(
        &mut self,
        lane: usize,
        region: usize,
        start: usize,
        len: usize,
        after: usize,
    ) {
        if len > 0 {
            self.outs[lane].items.push(SendItem {
                region,
                start,
                len,
                after,
            });
        }
    }

    /// Queues `len` bytes at `start` of `region` on an incoming lane.
    pub(crate) fn recv(
        &mut self,
        lane: usize,
        region: usize,
        start: usize,
        len: usize,
        mode: Mode,
    ) {
        if len > 0 {
            self.ins[lane].items.push(RecvItem {
                region,
                start,
                len,
                mode,
            });
        }
    }

    /// True if every item lies inside its region.
    pub(crate) fn check_bounds(&self) -> bool {
        let ok = |region: usize, start: usize, len: usize| {
            self.regions
                .get(region)
                .is_some_and(|r| start.checked_add(len).is_some_and(|end| end <= r.len))
        };
        self.outs
            .iter()
            .all(|l| l.items.iter().all(|i| ok(i.region, i.start, i.len)))
            && self
                .ins
                .iter()
                .all(|l| l.items.iter().all(|i| ok(i.region, i.start, i.len)))
    }
}
