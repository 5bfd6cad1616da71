#!/usr/bin/env python3
"""Curves and a table from `volley train` runs on Atari (standard library only: hand-written SVG).

    python3 bench/plot_atari.py OUT_PREFIX LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--marks 250000,500000]

Each RUN_DIR holds the metrics.jsonl that `volley train --run-dir` writes. Writes
OUT_PREFIX-frames.svg and OUT_PREFIX-time.svg: the last-100-episode mean return of each run
against frames (4 per agent step: ALE's frame skip) and against wall time, with the +18 target
dashed. Prints a Markdown table per run at the agent-step marks (default: every 200 K) and its
last row.
"""
import json
import pathlib
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
FRAMES_PER_STEP = 4
TARGET = 18.0


def load(run_dir):
    rows = []
    with open(pathlib.Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line the run was still writing
            if row.get("mean_return_100") is not None:
                rows.append(row)
    return rows


def svg_plot(path, title, xlabel, series, xmax, xfmt):
    w, h, left, right, top, bottom = 640, 400, 70, 20, 40, 50
    ymin, ymax = -21.0, 21.0
    pw, ph = w - left - right, h - top - bottom

    def x(v):
        return left + pw * v / xmax

    def y(v):
        return top + ph * (ymax - v) / (ymax - ymin)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           f'<path d="M{left} {top} V{top + ph} H{left + pw}" fill="none" stroke="black"/>']
    for i in range(5):
        xv = xmax * i / 4
        out.append(f'<text x="{x(xv):.1f}" y="{top + ph + 18}" text-anchor="middle">{xfmt(xv)}</text>')
    for yv in (-20, -10, 0, 10, 20):
        out.append(f'<path d="M{left} {y(yv):.1f} H{left + pw}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(yv) + 4:.1f}" text-anchor="end">{yv}</text>')
    out.append(f'<path d="M{left} {y(TARGET):.1f} H{left + pw}" stroke="#c33" stroke-dasharray="6 4"/>')
    out.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">{xlabel}</text>')
    for i, (label, points) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        points = points[::max(1, len(points) // 400)] + points[-1:]  # at most about 400 points
        d = " ".join(f"{'M' if j == 0 else 'L'}{x(px):.1f} {y(py):.1f}" for j, (px, py) in enumerate(points))
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out.append(f'<text x="{left + 10}" y="{top + 16 + 16 * i}" fill="{color}">{label}</text>')
    out.append("</svg>")
    pathlib.Path(path).write_text("\n".join(out) + "\n")


def table(label, rows, marks):
    print(f"\n{label}\n")
    print("| agent steps | frames | wall s | episodes | last-20 return | last-100 return | policy entropy | explained variance |")
    print("|---|---|---|---|---|---|---|---|")
    picked, next_mark = [], 0
    for row in rows:
        while next_mark < len(marks) and row["env_steps"] >= marks[next_mark]:
            picked.append(row)
            next_mark += 1
    if rows and (not picked or picked[-1] is not rows[-1]):
        picked.append(rows[-1])
    for row in picked:
        steps = row["env_steps"]
        print(f"| {steps:,} | {steps * FRAMES_PER_STEP / 1e6:.2f} M | {row['wall_secs']:,.0f} | {row['episodes']:,} | "
              f"{row['mean_return_20']:.2f} | {row['mean_return_100']:.2f} | {row['entropy']:.3f} | "
              f"{row['explained_variance']:.2f} |")


def main():
    args = sys.argv[1:]
    marks = None
    if "--marks" in args:
        i = args.index("--marks")
        marks = [int(m) for m in args[i + 1].split(",")]
        del args[i:i + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    prefix, runs = args[0], [a.split("=", 1) for a in args[1:]]
    loaded = [(label, load(run_dir)) for label, run_dir in runs]
    max_steps = max(r[-1]["env_steps"] for _, r in loaded if r)
    max_secs = max(r[-1]["wall_secs"] for _, r in loaded if r)
    marks = marks or list(range(200_000, max_steps + 1, 200_000))
    frames = [(label, [(r["env_steps"] * FRAMES_PER_STEP, r["mean_return_100"]) for r in rows]) for label, rows in loaded]
    times = [(label, [(r["wall_secs"] / 60, r["mean_return_100"]) for r in rows]) for label, rows in loaded]
    svg_plot(f"{prefix}-frames.svg", "Pong through the service: last-100 mean return", "frames",
             frames, max_steps * FRAMES_PER_STEP, lambda v: f"{v / 1e6:.1f}M")
    svg_plot(f"{prefix}-time.svg", "Pong through the service: last-100 mean return", "wall time (minutes)",
             times, max_secs / 60, lambda v: f"{v:.0f}")
    for label, rows in loaded:
        table(label, rows, marks)


if __name__ == "__main__":
    main()
