//! Golden test: `volley_env::Pendulum` against Gymnasium's Pendulum-v1, computed independently
//! by Python (gymnasium 1.x, numpy 2) in the same run.
//!
//! The Python side draws 40 exact start states (angles well outside `[-π, π)`, speeds up to the
//! cap) and torque sequences (including values beyond ±2, which both sides clip), sets
//! `env.unwrapped.state`, steps `gymnasium.make("Pendulum-v1")` and prints every observation,
//! reward and flag, plus one full episode to check the 200-step truncation. This side replays
//! the same inputs and compares step by step.
//!
//! Needs a Python with `gymnasium`: `$VOLLEY_ENVS_PYTHON` (else `python3`). Without one the test
//! is skipped with a message, unless `VOLLEY_REQUIRE_PYTHON_ENVS=1` (CI), where it fails.

use std::process::Command;

use volley_env::pendulum::{Pendulum, MAX_EPISODE_STEPS};
use volley_env::{Action, Env};

const SCRIPT: &str = r#"
import json, sys
import numpy as np
import gymnasium as gym

rng = np.random.default_rng(20261201)
env = gym.make("Pendulum-v1")
env.reset(seed=0)
cases = []
for case in range(40):
    theta = float(rng.uniform(-12.0, 12.0))
    theta_dot = float(rng.uniform(-8.0, 8.0))
    torques = rng.uniform(-3.0, 3.0, size=60).astype(np.float32)
    env.reset(seed=case)
    env.unwrapped.state = np.array([theta, theta_dot])
    steps = []
    for u in torques:
        obs, reward, terminated, truncated, _ = env.step(np.array([u], dtype=np.float32))
        steps.append({"obs": [float(v) for v in obs], "reward": float(reward),
                      "terminated": bool(terminated), "truncated": bool(truncated)})
    cases.append({"theta": theta, "theta_dot": theta_dot, "torques": [float(u) for u in torques],
                  "steps": steps, "final_state": [float(v) for v in env.unwrapped.state]})
env.reset(seed=7)
flags = []
for t in range(MAX_STEPS):
    _, _, terminated, truncated, _ = env.step(np.array([0.5], dtype=np.float32))
    flags.append([bool(terminated), bool(truncated)])
json.dump({"numpy": np.__version__, "gymnasium": gym.__version__, "cases": cases, "episode_flags": flags},
          sys.stdout)
"#;

fn python() -> String {
    std::env::var("VOLLEY_ENVS_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn required() -> bool {
    std::env::var("VOLLEY_REQUIRE_PYTHON_ENVS").is_ok_and(|v| v == "1")
}

fn golden() -> Option<serde_json::Value> {
    let script = SCRIPT.replace("MAX_STEPS", &MAX_EPISODE_STEPS.to_string());
    let output = match Command::new(python()).arg("-c").arg(&script).output() {
        Ok(output) => output,
        Err(err) => {
            assert!(!required(), "cannot run {}: {err}", python());
            eprintln!("skipping the Pendulum golden test: cannot run {}: {err}", python());
            return None;
        }
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!required(), "the Gymnasium script failed: {stderr}");
        eprintln!("skipping the Pendulum golden test (needs gymnasium in {}): {stderr}", python());
        return None;
    }
    Some(serde_json::from_slice(&output.stdout).expect("the script prints JSON"))
}

fn f64_at(value: &serde_json::Value) -> f64 {
    value.as_f64().expect("a number")
}

#[test]
fn pendulum_matches_gymnasium_step_by_step() {
    let Some(golden) = golden() else { return };
    eprintln!("golden from gymnasium {} with numpy {}", golden["gymnasium"], golden["numpy"]);
    let mut worst_obs = 0.0f64;
    let mut worst_state = 0.0f64;
    for (case_idx, case) in golden["cases"].as_array().expect("cases").iter().enumerate() {
        let mut env = Pendulum::new();
        env.set_state([f64_at(&case["theta"]), f64_at(&case["theta_dot"])]);
        let mut obs = [0.0f32; 3];
        let torques = case["torques"].as_array().expect("torques");
        for (t, (torque, want)) in torques.iter().zip(case["steps"].as_array().expect("steps")).enumerate() {
            let torque = f64_at(torque) as f32;
            let outcome = env.step(Action::Continuous(&[torque]), &mut obs).expect("live episode");
            let want_obs: Vec<f64> = want["obs"].as_array().expect("obs").iter().map(f64_at).collect();
            for (i, (&got, &want_value)) in obs.iter().zip(&want_obs).enumerate() {
                // One f32 rounding step apart at most: numpy's vectorised sin/cos may differ
                // from the platform libm in the last bit of the f64 before rounding.
                let diff = (f64::from(got) - want_value).abs();
                worst_obs = worst_obs.max(diff);
                assert!(
                    diff <= f64::from(f32::EPSILON) * want_value.abs().max(1.0),
                    "case {case_idx} step {t} obs[{i}]: {got} vs gymnasium {want_value}"
                );
            }
            let want_reward = f64_at(&want["reward"]);
            assert!(
                (f64::from(outcome.reward) - want_reward).abs() <= 1e-6 * want_reward.abs().max(1.0),
                "case {case_idx} step {t} reward: {} vs gymnasium {want_reward}",
                outcome.reward
            );
            assert_eq!(outcome.terminated, want["terminated"].as_bool().expect("flag"), "case {case_idx} step {t}");
        }
        let want_state: Vec<f64> = case["final_state"].as_array().expect("state").iter().map(f64_at).collect();
        for (got, want) in env.state().iter().zip(&want_state) {
            let diff = (got - want).abs() / want.abs().max(1.0);
            worst_state = worst_state.max(diff);
            assert!(diff <= 1e-12, "case {case_idx} final state: {:?} vs gymnasium {want_state:?}", env.state());
        }
    }
    eprintln!("largest observation difference {worst_obs:e}, largest relative state difference {worst_state:e}");

    let mut env = Pendulum::new();
    let mut obs = [0.0f32; 3];
    env.reset(7, &mut obs).expect("reset");
    for (t, flags) in golden["episode_flags"].as_array().expect("flags").iter().enumerate() {
        let outcome = env.step(Action::Continuous(&[0.5]), &mut obs).expect("live episode");
        let want = (flags[0].as_bool().expect("flag"), flags[1].as_bool().expect("flag"));
        assert_eq!((outcome.terminated, outcome.truncated), want, "episode step {}", t + 1);
    }
}
