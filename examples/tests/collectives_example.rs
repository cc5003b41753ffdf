//! The `collectives` example under `rekindle run`: the eight collectives of seed 6, issued
//! asynchronously and then waited on, each checked against its closed form on every rank.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rekindle_elastic::testing::Finished as Output;

/// The longest one run may take.
const T: Duration = Duration::from_secs(300);

/// `target/<profile>/rekindle`, built beside this test by `cargo build --workspace --bins`.
fn rekindle() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = dir.join("rekindle");
    assert!(
        bin.is_file(),
        "{} is missing: cargo build --workspace --bins first",
        bin.display()
    );
    bin
}

fn run(nproc: usize, extra: &[&str]) -> Output {
    let mut cmd = Command::new(rekindle());
    cmd.args([
        "run",
        "--standalone",
        "--nproc-per-node",
        &nproc.to_string(),
    ])
    .arg(env!("CARGO_BIN_EXE_collectives"))
    .args(extra);
    rekindle_elastic::testing::run(cmd, T).expect("running rekindle")
}

fn text(out: &Output) -> String {
    format!("{}\n{}", out.stdout, out.stderr)
}

#[test]
fn every_collective_is_right_on_every_rank() {
    for nproc in [1, 3, 4] {
        let out = run(nproc, &["--count", "257"]);
        let log = text(&out);
        assert!(out.success(), "{nproc} ranks:\n{log}");
        for op in [
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "scatter",
            "gather",
            "all_to_all",
        ] {
            let row = log
                .lines()
                .find(|l| l.contains(&format!("] {op} ")))
                .unwrap_or_else(|| panic!("{nproc} ranks: no row for {op}:\n{log}"));
            // Rank 0 is not the reduce's root for more than one rank: its buffer is scratch.
            let want = if op == "reduce" && nproc > 1 {
                "scratch"
            } else {
                "ok"
            };
            assert!(row.contains(want), "{nproc} ranks, {op}: {row}");
        }
        assert!(log.contains("ranks with a wrong result: 0"), "{log}");
    }
}

/// Without the `nccl` feature, or without a GPU, `--backend nccl` is refused with a reason.
#[test]
fn nccl_without_the_feature_or_a_gpu_is_a_clear_error() {
    let out = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_collectives"));
        cmd.args(["--backend", "nccl"]);
        rekindle_elastic::testing::run(cmd, T).unwrap()
    };
    assert!(!out.success());
    let err = out.stderr.to_lowercase();
    assert!(err.contains("nccl") || err.contains("cuda"), "{err}");
}
