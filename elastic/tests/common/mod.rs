//! Helpers for tests that run the real `rekindle` binary, on the shared process helpers of
//! `rekindle_elastic::testing`.
#![allow(dead_code, unused_imports)]

use std::process::Command;

pub use rekindle_elastic::testing::{field, pid_alive, wait_pid_gone, Proc};

pub const REKINDLE: &str = env!("CARGO_BIN_EXE_rekindle");
pub const WORKER: &str = env!("CARGO_BIN_EXE_rekindle-test-worker");

/// Starts `rekindle args...` with extra environment `envs` and the agent's debug log on.
pub fn rekindle(args: &[&str], envs: &[(&str, &str)]) -> Proc {
    let mut cmd = Command::new(REKINDLE);
    cmd.args(args)
        .envs(envs.iter().copied())
        .env("REKINDLE_LOG", "rekindle_elastic=debug");
    Proc::spawn(cmd).expect("spawn rekindle")
}
