//! The `rekindle` command (see `rekindle_elastic::cli`).

use clap::Parser;
use rekindle_elastic::agent::exit_code;
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
    // A panic is a bug in rekindle, never the user's doing: it gets its own exit code rather
    // than Rust's 101.
    let code = std::panic::catch_unwind(|| match &cli.command {
        Command::Run(args) => cli::run(args),
        Command::Ckpt(args) => cli::ckpt(args),
    })
    .unwrap_or_else(|_| {
        eprintln!(
            "rekindle: internal error (a bug in rekindle; please report it): see the panic above"
        );
        exit_code::INTERNAL
    });
    std::process::exit(code);
}
