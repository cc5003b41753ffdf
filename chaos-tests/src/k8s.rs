//! The Kubernetes training workload as "pods" on this machine: the container's command line
//! and environment read from `examples/k8s/train.yaml`, with the values Kubernetes would fill
//! in (the Downward API's pod IP and job uid, the mounted job secret) filled in by the harness,
//! and run as nodes of a [`Cluster`](crate::cluster::Cluster), each in its own network
//! namespace against a real etcd (scenario `k8s-pods`).
//!
//! What is kept from the manifest: every flag of `rekindle run` and of the training program,
//! and every environment variable with its source. What is mapped to this machine, because it
//! names the cluster's own things: the etcd endpoint (the Service's DNS names), the log and
//! checkpoint volumes (temp dirs), the step count (the harness's), and the training program's
//! path (the workspace's `ddp`, as the image holds it). The harness adds `--log-every=1` and
//! `--loss-csv` so that it can time faults; neither changes what is trained.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

use crate::cluster::ClusterError;
use crate::workload::Workload;

/// The manifest, relative to the workspace root.
pub const TRAIN_MANIFEST: &str = "examples/k8s/train.yaml";

/// Where a pod's environment variable comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvSource {
    /// A literal `value`.
    Value(String),
    /// `valueFrom.fieldRef.fieldPath` (the Downward API).
    Field(String),
}

/// The training container as the manifest declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTemplate {
    /// The `rekindle run` flags (the container's args up to the program, without `run`).
    pub agent_args: Vec<String>,
    /// The training program's name (the image's binary).
    pub program: String,
    /// Its arguments.
    pub program_args: Vec<String>,
    /// The container's environment, in order.
    pub env: Vec<(String, EnvSource)>,
}

/// What Kubernetes gives one pod.
#[derive(Debug, Clone)]
pub struct PodFacts {
    /// `status.podIP`.
    pub pod_ip: String,
    /// `metadata.labels['batch.kubernetes.io/controller-uid']`: the Job's uid.
    pub job_uid: String,
    /// The etcd endpoint the Service names stand for.
    pub etcd_endpoint: String,
    /// The log volume.
    pub log_dir: PathBuf,
    /// Where the Secret is mounted (the file the manifest's `REKINDLE_SECRET_FILE` names is
    /// written there by the harness).
    pub secret_file: PathBuf,
}

fn bad(reason: impl Into<String>) -> ClusterError {
    ClusterError::Unsupported(format!("{TRAIN_MANIFEST}: {}", reason.into()))
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, ClusterError> {
    v.as_sequence()
        .ok_or_else(|| bad(format!("{what} is not a list")))?
        .iter()
        .map(|a| match a {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(n.to_string()),
            other => Err(bad(format!("{what} holds {other:?}"))),
        })
        .collect()
}

impl PodTemplate {
    /// Reads the Job's container `container` from the manifest text `yaml` (several
    /// documents).
    pub fn parse(yaml: &str, container: &str) -> Result<PodTemplate, ClusterError> {
        for doc in serde_yaml::Deserializer::from_str(yaml) {
            let v = Value::deserialize(doc).map_err(|e| bad(e.to_string()))?;
            if v.get("kind").and_then(Value::as_str) != Some("Job") {
                continue;
            }
            let containers = v
                .get("spec")
                .and_then(|s| s.get("template"))
                .and_then(|t| t.get("spec"))
                .and_then(|s| s.get("containers"))
                .and_then(Value::as_sequence)
                .ok_or_else(|| bad("the Job has no containers"))?;
            let c = containers
                .iter()
                .find(|c| c.get("name").and_then(Value::as_str) == Some(container))
                .ok_or_else(|| bad(format!("no container {container:?}")))?;
            let args = strings(c.get("args").unwrap_or(&Value::Null), "args")?;
            let (run, rest) = args
                .split_first()
                .ok_or_else(|| bad("the container has no args"))?;
            if run != "run" {
                return Err(bad(format!("the args start with {run:?}, not \"run\"")));
            }
            let at = rest
                .iter()
                .position(|a| !a.starts_with('-'))
                .ok_or_else(|| bad("no training program in the args"))?;
            let mut env = Vec::new();
            for e in c
                .get("env")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                let name = e
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("an env entry has no name"))?;
                let source = if let Some(v) = e.get("value").and_then(Value::as_str) {
                    EnvSource::Value(v.to_string())
                } else if let Some(p) = e
                    .get("valueFrom")
                    .and_then(|f| f.get("fieldRef"))
                    .and_then(|f| f.get("fieldPath"))
                    .and_then(Value::as_str)
                {
                    EnvSource::Field(p.to_string())
                } else {
                    return Err(bad(format!("env {name}: neither a value nor a fieldRef")));
                };
                env.push((name.to_string(), source));
            }
            return Ok(PodTemplate {
                agent_args: rest[..at].to_vec(),
                program: rest[at].clone(),
                program_args: rest[at + 1..].to_vec(),
                env,
            });
        }
        Err(bad("no Job in the manifest"))
    }

    /// The workspace's manifest.
    pub fn load() -> Result<PodTemplate, ClusterError> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = std::fs::read_to_string(root.join(TRAIN_MANIFEST))
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        PodTemplate::parse(&text, "rekindle")
    }

    /// The pod's environment as Kubernetes would set it: fieldRefs from `facts`, then
    /// `$(VAR)` references to earlier variables expanded.
    pub fn environment(&self, facts: &PodFacts) -> Result<Vec<(String, String)>, ClusterError> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (name, source) in &self.env {
            let value = match source {
                EnvSource::Value(v) => expand(v, &out),
                EnvSource::Field(p) if p == "status.podIP" => facts.pod_ip.clone(),
                EnvSource::Field(p)
                    if p == "metadata.labels['batch.kubernetes.io/controller-uid']" =>
                {
                    facts.job_uid.clone()
                }
                EnvSource::Field(p) => return Err(bad(format!("env {name}: no value for {p}"))),
            };
            let value = if name == "REKINDLE_SECRET_FILE" {
                facts.secret_file.display().to_string()
            } else {
                value
            };
            out.push((name.clone(), value));
        }
        Ok(out)
    }

    /// The `rekindle run` flags of one pod: `$(VAR)` expanded from its environment, and the
    /// cluster's own names mapped to this machine (see the module docs).
    pub fn agent_argv(&self, facts: &PodFacts) -> Result<Vec<String>, ClusterError> {
        let env = self.environment(facts)?;
        let mut out = vec!["run".to_string()];
        for a in &self.agent_args {
            let a = expand(a, &env);
            let a = match a.split_once('=') {
                Some(("--rdzv-endpoint", _)) => format!("--rdzv-endpoint={}", facts.etcd_endpoint),
                Some(("--log-dir", _)) => format!("--log-dir={}", facts.log_dir.display()),
                _ => a,
            };
            out.push(a);
        }
        Ok(out)
    }

    /// The training program as a workload: `program` (the workspace binary the image holds
    /// under the manifest's name) with the manifest's arguments, the step count and the
    /// checkpoint path given to the harness, and the two observation flags added.
    pub fn workload(&self, program: PathBuf) -> Workload {
        let mut args: Vec<String> = self
            .program_args
            .iter()
            .map(|a| match a.split_once('=') {
                Some(("--steps", _)) => "--steps={steps}".to_string(),
                Some(("--checkpoint-dir", _)) => "--checkpoint-dir={checkpoint_dir}".to_string(),
                _ => a.clone(),
            })
            .collect();
        args.extend([
            "--log-every=1".to_string(),
            "--loss-csv={loss_csv}".to_string(),
        ]);
        let mut w = Workload::custom(program, args);
        w.name = "k8s".into();
        w
    }
}

/// Expands Kubernetes' `$(VAR)` references from `env` (`$$` is a literal `$`; an unknown
/// name is left as written, as Kubernetes does).
pub fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(body) = tail.strip_prefix("$(") {
            match body.find(')') {
                Some(end) => {
                    let name = &body[..end];
                    match env.iter().rev().find(|(k, _)| k == name) {
                        Some((_, v)) => out.push_str(v),
                        None => out.push_str(&tail[..end + 3]),
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    out.push_str(tail);
                    rest = "";
                }
            }
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_expand_like_kubernetes() {
        let env = vec![("A".to_string(), "1".to_string()), ("B".into(), "x".into())];
        assert_eq!(expand("--id=$(A)-$(B)", &env), "--id=1-x");
        assert_eq!(expand("$$(A) $(C) $", &env), "$(A) $(C) $");
        assert_eq!(expand("$(A", &env), "$(A");
    }

    #[test]
    fn the_bundled_manifest_reads_and_renders() {
        let t = PodTemplate::load().unwrap();
        assert_eq!(t.program, "ddp");
        assert!(t.agent_args.iter().any(|a| a.starts_with("--nnodes=")));
        let facts = PodFacts {
            pod_ip: "10.1.2.3".into(),
            job_uid: "uid-7".into(),
            etcd_endpoint: "10.0.0.1:2379".into(),
            log_dir: "/tmp/logs".into(),
            secret_file: "/tmp/secret".into(),
        };
        let argv = t.agent_argv(&facts).unwrap();
        assert_eq!(argv[0], "run");
        for want in [
            "--rdzv-id=uid-7",
            "--local-addr=10.1.2.3",
            "--rdzv-endpoint=10.0.0.1:2379",
            "--log-dir=/tmp/logs",
        ] {
            assert!(argv.iter().any(|a| a == want), "{want} in {argv:?}");
        }
        assert!(!argv.iter().any(|a| a.contains("$(")), "{argv:?}");
        let env = t.environment(&facts).unwrap();
        assert!(env.contains(&("REKINDLE_SECRET_FILE".into(), "/tmp/secret".into())));
        let w = t.workload("/bin/ddp".into());
        assert!(w.uses("{steps}") && w.uses("{checkpoint_dir}"));
    }

    #[test]
    fn bad_manifests_are_errors() {
        assert!(PodTemplate::parse("kind: Service\n", "rekindle").is_err());
        let no_run = "kind: Job\nspec:\n  template:\n    spec:\n      containers:\n        - name: rekindle\n          args: [train]\n";
        assert!(PodTemplate::parse(no_run, "rekindle").is_err());
    }
}
