//! Every collective with ranks as separate processes: `collectives_perf -c 1` checks each
//! result against closed-form values and exits non-zero on any wrong element.

use std::process::Command;

fn perf(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_collectives_perf"))
        .args(args)
        .output()
        .expect("running collectives_perf");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "collectives_perf {args:?} failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
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
    let out = Command::new(env!("CARGO_BIN_EXE_collectives_perf"))
        .args(["--op", "all_shuffle"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown --op"));
    let out = Command::new(env!("CARGO_BIN_EXE_collectives_perf"))
        .args(["-b", "12Q"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}
