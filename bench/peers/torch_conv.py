"""Peer baseline for docs/BENCHMARKS.md: PyTorch CPU, one whole V-trace update of the MinAtar and
Nature-DQN networks, the shapes and the update of `cargo bench -p volley-learner --bench conv`.

Each update: a forward over the (T+1)·B observations, V-trace targets and advantages (no gradient;
rho-bar = pg-rho-bar = c-bar = 1, lambda = 0.95, discount 0.99), the loss
policy + 0.5 · ½(vs − V)² − 0.01 · entropy averaged over the T·B samples, backward, a global
gradient-norm clip at 0.5 and an Adam step (lr 1e-4), in f32 unless `--bf16` (autocast).

    python3 -m venv target/venv-torch && target/venv-torch/bin/pip install torch==2.15.0
    target/venv-torch/bin/python bench/peers/torch_conv.py --threads 1,2

Prints a Markdown table row per network, batch and thread count: the median of `--runs`
timings, each the mean of as many updates as fit in about a second (after one warm-up update).
"""

import argparse
import statistics
import time

import torch
from torch import nn

NETWORKS = {
    # name: (channels, side, [(out_channels, kernel, stride)], hidden, n_actions)
    "minatar": (4, 10, [(16, 3, 1)], 128, 3),
    "nature": (4, 84, [(32, 8, 4), (64, 4, 2), (64, 3, 1)], 512, 6),
}


class Net(nn.Module):
    def __init__(self, channels, side, convs, hidden, n_actions):
        super().__init__()
        layers, c = [], channels
        for out_channels, kernel, stride in convs:
            layers += [nn.Conv2d(c, out_channels, kernel, stride), nn.ReLU()]
            c = out_channels
            side = (side - kernel) // stride + 1
        self.torso = nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * side * side, hidden), nn.ReLU())
        self.heads = nn.Linear(hidden, n_actions + 1)

    def forward(self, obs):
        out = self.heads(self.torso(obs))
        return out[:, :-1], out[:, -1]


def vtrace(log_rhos, discounts, rewards, values, bootstrap, lambda_=0.95):
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018), time-major [T][B]."""
    rhos = torch.exp(log_rhos).clamp(max=1.0)
    cs = lambda_ * torch.exp(log_rhos).clamp(max=1.0)
    values_tp1 = torch.cat([values[1:], bootstrap[None]], 0)
    deltas = rhos * (rewards + discounts * values_tp1 - values)
    acc = torch.zeros_like(bootstrap)
    vs_minus_v = []
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v.append(acc)
    vs = torch.stack(vs_minus_v[::-1]) + values
    vs_tp1 = torch.cat([vs[1:], bootstrap[None]], 0)
    pg_adv = rhos * (rewards + discounts * vs_tp1 - values)
    return vs, pg_adv


def update(net, opt, batch, t_len, b_len, bf16):
    obs, actions, behaviour_log_probs, rewards, discounts = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, values = net(obs)
    logits, values = logits.float().view(t_len + 1, b_len, -1), values.float().view(t_len + 1, b_len)
    log_probs = torch.log_softmax(logits[:-1], -1)
    taken = log_probs.gather(-1, actions[..., None])[..., 0]
    with torch.no_grad():
        vs, pg_adv = vtrace(taken - behaviour_log_probs, discounts, rewards, values[:-1], values[-1])
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss = (-(pg_adv * taken) + 0.5 * 0.5 * (vs - values[:-1]) ** 2 - 0.01 * entropy).mean()
    opt.zero_grad(set_to_none=False)
    loss.backward()
    nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    opt.step()


def measure(name, t_len, b_len, threads, runs, bf16):
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    channels, side, convs, hidden, n_actions = NETWORKS[name]
    net = Net(channels, side, convs, hidden, n_actions)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    rows = (t_len + 1) * b_len
    obs = (torch.rand(rows, channels, side, side) < 0.1).float()
    batch = (
        obs,
        torch.randint(0, n_actions, (t_len, b_len)),
        torch.full((t_len, b_len), -float(torch.log(torch.tensor(float(n_actions))))),
        torch.rand(t_len, b_len) * 2 - 1,
        torch.full((t_len, b_len), 0.99),
    )
    update(net, opt, batch, t_len, b_len, bf16)  # warm-up: allocation, oneDNN primitive choice
    rates = []
    for _ in range(runs):
        n, start = 0, time.perf_counter()
        while n < 3 or (n < 50 and time.perf_counter() - start < 1.0):
            update(net, opt, batch, t_len, b_len, bf16)
            n += 1
        rates.append(n * t_len * b_len / (time.perf_counter() - start))
    return statistics.median(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (oneDNN) instead of f32")
    parser.add_argument("--quick", action="store_true", help="MinAtar rows only")
    parser.add_argument("--configs", default="minatar:32:8,minatar:32:32,nature:20:8,nature:20:32")
    args = parser.parse_args()
    torch.set_num_interop_threads(1)
    print(f"torch {torch.__version__}, {'bf16 autocast' if args.bf16 else 'f32'}")
    print("| peer | threads | network | T | B | samples/s |")
    print("|---|---|---|---|---|---|")
    for config in args.configs.split(","):
        name, t_len, b_len = config.split(":")
        if args.quick and name != "minatar":
            continue
        for threads in (int(n) for n in args.threads.split(",")):
            rate = measure(name, int(t_len), int(b_len), threads, args.runs, args.bf16)
            print(f"| torch | {threads} | {name} | {t_len} | {b_len} | {rate:.0f} |", flush=True)


if __name__ == "__main__":
    main()
