//! Frames after the handshake are sealed: an on-path party that alters, injects or replays
//! bytes is detected and reported as that peer's failure, never accepted. Ranks are threads;
//! rank 1 reaches rank 0 through a relay thread that forwards (and tampers with) the bytes.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{config, run_ranks, WAIT};
use rekindle_runtime::collectives::check::{reduce_expected, reduce_input, value};
use rekindle_runtime::store::{InMemoryStore, Store};
use rekindle_runtime::{
    group_prefix, Buffer, DType, Error, ProcessGroup, ReduceOp, TcpOptions, WireMode,
};

fn tcp_only(wire: WireMode) -> TcpOptions {
    TcpOptions {
        shared_memory: false,
        wire: Some(wire),
        ..TcpOptions::default()
    }
}

/// Rewrites the bytes of one direction of one relayed connection: called with the connection's
/// index (in accept order: rank 1 dials data, then control), whether the bytes go from rank 1
/// to rank 0, the stream offset of `chunk`, and the chunk; returns what to forward instead.
type Tamper = dyn Fn(usize, bool, usize, &[u8]) -> Vec<u8> + Send + Sync;

/// Forwards every connection made to the returned address to `target`, through `tamper`.
fn relay(target: SocketAddr, tamper: Arc<Tamper>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for (conn, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(target) else {
                return;
            };
            for (from, to, up) in [
                (
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    true,
                ),
                (server, client, false),
            ] {
                let tamper = tamper.clone();
                std::thread::spawn(move || forward(from, to, conn, up, &*tamper));
            }
            if conn == 1 {
                return; // data and control: all rank 1 makes
            }
        }
    });
    addr
}

fn forward(mut from: TcpStream, mut to: TcpStream, conn: usize, up: bool, tamper: &Tamper) {
    let mut buf = vec![0u8; 1 << 16];
    let mut offset = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let out = tamper(conn, up, offset, &buf[..n]);
        offset += n;
        if to.write_all(&out).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A two-rank group whose rank 1 reaches rank 0 through a relay: (rank 0, rank 1).
fn relayed_pair(job: &str, opts: TcpOptions, tamper: Arc<Tamper>) -> (ProcessGroup, ProcessGroup) {
    let store0: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let short = |mut c: rekindle_runtime::GroupConfig| {
        c.op_timeout = Duration::from_secs(10);
        c
    };
    let (s0, o0, j0) = (store0.clone(), opts.clone(), job.to_string());
    let rank0 = std::thread::spawn(move || ProcessGroup::tcp(short(config(&j0, 0, 0, 2, s0)), o0));
    let key = format!("{}addr/0", group_prefix(job, 0));
    let real: SocketAddr = String::from_utf8(store0.wait(&[&key], WAIT).unwrap().remove(0))
        .unwrap()
        .parse()
        .unwrap();
    let store1: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    store1
        .set(&key, relay(real, tamper).to_string().as_bytes())
        .unwrap();
    let pg1 = ProcessGroup::tcp(short(config(job, 0, 1, 2, store1)), opts).unwrap();
    (rank0.join().unwrap().unwrap(), pg1)
}

/// Bytes of rank 1's hello on a connection of `job` (see the handshake's wire format).
fn hello_len(job: &str) -> usize {
    8 + 1 + job.len() + 8 + 4 + 4 + 1 + 1 + 16 + 32
}

fn assert_authentication_failure(e: &Error, peer: usize) {
    match e {
        Error::PeerLost {
            peer: p, reason, ..
        } if *p == peer => assert!(
            reason.contains("failed authentication"),
            "expected an authentication failure naming rank {peer}, got: {e}"
        ),
        other => panic!("expected an authentication failure naming rank {peer}, got: {other}"),
    }
}

#[test]
fn a_byte_flipped_on_the_path_fails_the_operation_naming_the_sender() {
    for wire in [WireMode::Mac, WireMode::Encrypt] {
        // One byte deep inside the first all-reduce's data from rank 1 to rank 0.
        let flip: Arc<Tamper> = Arc::new(|conn, up, offset, chunk| {
            let mut out = chunk.to_vec();
            let at = 5000usize;
            if conn == 0 && up && (offset..offset + chunk.len()).contains(&at) {
                out[at - offset] ^= 0x10;
            }
            out
        });
        let (pg0, pg1) = relayed_pair(&format!("flip-{wire}"), tcp_only(wire), flip);
        let input = |rank| {
            Buffer::from_fn(DType::F32, 1 << 14, |i| {
                reduce_input(ReduceOp::Sum, rank, i)
            })
        };
        let h = std::thread::spawn(move || pg1.all_reduce(input(1), ReduceOp::Sum).wait(WAIT));
        let e = pg0
            .all_reduce(input(0), ReduceOp::Sum)
            .wait(WAIT)
            .expect_err("an altered frame must never be accepted");
        assert_authentication_failure(&e, 1);
        // Rank 1 learns of the failure too, and never returns a result either.
        assert!(h.join().unwrap().is_err(), "{wire}");
    }
}

#[test]
fn injected_and_replayed_control_frames_are_refused() {
    for wire in [WireMode::Mac, WireMode::Encrypt] {
        let job = format!("inject-{wire}");
        let (hello, frame) = (
            hello_len(&job),
            6 + if wire == WireMode::Mac { 32 } else { 16 },
        );
        // On rank 1's control connection: after the first heartbeat frame, send it again (a
        // genuine frame out of place), then a forged abort notice with a made-up tag.
        let first = Arc::new(Mutex::new(Vec::new()));
        let injected = Arc::new(AtomicUsize::new(0));
        let tamper: Arc<Tamper> = Arc::new(move |conn, up, offset, chunk| {
            let mut out = chunk.to_vec();
            if conn != 1 || !up || offset + chunk.len() <= hello {
                return out;
            }
            let mut seen = first.lock().unwrap();
            let start = hello.saturating_sub(offset);
            let want = frame - seen.len();
            seen.extend_from_slice(&chunk[start..chunk.len().min(start + want)]);
            if seen.len() == frame && injected.fetch_add(1, Ordering::SeqCst) == 0 {
                out.extend_from_slice(&seen);
                let mut forged = vec![2u8, 1, 0, 0, 0, 1];
                forged.resize(frame, 0xA5);
                out.extend_from_slice(&forged);
            }
            out
        });
        let (pg0, pg1) = relayed_pair(&job, tcp_only(wire), tamper);
        // Both ranks run barriers until rank 0's fails: the replayed heartbeat reaches it
        // within a heartbeat interval of the group forming.
        let stop = Arc::new(AtomicUsize::new(0));
        let stop1 = stop.clone();
        let h = std::thread::spawn(move || {
            while stop1.load(Ordering::SeqCst) == 0 && pg1.barrier().wait(WAIT).is_ok() {}
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let e = loop {
            match pg0.barrier().wait(WAIT) {
                Err(e) => break e,
                Ok(_) => assert!(
                    Instant::now() < deadline,
                    "{wire}: the injected frames were never noticed"
                ),
            }
        };
        stop.store(1, Ordering::SeqCst);
        assert_authentication_failure(&e, 1);
        h.join().unwrap();
    }
}

#[test]
fn ranks_with_different_wire_modes_refuse_each_other() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let s0 = store.clone();
    let rank0 = std::thread::spawn(move || {
        let mut c = config("modes", 0, 0, 2, s0);
        c.bootstrap_timeout = Duration::from_secs(3);
        rekindle_runtime::TcpBackend::new(c, tcp_only(WireMode::Mac))
    });
    let mut c = config("modes", 0, 1, 2, store);
    c.bootstrap_timeout = Duration::from_secs(3);
    let e = rekindle_runtime::TcpBackend::new(c, tcp_only(WireMode::Encrypt)).unwrap_err();
    assert!(e.to_string().contains("different wire modes"), "{e}");
    assert!(rank0.join().unwrap().is_err());
}

#[test]
fn frames_larger_and_smaller_than_a_chunk_arrive_exactly_in_both_modes() {
    // Items of one byte to several frames (1 MB and up: 256 KiB frames), copied and reduced,
    // over TCP only, in both wire modes.
    for wire in [WireMode::Mac, WireMode::Encrypt] {
        let out = run_ranks(&format!("frames-{wire}"), 3, tcp_only(wire), |rank, pg| {
            let n = 300_001;
            let reduced = pg
                .all_reduce(
                    Buffer::from_fn(DType::F32, n, |i| reduce_input(ReduceOp::Avg, rank, i)),
                    ReduceOp::Avg,
                )
                .wait(WAIT)
                .unwrap();
            let sent = pg
                .broadcast(Buffer::from_fn(DType::F64, 150_001, |i| value(rank, i)), 2)
                .wait(WAIT)
                .unwrap();
            let big = Buffer::from_fn(DType::U8, 1_000_003, |i| value(rank, i));
            let got = if rank == 0 {
                pg.send(big, 1).wait(WAIT).unwrap();
                None
            } else if rank == 1 {
                Some(
                    pg.recv(Buffer::zeros(DType::U8, 1_000_003), 0)
                        .wait(WAIT)
                        .unwrap(),
                )
            } else {
                None
            };
            let one = pg
                .all_reduce(Buffer::from(vec![rank as i64 + 1]), ReduceOp::Sum)
                .wait(WAIT)
                .unwrap();
            (reduced, sent, got, one)
        });
        let want = Buffer::from_fn(DType::F32, 300_001, |i| {
            reduce_expected(ReduceOp::Avg, DType::F32, 3, i)
        });
        for (rank, (reduced, sent, got, one)) in out.iter().enumerate() {
            assert_eq!(reduced.as_bytes(), want.as_bytes(), "{wire} rank {rank}");
            let root = Buffer::from_fn(DType::F64, 150_001, |i| value(2, i));
            assert_eq!(sent.as_bytes(), root.as_bytes(), "{wire} rank {rank}");
            if let Some(got) = got {
                let sent = Buffer::from_fn(DType::U8, 1_000_003, |i| value(0, i));
                assert_eq!(got.as_bytes(), sent.as_bytes(), "{wire}");
            }
            assert_eq!(one.clone().into_vec::<i64>().unwrap(), vec![6]);
        }
    }
}
