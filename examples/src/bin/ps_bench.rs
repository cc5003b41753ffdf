//! Parameter-server benchmarks.
//!
//! `ps_bench rank`: one rank of a job under `rekindle run` that trains a synthetic model of
//! `--params` f32 parameters (four tensors, gradients that cost one pass to compute) with the
//! synchronous parameter server (`--arch ps --servers K`) or DDP's ring all-reduce
//! (`--arch ring`), and reports the communication time per step: the time between the
//! measuring rank's (the first worker's) step-function calls minus the time inside them,
//! median over the steps after `--warmup`. `scripts/ps-bench-netns.sh` runs it with every
//! rank in its own network namespace behind a rate-limited link, for 1..4 workers and each
//! architecture, and appends one CSV row per run; the model it is compared with:
//!
//! ```text
//! parameter server, K servers, W workers:  2 x max(W / K, 1) x 4P bytes / rate
//!     (each server moves W x 4P/K bytes in, then out; each worker 4P in and out)
//! ring all-reduce, W ranks:                2 x (W - 1) / W x 4P bytes / rate
//!     (reduce-scatter then all-gather, both directions of every link at once)
//! ```
//!
//! That is the parameter server without its in-memory shard copies (`--shard-copies off`,
//! architecture `ps<K>-nocopies`). With the copies on and two servers or more, each server
//! also forwards its shard's summed gradient to the server keeping the copy:
//! `2 x max((W + 1) / K, 1) x 4P bytes / rate`, the table's second model.
//!
//! `ps_bench plot CSV SVG`: the table (measured, both models, ratios) in markdown on
//! stdout and the plot (measured points, model lines) as SVG.
//!
//! `ps_bench straggler`: one run of one benchmark for the straggler claim. For each mode
//! (async, then sync) it starts `rekindle run --standalone` with one server and `--workers`
//! workers of the `parameter_server` example, measures every worker's samples/s for
//! `--phase` seconds, then slows one worker about 3x with a SIGSTOP/SIGCONT duty cycle
//! (stopped two thirds of every `--period-ms`) and measures again: asynchronous training
//! keeps the other workers' rate, synchronous training falls to the straggler's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use clap::{Parser, Subcommand, ValueEnum};
use rekindle_elastic::train::strategy::{ParameterServer, PsConfig, PsMode};
use rekindle_elastic::train::{self, ElasticOptions, StepOutput, Trainer};
use rekindle_runtime::optim::{Optimizer, Sgd, SgdConfig};
use rekindle_runtime::sampler::ElasticConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Arch {
    /// The synchronous parameter server.
    Ps,
    /// DDP's ring all-reduce.
    Ring,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(Debug, Parser)]
#[command(about = "Parameter-server benchmarks", args_override_self = true)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// One rank of a communication benchmark (run under `rekindle run`).
    Rank {
        /// The architecture.
        #[arg(long, value_enum)]
        arch: Arch,
        /// Servers (the first ranks), for `--arch ps`.
        #[arg(long, default_value_t = 1)]
        servers: usize,
        /// `--arch ps` with two servers or more: `off` keeps no in-memory copies of the
        /// shards (no copy traffic; the row's architecture is `ps<K>-nocopies`).
        #[arg(long, value_enum, default_value = "on")]
        shard_copies: Switch,
        /// Parameters (f32) of the model.
        #[arg(long, default_value_t = 1 << 21)]
        params: usize,
        /// Steps measured.
        #[arg(long, default_value_t = 10)]
        steps: u64,
        /// Steps run first and not measured.
        #[arg(long, default_value_t = 2)]
        warmup: u64,
        /// The measuring rank appends a row here.
        #[arg(long)]
        csv: Option<PathBuf>,
        /// The link rate the run was shaped to, in Mbit/s (recorded in the CSV).
        #[arg(long, default_value_t = 0.0)]
        rate_mbit: f64,
    },
    /// Table and SVG plot from the CSV of `rank` runs.
    Plot {
        /// The CSV.
        csv: PathBuf,
        /// The SVG to write.
        svg: PathBuf,
    },
    /// Asynchronous and synchronous training with a straggler.
    Straggler {
        /// Workers (one server besides).
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// Seconds measured per phase.
        #[arg(long, default_value_t = 10.0)]
        phase: f64,
        /// Seconds before the first phase.
        #[arg(long, default_value_t = 3.0)]
        warmup: f64,
        /// The duty cycle's period.
        #[arg(long, default_value_t = 150)]
        period_ms: u64,
        /// Layer sizes of the example model.
        #[arg(long, default_value = "256-512-10")]
        layers: String,
        /// Samples per step.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Write the rates here (CSV).
        #[arg(long)]
        csv: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    match Args::parse().cmd {
        Cmd::Rank {
            arch,
            servers,
            shard_copies,
            params,
            steps,
            warmup,
            csv,
            rate_mbit,
        } => rank(&RankArgs {
            arch,
            servers,
            copies: shard_copies == Switch::On,
            params,
            steps,
            warmup,
            csv,
            rate_mbit,
        }),
        Cmd::Plot { csv, svg } => plot(&csv, &svg),
        Cmd::Straggler {
            workers,
            phase,
            warmup,
            period_ms,
            layers,
            batch,
            csv,
        } => straggler(&StragglerArgs {
            workers,
            phase,
            warmup,
            period: Duration::from_millis(period_ms),
            layers,
            batch,
            csv,
        }),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

struct RankArgs {
    arch: Arch,
    servers: usize,
    copies: bool,
    params: usize,
    steps: u64,
    warmup: u64,
    csv: Option<PathBuf>,
    rate_mbit: f64,
}

fn rank(a: &RankArgs) -> Result<()> {
    let (arch, servers, copies, params) = (a.arch, a.servers, a.copies, a.params);
    let (steps, warmup, csv, rate_mbit) = (a.steps, a.warmup, a.csv.as_deref(), a.rate_mbit);
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let worker = train::init()?;
    let rank = worker.assignment.rank;
    let world = worker.assignment.world_size;
    let (servers, workers) = match arch {
        Arch::Ps => {
            if world <= servers {
                bail!("{servers} server(s) need at least {} ranks", servers + 1);
            }
            (servers, world - servers)
        }
        Arch::Ring => (0, world),
    };
    // Four tensors of a quarter each; the gradient of sum(w * c) is c.
    let varmap = VarMap::new();
    let mut tensors = Vec::new();
    {
        let mut data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned VarMap"))?;
        for i in 0..4 {
            let n = params / 4 + usize::from(i < params % 4);
            let var = Var::from_tensor(&Tensor::zeros(n, DType::F32, &Device::Cpu)?)?;
            tensors.push(var.as_tensor().clone());
            data.insert(format!("w{i}"), var);
        }
    }
    let c = Tensor::full(1e-3f32, params / 4 + 1, &Device::Cpu)?;
    let sgd = |specs| -> Result<Box<dyn Optimizer>, _> {
        Ok(Box::new(Sgd::new(SgdConfig::new(1e-6), specs)?) as Box<dyn Optimizer>)
    };
    let mut options = ElasticOptions {
        progress: false,
        op_timeout: Duration::from_secs(120),
        bootstrap_timeout: Duration::from_secs(120),
        ..ElasticOptions::default()
    };
    // Ranks in separate network namespaces are separate hosts.
    options.tcp.shared_memory = false;
    let data = ElasticConfig::new(1 << 20, 64 * workers.max(1)).seed(1);
    let total = warmup + steps;
    let measuring = rank == servers;
    let mut enter: Vec<Instant> = Vec::new();
    let mut compute: Vec<f64> = Vec::new();
    let mut step_fn = |input: &train::StepInput<'_>| -> Result<StepOutput> {
        let t0 = Instant::now();
        enter.push(t0);
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for t in &tensors {
            let n = t.dim(0)?;
            loss = (loss + (t * c.narrow(0, 0, n)?)?.sum_all()?)?;
        }
        let out = StepOutput::new(loss.backward()?, input.indices.len().max(1));
        compute.push(t0.elapsed().as_secs_f64());
        Ok(out)
    };
    match arch {
        Arch::Ps => {
            let mut config = PsConfig::new(servers, PsMode::Sync);
            config.copies = copies;
            let strategy = ParameterServer::new(varmap.clone(), Box::new(sgd), config)?;
            let mut t = Trainer::with_strategy(worker, strategy, data, options)?;
            t.run(total + 1, &mut step_fn)?;
        }
        Arch::Ring => {
            let opt = sgd(train::param_specs(&varmap)?)?;
            let mut t = Trainer::new(worker, varmap.clone(), opt, data, options)?;
            t.run(total + 1, &mut step_fn)?;
        }
    }
    if !measuring {
        return Ok(());
    }
    // Step i's time: from its call to the next call.
    let mut step_ms: Vec<f64> = Vec::new();
    let mut comm_ms: Vec<f64> = Vec::new();
    for i in warmup as usize..(total as usize).min(enter.len().saturating_sub(1)) {
        let step = (enter[i + 1] - enter[i]).as_secs_f64();
        step_ms.push(step * 1e3);
        comm_ms.push((step - compute[i]) * 1e3);
    }
    let mut compute_ms: Vec<f64> = compute.iter().map(|c| c * 1e3).collect();
    let (comm, step, comp) = (
        median(&mut comm_ms),
        median(&mut step_ms),
        median(&mut compute_ms),
    );
    let label = match arch {
        Arch::Ps if copies || servers < 2 => format!("ps{servers}"),
        Arch::Ps => format!("ps{servers}-nocopies"),
        Arch::Ring => "ring".to_string(),
    };
    println!(
        "ps_bench arch={label} workers={workers} params={params} comm_ms={comm:.2} \
         step_ms={step:.2} compute_ms={comp:.2} rate_mbit={rate_mbit}"
    );
    if let Some(path) = csv {
        let mut f = rekindle_examples::append_csv(
            path,
            "arch,servers,workers,params,rate_mbit,comm_ms,step_ms,compute_ms",
        )?;
        writeln!(
            f,
            "{label},{servers},{workers},{params},{rate_mbit},{comm:.3},{step:.3},{comp:.3}"
        )?;
    }
    Ok(())
}

/// The model's communication time in ms (see the module docs).
fn model_ms(arch: &str, servers: usize, workers: usize, params: usize, rate_mbit: f64) -> f64 {
    let bytes = 4.0 * params as f64;
    let rate = rate_mbit * 1e6 / 8.0;
    let w = workers as f64;
    let moved = if arch == "ring" {
        2.0 * (w - 1.0) / w * bytes
    } else {
        2.0 * (w / servers as f64).max(1.0) * bytes
    };
    moved / rate * 1e3
}

/// The model with the traffic of the servers' in-memory copies: with two servers or more and
/// the copies on, each server also forwards its shard's summed gradient to the server that
/// keeps the copy, so a server link carries `(W + 1) x 4P / K` each way.
fn model_with_copies_ms(
    arch: &str,
    servers: usize,
    workers: usize,
    params: usize,
    rate_mbit: f64,
) -> f64 {
    if arch == "ring" || arch.ends_with("-nocopies") || servers < 2 {
        return model_ms(arch, servers, workers, params, rate_mbit);
    }
    let bytes = 4.0 * params as f64;
    let rate = rate_mbit * 1e6 / 8.0;
    let w = workers as f64;
    2.0 * ((w + 1.0) / servers as f64).max(1.0) * bytes / rate * 1e3
}

/// One CSV row of `rank` runs.
#[derive(Debug, Clone)]
struct Row {
    arch: String,
    servers: usize,
    workers: usize,
    params: usize,
    rate_mbit: f64,
    comm_ms: f64,
}

fn read_rows(csv: &Path) -> Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let bad = || format!("{}: line {}: {line:?}", csv.display(), n + 1);
        if f.len() < 6 {
            bail!(bad());
        }
        rows.push(Row {
            arch: f[0].to_string(),
            servers: f[1].parse().with_context(bad)?,
            workers: f[2].parse().with_context(bad)?,
            params: f[3].parse().with_context(bad)?,
            rate_mbit: f[4].parse().with_context(bad)?,
            comm_ms: f[5].parse().with_context(bad)?,
        });
    }
    if rows.is_empty() {
        bail!("{}: no rows", csv.display());
    }
    Ok(rows)
}

fn plot(csv: &Path, svg_path: &Path) -> Result<()> {
    let rows = read_rows(csv)?;
    // The median of repeated runs of one configuration.
    let mut runs: BTreeMap<(String, usize, usize), Vec<f64>> = BTreeMap::new();
    for r in &rows {
        runs.entry((r.arch.clone(), r.servers, r.workers))
            .or_default()
            .push(r.comm_ms);
    }
    let (params, rate) = (rows[0].params, rows[0].rate_mbit);
    println!(
        "| architecture | workers | measured ms/step | model ms/step | measured / model | \
         model with copy traffic | measured / that |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    let mut series: BTreeMap<String, Vec<(usize, f64, f64)>> = BTreeMap::new();
    for ((arch, servers, workers), v) in &mut runs {
        let m = median(v);
        let model = model_ms(arch, *servers, *workers, params, rate);
        let with_copies = model_with_copies_ms(arch, *servers, *workers, params, rate);
        let ratio = |model: f64| {
            if model > 0.0 {
                format!("{:.2}", m / model)
            } else {
                "-".into()
            }
        };
        let name = if arch == "ring" {
            "ring all-reduce".to_string()
        } else if arch.ends_with("-nocopies") {
            format!("parameter server, {servers} server(s), no copies")
        } else {
            format!("parameter server, {servers} server(s)")
        };
        println!(
            "| {name} | {workers} | {m:.1} | {model:.1} | {} | {with_copies:.1} | {} |",
            ratio(model),
            ratio(with_copies)
        );
        series.entry(name).or_default().push((*workers, m, model));
    }
    let (w, h, left, right, top, bottom) = (720.0, 420.0, 70.0, 200.0, 20.0, 45.0);
    let xmax = series.values().flatten().map(|p| p.0).max().unwrap_or(1) as f64;
    let ymax = series
        .values()
        .flatten()
        .map(|p| p.1.max(p.2))
        .fold(1.0, f64::max)
        * 1.1;
    let sx = |x: f64| left + (x - 1.0) / (xmax - 1.0).max(1.0) * (w - left - right);
    let sy = |y: f64| top + (1.0 - y / ymax) * (h - top - bottom);
    let mut svg = String::new();
    writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    )?;
    writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#)?;
    writeln!(
        svg,
        r#"<path d="M{left},{top} V{} H{}" stroke="black" fill="none"/>"#,
        h - bottom,
        w - right
    )?;
    for i in 0..=4 {
        let y = ymax * i as f64 / 4.0;
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{y:.0}</text><path d="M{left},{} h-4" stroke="black"/>"##,
            left - 6.0,
            sy(y) + 4.0,
            sy(y)
        )?;
    }
    for x in 1..=xmax as usize {
        writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{x}</text>"#,
            sx(x as f64),
            h - bottom + 16.0
        )?;
    }
    writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">workers</text>"#,
        (left + w - right) / 2.0,
        h - 8.0
    )?;
    writeln!(
        svg,
        r#"<text x="16" y="{y}" transform="rotate(-90 16 {y})" text-anchor="middle">communication ms per step ({:.0} MB of parameters, {rate:.0} Mbit/s links)</text>"#,
        4.0 * params as f64 / 1e6,
        y = (top + h - bottom) / 2.0
    )?;
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        let mut model = String::new();
        for (j, (x, _, m)) in pts.iter().enumerate() {
            let cmd = if j == 0 { 'M' } else { 'L' };
            write!(model, "{cmd}{:.1},{:.1} ", sx(*x as f64), sy(*m))?;
        }
        writeln!(
            svg,
            r##"<path d="{model}" stroke="{color}" stroke-dasharray="5 4" fill="none"/>"##
        )?;
        for (x, y, _) in pts {
            writeln!(
                svg,
                r##"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{color}"/>"##,
                sx(*x as f64),
                sy(*y)
            )?;
        }
        let ly = top + 16.0 + 18.0 * i as f64;
        writeln!(
            svg,
            r##"<circle cx="{}" cy="{}" r="4" fill="{color}"/><text x="{}" y="{}">{name}</text>"##,
            w - right + 14.0,
            ly - 4.0,
            w - right + 24.0,
            ly
        )?;
    }
    let ly = top + 16.0 + 18.0 * series.len() as f64;
    writeln!(
        svg,
        r##"<path d="M{},{} h16" stroke="#444" stroke-dasharray="5 4"/><text x="{}" y="{}">model</text>"##,
        w - right + 6.0,
        ly - 4.0,
        w - right + 24.0,
        ly
    )?;
    writeln!(svg, "</svg>")?;
    std::fs::write(svg_path, svg).with_context(|| format!("writing {}", svg_path.display()))?;
    eprintln!("wrote {}", svg_path.display());
    Ok(())
}

struct StragglerArgs {
    workers: usize,
    phase: f64,
    warmup: f64,
    period: Duration,
    layers: String,
    batch: usize,
    csv: Option<PathBuf>,
}

/// A binary next to this one.
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let p = exe.with_file_name(name);
    if !p.is_file() {
        bail!(
            "{} not found: build the workspace's binaries first",
            p.display()
        );
    }
    Ok(p)
}

/// A job's output lines, and the processes to kill at the end.
struct Running {
    agent: std::process::Child,
    lines: mpsc::Receiver<String>,
    pids: BTreeMap<usize, i32>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for pid in self.pids.values() {
            // SAFETY: kill(2) on pids this job printed; a stale pid is at worst ESRCH.
            unsafe {
                libc::kill(*pid, libc::SIGCONT);
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        let _ = self.agent.kill();
        let _ = self.agent.wait();
    }
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// Reads the job's lines until `until`: the workers' pids, and each progress line as
/// (seconds since `origin` when it arrived, the worker's samples so far).
fn collect(
    job: &mut Running,
    origin: Instant,
    until: Instant,
    points: &mut BTreeMap<usize, Vec<(f64, u64)>>,
) {
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        let Ok(line) = job.lines.recv_timeout(left) else {
            return;
        };
        if line.contains(" pid=") {
            if let (Some(r), Some(p)) = (field(&line, "rank"), field(&line, "pid")) {
                if let (Ok(r), Ok(p)) = (r.parse(), p.parse()) {
                    job.pids.insert(r, p);
                }
            }
        }
        if line.contains("progress rank=") {
            if let (Some(r), Some(s)) = (
                field(&line, "rank").and_then(|v| v.parse().ok()),
                field(&line, "samples").and_then(|v| v.parse().ok()),
            ) {
                points
                    .entry(r)
                    .or_default()
                    .push((origin.elapsed().as_secs_f64(), s));
            }
        }
    }
}

/// Samples per second of each worker over the progress points in `[from, to]` seconds.
fn per_second(
    points: &BTreeMap<usize, Vec<(f64, u64)>>,
    from: f64,
    to: f64,
) -> BTreeMap<usize, f64> {
    points
        .iter()
        .filter_map(|(r, v)| {
            let inside: Vec<&(f64, u64)> =
                v.iter().filter(|(t, _)| *t >= from && *t <= to).collect();
            let (a, b) = (inside.first()?, inside.last()?);
            (b.0 > a.0).then(|| (*r, (b.1 - a.1) as f64 / (b.0 - a.0)))
        })
        .collect()
}

/// Samples/s by rank.
type Rates = BTreeMap<usize, f64>;

fn straggler(a: &StragglerArgs) -> Result<()> {
    if a.workers < 2 {
        bail!("--workers must be at least 2 (one is slowed)");
    }
    let rekindle = sibling("rekindle")?;
    let example = sibling("parameter_server")?;
    let mut results: Vec<(String, Rates, Rates)> = Vec::new();
    let victim = a.workers; // the last worker's rank (one server first)
    for mode in ["async", "sync"] {
        let logs = tempfile::tempdir()?;
        let mut agent = Command::new(&rekindle)
            .args(["run", "--standalone", "--nproc-per-node"])
            .arg((a.workers + 1).to_string())
            .arg("--log-dir")
            .arg(logs.path())
            .arg(&example)
            .args(["--servers", "1", "--mode", mode, "--staleness", "none"])
            .args(["--steps", "100000000", "--layers", &a.layers])
            .args(["--batch", &a.batch.to_string(), "--dataset", "65536"])
            .args(["--threads", "1", "--progress-every", "5", "--seed", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the job")?;
        let (tx, lines) = mpsc::channel();
        let out = agent.stdout.take().context("no stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut job = Running {
            agent,
            lines,
            pids: BTreeMap::new(),
        };
        let mut points: BTreeMap<usize, Vec<(f64, u64)>> = BTreeMap::new();
        let origin = Instant::now();
        let at = |secs: f64| origin + Duration::from_secs_f64(secs);
        // Until every worker reports progress.
        while points.len() < a.workers && origin.elapsed() < Duration::from_secs(120) {
            collect(
                &mut job,
                origin,
                Instant::now() + Duration::from_millis(200),
                &mut points,
            );
        }
        if points.len() < a.workers {
            bail!("{mode}: the workers did not report progress within 120 s");
        }
        let t0 = origin.elapsed().as_secs_f64();
        let base = (t0 + a.warmup, t0 + a.warmup + a.phase);
        collect(&mut job, origin, at(base.1), &mut points);
        let pid = *job.pids.get(&victim).context("the straggler's pid")?;
        // The duty cycle: stopped 2/3 of every period.
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let period = a.period;
        let cycle = std::thread::spawn(move || loop {
            // SAFETY: kill(2) on the straggler's pid.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            if stop_rx.recv_timeout(period / 3).is_ok() {
                return;
            }
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            if stop_rx.recv_timeout(period * 2 / 3).is_ok() {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                return;
            }
        });
        let slow = (base.1 + a.warmup, base.1 + a.warmup + a.phase);
        collect(&mut job, origin, at(slow.1), &mut points);
        let _ = stop_tx.send(());
        let _ = cycle.join();
        let before = per_second(&points, base.0, base.1);
        let after = per_second(&points, slow.0, slow.1);
        results.push((mode.to_string(), before, after));
        drop(job);
    }
    println!(
        "| mode | worker | samples/s before | samples/s with rank {victim} slowed | change |\n\
         |---|---|---|---|---|"
    );
    let mut csv = String::from("mode,rank,before,after\n");
    for (mode, before, after) in &results {
        for (r, b) in before {
            let x = after.get(r).copied().unwrap_or(0.0);
            let tag = if *r == victim { " (slowed)" } else { "" };
            println!(
                "| {mode} | rank {r}{tag} | {b:.0} | {x:.0} | {:+.1}% |",
                (x / b - 1.0) * 100.0
            );
            writeln!(csv, "{mode},{r},{b:.1},{x:.1}")?;
        }
        let others: Vec<f64> = before
            .iter()
            .filter(|(r, _)| **r != victim)
            .map(|(r, b)| after.get(r).copied().unwrap_or(0.0) / b)
            .collect();
        let mean = others.iter().sum::<f64>() / others.len().max(1) as f64;
        println!(
            "| {mode} | others, mean | | | {:+.1}% |",
            (mean - 1.0) * 100.0
        );
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
