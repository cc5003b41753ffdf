//! The collective algorithms, each expressed as a [`Plan`] for the engine.
//!
//! - all_reduce: ring reduce-scatter + all-gather, chunked and pipelined, for large buffers; for
//!   buffers up to `small_message_bytes`, one direct exchange with every peer followed by a
//!   local reduction in rank order (one network hop instead of 2(n-1)).
//! - reduce_scatter and all_gather: the two halves of the ring.
//! - broadcast and reduce: a pipelined chain from (or to) the root.
//! - scatter, gather, all_to_all, send/recv, barrier: direct transfers.
//!
//! Every algorithm fixes the order in which each element is combined, and an element's final
//! value is computed on one rank and copied to the others, so results are bit-identical on
//! every rank and every run for the same inputs and world size.

use std::ops::Range;
use std::time::Instant;

use super::engine::Mesh;
use super::plan::{Mode, Plan};
use super::wire::algo::{CHAIN as ALGO_CHAIN, DIRECT as ALGO_DIRECT, RING as ALGO_RING};
use super::wire::kind::{
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, GATHER, P2P, REDUCE, REDUCE_SCATTER,
    SCATTER,
};
use super::wire::{redop_code, Header};
use super::TcpOptions;
use crate::buffer::Buffer;
use crate::collectives::reduce::{combine, finish_avg, ReduceOp};
use crate::collectives::{output, segment, Collective};
use crate::error::{Error, Result};

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

/// Byte ranges of at most `chunk_bytes` (a multiple of `w`) covering elements `elems`.
fn chunks(
    elems: Range<usize>,
    w: usize,
    chunk_bytes: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let chunk = (chunk_bytes / w).max(1) * w;
    let (start, end) = (elems.start * w, elems.end * w);
    (start..end)
        .step_by(chunk)
        .map(move |s| (s, chunk.min(end - s)))
}

struct Ctx<'a> {
    rank: usize,
    world: usize,
    opts: &'a TcpOptions,
}

impl Ctx<'_> {
    fn header(
        &self,
        kind: u8,
        algo: u8,
        buf: &Buffer,
        redop: u8,
        nbytes: usize,
        aux: usize,
    ) -> Header {
        Header {
            kind,
            dtype: buf.dtype().code(),
            redop,
            algo,
            seq: 0,
            nbytes: nbytes as u64,
            aux: aux as u64,
            // Ring and chain items are cut at this size: peers must agree on it.
            chunk: if algo == ALGO_DIRECT {
                0
            } else {
                self.opts.max_segment_bytes as u64
            },
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(invalid(
                op,
                format!("root {root} is not below world size {}", self.world),
            ));
        }
        Ok(())
    }
}

/// Runs one collective to completion.
pub(crate) fn execute(
    mesh: &mut Mesh,
    opts: &TcpOptions,
    op: Collective,
    deadline: Instant,
) -> Result<Buffer> {
    let ctx = Ctx {
        rank: mesh.rank,
        world: mesh.world,
        opts,
    };
    let name = op.name();
    match op {
        Collective::AllReduce { mut buf, op } => {
            if ctx.world > 1 {
                if buf.size_in_bytes() <= opts.small_message_bytes {
                    all_reduce_direct(mesh, &ctx, &mut buf, op, deadline)?;
                } else {
                    let len = buf.len();
                    let segs: Vec<_> = (0..ctx.world).map(|j| segment(len, ctx.world, j)).collect();
                    let hdr = ctx.header(
                        ALL_REDUCE,
                        ALGO_RING,
                        &buf,
                        redop_code(op),
                        buf.size_in_bytes(),
                        0,
                    );
                    ring(
                        mesh,
                        &ctx,
                        &mut buf,
                        &segs,
                        2 * (ctx.world - 1),
                        0,
                        ctx.world - 1,
                        op,
                        hdr,
                        name,
                        deadline,
                    )?;
                }
            }
            Ok(buf)
        }
        Collective::ReduceScatter { mut buf, op, out } => {
            let len = buf.len();
            let mut out = output(
                out,
                buf.dtype(),
                segment(len, ctx.world, ctx.rank).len(),
                name,
            )?;
            let segs: Vec<_> = (0..ctx.world).map(|j| segment(len, ctx.world, j)).collect();
            if ctx.world > 1 {
                let hdr = ctx.header(
                    REDUCE_SCATTER,
                    ALGO_RING,
                    &buf,
                    redop_code(op),
                    buf.size_in_bytes(),
                    0,
                );
                ring(
                    mesh,
                    &ctx,
                    &mut buf,
                    &segs,
                    ctx.world - 1,
                    ctx.world - 1,
                    ctx.world - 1,
                    op,
                    hdr,
                    name,
                    deadline,
                )?;
            }
            let mine = &segs[ctx.rank];
            let w = buf.dtype().size_in_bytes();
            out.as_bytes_mut()
                .copy_from_slice(&buf.as_bytes()[mine.start * w..mine.end * w]);
            Ok(out)
        }
        Collective::AllGather { buf, out } => {
            let (n, c, w) = (ctx.world, buf.len(), buf.dtype().size_in_bytes());
            let mut out = output(out, buf.dtype(), n * c, name)?;
            out.as_bytes_mut()[ctx.rank * c * w..(ctx.rank + 1) * c * w]
                .copy_from_slice(buf.as_bytes());
            if n > 1 {
                let segs: Vec<_> = (0..n).map(|j| j * c..(j + 1) * c).collect();
                let hdr = ctx.header(ALL_GATHER, ALGO_RING, &buf, 0, buf.size_in_bytes(), 0);
                ring(
                    mesh,
                    &ctx,
                    &mut out,
                    &segs,
                    n - 1,
                    0,
                    0,
                    ReduceOp::Sum,
                    hdr,
                    name,
                    deadline,
                )?;
            }
            Ok(out)
        }
        Collective::Broadcast { mut buf, root } => {
            ctx.check_root(name, root)?;
            let hdr = ctx.header(BROADCAST, ALGO_CHAIN, &buf, 0, buf.size_in_bytes(), root);
            let pos = (ctx.rank + ctx.world - root) % ctx.world;
            chain(
                mesh,
                &ctx,
                &mut buf,
                pos,
                Mode::Copy,
                ReduceOp::Sum,
                hdr,
                name,
                deadline,
            )?;
            Ok(buf)
        }
        Collective::Reduce { mut buf, op, root } => {
            ctx.check_root(name, root)?;
            let hdr = ctx.header(
                REDUCE,
                ALGO_CHAIN,
                &buf,
                redop_code(op),
                buf.size_in_bytes(),
                root,
            );
            // The chain starts after the root and ends at it.
            let pos = (ctx.rank + 2 * ctx.world - root - 1) % ctx.world;
            let mode = if pos == ctx.world - 1 {
                Mode::ReduceFinish
            } else {
                Mode::Reduce
            };
            chain(mesh, &ctx, &mut buf, pos, mode, op, hdr, name, deadline)?;
            Ok(buf)
        }
        Collective::Scatter { mut buf, root } => {
            ctx.check_root(name, root)?;
            let w = buf.dtype().size_in_bytes();
            let mut plan = Plan::new(buf.dtype(), ReduceOp::Sum, ctx.world);
            if ctx.rank == root {
                let c = buf.len();
                let mine = segment(c, ctx.world, root);
                let mut out = Buffer::zeros(buf.dtype(), mine.len());
                out.as_bytes_mut()
                    .copy_from_slice(&buf.as_bytes()[mine.start * w..mine.end * w]);
                let r = plan.region(&mut buf);
                for j in (0..ctx.world).filter(|j| *j != root) {
                    let s = segment(c, ctx.world, j);
                    let hdr = ctx.header(SCATTER, ALGO_DIRECT, &buf, 0, s.len() * w, root);
                    let l = plan.out_lane(j, None, hdr);
                    plan.send(l, r, s.start * w, s.len() * w, 0);
                }
                mesh.run(&mut plan, name, deadline)?;
                Ok(out)
            } else {
                let hdr = ctx.header(SCATTER, ALGO_DIRECT, &buf, 0, buf.size_in_bytes(), root);
                let bytes = buf.size_in_bytes();
                let r = plan.region(&mut buf);
                let l = plan.in_lane(root, hdr);
                plan.recv(l, r, 0, bytes, Mode::Copy);
                mesh.run(&mut plan, name, deadline)?;
                Ok(buf)
            }
        }
        Collective::Gather { mut buf, root, out } => {
            ctx.check_root(name, root)?;
            let (c, w) = (buf.len(), buf.dtype().size_in_bytes());
            let hdr = ctx.header(GATHER, ALGO_DIRECT, &buf, 0, c * w, root);
            let mut plan = Plan::new(buf.dtype(), ReduceOp::Sum, ctx.world);
            if ctx.rank == root {
                let mut out = output(out, buf.dtype(), ctx.world * c, name)?;
                out.as_bytes_mut()[root * c * w..(root + 1) * c * w]
                    .copy_from_slice(buf.as_bytes());
                let r = plan.region(&mut out);
                for j in (0..ctx.world).filter(|j| *j != root) {
                    let l = plan.in_lane(j, hdr);
                    plan.recv(l, r, j * c * w, c * w, Mode::Copy);
                }
                mesh.run(&mut plan, name, deadline)?;
                Ok(out)
            } else {
                let r = plan.region(&mut buf);
                let l = plan.out_lane(root, None, hdr);
                plan.send(l, r, 0, c * w, 0);
                mesh.run(&mut plan, name, deadline)?;
                Ok(buf)
            }
        }
        Collective::AllToAll { mut buf, out } => {
            let (n, c, w) = (ctx.world, buf.len(), buf.dtype().size_in_bytes());
            let mine = segment(c, n, ctx.rank);
            let block = mine.len() * w;
            let mut out = output(out, buf.dtype(), n * mine.len(), name)?;
            out.as_bytes_mut()[ctx.rank * block..(ctx.rank + 1) * block]
                .copy_from_slice(&buf.as_bytes()[mine.start * w..mine.end * w]);
            let hdr = ctx.header(ALL_TO_ALL, ALGO_DIRECT, &buf, 0, c * w, 0);
            let mut plan = Plan::new(buf.dtype(), ReduceOp::Sum, n);
            let rin = plan.region(&mut buf);
            let rout = plan.region(&mut out);
            for j in (0..n).filter(|j| *j != ctx.rank) {
                let s = segment(c, n, j);
                let lo = plan.out_lane(j, None, hdr);
                plan.send(lo, rin, s.start * w, s.len() * w, 0);
                let li = plan.in_lane(j, hdr);
                plan.recv(li, rout, j * block, block, Mode::Copy);
            }
            mesh.run(&mut plan, name, deadline)?;
            Ok(out)
        }
        Collective::Send { mut buf, peer } | Collective::Recv { mut buf, peer } => {
            let sending = name == "send";
            if peer >= ctx.world || peer == ctx.rank {
                return Err(invalid(
                    name,
                    format!("peer {peer} is not another rank of {}", ctx.world),
                ));
            }
            let hdr = ctx.header(P2P, ALGO_DIRECT, &buf, 0, buf.size_in_bytes(), 0);
            let bytes = buf.size_in_bytes();
            let mut plan = Plan::new(buf.dtype(), ReduceOp::Sum, ctx.world);
            plan.point_to_point();
            let r = plan.region(&mut buf);
            if sending {
                let l = plan.out_lane(peer, None, hdr);
                plan.send(l, r, 0, bytes, 0);
            } else {
                let l = plan.in_lane(peer, hdr);
                plan.recv(l, r, 0, bytes, Mode::Copy);
            }
            mesh.run(&mut plan, name, deadline)?;
            Ok(buf)
        }
        Collective::Barrier => {
            let buf = Buffer::U8(Vec::new());
            let hdr = ctx.header(BARRIER, ALGO_DIRECT, &buf, 0, 0, 0);
            let mut plan = Plan::new(buf.dtype(), ReduceOp::Sum, ctx.world);
            for j in (0..ctx.world).filter(|j| *j != ctx.rank) {
                plan.out_lane(j, None, hdr);
                plan.in_lane(j, hdr);
            }
            mesh.run(&mut plan, name, deadline)?;
            Ok(buf)
        }
    }
}

/// Every rank sends its whole buffer to every peer, then reduces all n buffers in rank order.
fn all_reduce_direct(
    mesh: &mut Mesh,
    ctx: &Ctx<'_>,
    buf: &mut Buffer,
    op: ReduceOp,
    deadline: Instant,
) -> Result<()> {
    let (n, bytes) = (ctx.world, buf.size_in_bytes());
    let dtype = buf.dtype();
    let mut scratch = Buffer::zeros(dtype, buf.len() * (n - 1));
    let hdr = ctx.header(ALL_REDUCE, ALGO_DIRECT, buf, redop_code(op), bytes, 0);
    let mut plan = Plan::new(dtype, op, n);
    let rb = plan.region(buf);
    let rs = plan.region(&mut scratch);
    let slot = |p: usize| if p < ctx.rank { p } else { p - 1 };
    for p in (0..n).filter(|p| *p != ctx.rank) {
        let lo = plan.out_lane(p, None, hdr);
        plan.send(lo, rb, 0, bytes, 0);
        let li = plan.in_lane(p, hdr);
        plan.recv(li, rs, slot(p) * bytes, bytes, Mode::Copy);
    }
    mesh.run(&mut plan, "all_reduce", deadline)?;
    drop(plan);
    let mut acc = Buffer::zeros(dtype, buf.len());
    {
        let data = |p: usize| -> &[u8] {
            if p == ctx.rank {
                buf.as_bytes()
            } else {
                &scratch.as_bytes()[slot(p) * bytes..(slot(p) + 1) * bytes]
            }
        };
        acc.as_bytes_mut().copy_from_slice(data(0));
        for p in 1..n {
            combine(op, dtype, acc.as_bytes_mut(), data(p));
        }
    }
    finish_avg(op, dtype, acc.as_bytes_mut(), n);
    *buf = acc;
    Ok(())
}

/// A ring over `segs` (element ranges of `buf`, one per rank): at step `s` rank `r` sends
/// segment `r - s + shift` to `r + 1` and receives segment `r - s - 1 + shift` from `r - 1`
/// (mod n). Steps below `reduce_steps` reduce what they receive (the last of them finishes an
/// average); later steps copy. Chunks are forwarded as soon as they were received.
#[allow(clippy::too_many_arguments)]
fn ring(
    mesh: &mut Mesh,
    ctx: &Ctx<'_>,
    buf: &mut Buffer,
    segs: &[Range<usize>],
    steps: usize,
    shift: usize,
    reduce_steps: usize,
    op: ReduceOp,
    hdr: Header,
    name: &'static str,
    deadline: Instant,
) -> Result<()> {
    let (r, n) = (ctx.rank, ctx.world);
    let w = buf.dtype().size_in_bytes();
    let chunk = ctx.opts.max_segment_bytes;
    let mut plan = Plan::new(buf.dtype(), op, n);
    let region = plan.region(buf);
    let inl = plan.in_lane((r + n - 1) % n, hdr);
    let outl = plan.out_lane((r + 1) % n, Some(inl), hdr);
    let send_seg = |s: usize| (r + shift + 2 * n - s) % n;
    let recv_seg = |s: usize| (r + shift + 2 * n - s - 1) % n;
    // Items are ordered by `chunk + step * RING_LAG`, not step by step: a chunk is forwarded
    // a few chunks after it arrived, while it is still in cache, instead of after the whole
    // step. A send depends only on a receive of the previous step with a smaller key, which
    // the previous rank sends earlier in its own stream, so no cycle of waits can form.
    let order = |step: usize, k: usize| (k + step * RING_LAG, step);
    let mut recvs: Vec<(RingKey, usize, usize, usize, Mode)> = Vec::new();
    for s in 0..steps {
        let mode = if s + 1 < reduce_steps {
            Mode::Reduce
        } else if s + 1 == reduce_steps {
            Mode::ReduceFinish
        } else {
            Mode::Copy
        };
        for (k, (start, len)) in chunks(segs[recv_seg(s)].clone(), w, chunk).enumerate() {
            recvs.push((order(s, k), k, start, len, mode));
        }
    }
    recvs.sort_by_key(|x| x.0);
    // Where each (step, chunk) lands in the receive lane.
    let mut recv_pos: Vec<Vec<usize>> = vec![Vec::new(); steps];
    for (pos, &((_, s), k, start, len, mode)) in recvs.iter().enumerate() {
        if recv_pos[s].len() <= k {
            recv_pos[s].resize(k + 1, 0);
        }
        recv_pos[s][k] = pos;
        plan.recv(inl, region, start, len, mode);
    }
    // Step 0 sends this rank's own data; every later step forwards, chunk for chunk, what the
    // previous step received.
    let mut sends: Vec<(RingKey, usize, usize, usize)> = Vec::new();
    for s in 0..steps {
        for (k, (start, len)) in chunks(segs[send_seg(s)].clone(), w, chunk).enumerate() {
            sends.push((order(s, k), k, start, len));
        }
    }
    sends.sort_by_key(|x| x.0);
    for ((_, s), k, start, len) in sends {
        let after = match s {
            0 => 0,
            _ => match recv_pos[s - 1].get(k) {
                Some(pos) => pos + 1,
                None => {
                    return Err(Error::InvalidArgument {
                        op: name,
                        reason: "internal: ring chunk without a source".into(),
                    })
                }
            },
        };
        plan.send(outl, region, start, len, after);
    }
    mesh.run(&mut plan, name, deadline)
}

/// The position of a ring item in its lane: (chunk + step * RING_LAG, step).
type RingKey = (usize, usize);

/// How many chunks a ring step runs ahead of the next one (see `ring`).
const RING_LAG: usize = 2;

/// A pipelined chain: position 0 sends, each later position receives chunk by chunk from the
/// previous one (copying or reducing into its buffer) and forwards to the next.
#[allow(clippy::too_many_arguments)]
fn chain(
    mesh: &mut Mesh,
    ctx: &Ctx<'_>,
    buf: &mut Buffer,
    pos: usize,
    mode: Mode,
    op: ReduceOp,
    hdr: Header,
    name: &'static str,
    deadline: Instant,
) -> Result<()> {
    let (r, n) = (ctx.rank, ctx.world);
    if n == 1 {
        return Ok(());
    }
    let w = buf.dtype().size_in_bytes();
    let items: Vec<_> = chunks(0..buf.len(), w, ctx.opts.max_segment_bytes).collect();
    let mut plan = Plan::new(buf.dtype(), op, n);
    let region = plan.region(buf);
    let inl = (pos > 0).then(|| plan.in_lane((r + n - 1) % n, hdr));
    if let Some(l) = inl {
        for &(start, len) in &items {
            plan.recv(l, region, start, len, mode);
        }
    }
    if pos < n - 1 {
        let l = plan.out_lane((r + 1) % n, inl, hdr);
        for (i, &(start, len)) in items.iter().enumerate() {
            plan.send(l, region, start, len, if inl.is_some() { i + 1 } else { 0 });
        }
    }
    mesh.run(&mut plan, name, deadline)
}
