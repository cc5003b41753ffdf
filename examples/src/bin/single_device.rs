//! Single-device training: the example MLP on one device (CUDA when there is one and the build
//! supports it, else the CPU), with rekindle's SGD, the elastic sampler at world size 1, and
//! checkpoints that resume bit-identically, onto any device through a map-location.
//!
//! ```text
//! cargo run --release -p rekindle-examples --bin single_device -- \
//!     --checkpoint-dir /tmp/single-ckpt --loss-csv loss.csv
//! ```
//!
//! The log (stderr) says which device is used and why, whether the run resumed, and the loss
//! every `--log-every` steps. Stdout gets exactly one line at the end:
//! `final_step=<N> params_sha256=<hex>`. See docs/examples-single-device.md.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use clap::Parser;
use rekindle_examples::mlp::{named_vars, params_sha256, Mlp, MlpConfig, TeacherDataset};
use rekindle_runtime::optim::{specs_of, step_vars, Optimizer, Sgd, SgdConfig};
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler, ElasticState};
use rekindle_runtime::Device;
use rekindle_storage::candle_io::candle_device;
use rekindle_storage::{
    Checkpoint, CheckpointDir, LoadOptions, MapLocation, Snapshot, StorageError, TrainingState,
};

/// The file group of the model parameters.
const MODEL_GROUP: &str = "model";
/// The file group of the optimizer state and the sampler position.
const TRAIN_GROUP: &str = "optimizer";

#[derive(Debug, Clone, Parser)]
#[command(
    about = "Train the example MLP on one device, with checkpoints and resume",
    args_override_self = true
)]
struct Args {
    /// `auto` (CUDA when available and compiled in, else the CPU), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Train until this many optimizer steps have been taken in total.
    #[arg(long, default_value_t = 1000)]
    steps: u64,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Layer sizes, input to output (784-1024-1024-10 is the benchmark model).
    #[arg(long, default_value = "64-128-10")]
    layers: String,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Samples in the generated dataset (one epoch).
    #[arg(long, default_value_t = 262_144)]
    samples: usize,
    /// Seed of the initial parameters, the dataset and the sample order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where checkpoints are written and resumed from (none: no checkpoints).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every K steps (0: only at the end); the end of the run always saves.
    #[arg(long, default_value_t = 250)]
    checkpoint_every: u64,
    /// Where a resumed checkpoint's tensors go, e.g. `cpu` or `cuda:1->cuda:0,cuda:*->cpu`
    /// (default: the training device).
    #[arg(long)]
    map_location: Option<String>,
    /// Write `step,loss,samples_per_s` here, one row per step.
    #[arg(long)]
    loss_csv: Option<PathBuf>,
    /// Log the loss every N steps (0: never).
    #[arg(long, default_value_t = 100)]
    log_every: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("single_device: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The device to train on and why it was chosen.
fn choose_device(request: &str) -> Result<(Device, candle_core::Device, String)> {
    if request.trim().eq_ignore_ascii_case("auto") {
        let reason = match Device::Cuda(0).ensure_available() {
            Err(rekindle_runtime::Error::CudaUnavailable { reason, .. }) => {
                format!("auto: no CUDA device: {reason}")
            }
            Err(e) => format!("auto: no CUDA device: {e}"),
            Ok(()) => match candle_device(Device::Cuda(0), "<model>") {
                Ok(dev) => return Ok((Device::Cuda(0), dev, "auto: CUDA device 0 found".into())),
                Err(StorageError::CudaNotCompiled { .. }) => "auto: a CUDA device is visible but \
                     this build has no CUDA support (build with --features rekindle-storage/cuda)"
                    .to_string(),
                Err(e) => format!("auto: CUDA device 0 failed to initialise: {e}"),
            },
        };
        return Ok((Device::Cpu, candle_core::Device::Cpu, reason));
    }
    let device: Device = request
        .parse()
        .with_context(|| format!("--device {request:?}: expected auto, cpu, cuda or cuda:N"))?;
    match device {
        Device::Cpu => Ok((Device::Cpu, candle_core::Device::Cpu, "--device cpu".into())),
        Device::Cuda(n) => {
            device
                .ensure_available()
                .with_context(|| format!("--device {device}: CUDA is not usable here"))?;
            let dev = match candle_device(device, "<model>") {
                Err(StorageError::CudaNotCompiled { .. }) => bail!(
                    "--device {device}: this build has no CUDA support \
                     (build with --features rekindle-storage/cuda)"
                ),
                r => r.with_context(|| format!("--device {device}: CUDA device {n} failed"))?,
            };
            Ok((device, dev, format!("--device {device}")))
        }
    }
}

/// Everything that must match between the run that saved a checkpoint and the run resuming it.
fn run_identity(args: &Args) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("layers".into(), args.layers.clone().into());
    m.insert("batch".into(), args.batch.into());
    m.insert("samples".into(), args.samples.into());
    m.insert("seed".into(), args.seed.into());
    m.insert("lr".into(), args.lr.into());
    m.insert("momentum".into(), args.momentum.into());
    m
}

/// The live training state.
struct Trainer {
    candle_device: candle_core::Device,
    varmap: VarMap,
    model: Mlp,
    /// The variables in name order, the optimizer's parameter order.
    vars: Vec<(String, Var)>,
    optimizer: Sgd,
    sampler: ElasticSampler,
    data: TeacherDataset,
    step: u64,
}

impl Trainer {
    fn new(args: &Args, candle_device: candle_core::Device) -> Result<Self> {
        if args.batch == 0 {
            bail!("--batch must be at least 1");
        }
        if args.samples < args.batch {
            bail!(
                "--samples {} is smaller than --batch {}: an epoch would have no step",
                args.samples,
                args.batch
            );
        }
        let config = MlpConfig::parse(&args.layers)?;
        let data = TeacherDataset::new(args.samples, config.input, config.classes, args.seed)?;
        let varmap = VarMap::new();
        let model = Mlp::new(&config, &varmap, args.seed, &candle_device)?;
        let mut vars: Vec<(String, Var)> = named_vars(&varmap)?.into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let optimizer = Sgd::new(
            SgdConfig::new(args.lr).momentum(args.momentum),
            specs_of(&vars),
        )?;
        let sampler = ElasticSampler::new(
            ElasticConfig::new(args.samples, args.batch)
                .seed(args.seed)
                .drop_last(true),
        )?;
        Ok(Trainer {
            candle_device,
            varmap,
            model,
            vars,
            optimizer,
            sampler,
            data,
            step: 0,
        })
    }

    /// One optimizer step; returns the batch's loss and size.
    fn train_step(&mut self) -> Result<(f32, usize)> {
        let planned = self
            .sampler
            .plan()
            .context("the sampler has no step left in the epoch")?;
        let batch = self.data.batch(planned.indices(), &self.candle_device)?;
        let loss = self.model.loss(&batch.x, &batch.y)?;
        let grads = loss.backward()?;
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        step_vars(&mut self.optimizer, &vars, &grads)?;
        self.sampler.commit(&planned)?;
        if self.sampler.epoch_done() {
            self.sampler.set_epoch(self.sampler.epoch() + 1);
        }
        self.step += 1;
        Ok((loss.to_scalar::<f32>()?, planned.len()))
    }

    /// The checkpoint of the current state.
    fn snapshot(&self, identity: &BTreeMap<String, serde_json::Value>) -> Result<Snapshot> {
        let mut snap = Snapshot::new(TrainingState {
            step: self.step,
            epoch: self.sampler.epoch(),
            sample_cursor: self.sampler.cursor() as u64,
            world_size: 1,
            user: identity.clone(),
            ..Default::default()
        });
        snap.insert_varmap(MODEL_GROUP, &self.varmap)?;
        for (name, t) in self.optimizer.state()? {
            snap.insert_candle(TRAIN_GROUP, &name, &t)?;
        }
        for (name, t) in self.sampler.state().to_tensors()? {
            snap.insert_candle(TRAIN_GROUP, &name, &t)?;
        }
        Ok(snap)
    }

    /// Restores parameters, optimizer and sampler from `ckpt`; returns a summary of where the
    /// map-location put the tensors.
    fn restore(
        &mut self,
        ckpt: &Checkpoint,
        identity: &BTreeMap<String, serde_json::Value>,
    ) -> Result<String> {
        let saved = &ckpt.state().user;
        let show = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
        for (key, want) in identity {
            match saved.get(key) {
                Some(got) if got == want => {}
                got => bail!(
                    "{} was written with --{key} {}, this run has --{key} {}; use another \
                     --checkpoint-dir or the same flags",
                    ckpt.path().display(),
                    got.map_or("(none)".to_string(), show),
                    show(want)
                ),
            }
        }
        let mut moves: BTreeMap<(String, String), usize> = BTreeMap::new();
        let mut load = |name: &str| -> Result<Tensor> {
            let t = ckpt.tensor(name)?;
            let from = ckpt
                .manifest()
                .tensors
                .get(t.stored_name())
                .map_or_else(|| "?".to_string(), |e| e.device.clone());
            *moves.entry((from, t.device().to_string())).or_default() += 1;
            Ok(t.to_candle()?)
        };

        for (name, var) in &self.vars {
            let value = load(name)?;
            if value.dims() != var.dims() || value.dtype() != var.dtype() {
                bail!(
                    "tensor {name:?} of {} is {:?} {:?}, the model has {:?} {:?}",
                    ckpt.path().display(),
                    value.dtype(),
                    value.dims(),
                    var.dtype(),
                    var.dims()
                );
            }
            var.set(&value.to_device(&self.candle_device)?)?;
        }
        let mut optim_state = Vec::new();
        for name in ckpt.names() {
            if name.starts_with("optim.") {
                optim_state.push((name.to_string(), load(name)?));
            }
        }
        self.optimizer.load_state(&optim_state)?;
        let mut sampler_state = Vec::new();
        for name in ElasticState::NAMES {
            sampler_state.push((name.to_string(), load(name)?));
        }
        self.sampler
            .restore(ElasticState::from_tensors(&sampler_state)?)?;
        let state = ckpt.state();
        if (state.epoch, state.sample_cursor)
            != (self.sampler.epoch(), self.sampler.cursor() as u64)
        {
            bail!(
                "{}: the manifest says epoch {} cursor {}, the sampler tensors epoch {} cursor {}",
                ckpt.path().display(),
                state.epoch,
                state.sample_cursor,
                self.sampler.epoch(),
                self.sampler.cursor()
            );
        }
        if self.optimizer.step_count() != ckpt.step() {
            bail!(
                "{}: step {} but the optimizer state has taken {} steps",
                ckpt.path().display(),
                ckpt.step(),
                self.optimizer.step_count()
            );
        }
        self.step = ckpt.step();
        let moves: Vec<String> = moves
            .iter()
            .map(|((from, to), n)| format!("{n} tensors {from} -> {to}"))
            .collect();
        Ok(moves.join(", "))
    }
}

/// Renames a checkpoint that does not verify to `<dir>.corrupt` (or `.corrupt.N`), out of the
/// way of the run that now trains through its step again, kept for inspection.
fn move_aside(step_dir: &Path) -> Result<PathBuf> {
    let base = step_dir.as_os_str().to_owned();
    for n in 0u32.. {
        let mut name = base.clone();
        name.push(if n == 0 {
            ".corrupt".to_string()
        } else {
            format!(".corrupt.{n}")
        });
        let to = PathBuf::from(name);
        if !to.exists() {
            std::fs::rename(step_dir, &to)
                .with_context(|| format!("moving {} aside", step_dir.display()))?;
            return Ok(to);
        }
    }
    bail!("no free name to move {} aside", step_dir.display())
}

/// The loss CSV: a fresh file, or on resume the rows up to the resumed step kept (a run that
/// died after its last checkpoint wrote rows that the resumed run writes again).
fn open_loss_csv(path: &Path, resumed_at: Option<u64>) -> Result<BufWriter<File>> {
    let mut kept = Vec::new();
    if let (Some(step), Ok(f)) = (resumed_at, File::open(path)) {
        for line in BufReader::new(f).lines().skip(1) {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            let row_step = line.split(',').next().and_then(|s| s.parse::<u64>().ok());
            if row_step.is_some_and(|s| s <= step) {
                kept.push(line);
            }
        }
    }
    let mut w =
        BufWriter::new(File::create(path).with_context(|| format!("creating {}", path.display()))?);
    writeln!(w, "step,loss,samples_per_s")?;
    for line in kept {
        writeln!(w, "{line}")?;
    }
    Ok(w)
}

fn run(args: &Args) -> Result<()> {
    let (device, candle_dev, why) = choose_device(&args.device)?;
    eprintln!("device: {device} ({why})");
    let (map_location, map_text) = match &args.map_location {
        Some(s) => (
            s.parse::<MapLocation>()
                .with_context(|| format!("--map-location {s:?}"))?,
            s.clone(),
        ),
        None => (MapLocation::Device(device), device.to_string()),
    };
    let identity = run_identity(args);
    let mut trainer = Trainer::new(args, candle_dev)?;
    let config = MlpConfig::parse(&args.layers)?;
    eprintln!(
        "model: {} ({} parameters), batch {}, {} samples, SGD lr {} momentum {}, seed {}",
        args.layers,
        config.param_count(),
        args.batch,
        args.samples,
        args.lr,
        args.momentum,
        args.seed
    );

    let dir = args
        .checkpoint_dir
        .as_ref()
        .map(CheckpointDir::new)
        .transpose()?;
    let mut resumed_at = None;
    if let Some(dir) = &dir {
        let committed = dir.committed_steps()?;
        if committed.is_empty() {
            eprintln!(
                "no checkpoint in {}: starting from step 0",
                dir.root().display()
            );
        } else {
            let opts = LoadOptions::default().map_location(map_location.clone());
            let ckpt = dir.load_latest(&opts).with_context(|| {
                format!(
                    "resuming from {} with map-location {map_text}",
                    dir.root().display()
                )
            })?;
            let skipped: Vec<u64> = committed
                .iter()
                .copied()
                .filter(|&s| s > ckpt.step())
                .collect();
            if !skipped.is_empty() {
                eprintln!(
                    "skipped {} newer checkpoint(s) that do not verify: steps {skipped:?}",
                    skipped.len()
                );
            }
            for step in skipped {
                let to = move_aside(&dir.step_path(step))?;
                eprintln!(
                    "moved the unverifiable step-{step} aside to {}",
                    to.display()
                );
            }
            let moves = trainer.restore(&ckpt, &identity)?;
            eprintln!(
                "resumed from step {} ({}, epoch {} cursor {}; map-location {map_text}: {moves})",
                ckpt.step(),
                ckpt.path().display(),
                ckpt.state().epoch,
                ckpt.state().sample_cursor
            );
            resumed_at = Some(ckpt.step());
        }
    }
    let mut csv = args
        .loss_csv
        .as_deref()
        .map(|p| open_loss_csv(p, resumed_at))
        .transpose()?;

    let mut saved_at = resumed_at;
    let save = |trainer: &Trainer, csv: &mut Option<BufWriter<File>>| -> Result<()> {
        let Some(dir) = &dir else { return Ok(()) };
        if let Some(w) = csv.as_mut() {
            w.flush()?;
        }
        let info = dir.save(&trainer.snapshot(&identity)?)?;
        eprintln!(
            "checkpoint: step {} -> {} ({} bytes)",
            info.step,
            info.path.display(),
            info.bytes_written
        );
        Ok(())
    };
    if trainer.step >= args.steps {
        eprintln!(
            "already at step {} (--steps {}): nothing to train",
            trainer.step, args.steps
        );
    }
    while trainer.step < args.steps {
        let start = Instant::now();
        let (loss, n) = trainer.train_step()?;
        let samples_per_s = n as f64 / start.elapsed().as_secs_f64();
        if !loss.is_finite() {
            bail!(
                "the loss is {loss} at step {}: lower --lr (now {})",
                trainer.step,
                args.lr
            );
        }
        if let Some(w) = csv.as_mut() {
            writeln!(w, "{},{loss},{samples_per_s:.1}", trainer.step)?;
        }
        if args.log_every > 0 && trainer.step % args.log_every == 0 {
            eprintln!(
                "step {}/{} loss {loss:.4} samples/s {samples_per_s:.0} (epoch {})",
                trainer.step,
                args.steps,
                trainer.sampler.epoch()
            );
        }
        if args.checkpoint_every > 0 && trainer.step % args.checkpoint_every == 0 {
            save(&trainer, &mut csv)?;
            saved_at = Some(trainer.step);
        }
    }
    if saved_at != Some(trainer.step) {
        save(&trainer, &mut csv)?;
    }
    if let Some(mut w) = csv {
        w.flush()?;
    }
    println!(
        "final_step={} params_sha256={}",
        trainer.step,
        params_sha256(&trainer.varmap)?
    );
    Ok(())
}
