//! The strategy seam of the elastic loop, through a strategy written against the public API
//! alone: state sharded over the ranks, a step that communicates in sub-groups and in the
//! whole group, sharded checkpoints, re-forming after a rank fails (its shard from the newest
//! checkpoint, or the whole state rolled back to it), and a resume into another world size.
//! Ranks are threads of this process sharing one embedded store.
//!
//! The toy model counts samples: `counts[j]` is the number of consumed samples `i` with
//! `i % LEN == j`, split into contiguous blocks, one per rank. After whole epochs the result
//! has a closed form, whatever failed in between.

use std::ops::Range;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rekindle_elastic::store::TcpStoreServer;
use rekindle_elastic::train::strategy::{
    BoxError, CheckpointPlan, Group, StateSource, StepDone, StepError, SubGroup,
};
use rekindle_elastic::train::{
    Assignment, ElasticOptions, RunSummary, StepInput, Strategy, TrainError, Trainer, WorkerEnv,
};
use rekindle_runtime::sampler::ElasticConfig;
use rekindle_runtime::{Buffer, ReduceOp};
use rekindle_storage::{Checkpoint, Layout, Snapshot};

/// Counters (the model's length).
const LEN: usize = 12;
/// Dataset and global batch: 6 steps per epoch.
const DATASET: usize = 48;
const BATCH: usize = 8;

fn block(rank: usize, world: usize) -> Range<usize> {
    rekindle_runtime::collectives::segment(LEN, world, rank)
}

fn name(j: usize) -> String {
    format!("counts.{j:02}")
}

struct Counts {
    rank: usize,
    world: usize,
    /// The block held and its values, at `at_step`.
    block: Range<usize>,
    values: Vec<f32>,
    at_step: u64,
    held: bool,
    pair: Option<SubGroup>,
    /// How the last sync ended, for the assertions.
    synced: Vec<StateSource>,
}

impl Counts {
    fn new() -> Counts {
        Counts {
            rank: 0,
            world: 0,
            block: 0..0,
            values: Vec::new(),
            at_step: 0,
            held: false,
            pair: None,
            synced: Vec::new(),
        }
    }

    fn wait(
        group: &Group<'_>,
        work: rekindle_runtime::Work,
        during: &'static str,
    ) -> Result<Vec<f32>, StepError> {
        let out = work
            .wait(group.wait())
            .map_err(|e| StepError::collective(during, e))?;
        out.into_vec::<f32>()
            .map_err(|_| StepError::state(during, "not f32"))
    }

    fn sum(group: &Group<'_>, v: Vec<f32>, during: &'static str) -> Result<Vec<f32>, StepError> {
        Self::wait(
            group,
            group.pg().all_reduce(Buffer::from(v), ReduceOp::Sum),
            during,
        )
    }
}

fn held(m: &rekindle_elastic::train::form::Member) -> Option<(Range<usize>, u64)> {
    let b = m.holds.get("block")?.as_array()?;
    let a = b.first()?.as_u64()? as usize;
    let e = b.get(1)?.as_u64()? as usize;
    Some((a..e, m.holds.get("step")?.as_u64()?))
}

impl Strategy for Counts {
    type Output = Vec<f32>;

    fn name(&self) -> &'static str {
        "counts"
    }

    fn restore(&mut self, ckpt: &Checkpoint, rank: usize, world: usize) -> Result<(), StepError> {
        self.block = block(rank, world);
        self.values = self
            .block
            .clone()
            .map(|j| {
                let t = ckpt.tensor(&name(j))?;
                Ok(t.as_slice::<f32>().map_or(f32::NAN, |s| s[0]))
            })
            .collect::<Result<_, rekindle_storage::StorageError>>()?;
        self.at_step = ckpt.step();
        self.held = true;
        Ok(())
    }

    fn holdings(&self) -> serde_json::Value {
        if !self.held {
            return serde_json::Value::Null;
        }
        serde_json::json!({ "block": [self.block.start, self.block.end], "step": self.at_step })
    }

    fn sync(&mut self, group: &mut Group<'_>) -> Result<StateSource, StepError> {
        let (rank, world) = (group.rank(), group.world_size());
        // Pairs of ranks share a sub-group: [0, 1], [2, 3], ...
        let first = rank - rank % 2;
        let pair: Vec<usize> = (first..(first + 2).min(world)).collect();
        self.pair = Some(group.subgroup("pair", &pair)?);
        // The newest step any holder is at, and whether the holders at that step cover it all.
        let holders: Vec<Option<(Range<usize>, u64)>> = group.members().iter().map(held).collect();
        let newest = holders.iter().flatten().map(|(_, s)| *s).max();
        let mut covered = [false; LEN];
        for (b, s) in holders.iter().flatten() {
            if Some(*s) == newest {
                b.clone().for_each(|j| covered[j] = true);
            }
        }
        // Every rank contributes what it holds at that step; the sum is the whole state.
        let mut dense = vec![0.0f32; LEN];
        if self.held && Some(self.at_step) == newest {
            for (j, v) in self.block.clone().zip(&self.values) {
                dense[j] = *v;
            }
        }
        let whole = Self::sum(group, dense, "gathering the shards")?;
        let ckpt = group.newest_checkpoint()?;
        let (source, whole, step) = match newest {
            None => (StateSource::Rank(0), vec![0.0; LEN], 0),
            Some(s) if covered.iter().all(|&c| c) => {
                let src = (0..world)
                    .find(|&r| holders[r].as_ref().is_some_and(|(_, hs)| *hs == s))
                    .unwrap_or(0);
                (StateSource::Rank(src), whole, s)
            }
            Some(s) => {
                let Some(ckpt) = ckpt else {
                    return Err(StepError::state(
                        "sync",
                        "a shard is lost and there is no checkpoint",
                    ));
                };
                let from_ckpt = |j: usize| -> Result<f32, StepError> {
                    Ok(ckpt
                        .tensor(&name(j))?
                        .as_slice::<f32>()
                        .map_or(f32::NAN, |v| v[0]))
                };
                if ckpt.step() == s {
                    // The lost shards are in a checkpoint of this very step.
                    let mut whole = whole;
                    for j in 0..LEN {
                        if !covered[j] {
                            whole[j] = from_ckpt(j)?;
                        }
                    }
                    let src = (0..world)
                        .find(|&r| holders[r].as_ref().is_some_and(|(_, hs)| *hs == s))
                        .unwrap_or(0);
                    (StateSource::Rank(src), whole, s)
                } else {
                    let whole = (0..LEN).map(from_ckpt).collect::<Result<Vec<_>, _>>()?;
                    (StateSource::Checkpoint, whole, ckpt.step())
                }
            }
        };
        self.rank = rank;
        self.world = world;
        self.block = block(rank, world);
        self.values = whole[self.block.clone()].to_vec();
        self.at_step = step;
        self.held = true;
        self.synced.push(source);
        Ok(source)
    }

    fn step(
        &mut self,
        group: &mut Group<'_>,
        input: &StepInput<'_>,
        step_fn: &mut dyn FnMut(&StepInput<'_>) -> Result<Vec<f32>, BoxError>,
    ) -> Result<StepDone, StepError> {
        let delta = step_fn(input).map_err(StepError::Program)?;
        let pair = self
            .pair
            .as_ref()
            .ok_or_else(|| StepError::state("step", "no pair"))?;
        let pair_sum = pair
            .pg()
            .all_reduce(Buffer::from(delta), ReduceOp::Sum)
            .wait(group.wait())
            .map_err(|e| pair.error("the pair's sum", e))?
            .into_vec::<f32>()
            .map_err(|_| StepError::state("step", "not f32"))?;
        let leader = pair.pg().rank() == 0;
        let mine = if leader { pair_sum } else { vec![0.0; LEN] };
        let total = Self::sum(group, mine, "the total")?;
        // Atomic: the state changes only once every collective of the step succeeded.
        for (v, d) in self.values.iter_mut().zip(&total[self.block.clone()]) {
            *v += d;
        }
        self.at_step += 1;
        Ok(StepDone {
            global_samples: total.iter().sum::<f32>() as u64,
            ..StepDone::default()
        })
    }

    fn checkpoint_plan(&self, world: usize) -> CheckpointPlan {
        CheckpointPlan::Sharded(Layout::Custom {
            name: "counts".into(),
            shards: world,
        })
    }

    fn checkpoint(&self, snap: &mut Snapshot) -> Result<(), StepError> {
        for (j, v) in self.block.clone().zip(&self.values) {
            snap.insert_in(
                "model",
                &name(j),
                rekindle_runtime::Device::Cpu,
                rekindle_storage::HostTensor::from_slice(&[1], &[*v])?,
            )?;
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.pair = None;
    }
}

/// What one rank's thread ends with.
type Outcome = (
    Result<RunSummary, TrainError>,
    Vec<f32>,
    Range<usize>,
    Vec<StateSource>,
);

/// One job: its store, world size, steps, checkpoint directory and checkpoint interval.
struct Job<'a> {
    store: &'a str,
    world: usize,
    steps: u64,
    dir: &'a Path,
    every: u64,
}

/// Runs rank `rank` of `job` on a thread; its step function fails at `fail_at`.
fn spawn_rank(
    job: &Job<'_>,
    rank: usize,
    fail_at: Option<u64>,
    done: mpsc::Sender<(usize, Outcome)>,
) {
    let Job {
        store,
        world,
        steps,
        dir,
        every,
    } = *job;
    let mut env = WorkerEnv::single("strategy-test");
    env.assignment = Assignment {
        round: 0,
        rank,
        world_size: world,
        store_addr: Some(store.to_string()),
        store_prefix: "job/".into(),
    };
    let options = ElasticOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: every,
        keep_checkpoints: 100,
        op_timeout: Duration::from_secs(10),
        bootstrap_timeout: Duration::from_secs(20),
        rejoin_timeout: Duration::from_secs(60),
        progress: false,
        handle_signals: false,
        ..ElasticOptions::default()
    };
    std::thread::spawn(move || {
        let data = ElasticConfig::new(DATASET, BATCH).seed(5);
        let mut trainer = match Trainer::with_strategy(env, Counts::new(), data, options) {
            Ok(t) => t,
            Err(e) => {
                let _ = done.send((rank, (Err(e), Vec::new(), 0..0, Vec::new())));
                return;
            }
        };
        let out = trainer.run(steps, |input| {
            if Some(input.step) == fail_at {
                return Err(format!("rank {rank} fails at step {}", input.step));
            }
            let mut delta = vec![0.0f32; LEN];
            for &i in input.indices {
                delta[i % LEN] += 1.0;
            }
            Ok(delta)
        });
        let s = trainer.strategy();
        let _ = done.send((
            rank,
            (out, s.values.clone(), s.block.clone(), s.synced.clone()),
        ));
    });
}

fn recv(rx: &mpsc::Receiver<(usize, Outcome)>) -> (usize, Outcome) {
    rx.recv_timeout(Duration::from_secs(120))
        .expect("a rank did not finish within 120 s")
}

/// Every counter after `epochs` whole epochs: each residue class mod LEN has DATASET / LEN
/// samples per epoch.
fn expected(epochs: usize) -> f32 {
    (epochs * DATASET / LEN) as f32
}

fn check_final(outcomes: &[(usize, Outcome)], steps: u64, world: usize) {
    let epochs = steps as usize * BATCH / DATASET;
    for (rank, (out, values, blk, _)) in outcomes {
        let summary = out.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(summary.step, steps);
        assert_eq!(*blk, block(*rank, world), "rank {rank}'s block");
        assert!(
            values.iter().all(|&v| v == expected(epochs)),
            "rank {rank}: {values:?}, expected {} everywhere",
            expected(epochs)
        );
    }
}

fn run_job(job: &Job<'_>) -> Vec<(usize, Outcome)> {
    let (tx, rx) = mpsc::channel();
    for rank in 0..job.world {
        spawn_rank(job, rank, None, tx.clone());
    }
    (0..job.world).map(|_| recv(&rx)).collect()
}

fn server() -> (TcpStoreServer, String) {
    let secret = rekindle_runtime::JobSecret::from_env().unwrap();
    let s = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

#[test]
fn sharded_state_with_sub_groups_trains_and_checkpoints_its_shards() {
    let (_server, store) = server();
    let dir = tempfile::tempdir().unwrap();
    let outcomes = run_job(&Job {
        store: &store,
        world: 3,
        steps: 30,
        dir: dir.path(),
        every: 10,
    });
    check_final(&outcomes, 30, 3);
    let ckpt = Checkpoint::open(&dir.path().join("step-30"), &Default::default()).unwrap();
    assert_eq!(ckpt.state().world_size, 3);
    for j in 0..LEN {
        assert_eq!(
            ckpt.tensor(&name(j)).unwrap().as_slice::<f32>().unwrap(),
            &[expected(5)]
        );
    }
    for (rank, (_, _, _, synced)) in &outcomes {
        assert_eq!(
            synced,
            &[StateSource::Rank(0)],
            "rank {rank}: one fresh group"
        );
    }
}

/// Rank 1 fails at step `fail_at`, and a replacement with no state takes its place.
fn fail_and_replace(every: u64, fail_at: u64) -> Vec<(usize, Outcome)> {
    let (_server, store) = server();
    let dir = tempfile::tempdir().unwrap();
    let job = Job {
        store: &store,
        world: 3,
        steps: 36,
        dir: dir.path(),
        every,
    };
    let (tx, rx) = mpsc::channel();
    spawn_rank(&job, 0, None, tx.clone());
    spawn_rank(&job, 1, Some(fail_at), tx.clone());
    spawn_rank(&job, 2, None, tx.clone());
    let (rank, (out, ..)) = recv(&rx);
    assert_eq!(rank, 1, "the failing rank ends first");
    assert!(
        matches!(out, Err(TrainError::Step { step, .. }) if step == fail_at),
        "{out:?}"
    );
    spawn_rank(&job, 1, None, tx.clone());
    let outcomes: Vec<_> = (0..3).map(|_| recv(&rx)).collect();
    check_final(&outcomes, 36, 3);
    outcomes
}

#[test]
fn a_lost_shard_comes_from_a_checkpoint_of_the_same_step() {
    // A checkpoint every 5 steps; rank 1 fails computing step 25 (index), after the
    // checkpoint of step 25: the survivors hold their shards at step 25 and the lost one is
    // in the checkpoint.
    let outcomes = fail_and_replace(5, 25);
    for (rank, (_, _, _, synced)) in outcomes {
        if rank != 1 {
            assert_eq!(
                synced,
                vec![StateSource::Rank(0), StateSource::Rank(0)],
                "rank {rank}"
            );
        }
    }
}

#[test]
fn without_a_current_checkpoint_the_group_rolls_back_to_the_newest() {
    // Checkpoints at 10 and 20; rank 1 fails at step 25: its shard at 25 is nowhere, so the
    // whole state goes back to step 20 and steps 20..36 are taken again.
    let outcomes = fail_and_replace(10, 25);
    for (rank, (_, _, _, synced)) in outcomes {
        if rank != 1 {
            assert_eq!(
                synced,
                vec![StateSource::Rank(0), StateSource::Checkpoint],
                "rank {rank}"
            );
        }
    }
}

#[test]
fn a_checkpoint_of_two_shards_resumes_in_three() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (_server, store) = server();
        let job = Job {
            store: &store,
            world: 2,
            steps: 12,
            dir: dir.path(),
            every: 0,
        };
        check_final(&run_job(&job), 12, 2);
    }
    let (_server, store) = server();
    let outcomes = run_job(&Job {
        store: &store,
        world: 3,
        steps: 30,
        dir: dir.path(),
        every: 0,
    });
    check_final(&outcomes, 30, 3);
    for (rank, (out, ..)) in &outcomes {
        assert_eq!(out.as_ref().unwrap().resumed_from, Some(12), "rank {rank}");
    }
}
