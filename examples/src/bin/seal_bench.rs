//! seal_bench: how fast one core authenticates frames, against what the TCP backend needs.
//!
//! Every frame the TCP backend sends after the handshake carries a tag (see "Frames after the
//! handshake" in docs/collectives.md). In a 2-rank ring all-reduce each rank seals every byte
//! of the buffer it sends and opens every byte it receives, on the thread that also moves the
//! data, so at an untagged bus bandwidth of `B` GB/s and a tag rate of `c` GB/s per core a
//! buffer of `S` bytes takes `S/B + 2S/c` seconds instead of `S/B`:
//!
//! ```text
//! tagged busbw = B / (1 + 2B/c)        cost = 1 - 1 / (1 + 2B/c)
//! cost <= 10%  <=>  c >= 18 B
//! ```
//!
//! `seal_bench --base-busbw 1.8` measures, on one thread and buffers of `--kib` KiB each,
//! the tag rate of every candidate of well-kept crates (the default mode's keyed BLAKE3, and
//! `ring`'s AES-256-GCM, ChaCha20-Poly1305, GMAC through AES-256-GCM's associated data and
//! HMAC-SHA256) beside `memcpy`, and prints for each the busbw and cost the model predicts.
//! Each figure is the median of `--reps` timed runs of `--ms` milliseconds; `--csv` appends
//! one row per primitive and size.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
use ring::hmac;

#[derive(Parser, Debug)]
#[command(about = "Tag rate of frame-authentication primitives on one core")]
struct Args {
    /// Buffer sizes in KiB (the TCP backend's frames are 256 KiB).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    kib: Vec<usize>,
    /// Milliseconds of one timed run.
    #[arg(long, default_value_t = 300)]
    ms: u64,
    /// Timed runs per primitive and size (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Untagged `collectives_perf --no-shm` all-reduce busbw (GB/s, 2 ranks) to predict from.
    #[arg(long)]
    base_busbw: Option<f64>,
    /// Append CSV rows here (`primitive,kib,gb_per_s,best_gb_per_s`).
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// Processes the whole first buffer once (the second is `memcpy`'s destination).
type Run = Box<dyn FnMut(&mut [u8], &mut [u8])>;

/// One primitive: a name and its run.
struct Primitive {
    name: &'static str,
    run: Run,
}

fn aead(alg: &'static ring::aead::Algorithm) -> Result<LessSafeKey> {
    let key = UnboundKey::new(alg, &[7u8; 32]).map_err(|_| anyhow::anyhow!("aead key"))?;
    Ok(LessSafeKey::new(key))
}

fn nonce(counter: &mut u64) -> Nonce {
    *counter += 1;
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn primitives() -> Result<Vec<Primitive>> {
    let key = [7u8; 32];
    let gcm = aead(&AES_256_GCM)?;
    let gmac = aead(&AES_256_GCM)?;
    let chacha = aead(&CHACHA20_POLY1305)?;
    let hmac_key = hmac::Key::new(hmac::HMAC_SHA256, &key);
    let (mut c1, mut c2, mut c3) = (0u64, 0u64, 0u64);
    Ok(vec![
        Primitive {
            name: "memcpy",
            run: Box::new(|buf, dst| dst.copy_from_slice(buf)),
        },
        Primitive {
            name: "blake3-keyed (mac)",
            run: Box::new(move |buf, _| {
                let mut h = blake3::Hasher::new_keyed(&key);
                h.update(buf);
                h.update(&(buf.len() as u64).to_le_bytes());
                std::hint::black_box(h.finalize());
            }),
        },
        Primitive {
            name: "aes-256-gcm (encrypt)",
            run: Box::new(move |buf, _| {
                let tag = gcm.seal_in_place_separate_tag(nonce(&mut c1), Aad::empty(), buf);
                std::hint::black_box(tag.ok());
            }),
        },
        Primitive {
            name: "chacha20-poly1305",
            run: Box::new(move |buf, _| {
                let tag = chacha.seal_in_place_separate_tag(nonce(&mut c2), Aad::empty(), buf);
                std::hint::black_box(tag.ok());
            }),
        },
        Primitive {
            name: "gmac (aes-256-gcm aad)",
            run: Box::new(move |buf, _| {
                let tag =
                    gmac.seal_in_place_separate_tag(nonce(&mut c3), Aad::from(&buf[..]), &mut []);
                std::hint::black_box(tag.ok());
            }),
        },
        Primitive {
            name: "hmac-sha256",
            run: Box::new(move |buf, _| {
                std::hint::black_box(hmac::sign(&hmac_key, buf));
            }),
        },
    ])
}

/// Median and best GB/s of `reps` runs of about `ms` each.
fn measure(p: &mut Primitive, bytes: usize, ms: u64, reps: usize) -> (f64, f64) {
    let mut buf: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; bytes];
    (p.run)(&mut buf, &mut dst);
    let budget = Duration::from_millis(ms);
    let mut rates: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            let mut n = 0u64;
            while start.elapsed() < budget {
                (p.run)(&mut buf, &mut dst);
                n += 1;
            }
            n as f64 * bytes as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    (rates[rates.len() / 2], rates[rates.len() - 1])
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.reps == 0 || args.ms == 0 || args.kib.contains(&0) {
        bail!("--reps, --ms and every --kib must be positive");
    }
    if let Some(b) = args.base_busbw {
        if !(b.is_finite() && b > 0.0) {
            bail!("--base-busbw must be a positive number of GB/s, not {b}");
        }
    }
    let mut csv = match &args.csv {
        Some(path) => Some(rekindle_examples::append_csv(
            path,
            "primitive,kib,gb_per_s,best_gb_per_s",
        )?),
        None => None,
    };
    let mut prims = primitives()?;
    let (extra_head, extra_rule) = match args.base_busbw {
        Some(_) => (" predicted busbw | cost |", "---:|---:|"),
        None => ("", ""),
    };
    println!("| primitive | KiB | GB/s (median) | best |{extra_head}");
    println!("|---|---:|---:|---:|{extra_rule}");
    for &kib in &args.kib {
        for p in &mut prims {
            let (median, best) = measure(p, kib << 10, args.ms, args.reps);
            print!("| {} | {kib} | {median:.2} | {best:.2} |", p.name);
            match args.base_busbw {
                // memcpy tags nothing: it is the reference, not a candidate.
                Some(_) if p.name == "memcpy" => print!(" | |"),
                Some(b) => {
                    let tagged = b / (1.0 + 2.0 * b / median);
                    print!(" {tagged:.2} | {:.0}% |", 100.0 * (1.0 - tagged / b));
                }
                None => {}
            }
            println!();
            if let Some(f) = &mut csv {
                writeln!(f, "{},{kib},{median:.3},{best:.3}", p.name)?;
            }
        }
    }
    if let Some(b) = args.base_busbw {
        println!(
            "\ncost <= 10% needs a tag rate of at least 18 x {b:.2} = {:.1} GB/s per core",
            18.0 * b
        );
    }
    Ok(())
}
