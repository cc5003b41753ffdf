//! The report of a run: every fault with its time, detection time, time to the next
//! completed step and steps lost; totals and medians; the invariants; as a table
//! ([`Report::table`]), as JSON ([`Report::json`]) and as a timeline plot ([`Report::svg`]).

use serde::Serialize;

use crate::fault::Fault;

/// What happened to one fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultRecord {
    /// The fault.
    pub fault: Fault,
    /// Seconds from the start of the run to the injection.
    pub at_s: f64,
    /// For faults that last (a hang, a partition, etcd down): seconds until healed.
    pub healed_at_s: Option<f64>,
    /// The last step the job had printed when the fault came.
    pub step_before: Option<u64>,
    /// Seconds from the fault to the first line showing it was noticed.
    pub detected_after_s: Option<f64>,
    /// Seconds from the fault to the next step completed after it was noticed (after it was
    /// healed, for a fault that lasts): a step in flight that still completes does not count.
    pub next_step_after_s: Option<f64>,
    /// Steps completed before the fault and done again after it.
    pub steps_lost: Option<u64>,
    /// False when no step completed within the hang deadline after the fault.
    pub recovered: bool,
}

/// One invariant and whether it held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Its name.
    pub name: String,
    /// Whether it held.
    pub held: bool,
    /// What was seen.
    pub detail: String,
}

impl Check {
    /// A check that held.
    pub fn pass(name: &str, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            held: true,
            detail: detail.into(),
        }
    }

    /// A check that failed.
    pub fn fail(name: &str, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            held: false,
            detail: detail.into(),
        }
    }

    /// A check that held when `ok`.
    pub fn new(name: &str, ok: bool, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            held: ok,
            detail: detail.into(),
        }
    }
}

/// Totals over the faults of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    /// Faults injected.
    pub faults: usize,
    /// Faults after which a step completed within the hang deadline.
    pub recovered: usize,
    /// Faults after which none did.
    pub hangs: usize,
    /// Worker restarts the agents spent (`--max-restarts` budget used).
    pub restarts_spent: usize,
    /// Workers the agents killed as silent that the harness had not stopped.
    pub healthy_killed: usize,
    /// Median detection time in seconds.
    pub median_detect_s: Option<f64>,
    /// Median time from a fault to the next completed step, in seconds.
    pub median_next_step_s: Option<f64>,
    /// Median steps lost.
    pub median_steps_lost: Option<f64>,
    /// Steps lost over all faults.
    pub steps_lost: u64,
}

/// A point of the timeline: seconds from the start, and the step completed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// Seconds from the start of the run.
    pub t: f64,
    /// The step.
    pub step: u64,
}

/// The report of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The scenario.
    pub scenario: String,
    /// Its goal (the row of the targets table).
    pub goal: String,
    /// The seed.
    pub seed: u64,
    /// The workload.
    pub workload: String,
    /// Where the nodes ran.
    pub network: String,
    /// The world size at start.
    pub world_size: usize,
    /// Wall time of the faulty run in seconds.
    pub wall_s: f64,
    /// Every fault.
    pub faults: Vec<FaultRecord>,
    /// Totals and medians.
    pub totals: Totals,
    /// Every invariant.
    pub checks: Vec<Check>,
    /// Step against time.
    pub timeline: Vec<Point>,
    /// True when every invariant held.
    pub passed: bool,
    /// The first invariant that failed, as one line.
    pub reason: Option<String>,
}

/// The median of `v` (`None` for none).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

impl Totals {
    /// Totals over `faults`; the two counts come from the job's log.
    pub fn of(faults: &[FaultRecord], restarts_spent: usize, healthy_killed: usize) -> Totals {
        let pick = |f: fn(&FaultRecord) -> Option<f64>| -> Vec<f64> {
            faults.iter().filter_map(f).collect()
        };
        Totals {
            faults: faults.len(),
            recovered: faults.iter().filter(|f| f.recovered).count(),
            hangs: faults.iter().filter(|f| !f.recovered).count(),
            restarts_spent,
            healthy_killed,
            median_detect_s: median(&pick(|f| f.detected_after_s)),
            median_next_step_s: median(&pick(|f| f.next_step_after_s)),
            median_steps_lost: median(&pick(|f| f.steps_lost.map(|s| s as f64))),
            steps_lost: faults.iter().filter_map(|f| f.steps_lost).sum(),
        }
    }
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3}"))
}

impl Report {
    /// Fills `passed` and `reason` from the checks.
    pub fn conclude(&mut self) {
        let failed = self.checks.iter().find(|c| !c.held);
        self.passed = failed.is_none();
        self.reason = failed.map(|c| format!("{}: {}", c.name, c.detail));
    }

    /// The report as text tables (faults, totals, invariants).
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "chaos: scenario {} seed {} workload {} world {} ({})\n",
            self.scenario, self.seed, self.workload, self.world_size, self.network
        ));
        out.push_str(&format!("goal: {}\n\n", self.goal));
        out.push_str(
            "| # | fault | target | at s | step | detected s | next step s | steps lost | recovered |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|---|---|\n");
        for (i, f) in self.faults.iter().enumerate() {
            out.push_str(&format!(
                "| {} | {} | {} | {:.3} | {} | {} | {} | {} | {} |\n",
                i + 1,
                f.fault.kind(),
                f.fault.target(),
                f.at_s,
                f.step_before.map_or("-".into(), |s| s.to_string()),
                secs(f.detected_after_s),
                secs(f.next_step_after_s),
                f.steps_lost.map_or("-".into(), |s| s.to_string()),
                if f.recovered { "yes" } else { "NO" }
            ));
        }
        let t = &self.totals;
        out.push_str(&format!(
            "\nfaults {} | recovered {} | hangs {} | restarts spent {} | healthy processes killed {} | \
             median detection {} s | median next step {} s | median steps lost {} | steps lost {} | wall {:.1} s\n\n",
            t.faults,
            t.recovered,
            t.hangs,
            t.restarts_spent,
            t.healthy_killed,
            secs(t.median_detect_s),
            secs(t.median_next_step_s),
            t.median_steps_lost.map_or("-".into(), |x| format!("{x}")),
            t.steps_lost,
            self.wall_s
        ));
        out.push_str("| invariant | held | detail |\n|---|---|---|\n");
        for c in self.checks.iter().filter(|c| c.name != "log") {
            out.push_str(&format!(
                "| {} | {} | {} |\n",
                c.name,
                if c.held { "yes" } else { "NO" },
                c.detail.replace('\n', " ")
            ));
        }
        if let Some(log) = self.checks.iter().find(|c| c.name == "log") {
            out.push_str(&format!("\n{}\n", log.detail));
        }
        out.push_str(&match &self.reason {
            None => "\nPASS: every invariant held\n".to_string(),
            Some(r) => format!("\nFAIL: {r}\n"),
        });
        out
    }

    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The timeline as an SVG plot: step against seconds, faults as red lines (shaded while
    /// they last) labelled with their number and kind.
    pub fn svg(&self) -> String {
        crate::plot::timeline(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(detect: Option<f64>, next: Option<f64>, lost: Option<u64>, ok: bool) -> FaultRecord {
        FaultRecord {
            fault: Fault::KillWorker {
                node: 0,
                local_rank: 1,
            },
            at_s: 1.0,
            healed_at_s: None,
            step_before: Some(10),
            detected_after_s: detect,
            next_step_after_s: next,
            steps_lost: lost,
            recovered: ok,
        }
    }

    #[test]
    fn medians_and_totals() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        let t = Totals::of(
            &[
                rec(Some(0.1), Some(0.3), Some(0), true),
                rec(Some(0.2), Some(0.5), Some(2), true),
                rec(None, None, None, false),
            ],
            2,
            1,
        );
        assert_eq!((t.faults, t.recovered, t.hangs), (3, 2, 1));
        assert_eq!(t.median_detect_s, Some(0.15000000000000002));
        assert_eq!(t.median_next_step_s, Some(0.4));
        assert_eq!(t.median_steps_lost, Some(1.0));
        assert_eq!(
            (t.steps_lost, t.restarts_spent, t.healthy_killed),
            (2, 2, 1)
        );
    }

    #[test]
    fn a_failed_check_is_the_reason_and_shows_in_the_table_and_json() {
        let mut r = Report {
            scenario: "kill-worker".into(),
            goal: "g".into(),
            seed: 1,
            workload: "ddp".into(),
            network: "loopback".into(),
            world_size: 2,
            wall_s: 3.0,
            faults: vec![rec(Some(0.1), Some(0.3), Some(0), true)],
            totals: Totals::default(),
            checks: vec![
                Check::pass("exit", "0"),
                Check::fail("fingerprint", "abc != def"),
            ],
            timeline: vec![Point { t: 0.5, step: 1 }],
            passed: true,
            reason: None,
        };
        r.conclude();
        assert!(!r.passed);
        assert_eq!(r.reason.as_deref(), Some("fingerprint: abc != def"));
        let table = r.table();
        assert!(
            table.contains(
                "| 1 | kill-worker | node 0 local rank 1 | 1.000 | 10 | 0.100 | 0.300 | 0 | yes |"
            ),
            "{table}"
        );
        assert!(table.ends_with("FAIL: fingerprint: abc != def\n"));
        let json: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(json["passed"], false);
        assert_eq!(json["faults"][0]["fault"]["kind"], "kill-worker");
        assert!(r.svg().starts_with("<svg"));
    }
}
