//! Shared-memory rings are as untrusted as a socket: a corrupted counter or a ring file
//! truncated under its mapping is a peer failure naming the rank, never a crash; a full ring
//! directory makes the pair use TCP; stale ring files of killed processes are swept. Ranks are
//! threads, so the test reaches the rings through this process's own mappings, as a hostile
//! peer would through its own.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{config, WAIT};
use rekindle_runtime::store::{InMemoryStore, Store};
use rekindle_runtime::{
    Buffer, Error, PeerTransport, ProcessGroup, ReduceOp, TcpBackend, TcpOptions,
};

/// A ring directory of the test's own under /dev/shm.
fn ring_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap()
}

fn opts(dir: &Path) -> TcpOptions {
    TcpOptions {
        shm_dir: dir.to_path_buf(),
        ..TcpOptions::default()
    }
}

/// Two backends of one group (rank 0, rank 1) with a short op deadline.
fn pair(job: &str, opts: TcpOptions) -> (TcpBackend, TcpBackend) {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let short = |mut c: rekindle_runtime::GroupConfig| {
        c.op_timeout = Duration::from_secs(10);
        c
    };
    let (s1, o1, j1) = (store.clone(), opts.clone(), job.to_string());
    let h =
        std::thread::spawn(move || TcpBackend::new(short(config(&j1, 0, 1, 2, s1)), o1).unwrap());
    let b0 = TcpBackend::new(short(config(job, 0, 0, 2, store)), opts).unwrap();
    (b0, h.join().unwrap())
}

/// Runs one all-reduce on both ranks: (rank 0's result, rank 1's result).
fn all_reduce(
    pg0: &ProcessGroup,
    pg1: &ProcessGroup,
) -> (Result<Buffer, Error>, Result<Buffer, Error>) {
    let w0 = pg0.all_reduce(Buffer::from(vec![1.0f32; 1 << 16]), ReduceOp::Sum);
    let w1 = pg1.all_reduce(Buffer::from(vec![2.0f32; 1 << 16]), ReduceOp::Sum);
    (w0.wait(WAIT), w1.wait(WAIT))
}

/// This process's mappings of ring files in `dir` (unlinked by now): (start, end) addresses.
fn ring_mappings(dir: &Path) -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let needle = format!("{}/rekindle-", dir.display());
    maps.lines()
        .filter(|l| l.contains(&needle))
        .map(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            )
        })
        .collect()
}

fn assert_names(e: &Error, peer: usize, what: &str) {
    match e {
        Error::PeerLost {
            peer: p, reason, ..
        } if *p == peer => {
            assert!(
                reason.contains(what),
                "expected {what:?} naming rank {peer}, got: {e}"
            )
        }
        other => panic!("expected {what:?} naming rank {peer}, got: {other}"),
    }
}

#[test]
fn a_corrupted_ring_counter_is_a_peer_failure_naming_the_rank() {
    let dir = ring_dir();
    let (b0, b1) = pair("counter", opts(dir.path()));
    assert_eq!(b0.peer_transports(), &[(1, PeerTransport::SharedMemory)]);
    let (pg0, pg1) = (
        ProcessGroup::new(Arc::new(b0)),
        ProcessGroup::new(Arc::new(b1)),
    );
    let (a, b) = all_reduce(&pg0, &pg1);
    assert!(a.is_ok() && b.is_ok());
    // Both ring files, each mapped twice (by its reader and its writer): a "reader" claims to
    // have consumed far more than was ever written. The head counter is the first word of the
    // control page.
    let maps = ring_mappings(dir.path());
    assert_eq!(maps.len(), 4, "{maps:?}");
    for (start, _) in maps {
        // SAFETY: a live shared mapping of this process, at least a page long; the test plays
        // the hostile peer that can write it.
        unsafe { std::ptr::write_volatile(start as *mut u64, 1 << 62) };
    }
    let (a, b) = all_reduce(&pg0, &pg1);
    assert_both_fail(a, b, "impossible head counter");
}

/// Each rank's error names the other; the first rank to fail says `what` (the other may only
/// have heard of it).
fn assert_both_fail(a: Result<Buffer, Error>, b: Result<Buffer, Error>, what: &str) {
    let (a, b) = (a.unwrap_err(), b.unwrap_err());
    assert_names(&a, 1, "");
    assert_names(&b, 0, "");
    assert!(
        a.to_string().contains(what) || b.to_string().contains(what),
        "neither error says {what:?}: {a} / {b}"
    );
}

#[test]
fn a_ring_file_truncated_under_the_reader_is_a_peer_failure_not_a_crash() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: opening /proc/self/map_files needs root");
        return;
    }
    let dir = ring_dir();
    let (b0, b1) = pair("truncated", opts(dir.path()));
    let (pg0, pg1) = (
        ProcessGroup::new(Arc::new(b0)),
        ProcessGroup::new(Arc::new(b1)),
    );
    let (a, b) = all_reduce(&pg0, &pg1);
    assert!(a.is_ok() && b.is_ok());
    // Truncate every ring file (through this process's mappings of them: they are unlinked).
    for (start, end) in ring_mappings(dir.path()) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/map_files/{start:x}-{end:x}"))
            .unwrap();
        f.set_len(0).unwrap();
    }
    let (a, b) = all_reduce(&pg0, &pg1);
    assert_both_fail(a, b, "truncated");
}

/// A tmpfs of `size` mounted on a fresh temp dir, unmounted (and the dir removed) on drop,
/// also when the test fails.
struct SmallTmpfs {
    dir: tempfile::TempDir,
}

impl SmallTmpfs {
    fn mount(size: &str) -> SmallTmpfs {
        let dir = tempfile::tempdir().unwrap();
        let target = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
        let opts = std::ffi::CString::new(format!("size={size},mode=0700")).unwrap();
        // SAFETY: NUL-terminated strings; mounting a fresh tmpfs on a directory of ours.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount: {}", std::io::Error::last_os_error());
        SmallTmpfs { dir }
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(self.dir.path().to_str().unwrap()).unwrap();
        // SAFETY: unmounting the tmpfs this guard mounted.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn a_full_ring_directory_makes_the_pair_use_tcp_and_says_why() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    }
    // 1 MiB of room for 4 MiB rings, as a container's small /dev/shm would be for 8 ranks.
    let small = SmallTmpfs::mount("1m");
    let (b0, b1) = pair("full", opts(small.dir.path()));
    for (b, peer) in [(&b0, 1), (&b1, 0)] {
        match b.peer_transports() {
            [(p, PeerTransport::Tcp { why })] if *p == peer => {
                assert!(why.contains("no room"), "{why}")
            }
            other => panic!("expected TCP with the reason, got {other:?}"),
        }
    }
    let (pg0, pg1) = (
        ProcessGroup::new(Arc::new(b0)),
        ProcessGroup::new(Arc::new(b1)),
    );
    let (a, b) = all_reduce(&pg0, &pg1);
    for got in [a.unwrap(), b.unwrap()] {
        assert_eq!(got.into_vec::<f32>().unwrap(), vec![3.0; 1 << 16]);
    }
    let left: Vec<_> = std::fs::read_dir(small.dir.path()).unwrap().collect();
    assert!(left.is_empty(), "no ring file is left behind: {left:?}");
}

#[test]
fn stale_ring_files_of_killed_processes_are_swept_when_a_group_forms() {
    let dir = ring_dir();
    let dead = {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    };
    let stale = dir
        .path()
        .join(format!("rekindle-{dead}-{}", "5a".repeat(12)));
    let f = std::fs::File::create(&stale).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    drop(f);
    let (b0, _b1) = pair("sweep", opts(dir.path()));
    assert!(!stale.exists(), "the stale ring file was swept");
    assert_eq!(b0.peer_transports(), &[(1, PeerTransport::SharedMemory)]);
}
