//! The Kubernetes manifests' training workload run as pods: each pod's own `rekindle run`
//! command line and environment from `examples/k8s/train.yaml` (the Downward API values and
//! the mounted secret filled in), every pod in its own network and mount namespace, against a
//! real etcd on a host of its own. Needs root (namespaces); says so and passes otherwise.

use rekindle_chaos_tests::cluster::NetMode;
use rekindle_chaos_tests::report::Report;
use rekindle_chaos_tests::runner::Options;
use rekindle_chaos_tests::{scenario, workload};

fn run(name: &str) -> Option<Report> {
    let opts = Options::new(1);
    if opts.mode == NetMode::Loopback {
        eprintln!("skipped {name}: the pods need network namespaces (root)");
        return None;
    }
    let pods = workload::k8s().expect("the manifest and the ddp binary");
    let report = scenario::run(name, &pods, &opts).expect("the scenario runs");
    eprintln!("{}", report.table());
    assert!(report.passed, "{}", report.table());
    Some(report)
}

#[test]
fn two_pods_train_like_the_same_ranks_on_one_host() {
    run("k8s-pods-fixed");
}

#[test]
fn a_pod_deleted_and_a_pod_added_mid_run() {
    if let Some(r) = run("k8s-pods") {
        assert_eq!((r.totals.faults, r.totals.recovered), (2, 2));
    }
}
