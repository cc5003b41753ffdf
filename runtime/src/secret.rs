//! The job secret that authenticates every connection of a process group.
//!
//! Read, in order, from `REKINDLE_SECRET` (the secret itself) or `REKINDLE_SECRET_FILE` (a file
//! whose contents, without a trailing newline, are the secret). With neither set, the documented
//! single-host default [`DEFAULT_SECRET`] is used: it keeps a stray process of another job from
//! joining by accident but is no protection against anyone who can read this source, so it is
//! refused for anything that listens on or connects to a non-loopback address
//! ([`JobSecret::check_exposure`]).
//!
//! The primitives here ([`JobSecret::mac`], [`JobSecret::verify`], [`nonce`],
//! [`JobSecret::derive`]) are what every authenticated connection of a job is built from: the
//! collectives' handshake and the embedded store's.

use std::net::IpAddr;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// The secret used when neither env var is set: fine for single-host runs, not beyond.
pub const DEFAULT_SECRET: &[u8] = b"rekindle-single-host-default-secret";

/// Env var holding the secret.
pub const SECRET_ENV: &str = "REKINDLE_SECRET";
/// Env var naming a file that holds the secret.
pub const SECRET_FILE_ENV: &str = "REKINDLE_SECRET_FILE";

/// A job secret. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(Vec<u8>);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobSecret({} bytes)", self.0.len())
    }
}

impl JobSecret {
    /// A secret from bytes. An empty secret is refused.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(Error::Secret {
                source_desc: "argument".into(),
                reason: "the secret is empty".into(),
            });
        }
        Ok(JobSecret(bytes))
    }

    /// The single-host default.
    pub fn default_single_host() -> Self {
        JobSecret(DEFAULT_SECRET.to_vec())
    }

    /// True if this is the single-host default.
    pub fn is_default(&self) -> bool {
        self.0 == DEFAULT_SECRET
    }

    /// Reads the secret from `REKINDLE_SECRET`, then `REKINDLE_SECRET_FILE`, else the default.
    /// An unreadable or empty secret file is an error, never a silent fallback.
    pub fn from_env() -> Result<Self> {
        Self::from_sources(
            std::env::var_os(SECRET_ENV).map(|v| v.into_encoded_bytes()),
            std::env::var_os(SECRET_FILE_ENV).map(std::path::PathBuf::from),
        )
    }

    /// The resolution rule of [`JobSecret::from_env`] over explicit sources.
    pub fn from_sources(value: Option<Vec<u8>>, file: Option<std::path::PathBuf>) -> Result<Self> {
        if let Some(v) = value {
            return JobSecret::new(v).map_err(|_| Error::Secret {
                source_desc: SECRET_ENV.into(),
                reason: "the variable is set but empty".into(),
            });
        }
        if let Some(path) = file {
            let desc = format!("{SECRET_FILE_ENV}={}", path.display());
            let mut bytes = std::fs::read(&path).map_err(|e| Error::Secret {
                source_desc: desc.clone(),
                reason: e.to_string(),
            })?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            return JobSecret::new(bytes).map_err(|_| Error::Secret {
                source_desc: desc,
                reason: "the file is empty".into(),
            });
        }
        Ok(JobSecret::default_single_host())
    }

    /// HMAC-SHA256 of `parts` under this secret. Each part is preceded by its length, so the
    /// boundaries between parts are bound too (`["ab", "c"]` and `["a", "bc"]` differ).
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        self.hmac(parts).finalize().into_bytes().into()
    }

    /// Checks `tag` against [`JobSecret::mac`] of `parts`, in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(parts).verify_slice(tag).is_ok()
    }

    /// A key derived from this secret and `parts` (their [`JobSecret::mac`]), for example a
    /// session key from a handshake's nonces. Never the default secret.
    pub fn derive(&self, parts: &[&[u8]]) -> JobSecret {
        JobSecret(self.mac(parts).to_vec())
    }

    /// Refuses the built-in default secret for a process that listens on or connects to any of
    /// `addrs` that is not a loopback address: that secret is public, so off loopback it would
    /// let anyone who can reach the address in. Any other secret passes. Unspecified addresses
    /// (`0.0.0.0`, `::`) count as off loopback, since they listen on every interface.
    pub fn check_exposure(&self, addrs: &[IpAddr]) -> Result<()> {
        if !self.is_default() {
            return Ok(());
        }
        match addrs.iter().find(|a| !a.is_loopback()) {
            Some(addr) => Err(Error::DefaultSecretOffLoopback {
                addr: addr.to_string(),
            }),
            None => Ok(()),
        }
    }

    fn hmac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// 16 fresh random bytes for a challenge (a handshake's nonce).
pub fn nonce() -> Result<[u8; 16]> {
    let mut n = [0u8; 16];
    getrandom::getrandom(&mut n).map_err(|e| Error::Io {
        context: "drawing a nonce".into(),
        message: e.to_string(),
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_order_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, "from-file\n").unwrap();
        let s = JobSecret::from_sources(Some(b"v".to_vec()), Some(f.clone())).unwrap();
        assert_eq!(s, JobSecret::new("v").unwrap());
        let s = JobSecret::from_sources(None, Some(f)).unwrap();
        assert_eq!(s, JobSecret::new("from-file").unwrap());
        assert!(JobSecret::from_sources(None, None).unwrap().is_default());
        assert!(JobSecret::from_sources(Some(vec![]), None).is_err());
        let missing = dir.path().join("missing");
        let err = JobSecret::from_sources(None, Some(missing)).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        assert!(JobSecret::from_sources(None, Some(empty)).is_err());
    }

    #[test]
    fn macs_bind_every_part() {
        let a = JobSecret::new("a").unwrap();
        let b = JobSecret::new("b").unwrap();
        let tag = a.mac(&[b"x", b"y"]);
        assert!(a.verify(&[b"x", b"y"], &tag));
        assert!(!b.verify(&[b"x", b"y"], &tag));
        assert!(!a.verify(&[b"xy"], &tag), "part boundaries are bound");
        assert_eq!(format!("{a:?}"), "JobSecret(1 bytes)");
        let k = a.derive(&[b"n1", b"n2"]);
        assert_ne!(k, a.derive(&[b"n1", b"n3"]));
        assert_ne!(k, b.derive(&[b"n1", b"n2"]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn the_default_secret_stays_on_loopback() {
        let lo: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        let d = JobSecret::default_single_host();
        assert!(d.check_exposure(&lo).is_ok());
        assert!(d.check_exposure(&[]).is_ok());
        for off in ["10.0.0.2", "0.0.0.0", "::"] {
            let mut addrs = lo.clone();
            addrs.push(off.parse().unwrap());
            let e = d.check_exposure(&addrs).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(off) && msg.contains(SECRET_FILE_ENV), "{msg}");
        }
        let real = JobSecret::new("s").unwrap();
        assert!(real.check_exposure(&["10.0.0.2".parse().unwrap()]).is_ok());
    }
}
