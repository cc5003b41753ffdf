//! The messages between workers and servers: a fixed header of [`HEADER_LEN`] `f32` slots
//! (integers travel as bit patterns, which the transport moves unchanged), then the shard's
//! elements: a push carries gradients (each worker's already multiplied by its sample count),
//! a reply the shard's parameters after the update. Every message of a worker-server pair
//! has the same length, as the transport requires of a send and its receive.

/// Slots of the header.
pub const HEADER_LEN: usize = 13;

const MAGIC: u32 = 0x5053_0001;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Worker to server: gradients.
    Push = 1,
    /// Server to worker: parameters.
    Reply = 2,
    /// Server to the server keeping its copy: an update to apply to the copy.
    Forward = 3,
}

/// The push's update was not applied: it was more than the bound's versions stale. The
/// reply carries fresh parameters; the worker computes the same batch again from them.
pub const REFUSED: u32 = 1;
/// The push's ticket was applied to this shard already (before the group re-formed); the
/// reply carries the parameters, nothing was applied.
pub const DUPLICATE: u32 = 2;
/// The sender got a termination signal: the job stops at the next agreed step.
pub const STOP: u32 = 4;

/// No stop step agreed.
pub const NO_STOP: u64 = u64::MAX;

/// The header of every message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Header {
    /// What the message is.
    pub kind: Kind,
    /// [`REFUSED`], [`DUPLICATE`], [`STOP`].
    pub flags: u32,
    /// The step (synchronous) or ticket (asynchronous) it belongs to.
    pub ticket: u64,
    /// Push: the version of the parameters the gradients were computed from. Reply: the
    /// shard's version after it. Forward: the version the update makes.
    pub version: u64,
    /// Reply from server 0 (asynchronous): the worker's next ticket.
    pub next: u64,
    /// The samples the gradients are over (reply, synchronous: of the whole step).
    pub samples: u32,
    /// The mean loss over those samples (NaN when none was reported).
    pub loss: f32,
    /// The step at which every rank stops ([`NO_STOP`] while none is agreed).
    pub stop_at: u64,
}

/// Why a message does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than a header.
    #[error("a message of {len} elements is shorter than the {HEADER_LEN}-element header")]
    Short {
        /// Its length.
        len: usize,
    },
    /// Not a parameter-server message.
    #[error("bad magic {found:#x}")]
    Magic {
        /// The first slot's bits.
        found: u32,
    },
    /// An unknown kind.
    #[error("unknown message kind {kind}")]
    Kind {
        /// The kind.
        kind: u32,
    },
}

fn put_u64(buf: &mut [f32], at: usize, v: u64) {
    buf[at] = f32::from_bits(v as u32);
    buf[at + 1] = f32::from_bits((v >> 32) as u32);
}

fn get_u64(buf: &[f32], at: usize) -> u64 {
    u64::from(buf[at].to_bits()) | (u64::from(buf[at + 1].to_bits()) << 32)
}

impl Header {
    /// A header of `kind` for `ticket`, everything else empty.
    pub fn new(kind: Kind, ticket: u64) -> Header {
        Header {
            kind,
            flags: 0,
            ticket,
            version: 0,
            next: 0,
            samples: 0,
            loss: f32::NAN,
            stop_at: NO_STOP,
        }
    }

    /// Writes the header into the first [`HEADER_LEN`] slots of `buf` (which must be at
    /// least that long).
    pub fn write(&self, buf: &mut [f32]) {
        buf[0] = f32::from_bits(MAGIC);
        buf[1] = f32::from_bits(self.kind as u32);
        buf[2] = f32::from_bits(self.flags);
        put_u64(buf, 3, self.ticket);
        put_u64(buf, 5, self.version);
        put_u64(buf, 7, self.next);
        buf[9] = f32::from_bits(self.samples);
        buf[10] = self.loss;
        put_u64(buf, 11, self.stop_at);
    }

    /// Reads a header.
    pub fn read(buf: &[f32]) -> Result<Header, WireError> {
        if buf.len() < HEADER_LEN {
            return Err(WireError::Short { len: buf.len() });
        }
        let magic = buf[0].to_bits();
        if magic != MAGIC {
            return Err(WireError::Magic { found: magic });
        }
        let kind = match buf[1].to_bits() {
            1 => Kind::Push,
            2 => Kind::Reply,
            3 => Kind::Forward,
            kind => return Err(WireError::Kind { kind }),
        };
        Ok(Header {
            kind,
            flags: buf[2].to_bits(),
            ticket: get_u64(buf, 3),
            version: get_u64(buf, 5),
            next: get_u64(buf, 7),
            samples: buf[9].to_bits(),
            loss: buf[10],
            stop_at: get_u64(buf, 11),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let cases = [
            Header::new(Kind::Push, 0),
            Header {
                kind: Kind::Reply,
                flags: REFUSED | STOP,
                ticket: u64::MAX - 1,
                version: 1 << 40,
                next: 123_456_789_012,
                samples: 512,
                loss: 2.25,
                stop_at: 77,
            },
            Header {
                kind: Kind::Forward,
                flags: DUPLICATE,
                ticket: 3,
                version: 4,
                next: 0,
                samples: u32::MAX,
                loss: -0.0,
                stop_at: NO_STOP,
            },
        ];
        for h in cases {
            let mut buf = vec![0.0f32; HEADER_LEN + 3];
            h.write(&mut buf);
            let back = Header::read(&buf).unwrap();
            assert_eq!(back.kind, h.kind);
            assert_eq!(back.flags, h.flags);
            assert_eq!(back.ticket, h.ticket);
            assert_eq!(back.version, h.version);
            assert_eq!(back.next, h.next);
            assert_eq!(back.samples, h.samples);
            assert_eq!(back.loss.to_bits(), h.loss.to_bits());
            assert_eq!(back.stop_at, h.stop_at);
        }
        assert_eq!(Header::read(&[0.0; 3]), Err(WireError::Short { len: 3 }));
        assert!(matches!(
            Header::read(&[1.0; HEADER_LEN]),
            Err(WireError::Magic { .. })
        ));
        let mut buf = vec![0.0f32; HEADER_LEN];
        Header::new(Kind::Push, 1).write(&mut buf);
        buf[1] = f32::from_bits(9);
        assert_eq!(Header::read(&buf), Err(WireError::Kind { kind: 9 }));
    }
}
