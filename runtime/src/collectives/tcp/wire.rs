//! The wire format: what travels on a pair's connections once the handshake is done.
//!
//! ```text
//! data connection, per operation and direction, one lane:
//!   segment 0   the operation header (HEADER_LEN bytes, below)
//!   segment 1.. the operation's items (chunks of the user's buffers), in plan order
//!
//! over TCP every segment is cut into frames of at most FRAME_MAX payload bytes, each sealed:
//!   frame       payload, tag            (see `seal`: a MAC, or AES-256-GCM ciphertext + tag)
//! through a shared-memory ring the segments go unframed, padded to a multiple of 8 bytes
//! (the ring never leaves the host; see `shm`), and the data connection carries only
//! one-byte doorbells.
//!
//! control connection, one sealed frame per message:
//!   kind u8, rank u32 LE, cause u8       (CTRL_LEN bytes), tag
//! ```
//!
//! Frame lengths are not sent: both sides cut the same segments at the same places (a
//! segment's length follows from the header, which both sides must agree on first), so a
//! frame's length is known before its first byte arrives, and every byte a peer sends is
//! either part of an authenticated frame or refused.

/// Bytes of the header that opens every lane.
pub(crate) const HEADER_LEN: usize = 40;
const MAGIC: u32 = 0x524b_444c; // "RKDL"

/// The most payload bytes in one sealed frame on a TCP lane. Frames never straddle
/// segments, so both sides cut them identically.
pub(crate) const FRAME_MAX: usize = 256 << 10;

/// Operation kinds, as sent in [`Header::kind`].
pub(crate) mod kind {
    pub(crate) const ALL_REDUCE: u8 = 1;
    pub(crate) const BROADCAST: u8 = 2;
    pub(crate) const REDUCE: u8 = 3;
    pub(crate) const ALL_GATHER: u8 = 4;
    pub(crate) const REDUCE_SCATTER: u8 = 5;
    pub(crate) const SCATTER: u8 = 6;
    pub(crate) const GATHER: u8 = 7;
    pub(crate) const ALL_TO_ALL: u8 = 8;
    pub(crate) const P2P: u8 = 9;
    pub(crate) const BARRIER: u8 = 10;
}

/// Algorithm codes, as sent in [`Header::algo`].
pub(crate) mod algo {
    pub(crate) const DIRECT: u8 = 1;
    pub(crate) const RING: u8 = 2;
    pub(crate) const CHAIN: u8 = 3;
}

/// The operation name of a header's kind code.
pub(crate) fn kind_name(code: u8) -> &'static str {
    match code {
        kind::ALL_REDUCE => "all_reduce",
        kind::BROADCAST => "broadcast",
        kind::REDUCE => "reduce",
        kind::ALL_GATHER => "all_gather",
        kind::REDUCE_SCATTER => "reduce_scatter",
        kind::SCATTER => "scatter",
        kind::GATHER => "gather",
        kind::ALL_TO_ALL => "all_to_all",
        kind::P2P => "send/recv",
        kind::BARRIER => "barrier",
        _ => "unknown",
    }
}

/// The wire code of a reduction.
pub(crate) fn redop_code(op: crate::collectives::ReduceOp) -> u8 {
    use crate::collectives::ReduceOp;
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Prod => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Avg => 5,
    }
}

/// What an operation tells a peer about itself, so ranks that issued different operations
/// (or sizes, dtypes, roots, chunk sizes) fail with [`crate::Error::Mismatch`] instead of
/// exchanging garbage. Equal headers imply equal segment lengths on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub dtype: u8,
    pub redop: u8,
    pub algo: u8,
    pub seq: u64,
    pub nbytes: u64,
    pub aux: u64,
    /// The chunk size the algorithm cut its items with (0 when it does not chunk).
    pub chunk: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind;
        b[5] = self.dtype;
        b[6] = self.redop;
        b[7] = self.algo;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.nbytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b[32..40].copy_from_slice(&self.chunk.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut m = [0u8; 4];
        m.copy_from_slice(&b[0..4]);
        (u32::from_le_bytes(m) == MAGIC).then(|| Header {
            kind: b[4],
            dtype: b[5],
            redop: b[6],
            algo: b[7],
            seq: u64_at(8),
            nbytes: u64_at(16),
            aux: u64_at(24),
            chunk: u64_at(32),
        })
    }

    /// A one-line description for mismatch errors.
    pub(crate) fn describe(&self) -> String {
        format!(
            "{} (algo {}, dtype code {}, op code {}) of {} bytes, aux {}, chunk {}, seq {}",
            kind_name(self.kind),
            self.algo,
            self.dtype,
            self.redop,
            self.nbytes,
            self.aux,
            self.chunk,
            self.seq
        )
    }
}

/// Why a rank gave up on an operation, as told to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    Lost = 1,
    Timeout = 2,
    Mismatch = 3,
    Other = 4,
}

impl Cause {
    fn from_code(code: u8) -> Cause {
        match code {
            1 => Cause::Lost,
            2 => Cause::Timeout,
            3 => Cause::Mismatch,
            _ => Cause::Other,
        }
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Cause::Lost => "lost",
            Cause::Timeout => "timed out",
            Cause::Mismatch => "out of step",
            Cause::Other => "failed",
        }
    }
}

/// Payload bytes of a control message.
pub(crate) const CTRL_LEN: usize = 6;

/// A control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    /// The sender is alive.
    Heartbeat,
    /// The sender leaves the group in an orderly way.
    Goodbye,
    /// The sender gave up on its operation because `lost` (or itself) failed.
    Abort { lost: Option<usize>, cause: Cause },
}

const CTRL_GOODBYE: u8 = 1;
const CTRL_ABORT: u8 = 2;
const CTRL_HEARTBEAT: u8 = 3;

impl Control {
    pub(crate) fn encode(self) -> [u8; CTRL_LEN] {
        let mut b = [0u8; CTRL_LEN];
        match self {
            Control::Heartbeat => b[0] = CTRL_HEARTBEAT,
            Control::Goodbye => b[0] = CTRL_GOODBYE,
            Control::Abort { lost, cause } => {
                b[0] = CTRL_ABORT;
                b[1..5].copy_from_slice(&lost.map_or(u32::MAX, |p| p as u32).to_le_bytes());
                b[5] = cause as u8;
            }
        }
        b
    }

    /// Decodes an authenticated message; `None` for an unknown kind.
    pub(crate) fn decode(b: &[u8; CTRL_LEN]) -> Option<Control> {
        match b[0] {
            CTRL_HEARTBEAT => Some(Control::Heartbeat),
            CTRL_GOODBYE => Some(Control::Goodbye),
            CTRL_ABORT => {
                let lost = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
                Some(Control::Abort {
                    lost: (lost != u32::MAX).then_some(lost as usize),
                    cause: Cause::from_code(b[5]),
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_control_messages_round_trip() {
        let h = Header {
            kind: kind::ALL_GATHER,
            dtype: 3,
            redop: 0,
            algo: algo::RING,
            seq: u64::MAX - 1,
            nbytes: 1 << 40,
            aux: 7,
            chunk: 256 << 10,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert_eq!(Header::decode(&bad), None);
        for m in [
            Control::Heartbeat,
            Control::Goodbye,
            Control::Abort {
                lost: Some(3),
                cause: Cause::Timeout,
            },
            Control::Abort {
                lost: None,
                cause: Cause::Other,
            },
        ] {
            assert_eq!(Control::decode(&m.encode()), Some(m));
        }
        assert_eq!(Control::decode(&[9, 0, 0, 0, 0, 0]), None);
    }
}
