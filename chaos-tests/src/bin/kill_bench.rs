//! kill_bench: how fast survivors learn that a rank was SIGKILLed mid-collective.
//!
//! `kill_bench --world 2 --trials 20 [--csv FILE] [--no-shm]` starts `world` `collective_peer`
//! processes (all-reducing in a loop), SIGKILLs one of them once every rank is running, and
//! times kill -> the last survivor's `error kind=peer_lost` line. Prints p50/p99/max and any
//! trial that hung or named the wrong rank (a failure, exit 1).

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rekindle_elastic::testing::{field, Proc};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2)]
    world: usize,
    #[arg(long, default_value_t = 20)]
    trials: usize,
    /// Elements per all-reduce (f32).
    #[arg(long, default_value_t = 262_144)]
    elems: usize,
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.world < 2 {
        bail!("--world must be at least 2");
    }
    let peer = std::env::current_exe()?
        .parent()
        .context("no executable directory")?
        .join("collective_peer");
    let mut times = Vec::new();
    let mut failures = 0;
    for trial in 0..a.trials {
        let dir = tempfile::tempdir()?;
        let victim = 1 + trial % (a.world - 1);
        let mut procs = Vec::new();
        for r in 0..a.world {
            let mut cmd = Command::new(&peer);
            cmd.arg("--store").arg(dir.path()).args([
                "--rank",
                &r.to_string(),
                "--world",
                &a.world.to_string(),
                "--elems",
                &a.elems.to_string(),
            ]);
            procs.push(Proc::spawn(cmd)?);
        }
        for p in procs.iter_mut() {
            if p.wait_line(Duration::from_secs(60), |l| l == "iter 3")
                .is_err()
            {
                bail!("trial {trial}: a rank never started: {}", p.output());
            }
        }
        let t = Instant::now();
        procs[victim].signal(libc::SIGKILL);
        let mut worst = Duration::ZERO;
        for (r, p) in procs.iter_mut().enumerate().filter(|(r, _)| *r != victim) {
            match p.wait_line(Duration::from_secs(60), |l| l.starts_with("error")) {
                Ok(line)
                    if field(&line, "kind") == Some("peer_lost")
                        && field(&line, "peer") == Some(victim.to_string().as_str()) =>
                {
                    worst = worst.max(t.elapsed());
                }
                other => {
                    eprintln!("trial {trial}: rank {r} gave {other:?}");
                    failures += 1;
                }
            }
        }
        times.push(worst.as_secs_f64() * 1e3);
    }
    let mut sorted = times.clone();
    sorted.sort_by(|x, y| x.total_cmp(y));
    let pct = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    println!(
        "# kill -> every survivor failed with peer_lost naming the victim, world {}",
        a.world
    );
    println!(
        "{:>8} {:>10} {:>10} {:>10} {:>9}",
        "trials", "p50_ms", "p99_ms", "max_ms", "failures"
    );
    println!(
        "{:>8} {:>10.2} {:>10.2} {:>10.2} {:>9}",
        a.trials,
        pct(0.5),
        pct(0.99),
        sorted.last().copied().unwrap_or(0.0),
        failures
    );
    if let Some(path) = a.csv {
        let mut f = std::fs::File::create(&path)?;
        writeln!(f, "trial,world,detect_ms")?;
        for (i, t) in times.iter().enumerate() {
            writeln!(f, "{i},{},{t:.3}", a.world)?;
        }
    }
    if failures > 0 {
        bail!("{failures} survivors did not report the kill correctly");
    }
    Ok(())
}
