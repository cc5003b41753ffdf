//! The progress engine: runs one operation's transfers over the mesh, all at once.
//!
//! An operation is a [`Plan`]: per peer, an outgoing lane of byte ranges to send and an
//! incoming lane of byte ranges to receive, each range either copied in place or reduced into
//! place through a one-chunk staging buffer. A send may depend on an incoming lane having
//! processed a number of ranges, which is how ring and chain algorithms forward a chunk as soon
//! as it arrived (and was reduced): sending, receiving and reducing overlap chunk by chunk, and
//! both directions of a socket are used at once. One thread drives every lane with
//! non-blocking I/O and `poll(2)`, which also watches every other peer's socket so that a dead
//! rank is noticed even when the current operation does not talk to it.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bootstrap::PeerLinks;
use super::link::{self, Io};
use super::shm::ShmPair;
use super::write_mode::{Choice, WriteModes, MIN_LANE_BYTES};
use crate::buffer::Buffer;
use crate::bulk_copy::copy_streaming;
use crate::collectives::reduce::{combine, finish_avg, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Bytes of the header that opens every lane.
pub(crate) const HEADER_LEN: usize = 32;
const MAGIC: u32 = 0x524b_444c; // "RKDL"

/// What an operation tells a peer about itself, so ranks that issued different operations
/// (or sizes, dtypes, roots) fail with [`Error::Mismatch`] instead of exchanging garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub dtype: u8,
    pub redop: u8,
    pub algo: u8,
    pub seq: u64,
    pub nbytes: u64,
    pub aux: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind;
        b[5] = self.dtype;
        b[6] = self.redop;
        b[7] = self.algo;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.nbytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut m = [0u8; 4];
        m.copy_from_slice(&b[0..4]);
        (u32::from_le_bytes(m) == MAGIC).then(|| Header {
            kind: b[4],
            dtype: b[5],
            redop: b[6],
            algo: b[7],
            seq: u64_at(8),
            nbytes: u64_at(16),
            aux: u64_at(24),
        })
    }
}

/// What to do with a received range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Receive straight into place.
    Copy,
    /// Receive into staging, then `dst = op(dst, staged)`.
    Reduce,
    /// As `Reduce`, then divide by the world size for `Avg`: the element's sum is complete.
    ReduceFinish,
}

/// Received bytes are copied out of a ring with streaming stores into buffers of at least
/// this size (see [`crate::bulk_copy`]): with the sender's buffer and the rings competing for
/// the last-level cache, such a destination is mostly evicted before the caller reads it.
/// Measured on the project's VM (32 MiB L3): at 16 MiB streaming sped up 2-rank broadcast
/// 1.9x and 2- and 4-rank all-reduce by a quarter; at 1 MiB, which stays in cache, it slowed
/// the all-reduce by a third (docs/benchmarks.md).
const STREAM_REGION_BYTES: usize = 16 << 20;

struct Region {
    ptr: *mut u8,
    len: usize,
}

struct SendItem {
    region: usize,
    start: usize,
    len: usize,
    /// The dependency lane must have processed at least this many items first.
    after: usize,
}

struct RecvItem {
    region: usize,
    start: usize,
    len: usize,
    mode: Mode,
}

struct OutLane {
    peer: usize,
    dep: Option<usize>,
    header: Header,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    items: Vec<SendItem>,
    cur: usize,
    off: usize,
    /// Write into a shared-memory ring with streaming stores (set by `run`, see
    /// [`super::write_mode`]).
    streaming: bool,
}

struct InLane {
    peer: usize,
    expect: Header,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    items: Vec<RecvItem>,
    cur: usize,
    off: usize,
    staging: Option<Buffer>,
}

/// The transfers of one operation. Regions are raw views of buffers the caller owns and keeps
/// alive, unmoved and otherwise untouched, until [`Mesh::run`] returns.
pub(crate) struct Plan {
    /// Zeros sent, and scratch received, to keep each shared-memory lane 8-byte aligned.
    pad: Buffer,
    /// True when every rank takes part (all but send/recv): any lost rank fails it.
    group_wide: bool,
    regions: Vec<Region>,
    outs: Vec<OutLane>,
    ins: Vec<InLane>,
    dtype: DType,
    op: ReduceOp,
    world: usize,
    /// How this run writes its large shared-memory lanes (set by `Mesh::run`).
    write_choice: Option<Choice>,
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

    fn needs(&self, peer: usize) -> bool {
        self.group_wide
            || self.ins.iter().any(|l| l.peer == peer)
            || self.outs.iter().any(|l| l.peer == peer)
    }

    /// Registers the plan's own padding buffer (zeros to send, scratch to receive into).
    fn pad_region(&mut self) -> usize {
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
            hdr_off: 0,
            items: Vec::new(),
            cur: 0,
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
            hdr_off: 0,
            items: Vec::new(),
            cur: 0,
            off: 0,
            staging: None,
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
        debug_assert!(start + len <= self.regions[region].len);
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
        debug_assert!(start + len <= self.regions[region].len);
        if len > 0 {
            self.ins[lane].items.push(RecvItem {
                region,
                start,
                len,
                mode,
            });
        }
    }

    fn check_bounds(&self) -> bool {
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

/// What this rank knows of a peer's liveness, from the control connection.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    Alive,
    /// Said goodbye: it dropped its group in an orderly way.
    Departed,
    /// Its control connection closed without a goodbye: the process died or aborted.
    Dead(String),
}

/// Control messages: a kind byte, a rank (u32 LE) and a cause byte.
const CTRL_LEN: usize = 6;
const CTRL_GOODBYE: u8 = 1;
const CTRL_ABORT: u8 = 2;
const CTRL_HEARTBEAT: u8 = 3;

/// A heartbeat control message.
pub(crate) const HEARTBEAT: [u8; CTRL_LEN] = [CTRL_HEARTBEAT, 0, 0, 0, 0, 0];
/// A goodbye control message.
pub(crate) const GOODBYE: [u8; CTRL_LEN] = [CTRL_GOODBYE, 0, 0, 0, 0, 0];

/// Sends a control message to every peer.
pub(crate) type ControlSender = Arc<dyn Fn(&[u8; CTRL_LEN]) + Send + Sync>;

/// Sends one control message to every given control socket. Callers serialise sends (the
/// `Shared` mutex), so 6-byte messages never interleave.
pub(crate) fn broadcast_control(ctrl: &[TcpStream], msg: &[u8; CTRL_LEN]) {
    for s in ctrl {
        // Tiny and rare: a non-blocking send only fails if the peer is gone, which the peer's
        // own side notices anyway.
        let _ = link::send(s.as_raw_fd(), msg);
    }
}

/// Why a rank gave up on an operation, as told to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    Lost = 1,
    Timeout = 2,
    Mismatch = 3,
    Other = 4,
}

impl Cause {
    fn describe(code: u8) -> &'static str {
        match code {
            1 => "lost",
            2 => "timed out",
            3 => "out of step",
            _ => "failed",
        }
    }
}

struct Peer {
    data: TcpStream,
    ctrl: TcpStream,
    /// Shared-memory rings, when the peer is on this host; the data socket then carries only
    /// doorbells.
    shm: Option<ShmPair>,
    state: PeerState,
    /// When a control message (usually a heartbeat) was last read from it.
    last_heard: Instant,
    ctrl_buf: [u8; CTRL_LEN],
    ctrl_off: usize,
}

/// The connected peers of one rank, with per-direction sequence numbers.
pub(crate) struct Mesh {
    pub rank: usize,
    pub world: usize,
    links: Vec<Option<Peer>>,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    aborted: Arc<AtomicBool>,
    /// A failure another rank reported: (reporter, lost rank or None, cause code).
    notice: Option<(usize, Option<usize>, u8)>,
    /// Sends control messages (shared with the heartbeat thread).
    control: ControlSender,
    /// A peer silent for longer than this is presumed hung when naming a timeout's culprit.
    silence: Duration,
    /// Streaming or ordinary stores for large lanes into shared-memory rings, as measured.
    write_modes: WriteModes,
}

/// The longest single poll, so an abort is seen even if no socket event wakes us.
const POLL_SLICE: Duration = Duration::from_millis(50);

/// How long a rank blocked on a shared-memory ring keeps polling the ring before it asks for
/// a doorbell and sleeps. Waking a sleeping thread costs tens of microseconds (more on an idle
/// virtual machine), so a short wait is cheaper spent awake; the spin yields the CPU on every
/// turn, so a peer sharing this core (more ranks than cores) runs instead.
const SHM_SPIN: Duration = Duration::from_micros(500);

fn kind_name(kind: u8) -> &'static str {
    super::algorithms::kind_name(kind)
}

fn describe(h: &Header) -> String {
    format!(
        "{} (algo {}, dtype code {}, op code {}) of {} bytes, aux {}, seq {}",
        kind_name(h.kind),
        h.algo,
        h.dtype,
        h.redop,
        h.nbytes,
        h.aux,
        h.seq
    )
}

impl Mesh {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        links: Vec<Option<PeerLinks>>,
        aborted: Arc<AtomicBool>,
        control: ControlSender,
        silence: Duration,
    ) -> Mesh {
        let now = Instant::now();
        let links = links
            .into_iter()
            .map(|l| {
                l.map(|l| Peer {
                    data: l.data,
                    ctrl: l.ctrl,
                    shm: l.shm,
                    state: PeerState::Alive,
                    last_heard: now,
                    ctrl_buf: [0; CTRL_LEN],
                    ctrl_off: 0,
                })
            })
            .collect();
        Mesh {
            rank,
            world,
            links,
            send_seq: vec![0; world],
            recv_seq: vec![0; world],
            aborted,
            notice: None,
            control,
            silence,
            write_modes: WriteModes::default(),
        }
    }

    /// Reads whatever control messages have arrived, without blocking.
    fn read_control(&mut self) {
        for (p, peer) in self.links.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            loop {
                if matches!(peer.state, PeerState::Dead(_)) {
                    break;
                }
                let fd = peer.ctrl.as_raw_fd();
                match link::recv(fd, &mut peer.ctrl_buf[peer.ctrl_off..]) {
                    Io::Done(n) => {
                        peer.ctrl_off += n;
                        if peer.ctrl_off < CTRL_LEN {
                            continue;
                        }
                        peer.ctrl_off = 0;
                        peer.last_heard = Instant::now();
                        let b = peer.ctrl_buf;
                        match b[0] {
                            CTRL_HEARTBEAT => {}
                            CTRL_GOODBYE => peer.state = PeerState::Departed,
                            CTRL_ABORT => {
                                let lost = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
                                let lost = (lost != u32::MAX).then_some(lost as usize);
                                if self.notice.is_none() {
                                    self.notice = Some((p, lost, b[5]));
                                }
                            }
                            _ => {
                                peer.state =
                                    PeerState::Dead("sent an unknown control message".into())
                            }
                        }
                    }
                    Io::Blocked => break,
                    Io::Closed => {
                        if peer.state != PeerState::Departed {
                            peer.state = PeerState::Dead("its process exited or aborted".into());
                        }
                        break;
                    }
                    Io::Failed(e) => {
                        if peer.state != PeerState::Departed {
                            peer.state = PeerState::Dead(e.to_string());
                        }
                        break;
                    }
                }
            }
        }
    }

    /// The error that must end `plan` now, given what the control connections said.
    fn liveness_error(&self, plan: &Plan, op: &'static str) -> Option<Error> {
        if let Some((reporter, lost, cause)) = self.notice {
            let what = Cause::describe(cause);
            if cause == Cause::Mismatch as u8 {
                return Some(Error::Mismatch {
                    rank: self.rank,
                    peer: reporter,
                    op,
                    reason: format!("rank {reporter} found the ranks' operations out of step"),
                });
            }
            return Some(match lost {
                Some(peer) if peer != self.rank => self.lost(
                    peer,
                    op,
                    format!("rank {reporter} reports rank {peer} {what}"),
                ),
                _ => self.lost(reporter, op, format!("rank {reporter} {what}")),
            });
        }
        self.links
            .iter()
            .enumerate()
            .find_map(|(p, peer)| match peer {
                Some(Peer {
                    state: PeerState::Dead(reason),
                    ..
                }) if plan.needs(p) => Some(self.lost(p, op, reason.clone())),
                _ => None,
            })
    }

    /// An abort shuts this rank's own sockets down, which reads like dead peers: report the
    /// abort instead.
    fn unless_aborted(&self, e: Error) -> Error {
        if self.aborted.load(Ordering::Acquire) {
            Error::Aborted { rank: self.rank }
        } else {
            e
        }
    }

    /// The peers that went silent (no heartbeat for longer than the silence bound): the
    /// likely culprits of a timeout.
    fn silent_peers(&self, now: Instant) -> Vec<usize> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(p, peer)| {
                let peer = peer.as_ref()?;
                (peer.state == PeerState::Alive
                    && now.duration_since(peer.last_heard) > self.silence)
                    .then_some(p)
            })
            .collect()
    }

    /// Tells every peer that this rank gave up on its operation because of `lost`.
    pub(crate) fn notify_failure(&mut self, lost: Option<usize>, cause: Cause) {
        if self.notice.is_some() {
            return; // the failure came from another rank's notice: it already told everyone
        }
        let mut msg = [0u8; CTRL_LEN];
        msg[0] = CTRL_ABORT;
        msg[1..5].copy_from_slice(&lost.map_or(u32::MAX, |p| p as u32).to_le_bytes());
        msg[5] = cause as u8;
        (self.control)(&msg);
    }

    /// Says goodbye to every peer and closes the connections (an orderly leave).
    pub(crate) fn goodbye(self) {
        (self.control)(&GOODBYE);
        for peer in self.links.iter().flatten() {
            let _ = peer.ctrl.shutdown(std::net::Shutdown::Write);
            let _ = peer.data.shutdown(std::net::Shutdown::Write);
        }
    }

    fn lost(&self, peer: usize, op: &'static str, reason: impl Into<String>) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer,
            op,
            reason: reason.into(),
        }
    }

    /// Runs every transfer of `plan` to completion, or fails at the first lost peer, mismatch,
    /// abort, or at `deadline`.
    pub(crate) fn run(
        &mut self,
        plan: &mut Plan,
        op: &'static str,
        deadline: Instant,
    ) -> Result<()> {
        let started = Instant::now();
        self.run_inner(plan, op, deadline)
            .map_err(|e| self.unless_aborted(e))?;
        if let Some(choice) = plan.write_choice {
            self.write_modes.record(choice, started.elapsed());
        }
        Ok(())
    }

    fn run_inner(&mut self, plan: &mut Plan, op: &'static str, deadline: Instant) -> Result<()> {
        if !plan.check_bounds() {
            return Err(Error::InvalidArgument {
                op,
                reason: "internal plan out of bounds".into(),
            });
        }
        for l in &mut plan.outs {
            l.header.seq = self.send_seq[l.peer];
            self.send_seq[l.peer] += 1;
            l.hdr = l.header.encode();
        }
        let max_reduce_len = |l: &InLane| {
            l.items
                .iter()
                .filter(|i| i.mode != Mode::Copy)
                .map(|i| i.len)
                .max()
        };
        for l in &mut plan.ins {
            l.expect.seq = self.recv_seq[l.peer];
            self.recv_seq[l.peer] += 1;
            if let Some(bytes) = max_reduce_len(l) {
                let w = plan.dtype.size_in_bytes();
                l.staging = Some(Buffer::zeros(plan.dtype, bytes.div_ceil(w)));
            }
        }
        // Lanes through shared memory end on an 8-byte boundary, so every element in a ring
        // is aligned for its dtype and a wrap never splits one.
        let pad = plan.pad_region();
        let shm_outs: Vec<(usize, usize)> = (0..plan.outs.len())
            .filter(|&i| self.is_shm(plan.outs[i].peer))
            .map(|i| {
                let total = HEADER_LEN + plan.outs[i].items.iter().map(|x| x.len).sum::<usize>();
                (i, total)
            })
            .collect();
        for &(i, total) in &shm_outs {
            plan.send(i, pad, 0, (8 - total % 8) % 8, 0);
        }
        let largest = shm_outs.iter().map(|&(_, total)| total).max().unwrap_or(0);
        plan.write_choice = self.write_modes.choose(largest);
        if let Some(choice) = plan.write_choice {
            for &(i, total) in &shm_outs {
                plan.outs[i].streaming = choice.streaming && total >= MIN_LANE_BYTES;
            }
        }
        for i in 0..plan.ins.len() {
            if self.is_shm(plan.ins[i].peer) {
                let total: usize =
                    HEADER_LEN + plan.ins[i].items.iter().map(|x| x.len).sum::<usize>();
                plan.recv(i, pad, 8, (8 - total % 8) % 8, Mode::Copy);
            }
        }
        let start = Instant::now();
        let mut spin_since: Option<Instant> = None;
        let mut shm_wait_in: Vec<usize> = Vec::new();
        let mut shm_wait_out: Vec<usize> = Vec::new();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 * self.world);
        let mut want_read = vec![false; self.world];
        let mut want_write = vec![false; self.world];
        self.read_control();
        if let Some(e) = self.liveness_error(plan, op) {
            return Err(e);
        }
        loop {
            if self.aborted.load(Ordering::Acquire) {
                return Err(Error::Aborted { rank: self.rank });
            }
            let mut progressed = false;
            want_read.fill(false);
            want_write.fill(false);
            shm_wait_in.clear();
            shm_wait_out.clear();
            for l in plan.ins.iter_mut() {
                progressed |= if self.is_shm(l.peer) {
                    self.pump_in_shm(
                        l,
                        &plan.regions,
                        plan.dtype,
                        plan.op,
                        plan.world,
                        op,
                        &mut shm_wait_in,
                    )?
                } else {
                    self.pump_in(
                        l,
                        &plan.regions,
                        plan.dtype,
                        plan.op,
                        plan.world,
                        op,
                        &mut want_read,
                    )?
                };
            }
            let in_done: Vec<usize> = plan.ins.iter().map(|l| l.cur).collect();
            for l in plan.outs.iter_mut() {
                progressed |= if self.is_shm(l.peer) {
                    self.pump_out_shm(l, &plan.regions, &in_done, &mut shm_wait_out)
                } else {
                    self.pump_out(l, &plan.regions, &in_done, op, &mut want_write)?
                };
            }
            let finished = plan
                .ins
                .iter()
                .all(|l| l.hdr_off == HEADER_LEN && l.cur == l.items.len())
                && plan
                    .outs
                    .iter()
                    .all(|l| l.hdr_off == HEADER_LEN && l.cur == l.items.len());
            if finished {
                return Ok(());
            }
            if progressed {
                spin_since = None;
                continue;
            }
            // A departed peer on a ring: its data was written before its goodbye, so an empty
            // ring now stays empty (and a full one stays full).
            for &p in shm_wait_in.iter().chain(&shm_wait_out) {
                if matches!(
                    self.links[p].as_ref().map(|x| &x.state),
                    Some(PeerState::Departed)
                ) {
                    return Err(self.lost(
                        p,
                        op,
                        "it left the group before finishing this operation",
                    ));
                }
            }
            let now = Instant::now();
            if !shm_wait_in.is_empty() || !shm_wait_out.is_empty() {
                // A peer on this host is usually microseconds away: spin a little before
                // paying for doorbells and a poll.
                let since = *spin_since.get_or_insert(now);
                if now.duration_since(since) < SHM_SPIN && now < deadline {
                    std::thread::yield_now();
                    continue;
                }
                spin_since = None;
                if !self.arm_doorbells(&shm_wait_in, &shm_wait_out, &mut want_read) {
                    continue; // bytes or space arrived while arming
                }
            }
            if now >= deadline {
                // Name the silent peers if any (a stopped process sends no heartbeats; one
                // merely blocked behind it still does); else the peers this rank's lanes wait
                // on: to read from, or to write to (a full socket or a full ring alike).
                let mut waiting_on = self.silent_peers(now);
                if waiting_on.is_empty() {
                    waiting_on = plan
                        .ins
                        .iter()
                        .filter(|l| l.hdr_off < HEADER_LEN || l.cur < l.items.len())
                        .map(|l| l.peer)
                        .chain(
                            plan.outs
                                .iter()
                                .filter(|l| want_write[l.peer] || shm_wait_out.contains(&l.peer))
                                .map(|l| l.peer),
                        )
                        .collect();
                }
                waiting_on.sort_unstable();
                waiting_on.dedup();
                return Err(Error::Timeout {
                    rank: self.rank,
                    op,
                    elapsed: now - start,
                    waiting_on,
                });
            }
            // Data sockets are polled for what the lanes wait on; control sockets always, for
            // goodbyes, failure notices and the close of a dead peer. A data socket's hang-up
            // alone proves nothing: a peer that finished and left closes it too.
            fds.clear();
            for (p, peer) in self.links.iter().enumerate() {
                let Some(peer) = peer else { continue };
                let mut events = 0;
                if want_read[p] {
                    events |= libc::POLLIN;
                }
                if want_write[p] {
                    events |= libc::POLLOUT;
                }
                if events != 0 {
                    fds.push(libc::pollfd {
                        fd: peer.data.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                }
                if !matches!(peer.state, PeerState::Dead(_)) {
                    fds.push(libc::pollfd {
                        fd: peer.ctrl.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            if !link::poll(&mut fds, (deadline - now).min(POLL_SLICE)) {
                return Err(Error::io(
                    format!("rank {}: poll during {op}", self.rank),
                    &std::io::Error::last_os_error(),
                ));
            }
            self.drain_doorbells(&want_read);
            self.read_control();
            if let Some(e) = self.liveness_error(plan, op) {
                return Err(e);
            }
        }
    }

    fn is_shm(&self, peer: usize) -> bool {
        self.links[peer].as_ref().is_some_and(|p| p.shm.is_some())
    }

    /// Asks the peers whose rings block us for a doorbell; false if one need not be waited for.
    fn arm_doorbells(&self, wait_in: &[usize], wait_out: &[usize], want_read: &mut [bool]) -> bool {
        let mut all_armed = true;
        for &p in wait_in {
            if let Some(shm) = self.links[p].as_ref().and_then(|x| x.shm.as_ref()) {
                all_armed &= shm.rx.wait_for_data();
                want_read[p] = true;
            }
        }
        for &p in wait_out {
            if let Some(shm) = self.links[p].as_ref().and_then(|x| x.shm.as_ref()) {
                all_armed &= shm.tx.wait_for_space();
                want_read[p] = true;
            }
        }
        all_armed
    }

    /// Reads away doorbell bytes of shared-memory peers we waited on.
    fn drain_doorbells(&self, waited: &[bool]) {
        let mut sink = [0u8; 64];
        for (p, peer) in self.links.iter().enumerate() {
            let Some(peer) = peer else { continue };
            if peer.shm.is_none() || !waited[p] {
                continue;
            }
            while let Io::Done(_) = link::recv(peer.data.as_raw_fd(), &mut sink) {}
        }
    }

    fn ring_doorbell(&self, peer: usize) {
        if let Some(p) = &self.links[peer] {
            let _ = link::send(p.data.as_raw_fd(), &[1]);
        }
    }

    /// As [`Mesh::pump_in`], from the peer's ring: copies out, or reduces straight from the
    /// ring into place.
    #[allow(clippy::too_many_arguments)]
    fn pump_in_shm(
        &self,
        l: &mut InLane,
        regions: &[Region],
        dtype: DType,
        rop: ReduceOp,
        world: usize,
        op: &'static str,
        wait: &mut Vec<usize>,
    ) -> Result<bool> {
        let Some(ring) = self.links[l.peer]
            .as_ref()
            .and_then(|p| p.shm.as_ref())
            .map(|s| &s.rx)
        else {
            return Err(self.lost(l.peer, op, "no connection"));
        };
        let w = dtype.size_in_bytes();
        let mut progressed = false;
        loop {
            if l.hdr_off < HEADER_LEN {
                let (a, b) = ring.readable(HEADER_LEN - l.hdr_off);
                let n = a.len() + b.len();
                if n == 0 {
                    wait.push(l.peer);
                    return Ok(progressed);
                }
                l.hdr[l.hdr_off..l.hdr_off + a.len()].copy_from_slice(a);
                l.hdr[l.hdr_off + a.len()..l.hdr_off + n].copy_from_slice(b);
                if ring.consume(n) {
                    self.ring_doorbell(l.peer);
                }
                l.hdr_off += n;
                progressed = true;
                if l.hdr_off == HEADER_LEN {
                    self.check_header(l, op)?;
                }
                continue;
            }
            let Some(item) = l.items.get(l.cur) else {
                return Ok(progressed);
            };
            let region = &regions[item.region];
            let (a, b) = ring.readable(item.len - l.off);
            let mut n = a.len() + b.len();
            if item.mode != Mode::Copy {
                n -= n % w;
            }
            if n == 0 {
                wait.push(l.peer);
                return Ok(progressed);
            }
            let (a, b) = (&a[..a.len().min(n)], &b[..n - a.len().min(n)]);
            // SAFETY: bounds were checked; the region outlives `run`; no other view of these
            // bytes exists during this call.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(region.ptr.add(item.start + l.off), n) };
            if item.mode == Mode::Copy {
                let copy = if region.len >= STREAM_REGION_BYTES {
                    copy_streaming
                } else {
                    <[u8]>::copy_from_slice
                };
                let (d1, d2) = dst.split_at_mut(a.len());
                copy(d1, a);
                copy(d2, b);
            } else {
                let (d1, d2) = dst.split_at_mut(a.len());
                combine(rop, dtype, d1, a);
                combine(rop, dtype, d2, b);
            }
            if ring.consume(n) {
                self.ring_doorbell(l.peer);
            }
            progressed = true;
            l.off += n;
            if l.off == item.len {
                if item.mode == Mode::ReduceFinish {
                    // SAFETY: as above, the whole item.
                    let whole = unsafe {
                        std::slice::from_raw_parts_mut(region.ptr.add(item.start), item.len)
                    };
                    finish_avg(rop, dtype, whole, world);
                }
                l.cur += 1;
                l.off = 0;
            }
        }
    }

    /// As [`Mesh::pump_out`], into the peer's ring.
    fn pump_out_shm(
        &self,
        l: &mut OutLane,
        regions: &[Region],
        in_done: &[usize],
        wait: &mut Vec<usize>,
    ) -> bool {
        let Some(ring) = self.links[l.peer]
            .as_ref()
            .and_then(|p| p.shm.as_ref())
            .map(|s| &s.tx)
        else {
            return false;
        };
        let mut progressed = false;
        loop {
            let src: &[u8] = if l.hdr_off < HEADER_LEN {
                &l.hdr[l.hdr_off..]
            } else {
                let Some(item) = l.items.get(l.cur) else {
                    return progressed;
                };
                if l.dep.is_some_and(|d| in_done[d] < item.after) {
                    return progressed;
                }
                let region = &regions[item.region];
                // SAFETY: bounds checked; the bytes are complete input or received data.
                unsafe {
                    std::slice::from_raw_parts(region.ptr.add(item.start + l.off), item.len - l.off)
                }
            };
            let (n, bell) = ring.write(src, l.streaming && l.hdr_off == HEADER_LEN);
            if bell {
                self.ring_doorbell(l.peer);
            }
            if n == 0 {
                wait.push(l.peer);
                return progressed;
            }
            progressed = true;
            if l.hdr_off < HEADER_LEN {
                l.hdr_off += n;
            } else {
                l.off += n;
                if l.off == l.items[l.cur].len {
                    l.cur += 1;
                    l.off = 0;
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn pump_in(
        &self,
        l: &mut InLane,
        regions: &[Region],
        dtype: DType,
        rop: ReduceOp,
        world: usize,
        op: &'static str,
        want_read: &mut [bool],
    ) -> Result<bool> {
        let Some(peer) = &self.links[l.peer] else {
            return Err(self.lost(l.peer, op, "no connection"));
        };
        let fd = peer.data.as_raw_fd();
        let mut progressed = false;
        loop {
            if l.hdr_off < HEADER_LEN {
                match link::recv(fd, &mut l.hdr[l.hdr_off..]) {
                    Io::Done(n) => {
                        l.hdr_off += n;
                        progressed = true;
                        if l.hdr_off == HEADER_LEN {
                            self.check_header(l, op)?;
                        }
                        continue;
                    }
                    other => return self.blocked_in(other, l.peer, op, want_read, progressed),
                }
            }
            let Some(item) = l.items.get(l.cur) else {
                return Ok(progressed);
            };
            let region = &regions[item.region];
            let got = if item.mode == Mode::Copy {
                // SAFETY: the plan's bounds were checked; the region's buffer outlives `run`
                // and no other view of these bytes exists during this call.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        region.ptr.add(item.start + l.off),
                        item.len - l.off,
                    )
                };
                link::recv(fd, dst)
            } else {
                let staging = match l.staging.as_mut() {
                    Some(s) => s.as_bytes_mut(),
                    None => return Err(self.lost(l.peer, op, "internal: no staging buffer")),
                };
                link::recv(fd, &mut staging[l.off..item.len])
            };
            match got {
                Io::Done(n) => {
                    progressed = true;
                    l.off += n;
                    if l.off == item.len {
                        if item.mode != Mode::Copy {
                            // SAFETY: as above; the staging buffer is a different allocation.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(region.ptr.add(item.start), item.len)
                            };
                            if let Some(s) = l.staging.as_ref() {
                                combine(rop, dtype, dst, &s.as_bytes()[..item.len]);
                            }
                            if item.mode == Mode::ReduceFinish {
                                finish_avg(rop, dtype, dst, world);
                            }
                        }
                        l.cur += 1;
                        l.off = 0;
                    }
                }
                other => return self.blocked_in(other, l.peer, op, want_read, progressed),
            }
        }
    }

    fn blocked_in(
        &self,
        io: Io,
        peer: usize,
        op: &'static str,
        want_read: &mut [bool],
        progressed: bool,
    ) -> Result<bool> {
        match io {
            Io::Blocked => {
                want_read[peer] = true;
                Ok(progressed)
            }
            Io::Closed => {
                let departed = matches!(
                    self.links[peer].as_ref().map(|p| &p.state),
                    Some(PeerState::Departed)
                );
                let reason = if departed {
                    "it left the group before sending this operation's data"
                } else {
                    "connection closed (EOF)"
                };
                Err(self.lost(peer, op, reason))
            }
            Io::Failed(e) => Err(self.lost(peer, op, e.to_string())),
            Io::Done(_) => Ok(true),
        }
    }

    fn check_header(&self, l: &InLane, op: &'static str) -> Result<()> {
        let mismatch = |reason: String| Error::Mismatch {
            rank: self.rank,
            peer: l.peer,
            op,
            reason,
        };
        let Some(got) = Header::decode(&l.hdr) else {
            return Err(mismatch(
                "the peer sent bytes that are not a rekindle header".into(),
            ));
        };
        if got != l.expect {
            return Err(mismatch(format!(
                "expected {}, the peer sent {}",
                describe(&l.expect),
                describe(&got)
            )));
        }
        Ok(())
    }

    fn pump_out(
        &self,
        l: &mut OutLane,
        regions: &[Region],
        in_done: &[usize],
        op: &'static str,
        want_write: &mut [bool],
    ) -> Result<bool> {
        let Some(peer) = &self.links[l.peer] else {
            return Err(self.lost(l.peer, op, "no connection"));
        };
        let fd = peer.data.as_raw_fd();
        let mut progressed = false;
        loop {
            let io = if l.hdr_off < HEADER_LEN {
                link::send(fd, &l.hdr[l.hdr_off..])
            } else {
                let Some(item) = l.items.get(l.cur) else {
                    return Ok(progressed);
                };
                if l.dep.is_some_and(|d| in_done[d] < item.after) {
                    return Ok(progressed);
                }
                let region = &regions[item.region];
                // SAFETY: bounds checked; the bytes were completely received or are input
                // that nothing writes during the operation.
                let src = unsafe {
                    std::slice::from_raw_parts(region.ptr.add(item.start + l.off), item.len - l.off)
                };
                link::send(fd, src)
            };
            match io {
                Io::Done(n) => {
                    progressed = true;
                    if l.hdr_off < HEADER_LEN {
                        l.hdr_off += n;
                    } else {
                        l.off += n;
                        if l.off == l.items[l.cur].len {
                            l.cur += 1;
                            l.off = 0;
                        }
                    }
                }
                Io::Blocked => {
                    want_write[l.peer] = true;
                    return Ok(progressed);
                }
                Io::Closed => return Err(self.lost(l.peer, op, "connection closed")),
                Io::Failed(e) => return Err(self.lost(l.peer, op, e.to_string())),
            }
        }
    }
}
