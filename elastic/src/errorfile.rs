//! Worker error files: how a worker tells the agent why it failed.
//!
//! The agent gives each worker a path in `REKINDLE_ERROR_FILE` (and, for torchelastic-aware
//! programs, `TORCHELASTIC_ERROR_FILE`). A failing worker writes one JSON object there, with
//! [`record_error`] or by hand:
//!
//! ```json
//! {"message": "CUDA out of memory", "timestamp": 1764680000.25, "rank": 3, "details": "..."}
//! ```
//!
//! torchelastic's format (`{"message": {"message": ..., "extraInfo": {"timestamp": ...}}}`)
//! is read too. The agent reports the failure with the earliest timestamp as the root cause.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Env var holding the error file's path.
pub const ERROR_FILE_ENV: &str = "REKINDLE_ERROR_FILE";
/// torchelastic's name for the same path.
pub const TORCHELASTIC_ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// What a worker wrote about its failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// One line saying what failed.
    pub message: String,
    /// When, in seconds since the Unix epoch.
    pub timestamp: f64,
    /// The worker's global rank, if it knew it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u64>,
    /// More text (a backtrace, a cause chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes `message` (and `details`) to the file named by `REKINDLE_ERROR_FILE`, atomically
/// (temp file, then rename). Returns `Ok(false)` when the variable is not set.
pub fn record_error(message: &str, details: Option<&str>) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return Ok(false);
    };
    let rank = std::env::var("RANK").ok().and_then(|r| r.parse().ok());
    write_error_file(
        Path::new(&path),
        &ErrorRecord {
            message: message.to_string(),
            timestamp: unix_now(),
            rank,
            details: details.map(String::from),
        },
    )?;
    Ok(true)
}

/// Writes `record` to `path` atomically.
pub fn write_error_file(path: &Path, record: &ErrorRecord) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, body)?;
    std::fs::rename(&tmp, path)
}

#[derive(Deserialize)]
struct TorchExtra {
    #[serde(default)]
    timestamp: Option<serde_json::Value>,
    #[serde(default)]
    py_callstack: Option<String>,
}

#[derive(Deserialize)]
struct TorchMessage {
    message: String,
    #[serde(default, rename = "extraInfo")]
    extra_info: Option<TorchExtra>,
}

#[derive(Deserialize)]
struct TorchRecord {
    message: TorchMessage,
}

/// Reads an error file in rekindle's or torchelastic's format. `None` if it does not exist or
/// cannot be parsed (the worker may have died mid-write; the exit status still counts).
pub fn read_error_file(path: &Path) -> Option<ErrorRecord> {
    let raw = std::fs::read(path).ok()?;
    if let Ok(r) = serde_json::from_slice::<ErrorRecord>(&raw) {
        return Some(r);
    }
    let t: TorchRecord = serde_json::from_slice(&raw).ok()?;
    let extra = t.message.extra_info;
    let timestamp = extra
        .as_ref()
        .and_then(|e| e.timestamp.as_ref())
        .and_then(|v| match v {
            serde_json::Value::Number(n) => n.as_f64(),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        })
        .unwrap_or(0.0);
    Some(ErrorRecord {
        message: t.message.message,
        timestamp,
        rank: None,
        details: extra.and_then(|e| e.py_callstack),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_torchelastic_format() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("error.json");
        let rec = ErrorRecord {
            message: "boom".into(),
            timestamp: 12.5,
            rank: Some(3),
            details: None,
        };
        write_error_file(&p, &rec).unwrap();
        assert_eq!(read_error_file(&p), Some(rec));

        std::fs::write(
            &p,
            r#"{"message": {"message": "RuntimeError: x", "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000"}}}"#,
        )
        .unwrap();
        let got = read_error_file(&p).unwrap();
        assert_eq!(got.message, "RuntimeError: x");
        assert_eq!(got.timestamp, 1_700_000_000.0);
        assert_eq!(got.details.as_deref(), Some("tb"));

        std::fs::write(&p, b"{not json").unwrap();
        assert_eq!(read_error_file(&p), None);
        assert_eq!(read_error_file(&dir.path().join("missing")), None);
    }
}
