//! Every collective with ranks as separate processes: `collectives_perf -c 1` checks each
//! result against closed-form values and exits non-zero on any wrong element.

use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::{run, Finished};

/// Runs `collectives_perf args...` to its end (at most five minutes).
fn collectives_perf(args: &[&str]) -> Finished {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_collectives_perf"));
    cmd.args(args);
    run(cmd, Duration::from_secs(300)).expect("running collectives_perf")
}

fn perf(args: &[&str]) {
    let out = collectives_perf(args);
    let stdout = &out.stdout;
    assert!(
        out.success(),
        "collectives_perf {args:?} failed: exit code {}\n{stdout}\n{}",
        out.code,
        out.stderr
    );
    // Every row reports zero wrong elements.
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("#wrong"))
        .collect();
    assert!(!rows.is_empty(), "no rows printed: {stdout}");
    for row in rows {
        assert_eq!(row.split_whitespace().last(), Some("0"), "row {row:?}");
    }
}

#[test]
fn every_op_and_dtype_across_processes_many_chunks() {
    for n in ["1", "2", "3", "5"] {
        for dtype in ["f32", "f64", "f16", "bf16", "i32", "i64", "u8"] {
            perf(&[
                "--op",
                "all",
                "--nranks",
                n,
                "-b",
                "8",
                "-e",
                "4K",
                "-f",
                "8",
                "-n",
                "1",
                "-w",
                "0",
                "-c",
                "1",
                "--dtype",
                dtype,
                "--max-segment",
                "64",
                "--small-bytes",
                "0",
            ]);
        }
    }
}

#[test]
fn every_reduction_across_processes() {
    for redop in ["sum", "prod", "min", "max", "avg"] {
        perf(&[
            "--op",
            "all_reduce",
            "--nranks",
            "3",
            "-b",
            "4",
            "-e",
            "1M",
            "-f",
            "64",
            "-n",
            "1",
            "-w",
            "0",
            "-c",
            "1",
            "--redop",
            redop,
        ]);
    }
}

#[test]
fn bad_flags_are_errors() {
    let out = collectives_perf(&["--op", "all_shuffle"]);
    assert!(!out.success());
    assert!(out.stderr.contains("unknown --op"));
    let out = collectives_perf(&["-b", "12Q"]);
    assert!(!out.success());
}
