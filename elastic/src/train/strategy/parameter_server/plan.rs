//! The re-forming decision: from what every member of a new group holds (published with its
//! generation record), where each shard's state comes from and which step the group takes up
//! again. A pure function, so every rank reaches the same decision without talking.
//!
//! Synchronous mode keeps the shards in step: each holds its values at one step `at` and,
//! after an update, the values before it (`undo`), so a step that some servers applied and
//! others did not can be taken back. The group takes up the newest step `S` at which every
//! shard is held (current or undone) and some rank's loop stopped, so the loop's step and
//! sampler come from that rank. A shard that no rank holds at such a step comes from the
//! newest checkpoint, and then the whole state goes back to that checkpoint's step (shards
//! held in memory at exactly that step are taken from memory).
//!
//! Asynchronous mode never goes back: each shard keeps the tickets it applied
//! ([`Applied`]), so its best holder (most applied) is taken as it is, a push of a ticket it
//! already applied is ignored, and the tickets some shard misses are dealt again. The group
//! takes up the lowest first-unapplied ticket over the shards; the loop moves forward to it
//! from a rank whose step is not past it ([`LoopSource::Advance`]).

use serde::{Deserialize, Serialize};

use super::tickets::Applied;

/// One shard a rank holds, as published in its generation record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// The shard (server index).
    pub shard: usize,
    /// True for the in-memory copy a server keeps of its predecessor's shard.
    #[serde(default)]
    pub copy: bool,
    /// Synchronous: the step of the values. Asynchronous: the first ticket not applied.
    pub at: u64,
    /// Synchronous: the values of step `at - 1` are kept too.
    #[serde(default)]
    pub undo: bool,
    /// Asynchronous: the updates applied.
    #[serde(default)]
    pub version: u64,
    /// Asynchronous: the tickets applied past `at`.
    #[serde(default)]
    pub beyond: Vec<u64>,
}

/// What a rank holds: its shards under a map of `servers` servers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holdings {
    /// The number of servers of the map the shards belong to.
    pub servers: usize,
    /// The shards.
    pub shards: Vec<Holding>,
}

/// A member of the new group, as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// It holds training state (the loop's `has_state`).
    pub has_state: bool,
    /// Its loop's step.
    pub step: u64,
    /// Its shards, if any.
    pub holdings: Option<Holdings>,
}

/// The newest checkpoint, as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointView {
    /// Its step.
    pub step: u64,
    /// Asynchronous: the tickets each shard had applied when saved (`None` for a shard of
    /// another map, or a checkpoint of another mode: only its step is known).
    pub applied: Vec<Option<Applied>>,
}

/// How the group trains: in step, or asynchronously.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Synchronous mode.
    Sync,
    /// Asynchronous mode.
    Async,
}

/// Where one shard's state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardSource {
    /// From this rank's memory (its values before the last update when `undo`).
    Rank {
        /// The rank.
        rank: usize,
        /// Take the values before the last update.
        undo: bool,
    },
    /// From the newest checkpoint.
    Checkpoint,
    /// The program's initial parameters and a fresh optimizer (a new job).
    Init,
}

/// Where the loop's state (step and sampler) comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopSource {
    /// This rank's.
    Rank(usize),
    /// This rank's, moved forward to `step`.
    Advance {
        /// The rank.
        rank: usize,
        /// The step.
        step: u64,
    },
    /// The checkpoint's.
    Checkpoint,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The step the group takes up.
    pub step: u64,
    /// Where the loop's state comes from.
    pub loop_source: LoopSource,
    /// Where each shard comes from.
    pub shards: Vec<ShardSource>,
    /// Asynchronous: the tickets each shard has applied (synchronous: all below `step`).
    pub applied: Vec<Applied>,
}

/// Why memory alone (or with the checkpoint) does not give a plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// These shards are held by no rank at a usable step: a checkpoint is needed.
    #[error("shard(s) {shards:?} are held by no rank at a step the group can take up")]
    Lost {
        /// The shards.
        shards: Vec<usize>,
    },
    /// Even with the checkpoint there is no consistent state.
    #[error("{reason}")]
    Inconsistent {
        /// What is wrong.
        reason: String,
    },
}

/// The shards of map `servers` that `m` holds.
fn held(m: &MemberView, servers: usize) -> &[Holding] {
    match &m.holdings {
        Some(h) if h.servers == servers => &h.shards,
        _ => &[],
    }
}

fn fresh(servers: usize) -> Plan {
    Plan {
        step: 0,
        loop_source: LoopSource::Rank(0),
        shards: vec![ShardSource::Init; servers],
        applied: vec![Applied::default(); servers],
    }
}

/// Decides the plan for a group of `members` (in rank order) over `servers` servers;
/// `checkpoint` is the newest checkpoint when memory alone gave [`PlanError::Lost`].
pub fn plan(
    members: &[MemberView],
    servers: usize,
    pace: Pace,
    checkpoint: Option<&CheckpointView>,
) -> Result<Plan, PlanError> {
    if members.iter().all(|m| !m.has_state) {
        return Ok(fresh(servers));
    }
    match pace {
        Pace::Sync => plan_sync(members, servers, checkpoint),
        Pace::Async => plan_async(members, servers, checkpoint),
    }
}

/// A copy of a shard at some step: (step, undo, copy, rank).
type Entry = (u64, bool, bool, usize);

fn plan_sync(
    members: &[MemberView],
    servers: usize,
    checkpoint: Option<&CheckpointView>,
) -> Result<Plan, PlanError> {
    let mut avail: Vec<Vec<Entry>> = vec![Vec::new(); servers];
    for (r, m) in members.iter().enumerate() {
        for h in held(m, servers).iter().filter(|h| h.shard < servers) {
            avail[h.shard].push((h.at, false, h.copy, r));
            if h.undo && h.at > 0 {
                avail[h.shard].push((h.at - 1, true, h.copy, r));
            }
        }
    }
    // Current values before undone ones, a primary before a copy, then the lowest rank.
    let pick = |s: usize, step: u64| {
        avail[s]
            .iter()
            .filter(|e| e.0 == step)
            .min_by_key(|e| (e.1, e.2, e.3))
            .map(|e| ShardSource::Rank {
                rank: e.3,
                undo: e.1,
            })
    };
    let loop_rank = |step: u64| members.iter().position(|m| m.has_state && m.step == step);
    let mut steps: Vec<u64> = avail.iter().flatten().map(|e| e.0).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps.dedup();
    for &s in &steps {
        let Some(r) = loop_rank(s) else { continue };
        if let Some(shards) = (0..servers).map(|k| pick(k, s)).collect::<Option<Vec<_>>>() {
            return Ok(Plan {
                step: s,
                loop_source: LoopSource::Rank(r),
                shards,
                applied: vec![Applied::new(s, []); servers],
            });
        }
    }
    let Some(c) = checkpoint else {
        let newest = steps.first().copied();
        let shards = (0..servers)
            .filter(|&k| newest.is_none_or(|n| pick(k, n).is_none()))
            .collect();
        return Err(PlanError::Lost { shards });
    };
    let shards = (0..servers)
        .map(|k| pick(k, c.step).unwrap_or(ShardSource::Checkpoint))
        .collect();
    Ok(Plan {
        step: c.step,
        loop_source: loop_rank(c.step).map_or(LoopSource::Checkpoint, LoopSource::Rank),
        shards,
        applied: vec![Applied::new(c.step, []); servers],
    })
}

fn plan_async(
    members: &[MemberView],
    servers: usize,
    checkpoint: Option<&CheckpointView>,
) -> Result<Plan, PlanError> {
    // Each shard's best holder: the most tickets applied, a primary before a copy, the
    // lowest rank.
    let mut best: Vec<Option<(usize, &Holding)>> = vec![None; servers];
    for (r, m) in members.iter().enumerate() {
        for h in held(m, servers).iter().filter(|h| h.shard < servers) {
            let better = match best[h.shard] {
                None => true,
                Some((_, b)) => (h.at, h.version, !h.copy) > (b.at, b.version, !b.copy),
            };
            if better {
                best[h.shard] = Some((r, h));
            }
        }
    }
    let lost: Vec<usize> = (0..servers).filter(|&k| best[k].is_none()).collect();
    let mut shards = Vec::with_capacity(servers);
    let mut applied = Vec::with_capacity(servers);
    for (k, b) in best.iter().enumerate() {
        match (b, checkpoint) {
            (Some((r, h)), _) => {
                shards.push(ShardSource::Rank {
                    rank: *r,
                    undo: false,
                });
                applied.push(Applied::new(h.at, h.beyond.iter().copied()));
            }
            (None, Some(c)) => {
                shards.push(ShardSource::Checkpoint);
                applied.push(
                    c.applied
                        .get(k)
                        .cloned()
                        .flatten()
                        .unwrap_or_else(|| Applied::new(c.step, [])),
                );
            }
            (None, None) => return Err(PlanError::Lost { shards: lost }),
        }
    }
    let step = applied.iter().map(Applied::prefix).min().unwrap_or(0);
    let from = members
        .iter()
        .enumerate()
        .filter(|(_, m)| m.has_state && m.step <= step)
        .max_by(|(ra, a), (rb, b)| a.step.cmp(&b.step).then(rb.cmp(ra)));
    let (step, loop_source) = match (from, checkpoint) {
        (Some((r, m)), _) if m.step == step => (step, LoopSource::Rank(r)),
        (Some((r, _)), _) => (step, LoopSource::Advance { rank: r, step }),
        (None, Some(c)) if shards.contains(&ShardSource::Checkpoint) && c.step <= step => {
            (c.step, LoopSource::Checkpoint)
        }
        _ => {
            return Err(PlanError::Inconsistent {
                reason: format!(
                    "no rank's step is at or before step {step}, the first ticket some shard \
                     has not applied"
                ),
            })
        }
    };
    Ok(Plan {
        step,
        loop_source,
        shards,
        applied,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(step: u64, shards: &[Holding]) -> MemberView {
        MemberView {
            has_state: true,
            step,
            holdings: (!shards.is_empty()).then(|| Holdings {
                servers: 2,
                shards: shards.to_vec(),
            }),
        }
    }

    fn fresh_member() -> MemberView {
        MemberView {
            has_state: false,
            step: 0,
            holdings: None,
        }
    }

    fn sync(shard: usize, copy: bool, at: u64, undo: bool) -> Holding {
        Holding {
            shard,
            copy,
            at,
            undo,
            version: 0,
            beyond: Vec::new(),
        }
    }

    fn asy(shard: usize, copy: bool, at: u64, beyond: &[u64]) -> Holding {
        Holding {
            shard,
            copy,
            at,
            undo: false,
            version: at + beyond.len() as u64,
            beyond: beyond.to_vec(),
        }
    }

    fn rank(rank: usize, undo: bool) -> ShardSource {
        ShardSource::Rank { rank, undo }
    }

    #[test]
    fn synchronous_plans() {
        let ck = |step| CheckpointView {
            step,
            applied: vec![None, None],
        };
        // (members, checkpoint, expected step, loop source, shard sources) or the lost shards.
        type Case = (
            Vec<MemberView>,
            Option<CheckpointView>,
            Result<(u64, LoopSource, Vec<ShardSource>), Vec<usize>>,
        );
        let cases: Vec<Case> = vec![
            // A new job: initial state.
            (
                vec![fresh_member(), fresh_member(), fresh_member()],
                None,
                Ok((0, LoopSource::Rank(0), vec![ShardSource::Init; 2])),
            ),
            // Every shard at 10, a worker replaced: from the servers.
            (
                vec![
                    member(10, &[sync(0, false, 10, true), sync(1, true, 10, true)]),
                    member(10, &[sync(1, false, 10, true), sync(0, true, 10, true)]),
                    fresh_member(),
                ],
                None,
                Ok((
                    10,
                    LoopSource::Rank(0),
                    vec![rank(0, false), rank(1, false)],
                )),
            ),
            // Server 0 applied step 10 (at 11) and returned; server 1 died before applying:
            // its copy on server 0 is at 10, so shard 0 is undone to 10.
            (
                vec![
                    member(10, &[sync(0, false, 11, true), sync(1, true, 10, true)]),
                    fresh_member(),
                    member(10, &[]),
                ],
                None,
                Ok((10, LoopSource::Rank(0), vec![rank(0, true), rank(0, false)])),
            ),
            // Both shards applied step 10 and a worker finished it (loop at 11): keep 11,
            // shard 1 from its copy.
            (
                vec![
                    member(10, &[sync(0, false, 11, true), sync(1, true, 11, true)]),
                    fresh_member(),
                    member(11, &[]),
                ],
                None,
                Ok((
                    11,
                    LoopSource::Rank(2),
                    vec![rank(0, false), rank(0, false)],
                )),
            ),
            // The same but no rank finished step 10: both undone to 10.
            (
                vec![
                    member(10, &[sync(0, false, 11, true), sync(1, true, 11, true)]),
                    fresh_member(),
                    member(10, &[]),
                ],
                None,
                Ok((10, LoopSource::Rank(0), vec![rank(0, true), rank(0, true)])),
            ),
            // Shard 1 is held nowhere: lost without a checkpoint...
            (
                vec![member(10, &[sync(0, false, 10, true)]), fresh_member()],
                None,
                Err(vec![1]),
            ),
            // ... and from a checkpoint of step 10 the group keeps shard 0's memory.
            (
                vec![member(10, &[sync(0, false, 10, true)]), fresh_member()],
                Some(ck(10)),
                Ok((
                    10,
                    LoopSource::Rank(0),
                    vec![rank(0, false), ShardSource::Checkpoint],
                )),
            ),
            // A checkpoint of step 5: everything goes back to it.
            (
                vec![member(10, &[sync(0, false, 10, true)]), fresh_member()],
                Some(ck(5)),
                Ok((
                    5,
                    LoopSource::Checkpoint,
                    vec![ShardSource::Checkpoint, ShardSource::Checkpoint],
                )),
            ),
        ];
        for (i, (members, ckpt, want)) in cases.into_iter().enumerate() {
            let got = plan(&members, 2, Pace::Sync, ckpt.as_ref());
            match want {
                Ok((step, src, shards)) => {
                    let p = got.unwrap_or_else(|e| panic!("case {i}: {e}"));
                    assert_eq!(
                        (p.step, p.loop_source, p.shards),
                        (step, src, shards),
                        "case {i}"
                    );
                }
                Err(lost) => assert_eq!(got, Err(PlanError::Lost { shards: lost }), "case {i}"),
            }
        }
    }

    #[test]
    fn asynchronous_plans() {
        // Shard 0 applied 0..7 and 9; its copy on server 1 lags (0..6). Shard 1 applied 0..8.
        // A worker (rank 2) is at step 12; the dead one's ticket 7 is missing on shard 0.
        let members = vec![
            member(7, &[asy(0, false, 7, &[9]), asy(1, true, 8, &[])]),
            member(8, &[asy(1, false, 8, &[]), asy(0, true, 6, &[])]),
            member(12, &[]),
        ];
        let p = plan(&members, 2, Pace::Async, None).unwrap();
        assert_eq!(p.step, 7);
        assert_eq!(p.loop_source, LoopSource::Rank(0));
        assert_eq!(p.shards, vec![rank(0, false), rank(1, false)]);
        assert_eq!(p.applied, vec![Applied::new(7, [9]), Applied::new(8, [])]);

        // Server 0 is replaced: shard 0 from its copy on server 1 (prefix 6), and the loop
        // moves forward to 6 from the lowest step at or before it (none is at 6: rank 2's
        // replacement joined without state).
        let members = vec![
            fresh_member(),
            member(5, &[asy(1, false, 8, &[]), asy(0, true, 6, &[])]),
            member(12, &[]),
        ];
        let p = plan(&members, 2, Pace::Async, None).unwrap();
        assert_eq!(p.step, 6);
        assert_eq!(p.loop_source, LoopSource::Advance { rank: 1, step: 6 });
        assert_eq!(p.shards, vec![rank(1, false), rank(1, false)]);

        // Both copies of shard 0 are gone: lost, then from the checkpoint of step 4, whose
        // shard 0 had applied 0..5 and 7.
        let members = vec![
            fresh_member(),
            member(9, &[asy(1, false, 9, &[])]),
            member(12, &[]),
        ];
        assert_eq!(
            plan(&members, 2, Pace::Async, None),
            Err(PlanError::Lost { shards: vec![0] })
        );
        let ck = CheckpointView {
            step: 4,
            applied: vec![Some(Applied::new(5, [7])), None],
        };
        let p = plan(&members, 2, Pace::Async, Some(&ck)).unwrap();
        assert_eq!(p.step, 4);
        assert_eq!(p.loop_source, LoopSource::Checkpoint);
        assert_eq!(p.shards, vec![ShardSource::Checkpoint, rank(1, false)]);
        assert_eq!(p.applied[0], Applied::new(5, [7]));

        // A new job.
        let p = plan(&[fresh_member(), fresh_member()], 2, Pace::Async, None).unwrap();
        assert_eq!(p.shards, vec![ShardSource::Init; 2]);
    }
}
