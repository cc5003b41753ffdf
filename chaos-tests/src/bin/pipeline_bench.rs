//! Pipeline benchmarks: the `pipeline` example under `rekindle run --standalone`, measured.
//!
//! ```text
//! cargo build --release --workspace --bins
//! target/release/pipeline_bench bubble   --csv docs/data/pipeline-bubble.csv
//! target/release/pipeline_bench recovery --kills 20 --csv docs/data/pipeline-recovery.csv
//! target/release/pipeline_bench memory   --csv docs/data/pipeline-memory.csv
//! target/release/pipeline_bench copy     --csv docs/data/pipeline-copy.csv
//! ```
//!
//! - `bubble`: GPipe and 1F1B at S = 2, 3, 4 stages and M = 1, 4, 8 micro-batches. Every rank
//!   records each step's passes; the idle fraction of a step is
//!   `1 - sum(busy) / (S * (last pass end - first pass start))` over the stages, its median over
//!   the measured steps is set against `(S-1)/(M+S-1)`. By default every layer's compute is
//!   emulated by a wait (`--emulate-ms` forward, twice that backward), so the S stages run
//!   side by side on fewer cores; `--emulate-ms 0` uses the MLP's real compute.
//! - `recovery`: SIGKILLs a stage rank every `--gap` steps (victims rotate over the ranks),
//!   and measures the time from the kill to the completion of the re-formed group's first step
//!   and the committed steps lost.
//! - `memory`: each stage rank's parameters, optimizer state, neighbour copy, the most
//!   micro-batches in flight (GPipe keeps M, 1F1B at most S - s) and their activations, and
//!   its peak resident set.
//! - `copy`: the step time with and without neighbour copies (refreshed every step).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::{field, kill, workspace_bin, Proc};

#[derive(Debug, Parser)]
#[command(about = "Pipeline benchmarks: bubble, recovery, memory, neighbour-copy overhead")]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Idle fraction of GPipe and 1F1B against (S-1)/(M+S-1).
    Bubble {
        /// Stage counts.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
        stages: Vec<usize>,
        /// Micro-batch counts.
        #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
        micro: Vec<usize>,
        /// Emulated forward milliseconds per layer (0: the real compute).
        #[arg(long, default_value_t = 2.0)]
        emulate_ms: f64,
        /// Layer sizes (12 equal layers split evenly over 2, 3 or 4 stages).
        #[arg(long, default_value = "64-64-64-64-64-64-64-64-64-64-64-64-64")]
        layers: String,
        /// Global batch.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Steps per setting (the first `--warmup` are not counted).
        #[arg(long, default_value_t = 15)]
        steps: u64,
        /// Steps not counted.
        #[arg(long, default_value_t = 3)]
        warmup: u64,
        /// Rows here.
        #[arg(long)]
        csv: Option<PathBuf>,
    },
    /// Time from SIGKILL of a stage rank to the re-formed group's next completed step.
    Recovery {
        /// Kills.
        #[arg(long, default_value_t = 20)]
        kills: usize,
        /// Stages (= ranks).
        #[arg(long, default_value_t = 3)]
        stages: usize,
        /// Kill only this rank (default: rotate over every rank).
        #[arg(long)]
        victim: Option<usize>,
        /// Layer sizes.
        #[arg(long, default_value = "256-512-512-512-512-512-10")]
        layers: String,
        /// Global batch.
        #[arg(long, default_value_t = 256)]
        batch: usize,
        /// Completed steps between a recovery and the next kill.
        #[arg(long, default_value_t = 8)]
        gap: u64,
        /// Without neighbour copies (a lost stage comes from the checkpoint).
        #[arg(long)]
        no_copy: bool,
        /// A kill not recovered from within this many seconds is a hang.
        #[arg(long, default_value_t = 60.0)]
        hang_after: f64,
        /// Rows here.
        #[arg(long)]
        csv: Option<PathBuf>,
    },
    /// Memory per stage rank.
    Memory {
        /// Stage counts.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
        stages: Vec<usize>,
        /// Micro-batches.
        #[arg(long, default_value_t = 8)]
        micro: usize,
        /// Layer sizes.
        #[arg(long, default_value = "512-1024-1024-1024-1024-1024-1024-1024-10")]
        layers: String,
        /// Global batch.
        #[arg(long, default_value_t = 1024)]
        batch: usize,
        /// Steps.
        #[arg(long, default_value_t = 5)]
        steps: u64,
        /// Rows here.
        #[arg(long)]
        csv: Option<PathBuf>,
    },
    /// Step time with and without neighbour copies.
    Copy {
        /// Stage counts.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
        stages: Vec<usize>,
        /// Layer sizes.
        #[arg(long, default_value = "256-512-512-512-512-512-512-512-10")]
        layers: String,
        /// Global batch.
        #[arg(long, default_value_t = 256)]
        batch: usize,
        /// Steps per run (the first 5 are not counted).
        #[arg(long, default_value_t = 60)]
        steps: u64,
        /// Runs per setting (alternating with and without copies; medians reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Rows here.
        #[arg(long)]
        csv: Option<PathBuf>,
    },
}

/// The recovery benchmark's checkpoint interval (steps).
const CHECKPOINT_EVERY: u64 = 50;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `rekindle run --standalone --nproc-per-node <nproc> [agent] pipeline <args>`.
fn launch(nproc: usize, agent: &[&str], args: &[String], logs: &Path) -> Result<Proc> {
    let mut all = strings(&["run", "--standalone", "--nproc-per-node"]);
    all.push(nproc.to_string());
    all.extend(strings(&["--log-dir", &logs.display().to_string()]));
    all.extend(strings(agent));
    all.push(workspace_bin("pipeline")?.display().to_string());
    all.extend(args.iter().cloned());
    let mut cmd = std::process::Command::new(workspace_bin("rekindle")?);
    cmd.args(&all).env("REKINDLE_LOG", "warn");
    Ok(Proc::spawn(cmd)?)
}

fn run_to_end(nproc: usize, args: &[String]) -> Result<Proc> {
    let logs = tempfile::tempdir()?;
    let mut job = launch(nproc, &[], args, logs.path())?;
    if job.wait_exit(Duration::from_secs(600)).ok() != Some(0) {
        bail!("the job failed:\n{}", job.output());
    }
    Ok(job)
}

fn write_csv(path: &Option<PathBuf>, header: &str, rows: &[String]) -> Result<()> {
    if let Some(path) = path {
        let mut f = std::fs::File::create(path).with_context(|| path.display().to_string())?;
        writeln!(f, "{header}")?;
        for r in rows {
            writeln!(f, "{r}")?;
        }
    }
    Ok(())
}

/// One rank's step timings: `step -> (started, passes_start, passes_end, busy, ended)`.
type Timings = BTreeMap<u64, (f64, f64, f64, f64, f64)>;

fn read_timings(dir: &Path) -> Result<Vec<Timings>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let text = std::fs::read_to_string(&path)?;
        let mut t = Timings::new();
        for l in text.lines().skip(1) {
            let f: Vec<f64> = l.split(',').filter_map(|x| x.parse().ok()).collect();
            if f.len() == 11 {
                t.insert(f[0] as u64, (f[6], f[7], f[8], f[9], f[10]));
            }
        }
        out.push(t);
    }
    Ok(out)
}

fn ideal(s: usize, m: usize) -> f64 {
    (s as f64 - 1.0) / (m as f64 + s as f64 - 1.0)
}

#[allow(clippy::too_many_arguments)]
fn bubble(
    stages: &[usize],
    micro: &[usize],
    emulate_ms: f64,
    layers: &str,
    batch: usize,
    steps: u64,
    warmup: u64,
    csv: &Option<PathBuf>,
) -> Result<()> {
    println!("| schedule | S | M | (S-1)/(M+S-1) | measured idle (passes) | difference | idle over the whole step |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for schedule in ["gpipe", "1f1b"] {
        for &s in stages {
            for &m in micro {
                let dir = tempfile::tempdir()?;
                let mut args = strings(&[
                    "--stages",
                    &s.to_string(),
                    "--micro-batches",
                    &m.to_string(),
                    "--schedule",
                    schedule,
                    "--steps",
                    &steps.to_string(),
                    "--layers",
                    layers,
                    "--batch",
                    &batch.to_string(),
                    "--dataset",
                    "8192",
                    "--threads",
                    "1",
                    "--timings-dir",
                    &dir.path().display().to_string(),
                ]);
                if emulate_ms > 0.0 {
                    args.extend(strings(&["--emulate-ms", &emulate_ms.to_string()]));
                }
                run_to_end(s, &args)?;
                let ranks = read_timings(dir.path())?;
                if ranks.len() != s {
                    bail!("{} timing files for {s} ranks", ranks.len());
                }
                let (mut passes, mut whole) = (Vec::new(), Vec::new());
                for step in warmup..steps {
                    let rows: Vec<_> = ranks.iter().filter_map(|t| t.get(&step)).collect();
                    if rows.len() != s {
                        continue;
                    }
                    let busy: f64 = rows.iter().map(|r| r.3).sum();
                    let first = rows.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
                    let last = rows.iter().map(|r| r.2).fold(0.0, f64::max);
                    let start = rows.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
                    let end = rows.iter().map(|r| r.4).fold(0.0, f64::max);
                    passes.push(1.0 - busy / (s as f64 * (last - first)));
                    whole.push(1.0 - busy / (s as f64 * (end - start)));
                }
                let (p, w) = (median(&mut passes), median(&mut whole));
                let i = ideal(s, m);
                println!(
                    "| {schedule} | {s} | {m} | {:.1}% | {:.1}% | {:+.1} pp | {:.1}% |",
                    100.0 * i,
                    100.0 * p,
                    100.0 * (p - i),
                    100.0 * w
                );
                rows.push(format!(
                    "{schedule},{s},{m},{emulate_ms},{i:.4},{p:.4},{w:.4},{}",
                    passes.len()
                ));
            }
        }
    }
    write_csv(
        csv,
        "schedule,stages,micro_batches,emulate_ms,ideal,idle_passes,idle_step,steps",
        &rows,
    )
}

/// `(step, unix_time)` of every row of the loss CSV.
fn loss_rows(path: &Path) -> Vec<(u64, f64)> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Some((f.first()?.parse().ok()?, f.get(5)?.parse().ok()?))
        })
        .collect()
}

/// The `(generation, step)` of the newest `generation G: ... state of step S` line with
/// `G >= generation`.
fn resumed_step(job: &Proc, generation: u64) -> Option<(u64, u64)> {
    job.lines().iter().rev().find_map(|l| {
        let l = &l.text;
        let g: u64 = l
            .split(" generation ")
            .nth(1)?
            .split(':')
            .next()?
            .parse()
            .ok()?;
        let s: u64 = l
            .split("state of step ")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()?;
        (g >= generation).then_some((g, s))
    })
}

#[allow(clippy::too_many_arguments)]
fn recovery(
    kills: usize,
    stages: usize,
    victim: Option<usize>,
    layers: &str,
    batch: usize,
    gap: u64,
    no_copy: bool,
    hang_after: f64,
    csv: &Option<PathBuf>,
) -> Result<()> {
    let work = tempfile::tempdir()?;
    let loss = work.path().join("loss.csv");
    let ckpt = work.path().join("ckpt");
    let mut args = strings(&[
        "--stages",
        &stages.to_string(),
        "--steps",
        "100000000",
        "--layers",
        layers,
        "--batch",
        &batch.to_string(),
        "--threads",
        "1",
        "--checkpoint-dir",
        &ckpt.display().to_string(),
        "--checkpoint-every",
        &CHECKPOINT_EVERY.to_string(),
        "--loss-csv",
        &loss.display().to_string(),
    ]);
    if no_copy {
        args.push("--no-copy".into());
    }
    let restarts = (kills + 1).to_string();
    let mut job = launch(
        stages,
        &["--max-restarts", &restarts],
        &args,
        &work.path().join("logs"),
    )?;
    let hang = Duration::from_secs_f64(hang_after);
    // Without copies a lost stage comes from the newest checkpoint: the first kill waits for
    // the first one (a job that lost layers held nowhere, with no checkpoint, fails).
    let mut ready_at = 1 + gap + if no_copy { CHECKPOINT_EVERY } else { 0 };
    let mut generation = 0u64;
    let mut rows = Vec::new();
    let (mut ms, mut lost) = (Vec::new(), Vec::new());
    let mut hangs = 0;
    while ms.len() < kills {
        let deadline = Instant::now() + hang;
        while loss_rows(&loss).last().is_none_or(|(s, _)| *s < ready_at) {
            let _ = job.next_line(Duration::from_millis(5), |_| false);
            if Instant::now() > deadline {
                bail!("no progress:\n{}", job.output());
            }
        }
        let v = victim.unwrap_or(ms.len() % stages);
        let Some(pid) = rank_pid(&job, v) else {
            bail!("no pid for rank {v}:\n{}", job.output());
        };
        let before = loss_rows(&loss).last().map_or(0, |r| r.0);
        let t_kill = unix_now();
        kill(pid, libc::SIGKILL);
        let deadline = Instant::now() + hang;
        let mut recovered = None;
        while Instant::now() < deadline {
            let _ = job.next_line(Duration::from_millis(2), |_| false);
            if let Some((g, s)) = resumed_step(&job, generation + 1) {
                if let Some((_, t)) = loss_rows(&loss)
                    .iter()
                    .rev()
                    .find(|(step, t)| *step == s + 1 && *t > t_kill)
                {
                    recovered = Some((g, s, (t - t_kill) * 1e3));
                    break;
                }
            }
        }
        let Some((g, resumed, took)) = recovered else {
            hangs += 1;
            eprintln!(
                "kill {}: no recovery within {hang:?}; the job said:\n{}",
                ms.len() + 1,
                job.output()
            );
            break;
        };
        generation = g;
        ready_at = resumed + 1 + gap;
        let steps_lost = before.saturating_sub(resumed);
        eprintln!(
            "kill {:2}: rank {v}, last step {before}, resumed at {resumed}, next step {took:.0} ms after the kill",
            ms.len() + 1
        );
        rows.push(format!(
            "{},{v},{before},{resumed},{steps_lost},{took:.1}",
            ms.len() + 1
        ));
        ms.push(took);
        lost.push(steps_lost);
    }
    job.signal(libc::SIGTERM);
    let _ = job.wait_exit(Duration::from_secs(60));
    let max_lost = lost.iter().copied().max().unwrap_or(0);
    let mut sorted = ms.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        sorted
            .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!("| stages | copies | kills | hangs | recovery p50 | p90 | max | committed steps lost (max) |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {stages} | {} | {} | {hangs} | {:.0} ms | {:.0} ms | {:.0} ms | {max_lost} |",
        if no_copy { "off" } else { "every step" },
        ms.len(),
        pct(0.5),
        pct(0.9),
        sorted.last().copied().unwrap_or(f64::NAN)
    );
    write_csv(
        csv,
        "kill,victim,last_step_before,resumed_step,steps_lost,recovery_ms",
        &rows,
    )?;
    if hangs > 0 {
        bail!("{hangs} kill(s) were not recovered from");
    }
    Ok(())
}

fn memory(
    stages: &[usize],
    micro: usize,
    layers: &str,
    batch: usize,
    steps: u64,
    csv: &Option<PathBuf>,
) -> Result<()> {
    let mb = |b: &str| b.parse::<f64>().unwrap_or(f64::NAN) / (1 << 20) as f64;
    println!("| schedule | S | M | stage | layers | params | optimizer | copy | in flight (bound) | activations | peak RSS |");
    println!("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for schedule in ["gpipe", "1f1b"] {
        for &s in stages {
            let args = strings(&[
                "--stages",
                &s.to_string(),
                "--micro-batches",
                &micro.to_string(),
                "--schedule",
                schedule,
                "--steps",
                &steps.to_string(),
                "--layers",
                layers,
                "--batch",
                &batch.to_string(),
                "--threads",
                "1",
            ]);
            let job = run_to_end(s, &args)?;
            let lines = job.lines();
            for rank in 0..s {
                let tag = format!("memory rank={rank} ");
                let Some(l) = lines
                    .iter()
                    .map(|l| l.text.as_str())
                    .find(|l| l.contains(&tag))
                else {
                    bail!("no memory line of rank {rank}:\n{}", job.output());
                };
                let get = |k: &str| field(l, k).unwrap_or("?").to_string();
                let bound = if schedule == "gpipe" {
                    micro
                } else {
                    (s - rank).min(micro)
                };
                let rss = get("peak_rss_kib").parse::<f64>().unwrap_or(f64::NAN) / 1024.0;
                println!(
                    "| {schedule} | {s} | {micro} | {rank} | {} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {} ({bound}) | {:.1} MiB | {rss:.0} MiB |",
                    get("layers"),
                    mb(&get("params_bytes")),
                    mb(&get("optimizer_bytes")),
                    mb(&get("copy_bytes")),
                    get("peak_in_flight"),
                    mb(&get("peak_activation_bytes")),
                );
                rows.push(format!(
                    "{schedule},{s},{micro},{rank},{},{},{},{},{},{bound},{},{}",
                    get("layers"),
                    get("params_bytes"),
                    get("optimizer_bytes"),
                    get("copy_bytes"),
                    get("peak_in_flight"),
                    get("peak_activation_bytes"),
                    get("peak_rss_kib")
                ));
            }
        }
    }
    write_csv(
        csv,
        "schedule,stages,micro_batches,stage,layers,params_bytes,optimizer_bytes,copy_bytes,peak_in_flight,bound,peak_activation_bytes,peak_rss_kib",
        &rows,
    )
}

/// The median step time of the loss CSV's rows after the first 5.
fn step_time(loss: &Path) -> f64 {
    let rows = loss_rows(loss);
    let mut d: Vec<f64> = rows
        .windows(2)
        .skip(5)
        .map(|w| (w[1].1 - w[0].1) * 1e3)
        .collect();
    median(&mut d)
}

fn copy(
    stages: &[usize],
    layers: &str,
    batch: usize,
    steps: u64,
    rounds: usize,
    csv: &Option<PathBuf>,
) -> Result<()> {
    println!("| S | step without copies | with copies (every step) | overhead |");
    println!("|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for &s in stages {
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            for no_copy in [round % 2 == 0, round % 2 != 0] {
                let dir = tempfile::tempdir()?;
                let loss = dir.path().join("loss.csv");
                let mut args = strings(&[
                    "--stages",
                    &s.to_string(),
                    "--steps",
                    &steps.to_string(),
                    "--layers",
                    layers,
                    "--batch",
                    &batch.to_string(),
                    "--threads",
                    "1",
                    "--loss-csv",
                    &loss.display().to_string(),
                ]);
                if no_copy {
                    args.push("--no-copy".into());
                }
                run_to_end(s, &args)?;
                let t = step_time(&loss);
                rows.push(format!("{s},{round},{},{t:.3}", !no_copy));
                if no_copy { &mut off } else { &mut on }.push(t);
            }
        }
        let (a, b) = (median(&mut off), median(&mut on));
        println!(
            "| {s} | {a:.2} ms | {b:.2} ms | {:+.1}% |",
            100.0 * (b / a - 1.0)
        );
    }
    write_csv(csv, "stages,round,copies,step_ms", &rows)
}

fn main() -> Result<()> {
    match Args::parse().what {
        What::Bubble {
            stages,
            micro,
            emulate_ms,
            layers,
            batch,
            steps,
            warmup,
            csv,
        } => bubble(
            &stages, &micro, emulate_ms, &layers, batch, steps, warmup, &csv,
        ),
        What::Recovery {
            kills,
            stages,
            victim,
            layers,
            batch,
            gap,
            no_copy,
            hang_after,
            csv,
        } => recovery(
            kills, stages, victim, &layers, batch, gap, no_copy, hang_after, &csv,
        ),
        What::Memory {
            stages,
            micro,
            layers,
            batch,
            steps,
            csv,
        } => memory(&stages, micro, &layers, batch, steps, &csv),
        What::Copy {
            stages,
            layers,
            batch,
            steps,
            rounds,
            csv,
        } => copy(&stages, &layers, batch, steps, rounds, &csv),
    }
}
