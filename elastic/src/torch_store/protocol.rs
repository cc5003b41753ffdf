//! PyTorch's TCPStore wire format, as its C++ client (`c10d::TCPStore`) speaks it.
//!
//! A connection starts with `VALIDATE` and the magic number; every later request is a command
//! byte followed by its fields. Integers are in the machine's byte order (little-endian on
//! every platform PyTorch ships for); a key or a value is a `u64` length and its bytes; a list
//! is a `u64` count and its items. Most commands get one response; `SET`, `APPEND`,
//! `MULTI_SET` and `QUEUE_PUSH` get none; `WAIT` and `BARRIER` are answered when they are
//! satisfied (or cancelled with `CANCEL_WAIT`).
//!
//! This module is sans-IO: [`parse`] takes the bytes received so far and returns the first
//! complete command (or asks for more); the encoders append responses to a buffer.

/// The number a client sends with `VALIDATE` as its first message.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The command bytes (`c10d::detail::QueryType`).
pub mod query {
    /// `u32` magic: the first message of every connection. No response.
    pub const VALIDATE: u8 = 0;
    /// key, value. No response.
    pub const SET: u8 = 1;
    /// key, expected, desired. Response: the value now stored.
    pub const COMPARE_SET: u8 = 2;
    /// key. Response: the value (empty when missing).
    pub const GET: u8 = 3;
    /// key, `i64` delta. Response: the new `i64` value.
    pub const ADD: u8 = 4;
    /// keys. Response: `u8` ready (0) or not ready (1).
    pub const CHECK: u8 = 5;
    /// keys. Response: `u8` stop waiting (0) once every key exists.
    pub const WAIT: u8 = 6;
    /// Response: the `i64` number of keys.
    pub const GETNUMKEYS: u8 = 7;
    /// key. Response: the `i64` number of keys deleted.
    pub const DELETE_KEY: u8 = 8;
    /// key, value. No response.
    pub const APPEND: u8 = 9;
    /// keys. Response: one value per key.
    pub const MULTI_GET: u8 = 10;
    /// `u64` count, then key and value pairs. No response.
    pub const MULTI_SET: u8 = 11;
    /// Response: `u8` wait cancelled (1).
    pub const CANCEL_WAIT: u8 = 12;
    /// `u32` nonce. Response: the nonce.
    pub const PING: u8 = 13;
    /// queue name, value. No response.
    pub const QUEUE_PUSH: u8 = 14;
    /// queue name. Response: the `i64` length before the pop, then the value if it was not 0.
    pub const QUEUE_POP: u8 = 15;
    /// queue name. Response: the `i64` length.
    pub const QUEUE_LEN: u8 = 16;
    /// Response: the keys (a count and the keys).
    pub const LIST_KEYS: u8 = 17;
    /// key, `i64` world size. Adds 1 to the counter at key; response `u8` 0 once the counter
    /// is at least the world size.
    pub const BARRIER: u8 = 18;
}

/// `CHECK` answers.
pub mod check {
    /// Every key exists.
    pub const READY: u8 = 0;
    /// At least one key is missing.
    pub const NOT_READY: u8 = 1;
}

/// `WAIT`, `BARRIER` and `CANCEL_WAIT` answers.
pub mod wait {
    /// The wait (or barrier) is satisfied.
    pub const STOP_WAITING: u8 = 0;
    /// The pending wait was cancelled.
    pub const WAIT_CANCELED: u8 = 1;
}

/// Bounds on what one client may send or store. The defaults are those of PyTorch's own
/// server (libuv backend) for lengths and counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// The longest key, in bytes (PyTorch: 8 KiB).
    pub max_key_len: usize,
    /// The largest value, in bytes (PyTorch: 8 MiB).
    pub max_value_len: usize,
    /// The most keys in one `CHECK`, `WAIT`, `MULTI_GET` or `MULTI_SET` (PyTorch: 131072).
    pub max_keys: usize,
    /// The largest single request, in bytes; a connection that sends more without completing
    /// a request is closed.
    pub max_request_len: usize,
    /// The most bytes of keys and values (queues included) the store holds.
    pub max_store_bytes: usize,
    /// The most connections served at once; more are closed as they arrive.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 8 << 10,
            max_value_len: 8 << 20,
            max_keys: 128 << 10,
            max_request_len: 64 << 20,
            max_store_bytes: 512 << 20,
            max_connections: 4096,
        }
    }
}

/// One request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `VALIDATE magic`.
    Validate {
        /// The number sent.
        magic: u32,
    },
    /// `SET key value`.
    Set {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// `COMPARE_SET key expected desired`.
    CompareSet {
        /// The key.
        key: Vec<u8>,
        /// The value the key must hold (empty: the key must be missing).
        expected: Vec<u8>,
        /// The new value.
        desired: Vec<u8>,
    },
    /// `GET key`.
    Get {
        /// The key.
        key: Vec<u8>,
    },
    /// `ADD key delta`.
    Add {
        /// The key (a decimal integer, or missing: 0).
        key: Vec<u8>,
        /// The amount.
        delta: i64,
    },
    /// `CHECK keys`.
    Check {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `WAIT keys`.
    Wait {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `GETNUMKEYS`.
    NumKeys,
    /// `DELETE_KEY key`.
    DeleteKey {
        /// The key.
        key: Vec<u8>,
    },
    /// `APPEND key value`.
    Append {
        /// The key.
        key: Vec<u8>,
        /// The bytes to append.
        value: Vec<u8>,
    },
    /// `MULTI_GET keys`.
    MultiGet {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `MULTI_SET (key value)...`.
    MultiSet {
        /// The pairs.
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// `CANCEL_WAIT`.
    CancelWait,
    /// `PING nonce`.
    Ping {
        /// Echoed back.
        nonce: u32,
    },
    /// `QUEUE_PUSH name value`.
    QueuePush {
        /// The queue.
        key: Vec<u8>,
        /// The item.
        value: Vec<u8>,
    },
    /// `QUEUE_POP name`.
    QueuePop {
        /// The queue.
        key: Vec<u8>,
    },
    /// `QUEUE_LEN name`.
    QueueLen {
        /// The queue.
        key: Vec<u8>,
    },
    /// `LIST_KEYS`.
    ListKeys,
    /// `BARRIER key world_size`.
    Barrier {
        /// The counter.
        key: Vec<u8>,
        /// How many arrivals complete the barrier.
        world_size: i64,
    },
}

/// Why a request could not be parsed. The server closes the connection, as PyTorch's does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// An unknown command byte.
    #[error("unknown command {command}")]
    UnknownCommand {
        /// The byte.
        command: u8,
    },
    /// A key over [`Limits::max_key_len`].
    #[error("a key of {len} bytes (at most {max})")]
    KeyTooLong {
        /// Its length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A value over [`Limits::max_value_len`].
    #[error("a value of {len} bytes (at most {max})")]
    ValueTooLarge {
        /// Its length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A list over [`Limits::max_keys`].
    #[error("{count} keys in one request (at most {max})")]
    TooManyKeys {
        /// The count sent.
        count: u64,
        /// The limit.
        max: usize,
    },
    /// A request longer than [`Limits::max_request_len`].
    #[error("a request of more than {max} bytes")]
    RequestTooLarge {
        /// The limit.
        max: usize,
    },
}

/// Reading ran out of bytes, or found a bad field.
enum Stop {
    More,
    Bad(ProtocolError),
}

impl From<ProtocolError> for Stop {
    fn from(e: ProtocolError) -> Self {
        Stop::Bad(e)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
    /// Only measure: keys and values are skipped, not copied.
    dry: bool,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Stop> {
        let end = self.pos.checked_add(n).ok_or(Stop::More)?;
        if end > self.buf.len() {
            if end > self.limits.max_request_len {
                return Err(Stop::Bad(ProtocolError::RequestTooLarge {
                    max: self.limits.max_request_len,
                }));
            }
            return Err(Stop::More);
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, Stop> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, Stop> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn key(&mut self) -> Result<Vec<u8>, Stop> {
        let len = self.u64()?;
        let max = self.limits.max_key_len;
        if len > max as u64 {
            return Err(ProtocolError::KeyTooLong { len, max }.into());
        }
        self.bytes(len as usize)
    }

    fn value(&mut self) -> Result<Vec<u8>, Stop> {
        let len = self.u64()?;
        let max = self.limits.max_value_len;
        if len > max as u64 {
            return Err(ProtocolError::ValueTooLarge { len, max }.into());
        }
        self.bytes(len as usize)
    }

    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, Stop> {
        let dry = self.dry;
        let b = self.take(n)?;
        Ok(if dry { Vec::new() } else { b.to_vec() })
    }

    fn count(&mut self) -> Result<usize, Stop> {
        let count = self.u64()?;
        let max = self.limits.max_keys;
        if count > max as u64 {
            return Err(ProtocolError::TooManyKeys { count, max }.into());
        }
        Ok(count as usize)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, Stop> {
        let n = self.count()?;
        // Each key takes at least its 8-byte length: do not reserve for a count not yet sent.
        let mut keys = Vec::with_capacity(if self.dry { 0 } else { n });
        for _ in 0..n {
            let k = self.key()?;
            if !self.dry {
                keys.push(k);
            }
        }
        Ok(keys)
    }

    fn command(&mut self) -> Result<Command, Stop> {
        use query::*;
        let cmd = self.u8()?;
        Ok(match cmd {
            VALIDATE => Command::Validate { magic: self.u32()? },
            SET => Command::Set {
                key: self.key()?,
                value: self.value()?,
            },
            COMPARE_SET => Command::CompareSet {
                key: self.key()?,
                expected: self.value()?,
                desired: self.value()?,
            },
            GET => Command::Get { key: self.key()? },
            ADD => Command::Add {
                key: self.key()?,
                delta: self.i64()?,
            },
            CHECK => Command::Check { keys: self.keys()? },
            WAIT => Command::Wait { keys: self.keys()? },
            GETNUMKEYS => Command::NumKeys,
            DELETE_KEY => Command::DeleteKey { key: self.key()? },
            APPEND => Command::Append {
                key: self.key()?,
                value: self.value()?,
            },
            MULTI_GET => Command::MultiGet { keys: self.keys()? },
            MULTI_SET => {
                let n = self.count()?;
                let mut pairs = Vec::with_capacity(if self.dry { 0 } else { n });
                for _ in 0..n {
                    let kv = (self.key()?, self.value()?);
                    if !self.dry {
                        pairs.push(kv);
                    }
                }
                Command::MultiSet { pairs }
            }
            CANCEL_WAIT => Command::CancelWait,
            PING => Command::Ping { nonce: self.u32()? },
            QUEUE_PUSH => Command::QueuePush {
                key: self.key()?,
                value: self.value()?,
            },
            QUEUE_POP => Command::QueuePop { key: self.key()? },
            QUEUE_LEN => Command::QueueLen { key: self.key()? },
            LIST_KEYS => Command::ListKeys,
            BARRIER => Command::Barrier {
                key: self.key()?,
                world_size: self.i64()?,
            },
            command => return Err(ProtocolError::UnknownCommand { command }.into()),
        })
    }
}

/// Parses the first request in `buf`: `Ok(Some((command, bytes used)))`, `Ok(None)` when
/// `buf` holds only part of one, or the reason the stream is unusable.
///
/// A partial request is measured without copying anything, so a large request arriving in
/// many reads costs one walk over its fields per read, and no allocation until it is whole.
pub fn parse(buf: &[u8], limits: &Limits) -> Result<Option<(Command, usize)>, ProtocolError> {
    let run = |dry| {
        let mut r = Reader {
            buf,
            pos: 0,
            limits,
            dry,
        };
        r.command().map(|c| (c, r.pos))
    };
    match run(true).and_then(|_| run(false)) {
        Ok(c) => Ok(Some(c)),
        Err(Stop::More) => Ok(None),
        Err(Stop::Bad(e)) => Err(e),
    }
}

/// Appends a byte string (`u64` length and bytes).
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Appends an `i64`.
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `u64`.
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `u32`.
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The encoding of `cmd`, as PyTorch's client sends it (for tests and tools).
pub fn encode(cmd: &Command) -> Vec<u8> {
    use query::*;
    let mut o = Vec::new();
    let keys = |o: &mut Vec<u8>, keys: &[Vec<u8>]| {
        put_u64(o, keys.len() as u64);
        for k in keys {
            put_bytes(o, k);
        }
    };
    match cmd {
        Command::Validate { magic } => {
            o.push(VALIDATE);
            put_u32(&mut o, *magic);
        }
        Command::Set { key, value } => {
            o.push(SET);
            put_bytes(&mut o, key);
            put_bytes(&mut o, value);
        }
        Command::CompareSet {
            key,
            expected,
            desired,
        } => {
            o.push(COMPARE_SET);
            put_bytes(&mut o, key);
            put_bytes(&mut o, expected);
            put_bytes(&mut o, desired);
        }
        Command::Get { key } => {
            o.push(GET);
            put_bytes(&mut o, key);
        }
        Command::Add { key, delta } => {
            o.push(ADD);
            put_bytes(&mut o, key);
            put_i64(&mut o, *delta);
        }
        Command::Check { keys: k } => {
            o.push(CHECK);
            keys(&mut o, k);
        }
        Command::Wait { keys: k } => {
            o.push(WAIT);
            keys(&mut o, k);
        }
        Command::NumKeys => o.push(GETNUMKEYS),
        Command::DeleteKey { key } => {
            o.push(DELETE_KEY);
            put_bytes(&mut o, key);
        }
        Command::Append { key, value } => {
            o.push(APPEND);
            put_bytes(&mut o, key);
            put_bytes(&mut o, value);
        }
        Command::MultiGet { keys: k } => {
            o.push(MULTI_GET);
            keys(&mut o, k);
        }
        Command::MultiSet { pairs } => {
            o.push(MULTI_SET);
            put_u64(&mut o, pairs.len() as u64);
            for (k, v) in pairs {
                put_bytes(&mut o, k);
                put_bytes(&mut o, v);
            }
        }
        Command::CancelWait => o.push(CANCEL_WAIT),
        Command::Ping { nonce } => {
            o.push(PING);
            put_u32(&mut o, *nonce);
        }
        Command::QueuePush { key, value } => {
            o.push(QUEUE_PUSH);
            put_bytes(&mut o, key);
            put_bytes(&mut o, value);
        }
        Command::QueuePop { key } => {
            o.push(QUEUE_POP);
            put_bytes(&mut o, key);
        }
        Command::QueueLen { key } => {
            o.push(QUEUE_LEN);
            put_bytes(&mut o, key);
        }
        Command::ListKeys => o.push(LIST_KEYS),
        Command::Barrier { key, world_size } => {
            o.push(BARRIER);
            put_bytes(&mut o, key);
            put_i64(&mut o, *world_size);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn every_command() -> Vec<Command> {
        vec![
            Command::Validate {
                magic: VALIDATION_MAGIC,
            },
            Command::Set {
                key: k("/a"),
                value: k("v"),
            },
            Command::CompareSet {
                key: k("/a"),
                expected: vec![],
                desired: k("w"),
            },
            Command::Get { key: k("/a") },
            Command::Add {
                key: k("/n"),
                delta: -3,
            },
            Command::Check {
                keys: vec![k("/a"), k("/b")],
            },
            Command::Wait {
                keys: vec![k("/a")],
            },
            Command::NumKeys,
            Command::DeleteKey { key: k("/a") },
            Command::Append {
                key: k("/a"),
                value: k("x"),
            },
            Command::MultiGet {
                keys: vec![k("/a"), k("")],
            },
            Command::MultiSet {
                pairs: vec![(k("/a"), k("1")), (k("/b"), vec![])],
            },
            Command::CancelWait,
            Command::Ping { nonce: 0xdead_beef },
            Command::QueuePush {
                key: k("/q"),
                value: k("z"),
            },
            Command::QueuePop { key: k("/q") },
            Command::QueueLen { key: k("/q") },
            Command::ListKeys,
            Command::Barrier {
                key: k("/b"),
                world_size: 4,
            },
        ]
    }

    #[test]
    fn every_command_round_trips_and_needs_all_its_bytes() {
        let limits = Limits::default();
        for cmd in every_command() {
            let bytes = encode(&cmd);
            assert_eq!(parse(&bytes, &limits), Ok(Some((cmd.clone(), bytes.len()))));
            for cut in 0..bytes.len() {
                assert_eq!(
                    parse(&bytes[..cut], &limits),
                    Ok(None),
                    "{cmd:?} cut at {cut}"
                );
            }
            let mut two = bytes.clone();
            two.extend_from_slice(&bytes);
            assert_eq!(parse(&two, &limits), Ok(Some((cmd, bytes.len()))));
        }
    }

    #[test]
    fn bytes_match_pytorchs_client() {
        // Captured from torch 2.15's TCPStore client: connect (validate and ping), set("k", "v"),
        // add("n", 5), barrier("bb", 2) (its keys carry the client's "/" prefix).
        let limits = Limits::default();
        let cases: &[(&str, Command)] = &[
            (
                "00cef7853c",
                Command::Validate {
                    magic: VALIDATION_MAGIC,
                },
            ),
            ("0d6a480000", Command::Ping { nonce: 0x486a }),
            (
                "0102000000000000002f6b010000000000000076",
                Command::Set {
                    key: k("/k"),
                    value: k("v"),
                },
            ),
            (
                "0402000000000000002f6e0500000000000000",
                Command::Add {
                    key: k("/n"),
                    delta: 5,
                },
            ),
            (
                "1203000000000000002f62620200000000000000",
                Command::Barrier {
                    key: k("/bb"),
                    world_size: 2,
                },
            ),
        ];
        for (hex, cmd) in cases {
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            assert_eq!(parse(&bytes, &limits), Ok(Some((cmd.clone(), bytes.len()))));
            assert_eq!(encode(cmd), bytes);
        }
    }

    #[test]
    fn limits_are_typed_errors() {
        let limits = Limits {
            max_key_len: 4,
            max_value_len: 8,
            max_keys: 2,
            max_request_len: 64,
            ..Limits::default()
        };
        let long_key = encode(&Command::Get { key: k("/abcd") });
        assert_eq!(
            parse(&long_key, &limits),
            Err(ProtocolError::KeyTooLong { len: 5, max: 4 })
        );
        let big = encode(&Command::Set {
            key: k("/a"),
            value: vec![0; 9],
        });
        assert_eq!(
            parse(&big, &limits),
            Err(ProtocolError::ValueTooLarge { len: 9, max: 8 })
        );
        let many = encode(&Command::Wait {
            keys: vec![k("a"), k("b"), k("c")],
        });
        assert_eq!(
            parse(&many, &limits),
            Err(ProtocolError::TooManyKeys { count: 3, max: 2 })
        );
        // A count far beyond what was sent is refused before anything is allocated for it.
        let mut huge = vec![query::MULTI_GET];
        put_u64(&mut huge, u64::MAX);
        assert!(matches!(
            parse(&huge, &Limits::default()),
            Err(ProtocolError::TooManyKeys { .. })
        ));
        // A request that cannot complete within max_request_len.
        let mut set = vec![query::SET];
        put_bytes(&mut set, b"/a");
        put_u64(&mut set, 8);
        let limits = Limits {
            max_request_len: set.len() + 4,
            ..Limits::default()
        };
        assert_eq!(
            parse(&set, &limits),
            Err(ProtocolError::RequestTooLarge { max: set.len() + 4 })
        );
        assert_eq!(
            parse(&[99], &Limits::default()),
            Err(ProtocolError::UnknownCommand { command: 99 })
        );
    }
}
