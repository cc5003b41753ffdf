//! Worker processes: spawn one in its own process group, forward its output with a `[rank N]`
//! prefix into per-attempt log files, see it exit, signal it, reap it.
//!
//! No signal can reach a recycled pid. A worker's exit is observed without reaping it
//! (`waitid(WNOWAIT)` on a thread of its own), so its pid, which is also its process group's
//! id, stays reserved by the kernel until the agent's monitor reaps it. The monitor is the
//! only thread that signals workers and the only one that reaps them, and a [`Child`] that
//! has been reaped refuses to send anything. So every `kill(-pid)` happens strictly before
//! the reap of that pid.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant, SystemTime};

use super::events::Event;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
}

impl Exit {
    /// True for exit code 0.
    pub(crate) fn success(self) -> bool {
        self == Exit::Code(0)
    }

    fn from_wait_status(status: libc::c_int) -> Exit {
        if libc::WIFEXITED(status) {
            Exit::Code(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            Exit::Signal(libc::WTERMSIG(status))
        } else {
            Exit::Code(255)
        }
    }
}

impl std::fmt::Display for Exit {
    /// `exit code N` or `signal N (NAME)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "signal {s} ({})", signal_name(*s)),
        }
    }
}

/// How to start one worker.
#[derive(Debug, Clone)]
pub(crate) struct WorkerSpec {
    pub local_rank: usize,
    pub global_rank: usize,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Variables of the agent's environment the worker must not inherit.
    pub unset: Vec<String>,
    pub dir: PathBuf,
    pub error_file: PathBuf,
}

/// A started worker process, until it is reaped.
#[derive(Debug)]
pub(crate) struct Child {
    pid: i32,
    reaped: Option<Exit>,
}

/// Why a signal was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SignalError {
    /// The worker was reaped: its pid may belong to another process by now.
    #[error("process {pid} was already reaped")]
    Reaped {
        /// The pid it had.
        pid: i32,
    },
    /// kill(2) failed.
    #[error("kill({pid}, {signal}) failed: errno {errno}")]
    Kill {
        /// The process group.
        pid: i32,
        /// The signal.
        signal: i32,
        /// The OS error number.
        errno: i32,
    },
}

impl Child {
    /// The worker's pid (and process group id).
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `sig` to the worker's process group. Refused once the worker is reaped.
    pub(crate) fn signal_group(&self, sig: i32) -> Result<(), SignalError> {
        if self.reaped.is_some() {
            return Err(SignalError::Reaped { pid: self.pid });
        }
        // SAFETY: kill(2) has no memory-safety preconditions. The group id is the pid of our
        // unreaped child (a zombie at worst), which the kernel does not hand out again.
        let rc = unsafe { libc::kill(-self.pid, sig) };
        if rc != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            // ESRCH: the leader is a zombie whose group has no one else left; nothing to do.
            if errno != libc::ESRCH {
                return Err(SignalError::Kill {
                    pid: self.pid,
                    signal: sig,
                    errno,
                });
            }
        }
        Ok(())
    }

    /// True when the worker is stopped (SIGSTOP, or a tracing stop): `T` or `t` in the state
    /// field of `/proc/<pid>/stat`. The pid is our unreaped child, so it names this worker
    /// whatever it did; false when the state cannot be read.
    pub(crate) fn stopped(&self) -> bool {
        if self.reaped.is_some() {
            return false;
        }
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .ok()
            .and_then(|stat| {
                // The command name may hold spaces and parentheses: the state follows the
                // last ')'.
                let rest = &stat[stat.rfind(')')? + 1..];
                rest.split_whitespace().next().map(|s| s == "T" || s == "t")
            })
            .unwrap_or(false)
    }

    /// Reaps the worker after its exit was reported ([`Event::Exited`]); returns how it ended
    /// (`None` if it has not exited). After this, [`Child::signal_group`] sends nothing.
    pub(crate) fn reap(&mut self) -> Option<Exit> {
        if let Some(e) = self.reaped {
            return Some(e);
        }
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid on our own child with a valid out pointer.
        let rc = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        match rc {
            0 => None,
            r if r == self.pid => {
                let e = Exit::from_wait_status(status);
                self.reaped = Some(e);
                Some(e)
            }
            _ => {
                // ECHILD: nothing left to reap; treat it as gone so it is never signalled.
                let e = Exit::Code(255);
                self.reaped = Some(e);
                Some(e)
            }
        }
    }
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

/// Blocks until `pid` exits, without reaping it. `None` if it cannot be waited for.
fn wait_exit_no_reap(pid: i32) -> Option<Exit> {
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value; waitid writes into our own buffer.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid out pointer; WNOWAIT leaves it unreaped.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: after a successful waitid for an exited child, si_status is set.
            let status = unsafe { info.si_status() };
            return Some(match info.si_code {
                libc::CLD_EXITED => Exit::Code(status),
                _ => Exit::Signal(status),
            });
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return None;
        }
    }
}

/// Starts a worker in a new process group; its exit is sent on `events` (unreaped).
pub(crate) fn spawn(spec: &WorkerSpec, events: Sender<Event>) -> std::io::Result<Child> {
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
    for k in &spec.unset {
        cmd.env_remove(k);
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
    // `child` is dropped without waiting: std neither kills nor reaps on drop, and the reap is
    // the monitor's (`Child::reap`).
    drop(child);
    let local_rank = spec.local_rank;
    std::thread::Builder::new()
        .name(format!("rekindle-wait-{local_rank}"))
        .spawn(move || {
            let exit = wait_exit_no_reap(pid).unwrap_or(Exit::Code(255));
            // Report the exit only after the worker's last lines are out, so nothing is lost
            // when the agent exits right after. A grandchild holding the pipes open must not
            // stall the agent: wait at most 2 s for the streams to end. The worker stays
            // unreaped meanwhile, so the delay opens no window for a recycled pid.
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
                pid,
                local_rank,
                exit,
                at: SystemTime::now(),
            });
        })?;
    Ok(Child { pid, reaped: None })
}

/// The name of a signal, for messages.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &std::path::Path, script: &str) -> WorkerSpec {
        WorkerSpec {
            local_rank: 0,
            global_rank: 0,
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![],
            unset: vec![],
            dir: dir.to_path_buf(),
            error_file: dir.join("error.json"),
        }
    }

    fn proc_state(pid: i32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) S ...": the state follows the last ')'.
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    }

    fn next_exit(rx: &std::sync::mpsc::Receiver<Event>) -> (i32, Exit) {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Event::Exited { pid, exit, .. }) => (pid, exit),
            other => panic!("expected an exit, got {other:?}"),
        }
    }

    #[test]
    fn an_exited_worker_stays_unreaped_until_the_monitor_reaps_it() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut child = spawn(&spec(dir.path(), "exit 3"), tx).unwrap();
        let (pid, exit) = next_exit(&rx);
        assert_eq!((pid, exit), (child.pid(), Exit::Code(3)));
        // Reported but not reaped: a zombie holds the pid (and the group id), so signalling
        // the group cannot reach another process.
        assert_eq!(proc_state(pid), Some('Z'));
        assert_eq!(child.signal_group(libc::SIGKILL), Ok(()));
        assert_eq!(child.reap(), Some(Exit::Code(3)));
        assert_eq!(proc_state(pid), None, "reaped");
        // Once reaped, nothing is sent: the pid may be another process's by now.
        assert_eq!(
            child.signal_group(libc::SIGKILL),
            Err(SignalError::Reaped { pid })
        );
    }

    #[test]
    fn unset_variables_are_not_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // cargo sets CARGO_MANIFEST_DIR for the tests it runs; the worker must not see it.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let mut s = spec(
            dir.path(),
            r#"test -z "${CARGO_MANIFEST_DIR+x}" && exit 0 || exit 1"#,
        );
        s.unset = vec!["CARGO_MANIFEST_DIR".into()];
        let mut child = spawn(&s, tx).unwrap();
        assert_eq!(next_exit(&rx).1, Exit::Code(0));
        child.reap();
    }

    #[test]
    fn signals_reach_the_whole_group_and_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // A shell whose child ignores nothing: SIGTERM to the group ends both.
        let mut child = spawn(&spec(dir.path(), "sleep 600 & wait"), tx).unwrap();
        assert_eq!(child.reap(), None, "still running");
        child.signal_group(libc::SIGTERM).unwrap();
        let (_, exit) = next_exit(&rx);
        assert_eq!(exit, Exit::Signal(libc::SIGTERM));
        assert_eq!(exit.to_string(), "signal 15 (SIGTERM)");
        assert_eq!(child.reap(), Some(exit));
    }
}
