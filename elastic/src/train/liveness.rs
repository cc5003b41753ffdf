//! The worker's liveness record for its own agent: which group it is in and a beat that
//! moves with every step and every change of group.
//!
//! A peer that finds a rank silent past the collective deadline cannot tell a dead or stuck
//! rank from one it merely cannot reach (a network partition). The rank's own agent can: it
//! reads this record, which the worker keeps in a file the agent names
//! ([`LIVENESS_FILE_ENV`], next to the worker's error file), and the process state. An eviction
//! request names the round and generation in which the rank was silent (see
//! [`EvictionNotice`]); the agent acts on it only when the worker is stopped, or still in that
//! generation without a beat for a grace period (see `agent::evictions`).
//!
//! The record is one line, `v1 <round> <generation> <in|out> <beat> <check>`, rewritten in
//! place (a single positioned write, no rename, about a microsecond), where `check` is an
//! FNV-1a hash of the rest so that a read racing a write is recognised and read again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The file the agent reads this worker's liveness record from.
pub const LIVENESS_FILE_ENV: &str = "REKINDLE_LIVENESS_FILE";

/// The record's fixed width: every write covers the whole record.
const WIDTH: usize = 96;

/// What the worker says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// The round it is in.
    pub round: u64,
    /// The generation it is in, or last left.
    pub generation: u64,
    /// True while it trains in that generation's group; false once it left it (re-forming,
    /// moving to a new round, or stopping).
    pub in_group: bool,
    /// Moves with every completed step and every change of the fields above.
    pub beat: u64,
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

impl Liveness {
    /// The record as written: the line padded with spaces to a fixed width.
    pub fn encode(&self) -> [u8; WIDTH] {
        let body = format!(
            "v1 {} {} {} {}",
            self.round,
            self.generation,
            if self.in_group { "in" } else { "out" },
            self.beat
        );
        let line = format!("{body} {:08x}\n", fnv1a(body.as_bytes()));
        let mut out = [b' '; WIDTH];
        let n = line.len().min(WIDTH);
        out[..n].copy_from_slice(&line.as_bytes()[..n]);
        out
    }

    /// Parses a record; `None` for anything else (torn, empty, another version).
    pub fn decode(raw: &[u8]) -> Option<Liveness> {
        let text = std::str::from_utf8(raw).ok()?;
        let line = text.lines().next()?.trim_end();
        let (body, check) = line.rsplit_once(' ')?;
        if u32::from_str_radix(check, 16).ok()? != fnv1a(body.as_bytes()) {
            return None;
        }
        let mut f = body.split(' ');
        if f.next()? != "v1" {
            return None;
        }
        let round = f.next()?.parse().ok()?;
        let generation = f.next()?.parse().ok()?;
        let in_group = match f.next()? {
            "in" => true,
            "out" => false,
            _ => return None,
        };
        let beat = f.next()?.parse().ok()?;
        f.next().is_none().then_some(Liveness {
            round,
            generation,
            in_group,
            beat,
        })
    }

    /// Reads the record at `path` (a few tries when a read races a write); `None` when there
    /// is no valid record.
    pub fn read(path: &Path) -> Option<Liveness> {
        (0..3).find_map(|_| {
            std::fs::read(path)
                .ok()
                .and_then(|raw| Liveness::decode(&raw))
        })
    }
}

/// Keeps this worker's record current. Without the variable (not under `rekindle run`) it
/// only tracks the group, which eviction requests name.
#[derive(Debug)]
pub(crate) struct LivenessWriter {
    file: Option<File>,
    now: Liveness,
}

impl LivenessWriter {
    /// A writer to the file the agent named, if it named one it can open.
    pub(crate) fn from_env(round: u64) -> LivenessWriter {
        let file = std::env::var_os(LIVENESS_FILE_ENV)
            .filter(|p| !p.is_empty())
            .and_then(|p| match File::create(&p) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(path = ?p, error = %e, "cannot write the liveness record");
                    None
                }
            });
        let mut w = LivenessWriter {
            file,
            now: Liveness {
                round,
                generation: 0,
                in_group: false,
                beat: 0,
            },
        };
        w.write();
        w
    }

    fn write(&mut self) {
        if let Some(f) = &self.file {
            // A failed write leaves the old record, which only makes the agent more careful.
            let _ = f.write_all_at(&self.now.encode(), 0);
        }
    }

    fn set(&mut self, round: u64, generation: u64, in_group: bool) {
        self.now.round = round;
        self.now.generation = generation;
        self.now.in_group = in_group;
        self.beat();
    }

    /// The rank trains in `generation` of `round` from now.
    pub(crate) fn entered(&mut self, round: u64, generation: u64) {
        self.set(round, generation, true);
    }

    /// The rank left its group (or moved to `round`).
    pub(crate) fn left(&mut self, round: u64) {
        let generation = self.now.generation;
        self.set(round, generation, false);
    }

    /// A step completed, or the rank is waiting and alive.
    pub(crate) fn beat(&mut self) {
        self.now.beat += 1;
        self.write();
    }

    /// The group this rank trains in, if it is in one.
    pub(crate) fn group(&self) -> Option<(u64, u64)> {
        self.now
            .in_group
            .then_some((self.now.round, self.now.generation))
    }
}

/// The value of an eviction request (see [`evict_key`](super::form::evict_key)): who found
/// the rank silent, and in which group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictionNotice {
    /// The reporting rank.
    pub by: usize,
    /// The round of the group in which the rank was silent.
    pub round: u64,
    /// Its generation.
    pub generation: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_damage_is_refused() {
        let l = Liveness {
            round: 3,
            generation: 17,
            in_group: true,
            beat: 123_456_789,
        };
        let raw = l.encode();
        assert_eq!(raw.len(), WIDTH);
        assert_eq!(Liveness::decode(&raw), Some(l));
        let out = Liveness {
            in_group: false,
            ..l
        };
        assert_eq!(Liveness::decode(&out.encode()), Some(out));
        // A byte of a field changed (as a read racing a write could see it): refused.
        let mut torn = raw;
        torn[3] = b'4';
        assert_eq!(Liveness::decode(&torn), None);
        assert_eq!(Liveness::decode(b""), None);
        assert_eq!(Liveness::decode(b"v2 1 2 in 3 00000000\n"), None);
    }

    #[test]
    fn the_writer_keeps_the_file_current() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("liveness");
        let mut w = LivenessWriter {
            file: Some(File::create(&path).unwrap()),
            now: Liveness {
                round: 0,
                generation: 0,
                in_group: false,
                beat: 0,
            },
        };
        w.entered(2, 5);
        assert_eq!(w.group(), Some((2, 5)));
        w.beat();
        let l = Liveness::read(&path).unwrap();
        assert_eq!((l.round, l.generation, l.in_group, l.beat), (2, 5, true, 2));
        w.left(2);
        assert_eq!(w.group(), None);
        let l = Liveness::read(&path).unwrap();
        assert_eq!(
            (l.round, l.generation, l.in_group, l.beat),
            (2, 5, false, 3)
        );
    }
}
