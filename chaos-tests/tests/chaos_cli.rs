//! The `chaos` command as a user runs it: listing, a user's own program after `--`, the
//! report files, and the exit codes (0 only when every invariant held, 1 with a one-line
//! reason, 2 when it cannot run).

use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::{run, Finished};

const T: Duration = Duration::from_secs(300);

fn chaos(args: &[&str]) -> Finished {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_chaos"));
    cmd.args(args);
    run(cmd, T).unwrap()
}

#[test]
fn list_names_every_scenario_and_the_network() {
    let out = chaos(&["--list"]);
    assert!(out.success(), "{}", out.stderr);
    for s in rekindle_chaos_tests::scenario::all() {
        assert!(
            out.stdout.contains(&format!("| {} |", s.name())),
            "{}",
            out.stdout
        );
    }
    assert!(out.stdout.contains("network here: "), "{}", out.stdout);
}

#[test]
fn bad_requests_exit_2_with_a_message() {
    let out = chaos(&["--scenario", "no-such", "--seed", "1"]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("no scenario \"no-such\""),
        "{}",
        out.stderr
    );
    let out = chaos(&["--scenario", "kill-worker", "--workload", "nope"]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("no bundled workload"), "{}", out.stderr);
    let out = chaos(&["--seed", "1"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    // A scenario that needs checkpoints, with a program that does not take the directory.
    let out = chaos(&["--scenario", "corrupt-checkpoint", "--", "/bin/true"]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("{checkpoint_dir}"), "{}", out.stderr);
}

/// A script that prints a fingerprint, fixed or fresh each run.
fn script(dir: &std::path::Path, fixed: bool) -> String {
    let path = dir.join(if fixed { "fixed.sh" } else { "fresh.sh" });
    let body = if fixed {
        "echo final_step=5 params_sha256=$(printf '%064d' 7)\n"
    } else {
        "echo final_step=5 params_sha256=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\n"
    };
    std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path.display().to_string()
}

#[test]
fn a_program_that_keeps_its_result_passes_and_writes_the_report_files() {
    let dir = tempfile::tempdir().unwrap();
    let prog = script(dir.path(), true);
    let json = dir.path().join("report.json");
    let svg = dir.path().join("timeline.svg");
    let out = chaos(&[
        "--scenario",
        "kill-worker",
        "--seed",
        "3",
        "--faults",
        "0",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--",
        &prog,
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("PASS: every invariant held"),
        "{}",
        out.stdout
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["scenario"], "kill-worker");
    assert_eq!(report["workload"], "fixed.sh");
    assert_eq!(report["passed"], true);
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
}

#[test]
fn a_program_whose_result_changes_fails_with_a_one_line_reason() {
    let dir = tempfile::tempdir().unwrap();
    let prog = script(dir.path(), false);
    let out = chaos(&[
        "--scenario",
        "kill-worker",
        "--seed",
        "3",
        "--faults",
        "0",
        "--",
        &prog,
    ]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let last = out.stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with(
            "chaos: FAIL kill-worker seed 3: fingerprint: final_step=5 params_sha256="
        ),
        "{}",
        out.stderr
    );
}
