#!/usr/bin/env python3
"""Plots and a table from bench/work-evidence.sh runs (standard library only: hand-written SVG).

    python3 bench/plot_work.py EVIDENCE_DIR OUT_DIR

For each study (milestones, memory) and each configuration, it reads seed*/work.jsonl and plots
the evaluation metric against env steps and against wall time: the mean over seeds as a line,
the min-max over seeds as a band. Evaluation metric: the fresh-start success rate (episodes that
did not start from a saved state; window of 50 episodes per task, Beta(1,1)-smoothed), for
milestones on the hardest task (4 rooms) and averaged over tasks, for memory averaged over the
four delays. Prints a Markdown table of final values and steps to thresholds.
"""
import json
import math
import pathlib
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def load(run_dir):
    rows = []
    with open(run_dir / "work.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
    return rows


def metric(row, which):
    tasks = row["tasks"]
    if which == "hardest":
        return tasks[-1]["fresh_success"]
    if which.startswith("members:"):
        # A chosen subset of the task list, e.g. "members:1,2" (the learnable members).
        tasks = [tasks[int(i)] for i in which.split(":", 1)[1].split(",")]
    return sum(t["fresh_success"] for t in tasks) / len(tasks)


def resample(rows, key, which, grid):
    """Metric at each grid point: the last row at or before it (step function)."""
    out, i = [], 0
    for x in grid:
        while i + 1 < len(rows) and rows[i + 1][key] <= x:
            i += 1
        out.append(metric(rows[i], which) if rows[i][key] <= x else float("nan"))
    return out


def svg_plot(path, title, xlabel, series, xmax, ylabel="fresh-start success rate"):
    w, h, left, right, top, bottom = 640, 380, 60, 170, 40, 50
    pw, ph = w - left - right, h - top - bottom
    sx = lambda x: left + pw * x / xmax
    sy = lambda y: top + ph * (1 - y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14">{title}</text>',
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>',
        f'<text x="{left + pw / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
        f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" text-anchor="middle">'
        f"{ylabel}</text>",
    ]
    for k in range(6):
        y = k / 5
        parts.append(f'<line x1="{left - 4}" y1="{sy(y)}" x2="{left + pw}" y2="{sy(y)}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 8}" y="{sy(y) + 4}" text-anchor="end">{y:.1f}</text>')
    for k in range(5):
        x = xmax * k / 4
        label = f"{x / 1e3:.0f}K" if xlabel.startswith("env") else f"{x:.1f}"
        parts.append(f'<text x="{sx(x)}" y="{top + ph + 16}" text-anchor="middle">{label}</text>')
    for idx, (name, grid, lo, mid, hi) in enumerate(series):
        color = COLORS[idx % len(COLORS)]
        pts = [(x, a, m, b) for x, a, m, b in zip(grid, lo, mid, hi) if not math.isnan(m)]
        if not pts:
            continue
        band = " ".join(f"{sx(x):.1f},{sy(b):.1f}" for x, _, _, b in pts)
        band += " " + " ".join(f"{sx(x):.1f},{sy(a):.1f}" for x, a, _, _ in reversed(pts))
        parts.append(f'<polygon points="{band}" fill="{color}" fill-opacity="0.15" stroke="none"/>')
        line = " ".join(f"{sx(x):.1f},{sy(m):.1f}" for x, _, m, _ in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        ly = top + 10 + 18 * idx
        parts.append(f'<line x1="{left + pw + 10}" y1="{ly}" x2="{left + pw + 30}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{left + pw + 35}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def study(evidence, out, name, which, title, threshold):
    base = evidence / name
    configs = sorted(p.name for p in base.iterdir() if p.is_dir())
    runs = {c: [load(d) for d in sorted((base / c).glob("seed*")) if (d / "work.jsonl").exists()] for c in configs}
    table = []
    for key, xlabel, suffix in [("env_steps", "env steps", "steps"), ("secs", "wall time (s)", "time")]:
        xmax = max(r[-1][key] for rs in runs.values() for r in rs)
        grid = [xmax * i / 200 for i in range(201)]
        series = []
        for c in configs:
            curves = [resample(r, key, which, grid) for r in runs[c]]
            lo = [min(v) for v in zip(*curves)]
            hi = [max(v) for v in zip(*curves)]
            mid = [sum(v) / len(v) for v in zip(*curves)]
            series.append((c, grid, lo, mid, hi))
        tag = which.replace(":", "-").replace(",", "")
        svg_plot(out / f"work-{name}-{tag}-{suffix}.svg", title, xlabel, series, xmax)
    for c in configs:
        finals = [metric(r[-1], which) for r in runs[c]]
        # Mean over the last 10% of updates, per seed: less noisy than the last row alone.
        tails = []
        for r in runs[c]:
            tail = r[int(len(r) * 0.9):]
            tails.append(sum(metric(x, which) for x in tail) / len(tail))
        steps_to = []
        for r in runs[c]:
            # Only once every task's window is full, so the prior's ½ does not count.
            hit = next(
                (x["env_steps"] for x in r
                 if min(t["fresh_episodes"] for t in x["tasks"]) >= 50 and metric(x, which) >= threshold),
                None,
            )
            steps_to.append(hit)
        # Area under the curve: the mean of the metric over the whole env-step budget (the
        # curve resampled on a grid of 100 points), per seed; learning sooner scores higher.
        areas = []
        for r in runs[c]:
            budget = r[-1]["env_steps"]
            grid = [budget * (i + 0.5) / 100 for i in range(100)]
            values = [v for v in resample(r, "env_steps", which, grid) if v == v]
            areas.append(sum(values) / len(values))
        secs = [r[-1]["secs"] for r in runs[c]]
        table.append((c, tails, areas, steps_to, secs, [r[-1]["items_resume"] / max(1, r[-1]["items_fresh"] + r[-1]["items_resume"]) for r in runs[c]]))
    return table


# Two-sided 95% Student-t quantiles by degrees of freedom (1..10).
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def mean_ci(values):
    """Mean ± the half-width of its 95% confidence interval (Student t over seeds)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return f"{mean:.2f}"
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = T95[min(n - 1, len(T95)) - 1]
    return f"{mean:.2f} ± {t * sd / math.sqrt(n):.2f}"


def diff_ci(a, b):
    """Mean of a − b ± the half-width of its 95% confidence interval (Welch's t)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    if se2 == 0:
        return f"{ma - mb:+.2f} ± 0.00"
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    t = T95[min(max(int(df), 1), len(T95)) - 1]
    return f"{ma - mb:+.2f} ± {t * math.sqrt(se2):.2f}"


def main():
    evidence, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name, which, title, threshold in [
        ("chain-restarts", "mean", "milestones 5x6, 24 steps per room: fresh-start success", 0.5),
        ("family-budget", "members:1,2", "task family: the learnable members (3x6, 4x6): fresh-start success", 0.9),
        ("family-budget", "mean", "task family (1x4, 3x6, 4x6 and six too-hard chains): mean fresh-start success", 0.3),
        ("milestones-restarts", "mean", "milestones 3x6, fresh-start success", 0.2),
        ("milestones-tasks", "hardest", "milestones, 4-room task (tasks: 2, 3, 4 rooms)", 0.2),
        ("milestones-tasks", "mean", "milestones, mean over 2/3/4-room tasks", 0.2),
        ("memory-tasks", "mean", "memory (4 cues), mean over delays 4/16/64/256", 0.6),
        ("group-baseline", "mean", "milestones 4x8: critic vs group baseline (K = 8), fresh-start success", 0.5),
        ("group-filter", "mean", "milestones 4x8, group rollouts: without vs with the zero-variance filter", 0.5),
    ]:
        if not (evidence / name).exists():
            continue
        table = study(evidence, out, name, which, title, threshold)
        print(f"\n{title}\n")
        print(
            f"| config | fresh success, last 10% of updates (seeds) | mean ± 95% CI | area under the curve (seeds) "
            f"| mean ± 95% CI | env steps to {threshold} (seeds) | wall s | restart share |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for c, tails, areas, steps_to, secs, restart in table:
            fmt_steps = ", ".join("–" if s is None else f"{s / 1e3:.0f}K" for s in steps_to)
            print(
                f"| {c} | {', '.join(f'{t:.2f}' for t in tails)} | {mean_ci(tails)} | "
                f"{', '.join(f'{a:.2f}' for a in areas)} | {mean_ci(areas)} | {fmt_steps} | "
                f"{sum(secs) / len(secs):.1f} | {sum(restart) / len(restart):.2f} |"
            )
        if len(table) == 2 and min(len(table[0][2]), len(table[1][2])) >= 2:
            (a, _, area_a, *_), (b, _, area_b, *_) = table
            print(f"\nArea under the curve, {a} − {b}: {diff_ci(area_a, area_b)} (95% CI, Welch)")


if __name__ == "__main__":
    main()
