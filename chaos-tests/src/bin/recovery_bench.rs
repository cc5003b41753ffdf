//! Recovery benchmark: SIGKILL one rank of a running elastic DDP job, again and again, and
//! measure the time from the kill to the next completed step of the re-formed group, the
//! steps lost per kill, and hangs.
//!
//! ```text
//! cargo build --release --workspace --bins
//! target/release/recovery_bench --kills 100 --backend standalone --csv recovery.csv
//! target/release/recovery_bench --kills 100 --backend etcd --csv recovery-etcd.csv
//! ```
//!
//! The job is `rekindle run ... --max-restarts <kills> ddp` (the 784-1024-1024-10 MLP, 256
//! samples per rank, one compute thread per rank, a checkpoint every 50 steps). Rank 0
//! appends each completed step with its wall-clock time to a loss CSV; after every kill the
//! bench waits for the line in which the re-formed group's rank 0 names the step it resumed
//! from (`state of step S`) and for the CSV row of step `S + 1`. Victims alternate between
//! the ranks, so rank 0 (the checkpoint writer) is killed half of the time.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::EtcdServer;
use rekindle_elastic::testing::{kill, workspace_bin, Proc};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// `--standalone`: the agent's embedded store.
    Standalone,
    /// `--rdzv-backend etcd` against a real etcd started by the bench.
    Etcd,
}

#[derive(Debug, Parser)]
#[command(about = "Time from SIGKILL of a rank to the re-formed group's next step")]
struct Args {
    /// Kills to perform.
    #[arg(long, default_value_t = 100)]
    kills: usize,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Rendezvous backend.
    #[arg(long, value_enum, default_value_t = Backend::Standalone)]
    backend: Backend,
    /// Layer sizes of the MLP.
    #[arg(long, default_value = "784-1024-1024-10")]
    layers: String,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 256)]
    batch_per_rank: usize,
    /// Completed steps between a recovery and the next kill.
    #[arg(long, default_value_t = 8)]
    gap: u64,
    /// A kill not recovered from within this many seconds counts as a hang (and ends the run).
    #[arg(long, default_value_t = 60.0)]
    hang_after: f64,
    /// Per-kill rows here.
    #[arg(long)]
    csv: Option<PathBuf>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `(step, unix_time)` of every row of the loss CSV.
fn rows(path: &Path) -> Vec<(u64, f64)> {
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

fn last_step(path: &Path) -> Option<(u64, f64)> {
    rows(path).last().copied()
}

/// The `S` of the newest `generation G: ... state of step S` line with `G >= generation`.
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

/// Waits `d` between two looks at the loss CSV; an error once the job has exited.
fn pause(job: &Proc, d: Duration) -> Result<()> {
    if let Some(code) = job.try_exit() {
        bail!("the job exited with code {code}:\n{}", job.output());
    }
    std::thread::sleep(d);
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

struct Kill {
    victim: usize,
    before: u64,
    resumed: u64,
    recovery_ms: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rekindle = workspace_bin("rekindle")?;
    let ddp = workspace_bin("ddp")?;
    let work = tempfile::tempdir()?;
    let loss = work.path().join("loss.csv");
    let ckpt = work.path().join("ckpt");
    let etcd = match args.backend {
        Backend::Etcd => Some(EtcdServer::start().context("starting etcd")?),
        Backend::Standalone => None,
    };
    let mut job_args: Vec<String> = vec!["run".into()];
    match &etcd {
        None => job_args.push("--standalone".into()),
        Some(e) => job_args.extend(
            [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &e.endpoint(),
                "--rdzv-id",
                "recovery-bench",
                "--nnodes",
                "1",
                "--local-addr",
                "127.0.0.1",
            ]
            .map(String::from),
        ),
    }
    job_args.extend([
        "--nproc-per-node".to_string(),
        args.nproc.to_string(),
        "--max-restarts".into(),
        (args.kills + 1).to_string(),
        "--log-dir".into(),
        work.path().join("logs").display().to_string(),
        ddp.display().to_string(),
        "--steps".into(),
        "100000000".into(),
        "--layers".into(),
        args.layers.clone(),
        "--batch".into(),
        (args.batch_per_rank * args.nproc).to_string(),
        "--threads".into(),
        "1".into(),
        "--checkpoint-dir".into(),
        ckpt.display().to_string(),
        "--checkpoint-every".into(),
        "50".into(),
        "--loss-csv".into(),
        loss.display().to_string(),
    ]);
    let mut cmd = std::process::Command::new(&rekindle);
    cmd.args(&job_args).env("REKINDLE_LOG", "warn");
    let mut job = Proc::spawn(cmd)?;
    let hang = Duration::from_secs_f64(args.hang_after);
    let mut kills: Vec<Kill> = Vec::new();
    let mut generation = 0u64;
    let mut hangs = 0usize;
    let mut ready_at = 1 + args.gap;
    eprintln!(
        "recovery_bench: {} kills, {} ranks, backend {:?}, model {}",
        args.kills, args.nproc, args.backend, args.layers
    );
    while kills.len() < args.kills {
        // Wait for `gap` more completed steps.
        let deadline = Instant::now() + hang;
        loop {
            pause(&job, Duration::from_millis(5))?;
            if last_step(&loss).is_some_and(|(s, _)| s >= ready_at) {
                break;
            }
            if Instant::now() > deadline {
                bail!("no progress:\n{}", job.output());
            }
        }
        let victim = kills.len() % args.nproc;
        let Some(pid) = rank_pid(&job, victim) else {
            bail!("no pid for rank {victim}:\n{}", job.output());
        };
        let before = last_step(&loss).map(|(s, _)| s).unwrap_or(0);
        let t_kill = unix_now();
        kill(pid, libc::SIGKILL);
        // The re-formed group names its step; then wait for the CSV row after it.
        let deadline = Instant::now() + hang;
        let mut recovered = None;
        while Instant::now() < deadline {
            pause(&job, Duration::from_millis(2))?;
            if let Some((g, s)) = resumed_step(&job, generation + 1) {
                if let Some((_, t)) = rows(&loss)
                    .iter()
                    .rev()
                    .find(|(step, t)| *step == s + 1 && *t > t_kill)
                {
                    recovered = Some((g, s, (t - t_kill) * 1e3));
                    break;
                }
            }
        }
        let Some((g, resumed, ms)) = recovered else {
            hangs += 1;
            eprintln!("kill {}: no recovery within {hang:?}", kills.len() + 1);
            break;
        };
        generation = g;
        ready_at = resumed + 1 + args.gap;
        eprintln!(
            "kill {:3}: rank {victim}, last step {before}, resumed at {resumed}, next step {ms:.0} ms after the kill",
            kills.len() + 1
        );
        kills.push(Kill {
            victim,
            before,
            resumed,
            recovery_ms: ms,
        });
    }
    job.stop(Duration::from_secs(60));

    let mut ms: Vec<f64> = kills.iter().map(|k| k.recovery_ms).collect();
    ms.sort_by(f64::total_cmp);
    let lost: Vec<u64> = kills
        .iter()
        .map(|k| k.before.saturating_sub(k.resumed))
        .collect();
    let max_lost = lost.iter().copied().max().unwrap_or(0);
    let mean_lost = lost.iter().sum::<u64>() as f64 / lost.len().max(1) as f64;
    println!(
        "| backend | ranks | kills | hangs | recovery p50 ms | p90 ms | max ms | steps lost mean | max |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {:?} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {} |",
        args.backend,
        args.nproc,
        kills.len(),
        hangs,
        percentile(&ms, 0.5),
        percentile(&ms, 0.9),
        ms.last().copied().unwrap_or(f64::NAN),
        mean_lost,
        max_lost
    );
    if let Some(path) = &args.csv {
        let mut f = std::fs::File::create(path)?;
        writeln!(
            f,
            "kill,backend,victim,last_step_before,resumed_step,steps_lost,recovery_ms"
        )?;
        for (i, k) in kills.iter().enumerate() {
            writeln!(
                f,
                "{},{:?},{},{},{},{},{:.1}",
                i + 1,
                args.backend,
                k.victim,
                k.before,
                k.resumed,
                k.before.saturating_sub(k.resumed),
                k.recovery_ms
            )?;
        }
    }
    if hangs > 0 {
        bail!("{hangs} kill(s) were not recovered from");
    }
    Ok(())
}
