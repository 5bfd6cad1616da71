"""Volley's conv learner against the PyTorch CPU peer in one sitting, rounds alternating.

Each round runs `cargo bench -p volley-learner --bench conv -- --threads 1,2 --obs u8` (the built
bench binary, `--bench-bin`) and then `bench/peers/torch_conv.py --runs 1` (with `--torch-python`), and
records `uptime`'s one-minute load before each. Prints, per network, batch and thread count, the
median samples/s of each side over the rounds, the median ratio of the rounds' pairs (each round's
Volley figure over the same round's PyTorch figure, so a load change between rounds cancels) and
the median GFLOP/s and % of the f32 peak of Volley's rows.

With `--actor-bench-bin` (the built `cargo bench -p volley-actor --bench actor` binary) each round
also runs the actor's Nature-DQN policy step (`actor_nature_policy_steps`, 1 and 8 environments,
one thread) and then its peer `bench/peers/torch_actor_nature.py --runs 1`, and a second table
gives their agent steps/s and the median of the rounds' ratios.

    cargo bench -p volley-learner --bench conv --no-run   # prints the binary's path
    cargo bench -p volley-actor --bench actor --no-run
    python3 bench/conv_vs_torch.py --bench-bin target/release/deps/conv-HASH \\
        --actor-bench-bin target/release/deps/actor-HASH \\
        --torch-python target/venv-torch/bin/python --rounds 5
"""

import argparse
import os
import statistics
import subprocess


def table_rows(text):
    """The Markdown rows of a bench's output as lists of cells (header and rule excluded)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in ("cpu", "torch"):
            rows.append(cells)
    return rows


def criterion_rates(text):
    """Agent steps/s per batch from criterion's output: the middle `thrpt` estimate of each
    `actor_nature_policy_steps/<name>/<batch>` benchmark."""
    rates, batch = {}, None
    scale = {"elem/s": 1.0, "Kelem/s": 1e3, "Melem/s": 1e6}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("actor_nature_policy_steps/"):
            batch = int(line.split("/")[-1])
        elif line.startswith("thrpt:") and batch is not None:
            value, unit = line.split("[")[1].split()[2:4]
            rates[batch] = float(value) * scale[unit]
            batch = None
    return rates


def load_1min():
    return os.getloadavg()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-bin", required=True)
    parser.add_argument("--torch-python", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--actor-bench-bin", help="also the actor's Nature-DQN policy step and its peer")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    volley, torch, extra, loads = {}, {}, {}, []
    actor, actor_peer = {}, {}
    for round_idx in range(args.rounds):
        loads.append(load_1min())
        bench = [args.bench_bin, "--threads", args.threads, "--obs", "u8"]
        out = subprocess.run(bench, capture_output=True, text=True, check=True)
        # The bench's columns since issue 44 item 3: the batch's element type and its bytes after
        # the thread count and the network; `--obs u8` is the learner's path for image frames.
        for backend, threads, net, _obs, t_len, b_len, _mb, rate, _ms, gflops, of_peak in table_rows(out.stdout):
            key = (net, int(t_len), int(b_len), int(threads))
            volley.setdefault(key, []).append(float(rate))
            extra.setdefault(key, []).append((float(gflops), float(of_peak.rstrip(" %"))))
        loads.append(load_1min())
        peer = [args.torch_python, os.path.join(here, "peers", "torch_conv.py"), "--threads", args.threads, "--runs", "1"]
        out = subprocess.run(peer, capture_output=True, text=True, check=True)
        for _peer, threads, net, t_len, b_len, rate in table_rows(out.stdout):
            torch.setdefault((net, int(t_len), int(b_len), int(threads)), []).append(float(rate))
        if args.actor_bench_bin:
            loads.append(load_1min())
            bench = [args.actor_bench_bin, "--bench", "actor_nature_policy_steps", "--warm-up-time", "1"]
            out = subprocess.run(bench + ["--measurement-time", "2"], capture_output=True, text=True, check=True)
            for batch, rate in criterion_rates(out.stdout).items():
                actor.setdefault(batch, []).append(rate)
            loads.append(load_1min())
            peer = [args.torch_python, os.path.join(here, "peers", "torch_actor_nature.py"), "--runs", "1"]
            out = subprocess.run(peer, capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if line.startswith("|") and cells[0] == "torch":
                    actor_peer.setdefault(int(cells[2]), []).append(float(cells[3]))
        print(f"round {round_idx + 1}/{args.rounds} done, load {loads[-1]:.1f}", flush=True)
    print(f"rounds: {args.rounds}; one-minute load before each half-round: {min(loads):.1f}-{max(loads):.1f}")
    print("| network | T | B | threads | Volley samples/s | PyTorch f32 samples/s | Volley / PyTorch (median of pairs) | Volley GFLOP/s | % of f32 peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in sorted(volley, key=lambda k: (k[0] != "minatar", k[2], k[3])):
        net, t_len, b_len, threads = key
        ours, theirs = volley[key], torch.get(key, [])
        ratio = statistics.median(a / b for a, b in zip(ours, theirs)) if theirs else float("nan")
        gflops = statistics.median(g for g, _ in extra[key])
        of_peak = statistics.median(p for _, p in extra[key])
        print(
            f"| {net} | {t_len} | {b_len} | {threads} | {statistics.median(ours):,.0f} | "
            f"{statistics.median(theirs) if theirs else float('nan'):,.0f} | {ratio:.2f} | {gflops:.1f} | {of_peak:.0f} % |"
        )

    if actor:
        print()
        print("| actor policy step, Nature-DQN, 1 thread | envs | Volley agent steps/s | PyTorch no_grad agent steps/s | Volley / PyTorch (median of pairs) |")
        print("|---|---|---|---|---|")
        for batch in sorted(actor):
            ours, theirs = actor[batch], actor_peer.get(batch, [])
            ratio = statistics.median(a / b for a, b in zip(ours, theirs)) if theirs else float("nan")
            print(
                f"| frames 84×84×4 in, actions out | {batch} | {statistics.median(ours):,.0f} | "
                f"{statistics.median(theirs) if theirs else float('nan'):,.0f} | {ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
