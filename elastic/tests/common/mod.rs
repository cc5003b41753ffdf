//! Helpers for tests that run the real `rekindle` binary.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const REKINDLE: &str = env!("CARGO_BIN_EXE_rekindle");
pub const WORKER: &str = env!("CARGO_BIN_EXE_rekindle-test-worker");

/// A running `rekindle` process whose output lines are collected as they come.
pub struct AgentProc {
    pub child: Child,
    lines: Receiver<String>,
    pub seen: Arc<Mutex<Vec<String>>>,
    exit: Receiver<ExitStatus>,
    status: Option<ExitStatus>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl AgentProc {
    pub fn spawn(args: &[&str], envs: &[(&str, &str)]) -> AgentProc {
        let mut child = Command::new(REKINDLE)
            .args(args)
            .envs(envs.iter().copied())
            .env("REKINDLE_LOG", "rekindle_elastic=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rekindle");
        let (tx, lines) = channel();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (tx, seen) = (tx.clone(), seen.clone());
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    seen.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            }));
        }
        let (etx, exit) = channel();
        let pid = child.id() as i32;
        std::thread::spawn(move || {
            // Reap through waitpid on the pid so the Child stays usable for kill().
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid out pointer.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r == pid {
                use std::os::unix::process::ExitStatusExt;
                let _ = etx.send(ExitStatus::from_raw(status));
            }
        });
        AgentProc {
            child,
            lines,
            seen,
            exit,
            status: None,
            readers,
        }
    }

    /// Waits for an output line (seen before or arriving) that contains `needle`; returns it.
    pub fn wait_line(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self
                .seen
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return l.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(_) => {}
                Err(_) => panic!(
                    "no line containing {needle:?} within {timeout:?}; output:\n{}",
                    self.output()
                ),
            }
        }
    }

    pub fn output(&self) -> String {
        self.seen.lock().unwrap().join("\n")
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Waits for the exit code (128+N for signal N).
    pub fn wait_code(&mut self, timeout: Duration) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        let status = match self.status {
            Some(s) => s,
            None => {
                let s = self.exit.recv_timeout(timeout).unwrap_or_else(|_| {
                    panic!(
                        "rekindle did not exit within {timeout:?}; output:\n{}",
                        self.output()
                    )
                });
                self.status = Some(s);
                s
            }
        };
        // The pipes close when the agent exits: the readers then hold every line.
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if self.status.is_none() && self.exit.try_recv().is_err() {
            let _ = self.child.kill();
            let _ = self.exit.recv_timeout(Duration::from_secs(10));
        }
    }
}

/// True if a process with this pid exists.
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Parses `key=value` from a line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
}
