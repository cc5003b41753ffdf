//! A small worker program for the agent's tests and for trying `rekindle run` by hand.
//!
//! `rekindle-test-worker MODE [ARG]`, with the agent's env vars:
//! - `barrier`: every rank sets `rank/<RANK>` in the job store (`REKINDLE_STORE` +
//!   `REKINDLE_STORE_PREFIX`) and waits for all `WORLD_SIZE` of them, then prints
//!   `barrier ok rank=R world=W round=N node=G` and exits 0;
//! - `fail-once`: rank 1 of the first attempt writes an error file and exits 3; everyone
//!   else (and every later attempt) does `barrier`;
//! - `fail ARG`: rank 1 sleeps ARG seconds, writes an error file and exits 3; others block;
//! - `hold`: `barrier`, print `ready store=ADDR prefix=P pid=PID`, then block until the key
//!   `go` appears in the job store (exit 0), a membership event arrives from the agent
//!   (print `membership JSON`, exit 0), or SIGTERM (print `got SIGTERM`, exit 143);
//! - `stubborn`: print `ready pid=PID`, ignore SIGTERM, block until killed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rekindle_elastic::membership::WorkerMembership;
use rekindle_runtime::store::{PrefixStore, Store};

fn env(k: &str) -> Result<String> {
    std::env::var(k).with_context(|| format!("{k} is not set"))
}

fn env_usize(k: &str) -> Result<usize> {
    env(k)?
        .parse()
        .with_context(|| format!("{k} is not a number"))
}

fn job_store() -> Result<Arc<dyn Store>> {
    let addr = env("REKINDLE_STORE")?;
    let prefix = env("REKINDLE_STORE_PREFIX")?;
    let client: Arc<dyn Store> =
        rekindle_elastic::store::connect(&addr).with_context(|| format!("store {addr}"))?;
    Ok(Arc::new(PrefixStore::new(client, prefix)))
}

fn barrier(store: &dyn Store) -> Result<()> {
    let rank = env_usize("RANK")?;
    let world = env_usize("WORLD_SIZE")?;
    store.set(&format!("rank/{rank}"), rank.to_string().as_bytes())?;
    let keys: Vec<String> = (0..world).map(|r| format!("rank/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&refs, Duration::from_secs(60))?;
    println!(
        "barrier ok rank={rank} world={world} round={} node={}",
        env("REKINDLE_ROUND")?,
        env("GROUP_RANK")?
    );
    Ok(())
}

fn term_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut term = {
        let _g = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?
    };
    std::thread::spawn(move || {
        rt.block_on(async move {
            term.recv().await;
            f.store(true, Ordering::Release);
        })
    });
    Ok(flag)
}

fn hold() -> Result<i32> {
    let term = term_flag()?;
    let store = job_store()?;
    barrier(store.as_ref())?;
    let mut membership = WorkerMembership::from_env()?;
    println!(
        "ready store={} prefix={} pid={}",
        env("REKINDLE_STORE")?,
        env("REKINDLE_STORE_PREFIX")?,
        std::process::id()
    );
    loop {
        if term.load(Ordering::Acquire) {
            println!("got SIGTERM");
            return Ok(143);
        }
        if store.get("go")?.is_some() {
            println!("go");
            return Ok(0);
        }
        if let Some(m) = membership.as_mut() {
            if let Some(ev) = m.next_timeout(Duration::from_millis(100))? {
                println!("membership {}", serde_json::to_string(&ev)?);
                return Ok(0);
            }
        } else {
            store
                .wait(&["go"], Duration::from_millis(100))
                .map(|_| ())
                .or_else(|e| match e {
                    rekindle_runtime::store::StoreError::Timeout { .. } => Ok(()),
                    e => Err(e),
                })?;
        }
    }
}

fn main() -> Result<()> {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let arg = std::env::args().nth(2);
    let code = match mode.as_str() {
        "barrier" => {
            barrier(job_store()?.as_ref())?;
            0
        }
        "fail-once" => {
            if env("REKINDLE_RESTART_COUNT")? == "0" && env_usize("RANK")? == 1 {
                rekindle_elastic::errorfile::record_error("fail-once: first attempt fails", None)?;
                3
            } else {
                barrier(job_store()?.as_ref())?;
                0
            }
        }
        "fail" => {
            let secs: f64 = arg.as_deref().unwrap_or("0").parse()?;
            if env_usize("RANK")? == 1 {
                std::thread::sleep(Duration::from_secs_f64(secs));
                rekindle_elastic::errorfile::record_error("fail: rank 1 gives up", None)?;
                3
            } else {
                let term = term_flag()?;
                while !term.load(Ordering::Acquire) {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                143
            }
        }
        "hold" => hold()?,
        "stubborn" => {
            // SAFETY: setting SIGTERM's disposition to ignore has no preconditions.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            }
            println!("ready pid={}", std::process::id());
            loop {
                std::thread::park();
            }
        }
        other => bail!("unknown mode {other:?} (barrier, fail-once, fail, hold, stubborn)"),
    };
    std::process::exit(code);
}
