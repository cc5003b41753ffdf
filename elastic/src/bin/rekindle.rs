//! The `rekindle` command (see `rekindle_elastic::cli`).

use clap::Parser;
use rekindle_elastic::cli::{self, Cli, Command};

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("REKINDLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("rekindle_elastic=info")),
        )
        .init();
    let cli = Cli::parse();
    let code = match &cli.command {
        Command::Run(args) => cli::run(args),
        Command::Ckpt(args) => cli::ckpt(args),
    };
    std::process::exit(code);
}
