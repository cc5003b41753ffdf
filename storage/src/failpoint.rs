//! Failpoints at each stage of the commit protocol, for the crash-safety tests.
//!
//! Compiled only with the `failpoints` feature; without it [`hit`] is an empty inline function.
//! With it, `REKINDLE_FAILPOINT=<name>=<action>[,...]` arms failpoints, where action is
//! `error` (the save returns [`StorageError::Failpoint`]) or `pause` (print
//! `REKINDLE_FAILPOINT_REACHED <name>` on stdout and wait, so that a test can kill the process
//! at exactly that point; the wait gives up after five minutes and returns the error).

use crate::error::Result;
#[cfg(feature = "failpoints")]
use crate::error::StorageError;

/// The environment variable that arms failpoints.
pub const FAILPOINT_ENV: &str = "REKINDLE_FAILPOINT";

/// The commit stages, in order, as failpoint names.
pub const SAVE_STAGES: [&str; 9] = [
    "storage::save::stale_cleaned",
    "storage::save::tmp_created",
    "storage::save::file_partial",
    "storage::save::file_written",
    "storage::save::files_synced",
    "storage::save::manifest_written",
    "storage::save::tmp_dir_synced",
    "storage::save::renamed",
    "storage::save::parent_synced",
];

/// Runs the failpoint `name` if it is armed.
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &'static str) -> Result<()> {
    let Ok(spec) = std::env::var(FAILPOINT_ENV) else {
        return Ok(());
    };
    for item in spec.split(',') {
        let (n, action) = item.split_once('=').unwrap_or((item, "error"));
        if n.trim() != name {
            continue;
        }
        if action.trim() == "pause" {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "REKINDLE_FAILPOINT_REACHED {name}");
            let _ = out.flush();
            drop(out);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
            while std::time::Instant::now() < deadline {
                std::thread::park_timeout(std::time::Duration::from_secs(1));
            }
        }
        return Err(StorageError::Failpoint { name });
    }
    Ok(())
}

/// Runs the failpoint `name` if it is armed (compiled away without `failpoints`).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &'static str) -> Result<()> {
    Ok(())
}
