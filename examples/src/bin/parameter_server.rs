//! Parameter-server training of the example MLP (seed 5.2): the first `--servers` ranks hold
//! the parameters, sharded, and the others compute gradients, one process per rank:
//!
//! ```text
//! rekindle run --standalone --nproc-per-node 4 target/release/parameter_server \
//!     --servers 1 --mode sync --steps 300 --seed 7
//! ```
//!
//! `--mode sync`: each step's global batch (`--batch`) is split among the workers, every
//! server waits for every worker's gradients, sums them in worker order and updates its
//! shard; the result equals DDP's on as many ranks as there are workers, up to the order of
//! the sum. `--mode async --staleness T`: each step's batch is computed by one worker, dealt
//! by server 0, and applied by each server when it arrives; a push more than `T` updates
//! behind its shard is computed again from fresh parameters (`--staleness none`: no bound).
//! Servers print their pushes' staleness at the end. Kill a worker or a server (with
//! `--max-restarts`) and the job re-forms: a server's shard comes from the copy its successor
//! keeps, or from the newest checkpoint. At the end rank 0 prints
//! `final_step=<N> params_sha256=<hex>`, the fingerprint DDP's example prints.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};
use rekindle_elastic::train::strategy::{ParameterServer, PsConfig, PsMode};
use rekindle_elastic::train::{
    self, CollectiveBackend, ElasticOptions, RunEnd, StepOutput, Trainer,
};
use rekindle_examples::mlp::{params_sha256, Mlp, MlpConfig, TeacherDataset};
use rekindle_runtime::optim::{Optimizer, Sgd, SgdConfig};
use rekindle_runtime::sampler::ElasticConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Sync,
    Async,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(Debug, Parser)]
#[command(
    about = "Parameter-server training of an MLP on a generated dataset",
    args_override_self = true
)]
struct Args {
    /// Ranks that serve (the first ranks of the job); the others work.
    #[arg(long, default_value_t = 1)]
    servers: usize,
    /// Synchronous (every step waits for every worker) or asynchronous.
    #[arg(long, value_enum, default_value = "sync")]
    mode: Mode,
    /// Asynchronous mode: the most updates a push may be behind its shard ("none": no bound).
    #[arg(long, default_value = "none")]
    staleness: String,
    /// Steps to train (a resumed run counts the checkpoint's steps).
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Samples per step: split among the workers (sync), one worker's batch (async).
    #[arg(long, default_value_t = 512)]
    batch: usize,
    /// Layer sizes.
    #[arg(long, default_value = "784-1024-1024-10")]
    layers: String,
    /// Samples in the generated dataset.
    #[arg(long, default_value_t = 200_000)]
    dataset: usize,
    /// Learning rate (SGD with momentum 0.9).
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// Seed of the initial parameters, the dataset and the data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Tensors with fewer elements are never split over servers.
    #[arg(long, default_value_t = 1 << 16)]
    min_split: usize,
    /// With two servers or more, each keeps an in-memory copy of its predecessor's shard, so
    /// that a lost server loses no step (`on`); `off` saves that traffic, and a lost server's
    /// shard then comes from the newest checkpoint (the job goes back to its step).
    #[arg(long, value_enum, default_value = "on")]
    shard_copies: Switch,
    /// Checkpoint directory (resumes from its newest valid checkpoint).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end and on SIGTERM).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Rank 0 appends the loss curve here (CSV).
    #[arg(long)]
    loss_csv: Option<PathBuf>,
    /// Compute threads per rank (default: the cores divided among the node's ranks).
    #[arg(long)]
    threads: Option<usize>,
    /// Print `step=<N> loss=<L>` on the first worker every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    log_every: u64,
    /// Every worker prints `progress rank=<R> samples=<S> secs=<T>` every this many of its
    /// own steps (0: never): what it computed since it started.
    #[arg(long, default_value_t = 0)]
    progress_every: u64,
    /// Collective deadline in seconds (a peer silent this long counts as lost).
    #[arg(long, default_value_t = 30.0)]
    op_timeout: f64,
    /// Collective backend: `tcp`, or `nccl` on cuda:LOCAL_RANK (a build with the `nccl`
    /// feature; host buffers are staged through the device).
    #[arg(long, default_value = "tcp")]
    backend: CollectiveBackend,
}

fn staleness(s: &str) -> Result<Option<u64>> {
    if s == "none" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .with_context(|| format!("--staleness {s:?}: a number of updates, or none"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.servers == 0 {
        bail!("--servers must be at least 1");
    }
    let mode = match args.mode {
        Mode::Sync => PsMode::Sync,
        Mode::Async => PsMode::Async {
            staleness: staleness(&args.staleness)?,
        },
    };
    let local_world: usize = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = args.threads.unwrap_or((cores / local_world.max(1)).max(1));
    // candle's CPU kernels read this once, on first use.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());

    let worker = train::init()?;
    let rank = worker.assignment.rank;
    let role = if rank < args.servers {
        "server"
    } else {
        "worker"
    };
    println!(
        "rank={rank} pid={} world_size={} role={role} threads={threads}",
        std::process::id(),
        worker.assignment.world_size
    );
    let config = MlpConfig::parse(&args.layers)?;
    let data = TeacherDataset::new(args.dataset, config.input, config.classes, args.seed)?;
    let varmap = VarMap::new();
    let model = Mlp::new(&config, &varmap, args.seed, &Device::Cpu)?;
    let lr = args.lr;
    let factory = Box::new(move |specs| {
        let opt: Box<dyn Optimizer> = Box::new(Sgd::new(SgdConfig::new(lr).momentum(0.9), specs)?);
        Ok(opt)
    });
    let mut ps_config = PsConfig::new(args.servers, mode);
    ps_config.min_split = args.min_split;
    ps_config.copies = args.shard_copies == Switch::On;
    let strategy = ParameterServer::new(varmap.clone(), factory, ps_config)?;
    let sampler = ElasticConfig::new(args.dataset, args.batch).seed(args.seed);
    let options = ElasticOptions {
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        loss_csv: args.loss_csv.clone(),
        op_timeout: std::time::Duration::from_secs_f64(args.op_timeout),
        backend: args.backend,
        ..ElasticOptions::default()
    };
    let mut trainer = Trainer::with_strategy(worker, strategy, sampler, options)?;
    let (log_every, progress_every, servers) = (args.log_every, args.progress_every, args.servers);
    let started = Instant::now();
    let (mut computed, mut samples) = (0u64, 0u64);
    let summary = trainer.run(args.steps, |input| -> Result<StepOutput> {
        if input.indices.is_empty() {
            return Ok(StepOutput::empty());
        }
        let batch = data.batch(input.indices, &Device::Cpu)?;
        let loss = model.loss(&batch.x, &batch.y)?;
        let value = loss.to_scalar::<f32>()?;
        let first_worker = input.rank == servers;
        if log_every > 0 && first_worker && (input.step + 1) % log_every == 0 {
            println!("step={} loss={value:.4}", input.step + 1);
        }
        computed += 1;
        samples += input.indices.len() as u64;
        if progress_every > 0 && computed % progress_every == 0 {
            println!(
                "progress rank={} samples={samples} secs={:.3}",
                input.rank,
                started.elapsed().as_secs_f64()
            );
        }
        Ok(StepOutput::new(loss.backward()?, input.indices.len()).with_loss(value))
    })?;
    let stats = trainer.strategy().staleness();
    if matches!(mode, PsMode::Async { .. }) && summary.rank < servers {
        println!("staleness rank={} {}", summary.rank, stats.summary());
    }
    match summary.end {
        RunEnd::Finished => {
            if summary.rank == 0 {
                println!(
                    "final_step={} params_sha256={}",
                    summary.step,
                    params_sha256(&varmap).context("fingerprinting the parameters")?
                );
            }
            eprintln!(
                "rank {}: done at step {} (groups formed {}, steps discarded {}, resumed from {:?})",
                summary.rank,
                summary.step,
                summary.groups_formed,
                summary.steps_discarded,
                summary.resumed_from
            );
        }
        RunEnd::Preempted { signal } => {
            eprintln!(
                "rank {}: preempted (signal {signal}) at step {}; checkpoint {:?}",
                summary.rank, summary.step, summary.last_checkpoint
            );
        }
    }
    Ok(())
}
