//! Key normalisation: the `module.` prefix that PyTorch's DataParallel and
//! DistributedDataParallel put in front of every parameter name.

/// The wrapper prefixes stripped from the front of a name, repeatedly (a DDP-wrapped
/// DataParallel model gives `module.module.`).
pub const STRIPPED_PREFIXES: [&str; 1] = ["module."];

/// `name` without leading `module.` prefixes. A name that would become empty is kept as it is.
pub fn normalize_key(name: &str) -> &str {
    let mut n = name;
    loop {
        match STRIPPED_PREFIXES.iter().find_map(|p| n.strip_prefix(p)) {
            Some(rest) if !rest.is_empty() => n = rest,
            _ => return n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_wrapper_prefixes() {
        for (input, want) in [
            ("module.fc1.weight", "fc1.weight"),
            ("module.module.fc1.weight", "fc1.weight"),
            ("fc1.weight", "fc1.weight"),
            ("encoder.module.x", "encoder.module.x"),
            ("module.", "module."),
            ("modules.x", "modules.x"),
        ] {
            assert_eq!(normalize_key(input), want, "{input}");
        }
    }
}
