//! `rekindle run` with the etcd rendezvous, against a real etcd and real agent processes.
#![cfg(feature = "test-etcd")]

mod common;

use std::time::{Duration, Instant};

use common::{field, rekindle, Proc, WORKER};
use rekindle_elastic::testing::EtcdServer;
use rekindle_runtime::store::Store;

const T: Duration = Duration::from_secs(60);

fn etcd_agent(
    etcd: &str,
    job: &str,
    nnodes: &str,
    conf: &str,
    logs: &str,
    worker: &[&str],
) -> Proc {
    let mut args = vec![
        "run",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        etcd,
        "--rdzv-id",
        job,
        "--nnodes",
        nnodes,
        "--rdzv-conf",
        conf,
        "--local-addr",
        "127.0.0.1",
        "--log-dir",
        logs,
    ];
    args.extend_from_slice(worker);
    rekindle(&args, &[])
}

#[test]
fn two_agents_form_one_job_and_a_late_joiner_exits_zero() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let conf = "last_call_timeout=0.2,lease_ttl=2";
    let w = ["--nproc-per-node", "2", WORKER, "barrier"];
    let mut a = etcd_agent(&etcd.endpoint(), "job2", "2", conf, l, &w);
    let mut b = etcd_agent(&etcd.endpoint(), "job2", "2", conf, l, &w);
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert_eq!(b.wait_exit(T).unwrap(), 0, "{}", b.output());
    let all = format!("{}\n{}", a.output(), b.output());
    for r in 0..4 {
        assert!(
            all.contains(&format!("barrier ok rank={r} world=4")),
            "{all}"
        );
    }
    let mut late = etcd_agent(&etcd.endpoint(), "job2", "2", conf, l, &w);
    assert_eq!(late.wait_exit(T).unwrap(), 0, "{}", late.output());
    assert!(
        late.output().contains("has already finished"),
        "{}",
        late.output()
    );
}

#[test]
fn sigkilled_agent_is_dropped_within_the_ttl_and_the_survivor_reforms() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let conf = "last_call_timeout=0.3,lease_ttl=2";
    let mut a = etcd_agent(
        &etcd.endpoint(),
        "killjob",
        "1:2",
        conf,
        l,
        &[WORKER, "hold"],
    );
    let mut b = etcd_agent(
        &etcd.endpoint(),
        "killjob",
        "1:2",
        conf,
        l,
        &[WORKER, "hold"],
    );
    a.wait_for("world=2 round=0", T).unwrap();
    b.wait_for("world=2 round=0", T).unwrap();
    // Kill the node that does not host the round's store (node 0's store serves the workers).
    let (mut survivor, mut victim) = if a.output().contains("node_rank=0") {
        (a, b)
    } else {
        (b, a)
    };
    survivor.wait_for("ready", T).unwrap();
    let t0 = Instant::now();
    victim.signal(libc::SIGKILL);
    assert_eq!(victim.wait_exit(T).unwrap(), 137);
    let mut a = survivor;
    a.wait_for("peer_lost", T).unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(4500),
        "peer lost after {took:?}"
    );
    let line = a.wait_for("world=1 round=1", T).unwrap();
    assert!(line.contains("rank=0"), "{line}");
    // Let the survivor finish: set `go` in its new round's store.
    let ready = a.wait_for("/r1/ pid", T).unwrap();
    let store = rekindle_elastic::store::connect(field(&ready, "store").unwrap()).unwrap();
    store
        .set(&format!("{}go", field(&ready, "prefix").unwrap()), b"1")
        .unwrap();
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert!(
        !a.output().contains("restarting workers"),
        "a membership change is no restart"
    );
}

#[test]
fn etcd_restart_mid_run_fails_nothing() {
    let mut etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let conf = "last_call_timeout=0.2,lease_ttl=3";
    let mut a = etcd_agent(&etcd.endpoint(), "rsjob", "2", conf, l, &[WORKER, "hold"]);
    let mut b = etcd_agent(&etcd.endpoint(), "rsjob", "2", conf, l, &[WORKER, "hold"]);
    let ready = a.wait_for("ready store=", T).unwrap();
    b.wait_for("ready store=", T).unwrap();
    etcd.restart().unwrap();
    // Past the TTL: an agent that failed to keep its lease would have been dropped by now.
    std::thread::sleep(Duration::from_secs(6));
    let store = rekindle_elastic::store::connect(field(&ready, "store").unwrap()).unwrap();
    store
        .set(&format!("{}go", field(&ready, "prefix").unwrap()), b"1")
        .unwrap();
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert_eq!(b.wait_exit(T).unwrap(), 0, "{}", b.output());
    for out in [a.output(), b.output()] {
        assert!(!out.contains("membership changed"), "{out}");
        assert!(
            out.contains("[rank 0] go") || out.contains("[rank 1] go"),
            "{out}"
        );
    }
}

#[test]
fn etcd_down_at_start_gives_a_clear_error_after_the_join_timeout() {
    let mut etcd = EtcdServer::start().unwrap();
    etcd.stop();
    let logs = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut a = etcd_agent(
        &etcd.endpoint(),
        "downjob",
        "1",
        "join_timeout=3,read_timeout=0.5",
        logs.path().to_str().unwrap(),
        &[WORKER, "barrier"],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 3, "{}", a.output());
    assert!(t0.elapsed() >= Duration::from_secs(2), "{:?}", t0.elapsed());
    let out = a.output();
    assert!(out.contains("retrying"), "{out}");
    assert!(
        out.contains("cannot reach the etcd rendezvous store"),
        "{out}"
    );
}

#[test]
fn wrong_credentials_exit_3_with_a_clear_message() {
    let etcd = EtcdServer::start_with_auth("right").unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut a = etcd_agent(
        &etcd.endpoint(),
        "authjob",
        "1",
        "user=root,password=wrong",
        logs.path().to_str().unwrap(),
        &[WORKER, "barrier"],
    );
    assert_eq!(a.wait_exit(T).unwrap(), 3, "{}", a.output());
    assert!(
        a.output().contains("refused the credentials"),
        "{}",
        a.output()
    );
    let mut ok = etcd_agent(
        &etcd.endpoint(),
        "authjob",
        "1",
        "user=root,password=right",
        logs.path().to_str().unwrap(),
        &[WORKER, "barrier"],
    );
    assert_eq!(ok.wait_exit(T).unwrap(), 0, "{}", ok.output());
}

#[test]
fn a_failure_on_one_node_restarts_the_job_and_only_that_node_counts_it() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let conf = "last_call_timeout=0.2,lease_ttl=2";
    let w = ["--max-restarts", "1", WORKER, "fail-once"];
    let mut a = etcd_agent(&etcd.endpoint(), "restartjob", "2", conf, l, &w);
    let mut b = etcd_agent(&etcd.endpoint(), "restartjob", "2", conf, l, &w);
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert_eq!(b.wait_exit(T).unwrap(), 0, "{}", b.output());
    let all = format!("{}\n{}", a.output(), b.output());
    assert_eq!(
        all.matches("restarting workers (restart 1 of 1)").count(),
        1,
        "{all}"
    );
    // The other node re-forms, unless the new round opened before it started its workers.
    assert!(
        all.matches("stopping workers to re-form").count() <= 1,
        "{all}"
    );
    assert!(all.contains("barrier ok rank=0 world=2 round=1"), "{all}");
    assert!(all.contains("barrier ok rank=1 world=2 round=1"), "{all}");
}

#[test]
fn with_etcd_credentials_the_workers_store_is_etcd_with_the_same_credentials() {
    let etcd = EtcdServer::start_with_auth("right").unwrap();
    let logs = tempfile::tempdir().unwrap();
    let l = logs.path().to_str().unwrap();
    let w = ["--nproc-per-node", "2", WORKER, "hold"];
    let mut a = etcd_agent(
        &etcd.endpoint(),
        "credjob",
        "1",
        "user=root,password=right",
        l,
        &w,
    );
    let ready = a.wait_for("[rank 1] ready store=", T).unwrap();
    a.wait_for("[rank 0] ready store=", T).unwrap();
    let addr = field(&ready, "store").unwrap();
    // etcd itself, with the agent's user and the password as a file only.
    assert!(addr.starts_with("etcd://"), "{addr}");
    assert!(addr.contains("user=root&password_file="), "{addr}");
    assert!(
        !addr.contains("right"),
        "the password is not in the address: {addr}"
    );
    let parsed = rekindle_elastic::store::EtcdAddress::parse(addr).unwrap();
    let pw_file = parsed.password_file.clone().unwrap();
    // Without the credentials the cluster refuses, so there is no unprotected side channel.
    let bare = rekindle_elastic::store::EtcdAddress {
        user: None,
        password_file: None,
        ..parsed.clone()
    };
    assert!(matches!(
        bare.connect().map(|s| s.get("x")),
        Err(rekindle_runtime::store::StoreError::Unauthorized { .. })
            | Ok(Err(
                rekindle_runtime::store::StoreError::Unauthorized { .. }
            ))
    ));
    // The workers met there (their barrier passed); let them finish through it.
    let store = rekindle_elastic::store::connect(addr).unwrap();
    let prefix = field(&ready, "prefix").unwrap();
    assert_eq!(
        store.get(&format!("{prefix}rank/0")).unwrap(),
        Some(b"0".to_vec())
    );
    store.set(&format!("{prefix}go"), b"1").unwrap();
    assert_eq!(a.wait_exit(T).unwrap(), 0, "{}", a.output());
    assert!(!pw_file.exists(), "the agent removed its password file");
}
