//! The timeline plot of a report: step against wall time, faults marked.

use crate::report::Report;

const W: f64 = 900.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round tick step giving about `n` ticks over `span`.
fn tick(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|t| *t >= raw)
        .unwrap_or(10.0 * mag)
}

/// The SVG document.
pub fn timeline(r: &Report) -> String {
    let t_max = r
        .timeline
        .iter()
        .map(|p| p.t)
        .chain(r.faults.iter().map(|f| f.healed_at_s.unwrap_or(f.at_s)))
        .fold(r.wall_s.max(1.0), f64::max);
    let s_max = r.timeline.iter().map(|p| p.step).max().unwrap_or(1).max(1) as f64;
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let x = |t: f64| LEFT + t / t_max * pw;
    let y = |s: f64| TOP + ph - s / s_max * ph;
    let mut o = String::new();
    o.push_str(&format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n"
    ));
    o.push_str(&format!(
        "<rect x=\"0\" y=\"0\" width=\"{W}\" height=\"{H}\" fill=\"white\"/>\n"
    ));
    o.push_str(&format!(
        "<text x=\"{LEFT}\" y=\"22\" font-size=\"14\">{} (seed {}, {}): {}</text>\n",
        esc(&r.scenario),
        r.seed,
        esc(&r.workload),
        if r.passed {
            "every invariant held"
        } else {
            "FAILED"
        }
    ));
    // Axes and ticks.
    o.push_str(&format!(
        "<line x1=\"{LEFT}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        TOP + ph,
        LEFT + pw,
        TOP + ph
    ));
    o.push_str(&format!(
        "<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{}\" stroke=\"black\"/>\n",
        TOP + ph
    ));
    let dt = tick(t_max, 8.0);
    let mut t = 0.0;
    while t <= t_max + 1e-9 {
        o.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{1}\" x2=\"{0:.1}\" y2=\"{2}\" stroke=\"#ddd\"/><text x=\"{0:.1}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
            x(t),
            TOP,
            TOP + ph,
            TOP + ph + 16.0,
            fmt_num(t)
        ));
        t += dt;
    }
    let ds = tick(s_max, 6.0);
    let mut s = 0.0;
    while s <= s_max + 1e-9 {
        o.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#ddd\"/><text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{4}</text>\n",
            y(s),
            LEFT + pw,
            LEFT - 6.0,
            y(s) + 4.0,
            fmt_num(s)
        ));
        s += ds;
    }
    o.push_str(&format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">seconds</text>\n",
        LEFT + pw / 2.0,
        H - 12.0
    ));
    o.push_str(&format!(
        "<text x=\"16\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {0})\">step</text>\n",
        TOP + ph / 2.0
    ));
    // Faults.
    for (i, f) in r.faults.iter().enumerate() {
        if let Some(end) = f.healed_at_s {
            o.push_str(&format!(
                "<rect x=\"{:.1}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{ph}\" fill=\"#f4b6b6\" fill-opacity=\"0.5\"/>\n",
                x(f.at_s),
                (x(end) - x(f.at_s)).max(1.0)
            ));
        }
        o.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{1}\" x2=\"{0:.1}\" y2=\"{2}\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/><text x=\"{3:.1}\" y=\"{4}\" fill=\"#c00\" font-size=\"10\">{5} {6}</text>\n",
            x(f.at_s),
            TOP,
            TOP + ph,
            x(f.at_s) + 2.0,
            TOP + 10.0 + 11.0 * (i % 4) as f64,
            i + 1,
            esc(f.fault.kind())
        ));
    }
    // The step curve.
    if !r.timeline.is_empty() {
        let pts: Vec<String> = r
            .timeline
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.t), y(p.step as f64)))
            .collect();
        o.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"#1f5fbf\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
    }
    o.push_str("</svg>\n");
    o
}

fn fmt_num(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick(10.0, 5.0), 2.0);
        assert_eq!(tick(1500.0, 6.0), 500.0);
        assert_eq!(tick(0.7, 7.0), 0.1);
    }
}
