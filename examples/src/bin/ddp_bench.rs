//! DDP overhead: the step time of an MLP trained with DDP on N ranks (separate processes, one
//! batch per rank) divided by a single process's step time for one such batch, with the same
//! compute threads per process. Beside it, at the same global batch (N batches per step): one
//! process on one device, one process with DataParallel over N CPU replicas (a thread each),
//! and DDP, as samples per second.
//!
//! ```text
//! cargo run --release -p rekindle-examples --bin ddp_bench -- --ranks 2 --threads 1 --csv ddp.csv
//! ```
//!
//! The bench spawns itself: first one single-process run (alone on the machine), then the N
//! DDP ranks at once, which bootstrap through a `FileStore` in a temporary directory. Every
//! child gets `RAYON_NUM_THREADS` (candle's CPU thread count, see
//! `candle_core::utils::get_num_threads`) set to `--threads`. A step is timed from the
//! forward pass to the end of the parameter update; generating the batch is not timed.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};
use rekindle_examples::mlp::{named_vars, params_sha256, Mlp, MlpConfig, TeacherDataset};
use rekindle_runtime::ddp::{Ddp, DdpOptions, StepMode};
use rekindle_runtime::optim::{specs_of, step_vars, Optimizer, Sgd, SgdConfig};
use rekindle_runtime::parallel::{keep_freed_memory, DataParallel};
use rekindle_runtime::sampler::{ElasticConfig, ElasticSampler};
use rekindle_runtime::store::{FileStore, Store};
use rekindle_runtime::{GroupConfig, JobSecret, ProcessGroup, TcpOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Spawn the runs and print the table.
    Coordinator,
    /// One process training alone (the baseline).
    Single,
    /// One DDP rank.
    Rank,
    /// One process, DataParallel over `--ranks` CPU replicas.
    Dp,
}

/// How every run's C allocator treats freed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Allocator {
    /// glibc's defaults: large buffers are mapped and unmapped every step.
    System,
    /// `rekindle_runtime::parallel::keep_freed_memory`: freed buffers are reused.
    KeepFreed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Atomic,
    Overlapped,
}

#[derive(Debug, Clone, Parser)]
#[command(about = "DDP step time over a single process's, MLP on CPU")]
struct Args {
    /// Layer sizes.
    #[arg(long, default_value = "784-1024-1024-10")]
    layers: String,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// DDP ranks (separate processes).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Compute threads per process (RAYON_NUM_THREADS).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// DDP bucket cap in MiB.
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// DDP first bucket size in MiB.
    #[arg(long, default_value_t = 1.0)]
    first_bucket_mb: f64,
    /// When parameters are updated relative to the all-reduces.
    #[arg(long, value_enum, default_value_t = Mode::Atomic)]
    mode: Mode,
    /// The C allocator's treatment of freed memory, the same in every run.
    #[arg(long, value_enum, default_value_t = Allocator::System)]
    allocator: Allocator,
    /// Write the table as CSV here.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Seed of the model and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = Role::Coordinator, hide = true)]
    role: Role,
    #[arg(long, default_value_t = 0, hide = true)]
    rank: usize,
    #[arg(long, hide = true)]
    store_dir: Option<PathBuf>,
}

/// What a child reports on its last stdout line.
#[derive(Debug, Clone)]
struct Timing {
    steps_ms: Vec<f64>,
    sync_ms: Vec<f64>,
    first_loss: f32,
    last_loss: f32,
    sha: String,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 0.5)
}

impl Timing {
    fn encode(&self) -> String {
        let join = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.4}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "RESULT steps={} sync={} first_loss={} last_loss={} sha={}",
            join(&self.steps_ms),
            join(&self.sync_ms),
            self.first_loss,
            self.last_loss,
            self.sha
        )
    }

    fn decode(line: &str) -> Result<Timing> {
        let mut t = Timing {
            steps_ms: Vec::new(),
            sync_ms: Vec::new(),
            first_loss: f32::NAN,
            last_loss: f32::NAN,
            sha: String::new(),
        };
        let body = line.strip_prefix("RESULT ").context("not a RESULT line")?;
        let nums = |v: &str| -> Result<Vec<f64>> {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(|s| Ok(s.parse()?))
                .collect()
        };
        for field in body.split(' ') {
            let (k, v) = field.split_once('=').context("malformed field")?;
            match k {
                "steps" => t.steps_ms = nums(v)?,
                "sync" => t.sync_ms = nums(v)?,
                "first_loss" => t.first_loss = v.parse()?,
                "last_loss" => t.last_loss = v.parse()?,
                "sha" => t.sha = v.to_string(),
                _ => bail!("unknown field {k:?}"),
            }
        }
        Ok(t)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.ranks == 0 || args.batch == 0 || args.threads == 0 || args.steps == 0 {
        bail!("--ranks, --batch, --threads and --steps must be at least 1");
    }
    MlpConfig::parse(&args.layers)?;
    if args.allocator == Allocator::KeepFreed
        && args.role != Role::Coordinator
        && !keep_freed_memory()
    {
        bail!("--allocator keep-freed needs glibc");
    }
    match args.role {
        Role::Coordinator => coordinate(&args),
        Role::Single => {
            println!("{}", single(&args)?.encode());
            Ok(())
        }
        Role::Rank => {
            println!("{}", rank(&args)?.encode());
            Ok(())
        }
        Role::Dp => {
            println!("{}", data_parallel(&args)?.encode());
            Ok(())
        }
    }
}

/// Spawns this program with `role`, RAYON_NUM_THREADS set, and returns the child.
fn spawn(
    args: &Args,
    role: &str,
    rank: usize,
    store: Option<&std::path::Path>,
) -> Result<std::process::Child> {
    let exe = std::env::current_exe().context("locating this program")?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "--role",
        role,
        "--rank",
        &rank.to_string(),
        "--layers",
        &args.layers,
        "--batch",
        &args.batch.to_string(),
        "--ranks",
        &args.ranks.to_string(),
        "--threads",
        &args.threads.to_string(),
        "--steps",
        &args.steps.to_string(),
        "--warmup",
        &args.warmup.to_string(),
        "--bucket-cap-mb",
        &args.bucket_cap_mb.to_string(),
        "--first-bucket-mb",
        &args.first_bucket_mb.to_string(),
        "--seed",
        &args.seed.to_string(),
        "--mode",
        match args.mode {
            Mode::Atomic => "atomic",
            Mode::Overlapped => "overlapped",
        },
        "--allocator",
        match args.allocator {
            Allocator::System => "system",
            Allocator::KeepFreed => "keep-freed",
        },
    ]);
    if let Some(dir) = store {
        cmd.arg("--store-dir").arg(dir);
    }
    cmd.env("RAYON_NUM_THREADS", args.threads.to_string())
        .env_remove("CANDLE_NUM_THREADS")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd.spawn()
        .with_context(|| format!("spawning the {role} run"))
}

fn collect(child: std::process::Child, what: &str) -> Result<Timing> {
    let mut child = child;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut last = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if line.starts_with("RESULT ") {
            last = Some(line);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("the {what} run failed: {status}");
    }
    Timing::decode(&last.with_context(|| format!("the {what} run printed no result"))?)
}

fn coordinate(args: &Args) -> Result<()> {
    let single = collect(spawn(args, "single", 0, None)?, "single-process")?;
    // The same number of independent single processes at once: the machine's contention
    // without any communication, to tell DDP's cost from the cost of sharing the cores.
    let concurrent = (0..args.ranks)
        .map(|r| spawn(args, "single", r, None))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .map(|c| collect(c, "concurrent single-process"))
        .collect::<Result<Vec<_>>>()?;
    let dir = tempfile::tempdir().context("creating the store directory")?;
    let children = (0..args.ranks)
        .map(|r| spawn(args, "rank", r, Some(dir.path())))
        .collect::<Result<Vec<_>>>()?;
    let ranks = children
        .into_iter()
        .enumerate()
        .map(|(r, c)| collect(c, &format!("rank {r}")))
        .collect::<Result<Vec<_>>>()?;
    if ranks.iter().any(|t| t.sha != ranks[0].sha) {
        bail!("the ranks finished with different parameters");
    }
    // The same global batch in one process: on one device, and with DataParallel.
    let global_args = Args {
        batch: args.batch * args.ranks,
        ..args.clone()
    };
    let single_global = collect(spawn(&global_args, "single", 0, None)?, "single-process")?;
    let dp = collect(spawn(args, "dp", 0, None)?, "data-parallel")?;

    // A DDP step ends when the slowest rank's does: the per-step maximum over ranks.
    let steps = args.steps;
    let ddp_steps: Vec<f64> = (0..steps)
        .map(|s| ranks.iter().map(|t| t.steps_ms[s]).fold(0.0, f64::max))
        .collect();
    let sync: Vec<f64> = (0..steps)
        .map(|s| ranks.iter().map(|t| t.sync_ms[s]).fold(0.0, f64::max))
        .collect();
    let base = median(&single.steps_ms);
    let slowest = |runs: &[Timing], pick: fn(&Timing) -> &Vec<f64>| -> Vec<f64> {
        (0..steps)
            .map(|s| runs.iter().map(|t| pick(t)[s]).fold(0.0, f64::max))
            .collect()
    };
    let conc_steps = slowest(&concurrent, |t| &t.steps_ms);
    let conc_sync = slowest(&concurrent, |t| &t.sync_ms);
    let ddp = median(&ddp_steps);
    let mut rows = vec![
        (
            "single",
            1,
            median(&single.steps_ms),
            percentile_of(&single.steps_ms, 0.9),
            median(&single.sync_ms),
        ),
        (
            "single-concurrent",
            args.ranks,
            median(&conc_steps),
            percentile_of(&conc_steps, 0.9),
            median(&conc_sync),
        ),
        (
            "ddp",
            args.ranks,
            ddp,
            percentile_of(&ddp_steps, 0.9),
            median(&sync),
        ),
    ];
    let layers = &args.layers;
    println!(
        "MLP {layers}, batch {} per rank, {} thread(s) per process, {} timed steps, mode {:?}, buckets {} MiB first / {} MiB cap, allocator {:?}",
        args.batch, args.threads, steps, args.mode, args.first_bucket_mb, args.bucket_cap_mb, args.allocator
    );
    println!(
        "{:<18} {:>5} {:>10} {:>10} {:>10} {:>7}",
        "run", "ranks", "median ms", "p90 ms", "update ms", "ratio"
    );
    let mut csv =
        String::from("run,ranks,batch_per_rank,threads,median_ms,p90_ms,update_ms,ratio\n");
    for (name, n, med, p90, upd) in rows.drain(..) {
        let ratio = med / base;
        println!("{name:<18} {n:>5} {med:>10.2} {p90:>10.2} {upd:>10.2} {ratio:>7.3}");
        csv.push_str(&format!(
            "{name},{n},{},{},{med:.3},{p90:.3},{upd:.3},{ratio:.4}\n",
            args.batch, args.threads
        ));
    }
    println!(
        "ddp over single-concurrent: {:.3}",
        ddp / median(&conc_steps)
    );
    println!(
        "loss {:.4} -> {:.4} (ddp rank 0); peer: torch DDP + Gloo 1.26x (31.9 ms vs 25.3 ms); goal <= 1.10x",
        ranks[0].first_loss, ranks[0].last_loss
    );
    let global = (args.batch * args.ranks) as f64;
    let per_s = |ms: f64| global / (ms / 1e3);
    let one = per_s(median(&single_global.steps_ms));
    println!(
        "\nsame global batch ({} samples per step), {} thread(s) per replica or process:",
        args.batch * args.ranks,
        args.threads
    );
    println!(
        "{:<18} {:>8} {:>10} {:>12} {:>9}",
        "run", "devices", "median ms", "samples/s", "vs one"
    );
    csv.push_str("\nrun,devices,global_batch,threads,median_ms,samples_per_s,speedup\n");
    for (name, n, steps_ms) in [
        ("one-device", 1, &single_global.steps_ms),
        ("data-parallel", args.ranks, &dp.steps_ms),
        ("ddp", args.ranks, &ddp_steps),
    ] {
        let med = median(steps_ms);
        let sps = per_s(med);
        println!(
            "{name:<18} {n:>8} {med:>10.2} {sps:>12.0} {:>9.3}",
            sps / one
        );
        csv.push_str(&format!(
            "{name},{n},{},{},{med:.3},{sps:.1},{:.4}\n",
            args.batch * args.ranks,
            args.threads,
            sps / one
        ));
    }
    println!("goal: data-parallel over 2 CPU replicas >= 1.6x one device");
    if let Some(path) = &args.csv {
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One process, DataParallel over `--ranks` CPU replicas at the global batch; the optimizer
/// updates the first replica's variables in place, as in the single-process baseline.
fn data_parallel(args: &Args) -> Result<Timing> {
    let cfg = MlpConfig::parse(&args.layers)?;
    let dp = DataParallel::new(vec![Device::Cpu; args.ranks], |vm: &VarMap, d: &Device| {
        Mlp::new(&cfg, vm, args.seed, d)
    })?;
    let data = TeacherDataset::new(300_000, cfg.input, cfg.classes, args.seed)?;
    let mut named: Vec<(String, candle_core::Var)> = named_vars(dp.varmap())?.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut opt = sgd(specs_of(&named))?;
    let vars: Vec<candle_core::Var> = named.into_iter().map(|(_, v)| v).collect();
    let global = args.batch * args.ranks;
    let mut sampler = ElasticSampler::new(ElasticConfig::new(data.len(), global).seed(args.seed))?;
    let mut steps_ms = Vec::new();
    let mut sync_ms = Vec::new();
    let mut losses = Vec::new();
    for step in 0..args.warmup + args.steps {
        if sampler.epoch_done() {
            sampler.set_epoch(sampler.epoch() + 1);
        }
        let planned = sampler.plan().context("an epoch has at least one step")?;
        let batch = data.batch(planned.indices(), &Device::Cpu)?;
        let t0 = Instant::now();
        let out = dp.forward_backward(&batch.x, &batch.y, |m, x, y| {
            m.loss(x, y)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })?;
        let t1 = Instant::now();
        step_vars(&mut opt, &vars, &out.grads)?;
        let t2 = Instant::now();
        sampler.commit(&planned)?;
        losses.push(out.loss);
        if step >= args.warmup {
            steps_ms.push((t2 - t0).as_secs_f64() * 1e3);
            sync_ms.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    Ok(Timing {
        steps_ms,
        sync_ms,
        first_loss: losses.first().copied().unwrap_or(f32::NAN),
        last_loss: losses.last().copied().unwrap_or(f32::NAN),
        sha: params_sha256(dp.varmap())?,
    })
}

fn percentile_of(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, p)
}

struct Setup {
    model: Mlp,
    varmap: VarMap,
    data: TeacherDataset,
}

fn setup(args: &Args) -> Result<Setup> {
    let cfg = MlpConfig::parse(&args.layers)?;
    let varmap = VarMap::new();
    let model = Mlp::new(&cfg, &varmap, args.seed, &Device::Cpu)?;
    let data = TeacherDataset::new(300_000, cfg.input, cfg.classes, args.seed)?;
    Ok(Setup {
        model,
        varmap,
        data,
    })
}

fn sgd(specs: Vec<rekindle_runtime::optim::ParamSpec>) -> Result<Sgd> {
    Ok(Sgd::new(SgdConfig::new(0.05).momentum(0.9), specs)?)
}

/// The baseline: one process, one batch per step, the same optimizer code updating the
/// variables in place straight from their gradients (no flattening, no collectives).
fn single(args: &Args) -> Result<Timing> {
    let s = setup(args)?;
    let mut named: Vec<(String, candle_core::Var)> = named_vars(&s.varmap)?.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut opt = sgd(specs_of(&named))?;
    let vars: Vec<candle_core::Var> = named.into_iter().map(|(_, v)| v).collect();
    let sampler =
        ElasticSampler::new(ElasticConfig::new(s.data.len(), args.batch).seed(args.seed))?;
    let mut update =
        |grads: &candle_core::backprop::GradStore, _n: usize, opt: &mut dyn Optimizer| {
            step_vars(opt, &vars, grads).map_err(anyhow::Error::from)
        };
    train(args, &s, &mut update, &mut opt, sampler, 1, 0)
}

fn group_config(store: Arc<dyn Store>, rank: usize, world: usize) -> Result<GroupConfig> {
    Ok(GroupConfig {
        job: "ddp-bench".into(),
        round: 0,
        rank,
        world_size: world,
        store,
        secret: JobSecret::new("ddp-bench")?,
        op_timeout: Duration::from_secs(60),
        bootstrap_timeout: Duration::from_secs(60),
    })
}

fn ddp_options(args: &Args) -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        first_bucket_mb: args.first_bucket_mb,
        mode: match args.mode {
            Mode::Atomic => StepMode::Atomic,
            Mode::Overlapped => StepMode::Overlapped,
        },
        ..DdpOptions::default()
    }
}

fn rank(args: &Args) -> Result<Timing> {
    let dir = args
        .store_dir
        .as_ref()
        .context("--store-dir is required for a rank")?;
    let s = setup(args)?;
    let store: Arc<dyn Store> = Arc::new(FileStore::new(dir)?);
    let pg = ProcessGroup::tcp(
        group_config(store, args.rank, args.ranks)?,
        TcpOptions::default(),
    )?;
    let mut ddp = Ddp::new(&s.varmap, pg, ddp_options(args))?;
    let mut opt = sgd(ddp.param_specs())?;
    let global = args.batch * args.ranks;
    let sampler = ElasticSampler::new(ElasticConfig::new(s.data.len(), global).seed(args.seed))?;
    let mut update =
        |grads: &candle_core::backprop::GradStore, n: usize, opt: &mut dyn Optimizer| {
            ddp.step(Some(grads), n, opt)
                .map(|_| ())
                .map_err(anyhow::Error::from)
        };
    let timing = train(
        args,
        &s,
        &mut update,
        &mut opt,
        sampler,
        args.ranks,
        args.rank,
    )?;
    ddp.check_parameters()?;
    Ok(timing)
}

fn train(
    args: &Args,
    s: &Setup,
    update: &mut dyn FnMut(
        &candle_core::backprop::GradStore,
        usize,
        &mut dyn Optimizer,
    ) -> Result<()>,
    opt: &mut dyn Optimizer,
    mut sampler: ElasticSampler,
    world: usize,
    rank: usize,
) -> Result<Timing> {
    let mut steps_ms = Vec::new();
    let mut sync_ms = Vec::new();
    let mut losses = Vec::new();
    for step in 0..args.warmup + args.steps {
        if sampler.epoch_done() {
            sampler.set_epoch(sampler.epoch() + 1);
        }
        let planned = sampler.plan().context("an epoch has at least one step")?;
        let mine = planned.rank_indices(world, rank)?;
        let batch = s.data.batch(mine, &Device::Cpu)?;
        let t0 = Instant::now();
        let loss = s.model.loss(&batch.x, &batch.y)?;
        let grads = loss.backward()?;
        let t1 = Instant::now();
        update(&grads, mine.len(), opt)?;
        let t2 = Instant::now();
        sampler.commit(&planned)?;
        losses.push(loss.to_scalar::<f32>()?);
        if step >= args.warmup {
            steps_ms.push((t2 - t0).as_secs_f64() * 1e3);
            sync_ms.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    Ok(Timing {
        steps_ms,
        sync_ms,
        first_loss: losses.first().copied().unwrap_or(f32::NAN),
        last_loss: losses.last().copied().unwrap_or(f32::NAN),
        sha: params_sha256(&s.varmap)?,
    })
}
