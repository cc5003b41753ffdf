//! Rank 0's progress bar and loss curve.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::TrainError;

/// One completed step, as rank 0 reports it.
pub(crate) struct StepLine {
    pub step: u64,
    pub epoch: u64,
    pub loss: Option<f64>,
    pub samples_per_s: f64,
    pub world_size: usize,
}

pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    csv: Option<(PathBuf, BufWriter<File>)>,
}

const CSV_HEADER: &str = "step,epoch,loss,samples_per_s,world_size,unix_time";

fn csv_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::LossCsv {
        path: path.to_path_buf(),
        source,
    }
}

impl Progress {
    /// A bar up to `total` steps (drawn only on a terminal) and the CSV, appended to (a
    /// restarted rank 0 continues the same curve).
    pub fn new(
        total: u64,
        start: u64,
        bar: bool,
        csv: Option<&Path>,
    ) -> Result<Progress, TrainError> {
        let bar = bar.then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
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
        Ok(Progress { bar, csv })
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
            Some(bar) if !bar.is_hidden() => bar.println(msg),
            _ => eprintln!("{msg}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
