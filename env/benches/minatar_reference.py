"""Steps per second of the reference MinAtar (PyPI `minatar==1.0.15`) on one core, timed as
`env/benches/env.rs` times the native games: uniformly random actions from the minimal action
set (precomputed), `act` then `state()` (the observation an agent reads) every step, `reset()`
at episode ends, default sticky actions and difficulty ramping.

Usage: python minatar_reference.py [SECONDS_PER_GAME]
(with minatar and numpy importable, e.g. PYTHONPATH=target/volley-tools/minatar-1.0.15
after `cargo test -p volley-env --test minatar_golden` installed them there).
"""

import sys
import time

import numpy as np
from minatar import Environment

GAMES = ["asterix", "breakout", "freeway", "seaquest", "space_invaders"]


def steps_per_second(game, seconds):
    env = Environment(game)
    env.seed(0)
    env.reset()
    actions = env.minimal_action_set()
    picks = np.random.RandomState(1).randint(len(actions), size=4096)
    n_steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for pick in picks:
            _, terminal = env.act(actions[pick])
            env.state()
            if terminal:
                env.reset()
        n_steps += len(picks)
        now = time.perf_counter()
        if now >= deadline:
            return n_steps / (now - start)


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    import minatar

    print(f"# minatar {getattr(minatar, '__version__', '1.0.15')}, numpy {np.__version__}, "
          f"python {sys.version.split()[0]}")
    for game in GAMES:
        print(f"{game} {steps_per_second(game, seconds):.0f} steps/s")


if __name__ == "__main__":
    main()
