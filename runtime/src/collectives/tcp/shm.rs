//! The same-host transport: a single-producer, single-consumer byte ring in shared memory per
//! direction of a pair of ranks on one host.
//!
//! Bulk bytes go through the ring (one copy in, one copy out, or a reduction straight out of
//! the ring), the pair's TCP data connection carries only one-byte doorbells that wake a side
//! blocked on an empty or full ring, and the control connection still carries liveness, so
//! failure semantics are the TCP backend's. A pair uses the rings only if both sides could map
//! each other's ring file, which never happens across hosts (the file is in this host's ring
//! directory, `/dev/shm` by default, under a random name sent over the authenticated
//! connection, and unlinked as soon as the peer mapped it); otherwise the pair stays on TCP.
//!
//! The peer is trusted no more than a socket:
//! - each side keeps the counter it owns (the reader's `head`, the writer's `tail`) in private
//!   memory and only reads the other's from the shared page, checking it against what is
//!   possible (`head <= tail <= head + capacity`) before using it; a bad value is a
//!   [`RingFault`], which the engine reports as that peer's failure;
//! - a ring file shrunk under its mapping faults into zero pages instead of killing this
//!   process (see `sigbus`), and the ring reports it;
//! - a peer's ring name must look like one this code makes, is opened in the ring directory
//!   without following links, and must be a regular file of this user of exactly the agreed
//!   size;
//! - ring files are allocated up front (`posix_fallocate`), so a full ring directory fails the
//!   setup (the pair then uses TCP and says why) instead of raising SIGBUS at the first write;
//! - files left behind by processes killed between creating and unlinking them are swept
//!   when a group forms ([`sweep`]).

use std::ffi::CString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::seal::Keys;
use super::sigbus::Guard;
use crate::bulk_copy::copy_streaming;

/// Bytes of the control page at the start of every ring file.
const CTL_BYTES: usize = 4096;

/// The prefix of every ring file's name: `rekindle-<creator pid>-<24 hex digits>`.
const PREFIX: &str = "rekindle-";

/// A ring file is unlinked within a handshake timeout of its creation; one older than this
/// whose creator is gone was left by a killed process.
const STALE_AGE: Duration = Duration::from_secs(60);

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

/// What is wrong with a ring, as found by this side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RingFault {
    /// A counter the peer writes holds a value no correct peer could have written.
    Counter {
        /// `head` or `tail`.
        name: &'static str,
        /// The value found.
        value: u64,
        /// The range it had to be in.
        low: u64,
        /// The range's end (inclusive).
        high: u64,
    },
    /// The ring file shrank under its mapping.
    Truncated,
}

impl std::fmt::Display for RingFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingFault::Counter {
                name,
                value,
                low,
                high,
            } => write!(
                f,
                "its shared-memory ring holds an impossible {name} counter ({value}, outside \
                 {low}..={high}): the peer is faulty or hostile"
            ),
            RingFault::Truncated => f.write_str(
                "its shared-memory ring file was truncated under the mapping: the peer is \
                 faulty or hostile",
            ),
        }
    }
}

/// One ring file, mapped in this process.
struct Mapping {
    base: *mut u8,
    cap: usize,
    guard: Option<Guard>,
}

// SAFETY: the mapping is shared memory accessed only through atomics (counters) and through
// byte ranges that the SPSC protocol gives to exactly one side at a time; one thread at a
// time uses a ring.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Unregister first, so no fault handler can touch the range once it is unmapped.
        drop(self.guard.take());
        // SAFETY: base/len are exactly what mmap returned.
        unsafe {
            libc::munmap(self.base.cast(), CTL_BYTES + self.cap);
        }
    }
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Mapping {
    fn map(fd: &OwnedFd, cap: usize) -> Result<Mapping, String> {
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
        let mut m = Mapping {
            base: p.cast(),
            cap,
            guard: None,
        };
        m.guard = Some(
            Guard::register(m.base, CTL_BYTES + cap)
                .ok_or("cannot guard the mapping against truncation (SIGBUS handler)")?,
        );
        Ok(m)
    }

    fn ctl(&self) -> &Ctl {
        // SAFETY: the control page is at the start of the mapping, page-aligned, and Ctl is
        // made of atomics, valid for any bit pattern (zero-initialised by fallocate).
        unsafe { &*(self.base as *const Ctl) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(CTL_BYTES) }
    }

    fn check(&self) -> Result<(), RingFault> {
        match &self.guard {
            Some(g) if !g.faulted() => Ok(()),
            _ => Err(RingFault::Truncated),
        }
    }
}

/// The reading side of a ring: this rank's own file, written by the peer.
pub(crate) struct RingReader {
    map: Mapping,
    /// Bytes consumed, ever: the authoritative copy of the shared `head`.
    head: u64,
}

impl RingReader {
    fn tail(&self) -> Result<u64, RingFault> {
        let tail = self.map.ctl().tail.load(Ordering::Acquire);
        // After the access: a truncated file faults it into zero pages, which reads as 0.
        self.map.check()?;
        let high = self.head + self.map.cap as u64;
        if tail < self.head || tail > high {
            return Err(RingFault::Counter {
                name: "tail",
                value: tail,
                low: self.head,
                high,
            });
        }
        Ok(tail)
    }

    /// The readable bytes, up to `max`, as at most two contiguous pieces. The peer may change
    /// them while they are read, but not their bounds; check [`RingReader::consume`]'s result
    /// before trusting what was read.
    pub(crate) fn readable(&self, max: usize) -> Result<(&[u8], &[u8]), RingFault> {
        let tail = self.tail()?;
        let cap = self.map.cap;
        let n = ((tail - self.head) as usize).min(max);
        let at = (self.head % cap as u64) as usize;
        let first = n.min(cap - at);
        // SAFETY: `at + first <= cap` and `n - first <= cap - first`, so both pieces are in the
        // data area; the protocol gives the reader [head, tail) until it consumes them.
        Ok(unsafe {
            (
                std::slice::from_raw_parts(self.map.data().add(at), first),
                std::slice::from_raw_parts(self.map.data(), n - first),
            )
        })
    }

    /// Releases `n` bytes (at most what [`RingReader::readable`] returned); returns whether
    /// the writer asked for a doorbell. An error means what was read is garbage.
    pub(crate) fn consume(&mut self, n: usize) -> Result<bool, RingFault> {
        // Checked first for what was read, and again after the stores.
        self.map.check()?;
        let ctl = self.map.ctl();
        self.head += n as u64;
        ctl.head.store(self.head, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let bell = ctl.tx_wait.swap(0, Ordering::SeqCst) == 1;
        self.map.check()?;
        Ok(bell)
    }

    /// About to sleep: asks for a doorbell; false if data arrived meanwhile.
    pub(crate) fn wait_for_data(&self) -> Result<bool, RingFault> {
        let ctl = self.map.ctl();
        ctl.rx_wait.store(1, Ordering::SeqCst);
        let empty = self.tail()? == self.head;
        if !empty {
            ctl.rx_wait.store(0, Ordering::SeqCst);
        }
        Ok(empty)
    }
}

/// The writing side of a ring: the peer's file.
pub(crate) struct RingWriter {
    map: Mapping,
    /// Bytes produced, ever: the authoritative copy of the shared `tail`.
    tail: u64,
    /// The highest `head` seen: the reader never moves it back.
    head: u64,
}

impl RingWriter {
    fn head(&mut self) -> Result<u64, RingFault> {
        let head = self.map.ctl().head.load(Ordering::Acquire);
        // After the access: a truncated file faults it into zero pages, which reads as 0.
        self.map.check()?;
        if head < self.head || head > self.tail {
            return Err(RingFault::Counter {
                name: "head",
                value: head,
                low: self.head,
                high: self.tail,
            });
        }
        self.head = head;
        Ok(head)
    }

    /// Copies as much of `src` as fits; returns the bytes written and whether the reader
    /// asked for a doorbell. With `streaming`, the bytes go to memory with streaming stores
    /// (see [`crate::bulk_copy`]) instead of through this core's cache.
    pub(crate) fn write(
        &mut self,
        src: &[u8],
        streaming: bool,
    ) -> Result<(usize, bool), RingFault> {
        let head = self.head()?;
        let cap = self.map.cap;
        // head <= tail <= head + cap holds: every write keeps tail - head within cap, and head
        // only grows.
        let free = cap - (self.tail - head) as usize;
        let n = free.min(src.len());
        if n == 0 {
            return Ok((0, false));
        }
        let at = (self.tail % cap as u64) as usize;
        let first = n.min(cap - at);
        // SAFETY: the SPSC protocol gives the writer the free range [tail, head + cap), which
        // the reader does not touch until `tail` is published below; the two pieces are
        // within the data area.
        let (d1, d2) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.map.data().add(at), first),
                std::slice::from_raw_parts_mut(self.map.data(), n - first),
            )
        };
        let copy = if streaming {
            copy_streaming // fenced: the stores are visible before `tail` moves
        } else {
            <[u8]>::copy_from_slice
        };
        copy(d1, &src[..first]);
        copy(d2, &src[first..n]);
        self.map.check()?;
        self.tail += n as u64;
        let ctl = self.map.ctl();
        ctl.tail.store(self.tail, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let bell = ctl.rx_wait.swap(0, Ordering::SeqCst) == 1;
        self.map.check()?;
        Ok((n, bell))
    }

    /// About to sleep: asks for a doorbell; false if space appeared meanwhile.
    pub(crate) fn wait_for_space(&mut self) -> Result<bool, RingFault> {
        self.map.ctl().tx_wait.store(1, Ordering::SeqCst);
        let full = (self.tail - self.head()?) as usize == self.map.cap;
        if !full {
            self.map.ctl().tx_wait.store(0, Ordering::SeqCst);
        }
        Ok(full)
    }
}

/// Both directions of a pair.
pub(crate) struct ShmPair {
    /// This rank writes, the peer reads.
    pub tx: RingWriter,
    /// The peer writes, this rank reads.
    pub rx: RingReader,
}

/// A ring file this process created, unlinked when dropped.
struct Created {
    path: CString,
    reader: RingReader,
}

impl Created {
    fn name(&self) -> &[u8] {
        let bytes = self.path.as_bytes();
        let slash = bytes.iter().rposition(|b| *b == b'/').map_or(0, |i| i + 1);
        &bytes[slash..]
    }
}

fn unlink(path: &CString) {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::unlink(path.as_ptr()) };
}

fn cpath(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{} has a NUL byte", p.display()))
}

/// Creates a ring file of `cap` data bytes (a multiple of 8) in `dir`, allocates all of it,
/// and maps it.
fn create(dir: &Path, cap: usize) -> Result<Created, String> {
    let mut nonce = [0u8; 12];
    getrandom::getrandom(&mut nonce).map_err(|e| e.to_string())?;
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let path = cpath(&dir.join(format!("{PREFIX}{}-{hex}", std::process::id())))?;
    // SAFETY: a NUL-terminated path; O_EXCL guarantees a fresh file of ours.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(os_err(&format!(
            "creating a ring file in {}",
            dir.display()
        )));
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = CTL_BYTES + cap;
    // SAFETY: a valid fd; the size fits in off_t for any ring this code creates.
    let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
    if rc != 0 {
        unlink(&path);
        let why = std::io::Error::from_raw_os_error(rc);
        return Err(if rc == libc::ENOSPC {
            format!(
                "{} has no room for a {len}-byte ring ({why}); give it more space (a \
                 container's /dev/shm is often 64 MiB) or lower TcpOptions::shm_ring_bytes",
                dir.display()
            )
        } else {
            format!("allocating a {len}-byte ring in {}: {why}", dir.display())
        });
    }
    match Mapping::map(&fd, cap) {
        Ok(map) => Ok(Created {
            path,
            reader: RingReader { map, head: 0 },
        }),
        Err(e) => {
            unlink(&path);
            Err(e)
        }
    }
}

/// True if `name` is a ring file name this code makes; returns the creator's pid.
fn parse_name(name: &[u8]) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX.as_bytes())?;
    let dash = rest.iter().position(|b| *b == b'-')?;
    let (pid, hex) = (&rest[..dash], &rest[dash + 1..]);
    let digits = !pid.is_empty() && pid.len() <= 10 && pid.iter().all(u8::is_ascii_digit);
    let hex_ok = hex.len() == 24 && hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !(digits && hex_ok) {
        return None;
    }
    std::str::from_utf8(pid).ok()?.parse().ok()
}

/// Opens and maps the peer's ring file `name` in `dir` for writing, after checking that it is
/// what a peer of this job would have made.
fn open_peer(dir: &Path, name: &[u8], cap: usize) -> Result<RingWriter, String> {
    if parse_name(name).is_none() {
        return Err(format!(
            "the peer offered {:?}, which is not a ring file name",
            String::from_utf8_lossy(name)
        ));
    }
    let path = cpath(&dir.join(std::ffi::OsStr::from_bytes(name)))?;
    // SAFETY: a NUL-terminated path; O_NOFOLLOW refuses a symbolic link in its place.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(os_err("opening the peer's ring file"));
    }
    // SAFETY: fd was just returned by open.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fstat into a zeroed stat of the right type.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(os_err("fstat of the peer's ring file"));
        }
        st
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let want = (CTL_BYTES + cap) as i64;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err("the peer's ring file is not a regular file".into());
    }
    if st.st_uid != me {
        return Err(format!(
            "the peer's ring file belongs to uid {}, not to this process's uid {me}",
            st.st_uid
        ));
    }
    if st.st_nlink != 1 || st.st_size as i64 != want {
        return Err(format!(
            "the peer's ring file has {} bytes and {} links (expected {want} and 1)",
            st.st_size, st.st_nlink
        ));
    }
    Ok(RingWriter {
        map: Mapping::map(&fd, cap)?,
        tail: 0,
        head: 0,
    })
}

/// Removes ring files in `dir` left by processes that died between creating and unlinking
/// them: names this code makes, owned by this user, older than a minute, whose creator pid
/// no longer exists. Returns how many were removed.
pub(crate) fn sweep(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = parse_name(name.as_bytes()) else {
            continue;
        };
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        use std::os::unix::fs::MetadataExt;
        let old = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age > STALE_AGE);
        if !meta.file_type().is_file() || meta.uid() != me || !old || pid_alive(pid) {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(
            dir = %dir.display(),
            removed,
            "removed shared-memory ring files left by killed processes"
        );
    }
    removed
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Bytes of a ring offer: a length byte and a file name, zero-padded.
const OFFER_LEN: usize = 64;

/// Sends `payload` sealed as one frame on a blocking stream.
fn send_sealed(s: &mut TcpStream, keys: &mut Keys, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = payload.to_vec();
    let tag = keys
        .send
        .seal(&mut buf)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    buf.extend_from_slice(tag.as_slice());
    s.write_all(&buf)
}

/// Receives one sealed frame of `len` payload bytes on a blocking stream.
fn recv_sealed(s: &mut TcpStream, keys: &mut Keys, len: usize) -> std::io::Result<Vec<u8>> {
    let tag_len = keys.recv.tag_len();
    let mut buf = vec![0u8; len + tag_len];
    s.read_exact(&mut buf)?;
    let tag = buf.split_off(len);
    keys.recv
        .open(&mut buf, &tag)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    Ok(buf)
}

/// How a negotiation ended.
pub(crate) enum Negotiated {
    /// Both sides mapped each other's ring.
    Rings(ShmPair),
    /// The pair uses TCP. `warn` says why when this side found a problem worth a warning (a
    /// full ring directory, a bad peer file), `None` when the cause is ordinary (another host,
    /// shared memory off) or the peer's to report.
    Tcp { why: String, warn: bool },
}

/// Negotiates a ring pair over a freshly authenticated, still blocking data connection; both
/// sides run this symmetrically, each with `dir` = `None` when its shared memory is off.
/// Every message is sealed with the connection's keys. I/O errors end the connection.
pub(crate) fn negotiate(
    data: &mut TcpStream,
    keys: &mut Keys,
    dir: Option<&Path>,
    cap: usize,
) -> std::io::Result<Negotiated> {
    let created = dir.map(|d| create(d, cap));
    let mut offer = [0u8; OFFER_LEN];
    if let Some(Ok(c)) = &created {
        let name = c.name();
        offer[0] = name.len() as u8;
        offer[1..1 + name.len()].copy_from_slice(name);
    }
    send_sealed(data, keys, &offer)?;
    let theirs = recv_sealed(data, keys, OFFER_LEN)?;
    let len = (theirs[0] as usize).min(OFFER_LEN - 1);
    let name = &theirs[1..1 + len];
    let opened = match dir {
        Some(d) if !name.is_empty() => Some(open_peer(d, name, cap)),
        _ => None,
    };
    send_sealed(data, keys, &[u8::from(matches!(opened, Some(Ok(_))))])?;
    let ack = recv_sealed(data, keys, 1)?;
    // The peer has mapped our file or given up on it: either way the name can go.
    if let Some(Ok(c)) = &created {
        unlink(&c.path);
    }
    Ok(match (created, opened, ack[0]) {
        (Some(Ok(mine)), Some(Ok(tx)), 1) => Negotiated::Rings(ShmPair {
            tx,
            rx: mine.reader,
        }),
        (None, _, _) => Negotiated::Tcp {
            why: "shared memory is off on this rank".into(),
            warn: false,
        },
        (Some(Err(e)), _, _) => Negotiated::Tcp { why: e, warn: true },
        (_, None, _) => Negotiated::Tcp {
            why: "the peer offered no ring (shared memory off, or it could not make one)".into(),
            warn: false,
        },
        // Not found: the usual sign of a peer on another host.
        (_, Some(Err(e)), _) if e.contains("No such file") => Negotiated::Tcp {
            why: format!("{e} (the peer is on another host)"),
            warn: false,
        },
        (_, Some(Err(e)), _) => Negotiated::Tcp { why: e, warn: true },
        (_, Some(Ok(_)), _) => Negotiated::Tcp {
            why: "the peer could not map this rank's ring".into(),
            warn: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm_dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").unwrap()
    }

    /// A ring of `cap` bytes: (reader, writer), with the file already unlinked.
    fn ring(dir: &Path, cap: usize) -> (RingReader, RingWriter) {
        let c = create(dir, cap).unwrap();
        let w = open_peer(dir, c.name(), cap).unwrap();
        unlink(&c.path);
        (c.reader, w)
    }

    #[test]
    fn ring_wraps_and_signals() {
        let dir = shm_dir();
        let (mut r, mut w) = ring(dir.path(), 64);
        assert!(r.wait_for_data().unwrap(), "empty ring waits");
        let data: Vec<u8> = (0..100u8).collect();
        let (n, bell) = w.write(&data, false).unwrap();
        assert_eq!(
            (n, bell),
            (64, true),
            "fills the ring and rings the waiting reader"
        );
        assert_eq!(w.write(&data[64..], false).unwrap().0, 0, "full");
        assert!(w.wait_for_space().unwrap());
        let (a, b) = r.readable(40).unwrap();
        assert_eq!((a.len(), b.len()), (40, 0));
        assert_eq!(a, &data[..40]);
        assert!(r.consume(40).unwrap(), "rings the waiting writer");
        let (n, _) = w.write(&data[64..], false).unwrap();
        assert_eq!(n, 36);
        let (a, b) = r.readable(usize::MAX).unwrap();
        let got: Vec<u8> = a.iter().chain(b).copied().collect();
        assert_eq!(got, &data[40..]);
        assert!(!r.consume(got.len()).unwrap());
    }

    #[test]
    fn streaming_writes_carry_the_same_bytes_across_wraps() {
        // Pieces of odd lengths at every offset of the ring, each written with streaming
        // stores and read back: the bytes that arrive are the bytes sent, in order.
        const CAP: usize = 4096;
        let dir = shm_dir();
        let (mut r, mut w) = ring(dir.path(), CAP);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got) = (0, Vec::with_capacity(data.len()));
        let mut piece = 1;
        while got.len() < data.len() {
            let end = (sent + piece).min(data.len());
            sent += w.write(&data[sent..end], true).unwrap().0;
            piece = piece % 3001 + 977;
            let (a, b) = r.readable(piece / 2 + 1).unwrap();
            let n = a.len() + b.len();
            got.extend_from_slice(a);
            got.extend_from_slice(b);
            r.consume(n).unwrap();
        }
        assert_eq!(got, data);
    }

    #[test]
    fn impossible_counters_are_faults_not_accesses() {
        let dir = shm_dir();
        let (mut r, mut w) = ring(dir.path(), 64);
        w.write(&[1; 10], false).unwrap();
        // The peer claims more bytes than the ring holds, then fewer than were consumed.
        let ctl = w.map.ctl();
        for bad in [64 + 1, u64::MAX] {
            ctl.tail.store(bad, Ordering::SeqCst);
            assert_eq!(
                r.readable(usize::MAX).unwrap_err(),
                RingFault::Counter {
                    name: "tail",
                    value: bad,
                    low: 0,
                    high: 64
                }
            );
        }
        ctl.tail.store(10, Ordering::SeqCst);
        r.consume(8).unwrap();
        ctl.tail.store(7, Ordering::SeqCst);
        assert!(matches!(
            r.readable(1),
            Err(RingFault::Counter { name: "tail", .. })
        ));
        assert!(r.wait_for_data().is_err());
        // The reader's head past what was written, or moved back.
        let rctl = r.map.ctl();
        rctl.head.store(11, Ordering::SeqCst);
        assert!(matches!(
            w.write(&[1], false),
            Err(RingFault::Counter {
                name: "head",
                value: 11,
                low: 0,
                high: 10
            })
        ));
        rctl.head.store(8, Ordering::SeqCst);
        w.write(&[1], false).unwrap();
        rctl.head.store(2, Ordering::SeqCst);
        assert!(matches!(
            w.write(&[1], false),
            Err(RingFault::Counter {
                name: "head",
                value: 2,
                low: 8,
                ..
            })
        ));
        assert!(w.wait_for_space().is_err());
    }

    #[test]
    fn a_ring_file_truncated_under_both_mappings_faults_instead_of_killing() {
        let dir = shm_dir();
        let c = create(dir.path(), 1 << 16).unwrap();
        let mut w = open_peer(dir.path(), c.name(), 1 << 16).unwrap();
        let mut r = c.reader;
        w.write(&[5; 1000], false).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(std::ffi::OsStr::from_bytes(
                &c.path.as_bytes()[dir.path().as_os_str().len() + 1..],
            )));
        f.unwrap().set_len(0).unwrap();
        // Both sides touch the ring: the accesses fault into zero pages and are reported.
        assert_eq!(w.write(&[6; 100], false).unwrap_err(), RingFault::Truncated);
        assert_eq!(r.readable(10).unwrap_err(), RingFault::Truncated);
        assert_eq!(r.consume(0).unwrap_err(), RingFault::Truncated);
        unlink(&c.path);
    }

    #[test]
    fn peer_files_are_checked_before_they_are_mapped() {
        let dir = shm_dir();
        let d = dir.path();
        let bad_name = open_peer(d, b"../../etc/passwd", 64).err().unwrap();
        assert!(bad_name.contains("not a ring file name"), "{bad_name}");
        let c = create(d, 64).unwrap();
        let name = c.name().to_vec();
        // The wrong size.
        let e = open_peer(d, &name, 128).err().unwrap();
        assert!(e.contains("bytes"), "{e}");
        // A symbolic link in place of a ring file.
        let link = format!("{PREFIX}1-{}", "ab".repeat(12));
        std::os::unix::fs::symlink(d.join(std::ffi::OsStr::from_bytes(&name)), d.join(&link))
            .unwrap();
        let e = open_peer(d, link.as_bytes(), 64).err().unwrap();
        assert!(e.contains("opening"), "{e}");
        // A missing file.
        let e = open_peer(d, format!("{PREFIX}1-{}", "cd".repeat(12)).as_bytes(), 64)
            .err()
            .unwrap();
        assert!(e.contains("No such file"), "{e}");
        unlink(&c.path);
    }

    #[test]
    fn names_parse_strictly() {
        assert_eq!(
            parse_name(format!("{PREFIX}42-{}", "0a".repeat(12)).as_bytes()),
            Some(42)
        );
        for bad in [
            "rekindle-42-0a".to_string(),
            format!("{PREFIX}-{}", "0a".repeat(12)),
            format!("{PREFIX}4x-{}", "0a".repeat(12)),
            format!("{PREFIX}42-{}", "0A".repeat(12)),
            format!("{PREFIX}42-{}/", "0a".repeat(12)),
            "other".to_string(),
        ] {
            assert_eq!(parse_name(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn sweeping_removes_only_old_files_of_dead_processes() {
        let dir = shm_dir();
        let d = dir.path();
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        let me = std::process::id();
        let file = |pid: u32, tag: &str, age: Duration| {
            let p = d.join(format!("{PREFIX}{pid}-{}", tag.repeat(12)));
            let f = std::fs::File::create(&p).unwrap();
            f.set_modified(SystemTime::now() - age).unwrap();
            p
        };
        let hour = Duration::from_secs(3600);
        let stale = file(dead, "01", hour);
        let fresh = file(dead, "02", Duration::ZERO);
        let alive = file(me, "03", hour);
        let other = d.join("not-a-ring");
        std::fs::File::create(&other).unwrap();
        assert_eq!(sweep(d), 1);
        assert!(!stale.exists());
        assert!(fresh.exists() && alive.exists() && other.exists());
    }
}
