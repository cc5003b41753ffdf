//! Devices: `cpu`, `cuda`, `cuda:N`, and a CUDA probe that never panics.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where tensors live. The CUDA variant always exists; whether it is usable is a run-time
/// question answered by [`cuda_device_count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// The CUDA device with this ordinal (after `CUDA_VISIBLE_DEVICES` remapping).
    Cuda(usize),
}

impl Device {
    /// True for [`Device::Cuda`].
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The best device here: `cuda:0` when a CUDA device is visible, else `cpu`.
    pub fn best_available() -> Device {
        if cuda_device_count() > 0 {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }
    }

    /// Checks that the device can be used in this process: always for the CPU; for CUDA, that
    /// the driver loads and the ordinal is below the visible device count.
    pub fn ensure_available(&self) -> Result<()> {
        match *self {
            Device::Cpu => Ok(()),
            Device::Cuda(ordinal) => match probe_cuda() {
                Err(reason) => Err(Error::CudaUnavailable { ordinal, reason }),
                Ok(count) if ordinal >= count => Err(Error::CudaUnavailable {
                    ordinal,
                    reason: format!("only {count} CUDA device(s) are visible"),
                }),
                Ok(_) => Ok(()),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda` (meaning `cuda:0`) and `cuda:N`, case-insensitively and ignoring
    /// surrounding whitespace.
    fn from_str(s: &str) -> Result<Self> {
        let invalid = || Error::InvalidDevice {
            input: s.to_string(),
        };
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => {
                let n = t.strip_prefix("cuda:").ok_or_else(invalid)?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(invalid());
                }
                n.parse().map(Device::Cuda).map_err(|_| invalid())
            }
        }
    }
}

/// How many CUDA devices this process may use: 0 when libcuda is missing, the driver fails to
/// initialise, or `CUDA_VISIBLE_DEVICES` hides them all. Never panics.
pub fn cuda_device_count() -> usize {
    probe_cuda().unwrap_or(0)
}

/// The number of devices `CUDA_VISIBLE_DEVICES` leaves visible out of `physical` devices, with
/// the driver's rules: unset means all; entries are read left to right and the list stops at the
/// first entry that is not a valid, unseen ordinal (or GPU-/MIG- UUID, counted as one device);
/// an empty value hides every device.
pub fn visible_device_count(cuda_visible_devices: Option<&str>, physical: usize) -> usize {
    let Some(list) = cuda_visible_devices else {
        return physical;
    };
    let mut seen = Vec::new();
    for entry in list.split(',') {
        let entry = entry.trim();
        if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
            seen.push(usize::MAX - seen.len());
            continue;
        }
        match entry.parse::<usize>() {
            Ok(i) if i < physical && !seen.contains(&i) => seen.push(i),
            _ => break,
        }
    }
    seen.len().min(physical)
}

/// Loads libcuda with `dlopen` (no link-time dependency), calls `cuInit` and
/// `cuDeviceGetCount`. The driver applies `CUDA_VISIBLE_DEVICES` itself; the count is also
/// clamped by [`visible_device_count`] so the rule holds even for a driver that reports more.
fn probe_cuda() -> std::result::Result<usize, String> {
    type CuInit = unsafe extern "C" fn(u32) -> i32;
    type CuDeviceGetCount = unsafe extern "C" fn(*mut i32) -> i32;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    if visible_device_count(visible.as_deref(), usize::MAX) == 0 {
        return Ok(0);
    }
    let mut last_err = String::from("libcuda not found");
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                last_err = format!("cannot load {name}: {e}");
                continue;
            }
        };
        // SAFETY: the signatures match the CUDA driver API (CUresult is a C enum, i.e. i32).
        let count = unsafe {
            let init: libloading::Symbol<CuInit> =
                lib.get(b"cuInit\0").map_err(|e| format!("cuInit: {e}"))?;
            let get_count: libloading::Symbol<CuDeviceGetCount> = lib
                .get(b"cuDeviceGetCount\0")
                .map_err(|e| format!("cuDeviceGetCount: {e}"))?;
            let rc = init(0);
            if rc != 0 {
                return Err(format!("cuInit failed with CUresult {rc}"));
            }
            let mut n = 0i32;
            let rc = get_count(&mut n);
            if rc != 0 {
                return Err(format!("cuDeviceGetCount failed with CUresult {rc}"));
            }
            n.max(0) as usize
        };
        // The library stays loaded for the life of the process, as CUDA expects.
        std::mem::forget(lib);
        return Ok(visible_device_count(visible.as_deref(), count));
    }
    Err(last_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("CPU", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            (" cuda:12 ", Device::Cuda(12)),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d, "{s}");
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert_eq!(Device::Cpu.to_string(), "cpu");
        for d in [Device::Cpu, Device::Cuda(0), Device::Cuda(7)] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
    }

    #[test]
    fn rejects_bad_devices() {
        for s in [
            "", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "tpu", "cuda:+1",
        ] {
            let err = s.parse::<Device>().unwrap_err();
            assert!(matches!(err, Error::InvalidDevice { .. }), "{s}: {err}");
        }
    }

    #[test]
    fn visible_devices_follow_driver_rules() {
        let table: &[(Option<&str>, usize, usize)] = &[
            (None, 4, 4),
            (Some(""), 4, 0),
            (Some("-1"), 4, 0),
            (Some("0"), 4, 1),
            (Some("2,3"), 4, 2),
            (Some("0,7,1"), 4, 1),
            (Some("1,1"), 4, 1),
            (Some("GPU-abc,0"), 4, 2),
            (Some("3,2,1,0"), 2, 0),
        ];
        for &(env, physical, want) in table {
            assert_eq!(
                visible_device_count(env, physical),
                want,
                "{env:?} of {physical}"
            );
        }
    }

    #[test]
    fn probe_never_panics() {
        // On a machine without libcuda this is 0; with one it is the visible count.
        let n = cuda_device_count();
        if n == 0 {
            assert!(Device::Cuda(0).ensure_available().is_err());
            assert_eq!(Device::best_available(), Device::Cpu);
        }
        assert!(Device::Cpu.ensure_available().is_ok());
    }
}
