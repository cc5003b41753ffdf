//! `chaos`: attack a real `rekindle run` job and check that nothing is lost.
//!
//! ```text
//! chaos --list
//! chaos --scenario NAME --seed S [--faults N] [--json FILE] [--plot FILE] [--log FILE] [-- PROGRAM ARGS]
//! ```
//!
//! Without `-- PROGRAM ARGS` the job trains the bundled `ddp` (or `--workload NAME`). The
//! report (each fault, totals, invariants) goes to stdout; the exit code is 0 only when every
//! invariant held, 1 with a one-line reason on stderr otherwise, 2 when the scenario cannot
//! run here (bad flags, a missing binary, no root for network faults).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use rekindle_chaos_tests::cluster::NetMode;
use rekindle_chaos_tests::runner::Options;
use rekindle_chaos_tests::scenario;
use rekindle_chaos_tests::workload::{Workload, BUNDLED};

#[derive(Debug, Parser)]
#[command(
    about = "Attack a real rekindle job with faults and check that nothing is lost",
    after_help = "Arguments of PROGRAM may hold {steps}, {checkpoint_dir}, {checkpoint_every}, {op_timeout} and {loss_csv}; the harness fills them per run. See docs/chaos.md."
)]
struct Args {
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
    /// The scenario to run.
    #[arg(long, required_unless_present = "list")]
    scenario: Option<String>,
    /// The seed of the fault schedule (the same seed gives the same schedule).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Faults to inject (default: the scenario's).
    #[arg(long)]
    faults: Option<usize>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the timeline (step against seconds, faults marked) as SVG here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// A bundled workload (ignored with `-- PROGRAM ARGS`).
    #[arg(long, default_value = "ddp")]
    workload: String,
    /// The dataset length of PROGRAM, for the sample audit.
    #[arg(long)]
    dataset: Option<u64>,
    /// Write the job's whole log (every node's lines, with their times) here.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Run every node on 127.0.0.1 even as root.
    #[arg(long)]
    loopback: bool,
    /// A fault after which no step completes within this many seconds is a hang.
    #[arg(long, default_value_t = 60.0)]
    hang_after: f64,
    /// The program to train and its arguments (default: the bundled workload).
    #[arg(last = true)]
    program: Vec<String>,
}

fn list() {
    println!("| scenario | faults | network | what | goal |");
    println!("|---|---|---|---|---|");
    for s in scenario::all() {
        println!(
            "| {} | {} | {} | {} | {} |",
            s.name(),
            s.default_faults(),
            if s.needs_namespaces() {
                "namespaces"
            } else {
                "any"
            },
            s.about(),
            s.goal()
        );
    }
    let names: Vec<&str> = BUNDLED.iter().map(|(n, _)| *n).collect();
    println!("\nbundled workloads: {}", names.join(", "));
    println!("network here: {}", NetMode::detect().describe());
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.list {
        list();
        return ExitCode::SUCCESS;
    }
    let Some(name) = args.scenario.as_deref() else {
        eprintln!("chaos: --scenario is required (chaos --list names them)");
        return ExitCode::from(2);
    };
    if scenario::by_name(name).is_none() {
        eprintln!("chaos: no scenario {name:?} (chaos --list names them)");
        return ExitCode::from(2);
    }
    let workload = match args.program.split_first() {
        Some((program, rest)) => {
            let mut w = Workload::custom(program, rest.to_vec());
            w.dataset_len = args.dataset;
            Ok(w)
        }
        None => match Workload::bundled(&args.workload) {
            None => {
                eprintln!(
                    "chaos: no bundled workload {:?} (chaos --list names them)",
                    args.workload
                );
                return ExitCode::from(2);
            }
            Some(w) => w,
        },
    };
    let workload = match workload {
        Ok(w) => w,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    if !(args.hang_after.is_finite() && args.hang_after > 0.0) {
        eprintln!("chaos: --hang-after must be a positive number of seconds");
        return ExitCode::from(2);
    }
    let mut opts = Options::new(args.seed);
    opts.faults = args.faults;
    opts.hang_after = Duration::from_secs_f64(args.hang_after);
    opts.log = args.log.clone();
    if args.loopback {
        opts.mode = NetMode::Loopback;
    }
    eprintln!("chaos: network: {}", opts.mode.describe());
    let report = match scenario::run(name, &workload, &opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    print!("{}", report.table());
    for (path, text) in [(&args.json, report.json()), (&args.plot, report.svg())] {
        if let Some(path) = path {
            if let Err(e) = std::fs::write(path, text) {
                eprintln!("chaos: cannot write {}: {e}", path.display());
                return ExitCode::from(2);
            }
        }
    }
    match &report.reason {
        None => ExitCode::SUCCESS,
        Some(reason) => {
            eprintln!(
                "chaos: FAIL {name} seed {}: {}",
                args.seed,
                reason.lines().next().unwrap_or("")
            );
            ExitCode::from(1)
        }
    }
}
