//! The two [`Store`](rekindle_runtime::store::Store) implementations of this crate: etcd v3
//! ([`EtcdStore`]) and the embedded TCP store ([`TcpStoreServer`] and [`TcpStoreClient`],
//! which serve only holders of the job secret). Both pass
//! `rekindle_runtime::store::testing::conformance` unchanged.

mod etcd;
mod tcp;

pub(crate) use etcd::get_prefix_opts;
pub use etcd::EtcdStore;
pub use tcp::{
    ServerError, ServerLimits, TcpStoreClient, TcpStoreServer, DEFAULT_OP_TIMEOUT, MAX_FRAME,
};

use std::path::PathBuf;
use std::sync::Arc;

use rekindle_runtime::secret::JobSecret;
use rekindle_runtime::store::{Store, StoreError, StoreResult};

use crate::etcd::{EtcdConfig, EtcdTls};

/// The scheme of a store address that names an etcd cluster (see [`connect`]).
pub const ETCD_SCHEME: &str = "etcd://";

/// Opens the store an address names, as `rekindle run` hands it to workers in
/// `REKINDLE_STORE`, with the job secret from the environment
/// ([`JobSecret::from_env`]); see [`connect_with`].
pub fn connect(addr: &str) -> StoreResult<Arc<dyn Store>> {
    if addr.starts_with(ETCD_SCHEME) {
        return EtcdAddress::parse(addr)?.connect();
    }
    let secret = JobSecret::from_env().map_err(|e| StoreError::Backend {
        op: "connect",
        reason: e.to_string(),
    })?;
    connect_with(addr, &secret)
}

/// Opens the store an address names: `host:port` is an embedded store ([`TcpStoreClient`],
/// authenticated with `secret`); `etcd://...` is an etcd cluster ([`EtcdAddress`], protected
/// by its own credentials, if any).
pub fn connect_with(addr: &str, secret: &JobSecret) -> StoreResult<Arc<dyn Store>> {
    if addr.starts_with(ETCD_SCHEME) {
        return EtcdAddress::parse(addr)?.connect();
    }
    Ok(Arc::new(TcpStoreClient::connect(addr, secret)?))
}

/// An etcd cluster as a store address names it:
/// `etcd://host:port[,host:port...][?key=value&...]` with the keys
///
/// | key | meaning |
/// |---|---|
/// | `lease` | bind every key written to this lease (decimal id) |
/// | `user` | the etcd user name |
/// | `password_file` | a file holding that user's password (never the password itself) |
/// | `cacert`, `cert`, `key` | PEM files for TLS (the endpoints then use `https://`) |
///
/// Values are percent-encoded where they contain `%`, `&`, `=`, `?`, `,` or spaces. The
/// password travels only as the path of a file, so it is never in a process's environment or
/// command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAddress {
    /// Endpoints, `host:port`.
    pub endpoints: Vec<String>,
    /// The lease every write is bound to.
    pub lease: Option<i64>,
    /// The user name.
    pub user: Option<String>,
    /// The file holding the user's password.
    pub password_file: Option<PathBuf>,
    /// TLS files.
    pub tls: Option<EtcdTls>,
}

fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '%' | '&' | '=' | '?' | ',' | ' ' | '#' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

fn unescape(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl EtcdAddress {
    /// The address as a string for [`connect`].
    pub fn format(&self) -> String {
        let mut query: Vec<String> = Vec::new();
        if let Some(l) = self.lease {
            query.push(format!("lease={l}"));
        }
        if let Some(u) = &self.user {
            query.push(format!("user={}", escape(u)));
        }
        let path = |k: &str, p: &PathBuf| format!("{k}={}", escape(&p.to_string_lossy()));
        if let Some(p) = &self.password_file {
            query.push(path("password_file", p));
        }
        if let Some(t) = &self.tls {
            for (k, v) in [("cacert", &t.ca), ("cert", &t.cert), ("key", &t.key)] {
                if let Some(p) = v {
                    query.push(path(k, p));
                }
            }
        }
        let mut out = format!("{ETCD_SCHEME}{}", self.endpoints.join(","));
        if !query.is_empty() {
            out.push('?');
            out.push_str(&query.join("&"));
        }
        out
    }

    /// Parses an `etcd://` address. Unknown keys, bad numbers and a password file without a
    /// user are [`StoreError::InvalidValue`]s naming the address.
    pub fn parse(addr: &str) -> StoreResult<EtcdAddress> {
        let bad = |reason: String| StoreError::InvalidValue {
            key: addr.to_string(),
            reason,
        };
        let Some(rest) = addr.strip_prefix(ETCD_SCHEME) else {
            return Err(bad(format!("does not start with {ETCD_SCHEME}")));
        };
        let (endpoints, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut out = EtcdAddress {
            endpoints: endpoints
                .split(',')
                .filter(|e| !e.is_empty())
                .map(str::to_string)
                .collect(),
            ..Default::default()
        };
        if out.endpoints.is_empty() {
            return Err(bad("no etcd endpoint".into()));
        }
        let mut tls = EtcdTls::default();
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let Some((k, v)) = kv.split_once('=') else {
                return Err(bad(format!("parameter {kv:?} is not key=value")));
            };
            let v = unescape(v).ok_or_else(|| bad(format!("{k}: bad percent-encoding")))?;
            match k {
                "lease" => {
                    out.lease = Some(
                        v.parse::<i64>()
                            .map_err(|_| bad(format!("lease {v:?} is not a number")))?,
                    )
                }
                "user" => out.user = Some(v),
                "password_file" => out.password_file = Some(v.into()),
                "cacert" => tls.ca = Some(v.into()),
                "cert" => tls.cert = Some(v.into()),
                "key" => tls.key = Some(v.into()),
                _ => return Err(bad(format!("unknown parameter {k:?}"))),
            }
        }
        if out.password_file.is_some() != out.user.is_some() {
            return Err(bad("user and password_file go together".into()));
        }
        if tls != EtcdTls::default() {
            out.tls = Some(tls);
        }
        Ok(out)
    }

    /// The client configuration: reads the password file (a missing or unreadable file is a
    /// [`StoreError::Unauthorized`] naming it).
    pub fn config(&self) -> StoreResult<EtcdConfig> {
        let mut cfg = EtcdConfig::new(self.endpoints.clone());
        cfg.tls = self.tls.clone();
        if let (Some(user), Some(file)) = (&self.user, &self.password_file) {
            let raw = std::fs::read_to_string(file).map_err(|e| StoreError::Unauthorized {
                endpoint: cfg.endpoint_string(),
                reason: format!("cannot read the password file {}: {e}", file.display()),
            })?;
            cfg.user = Some((user.clone(), raw.trim_end_matches(['\n', '\r']).to_string()));
        }
        Ok(cfg)
    }

    /// Connects ([`EtcdStore`], every key bound to the lease when there is one).
    pub fn connect(&self) -> StoreResult<Arc<dyn Store>> {
        let store = EtcdStore::connect(&self.config()?, "")?;
        Ok(Arc::new(match self.lease {
            Some(l) => store.with_lease(l),
            None => store,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_addresses_round_trip() {
        let a = EtcdAddress {
            endpoints: vec!["h1:2379".into(), "h2:2379".into()],
            lease: Some(42),
            user: Some("train er".into()),
            password_file: Some("/run/a&b=c,d%e/pw".into()),
            tls: Some(EtcdTls {
                ca: Some("/ca.pem".into()),
                cert: None,
                key: None,
            }),
        };
        let s = a.format();
        assert!(
            s.starts_with("etcd://h1:2379,h2:2379?lease=42&user=train%20er&"),
            "{s}"
        );
        assert!(!s.contains("a&b"), "{s}");
        assert_eq!(EtcdAddress::parse(&s).unwrap(), a);
        let plain = EtcdAddress::parse("etcd://h:1?lease=7").unwrap();
        assert_eq!(
            (plain.lease, &plain.user, &plain.tls),
            (Some(7), &None, &None)
        );
        assert_eq!(plain.format(), "etcd://h:1?lease=7");
    }

    #[test]
    fn the_password_comes_from_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "s3cret\n").unwrap();
        let a = EtcdAddress {
            endpoints: vec!["h:1".into()],
            user: Some("u".into()),
            password_file: Some(pw),
            ..Default::default()
        };
        assert_eq!(
            a.config().unwrap().user,
            Some(("u".into(), "s3cret".into()))
        );
        let missing = EtcdAddress {
            password_file: Some(dir.path().join("missing")),
            ..a
        };
        let e = missing.config().unwrap_err();
        assert!(matches!(e, StoreError::Unauthorized { .. }), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[test]
    fn bad_etcd_addresses_are_typed_errors() {
        for addr in [
            "etcd://",
            "etcd://h:1?lease=x",
            "etcd://h:1?ttl=3",
            "etcd://h:1?user=u",
            "etcd://h:1?password_file=/p",
            "etcd://h:1?user=u&password_file=%zz",
        ] {
            match connect(addr) {
                Err(StoreError::InvalidValue { key, .. }) => assert_eq!(key, addr),
                Err(other) => panic!("{addr}: unexpected {other}"),
                Ok(_) => panic!("{addr}: accepted"),
            }
        }
    }
}
