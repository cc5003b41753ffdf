//! Checkpoint throughput: dd's fdatasync rate on the same directory, our save rate with fsync,
//! the stall of an asynchronous save, and load times (zero-copy open, fully verified load).
//!
//! `cargo run --release -p rekindle-examples --bin ckpt_bench -- --size-mib 1024 --tensors 64`

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rekindle_storage::{
    AsyncCheckpointer, Checkpoint, CheckpointDir, HostTensor, LoadOptions, Snapshot, TensorDType,
    TrainingState, Verify,
};

/// Measures checkpoint save and load rates against dd on the same directory.
#[derive(Debug, Parser)]
struct Args {
    /// Total size of the state in MiB (f32 tensors).
    #[arg(long, default_value_t = 1024)]
    size_mib: usize,
    /// Number of tensors the state is split into.
    #[arg(long, default_value_t = 64)]
    tensors: usize,
    /// Directory to write into (default: /var/tmp). Without `--keep` the benchmark works in a
    /// temporary directory inside it and removes it at the end.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Leave the last checkpoint written: with `--dir D`, D itself is the checkpoint
    /// directory (`D/step-N`, so `rekindle ckpt verify D` checks it; D must hold no
    /// checkpoint yet); without `--dir`, a directory under /var/tmp that is printed.
    #[arg(long)]
    keep: bool,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

/// Where the benchmark writes: a temporary directory removed at the end, or a directory
/// that stays.
enum Root {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl Root {
    fn open(dir: Option<&Path>, keep: bool) -> Result<Root> {
        let base = dir.unwrap_or(Path::new("/var/tmp"));
        std::fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
        match (dir, keep) {
            (Some(d), true) => {
                let taken: Vec<String> = std::fs::read_dir(d)?
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("step-"))
                    .collect();
                if !taken.is_empty() {
                    bail!(
                        "--keep --dir {}: it already holds checkpoints ({}); give an empty or new \
                         directory",
                        d.display(),
                        taken.join(", ")
                    );
                }
                Ok(Root::Kept(d.to_path_buf()))
            }
            (None, true) => Ok(Root::Kept(
                tempfile::Builder::new()
                    .prefix("ckpt_bench-")
                    .tempdir_in(base)?
                    .keep(),
            )),
            (_, false) => Ok(Root::Temp(tempfile::tempdir_in(base)?)),
        }
    }

    fn path(&self) -> &Path {
        match self {
            Root::Temp(t) => t.path(),
            Root::Kept(p) => p,
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Flushes everything dirty so each measurement starts from a quiet disk.
fn quiesce() {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
}

/// Drops the page cache of every file under `dir` (clean pages only: the files were synced by
/// the save) with `posix_fadvise(DONTNEED)`, so the next read comes from the disk.
fn evict(dir: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    quiesce();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_file() {
            let f = std::fs::File::open(&path)?;
            // SAFETY: a valid open descriptor; advice only, it never changes the contents.
            let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                anyhow::bail!("posix_fadvise({}): error {rc}", path.display());
            }
        }
    }
    Ok(())
}

fn dd_seconds(dir: &Path, size_mib: usize) -> Result<f64> {
    let target = dir.join("dd.bin");
    quiesce();
    let start = Instant::now();
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", target.display()))
        .args(["bs=1M", &format!("count={size_mib}"), "conv=fdatasync"])
        .output()
        .context("running dd")?;
    let secs = start.elapsed().as_secs_f64();
    std::fs::remove_file(&target).ok();
    if !out.status.success() {
        bail!("dd failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(secs)
}

fn state_snapshot(step: u64, size_mib: usize, tensors: usize) -> Result<Snapshot> {
    let per = size_mib * (1 << 20) / 4 / tensors;
    let mut snap = Snapshot::new(TrainingState {
        step,
        ..Default::default()
    });
    for t in 0..tensors {
        let mut x = HostTensor::zeros(TensorDType::F32, &[per]);
        // Non-constant data: a xorshift stream per tensor.
        let mut s = 0x9e3779b97f4a7c15u64 ^ t as u64;
        for chunk in x.as_bytes_mut().chunks_exact_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            chunk.copy_from_slice(&s.to_le_bytes());
        }
        snap.insert(&format!("layers.{t}.weight"), x)?;
    }
    Ok(snap)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.tensors == 0 || args.size_mib == 0 || args.repeat == 0 {
        bail!("--size-mib, --tensors and --repeat must be at least 1");
    }
    let root = Root::open(args.dir.as_deref(), args.keep)?;
    let bytes = (args.size_mib as f64) * (1u64 << 20) as f64;
    let gbps = |secs: f64| bytes / secs / 1e9;

    let mut dd = Vec::new();
    let mut save = Vec::new();
    let dir = CheckpointDir::new(root.path())?;
    let mut step = 0;
    let mut live = state_snapshot(0, args.size_mib, args.tensors)?;
    for _ in 0..args.repeat {
        dd.push(dd_seconds(root.path(), args.size_mib)?);
        step += 1;
        live.state.step = step;
        quiesce();
        let start = Instant::now();
        dir.save(&live)?;
        save.push(start.elapsed().as_secs_f64());
        if step > 1 {
            std::fs::remove_dir_all(dir.step_path(step - 1))?;
        }
    }
    let dd_s = median(dd);
    let save_s = median(save);

    // Asynchronous saves: the first allocates the snapshot buffers, later ones reuse them.
    let saver = AsyncCheckpointer::new(CheckpointDir::new(root.path())?);
    let mut stalls = Vec::new();
    let mut first_stall = 0.0;
    for i in 0..=args.repeat {
        step += 1;
        live.state.step = step;
        quiesce();
        let start = Instant::now();
        saver.save(&live)?;
        let stall = start.elapsed().as_secs_f64();
        saver.flush(Duration::from_secs(600))?;
        std::fs::remove_dir_all(dir.step_path(step - 1))?;
        if i == 0 {
            first_stall = stall;
        } else {
            stalls.push(stall);
        }
    }
    drop(saver);
    let stall_s = median(stalls);

    let path = dir.step_path(step);
    let mut zero_copy = Vec::new();
    let mut verified = Vec::new();
    for _ in 0..args.repeat {
        let start = Instant::now();
        let c = Checkpoint::open(&path, &LoadOptions::default().verify(Verify::Structure))?;
        let n: usize = c
            .names()
            .iter()
            .map(|n| c.tensor(n).map(|t| t.bytes().len()).unwrap_or(0))
            .sum();
        zero_copy.push(start.elapsed().as_secs_f64());
        assert!(n > 0);
        drop(c);
        let start = Instant::now();
        let c = Checkpoint::open(&path, &LoadOptions::default())?;
        verified.push(start.elapsed().as_secs_f64());
        drop(c);
    }
    let zc_s = median(zero_copy);
    let ver_s = median(verified);
    // Cold loads: the checkpoint's pages dropped from the page cache before each open.
    let mut cold = Vec::new();
    for _ in 0..args.repeat {
        evict(&path)?;
        let start = Instant::now();
        let c = Checkpoint::open(&path, &LoadOptions::default())?;
        cold.push(start.elapsed().as_secs_f64());
        drop(c);
    }
    let cold_s = median(cold);

    println!(
        "ckpt_bench: {} MiB of f32 in {} tensors, dir {}, median of {}",
        args.size_mib,
        args.tensors,
        root.path().display(),
        args.repeat
    );
    println!("{:<34} {:>10} {:>10}", "measurement", "seconds", "GB/s");
    println!(
        "{:<34} {:>10.3} {:>10.2}",
        "dd bs=1M conv=fdatasync",
        dd_s,
        gbps(dd_s)
    );
    println!(
        "{:<34} {:>10.3} {:>10.2}",
        "save (fsync, atomic commit)",
        save_s,
        gbps(save_s)
    );
    println!(
        "{:<34} {:>10.3} {:>10}",
        "async save stall (reused buffers)", stall_s, "-"
    );
    println!(
        "{:<34} {:>10.3} {:>10}",
        "async save stall (first call)", first_stall, "-"
    );
    println!(
        "{:<34} {:>10.6} {:>10}",
        "load zero-copy (open + views)", zc_s, "-"
    );
    println!(
        "{:<34} {:>10.3} {:>10.2}",
        "load verified (xxh3 every file)",
        ver_s,
        gbps(ver_s)
    );
    println!(
        "{:<34} {:>10.3} {:>10.2}",
        "load verified, cold (fadvise)",
        cold_s,
        gbps(cold_s)
    );
    println!(
        "save / dd = {:.2}, async stall / save = {:.3}",
        gbps(save_s) / gbps(dd_s),
        stall_s / save_s
    );
    let json = serde_json::json!({
        "size_mib": args.size_mib,
        "tensors": args.tensors,
        "dd_gbps": gbps(dd_s),
        "save_gbps": gbps(save_s),
        "save_s": save_s,
        "async_stall_ratio": stall_s / save_s,
        "async_stall_s": stall_s,
        "async_first_stall_s": first_stall,
        "load_zero_copy_s": zc_s,
        "load_verified_gbps": gbps(ver_s),
        "load_verified_cold_s": cold_s,
    });
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&json)? + "\n")?;
    }
    if let Root::Kept(dir) = &root {
        println!(
            "kept {} (check it with: rekindle ckpt verify {})",
            dir.join(format!("step-{step}")).display(),
            dir.display()
        );
    }
    Ok(())
}
