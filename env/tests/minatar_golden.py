"""Golden traces from the reference MinAtar package (PyPI `minatar==1.0.15`, with numpy).

Volley's native MinAtar (`env/src/minatar/`) must reproduce these step for step: the Rust test
`env/tests/minatar_golden.rs` runs this script and compares every line.

Usage: python minatar_golden.py OUT_FILE

Each run below is `Environment(game, sticky_action_prob, difficulty_ramping)`, `seed(seed)`,
`reset()`, then `n_steps` agent actions; after a terminal step it calls `reset()` (the same
generator continues) and goes on. Agent actions index the minimal action set (as
`gym.make("MinAtar/<Game>-v1")`) or, with `full`, all six. They come from a separate generator
and are held for a random number of steps, which reaches further into the games (ramping,
cleared waves, divers) than independent draws.

Output, one line per record:
  `run <game> <seed> <full 0|1> <ramping 0|1> <sticky> <n_steps>` starts a run;
  `reset <obs>` is the observation after a reset;
  `step <action> <reward> <terminal 0|1> <obs>` is one step.
`<obs>` is the state transposed to channel-major `[C][10][10]` and packed with
`numpy.packbits` (most significant bit first), in hex. The last line is `end <n_runs>`.
A summary of how far each run got goes to stderr.
"""

import sys

import numpy as np
from minatar import Environment

# (game, seed, full action set, difficulty ramping, sticky action probability, steps).
# A seed of 2**32 or more is given to numpy as the array of its two 32-bit halves, as Volley does.
RUNS = [
    ("asterix", 0, False, True, 0.1, 8000),
    ("breakout", 1, False, True, 0.1, 4000),
    ("freeway", 2, False, True, 0.1, 5100),
    ("seaquest", 3, False, True, 0.1, 12000),
    ("space_invaders", 4, False, True, 0.1, 4000),
    ("seaquest", 0x9ABCDEF012345678, True, False, 0.1, 3000),
    ("space_invaders", 4294967295, True, True, 0.25, 2000),
]


def numpy_seed(seed):
    return seed if seed < 2**32 else [seed & 0xFFFFFFFF, seed >> 32]


def obs_hex(env):
    state = np.ascontiguousarray(np.transpose(env.state(), (2, 0, 1)))
    return np.packbits(state.astype(np.uint8)).tobytes().hex()


def aim_and_fire(env):
    """Space Invaders: dodge bullets, else move under the nearest alien column and fire, so
    waves get cleared."""
    state = env.state()
    cannon = int(np.argmax(state[9, :, 0]))
    if state[4:, cannon, 5].any():
        return 1 if cannon > 0 and not state[4:, cannon - 1, 5].any() else 3
    aliens = state[:, :, 1]
    columns = np.flatnonzero(aliens.any(axis=0))
    # The column whose lowest alien is lowest, the nearest of those.
    depth = np.array([np.flatnonzero(aliens[:, c]).max() for c in columns])
    lowest = columns[depth == depth.max()]
    target = lowest[np.argmin(np.abs(lowest - cannon))]
    return 5 if target == cannon else (1 if target < cannon else 3)


def trace(out, game, seed, full, ramping, sticky, n_steps):
    env = Environment(game, sticky_action_prob=sticky, difficulty_ramping=ramping)
    env.seed(numpy_seed(seed))
    env.reset()
    action_set = list(range(env.num_actions())) if full else env.minimal_action_set()
    policy = np.random.RandomState((seed + 1000) % 2**32)
    out.write(f"run {game} {seed} {int(full)} {int(ramping)} {sticky!r} {n_steps}\n")
    out.write(f"reset {obs_hex(env)}\n")
    action, hold = 0, 0
    episodes, total, max_ramp = 0, 0, 0
    for _ in range(n_steps):
        if hold == 0:
            action = int(policy.randint(len(action_set)))
            hold = int(policy.randint(1, 8))
        hold -= 1
        if game == "space_invaders" and policy.rand() < 0.7:
            action = action_set.index(aim_and_fire(env))
        reward, terminal = env.act(action_set[action])
        total += int(reward)
        ramp = env.env.difficulty_ramp()
        max_ramp = max(max_ramp, ramp or 0)
        out.write(f"step {action} {int(reward)} {int(terminal)} {obs_hex(env)}\n")
        if terminal:
            episodes += 1
            env.reset()
            out.write(f"reset {obs_hex(env)}\n")
    print(f"{game} seed {seed}: {n_steps} steps, {episodes} episodes, return {total}, max ramp {max_ramp}",
          file=sys.stderr)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], "w") as out:
        for run in RUNS:
            trace(out, *run)
        out.write(f"end {len(RUNS)}\n")


if __name__ == "__main__":
    main()
