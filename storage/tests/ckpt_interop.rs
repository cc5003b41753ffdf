//! Interop with Python `safetensors` (PyPI packages `safetensors` and `numpy`, installed by
//! scripts/test.sh): our files load there, and a PyTorch DP/DDP-style state dict with
//! `module.` prefixes loads into a plain model here.

mod common;

use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device as CDevice};
use candle_nn::VarMap;
use rekindle_storage::{
    load_varmap, CheckpointDir, LoadOptions, SafetensorsFile, Snapshot, TensorDType,
};

/// Runs a Python script; fails the test with instructions when the packages are missing.
fn python(script: &str, args: &[&Path]) -> String {
    let probe = Command::new("python3")
        .args(["-c", "import safetensors.numpy, numpy"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "python3 cannot import safetensors and numpy ({}): run scripts/test.sh, which pip-installs them",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("python3 is not runnable ({e}): install it and run scripts/test.sh"),
    }
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const CHECK_FILES: &str = r#"
import sys, json
import numpy as np
import safetensors, safetensors.numpy
model, halfs, expected = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
loaded = safetensors.numpy.load_file(model)
assert sorted(loaded) == sorted(k for k in expected if not k.endswith("bf16")), sorted(loaded)
for name, arr in loaded.items():
    want = expected[name]
    assert list(arr.shape) == want["shape"], (name, arr.shape)
    assert arr.dtype.name == want["numpy"], (name, arr.dtype)
    assert arr.flatten().astype(np.float64).tolist() == want["values"], name
# numpy has no bfloat16: read the raw bytes and widen them to f32.
raw = dict(safetensors.deserialize(open(halfs, "rb").read()))
t = raw["w.bf16"]
assert t["dtype"] == "BF16" and list(t["shape"]) == expected["w.bf16"]["shape"]
u = np.frombuffer(bytes(t["data"]), dtype=np.uint16).astype(np.uint32) << 16
assert u.view(np.float32).astype(np.float64).tolist() == expected["w.bf16"]["values"]
print("ok", len(loaded) + 1)
"#;

#[test]
fn python_safetensors_loads_our_files() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(root.path()).unwrap();
    let mut snap = Snapshot::new(common::state(1));
    let mut expected = serde_json::Map::new();
    for (i, d) in TensorDType::ALL.into_iter().enumerate() {
        let name = format!("w.{}", d.safetensors_name().to_lowercase());
        let shape = [2, 3, 4];
        let t = common::tensor(d, &shape, i * 3);
        let group = if d == TensorDType::BF16 {
            "halfs"
        } else {
            "model"
        };
        let values: Vec<f64> = (0..24)
            .map(|j| {
                let v = ((j + i * 3) % 251) as f64;
                match d {
                    TensorDType::I32 => v - 100.0,
                    TensorDType::I64 => v - (1u64 << 40) as f64,
                    TensorDType::Bool => (v as u64 % 2) as f64,
                    _ => v,
                }
            })
            .collect();
        let numpy = match d {
            TensorDType::F64 => "float64",
            TensorDType::I64 => "int64",
            TensorDType::F32 => "float32",
            TensorDType::I32 => "int32",
            TensorDType::F16 => "float16",
            TensorDType::BF16 => "bfloat16",
            TensorDType::U8 => "uint8",
            TensorDType::Bool => "bool",
        };
        expected.insert(
            name.clone(),
            serde_json::json!({"shape": shape, "numpy": numpy, "values": values}),
        );
        snap.insert_in(group, &name, rekindle_runtime::Device::Cpu, t)
            .unwrap();
    }
    dir.save(&snap).unwrap();
    let exp = root.path().join("expected.json");
    std::fs::write(&exp, serde_json::Value::Object(expected).to_string()).unwrap();
    let step = root.path().join("step-1");
    let out = python(
        CHECK_FILES,
        &[
            &step.join("model.safetensors"),
            &step.join("halfs.safetensors"),
            &exp,
        ],
    );
    assert_eq!(out.trim(), "ok 8");
}

const WRITE_DDP: &str = r#"
import sys
import numpy as np
import safetensors.numpy
w = (np.arange(12, dtype=np.float32) * 0.5).reshape(4, 3)
b = np.array([1.0, -2.0, 3.0, -4.0], dtype=np.float32)
safetensors.numpy.save_file({"module.fc.weight": w, "module.fc.bias": b}, sys.argv[1], metadata={"format": "pt"})
"#;

#[test]
fn ddp_state_dict_with_module_prefix_loads_into_plain_model() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("ddp.safetensors");
    python(WRITE_DDP, &[&file]);
    let vm = VarMap::new();
    let init = candle_nn::Init::Const(0.0);
    vm.get((4, 3), "fc.weight", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    vm.get(4, "fc.bias", init, DType::F32, &CDevice::Cpu)
        .unwrap();
    let f = SafetensorsFile::open(&file, &LoadOptions::default()).unwrap();
    assert_eq!(f.names(), vec!["fc.bias", "fc.weight"]);
    assert_eq!(f.tensor("fc.bias").unwrap().stored_name(), "module.fc.bias");
    let report = load_varmap(&f, &vm).unwrap();
    assert_eq!(report.loaded.len(), 2);
    let data = vm.data().lock().unwrap();
    let w: Vec<f32> = data["fc.weight"].flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(w, (0..12).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
    assert_eq!(
        data["fc.bias"].to_vec1::<f32>().unwrap(),
        vec![1.0, -2.0, 3.0, -4.0]
    );
    drop(data);
    // With normalisation off the prefixed names are what the file holds.
    let raw = SafetensorsFile::open(&file, &LoadOptions::default().normalize_keys(false)).unwrap();
    assert_eq!(raw.names(), vec!["module.fc.bias", "module.fc.weight"]);
    assert!(load_varmap(&raw, &vm).is_err());
}
