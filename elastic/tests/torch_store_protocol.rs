//! The PyTorch TCPStore server, proxy and per-round bootstrap, driven by a client that writes
//! raw bytes as PyTorch's `c10d::TCPStore` does (little-endian integers, `u64` lengths).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rekindle_elastic::store::{TcpStoreClient, TcpStoreServer};
use rekindle_elastic::torch_store::{
    Limits, RoundSite, TorchBootstrap, TorchStoreProxy, TorchStoreServer, ADDR_KEY,
};
use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::Store;

const T: Duration = Duration::from_secs(20);

/// A client that speaks the protocol byte by byte.
struct Raw {
    s: TcpStream,
}

fn b(s: &str) -> Vec<u8> {
    let mut o = (s.len() as u64).to_le_bytes().to_vec();
    o.extend_from_slice(s.as_bytes());
    o
}

fn u64le(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn i64le(v: i64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

impl Raw {
    /// Connects without validating.
    fn bare(addr: SocketAddr) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.set_nodelay(true).unwrap();
        Raw { s }
    }

    /// Connects as PyTorch's client does: VALIDATE with the magic, then PING.
    fn connect(addr: SocketAddr) -> Raw {
        let mut c = Raw::bare(addr);
        c.send(&[&[0u8][..], &0x3C85_F7CEu32.to_le_bytes()].concat());
        c.send(&[&[13u8][..], &0x0102_0304u32.to_le_bytes()].concat());
        assert_eq!(c.read(4), 0x0102_0304u32.to_le_bytes());
        c
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// Sends a command byte and its fields.
    fn cmd(&mut self, code: u8, fields: &[Vec<u8>]) {
        let mut o = vec![code];
        for f in fields {
            o.extend_from_slice(f);
        }
        self.send(&o);
    }

    fn read(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).unwrap();
        v
    }

    fn read_bytes(&mut self) -> Vec<u8> {
        let len = u64::from_le_bytes(self.read(8).try_into().unwrap());
        self.read(len as usize)
    }

    fn read_i64(&mut self) -> i64 {
        i64::from_le_bytes(self.read(8).try_into().unwrap())
    }

    /// True if the server closed the connection (read returns end of stream or a reset).
    fn closed(&mut self) -> bool {
        let mut one = [0u8; 1];
        matches!(self.s.read(&mut one), Ok(0) | Err(_))
    }
}

fn server() -> TorchStoreServer {
    TorchStoreServer::bind("127.0.0.1:0".parse().unwrap(), Limits::default()).unwrap()
}

#[test]
fn every_command_over_a_socket() {
    let srv = server();
    let mut c = Raw::connect(srv.local_addr());
    // SET /k v; GET /k.
    c.cmd(1, &[b("/k"), b("v")]);
    c.cmd(3, &[b("/k")]);
    assert_eq!(c.read_bytes(), b"v");
    // GET of a missing key: empty.
    c.cmd(3, &[b("/none")]);
    assert_eq!(c.read_bytes(), b"");
    // COMPARE_SET: swapped, not swapped, missing key with an expected value.
    c.cmd(2, &[b("/k"), b("v"), b("w")]);
    assert_eq!(c.read_bytes(), b"w");
    c.cmd(2, &[b("/k"), b("v"), b("z")]);
    assert_eq!(c.read_bytes(), b"w");
    c.cmd(2, &[b("/m"), b("e"), b("z")]);
    assert_eq!(c.read_bytes(), b"e");
    // ADD twice.
    c.cmd(4, &[b("/n"), i64le(5)]);
    assert_eq!(c.read_i64(), 5);
    c.cmd(4, &[b("/n"), i64le(-8)]);
    assert_eq!(c.read_i64(), -3);
    // CHECK: ready, then not ready.
    c.cmd(5, &[u64le(2), b("/k"), b("/n")]);
    assert_eq!(c.read(1), [0]);
    c.cmd(5, &[u64le(2), b("/k"), b("/nope")]);
    assert_eq!(c.read(1), [1]);
    // WAIT on present keys answers at once.
    c.cmd(6, &[u64le(1), b("/k")]);
    assert_eq!(c.read(1), [0]);
    // GETNUMKEYS: /k and /n.
    c.cmd(7, &[]);
    assert_eq!(c.read_i64(), 2);
    // APPEND, then MULTI_SET and MULTI_GET.
    c.cmd(9, &[b("/k"), b("x")]);
    c.cmd(11, &[u64le(2), b("/a"), b("1"), b("/b"), b("22")]);
    c.cmd(10, &[u64le(3), b("/k"), b("/a"), b("/b")]);
    assert_eq!(c.read_bytes(), b"wx");
    assert_eq!(c.read_bytes(), b"1");
    assert_eq!(c.read_bytes(), b"22");
    // DELETE_KEY: 1 then 0.
    c.cmd(8, &[b("/a")]);
    assert_eq!(c.read_i64(), 1);
    c.cmd(8, &[b("/a")]);
    assert_eq!(c.read_i64(), 0);
    // LIST_KEYS: /k, /n, /b in some order.
    c.cmd(17, &[]);
    let n = c.read_i64();
    let mut keys: Vec<Vec<u8>> = (0..n).map(|_| c.read_bytes()).collect();
    keys.sort();
    assert_eq!(keys, vec![b"/b".to_vec(), b"/k".to_vec(), b"/n".to_vec()]);
    // Queues: push two, length, pop both, pop empty.
    c.cmd(14, &[b("/q"), b("i1")]);
    c.cmd(14, &[b("/q"), b("i2")]);
    c.cmd(16, &[b("/q")]);
    assert_eq!(c.read_i64(), 2);
    c.cmd(15, &[b("/q")]);
    assert_eq!(c.read_i64(), 2);
    assert_eq!(c.read_bytes(), b"i1");
    c.cmd(15, &[b("/q")]);
    assert_eq!(c.read_i64(), 1);
    assert_eq!(c.read_bytes(), b"i2");
    c.cmd(15, &[b("/q")]);
    assert_eq!(c.read_i64(), 0);
    // BARRIER of one passes at once; CANCEL_WAIT with nothing pending.
    c.cmd(18, &[b("/bar"), i64le(1)]);
    assert_eq!(c.read(1), [0]);
    c.cmd(12, &[]);
    assert_eq!(c.read(1), [1]);
    // PING.
    c.cmd(13, &[0xabcdu32.to_le_bytes().to_vec()]);
    assert_eq!(c.read(4), 0xabcdu32.to_le_bytes());
    assert_eq!(srv.num_keys(), 4);
}

#[test]
fn a_request_split_across_many_writes_is_served() {
    let srv = server();
    let mut c = Raw::connect(srv.local_addr());
    let value = "x".repeat(100_000);
    let mut req = vec![1u8];
    req.extend(b("/big"));
    req.extend(b(&value));
    for chunk in req.chunks(997) {
        c.send(chunk);
    }
    c.cmd(3, &[b("/big")]);
    assert_eq!(c.read_bytes(), value.as_bytes());
}

#[test]
fn a_wait_is_answered_when_another_client_sets_the_key() {
    let srv = server();
    let mut waiter = Raw::connect(srv.local_addr());
    let mut setter = Raw::connect(srv.local_addr());
    waiter.cmd(6, &[u64le(2), b("/x"), b("/y")]);
    // Answers come in order: the PING's reply first proves the WAIT is still pending.
    waiter.cmd(13, &[7u32.to_le_bytes().to_vec()]);
    assert_eq!(waiter.read(4), 7u32.to_le_bytes());
    setter.cmd(1, &[b("/x"), b("1")]);
    setter.cmd(13, &[8u32.to_le_bytes().to_vec()]);
    assert_eq!(setter.read(4), 8u32.to_le_bytes());
    waiter.cmd(13, &[9u32.to_le_bytes().to_vec()]);
    assert_eq!(waiter.read(4), 9u32.to_le_bytes());
    setter.cmd(4, &[b("/y"), i64le(1)]);
    assert_eq!(setter.read_i64(), 1);
    assert_eq!(waiter.read(1), [0]);
}

#[test]
fn a_cancelled_wait_answers_cancelled_and_stays_cancelled() {
    let srv = server();
    let mut waiter = Raw::connect(srv.local_addr());
    let mut setter = Raw::connect(srv.local_addr());
    waiter.cmd(6, &[u64le(1), b("/late")]);
    waiter.cmd(12, &[]);
    assert_eq!(waiter.read(1), [1]);
    setter.cmd(1, &[b("/late"), b("v")]);
    // The next answer on the waiter's connection is its PING, not a stale STOP_WAITING.
    setter.cmd(13, &[1u32.to_le_bytes().to_vec()]);
    assert_eq!(setter.read(4), 1u32.to_le_bytes());
    waiter.cmd(13, &[2u32.to_le_bytes().to_vec()]);
    assert_eq!(waiter.read(4), 2u32.to_le_bytes());
}

#[test]
fn a_barrier_releases_all_ranks_at_the_world_size() {
    let srv = server();
    let mut ranks: Vec<Raw> = (0..3).map(|_| Raw::connect(srv.local_addr())).collect();
    for r in ranks.iter_mut().take(2) {
        r.cmd(18, &[b("/init"), i64le(3)]);
        r.cmd(13, &[5u32.to_le_bytes().to_vec()]);
        assert_eq!(
            r.read(4),
            5u32.to_le_bytes(),
            "released before the last rank"
        );
    }
    ranks[2].cmd(18, &[b("/init"), i64le(3)]);
    for r in &mut ranks {
        assert_eq!(r.read(1), [0]);
    }
    ranks[0].cmd(3, &[b("/init")]);
    assert_eq!(ranks[0].read_bytes(), b"3");
}

#[test]
fn strangers_and_bad_requests_are_disconnected() {
    let limits = Limits {
        max_key_len: 16,
        ..Limits::default()
    };
    let srv = TorchStoreServer::bind("127.0.0.1:0".parse().unwrap(), limits).unwrap();
    // No VALIDATE first: this is rekindle's own store protocol, say.
    let mut c = Raw::bare(srv.local_addr());
    c.send(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert!(c.closed());
    // A wrong magic number.
    let mut c = Raw::bare(srv.local_addr());
    c.cmd(0, &[1u32.to_le_bytes().to_vec()]);
    assert!(c.closed());
    // A key over the limit.
    let mut c = Raw::connect(srv.local_addr());
    c.cmd(3, &[b("/0123456789abcdefg")]);
    assert!(c.closed());
    // An unknown command.
    let mut c = Raw::connect(srv.local_addr());
    c.cmd(200, &[]);
    assert!(c.closed());
    // ADD on a value that is not a number.
    let mut c = Raw::connect(srv.local_addr());
    c.cmd(1, &[b("/t"), b("abc")]);
    c.cmd(4, &[b("/t"), i64le(1)]);
    assert!(c.closed());
    // The store still serves others, and the faulty ADD changed nothing.
    let mut ok = Raw::connect(srv.local_addr());
    ok.cmd(3, &[b("/t")]);
    assert_eq!(ok.read_bytes(), b"abc");
}

#[test]
fn connections_past_the_limit_are_closed() {
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let srv = TorchStoreServer::bind("127.0.0.1:0".parse().unwrap(), limits).unwrap();
    let a = Raw::connect(srv.local_addr());
    let _b = Raw::connect(srv.local_addr());
    let mut third = Raw::bare(srv.local_addr());
    assert!(third.closed());
    drop(a);
    let deadline = Instant::now() + T;
    while srv.connections() > 1 {
        assert!(
            Instant::now() < deadline,
            "the closed connection was not noticed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut again = Raw::connect(srv.local_addr());
    again.cmd(7, &[]);
    assert_eq!(again.read_i64(), 0);
}

#[test]
fn dropping_the_server_closes_its_connections() {
    let srv = server();
    let mut c = Raw::connect(srv.local_addr());
    c.cmd(6, &[u64le(1), b("/never")]);
    drop(srv);
    assert!(c.closed());
}

#[test]
fn the_proxy_holds_a_client_until_the_server_is_known() {
    let srv = server();
    let target = srv.local_addr();
    let published = Arc::new(AtomicBool::new(false));
    let p = published.clone();
    let resolve: rekindle_elastic::torch_store::Resolve = Arc::new(move |wait: Duration| {
        if p.load(Ordering::Acquire) {
            Ok(target)
        } else {
            // A lookup that finds nothing yet takes (part of) its time, as a store wait does.
            std::thread::sleep(wait.min(Duration::from_millis(20)));
            Err("not published yet".into())
        }
    });
    let proxy = TorchStoreProxy::bind("127.0.0.1:0".parse().unwrap(), resolve, 16).unwrap();
    let mut c = Raw::bare(proxy.local_addr());
    c.send(&[&[0u8][..], &0x3C85_F7CEu32.to_le_bytes()].concat());
    c.cmd(1, &[b("/via-proxy"), b("1")]);
    published.store(true, Ordering::Release);
    c.cmd(3, &[b("/via-proxy")]);
    assert_eq!(c.read_bytes(), b"1");
    let mut direct = Raw::connect(target);
    direct.cmd(3, &[b("/via-proxy")]);
    assert_eq!(direct.read_bytes(), b"1");
}

/// The secret the tests' stores are opened with.
fn secret() -> &'static JobSecret {
    static SECRET: std::sync::OnceLock<JobSecret> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| JobSecret::new(b"torch-store-protocol-test".to_vec()).unwrap())
}

fn site<'a>(node_rank: usize, store: &'a str, prefix: &'a str) -> RoundSite<'a> {
    RoundSite {
        node_rank,
        nnodes: 2,
        master_addr: "127.0.0.1",
        round_store: store,
        round_prefix: prefix,
        secret: secret(),
    }
}

fn env_addr(b: &TorchBootstrap) -> SocketAddr {
    let get = |k: &str| {
        b.worker_env()
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
    format!("{}:{}", get("MASTER_ADDR"), get("MASTER_PORT"))
        .parse()
        .unwrap()
}

#[test]
fn two_nodes_share_one_store_per_round_and_each_round_starts_empty() {
    // The round's store: rekindle's embedded store, as node 0's agent serves it.
    let rdzv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).unwrap();
    let rdzv_addr = rdzv.local_addr().to_string();
    let (mut node0, mut node1) = (TorchBootstrap::new(), TorchBootstrap::new());

    // Node 1 starts its workers first: its proxy accepts them before node 0 has published.
    node1
        .start_round(&site(1, &rdzv_addr, "/rekindle/j/r0/"))
        .unwrap();
    let addr1 = env_addr(&node1);
    assert!(addr1.ip().is_loopback());
    let mut rank1 = Raw::bare(addr1);
    rank1.send(&[&[0u8][..], &0x3C85_F7CEu32.to_le_bytes()].concat());
    rank1.cmd(1, &[b("/rank1"), b("here")]);

    node0
        .start_round(&site(0, &rdzv_addr, "/rekindle/j/r0/"))
        .unwrap();
    let addr0 = env_addr(&node0);
    let published = TcpStoreClient::connect(&rdzv_addr, secret())
        .unwrap()
        .get(&format!("/rekindle/j/r0/{ADDR_KEY}"))
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8(published).unwrap(), addr0.to_string());
    // Rank 1's SET reaches the store once its proxy has read the address: wait for the key
    // first, as PyTorch's get() does.
    let mut rank0 = Raw::connect(addr0);
    rank0.cmd(6, &[u64le(1), b("/rank1")]);
    assert_eq!(rank0.read(1), [0]);
    rank0.cmd(3, &[b("/rank1")]);
    assert_eq!(rank0.read_bytes(), b"here");
    rank1.cmd(13, &[3u32.to_le_bytes().to_vec()]);
    assert_eq!(rank1.read(4), 3u32.to_le_bytes());

    // The next round: new endpoints, the old connections closed, no key of round 0 left.
    node0
        .start_round(&site(0, &rdzv_addr, "/rekindle/j/r1/"))
        .unwrap();
    node1
        .start_round(&site(1, &rdzv_addr, "/rekindle/j/r1/"))
        .unwrap();
    assert!(rank0.closed());
    assert!(rank1.closed());
    let mut fresh = Raw::connect(env_addr(&node1));
    fresh.cmd(7, &[]);
    assert_eq!(fresh.read_i64(), 0);
    fresh.cmd(5, &[u64le(1), b("/rank1")]);
    assert_eq!(fresh.read(1), [1]);
}

#[test]
fn a_one_node_round_binds_loopback_and_publishes_nothing() {
    let rdzv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).unwrap();
    let rdzv_addr = rdzv.local_addr().to_string();
    let mut b = TorchBootstrap::new();
    b.start_round(&RoundSite {
        node_rank: 0,
        nnodes: 1,
        master_addr: "node0.example",
        round_store: &rdzv_addr,
        round_prefix: "/rekindle/j/r0/",
        secret: secret(),
    })
    .unwrap();
    assert!(env_addr(&b).ip().is_loopback());
    let key = format!("/rekindle/j/r0/{ADDR_KEY}");
    assert_eq!(
        TcpStoreClient::connect(&rdzv_addr, secret())
            .unwrap()
            .get(&key)
            .unwrap(),
        None
    );
}
