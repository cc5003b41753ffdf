//! The connection handshake: job, round and ranks, authenticated with the job secret.
//!
//! ```text
//! acceptor  -> connector : "RKDLHS02" nonce_a[16]
//! connector -> acceptor  : "RKDLHS02" job_len u8, job, round u64, rank u32, target u32,
//!                          channel u8, wire u8, nonce_c[16],
//!                          HMAC(secret, "client", nonce_a, nonce_c, job, round, rank, target,
//!                               channel, wire)
//! acceptor  -> connector : status u8, HMAC(secret, "server", nonce_c, nonce_a, job, round,
//!                                         target, rank, channel, wire)
//! ```
//! Both sides prove knowledge of the secret over fresh nonces, so a recorded handshake cannot be
//! replayed, and the acceptor's answer proves it is the rank the connector meant. A connection
//! that fails any check is refused (with a status byte saying why) and closed; it never joins
//! the group.
//!
//! Both sides then derive one key per direction of the connection,
//! `HMAC(secret, "wire", direction, nonce_a, nonce_c, job, round, rank, target, channel, wire)`,
//! with which every later frame is sealed (see `seal`): fresh nonces make the keys unique to
//! this connection, so frames of one connection cannot be replayed on another.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::seal::{Keys, Sealer, WireMode};
use crate::secret::JobSecret;

const MAGIC: &[u8; 8] = b"RKDLHS02";

/// The identity a side expects and presents.
pub(crate) struct Identity<'a> {
    pub job: &'a str,
    pub round: u64,
    pub rank: usize,
    pub world: usize,
    pub secret: &'a JobSecret,
    /// How frames after the handshake are sealed; both sides must agree.
    pub wire: WireMode,
}

/// Why a handshake was refused, as sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    BadMagic = 1,
    WrongJob = 2,
    WrongRound = 3,
    BadRank = 4,
    BadSecret = 5,
    Duplicate = 6,
    WireMode = 7,
}

impl Refusal {
    fn from_code(c: u8) -> Option<Refusal> {
        Some(match c {
            1 => Refusal::BadMagic,
            2 => Refusal::WrongJob,
            3 => Refusal::WrongRound,
            4 => Refusal::BadRank,
            5 => Refusal::BadSecret,
            6 => Refusal::Duplicate,
            7 => Refusal::WireMode,
            _ => return None,
        })
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Refusal::BadMagic => "not a rekindle connection (bad magic or version)",
            Refusal::WrongJob => "wrong job id",
            Refusal::WrongRound => "wrong rendezvous round",
            Refusal::BadRank => "rank out of range or not expected here",
            Refusal::BadSecret => "wrong job secret",
            Refusal::Duplicate => "rank already connected",
            Refusal::WireMode => {
                "the ranks use different wire modes (REKINDLE_WIRE / TcpOptions::wire differ)"
            }
        }
    }
}

fn nonce() -> Result<[u8; 16], String> {
    let mut n = [0u8; 16];
    getrandom::getrandom(&mut n).map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(n)
}

fn set_deadline(s: &TcpStream, deadline: Instant) -> Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))
        .and_then(|_| s.set_write_timeout(Some(left)))
        .map_err(|e| format!("setting socket timeouts: {e}"))
}

fn read_exact(s: &mut TcpStream, buf: &mut [u8], what: &str) -> Result<(), String> {
    s.read_exact(buf)
        .map_err(|e| format!("reading {what}: {e}"))
}

/// Which of a pair's two connections this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    /// Carries the operations' bytes.
    Data = 0,
    /// Carries liveness notices (goodbye, abort).
    Control = 1,
}

/// The direction keys of a connection between `connector` and `acceptor`.
#[allow(clippy::too_many_arguments)]
fn derive_keys(
    me: &Identity<'_>,
    i_am_connector: bool,
    nonce_a: &[u8],
    nonce_c: &[u8],
    job: &[u8],
    round: &[u8],
    connector: &[u8],
    acceptor: &[u8],
    chan: &[u8],
) -> Keys {
    let wire = [me.wire.code()];
    let key = |dir: &[u8]| {
        me.secret.mac(&[
            b"wire", dir, nonce_a, nonce_c, job, round, connector, acceptor, chan, &wire,
        ])
    };
    let (c2a, a2c) = (key(b"c2a"), key(b"a2c"));
    let (send, recv) = if i_am_connector {
        (c2a, a2c)
    } else {
        (a2c, c2a)
    };
    Keys {
        send: Sealer::new(me.wire, send),
        recv: Sealer::new(me.wire, recv),
    }
}

/// The connector's side. Returns the connection's keys, or an error string on any failure or
/// refusal.
pub(crate) fn connect(
    s: &mut TcpStream,
    me: &Identity<'_>,
    target: usize,
    channel: Channel,
    deadline: Instant,
) -> Result<Keys, String> {
    set_deadline(s, deadline)?;
    let mut hello = [0u8; 24];
    read_exact(s, &mut hello, "the acceptor's hello")?;
    if &hello[..8] != MAGIC {
        return Err("the peer is not a rekindle process group (bad magic)".into());
    }
    let nonce_a = &hello[8..24];
    let nonce_c = nonce()?;
    let job = me.job.as_bytes();
    let (round, rank, tgt) = (
        me.round.to_le_bytes(),
        (me.rank as u32).to_le_bytes(),
        (target as u32).to_le_bytes(),
    );
    let chan = [channel as u8];
    let wire = [me.wire.code()];
    let mac = me.secret.mac(&[
        b"client", nonce_a, &nonce_c, job, &round, &rank, &tgt, &chan, &wire,
    ]);
    let mut msg = Vec::with_capacity(8 + 1 + job.len() + 8 + 4 + 4 + 1 + 1 + 16 + 32);
    msg.extend_from_slice(MAGIC);
    msg.push(job.len() as u8);
    msg.extend_from_slice(job);
    msg.extend_from_slice(&round);
    msg.extend_from_slice(&rank);
    msg.extend_from_slice(&tgt);
    msg.extend_from_slice(&chan);
    msg.extend_from_slice(&wire);
    msg.extend_from_slice(&nonce_c);
    msg.extend_from_slice(&mac);
    s.write_all(&msg)
        .map_err(|e| format!("sending the hello: {e}"))?;
    let mut reply = [0u8; 33];
    read_exact(s, &mut reply, "the acceptor's answer")?;
    if reply[0] != 0 {
        let why = Refusal::from_code(reply[0]).map_or("unknown reason", Refusal::describe);
        return Err(format!("refused by rank {target}: {why}"));
    }
    let ok = me.secret.verify(
        &[
            b"server", &nonce_c, nonce_a, job, &round, &tgt, &rank, &chan, &wire,
        ],
        &reply[1..],
    );
    if !ok {
        return Err(format!(
            "the acceptor could not prove it is rank {target} of this job (wrong secret)"
        ));
    }
    s.set_read_timeout(None).ok();
    s.set_write_timeout(None).ok();
    Ok(derive_keys(
        me, true, nonce_a, &nonce_c, job, &round, &rank, &tgt, &chan,
    ))
}

/// The acceptor's side. `is_taken(rank, channel)` says whether that connection already exists.
/// Returns the connector's rank and channel and the connection's keys, or the refusal (after
/// telling the connector).
pub(crate) fn accept(
    s: &mut TcpStream,
    me: &Identity<'_>,
    is_taken: impl Fn(usize, Channel) -> bool,
    deadline: Instant,
) -> Result<(usize, Channel, Keys), String> {
    set_deadline(s, deadline)?;
    let nonce_a = nonce()?;
    let mut hello = [0u8; 24];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..].copy_from_slice(&nonce_a);
    s.write_all(&hello)
        .map_err(|e| format!("sending the hello: {e}"))?;
    let mut head = [0u8; 9];
    read_exact(s, &mut head, "the connector's hello")?;
    let refuse = |s: &mut TcpStream, why: Refusal| {
        let mut reply = [0u8; 33];
        reply[0] = why as u8;
        let _ = s.write_all(&reply);
        Err(why.describe().to_string())
    };
    if &head[..8] != MAGIC {
        return refuse(s, Refusal::BadMagic);
    }
    let mut rest = vec![0u8; head[8] as usize + 8 + 4 + 4 + 1 + 1 + 16 + 32];
    read_exact(s, &mut rest, "the connector's hello")?;
    let (job, rest_) = rest.split_at(head[8] as usize);
    let (round, rest_) = rest_.split_at(8);
    let (rank, rest_) = rest_.split_at(4);
    let (tgt, rest_) = rest_.split_at(4);
    let (chan, rest_) = rest_.split_at(1);
    let (wire, rest_) = rest_.split_at(1);
    let (nonce_c, mac) = rest_.split_at(16);
    if !me.secret.verify(
        &[
            b"client", &nonce_a, nonce_c, job, round, rank, tgt, chan, wire,
        ],
        mac,
    ) {
        return refuse(s, Refusal::BadSecret);
    }
    if wire[0] != me.wire.code() {
        return refuse(s, Refusal::WireMode);
    }
    if job != me.job.as_bytes() {
        return refuse(s, Refusal::WrongJob);
    }
    let round_v = u64::from_le_bytes(round.try_into().unwrap_or([0; 8]));
    if round_v != me.round {
        return refuse(s, Refusal::WrongRound);
    }
    let rank_v = u32::from_le_bytes(rank.try_into().unwrap_or([0xff; 4])) as usize;
    let tgt_v = u32::from_le_bytes(tgt.try_into().unwrap_or([0xff; 4])) as usize;
    if tgt_v != me.rank || rank_v >= me.world || rank_v <= me.rank {
        return refuse(s, Refusal::BadRank);
    }
    let channel = match chan[0] {
        0 => Channel::Data,
        1 => Channel::Control,
        _ => return refuse(s, Refusal::BadMagic),
    };
    if is_taken(rank_v, channel) {
        return refuse(s, Refusal::Duplicate);
    }
    let mut reply = [0u8; 33];
    reply[1..].copy_from_slice(&me.secret.mac(&[
        b"server", nonce_c, &nonce_a, job, round, tgt, rank, chan, wire,
    ]));
    s.write_all(&reply)
        .map_err(|e| format!("sending the answer: {e}"))?;
    s.set_read_timeout(None).ok();
    s.set_write_timeout(None).ok();
    let keys = derive_keys(me, false, &nonce_a, nonce_c, job, round, rank, tgt, chan);
    Ok((rank_v, channel, keys))
}
