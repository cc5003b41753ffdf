//! The embedded store against strangers, spoken to with raw TCP bytes (not the real client):
//! without the job secret nothing is read or written; forged, replayed and oversized frames
//! close the connection; connection counts are bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rekindle_elastic::store::{ServerLimits, TcpStoreClient, TcpStoreServer, MAX_FRAME};
use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::Store;

const MAGIC: &[u8; 8] = b"RKDLST01";
const T: Duration = Duration::from_secs(10);

fn secret() -> JobSecret {
    JobSecret::new("the job's secret").unwrap()
}

fn server(limits: ServerLimits) -> TcpStoreServer {
    TcpStoreServer::bind_with("127.0.0.1:0".parse().unwrap(), &secret(), limits).unwrap()
}

fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// Reads until EOF (the server closed the connection) or the timeout; returns the bytes.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    let deadline = Instant::now() + T;
    loop {
        assert!(
            Instant::now() < deadline,
            "the server kept the connection open"
        );
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("the server kept the connection open: {e}"),
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// A `set(key, value)` request body with id 1.
fn set_body(key: &str, value: &[u8]) -> Vec<u8> {
    let mut b = 1u64.to_be_bytes().to_vec();
    b.push(1);
    put_bytes(&mut b, key.as_bytes());
    put_bytes(&mut b, value);
    b
}

/// A `get(key)` request body with id `id`.
fn get_body(id: u64, key: &str) -> Vec<u8> {
    let mut b = id.to_be_bytes().to_vec();
    b.push(2);
    put_bytes(&mut b, key.as_bytes());
    b
}

/// The handshake as a client holding `secret`; returns the session key, or the server's status
/// byte when it refused.
fn handshake(s: &mut TcpStream, secret: &JobSecret) -> Result<JobSecret, u8> {
    let mut hello = [0u8; 24];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], MAGIC);
    let nonce_s = &hello[8..];
    let nonce_c = [7u8; 16];
    let mut msg = MAGIC.to_vec();
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&secret.mac(&[b"store-client", nonce_s, &nonce_c]));
    s.write_all(&msg).unwrap();
    let mut reply = [0u8; 33];
    s.read_exact(&mut reply).unwrap();
    if reply[0] != 0 {
        return Err(reply[0]);
    }
    assert!(secret.verify(&[b"store-server", &nonce_c, nonce_s], &reply[1..]));
    Ok(secret.derive(&[b"store-session", nonce_s, &nonce_c]))
}

fn frame(session: &JobSecret, seq: u64, body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f.extend_from_slice(&session.mac(&[b"store-request", &seq.to_be_bytes(), body]));
    f
}

/// Reads one response frame and checks its MAC; returns the body.
fn read_response(s: &mut TcpStream, session: &JobSecret, seq: u64) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    let mut tag = [0u8; 32];
    s.read_exact(&mut tag).unwrap();
    assert!(session.verify(&[b"store-response", &seq.to_be_bytes(), &body], &tag));
    body
}

fn real_client(server: &TcpStoreServer) -> TcpStoreClient {
    TcpStoreClient::connect(&server.local_addr().to_string(), &secret()).unwrap()
}

#[test]
fn a_holder_of_the_secret_speaking_raw_bytes_is_served() {
    // The positive control: the raw client below is right, so its refusals elsewhere mean
    // something.
    let srv = server(ServerLimits::default());
    real_client(&srv).set("k", b"v").unwrap();
    let mut s = raw(srv.local_addr());
    let session = handshake(&mut s, &secret()).unwrap();
    s.write_all(&frame(&session, 0, &get_body(9, "k"))).unwrap();
    let body = read_response(&mut s, &session, 0);
    // id 9, R_VALUE, Some, len 1, "v"
    let mut want = 9u64.to_be_bytes().to_vec();
    want.extend_from_slice(&[1, 1, 0, 0, 0, 1, b'v']);
    assert_eq!(body, want);
    s.write_all(&frame(&session, 1, &set_body("k2", b"raw")))
        .unwrap();
    read_response(&mut s, &session, 1);
    assert_eq!(real_client(&srv).get("k2").unwrap(), Some(b"raw".to_vec()));
    assert_eq!(srv.refused_connections(), 0);
}

#[test]
fn a_stranger_can_neither_read_nor_write() {
    let srv = server(ServerLimits::default());
    let owner = real_client(&srv);
    owner
        .set("/rekindle/j/r0/addr/0", b"10.0.0.1:5000")
        .unwrap();

    // A wrong secret: refused with status 2 (bad secret), then closed.
    let mut s = raw(srv.local_addr());
    assert_eq!(
        handshake(&mut s, &JobSecret::new("guess").unwrap()).err(),
        Some(2)
    );
    assert!(read_to_close(&mut s).is_empty());

    // No handshake at all: a request frame straight away is a bad hello; closed with nothing
    // served.
    let mut s = raw(srv.local_addr());
    let mut hello = [0u8; 24];
    s.read_exact(&mut hello).unwrap();
    let mut f = (set_body("/rekindle/j/r0/addr/0", b"evil").len() as u32)
        .to_be_bytes()
        .to_vec();
    f.extend_from_slice(&set_body("/rekindle/j/r0/addr/0", b"evil"));
    f.resize(f.len().max(56), 0);
    let _ = s.write_all(&f);
    let answer = read_to_close(&mut s);
    assert!(
        answer.len() <= 33 && answer.first().is_none_or(|b| *b != 0),
        "{answer:?}"
    );

    // The handshake of a past connection replayed: the server's nonce is fresh, so the MAC
    // does not fit.
    let mut s = raw(srv.local_addr());
    let mut hello = [0u8; 24];
    s.read_exact(&mut hello).unwrap();
    let stale_nonce_s = [0u8; 16];
    let nonce_c = [7u8; 16];
    let mut msg = MAGIC.to_vec();
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&secret().mac(&[b"store-client", &stale_nonce_s, &nonce_c]));
    s.write_all(&msg).unwrap();
    let answer = read_to_close(&mut s);
    assert_eq!(answer.first(), Some(&2), "{answer:?}");

    assert_eq!(
        owner.get("/rekindle/j/r0/addr/0").unwrap(),
        Some(b"10.0.0.1:5000".to_vec())
    );
    assert_eq!(srv.refused_connections(), 3);
}

#[test]
fn forged_replayed_and_oversized_frames_close_the_connection() {
    let srv = server(ServerLimits::default());
    let owner = real_client(&srv);
    owner.set("k", b"original").unwrap();

    // A frame altered on the path (its MAC no longer fits).
    let mut s = raw(srv.local_addr());
    let session = handshake(&mut s, &secret()).unwrap();
    let mut f = frame(&session, 0, &set_body("k", b"altered"));
    let last = f.len() - 40;
    f[last] ^= 1;
    s.write_all(&f).unwrap();
    assert!(read_to_close(&mut s).is_empty());

    // A genuine frame replayed: its sequence number is the past one's.
    let mut s = raw(srv.local_addr());
    let session = handshake(&mut s, &secret()).unwrap();
    let good = frame(&session, 0, &set_body("k", b"once"));
    s.write_all(&good).unwrap();
    read_response(&mut s, &session, 0);
    owner.set("k", b"original").unwrap();
    s.write_all(&good).unwrap();
    assert!(read_to_close(&mut s).is_empty());

    // A length over the limit: closed before anything that large is read or allocated.
    let mut s = raw(srv.local_addr());
    handshake(&mut s, &secret()).unwrap();
    s.write_all(&((MAX_FRAME + 1) as u32).to_be_bytes())
        .unwrap();
    assert!(read_to_close(&mut s).is_empty());

    assert_eq!(owner.get("k").unwrap(), Some(b"original".to_vec()));
    assert_eq!(srv.refused_connections(), 3);
}

#[test]
fn connections_and_handshakes_are_bounded() {
    let srv = server(ServerLimits {
        max_connections: 3,
        max_handshakes: 2,
        handshake_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    // Two strangers that never answer the hello hold both handshake slots ...
    let mut idle: Vec<TcpStream> = (0..2).map(|_| raw(srv.local_addr())).collect();
    for s in &mut idle {
        let mut hello = [0u8; 24];
        s.read_exact(&mut hello).unwrap();
    }
    // ... so a third connection is closed at once, without even a hello.
    let mut third = raw(srv.local_addr());
    assert!(read_to_close(&mut third).is_empty());
    // The strangers are dropped at the handshake deadline; then the owner gets in.
    for s in &mut idle {
        assert!(read_to_close(s).is_empty());
    }
    let a = real_client(&srv);
    let b = real_client(&srv);
    let c = real_client(&srv);
    a.set("x", b"1").unwrap();
    assert_eq!(c.get("x").unwrap(), Some(b"1".to_vec()));
    // Three authenticated connections fill the server: a fourth is closed at once.
    let mut fourth = raw(srv.local_addr());
    assert!(read_to_close(&mut fourth).is_empty());
    drop(b);
    assert_eq!(a.get("x").unwrap(), Some(b"1".to_vec()));
    assert_eq!(srv.refused_connections(), 4);
}
