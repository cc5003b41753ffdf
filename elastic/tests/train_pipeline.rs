//! The pipeline strategy in one process: ranks are threads sharing an embedded store, each
//! running the elastic loop over its stage. A small tanh MLP on a generated dataset; the
//! results are compared with single-process training of the same model on the same global
//! batches, between schedules and layouts, and between runs with and without a failed rank.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::Linear;
use rekindle_elastic::store::TcpStoreServer;
use rekindle_elastic::train::strategy::pipeline::{
    Batch, OptimizerFactory, PipelineConfig, PipelineModel, PipelineStrategy, Schedule, SyncReport,
};
use rekindle_elastic::train::strategy::BoxError;
use rekindle_elastic::train::{
    Assignment, ElasticOptions, RunSummary, StateSource, TrainError, Trainer, WorkerEnv,
};
use rekindle_runtime::optim::{step_vars, AdamW, AdamWConfig, Optimizer, ParamSpec};
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler};
use rekindle_storage::{Checkpoint, Layout};

/// Layer widths: 4 layers.
const DIMS: [usize; 5] = [6, 12, 10, 8, 3];
const DATASET: usize = 96;
const BATCH: usize = 24;
const LR: f64 = 0.01;

struct Tiny;

impl PipelineModel for Tiny {
    fn layers(&self) -> usize {
        DIMS.len() - 1
    }

    fn params(&self, layer: usize) -> Vec<ParamSpec> {
        let (i, o) = (DIMS[layer], DIMS[layer + 1]);
        vec![
            ParamSpec::new(format!("l{layer}.weight"), &[o, i]),
            ParamSpec::new(format!("l{layer}.bias"), &[o]),
        ]
    }

    fn init(&self, layer: usize) -> Result<Vec<Tensor>, BoxError> {
        let (i, o) = (DIMS[layer], DIMS[layer + 1]);
        let val = |j: usize, salt: usize| {
            let x = ((j * 7919 + salt * 104_729 + layer * 15_485_863) % 1000) as f32;
            (x / 1000.0 - 0.5) / (i as f32).sqrt()
        };
        let w: Vec<f32> = (0..o * i).map(|j| val(j, 1)).collect();
        let b: Vec<f32> = (0..o).map(|j| val(j, 2)).collect();
        Ok(vec![
            Tensor::from_vec(w, (o, i), &Device::Cpu)?,
            Tensor::from_vec(b, o, &Device::Cpu)?,
        ])
    }

    fn layer(&self, layer: usize, params: &[Tensor]) -> Result<Box<dyn Module + Send>, BoxError> {
        Ok(Box::new(TinyLayer {
            linear: Linear::new(params[0].clone(), Some(params[1].clone())),
            tanh: layer + 2 < DIMS.len(),
        }))
    }

    fn output_shape(&self, layer: usize, samples: usize) -> Vec<usize> {
        vec![samples, DIMS[layer + 1]]
    }

    fn loss(&self, output: &Tensor, targets: &Tensor) -> Result<Tensor, BoxError> {
        Ok(candle_nn::loss::cross_entropy(output, targets)?)
    }
}

struct TinyLayer {
    linear: Linear,
    tanh: bool,
}

impl Module for TinyLayer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.linear.forward(x)?;
        if self.tanh {
            h.tanh()
        } else {
            Ok(h)
        }
    }
}

fn batch(indices: &[usize]) -> candle_core::Result<Batch> {
    let d = DIMS[0];
    let x: Vec<f32> = indices
        .iter()
        .flat_map(|&i| (0..d).map(move |k| ((i * 37 + k * 13) as f32 * 0.11).sin()))
        .collect();
    let y: Vec<u32> = indices
        .iter()
        .map(|&i| (((i * 37) as f32 * 0.11).sin() > 0.0) as u32 + (i % 5 == 0) as u32)
        .collect();
    Ok(Batch::new(
        Tensor::from_vec(x, (indices.len(), d), &Device::Cpu)?,
        Tensor::from_vec(y, indices.len(), &Device::Cpu)?,
    ))
}

fn adamw() -> OptimizerFactory {
    Box::new(|specs| Ok(Box::new(AdamW::new(AdamWConfig::new(LR), specs)?) as Box<dyn Optimizer>))
}

fn sampler() -> ElasticConfig {
    ElasticConfig::new(DATASET, BATCH).seed(9)
}

/// Single-process training: the whole global batch at once, the mean loss, one optimizer.
fn reference(steps: u64) -> BTreeMap<String, Vec<f32>> {
    let model = Tiny;
    let mut vars: Vec<Var> = Vec::new();
    let mut specs = Vec::new();
    let mut layers = Vec::new();
    for l in 0..model.layers() {
        let init = model.init(l).unwrap();
        let v: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let tensors: Vec<Tensor> = v.iter().map(|v| v.as_tensor().clone()).collect();
        layers.push(model.layer(l, &tensors).unwrap());
        vars.extend(v);
        specs.extend(model.params(l));
    }
    let mut opt = AdamW::new(AdamWConfig::new(LR), specs.clone()).unwrap();
    let mut s = ElasticSampler::new(sampler()).unwrap();
    for _ in 0..steps {
        if s.epoch_done() {
            s.set_epoch(s.epoch() + 1);
        }
        let planned = s.plan().unwrap();
        let b = batch(planned.indices()).unwrap();
        let mut h = b.inputs.clone();
        for l in &layers {
            h = l.forward(&h).unwrap();
        }
        let loss = model.loss(&h, &b.targets).unwrap();
        step_vars(&mut opt, &vars, &loss.backward().unwrap()).unwrap();
        s.commit(&planned).unwrap();
    }
    specs
        .iter()
        .zip(&vars)
        .map(|(p, v)| (p.name.clone(), flat(v.as_tensor())))
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// What one rank's thread ends with.
struct Outcome {
    rank: usize,
    result: Result<RunSummary, TrainError>,
    params: Option<BTreeMap<String, Vec<f32>>>,
    syncs: Vec<SyncReport>,
}

#[derive(Clone)]
struct Job {
    store: String,
    world: usize,
    steps: u64,
    config: PipelineConfig,
    dir: Option<std::path::PathBuf>,
    every: u64,
}

fn spawn_rank(job: &Job, rank: usize, fail_at: Option<u64>, done: mpsc::Sender<Outcome>) {
    let job = job.clone();
    let mut env = WorkerEnv::single("pipeline-test");
    env.assignment = Assignment {
        round: 0,
        rank,
        world_size: job.world,
        store_addr: Some(job.store.clone()),
        store_prefix: "job/".into(),
    };
    let options = ElasticOptions {
        checkpoint_dir: job.dir.clone(),
        checkpoint_every: job.every,
        keep_checkpoints: 100,
        op_timeout: Duration::from_secs(10),
        bootstrap_timeout: Duration::from_secs(20),
        rejoin_timeout: Duration::from_secs(60),
        progress: false,
        handle_signals: false,
        ..ElasticOptions::default()
    };
    std::thread::spawn(move || {
        let strategy = PipelineStrategy::new(Box::new(Tiny), adamw(), job.config.clone()).unwrap();
        let mut trainer = match Trainer::with_strategy(env, strategy, sampler(), options) {
            Ok(t) => t,
            Err(e) => {
                let _ = done.send(Outcome {
                    rank,
                    result: Err(e),
                    params: None,
                    syncs: Vec::new(),
                });
                return;
            }
        };
        let result = trainer.run(job.steps, |input| {
            if Some(input.step) == fail_at {
                return Err(format!("rank {rank} fails at step {}", input.step).into());
            }
            batch(input.indices).map_err(|e| Box::new(e) as BoxError)
        });
        let s = trainer.strategy();
        let params = s
            .parameters()
            .map(|p| p.iter().map(|(n, t)| (n.clone(), flat(t))).collect());
        let _ = done.send(Outcome {
            rank,
            result,
            params,
            syncs: s.syncs().to_vec(),
        });
    });
}

fn recv(rx: &mpsc::Receiver<Outcome>) -> Outcome {
    rx.recv_timeout(Duration::from_secs(180))
        .expect("a rank did not finish within 180 s")
}

fn server() -> (TcpStoreServer, String) {
    let secret = rekindle_runtime::JobSecret::from_env().unwrap();
    let s = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

fn job(store: &str, world: usize, steps: u64, config: PipelineConfig) -> Job {
    Job {
        store: store.to_string(),
        world,
        steps,
        config,
        dir: None,
        every: 0,
    }
}

/// Runs every rank of `job`; returns the outcomes in rank order.
fn run(job: &Job) -> Vec<Outcome> {
    let (tx, rx) = mpsc::channel();
    for rank in 0..job.world {
        spawn_rank(job, rank, None, tx.clone());
    }
    let mut out: Vec<Outcome> = (0..job.world).map(|_| recv(&rx)).collect();
    out.sort_by_key(|o| o.rank);
    for o in &out {
        let s = o
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {}: {e}", o.rank));
        assert_eq!(s.step, job.steps, "rank {}", o.rank);
    }
    out
}

fn params_of(out: &[Outcome]) -> BTreeMap<String, Vec<f32>> {
    out.iter()
        .find(|o| o.rank == 0)
        .and_then(|o| o.params.clone())
        .expect("rank 0 gathered the parameters")
}

fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(n, x)| x.iter().zip(&b[n]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// The tolerance against single-process training: the pipeline sums each micro-batch's
/// summed loss gradient and divides by the batch once, the reference averages the whole
/// batch; the difference is rounding, a few units in the last place per step.
const TOLERANCE: f32 = 1e-5;

#[test]
fn three_stages_match_single_process_training_and_both_schedules_agree_bit_for_bit() {
    let (_s, store) = server();
    let steps = 12;
    let one_f_one_b = params_of(&run(&job(
        &store,
        3,
        steps,
        PipelineConfig::new(3).micro_batches(4),
    )));
    let (_s2, store2) = server();
    let gpipe = params_of(&run(&job(
        &store2,
        3,
        steps,
        PipelineConfig::new(3)
            .micro_batches(4)
            .schedule(Schedule::GPipe),
    )));
    assert_eq!(
        gpipe, one_f_one_b,
        "GPipe and 1F1B accumulate in the same order"
    );
    let single = reference(steps);
    let d = max_diff(&one_f_one_b, &single);
    eprintln!("max |pipeline - single process| = {d:e}");
    assert!(d <= TOLERANCE, "max |pipeline - single process| = {d}");
    // The parameters moved: the comparison is not trivial.
    let init = reference(0);
    assert!(max_diff(&single, &init) > 1e-3);
}

#[test]
fn two_replicas_of_two_stages_match_single_process_training() {
    let (_s, store) = server();
    let steps = 10;
    let out = run(&job(
        &store,
        4,
        steps,
        PipelineConfig::new(2).micro_batches(3),
    ));
    for o in &out {
        assert_eq!(
            (o.syncs[0].replicas, o.syncs[0].stages),
            (2, 2),
            "rank {}",
            o.rank
        );
    }
    let d = max_diff(&params_of(&out), &reference(steps));
    eprintln!("max |2x2 pipeline - single process| = {d:e}");
    assert!(d <= TOLERANCE, "max |2x2 pipeline - single process| = {d}");
}

/// Rank `victim` fails at step `fail_at` and a replacement without state takes its place;
/// returns the outcomes of the survivors and the replacement.
fn fail_and_replace(job: &Job, victim: usize, fail_at: u64) -> Vec<Outcome> {
    let (tx, rx) = mpsc::channel();
    for rank in 0..job.world {
        spawn_rank(job, rank, (rank == victim).then_some(fail_at), tx.clone());
    }
    let failed = recv(&rx);
    assert_eq!(failed.rank, victim, "the failing rank ends first");
    assert!(
        matches!(failed.result, Err(TrainError::Step { step, .. }) if step == fail_at),
        "{:?}",
        failed.result.err()
    );
    spawn_rank(job, victim, None, tx.clone());
    let mut out: Vec<Outcome> = (0..job.world).map(|_| recv(&rx)).collect();
    out.sort_by_key(|o| o.rank);
    for o in &out {
        let s = o
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {}: {e}", o.rank));
        assert_eq!(s.step, job.steps);
    }
    out
}

#[test]
fn a_replaced_stage_takes_its_layers_from_the_neighbour_copy_and_ends_bit_identical() {
    // Two stages, no checkpoints at all: the last stage fails at step 7 and only its
    // neighbour's copy holds its layers.
    let (_s, store) = server();
    let config = PipelineConfig::new(2).micro_batches(3);
    let undisturbed = params_of(&run(&job(&store, 2, 14, config.clone())));
    let (_s2, store2) = server();
    let out = fail_and_replace(&job(&store2, 2, 14, config), 1, 7);
    assert_eq!(params_of(&out), undisturbed);
    let replacement = &out[1].syncs;
    assert_eq!(replacement.len(), 1, "{replacement:?}");
    let r = replacement[0];
    assert_eq!(r.step, 7, "no step was lost");
    assert_eq!(r.source, StateSource::Rank(0));
    // Its own layers from rank 0's copy, its copy (stage 0's layers) from rank 0's stage.
    assert_eq!((r.received, r.local, r.from_checkpoint), (4, 0, 0));
    let survivor = out[0].syncs.last().unwrap();
    assert_eq!((survivor.step, survivor.local), (7, 4));
}

#[test]
fn without_copies_a_lost_stage_rolls_the_group_back_to_the_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (_s, store) = server();
    let config = PipelineConfig::new(2)
        .micro_batches(2)
        .neighbour_copy(false);
    let undisturbed = params_of(&run(&job(&store, 2, 14, config.clone())));
    let (_s2, store2) = server();
    let mut j = job(&store2, 2, 14, config);
    j.dir = Some(dir.path().to_path_buf());
    j.every = 5;
    let out = fail_and_replace(&j, 1, 7);
    assert_eq!(
        params_of(&out),
        undisturbed,
        "the rollback replays steps 5..7 exactly"
    );
    let last = out[0].syncs.last().unwrap();
    assert_eq!(last.source, StateSource::Checkpoint);
    assert_eq!(last.step, 5);
}

fn open(dir: &Path, step: u64) -> Checkpoint {
    Checkpoint::open(&dir.join(format!("step-{step}")), &Default::default()).unwrap()
}

#[test]
fn a_checkpoint_of_three_stages_resumes_in_two_stages_and_loads_into_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let config = PipelineConfig::new(3).micro_batches(2);
    {
        let (_s, store) = server();
        let mut j = job(&store, 3, 6, config.clone());
        j.dir = Some(dir.path().to_path_buf());
        let first = params_of(&run(&j));
        // One manifest over three writers, every parameter by its own name: a single
        // process reads the whole model.
        let ckpt = open(dir.path(), 6);
        assert_eq!(ckpt.state().layout, Layout::Pipeline { stages: 3 });
        for (name, want) in &first {
            let got = ckpt.tensor(name).unwrap();
            assert_eq!(got.as_slice::<f32>().unwrap(), want.as_slice(), "{name}");
        }
        assert!(ckpt
            .names()
            .iter()
            .any(|n| n.starts_with("optim.l0.weight.")));
    }
    let (_s, store) = server();
    let mut j = job(&store, 2, 12, config.clone());
    j.dir = Some(dir.path().to_path_buf());
    let out = run(&j);
    for o in &out {
        assert_eq!(o.result.as_ref().unwrap().resumed_from, Some(6));
        let s = o.syncs[0];
        assert_eq!((s.step, s.stages), (6, 2));
    }
    // Stage boundaries do not change the arithmetic: the same as 12 undisturbed steps on
    // three stages.
    let (_s2, store2) = server();
    let straight = params_of(&run(&job(&store2, 3, 12, config.clone())));
    assert_eq!(params_of(&out), straight);
    // And into one process, which holds every layer.
    let (_s3, store3) = server();
    let mut j = job(&store3, 1, 14, config);
    j.dir = Some(dir.path().to_path_buf());
    let one = run(&j);
    assert_eq!(one[0].syncs[0].stages, 1);
    assert_eq!(one[0].result.as_ref().unwrap().resumed_from, Some(12));
}

#[test]
fn checkpoints_move_between_a_2x2_grid_and_three_stages() {
    let dir = tempfile::tempdir().unwrap();
    let run_in = |world: usize, stages: usize, steps: u64| {
        let (_s, store) = server();
        let mut j = job(
            &store,
            world,
            steps,
            PipelineConfig::new(stages).micro_batches(2),
        );
        j.dir = Some(dir.path().to_path_buf());
        run(&j)
    };
    // Two replicas of two stages write one manifest (each layer by one replica).
    let grid = run_in(4, 2, 6);
    assert_eq!(grid[0].syncs[0].replicas, 2);
    assert_eq!(
        open(dir.path(), 6).state().layout,
        Layout::Custom {
            name: "pipeline 2x2".into(),
            shards: 4
        }
    );
    // Three stages read it, and their checkpoint goes back into the 2x2 grid.
    let three = run_in(3, 3, 10);
    for o in &three {
        assert_eq!(o.result.as_ref().unwrap().resumed_from, Some(6));
        assert_eq!((o.syncs[0].replicas, o.syncs[0].stages), (1, 3));
    }
    let back = run_in(4, 2, 14);
    for o in &back {
        assert_eq!(o.result.as_ref().unwrap().resumed_from, Some(10));
        assert_eq!((o.syncs[0].replicas, o.syncs[0].stages), (2, 2));
    }
    // Every hand-over carried parameters and optimizer moments: the result is single-process
    // training of 14 steps.
    let d = max_diff(&params_of(&back), &reference(14));
    eprintln!("max |2x2 -> 3 -> 2x2 - single process| = {d:e}");
    assert!(
        d <= TOLERANCE,
        "max |2x2 -> 3 -> 2x2 - single process| = {d}"
    );
}
