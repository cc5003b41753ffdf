//! Worker processes: spawn in their own process group, forward their output with a
//! `[rank N]` prefix into per-attempt log files, stop them with SIGTERM, a grace period,
//! SIGKILL, and reap them.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant, SystemTime};

/// What the agent's monitor loop hears about.
#[derive(Debug)]
pub(crate) enum Event {
    /// A worker exited (and was reaped).
    Exited {
        local_rank: usize,
        status: ExitStatus,
        at: SystemTime,
    },
    /// The agent received this signal.
    Signal(i32),
    /// A rendezvous running on a helper thread finished.
    Rendezvous(Box<Result<crate::rendezvous::RendezvousInfo, crate::rendezvous::RendezvousError>>),
}

/// How to start one worker.
#[derive(Debug, Clone)]
pub(crate) struct WorkerSpec {
    pub local_rank: usize,
    pub global_rank: usize,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub dir: PathBuf,
    pub error_file: PathBuf,
}

/// A started worker.
#[derive(Debug)]
pub(crate) struct Worker {
    pub local_rank: usize,
    pub global_rank: usize,
    pub pid: i32,
    pub error_file: PathBuf,
    pub exit: Option<(ExitStatus, SystemTime)>,
    /// The worker exited after the agent began stopping it.
    pub stopped: bool,
}

/// Copies `from` line by line to the log file and to the agent's stream with a prefix;
/// sends on `done` at end of stream.
fn forward<R: Read + Send + 'static>(
    from: R,
    mut file: File,
    prefix: String,
    to_stderr: bool,
    done: Sender<()>,
) {
    std::thread::spawn(move || {
        let mut rd = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match rd.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let _ = file.write_all(&line);
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let mut out = Vec::with_capacity(prefix.len() + line.len());
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            // One write per line keeps lines of different ranks from interleaving.
            if to_stderr {
                let _ = std::io::stderr().lock().write_all(&out);
            } else {
                let _ = std::io::stdout().lock().write_all(&out);
            }
        }
        let _ = file.flush();
        let _ = done.send(());
    });
}

/// Starts a worker in a new process group; its exit is sent on `events`.
pub(crate) fn spawn(spec: &WorkerSpec, events: Sender<Event>) -> std::io::Result<Worker> {
    std::fs::create_dir_all(&spec.dir)?;
    let stdout_log = File::create(spec.dir.join("stdout.log"))?;
    let stderr_log = File::create(spec.dir.join("stderr.log"))?;
    let _ = std::fs::remove_file(&spec.error_file);
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "no program to run",
        ));
    };
    let mut cmd = Command::new(program);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
    // is async-signal-safe. It asks the kernel to SIGKILL the worker if the agent dies, so a
    // SIGKILLed agent leaves no orphan workers behind.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .args(args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()?;
    let pid = child.id() as i32;
    let prefix = format!("[rank {}] ", spec.global_rank);
    let (done_tx, done) = std::sync::mpsc::channel();
    let mut streams = 0;
    if let Some(out) = child.stdout.take() {
        forward(out, stdout_log, prefix.clone(), false, done_tx.clone());
        streams += 1;
    }
    if let Some(err) = child.stderr.take() {
        forward(err, stderr_log, prefix, true, done_tx);
        streams += 1;
    }
    let local_rank = spec.local_rank;
    std::thread::spawn(move || {
        // This thread owns the child: waiting here reaps it.
        let status = match child.wait() {
            Ok(s) => s,
            Err(_) => ExitStatus::from_raw(255 << 8),
        };
        // Report the exit only after the worker's last lines are out, so nothing is lost when
        // the agent exits right after. A grandchild holding the pipes open must not stall
        // the agent: wait at most 2 s for the streams to end.
        let until = Instant::now() + Duration::from_secs(2);
        for _ in 0..streams {
            if done
                .recv_timeout(until.saturating_duration_since(Instant::now()))
                .is_err()
            {
                break;
            }
        }
        let _ = events.send(Event::Exited {
            local_rank,
            status,
            at: SystemTime::now(),
        });
    });
    Ok(Worker {
        local_rank: spec.local_rank,
        global_rank: spec.global_rank,
        pid,
        error_file: spec.error_file.clone(),
        exit: None,
        stopped: false,
    })
}

/// Sends `sig` to the process group of every worker still running.
pub(crate) fn signal_all(workers: &[Worker], sig: i32) {
    for w in workers.iter().filter(|w| w.exit.is_none()) {
        // SAFETY: kill(2) with a negative pid signals the worker's process group; it has no
        // memory-safety preconditions. The group exists while its leader is unreaped, and
        // the leader is reaped only by its waiter thread, which reports it before we get here
        // again.
        unsafe {
            libc::kill(-w.pid, sig);
        }
    }
}

/// Stops every running worker: SIGTERM to each process group, up to `grace` for them to
/// exit, then SIGKILL, then waits (bounded) until all are reaped. Signals received meanwhile
/// are returned; a SIGINT cuts the grace period short.
pub(crate) fn stop_all(
    workers: &mut [Worker],
    events: &Receiver<Event>,
    grace: Duration,
    mut on_exit: impl FnMut(&Worker),
) -> Vec<i32> {
    let mut signals = Vec::new();
    signal_all(workers, libc::SIGTERM);
    let mut killed = false;
    let mut deadline = Instant::now() + grace;
    while workers.iter().any(|w| w.exit.is_none()) {
        let now = Instant::now();
        if now >= deadline {
            if killed {
                tracing::error!("workers did not exit 10 s after SIGKILL; giving up on them");
                break;
            }
            signal_all(workers, libc::SIGKILL);
            killed = true;
            deadline = now + Duration::from_secs(10);
            continue;
        }
        match events.recv_timeout(deadline - now) {
            Ok(Event::Exited {
                local_rank,
                status,
                at,
            }) => {
                if let Some(w) = workers.iter_mut().find(|w| w.local_rank == local_rank) {
                    w.exit = Some((status, at));
                    w.stopped = true;
                    on_exit(w);
                }
            }
            Ok(Event::Signal(s)) => {
                signals.push(s);
                // Ctrl-C during the grace period: the user does not want to wait.
                if !killed && s == libc::SIGINT {
                    deadline = Instant::now();
                }
            }
            Ok(Event::Rendezvous(_)) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    signals
}

/// `exit code N` or `signal N (NAME)`.
pub(crate) fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s} ({})", signal_name(s)),
        _ => "an unknown status".into(),
    }
}

pub(crate) fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "?",
    }
}
