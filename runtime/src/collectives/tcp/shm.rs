//! The same-host transport: a single-producer, single-consumer byte ring in shared memory per
//! direction of a pair of ranks on one host.
//!
//! Bulk bytes go through the ring (one copy in, one copy out, or a reduction straight out of
//! the ring), the pair's TCP data connection carries only one-byte doorbells that wake a side
//! blocked on an empty or full ring, and the control connection still carries liveness, so
//! failure semantics are the TCP backend's. A pair uses the ring only if both sides could map
//! each other's ring file, which never happens across hosts (the file is in this host's
//! `/dev/shm` under a random name, sent over the authenticated connection and unlinked as soon
//! as the peer mapped it); otherwise the pair stays on TCP.

use std::ffi::CString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::bulk_copy::copy_streaming;

/// Bytes of the control page at the start of every ring file.
const CTL_BYTES: usize = 4096;

/// The ring's shared counters, each on its own cache line.
#[repr(C)]
struct Ctl {
    /// Bytes consumed by the reader, ever.
    head: AtomicU64,
    _pad0: [u8; 56],
    /// Bytes produced by the writer, ever.
    tail: AtomicU64,
    _pad1: [u8; 56],
    /// The reader found the ring empty and waits for a doorbell.
    rx_wait: AtomicU32,
    _pad2: [u8; 60],
    /// The writer found the ring full and waits for a doorbell.
    tx_wait: AtomicU32,
}

/// One direction's ring, mapped in this process.
pub(crate) struct Ring {
    base: *mut u8,
    cap: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics (counters) and through
// byte ranges that the SPSC protocol gives to exactly one side at a time.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned.
        unsafe {
            libc::munmap(self.base.cast(), CTL_BYTES + self.cap);
        }
    }
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Ring {
    fn map(fd: &OwnedFd, cap: usize) -> Result<Ring, String> {
        use std::os::fd::AsRawFd;
        // SAFETY: mapping a file we opened, of at least this size, shared read-write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                CTL_BYTES + cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap"));
        }
        Ok(Ring {
            base: p.cast(),
            cap,
        })
    }

    /// Creates a ring file of `cap` data bytes (a multiple of 8) in /dev/shm and maps it.
    fn create(cap: usize) -> Result<(Ring, CString), String> {
        let mut nonce = [0u8; 12];
        getrandom::getrandom(&mut nonce).map_err(|e| e.to_string())?;
        let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let path = CString::new(format!("/dev/shm/rekindle-{hex}")).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated path; O_EXCL guarantees a fresh file of ours.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_err("creating the ring file"));
        }
        // SAFETY: fd was just returned by open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        use std::os::fd::AsRawFd;
        // SAFETY: a valid fd; the size fits in off_t for any ring this code creates.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), (CTL_BYTES + cap) as libc::off_t) } != 0 {
            let e = os_err("sizing the ring file");
            // SAFETY: the NUL-terminated path of the file created above.
            unsafe { libc::unlink(path.as_ptr()) };
            return Err(e);
        }
        match Ring::map(&fd, cap) {
            Ok(r) => Ok((r, path)),
            Err(e) => {
                // SAFETY: as above.
                unsafe { libc::unlink(path.as_ptr()) };
                Err(e)
            }
        }
    }

    fn open(path: &CString, cap: usize) -> Result<Ring, String> {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("opening the peer's ring file"));
        }
        // SAFETY: fd was just returned by open.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let meta = std::fs::File::from(fd.try_clone().map_err(|e| e.to_string())?)
            .metadata()
            .map_err(|e| e.to_string())?;
        if meta.len() != (CTL_BYTES + cap) as u64 {
            return Err(format!("the peer's ring file has {} bytes", meta.len()));
        }
        Ring::map(&fd, cap)
    }

    fn ctl(&self) -> &Ctl {
        // SAFETY: the control page is at the start of the mapping, page-aligned, and Ctl is
        // made of atomics, valid for any bit pattern (zero-initialised by ftruncate).
        unsafe { &*(self.base as *const Ctl) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(CTL_BYTES) }
    }

    /// Writer: copies as much of `src` as fits; returns the bytes written and whether the
    /// reader asked for a doorbell. With `streaming`, the bytes go to memory with streaming
    /// stores (see [`crate::bulk_copy`]) instead of through this core's cache.
    pub(crate) fn write(&self, src: &[u8], streaming: bool) -> (usize, bool) {
        let ctl = self.ctl();
        let tail = ctl.tail.load(Ordering::Relaxed);
        let head = ctl.head.load(Ordering::Acquire);
        let free = self.cap - (tail - head) as usize;
        let n = free.min(src.len());
        if n == 0 {
            return (0, false);
        }
        let at = (tail % self.cap as u64) as usize;
        let first = n.min(self.cap - at);
        // SAFETY: the SPSC protocol gives the writer the free range [tail, head + cap), which
        // the reader does not touch until `tail` is published below; the two pieces are
        // within the data area.
        let (d1, d2) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.data().add(at), first),
                std::slice::from_raw_parts_mut(self.data(), n - first),
            )
        };
        let copy = if streaming {
            copy_streaming // fenced: the stores are visible before `tail` moves
        } else {
            <[u8]>::copy_from_slice
        };
        copy(d1, &src[..first]);
        copy(d2, &src[first..n]);
        ctl.tail.store(tail + n as u64, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let ring = ctl.rx_wait.swap(0, Ordering::SeqCst) == 1;
        (n, ring)
    }

    /// Reader: the readable bytes, up to `max`, as at most two contiguous pieces.
    pub(crate) fn readable(&self, max: usize) -> (&[u8], &[u8]) {
        let ctl = self.ctl();
        let head = ctl.head.load(Ordering::Relaxed);
        let tail = ctl.tail.load(Ordering::Acquire);
        let n = ((tail - head) as usize).min(max);
        let at = (head % self.cap as u64) as usize;
        let first = n.min(self.cap - at);
        // SAFETY: the protocol gives the reader [head, tail) until it calls `consume`.
        unsafe {
            (
                std::slice::from_raw_parts(self.data().add(at), first),
                std::slice::from_raw_parts(self.data(), n - first),
            )
        }
    }

    /// Reader: releases `n` bytes; returns whether the writer asked for a doorbell.
    pub(crate) fn consume(&self, n: usize) -> bool {
        let ctl = self.ctl();
        let head = ctl.head.load(Ordering::Relaxed);
        ctl.head.store(head + n as u64, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        ctl.tx_wait.swap(0, Ordering::SeqCst) == 1
    }

    /// Reader about to sleep: asks for a doorbell; false if data arrived meanwhile.
    pub(crate) fn wait_for_data(&self) -> bool {
        let ctl = self.ctl();
        ctl.rx_wait.store(1, Ordering::SeqCst);
        let empty = ctl.tail.load(Ordering::SeqCst) == ctl.head.load(Ordering::SeqCst);
        if !empty {
            ctl.rx_wait.store(0, Ordering::SeqCst);
        }
        empty
    }

    /// Writer about to sleep: asks for a doorbell; false if space appeared meanwhile.
    pub(crate) fn wait_for_space(&self) -> bool {
        let ctl = self.ctl();
        ctl.tx_wait.store(1, Ordering::SeqCst);
        let full = (ctl.tail.load(Ordering::SeqCst) - ctl.head.load(Ordering::SeqCst)) as usize
            == self.cap;
        if !full {
            ctl.tx_wait.store(0, Ordering::SeqCst);
        }
        full
    }
}

/// Both directions of a pair.
pub(crate) struct ShmPair {
    /// This rank writes, the peer reads.
    pub tx: Ring,
    /// The peer writes, this rank reads.
    pub rx: Ring,
}

/// Takes part in a negotiation without offering or accepting rings (shared memory disabled
/// here), so the peer falls back to TCP too.
pub(crate) fn decline(data: &mut TcpStream) -> std::io::Result<Option<ShmPair>> {
    data.write_all(&[0])?;
    let mut len = [0u8; 1];
    data.read_exact(&mut len)?;
    let mut theirs = vec![0u8; len[0] as usize];
    data.read_exact(&mut theirs)?;
    data.write_all(&[0])?;
    let mut ack = [0u8; 1];
    data.read_exact(&mut ack)?;
    Ok(None)
}

/// Negotiates a ring pair over a freshly authenticated, still blocking data connection. Both
/// sides run this symmetrically. Returns `None` (stay on TCP) if either side cannot map the
/// other's ring, which is always the case across hosts.
pub(crate) fn negotiate(data: &mut TcpStream, cap: usize) -> std::io::Result<Option<ShmPair>> {
    let created = Ring::create(cap);
    let name: &[u8] = match &created {
        Ok((_, path)) => path.as_bytes(),
        Err(_) => b"",
    };
    data.write_all(&[name.len() as u8])?;
    data.write_all(name)?;
    let mut len = [0u8; 1];
    data.read_exact(&mut len)?;
    let mut theirs = vec![0u8; len[0] as usize];
    data.read_exact(&mut theirs)?;
    let opened = if theirs.is_empty() || !theirs.starts_with(b"/dev/shm/rekindle-") {
        None
    } else {
        CString::new(theirs)
            .ok()
            .and_then(|p| Ring::open(&p, cap).ok())
    };
    data.write_all(&[u8::from(opened.is_some())])?;
    let mut ack = [0u8; 1];
    data.read_exact(&mut ack)?;
    // The peer has mapped our file or given up on it: either way the name can go.
    if let Ok((_, path)) = &created {
        // SAFETY: the NUL-terminated path of the file this side created.
        unsafe { libc::unlink(path.as_ptr()) };
    }
    match (created, opened, ack[0]) {
        (Ok((rx, _)), Some(tx), 1) => Ok(Some(ShmPair { tx, rx })),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_wraps_and_signals() {
        let (r, path) = Ring::create(64).unwrap();
        let w = Ring::open(&path, 64).unwrap();
        unsafe { libc::unlink(path.as_ptr()) };
        assert!(r.wait_for_data(), "empty ring waits");
        let data: Vec<u8> = (0..100u8).collect();
        let (n, bell) = w.write(&data, false);
        assert_eq!(
            (n, bell),
            (64, true),
            "fills the ring and rings the waiting reader"
        );
        assert_eq!(w.write(&data[64..], false).0, 0, "full");
        assert!(w.wait_for_space());
        let (a, b) = r.readable(40);
        assert_eq!((a.len(), b.len()), (40, 0));
        assert_eq!(a, &data[..40]);
        assert!(r.consume(40), "rings the waiting writer");
        let (n, _) = w.write(&data[64..], false);
        assert_eq!(n, 36);
        let (a, b) = r.readable(usize::MAX);
        let got: Vec<u8> = a.iter().chain(b).copied().collect();
        assert_eq!(got, &data[40..]);
        assert!(!r.consume(got.len()));
    }

    #[test]
    fn streaming_writes_carry_the_same_bytes_across_wraps() {
        // Pieces of odd lengths at every offset of the ring, each written with streaming
        // stores and read back: the bytes that arrive are the bytes sent, in order.
        const CAP: usize = 4096;
        let (r, path) = Ring::create(CAP).unwrap();
        let w = Ring::open(&path, CAP).unwrap();
        unsafe { libc::unlink(path.as_ptr()) };
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got) = (0, Vec::with_capacity(data.len()));
        let mut piece = 1;
        while got.len() < data.len() {
            let end = (sent + piece).min(data.len());
            sent += w.write(&data[sent..end], true).0;
            piece = piece % 3001 + 977;
            let (a, b) = r.readable(piece / 2 + 1);
            got.extend_from_slice(a);
            got.extend_from_slice(b);
            r.consume(a.len() + b.len());
        }
        assert_eq!(got, data);
    }
}
