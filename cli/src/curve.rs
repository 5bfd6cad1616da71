//! The learning curve as a self-contained SVG (mean return of the last 20 episodes against
//! environment steps), so a run directory can be looked at without any plotting tool.

use std::fmt::Write as _;
use std::path::Path;

/// One point of the curve.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    /// Environment steps consumed.
    pub env_steps: u64,
    /// Mean return of the last 20 episodes.
    pub mean_return: f32,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// Render the curve; `target` draws a dashed threshold line.
pub fn render_svg(points: &[Point], target: Option<f32>, title: &str) -> String {
    let max_steps = points.iter().map(|p| p.env_steps).max().unwrap_or(1).max(1) as f64;
    let values = points.iter().map(|p| p.mean_return as f64).chain(target.map(|t| t as f64));
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    lo = lo.min(0.0);
    if hi - lo < 1e-9 {
        hi = lo + 1.0;
    }
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |steps: f64| LEFT + steps / max_steps * plot_w;
    let y = |v: f64| TOP + (1.0 - (v - lo) / (hi - lo)) * plot_h;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{} — mean return (last 20 episodes)</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    // Axes with five ticks each.
    let _ =
        writeln!(svg, r#"<path d="M{LEFT} {TOP} V{} H{}" fill="none" stroke="black"/>"#, TOP + plot_h, LEFT + plot_w);
    for i in 0..=4 {
        let frac = i as f64 / 4.0;
        let steps = frac * max_steps;
        let value = lo + frac * (hi - lo);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x(steps),
            TOP + plot_h + 18.0,
            human(steps)
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{:.1}</text>"#,
            LEFT - 6.0,
            y(value) + 4.0,
            value
        );
        let _ = writeln!(svg, r##"<path d="M{LEFT} {:.1} H{:.1}" stroke="#ddd"/>"##, y(value), LEFT + plot_w);
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">environment steps</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 10.0
    );
    if let Some(target) = target {
        let _ = writeln!(
            svg,
            r##"<path d="M{LEFT} {:.1} H{:.1}" stroke="#c33" stroke-dasharray="6 4"/>"##,
            y(target as f64),
            LEFT + plot_w
        );
    }
    if !points.is_empty() {
        let mut path = String::new();
        for (i, p) in points.iter().enumerate() {
            let _ = write!(
                path,
                "{}{:.1} {:.1}",
                if i == 0 { "M" } else { " L" },
                x(p.env_steps as f64),
                y(p.mean_return as f64)
            );
        }
        let _ = writeln!(svg, r##"<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>"##);
    }
    svg.push_str("</svg>\n");
    svg
}

/// Render and write the curve to `path`.
pub fn write_svg(path: &Path, points: &[Point], target: Option<f32>, title: &str) -> std::io::Result<()> {
    std::fs::write(path, render_svg(points, target, title))
}

fn human(steps: f64) -> String {
    if steps >= 1e6 {
        format!("{:.1}M", steps / 1e6)
    } else if steps >= 1e3 {
        format!("{:.0}K", steps / 1e3)
    } else {
        format!("{steps:.0}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_polyline_vertex_per_point() {
        let points: Vec<Point> = (0..5).map(|i| Point { env_steps: i * 100, mean_return: i as f32 * 10.0 }).collect();
        let svg = render_svg(&points, Some(475.0), "cartpole");
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        let curve = svg.lines().find(|l| l.contains("stroke=\"#1f77b4\"")).expect("curve path");
        assert_eq!(curve.matches(" L").count(), 4);
    }

    #[test]
    fn empty_curve_still_renders_axes() {
        let svg = render_svg(&[], None, "a<b");
        assert!(svg.contains("a&lt;b"));
        assert!(!svg.contains("NaN"));
    }
}
