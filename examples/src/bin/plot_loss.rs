//! Draws a loss curve CSV (as the elastic loop's `--loss-csv` writes it: a header, then
//! `step,epoch,loss,...` rows) as an SVG line chart:
//!
//! ```text
//! cargo run --release -p rekindle-examples --bin plot_loss -- loss.csv docs/data/loss.svg
//! ```
//!
//! Rows of a step seen twice (a step redone after a fault) keep the last value. Vertical
//! marks show where the world size changed.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        bail!("usage: plot_loss LOSS_CSV OUT_SVG");
    };
    let text = std::fs::read_to_string(input).with_context(|| format!("reading {input}"))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().context("empty CSV")?.split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (Some(step_col), Some(loss_col)) = (col("step"), col("loss")) else {
        bail!("{input}: needs `step` and `loss` columns, has {header:?}");
    };
    let world_col = col("world_size");
    let mut points: BTreeMap<u64, (f64, Option<u64>)> = BTreeMap::new();
    for (n, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').collect();
        let parse_err = || format!("{input}: line {}: {line:?}", n + 2);
        let step: u64 = f
            .get(step_col)
            .and_then(|s| s.parse().ok())
            .with_context(parse_err)?;
        let Some(loss) = f.get(loss_col).and_then(|s| s.parse::<f64>().ok()) else {
            continue;
        };
        let world = world_col
            .and_then(|c| f.get(c))
            .and_then(|s| s.parse().ok());
        points.insert(step, (loss, world));
    }
    if points.len() < 2 {
        bail!("{input}: fewer than two points to draw");
    }
    let (w, h, left, right, top, bottom) = (720.0, 360.0, 60.0, 20.0, 20.0, 40.0);
    let (x0, x1) = (
        *points.keys().next().unwrap_or(&0) as f64,
        *points.keys().last().unwrap_or(&1) as f64,
    );
    let ymax = points.values().map(|p| p.0).fold(f64::MIN, f64::max) * 1.05;
    let ymin = 0.0;
    let sx = |x: f64| left + (x - x0) / (x1 - x0).max(1.0) * (w - left - right);
    let sy = |y: f64| top + (1.0 - (y - ymin) / (ymax - ymin).max(1e-12)) * (h - top - bottom);
    let mut svg = String::new();
    writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    )?;
    writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#)?;
    // Axes and ticks.
    writeln!(
        svg,
        r#"<path d="M{left},{top} V{} H{}" stroke="black" fill="none"/>"#,
        h - bottom,
        w - right
    )?;
    for i in 0..=4 {
        let y = ymin + (ymax - ymin) * i as f64 / 4.0;
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{y:.2}</text><path d="M{left},{} h-4" stroke="black"/>"##,
            left - 6.0,
            sy(y) + 4.0,
            sy(y)
        )?;
        let x = x0 + (x1 - x0) * i as f64 / 4.0;
        writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{x:.0}</text>"#,
            sx(x),
            h - bottom + 16.0
        )?;
    }
    writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
        (left + w - right) / 2.0,
        h - 6.0
    )?;
    writeln!(
        svg,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">loss</text>"#,
        (top + h - bottom) / 2.0,
        (top + h - bottom) / 2.0
    )?;
    // World-size changes.
    let mut last_world = None;
    for (&step, &(_, world)) in &points {
        if world.is_some() && last_world.is_some() && world != last_world {
            writeln!(
                svg,
                r##"<path d="M{x},{top} V{}" stroke="#999" stroke-dasharray="4 3"/><text x="{}" y="{}" fill="#666">world {}</text>"##,
                h - bottom,
                sx(step as f64) + 4.0,
                top + 12.0,
                world.unwrap_or(0),
                x = sx(step as f64)
            )?;
        }
        last_world = world;
    }
    let mut d = String::new();
    for (i, (&step, &(loss, _))) in points.iter().enumerate() {
        let cmd = if i == 0 { 'M' } else { 'L' };
        write!(d, "{cmd}{:.1},{:.1} ", sx(step as f64), sy(loss))?;
    }
    writeln!(
        svg,
        r##"<path d="{d}" stroke="#1f77b4" stroke-width="1.5" fill="none"/>"##
    )?;
    writeln!(svg, "</svg>")?;
    std::fs::write(output, svg).with_context(|| format!("writing {output}"))?;
    println!("wrote {output} ({} points)", points.len());
    Ok(())
}
