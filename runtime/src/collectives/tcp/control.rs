//! The control protocol: liveness and failure notices on each pair's control connection.
//!
//! Every rank sends a heartbeat to every peer each `heartbeat_interval` (from its own
//! thread), a failure notice (`Abort`, naming the rank it lost) when an operation fails, and a
//! goodbye when it leaves in an orderly way. Messages are sealed frames (see `wire`, `seal`),
//! so an injected or altered notice is refused and reported, never acted on.
//!
//! A rank reads its control connections only while it runs an operation, so a peer idle for a
//! long time (an evaluation, a checkpoint) stops reading and the sender's socket fills. Frames
//! are therefore written whole or queued: what the socket does not take waits in
//! [`ControlOut`]'s queue and goes first next time, and a heartbeat is skipped while anything
//! waits (a queued frame says as much). The stream never holds a partial frame followed by
//! another frame's bytes, however long the idle spell.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::link::{self, Io};
use super::seal::{SealError, Sealer, MAX_TAG};
use super::wire::{Control, CTRL_LEN};

/// The sending half of one peer's control connection.
pub(crate) struct ControlOut {
    stream: TcpStream,
    seal: Sealer,
    /// Sealed bytes the socket has not taken yet, from `sent` on.
    queue: Vec<u8>,
    sent: usize,
    /// The connection failed; nothing more is sent.
    broken: bool,
}

impl ControlOut {
    pub(crate) fn new(stream: TcpStream, seal: Sealer) -> ControlOut {
        ControlOut {
            stream,
            seal,
            queue: Vec::new(),
            sent: 0,
            broken: false,
        }
    }

    /// Sends what is queued; true when the queue is empty.
    pub(crate) fn flush(&mut self) -> bool {
        while !self.broken && self.sent < self.queue.len() {
            match link::send(self.stream.as_raw_fd(), &self.queue[self.sent..]) {
                Io::Done(n) => self.sent += n,
                Io::Blocked => return false,
                // The peer is gone; its own side notices, and so does ours when it reads.
                Io::Closed | Io::Failed(_) => self.broken = true,
            }
        }
        self.queue.clear();
        self.sent = 0;
        true
    }

    /// Seals `msg` and sends it, queueing what the socket does not take. A heartbeat is
    /// skipped while earlier frames still wait.
    pub(crate) fn send(&mut self, msg: Control) {
        if !self.flush() && msg == Control::Heartbeat {
            return;
        }
        if self.broken {
            return;
        }
        let mut frame = msg.encode().to_vec();
        match self.seal.seal(&mut frame) {
            Ok(tag) => frame.extend_from_slice(tag.as_slice()),
            Err(_) => {
                self.broken = true;
                return;
            }
        }
        self.queue.extend_from_slice(&frame);
        self.flush();
    }

    fn waiting(&self) -> bool {
        !self.broken && self.sent < self.queue.len()
    }
}

/// The sending halves of every peer's control connection (`None` at this rank's index), shared
/// by the worker and the heartbeat thread; the lock serialises whole frames.
pub(crate) type ControlLinks = Arc<Mutex<Vec<Option<ControlOut>>>>;

/// Sends `msg` to every peer.
pub(crate) fn broadcast(links: &ControlLinks, msg: Control) {
    let mut links = links.lock().unwrap_or_else(|p| p.into_inner());
    for c in links.iter_mut().flatten() {
        c.send(msg);
    }
}

/// Flushes every queue until `deadline`; true when everything was sent.
pub(crate) fn drain(links: &ControlLinks, deadline: Instant) -> bool {
    loop {
        let mut fds: Vec<libc::pollfd> = {
            let mut links = links.lock().unwrap_or_else(|p| p.into_inner());
            links
                .iter_mut()
                .flatten()
                .filter_map(|c| (!c.flush() && c.waiting()).then_some(&*c))
                .map(|c| libc::pollfd {
                    fd: c.stream.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                })
                .collect()
        };
        let now = Instant::now();
        if fds.is_empty() {
            return true;
        }
        if now >= deadline {
            return false;
        }
        let slice = (deadline - now).min(Duration::from_millis(50));
        if !link::poll(&mut fds, slice) {
            return false;
        }
    }
}

/// How a control connection ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The peer closed it.
    Closed,
    /// The OS reported an error.
    Failed(std::io::Error),
    /// A frame failed authentication: altered or injected on the way.
    Forged(SealError),
    /// An authenticated frame of an unknown kind.
    Unknown(u8),
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Closed => f.write_str("its process exited or aborted"),
            Ended::Failed(e) => write!(f, "its control connection failed: {e}"),
            Ended::Forged(e) => write!(f, "on its control connection, {e}"),
            Ended::Unknown(k) => write!(f, "it sent an unknown control message (kind {k})"),
        }
    }
}

/// The receiving half of one peer's control connection.
pub(crate) struct ControlIn {
    stream: TcpStream,
    open: Sealer,
    buf: [u8; CTRL_LEN + MAX_TAG],
    got: usize,
}

impl ControlIn {
    pub(crate) fn new(stream: TcpStream, open: Sealer) -> ControlIn {
        ControlIn {
            stream,
            open,
            buf: [0; CTRL_LEN + MAX_TAG],
            got: 0,
        }
    }

    /// The connection, for polling.
    pub(crate) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Reads every whole message that has arrived, without blocking, handing each to `on`.
    /// An error ends the connection: nothing after it is read.
    pub(crate) fn read(&mut self, mut on: impl FnMut(Control)) -> Result<(), Ended> {
        let frame = CTRL_LEN + self.open.tag_len();
        loop {
            match link::recv(self.stream.as_raw_fd(), &mut self.buf[self.got..frame]) {
                Io::Done(n) => self.got += n,
                Io::Blocked => return Ok(()),
                Io::Closed => return Err(Ended::Closed),
                Io::Failed(e) => return Err(Ended::Failed(e)),
            }
            if self.got < frame {
                continue;
            }
            self.got = 0;
            let (payload, tag) = self.buf[..frame].split_at_mut(CTRL_LEN);
            self.open.open(payload, tag).map_err(Ended::Forged)?;
            let mut msg = [0u8; CTRL_LEN];
            msg.copy_from_slice(payload);
            on(Control::decode(&msg).ok_or(Ended::Unknown(msg[0]))?);
        }
    }
}
