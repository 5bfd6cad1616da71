#!/usr/bin/env python3
"""Summarise bench/long-run.sh runs (standard library only), and optionally plot them.

    python3 bench/long_run_summary.py RUNS_DIR
    python3 bench/long_run_summary.py --plot OUT.svg TITLE RUN_DIR [RUN_DIR ...]

Summary: for each run directory with a metrics.jsonl (`volley train`; one row per update) or a
learner.log (`volley learner`; a progress line every 2 s), prints the env steps at which the
last-100 mean return first reached the environment's solved threshold, the minimum of that mean
over the rest of the run (and where), the final value, and the ranges of entropy and gradient
norm after the first solve (train runs only). Plot: last-100 mean return against env steps for
each run directory, as a hand-written SVG.
"""
import json
import pathlib
import re
import sys

THRESHOLDS = {"cartpole": 475.0, "memory": 0.95, "milestones": 0.9}
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def threshold(name):
    for env, value in THRESHOLDS.items():
        if env in name:
            return value
    return None


def load(run):
    """Rows with env_steps, mean_return_100 and (train runs) entropy and grad_norm."""
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        rows = []
        with open(metrics) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break  # a line cut off by a stop
        return rows
    log = run / "learner.log"
    if log.exists():
        rows = []
        for line in open(log, errors="replace"):
            if "learner progress" not in line:
                continue
            steps = re.search(r"env_steps=(\d+)", line)
            ret = re.search(r"mean_return_100=([-\d.eE+]+)", line)
            if steps and ret:
                rows.append({"env_steps": int(steps.group(1)), "mean_return_100": float(ret.group(1))})
        return rows
    return None


def summarise(run):
    rows = load(run)
    if not rows:
        return None
    solved = threshold(run.name)
    first = next(
        (i for i, r in enumerate(rows) if r.get("mean_return_100") is not None and r["mean_return_100"] >= solved),
        None,
    )
    out = {"run": run.name, "env_steps": rows[-1]["env_steps"], "final": rows[-1].get("mean_return_100")}
    if first is None:
        return out
    after = [r for r in rows[first:] if r.get("mean_return_100") is not None]
    low = min(after, key=lambda r: r["mean_return_100"])
    out.update(first_solved=rows[first]["env_steps"], min_after=low["mean_return_100"], min_at=low["env_steps"])
    if "entropy" in rows[first]:
        entropy = [r["entropy"] for r in after]
        grad = [r["grad_norm"] for r in after]
        out.update(entropy=(min(entropy), max(entropy)), grad_norm=(min(grad), max(grad)))
    return out


def fmt(v, spec):
    return "-" if v is None else spec % v


def table(runs_dir):
    print("| run | env steps | first solved at | min last-100 after | at step | final last-100 | entropy after | grad norm after |")
    print("|---|---|---|---|---|---|---|---|")
    for run in sorted(p for p in pathlib.Path(runs_dir).iterdir() if p.is_dir()):
        s = summarise(run)
        if s is None:
            continue
        ent = s.get("entropy")
        grad = s.get("grad_norm")
        print(
            "| %s | %s | %s | %s | %s | %s | %s | %s |"
            % (
                s["run"],
                fmt(s["env_steps"], "%d"),
                fmt(s.get("first_solved"), "%d"),
                fmt(s.get("min_after"), "%.2f"),
                fmt(s.get("min_at"), "%d"),
                fmt(s["final"], "%.2f"),
                "%.3g–%.3g" % ent if ent else "-",
                "%.3g–%.3g" % grad if grad else "-",
            )
        )


def plot(out, title, runs):
    width, height, left, right, top, bottom = 760, 380, 60, 150, 30, 45
    series = []
    for run in runs:
        rows = [r for r in (load(pathlib.Path(run)) or []) if r.get("mean_return_100") is not None]
        # Thin to at most 2000 points, keeping each bucket's minimum (collapses stay visible).
        step = max(1, len(rows) // 2000)
        thin = [min(rows[i : i + step], key=lambda r: r["mean_return_100"]) for i in range(0, len(rows), step)]
        series.append((pathlib.Path(run).name, thin))
    max_x = max((r["env_steps"] for _, rows in series for r in rows), default=1)
    max_y = max((r["mean_return_100"] for _, rows in series for r in rows), default=1) * 1.05
    sx = lambda x: left + (width - left - right) * x / max_x
    sy = lambda y: top + (height - top - bottom) * (1 - y / max_y)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="14">{title}</text>',
        f'<line x1="{left}" y1="{sy(0)}" x2="{width - right}" y2="{sy(0)}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{sy(0)}" stroke="black"/>',
    ]
    for i in range(6):
        y = max_y * i / 5
        svg.append(f'<text x="{left - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.0f}</text>')
        x = max_x * i / 5
        svg.append(f'<text x="{sx(x)}" y="{sy(0) + 16}" text-anchor="middle">{x / 1e6:.1f}M</text>')
    svg.append(f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">env steps</text>')
    svg.append(f'<text x="14" y="{top + 10}" font-size="11">last-100 mean return</text>')
    for k, (name, rows) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        points = " ".join(f"{sx(r['env_steps']):.1f},{sy(r['mean_return_100']):.1f}" for r in rows)
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{points}"/>')
        svg.append(f'<text x="{width - right + 8}" y="{top + 16 * k + 10}" fill="{color}">{name}</text>')
    svg.append("</svg>")
    pathlib.Path(out).write_text("\n".join(svg))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        table(sys.argv[1])
