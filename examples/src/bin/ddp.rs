//! Elastic DDP training of the example MLP (seed 2.2), one process per rank:
//!
//! ```text
//! rekindle run --standalone --nproc-per-node 2 target/release/ddp --steps 300 \
//!     --checkpoint-dir /tmp/rekindle-ddp --checkpoint-every 50
//! ```
//!
//! Each step takes a fixed global batch (`--batch`) from the elastic sampler (shuffled by
//! seed and epoch, `set_epoch` at every epoch boundary); each rank computes the gradients of
//! its share, DDP averages them, and rank 0 checkpoints every `--checkpoint-every` steps in
//! the background. Kill a rank and the others keep their state and take in its replacement;
//! kill all and a new run resumes from the newest checkpoint. At the end rank 0 prints
//! `final_step=<N> params_sha256=<hex>`: the same for a run with faults as without, at the
//! same world size.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::Device;
use candle_nn::VarMap;
use clap::Parser;
use rekindle_elastic::train::{
    self, CollectiveBackend, ElasticOptions, RunEnd, StepOutput, Trainer,
};
use rekindle_examples::mlp::{params_sha256, Mlp, MlpConfig, TeacherDataset};
use rekindle_runtime::optim::{Sgd, SgdConfig};
use rekindle_runtime::sampler::ElasticConfig;

#[derive(Debug, Parser)]
#[command(
    about = "Elastic DDP training of an MLP on a generated dataset",
    args_override_self = true
)]
struct Args {
    /// Steps to train (a resumed run counts the checkpoint's steps).
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Global batch size (split over the ranks).
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
    /// Print `step=<N> loss=<L>` on rank 0 every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    log_every: u64,
    /// Collective deadline in seconds (a peer silent this long counts as lost).
    #[arg(long, default_value_t = 30.0)]
    op_timeout: f64,
    /// Collective backend: `tcp`, or `nccl` on cuda:LOCAL_RANK (a build with the `nccl`
    /// feature; the model stays on the CPU and its gradients are staged through the device).
    #[arg(long, default_value = "tcp")]
    backend: CollectiveBackend,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The runtime's warnings (a connection refused for a wrong secret, a checkpoint that
    // failed) go to stderr; `REKINDLE_LOG` sets the filter.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("REKINDLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
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
    println!(
        "rank={rank} pid={} world_size={} threads={threads}",
        std::process::id(),
        worker.assignment.world_size
    );
    let config = MlpConfig::parse(&args.layers)?;
    let data = TeacherDataset::new(args.dataset, config.input, config.classes, args.seed)?;
    let varmap = VarMap::new();
    let model = Mlp::new(&config, &varmap, args.seed, &Device::Cpu)?;
    let optimizer = Sgd::new(
        SgdConfig::new(args.lr).momentum(0.9),
        train::param_specs(&varmap)?,
    )?;
    let sampler = ElasticConfig::new(args.dataset, args.batch).seed(args.seed);
    let options = ElasticOptions {
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        loss_csv: args.loss_csv.clone(),
        op_timeout: std::time::Duration::from_secs_f64(args.op_timeout),
        backend: args.backend,
        ..ElasticOptions::default()
    };
    let mut trainer = Trainer::new(
        worker,
        varmap.clone(),
        Box::new(optimizer),
        sampler,
        options,
    )?;
    let log_every = args.log_every;
    let summary = trainer.run(args.steps, |input| -> Result<StepOutput> {
        if input.indices.is_empty() {
            return Ok(StepOutput::empty());
        }
        let batch = data.batch(input.indices, &Device::Cpu)?;
        let loss = model.loss(&batch.x, &batch.y)?;
        let value = loss.to_scalar::<f32>()?;
        if log_every > 0 && input.rank == 0 && (input.step + 1) % log_every == 0 {
            println!("step={} loss={value:.4}", input.step + 1);
        }
        Ok(StepOutput::new(loss.backward()?, input.indices.len()).with_loss(value))
    })?;
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
