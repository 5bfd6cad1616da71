"""Peer baseline for docs/BENCHMARKS.md: Gymnasium CartPole-v1 raw env steps/s on one core.

Run beside `cargo bench -p volley-env --bench env` on the same machine:
    pip install gymnasium==1.4.0
    taskset -c 0 python3 bench/peers/gymnasium_cartpole.py
Prints one line per mode with the median of 5 runs.
"""

import statistics
import time

import gymnasium as gym
import numpy as np

N_ENVS = 64
STEPS = 2_000


def measure(env) -> float:
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, size=(STEPS, N_ENVS))
    start = time.perf_counter()
    for t in range(STEPS):
        env.step(actions[t])
    return STEPS * N_ENVS / (time.perf_counter() - start)


def main() -> None:
    modes = {
        "vector_entry_point (numpy CartPoleVectorEnv)": dict(vectorization_mode="vector_entry_point"),
        "sync (SyncVectorEnv of 64 CartPole)": dict(vectorization_mode="sync"),
    }
    for name, kwargs in modes.items():
        env = gym.make_vec("CartPole-v1", num_envs=N_ENVS, **kwargs)
        rates = [measure(env) for _ in range(5)]
        env.close()
        print(f"gymnasium {gym.__version__} {name}: median {statistics.median(rates):,.0f} env steps/s")


if __name__ == "__main__":
    main()
