//! The `rekindle-ckpt` binary, run as a real process.

mod common;

use std::process::Command;

fn ckpt(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rekindle-ckpt"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn ls_inspect_verify() {
    let root = tempfile::tempdir().unwrap();
    let dir = rekindle_storage::CheckpointDir::new(root.path()).unwrap();
    dir.save(&common::snapshot(1)).unwrap();
    dir.save(&common::snapshot(2)).unwrap();
    let r = root.path().to_str().unwrap();
    let (code, out, _) = ckpt(&["ls", r]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.lines().filter(|l| l.ends_with("valid")).count() == 2,
        "{out}"
    );

    let step2 = root.path().join("step-2");
    let (code, out, _) = ckpt(&["inspect", step2.to_str().unwrap()]);
    assert_eq!(code, 0);
    for want in [
        "step 2  epoch 0  sample_cursor 512",
        "w.bf16  BF16  [3, 5]",
        "w.f32.exp_avg  F32  [3, 5]  optimizer.safetensors  saved on cuda:1",
        "user lr = 0.5",
    ] {
        assert!(out.contains(want), "{want:?} not in\n{out}");
    }
    let file = step2.join("model.safetensors");
    let (code, out, _) = ckpt(&["inspect", file.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(
        out.contains("8 tensors") && out.contains("w.bool  BOOL  [3, 5]"),
        "{out}"
    );

    assert_eq!(ckpt(&["verify", step2.to_str().unwrap()]).0, 0);
    assert_eq!(ckpt(&["verify", r]).0, 0);
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let (code, out, _) = ckpt(&["verify", step2.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("INVALID") && out.contains("checksum mismatch"),
        "{out}"
    );
    assert_eq!(ckpt(&["verify", r]).0, 1);
    assert_eq!(
        ckpt(&["verify", root.path().join("step-1").to_str().unwrap()]).0,
        0
    );
    let (code, out, _) = ckpt(&["ls", r]);
    assert_eq!(code, 1);
    assert!(out.contains("INVALID"), "{out}");

    let (code, _, err) = ckpt(&["verify", root.path().join("nope").to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("nope"), "{err}");
    let (code, _, err) = ckpt(&["inspect", root.path().to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("not a committed checkpoint"), "{err}");
}
