//! Pipeline schedules: the order in which a stage runs the forward and backward passes of a
//! step's micro-batches, and a simulator of the resulting idle time.

use super::PipelineError;

/// How a stage orders its micro-batches' passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// GPipe: every forward pass, then every backward pass. Keeps the activations of all `M`
    /// micro-batches.
    GPipe,
    /// 1F1B (PipeDream-Flush): stage `s` of `S` runs `S - s - 1` warm-up forward passes,
    /// then alternates one forward and one backward, then drains the backward passes. The
    /// same idle time as GPipe with the activations of at most `S - s` micro-batches.
    OneFOneB,
}

impl Schedule {
    /// The name `--schedule` takes: `gpipe` or `1f1b`.
    pub fn name(&self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Schedule {
    type Err = PipelineError;

    fn from_str(s: &str) -> Result<Schedule, PipelineError> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            _ => Err(PipelineError::Schedule { input: s.into() }),
        }
    }
}

/// One pass of one micro-batch on one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The forward pass of micro-batch `m`: receive its activations from the previous stage
    /// (or read the batch, on the first), run the stage's layers, send the output on (or
    /// compute the loss, on the last).
    Forward(usize),
    /// The backward pass of micro-batch `m`: receive the gradient of its output from the
    /// next stage (or start from the loss, on the last), accumulate the parameters'
    /// gradients, send the input's gradient back (except on the first).
    Backward(usize),
}

/// The passes of `stage` (of `stages`) over `micro` micro-batches, in order. Backward passes
/// always run in micro-batch order `0, 1, ..., M-1`, under both schedules, so gradients are
/// accumulated in the same order whatever the schedule and the results are bit-identical.
pub fn actions(schedule: Schedule, stages: usize, stage: usize, micro: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(2 * micro);
    match schedule {
        Schedule::GPipe => {
            out.extend((0..micro).map(Action::Forward));
            out.extend((0..micro).map(Action::Backward));
        }
        Schedule::OneFOneB => {
            let warmup = stages.saturating_sub(stage + 1).min(micro);
            out.extend((0..warmup).map(Action::Forward));
            for i in 0..(micro - warmup) {
                out.push(Action::Forward(warmup + i));
                out.push(Action::Backward(i));
            }
            out.extend(((micro - warmup)..micro).map(Action::Backward));
        }
    }
    out
}

/// The largest number of micro-batches whose forward pass has run and backward pass has not,
/// over `actions`: the activations a stage keeps at its peak.
pub fn peak_in_flight(actions: &[Action]) -> usize {
    let mut live = 0usize;
    let mut peak = 0usize;
    for a in actions {
        match a {
            Action::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Action::Backward(_) => live = live.saturating_sub(1),
        }
    }
    peak
}

/// The idle fraction of a pipeline with uniform stages and free communication,
/// `(S - 1) / (M + S - 1)`: the GPipe paper's bubble.
pub fn ideal_bubble(stages: usize, micro: usize) -> f64 {
    let (s, m) = (stages as f64, micro as f64);
    if s + m <= 1.0 {
        return 0.0;
    }
    (s - 1.0) / (m + s - 1.0)
}

/// When each stage was busy in a simulated step.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// From the first pass's start to the last pass's end.
    pub makespan: f64,
    /// Per stage, the time spent in passes.
    pub busy: Vec<f64>,
    /// Per stage, each pass with its start and end, in the order run.
    pub passes: Vec<Vec<(Action, f64, f64)>>,
}

impl Timeline {
    /// The idle fraction: `1 - sum(busy) / (stages * makespan)`.
    pub fn bubble(&self) -> f64 {
        let stages = self.busy.len() as f64;
        if self.makespan <= 0.0 || stages == 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<f64>() / (stages * self.makespan)
    }
}

/// Runs `schedule` on `stages` stages and `micro` micro-batches, every forward pass taking
/// `forward` and every backward pass `backward` time units, messages arriving at once: each
/// pass starts when its stage is free and its input exists (the previous stage's forward
/// pass of the micro-batch, the next stage's backward pass). Both schedules are free of
/// deadlock; a stage count or micro-batch count of 0 is an error.
pub fn simulate(
    schedule: Schedule,
    stages: usize,
    micro: usize,
    forward: f64,
    backward: f64,
) -> Result<Timeline, PipelineError> {
    if stages == 0 {
        return Err(PipelineError::Stages { stages, layers: 0 });
    }
    if micro == 0 {
        return Err(PipelineError::MicroBatches);
    }
    let plans: Vec<Vec<Action>> = (0..stages)
        .map(|s| actions(schedule, stages, s, micro))
        .collect();
    // done_f[s][m] / done_b[s][m]: when the pass ended.
    let mut done_f = vec![vec![None::<f64>; micro]; stages];
    let mut done_b = vec![vec![None::<f64>; micro]; stages];
    let mut next = vec![0usize; stages];
    let mut free = vec![0.0f64; stages];
    let mut passes = vec![Vec::new(); stages];
    let mut busy = vec![0.0f64; stages];
    let total: usize = plans.iter().map(Vec::len).sum();
    let mut ran = 0usize;
    while ran < total {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&a) = plans[s].get(next[s]) {
                let ready = match a {
                    Action::Forward(_) if s == 0 => Some(0.0),
                    Action::Forward(m) => done_f[s - 1][m],
                    Action::Backward(m) if s + 1 == stages => done_f[s][m],
                    Action::Backward(m) => done_b[s + 1][m],
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free[s]);
                let (end, slot) = match a {
                    Action::Forward(m) => (start + forward, &mut done_f[s][m]),
                    Action::Backward(m) => (start + backward, &mut done_b[s][m]),
                };
                *slot = Some(end);
                free[s] = end;
                busy[s] += end - start;
                passes[s].push((a, start, end));
                next[s] += 1;
                ran += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    Ok(Timeline {
        makespan,
        busy,
        passes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::{Backward as B, Forward as F};

    #[test]
    fn schedules_per_stage() {
        assert_eq!(
            actions(Schedule::GPipe, 3, 1, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
        // 1F1B, 3 stages, 4 micro-batches.
        assert_eq!(
            actions(Schedule::OneFOneB, 3, 0, 4),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        assert_eq!(
            actions(Schedule::OneFOneB, 3, 1, 4),
            vec![F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]
        );
        assert_eq!(
            actions(Schedule::OneFOneB, 3, 2, 4),
            vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]
        );
        // Fewer micro-batches than warm-up slots.
        assert_eq!(
            actions(Schedule::OneFOneB, 4, 0, 2),
            vec![F(0), F(1), B(0), B(1)]
        );
        assert_eq!(
            actions(Schedule::OneFOneB, 1, 0, 2),
            vec![F(0), B(0), F(1), B(1)]
        );
        assert_eq!("1F1B".parse::<Schedule>().unwrap(), Schedule::OneFOneB);
        assert_eq!("gpipe".parse::<Schedule>().unwrap(), Schedule::GPipe);
        assert!("zigzag".parse::<Schedule>().is_err());
    }

    #[test]
    fn every_micro_batch_once_each_way_backward_in_order() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..=5 {
                for micro in 1..=9 {
                    for stage in 0..stages {
                        let a = actions(schedule, stages, stage, micro);
                        let fw: Vec<usize> = a
                            .iter()
                            .filter_map(|x| match x {
                                F(m) => Some(*m),
                                _ => None,
                            })
                            .collect();
                        let bw: Vec<usize> = a
                            .iter()
                            .filter_map(|x| match x {
                                B(m) => Some(*m),
                                _ => None,
                            })
                            .collect();
                        let all: Vec<usize> = (0..micro).collect();
                        assert_eq!(fw, all);
                        assert_eq!(bw, all);
                        // A micro-batch goes backward only after its forward pass.
                        for m in 0..micro {
                            let f = a.iter().position(|x| *x == F(m)).unwrap();
                            let b = a.iter().position(|x| *x == B(m)).unwrap();
                            assert!(f < b);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn peak_activations() {
        // (stages, micro) -> peak in flight on stage 0: GPipe keeps M, 1F1B at most S.
        for (stages, micro) in [(2, 1), (2, 4), (3, 8), (4, 8), (4, 2)] {
            let g = peak_in_flight(&actions(Schedule::GPipe, stages, 0, micro));
            let o = peak_in_flight(&actions(Schedule::OneFOneB, stages, 0, micro));
            assert_eq!(g, micro);
            assert_eq!(o, stages.min(micro), "{stages} {micro}");
            for s in 0..stages {
                let o = peak_in_flight(&actions(Schedule::OneFOneB, stages, s, micro));
                assert_eq!(o, (stages - s).min(micro));
            }
        }
    }

    #[test]
    fn simulated_bubble_is_the_ideal_one() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in [1, 2, 3, 4] {
                for micro in [1, 4, 8] {
                    let t = simulate(schedule, stages, micro, 1.0, 2.0).unwrap();
                    let passes: usize = t.passes.iter().map(Vec::len).sum();
                    assert_eq!(passes, 2 * stages * micro, "everything ran");
                    // (M + S - 1) slots of forward + backward time.
                    assert_eq!(t.makespan, 3.0 * (micro + stages - 1) as f64);
                    let want = ideal_bubble(stages, micro);
                    assert!(
                        (t.bubble() - want).abs() < 1e-12,
                        "{schedule} {stages} {micro}"
                    );
                }
            }
        }
        assert!((ideal_bubble(4, 8) - 3.0 / 11.0).abs() < 1e-15);
        assert_eq!(ideal_bubble(1, 1), 0.0);
        assert!(simulate(Schedule::GPipe, 0, 1, 1.0, 1.0).is_err());
        assert_eq!(
            simulate(Schedule::GPipe, 2, 0, 1.0, 1.0),
            Err(PipelineError::MicroBatches)
        );
    }
}
