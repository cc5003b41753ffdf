//! The etcd store against a real etcd server.
#![cfg(feature = "test-etcd")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rekindle_elastic::etcd::EtcdConfig;
use rekindle_elastic::store::EtcdStore;
use rekindle_elastic::testing::EtcdServer;
use rekindle_runtime::store::{testing::conformance, Store, StoreError};

#[test]
fn conforms() {
    let etcd = EtcdServer::start().unwrap();
    let store = EtcdStore::connect(&EtcdConfig::new([etcd.endpoint()]), "/t/conf/").unwrap();
    conformance(Arc::new(store)).unwrap();
}

#[test]
fn conforms_when_bound_to_a_lease() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let endpoint = format!("http://{}", etcd.endpoint());
    let lease = rt
        .block_on(async move {
            let mut c = etcd_client::Client::connect([endpoint], None).await?;
            c.lease_grant(60, None).await.map(|r| r.id())
        })
        .unwrap();
    let store = EtcdStore::connect(&cfg, "/t/lease/")
        .unwrap()
        .with_lease(lease);
    conformance(Arc::new(store)).unwrap();
}

#[test]
fn usable_from_inside_a_tokio_runtime() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let store = EtcdStore::connect(&cfg, "/t/async/").unwrap();
        store.set("k", b"v").unwrap();
        assert_eq!(
            store.wait(&["k"], Duration::from_secs(5)).unwrap(),
            vec![b"v".to_vec()]
        );
        drop(store);
    });
}

#[test]
fn two_prefixes_do_not_see_each_other() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let a = EtcdStore::connect(&cfg, "/rekindle/job-a/").unwrap();
    let b = EtcdStore::connect(&cfg, "/rekindle/job-b/").unwrap();
    a.set("k", b"a").unwrap();
    assert_eq!(b.get("k").unwrap(), None);
    b.set("k", b"b").unwrap();
    assert_eq!(a.get("k").unwrap(), Some(b"a".to_vec()));
    assert_eq!(b.delete_prefix("").unwrap(), 1);
    assert_eq!(a.get("k").unwrap(), Some(b"a".to_vec()));
}

#[test]
fn unreachable_etcd_is_a_connection_error_within_the_timeout() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut cfg = EtcdConfig::new([format!("127.0.0.1:{port}")]);
    cfg.request_timeout = Duration::from_millis(500);
    let t0 = Instant::now();
    let err = EtcdStore::connect(&cfg, "/x/")
        .and_then(|s| s.get("k"))
        .unwrap_err();
    assert!(matches!(err, StoreError::Connection { .. }), "{err:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn wrong_credentials_are_unauthorized() {
    let etcd = EtcdServer::start_with_auth("s3cret").unwrap();
    let mut cfg = EtcdConfig::new([etcd.endpoint()]);
    cfg.user = Some(("root".into(), "wrong".into()));
    let err = EtcdStore::connect(&cfg, "/x/").unwrap_err();
    assert!(matches!(err, StoreError::Unauthorized { .. }), "{err:?}");
    assert!(err.to_string().contains("refused the credentials"), "{err}");

    cfg.user = None;
    let err = EtcdStore::connect(&cfg, "/x/")
        .and_then(|s| s.set("k", b"v"))
        .unwrap_err();
    assert!(matches!(err, StoreError::Unauthorized { .. }), "{err:?}");

    cfg.user = Some(("root".into(), "s3cret".into()));
    let store = EtcdStore::connect(&cfg, "/x/").unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn wait_survives_an_etcd_restart() {
    let mut etcd = EtcdServer::start().unwrap();
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let store = Arc::new(EtcdStore::connect(&cfg, "/t/restart/").unwrap());
    store.set("before", b"1").unwrap();
    let waiter = {
        let store = store.clone();
        std::thread::spawn(move || {
            store.set("waiting", b"1")?;
            store.wait(&["before", "after"], Duration::from_secs(20))
        })
    };
    store.wait(&["waiting"], Duration::from_secs(10)).unwrap();
    etcd.restart().unwrap();
    let writer = EtcdStore::connect(&cfg, "/t/restart/").unwrap();
    writer.set("after", b"2").unwrap();
    let got = waiter.join().unwrap().unwrap();
    assert_eq!(got, vec![b"1".to_vec(), b"2".to_vec()]);
}

#[test]
fn a_worker_store_address_opens_a_conforming_store_bound_to_the_lease() {
    let etcd = EtcdServer::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let endpoint = format!("http://{}", etcd.endpoint());
    let mut client = rt
        .block_on(etcd_client::Client::connect([endpoint], None))
        .unwrap();
    let lease = rt
        .block_on(client.lease_grant(60, None))
        .map(|r| r.id())
        .unwrap();
    let addr = format!("etcd://{}?lease={lease}", etcd.endpoint());
    let store = rekindle_elastic::store::connect(&addr).unwrap();
    conformance(Arc::new(rekindle_runtime::store::PrefixStore::new(
        store.clone(),
        "/t/url/",
    )))
    .unwrap();
    store.set("/t/url/bound", b"1").unwrap();
    assert_eq!(store.get("/t/url/bound").unwrap(), Some(b"1".to_vec()));
    // The key goes with the lease, as a dead job's keys do.
    rt.block_on(client.lease_revoke(lease)).unwrap();
    assert_eq!(store.get("/t/url/bound").unwrap(), None);
}
