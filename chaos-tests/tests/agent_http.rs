//! The agent's HTTP endpoint (`rekindle run --health-port 0`) scraped over real HTTP/1.1
//! during real runs of the `ddp` example: readiness, the JSON status, and the Prometheus
//! metrics, before and after a worker is SIGKILLed.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use rekindle_chaos_tests::rank_pid;
use rekindle_elastic::testing::EtcdServer;
use rekindle_elastic::testing::{kill, workspace_bin, Proc};

const T: Duration = Duration::from_secs(120);

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn ddp_args(steps: u64, ckpt: &Path) -> Vec<String> {
    let mut a = vec![workspace_bin("ddp").unwrap().display().to_string()];
    a.extend(strings(&[
        "--steps",
        &steps.to_string(),
        "--layers",
        "64-128-10",
        "--batch",
        "64",
        "--dataset",
        "4096",
        "--seed",
        "3",
        "--log-every",
        "50",
        "--threads",
        "1",
        "--checkpoint-every",
        "100",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]));
    a
}

/// A parsed HTTP response.
struct Response {
    code: u16,
    content_type: String,
    body: String,
}

/// `GET path` over a fresh connection, as any HTTP/1.1 client sends it.
fn get(addr: SocketAddr, path: &str) -> Response {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: rekindle-test\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap();
    assert!(status.starts_with("HTTP/1.1 "), "{status}");
    let code = status[9..12].parse().unwrap();
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string()))
        .collect();
    let len: usize = headers["content-length"].parse().unwrap();
    assert_eq!(len, body.len(), "Content-Length matches the body");
    Response {
        code,
        content_type: headers["content-type"].clone(),
        body: body.to_string(),
    }
}

/// `rekindle` with `args`, its output captured.
fn spawn(args: &[String]) -> Proc {
    let mut cmd = std::process::Command::new(workspace_bin("rekindle").unwrap());
    cmd.args(args);
    Proc::spawn(cmd).unwrap()
}

/// The address of the `rekindle: health endpoint on http://ADDR/` line.
fn endpoint(job: &mut Proc) -> SocketAddr {
    let line = job
        .wait_line(T, |l| l.contains("health endpoint on http://"))
        .unwrap_or_else(|_| panic!("no endpoint line:\n{}", job.output()));
    let rest = line.split("http://").nth(1).unwrap();
    rest.split('/').next().unwrap().parse().unwrap()
}

fn status(addr: SocketAddr) -> serde_json::Value {
    let r = get(addr, "/status");
    assert_eq!((r.code, r.content_type.as_str()), (200, "application/json"));
    serde_json::from_str(&r.body).unwrap()
}

/// Parses the exposition: every sample's value by `name{labels}`, after checking that each
/// sample's family has HELP and TYPE lines and a conventional name.
fn metrics(addr: SocketAddr) -> BTreeMap<String, f64> {
    let r = get(addr, "/metrics");
    assert_eq!(r.code, 200);
    assert!(r.content_type.starts_with("text/plain; version=0.0.4"));
    let mut types = BTreeMap::new();
    let mut helps = 0;
    let mut samples = BTreeMap::new();
    for line in r.body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "summary"].contains(&kind), "{line}");
            types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with("# HELP ") {
            helps += 1;
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("name value");
        let name = series.split('{').next().unwrap();
        let family = ["_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| types.get(*f).is_some_and(|k| k == "summary"))
            .unwrap_or(name);
        let kind = types
            .get(family)
            .unwrap_or_else(|| panic!("no TYPE before {line}"));
        assert!(name.starts_with("rekindle_"), "{line}");
        if kind == "counter" {
            assert!(name.ends_with("_total"), "a counter ends in _total: {line}");
        }
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        assert!(v.is_finite() && v >= 0.0, "{line}");
        samples.insert(series.to_string(), v);
    }
    assert_eq!(helps, types.len(), "one HELP per family");
    samples
}

/// Scrapes until `pred` holds (the workers' figures arrive a fraction of a second late).
fn metrics_until(
    job: &Proc,
    addr: SocketAddr,
    what: &str,
    pred: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> BTreeMap<String, f64> {
    let deadline = Instant::now() + T;
    loop {
        let m = metrics(addr);
        if pred(&m) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {m:#?}\n{}",
            job.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn step_line(at_least: u64) -> impl Fn(&str) -> bool {
    move |l: &str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix("step="))
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= at_least)
    }
}

#[test]
fn the_endpoint_reports_a_standalone_run_and_counts_a_killed_worker_once() {
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let mut args = strings(&[
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--health-port",
        "0",
        "--log-dir",
        logs.path().to_str().unwrap(),
    ]);
    args.extend(ddp_args(200_000, ck.path()));
    let mut job = spawn(&args);
    let addr = endpoint(&mut job);
    assert!(
        addr.ip().is_loopback(),
        "a one-host run listens on loopback"
    );
    assert_eq!(get(addr, "/healthz").code, 200);
    assert_eq!(get(addr, "/nowhere").code, 404);

    job.wait_line(T, step_line(300))
        .unwrap_or_else(|_| panic!("no progress:\n{}", job.output()));
    assert_eq!(get(addr, "/readyz").code, 200);
    // The workers rewrite their figures at most every 200 ms.
    let deadline = Instant::now() + T;
    let s = loop {
        let s = status(addr);
        if s["last_step"].as_u64().is_some_and(|v| v >= 300) {
            break s;
        }
        assert!(Instant::now() < deadline, "{s}\n{}", job.output());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(s["job"].as_str().unwrap().starts_with("standalone-"), "{s}");
    assert_eq!(s["phase"], "running", "{s}");
    assert_eq!(s["ready"], true);
    assert_eq!(
        (s["round"].as_u64(), s["world_size"].as_u64()),
        (Some(0), Some(2))
    );
    assert_eq!(s["node_rank"], 0);
    assert_eq!(
        (s["restarts"].as_u64(), s["workers_running"].as_u64()),
        (Some(0), Some(2))
    );

    // Rank 0 checkpoints every 100 steps in the background.
    let m = metrics_until(&job, addr, "a committed checkpoint", |m| {
        m["rekindle_checkpoint_duration_seconds_count"] >= 1.0
    });
    assert_eq!(m["rekindle_rounds_total"], 1.0);
    assert_eq!(m["rekindle_round"], 0.0);
    assert_eq!(m["rekindle_world_size"], 2.0);
    assert_eq!(m["rekindle_workers_running"], 2.0);
    assert_eq!(m["rekindle_agent_ready"], 1.0);
    assert_eq!(m["rekindle_restarts_total"], 0.0);
    assert_eq!(m["rekindle_worker_failures_total{kind=\"signal\"}"], 0.0);
    assert_eq!(m["rekindle_worker_failures_total{kind=\"exit_code\"}"], 0.0);
    let step = m["rekindle_step"];
    assert!(step >= 300.0, "{m:#?}");
    // Two workers, each counting its own steps from 0 (a fresh run): the one furthest ahead
    // alone has `step` steps, and neither is past it.
    let steps = m["rekindle_steps_total"];
    assert_eq!(steps, m["rekindle_step_duration_seconds_count"]);
    assert!(steps >= step && steps <= 2.0 * step, "{m:#?}");
    assert!(m["rekindle_step_duration_seconds_sum"] > 0.0);
    assert!(m["rekindle_last_step_duration_seconds"] > 0.0);
    assert!(m["rekindle_checkpoint_size_bytes"] > 0.0);
    assert!(m["rekindle_checkpoint_written_bytes_total"] >= m["rekindle_checkpoint_size_bytes"]);
    // Every step all-reduces the gradients of a 64-128-10 MLP (9610 f32s) at least.
    assert!(
        m["rekindle_collective_sent_bytes_total"] >= 300.0 * 9610.0 * 4.0,
        "{m:#?}"
    );

    let victim = rank_pid(&job, 1).expect("rank 1's pid");
    kill(victim, libc::SIGKILL);
    job.wait_line(T, |l| l.contains("restarting rank 1 alone"))
        .unwrap_or_else(|_| panic!("no restart:\n{}", job.output()));
    let after = metrics_until(&job, addr, "the restart counted", |m| {
        m["rekindle_restarts_total"] >= 1.0 && m["rekindle_workers_running"] == 2.0
    });
    assert_eq!(after["rekindle_restarts_total"], 1.0);
    assert_eq!(
        after["rekindle_worker_failures_total{kind=\"signal\"}"],
        1.0
    );
    assert_eq!(
        after["rekindle_worker_failures_total{kind=\"exit_code\"}"],
        0.0
    );
    assert_eq!(
        after["rekindle_rounds_total"], 1.0,
        "restarted in place: same round"
    );
    // Counters never go down: the killed worker's file still counts.
    assert!(after["rekindle_steps_total"] >= steps);
    assert!(
        after["rekindle_collective_sent_bytes_total"] >= m["rekindle_collective_sent_bytes_total"]
    );
    let s = status(addr);
    assert_eq!(
        (s["restarts"].as_u64(), s["round"].as_u64()),
        (Some(1), Some(0)),
        "{s}"
    );

    job.signal(libc::SIGTERM);
    assert_eq!(job.wait_exit(T).ok(), Some(143), "{}", job.output());
}

#[test]
fn readiness_waits_for_the_round() {
    let etcd = EtcdServer::start().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let node = || {
        let mut args = strings(&[
            "run",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            "http-ready",
            "--nnodes",
            "2:2",
            "--rdzv-conf",
            "last_call_timeout=0.2,lease_ttl=2",
            "--local-addr",
            "127.0.0.1",
            "--nproc-per-node",
            "1",
            "--health-port",
            "0",
            "--log-dir",
            logs.path().to_str().unwrap(),
        ]);
        args.extend(ddp_args(5000, ck.path()));
        spawn(&args)
    };
    let mut a = node();
    let addr = endpoint(&mut a);
    // Alone, the node cannot form a round of two: alive, not ready.
    assert_eq!(get(addr, "/healthz").code, 200);
    let r = get(addr, "/readyz");
    assert_eq!(r.code, 503, "{}", r.body);
    let s = status(addr);
    assert_eq!(s["ready"], false, "{s}");
    assert!(s["round"].is_null(), "{s}");
    assert_eq!(s["job"], "http-ready");

    let mut b = node();
    let b_addr = endpoint(&mut b);
    let deadline = Instant::now() + T;
    while get(addr, "/readyz").code != 200 || get(b_addr, "/readyz").code != 200 {
        assert!(Instant::now() < deadline, "never ready:\n{}", a.output());
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = status(addr);
    assert_eq!(s["world_size"], 2, "{s}");
    let ranks: Vec<u64> = [addr, b_addr]
        .iter()
        .map(|x| status(*x)["node_rank"].as_u64().unwrap())
        .collect();
    assert!(ranks == [0, 1] || ranks == [1, 0], "{ranks:?}");
    assert_eq!(a.wait_exit(T).ok(), Some(0), "{}", a.output());
    assert_eq!(b.wait_exit(T).ok(), Some(0), "{}", b.output());
}
