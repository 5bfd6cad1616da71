#!/usr/bin/env python3
"""Plots and tables from bench/stitched-bptt.sh runs (standard library only).

    python3 bench/plot_bptt.py EVIDENCE_DIR OUT_DIR

EVIDENCE_DIR holds delay-D/CONFIG/seedS run directories of `volley train` on the memory task.
For each delay it reads every run's metrics.jsonl (one row per update: env_steps, wall_secs,
mean_return_100, which on memory is the success rate of the last 100 episodes) and plots the
mean over seeds (line) and the min-max over seeds (band) against env steps and against wall
time, then prints a Markdown table: the success rate over the last 10% of updates per seed, its
mean with the half-width of the 95% confidence interval (Student t), env steps and seconds until
the last-100 success rate first reached 0.9, wall time, and the share of windows that were short
(from summary.json).
"""
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from plot_work import mean_ci, svg_plot  # noqa: E402

THRESHOLD = 0.9


def load(run_dir):
    rows = []
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row.get("mean_return_100") is not None:
                rows.append(row)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return rows, summary


def resample(rows, key, grid):
    """Success at each grid point: the last row at or before it (step function)."""
    out, i = [], 0
    for x in grid:
        while i + 1 < len(rows) and rows[i + 1][key] <= x:
            i += 1
        out.append(rows[i]["mean_return_100"] if rows and rows[i][key] <= x else float("nan"))
    return out


def config_order(name):
    # single first, then stitched windows by K.
    return (name != "single", len(name), name)


def delay_study(base, out):
    configs = sorted((p.name for p in base.iterdir() if p.is_dir()), key=config_order)
    runs = {}
    for c in configs:
        loaded = [load(d) for d in sorted((base / c).glob("seed*")) if (d / "metrics.jsonl").exists()]
        runs[c] = [r for r in loaded if r[0]]
    configs = [c for c in configs if runs[c]]
    if not configs:
        return []
    for key, xlabel, suffix in [("env_steps", "env steps", "steps"), ("wall_secs", "wall time (s)", "time")]:
        xmax = max(rows[-1][key] for rs in runs.values() for rows, _ in rs)
        grid = [xmax * i / 200 for i in range(201)]
        series = []
        for c in configs:
            curves = [resample(rows, key, grid) for rows, _ in runs[c]]
            lo = [min(v) for v in zip(*curves)]
            hi = [max(v) for v in zip(*curves)]
            mid = [sum(v) / len(v) for v in zip(*curves)]
            series.append((c, grid, lo, mid, hi))
        title = f"memory, delay {base.name.removeprefix('delay-')}: success rate vs {xlabel}"
        svg_plot(out / f"bptt-{base.name}-{suffix}.svg", title, xlabel, series, xmax,
                 ylabel="success rate (last 100 episodes)")
    table = []
    for c in configs:
        tails, steps_to, secs_to, walls, short = [], [], [], [], []
        for rows, summary in runs[c]:
            tail = rows[int(len(rows) * 0.9):]
            tails.append(sum(r["mean_return_100"] for r in tail) / len(tail))
            # Only once 100 episodes are in the window.
            hit = next((r for r in rows if r["episodes"] >= 100 and r["mean_return_100"] >= THRESHOLD), None)
            steps_to.append(hit["env_steps"] if hit else None)
            secs_to.append(hit["wall_secs"] if hit else None)
            walls.append(rows[-1]["wall_secs"])
            windows = summary.get("windows", {})
            total = sum(windows.values())
            short.append((total - windows.get("full", 0)) / total if total else 0.0)
        table.append((c, tails, steps_to, secs_to, walls, short, rows[-1]["env_steps"]))
    return table


def main():
    evidence, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for base in sorted((p for p in evidence.iterdir() if p.is_dir() and p.name.startswith("delay-")),
                       key=lambda p: int(p.name.removeprefix("delay-"))):
        table = delay_study(base, out)
        if not table:
            continue
        print(f"\nmemory (2 cues), {base.name.replace('-', ' ')}\n")
        print(f"| config | success, last 10% of updates (seeds) | mean ± 95% CI | env steps to {THRESHOLD} (seeds) "
              f"| s to {THRESHOLD} (seeds) | wall s (mean) | short windows | env steps per run |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for c, tails, steps_to, secs_to, walls, short, budget in table:
            fmt_steps = ", ".join("–" if s is None else f"{s / 1e3:.0f}K" for s in steps_to)
            fmt_secs = ", ".join("–" if s is None else f"{s:.0f}" for s in secs_to)
            print(f"| {c} | {', '.join(f'{t:.2f}' for t in tails)} | {mean_ci(tails)} | {fmt_steps} | {fmt_secs} "
                  f"| {sum(walls) / len(walls):.1f} | {sum(short) / len(short):.3f} | {budget / 1e6:.1f}M |")


if __name__ == "__main__":
    main()
