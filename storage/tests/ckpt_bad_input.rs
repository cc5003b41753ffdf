//! Bad input: each case is a typed error that names the path.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{snapshot, state, tensor};
use rekindle_storage::{
    CheckpointDir, LoadOptions, SafetensorsFile, Snapshot, StorageError, TensorDType,
};

/// A root with a committed step 1 (two files); returns (tempdir, step dir).
fn saved() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    CheckpointDir::new(root.path())
        .unwrap()
        .save(&snapshot(1))
        .unwrap();
    let step = root.path().join("step-1");
    (root, step)
}

fn open(step: &Path) -> StorageError {
    rekindle_storage::Checkpoint::open(step, &LoadOptions::default()).unwrap_err()
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

fn names(err: &StorageError, path: &Path) {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "{msg} does not name {}",
        path.display()
    );
}

#[test]
fn truncated_file() {
    let (_root, step) = saved();
    let f = step.join("model.safetensors");
    edit(&f, |b| b.truncate(b.len() - 3));
    let err = open(&step);
    assert!(
        matches!(err, StorageError::SizeMismatch { ref path, .. } if path == &f),
        "{err}"
    );
    names(&err, &f);
    // A bare file truncated: the header says how long it must be.
    let err = SafetensorsFile::open(&f, &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, StorageError::SizeMismatch { .. }), "{err}");
    names(&err, &f);
}

#[test]
fn flipped_byte() {
    let (_root, step) = saved();
    let f = step.join("optimizer.safetensors");
    edit(&f, |b| {
        let i = b.len() - 10;
        b[i] ^= 1;
    });
    let err = open(&step);
    assert!(
        matches!(err, StorageError::ChecksumMismatch { ref path, tensor: None, .. } if path == &f),
        "{err}"
    );
    names(&err, &f);
}

#[test]
fn header_length_beyond_file() {
    let (_root, step) = saved();
    let f = step.join("model.safetensors");
    edit(&f, |b| b[..8].copy_from_slice(&(1u64 << 33).to_le_bytes()));
    for err in [
        open(&step),
        SafetensorsFile::open(&f, &LoadOptions::default()).unwrap_err(),
    ] {
        assert!(
            matches!(err, StorageError::InvalidHeader { ref reason, .. } if reason.contains("beyond the end")),
            "{err}"
        );
        names(&err, &f);
    }
}

#[test]
fn malformed_json_header() {
    let (_root, step) = saved();
    let f = step.join("model.safetensors");
    edit(&f, |b| b[9] = b'#');
    for err in [
        open(&step),
        SafetensorsFile::open(&f, &LoadOptions::default()).unwrap_err(),
    ] {
        assert!(
            matches!(err, StorageError::InvalidHeader { ref reason, .. } if reason.contains("malformed JSON")),
            "{err}"
        );
        names(&err, &f);
    }
}

#[test]
fn missing_shard() {
    let (_root, step) = saved();
    let f = step.join("optimizer.safetensors");
    std::fs::remove_file(&f).unwrap();
    let err = open(&step);
    assert!(
        matches!(err, StorageError::MissingFile { ref path, rank: 0 } if path == &f),
        "{err}"
    );
    names(&err, &f);
}

#[test]
fn manifest_of_newer_format_version() {
    let (_root, step) = saved();
    let m = step.join("manifest.json");
    edit(&m, |b| {
        let mut v: serde_json::Value = serde_json::from_slice(b).unwrap();
        v["format_version"] = serde_json::json!(rekindle_storage::FORMAT_VERSION + 1);
        *b = v.to_string().into_bytes();
    });
    let err = open(&step);
    assert!(
        matches!(err, StorageError::UnsupportedFormatVersion { found, supported, .. } if found == supported + 1),
        "{err}"
    );
    names(&err, &m);
}

/// Saves step 2 (16 MiB) into a root that already holds step 1 (small) but has only 8 MiB:
/// the save fails with NoSpace naming the file, and step 1 still loads.
fn check_disk_full(root: &Path) {
    let dir = CheckpointDir::new(root).unwrap();
    let mut small = Snapshot::new(state(1));
    small
        .insert("w", tensor(TensorDType::F32, &[1024], 0))
        .unwrap();
    dir.save(&small).unwrap();
    let mut big = Snapshot::new(state(2));
    big.insert("w", tensor(TensorDType::F32, &[4 << 20], 0))
        .unwrap();
    let err = dir.save(&big).unwrap_err();
    match &err {
        StorageError::NoSpace { path, .. } => assert!(path.ends_with("model.safetensors"), "{err}"),
        e => panic!("expected NoSpace, got {e}"),
    }
    assert_eq!(dir.committed_steps().unwrap(), vec![1]);
    let ckpt = dir.load_latest(&LoadOptions::default()).unwrap();
    assert_eq!(ckpt.step(), 1);
    assert_eq!(
        ckpt.tensor("w").unwrap().to_host().unwrap(),
        small.get("w").unwrap().tensor
    );
    let leftovers = std::fs::read_dir(root)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp")
        })
        .count();
    assert_eq!(leftovers, 0, "the failed save removes its temp dir");
}

const CHILD_ENV: &str = "REKINDLE_STORAGE_TEST_CHILD";

/// Runs this test binary's `test` in a child process with `env` set; returns whether it passed.
fn run_child(test: &str, mode: &str, dir: &Path, uid: Option<u32>) -> bool {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // A copy of this binary in a world-readable temp dir, so an unprivileged child can run it
    // wherever the build directory is.
    let exe_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(exe_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = exe_dir.path().join("child");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(&exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{mode}:{}", dir.display()));
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out.status.success()
}

fn child_mode() -> Option<(String, PathBuf)> {
    let v = std::env::var(CHILD_ENV).ok()?;
    let (mode, dir) = v.split_once(':')?;
    Some((mode.to_string(), PathBuf::from(dir)))
}

#[test]
fn disk_full_while_saving_keeps_previous() {
    if let Some((mode, dir)) = child_mode() {
        if mode == "rlimit" {
            // SAFETY: plain libc calls on this process; no memory is shared.
            unsafe {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let lim = libc::rlimit {
                    rlim_cur: 8 << 20,
                    rlim_max: 8 << 20,
                };
                assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
            }
            check_disk_full(&dir);
        }
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .is_ok_and(|s| s.success());
    if mounted {
        let result = std::panic::catch_unwind(|| check_disk_full(mnt.path()));
        let _ = Command::new("umount").arg(mnt.path()).status();
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    } else {
        // Without the right to mount: a file-size limit in a child process stands in for a
        // full disk (writes fail with EFBIG).
        assert!(run_child(
            "disk_full_while_saving_keeps_previous",
            "rlimit",
            mnt.path(),
            None
        ));
    }
}

fn check_permission_denied(root: &Path) {
    // A read-only root: saving is refused.
    let ro = root.join("read-only");
    let err = CheckpointDir::new(&ro)
        .unwrap()
        .save(&snapshot(2))
        .unwrap_err();
    assert!(
        matches!(err, StorageError::PermissionDenied { .. }),
        "{err}"
    );
    names(&err, &ro);
    // An unreadable file: loading is refused, naming it.
    let f = root.join("readable/step-1/model.safetensors");
    let err =
        rekindle_storage::Checkpoint::open(&root.join("readable/step-1"), &LoadOptions::default())
            .unwrap_err();
    assert!(
        matches!(err, StorageError::PermissionDenied { ref path, .. } if path == &f),
        "{err}"
    );
}

#[test]
fn permission_denied() {
    use std::os::unix::fs::PermissionsExt;
    if let Some((mode, dir)) = child_mode() {
        if mode == "perm" {
            check_permission_denied(&dir);
        }
        return;
    }
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ro = root.path().join("read-only");
    std::fs::create_dir(&ro).unwrap();
    std::fs::write(ro.join(".rekindle-ckpt.lock"), b"").unwrap();
    std::fs::set_permissions(
        ro.join(".rekindle-ckpt.lock"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let readable = root.path().join("readable");
    CheckpointDir::new(&readable)
        .unwrap()
        .save(&snapshot(1))
        .unwrap();
    std::fs::set_permissions(
        readable.join("step-1/model.safetensors"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // Root bypasses permission bits: run the checks as an unprivileged user.
        assert!(run_child(
            "permission_denied",
            "perm",
            root.path(),
            Some(65534)
        ));
    } else {
        check_permission_denied(root.path());
    }
}
