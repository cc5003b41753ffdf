//! Elastic pipeline-parallel training of the example MLP, one process per stage rank:
//!
//! ```text
//! rekindle run --standalone --nproc-per-node 3 --max-restarts 3 target/release/pipeline \
//!     --stages 3 --micro-batches 4 --schedule 1f1b --steps 300 --seed 7
//! ```
//!
//! The MLP's layers (`--layers`, one per linear layer) are split into `--stages` stages
//! balanced by parameter count; with more ranks than stages the group runs as many
//! data-parallel replicas of the pipeline as fit. Each step takes a global batch from the
//! elastic sampler, cuts each replica's share into `--micro-batches` micro-batches and runs
//! them through the stages in the `--schedule`'s order. Each stage keeps an in-memory copy of
//! its neighbour's layers (unless `--no-copy`), so a killed stage rank's replacement takes its
//! layers from there without losing a step; a stage lost for good (`--nnodes MIN:MAX`) is
//! re-partitioned over the ranks left. At the end rank 0 gathers the whole model and prints
//! `final_step=<N> params_sha256=<hex>` (the parameters in name order, as the `ddp` example
//! hashes them): the same with a killed and replaced rank as without, at the same layout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use rekindle_elastic::train::strategy::pipeline::{
    Batch, OptimizerFactory, PipelineConfig, PipelineStrategy, Schedule,
};
use rekindle_elastic::train::{self, CollectiveBackend, ElasticOptions, RunEnd, Trainer};
use rekindle_examples::mlp::{MlpConfig, TeacherDataset};
use rekindle_examples::pipeline_mlp::{Emulated, MlpPipeline};
use rekindle_runtime::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use rekindle_runtime::sampler::ElasticConfig;
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OptimizerKind {
    /// AdamW (torch's defaults, weight decay 0.01).
    Adamw,
    /// SGD with momentum 0.9.
    Sgd,
}

#[derive(Debug, Parser)]
#[command(
    about = "Elastic pipeline-parallel training of an MLP on a generated dataset",
    args_override_self = true
)]
struct Args {
    /// Pipeline stages (per data-parallel replica).
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Micro-batches per replica per step.
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
    /// Schedule: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Steps to train (a resumed run counts the checkpoint's steps).
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Seed of the initial parameters, the dataset and the data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Global batch size (split over the replicas).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Layer sizes (each pair of neighbours is one linear layer).
    #[arg(long, default_value = "64-256-256-256-256-10")]
    layers: String,
    /// Samples in the generated dataset.
    #[arg(long, default_value_t = 65_536)]
    dataset: usize,
    /// Optimizer of every stage.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    optimizer: OptimizerKind,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Do not keep neighbour copies (a lost stage then comes from the newest checkpoint).
    #[arg(long)]
    no_copy: bool,
    /// Checkpoint directory (resumes from its newest valid checkpoint; every rank must see it).
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
    /// Rank 0 prints `step=<N>` every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    log_every: u64,
    /// Collective deadline in seconds (a peer silent this long counts as lost).
    #[arg(long, default_value_t = 30.0)]
    op_timeout: f64,
    /// Collective backend: `tcp`, or `nccl` on cuda:LOCAL_RANK (a build with the `nccl`
    /// feature; host buffers are staged through the device).
    #[arg(long, default_value = "tcp")]
    backend: CollectiveBackend,
    /// Emulate each layer's compute with a wait of this many ms forward (twice that
    /// backward), for measuring schedules on fewer cores than stages.
    #[arg(long)]
    emulate_ms: Option<f64>,
    /// Every rank writes its per-step timings to `<dir>/timings-<rank>-<pid>.csv`.
    #[arg(long)]
    timings_dir: Option<PathBuf>,
}

/// The sha256 of `params` (sorted by name), each as little-endian f32.
fn fingerprint(params: &[(String, Tensor)]) -> Result<String> {
    let mut h = Sha256::new();
    for (_, t) in params {
        for x in t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? {
            h.update(x.to_le_bytes());
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The peak resident set of this process (VmHWM), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let schedule: Schedule = args.schedule.parse()?;
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
    if args.stages == 0 || args.stages > config.layers().len() {
        bail!(
            "--stages {} for a model of {} layers (need 1 <= stages <= layers)",
            args.stages,
            config.layers().len()
        );
    }
    let data = TeacherDataset::new(args.dataset, config.input, config.classes, args.seed)?;
    let mut model = MlpPipeline::new(&config, args.seed);
    if let Some(ms) = args.emulate_ms {
        model = model.with_emulated(Emulated { forward_ms: ms });
    }
    let (kind, lr) = (args.optimizer, args.lr);
    let new_optimizer: OptimizerFactory = Box::new(move |specs| {
        Ok(match kind {
            OptimizerKind::Adamw => {
                Box::new(AdamW::new(AdamWConfig::new(lr), specs)?) as Box<dyn Optimizer>
            }
            OptimizerKind::Sgd => Box::new(Sgd::new(SgdConfig::new(lr).momentum(0.9), specs)?),
        })
    });
    let pipeline = PipelineConfig::new(args.stages)
        .micro_batches(args.micro_batches)
        .schedule(schedule)
        .neighbour_copy(!args.no_copy)
        .record_steps(args.timings_dir.is_some());
    let strategy = PipelineStrategy::new(Box::new(model), new_optimizer, pipeline)?;
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
    let log_every = args.log_every;
    let summary = trainer.run(args.steps, |input| -> Result<Batch> {
        let b = data.batch(input.indices, &Device::Cpu)?;
        if log_every > 0 && (input.step + 1) % log_every == 0 && input.rank == 0 {
            println!("step={}", input.step + 1);
        }
        Ok(Batch::new(b.x, b.y))
    })?;
    let strategy = trainer.strategy();
    if let Some(dir) = &args.timings_dir {
        let path = dir.join(format!(
            "timings-{}-{}.csv",
            summary.rank,
            std::process::id()
        ));
        let mut f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        writeln!(
            f,
            "step,rank,stage,replica,stages,micro_batches,started,passes_start,passes_end,busy,ended"
        )?;
        for t in strategy.history() {
            writeln!(
                f,
                "{},{},{},{},{},{},{:.6},{:.6},{:.6},{:.6},{:.6}",
                t.step,
                summary.rank,
                t.stage,
                t.replica,
                t.stages,
                t.micro_batches,
                t.started,
                t.passes_start,
                t.passes_end,
                t.busy,
                t.ended
            )?;
        }
    }
    let mem = strategy.memory();
    let range = |r: Option<std::ops::Range<usize>>| {
        r.map_or("-".to_string(), |r| format!("{}..{}", r.start, r.end))
    };
    println!(
        "memory rank={} layers={} copy={} params_bytes={} optimizer_bytes={} copy_bytes={} \
         peak_in_flight={} peak_activation_bytes={} peak_rss_kib={}",
        summary.rank,
        range(strategy.layers()),
        range(strategy.copy_layers()),
        mem.params_bytes,
        mem.optimizer_bytes,
        mem.copy_bytes,
        mem.peak_in_flight,
        mem.peak_activation_bytes,
        peak_rss_kib().unwrap_or(0)
    );
    match summary.end {
        RunEnd::Finished => {
            if let Some(params) = strategy.parameters() {
                println!(
                    "final_step={} params_sha256={}",
                    summary.step,
                    fingerprint(params).context("fingerprinting the parameters")?
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
