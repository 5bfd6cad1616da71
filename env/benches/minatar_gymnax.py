"""Steps per second of gymnax's MinAtar games (JAX, CPU) on one core, for comparison with the
native games (`env/benches/env.rs`) and the reference package (`minatar_reference.py`).

gymnax re-implements MinAtar in JAX (no sticky actions, episodes capped at 1,000 steps; its
Seaquest differs from the reference), so this compares throughput only, not the same dynamics.
Uniformly random actions, auto-reset (gymnax's `step` resets at episode ends), the observation
computed every step, the whole rollout jitted as one `lax.scan` (the fastest way to run gymnax),
unbatched and `vmap`ped over a batch of environments. Compile time is excluded.

Usage (one core, one XLA thread):
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
      taskset -c 0 python minatar_gymnax.py [SECONDS_PER_CASE]
(needs `pip install "jax[cpu]" gymnax six`; measured with jax 0.10.2, gymnax 1.0.1).
"""

import sys
import time

import jax
import jax.numpy as jnp
import gymnax

GAMES = ["Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar", "SpaceInvaders-MinAtar"]
STEPS_PER_CALL = 1000


def rollout_fn(env, params, n_envs):
    n_actions = env.action_space(params).n

    def one_env_step(carry, key):
        state = carry
        key_act, key_step = jax.random.split(key)
        action = jax.random.randint(key_act, (), 0, n_actions)
        obs, state, reward, _, _, _ = env.step(key_step, state, action, params)
        return state, obs.sum() + reward

    def run(key, state):
        keys = jax.random.split(key, STEPS_PER_CALL)
        if n_envs == 1:
            state, out = jax.lax.scan(one_env_step, state, keys)
        else:
            keys = jax.vmap(lambda k: jax.random.split(k, n_envs))(keys)
            state, out = jax.lax.scan(jax.vmap(one_env_step), state, keys)
        return state, out.sum()

    return jax.jit(run)


def steps_per_second(game, n_envs, seconds):
    env, params = gymnax.make(game)
    key = jax.random.PRNGKey(0)
    if n_envs == 1:
        _, state = env.reset(key, params)
    else:
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, n_envs), params)
    run = rollout_fn(env, params, n_envs)
    state, total = run(key, state)  # compile
    total.block_until_ready()
    n_steps = 0
    start = time.perf_counter()
    while True:
        key, sub = jax.random.split(key)
        state, total = run(sub, state)
        total.block_until_ready()
        n_steps += STEPS_PER_CALL * n_envs
        now = time.perf_counter()
        if now - start >= seconds:
            return n_steps / (now - start)


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    print(f"# gymnax {getattr(gymnax, '__version__', '?')}, jax {jax.__version__}, devices {jax.devices()}")
    for game in GAMES:
        rates = {n: steps_per_second(game, n, seconds) for n in (1, 64)}
        print(f"{game} {rates[1]:.0f} steps/s (1 env), {rates[64]:.0f} steps/s (64 envs, vmap)", flush=True)


if __name__ == "__main__":
    main()
