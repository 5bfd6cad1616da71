#!/usr/bin/env python3
"""Learning curves of bench/mujoco.sh runs (issue 14, docs/BENCHMARKS.md). Standard library only.

    python3 bench/plot_mujoco.py RUNS_DIR OUT.svg [marks, default 250000,500000,750000,1000000]

Reads RUNS_DIR/<env>-s<seed>/run/metrics.jsonl (written by `volley train --run-dir`), prints a
Markdown table per environment of the mean return of the last 100 episodes at env-step marks (each
seed, and the mean ± sample standard deviation over seeds), the final value and the wall seconds,
and writes one SVG with two panels per environment: the last-100 mean return against env steps and
against wall seconds, one line per seed.
"""
import json
import pathlib
import statistics
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def load(metrics: pathlib.Path):
    points = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("mean_return_100") is not None:
            points.append((row["env_steps"], row["wall_secs"], row["mean_return_100"]))
    return points


def at(points, steps):
    """The last value logged at or before `steps`."""
    before = [r for s, _, r in points if s <= steps]
    return before[-1] if before else None


def panel(svg, curves, title, x_of, x_label, x0, y0, w, h):
    xs = [x_of(p) for pts in curves.values() for p in pts]
    ys = [p[2] for pts in curves.values() for p in pts]
    x_hi = max(xs) or 1.0
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    svg.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    svg.append(f'<text x="{x0 + w / 2}" y="{y0 - 6}" text-anchor="middle" font-size="13">{title}</text>')
    svg.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 30}" text-anchor="middle" font-size="11">{x_label}</text>')
    for frac in (0.0, 0.5, 1.0):
        y = y0 + h - frac * h
        svg.append(f'<text x="{x0 - 4}" y="{y + 4}" text-anchor="end" font-size="10">{lo + frac * (hi - lo):.0f}</text>')
        x = x0 + frac * w
        svg.append(f'<text x="{x}" y="{y0 + h + 14}" text-anchor="middle" font-size="10">{frac * x_hi:,.0f}</text>')
    if lo < 0 < hi:
        y = y0 + h - (0 - lo) / (hi - lo) * h
        svg.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>')
    for i, (seed, pts) in enumerate(sorted(curves.items())):
        path = " ".join(
            f"{x0 + x_of(p) / x_hi * w:.1f},{y0 + h - (p[2] - lo) / (hi - lo) * h:.1f}" for p in pts
        )
        color = COLORS[i % len(COLORS)]
        svg.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        svg.append(f'<text x="{x0 + w - 4}" y="{y0 + 14 + 12 * i}" text-anchor="end" font-size="10" fill="{color}">seed {seed}</text>')


def main():
    runs = pathlib.Path(sys.argv[1])
    out = pathlib.Path(sys.argv[2])
    marks = [int(m) for m in sys.argv[3].split(",")] if len(sys.argv) > 3 else [250_000, 500_000, 750_000, 1_000_000]
    by_env = {}
    for metrics in sorted(runs.glob("*-s*/run/metrics.jsonl")):
        env, seed = metrics.parent.parent.name.rsplit("-s", 1)
        points = load(metrics)
        if points:
            by_env.setdefault(env, {})[int(seed)] = points
    w, h, left, top, gap = 360, 220, 60, 40, 70
    svg = []
    for row, (env, curves) in enumerate(sorted(by_env.items())):
        y0 = top + row * (h + gap)
        panel(svg, curves, f"{env}: last-100 mean return vs env steps", lambda p: p[0], "env steps", left, y0, w, h)
        panel(svg, curves, f"{env}: vs wall seconds", lambda p: p[1], "wall seconds", left + w + gap, y0, w, h)
        print(f"\n{env}\n")
        print("| seed | " + " | ".join(f"{m:,}" for m in marks) + " | final | env steps | wall s |")
        print("|---" * (len(marks) + 4) + "|")
        for seed, pts in sorted(curves.items()):
            cells = [at(pts, m) for m in marks]
            print(f"| {seed} | " + " | ".join("–" if c is None else f"{c:.0f}" for c in cells)
                  + f" | {pts[-1][2]:.0f} | {pts[-1][0]:,} | {pts[-1][1]:.0f} |")
        finals = [pts[-1][2] for pts in curves.values()]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"| mean ± sd | " + " | ".join(
            (lambda vals: "–" if not vals else f"{statistics.mean(vals):.0f}")([v for v in (at(p, m) for p in curves.values()) if v is not None])
            for m in marks) + f" | {statistics.mean(finals):.0f} ± {spread:.0f} | | |")
    width = left + 2 * w + gap + 20
    height = top + len(by_env) * (h + gap)
    out.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>' + "".join(svg) + "</svg>\n"
    )


if __name__ == "__main__":
    main()
