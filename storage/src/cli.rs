//! The `ckpt` commands: `ls`, `inspect`, `verify`. Shipped as the `rekindle-ckpt` binary and
//! meant to be mounted as `rekindle ckpt ...` by another clap CLI: embed [`CkptArgs`] (a
//! `clap::Args`) and call [`run`].
//!
//! Exit codes: 0 success (for `verify`: everything checked is valid), 1 a checkpoint did not
//! verify, 2 the command could not run (bad path, unreadable directory).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::dir::CheckpointDir;
use crate::error::{Result, StorageError};
use crate::load::{Checkpoint, LoadOptions, SafetensorsFile, Verify};
use crate::manifest::MANIFEST_FILE;
use crate::map_location::MapLocation;

/// `ckpt` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CkptArgs {
    /// The command.
    #[command(subcommand)]
    pub command: CkptCommand,
}

/// The `ckpt` commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CkptCommand {
    /// Lists the checkpoints of a directory with their step, state and validity.
    Ls {
        /// The checkpoint root.
        dir: PathBuf,
    },
    /// Shows a checkpoint's state, files and tensors, or a bare `.safetensors` file's tensors
    /// (names as they load, after key normalisation).
    Inspect {
        /// A `step-<N>/` directory or a `.safetensors` file.
        path: PathBuf,
        /// Show names as stored, without stripping `module.` prefixes.
        #[arg(long)]
        no_normalize: bool,
    },
    /// Verifies sizes, headers and checksums; exits 0 only if valid.
    Verify {
        /// A `step-<N>/` directory, or a root (every committed checkpoint is verified).
        path: PathBuf,
    },
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done; everything checked is valid.
    Ok,
    /// Done; some checkpoint did not verify.
    Invalid,
}

impl Outcome {
    /// The process exit code: 0 or 1.
    pub fn code(self) -> u8 {
        match self {
            Outcome::Ok => 0,
            Outcome::Invalid => 1,
        }
    }
}

/// Runs a command, printing to stdout and errors to stderr; returns the exit code (2 when the
/// command could not run).
pub fn run(args: CkptArgs) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match run_to(&args, &mut out) {
        Ok(o) => ExitCode::from(o.code()),
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn w(out: &mut dyn Write, path: &Path, text: std::fmt::Arguments<'_>) -> Result<()> {
    out.write_fmt(text)
        .map_err(|e| StorageError::io("write output for", path, e))
}

/// Runs a command, writing its report to `out`.
pub fn run_to(args: &CkptArgs, out: &mut dyn Write) -> Result<Outcome> {
    match &args.command {
        CkptCommand::Ls { dir } => ls(dir, out),
        CkptCommand::Inspect { path, no_normalize } => inspect(path, !no_normalize, out),
        CkptCommand::Verify { path } => verify(path, out),
    }
}

fn structure_opts() -> LoadOptions {
    LoadOptions::default()
        .verify(Verify::Structure)
        .map_location(MapLocation::Device(rekindle_runtime::Device::Cpu))
}

fn full_opts() -> LoadOptions {
    structure_opts().verify(Verify::Full)
}

fn existing_root(dir: &Path) -> Result<CheckpointDir> {
    if !dir.is_dir() {
        return Err(StorageError::InvalidArgument {
            reason: format!("{} is not a directory", dir.display()),
        });
    }
    CheckpointDir::new(dir)
}

fn ls(dir: &Path, out: &mut dyn Write) -> Result<Outcome> {
    let root = existing_root(dir)?;
    let steps = root.committed_steps()?;
    w(
        out,
        dir,
        format_args!(
            "{:>10}  {:>6}  {:>12}  {:>12}  {:>5}  status\n",
            "step", "epoch", "cursor", "bytes", "files"
        ),
    )?;
    let mut outcome = Outcome::Ok;
    for step in steps {
        match Checkpoint::open(&root.step_path(step), &full_opts()) {
            Ok(c) => {
                let s = c.state();
                w(
                    out,
                    dir,
                    format_args!(
                        "{:>10}  {:>6}  {:>12}  {:>12}  {:>5}  valid\n",
                        step,
                        s.epoch,
                        s.sample_cursor,
                        c.data_bytes(),
                        c.manifest().files.len()
                    ),
                )?;
            }
            Err(e) => {
                outcome = Outcome::Invalid;
                w(
                    out,
                    dir,
                    format_args!(
                        "{:>10}  {:>6}  {:>12}  {:>12}  {:>5}  INVALID: {e}\n",
                        step, "-", "-", "-", "-"
                    ),
                )?;
            }
        }
    }
    let rd = std::fs::read_dir(dir).map_err(|e| StorageError::io("read directory", dir, e))?;
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-step-") || name.starts_with(".trash-step-") {
            w(out, dir, format_args!("{name}: leftover of an interrupted save or deletion (removed by the next save)\n"))?;
        }
    }
    Ok(outcome)
}

fn inspect(path: &Path, normalize: bool, out: &mut dyn Write) -> Result<Outcome> {
    if path.is_file() {
        let f = SafetensorsFile::open(path, &structure_opts().normalize_keys(normalize))?;
        w(out, path, format_args!("file {}\n", path.display()))?;
        for (k, v) in f.metadata() {
            w(out, path, format_args!("metadata {k} = {v}\n"))?;
        }
        w(out, path, format_args!("{} tensors\n", f.names().len()))?;
        for name in f.names() {
            let t = f.tensor(name)?;
            let stored = if t.stored_name() != name {
                format!("  (stored as {})", t.stored_name())
            } else {
                String::new()
            };
            w(
                out,
                path,
                format_args!("  {name}  {}  {:?}{stored}\n", t.dtype(), t.shape()),
            )?;
        }
        return Ok(Outcome::Ok);
    }
    if !path.join(MANIFEST_FILE).is_file() {
        return Err(StorageError::NotACheckpoint {
            path: path.to_path_buf(),
        });
    }
    let c = Checkpoint::open(path, &structure_opts().normalize_keys(normalize))?;
    let m = c.manifest();
    let s = &m.state;
    w(out, path, format_args!("checkpoint {}\nformat {} v{}\nstep {}  epoch {}  sample_cursor {}\nworld_size {}  layout {}\n",
        path.display(), m.format, m.format_version, s.step, s.epoch, s.sample_cursor, s.world_size,
        serde_json::to_string(&s.layout).unwrap_or_default()))?;
    for (k, v) in &s.rng {
        w(out, path, format_args!("rng {k}: {} bytes\n", v.len()))?;
    }
    for (k, v) in &s.user {
        w(out, path, format_args!("user {k} = {v}\n"))?;
    }
    w(out, path, format_args!("{} files\n", m.files.len()))?;
    for (name, f) in &m.files {
        w(
            out,
            path,
            format_args!(
                "  {name}  {} bytes  xxh3 {}  rank {}\n",
                f.size, f.xxh3, f.rank
            ),
        )?;
    }
    w(out, path, format_args!("{} tensors\n", m.tensors.len()))?;
    for name in c.names() {
        let t = c.tensor(name)?;
        let e = &m.tensors[t.stored_name()];
        w(
            out,
            path,
            format_args!(
                "  {name}  {}  {:?}  {}  saved on {}\n",
                t.dtype(),
                t.shape(),
                e.file,
                e.device
            ),
        )?;
    }
    Ok(Outcome::Ok)
}

fn verify(path: &Path, out: &mut dyn Write) -> Result<Outcome> {
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(match Checkpoint::open(path, &full_opts()) {
            Ok(c) => {
                w(
                    out,
                    path,
                    format_args!(
                        "{}: valid (step {}, {} files, {} bytes)\n",
                        path.display(),
                        c.step(),
                        c.manifest().files.len(),
                        c.data_bytes()
                    ),
                )?;
                Outcome::Ok
            }
            Err(e) => {
                w(
                    out,
                    path,
                    format_args!("{}: INVALID: {e}\n", path.display()),
                )?;
                Outcome::Invalid
            }
        });
    }
    let root = existing_root(path)?;
    let steps = root.committed_steps()?;
    if steps.is_empty() {
        w(
            out,
            path,
            format_args!("{}: no committed checkpoint\n", path.display()),
        )?;
        return Ok(Outcome::Invalid);
    }
    let mut outcome = Outcome::Ok;
    for step in steps {
        if verify(&root.step_path(step), out)? == Outcome::Invalid {
            outcome = Outcome::Invalid;
        }
    }
    Ok(outcome)
}
