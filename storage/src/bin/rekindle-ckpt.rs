//! `rekindle-ckpt ls DIR | inspect PATH | verify PATH`: the checkpoint tool.

use clap::Parser;

/// Lists, inspects and verifies rekindle checkpoints.
#[derive(Debug, Parser)]
#[command(name = "rekindle-ckpt", version)]
struct Cli {
    #[command(flatten)]
    args: rekindle_storage::cli::CkptArgs,
}

fn main() -> std::process::ExitCode {
    rekindle_storage::cli::run(Cli::parse().args)
}
