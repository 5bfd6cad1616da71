//! `--tensorboard DIR` (issue 45, item 6): the event files `volley train` and `volley learner`
//! write are read back with the `tensorboard` Python package's `EventAccumulator`, and their
//! scalars match the run's `metrics.jsonl` row for row.
//!
//! The interpreter is `$VOLLEY_ENVS_PYTHON` (else `python3`), the venv `.ci/run` builds with
//! `tensorboard` pinned. Without `tensorboard` the tests say so and return, unless
//! `VOLLEY_REQUIRE_TENSORBOARD=1` is set, as `.ci/run` does.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use volley_testkit::TestNats;

mod common;
use common::{actor_args, learner_args, train_in, Proc};

/// Set by `.ci/run`: a missing `tensorboard` package is a failure, not a skip.
const REQUIRE_TENSORBOARD: &str = "VOLLEY_REQUIRE_TENSORBOARD";
/// The Python interpreter with `tensorboard` (default `python3`).
const PYTHON: &str = "VOLLEY_ENVS_PYTHON";

/// A run of small batches on the CPU backend that never reaches a target: it takes its whole
/// step budget, one TensorBoard event per update.
const SMALL_CPU_RUN: [&str; 8] =
    ["--segment-len", "16", "--batch-segments", "8", "--target-return", "1e9", "--backend", "cpu"];

/// Upper bound on any wait: a safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(180);

/// Every tag the learner writes on the CPU backend with actors that finish episodes.
const TAGS: [&str; 15] = [
    "episode/return_mean_100",
    "episode/return_mean_20",
    "episode/length_mean_100",
    "loss/total",
    "loss/policy",
    "loss/value",
    "policy/entropy",
    "policy/approx_kl",
    "policy/behaviour_kl",
    "optim/learning_rate",
    "optim/grad_norm",
    "optim/ent_coef",
    "throughput/env_steps_per_sec",
    "lag/mean",
    "lag/max",
];

/// Loads every event file in a directory with TensorBoard's own reader and prints, per tag,
/// the (step, value) pairs as JSON.
const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
print(json.dumps(out))
"#;

/// The interpreter, or `None` after saying why the test is skipped (a failure when `.ci/run`
/// requires it).
fn python_or_skip(test: &str) -> Option<String> {
    let python = std::env::var(PYTHON).unwrap_or_else(|_| "python3".to_string());
    let probe = Command::new(&python).args(["-c", "import tensorboard; print(tensorboard.__version__)"]).output();
    let reason = match probe {
        Ok(out) if out.status.success() => return Some(python),
        Ok(out) => format!("{python:?} cannot import tensorboard: {}", String::from_utf8_lossy(&out.stderr).trim()),
        Err(err) => format!("cannot run {python:?}: {err}"),
    };
    if std::env::var(REQUIRE_TENSORBOARD).is_ok_and(|v| v == "1") {
        panic!("{REQUIRE_TENSORBOARD}=1 but {test} cannot run: {reason}");
    }
    eprintln!("SKIPPED {test}: {reason} (see .ci/run for the pinned package)");
    None
}

/// Read `dir`'s event files with TensorBoard: tag → [(step, value)].
fn read_scalars(python: &str, dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    let out = Command::new(python).args(["-c", READER]).arg(dir).output().expect("run the reader");
    assert!(out.status.success(), "reader failed: {}", String::from_utf8_lossy(&out.stderr));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON from the reader");
    value.as_object().expect("an object").clone()
}

fn points(scalars: &serde_json::Map<String, serde_json::Value>, tag: &str) -> Vec<(u64, f64)> {
    scalars
        .get(tag)
        .unwrap_or_else(|| panic!("no {tag} in {:?}", scalars.keys().collect::<Vec<_>>()))
        .as_array()
        .expect("a list")
        .iter()
        .map(|p| (p[0].as_u64().expect("step"), p[1].as_f64().expect("value")))
        .collect()
}

fn check_every_tag(scalars: &serde_json::Map<String, serde_json::Value>, updates: usize) {
    for tag in TAGS {
        let series = points(scalars, tag);
        assert!(!series.is_empty(), "{tag} has no points");
        assert!(series.len() <= updates, "{tag}: {} points for {updates} updates", series.len());
        assert!(series.windows(2).all(|w| w[0].0 <= w[1].0), "{tag}: steps go backwards: {series:?}");
    }
}

#[test]
fn train_writes_scalars_tensorboard_reads_back() {
    let Some(python) = python_or_skip("train_writes_scalars_tensorboard_reads_back") else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    let tb_dir = dir.path().join("tb");
    let tb = tb_dir.display().to_string();
    // An entropy bonus that decays, so `optim/ent_coef` changes from update to update.
    let flags = ["--max-env-steps", "8192", "--tensorboard", &tb, "--ent-coef", "0.01", "--final-ent-coef", "0"];
    train_in(&run_dir, &[&flags[..], &SMALL_CPU_RUN].concat());
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON row"))
        .collect();
    assert!(rows.len() >= 10, "{} updates", rows.len());
    let scalars = read_scalars(&python, &tb_dir);
    check_every_tag(&scalars, rows.len());
    // One point per update for the terms every update has, at the update's env steps, with the
    // value metrics.jsonl recorded (f32 both ways, so equal up to the JSON round trip).
    let columns = [
        ("loss/total", "loss_total"),
        ("policy/entropy", "entropy"),
        ("optim/grad_norm", "grad_norm"),
        ("optim/ent_coef", "ent_coef"),
    ];
    for (tag, column) in columns {
        let series = points(&scalars, tag);
        assert_eq!(series.len(), rows.len(), "{tag}");
        for ((step, value), row) in series.iter().zip(&rows) {
            assert_eq!(*step, row["env_steps"].as_u64().expect("env_steps"), "{tag}");
            let expected = row[column].as_f64().expect("a number");
            assert!((value - expected).abs() <= 1e-6 * expected.abs().max(1.0), "{tag}: {value} against {expected}");
        }
    }
    let last_return = points(&scalars, "episode/return_mean_100").last().copied().expect("a point");
    let last_row = rows.last().expect("a row");
    assert!((last_return.1 - last_row["mean_return_100"].as_f64().expect("a return")).abs() < 1e-3);
    // CartPole pays 1 per step, so an episode's length is its return.
    let lengths = points(&scalars, "episode/length_mean_100");
    assert!((lengths.last().expect("a point").1 - last_return.1).abs() < 1e-3, "{lengths:?}");
}

#[test]
fn learner_process_writes_scalars_tensorboard_reads_back() {
    let Some(python) = python_or_skip("learner_process_writes_scalars_tensorboard_reads_back") else { return };
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let tb_dir = dir.path().join("tb");
    let tb = tb_dir.display().to_string();
    let extra = [&["--max-env-steps", "4096", "--tensorboard", &tb][..], &SMALL_CPU_RUN].concat();
    let args = learner_args(&nats, "tb", dir.path(), &extra);
    let mut learner = Proc::volley(dir.path(), "learner", &args, PATIENCE);
    let mut actor = Proc::volley(dir.path(), "actor", &actor_args(&nats, "tb", "a0", &[]), PATIENCE);
    let summary = learner.summary();
    actor.terminate_and_wait();
    let updates = summary["updates"].as_u64().expect("updates") as usize;
    assert!(updates >= 10, "{summary}");
    assert!(learner.log().contains("TensorBoard log written"), "{}", learner.log());
    let scalars = read_scalars(&python, &tb_dir);
    check_every_tag(&scalars, updates);
    assert_eq!(points(&scalars, "loss/total").len(), updates);
}
