//! `rekindle run` and the job secret: the default secret stays on loopback, the workers'
//! stores serve only the job, and a stranger cannot get a worker evicted.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{field, pid_alive, rekindle, WORKER};
use rekindle_elastic::store::TcpStoreClient;
use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::Store;

const T: Duration = Duration::from_secs(60);

#[test]
fn the_default_secret_off_loopback_stops_with_how_to_set_one() {
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let standalone_at = |envs: &[(&str, &str)]| {
        rekindle(
            &[
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--local-addr",
                "192.0.2.10",
                "--log-dir",
                l,
                WORKER,
                "barrier",
            ],
            envs,
        )
    };
    let mut a = standalone_at(&[]);
    assert_eq!(a.wait_exit(T).unwrap(), 2, "{}", a.output());
    let out = a.output();
    assert!(
        out.contains("192.0.2.10 is not a loopback address")
            && out.contains("REKINDLE_SECRET_FILE"),
        "{out}"
    );
    assert!(!out.contains("[rank"), "no worker started: {out}");
    // Static, node 1 of a job whose node 0 is on another host.
    let mut b = rekindle(
        &[
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "192.0.2.1",
            "--master-port",
            "29400",
            "--log-dir",
            l,
            WORKER,
            "barrier",
        ],
        &[],
    );
    assert_eq!(b.wait_exit(T).unwrap(), 2, "{}", b.output());
    assert!(b.output().contains("192.0.2.1"), "{}", b.output());
    // With a secret of its own the same job runs.
    let secret_file = logs.path().join("secret");
    std::fs::write(&secret_file, "a real secret\n").unwrap();
    let mut ok = standalone_at(&[("REKINDLE_SECRET_FILE", secret_file.to_str().unwrap())]);
    assert_eq!(ok.wait_exit(T).unwrap(), 0, "{}", ok.output());
    assert_eq!(
        ok.output().matches("barrier ok").count(),
        2,
        "{}",
        ok.output()
    );
}

#[test]
fn workers_with_another_secret_are_refused_by_node_0s_store() {
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let port = {
        let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port().to_string()
    };
    let node = |rank: &str, secret: &str| {
        rekindle(
            &[
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-port",
                &port,
                "--log-dir",
                l,
                WORKER,
                "barrier",
            ],
            &[("REKINDLE_SECRET", secret)],
        )
    };
    let mut n0 = node("0", "the job's");
    n0.wait_for("agent started", T).unwrap();
    let mut n1 = node("1", "another job's");
    assert_eq!(n1.wait_exit(T).unwrap(), 1, "{}", n1.output());
    assert!(
        n1.output().contains("refused this job secret"),
        "{}",
        n1.output()
    );
}

/// A stranger's hello to the store at `addr`: refused (status 2) and closed.
fn stranger_is_refused(addr: &str) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut hello = [0u8; 24];
    s.read_exact(&mut hello).unwrap();
    let guess = JobSecret::default_single_host();
    let nonce_c = [1u8; 16];
    let mut msg = hello[..8].to_vec();
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&guess.mac(&[b"store-client", &hello[8..], &nonce_c]));
    s.write_all(&msg).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert_eq!(rest.first(), Some(&2), "{rest:?}");
    assert_eq!(rest.len(), 33, "nothing but the refusal: {rest:?}");
}

#[test]
fn a_stranger_cannot_get_a_worker_evicted() {
    let logs = tempfile::tempdir().unwrap();
    let secret = "evict-test-secret";
    let mut a = rekindle(
        &[
            "run",
            "--standalone",
            "--rdzv-id",
            "evictjob",
            "--log-dir",
            logs.path().to_str().unwrap(),
            WORKER,
            "hold",
        ],
        &[("REKINDLE_SECRET", secret)],
    );
    let ready = a.wait_for("[rank 0] ready store=", T).unwrap();
    let (addr, prefix) = (
        field(&ready, "store").unwrap(),
        field(&ready, "prefix").unwrap(),
    );
    let pid: i32 = field(&ready, "pid").unwrap().parse().unwrap();
    let node = std::fs::read_dir(logs.path().join("evictjob"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name()
        .into_string()
        .unwrap();
    let key = format!("{prefix}evict/{node}/{pid}");

    stranger_is_refused(addr);
    let owner = TcpStoreClient::connect(addr, &JobSecret::new(secret).unwrap()).unwrap();
    assert_eq!(owner.get(&key).unwrap(), None, "the stranger wrote nothing");
    assert!(pid_alive(pid));

    // The same request from a holder of the secret is acted on.
    owner.set(&key, b"7").unwrap();
    a.wait_for("stopped responding (reported by rank 7)", T)
        .unwrap();
    assert_eq!(a.wait_exit(T).unwrap(), 1, "{}", a.output());
    assert!(
        a.output().contains("failed with signal 9 (SIGKILL)"),
        "{}",
        a.output()
    );
}
