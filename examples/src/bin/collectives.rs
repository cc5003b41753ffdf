//! The eight collectives of seed 6 across the ranks of a job: all-reduce, broadcast, reduce,
//! all-gather, reduce-scatter, scatter, gather and all-to-all. Every operation is issued
//! asynchronously first (the NCCL stream pattern: a call returns at once with a handle) and
//! only then waited on; each result is checked against its closed form, and rank 0 prints a
//! table.
//!
//! ```text
//! rekindle run --standalone --nproc-per-node 4 target/release/collectives
//! ```
//!
//! `--backend nccl` uses NCCL on `cuda:LOCAL_RANK` (a build with the `nccl` feature and a GPU
//! per rank). The exit status is non-zero when any result is wrong on any rank.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use rekindle_elastic::train;
use rekindle_runtime::store::PrefixStore;
use rekindle_runtime::{
    segment, Buffer, Device, GroupConfig, JobSecret, ProcessGroup, ReduceOp, TcpOptions, Work,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The TCP backend (CPU).
    Tcp,
    /// NCCL on cuda:LOCAL_RANK.
    Nccl,
}

#[derive(Debug, Parser)]
#[command(about = "Run and check the eight collectives across the ranks of a job")]
struct Args {
    /// The collective backend.
    #[arg(long, value_enum, default_value_t = Backend::Tcp)]
    backend: Backend,
    /// Elements (f32) per rank per operation.
    #[arg(long, default_value_t = 1024)]
    count: usize,
    /// Deadline of each operation, in seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
}

/// One collective: its name, its handle, and the closed form of this rank's result (`None`
/// where the rank's buffer is scratch).
struct Issued {
    name: &'static str,
    work: Work,
    expected: Option<Vec<f32>>,
}

fn filled(n: usize, f: impl Fn(usize) -> f32) -> Buffer {
    Buffer::from((0..n).map(f).collect::<Vec<f32>>())
}

/// Issues every collective at once and returns the handles with their expected results.
fn issue_all(pg: &ProcessGroup, c: usize) -> Vec<Issued> {
    let (r, n) = (pg.rank(), pg.world_size());
    let rf = r as f32;
    let nf = n as f32;
    let triangle = nf * (nf + 1.0) / 2.0;
    let last = n - 1;
    let seg = segment(n * c, n, r);
    let mut out = Vec::new();
    let mut push = |name, work, expected| {
        out.push(Issued {
            name,
            work,
            expected,
        })
    };
    push(
        "all_reduce",
        pg.all_reduce(filled(c, |_| rf + 1.0), ReduceOp::Sum),
        Some(vec![triangle; c]),
    );
    push(
        "broadcast",
        pg.broadcast(filled(c, |i| if r == 0 { i as f32 + 0.5 } else { 0.0 }), 0),
        Some((0..c).map(|i| i as f32 + 0.5).collect()),
    );
    push(
        "reduce",
        pg.reduce(filled(c, |_| rf + 1.0), ReduceOp::Sum, last),
        (r == last).then(|| vec![triangle; c]),
    );
    push(
        "all_gather",
        pg.all_gather(filled(c, |_| rf)),
        Some((0..n * c).map(|p| (p / c) as f32).collect()),
    );
    push(
        "reduce_scatter",
        pg.reduce_scatter(filled(n * c, |p| (p + r) as f32), ReduceOp::Sum),
        Some(
            seg.clone()
                .map(|p| nf * p as f32 + nf * (nf - 1.0) / 2.0)
                .collect(),
        ),
    );
    push(
        "scatter",
        pg.scatter(
            if r == 0 {
                filled(n * c, |p| (p / c) as f32)
            } else {
                filled(c, |_| 0.0)
            },
            0,
        ),
        Some(vec![rf; c]),
    );
    push(
        "gather",
        pg.gather(filled(c, |_| rf), 0),
        (r == 0).then(|| (0..n * c).map(|p| (p / c) as f32).collect()),
    );
    push(
        "all_to_all",
        pg.all_to_all(filled(n * c, |p| (r * n + p / c) as f32)),
        Some((0..n * c).map(|p| ((p / c) * n + r) as f32).collect()),
    );
    out
}

fn main() -> Result<()> {
    let args = Args::parse();
    let worker = train::init()?;
    let a = worker.assignment.clone();
    let store = a.connect()?;
    let timeout = Duration::from_secs_f64(args.timeout);
    let config = GroupConfig {
        job: worker.job.clone(),
        round: a.round,
        rank: a.rank,
        world_size: a.world_size,
        store: Arc::new(PrefixStore::new(store, "collectives/")),
        secret: JobSecret::from_env()?,
        op_timeout: timeout,
        bootstrap_timeout: timeout,
    };
    let pg = match args.backend {
        Backend::Tcp => {
            let mut tcp = TcpOptions::default();
            if let Some(ip) = worker.local_addr.filter(|ip| !ip.is_loopback()) {
                tcp.bind_addr = ip;
            }
            ProcessGroup::tcp(config, tcp)
        }
        Backend::Nccl => ProcessGroup::nccl(config, Device::Cuda(worker.local_rank)),
    }
    .with_context(|| format!("rank {}: building the {:?} group", a.rank, args.backend))?;

    let started = Instant::now();
    let issued = issue_all(&pg, args.count);
    let issue_us = started.elapsed().as_secs_f64() * 1e6;
    let mut rows = Vec::new();
    let mut wrong = 0;
    for op in issued {
        let got = op
            .work
            .wait(timeout * 2)
            .with_context(|| format!("rank {}: {}", a.rank, op.name))?;
        let done_ms = started.elapsed().as_secs_f64() * 1e3;
        let verdict = match &op.expected {
            None => "scratch".to_string(),
            Some(want) => match got.as_slice::<f32>() {
                Some(v) if v == want.as_slice() => "ok".to_string(),
                Some(v) => {
                    wrong += 1;
                    let at = v.iter().zip(want).position(|(x, y)| x != y);
                    format!(
                        "WRONG (len {} vs {}, first difference at {at:?})",
                        v.len(),
                        want.len()
                    )
                }
                None => {
                    wrong += 1;
                    format!("WRONG dtype {:?}", got.dtype())
                }
            },
        };
        rows.push((op.name, verdict, done_ms));
    }
    // Every rank's verdict, so that rank 0 reports the job's.
    let bad_ranks = pg
        .all_reduce(
            Buffer::from(vec![u8::from(wrong > 0) as f32]),
            ReduceOp::Sum,
        )
        .wait(timeout * 2)
        .context("gathering the verdicts")?
        .as_slice::<f32>()
        .and_then(|v| v.first().copied())
        .unwrap_or(f32::NAN);
    if a.rank == 0 {
        println!(
            "{} ranks, {} f32 per rank, backend {:?}; all 8 issued in {issue_us:.0} us, then waited on",
            a.world_size, args.count, args.backend
        );
        println!("{:<16} {:<10} {:>12}", "collective", "rank 0", "done (ms)");
        for (name, verdict, ms) in &rows {
            println!("{name:<16} {verdict:<10} {ms:>12.3}");
        }
        println!("ranks with a wrong result: {bad_ranks}");
    }
    if wrong > 0 {
        for (name, verdict, _) in rows.iter().filter(|(_, v, _)| v.starts_with("WRONG")) {
            eprintln!("rank {}: {name}: {verdict}", a.rank);
        }
        bail!("rank {}: {wrong} collective(s) gave a wrong result", a.rank);
    }
    if bad_ranks != 0.0 {
        bail!("{bad_ranks} rank(s) saw a wrong result");
    }
    Ok(())
}
