//! Crash safety: a real writer process is killed (SIGKILL) at every stage of the commit; the
//! checkpoint root then holds the old checkpoint or the new one, each fully valid, never a
//! corrupt latest, and the next save cleans up what the dead writer left.

mod common;

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rekindle_storage::failpoint::{FAILPOINT_ENV, SAVE_STAGES};
use rekindle_storage::{CheckpointDir, LoadOptions, RetentionPolicy, StorageError};

const CHILD_ENV: &str = "REKINDLE_CRASH_CHILD_ROOT";
const RETENTION_STAGE: &str = "storage::retention::trashed";

/// The writer: saves step 2 (keeping only the last checkpoint) into the root it is given.
#[test]
fn crash_child() {
    let Ok(root) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = CheckpointDir::new(&root)
        .unwrap()
        .with_retention(RetentionPolicy::last(1).unwrap());
    let r = dir.save(&common::snapshot(2));
    // Reached only when the failpoint's pause ran out.
    panic!("the writer was not killed: {r:?}");
}

/// Starts the writer armed to pause at `stage`, waits until it is there, kills it.
fn kill_writer_at(root: &Path, stage: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, root)
        .env(FAILPOINT_ENV, format!("{stage}=pause"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // The test harness may have printed `test crash_child ... ` on the same line.
            if let Some((_, name)) = line.split_once("REKINDLE_FAILPOINT_REACHED ") {
                let _ = tx.send(name.trim().to_string());
            }
        }
    });
    let reached = rx.recv_timeout(Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        reached.as_deref(),
        Ok(stage),
        "the writer did not reach {stage}"
    );
}

fn check_after_crash(stage: &str) {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let old = common::snapshot(1);
    dir.save(&old).unwrap();
    kill_writer_at(root.path(), stage);

    let renamed = stage == RETENTION_STAGE
        || SAVE_STAGES.iter().position(|s| *s == stage)
            >= SAVE_STAGES
                .iter()
                .position(|s| *s == "storage::save::renamed");
    // Every committed checkpoint verifies: there is no corrupt one, latest or not.
    let steps = dir.committed_steps().unwrap();
    for &s in &steps {
        dir.load_step(s, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{stage}: step {s} is committed but invalid: {e}"));
    }
    let latest = dir.load_latest(&LoadOptions::default()).unwrap();
    let want = if renamed { 2 } else { 1 };
    assert_eq!(latest.step(), want, "{stage}: steps {steps:?}");
    let expected = if renamed { common::snapshot(2) } else { old };
    assert_eq!(latest.state(), &expected.state, "{stage}");
    for e in expected.entries() {
        assert_eq!(
            latest.tensor(&e.name).unwrap().bytes(),
            e.tensor.as_bytes(),
            "{stage}"
        );
    }
    drop(latest);

    // The next save succeeds and removes the dead writer's leftovers.
    let next = dir.save(&common::snapshot(3));
    match next {
        Ok(_) => {}
        Err(e) => panic!("{stage}: the save after the crash failed: {e}"),
    }
    let leftovers: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp") || n.starts_with(".trash"))
        .collect();
    assert!(leftovers.is_empty(), "{stage}: {leftovers:?}");
    assert_eq!(dir.load_latest(&LoadOptions::default()).unwrap().step(), 3);
}

#[test]
fn killed_writer_at_every_commit_stage_leaves_old_or_new() {
    for stage in SAVE_STAGES.iter().copied().chain([RETENTION_STAGE]) {
        check_after_crash(stage);
    }
}

#[test]
fn failpoint_error_leaves_no_trace() {
    // In-process errors at each stage before the rename: the save fails, nothing is committed,
    // and the temp dir is gone.
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    dir.save(&common::snapshot(1)).unwrap();
    let before_rename = SAVE_STAGES
        .iter()
        .take_while(|s| **s != "storage::save::renamed");
    for stage in before_rename {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "crash_child", "--test-threads=1"])
            .env(CHILD_ENV, root.path())
            .env(FAILPOINT_ENV, format!("{stage}=error"))
            .output()
            .unwrap();
        // The writer's save returned the failpoint error (its test panics with it).
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Failpoint"), "{stage}: {text}");
        assert_eq!(dir.committed_steps().unwrap(), vec![1], "{stage}");
        let tmp = std::fs::read_dir(root.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".tmp")
            })
            .count();
        assert_eq!(tmp, 0, "{stage}");
    }
    assert!(matches!(
        dir.load_step(2, &LoadOptions::default()),
        Err(StorageError::StepNotFound { .. })
    ));
}
