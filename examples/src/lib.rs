//! Shared helpers of the example programs.
pub mod mlp;
pub mod pipeline_mlp;

/// Opens `path` for appending CSV rows, writing `header` (without its newline) first when
/// the file does not exist yet.
pub fn append_csv(path: &std::path::Path, header: &str) -> anyhow::Result<std::fs::File> {
    use anyhow::Context;
    use std::io::Write;
    let fresh = !path.exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    if fresh {
        writeln!(f, "{header}").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(f)
}
