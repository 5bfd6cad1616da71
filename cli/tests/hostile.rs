//! A hostile actor against a real learner and actors (issue 12, docs/SECURITY.md): the Python
//! client `hostile_client.py` (nats-py, segments built from the documented wire format, not
//! from the Rust codec) sends random, truncated, bit-flipped, oversized and replayed messages,
//! absurd lengths, non-finite and huge values, future versions, forged episode summaries, long
//! ids and a forged weights pointer, while two honest actors train CartPole.
//!
//! Asserted: no process panics or exits early, the run is not stopped or frozen (it still
//! reaches its target), every rejection is counted under the reason the client meant, and the
//! learner's resident set stays within a bound.
//!
//! It needs a Python with `nats` (nats-py) and `xxhash`: `$VOLLEY_ENVS_PYTHON` (else `python3`).
//! Without one it says so and returns, unless `VOLLEY_REQUIRE_PYTHON_ENVS=1` is set, as
//! `.ci/run` does. Runs are bounded by environment steps, never by time.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use volley_testkit::TestNats;

mod common;
use common::{actor_args, learner_args, Proc};

/// Upper bound on any wait: a safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(600);
/// The hostile client may grow the learner's resident set by at most this much.
const MAX_RSS_GROWTH_BYTES: i64 = 64 << 20;
const ROUNDS: u64 = 5;

fn python() -> Result<String, String> {
    let python = std::env::var("VOLLEY_ENVS_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let probe = Command::new(&python).args(["-c", "import nats, xxhash"]).output();
    match probe {
        Ok(output) if output.status.success() => Ok(python),
        Ok(output) => Err(format!("{python} lacks nats-py or xxhash: {}", String::from_utf8_lossy(&output.stderr))),
        Err(err) => Err(format!("cannot run {python:?}: {err}")),
    }
}

#[test]
fn a_hostile_actor_cannot_stop_freeze_or_bloat_a_run() {
    let python = match python() {
        Ok(python) => python,
        Err(why) if std::env::var("VOLLEY_REQUIRE_PYTHON_ENVS").is_ok_and(|v| v == "1") => panic!("{why}"),
        Err(why) => {
            eprintln!("skipping the hostile-client test: {why}");
            return;
        }
    };
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let args = learner_args(&nats, "hostile", dir.path(), &["--max-env-steps", "3000000"]);
    let mut learner = Proc::volley(dir.path(), "learner", &args, PATIENCE);
    learner.wait_for_log("no weights published yet");
    let mut actors: Vec<Proc> = (0..2)
        .map(|i| {
            let id = format!("actor-{i}");
            Proc::volley(dir.path(), &id, &actor_args(&nats, "hostile", &id, &[]), PATIENCE)
        })
        .collect();
    actors[0].wait_for_log("actor started");

    // The honest actors pause while the client attacks (SIGSTOP, then SIGCONT): since issue 16
    // the learner solves CartPole in about a second, faster than the client sends its rounds,
    // and every hostile message must reach the learner before it stops. The actors hold
    // weights from before the forged pointer and must follow the real pointers after it.
    let signal_actors = |signal: &str| {
        for actor in &actors {
            let status = Command::new("kill").args([signal, &actor.child.id().to_string()]).status();
            assert!(status.is_ok_and(|s| s.success()), "kill {signal} an actor");
        }
    };
    signal_actors("-STOP");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hostile_client.py");
    let output = Command::new(&python)
        .arg(&script)
        .args([nats.url(), "hostile".into(), learner.child.id().to_string(), ROUNDS.to_string()])
        .envs(nats.client_env())
        .output()
        .expect("run the hostile client");
    signal_actors("-CONT");
    assert!(output.status.success(), "hostile client failed:\n{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("client report: {e}: {:?}", output.stdout));

    let summary = learner.summary();
    assert_eq!(summary["solved"], true, "the run still reaches its target: {summary}");
    // The pointer was forged at version 2^64 - 1 when the learner was at `forged_at`. Training
    // went on far beyond it (more than twice `max_policy_lag`), so the actors followed the
    // learner's later pointers: the run neither froze nor went back.
    let forged_at = report["forged_at"].as_u64().expect("forged_at");
    let updates = summary["updates"].as_u64().expect("updates");
    assert!(updates > forged_at + 20, "training froze after the forged pointer: {summary}\n{report}");
    assert!(summary["policy_version"].as_u64().expect("version") > forged_at, "{summary}");
    let rejected = &summary["segments_rejected"];
    for (reason, sent) in report["sent"].as_object().expect("sent by reason") {
        assert_eq!(rejected[reason], *sent, "reason {reason}: {summary}\nsent: {report}");
    }
    // The replayed segment went out once per round, the same bytes each time: every copy after
    // the first is skipped by the duplicate filter (`seen::SeenSegments`), not trained on again.
    let rounds = report["sent"]["bad_magic"].as_u64().expect("rounds sent");
    let duplicates = summary["segments_duplicate"].as_u64().expect("segments_duplicate in the summary");
    assert!(duplicates + 1 >= rounds, "{duplicates} duplicates skipped of {rounds} copies: {summary}");
    let growth = report["rss_after"].as_i64().expect("rss") - report["rss_before"].as_i64().expect("rss");
    eprintln!("learner resident set: {report}");
    assert!(growth <= MAX_RSS_GROWTH_BYTES, "the learner grew by {growth} bytes under attack");
    for actor in &mut actors {
        assert!(actor.child.try_wait().expect("wait").is_none(), "an actor exited:\n{}", actor.log());
        assert!(!actor.log().contains("panicked"), "{}", actor.log());
    }
    assert!(!learner.log().contains("panicked"), "{}", learner.log());
}
