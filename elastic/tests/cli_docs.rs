//! The user guide against the programs: its CLI reference lists exactly the flags that
//! `rekindle ... --help` prints, and it has a section for every example program.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn guide() -> String {
    std::fs::read_to_string(repo().join("docs/user-guide.md")).unwrap()
}

/// The part of the guide from its `## The `rekindle` command line` heading to the next `## `.
fn reference(guide: &str) -> &str {
    let start = guide
        .find("## The `rekindle` command line")
        .expect("the CLI reference heading");
    let rest = &guide[start + 3..];
    let end = rest.find("\n## ").map_or(rest.len(), |e| e + 1);
    &rest[..end]
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rekindle"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "rekindle {args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The long options of a `--help` text (their own lines, not the aliases), without
/// `--help` and `--version`.
fn help_flags(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let t = l.trim_start();
            // `--flag` or `-h, --help`
            let t = t.strip_prefix("--").or_else(|| {
                t.strip_prefix('-')
                    .and_then(|r| r.split_once(", --"))
                    .map(|(_, f)| f)
            })?;
            let name: String = t
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            (!name.is_empty() && name != "help" && name != "version").then(|| format!("--{name}"))
        })
        .collect()
}

/// The subcommands a `--help` text lists, without `help`.
fn subcommands(text: &str) -> Vec<String> {
    let Some((_, rest)) = text.split_once("Commands:\n") else {
        return Vec::new();
    };
    rest.lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The flags the reference documents: those that start the first cell of a table row.
fn documented_flags(reference: &str) -> BTreeSet<String> {
    reference
        .lines()
        .filter_map(|l| l.strip_prefix("| `--"))
        .map(|r| {
            let name: String = r
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            format!("--{name}")
        })
        .collect()
}

#[test]
fn the_cli_reference_lists_exactly_the_flags_of_help() {
    let guide = guide();
    let reference = reference(&guide);
    let top = help(&[]);
    let mut commands: Vec<Vec<String>> = Vec::new();
    for sub in subcommands(&top) {
        let text = help(&[&sub]);
        let nested = subcommands(&text);
        commands.push(vec![sub.clone()]);
        commands.extend(nested.into_iter().map(|n| vec![sub.clone(), n]));
    }
    assert!(
        commands.iter().any(|c| c == &["run"]) && commands.iter().any(|c| c == &["ckpt", "verify"]),
        "{commands:?}"
    );
    let mut in_help = BTreeSet::new();
    for c in &commands {
        let args: Vec<&str> = c.iter().map(String::as_str).collect();
        assert!(
            reference.contains(&format!("rekindle {}", args.join(" "))),
            "the reference does not show `rekindle {}`",
            args.join(" ")
        );
        in_help.extend(help_flags(&help(&args)));
    }
    assert!(in_help.contains("--nproc-per-node") && in_help.contains("--no-normalize"));
    let documented = documented_flags(reference);
    let missing: Vec<_> = in_help.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "flags of --help missing in docs/user-guide.md: {missing:?}"
    );
    let unknown: Vec<_> = documented.difference(&in_help).collect();
    assert!(
        unknown.is_empty(),
        "flags in docs/user-guide.md that no --help prints: {unknown:?}"
    );
}

#[test]
fn the_user_guide_has_a_section_for_every_example() {
    let guide = guide();
    let mut bins: Vec<String> = std::fs::read_dir(repo().join("examples/src/bin"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "rs").then(|| p.file_stem()?.to_str().map(str::to_string))?
        })
        .collect();
    bins.sort();
    assert!(bins.contains(&"ddp".to_string()), "{bins:?}");
    let missing: Vec<_> = bins
        .iter()
        .filter(|b| !guide.contains(&format!("\n### `{b}`\n")))
        .collect();
    assert!(
        missing.is_empty(),
        "examples without a `### `name`` section in docs/user-guide.md: {missing:?}"
    );
}

#[test]
fn the_flag_parsers_read_what_they_should() {
    let text = "Options:\n      --nproc-per-node <N>\n          x [alias: --nproc_per_node]\n  -h, --help  Print help\n  -b, --minbytes <B>\n";
    let got: Vec<_> = help_flags(text).into_iter().collect();
    assert_eq!(got, ["--minbytes", "--nproc-per-node"]);
    let doc = "| `--grace-period SECS` | `30` | x |\n| `ls DIR` | x |\nuse `--other`\n";
    let got: Vec<_> = documented_flags(doc).into_iter().collect();
    assert_eq!(got, ["--grace-period"]);
    assert_eq!(
        subcommands("Commands:\n  run   R\n  help  H\n\nOptions:\n"),
        ["run"]
    );
}
