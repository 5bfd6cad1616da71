#!/usr/bin/env python3
"""Screen candidate defaults: run `volley train --env <env>` with each arm's extra flags over
environments and seeds, and print one Markdown row per arm and environment (issue 45: the
Pendulum sweep and the MinAtar screen behind the per-family defaults).

usage: bench/sweep.py --envs pendulum --seeds 1..5 --frames 150000 --out DIR \
                      --arm "base=" --arm "lr2e-3=--learning-rate 2e-3" [--jobs 2] [--volley BIN]

Every arm runs with the same budget (`--max-env-steps FRAMES`) and the same seeds, in the same
sitting, so the arms are paired. A run goes to OUT/<arm>/<env>-s<seed>/ (volley's run directory);
one whose summary.json exists is skipped, so a killed sweep resumes when started again.

Columns: for environments with a solved target (pendulum, cartpole) the median over seeds of the
env steps and learner-loop seconds until the last-20 mean first reached it (volley's
`steps_to_target_20`, `secs_to_target_20`) and how many seeds solved; for the rest (MinAtar) the
mean of the final last-100 returns with each seed's, the seeds that pass the suite's stability
checks (bench/suite.py), the lowest policy entropy, and the median over the last fifth of the
updates of the entropy, value loss and gradient norm. The load average is printed at the start
and end: wall seconds are only comparable within one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402  (stability checks, references, seed parsing)

SOLVED_TARGET = {"pendulum", "cartpole"}


def arm(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    if not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=FLAGS")
    return name, shlex.split(flags)


def cli_env(env: str) -> str:
    return suite.FAMILIES["minatar"].cli_env.get(env, env)


def run_one(args, name: str, flags: list[str], env: str, seed: int) -> None:
    directory = args.out / name / f"{env}-s{seed}"
    if (directory / "summary.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    command = [str(args.volley), "train", "--env", cli_env(env), "--seed", str(seed), "--max-env-steps",
               str(args.frames), "--max-secs", "100000", "--progress", "quiet", "--run-dir", str(directory), *flags]
    with open(directory / "train.log", "w") as log, open(directory / "stdout.json", "w") as out:
        status = subprocess.run(command, stdout=out, stderr=log).returncode
    if status != 0:
        print(f"{name} {env} s{seed}: failed ({status}); see {directory / 'train.log'}", file=sys.stderr, flush=True)
        (directory / "summary.json").unlink(missing_ok=True)


def tail_median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows[len(rows) * 4 // 5:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def row(args, name: str, flags: list[str], env: str) -> str:
    runs = {}
    for seed in args.seeds:
        run = suite.read_run(args.out / name / f"{env}-s{seed}")
        if run is not None:
            runs[seed] = run
    if not runs:
        return f"| {name} | {env} | 0 | – |"
    flag_text = " ".join(flags) or "(defaults)"
    if env in SOLVED_TARGET:
        steps = [r["summary"].get("steps_to_target_20") for r in runs.values()]
        secs = [r["summary"].get("secs_to_target_20") for r in runs.values()]
        solved = [s for s in steps if s is not None]
        # An unsolved seed counts as the whole budget (so the median is an upper bound then).
        med_steps = statistics.median([s if s is not None else args.frames for s in steps])
        med_secs = statistics.median([s for s in secs if s is not None]) if solved else None
        each = ", ".join(f"{s:,}" if s is not None else "–" for s in steps)
        return (f"| {name} | `{flag_text}` | {len(solved)}/{len(runs)} | **{med_steps:,.0f}** | {fmt(med_secs, '.2f')} "
                f"| {each} |")
    family = suite.FAMILIES["minatar"]
    reference = family.primary.scores.get(env)
    finals = [r["summary"]["final_mean_return"] for r in runs.values()]
    checks = [suite.stability(r, reference, family.low.get(env, 0.0)) for r in runs.values()]
    rows = [row for r in runs.values() for row in r["rows"]]
    walls = [r["summary"]["wall_secs"] for r in runs.values()]
    return (f"| {name} | {env} | {len(runs)} | **{statistics.mean(finals):.2f}** | "
            f"{', '.join(f'{f:.2f}' for f in finals)} | {sum(c['ok'] for c in checks)}/{len(checks)} | "
            f"{min(c['entropy_min'] for c in checks):.3f} | {fmt(tail_median(rows, 'entropy'), '.3f')} | "
            f"{fmt(tail_median(rows, 'loss_value'), '.4f')} | {fmt(tail_median(rows, 'grad_norm'), '.3f')} | "
            f"{statistics.median(walls):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", required=True, help="comma-separated: pendulum, cartpole or MinAtar games")
    parser.add_argument("--seeds", type=suite.parse_seeds, required=True)
    parser.add_argument("--frames", type=int, required=True, help="env steps per run (every arm the same)")
    parser.add_argument("--arm", type=arm, action="append", required=True, help="NAME=FLAGS (FLAGS may be empty)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--volley", type=Path, default=Path(os.environ.get("CARGO_TARGET_DIR", suite.REPO / "target")) / "release" / "volley")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    print(f"load average at start: {suite.load_average()}", flush=True)
    if not args.report_only:
        # Seeds outermost, so a sweep cut short still has every arm on its first seeds.
        work = [(name, flags, env, seed) for seed in args.seeds for env in envs for name, flags in args.arm]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda w: run_one(args, *w), work))
    print(f"load average at end: {suite.load_average()}", flush=True)
    for env in envs:
        if env in SOLVED_TARGET:
            print("\n| arm | flags | solved | median steps to last-20 target | median s | each seed |\n|---|---|---|---|---|---|")
        else:
            print("\n| arm | env | seeds | mean final last-100 | each seed | stable | min H | H (last 20 %) | "
                  "value loss | grad norm | median wall s |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for name, flags in args.arm:
            print(row(args, name, flags, env))


if __name__ == "__main__":
    main()
