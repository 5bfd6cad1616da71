//! Image observations and the conv torso end to end (issue 15): MinAtar with the `minatar`
//! conv preset, embedded and over a real nats-server (whose segments carry the 0/1 planes as
//! bytes, wire format 5), bounded by environment steps.

use std::time::Duration;

use volley_testkit::TestNats;

mod common;
use common::{actor_args, learner_args, read_json, train_in, volley, Proc};

/// Upper bound on any wait: a safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(300);

const MINATAR_CONV: [&str; 8] =
    ["--env", "minatar-breakout", "--conv", "minatar", "--torso", "128", "--activation", "relu"];

#[test]
fn minatar_trains_embedded_with_the_conv_torso() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    let mut args = vec!["--max-env-steps", "2048", "--segment-len", "16", "--batch-segments", "8"];
    args.extend(MINATAR_CONV);
    let summary = train_in(&run_dir, &args);
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
    assert!(summary["updates"].as_u64().expect("updates") >= 1, "{summary}");
    let spec = read_json(&run_dir.join("spec.json"));
    let conv = &spec["policy"]["conv"];
    assert_eq!(conv["in_channels"], 4, "{conv}");
    assert_eq!(conv["layers"][0]["out_channels"], 16, "{conv}");
    assert_eq!(conv["layers"][0]["kernel"], 3, "{conv}");
    assert_eq!(spec["policy"]["obs_dim"], 400);
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics");
    for line in metrics.lines() {
        let row: serde_json::Value = serde_json::from_str(line).expect("json row");
        assert!(row["loss_total"].as_f64().is_some_and(f64::is_finite), "{row}");
    }
}

#[test]
fn a_conv_torso_on_vector_observations_is_refused_by_name() {
    let output = volley()
        .args(["train", "--env", "cartpole", "--conv", "minatar", "--max-env-steps", "64", "--progress", "quiet"])
        .output()
        .expect("run volley");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--conv") && stderr.contains("image observations"), "{stderr}");
}

/// A learner and an actor process train MinAtar Breakout with the conv torso over NATS: every
/// segment (its observations as bytes on the wire) is accepted and the step budget is reached.
#[test]
fn minatar_trains_over_nats_with_the_conv_torso() {
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut extra = vec!["--max-env-steps", "8192", "--segment-len", "32", "--batch-segments", "8"];
    extra.extend(MINATAR_CONV);
    let mut learner = Proc::volley(dir.path(), "learner", &learner_args(&nats, "pixels", dir.path(), &extra), PATIENCE);
    let mut actor = Proc::volley(dir.path(), "actor-0", &actor_args(&nats, "pixels", "actor-0", &[]), PATIENCE);
    let summary = learner.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
    assert!(summary["env_steps"].as_u64().expect("env_steps") >= 8192, "{summary}");
    assert!(summary["segments_used"].as_u64().expect("segments_used") >= 8, "{summary}");
    let rejected: u64 =
        summary["segments_rejected"].as_object().expect("map").values().filter_map(|v| v.as_u64()).sum();
    assert_eq!(rejected, 0, "{summary}");
    actor.terminate();
    actor.wait_exit();
}
