//! The embedded store's authentication: a handshake that proves both sides hold the job secret,
//! then a MAC on every frame under a key of that connection alone.
//!
//! ```text
//! server -> client : "RKDLST01" nonce_s[16]
//! client -> server : "RKDLST01" nonce_c[16] HMAC(secret, "store-client", nonce_s, nonce_c)
//! server -> client : status u8, HMAC(secret, "store-server", nonce_c, nonce_s)
//! session key      : HMAC(secret, "store-session", nonce_s, nonce_c)
//! every frame      : len u32 (big-endian), body[len], HMAC(session, direction, seq u64, body)
//! ```
//!
//! This is the construction of the collectives' handshake (fresh nonces from both sides, MACs
//! from [`JobSecret`]), so a recorded handshake cannot be replayed and a party without the
//! secret gets nothing but the server's nonce. The frame MACs carry the direction and a
//! per-direction sequence number, so a frame cannot be injected, altered, replayed, reordered
//! or reflected back by anyone on the path. Before the handshake completes the server reads
//! only fixed-size messages, under a deadline; a stranger can make it allocate nothing.

use rekindle_runtime::secret::{nonce, JobSecret};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MAGIC: &[u8; 8] = b"RKDLST01";
/// The size of a frame's MAC.
pub(crate) const TAG_LEN: usize = 32;

/// Status byte of the server's answer.
const OK: u8 = 0;
const BAD_MAGIC: u8 = 1;
const BAD_SECRET: u8 = 2;

/// Which way a frame goes (bound into its MAC, so a frame cannot be reflected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Client to server: requests.
    Request,
    /// Server to client: responses.
    Response,
}

impl Direction {
    fn label(self) -> &'static [u8] {
        match self {
            Direction::Request => b"store-request",
            Direction::Response => b"store-response",
        }
    }
}

/// The key of one authenticated connection.
pub(crate) struct Session {
    key: JobSecret,
}

impl Session {
    fn new(secret: &JobSecret, nonce_s: &[u8], nonce_c: &[u8]) -> Session {
        Session {
            key: secret.derive(&[b"store-session", nonce_s, nonce_c]),
        }
    }

    /// The MAC of frame number `seq` going `dir`.
    pub(crate) fn tag(&self, dir: Direction, seq: u64, body: &[u8]) -> [u8; TAG_LEN] {
        self.key.mac(&[dir.label(), &seq.to_be_bytes(), body])
    }

    /// Checks a frame's MAC in constant time.
    pub(crate) fn check(&self, dir: Direction, seq: u64, body: &[u8], tag: &[u8]) -> bool {
        self.key
            .verify(&[dir.label(), &seq.to_be_bytes(), body], tag)
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// The peer does not hold the job secret (or the server refused ours).
    #[error("{0}")]
    Refused(&'static str),
    /// The peer does not speak this protocol.
    #[error("{0}")]
    Protocol(&'static str),
    /// The connection failed.
    #[error("{0}")]
    Io(String),
    /// The built-in default secret would be used with a peer off loopback.
    #[error("{0}")]
    Exposed(String),
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> HandshakeError {
    move |e| HandshakeError::Io(format!("{what}: {e}"))
}

fn fresh_nonce() -> Result<[u8; 16], HandshakeError> {
    nonce().map_err(|e| HandshakeError::Io(e.to_string()))
}

/// The server's side; the caller bounds it in time. Returns the session, or why the client
/// was refused (after telling it).
pub(crate) async fn accept<S>(s: &mut S, secret: &JobSecret) -> Result<Session, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let nonce_s = fresh_nonce()?;
    let mut hello = [0u8; 24];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..].copy_from_slice(&nonce_s);
    s.write_all(&hello).await.map_err(io("sending the hello"))?;
    let mut answer = [0u8; 8 + 16 + TAG_LEN];
    s.read_exact(&mut answer)
        .await
        .map_err(io("reading the client's hello"))?;
    let mut reply = [0u8; 1 + TAG_LEN];
    if &answer[..8] != MAGIC {
        reply[0] = BAD_MAGIC;
        let _ = s.write_all(&reply).await;
        return Err(HandshakeError::Protocol(
            "not a rekindle store client (bad magic)",
        ));
    }
    let nonce_c = &answer[8..24];
    if !secret.verify(&[b"store-client", &nonce_s, nonce_c], &answer[24..]) {
        reply[0] = BAD_SECRET;
        let _ = s.write_all(&reply).await;
        return Err(HandshakeError::Refused(
            "the client does not hold the job secret",
        ));
    }
    reply[0] = OK;
    reply[1..].copy_from_slice(&secret.mac(&[b"store-server", nonce_c, &nonce_s]));
    s.write_all(&reply)
        .await
        .map_err(io("sending the answer"))?;
    Ok(Session::new(secret, &nonce_s, nonce_c))
}

/// The client's side; the caller bounds it in time.
pub(crate) async fn connect<S>(s: &mut S, secret: &JobSecret) -> Result<Session, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut hello = [0u8; 24];
    s.read_exact(&mut hello)
        .await
        .map_err(io("reading the store's hello"))?;
    if &hello[..8] != MAGIC {
        return Err(HandshakeError::Protocol(
            "the peer is not a rekindle store (bad magic)",
        ));
    }
    let nonce_s = &hello[8..];
    let nonce_c = fresh_nonce()?;
    let mut msg = Vec::with_capacity(8 + 16 + TAG_LEN);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&secret.mac(&[b"store-client", nonce_s, &nonce_c]));
    s.write_all(&msg).await.map_err(io("sending the hello"))?;
    let mut reply = [0u8; 1 + TAG_LEN];
    s.read_exact(&mut reply)
        .await
        .map_err(io("reading the store's answer"))?;
    match reply[0] {
        OK => {}
        BAD_SECRET => {
            return Err(HandshakeError::Refused(
                "the store refused this job secret (REKINDLE_SECRET / REKINDLE_SECRET_FILE \
                 must be the same for every process of the job)",
            ))
        }
        _ => return Err(HandshakeError::Protocol("the store refused the hello")),
    }
    if !secret.verify(&[b"store-server", &nonce_c, nonce_s], &reply[1..]) {
        return Err(HandshakeError::Refused(
            "the store could not prove that it holds the job secret",
        ));
    }
    Ok(Session::new(secret, nonce_s, &nonce_c))
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The connection ended or failed.
    #[error("connection closed: {0}")]
    Io(#[from] std::io::Error),
    /// The length is above the limit.
    #[error("a frame of {len} bytes is over the {max}-byte limit")]
    TooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The MAC does not match: the frame was forged, altered, replayed or reordered.
    #[error("frame {seq} failed authentication")]
    BadTag {
        /// The frame's sequence number.
        seq: u64,
    },
}

/// Reads frame number `seq` going `dir` and checks its MAC.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    session: &Session,
    dir: Direction,
    seq: u64,
    max: usize,
) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    rd.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len + TAG_LEN];
    rd.read_exact(&mut body).await?;
    let tag = body.split_off(len);
    if !session.check(dir, seq, &body, &tag) {
        return Err(FrameError::BadTag { seq });
    }
    Ok(body)
}

/// Encodes `body` as frame number `seq` going `dir`: length, body, MAC.
pub(crate) fn seal_frame(session: &Session, dir: Direction, seq: u64, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(4 + body.len() + TAG_LEN);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    frame.extend_from_slice(&session.tag(dir, seq, body));
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(
        server: &str,
        client: &str,
    ) -> (
        Result<Session, HandshakeError>,
        Result<Session, HandshakeError>,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (s, c) = (
            JobSecret::new(server).unwrap(),
            JobSecret::new(client).unwrap(),
        );
        rt.block_on(async move {
            let (mut a, mut b) = tokio::io::duplex(1024);
            let srv = tokio::spawn(async move { accept(&mut a, &s).await });
            let cli = connect(&mut b, &c).await;
            (srv.await.unwrap(), cli)
        })
    }

    #[test]
    fn same_secret_gives_the_same_session_key() {
        let (s, c) = pair("k", "k");
        let (s, c) = (s.unwrap(), c.unwrap());
        let t = c.tag(Direction::Request, 0, b"body");
        assert!(s.check(Direction::Request, 0, b"body", &t));
        assert!(
            !s.check(Direction::Response, 0, b"body", &t),
            "direction is bound"
        );
        assert!(
            !s.check(Direction::Request, 1, b"body", &t),
            "sequence is bound"
        );
        assert!(
            !s.check(Direction::Request, 0, b"bodY", &t),
            "body is bound"
        );
    }

    #[test]
    fn a_different_secret_is_refused_on_both_sides() {
        let (s, c) = pair("k", "other");
        assert_eq!(
            s.err(),
            Some(HandshakeError::Refused(
                "the client does not hold the job secret"
            ))
        );
        assert!(
            matches!(c, Err(HandshakeError::Refused(m)) if m.contains("refused this job secret"))
        );
    }

    #[test]
    fn sessions_of_two_connections_differ() {
        let (a, _) = pair("k", "k");
        let (b, _) = pair("k", "k");
        let t = a.unwrap().tag(Direction::Request, 0, b"x");
        assert!(!b.unwrap().check(Direction::Request, 0, b"x", &t));
    }
}
