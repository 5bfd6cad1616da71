"""Peer baseline for docs/BENCHMARKS.md: PyTorch CPU inference of the Nature-DQN network as an
actor runs it, the shapes of `cargo bench -p volley-actor --bench actor -- actor_nature_policy_steps`.

Each step: a batch of 84×84×4 frames of 8-bit pixels (`uint8`) converted to `float32` and divided
by 255, the three convs (32 8×8 /4, 64 4×4 /2, 64 3×3 /1), 512 ReLU units and the heads (6 logits
and a value) under `torch.no_grad()`, then one categorical draw per agent; one intra-op and one
inter-op thread unless `--threads` says otherwise.

    target/venv-torch/bin/python bench/peers/torch_actor_nature.py --batches 1,8 --runs 5

Prints a Markdown table row per batch: the median over `--runs` timings of agent steps per second
(batch × steps / seconds), each timing as many steps as fit in about a second after 20 warm-up
steps.
"""

import argparse
import statistics
import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, n_actions=6):
        super().__init__()
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, 2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 512),
            nn.ReLU(),
        )
        self.heads = nn.Linear(512, n_actions + 1)

    def forward(self, frames):
        out = self.heads(self.torso(frames.float() / 255.0))
        return out[:, :-1], out[:, -1]


def step(net, frames):
    logits, _values = net(frames)
    return torch.distributions.Categorical(logits=logits).sample()


def measure(batch, runs):
    torch.manual_seed(1)
    net = Net().eval()
    frames = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8)
    rates = []
    with torch.no_grad():
        for _ in range(20):
            step(net, frames)
        for _ in range(runs):
            n, start = 0, time.perf_counter()
            while n < 10 or time.perf_counter() - start < 1.0:
                step(net, frames)
                n += 1
            rates.append(n * batch / (time.perf_counter() - start))
    return statistics.median(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8", help="comma-separated numbers of environments")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    print(f"torch {torch.__version__}, f32 inference, {args.threads} thread(s)")
    print("| peer | threads | batch | agent steps/s |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"| torch | {args.threads} | {batch} | {measure(batch, args.runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
