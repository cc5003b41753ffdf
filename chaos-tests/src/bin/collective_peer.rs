//! A rank process for fault tests: forms a TCP group through a `FileStore`, then all-reduces
//! in a loop. It prints `ready` once the group formed, `iter N` after each operation, and on
//! failure one line `error kind=<kind> peer=<rank|-> elapsed_ms=<ms since the op began>
//! message=<text>` before exiting with status 3.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use rekindle_runtime::store::{FileStore, Store};
use rekindle_runtime::{Buffer, Error, GroupConfig, JobSecret, ProcessGroup, ReduceOp, TcpOptions};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    store: std::path::PathBuf,
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    world: usize,
    #[arg(long, default_value = "chaos")]
    job: String,
    #[arg(long, default_value_t = 0)]
    round: u64,
    /// Elements per all-reduce (f32).
    #[arg(long, default_value_t = 65536)]
    elems: usize,
    /// Operation deadline in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    op_timeout_ms: u64,
    /// Stop after this many iterations (0: run until an error).
    #[arg(long, default_value_t = 0)]
    iters: u64,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(&a.store)?);
    let cfg = GroupConfig {
        job: a.job.clone(),
        round: a.round,
        rank: a.rank,
        world_size: a.world,
        store,
        secret: JobSecret::from_env()?,
        op_timeout: Duration::from_millis(a.op_timeout_ms),
        bootstrap_timeout: Duration::from_secs(30),
    };
    let pg = ProcessGroup::tcp(cfg, TcpOptions::default())?;
    println!("ready");
    let mut i = 0u64;
    loop {
        let t = Instant::now();
        let buf = Buffer::from(vec![1.0f32; a.elems]);
        match pg
            .all_reduce(buf, ReduceOp::Sum)
            .wait(Duration::from_secs(3600))
        {
            Ok(out) => {
                let v = out
                    .as_slice::<f32>()
                    .and_then(|s| s.first().copied())
                    .unwrap_or(f32::NAN);
                if v != a.world as f32 {
                    println!("error kind=wrong peer=- elapsed_ms=0 message=got {v}");
                    std::process::exit(3);
                }
            }
            Err(e) => {
                let ms = t.elapsed().as_millis();
                let (kind, peer) = match &e {
                    Error::PeerLost { peer, .. } => ("peer_lost", peer.to_string()),
                    Error::Timeout { waiting_on, .. } => {
                        ("timeout", format!("{waiting_on:?}").replace(' ', ""))
                    }
                    Error::Aborted { .. } => ("aborted", "-".into()),
                    _ => ("other", "-".into()),
                };
                println!("error kind={kind} peer={peer} elapsed_ms={ms} message={e}");
                std::process::exit(3);
            }
        }
        i += 1;
        println!("iter {i}");
        if a.iters > 0 && i >= a.iters {
            return Ok(());
        }
    }
}
