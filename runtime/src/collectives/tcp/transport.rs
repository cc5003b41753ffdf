//! The byte movers under the engine: one [`Outbound`] and one [`Inbound`] per peer, either
//! over the pair's TCP data connection (sealed frames, see `wire` and `seal`) or through
//! shared-memory rings (see `shm`). The engine's pumps see only segments of bytes to send or to
//! deliver (copied or reduced into place), whatever the transport.
//!
//! A segment reaches the engine only once it is trustworthy: over TCP, a frame's bytes count
//! as delivered when its tag checked out (until then they sit in staging, or in place but not
//! yet counted); through a ring, when the ring's counters were valid and its file intact after
//! the copy.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

use super::link::{self, Io};
use super::seal::{SealError, Sealer, Tag, MAX_TAG};
use super::shm::{RingFault, RingReader, RingWriter};
use super::wire::FRAME_MAX;
use crate::bulk_copy::copy_streaming;
use crate::collectives::reduce::{combine, ReduceOp};
use crate::dtype::DType;

/// Why a transport stopped working.
#[derive(Debug)]
pub(crate) enum LinkError {
    /// The peer closed the connection.
    Closed,
    /// The OS reported an error.
    Failed(std::io::Error),
    /// A frame failed authentication.
    Sealed(SealError),
    /// The peer's ring is corrupt.
    Ring(RingFault),
}

impl From<RingFault> for LinkError {
    fn from(f: RingFault) -> Self {
        LinkError::Ring(f)
    }
}

/// How received bytes go into place.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Delivery {
    /// Copied; with streaming stores when `streaming` (a destination that will not stay in
    /// cache).
    Copy { streaming: bool },
    /// Reduced into the destination: `dst = op(dst, received)`.
    Combine { dtype: DType, op: ReduceOp },
}

/// What a receive did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Received {
    /// This many bytes at the start of the destination are in place and trustworthy.
    Delivered(usize),
    /// Nothing more can be delivered until the peer sends more.
    Blocked,
}

/// What a send did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sent {
    /// Bytes of the source taken (they may still be buffered in the transport).
    pub taken: usize,
    /// The transport could not take or flush everything: wait until it can write.
    pub blocked: bool,
}

fn io_err(io: Io) -> LinkError {
    match io {
        Io::Closed => LinkError::Closed,
        Io::Failed(e) => LinkError::Failed(e),
        // Not errors; callers handle these before.
        Io::Done(_) | Io::Blocked => LinkError::Closed,
    }
}

fn copy_into(dst: &mut [u8], src: &[u8], streaming: bool) {
    if streaming {
        copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Staging memory, 8-byte aligned so reductions run on aligned elements.
struct Staging(Vec<u64>);

impl Staging {
    fn bytes(&mut self) -> &mut [u8] {
        if self.0.is_empty() {
            self.0 = vec![0u64; FRAME_MAX / 8];
        }
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// Receives sealed frames from a data connection.
pub(crate) struct SocketIn {
    fd: RawFd,
    open: Sealer,
    /// Payload bytes of the frame being received (0: none started).
    frame: usize,
    /// Payload bytes of it received so far.
    got: usize,
    tag: [u8; MAX_TAG],
    tag_got: usize,
    staging: Staging,
}

/// Sends sealed frames on a data connection.
pub(crate) struct SocketOut {
    fd: RawFd,
    seal: Sealer,
    state: OutState,
    tag: Option<Tag>,
    /// The encrypted copy of the frame in flight (encrypted mode).
    sealed: Staging,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OutState {
    /// Between frames.
    Idle,
    /// Sending a MAC frame's payload straight from the source: bytes left.
    Payload(usize),
    /// Sending the encrypted copy: (sent, length).
    Sealed(usize, usize),
    /// Sending the tag: bytes sent.
    Tag(usize),
}

/// Receives from the peer's ring into this rank's buffers.
pub(crate) struct RingIn {
    ring: RingReader,
    /// The data connection, for doorbells.
    fd: RawFd,
}

/// Writes into the peer's ring.
pub(crate) struct RingOut {
    ring: RingWriter,
    fd: RawFd,
}

/// The receiving half of a peer's transport.
pub(crate) enum Inbound {
    /// Sealed frames over TCP.
    Socket(Box<SocketIn>),
    /// A shared-memory ring.
    Ring(RingIn),
}

/// The sending half of a peer's transport.
pub(crate) enum Outbound {
    /// Sealed frames over TCP.
    Socket(Box<SocketOut>),
    /// A shared-memory ring.
    Ring(RingOut),
}

/// Wakes the peer blocked on a ring (a lost doorbell is harmless: it polls again).
fn ring_doorbell(fd: RawFd) {
    let _ = link::send(fd, &[1]);
}

impl Inbound {
    /// Frames on the data connection `data`, opened with `open`.
    pub(crate) fn socket(data: &TcpStream, open: Sealer) -> Inbound {
        Inbound::Socket(Box::new(SocketIn {
            fd: data.as_raw_fd(),
            open,
            frame: 0,
            got: 0,
            tag: [0; MAX_TAG],
            tag_got: 0,
            staging: Staging(Vec::new()),
        }))
    }

    /// The peer's ring, with doorbells on `data`.
    pub(crate) fn ring(ring: RingReader, data: &TcpStream) -> Inbound {
        Inbound::Ring(RingIn {
            ring,
            fd: data.as_raw_fd(),
        })
    }

    /// Delivers the next bytes of a segment into `dst`, which holds the rest of the segment
    /// (the same bytes again on the next call if nothing was delivered). Deliveries are whole
    /// elements when combining.
    pub(crate) fn deliver(&mut self, dst: &mut [u8], how: Delivery) -> Result<Received, LinkError> {
        if dst.is_empty() {
            return Ok(Received::Delivered(0));
        }
        match self {
            Inbound::Socket(s) => s.deliver(dst, how),
            Inbound::Ring(r) => r.deliver(dst, how),
        }
    }

    /// A ring about to sleep: asks for a doorbell; false if bytes arrived meanwhile (or this
    /// is not a ring).
    pub(crate) fn arm(&self) -> Result<bool, LinkError> {
        match self {
            Inbound::Socket(_) => Ok(false),
            Inbound::Ring(r) => Ok(r.ring.wait_for_data()?),
        }
    }
}

impl SocketIn {
    fn deliver(&mut self, dst: &mut [u8], how: Delivery) -> Result<Received, LinkError> {
        if self.frame == 0 {
            self.frame = dst.len().min(FRAME_MAX);
            self.got = 0;
            self.tag_got = 0;
        }
        let frame = self.frame;
        // A MAC frame copied into place lands there directly; it counts once its tag checks.
        let in_place = matches!(how, Delivery::Copy { .. }) && !self.open.transforms();
        let tag_len = self.open.tag_len();
        // The payload and the tag in one call where both have arrived.
        while self.got < frame || self.tag_got < tag_len {
            let io = if self.got < frame {
                let landing = if in_place {
                    &mut dst[self.got..frame]
                } else {
                    &mut self.staging.bytes()[self.got..frame]
                };
                link::recv2(self.fd, landing, &mut self.tag[..tag_len])
            } else {
                link::recv(self.fd, &mut self.tag[self.tag_got..tag_len])
            };
            match io {
                Io::Done(n) => {
                    let payload = n.min(frame - self.got);
                    self.got += payload;
                    self.tag_got += n - payload;
                }
                Io::Blocked => return Ok(Received::Blocked),
                other => return Err(io_err(other)),
            }
        }
        self.frame = 0;
        let tag = &self.tag[..tag_len];
        if in_place {
            self.open
                .open(&mut dst[..frame], tag)
                .map_err(LinkError::Sealed)?;
            return Ok(Received::Delivered(frame));
        }
        let staged = &mut self.staging.bytes()[..frame];
        self.open.open(staged, tag).map_err(LinkError::Sealed)?;
        match how {
            Delivery::Copy { streaming } => copy_into(&mut dst[..frame], staged, streaming),
            Delivery::Combine { dtype, op } => combine(op, dtype, &mut dst[..frame], staged),
        }
        Ok(Received::Delivered(frame))
    }
}

impl RingIn {
    fn deliver(&mut self, dst: &mut [u8], how: Delivery) -> Result<Received, LinkError> {
        let (a, b) = self.ring.readable(dst.len())?;
        let mut n = a.len() + b.len();
        if let Delivery::Combine { dtype, .. } = how {
            n -= n % dtype.size_in_bytes();
        }
        if n == 0 {
            return Ok(Received::Blocked);
        }
        let (a, b) = (&a[..a.len().min(n)], &b[..n - a.len().min(n)]);
        let (d1, d2) = dst[..n].split_at_mut(a.len());
        match how {
            Delivery::Copy { streaming } => {
                copy_into(d1, a, streaming);
                copy_into(d2, b, streaming);
            }
            Delivery::Combine { dtype, op } => {
                combine(op, dtype, d1, a);
                combine(op, dtype, d2, b);
            }
        }
        if self.ring.consume(n)? {
            ring_doorbell(self.fd);
        }
        Ok(Received::Delivered(n))
    }
}

impl Outbound {
    /// Frames on the data connection `data`, sealed with `seal`.
    pub(crate) fn socket(data: &TcpStream, seal: Sealer) -> Outbound {
        Outbound::Socket(Box::new(SocketOut {
            fd: data.as_raw_fd(),
            seal,
            state: OutState::Idle,
            tag: None,
            sealed: Staging(Vec::new()),
        }))
    }

    /// The peer's ring, with doorbells on `data`.
    pub(crate) fn ring(ring: RingWriter, data: &TcpStream) -> Outbound {
        Outbound::Ring(RingOut {
            ring,
            fd: data.as_raw_fd(),
        })
    }

    /// Sends the next bytes of a segment from `src` (the rest of the segment), after whatever
    /// the transport still holds of earlier segments; an empty `src` only flushes. With
    /// `streaming`, ring writes bypass the cache.
    pub(crate) fn send(&mut self, src: &[u8], streaming: bool) -> Result<Sent, LinkError> {
        let sent = self.send_inner(src, streaming);
        if let Ok(s) = &sent {
            crate::collectives::count_sent(s.taken);
        }
        sent
    }

    fn send_inner(&mut self, src: &[u8], streaming: bool) -> Result<Sent, LinkError> {
        match self {
            Outbound::Socket(s) => s.send(src),
            Outbound::Ring(r) => {
                if src.is_empty() {
                    return Ok(Sent::default());
                }
                let (n, bell) = r.ring.write(src, streaming)?;
                if bell {
                    ring_doorbell(r.fd);
                }
                Ok(Sent {
                    taken: n,
                    blocked: n < src.len(),
                })
            }
        }
    }

    /// True when nothing taken is still held back.
    pub(crate) fn idle(&self) -> bool {
        match self {
            Outbound::Socket(s) => s.state == OutState::Idle,
            Outbound::Ring(_) => true,
        }
    }

    /// A ring about to sleep: asks for a doorbell; false if space appeared meanwhile (or this
    /// is not a ring).
    pub(crate) fn arm(&mut self) -> Result<bool, LinkError> {
        match self {
            Outbound::Socket(_) => Ok(false),
            Outbound::Ring(r) => Ok(r.ring.wait_for_space()?),
        }
    }
}

impl SocketOut {
    fn send(&mut self, src: &[u8]) -> Result<Sent, LinkError> {
        let mut taken = 0;
        loop {
            let io = match self.state {
                OutState::Idle => {
                    let rest = &src[taken..];
                    if rest.is_empty() {
                        return Ok(Sent {
                            taken,
                            blocked: false,
                        });
                    }
                    let len = rest.len().min(FRAME_MAX);
                    let sealed = match self.seal.seal_unchanged(&rest[..len]) {
                        Some(tag) => {
                            self.state = OutState::Payload(len);
                            tag
                        }
                        None => {
                            let buf = &mut self.sealed.bytes()[..len];
                            buf.copy_from_slice(&rest[..len]);
                            taken += len;
                            self.state = OutState::Sealed(0, len);
                            self.seal.seal(buf)
                        }
                    };
                    self.tag = Some(sealed.map_err(LinkError::Sealed)?);
                    continue;
                }
                // The rest of the payload and the tag in one call, so the tag leaves with it.
                OutState::Payload(left) => match (src.get(taken..taken + left), &self.tag) {
                    (Some(piece), Some(tag)) => link::send2(self.fd, piece, tag.as_slice()),
                    _ => {
                        return Err(LinkError::Failed(std::io::Error::other(
                            "internal: a frame's source ended before the frame",
                        )))
                    }
                },
                OutState::Sealed(off, len) => match &self.tag {
                    Some(tag) => {
                        link::send2(self.fd, &self.sealed.bytes()[off..len], tag.as_slice())
                    }
                    None => link::send(self.fd, &self.sealed.bytes()[off..len]),
                },
                OutState::Tag(off) => match &self.tag {
                    Some(t) => link::send(self.fd, &t.as_slice()[off..]),
                    None => {
                        self.state = OutState::Idle;
                        continue;
                    }
                },
            };
            let n = match io {
                Io::Done(n) => n,
                Io::Blocked => {
                    return Ok(Sent {
                        taken,
                        blocked: true,
                    })
                }
                other => return Err(io_err(other)),
            };
            let tag_len = self.seal.tag_len();
            let tag_state = |sent: usize| {
                if sent == tag_len {
                    OutState::Idle
                } else {
                    OutState::Tag(sent)
                }
            };
            self.state = match self.state {
                OutState::Payload(left) if n < left => {
                    taken += n;
                    OutState::Payload(left - n)
                }
                OutState::Payload(left) => {
                    taken += left;
                    tag_state(n - left)
                }
                OutState::Sealed(off, len) if off + n < len => OutState::Sealed(off + n, len),
                OutState::Sealed(off, len) => tag_state(off + n - len),
                OutState::Tag(off) => tag_state(off + n),
                OutState::Idle => OutState::Idle,
            };
        }
    }
}
