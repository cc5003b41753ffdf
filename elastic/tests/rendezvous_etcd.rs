//! The rendezvous handler on a real etcd: rounds, ranks, leases, watches, closing, failures.
#![cfg(feature = "test-etcd")]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rekindle_elastic::etcd::EtcdConfig;
use rekindle_elastic::membership::MembershipEvent;
use rekindle_elastic::rendezvous::*;
use rekindle_elastic::testing::EtcdServer;
use rekindle_runtime::store::StoreError;

struct Opts {
    min: usize,
    max: usize,
    last_call: Duration,
    ttl: Duration,
    retention: Duration,
    join_timeout: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            min: 1,
            max: 1,
            last_call: Duration::from_millis(200),
            ttl: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            join_timeout: Duration::from_secs(30),
        }
    }
}

fn handler(cfg: &EtcdConfig, job: &str, id: &str, o: &Opts) -> Arc<DynamicRendezvousHandler> {
    let backend = EtcdBackend::connect(
        cfg,
        job,
        EtcdBackendOptions {
            lease_ttl: o.ttl,
            finished_retention: o.retention,
        },
    )
    .unwrap();
    let node = NodeInfo {
        id: id.into(),
        host: "127.0.0.1".into(),
        nproc: 1,
        store_addr: None,
    };
    let mut opts = HandlerOptions::new(o.min, o.max).unwrap();
    opts.settings.last_call = o.last_call;
    opts.join_timeout = o.join_timeout;
    Arc::new(DynamicRendezvousHandler::new(Arc::new(backend), node, opts))
}

/// Runs `next_rendezvous` on every handler in parallel.
fn join_all(hs: &[Arc<DynamicRendezvousHandler>]) -> Vec<RendezvousInfo> {
    let threads: Vec<_> = hs
        .iter()
        .map(|h| {
            let h = h.clone();
            thread::spawn(move || h.next_rendezvous())
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect()
}

fn ids(info: &RendezvousInfo) -> Vec<String> {
    info.participants.iter().map(|n| n.id.clone()).collect()
}

/// Keys under `prefix`, read with a plain etcd client.
fn keys_under(endpoint: &str, prefix: &str) -> BTreeSet<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (endpoint, prefix) = (format!("http://{endpoint}"), prefix.to_string());
    rt.block_on(async move {
        let mut c = etcd_client::Client::connect([endpoint], None)
            .await
            .unwrap();
        let r = c
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_keys_only(),
                ),
            )
            .await
            .unwrap();
        r.kvs()
            .iter()
            .map(|kv| kv.key_str().unwrap().to_string())
            .collect()
    })
}

/// Blocks until `key` is deleted (watch), at most `timeout`.
fn wait_deleted(endpoint: &str, key: &str, timeout: Duration) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (endpoint, key) = (format!("http://{endpoint}"), key.to_string());
    rt.block_on(async move {
        let mut c = etcd_client::Client::connect([endpoint], None)
            .await
            .unwrap();
        let r = c.get(key.clone(), None).await.unwrap();
        if r.kvs().is_empty() {
            return;
        }
        let rev = r.header().unwrap().revision();
        let mut w = c
            .watch(
                key.clone(),
                Some(etcd_client::WatchOptions::new().with_start_revision(rev + 1)),
            )
            .await
            .unwrap();
        tokio::time::timeout(timeout, async {
            loop {
                let m = w.message().await.unwrap().unwrap();
                if m.events()
                    .iter()
                    .any(|e| e.event_type() == etcd_client::EventType::Delete)
                {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{key} was not deleted within {timeout:?}"));
    })
}

#[test]
fn max_nodes_close_the_round_and_ranks_follow_join_order() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        min: 3,
        max: 3,
        ..Default::default()
    };
    let hs: Vec<_> = ["n0", "n1", "n2"]
        .iter()
        .map(|id| handler(&cfg, "max-job", id, &o))
        .collect();
    let infos = join_all(&hs);
    let order = ids(&infos[0]);
    for (i, info) in infos.iter().enumerate() {
        assert_eq!(info.round, 0);
        assert_eq!(info.world_size, 3);
        assert_eq!(ids(info), order, "every member sees the same order");
        assert_eq!(order[info.rank], hs[i].node().id);
    }
    // The round's store is bound to the job and shared by the members.
    infos[0].store.set("x", b"1").unwrap();
    assert_eq!(infos[2].store.get("x").unwrap(), Some(b"1".to_vec()));
}

#[test]
fn two_jobs_in_one_etcd_never_see_each_other() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        min: 2,
        max: 2,
        ..Default::default()
    };
    let hs = vec![
        handler(&cfg, "job-a", "a1", &o),
        handler(&cfg, "job-b", "b1", &o),
        handler(&cfg, "job-a", "a2", &o),
        handler(&cfg, "job-b", "b2", &o),
    ];
    let infos = join_all(&hs);
    for info in &infos {
        let want = if info.job == "job-a" { "a" } else { "b" };
        assert_eq!(info.world_size, 2);
        assert!(ids(info).iter().all(|id| id.starts_with(want)), "{info:?}");
    }
    infos[0].store.set("k", b"a").unwrap();
    assert_eq!(infos[1].store.get("k").unwrap(), None);
    let a_keys = keys_under(&etcd.endpoint(), "/rekindle/job-a/");
    assert!(a_keys.iter().all(|k| k.starts_with("/rekindle/job-a/")));
    assert!(a_keys.contains("/rekindle/job-a/nodes/a1"));
    assert!(!a_keys.iter().any(|k| k.contains("b1")));
}

#[test]
fn graceful_leave_is_seen_at_once_and_survivors_keep_their_order() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        min: 2,
        max: 3,
        ttl: Duration::from_secs(30),
        ..Default::default()
    };
    let hs: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| handler(&cfg, "leave-job", id, &o))
        .collect();
    let infos = join_all(&hs);
    let order = ids(&infos[0]);
    let leaver = hs.iter().position(|h| h.node().id == order[1]).unwrap();
    let survivors: Vec<_> = (0..3).filter(|i| *i != leaver).collect();
    let membership: Vec<_> = survivors
        .iter()
        .map(|i| hs[*i].membership().unwrap())
        .collect();
    let t0 = Instant::now();
    hs[leaver].shutdown().unwrap();
    for m in &membership {
        let ev = m.next_timeout(Duration::from_secs(10)).expect("an event");
        assert_eq!(
            ev,
            MembershipEvent::PeerLost {
                round: 0,
                node: order[1].clone()
            }
        );
    }
    // Far below the 30 s TTL: the lease was revoked.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let next = join_all(&[hs[survivors[0]].clone(), hs[survivors[1]].clone()]);
    for info in &next {
        assert_eq!(info.round, 1);
        assert_eq!(ids(info), vec![order[0].clone(), order[2].clone()]);
    }
}

#[test]
fn dead_node_lease_expires_within_the_ttl() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        min: 1,
        max: 2,
        ttl: Duration::from_secs(2),
        ..Default::default()
    };
    let a = handler(&cfg, "ttl-job", "a", &o);
    let b = handler(&cfg, "ttl-job", "b", &o);
    let infos = join_all(&[a.clone(), b.clone()]);
    assert_eq!(infos[0].world_size, 2);
    let m = a.membership().unwrap();
    let t0 = Instant::now();
    // Dropping without shutdown stops the keep-alive, as a crash would: the lease expires.
    drop(infos);
    drop(b);
    let ev = m.next_timeout(Duration::from_secs(10)).expect("peer lost");
    assert_eq!(
        ev,
        MembershipEvent::PeerLost {
            round: 0,
            node: "b".into()
        }
    );
    let took = t0.elapsed();
    assert!(took <= Duration::from_millis(4500), "lost after {took:?}");
    let next = a.next_rendezvous().unwrap();
    assert_eq!((next.round, next.world_size, next.rank), (1, 1, 0));
}

#[test]
fn late_node_waits_and_the_round_reforms_with_it() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        min: 2,
        max: 3,
        last_call: Duration::from_millis(300),
        ..Default::default()
    };
    let a = handler(&cfg, "grow-job", "a", &o);
    let b = handler(&cfg, "grow-job", "b", &o);
    let first = join_all(&[a.clone(), b.clone()]);
    assert_eq!(first[0].world_size, 2);
    let order = ids(&first[0]);
    let ma = a.membership().unwrap();
    let c = handler(&cfg, "grow-job", "c", &o);
    let late = {
        let c = c.clone();
        thread::spawn(move || c.next_rendezvous())
    };
    assert_eq!(
        ma.next_timeout(Duration::from_secs(10)),
        Some(MembershipEvent::NodeWaiting {
            round: 0,
            waiting: 1
        })
    );
    assert_eq!(a.num_nodes_waiting().unwrap(), 1);
    let next = join_all(&[a.clone(), b.clone()]);
    let from_c = late.join().unwrap().unwrap();
    for info in next.iter().chain([&from_c]) {
        assert_eq!(info.round, 1);
        assert_eq!(
            ids(info),
            vec![order[0].clone(), order[1].clone(), "c".to_string()]
        );
    }
    assert_eq!(from_c.rank, 2);
    assert_eq!(a.num_nodes_waiting().unwrap(), 0);
}

#[test]
fn closed_job_turns_late_joiners_away_and_the_id_is_free_after_retention() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let o = Opts {
        ttl: Duration::from_secs(2),
        retention: Duration::from_secs(2),
        ..Default::default()
    };
    let a = handler(&cfg, "reuse-job", "a", &o);
    let info = a.next_rendezvous().unwrap();
    info.store.set("pg/addr", b"x").unwrap();
    a.set_closed().unwrap();
    a.shutdown().unwrap();
    drop(info);
    let late = handler(&cfg, "reuse-job", "late", &o);
    match late.next_rendezvous() {
        Err(RendezvousError::Closed { job }) => assert_eq!(job, "reuse-job"),
        other => panic!("a late joiner must get Closed, got {other:?}"),
    }
    assert!(late.is_closed().unwrap());
    late.shutdown().unwrap();
    // The finished record goes after the retention, everything else with the job lease.
    wait_deleted(
        &etcd.endpoint(),
        "/rekindle/reuse-job/finished",
        Duration::from_secs(10),
    );
    wait_deleted(
        &etcd.endpoint(),
        "/rekindle/reuse-job/state",
        Duration::from_secs(10),
    );
    assert_eq!(
        keys_under(&etcd.endpoint(), "/rekindle/reuse-job/"),
        BTreeSet::new()
    );
    let again = handler(&cfg, "reuse-job", "new", &o);
    let info = again.next_rendezvous().unwrap();
    assert_eq!((info.round, info.rank, info.world_size), (0, 0, 1));
    assert_eq!(info.store.get("pg/addr").unwrap(), None, "no stale keys");
}

#[test]
fn etcd_down_at_start_is_retried_until_the_join_deadline() {
    let mut etcd = EtcdServer::start().unwrap();
    let mut cfg = EtcdConfig::new([etcd.endpoint()]);
    cfg.request_timeout = Duration::from_millis(500);
    etcd.stop();
    let o = Opts {
        join_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let h = handler(&cfg, "down-job", "a", &o);
    let t0 = Instant::now();
    let err = h.next_rendezvous().unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(err, RendezvousError::Connection { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("cannot reach the etcd rendezvous store"),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(6),
        "{took:?}"
    );

    // Back before the deadline: the join succeeds.
    let o = Opts {
        join_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let h = handler(&cfg, "down-job", "b", &o);
    let (tx, rx) = std::sync::mpsc::channel();
    let t = {
        let h = h.clone();
        thread::spawn(move || {
            tx.send(()).unwrap();
            h.next_rendezvous()
        })
    };
    rx.recv().unwrap();
    etcd.restart().unwrap();
    let info = t.join().unwrap().unwrap();
    assert_eq!(info.world_size, 1);
}

#[test]
fn etcd_restart_within_the_ttl_loses_nobody() {
    let mut etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let ttl = Duration::from_secs(3);
    let o = Opts {
        min: 2,
        max: 3,
        ttl,
        ..Default::default()
    };
    let a = handler(&cfg, "restart-job", "a", &o);
    let b = handler(&cfg, "restart-job", "b", &o);
    join_all(&[a.clone(), b.clone()]);
    let ma = a.membership().unwrap();
    etcd.restart().unwrap();
    // Longer than the TTL: had a keep-alive failed for good, a lease would have expired.
    assert_eq!(ma.next_timeout(ttl * 2), None, "nobody may be lost");
    // The store works again and the members are all still there.
    let c = handler(&cfg, "restart-job", "c", &o);
    let late = {
        let c = c.clone();
        thread::spawn(move || c.next_rendezvous())
    };
    assert_eq!(
        ma.next_timeout(Duration::from_secs(10)),
        Some(MembershipEvent::NodeWaiting {
            round: 0,
            waiting: 1
        })
    );
    let next = join_all(&[a.clone(), b.clone()]);
    assert_eq!(next[0].world_size, 3);
    assert_eq!(late.join().unwrap().unwrap().round, 1);
}

#[test]
fn wrong_credentials_are_a_clear_error() {
    let etcd = EtcdServer::start_with_auth("pw").unwrap();
    let mut cfg = EtcdConfig::new([etcd.endpoint()]);
    cfg.user = Some(("root".into(), "nope".into()));
    let err = EtcdBackend::connect(&cfg, "auth-job", EtcdBackendOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::Unauthorized { .. }), "{err:?}");

    cfg.user = None;
    let backend = EtcdBackend::connect(&cfg, "auth-job", EtcdBackendOptions::default()).unwrap();
    let node = NodeInfo {
        id: "a".into(),
        host: "h".into(),
        nproc: 1,
        store_addr: None,
    };
    let h =
        DynamicRendezvousHandler::new(Arc::new(backend), node, HandlerOptions::new(1, 1).unwrap());
    let err = h.next_rendezvous().unwrap_err();
    assert!(
        matches!(err, RendezvousError::Unauthorized { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("refused the credentials"), "{err}");

    cfg.user = Some(("root".into(), "pw".into()));
    let h = handler(&cfg, "auth-job", "b", &Opts::default());
    assert_eq!(h.next_rendezvous().unwrap().world_size, 1);
}

#[test]
fn missing_or_bad_job_id_is_refused() {
    let cfg = EtcdConfig::new(["127.0.0.1:1"]);
    for bad in ["", "a/b", "../x"] {
        let err = EtcdBackend::connect(&cfg, bad, EtcdBackendOptions::default()).unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidValue { .. }),
            "{bad:?}: {err:?}"
        );
    }
}
