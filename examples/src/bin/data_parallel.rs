//! DataParallel (seed 2.1): one process, the example MLP replicated over a list of devices;
//! each step's global batch is split between the replicas, which run forward and backward in
//! parallel, and the gradients are reduced onto the first device, where one optimizer updates
//! the model. The elastic loop (a job of one rank) schedules the steps, checkpoints and
//! resumes.
//!
//! ```text
//! cargo run --release -p rekindle-examples --bin data_parallel -- --devices cpu,cpu --steps 200
//! ```
//!
//! `--devices cpu,cpu` runs two replicas on the CPU, each on a thread of its own with
//! `--threads` compute threads (default 1); with the `cuda` feature, `cuda:0,cuda:1` uses two
//! GPUs. `--init-from FILE` starts from a safetensors state dict, such as one saved from a
//! PyTorch `nn.DataParallel` model (keys `module.fc1.weight`, ...: the prefix is stripped).
//! Checkpoints hold the names without it. This is the legacy path: DDP (`ddp`, one process per
//! device) scales better and survives failures. The last line on stdout is
//! `final_step=<N> params_sha256=<hex>`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_nn::VarMap;
use clap::Parser;
use rekindle_elastic::train::{self, ElasticOptions, RunEnd, StepOutput, Trainer};
use rekindle_examples::mlp::{params_sha256, Mlp, MlpConfig, TeacherDataset};
use rekindle_runtime::optim::{Sgd, SgdConfig};
use rekindle_runtime::parallel::{keep_freed_memory, DataParallel};
use rekindle_runtime::sampler::ElasticConfig;
use rekindle_runtime::Device;
use rekindle_storage::candle_io::candle_device;
use rekindle_storage::{load_varmap, LoadOptions, SafetensorsFile};

#[derive(Debug, Parser)]
#[command(
    about = "DataParallel training of an MLP over several devices of one process",
    args_override_self = true
)]
struct Args {
    /// The devices, first one first: `cpu,cpu`, `cuda:0,cuda:1` (with the cuda feature).
    #[arg(long, default_value = "cpu,cpu")]
    devices: String,
    /// Steps to train (a resumed run counts the checkpoint's steps).
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Global batch size (split over the replicas).
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
    /// Compute threads of each replica (candle's CPU kernels).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Start from this safetensors state dict (a `module.` prefix on its keys is stripped).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Checkpoint directory (resumes from its newest valid checkpoint).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end and on SIGTERM).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Print `step=<N> loss=<L>` every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    log_every: u64,
}

fn parse_devices(list: &str) -> Result<Vec<candle_core::Device>> {
    let devices = list
        .split(',')
        .map(|d| {
            let device: Device = d.trim().parse().with_context(|| format!("device {d:?}"))?;
            candle_device(device, "data_parallel").with_context(|| format!("device {d:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    if devices.is_empty() {
        bail!("--devices lists no device");
    }
    Ok(devices)
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The replicas' threads share this process's allocator: keep freed buffers for reuse.
    keep_freed_memory();
    // candle's CPU kernels read this once, on first use: each replica's thread computes alone.
    std::env::set_var("RAYON_NUM_THREADS", args.threads.max(1).to_string());
    let devices = parse_devices(&args.devices)?;
    let config = MlpConfig::parse(&args.layers)?;
    let cpu_only = devices.iter().all(|d| d.is_cpu());
    eprintln!(
        "data_parallel: {} replica(s) on {}{}",
        devices.len(),
        args.devices,
        if cpu_only && devices.len() > 1 {
            " (a CPU build: every replica is on the CPU, on a thread of its own)"
        } else {
            ""
        }
    );
    let seed = args.seed;
    let dp = DataParallel::new(devices.clone(), |varmap: &VarMap, device| {
        Mlp::new(&config, varmap, seed, device)
    })?;
    if let Some(path) = &args.init_from {
        let file = SafetensorsFile::open(path, &LoadOptions::default())
            .with_context(|| format!("opening {}", path.display()))?;
        let loaded = load_varmap(&file, dp.varmap())
            .with_context(|| format!("loading {} into the model", path.display()))?;
        eprintln!(
            "data_parallel: initialised from {} ({} tensors)",
            path.display(),
            loaded.loaded.len()
        );
    }
    let data = TeacherDataset::new(args.dataset, config.input, config.classes, args.seed)?;
    let varmap = dp.varmap().clone();
    let optimizer = Sgd::new(
        SgdConfig::new(args.lr).momentum(0.9),
        train::param_specs(&varmap)?,
    )?;
    let options = ElasticOptions {
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        ..ElasticOptions::default()
    };
    let sampler = ElasticConfig::new(args.dataset, args.batch).seed(args.seed);
    let mut trainer = Trainer::new(
        train::init()?,
        varmap.clone(),
        Box::new(optimizer),
        sampler,
        options,
    )?;
    let first = devices[0].clone();
    let log_every = args.log_every;
    let summary = trainer.run(args.steps, |input| -> Result<StepOutput> {
        if input.indices.is_empty() {
            return Ok(StepOutput::empty());
        }
        let batch = data.batch(input.indices, &first)?;
        let out = dp.forward_backward(&batch.x, &batch.y, |m, x, y| {
            m.loss(x, y)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })?;
        if log_every > 0 && (input.step + 1) % log_every == 0 {
            println!("step={} loss={:.4}", input.step + 1, out.loss);
        }
        Ok(StepOutput::new(out.grads, out.samples).with_loss(out.loss))
    })?;
    match summary.end {
        RunEnd::Finished => println!(
            "final_step={} params_sha256={}",
            summary.step,
            params_sha256(&varmap).context("fingerprinting the parameters")?
        ),
        RunEnd::Preempted { signal } => eprintln!(
            "data_parallel: stopped by signal {signal} at step {}; checkpoint {:?}",
            summary.step, summary.last_checkpoint
        ),
    }
    Ok(())
}
