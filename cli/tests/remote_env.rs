//! Remote environments over a real nats-server: `volley learner` and `volley actor` processes
//! training on environments served by other processes (docs/ENV_PROTOCOL.md).
//!
//! - `gymnasium_cartpole_served_by_python_is_solved_over_nats`: Gymnasium's CartPole-v1 served
//!   by the Python package (`python/`, `volley-envs serve`). It needs a Python with
//!   `volley_envs` and `gymnasium` installed: `$VOLLEY_ENVS_PYTHON` (else `python3`). Without
//!   one the test says so and returns, unless `VOLLEY_REQUIRE_PYTHON_ENVS=1` is set, as
//!   `.ci/run` does: then it fails with the reason, so CI can never pass it silently.
//! - `a_killed_env_server_aborts_its_episodes_and_the_actor_continues`: Rust only
//!   (`volley env-serve`).
//!
//! Runs are bounded by environment steps (the learner's budget or target), never by time.

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use volley_testkit::TestNats;

mod common;
use common::{actor_args, learner_args, read_json, strings, volley_args, Proc};

/// Both tests run a broker, servers, a learner and actors: one at a time on two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Upper bound on any wait: a safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(300);

/// Set by `.ci/run`: a missing Python environment server is a failure, not a skip.
const REQUIRE_PYTHON_ENV: &str = "VOLLEY_REQUIRE_PYTHON_ENVS";
/// The Python interpreter that has `volley_envs` and `gymnasium` (default `python3`).
const PYTHON_ENV: &str = "VOLLEY_ENVS_PYTHON";

fn learner(nats: &TestNats, dir: &Path, run: &str, extra: &[&str]) -> Proc {
    Proc::volley(dir, "learner", &learner_args(nats, run, dir, extra), PATIENCE)
}

fn actor(nats: &TestNats, dir: &Path, run: &str, id: &str, extra: &[&str]) -> Proc {
    Proc::volley(dir, id, &actor_args(nats, run, id, extra), PATIENCE)
}

/// Regression test for issue 48 item 4: one SIGINT stops a learner, or `volley train`, that
/// waits for a server of its environment service to tell the spaces (the first one was
/// ignored, "signal again to abort"). The learner exits as one stopped before its run ended
/// (75), train as one interrupted mid-run (0); both say what they were waiting for.
#[test]
fn one_signal_stops_a_process_waiting_for_an_environment_server() {
    let _serial = serial();
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run").display().to_string();
    let commands = [
        ("learner", learner(&nats, dir.path(), "waiting", &["--env", "remote:nobody"]), 75),
        (
            "train",
            Proc::volley(
                dir.path(),
                "train",
                &volley_args("train", &nats, &["--env", "remote:nobody", "--run-dir", &run_dir]),
                PATIENCE,
            ),
            0,
        ),
    ];
    for (name, mut process, expected) in commands {
        process.wait_for_log("waiting for a server of environment service nobody");
        process.interrupt();
        let status = process.wait_exit();
        assert_eq!(status.code(), Some(expected), "{name}: {status}\n{}", process.log());
        assert!(
            process.log().contains("interrupted while waiting for a server of environment service nobody"),
            "{name}:\n{}",
            process.log()
        );
    }
}

/// A minimal HTTP/1.0 GET of the actor's metrics.
fn metric(addr: &str, name: &str) -> f64 {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    response
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{response}"))
}

/// The Python interpreter with `volley_envs` and `gymnasium`, or why there is none.
fn python_with_volley_envs() -> Result<String, String> {
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".to_string());
    let probe = Command::new(&python)
        .args(["-c", "import volley_envs, gymnasium, nats, msgpack; print(gymnasium.__version__)"])
        .output()
        .map_err(|err| format!("cannot run {python:?}: {err}"))?;
    if probe.status.success() {
        Ok(python)
    } else {
        Err(format!(
            "{python:?} cannot import volley_envs and gymnasium (`pip install ./python`, or set {PYTHON_ENV}): {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ))
    }
}

/// Gymnasium's CartPole-v1, served by two `volley-envs serve` processes, solved by a Rust
/// learner and two actor processes over NATS (issue #7).
#[test]
fn gymnasium_cartpole_served_by_python_is_solved_over_nats() {
    let python = match python_with_volley_envs() {
        Ok(python) => python,
        Err(reason) if std::env::var(REQUIRE_PYTHON_ENV).is_ok_and(|v| v == "1") => {
            panic!("{REQUIRE_PYTHON_ENV}=1 but the Python environment server is unavailable: {reason}")
        }
        Err(reason) => {
            eprintln!("SKIPPED gymnasium_cartpole_served_by_python_is_solved_over_nats: {reason}");
            return;
        }
    };
    let _serial = serial();
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut servers: Vec<Proc> = (0..2)
        .map(|i| python_server(dir.path(), &format!("gym-{i}"), &python, &nats, "gymnasium:CartPole-v1"))
        .collect();
    // The target is the server's reward_threshold (475 for CartPole-v1); the budget bounds the run.
    let mut learner = learner(&nats, dir.path(), "gym", &["--env", "remote:cartpole-v1", "--max-env-steps", "600000"]);
    learner.wait_for_log("remote environment found");
    assert!(learner.log().contains("reward_threshold=Some(475.0)"), "{}", learner.log());
    let mut actors: Vec<Proc> = (0..2).map(|i| actor(&nats, dir.path(), "gym", &format!("actor-{i}"), &[])).collect();
    let summary = learner.summary();
    assert_eq!(summary["solved"], true, "{summary}\n{}", learner.log());
    assert!(summary["final_mean_return"].as_f64().expect("mean return") >= 475.0, "{summary}");
    for actor in &mut actors {
        let log = actor.log();
        assert!(log.contains("env=remote:cartpole-v1"), "{log}");
        assert!(!log.contains("environment session lost"), "no server was lost: {log}");
        assert!(actor.terminate_and_wait().success(), "{}", actor.log());
    }
    for server in &mut servers {
        assert!(server.terminate_and_wait().success(), "{}", server.log());
    }
}

/// An environment server killed mid-run: the actor aborts the episodes it hosted, counts them
/// (metrics and log), re-opens them on the surviving server and training reaches its budget.
#[test]
fn a_killed_env_server_aborts_its_episodes_and_the_actor_continues() {
    let _serial = serial();
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut servers: Vec<Proc> = (0..2)
        .map(|i| Proc::volley(dir.path(), &format!("env-serve-{i}"), &volley_args("env-serve", &nats, &[]), PATIENCE))
        .collect();
    for server in &mut servers {
        server.wait_for_log("environment server ready");
    }
    let mut learner = learner(
        &nats,
        dir.path(),
        "killenv",
        &["--env", "remote:cartpole", "--max-env-steps", "60000", "--target-return", "1e9"],
    );
    let metrics_addr = format!("127.0.0.1:{}", volley_testkit::free_port());
    let mut actor = actor(&nats, dir.path(), "killenv", "actor-0", &["--metrics-addr", &metrics_addr]);
    actor.wait_for_log("actor started");
    // Both servers host one session of four environments (one session per server found).
    assert_eq!(actor.log().matches("environment session opened").count(), 2, "{}", actor.log());
    // Kill a server once the learner is being fed, early in the 60K-step budget (not on a
    // progress line: those come every 2 s, and a quick machine can finish the budget first).
    let feeding = Instant::now();
    while metric(&metrics_addr, "volley_actor_segments_published_total") < 4.0 {
        assert!(feeding.elapsed() < PATIENCE, "the actor published no segments:\n{}", actor.log());
        thread::sleep(Duration::from_millis(10));
    }
    servers[0].kill9();
    let started = Instant::now();
    // The client counts the lost session first; the rollout counts the aborted episodes when
    // it processes that step: wait for both rather than race the scrape between them.
    while metric(&metrics_addr, "volley_actor_env_sessions_lost_total") < 1.0
        || metric(&metrics_addr, "volley_actor_episodes_aborted_total") < 4.0
    {
        assert!(started.elapsed() < PATIENCE, "the actor never noticed the lost server:\n{}", actor.log());
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&metrics_addr, "volley_actor_episodes_aborted_total"), 4.0, "{}", actor.log());
    let summary = learner.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
    assert!(summary["env_steps"].as_u64().expect("steps") >= 60_000, "{summary}");
    assert!(summary["updates"].as_u64().expect("updates") > 0, "{summary}");
    let log = actor.log();
    assert!(log.contains("environment session lost"), "{log}");
    assert_eq!(log.matches("environment session opened").count(), 3, "re-opened on the survivor: {log}");
    assert_eq!(metric(&metrics_addr, "volley_actor_env_sessions_lost_total"), 1.0);
    assert!(actor.terminate_and_wait().success(), "{}", actor.log());
    assert!(servers[1].terminate_and_wait().success(), "{}", servers[1].log());
}

/// A Python server started with `python -m volley_envs serve <env>`, ready to answer; its log
/// is `<dir>/<name>.log`.
fn python_server(dir: &Path, name: &str, python: &str, nats: &TestNats, env: &str) -> Proc {
    let ca = nats.ca_file().display().to_string();
    let args = strings(&["-m", "volley_envs", "serve", env, "--nats", &nats.url(), "--tls-ca", &ca]);
    let mut server = Proc::spawn(dir, name, python, &args, PATIENCE);
    server.wait_for_log("environment server ready");
    server
}

/// A broker, a Python server of `env` as service `service`, and a learner process for the run
/// named after the service on `remote:<service>` with `flags`, past its lookup of the spaces.
struct ServedRun {
    nats: TestNats,
    dir: tempfile::TempDir,
    server: Proc,
    learner: Proc,
}

fn served_run(python: &str, env: &str, service: &str, flags: &[&str]) -> ServedRun {
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let server = python_server(dir.path(), "gym-box", python, &nats, env);
    let remote = format!("remote:{service}");
    let mut args = vec!["--env", remote.as_str()];
    args.extend_from_slice(flags);
    let mut learner = learner(&nats, dir.path(), service, &args);
    learner.wait_for_log("remote environment found");
    ServedRun { nats, dir, server, learner }
}

/// A short learner + actor run over a box-action environment served by Python (protocol
/// version 2): the learner's spec gets a Gaussian head with the server's action width, the
/// actor sends f32 actions, and the run reaches its env-step budget with no environment error.
/// Returns the learner's summary and the actor's log.
fn box_action_run(
    python: &str,
    env: &str,
    service: &str,
    action_dim: usize,
    steps: &str,
) -> (serde_json::Value, String) {
    let _serial = serial();
    let remote = format!("remote:{service}");
    let ServedRun { nats, dir, mut server, mut learner } =
        served_run(python, env, service, &["--max-env-steps", steps, "--target-return", "1e9", "--segment-len", "32"]);
    let log = learner.log();
    assert!(log.contains(&format!("n_actions={action_dim}")) && log.contains("continuous=true"), "{log}");
    let mut actor = actor(&nats, dir.path(), service, "actor-0", &[]);
    let summary = learner.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}\n{}", learner.log());
    let actor_log = actor.log();
    assert!(actor_log.contains(&format!("env={remote}")), "{actor_log}");
    assert!(!actor_log.contains("environment session lost"), "{actor_log}");
    assert!(!actor_log.contains("remote_env_failed"), "no environment failed: {actor_log}");
    assert!(actor.terminate_and_wait().success(), "{actor_log}");
    let server_log = server.log();
    assert!(!server_log.contains("malformed environment request"), "{server_log}");
    assert!(server.terminate_and_wait().success(), "{server_log}");
    (summary, actor_log)
}

/// The Python interpreter, or `None` after saying why the test is skipped (a failure when
/// `.ci/run` requires the Python server).
fn python_or_skip(test: &str, extra_import: Option<&str>) -> Option<String> {
    let checked = python_with_volley_envs().and_then(|python| match extra_import {
        None => Ok(python),
        Some(module) => {
            let probe = Command::new(&python).args(["-c", &format!("import {module}")]).output();
            match probe {
                Ok(out) if out.status.success() => Ok(python),
                _ => Err(format!("{python:?} cannot import {module} (see .ci/run for the pinned packages)")),
            }
        }
    });
    match checked {
        Ok(python) => Some(python),
        Err(reason) if std::env::var(REQUIRE_PYTHON_ENV).is_ok_and(|v| v == "1") => {
            panic!("{REQUIRE_PYTHON_ENV}=1 but {test} cannot run: {reason}")
        }
        Err(reason) => {
            eprintln!("SKIPPED {test}: {reason}");
            None
        }
    }
}

/// Gymnasium's Pendulum-v1 (box actions in [-2, 2], one value) through the environment
/// service: distributed learner and actor, a short budget, no learning target.
#[test]
fn gymnasium_pendulum_box_actions_train_over_nats() {
    let Some(python) = python_or_skip("gymnasium_pendulum_box_actions_train_over_nats", None) else { return };
    let (summary, _) = box_action_run(&python, "gymnasium:Pendulum-v1", "pendulum-v1", 1, "4000");
    assert!(summary["env_steps"].as_u64().expect("steps") >= 4000, "{summary}");
}

/// The CI smoke run of a MuJoCo environment through the service (issue 14): HalfCheetah-v5,
/// six action values, a few thousand env steps. Needs `mujoco`; `.ci/run` installs it.
#[test]
fn gymnasium_halfcheetah_smoke_run_over_nats() {
    let Some(python) = python_or_skip("gymnasium_halfcheetah_smoke_run_over_nats", Some("mujoco")) else { return };
    let (summary, _) = box_action_run(&python, "gymnasium:HalfCheetah-v5", "halfcheetah-v5", 6, "3000");
    assert!(summary["env_steps"].as_u64().expect("steps") >= 3000, "{summary}");
}

/// `volley train` (embedded learner, actor threads) on a box-action environment served over
/// NATS: each actor thread opens its own sessions, and the spec written to the run directory
/// carries the server's action bounds.
#[test]
fn embedded_train_steps_a_remote_box_env() {
    let Some(python) = python_or_skip("embedded_train_steps_a_remote_box_env", None) else { return };
    let _serial = serial();
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut server = python_server(dir.path(), "gym-box", &python, &nats, "gymnasium:Pendulum-v1");
    let run_dir = dir.path().join("run").display().to_string();
    let args = volley_args(
        "train",
        &nats,
        &[
            "--env",
            "remote:pendulum-v1",
            "--actors",
            "2",
            "--max-env-steps",
            "3000",
            "--target-return",
            "1e9",
            "--run-dir",
            &run_dir,
            "--progress",
            "lines",
        ],
    );
    let mut train = Proc::volley(dir.path(), "train", &args, PATIENCE);
    let summary = train.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}\n{}", train.log());
    assert!(summary["env_steps"].as_u64().expect("steps") >= 3000, "{summary}");
    assert_eq!(train.log().matches("remote environments ready").count(), 2, "{}", train.log());
    let spec = read_json(&dir.path().join("run/spec.json"));
    assert_eq!(spec["env"]["action_box"], serde_json::json!({"low": [-2.0], "high": [2.0]}), "{spec}");
    assert_eq!(spec["policy"]["n_actions"], 1, "{spec}");
    assert!(server.terminate_and_wait().success(), "{}", server.log());
}

/// The CI smoke run of Atari through the service (issue 15): `volley-envs serve atari:Pong`
/// sends single 84×84 `u8` frames (protocol version 3), the actor stacks 4, and the learner
/// trains the Nature-DQN network on them for a couple of thousand env steps (no learning
/// target). Needs `ale_py` and OpenCV; `.ci/run` installs them.
#[test]
fn atari_pong_smoke_run_over_nats() {
    let Some(python) = python_or_skip("atari_pong_smoke_run_over_nats", Some("ale_py, cv2")) else { return };
    let _serial = serial();
    let ServedRun { nats, dir, mut server, mut learner } = served_run(
        &python,
        "atari:Pong",
        "pong",
        &[
            "--frame-stack",
            "4",
            "--conv",
            "nature",
            "--torso",
            "512",
            "--activation",
            "relu",
            "--segment-len",
            "32",
            "--max-env-steps",
            "2048",
            "--target-return",
            "1e9",
        ],
    );
    // Single served frames of 1×84×84 bytes.
    assert!(learner.log().contains("obs_dim=7056"), "{}", learner.log());
    let mut actor = actor(&nats, dir.path(), "pong", "actor-0", &[]);
    let summary = learner.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}\n{}", learner.log());
    assert!(summary["env_steps"].as_u64().expect("steps") >= 2048, "{summary}");
    assert!(summary["updates"].as_u64().expect("updates") >= 1, "{summary}");
    let actor_log = actor.log();
    assert!(!actor_log.contains("environment session lost"), "{actor_log}");
    assert!(!actor_log.contains("remote_env_failed"), "no environment failed: {actor_log}");
    assert!(actor.terminate_and_wait().success(), "{actor_log}");
    let server_log = server.log();
    assert!(!server_log.contains("malformed environment request"), "{server_log}");
    assert!(server.terminate_and_wait().success(), "{server_log}");
}

/// Issue 18, item 4: a served Gymnasium environment that snapshots (CartPole-v1: its state,
/// generator and time limit, no pickle) runs scheduled episodes (`--work`): the actor saves
/// snapshots through the environment protocol, restarts episodes from them on the server
/// (`restore`) and starts fresh ones with a reset of that environment alone (version 3).
#[test]
fn work_items_run_on_a_served_env_that_snapshots() {
    let Some(python) = python_or_skip("work_items_run_on_a_served_env_that_snapshots", None) else { return };
    let _serial = serial();
    let ServedRun { nats, dir, mut server, mut learner } = served_run(
        &python,
        "gymnasium:CartPole-v1",
        "cartpole-v1",
        &[
            "--work",
            "--restart-share",
            "0.5",
            "--snapshot-every",
            "10",
            "--max-env-steps",
            "8000",
            "--target-return",
            "1e9",
        ],
    );
    let metrics_addr = format!("127.0.0.1:{}", volley_testkit::free_port());
    let mut actor = actor(&nats, dir.path(), "cartpole-v1", "actor-0", &["--metrics-addr", &metrics_addr]);
    let summary = learner.summary();
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}\n{}", learner.log());
    let saved = metric(&metrics_addr, "volley_actor_snapshots_saved_total");
    let resumed = metric(&metrics_addr, "volley_actor_episodes_resumed_total");
    let completed = metric(&metrics_addr, "volley_actor_work_items_completed_total");
    let failures = metric(&metrics_addr, "volley_actor_resume_failures_total");
    let actor_log = actor.log();
    assert!(
        saved > 0.0 && resumed > 0.0 && completed > 0.0,
        "saved {saved}, resumed {resumed}, completed {completed}: {actor_log}"
    );
    assert_eq!(failures, 0.0, "every saved state restored: {actor_log}");
    assert!(!actor_log.contains("scheduled reset failed"), "fresh starts reset one environment: {actor_log}");
    assert!(!actor_log.contains("environment session lost"), "{actor_log}");
    assert!(!actor_log.contains("remote_env_failed"), "no environment failed: {actor_log}");
    assert!(actor.terminate_and_wait().success(), "{actor_log}");
    let server_log = server.log();
    assert!(server.terminate_and_wait().success(), "{server_log}");
}
