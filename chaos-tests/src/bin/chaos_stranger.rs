//! A foreign process for the chaos harness: it does not know the job secret and tries to get
//! in anyway. One line per attempt on stdout:
//! `stranger target=<addr> outcome=<refused-secret|refused-N|no-listener|reset|closed|accepted|...>`.
//!
//! ```text
//! chaos-stranger data --etcd HOST:PORT --job JOB
//! chaos-stranger store --addr HOST:PORT
//! ```
//!
//! `data` watches the job's etcd prefix and, the moment a rank publishes the address of its
//! collectives listener (`.../addr/<rank>`), connects to it and sends a well-formed handshake
//! whose MAC is not made with the job secret; it runs until killed. `store` connects to an
//! embedded store with the secret of its environment (`REKINDLE_SECRET`, a wrong one) and
//! tries to write and read a key.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "A process without the job secret that tries to connect to a job")]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Connect to every collectives listener the job publishes in etcd.
    Data {
        /// etcd endpoint, host:port.
        #[arg(long)]
        etcd: String,
        /// The job id.
        #[arg(long)]
        job: String,
    },
    /// Write and read a key of an embedded store.
    Store {
        /// The store's address, host:port.
        #[arg(long)]
        addr: String,
    },
}

/// What every version of the collectives' handshake starts its magic with.
const MAGIC_FAMILY: &[u8; 6] = b"RKDLHS";

/// The wire mode byte of the default sealing (MAC).
const WIRE_MAC: u8 = 1;

/// One handshake with a made-up MAC; the outcome word.
fn attempt(addr: SocketAddr, job: &str, target: u32) -> String {
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return "no-listener".into(),
        Err(e) => return format!("unreachable-{:?}", e.kind()),
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    let mut hello = [0u8; 24];
    if s.read_exact(&mut hello).is_err() {
        return "reset".into();
    }
    if &hello[..6] != MAGIC_FAMILY {
        return "not-rekindle".into();
    }
    let mut noise = [0u8; 48];
    let _ = getrandom::getrandom(&mut noise);
    let mut msg = Vec::new();
    // The acceptor's own magic (handshake version) back, as a rank of the job would.
    msg.extend_from_slice(&hello[..8]);
    msg.push(job.len().min(255) as u8);
    msg.extend_from_slice(&job.as_bytes()[..job.len().min(255)]);
    msg.extend_from_slice(&0u64.to_le_bytes());
    msg.extend_from_slice(&(target + 1).to_le_bytes());
    msg.extend_from_slice(&target.to_le_bytes());
    msg.push(0);
    msg.push(WIRE_MAC);
    // A fresh nonce and a MAC not made with the secret.
    msg.extend_from_slice(&noise);
    if s.write_all(&msg).is_err() {
        return "closed".into();
    }
    let mut reply = [0u8; 33];
    if s.read_exact(&mut reply).is_err() {
        return "closed".into();
    }
    match reply[0] {
        0 => "accepted".into(),
        5 => "refused-secret".into(),
        n => format!("refused-{n}"),
    }
}

fn data(etcd: &str, job: &str) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let prefix = format!("/rekindle/{job}/");
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([format!("http://{etcd}")], None)
            .await
            .with_context(|| format!("connecting to etcd at {etcd}"))?;
        let mut stream = c
            .watch(
                prefix.as_bytes(),
                Some(etcd_client::WatchOptions::new().with_prefix()),
            )
            .await
            .context("watching the job's prefix")?;
        println!("stranger watching prefix={prefix}");
        while let Some(resp) = stream.message().await.context("the watch")? {
            for ev in resp.events() {
                if ev.event_type() != etcd_client::EventType::Put {
                    continue;
                }
                let Some(kv) = ev.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                let Some(rank) = key
                    .rsplit_once("/addr/")
                    .and_then(|(_, r)| r.parse::<u32>().ok())
                else {
                    continue;
                };
                let Ok(addr) = String::from_utf8_lossy(kv.value()).parse::<SocketAddr>() else {
                    continue;
                };
                let job = job.to_string();
                std::thread::spawn(move || {
                    let outcome = attempt(addr, &job, rank);
                    println!("stranger target={addr} rank={rank} outcome={outcome}");
                });
            }
        }
        Ok(())
    })
}

fn store(addr: &str) -> Result<()> {
    let outcome = rekindle_elastic::store::connect(addr).and_then(|s| {
        s.set("chaos-stranger/probe", b"x")?;
        s.get("chaos-stranger/probe")
    });
    match outcome {
        Ok(_) => println!("stranger target={addr} outcome=accepted"),
        Err(e) => println!(
            "stranger target={addr} outcome=refused detail={}",
            e.to_string().replace(' ', "_")
        ),
    }
    Ok(())
}

fn main() -> Result<()> {
    match Args::parse().what {
        What::Data { etcd, job } => data(&etcd, &job),
        What::Store { addr } => store(&addr),
    }
}
