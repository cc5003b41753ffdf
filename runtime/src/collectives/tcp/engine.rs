//! The progress engine: runs one operation's [`Plan`] over the mesh, all lanes at once.
//!
//! One thread drives every lane with non-blocking I/O: it pumps each lane (see `pump`) until
//! nothing moves, then waits, spinning briefly on shared-memory rings before it arms their
//! doorbells, and `poll(2)`s the sockets the lanes wait on together with every peer's control
//! connection, so that a dead rank is noticed even when the current operation does not talk to
//! it. Sending, receiving and reducing overlap chunk by chunk, and both directions of every
//! connection are busy at once.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bootstrap::PeerLinks;
use super::control::{self, ControlIn, ControlLinks, ControlOut, Ended};
use super::link::{self, Io};
use super::plan::Plan;
use super::pump::{self, Fault, Reduction};
use super::transport::{Inbound, LinkError, Outbound};
use super::wire::{Cause, Control, HEADER_LEN};
use super::write_mode::{WriteModes, MIN_LANE_BYTES};
use crate::error::{Error, Result};

/// What this rank knows of a peer's liveness, from the control connection.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    Alive,
    /// Said goodbye: it dropped its group in an orderly way.
    Departed,
    /// Its control connection ended without a goodbye (the process died or aborted), or
    /// carried something that failed authentication.
    Dead(String),
}

/// A connected peer.
struct Peer {
    /// The data connection: frames, or only doorbells when the peer is on a ring.
    data: TcpStream,
    out: Outbound,
    inb: Inbound,
    ring: bool,
    ctrl: ControlIn,
    state: PeerState,
    /// When a control message (usually a heartbeat) was last read from it.
    last_heard: Instant,
}

/// A failure another rank reported.
#[derive(Debug, Clone, Copy)]
struct Notice {
    reporter: usize,
    lost: Option<usize>,
    cause: Cause,
}

/// The connected peers of one rank, with per-direction operation sequence numbers.
pub(crate) struct Mesh {
    pub rank: usize,
    pub world: usize,
    peers: Vec<Option<Peer>>,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    aborted: Arc<AtomicBool>,
    notice: Option<Notice>,
    /// The sending halves of the control connections (shared with the heartbeat thread).
    control: ControlLinks,
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

/// How long an orderly leave waits for its goodbyes to be sent.
const GOODBYE_FLUSH: Duration = Duration::from_millis(200);

/// Which lanes wait on what, per pass of the run loop.
struct Waits {
    /// Sockets to poll for reading / writing, per peer.
    read: Vec<bool>,
    write: Vec<bool>,
    /// Peers whose ring this rank waits to read from / write into.
    ring_in: Vec<usize>,
    ring_out: Vec<usize>,
}

impl Waits {
    fn clear(&mut self) {
        self.read.fill(false);
        self.write.fill(false);
        self.ring_in.clear();
        self.ring_out.clear();
    }
}

impl Mesh {
    /// The mesh over authenticated `links`; fills `control` with the sending halves of their
    /// control connections.
    pub(crate) fn new(
        rank: usize,
        world: usize,
        links: Vec<Option<PeerLinks>>,
        aborted: Arc<AtomicBool>,
        control: ControlLinks,
        silence: Duration,
    ) -> Result<Mesh> {
        let now = Instant::now();
        let mut outs = Vec::with_capacity(world);
        let mut peers = Vec::with_capacity(world);
        for l in links {
            let Some(l) = l else {
                outs.push(None);
                peers.push(None);
                continue;
            };
            let ctrl_tx = l
                .ctrl
                .try_clone()
                .map_err(|e| Error::io("cloning socket handles", &e))?;
            outs.push(Some(ControlOut::new(ctrl_tx, l.ctrl_keys.send)));
            let ring = l.shm.is_some();
            let (out, inb) = match l.shm {
                Some(pair) => (
                    Outbound::ring(pair.tx, &l.data),
                    Inbound::ring(pair.rx, &l.data),
                ),
                None => (
                    Outbound::socket(&l.data, l.data_keys.send),
                    Inbound::socket(&l.data, l.data_keys.recv),
                ),
            };
            peers.push(Some(Peer {
                data: l.data,
                out,
                inb,
                ring,
                ctrl: ControlIn::new(l.ctrl, l.ctrl_keys.recv),
                state: PeerState::Alive,
                last_heard: now,
            }));
        }
        *control.lock().unwrap_or_else(|p| p.into_inner()) = outs;
        Ok(Mesh {
            rank,
            world,
            peers,
            send_seq: vec![0; world],
            recv_seq: vec![0; world],
            aborted,
            notice: None,
            control,
            silence,
            write_modes: WriteModes::default(),
        })
    }

    /// Reads whatever control messages have arrived, without blocking.
    fn read_control(&mut self) {
        for (p, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            if matches!(peer.state, PeerState::Dead(_)) {
                continue;
            }
            let (state, notice, last_heard) =
                (&mut peer.state, &mut self.notice, &mut peer.last_heard);
            let read = peer.ctrl.read(|msg| {
                *last_heard = Instant::now();
                match msg {
                    Control::Heartbeat => {}
                    Control::Goodbye => *state = PeerState::Departed,
                    Control::Abort { lost, cause } => {
                        notice.get_or_insert(Notice {
                            reporter: p,
                            lost,
                            cause,
                        });
                    }
                }
            });
            match read {
                Ok(()) => {}
                // A departed peer closes its connections; that is no failure.
                Err(Ended::Closed | Ended::Failed(_)) if peer.state == PeerState::Departed => {}
                Err(e) => peer.state = PeerState::Dead(e.to_string()),
            }
        }
    }

    /// The error that must end `plan` now, given what the control connections said.
    fn liveness_error(&self, plan: &Plan, op: &'static str) -> Option<Error> {
        if let Some(Notice {
            reporter,
            lost,
            cause,
        }) = self.notice
        {
            if cause == Cause::Mismatch {
                return Some(Error::Mismatch {
                    rank: self.rank,
                    peer: reporter,
                    op,
                    reason: format!("rank {reporter} found the ranks' operations out of step"),
                });
            }
            let what = cause.describe();
            return Some(match lost {
                Some(peer) if peer != self.rank => self.lost(
                    peer,
                    op,
                    format!("rank {reporter} reports rank {peer} {what}"),
                ),
                _ => self.lost(reporter, op, format!("rank {reporter} {what}")),
            });
        }
        self.peers
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
        self.peers
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
        control::broadcast(&self.control, Control::Abort { lost, cause });
    }

    /// Says goodbye to every peer and closes the connections (an orderly leave).
    pub(crate) fn goodbye(self) {
        control::broadcast(&self.control, Control::Goodbye);
        control::drain(&self.control, Instant::now() + GOODBYE_FLUSH);
        for peer in self.peers.iter().flatten() {
            let _ = peer.ctrl.stream().shutdown(std::net::Shutdown::Write);
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

    /// The error for a lane to `peer` that failed with `fault`.
    fn fault(&self, peer: usize, op: &'static str, fault: Fault) -> Error {
        let reason = match fault {
            Fault::Mismatch(reason) => {
                return Error::Mismatch {
                    rank: self.rank,
                    peer,
                    op,
                    reason,
                }
            }
            Fault::Link(LinkError::Closed) => {
                let departed = matches!(
                    self.peers[peer].as_ref().map(|p| &p.state),
                    Some(PeerState::Departed)
                );
                if departed {
                    "it left the group before finishing this operation".to_string()
                } else {
                    "connection closed (EOF)".to_string()
                }
            }
            Fault::Link(LinkError::Failed(e)) => e.to_string(),
            Fault::Link(LinkError::Sealed(e)) => format!("on its data connection, {e}"),
            Fault::Link(LinkError::Ring(f)) => f.to_string(),
        };
        self.lost(peer, op, reason)
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

    fn is_ring(&self, peer: usize) -> bool {
        self.peers[peer].as_ref().is_some_and(|p| p.ring)
    }

    /// Numbers the lanes, pads shared-memory lanes and chooses their write mode.
    fn prepare(&mut self, plan: &mut Plan) {
        for l in &mut plan.outs {
            l.header.seq = self.send_seq[l.peer];
            self.send_seq[l.peer] += 1;
            l.hdr = l.header.encode();
        }
        for l in &mut plan.ins {
            l.expect.seq = self.recv_seq[l.peer];
            self.recv_seq[l.peer] += 1;
        }
        // Lanes through shared memory end on an 8-byte boundary, so every element in a ring
        // is aligned for its dtype and a wrap never splits one.
        let pad = plan.pad_region();
        let lane_bytes = |items: &mut dyn Iterator<Item = usize>| HEADER_LEN + items.sum::<usize>();
        let ring_outs: Vec<(usize, usize)> = (0..plan.outs.len())
            .filter(|&i| self.is_ring(plan.outs[i].peer))
            .map(|i| (i, lane_bytes(&mut plan.outs[i].items.iter().map(|x| x.len))))
            .collect();
        for &(i, total) in &ring_outs {
            plan.send(i, pad, 0, (8 - total % 8) % 8, 0);
        }
        let largest = ring_outs.iter().map(|&(_, total)| total).max().unwrap_or(0);
        plan.write_choice = self.write_modes.choose(largest);
        if let Some(choice) = plan.write_choice {
            for &(i, total) in &ring_outs {
                plan.outs[i].streaming = choice.streaming && total >= MIN_LANE_BYTES;
            }
        }
        for i in 0..plan.ins.len() {
            if self.is_ring(plan.ins[i].peer) {
                let total = lane_bytes(&mut plan.ins[i].items.iter().map(|x| x.len));
                plan.recv(i, pad, 8, (8 - total % 8) % 8, super::plan::Mode::Copy);
            }
        }
    }

    /// Pumps every lane once; returns whether anything moved, and fills `waits`.
    fn pump_all(&mut self, plan: &mut Plan, op: &'static str, waits: &mut Waits) -> Result<bool> {
        let red = Reduction {
            dtype: plan.dtype,
            op: plan.op,
            world: plan.world,
        };
        let mut progressed = false;
        for l in plan.ins.iter_mut() {
            let p = l.peer;
            let Some(peer) = self.peers[p].as_mut() else {
                return Err(self.lost(p, op, "no connection"));
            };
            let ring = peer.ring;
            let r = pump::pump_in(&mut peer.inb, l, &plan.regions, red);
            let r = r.map_err(|f| self.fault(p, op, f))?;
            progressed |= r.progressed;
            if r.blocked {
                if ring {
                    waits.ring_in.push(p);
                } else {
                    waits.read[p] = true;
                }
            }
        }
        let in_done: Vec<usize> = plan.ins.iter().map(|l| l.items_done()).collect();
        for l in plan.outs.iter_mut() {
            let p = l.peer;
            let Some(peer) = self.peers[p].as_mut() else {
                return Err(self.lost(p, op, "no connection"));
            };
            let ring = peer.ring;
            let r = pump::pump_out(&mut peer.out, l, &plan.regions, &in_done);
            let r = r.map_err(|f| self.fault(p, op, f))?;
            progressed |= r.progressed;
            if r.blocked {
                if ring {
                    waits.ring_out.push(p);
                } else {
                    waits.write[p] = true;
                }
            }
        }
        Ok(progressed)
    }

    fn finished(&self, plan: &Plan) -> bool {
        plan.ins.iter().all(|l| l.done())
            && plan
                .outs
                .iter()
                .all(|l| l.taken() && self.peers[l.peer].as_ref().is_some_and(|p| p.out.idle()))
    }

    fn run_inner(&mut self, plan: &mut Plan, op: &'static str, deadline: Instant) -> Result<()> {
        if !plan.check_bounds() {
            return Err(Error::InvalidArgument {
                op,
                reason: "internal plan out of bounds".into(),
            });
        }
        self.prepare(plan);
        let start = Instant::now();
        let mut spin_since: Option<Instant> = None;
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 * self.world);
        let mut waits = Waits {
            read: vec![false; self.world],
            write: vec![false; self.world],
            ring_in: Vec::new(),
            ring_out: Vec::new(),
        };
        self.read_control();
        if let Some(e) = self.liveness_error(plan, op) {
            return Err(e);
        }
        loop {
            if self.aborted.load(Ordering::Acquire) {
                return Err(Error::Aborted { rank: self.rank });
            }
            waits.clear();
            let progressed = self.pump_all(plan, op, &mut waits)?;
            if self.finished(plan) {
                return Ok(());
            }
            if progressed {
                spin_since = None;
                continue;
            }
            // A departed peer on a ring: its data was written before its goodbye, so an empty
            // ring now stays empty (and a full one stays full).
            for &p in waits.ring_in.iter().chain(&waits.ring_out) {
                if matches!(
                    self.peers[p].as_ref().map(|x| &x.state),
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
            if !waits.ring_in.is_empty() || !waits.ring_out.is_empty() {
                // A peer on this host is usually microseconds away: spin a little before
                // paying for doorbells and a poll.
                let since = *spin_since.get_or_insert(now);
                if now.duration_since(since) < SHM_SPIN && now < deadline {
                    std::thread::yield_now();
                    continue;
                }
                spin_since = None;
                if !self.arm_doorbells(&mut waits, op)? {
                    continue; // bytes or space arrived while arming
                }
            }
            if now >= deadline {
                return Err(self.timeout(plan, op, now, start, &waits));
            }
            self.poll(&mut fds, &waits, (deadline - now).min(POLL_SLICE), op)?;
            self.drain_doorbells(&waits.read);
            self.read_control();
            if let Some(e) = self.liveness_error(plan, op) {
                return Err(e);
            }
        }
    }

    /// Names the silent peers if any (a stopped process sends no heartbeats; one merely
    /// blocked behind it still does); else the peers this rank's lanes wait on: to read from,
    /// or to write to (a full socket or a full ring alike).
    fn timeout(
        &self,
        plan: &Plan,
        op: &'static str,
        now: Instant,
        start: Instant,
        waits: &Waits,
    ) -> Error {
        let mut waiting_on = self.silent_peers(now);
        if waiting_on.is_empty() {
            waiting_on = plan
                .ins
                .iter()
                .filter(|l| !l.done())
                .map(|l| l.peer)
                .chain(
                    plan.outs
                        .iter()
                        .filter(|l| waits.write[l.peer] || waits.ring_out.contains(&l.peer))
                        .map(|l| l.peer),
                )
                .collect();
        }
        waiting_on.sort_unstable();
        waiting_on.dedup();
        Error::Timeout {
            rank: self.rank,
            op,
            elapsed: now - start,
            waiting_on,
        }
    }

    /// Waits for the sockets the lanes wait on, and for every live peer's control connection.
    /// A data socket's hang-up alone proves nothing: a peer that finished and left closes it
    /// too.
    fn poll(
        &self,
        fds: &mut Vec<libc::pollfd>,
        waits: &Waits,
        timeout: Duration,
        op: &'static str,
    ) -> Result<()> {
        fds.clear();
        for (p, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let mut events = 0;
            if waits.read[p] {
                events |= libc::POLLIN;
            }
            if waits.write[p] {
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
                    fd: peer.ctrl.stream().as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        if link::poll(fds, timeout) {
            Ok(())
        } else {
            Err(Error::io(
                format!("rank {}: poll during {op}", self.rank),
                &std::io::Error::last_os_error(),
            ))
        }
    }

    /// Asks the peers whose rings block us for a doorbell (and marks their data sockets to be
    /// polled); false if one need not be waited for.
    fn arm_doorbells(&mut self, waits: &mut Waits, op: &'static str) -> Result<bool> {
        let mut all_armed = true;
        for i in 0..waits.ring_in.len() + waits.ring_out.len() {
            let (p, reading) = match waits.ring_in.get(i) {
                Some(&p) => (p, true),
                None => (waits.ring_out[i - waits.ring_in.len()], false),
            };
            let Some(peer) = self.peers[p].as_mut() else {
                continue;
            };
            let armed = if reading {
                peer.inb.arm()
            } else {
                peer.out.arm()
            };
            all_armed &= armed.map_err(|e| self.fault(p, op, Fault::Link(e)))?;
            waits.read[p] = true;
        }
        Ok(all_armed)
    }

    /// Reads away doorbell bytes of ring peers whose sockets were polled.
    fn drain_doorbells(&self, polled: &[bool]) {
        let mut sink = [0u8; 64];
        for (p, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            if !peer.ring || !polled[p] {
                continue;
            }
            while let Io::Done(_) = link::recv(peer.data.as_raw_fd(), &mut sink) {}
        }
    }
}
