//! Map-location: where each loaded tensor goes, given where it was saved.
//!
//! A checkpoint records each tensor's device at save (`cpu`, `cuda:N`). At load the caller says
//! where tensors go: one device for all, a table of rules such as `cuda:1 -> cuda:0, cuda:* ->
//! cpu`, or a function of the tensor's name and saved device. The default is the CPU, so a
//! resume never silently piles every rank's tensors onto GPU 0.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use rekindle_runtime::Device;

use crate::error::{Result, StorageError};

/// The left side of a mapping rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePattern {
    /// Exactly this device.
    Exact(Device),
    /// Any CUDA device (`cuda:*`).
    AnyCuda,
    /// Any device (`*`).
    Any,
}

impl DevicePattern {
    /// True when `d` matches.
    pub fn matches(&self, d: Device) -> bool {
        match self {
            DevicePattern::Exact(e) => *e == d,
            DevicePattern::AnyCuda => d.is_cuda(),
            DevicePattern::Any => true,
        }
    }
}

impl fmt::Display for DevicePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevicePattern::Exact(d) => write!(f, "{d}"),
            DevicePattern::AnyCuda => f.write_str("cuda:*"),
            DevicePattern::Any => f.write_str("*"),
        }
    }
}

/// A function choosing the device of a tensor from its name and saved device.
pub type MapFn = Arc<dyn Fn(&str, Device) -> Device + Send + Sync>;

/// Where loaded tensors go.
#[derive(Clone)]
pub enum MapLocation {
    /// Every tensor to this device.
    Device(Device),
    /// The first rule whose pattern matches the saved device decides; a tensor no rule
    /// matches stays on its saved device.
    Table(Vec<(DevicePattern, Device)>),
    /// A function of (name, saved device).
    Fn(MapFn),
}

impl Default for MapLocation {
    /// Everything to the CPU.
    fn default() -> Self {
        MapLocation::Device(Device::Cpu)
    }
}

impl fmt::Debug for MapLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MapLocation::Device(d) => write!(f, "MapLocation::Device({d})"),
            MapLocation::Table(rules) => {
                let text: Vec<String> = rules.iter().map(|(p, d)| format!("{p} -> {d}")).collect();
                write!(f, "MapLocation::Table({})", text.join(", "))
            }
            MapLocation::Fn(_) => f.write_str("MapLocation::Fn(..)"),
        }
    }
}

impl MapLocation {
    /// A mapping from a function of (tensor name, saved device).
    pub fn from_fn(f: impl Fn(&str, Device) -> Device + Send + Sync + 'static) -> MapLocation {
        MapLocation::Fn(Arc::new(f))
    }

    /// The device tensor `name`, saved on `saved`, goes to.
    pub fn resolve(&self, name: &str, saved: Device) -> Device {
        match self {
            MapLocation::Device(d) => *d,
            MapLocation::Table(rules) => rules
                .iter()
                .find(|(p, _)| p.matches(saved))
                .map_or(saved, |(_, d)| *d),
            MapLocation::Fn(f) => f(name, saved),
        }
    }
}

impl FromStr for MapLocation {
    type Err = StorageError;

    /// Parses a device (`cpu`, `cuda:0`) or comma-separated rules `FROM -> TO` where FROM is a
    /// device, `cuda:*` or `*`, and TO a device.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: String| StorageError::InvalidMapLocation {
            input: s.to_string(),
            reason,
        };
        if !s.contains("->") {
            return s
                .parse::<Device>()
                .map(MapLocation::Device)
                .map_err(|e| bad(e.to_string()));
        }
        let mut rules = Vec::new();
        for rule in s.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let (from, to) = rule
                .split_once("->")
                .ok_or_else(|| bad(format!("rule {rule:?} has no `->`")))?;
            let from = match from.trim().to_ascii_lowercase().as_str() {
                "*" => DevicePattern::Any,
                "cuda:*" => DevicePattern::AnyCuda,
                other => DevicePattern::Exact(
                    other
                        .parse()
                        .map_err(|e: rekindle_runtime::Error| bad(e.to_string()))?,
                ),
            };
            let to = to
                .trim()
                .parse::<Device>()
                .map_err(|e| bad(e.to_string()))?;
            rules.push((from, to));
        }
        if rules.is_empty() {
            return Err(bad("no rules".into()));
        }
        Ok(MapLocation::Table(rules))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_resolve_in_order() {
        let m: MapLocation = "cuda:1 -> cuda:0, cuda:* -> cpu".parse().unwrap();
        let table: &[(Device, Device)] = &[
            (Device::Cuda(1), Device::Cuda(0)),
            (Device::Cuda(0), Device::Cpu),
            (Device::Cuda(7), Device::Cpu),
            (Device::Cpu, Device::Cpu),
        ];
        for &(saved, want) in table {
            assert_eq!(m.resolve("w", saved), want, "{saved}");
        }
        let m: MapLocation = "cpu -> cuda:2".parse().unwrap();
        assert_eq!(m.resolve("w", Device::Cpu), Device::Cuda(2));
        assert_eq!(m.resolve("w", Device::Cuda(3)), Device::Cuda(3));
        let m: MapLocation = "* -> cuda:1".parse().unwrap();
        assert_eq!(m.resolve("w", Device::Cuda(3)), Device::Cuda(1));
        assert_eq!(
            "cuda:3"
                .parse::<MapLocation>()
                .unwrap()
                .resolve("w", Device::Cpu),
            Device::Cuda(3)
        );
    }

    #[test]
    fn functions_see_names() {
        let m = MapLocation::from_fn(|name, saved| {
            if name.starts_with("stage1.") {
                Device::Cuda(1)
            } else {
                saved
            }
        });
        assert_eq!(m.resolve("stage1.w", Device::Cpu), Device::Cuda(1));
        assert_eq!(m.resolve("stage0.w", Device::Cuda(0)), Device::Cuda(0));
        assert_eq!(
            MapLocation::default().resolve("x", Device::Cuda(5)),
            Device::Cpu
        );
    }

    #[test]
    fn rejects_bad_tables() {
        for s in [
            "",
            "cuda:1 -> ",
            "tpu -> cpu",
            "cuda:1 -> cuda:*",
            "cuda:1 => cpu",
            ",",
        ] {
            assert!(
                matches!(
                    s.parse::<MapLocation>(),
                    Err(StorageError::InvalidMapLocation { .. })
                ),
                "{s:?}"
            );
        }
    }
}
