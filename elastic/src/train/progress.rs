//! Rank 0's progress bar and loss curve.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

use super::TrainError;

/// One completed step, as rank 0 reports it.
pub(crate) struct StepLine {
    pub step: u64,
    pub epoch: u64,
    pub loss: Option<f64>,
    pub samples_per_s: f64,
    pub world_size: usize,
}

/// Samples per second over the steps of the last [`RATE_WINDOW`]: a step's own rate is noise
/// where steps are uneven (a parameter server's step may apply pushes that were already
/// waiting, and take microseconds), so the figure covers every step that began in the window.
#[derive(Debug, Default)]
pub(crate) struct StepRate {
    /// Start and samples of each step in the window, oldest first.
    steps: VecDeque<(Instant, u64)>,
    samples: u64,
}

/// The span [`StepRate`] averages over.
const RATE_WINDOW: Duration = Duration::from_secs(2);

impl StepRate {
    /// Records a step that began at `started`, ended at `now` and trained on `samples`
    /// samples (over all ranks); returns the samples per second of the window.
    pub fn record(&mut self, started: Instant, now: Instant, samples: u64) -> f64 {
        self.steps.push_back((started, samples));
        self.samples += samples;
        // Keep the newest step whatever its length; drop the ones that began before the window.
        while self.steps.len() > 1 {
            let Some(&(t, n)) = self.steps.front() else {
                break;
            };
            if now.saturating_duration_since(t) <= RATE_WINDOW {
                break;
            }
            self.steps.pop_front();
            self.samples -= n;
        }
        let since = self.steps.front().map_or(started, |(t, _)| *t);
        let secs = now.saturating_duration_since(since).as_secs_f64().max(1e-9);
        self.samples as f64 / secs
    }
}

pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    /// The bar redraws in place on a terminal; elsewhere (under `rekindle run`, whose
    /// workers write to pipes) it is printed as a line every [`LINE_EVERY`].
    tty: bool,
    csv: Option<(PathBuf, BufWriter<File>)>,
}

/// How often the bar is printed as a line when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(2);

/// A "terminal" that prints each drawing of the bar as one line of stderr, at most once per
/// `every`: the bar stays readable through a pipe, as the agent's per-rank output is.
#[derive(Debug)]
struct LineTerm {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl LineTerm {
    fn emit(&self, s: &str) -> std::io::Result<()> {
        let s = s.trim_end();
        if s.is_empty() {
            return Ok(());
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < self.every) {
            return Ok(());
        }
        *last = Some(Instant::now());
        writeln!(std::io::stderr(), "{s}")
    }
}

impl TermLike for LineTerm {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.emit(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.emit(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

const CSV_HEADER: &str = "step,epoch,loss,samples_per_s,world_size,unix_time";

fn csv_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::LossCsv {
        path: path.to_path_buf(),
        source,
    }
}

impl Progress {
    /// A bar up to `total` steps (redrawn in place on a terminal, printed as a line every
    /// 2 s elsewhere) and the CSV, appended to (a restarted rank 0 continues the same curve).
    pub fn new(
        total: u64,
        start: u64,
        bar: bool,
        csv: Option<&Path>,
    ) -> Result<Progress, TrainError> {
        let tty = std::io::stderr().is_terminal();
        let bar = bar.then(|| {
            let target = if tty {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::term_like(Box::new(LineTerm {
                    every: LINE_EVERY,
                    last: Mutex::new(None),
                }))
            };
            let b = ProgressBar::with_draw_target(Some(total), target);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]",
            ) {
                b.set_style(style);
            }
            b.set_position(start);
            b
        });
        let csv = match csv {
            Some(path) => {
                let fresh = std::fs::metadata(path)
                    .map(|m| m.len() == 0)
                    .unwrap_or(true);
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(csv_err(path))?;
                let mut w = BufWriter::new(file);
                if fresh {
                    writeln!(w, "{CSV_HEADER}").map_err(csv_err(path))?;
                }
                Some((path.to_path_buf(), w))
            }
            None => None,
        };
        Ok(Progress { bar, tty, csv })
    }

    pub fn step(&mut self, line: &StepLine) -> Result<(), TrainError> {
        if let Some(bar) = &self.bar {
            bar.set_position(line.step);
            let loss = line
                .loss
                .map(|l| format!("loss {l:.4}"))
                .unwrap_or_default();
            bar.set_message(format!(
                "{loss} {:.0} samples/s world {}",
                line.samples_per_s, line.world_size
            ));
        }
        if let Some((path, w)) = &mut self.csv {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            let loss = line.loss.map(|l| format!("{l:.6}")).unwrap_or_default();
            writeln!(
                w,
                "{},{},{loss},{:.1},{},{now:.6}",
                line.step, line.epoch, line.samples_per_s, line.world_size
            )
            .and_then(|_| w.flush())
            .map_err(csv_err(path))?;
        }
        Ok(())
    }

    /// Prints a message above the bar (or to stderr).
    pub fn println(&self, msg: &str) {
        match &self.bar {
            Some(bar) if self.tty => bar.println(msg),
            _ => eprintln!("{msg}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            if self.tty {
                bar.finish_and_clear();
            } else {
                eprintln!(
                    "step {}/{} {} [{:.1} s]",
                    bar.position(),
                    bar.length().unwrap_or(0),
                    bar.message(),
                    bar.elapsed().as_secs_f64()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn uneven_steps_average_over_the_window() {
        let t0 = Instant::now();
        let mut r = StepRate::default();
        // 100 samples in 100 ms, then a step of 100 samples that takes 1 us: the window holds
        // 200 samples over 100.001 ms, not the second step's 10^8 samples/s.
        assert!((r.record(t0, t0 + ms(100), 100) - 1000.0).abs() < 1e-9);
        let second = t0 + ms(100);
        let rate = r.record(second, second + Duration::from_micros(1), 100);
        assert!((rate - 200.0 / 0.100001).abs() < 1e-6, "{rate}");
    }

    #[test]
    fn steps_older_than_the_window_leave_it() {
        let t0 = Instant::now();
        let mut r = StepRate::default();
        // A slow first step (1 s per 10 samples), then steps of 100 samples per 100 ms until
        // the first one began more than 2 s before the newest end: only the fast steps remain.
        r.record(t0, t0 + ms(1000), 10);
        let mut rate = 0.0;
        for i in 0..20 {
            let start = t0 + ms(1000 + 100 * i);
            rate = r.record(start, start + ms(100), 100);
        }
        assert_eq!(r.steps.len(), 20);
        assert!((rate - 1000.0).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn a_single_long_step_is_kept() {
        let t0 = Instant::now();
        let mut r = StepRate::default();
        assert_eq!(r.record(t0, t0 + ms(5000), 500), 100.0);
        assert_eq!(r.record(t0 + ms(5000), t0 + ms(10_000), 1000), 200.0);
    }
}
