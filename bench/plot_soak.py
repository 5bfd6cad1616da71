#!/usr/bin/env python3
"""Plot and table from a bench/soak.sh run (standard library only: hand-written SVG).

    python3 bench/plot_soak.py SOAK_DIR OUT.svg

Reads SOAK_DIR/samples.csv and draws two panels against time: the resident set of every
process (MB), and the JetStream store (bytes on disk, the trajectory stream, the weights store;
MB). Prints a Markdown table of every fourth sample and the last one, and the range of each
figure after WARMUP_SECS (default 120), the numbers docs/BENCHMARKS.md quotes.
"""
import csv
import os
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
WIDTH, HEIGHT, MARGIN = 720, 260, 60


def load(path):
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def panel(title, rows, series, top):
    """One panel: `series` is [(label, values in MB)], drawn from y offset `top`."""
    t_max = max(r["secs"] for r in rows) or 1.0
    y_max = max(max(v) for _, v in series) * 1.1 or 1.0
    x = lambda t: MARGIN + (WIDTH - 2 * MARGIN) * t / t_max  # noqa: E731
    y = lambda v: top + HEIGHT - MARGIN / 2 - (HEIGHT - MARGIN) * v / y_max  # noqa: E731
    out = [f'<text x="{MARGIN}" y="{top + 16}" font-size="14">{title}</text>']
    out.append(f'<line x1="{MARGIN}" y1="{y(0)}" x2="{WIDTH - MARGIN}" y2="{y(0)}" stroke="black"/>')
    out.append(f'<line x1="{MARGIN}" y1="{y(0)}" x2="{MARGIN}" y2="{y(y_max)}" stroke="black"/>')
    for frac in (0.0, 0.5, 1.0):
        v = y_max * frac
        out.append(f'<text x="{MARGIN - 6}" y="{y(v) + 4}" font-size="10" text-anchor="end">{v:.0f}</text>')
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        t = t_max * frac
        out.append(f'<text x="{x(t)}" y="{y(0) + 14}" font-size="10" text-anchor="middle">{t:.0f} s</text>')
    for i, (label, values) in enumerate(series):
        points = " ".join(f"{x(r['secs']):.1f},{y(v):.1f}" for r, v in zip(rows, values))
        color = COLORS[i % len(COLORS)]
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out.append(f'<text x="{WIDTH - MARGIN + 4}" y="{top + 40 + 14 * i}" font-size="10" fill="{color}">{label}</text>')
    return out


def main(soak_dir, out_path, warmup=120.0):
    rows = load(os.path.join(soak_dir, "samples.csv"))
    mb_kib = lambda k: [r[k] / 1024 for r in rows]  # noqa: E731
    mb = lambda k: [r[k] / 1e6 for r in rows]  # noqa: E731
    rss = [("learner", mb_kib("learner_rss_kib"))]
    rss += [(f"actor {i}", mb_kib(f"actor{i}_rss_kib")) for i in range(3)]
    rss += [("nats-server", mb_kib("nats_rss_kib"))]
    store = [("store on disk", [r["store_disk_kib"] * 1024 / 1e6 for r in rows]),
             ("trajectory stream", mb("traj_bytes")), ("weights store", mb("weights_bytes"))]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH + 80}" height="{2 * HEIGHT}" font-family="sans-serif">']
    svg += panel("Resident set (MB)", rows, rss, 0)
    svg += panel("JetStream store (MB)", rows, store, HEIGHT)
    svg.append("</svg>")
    with open(out_path, "w") as f:
        f.write("\n".join(svg) + "\n")
    print("| secs | learner RSS | actor RSS (×3) | nats-server RSS | weights store msgs / bytes "
          "| trajectory stream msgs / bytes | store on disk |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        if i % 4 and i != len(rows) - 1:
            continue
        actors = " · ".join(f"{r[f'actor{j}_rss_kib'] / 1024:.1f}" for j in range(3))
        print(f"| {r['secs']:.0f} | {r['learner_rss_kib'] / 1024:.1f} MB | {actors} MB | {r['nats_rss_kib'] / 1024:.1f} MB "
              f"| {r['weights_msgs']:.0f} / {r['weights_bytes'] / 1e3:.1f} KB "
              f"| {r['traj_msgs']:.0f} / {r['traj_bytes'] / 1e6:.1f} MB | {r['store_disk_kib'] / 1024:.0f} MB |")
    after = [r for r in rows if r["secs"] >= warmup]
    print(f"\nranges from {warmup:.0f} s on ({len(after)} samples):")
    for key, scale, unit in [("learner_rss_kib", 1 / 1024, "MB"), ("actor0_rss_kib", 1 / 1024, "MB"),
                             ("actor1_rss_kib", 1 / 1024, "MB"), ("actor2_rss_kib", 1 / 1024, "MB"),
                             ("nats_rss_kib", 1 / 1024, "MB"), ("store_disk_kib", 1 / 1024, "MB"),
                             ("traj_bytes", 1e-6, "MB"), ("traj_msgs", 1, "msgs"),
                             ("weights_msgs", 1, "msgs"), ("weights_bytes", 1e-3, "KB"), ("store_bytes", 1e-6, "MB")]:
        values = [r[key] * scale for r in after]
        if values:
            print(f"  {key}: {min(values):.1f} - {max(values):.1f} {unit}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(os.environ.get("WARMUP_SECS", "120")))
