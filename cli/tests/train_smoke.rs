//! Smoke tests of the `volley` binary: a tiny embedded run, and clear errors for bad flags.

mod common;
use common::{read_json, train_in, volley, SMALL_GRU_ON_MEMORY};

/// Stitched BPTT windows of 4 segments of 8 steps, 8 segments a batch, to a budget of 4096 steps
/// (no target, so every run takes the whole budget).
const STITCHED_WINDOWS: [&str; 10] = [
    "--segment-len",
    "8",
    "--batch-segments",
    "8",
    "--bptt-segments",
    "4",
    "--max-env-steps",
    "4096",
    "--target-return",
    "1e9",
];

#[test]
fn tiny_train_run_prints_summary_and_writes_run_dir() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    let summary = train_in(&run_dir, &["--max-env-steps", "1024", "--segment-len", "16", "--batch-segments", "4"]);
    for key in ["env_steps", "wall_secs", "final_mean_return", "solved", "updates", "policy_version"] {
        assert!(summary.get(key).is_some(), "summary lacks {key}: {summary}");
    }
    assert!(summary["env_steps"].as_u64().expect("env_steps") >= 1024);
    assert!(summary["updates"].as_u64().expect("updates") >= 1);
    assert_eq!(summary["stop_reason"], "env_step_budget");
    for file in ["spec.json", "metrics.jsonl", "curve.svg", "summary.json"] {
        assert!(run_dir.join(file).is_file(), "run directory lacks {file}");
    }
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics");
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().expect("a row")).expect("json row");
    let loss = first["loss_total"].as_f64().expect("finite loss");
    assert!(loss.is_finite());
}

#[test]
fn selection_flags_reach_the_run_spec_and_training_runs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    let summary = train_in(
        &run_dir,
        &[
            "--max-env-steps",
            "2048",
            "--segment-len",
            "16",
            "--batch-segments",
            "4",
            "--select-priority-alpha",
            "0.6",
            "--select-priority-beta",
            "1",
            "--select-pool-factor",
            "3",
            "--select-zero-variance-min-group",
            "4",
            "--select-max-abs-reward",
            "10",
        ],
    );
    assert!(summary["updates"].as_u64().expect("updates") >= 1, "{summary}");
    let spec = read_json(&run_dir.join("spec.json"));
    let selection = &spec["hyper"]["selection"];
    assert_eq!(selection["priority"]["alpha"], 0.6, "{selection}");
    assert_eq!(selection["priority"]["beta"], 1.0);
    assert_eq!(selection["priority"]["pool_factor"], 3);
    assert_eq!(selection["zero_variance"]["min_group"], 4);
    assert_eq!(selection["guard"]["max_abs_reward"], 10.0);
}

#[test]
fn gru_and_vtrace_flags_run_on_the_memory_task() {
    let rest = ["--loss", "vtrace", "--max-env-steps", "512", "--segment-len", "8", "--batch-segments", "4"];
    train_summary(&[&SMALL_GRU_ON_MEMORY[..], &rest].concat());
}

/// Issue 18: stitched BPTT windows train end to end on the embedded bus, with V-trace and
/// PPO; every segment lands in a full window (one actor, no breaks), and the samples per update
/// stay `batch_segments · T`.
#[test]
fn stitched_bptt_windows_train_on_the_memory_task() {
    for loss in ["vtrace", "ppo"] {
        let rest = ["--loss", loss, "--ppo-minibatches", "1"];
        let summary = train_summary(&[&SMALL_GRU_ON_MEMORY[..], &rest, &STITCHED_WINDOWS].concat());
        assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
        assert!(summary["updates"].as_u64().expect("updates") >= 4, "{summary}");
        let windows = &summary["windows"];
        assert!(windows["full"].as_u64().expect("full windows") >= 8, "{summary}");
        for short in ["gap", "evicted", "lag"] {
            assert_eq!(windows[short], 0, "{loss}: {summary}");
        }
    }
}

fn assert_rejected(args: &[&str], expected: &str) {
    let output = volley().args(args).output().expect("run volley");
    assert!(!output.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(expected), "{args:?}: expected {expected:?} in {stderr}");
}

#[test]
fn invalid_flags_get_clear_errors() {
    assert_rejected(&["train", "--env", "pong"], "invalid value 'pong'");
    assert_rejected(&["train", "--actors", "0"], "--actors: 0 out of range");
    assert_rejected(&["train", "--torso", "64,x"], "--torso: \"x\" is not a width");
    assert_rejected(&["train", "--segment-len", "0"], "segment_len");
    assert_rejected(&["train", "--max-secs", "0"], "--max-secs");
    assert_rejected(&["train", "--gamma", "1.5"], "gamma");
    assert_rejected(&["train", "--run", "Bad.Name"], "invalid run id");
    assert_rejected(&["train", "--ppo-minibatches", "9", "--batch-segments", "8"], "ppo_minibatches");
    assert_rejected(&["train", "--select-priority-alpha=-1"], "selection.priority.alpha");
    assert_rejected(&["train", "--select-zero-variance-min-group", "1"], "selection.zero_variance.min_group");
    assert_rejected(&["train", "--select-priority-beta", "0.5"], "--select-priority-alpha");
    assert_rejected(&["train", "--bptt-segments", "4"], "needs a recurrent core (--core gru)");
    assert_rejected(&["train", "--core", "gru", "--bptt-segments", "3"], "not a multiple of bptt.segments");
}

/// `volley train ARGS` in a run directory of its own, removed afterwards: its summary.
fn train_summary(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("temp dir");
    train_in(&dir.path().join("run"), args)
}

#[test]
fn the_bare_command_solves_cartpole() {
    let summary = train_summary(&[]);
    assert_eq!(summary["solved"], true, "{summary}");
    assert!(summary["final_mean_return"].as_f64().expect("mean") >= 475.0, "{summary}");
    assert_eq!(summary["stop_reason"], "solved");
}

#[test]
fn a_gru_solves_the_memory_task_where_an_mlp_stays_at_chance() {
    let gru = train_summary(&["--env", "memory", "--core", "gru"]);
    assert_eq!(gru["solved"], true, "{gru}");
    let mlp = train_summary(&["--env", "memory", "--max-env-steps", "50000"]);
    let mlp_return = mlp["final_mean_return"].as_f64().expect("mean");
    // Two cues: chance is 0.5; 100 episodes put the mean within about ±0.15 of it.
    assert!((0.3..=0.7).contains(&mlp_return), "the MLP cannot beat chance: {mlp}");
}

/// Issue 14: a continuous environment trains end to end on the embedded bus with the Gaussian
/// head, squashed or not, with finite losses and every segment accepted.
#[test]
fn pendulum_trains_with_a_gaussian_head() {
    for extra in [&[][..], &["--squash-actions", "--loss", "vtrace"][..], &["--normalize-obs"][..]] {
        let dir = tempfile::tempdir().expect("temp dir");
        let run_dir = dir.path().join("run");
        let mut args =
            vec!["--env", "pendulum", "--max-env-steps", "4096", "--segment-len", "32", "--batch-segments", "8"];
        args.extend(extra);
        let summary = train_in(&run_dir, &args);
        assert!(summary["updates"].as_u64().expect("updates") >= 1, "{summary}");
        let mean = summary["final_mean_return"].as_f64().expect("a mean return after 20 episodes");
        assert!((-16.3 * 200.0..=0.0).contains(&mean), "{summary}");
        assert_eq!(summary["segments_rejected"], 0, "{summary}");
        let spec = read_json(&run_dir.join("spec.json"));
        assert_eq!(spec["policy"]["head"]["gaussian"]["squash"], extra.contains(&"--squash-actions"), "{spec}");
        assert_eq!(spec["policy"]["normalize_obs"], extra.contains(&"--normalize-obs"), "{spec}");
        let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics");
        for line in metrics.lines() {
            let row: serde_json::Value = serde_json::from_str(line).expect("json row");
            assert!(row["loss_total"].as_f64().expect("loss").is_finite(), "{row}");
        }
    }
}

/// Issue 48: `--progress quiet` still printed INFO and WARN lines (the training line, the
/// backend, the CUDA fallback on a CPU-only machine). Quiet prints the summary and nothing else;
/// an explicit `RUST_LOG` still wins.
#[test]
fn quiet_means_quiet_unless_rust_log_asks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |name: &str, rust_log: Option<&str>| {
        let mut command = volley();
        command
            .args(["train", "--max-env-steps", "512", "--progress", "quiet", "--run-dir"])
            .arg(dir.path().join(name));
        command.env_remove("RUST_LOG");
        if let Some(filter) = rust_log {
            command.env("RUST_LOG", filter);
        }
        let output = command.output().expect("run volley");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON summary");
        assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
        String::from_utf8(output.stderr).expect("utf-8 stderr")
    };
    let quiet = run("quiet", None);
    assert!(quiet.is_empty(), "--progress quiet printed:\n{quiet}");
    let asked = run("asked", Some("info"));
    assert!(asked.contains("learner backend"), "RUST_LOG=info is an explicit override:\n{asked}");
}

/// Issue 48: reruns overwrote `runs/<run>-<env>-<seed>` without a word. A rerun into the
/// default directory takes the next free `-N` suffix and says so; a `--run-dir` that already
/// holds a run is refused with the reason, and the run in it is left as it was.
#[test]
fn reruns_never_overwrite_a_run_directory() {
    let cwd = tempfile::tempdir().expect("temp dir");
    let train = |extra: &[&str]| {
        volley()
            .current_dir(cwd.path())
            .env_remove("RUST_LOG")
            .args(["train", "--max-env-steps", "256", "--progress", "lines"])
            .args(extra)
            .output()
            .expect("run volley")
    };
    let mut dirs = Vec::new();
    for _ in 0..3 {
        let output = train(&[]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON summary");
        dirs.push(summary["run_dir"].as_str().expect("run_dir").to_string());
        if dirs.len() > 1 {
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(stderr.contains("the default run directory exists"), "the suffix is not said:\n{stderr}");
        }
    }
    assert_eq!(dirs, ["runs/local-cartpole-1", "runs/local-cartpole-1-2", "runs/local-cartpole-1-3"]);
    let first_summary = cwd.path().join("runs/local-cartpole-1/summary.json");
    let before = std::fs::read(&first_summary).expect("the first run's summary");
    let output = train(&["--run-dir", "runs/local-cartpole-1"]);
    assert!(!output.status.success(), "an explicit --run-dir holding a run must be refused");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("already holds a run"), "{stderr}");
    assert_eq!(std::fs::read(&first_summary).expect("still there"), before, "the refused run touched the old one");
}

/// Issue 48: with `--bptt-segments 8` the progress line showed lag 15 while the summary said
/// `lag_max` 8: the line reported the lag the learner trained on, the summary the lag of
/// segments on arrival. The summary's `lag_max` is now the largest trained-on lag, the same
/// number as `metrics.jsonl`'s (and the progress line's), and the arrival lag has its own name.
#[test]
fn summary_lag_max_is_the_trained_on_lag_of_the_progress_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    let summary = train_in(&run_dir, &[&SMALL_GRU_ON_MEMORY[..], &STITCHED_WINDOWS].concat());
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics");
    let rows_max = metrics
        .lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line).expect("json row")["lag_max"].as_u64().expect("lag")
        })
        .max()
        .expect("rows");
    assert_eq!(summary["lag_max"].as_u64(), Some(rows_max), "{summary}");
    let on_arrival = summary["lag_max_on_arrival"].as_u64().expect("lag_max_on_arrival");
    // A window's oldest segment waits for the three after it.
    assert!(rows_max > on_arrival, "windows should wait: {summary}");
}
