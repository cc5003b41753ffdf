//! Model parallel in one process (seed 4): the layers of the example MLP on several devices,
//! the activations moved from device to device. By default it is the seed's `ToyModel`,
//! `Linear(10, 10)` and `ReLU` on the first device, `Linear(10, 5)` on the second, generalised
//! to any layer sizes split at any layers:
//!
//! ```text
//! cargo run --release -p rekindle-examples --bin model_parallel -- \
//!     --layers 10-10-5 --split 1 --devices cpu,cpu --steps 200 --checkpoint-dir /tmp/mp
//! ```
//!
//! `--split 1` starts the second stage at layer 1 (0-based, counting linear layers; each but
//! the last is followed by its ReLU). A CPU build runs every "device" on the CPU and says so;
//! with the `cuda` feature, `--devices cuda:0,cuda:1` uses two GPUs. The parameters have the
//! names of the unsplit MLP (`fc1.weight`, ...), so a checkpoint loads into the model on one
//! device through a map-location. The elastic loop (a job of one rank) schedules the steps,
//! checkpoints and resumes. The last line on stdout is `final_step=<N> params_sha256=<hex>`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_nn::VarMap;
use clap::Parser;
use rekindle_elastic::train::{self, ElasticOptions, RunEnd, StepOutput, Trainer};
use rekindle_examples::mlp::{params_sha256, seeded_linear, MlpConfig, TeacherDataset};
use rekindle_runtime::optim::{Sgd, SgdConfig};
use rekindle_runtime::parallel::{Layer, ModelParallel};
use rekindle_runtime::sampler::ElasticConfig;
use rekindle_runtime::Device;
use rekindle_storage::candle_io::candle_device;

#[derive(Debug, Parser)]
#[command(
    about = "Model-parallel training of an MLP split over several devices of one process",
    args_override_self = true
)]
struct Args {
    /// Layer sizes (the seed's ToyModel: 10-10-5).
    #[arg(long, default_value = "10-10-5")]
    layers: String,
    /// The linear layers (0-based) where a new stage starts, comma-separated.
    #[arg(long, default_value = "1")]
    split: String,
    /// One device per stage: `cpu,cpu`, `cuda:0,cuda:1` (with the cuda feature).
    #[arg(long, default_value = "cpu,cpu")]
    devices: String,
    /// Steps to train (a resumed run counts the checkpoint's steps).
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Samples in the generated dataset.
    #[arg(long, default_value_t = 10_000)]
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
    /// Print `step=<N> loss=<L>` every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    log_every: u64,
}

/// `cpu` or `cuda:N`, as `--devices` names them.
fn device_name(d: &candle_core::Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let config = MlpConfig::parse(&args.layers)?;
    let linears = config.layers();
    let split: Vec<usize> = if args.split.trim().is_empty() {
        Vec::new()
    } else {
        args.split
            .split(',')
            .map(|s| s.trim().parse().with_context(|| format!("--split {s:?}")))
            .collect::<Result<_>>()?
    };
    let devices = args
        .devices
        .split(',')
        .map(|d| {
            let device: Device = d.trim().parse().with_context(|| format!("device {d:?}"))?;
            candle_device(device, "model_parallel").with_context(|| format!("device {d:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    if devices.len() != split.len() + 1 {
        bail!(
            "{} device(s) for {} stage(s): give one device per stage (--split {:?})",
            devices.len(),
            split.len() + 1,
            args.split
        );
    }
    // Layer list: fc1, relu, fc2, relu, ..., fcK; linear layer k is layer 2k.
    let n_layers = 2 * linears.len() - 1;
    let split_layers: Vec<usize> = split.iter().map(|&k| 2 * k).collect();
    let varmap = VarMap::new();
    let seed = args.seed;
    let model = ModelParallel::new(devices.clone(), &split_layers, n_layers, |i, device| {
        if i % 2 == 1 {
            return Ok::<Layer, anyhow::Error>(Box::new(candle_nn::Activation::Relu));
        }
        let k = i / 2;
        let (inputs, outputs) = linears[k];
        Ok(Box::new(seeded_linear(
            &varmap, k, inputs, outputs, seed, device,
        )?))
    })?;
    for (s, device) in devices.iter().enumerate() {
        let layers = model.stage_layers(s).unwrap_or_default();
        eprintln!(
            "model_parallel: stage {s} on {}: layers {layers:?}",
            device_name(device)
        );
    }
    if devices.iter().all(|d| d.is_cpu()) && devices.len() > 1 {
        eprintln!(
            "model_parallel: a CPU build: every stage runs on the CPU (the activations still \
             move between the stages as between devices)"
        );
    }
    let data = TeacherDataset::new(args.dataset, config.input, config.classes, args.seed)?;
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
    let (first, last) = (devices[0].clone(), devices[devices.len() - 1].clone());
    let log_every = args.log_every;
    let summary = trainer.run(args.steps, |input| -> Result<StepOutput> {
        if input.indices.is_empty() {
            return Ok(StepOutput::empty());
        }
        let batch = data.batch(input.indices, &first)?;
        let logits = model.forward(&batch.x)?;
        let labels = batch.y.to_device(&last)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
        let value = loss.to_scalar::<f32>()?;
        if log_every > 0 && (input.step + 1) % log_every == 0 {
            println!("step={} loss={value:.4}", input.step + 1);
        }
        Ok(StepOutput::new(loss.backward()?, input.indices.len()).with_loss(value))
    })?;
    match summary.end {
        RunEnd::Finished => println!(
            "final_step={} params_sha256={}",
            summary.step,
            params_sha256(&varmap).context("fingerprinting the parameters")?
        ),
        RunEnd::Preempted { signal } => eprintln!(
            "model_parallel: stopped by signal {signal} at step {}; checkpoint {:?}",
            summary.step, summary.last_checkpoint
        ),
    }
    Ok(())
}
