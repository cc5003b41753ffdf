//! Abort, authentication and rebuild semantics of the TCP backend, ranks as threads.
//! (Killed and hung rank processes are covered by chaos-tests/tests/collective_faults.rs.)

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, WAIT};
use rekindle_runtime::store::{InMemoryStore, Store};
use rekindle_runtime::{Buffer, Error, JobSecret, ProcessGroup, ReduceOp, TcpBackend, TcpOptions};

fn two_groups(job: &str, round: u64, store: Arc<dyn Store>) -> (ProcessGroup, ProcessGroup) {
    let s1 = store.clone();
    let job1 = job.to_string();
    let h = std::thread::spawn(move || {
        ProcessGroup::tcp(config(&job1, round, 1, 2, s1), TcpOptions::default()).unwrap()
    });
    let pg0 = ProcessGroup::tcp(config(job, round, 0, 2, store), TcpOptions::default()).unwrap();
    (pg0, h.join().unwrap())
}

#[test]
fn abort_fails_in_flight_and_queued_ops_quickly_and_a_new_group_can_be_built() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let (pg0, pg1) = two_groups("abort", 0, store.clone());
    // Rank 1 issues nothing, so rank 0's first operation blocks and the rest queue behind it.
    let works: Vec<_> = (0..5)
        .map(|_| pg0.all_reduce(Buffer::from(vec![1.0f32; 1 << 16]), ReduceOp::Sum))
        .collect();
    let t = Instant::now();
    pg0.abort();
    let abort_took = t.elapsed();
    for w in works {
        let e = w.wait(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Aborted { rank: 0 }), "{e}");
    }
    let all_failed = t.elapsed();
    assert!(
        abort_took < Duration::from_secs(1),
        "abort took {abort_took:?}"
    );
    assert!(
        all_failed < Duration::from_secs(1),
        "failing the queue took {all_failed:?}"
    );
    assert!(matches!(pg0.error(), Some(Error::Aborted { .. })));
    // After an abort, new operations fail at once.
    let e = pg0.barrier().wait(WAIT).unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    // The peer sees rank 0 as lost.
    let e = pg1.barrier().wait(WAIT).unwrap_err();
    assert!(matches!(e, Error::PeerLost { peer: 0, .. }), "{e}");
    drop((pg0, pg1));

    // A new round in the same process: new ports, new prefix, working collectives.
    let (pg0, pg1) = two_groups("abort", 1, store);
    let h = std::thread::spawn(move || {
        pg1.all_reduce(Buffer::from(vec![2i64; 3]), ReduceOp::Sum)
            .wait(WAIT)
    });
    let got = pg0
        .all_reduce(Buffer::from(vec![5i64; 3]), ReduceOp::Sum)
        .wait(WAIT)
        .unwrap();
    assert_eq!(got.into_vec::<i64>().unwrap(), vec![7; 3]);
    assert_eq!(
        h.join().unwrap().unwrap().into_vec::<i64>().unwrap(),
        vec![7; 3]
    );
}

#[test]
fn an_orderly_leave_is_not_a_failure_for_finished_peers() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let (pg0, pg1) = two_groups("leave", 0, store);
    let h = std::thread::spawn(move || {
        pg1.barrier().wait(WAIT).unwrap();
        drop(pg1); // says goodbye
    });
    pg0.barrier().wait(WAIT).unwrap();
    h.join().unwrap();
    // An operation that needs the departed rank fails naming it.
    let e = pg0.barrier().wait(WAIT).unwrap_err();
    assert!(matches!(e, Error::PeerLost { peer: 1, .. }), "{e}");
}

/// Publishes `real_addr` as rank 0's address under `job`/`round` in a fresh store, so a
/// process group of that job and round dials the real rank 0.
fn store_pointing_at(real: &dyn Store, real_prefix: &str, job: &str, round: u64) -> Arc<dyn Store> {
    let addr = real
        .wait(&[&format!("{real_prefix}addr/0")], WAIT)
        .unwrap()
        .remove(0);
    let fake: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    fake.set(
        &format!("{}addr/0", rekindle_runtime::group_prefix(job, round)),
        &addr,
    )
    .unwrap();
    fake
}

#[test]
fn connections_with_a_wrong_secret_job_or_round_are_refused_and_never_join() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let prefix = rekindle_runtime::group_prefix("auth", 0);
    let s0 = store.clone();
    let rank0 = std::thread::spawn(move || {
        TcpBackend::new(config("auth", 0, 0, 2, s0), TcpOptions::default()).unwrap()
    });
    let short = |mut c: rekindle_runtime::GroupConfig| {
        c.bootstrap_timeout = Duration::from_secs(5);
        c
    };
    // Wrong secret, same job and round.
    let mut bad = short(config("auth", 0, 1, 2, store.clone()));
    bad.secret = JobSecret::new("not-the-secret").unwrap();
    let e = TcpBackend::new(bad, TcpOptions::default()).unwrap_err();
    assert!(e.to_string().contains("wrong job secret"), "{e}");
    // Right secret, wrong job id.
    let other_job = store_pointing_at(store.as_ref(), &prefix, "intruder", 0);
    let e = TcpBackend::new(
        short(config("intruder", 0, 1, 2, other_job)),
        TcpOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("wrong job id"), "{e}");
    // Right secret and job, a stale round.
    let old_round = store_pointing_at(store.as_ref(), &prefix, "auth", 7);
    let e = TcpBackend::new(
        short(config("auth", 7, 1, 2, old_round)),
        TcpOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("wrong rendezvous round"), "{e}");
    // Now the real rank 1 joins; the group forms and computes correctly.
    let real1 = ProcessGroup::tcp(config("auth", 0, 1, 2, store), TcpOptions::default()).unwrap();
    let b0 = rank0.join().unwrap();
    // Three strangers, each dialling twice at most (data and control), were refused.
    assert!(
        b0.refused_connections() >= 3,
        "refused {}",
        b0.refused_connections()
    );
    let pg0 = ProcessGroup::new(Arc::new(b0));
    let h = std::thread::spawn(move || {
        real1
            .all_reduce(Buffer::from(vec![1u8, 2]), ReduceOp::Sum)
            .wait(WAIT)
    });
    let got = pg0
        .all_reduce(Buffer::from(vec![10u8, 20]), ReduceOp::Sum)
        .wait(WAIT)
        .unwrap();
    assert_eq!(got.into_vec::<u8>().unwrap(), vec![11, 22]);
    assert_eq!(
        h.join().unwrap().unwrap().into_vec::<u8>().unwrap(),
        vec![11, 22]
    );
}

#[test]
fn a_missing_rank_fails_bootstrap_at_its_deadline() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let mut c = config("lonely", 0, 1, 3, store);
    c.bootstrap_timeout = Duration::from_millis(300);
    let t = Instant::now();
    let e = TcpBackend::new(c, TcpOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Bootstrap { rank: 1, .. }), "{e}");
    assert!(
        e.to_string().contains("addr/0"),
        "names the missing key: {e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A two-rank group with a 300 ms op deadline whose rank 1 is alive (it heartbeats) but never
/// takes part in an operation: (rank 0, rank 1).
fn pair_with_an_idle_peer(job: &'static str) -> (ProcessGroup, ProcessGroup) {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let s1 = store.clone();
    let h = std::thread::spawn(move || {
        let mut c = config(job, 0, 1, 2, s1);
        c.op_timeout = Duration::from_millis(300);
        ProcessGroup::tcp(c, TcpOptions::default()).unwrap()
    });
    let mut c = config(job, 0, 0, 2, store);
    c.op_timeout = Duration::from_millis(300);
    let pg0 = ProcessGroup::tcp(c, TcpOptions::default()).unwrap();
    (pg0, h.join().unwrap())
}

#[test]
fn a_root_blocked_on_a_full_ring_names_the_peer_it_waits_on() {
    // The root of a broadcast only sends; once its ring toward the peer is full, its lanes
    // wait to write, not to read. The peer is alive (heartbeats), so it is not "silent", and
    // the timeout must still name it as the rank the root waits on.
    let (pg0, _pg1) = pair_with_an_idle_peer("full-ring");
    let e = pg0
        .broadcast(Buffer::from(vec![1.0f32; 4 << 20]), 0)
        .wait(WAIT)
        .unwrap_err();
    match e {
        Error::Timeout { waiting_on, .. } => assert_eq!(waiting_on, vec![1]),
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn a_hung_peer_is_caught_by_the_op_deadline() {
    let (pg0, _pg1) = pair_with_an_idle_peer("hang");
    let e = pg0
        .all_reduce(Buffer::from(vec![1.0f64; 10]), ReduceOp::Sum)
        .wait(WAIT)
        .unwrap_err();
    match e {
        Error::Timeout { waiting_on, .. } => assert_eq!(waiting_on, vec![1]),
        other => panic!("expected a timeout, got {other}"),
    }
    // The group is now broken: later operations fail at once, naming the cause.
    let e = pg0.barrier().wait(WAIT).unwrap_err();
    assert!(matches!(e, Error::GroupBroken { .. }), "{e}");
}

#[test]
fn a_group_idle_far_longer_than_its_socket_buffers_take_to_fill_still_works() {
    // Heartbeats every millisecond into the smallest socket buffers the kernel allows, while
    // neither rank reads its control connections (they are read only during operations): the
    // buffers fill within tens of milliseconds, and senders must queue whole frames from then
    // on. The idle spell is the point of the test, so it is a plain wait.
    let opts = TcpOptions {
        heartbeat_interval: Duration::from_millis(1),
        socket_buffer_bytes: Some(1),
        shared_memory: false,
        ..TcpOptions::default()
    };
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let (s1, o1) = (store.clone(), opts.clone());
    let h = std::thread::spawn(move || ProcessGroup::tcp(config("idle", 0, 1, 2, s1), o1).unwrap());
    let pg0 = ProcessGroup::tcp(config("idle", 0, 0, 2, store), opts).unwrap();
    let pg1 = h.join().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // Small operations (direct, then ring): bulk data over such buffers crawls, which is not
    // what this tests.
    for len in [1000, 10_000] {
        let w1 = pg1.all_reduce(Buffer::from(vec![2i64; len]), ReduceOp::Sum);
        let got = pg0
            .all_reduce(Buffer::from(vec![5i64; len]), ReduceOp::Sum)
            .wait(WAIT)
            .unwrap_or_else(|e| panic!("{len} elements: {e}"));
        assert_eq!(got.into_vec::<i64>().unwrap(), vec![7; len]);
        w1.wait(WAIT).unwrap();
    }
    assert!(pg0.error().is_none() && pg1.error().is_none());
}
