//! Raw non-blocking socket I/O and `poll(2)`.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// What a non-blocking transfer did.
pub(crate) enum Io {
    /// Moved this many bytes (> 0).
    Done(usize),
    /// The socket would block.
    Blocked,
    /// The peer closed the connection (EOF on receive).
    Closed,
    /// The OS reported an error (reset, broken pipe, ...).
    Failed(std::io::Error),
}

/// Sends without raising SIGPIPE on a closed peer.
pub(crate) fn send(fd: RawFd, buf: &[u8]) -> Io {
    loop {
        // SAFETY: `buf` is a valid readable slice for its length; the fd is an open socket.
        let n = unsafe {
            libc::send(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            return Io::Done(n as usize);
        }
        if n == 0 {
            return Io::Blocked;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Io::Blocked,
            _ => return Io::Failed(e),
        }
    }
}

/// Receives into `buf` (which must be non-empty).
pub(crate) fn recv(fd: RawFd, buf: &mut [u8]) -> Io {
    loop {
        // SAFETY: `buf` is a valid writable slice for its length; the fd is an open socket.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n > 0 {
            return Io::Done(n as usize);
        }
        if n == 0 {
            return Io::Closed;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Io::Blocked,
            _ => return Io::Failed(e),
        }
    }
}

/// Sends `a` then `b` in one call (without raising SIGPIPE); the count covers both in order.
pub(crate) fn send2(fd: RawFd, a: &[u8], b: &[u8]) -> Io {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    loop {
        // SAFETY: a zeroed msghdr whose iovecs point at the two readable slices for their
        // lengths; the kernel only reads them.
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        };
        if n > 0 {
            return Io::Done(n as usize);
        }
        if n == 0 {
            return Io::Blocked;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Io::Blocked,
            _ => return Io::Failed(e),
        }
    }
}

/// Receives into `a`, then `b`, in one call (`a` must be non-empty); the count covers both
/// in order.
pub(crate) fn recv2(fd: RawFd, a: &mut [u8], b: &mut [u8]) -> Io {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_mut_ptr().cast(),
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        },
    ];
    loop {
        // SAFETY: a zeroed msghdr whose iovecs point at the two writable, exclusively borrowed
        // slices for their lengths.
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT)
        };
        if n > 0 {
            return Io::Done(n as usize);
        }
        if n == 0 {
            return Io::Closed;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Io::Blocked,
            _ => return Io::Failed(e),
        }
    }
}

/// `poll(2)` over `fds` for at most `timeout`; fills `revents`. Returns false on a poll error.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> bool {
    let ms = timeout.as_millis().clamp(0, i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd for its length.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return true;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return false;
        }
    }
}

/// Waits up to `timeout` for a listener (or socket) to become readable.
pub(crate) fn wait_readable(fd: &impl AsRawFd, timeout: Duration) -> bool {
    let mut p = [libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    poll(&mut p, timeout) && p[0].revents != 0
}

/// Asks for socket buffers of `bytes` each way (the kernel may clamp it).
pub(crate) fn set_buffer_sizes(s: &TcpStream, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid fd and a pointer to a c_int of the size given.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}
