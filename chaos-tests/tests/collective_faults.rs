//! Real rank processes, really killed and stopped: survivors must fail fast, naming the rank.

use std::process::Command;
use std::time::{Duration, Instant};

use rekindle_elastic::testing::{field, Proc};

fn peer(store: &std::path::Path, rank: usize, world: usize, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_collective_peer"));
    cmd.arg("--store").arg(store).args([
        "--rank",
        &rank.to_string(),
        "--world",
        &world.to_string(),
    ]);
    cmd.args(extra);
    Proc::spawn(cmd).expect("spawning collective_peer")
}

fn start(world: usize, extra: &[&str]) -> (tempfile::TempDir, Vec<Proc>) {
    let dir = tempfile::tempdir().unwrap();
    let mut procs: Vec<Proc> = (0..world)
        .map(|r| peer(dir.path(), r, world, extra))
        .collect();
    for (r, p) in procs.iter_mut().enumerate() {
        // Running collectives proves the group formed and every rank is in the loop.
        let got = p.wait_line(Duration::from_secs(60), |l| l == "iter 3");
        assert!(got.is_ok(), "rank {r} never reached iter 3: {}", p.output());
    }
    (dir, procs)
}

#[test]
fn sigkilled_rank_fails_every_survivor_naming_it() {
    for (world, victim) in [(2, 1), (3, 2), (4, 1)] {
        let (_dir, mut procs) = start(world, &[]);
        let killed_at = Instant::now();
        procs[victim].signal(libc::SIGKILL);
        for (r, p) in procs.iter_mut().enumerate().filter(|(r, _)| *r != victim) {
            let line = p
                .wait_line(Duration::from_secs(30), |l| l.starts_with("error"))
                .unwrap_or_else(|_| panic!("rank {r} did not fail: {}", p.output()));
            let detected = killed_at.elapsed();
            assert_eq!(field(&line, "kind"), Some("peer_lost"), "rank {r}: {line}");
            assert_eq!(
                field(&line, "peer"),
                Some(victim.to_string().as_str()),
                "rank {r}: {line}"
            );
            // The op deadline is 60 s: failing in well under it proves detection, not timeout.
            assert!(
                detected < Duration::from_secs(5),
                "rank {r} took {detected:?}"
            );
            eprintln!("world {world}: rank {r} saw the kill of rank {victim} after {detected:?}");
            assert_eq!(p.wait_exit(Duration::from_secs(10)).ok(), Some(3));
        }
    }
}

#[test]
fn sigstopped_rank_is_caught_by_the_op_deadline() {
    let (_dir, mut procs) = start(3, &["--op-timeout-ms", "1500"]);
    let stopped_at = Instant::now();
    procs[1].signal(libc::SIGSTOP);
    for r in [0, 2] {
        let p = &mut procs[r];
        let line = p
            .wait_line(Duration::from_secs(30), |l| l.starts_with("error"))
            .unwrap_or_else(|_| panic!("rank {r} did not fail: {}", p.output()));
        let kind = field(&line, "kind");
        assert!(
            matches!(kind, Some("timeout") | Some("peer_lost")),
            "rank {r}: {line}"
        );
        // Bounded by the 1.5 s deadline of the operation in flight (plus the next one's, if
        // the stop landed between two operations), never a hang.
        assert!(
            stopped_at.elapsed() < Duration::from_secs(10),
            "rank {r}: {line}"
        );
        // The stopped rank's heartbeats stop too, so it is the one named, whether this rank
        // timed out itself or was told by the other survivor.
        let peer = field(&line, "peer");
        assert!(matches!(peer, Some("[1]") | Some("1")), "rank {r}: {line}");
    }
    procs[1].signal(libc::SIGCONT);
}

#[test]
fn a_finished_job_exits_cleanly_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let mut procs: Vec<Proc> = (0..3)
        .map(|r| peer(dir.path(), r, 3, &["--iters", "50"]))
        .collect();
    for (r, p) in procs.iter_mut().enumerate() {
        assert_eq!(
            p.wait_exit(Duration::from_secs(60)).ok(),
            Some(0),
            "rank {r}"
        );
    }
}
