//! Forming the group of a round: the generation protocol.
//!
//! Within one round of the agent's rendezvous the world size and every rank are fixed; what
//! changes is which processes hold the ranks (a failed worker is restarted by its agent with
//! the same rank). The ranks agree on a *generation*, a number in the round's store:
//!
//! - `gen` holds the current generation (absent: 0);
//! - `gen/<g>/<rank>` is created (compare-and-set on absent) by the process that holds
//!   `rank` in generation `g`, with its [`Member`] record.
//!
//! A process joins the current generation by creating its key. If the key already exists,
//! the rank was a member of that generation already (the process failed out of it, or it
//! replaces a process that did), so the generation is over: the process opens `g + 1` (a
//! compare-and-set of `gen` from `g`; whoever loses the race sees the new value) and joins
//! that. The generation forms when every rank's key exists; a process that waits and sees
//! `gen` move on joins the newer generation. Every step is a single store operation, so no
//! interleaving leaves two processes of one rank in a generation or a survivor behind.

use std::time::{Duration, Instant};

use rekindle_runtime::store::{CasOutcome, Store, StoreError};
use serde::{Deserialize, Serialize};

use super::TrainError;

/// What a process says about itself when it joins a generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The step its state is at (0 without state).
    pub step: u64,
    /// True if it holds training state (it survived a group, or restored a checkpoint).
    pub has_state: bool,
    /// Its process id.
    pub pid: u32,
    /// Its agent's node id (`REKINDLE_NODE_ID`; empty without an agent).
    #[serde(default)]
    pub node: String,
    /// What it holds of a sharded state, as its strategy describes it
    /// ([`Strategy::holdings`](super::Strategy::holdings); null for replicated state).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub holds: serde_json::Value,
}

/// The key under which a rank asks `node`'s agent to kill its worker `pid`, which stopped
/// responding (the agent then replaces it like a worker that died). The value is an
/// [`EvictionNotice`](super::liveness::EvictionNotice) as JSON: the agent acts on it only if
/// the worker is stopped or stuck in that group (see [`super::liveness`]).
pub fn evict_key(node: &str, pid: u32) -> String {
    format!("evict/{node}/{pid}")
}

/// How often a waiting process looks for a newer generation or an interruption.
const WAIT_SLICE: Duration = Duration::from_millis(100);

const GEN_KEY: &str = "gen";

fn member_key(generation: u64, rank: usize) -> String {
    format!("gen/{generation}/{rank}")
}

fn store_err(rank: usize, during: &'static str) -> impl Fn(StoreError) -> TrainError {
    move |source| TrainError::Store {
        rank,
        during,
        source,
    }
}

fn parse_gen(raw: Option<&[u8]>) -> u64 {
    raw.and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn current(store: &dyn Store, rank: usize) -> Result<(u64, Option<Vec<u8>>), TrainError> {
    let raw = store
        .get(GEN_KEY)
        .map_err(store_err(rank, "reading the generation"))?;
    Ok((parse_gen(raw.as_deref()), raw))
}

/// The current generation number.
pub(crate) fn current_generation(store: &dyn Store, rank: usize) -> Result<u64, TrainError> {
    Ok(current(store, rank)?.0)
}

/// Opens generation `generation + 1` unless the store has already moved past `generation`.
fn open_next(store: &dyn Store, rank: usize, generation: u64) -> Result<(), TrainError> {
    let (now, raw) = current(store, rank)?;
    if now != generation {
        return Ok(());
    }
    let next = (generation + 1).to_string();
    // Losing the race is fine: someone else opened it.
    store
        .compare_and_set(GEN_KEY, raw.as_deref(), next.as_bytes())
        .map_err(store_err(rank, "opening a generation"))?;
    Ok(())
}

/// Whether a store error may pass (the store is unreachable for now: a partition, a
/// restarting etcd) rather than say something about the request.
fn transient(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Connection { .. } | StoreError::Backend { .. } | StoreError::Timeout { .. }
    )
}

/// Joins the current generation as `rank` of `world_size` and waits until every rank has
/// joined it; returns the generation and every rank's [`Member`] record, in rank order.
/// `interrupted` is asked between waits (about every 100 ms); when it says true the wait
/// ends with `Ok(None)`. An unreachable store is waited for (a rank cut off by a partition
/// rejoins when it heals, instead of failing). Fails with [`TrainError::RejoinTimeout`]
/// after `timeout`, or with the store's error if it was still unreachable then.
pub fn join_generation(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    me: &Member,
    timeout: Duration,
    round: u64,
    mut interrupted: impl FnMut() -> bool,
) -> Result<Option<(u64, Vec<Member>)>, TrainError> {
    let start = Instant::now();
    let body = serde_json::to_vec(me).map_err(|e| TrainError::Config {
        reason: format!("cannot encode the member record: {e}"),
    })?;
    let mut reported = false;
    // Generations this call has sent its record to. Finding our record there means an
    // earlier attempt's write went through although its answer was lost; finding an equal
    // record anywhere else is a stale one from an earlier re-formation.
    let mut written = Vec::new();
    loop {
        match join_once(
            store,
            rank,
            world_size,
            &body,
            (start, timeout),
            round,
            &mut written,
            &mut interrupted,
        ) {
            Err(TrainError::Store { source, during, .. })
                if transient(&source) && start.elapsed() < timeout =>
            {
                if !reported {
                    tracing::warn!(rank, during, error = %source, "the round's store is unreachable; waiting for it");
                    reported = true;
                }
                if interrupted() {
                    return Ok(None);
                }
                std::thread::sleep(WAIT_SLICE);
            }
            out => return out,
        }
    }
}

/// One attempt of [`join_generation`], from reading the generation on. `written` lists
/// the generations earlier attempts of the same call sent the record to.
#[allow(clippy::too_many_arguments)]
fn join_once(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    body: &[u8],
    (start, timeout): (Instant, Duration),
    round: u64,
    written: &mut Vec<u64>,
    interrupted: &mut impl FnMut() -> bool,
) -> Result<Option<(u64, Vec<Member>)>, TrainError> {
    let (mut generation, _) = current(store, rank)?;
    'join: loop {
        let retried = written.contains(&generation);
        if !retried {
            written.push(generation);
        }
        match store
            .compare_and_set(&member_key(generation, rank), None, body)
            .map_err(store_err(rank, "joining a generation"))?
        {
            CasOutcome::Swapped => {}
            // Our own record: an earlier attempt's write went through although its answer
            // was lost.
            CasOutcome::Current(Some(v)) if retried && v == body => {}
            CasOutcome::Current(_) => {
                open_next(store, rank, generation)?;
                generation = current(store, rank)?.0;
                continue 'join;
            }
        }
        tracing::debug!(rank, generation, "joined; waiting for the other ranks");
        let keys: Vec<String> = (0..world_size).map(|r| member_key(generation, r)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            match store.wait(&refs, WAIT_SLICE) {
                Ok(values) => {
                    let members = values
                        .iter()
                        .zip(&keys)
                        .map(|(v, key)| {
                            serde_json::from_slice::<Member>(v).map_err(|e| TrainError::Store {
                                rank,
                                during: "reading the members of a generation",
                                source: StoreError::InvalidValue {
                                    key: key.clone(),
                                    reason: e.to_string(),
                                },
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    return Ok(Some((generation, members)));
                }
                Err(StoreError::Timeout { .. }) => {}
                Err(e) => return Err(store_err(rank, "waiting for a generation")(e)),
            }
            if interrupted() {
                return Ok(None);
            }
            let (now, _) = current(store, rank)?;
            if now > generation {
                generation = now;
                continue 'join;
            }
            if start.elapsed() >= timeout {
                let mut missing = Vec::new();
                for (r, key) in keys.iter().enumerate() {
                    if store
                        .get(key)
                        .map_err(store_err(rank, "waiting for a generation"))?
                        .is_none()
                    {
                        missing.push(r);
                    }
                }
                return Err(TrainError::RejoinTimeout {
                    rank,
                    round,
                    generation,
                    waited: start.elapsed(),
                    missing,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rekindle_runtime::store::InMemoryStore;
    use std::sync::Arc;

    fn member(step: u64, has_state: bool) -> Member {
        Member {
            step,
            has_state,
            pid: 1,
            node: "n".into(),
            holds: serde_json::json!({ "layers": [0, 1] }),
        }
    }

    fn join_all(store: &Arc<InMemoryStore>, who: &[(usize, Member)], world: usize) -> Vec<u64> {
        let handles: Vec<_> = who
            .iter()
            .cloned()
            .map(|(rank, m)| {
                let store = store.clone();
                std::thread::spawn(move || {
                    join_generation(
                        store.as_ref(),
                        rank,
                        world,
                        &m,
                        Duration::from_secs(10),
                        0,
                        || false,
                    )
                    .unwrap()
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap().0).collect()
    }

    #[test]
    fn first_generation_forms_with_every_rank() {
        let store = Arc::new(InMemoryStore::new());
        let gens = join_all(
            &store,
            &[
                (0, member(0, false)),
                (1, member(0, false)),
                (2, member(0, false)),
            ],
            3,
        );
        assert_eq!(gens, vec![0, 0, 0]);
    }

    #[test]
    fn a_survivor_and_a_replacement_form_the_next_generation() {
        let store = Arc::new(InMemoryStore::new());
        assert_eq!(
            join_all(&store, &[(0, member(0, false)), (1, member(0, false))], 2),
            vec![0, 0]
        );
        // Rank 1 died; the survivor (rank 0, at step 7) and the replacement come back, in
        // either order: both land in generation 1 and see each other's records.
        for _ in 0..20 {
            let gens = join_all(&store, &[(0, member(7, true)), (1, member(0, false))], 2);
            assert_eq!(gens[0], gens[1]);
        }
        let (g, members) = join_generation(
            store.as_ref(),
            0,
            1,
            &member(9, true),
            Duration::from_secs(1),
            0,
            || false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(g, 21, "each re-formation opened exactly one generation");
        assert_eq!(members, vec![member(9, true)]);
    }

    #[test]
    fn an_equal_record_from_an_earlier_generation_is_not_taken_for_a_join() {
        let store = Arc::new(InMemoryStore::new());
        assert_eq!(
            join_all(&store, &[(0, member(0, false)), (1, member(0, false))], 2),
            vec![0, 0]
        );
        // Rank 1 re-forms without having trained a step, so its record is byte for byte the
        // one in generation 0: it must open generation 1 and wait there for rank 0, not
        // return generation 0's members.
        let err = join_generation(
            store.as_ref(),
            1,
            2,
            &member(0, false),
            Duration::from_millis(250),
            0,
            || false,
        )
        .unwrap_err();
        match err {
            TrainError::RejoinTimeout {
                generation,
                missing,
                ..
            } => {
                assert_eq!(generation, 1);
                assert_eq!(missing, vec![0]);
            }
            other => panic!("unexpected error: {other}"),
        }
    }

    /// A store that applies the first compare-and-set it is sent and then answers it with
    /// a connection error, as a store does whose reply is lost in a partition.
    struct LosesFirstCasAnswer {
        inner: InMemoryStore,
        lost: std::sync::atomic::AtomicBool,
    }

    impl Store for LosesFirstCasAnswer {
        fn set(&self, key: &str, value: &[u8]) -> rekindle_runtime::store::StoreResult<()> {
            self.inner.set(key, value)
        }
        fn get(&self, key: &str) -> rekindle_runtime::store::StoreResult<Option<Vec<u8>>> {
            self.inner.get(key)
        }
        fn wait(
            &self,
            keys: &[&str],
            timeout: Duration,
        ) -> rekindle_runtime::store::StoreResult<Vec<Vec<u8>>> {
            self.inner.wait(keys, timeout)
        }
        fn add(&self, key: &str, delta: i64) -> rekindle_runtime::store::StoreResult<i64> {
            self.inner.add(key, delta)
        }
        fn compare_and_set(
            &self,
            key: &str,
            expected: Option<&[u8]>,
            value: &[u8],
        ) -> rekindle_runtime::store::StoreResult<CasOutcome> {
            let out = self.inner.compare_and_set(key, expected, value)?;
            if self.lost.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Connection {
                    endpoint: "test".into(),
                    reason: "the answer was lost".into(),
                });
            }
            Ok(out)
        }
        fn delete_prefix(&self, prefix: &str) -> rekindle_runtime::store::StoreResult<u64> {
            self.inner.delete_prefix(prefix)
        }
    }

    #[test]
    fn a_join_whose_answer_was_lost_is_not_taken_for_a_stranger() {
        let store = LosesFirstCasAnswer {
            inner: InMemoryStore::new(),
            lost: true.into(),
        };
        // The write lands, its answer does not; the retry finds the record it sent and
        // stays in generation 0 instead of opening another one.
        let (g, members) = join_generation(
            &store,
            0,
            1,
            &member(3, true),
            Duration::from_secs(5),
            0,
            || false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(g, 0);
        assert_eq!(members, vec![member(3, true)]);
        assert_eq!(current_generation(&store, 0).unwrap(), 0);
    }

    #[test]
    fn a_missing_rank_times_out_naming_it() {
        let store = InMemoryStore::new();
        let err = join_generation(
            &store,
            1,
            3,
            &member(0, false),
            Duration::from_millis(250),
            4,
            || false,
        )
        .unwrap_err();
        match err {
            TrainError::RejoinTimeout {
                missing,
                generation,
                round,
                ..
            } => {
                assert_eq!(missing, vec![0, 2]);
                assert_eq!((generation, round), (0, 4));
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn an_interruption_ends_the_wait() {
        let store = InMemoryStore::new();
        let mut asked = 0;
        let out = join_generation(
            &store,
            0,
            2,
            &member(0, false),
            Duration::from_secs(30),
            0,
            || {
                asked += 1;
                asked == 2
            },
        )
        .unwrap();
        assert!(out.is_none());
        assert_eq!(asked, 2);
    }
}
