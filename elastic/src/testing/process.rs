//! Child processes for tests, benchmarks and the chaos harness.
//!
//! [`Proc`] starts a program with both output streams read line by line on threads, each line
//! stamped with the instant it arrived, so a caller waits (always with a deadline) for the
//! line that proves a state was reached instead of sleeping. Every process it starts carries a
//! tag in its environment ([`TAG_ENV`]), inherited by everything the process starts in turn,
//! so the whole tree can be found and killed by pid ([`tagged_pids`], [`kill_tagged`]) even
//! after the processes in the middle died; dropping a [`Proc`] kills its tree and reaps the
//! child.
//!
//! ```no_run
//! use std::process::Command;
//! use std::time::Duration;
//! use rekindle_elastic::testing::Proc;
//!
//! let mut cmd = Command::new("sh");
//! cmd.args(["-c", "echo ready; sleep 1; echo bye"]);
//! let mut p = Proc::spawn(cmd)?;
//! p.wait_for("ready", Duration::from_secs(10))?;
//! assert_eq!(p.wait_exit(Duration::from_secs(10))?, 0);
//! assert!(p.output().contains("bye"));
//! # Ok::<(), rekindle_elastic::testing::ProcError>(())
//! ```

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The environment variable that tags a process tree started by [`Proc`].
pub const TAG_ENV: &str = "REKINDLE_PROC_TAG";

/// How long [`Drop`] and the kill paths wait for a SIGKILLed child to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// Lines kept in an error message.
const TAIL_LINES: usize = 40;

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One output line, stamped when it was read.
#[derive(Debug, Clone)]
pub struct Line {
    /// When the line was read.
    pub at: Instant,
    /// Which stream it came from.
    pub stream: Stream,
    /// The text, without the newline.
    pub text: String,
}

/// Why a process could not be started or did not do what was waited for.
///
/// `Debug` prints the same text as `Display`, so that `.unwrap()` in a test shows the process's
/// last lines readably.
#[derive(thiserror::Error)]
pub enum ProcError {
    /// The program could not be started.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// No line matched before the deadline.
    #[error("{name} (pid {pid}): no line {what} within {timeout:?}; last lines:\n{tail}")]
    NoLine {
        /// The process's name.
        name: String,
        /// Its pid.
        pid: i32,
        /// What was waited for.
        what: String,
        /// The deadline.
        timeout: Duration,
        /// The last lines it printed.
        tail: String,
    },
    /// The process ended (its output closed) before a line matched.
    #[error("{name} (pid {pid}) ended ({status}) before a line {what}; last lines:\n{tail}")]
    Ended {
        /// The process's name.
        name: String,
        /// Its pid.
        pid: i32,
        /// What was waited for.
        what: String,
        /// How it ended, as far as known.
        status: String,
        /// The last lines it printed.
        tail: String,
    },
    /// The process did not exit before the deadline; it was killed.
    #[error(
        "{name} (pid {pid}) did not exit within {timeout:?} and was killed; last lines:\n{tail}"
    )]
    NoExit {
        /// The process's name.
        name: String,
        /// Its pid.
        pid: i32,
        /// The deadline.
        timeout: Duration,
        /// The last lines it printed.
        tail: String,
    },
}

impl std::fmt::Debug for ProcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A bell rung by every line and exit of the processes it is given to, so that one thread can
/// wait for a condition over several processes without polling.
#[derive(Debug, Clone, Default)]
pub struct Bell(Arc<(Mutex<u64>, Condvar)>);

impl Bell {
    /// A new bell.
    pub fn new() -> Bell {
        Bell::default()
    }

    /// Rings the bell.
    pub fn ring(&self) {
        let (count, cv) = &*self.0;
        *count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        cv.notify_all();
    }

    /// How many times it has rung.
    pub fn rung(&self) -> u64 {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the bell has rung more than `seen` times, or the deadline.
    pub fn wait_past(&self, seen: u64, deadline: Instant) {
        let (count, cv) = &*self.0;
        let mut c = count.lock().unwrap_or_else(|p| p.into_inner());
        while *c == seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            c = cv
                .wait_timeout(c, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Evaluates `cond` each time the bell rings until it gives a value or the deadline
    /// passes.
    pub fn wait_until<T>(
        &self,
        deadline: Instant,
        mut cond: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        loop {
            let seen = self.rung();
            if let Some(v) = cond() {
                return Some(v);
            }
            if Instant::now() >= deadline {
                return None;
            }
            self.wait_past(seen, deadline);
        }
    }
}

/// How to start a process (see [`Proc::spawn_with`]).
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// A name for messages (default: the program's file name).
    pub name: Option<String>,
    /// The tag for [`TAG_ENV`] (default: a fresh one). Give several processes one tag to find
    /// all of them, and everything they started, together.
    pub tag: Option<String>,
    /// Start the process as the leader of a new process group, so that
    /// [`Proc::signal_group`] reaches it and the children it keeps in its group.
    pub own_group: bool,
    /// A bell to ring at every line and at the exit.
    pub bell: Option<Bell>,
}

#[derive(Default)]
struct Shared {
    lines: Vec<Line>,
    open_streams: usize,
    status: Option<ExitStatus>,
}

struct State {
    shared: Mutex<Shared>,
    changed: Condvar,
    bell: Option<Bell>,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        self.changed.notify_all();
        if let Some(b) = &self.bell {
            b.ring();
        }
    }
}

/// A running child process with line-by-line access to its stdout and stderr.
///
/// The lines are collected by reader threads as they come, so [`Proc::output`] always holds
/// everything read so far; waits scan them under a condition variable.
pub struct Proc {
    name: String,
    pid: i32,
    tag: String,
    own_group: bool,
    state: Arc<State>,
    /// Lines before this index were examined by an earlier wait.
    cursor: usize,
}

impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc")
            .field("name", &self.name)
            .field("pid", &self.pid)
            .field("tag", &self.tag)
            .finish()
    }
}

/// A fresh tag: unique per process of the caller and call.
pub fn new_tag() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut salt = [0u8; 4];
    let _ = getrandom::getrandom(&mut salt);
    format!(
        "{}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        u32::from_le_bytes(salt)
    )
}

fn read_lines(pipe: impl Read, stream: Stream, state: Arc<State>) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    buf.pop();
                }
                let line = Line {
                    at: Instant::now(),
                    stream,
                    text: String::from_utf8_lossy(&buf).into_owned(),
                };
                state.lock().lines.push(line);
                state.notify();
            }
        }
    }
    let mut s = state.lock();
    s.open_streams = s.open_streams.saturating_sub(1);
    drop(s);
    state.notify();
}

/// What a wait stopped on.
enum Found {
    Line(String),
    Ended(String),
    Timeout,
}

impl Proc {
    /// Starts `cmd` with stdin closed and stdout and stderr read line by line.
    pub fn spawn(cmd: Command) -> Result<Proc, ProcError> {
        Proc::spawn_with(cmd, &SpawnOptions::default())
    }

    /// Starts `cmd` as [`Proc::spawn`] does, with `options`.
    pub fn spawn_with(mut cmd: Command, options: &SpawnOptions) -> Result<Proc, ProcError> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        let name = options.name.clone().unwrap_or_else(|| {
            std::path::Path::new(&program)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| program.clone())
        });
        let tag = options.tag.clone().unwrap_or_else(new_tag);
        cmd.env(TAG_ENV, &tag)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if options.own_group {
            cmd.process_group(0);
        }
        let mut child = cmd
            .spawn()
            .map_err(|source| ProcError::Spawn { program, source })?;
        let pid = child.id() as i32;
        let state = Arc::new(State {
            shared: Mutex::new(Shared::default()),
            changed: Condvar::new(),
            bell: options.bell.clone(),
        });
        if let Some(out) = child.stdout.take() {
            state.lock().open_streams += 1;
            let state = state.clone();
            std::thread::spawn(move || read_lines(out, Stream::Stdout, state));
        }
        if let Some(err) = child.stderr.take() {
            state.lock().open_streams += 1;
            let state = state.clone();
            std::thread::spawn(move || read_lines(err, Stream::Stderr, state));
        }
        // This thread owns the child: waiting here reaps it, and the exit wakes the waiters
        // like a line does, so nothing polls.
        {
            let state = state.clone();
            std::thread::spawn(move || {
                let status = child
                    .wait()
                    .unwrap_or_else(|_| ExitStatus::from_raw(255 << 8));
                state.lock().status = Some(status);
                state.notify();
            });
        }
        Ok(Proc {
            name,
            pid,
            tag,
            own_group: options.own_group,
            state,
            cursor: 0,
        })
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The name used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tag of this process's tree (see [`TAG_ENV`]).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Scans the lines from `from` for one satisfying `pred` until the deadline or the end of
    /// the output; moves the cursor past the lines examined.
    fn scan(&mut self, from: usize, deadline: Instant, pred: &dyn Fn(&str) -> bool) -> Found {
        let state = self.state.clone();
        let mut s = state.lock();
        let mut i = from;
        loop {
            while i < s.lines.len() {
                let hit = pred(&s.lines[i].text);
                i += 1;
                if hit {
                    self.cursor = self.cursor.max(i);
                    return Found::Line(s.lines[i - 1].text.clone());
                }
            }
            self.cursor = self.cursor.max(i);
            if s.open_streams == 0 && s.status.is_some() {
                return Found::Ended(status_text(s.status));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Found::Timeout;
            }
            s = state
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn found(
        &mut self,
        from: usize,
        what: &str,
        timeout: Duration,
        pred: &dyn Fn(&str) -> bool,
    ) -> Result<String, ProcError> {
        match self.scan(from, Instant::now() + timeout, pred) {
            Found::Line(l) => Ok(l),
            Found::Ended(status) => Err(ProcError::Ended {
                name: self.name.clone(),
                pid: self.pid,
                what: what.to_string(),
                status,
                tail: self.tail(),
            }),
            Found::Timeout => Err(ProcError::NoLine {
                name: self.name.clone(),
                pid: self.pid,
                what: what.to_string(),
                timeout,
                tail: self.tail(),
            }),
        }
    }

    /// Waits for a line, read before or arriving, that satisfies `pred`, and returns it.
    /// `what` describes it for the error.
    pub fn wait_line_matching(
        &mut self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, ProcError> {
        self.found(0, what, timeout, &pred)
    }

    /// Waits for a line (read before or arriving) that satisfies `pred`.
    pub fn wait_line(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, ProcError> {
        self.found(0, "matching the condition", timeout, &pred)
    }

    /// Waits for a line (read before or arriving) that contains `needle`.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String, ProcError> {
        let what = format!("containing {needle:?}");
        self.found(0, &what, timeout, &|l: &str| l.contains(needle))
    }

    /// Waits for a line after those an earlier wait examined that satisfies `pred`.
    pub fn next_line(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, ProcError> {
        self.found(self.cursor, "matching the condition", timeout, &pred)
    }

    /// Waits for a line after those an earlier wait examined that contains `needle`.
    pub fn next_for(&mut self, needle: &str, timeout: Duration) -> Result<String, ProcError> {
        let what = format!("containing {needle:?}");
        self.found(self.cursor, &what, timeout, &|l: &str| l.contains(needle))
    }

    /// Waits for a line after those an earlier wait examined that satisfies `pred`; `what`
    /// describes it.
    pub fn next_line_matching(
        &mut self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, ProcError> {
        self.found(self.cursor, what, timeout, &pred)
    }

    /// Marks every line read so far as examined: [`Proc::next_line`] then sees only lines
    /// that arrive later.
    pub fn skip_seen(&mut self) {
        self.cursor = self.state.lock().lines.len();
    }

    /// Sends `sig` to the process (nothing once it has been reaped).
    pub fn signal(&self, sig: i32) {
        let s = self.state.lock();
        if s.status.is_none() {
            kill(self.pid, sig);
        }
    }

    /// Sends `sig` to the process group the process leads (started with
    /// [`SpawnOptions::own_group`]); to the process alone otherwise.
    pub fn signal_group(&self, sig: i32) {
        let s = self.state.lock();
        if s.status.is_some() {
            return;
        }
        kill(if self.own_group { -self.pid } else { self.pid }, sig);
    }

    /// The exit code if the process has exited: its code, or 128 + the signal that ended it.
    pub fn try_exit(&self) -> Option<i32> {
        self.state.lock().status.map(exit_code)
    }

    /// Waits for the process to exit and its output to close; returns the exit code (128 +
    /// the signal for a process ended by one). At the deadline the process and its tree are
    /// killed and the error says so. Output still held open by a descendant after the exit is
    /// waited for until the same deadline, then the code is returned anyway.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<i32, ProcError> {
        let deadline = Instant::now() + timeout;
        let state = self.state.clone();
        let mut s = state.lock();
        while !(s.open_streams == 0 && s.status.is_some()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                if let Some(st) = s.status {
                    return Ok(exit_code(st));
                }
                drop(s);
                self.kill_tree();
                return Err(ProcError::NoExit {
                    name: self.name.clone(),
                    pid: self.pid,
                    timeout,
                    tail: self.tail(),
                });
            }
            s = state
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(s.status.map(exit_code).unwrap_or(255))
    }

    /// SIGKILLs the process and every process carrying its tag, then reaps it (bounded).
    pub fn kill_tree(&mut self) {
        self.signal(libc::SIGKILL);
        kill_tagged(&self.tag, libc::SIGKILL);
        let deadline = Instant::now() + REAP_TIMEOUT;
        let state = self.state.clone();
        let mut s = state.lock();
        while s.status.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = state
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// SIGTERM, up to `grace` for the exit, then SIGKILL of the tree; returns the exit code.
    pub fn stop(&mut self, grace: Duration) -> Option<i32> {
        self.signal(libc::SIGTERM);
        match self.wait_exit(grace) {
            Ok(code) => Some(code),
            Err(_) => self.try_exit(),
        }
    }

    /// Every line read so far.
    pub fn lines(&self) -> Vec<Line> {
        self.state.lock().lines.clone()
    }

    /// The lines read so far from index `from` on.
    pub fn lines_from(&self, from: usize) -> Vec<Line> {
        let s = self.state.lock();
        s.lines
            .get(from..)
            .map(<[Line]>::to_vec)
            .unwrap_or_default()
    }

    /// Every line read so far, one per line.
    pub fn output(&self) -> String {
        self.text_of(None)
    }

    /// The stdout lines read so far.
    pub fn stdout(&self) -> String {
        self.text_of(Some(Stream::Stdout))
    }

    /// The stderr lines read so far.
    pub fn stderr(&self) -> String {
        self.text_of(Some(Stream::Stderr))
    }

    fn text_of(&self, stream: Option<Stream>) -> String {
        let mut out = String::new();
        for l in self
            .state
            .lock()
            .lines
            .iter()
            .filter(|l| stream.is_none_or(|s| s == l.stream))
        {
            out.push_str(&l.text);
            out.push('\n');
        }
        out
    }

    fn tail(&self) -> String {
        let s = self.state.lock();
        let from = s.lines.len().saturating_sub(TAIL_LINES);
        s.lines[from..]
            .iter()
            .map(|l| l.text.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn status_text(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => format!("exit code {}", exit_code(s)),
        None => "output closed".into(),
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_tree();
    }
}

/// The code of an exit status: the exit code, or 128 + the signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// A program run to its end (see [`run`]).
#[derive(Debug, Clone)]
pub struct Finished {
    /// The exit code (128 + the signal for a process ended by one).
    pub code: i32,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

impl Finished {
    /// True for exit code 0.
    pub fn success(&self) -> bool {
        self.code == 0
    }
}

/// Runs `cmd` to its end with a deadline (killing it at the deadline): the bounded
/// counterpart of [`Command::output`].
pub fn run(cmd: Command, timeout: Duration) -> Result<Finished, ProcError> {
    let mut p = Proc::spawn(cmd)?;
    let code = p.wait_exit(timeout)?;
    Ok(Finished {
        code,
        stdout: p.stdout(),
        stderr: p.stderr(),
    })
}

/// Sends `sig` to `pid` (a negative pid names a process group). A process that is gone is
/// not an error.
pub fn kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory effects; a stale pid is at worst an ESRCH.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// True if a process with this pid exists (a zombie counts).
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Waits until no process with this pid runs (a zombie counts as gone); false at the deadline.
pub fn wait_pid_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    while pid_running(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        // Another process's exit cannot be waited on: re-read /proc with a growing pause.
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
    true
}

/// True if the process exists and is not a zombie.
pub fn pid_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// The pids of the live (not zombie) processes whose environment holds `TAG_ENV=tag`. Only
/// processes this user may read are seen (every one, as root).
pub fn tagged_pids(tag: &str) -> Vec<i32> {
    let needle = format!("{TAG_ENV}={tag}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id() as i32;
    let mut pids = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) && pid_running(pid) {
            pids.push(pid);
        }
    }
    pids.sort_unstable();
    pids
}

/// Sends `sig` to every process carrying `tag`; returns their pids.
pub fn kill_tagged(tag: &str, sig: i32) -> Vec<i32> {
    let pids = tagged_pids(tag);
    for &p in &pids {
        kill(p, sig);
    }
    pids
}

/// Waits until no live process carries `tag`; returns the ones still there at the deadline.
pub fn wait_tagged_gone(tag: &str, timeout: Duration) -> Vec<i32> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        let left = tagged_pids(tag);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        // Nothing to wait on for another process's exit: re-read /proc with a growing pause.
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Parses `key=value` from a line of space-separated words.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// The `final_step=<N> params_sha256=<hex>` line every training program of this project
/// prints at the end, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// The step the run ended at.
    pub step: u64,
    /// The SHA-256 of the parameters, in hex.
    pub sha256: String,
}

impl Fingerprint {
    /// Parses one line (with any prefix, such as the agent's `[rank 0] `).
    pub fn parse(line: &str) -> Option<Fingerprint> {
        let step = field(line, "final_step")?.parse().ok()?;
        let sha256 = field(line, "params_sha256")?;
        (sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit())).then(|| Fingerprint {
            step,
            sha256: sha256.to_string(),
        })
    }

    /// The last fingerprint line among `lines`.
    pub fn last_in<'a>(lines: impl DoubleEndedIterator<Item = &'a str>) -> Option<Fingerprint> {
        lines.rev().find_map(Fingerprint::parse)
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "final_step={} params_sha256={}", self.step, self.sha256)
    }
}

/// The last fingerprint line `p` printed.
pub fn final_fingerprint(p: &Proc) -> Option<Fingerprint> {
    let lines = p.lines();
    Fingerprint::last_in(lines.iter().map(|l| l.text.as_str()))
}

/// The path of a binary of this workspace, next to the running test or tool
/// (`target/<profile>/<name>`, searched upwards from the running executable up to `target`).
/// `cargo build --workspace --bins` builds them all.
pub fn workspace_bin(name: &str) -> std::io::Result<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(20);

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn lines_of_both_streams_arrive_in_order_and_the_exit_code_is_reported() {
        let mut p = Proc::spawn(sh("echo one; echo two >&2; echo three; exit 3")).unwrap();
        assert_eq!(p.wait_exit(T).unwrap(), 3);
        assert_eq!(p.stdout(), "one\nthree\n");
        assert_eq!(p.stderr(), "two\n");
        assert_eq!(p.lines().len(), 3);
    }

    #[test]
    fn waiting_for_a_line_that_never_comes_ends_at_the_deadline_or_the_exit() {
        let mut p = Proc::spawn(sh("echo a; exec sleep 30")).unwrap();
        p.wait_for("a", T).unwrap();
        let t0 = Instant::now();
        match p.wait_for("b", Duration::from_millis(200)) {
            Err(ProcError::NoLine { what, tail, .. }) => {
                assert_eq!(what, "containing \"b\"");
                assert_eq!(tail, "a");
            }
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        // A line already read satisfies wait_for again, but not next_for.
        p.wait_for("a", Duration::ZERO).unwrap();
        assert!(p.next_for("a", Duration::from_millis(50)).is_err());
        p.signal(libc::SIGKILL);
        assert_eq!(p.wait_exit(T).unwrap(), 128 + libc::SIGKILL);
        match p.wait_for("b", T) {
            Err(ProcError::Ended { status, .. }) => assert_eq!(status, "exit code 137"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_process_that_outlives_the_deadline_is_killed_with_its_tree() {
        let mut p = Proc::spawn(sh("sleep 60 & echo child=$!; wait")).unwrap();
        let line = p.wait_for("child=", T).unwrap();
        let child: i32 = field(&line, "child").unwrap().parse().unwrap();
        assert_eq!(tagged_pids(p.tag()).len(), 2, "the shell and its child");
        match p.wait_exit(Duration::from_millis(100)) {
            Err(ProcError::NoExit { .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(wait_tagged_gone(p.tag(), T).is_empty());
        assert!(
            wait_pid_gone(child, T),
            "a process mid-exit has no environment to read"
        );
    }

    #[test]
    fn dropping_a_proc_kills_its_descendants_found_by_tag() {
        let (tag, child) = {
            let mut p = Proc::spawn(sh("sleep 60 & echo child=$!; wait")).unwrap();
            let line = p.wait_for("child=", T).unwrap();
            (
                p.tag().to_string(),
                field(&line, "child").unwrap().parse::<i32>().unwrap(),
            )
        };
        assert!(wait_tagged_gone(&tag, T).is_empty());
        assert!(
            wait_pid_gone(child, T),
            "a process mid-exit has no environment to read"
        );
    }

    #[test]
    fn a_process_group_is_signalled_as_one() {
        let opts = SpawnOptions {
            own_group: true,
            ..SpawnOptions::default()
        };
        let mut p = Proc::spawn_with(sh("sleep 60 & echo child=$!; wait"), &opts).unwrap();
        let line = p.wait_for("child=", T).unwrap();
        let child: i32 = field(&line, "child").unwrap().parse().unwrap();
        p.signal_group(libc::SIGTERM);
        assert_eq!(p.wait_exit(T).unwrap(), 128 + libc::SIGTERM);
        assert!(wait_tagged_gone(p.tag(), T).is_empty());
        assert!(
            wait_pid_gone(child, T),
            "a process mid-exit has no environment to read"
        );
    }

    #[test]
    fn a_bell_wakes_a_waiter_on_the_lines_of_several_processes() {
        let bell = Bell::new();
        let opts = SpawnOptions {
            bell: Some(bell.clone()),
            ..SpawnOptions::default()
        };
        let a = Proc::spawn_with(sh("echo a1; exec sleep 30"), &opts).unwrap();
        let b = Proc::spawn_with(sh("echo b1; echo b2"), &opts).unwrap();
        let both = bell.wait_until(Instant::now() + T, || {
            let (la, lb) = (a.lines_from(0), b.lines_from(1));
            (la.len() == 1 && lb.len() == 1 && b.try_exit().is_some())
                .then(|| (la[0].text.clone(), lb[0].text.clone()))
        });
        assert_eq!(both, Some(("a1".to_string(), "b2".to_string())));
        let t0 = Instant::now();
        assert_eq!(
            bell.wait_until(t0 + Duration::from_millis(100), || None::<()>),
            None
        );
        assert!(t0.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn run_is_output_with_a_deadline() {
        let done = run(sh("echo out; echo err >&2"), T).unwrap();
        assert!(done.success());
        assert_eq!(
            (done.stdout.as_str(), done.stderr.as_str()),
            ("out\n", "err\n")
        );
        assert!(matches!(
            run(Command::new("/nonexistent/program"), T),
            Err(ProcError::Spawn { .. })
        ));
        assert!(matches!(
            run(sh("exec sleep 30"), Duration::from_millis(100)),
            Err(ProcError::NoExit { .. })
        ));
    }

    #[test]
    fn fields_and_fingerprints_parse() {
        let line = "[rank 0] final_step=1500 params_sha256=".to_string() + &"ab".repeat(32);
        let f = Fingerprint::parse(&line).unwrap();
        assert_eq!(f.step, 1500);
        assert_eq!(f.to_string(), line.trim_start_matches("[rank 0] "));
        assert_eq!(Fingerprint::parse("final_step=3 params_sha256=xyz"), None);
        assert_eq!(Fingerprint::parse("final_step=x params_sha256=ab"), None);
        assert_eq!(field("a=1 bb=2 b=3", "b"), Some("3"));
        assert_eq!(field("a=1", "c"), None);
        assert_eq!(Fingerprint::last_in(["x", &line, "y"].into_iter()), Some(f));
    }
}
