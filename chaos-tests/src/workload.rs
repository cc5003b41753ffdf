//! What the harness trains: a program that runs under `rekindle run` and prints
//! `final_step=<N> params_sha256=<hex>` at the end (rank 0).
//!
//! This is the extension point for new strategies. A bundled workload is an entry of
//! [`BUNDLED`]: a name, the workspace binary, and its arguments with placeholders that the
//! harness fills per run. The pipeline and parameter-server programs add an entry each (for
//! example `("pipeline", pipeline)`), and every scenario of [`crate::scenario::all`] then runs
//! against them with `chaos --workload pipeline --scenario NAME` and, in tests, with
//! [`crate::scenario::run`]. A user's own program is a [`Workload::custom`] (`chaos ... --
//! PROGRAM ARGS`).
//!
//! Placeholders in the arguments: `{steps}`, `{checkpoint_dir}`, `{checkpoint_every}`,
//! `{op_timeout}` (the collective deadline, seconds) and `{loss_csv}`. A program that wants
//! its faults timed prints `step=<N>` on rank 0 for every step it computes (the bundled `ddp`
//! does with `--log-every 1`); with `{loss_csv}` (rows `step,epoch,loss,...,unix_time`, as
//! the elastic loop's `loss_csv` option writes them) the report uses the commit times.

use std::path::{Path, PathBuf};

use rekindle_elastic::testing::workspace_bin;

/// Makes a bundled workload (finds its binary).
pub type MakeWorkload = fn() -> std::io::Result<Workload>;

/// The bundled workloads: name, constructor.
pub const BUNDLED: &[(&str, MakeWorkload)] = &[("ddp", ddp), ("k8s", k8s)];

/// The training program of the Kubernetes manifest (`examples/k8s/train.yaml`), as the pods of
/// scenario `k8s-pods` run it (see [`crate::k8s`]).
pub fn k8s() -> std::io::Result<Workload> {
    let pod = crate::k8s::PodTemplate::load().map_err(std::io::Error::other)?;
    let mut w = pod.workload(workspace_bin(&pod.program)?);
    // The program's own dataset size: its `--dataset`, or the bundled ddp's default.
    w.dataset_len = Some(
        pod.program_args
            .iter()
            .find_map(|a| a.strip_prefix("--dataset="))
            .and_then(|n| n.parse().ok())
            .unwrap_or(200_000),
    );
    Ok(w)
}

/// A training program and its arguments.
#[derive(Debug, Clone)]
pub struct Workload {
    /// A short name for reports.
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments, with placeholders (see the module docs).
    pub args: Vec<String>,
    /// The dataset length, for the sample audit (unknown for a custom program unless given).
    pub dataset_len: Option<u64>,
}

/// Per-run values of the placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Steps to train.
    pub steps: u64,
    /// Checkpoint every this many steps (0: only at the end and on preemption).
    pub checkpoint_every: u64,
    /// The collective deadline in seconds.
    pub op_timeout: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            steps: 600,
            checkpoint_every: 100,
            op_timeout: 30.0,
        }
    }
}

/// The files of one run that placeholders name.
#[derive(Debug, Clone)]
pub struct RunFiles {
    /// The checkpoint directory.
    pub checkpoint_dir: PathBuf,
    /// The loss CSV.
    pub loss_csv: PathBuf,
}

/// The bundled `ddp` example: the 64-128-10 MLP, a global batch of 64 out of 4096 samples (64
/// steps per epoch), one compute thread per rank, `step=<N>` printed at every step.
pub fn ddp() -> std::io::Result<Workload> {
    let args = [
        "--steps",
        "{steps}",
        "--layers",
        "64-128-10",
        "--batch",
        "64",
        "--dataset",
        "4096",
        "--seed",
        "3",
        "--threads",
        "1",
        "--log-every",
        "1",
        "--checkpoint-dir",
        "{checkpoint_dir}",
        "--checkpoint-every",
        "{checkpoint_every}",
        "--op-timeout",
        "{op_timeout}",
        "--loss-csv",
        "{loss_csv}",
    ];
    Ok(Workload {
        name: "ddp".into(),
        program: workspace_bin("ddp")?,
        args: args.iter().map(|s| s.to_string()).collect(),
        dataset_len: Some(4096),
    })
}

impl Workload {
    /// A bundled workload by name.
    pub fn bundled(name: &str) -> Option<std::io::Result<Workload>> {
        BUNDLED
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, make)| make())
    }

    /// A user's program with its arguments (placeholders allowed).
    pub fn custom(program: impl Into<PathBuf>, args: Vec<String>) -> Workload {
        let program = program.into();
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "program".into());
        Workload {
            name,
            program,
            args,
            dataset_len: None,
        }
    }

    /// True when some argument contains `placeholder` (such as `{checkpoint_dir}`).
    pub fn uses(&self, placeholder: &str) -> bool {
        self.args.iter().any(|a| a.contains(placeholder))
    }

    /// The arguments with the placeholders filled.
    pub fn argv(&self, s: &Settings, files: &RunFiles) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        self.args
            .iter()
            .map(|a| {
                a.replace("{steps}", &s.steps.to_string())
                    .replace("{checkpoint_dir}", &path(&files.checkpoint_dir))
                    .replace("{checkpoint_every}", &s.checkpoint_every.to_string())
                    .replace("{op_timeout}", &s.op_timeout.to_string())
                    .replace("{loss_csv}", &path(&files.loss_csv))
            })
            .collect()
    }

    /// Whether the program's file holds the storage failpoints (built with
    /// `--features rekindle-storage/failpoints`), needed to kill it at a commit stage.
    pub fn has_failpoints(&self) -> bool {
        std::fs::read(&self.program).is_ok_and(|bytes| {
            let needle = b"REKINDLE_FAILPOINT_REACHED";
            bytes.windows(needle.len()).any(|w| w == needle)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_filled() {
        let w = Workload::custom(
            "/bin/train",
            vec![
                "--steps={steps}".into(),
                "--dir".into(),
                "{checkpoint_dir}".into(),
                "--every".into(),
                "{checkpoint_every}".into(),
                "--deadline".into(),
                "{op_timeout}".into(),
                "--csv".into(),
                "{loss_csv}".into(),
            ],
        );
        assert_eq!(w.name, "train");
        assert!(w.uses("{checkpoint_dir}"));
        assert!(!w.uses("{seed}"));
        let files = RunFiles {
            checkpoint_dir: "/tmp/ck".into(),
            loss_csv: "/tmp/l.csv".into(),
        };
        let s = Settings {
            steps: 7,
            checkpoint_every: 3,
            op_timeout: 2.5,
        };
        assert_eq!(
            w.argv(&s, &files),
            [
                "--steps=7",
                "--dir",
                "/tmp/ck",
                "--every",
                "3",
                "--deadline",
                "2.5",
                "--csv",
                "/tmp/l.csv"
            ]
        );
    }

    #[test]
    fn unknown_bundled_names_are_none() {
        assert!(Workload::bundled("no-such-workload").is_none());
        assert!(BUNDLED.iter().any(|(n, _)| *n == "ddp"));
    }
}
