//! rekindle-chaos-tests: launches real rekindle processes and kills, hangs and stops them.
//!
//! [`Proc`] wraps a child process whose stdout is read line by line on a thread, so a test can
//! wait (with a deadline) for the line that proves a state was reached instead of sleeping.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A child process with line-by-line access to its stdout.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line read so far, for failure messages.
    pub seen: Vec<String>,
}

impl Proc {
    /// Spawns `cmd` with piped stdout.
    pub fn spawn(mut cmd: Command) -> std::io::Result<Proc> {
        let mut child = cmd.stdout(Stdio::piped()).stdin(Stdio::null()).spawn()?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Proc {
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until a line satisfies `pred` and returns it, or `None` at the deadline or when
    /// the output ends.
    pub fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if pred(&l) {
                        return Some(l);
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a pid we spawned; an already-exited child is harmless.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Waits for exit with a deadline, killing the process if it passes; returns the exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.code(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parses `key=value` fields of an `error ...` line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// The path of a binary of this workspace, built next to the running test or tool
/// (`target/<profile>/<name>`); `cargo test --workspace` and `cargo build --workspace` build
/// them all.
pub fn workspace_bin(name: &str) -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent();
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
        dir = d.parent();
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "binary {name:?} not found near {}; build it first (cargo build --workspace --bins)",
            exe.display()
        ),
    ))
}

/// A running job (`rekindle run ...`): both output streams, merged line by line.
pub struct Job {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line read so far, for failure messages and parsing.
    pub seen: Vec<String>,
}

impl Job {
    /// Spawns `program args`, with extra environment `envs`.
    pub fn spawn(
        program: &std::path::Path,
        args: &[String],
        envs: &[(&str, &str)],
    ) -> std::io::Result<Job> {
        let mut child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let (tx, lines) = mpsc::channel();
        let out = child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn std::io::Read + Send>);
        let err = child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn std::io::Read + Send>);
        for pipe in [out, err].into_iter().flatten() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Job {
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line (already seen or arriving) that satisfies `pred`; `None` at the
    /// deadline or when the output ends.
    pub fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        if let Some(l) = self.seen.iter().find(|l| pred(l)) {
            return Some(l.clone());
        }
        self.next_line(timeout, pred)
    }

    /// Waits for a line arriving from now on that satisfies `pred`.
    pub fn next_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if pred(&l) {
                        return Some(l);
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Sends a signal to the agent.
    pub fn signal(&self, sig: i32) {
        kill(self.child.id() as i32, sig);
    }

    /// Waits for exit (reading the rest of the output), killing the job at the deadline;
    /// returns the exit code (`None` if killed or signalled).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        // The output closes when the agent and every worker have exited.
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
        self.child.wait().ok().and_then(|s| s.code())
    }

    /// Everything seen so far, one line each.
    pub fn output(&self) -> String {
        self.seen.join("\n")
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `sig` to `pid`.
pub fn kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory effects; a stale pid is at worst an ESRCH.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The `pid=` of the newest `rank=<rank> pid=<pid>` line of `job` (what the `ddp` example
/// prints at start).
pub fn rank_pid(job: &Job, rank: usize) -> Option<i32> {
    let tag = format!("] rank={rank} pid=");
    job.seen
        .iter()
        .rev()
        .find(|l| l.contains(&tag))
        .and_then(|l| field(l, "pid"))
        .and_then(|p| p.parse().ok())
}

/// The `params_sha256` of the job's `final_step=` line.
pub fn final_fingerprint(job: &Job) -> Option<(u64, String)> {
    let line = job.seen.iter().rev().find(|l| l.contains("final_step="))?;
    Some((
        field(line, "final_step")?.parse().ok()?,
        field(line, "params_sha256")?.to_string(),
    ))
}
