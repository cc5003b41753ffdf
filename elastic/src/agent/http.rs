//! The agent's HTTP endpoint (`rekindle run --health-port PORT`): liveness, readiness, a JSON
//! status and Prometheus metrics, read-only and without authentication (it shows no secret).
//!
//! | path | answer |
//! |---|---|
//! | `/healthz` | 200 while the monitor loop turns (it does at least every monitor interval), 503 once it has been stuck for the grace period plus [`STUCK_MARGIN`] |
//! | `/readyz` | 200 while this node's workers are in a round, else 503 |
//! | `/status` | JSON: job, node, phase, attempt, round, world size, node rank, restarts, running workers, last step |
//! | `/metrics` | the Prometheus text format (version 0.0.4) |
//!
//! A small HTTP/1.1 server on std sockets: one thread accepts, each connection gets a thread of
//! its own, at most [`MAX_CONNECTIONS`] at once (more are closed at once), a request head of at
//! most [`MAX_REQUEST`] bytes, [`IO_TIMEOUT`] for reading and for writing, one request per
//! connection. The monitor only swaps the [`Snapshot`] under a mutex that no socket operation
//! holds, so a slow or hostile client never slows the agent.
//!
//! The workers' own figures (the step reached, step and checkpoint times, checkpoint sizes,
//! bytes sent by collectives) come from the file each worker's training loop rewrites in its
//! log dir (see [`crate::train::metrics`]); they are read when the endpoint is scraped.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::machine::Status;
use crate::train::metrics::{read_figures, WorkerFigures};

/// Connections served at once; more are closed without an answer.
pub(crate) const MAX_CONNECTIONS: usize = 16;
/// The largest request head read.
pub(crate) const MAX_REQUEST: usize = 8 * 1024;
/// Per read and per write.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How much longer than the grace period the monitor loop may be busy before it counts as
/// stuck (its longest wait, for the other nodes at the end of a run, is the grace period).
pub(crate) const STUCK_MARGIN: Duration = Duration::from_secs(30);

/// Why a failed worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// It exited with a non-zero code.
    ExitCode,
    /// A signal ended it.
    Signal,
}

/// What the monitor tells the endpoint.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub job: String,
    pub node_id: String,
    /// When the monitor loop last turned.
    pub heartbeat: Instant,
    /// How long it may go without turning.
    pub stuck_after: Duration,
    pub status: Option<Status>,
    pub node_rank: Option<usize>,
    /// Rounds this node's workers started in.
    pub rounds: u64,
    /// Worker failures seen while the workers ran, by kind.
    pub exit_code_failures: u64,
    pub signal_failures: u64,
    /// The metrics files of the workers running now.
    pub live_files: Vec<PathBuf>,
    /// The metrics files of every worker this agent started.
    pub all_files: Vec<PathBuf>,
}

impl Snapshot {
    fn ready(&self) -> bool {
        self.status
            .as_ref()
            .is_some_and(|s| matches!(s.phase, "running" | "reforming") && s.running > 0)
    }

    fn alive(&self) -> bool {
        self.heartbeat.elapsed() <= self.stuck_after
    }
}

/// The running endpoint; stops when dropped.
pub(crate) struct HealthServer {
    addr: SocketAddr,
    shared: Arc<Mutex<Snapshot>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HealthServer {
    /// Listens on `bind` and serves `initial` until [`HealthServer::update`] changes it.
    pub(crate) fn start(bind: SocketAddr, initial: Snapshot) -> std::io::Result<HealthServer> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Mutex::new(initial));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("rekindle-http".into())
            .spawn(move || accept_loop(listener, s, st))?;
        Ok(HealthServer {
            addr,
            shared,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Changes what is served.
    pub(crate) fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        if let Ok(mut s) = self.shared.lock() {
            f(&mut s);
        }
    }
}

impl Drop for HealthServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop; it sees the flag and ends.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip([127, 0, 0, 1].into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Mutex<Snapshot>>, stop: Arc<AtomicBool>) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else {
            // Out of descriptors and the like: do not spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let (shared, active2) = (shared.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("rekindle-http-conn".into())
            .spawn(move || {
                serve(stream, &shared);
                active2.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// One request, one answer.
fn serve(mut stream: TcpStream, shared: &Mutex<Snapshot>) {
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let deadline = Instant::now() + 2 * IO_TIMEOUT;
    let Some(head) = read_head(&mut stream, deadline) else {
        return;
    };
    let (status, ctype, body, head_only) = match parse_request_line(&head) {
        Err(code) => (
            code,
            "text/plain; charset=utf-8",
            reason(code).to_string(),
            false,
        ),
        Ok((method, path)) => {
            let snap = match shared.lock() {
                Ok(s) => s.clone(),
                Err(_) => return,
            };
            let (code, ctype, body) = route(path, &snap);
            (code, ctype, body, method == "HEAD")
        }
    };
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        reason(status),
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    let _ = stream.write_all(&out);
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads up to the blank line that ends the head; `None` on a timeout, a closed connection or
/// a head over [`MAX_REQUEST`] bytes.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> Option<String> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while Instant::now() < deadline {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(end);
            return String::from_utf8(buf).ok();
        }
        if buf.len() > MAX_REQUEST {
            return None;
        }
    }
    None
}

/// The method and the path (without a query) of a GET or HEAD request; else the status code.
fn parse_request_line(head: &str) -> Result<(&str, &str), u16> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(400);
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(400);
    }
    if method != "GET" && method != "HEAD" {
        return Err(405);
    }
    Ok((method, target.split('?').next().unwrap_or(target)))
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

const TEXT: &str = "text/plain; charset=utf-8";

fn route(path: &str, snap: &Snapshot) -> (u16, &'static str, String) {
    match path {
        "/healthz" => match snap.alive() {
            true => (200, TEXT, "ok\n".into()),
            false => (503, TEXT, "the agent's monitor loop is stuck\n".into()),
        },
        "/readyz" => match snap.ready() {
            true => (200, TEXT, "ready\n".into()),
            false => (503, TEXT, "the workers are not in a round\n".into()),
        },
        "/status" => (200, "application/json", status_json(snap)),
        "/metrics" => (
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics(snap),
        ),
        _ => (404, TEXT, "not found\n".into()),
    }
}

/// The figures of every file in `files` that can be read.
fn figures(files: &[PathBuf]) -> Vec<WorkerFigures> {
    files.iter().filter_map(|f| read_figures(f)).collect()
}

fn last_step(snap: &Snapshot) -> Option<u64> {
    figures(&snap.live_files).iter().map(|f| f.step).max()
}

fn status_json(snap: &Snapshot) -> String {
    let s = snap.status.as_ref();
    let v = serde_json::json!({
        "job": snap.job,
        "node_id": snap.node_id,
        "phase": s.map_or("starting", |s| s.phase),
        "ready": snap.ready(),
        "attempt": s.map(|s| s.attempt),
        "round": s.and_then(|s| s.round),
        "world_size": s.and_then(|s| s.world_size),
        "node_rank": snap.node_rank,
        "restarts": s.map_or(0, |s| s.restarts),
        "workers_running": s.map_or(0, |s| s.running),
        "last_step": last_step(snap),
    });
    let mut out = v.to_string();
    out.push('\n');
    out
}

/// The Prometheus text exposition of `snap`.
fn metrics(snap: &Snapshot) -> String {
    use std::fmt::Write as _;
    let s = snap.status.as_ref();
    let all = figures(&snap.all_files);
    let live = figures(&snap.live_files);
    let sum_u = |f: fn(&WorkerFigures) -> u64| all.iter().map(f).sum::<u64>();
    let sum_f = |f: fn(&WorkerFigures) -> f64| all.iter().map(f).sum::<f64>();
    let mut o = String::new();
    let mut one = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for (suffix, value) in samples {
            let _ = writeln!(o, "{name}{suffix} {value}");
        }
    };
    let n = |v: u64| v.to_string();
    let x = |v: f64| format!("{v}");
    one(
        "rekindle_agent_ready",
        "gauge",
        "1 while this node's workers are in a round.",
        &[("", n(u64::from(snap.ready())))],
    );
    one(
        "rekindle_rounds_total",
        "counter",
        "Rounds this node's workers started in.",
        &[("", n(snap.rounds))],
    );
    one(
        "rekindle_round",
        "gauge",
        "The round this node's workers are in.",
        &[("", n(s.and_then(|s| s.round).unwrap_or(0)))],
    );
    one(
        "rekindle_world_size",
        "gauge",
        "Workers in the current round, every node together.",
        &[("", n(s.and_then(|s| s.world_size).unwrap_or(0) as u64))],
    );
    one(
        "rekindle_workers_running",
        "gauge",
        "Workers of this node running now.",
        &[("", n(s.map_or(0, |s| s.running) as u64))],
    );
    one(
        "rekindle_restarts_total",
        "counter",
        "Worker restarts after failures (membership changes do not count).",
        &[("", n(u64::from(s.map_or(0, |s| s.restarts))))],
    );
    one(
        "rekindle_worker_failures_total",
        "counter",
        "Workers that failed while running, by kind: exit_code (a non-zero exit) or signal.",
        &[
            ("{kind=\"exit_code\"}", n(snap.exit_code_failures)),
            ("{kind=\"signal\"}", n(snap.signal_failures)),
        ],
    );
    one(
        "rekindle_step",
        "gauge",
        "The step this node's running workers reached.",
        &[("", n(live.iter().map(|f| f.step).max().unwrap_or(0)))],
    );
    one(
        "rekindle_steps_total",
        "counter",
        "Steps completed by this node's workers, each worker counted.",
        &[("", n(sum_u(|f| f.steps)))],
    );
    one(
        "rekindle_step_duration_seconds",
        "summary",
        "Wall time of the steps of this node's workers.",
        &[
            ("_sum", x(sum_f(|f| f.step_seconds_sum))),
            ("_count", n(sum_u(|f| f.steps))),
        ],
    );
    one(
        "rekindle_last_step_duration_seconds",
        "gauge",
        "The last step's wall time, slowest running worker of this node.",
        &[(
            "",
            x(live.iter().map(|f| f.last_step_seconds).fold(0.0, f64::max)),
        )],
    );
    one(
        "rekindle_checkpoint_duration_seconds",
        "summary",
        "Background checkpoints of this node's workers, from the start of the save to its commit.",
        &[
            ("_sum", x(sum_f(|f| f.checkpoint_seconds_sum))),
            ("_count", n(sum_u(|f| f.checkpoints))),
        ],
    );
    one(
        "rekindle_checkpoint_size_bytes",
        "gauge",
        "Bytes this node's running workers wrote for their last checkpoint.",
        &[("", n(live.iter().map(|f| f.last_checkpoint_bytes).sum()))],
    );
    one(
        "rekindle_checkpoint_written_bytes_total",
        "counter",
        "Bytes this node's workers wrote for checkpoints.",
        &[("", n(sum_u(|f| f.checkpoint_bytes_sum)))],
    );
    one(
        "rekindle_collective_sent_bytes_total",
        "counter",
        "Bytes the collectives of this node's workers sent to peers.",
        &[("", n(sum_u(|f| f.collective_bytes)))],
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(status: Option<Status>) -> Snapshot {
        Snapshot {
            job: "j".into(),
            node_id: "n".into(),
            heartbeat: Instant::now(),
            stuck_after: Duration::from_secs(60),
            status,
            node_rank: Some(0),
            rounds: 1,
            exit_code_failures: 2,
            signal_failures: 1,
            live_files: vec![],
            all_files: vec![],
        }
    }

    fn running(phase: &'static str, running: usize) -> Status {
        Status {
            phase,
            attempt: 0,
            restarts: 3,
            round: Some(4),
            world_size: Some(2),
            running,
        }
    }

    #[test]
    fn request_lines() {
        assert_eq!(
            parse_request_line("GET /metrics?x=1 HTTP/1.1\r\nHost: a"),
            Ok(("GET", "/metrics"))
        );
        assert_eq!(
            parse_request_line("HEAD /readyz HTTP/1.0"),
            Ok(("HEAD", "/readyz"))
        );
        assert_eq!(parse_request_line("POST /x HTTP/1.1"), Err(405));
        assert_eq!(parse_request_line("GET /x"), Err(400));
        assert_eq!(parse_request_line("GET x HTTP/1.1"), Err(400));
        assert_eq!(parse_request_line("GET /x SMTP"), Err(400));
    }

    #[test]
    fn ready_only_in_a_round_with_workers() {
        assert!(!snapshot(None).ready());
        assert!(!snapshot(Some(running("joining", 0))).ready());
        assert!(!snapshot(Some(running("stopping", 2))).ready());
        assert!(!snapshot(Some(running("running", 0))).ready());
        assert!(snapshot(Some(running("running", 2))).ready());
        assert!(snapshot(Some(running("reforming", 1))).ready());
        let mut stuck = snapshot(None);
        stuck.stuck_after = Duration::ZERO;
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(route("/healthz", &stuck).0, 503);
        assert_eq!(route("/healthz", &snapshot(None)).0, 200);
        assert_eq!(route("/nope", &snapshot(None)).0, 404);
    }

    #[test]
    fn metrics_have_help_type_and_sums_of_the_worker_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
        let fig = |step, steps, bytes| WorkerFigures {
            step,
            steps,
            step_seconds_sum: steps as f64 * 0.5,
            collective_bytes: bytes,
            ..WorkerFigures::default()
        };
        crate::train::metrics::write_atomic(&a, &fig(10, 10, 100)).unwrap();
        crate::train::metrics::write_atomic(&b, &fig(12, 4, 7)).unwrap();
        let mut snap = snapshot(Some(running("running", 2)));
        snap.all_files = vec![a.clone(), b.clone(), dir.path().join("missing.json")];
        snap.live_files = vec![b];
        let text = metrics(&snap);
        let value = |line: &str| {
            text.lines()
                .find(|l| l.starts_with(line) && l[line.len()..].starts_with(' '))
                .unwrap_or_else(|| panic!("{line} missing in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(value("rekindle_steps_total"), "14");
        assert_eq!(value("rekindle_step_duration_seconds_sum"), "7");
        assert_eq!(value("rekindle_step"), "12");
        assert_eq!(value("rekindle_collective_sent_bytes_total"), "107");
        assert_eq!(value("rekindle_restarts_total"), "3");
        assert_eq!(
            value("rekindle_worker_failures_total{kind=\"signal\"}"),
            "1"
        );
        assert_eq!(value("rekindle_agent_ready"), "1");
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(name.starts_with("rekindle_"), "{l}");
            let base = ["_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| text.contains(&format!("# TYPE {b} summary")))
                .unwrap_or(name);
            assert!(text.contains(&format!("# TYPE {base} ")), "{l}");
            assert!(text.contains(&format!("# HELP {base} ")), "{l}");
        }
        let json: serde_json::Value = serde_json::from_str(&status_json(&snap)).unwrap();
        assert_eq!(json["last_step"], 12);
        assert_eq!(json["round"], 4);
        assert_eq!(json["ready"], true);
    }
}
