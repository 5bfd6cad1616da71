#!/usr/bin/env python3
"""Learning curves of the MinAtar conv-torso runs (issue 15, docs/BENCHMARKS.md).

Reads `<runs>/minatar-<game>-s<seed>/metrics.jsonl` (written by `volley train --run-dir`), prints a
Markdown table of the mean return of the last 100 episodes at fixed env-step marks (mean over
seeds, and each seed), and writes an SVG with one panel per game and one line per seed.
Standard library only.

    python3 scripts/minatar_curves.py <runs dir> docs/img/minatar-conv-curves.svg [marks, e.g. 500000,1000000]
"""
import json
import pathlib
import sys

GAMES = ["breakout", "asterix", "freeway", "seaquest", "space-invaders"]
MARKS = [100_000, 250_000, 500_000, 750_000, 1_000_000]
COLORS = ["#1f77b4", "#d62728", "#2ca02c"]


def load(run: pathlib.Path):
    points = []
    for line in run.joinpath("metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("mean_return_100") is not None:
            points.append((row["env_steps"], row["mean_return_100"]))
    return points


def at(points, steps):
    """The last value logged at or before `steps`."""
    before = [r for s, r in points if s <= steps]
    return before[-1] if before else None


def panel(svg, points_by_seed, game, x0, y0, w, h):
    max_steps = max(s for pts in points_by_seed.values() for s, _ in pts)
    hi = max(r for pts in points_by_seed.values() for _, r in pts)
    hi = max(hi, 1e-6) * 1.05
    svg.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    svg.append(f'<text x="{x0 + w / 2}" y="{y0 - 6}" text-anchor="middle" font-size="13">{game}</text>')
    for frac in (0, 0.5, 1):
        y = y0 + h - frac * h
        svg.append(f'<text x="{x0 - 4}" y="{y + 4}" text-anchor="end" font-size="10">{hi * frac:.1f}</text>')
        x = x0 + frac * w
        svg.append(f'<text x="{x}" y="{y0 + h + 13}" text-anchor="middle" font-size="10">{max_steps * frac / 1e6:.1f}M</text>')
    for idx, (seed, pts) in enumerate(sorted(points_by_seed.items())):
        path = " ".join(f"{x0 + s / max_steps * w:.1f},{y0 + h - r / hi * h:.1f}" for s, r in pts[:: max(1, len(pts) // 300)])
        svg.append(f'<polyline fill="none" stroke="{COLORS[idx % 3]}" stroke-width="1.2" points="{path}"><title>seed {seed}</title></polyline>')


def main():
    global MARKS
    runs = pathlib.Path(sys.argv[1])
    out = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else None
    if len(sys.argv) > 3:
        MARKS = [int(m) for m in sys.argv[3].split(",")]
    data = {}
    for game in GAMES:
        for run in sorted(runs.glob(f"minatar-{game}-s*")):
            if run.is_dir() and run.joinpath("summary.json").exists():
                data.setdefault(game, {})[run.name.rsplit("-s", 1)[1]] = load(run)
    print("| game | seeds | " + " | ".join(f"{m / 1e6:g}M" for m in MARKS) + " | final (each seed) |")
    print("|---|---|" + "---|" * len(MARKS) + "---|")
    for game, by_seed in data.items():
        cells = []
        for mark in MARKS:
            values = [v for v in (at(p, mark) for p in by_seed.values()) if v is not None]
            cells.append(f"{sum(values) / len(values):.2f}" if values else "")
        finals = ", ".join(f"{p[-1][1]:.2f}" for _, p in sorted(by_seed.items()))
        print(f"| {game} | {len(by_seed)} | " + " | ".join(cells) + f" | {finals} |")
    if out:
        w, h, pad = 220, 150, 50
        svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{len(data) * (w + pad) + pad}" height="{h + 110}" font-family="sans-serif">']
        svg.append(f'<text x="10" y="16" font-size="13">MinAtar, conv torso (3x3x16 conv, 128 ReLU), V-trace: mean return of the last 100 episodes vs env steps, one line per seed</text>')
        for i, (game, by_seed) in enumerate(data.items()):
            panel(svg, by_seed, game, pad + i * (w + pad), 50, w, h)
        svg.append("</svg>")
        out.write_text("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
