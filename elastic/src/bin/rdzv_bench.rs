//! Rendezvous scale benchmark: N nodes (one etcd client each, in one process) rendezvous on
//! one real etcd with `--nnodes N:N`; measures the time from the last node's join to every
//! member knowing its rank.
//!
//! `cargo run --release -p rekindle-elastic --features test-etcd --bin rdzv-bench -- [--reps R] [--sizes 8,16,32,64] [--csv PATH]`
//!
//! Per round: N-1 nodes join and wait; then the clock starts and the last node calls
//! `next_rendezvous` (its lease grant and registration are inside the measured time); the
//! round's time is when the slowest member returns. Prints p50/p99 of the round times and of
//! the per-member times.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rekindle_elastic::etcd::EtcdConfig;
use rekindle_elastic::rendezvous::*;
use rekindle_elastic::testing::EtcdServer;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn handler(
    cfg: &EtcdConfig,
    job: &str,
    i: usize,
    n: usize,
) -> Result<Arc<DynamicRendezvousHandler>> {
    let backend = EtcdBackend::connect(cfg, job, EtcdBackendOptions::default())?;
    let node = NodeInfo {
        id: format!("node-{i:03}"),
        host: "127.0.0.1".into(),
        nproc: 1,
        store_addr: None,
    };
    let mut opts = HandlerOptions::new(n, n)?;
    opts.join_timeout = Duration::from_secs(60);
    Ok(Arc::new(DynamicRendezvousHandler::new(
        Arc::new(backend),
        node,
        opts,
    )))
}

/// One round of `n` nodes; returns every member's time from the last join, in ms.
fn round(cfg: &EtcdConfig, job: &str, n: usize) -> Result<Vec<f64>> {
    let hs: Vec<_> = (0..n)
        .map(|i| handler(cfg, job, i, n))
        .collect::<Result<_>>()?;
    let probe = EtcdBackend::connect(cfg, job, EtcdBackendOptions::default())?;
    let (tx, rx) =
        std::sync::mpsc::channel::<(usize, Result<RendezvousInfo, RendezvousError>, Instant)>();
    for (i, h) in hs.iter().enumerate().take(n - 1) {
        let (h, tx) = (h.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = h.next_rendezvous();
            let _ = tx.send((i, r, Instant::now()));
        });
    }
    // Wait (by watching the state) until the first n-1 have joined the open round.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let snap = probe.snapshot()?;
        let joined = snap
            .state
            .as_deref()
            .and_then(|b| serde_json::from_slice::<RendezvousState>(b).ok())
            .map(|s| s.participants.len())
            .unwrap_or(0);
        if joined == n - 1 {
            break;
        }
        if Instant::now() > deadline {
            bail!("only {joined} of {} nodes joined", n - 1);
        }
        probe.wait_for_change(&snap.token, deadline)?;
    }
    let t0 = Instant::now();
    {
        let (h, tx) = (hs[n - 1].clone(), tx.clone());
        std::thread::spawn(move || {
            let r = h.next_rendezvous();
            let _ = tx.send((n - 1, r, Instant::now()));
        });
    }
    drop(tx);
    let mut times = Vec::with_capacity(n);
    let mut ranks = vec![false; n];
    for _ in 0..n {
        let (i, r, at) = rx
            .recv_timeout(Duration::from_secs(60))
            .context("a member never finished")?;
        let info = r.with_context(|| format!("node {i}"))?;
        if info.world_size != n || ranks[info.rank] {
            bail!(
                "bad round: node {i} got rank {} of {}",
                info.rank,
                info.world_size
            );
        }
        ranks[info.rank] = true;
        times.push(at.saturating_duration_since(t0).as_secs_f64() * 1e3);
    }
    for h in &hs {
        let _ = h.shutdown();
    }
    Ok(times)
}

fn main() -> Result<()> {
    let mut reps = 10usize;
    let mut sizes = vec![8usize, 16, 32, 64];
    let mut csv: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().context("--reps N")?.parse()?,
            "--sizes" => {
                sizes = args
                    .next()
                    .context("--sizes a,b")?
                    .split(',')
                    .map(|s| s.parse())
                    .collect::<Result<_, _>>()?
            }
            "--csv" => csv = Some(args.next().context("--csv PATH")?),
            other => bail!("unknown argument {other:?} (--reps, --sizes, --csv)"),
        }
    }
    if sizes.iter().any(|n| *n < 2) || reps == 0 {
        bail!("sizes must be >= 2 and reps >= 1");
    }
    let etcd = EtcdServer::start()?;
    let cfg = EtcdConfig::new([etcd.endpoint()]);
    let mut rows = Vec::new();
    println!(
        "{:>4} {:>5} {:>12} {:>12} {:>13} {:>13}",
        "N", "reps", "all p50 ms", "all p99 ms", "member p50 ms", "member p99 ms"
    );
    for &n in &sizes {
        let mut all = Vec::new();
        let mut member = Vec::new();
        for r in 0..reps {
            let times = round(&cfg, &format!("bench-{n}-{r}"), n)?;
            all.push(times.iter().cloned().fold(0.0, f64::max));
            member.extend(times);
        }
        all.sort_by(f64::total_cmp);
        member.sort_by(f64::total_cmp);
        let row = (
            n,
            reps,
            percentile(&all, 50.0),
            percentile(&all, 99.0),
            percentile(&member, 50.0),
            percentile(&member, 99.0),
        );
        println!(
            "{:>4} {:>5} {:>12.1} {:>12.1} {:>13.1} {:>13.1}",
            row.0, row.1, row.2, row.3, row.4, row.5
        );
        rows.push(row);
    }
    if let Some(path) = csv {
        let mut out = String::from("n,reps,all_p50_ms,all_p99_ms,member_p50_ms,member_p99_ms\n");
        for r in &rows {
            out.push_str(&format!(
                "{},{},{:.2},{:.2},{:.2},{:.2}\n",
                r.0, r.1, r.2, r.3, r.4, r.5
            ));
        }
        std::fs::write(&path, out).with_context(|| format!("write {path}"))?;
    }
    Ok(())
}
