//! `seal_bench`: one row per primitive and size, predictions that follow the documented model,
//! CSV rows that match the table, and bad flags refused.

use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::{run, Finished};

fn seal_bench(args: &[&str]) -> Finished {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seal_bench"));
    cmd.args(args);
    run(cmd, Duration::from_secs(120)).expect("running seal_bench")
}

#[test]
fn rows_follow_the_model_and_reach_the_csv() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("seal.csv");
    let base = 1.8;
    let out = seal_bench(&[
        "--kib",
        "4,16",
        "--ms",
        "2",
        "--reps",
        "3",
        "--base-busbw",
        "1.8",
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert!(out.success(), "exit {}: {}", out.code, out.stderr);
    let rows: Vec<Vec<&str>> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| primitive"))
        .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 12, "6 primitives x 2 sizes:\n{}", out.stdout);
    for row in &rows {
        let rate: f64 = row[2].parse().unwrap();
        assert!(rate > 0.0, "{row:?}");
        if row[0] == "memcpy" {
            assert_eq!(row[4], "", "no prediction for memcpy: {row:?}");
            continue;
        }
        // tagged = B / (1 + 2B/c), printed to 2 decimals from the unrounded rate.
        let predicted: f64 = row[4].parse().unwrap();
        let expected = base / (1.0 + 2.0 * base / rate);
        assert!(
            (predicted - expected).abs() <= 0.006 + expected * 0.003,
            "{row:?}: expected {expected:.3}"
        );
        assert!(predicted < base, "{row:?}");
    }
    assert!(
        out.stdout.contains("18 x 1.80 = 32.4 GB/s"),
        "{}",
        out.stdout
    );
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "primitive,kib,gb_per_s,best_gb_per_s");
    assert_eq!(lines.len(), 13, "{text}");
    assert!(
        lines[1..].iter().all(|l| l.split(',').count() == 4),
        "{text}"
    );
}

#[test]
fn bad_flags_are_errors() {
    for args in [
        &["--reps", "0"][..],
        &["--kib", "0"],
        &["--base-busbw", "-1"],
        &["--ms", "x"],
    ] {
        let out = seal_bench(args);
        assert!(!out.success(), "{args:?} succeeded: {}", out.stdout);
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}
