//! The store itself, without I/O: keys, queues, and who waits for what. [`StoreState::apply`]
//! takes one parsed request of one connection and returns the bytes to send, to that
//! connection and to the connections whose wait it satisfied.
//!
//! Semantics follow PyTorch's server: a missing key reads as empty; `ADD` and `BARRIER` keep a
//! decimal counter; a `WAIT` is answered once every key exists (or its queue is not empty); a
//! `BARRIER` adds one arrival and is answered once the counter reaches its world size; a queue
//! push releases one waiter. Unlike PyTorch's server, a `COMPARE_SET` that changes nothing
//! releases no waiter.

use std::collections::{HashMap, HashSet, VecDeque};

use super::protocol::{
    check, put_bytes, put_i64, put_u32, put_u64, wait, Command, Limits, VALIDATION_MAGIC,
};

/// A connection's number, unique for the life of a server.
pub type ConnId = u64;

/// Why a connection must be closed. PyTorch's server closes it too, and its client reports a
/// closed connection to the program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    /// The first request was not `VALIDATE` with the magic number (not a PyTorch client).
    #[error("not a PyTorch TCPStore client (first request {first:?})")]
    NotValidated {
        /// What was sent first, shortened.
        first: String,
    },
    /// `ADD` or `BARRIER` on a key that does not hold a decimal integer, or an overflow.
    #[error("key {key:?} does not hold a counter that can take {delta:+}")]
    NotACounter {
        /// The key.
        key: String,
        /// The amount.
        delta: i64,
    },
    /// The store would exceed [`Limits::max_store_bytes`].
    #[error("the store is full ({held} of {max} bytes held; the request needs {more} more)")]
    Full {
        /// Bytes held.
        held: usize,
        /// The limit.
        max: usize,
        /// What the request adds.
        more: usize,
    },
}

/// What a connection is blocked on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pending {
    /// A `WAIT`: this many of its keys are still missing.
    Keys(usize),
    /// A `BARRIER` on this key with this world size.
    Barrier(Vec<u8>, i64),
}

/// The keys, queues and waiters of one server.
#[derive(Debug)]
pub struct StoreState {
    limits: Limits,
    map: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Bytes of keys and values held (queues included).
    held: usize,
    validated: HashSet<ConnId>,
    pending: HashMap<ConnId, Pending>,
    /// Missing key -> connections whose `WAIT` counts it, in arrival order.
    key_waiters: HashMap<Vec<u8>, Vec<ConnId>>,
    /// Barrier key -> connections waiting on it.
    barrier_waiters: HashMap<Vec<u8>, Vec<ConnId>>,
}

/// The bytes a request produced, per connection, in order.
pub type Replies = Vec<(ConnId, Vec<u8>)>;

fn show(key: &[u8]) -> String {
    String::from_utf8_lossy(&key[..key.len().min(64)]).into_owned()
}

fn counter(v: Option<&Vec<u8>>) -> Option<i64> {
    match v {
        None => Some(0),
        Some(v) => std::str::from_utf8(v).ok()?.trim().parse().ok(),
    }
}

impl StoreState {
    /// An empty store.
    pub fn new(limits: Limits) -> Self {
        StoreState {
            limits,
            map: HashMap::new(),
            queues: HashMap::new(),
            held: 0,
            validated: HashSet::new(),
            pending: HashMap::new(),
            key_waiters: HashMap::new(),
            barrier_waiters: HashMap::new(),
        }
    }

    /// Bytes of keys and values held.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Number of keys (queues not counted).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True if no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Forgets a closed connection and whatever it waited for.
    pub fn disconnect(&mut self, conn: ConnId) {
        self.validated.remove(&conn);
        self.clear_pending(conn);
    }

    /// Applies `cmd` from `conn`; the replies go to `out`. A [`Fault`] means: close `conn`
    /// (the store is unchanged by the faulty request).
    pub fn apply(&mut self, conn: ConnId, cmd: Command, out: &mut Replies) -> Result<(), Fault> {
        if !self.validated.contains(&conn) {
            return match cmd {
                Command::Validate {
                    magic: VALIDATION_MAGIC,
                } => {
                    self.validated.insert(conn);
                    Ok(())
                }
                other => {
                    let mut first = format!("{other:?}");
                    first.truncate(80);
                    Err(Fault::NotValidated { first })
                }
            };
        }
        let mut reply = Vec::new();
        match cmd {
            // A second VALIDATE is harmless; PyTorch's server ignores it too.
            Command::Validate { .. } => {}
            Command::Set { key, value } => self.set(key, value, out)?,
            Command::CompareSet {
                key,
                expected,
                desired,
            } => {
                let now = match self.map.get(&key) {
                    None if expected.is_empty() => {
                        self.set(key, desired.clone(), out)?;
                        desired
                    }
                    // PyTorch answers with the expected value when the key is missing.
                    None => expected,
                    Some(cur) if *cur == expected => {
                        self.set(key, desired.clone(), out)?;
                        desired
                    }
                    Some(cur) => cur.clone(),
                };
                put_bytes(&mut reply, &now);
            }
            Command::Get { key } => {
                put_bytes(&mut reply, self.map.get(&key).map_or(&[][..], |v| v));
            }
            Command::Add { key, delta } => {
                let v = self.add(key, delta, out)?;
                put_i64(&mut reply, v);
            }
            Command::Check { keys } => {
                let ready = keys.iter().all(|k| self.present(k));
                reply.push(if ready {
                    check::READY
                } else {
                    check::NOT_READY
                });
            }
            Command::Wait { keys } => {
                self.clear_pending(conn);
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.present(k)).collect();
                if missing.is_empty() {
                    reply.push(wait::STOP_WAITING);
                } else {
                    self.pending.insert(conn, Pending::Keys(missing.len()));
                    for k in missing {
                        self.key_waiters.entry(k).or_default().push(conn);
                    }
                }
            }
            Command::NumKeys => put_i64(&mut reply, self.map.len() as i64),
            Command::DeleteKey { key } => {
                let n = match self.map.remove(&key) {
                    Some(v) => {
                        self.held -= key.len() + v.len();
                        1
                    }
                    None => 0,
                };
                put_i64(&mut reply, n);
            }
            Command::Append { key, value } => {
                let mut v = self.map.get(&key).cloned().unwrap_or_default();
                v.extend_from_slice(&value);
                self.set(key, v, out)?;
            }
            Command::MultiGet { keys } => {
                for k in &keys {
                    put_bytes(&mut reply, self.map.get(k).map_or(&[][..], |v| v));
                }
            }
            Command::MultiSet { pairs } => {
                let more: usize = pairs.iter().map(|(k, v)| k.len() + v.len()).sum();
                self.room_for(more)?;
                for (k, v) in pairs {
                    self.set(k, v, out)?;
                }
            }
            Command::CancelWait => {
                self.clear_pending(conn);
                reply.push(wait::WAIT_CANCELED);
            }
            Command::Ping { nonce } => put_u32(&mut reply, nonce),
            Command::QueuePush { key, value } => {
                self.room_for(key.len() + value.len())?;
                self.held += key.len() + value.len();
                self.queues.entry(key.clone()).or_default().push_back(value);
                self.release_one(&key, out);
            }
            Command::QueuePop { key } => {
                let q = self.queues.get_mut(&key);
                let len = q.as_ref().map_or(0, |q| q.len());
                put_i64(&mut reply, len as i64);
                if let Some(v) = q.and_then(|q| q.pop_front()) {
                    self.held -= key.len() + v.len();
                    put_bytes(&mut reply, &v);
                }
                if self.queues.get(&key).is_some_and(|q| q.is_empty()) {
                    self.queues.remove(&key);
                }
            }
            Command::QueueLen { key } => {
                put_i64(
                    &mut reply,
                    self.queues.get(&key).map_or(0, |q| q.len()) as i64,
                );
            }
            Command::ListKeys => {
                put_u64(&mut reply, self.map.len() as u64);
                for k in self.map.keys() {
                    put_bytes(&mut reply, k);
                }
            }
            Command::Barrier { key, world_size } => {
                self.clear_pending(conn);
                let arrived = self.add(key.clone(), 1, out)?;
                if arrived >= world_size {
                    reply.push(wait::STOP_WAITING);
                } else {
                    self.pending
                        .insert(conn, Pending::Barrier(key.clone(), world_size));
                    self.barrier_waiters.entry(key).or_default().push(conn);
                }
            }
        }
        if !reply.is_empty() {
            out.push((conn, reply));
        }
        Ok(())
    }

    /// True if `key` exists or names a queue with items.
    fn present(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn room_for(&self, more: usize) -> Result<(), Fault> {
        if self.held + more > self.limits.max_store_bytes {
            return Err(Fault::Full {
                held: self.held,
                max: self.limits.max_store_bytes,
                more,
            });
        }
        Ok(())
    }

    fn set(&mut self, key: Vec<u8>, value: Vec<u8>, out: &mut Replies) -> Result<(), Fault> {
        let old = self.map.get(&key).map_or(0, |v| key.len() + v.len());
        let new = key.len() + value.len();
        if new > old {
            self.room_for(new - old)?;
        }
        self.held = self.held + new - old;
        self.map.insert(key.clone(), value);
        self.changed(&key, out);
        Ok(())
    }

    fn add(&mut self, key: Vec<u8>, delta: i64, out: &mut Replies) -> Result<i64, Fault> {
        let v = counter(self.map.get(&key))
            .and_then(|old| old.checked_add(delta))
            .ok_or_else(|| Fault::NotACounter {
                key: show(&key),
                delta,
            })?;
        self.set(key, v.to_string().into_bytes(), out)?;
        Ok(v)
    }

    /// `key` was written: every `WAIT` counting it has one key fewer to wait for, and barriers
    /// on it look at the new count.
    fn changed(&mut self, key: &[u8], out: &mut Replies) {
        if let Some(conns) = self.key_waiters.remove(key) {
            for c in conns {
                self.one_key_arrived(c, out);
            }
        }
        if self.barrier_waiters.contains_key(key) {
            let arrived = counter(self.map.get(key));
            let waiters = self.barrier_waiters.remove(key).unwrap_or_default();
            let mut still = Vec::new();
            for c in waiters {
                let done = match (self.pending.get(&c), arrived) {
                    (Some(Pending::Barrier(_, world)), Some(n)) => n >= *world,
                    (Some(Pending::Barrier(..)), None) => false,
                    // Not waiting on this barrier any more.
                    _ => continue,
                };
                if done {
                    self.pending.remove(&c);
                    out.push((c, vec![wait::STOP_WAITING]));
                } else {
                    still.push(c);
                }
            }
            if !still.is_empty() {
                self.barrier_waiters.insert(key.to_vec(), still);
            }
        }
    }

    /// An item was pushed to queue `key`: the first connection waiting on it is released from
    /// that key (and answered if it was its last).
    fn release_one(&mut self, key: &[u8], out: &mut Replies) {
        let Some(conns) = self.key_waiters.get_mut(key) else {
            return;
        };
        let first = conns.remove(0);
        if conns.is_empty() {
            self.key_waiters.remove(key);
        }
        self.one_key_arrived(first, out);
    }

    fn one_key_arrived(&mut self, conn: ConnId, out: &mut Replies) {
        if let Some(Pending::Keys(n)) = self.pending.get_mut(&conn) {
            *n -= 1;
            if *n == 0 {
                self.pending.remove(&conn);
                out.push((conn, vec![wait::STOP_WAITING]));
            }
        }
    }

    fn clear_pending(&mut self, conn: ConnId) {
        match self.pending.remove(&conn) {
            None => {}
            Some(Pending::Keys(_)) => self.key_waiters.retain(|_, conns| {
                conns.retain(|c| *c != conn);
                !conns.is_empty()
            }),
            Some(Pending::Barrier(key, _)) => {
                if let Some(conns) = self.barrier_waiters.get_mut(&key) {
                    conns.retain(|c| *c != conn);
                    if conns.is_empty() {
                        self.barrier_waiters.remove(&key);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn store() -> StoreState {
        StoreState::new(Limits::default())
    }

    /// Applies `cmd` for `conn` (validating it first if needed) and returns the replies.
    fn run(s: &mut StoreState, conn: ConnId, cmd: Command) -> Replies {
        let mut out = Vec::new();
        if !s.validated.contains(&conn) {
            s.apply(
                conn,
                Command::Validate {
                    magic: VALIDATION_MAGIC,
                },
                &mut out,
            )
            .unwrap();
        }
        s.apply(conn, cmd, &mut out).unwrap();
        out
    }

    fn bytes(b: &[u8]) -> Vec<u8> {
        let mut o = Vec::new();
        put_bytes(&mut o, b);
        o
    }

    fn i64b(v: i64) -> Vec<u8> {
        v.to_le_bytes().to_vec()
    }

    #[test]
    fn the_first_request_must_validate() {
        let mut s = store();
        let mut out = Vec::new();
        let e = s.apply(1, Command::Get { key: k("/a") }, &mut out);
        assert!(matches!(e, Err(Fault::NotValidated { .. })), "{e:?}");
        let e = s.apply(2, Command::Validate { magic: 7 }, &mut out);
        assert!(matches!(e, Err(Fault::NotValidated { .. })), "{e:?}");
        assert!(out.is_empty());
    }

    #[test]
    fn requests_and_their_answers() {
        let mut s = store();
        let c = 1;
        // (request, expected reply; None for no reply)
        let table: Vec<(Command, Option<Vec<u8>>)> = vec![
            (Command::Get { key: k("/a") }, Some(bytes(b""))),
            (
                Command::Set {
                    key: k("/a"),
                    value: k("v"),
                },
                None,
            ),
            (Command::Get { key: k("/a") }, Some(bytes(b"v"))),
            (
                Command::Append {
                    key: k("/a"),
                    value: k("w"),
                },
                None,
            ),
            (Command::Get { key: k("/a") }, Some(bytes(b"vw"))),
            (
                Command::Add {
                    key: k("/n"),
                    delta: 5,
                },
                Some(i64b(5)),
            ),
            (
                Command::Add {
                    key: k("/n"),
                    delta: -7,
                },
                Some(i64b(-2)),
            ),
            (Command::Get { key: k("/n") }, Some(bytes(b"-2"))),
            (
                Command::CompareSet {
                    key: k("/a"),
                    expected: k("vw"),
                    desired: k("x"),
                },
                Some(bytes(b"x")),
            ),
            (
                Command::CompareSet {
                    key: k("/a"),
                    expected: k("nope"),
                    desired: k("y"),
                },
                Some(bytes(b"x")),
            ),
            (
                Command::CompareSet {
                    key: k("/missing"),
                    expected: k("e"),
                    desired: k("y"),
                },
                Some(bytes(b"e")),
            ),
            (
                Command::CompareSet {
                    key: k("/new"),
                    expected: vec![],
                    desired: k("y"),
                },
                Some(bytes(b"y")),
            ),
            (
                Command::Check {
                    keys: vec![k("/a"), k("/new")],
                },
                Some(vec![check::READY]),
            ),
            (
                Command::Check {
                    keys: vec![k("/a"), k("/zz")],
                },
                Some(vec![check::NOT_READY]),
            ),
            (Command::NumKeys, Some(i64b(3))),
            (Command::DeleteKey { key: k("/new") }, Some(i64b(1))),
            (Command::DeleteKey { key: k("/new") }, Some(i64b(0))),
            (
                Command::MultiSet {
                    pairs: vec![(k("/p"), k("1")), (k("/q"), k("2"))],
                },
                None,
            ),
            (
                Command::MultiGet {
                    keys: vec![k("/q"), k("/none"), k("/p")],
                },
                Some([bytes(b"2"), bytes(b""), bytes(b"1")].concat()),
            ),
            (
                Command::Ping { nonce: 42 },
                Some(42u32.to_le_bytes().to_vec()),
            ),
            (Command::QueueLen { key: k("/Q") }, Some(i64b(0))),
            (
                Command::QueuePush {
                    key: k("/Q"),
                    value: k("i1"),
                },
                None,
            ),
            (
                Command::QueuePush {
                    key: k("/Q"),
                    value: k("i2"),
                },
                None,
            ),
            (Command::QueueLen { key: k("/Q") }, Some(i64b(2))),
            (
                Command::QueuePop { key: k("/Q") },
                Some([i64b(2), bytes(b"i1")].concat()),
            ),
            (
                Command::QueuePop { key: k("/Q") },
                Some([i64b(1), bytes(b"i2")].concat()),
            ),
            (Command::QueuePop { key: k("/Q") }, Some(i64b(0))),
            (Command::CancelWait, Some(vec![wait::WAIT_CANCELED])),
        ];
        for (i, (cmd, want)) in table.into_iter().enumerate() {
            let got = run(&mut s, c, cmd.clone());
            let want: Replies = want.into_iter().map(|w| (c, w)).collect();
            assert_eq!(got, want, "step {i}: {cmd:?}");
        }
        // The bytes held are exactly the keys and values present.
        let held: usize = [("/a", "x"), ("/n", "-2"), ("/p", "1"), ("/q", "2")]
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum();
        assert_eq!(s.held_bytes(), held);
        let listed = run(&mut s, c, Command::ListKeys);
        assert_eq!(listed[0].1[..8], 4u64.to_le_bytes());
        assert_eq!(listed[0].1.len(), 8 + 4 * (8 + 2));
    }

    #[test]
    fn a_wait_is_answered_when_its_last_key_arrives() {
        let mut s = store();
        let (a, b) = (1, 2);
        assert!(run(
            &mut s,
            a,
            Command::Wait {
                keys: vec![k("/x"), k("/y")]
            }
        )
        .is_empty());
        assert!(run(
            &mut s,
            b,
            Command::Set {
                key: k("/x"),
                value: k("1")
            }
        )
        .is_empty());
        // A second write of the same key does not count twice.
        assert!(run(
            &mut s,
            b,
            Command::Set {
                key: k("/x"),
                value: k("2")
            }
        )
        .is_empty());
        let out = run(
            &mut s,
            b,
            Command::Add {
                key: k("/y"),
                delta: 1,
            },
        );
        assert_eq!(out, vec![(a, vec![wait::STOP_WAITING]), (b, i64b(1))]);
        // Present keys answer at once.
        let out = run(
            &mut s,
            a,
            Command::Wait {
                keys: vec![k("/x")],
            },
        );
        assert_eq!(out, vec![(a, vec![wait::STOP_WAITING])]);
    }

    #[test]
    fn a_cancelled_or_disconnected_wait_is_forgotten() {
        let mut s = store();
        run(
            &mut s,
            1,
            Command::Wait {
                keys: vec![k("/x")],
            },
        );
        run(
            &mut s,
            2,
            Command::Wait {
                keys: vec![k("/x")],
            },
        );
        assert_eq!(
            run(&mut s, 1, Command::CancelWait),
            vec![(1, vec![wait::WAIT_CANCELED])]
        );
        s.disconnect(2);
        let out = run(
            &mut s,
            3,
            Command::Set {
                key: k("/x"),
                value: vec![],
            },
        );
        assert!(out.is_empty(), "{out:?}");
        assert!(s.key_waiters.is_empty() && s.pending.is_empty());
    }

    #[test]
    fn barriers_release_everyone_at_the_world_size() {
        let mut s = store();
        assert!(run(
            &mut s,
            1,
            Command::Barrier {
                key: k("/b"),
                world_size: 3
            }
        )
        .is_empty());
        assert!(run(
            &mut s,
            2,
            Command::Barrier {
                key: k("/b"),
                world_size: 3
            }
        )
        .is_empty());
        let out = run(
            &mut s,
            3,
            Command::Barrier {
                key: k("/b"),
                world_size: 3,
            },
        );
        let mut released: Vec<ConnId> = out.iter().map(|(c, _)| *c).collect();
        released.sort();
        assert_eq!(released, vec![1, 2, 3]);
        assert!(out.iter().all(|(_, b)| b == &vec![wait::STOP_WAITING]));
        // The counter stays (PyTorch keeps it too): a later barrier of the same size on the
        // same key passes at once.
        assert_eq!(
            run(&mut s, 1, Command::Get { key: k("/b") }),
            vec![(1, bytes(b"3"))]
        );
        // A set that brings the counter up also releases.
        run(
            &mut s,
            4,
            Command::Barrier {
                key: k("/c"),
                world_size: 10,
            },
        );
        let out = run(
            &mut s,
            5,
            Command::Set {
                key: k("/c"),
                value: k("10"),
            },
        );
        assert_eq!(out, vec![(4, vec![wait::STOP_WAITING])]);
    }

    #[test]
    fn a_queue_push_releases_one_waiter() {
        let mut s = store();
        run(
            &mut s,
            1,
            Command::Wait {
                keys: vec![k("/q")],
            },
        );
        run(
            &mut s,
            2,
            Command::Wait {
                keys: vec![k("/q")],
            },
        );
        let out = run(
            &mut s,
            3,
            Command::QueuePush {
                key: k("/q"),
                value: k("a"),
            },
        );
        assert_eq!(out, vec![(1, vec![wait::STOP_WAITING])]);
        let out = run(
            &mut s,
            3,
            Command::QueuePush {
                key: k("/q"),
                value: k("b"),
            },
        );
        assert_eq!(out, vec![(2, vec![wait::STOP_WAITING])]);
        // A non-empty queue satisfies a wait at once.
        let out = run(
            &mut s,
            4,
            Command::Wait {
                keys: vec![k("/q")],
            },
        );
        assert_eq!(out, vec![(4, vec![wait::STOP_WAITING])]);
    }

    #[test]
    fn bad_counters_and_a_full_store_are_faults_that_change_nothing() {
        let mut s = StoreState::new(Limits {
            max_store_bytes: 16,
            ..Limits::default()
        });
        run(
            &mut s,
            1,
            Command::Set {
                key: k("/t"),
                value: k("abc"),
            },
        );
        let mut out = Vec::new();
        let e = s.apply(
            1,
            Command::Add {
                key: k("/t"),
                delta: 1,
            },
            &mut out,
        );
        assert!(matches!(e, Err(Fault::NotACounter { .. })), "{e:?}");
        let e = s.apply(
            1,
            Command::Barrier {
                key: k("/t"),
                world_size: 2,
            },
            &mut out,
        );
        assert!(matches!(e, Err(Fault::NotACounter { .. })), "{e:?}");
        run(
            &mut s,
            1,
            Command::Set {
                key: k("/m"),
                value: i64::MAX.to_string().into_bytes()[..2].to_vec(),
            },
        );
        let e = s.apply(
            1,
            Command::Set {
                key: k("/big"),
                value: vec![0; 16],
            },
            &mut out,
        );
        assert_eq!(
            e,
            Err(Fault::Full {
                held: 9,
                max: 16,
                more: 20
            })
        );
        let e = s.apply(
            1,
            Command::MultiSet {
                pairs: vec![(k("/1"), k("12345")), (k("/2"), k("12345"))],
            },
            &mut out,
        );
        assert!(matches!(e, Err(Fault::Full { .. })), "{e:?}");
        assert!(out.is_empty());
        assert_eq!(s.len(), 2);
        assert_eq!(s.held_bytes(), 9);
    }
}
