//! The embedded store's wire format.
//!
//! Every message is a frame: a big-endian `u32` length, that many bytes of body, and the frame's
//! MAC (see [`super::auth`], which also describes the handshake before the first frame). A
//! request body is
//! `u64 id`, `u8 op`, then the op's fields; a response body is `u64 id`, `u8 status`, then the
//! payload. Strings and byte strings are a big-endian `u32` length and the bytes. Requests on
//! one connection are independent: the server answers each as soon as it is done, so a long
//! `wait` does not hold up a `set` sent after it, and the id pairs answers with requests.

use rekindle_runtime::store::{CasOutcome, StoreError};

/// The largest frame body either side accepts by default (16 MiB): the job's keys are
/// addresses, ids and small records, so bigger frames mean a corrupt stream or a client that
/// wants the server's memory.
pub const MAX_FRAME: usize = 16 << 20;

/// A request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// `set(key, value)`.
    Set { key: String, value: Vec<u8> },
    /// `get(key)`.
    Get { key: String },
    /// `wait(keys, timeout)`.
    Wait { keys: Vec<String>, timeout_ms: u64 },
    /// `add(key, delta)`.
    Add { key: String, delta: i64 },
    /// `compare_and_set(key, expected, value)`.
    Cas {
        key: String,
        expected: Option<Vec<u8>>,
        value: Vec<u8>,
    },
    /// `delete_prefix(prefix)`.
    DeletePrefix { prefix: String },
}

/// A response payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Done, no value (set).
    Done,
    /// A value or its absence (get).
    Value(Option<Vec<u8>>),
    /// The values of all waited keys.
    Values(Vec<Vec<u8>>),
    /// A counter (add).
    Counter(i64),
    /// A CAS outcome.
    Cas(CasOutcome),
    /// Number of keys deleted.
    Deleted(u64),
    /// A wait timed out; the missing keys.
    Timeout {
        missing: Vec<String>,
        timeout_ms: u64,
    },
    /// The key holds a value that the op cannot use.
    InvalidValue { key: String, reason: String },
    /// The request could not be parsed.
    BadRequest(String),
}

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const OP_CAS: u8 = 5;
const OP_DELETE_PREFIX: u8 = 6;

const R_DONE: u8 = 0;
const R_VALUE: u8 = 1;
const R_VALUES: u8 = 2;
const R_COUNTER: u8 = 3;
const R_CAS: u8 = 4;
const R_DELETED: u8 = 5;
const R_TIMEOUT: u8 = 6;
const R_INVALID: u8 = 7;
const R_BAD: u8 = 8;

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

fn put_opt(out: &mut Vec<u8>, b: Option<&[u8]>) {
    match b {
        Some(b) => {
            out.push(1);
            put_bytes(out, b);
        }
        None => out.push(0),
    }
}

/// A cursor over a received body; every read checks the remaining length.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "truncated message: need {n} bytes, have {}",
                self.buf.len()
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?).map_err(|_| "a key is not UTF-8".to_string())
    }
    fn opt(&mut self) -> Result<Option<Vec<u8>>, String> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes()?)),
            t => Err(format!("bad option tag {t}")),
        }
    }
    fn strings(&mut self) -> Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        (0..n).map(|_| self.string()).collect()
    }
    fn end(&self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!("{} trailing bytes", self.buf.len()))
        }
    }
}

/// Encodes a request body (without the frame length).
pub fn encode_request(id: u64, req: &Request) -> Vec<u8> {
    let mut out = id.to_be_bytes().to_vec();
    match req {
        Request::Set { key, value } => {
            out.push(OP_SET);
            put_bytes(&mut out, key.as_bytes());
            put_bytes(&mut out, value);
        }
        Request::Get { key } => {
            out.push(OP_GET);
            put_bytes(&mut out, key.as_bytes());
        }
        Request::Wait { keys, timeout_ms } => {
            out.push(OP_WAIT);
            out.extend_from_slice(&timeout_ms.to_be_bytes());
            out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
            for k in keys {
                put_bytes(&mut out, k.as_bytes());
            }
        }
        Request::Add { key, delta } => {
            out.push(OP_ADD);
            put_bytes(&mut out, key.as_bytes());
            out.extend_from_slice(&delta.to_be_bytes());
        }
        Request::Cas {
            key,
            expected,
            value,
        } => {
            out.push(OP_CAS);
            put_bytes(&mut out, key.as_bytes());
            put_opt(&mut out, expected.as_deref());
            put_bytes(&mut out, value);
        }
        Request::DeletePrefix { prefix } => {
            out.push(OP_DELETE_PREFIX);
            put_bytes(&mut out, prefix.as_bytes());
        }
    }
    out
}

/// Decodes a request body into its id and request. A body too short to hold an id is an error
/// with id 0.
pub fn decode_request(body: &[u8]) -> Result<(u64, Request), (u64, String)> {
    let mut r = Reader { buf: body };
    let id = r.u64().map_err(|e| (0, e))?;
    let parse = |r: &mut Reader| -> Result<Request, String> {
        let req = match r.u8()? {
            OP_SET => Request::Set {
                key: r.string()?,
                value: r.bytes()?,
            },
            OP_GET => Request::Get { key: r.string()? },
            OP_WAIT => {
                let timeout_ms = r.u64()?;
                Request::Wait {
                    keys: r.strings()?,
                    timeout_ms,
                }
            }
            OP_ADD => {
                let key = r.string()?;
                let mut a = [0u8; 8];
                a.copy_from_slice(r.take(8)?);
                Request::Add {
                    key,
                    delta: i64::from_be_bytes(a),
                }
            }
            OP_CAS => Request::Cas {
                key: r.string()?,
                expected: r.opt()?,
                value: r.bytes()?,
            },
            OP_DELETE_PREFIX => Request::DeletePrefix {
                prefix: r.string()?,
            },
            op => return Err(format!("unknown op {op}")),
        };
        r.end()?;
        Ok(req)
    };
    parse(&mut r).map(|req| (id, req)).map_err(|e| (id, e))
}

/// Encodes a response body.
pub fn encode_response(id: u64, resp: &Response) -> Vec<u8> {
    let mut out = id.to_be_bytes().to_vec();
    match resp {
        Response::Done => out.push(R_DONE),
        Response::Value(v) => {
            out.push(R_VALUE);
            put_opt(&mut out, v.as_deref());
        }
        Response::Values(vs) => {
            out.push(R_VALUES);
            out.extend_from_slice(&(vs.len() as u32).to_be_bytes());
            for v in vs {
                put_bytes(&mut out, v);
            }
        }
        Response::Counter(n) => {
            out.push(R_COUNTER);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Response::Cas(CasOutcome::Swapped) => {
            out.push(R_CAS);
            out.push(0);
        }
        Response::Cas(CasOutcome::Current(cur)) => {
            out.push(R_CAS);
            out.push(1);
            put_opt(&mut out, cur.as_deref());
        }
        Response::Deleted(n) => {
            out.push(R_DELETED);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Response::Timeout {
            missing,
            timeout_ms,
        } => {
            out.push(R_TIMEOUT);
            out.extend_from_slice(&timeout_ms.to_be_bytes());
            out.extend_from_slice(&(missing.len() as u32).to_be_bytes());
            for k in missing {
                put_bytes(&mut out, k.as_bytes());
            }
        }
        Response::InvalidValue { key, reason } => {
            out.push(R_INVALID);
            put_bytes(&mut out, key.as_bytes());
            put_bytes(&mut out, reason.as_bytes());
        }
        Response::BadRequest(why) => {
            out.push(R_BAD);
            put_bytes(&mut out, why.as_bytes());
        }
    }
    out
}

/// Decodes a response body.
pub fn decode_response(body: &[u8]) -> Result<(u64, Response), String> {
    let mut r = Reader { buf: body };
    let id = r.u64()?;
    let resp = match r.u8()? {
        R_DONE => Response::Done,
        R_VALUE => Response::Value(r.opt()?),
        R_VALUES => {
            let n = r.u32()? as usize;
            Response::Values((0..n).map(|_| r.bytes()).collect::<Result<_, _>>()?)
        }
        R_COUNTER => {
            let mut a = [0u8; 8];
            a.copy_from_slice(r.take(8)?);
            Response::Counter(i64::from_be_bytes(a))
        }
        R_CAS => match r.u8()? {
            0 => Response::Cas(CasOutcome::Swapped),
            1 => Response::Cas(CasOutcome::Current(r.opt()?)),
            t => return Err(format!("bad cas tag {t}")),
        },
        R_DELETED => Response::Deleted(r.u64()?),
        R_TIMEOUT => {
            let timeout_ms = r.u64()?;
            Response::Timeout {
                missing: r.strings()?,
                timeout_ms,
            }
        }
        R_INVALID => Response::InvalidValue {
            key: r.string()?,
            reason: r.string()?,
        },
        R_BAD => Response::BadRequest(r.string()?),
        s => return Err(format!("unknown response status {s}")),
    };
    r.end()?;
    Ok((id, resp))
}

/// Turns an error response into the store error it stands for.
pub fn response_error(resp: Response, op: &'static str) -> StoreError {
    match resp {
        Response::Timeout {
            missing,
            timeout_ms,
        } => StoreError::Timeout {
            missing,
            timeout: std::time::Duration::from_millis(timeout_ms),
        },
        Response::InvalidValue { key, reason } => StoreError::InvalidValue { key, reason },
        Response::BadRequest(why) => StoreError::Backend {
            op,
            reason: format!("server refused the request: {why}"),
        },
        other => StoreError::Backend {
            op,
            reason: format!("unexpected response {other:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let cases = vec![
            Request::Set {
                key: "a/b".into(),
                value: vec![0, 1, 255],
            },
            Request::Get { key: "".into() },
            Request::Wait {
                keys: vec!["x".into(), "y".into()],
                timeout_ms: 1234,
            },
            Request::Add {
                key: "n".into(),
                delta: -7,
            },
            Request::Cas {
                key: "c".into(),
                expected: None,
                value: b"v".to_vec(),
            },
            Request::Cas {
                key: "c".into(),
                expected: Some(vec![]),
                value: vec![],
            },
            Request::DeletePrefix {
                prefix: "p/".into(),
            },
        ];
        for (i, req) in cases.into_iter().enumerate() {
            let body = encode_request(i as u64, &req);
            assert_eq!(decode_request(&body), Ok((i as u64, req)));
        }
    }

    #[test]
    fn responses_round_trip() {
        let cases = vec![
            Response::Done,
            Response::Value(None),
            Response::Value(Some(vec![9])),
            Response::Values(vec![vec![], vec![1, 2]]),
            Response::Counter(i64::MIN),
            Response::Cas(CasOutcome::Swapped),
            Response::Cas(CasOutcome::Current(Some(b"a".to_vec()))),
            Response::Cas(CasOutcome::Current(None)),
            Response::Deleted(3),
            Response::Timeout {
                missing: vec!["k".into()],
                timeout_ms: 5,
            },
            Response::InvalidValue {
                key: "k".into(),
                reason: "r".into(),
            },
            Response::BadRequest("x".into()),
        ];
        for (i, resp) in cases.into_iter().enumerate() {
            let body = encode_response(i as u64, &resp);
            assert_eq!(decode_response(&body), Ok((i as u64, resp)));
        }
    }

    #[test]
    fn truncated_and_trailing_input_is_refused() {
        let body = encode_request(5, &Request::Get { key: "abc".into() });
        assert!(decode_request(&body[..body.len() - 1]).is_err());
        let mut long = body.clone();
        long.push(0);
        assert_eq!(decode_request(&long).unwrap_err().0, 5);
        assert!(decode_request(&[1, 2]).is_err());
        let mut bad = 1u64.to_be_bytes().to_vec();
        bad.push(99);
        assert!(decode_request(&bad).unwrap_err().1.contains("unknown op"));
    }
}
