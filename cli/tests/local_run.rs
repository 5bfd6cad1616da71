//! `deploy/local-run.sh`: a whole distributed run on one machine (nats-server, a learner and
//! actors), started as a user does from a terminal and stopped with one Ctrl-C.
//!
//! The script runs the `volley` binary under test (`VOLLEY_BIN`) and the test kit's
//! `nats-server` (put first on `PATH`); the learner's budget is never reached, so only the
//! signal stops the run.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use volley_testkit::{find_nats_server, free_port, TestNats};

/// Upper bound on starting the run (a debug build, two shared cores): a safety net against
/// hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(180);

/// How long one Ctrl-C may take to stop everything. Every process stops at once on its own
/// signal (the actors flush, the learner writes its checkpoint); the bug this guards against
/// (issue 48 item 1) took about 31 s, the learner waiting out its deadline on a broker that
/// the terminal's SIGINT had stopped first.
const STOP_BOUND: Duration = Duration::from_secs(20);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-run.sh")
}

/// `PATH` with the test kit's nats-server first.
fn path_with_nats_server() -> String {
    let nats = find_nats_server();
    let dir = nats.parent().expect("nats-server has a directory");
    format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default())
}

/// Start the script with `script_flags`, data directory `data` and then `-- learner_flags`, in
/// a process group of its own, as a shell starts a foreground job: the terminal's Ctrl-C is a
/// SIGINT to that whole group. Its stderr goes to `stderr`.
///
/// The script gets SIGINT at its default disposition, as a terminal's job does, whatever this
/// test process inherited: a test run started in the background of a non-interactive shell
/// (`cargo test &` in a script) starts with SIGINT ignored, and bash can neither trap nor reset
/// a signal that was ignored when it started, so the script would never see the Ctrl-C.
fn spawn_local_run(script_flags: &[&str], data: &Path, stderr: &Path, learner_flags: &[&str]) -> Child {
    let mut command = Command::new("bash");
    // SAFETY: the closure runs in the forked child before exec and calls only `signal`, which
    // is async-signal-safe; it touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::signal(libc::SIGINT, libc::SIG_DFL) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
        .arg(script())
        .args(script_flags)
        .arg("-d")
        .arg(data)
        .arg("--")
        .args(learner_flags)
        .env("VOLLEY_BIN", env!("CARGO_BIN_EXE_volley"))
        .env("PATH", path_with_nats_server())
        .env("VOLLEY_LOCAL_NICE", "0")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(fs::File::create(stderr).expect("stderr file"))
        .process_group(0)
        .spawn()
        .expect("start deploy/local-run.sh")
}

/// The script with one actor on `port`, run `ctrlc`.
fn start_local_run(port: u16, data: &Path, stderr: &Path, learner_flags: &[&str]) -> Child {
    spawn_local_run(&["-n", "1", "-p", &port.to_string(), "-r", "ctrlc"], data, stderr, learner_flags)
}

fn wait_for_file_line(path: &Path, needle: &str, child: &mut Child) {
    let started = Instant::now();
    while !fs::read_to_string(path).unwrap_or_default().contains(needle) {
        let exited = child.try_wait().expect("wait");
        assert!(exited.is_none(), "local-run.sh exited ({exited:?}) before {} said {needle:?}", path.display());
        assert!(started.elapsed() < PATIENCE, "{} never said {needle:?}", path.display());
        thread::sleep(Duration::from_millis(100));
    }
}

fn wait_within(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        if started.elapsed() >= bound {
            return None;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Processes whose command line names `needle` (the run's data directory or port).
fn processes_naming(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        if pid == std::process::id() {
            continue;
        }
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

fn kill_group(child: &Child, signal: &str) {
    let status = Command::new("kill").args([signal, "--", &format!("-{}", child.id())]).status().expect("kill");
    assert!(status.success(), "kill {signal} to the script's process group");
}

/// Regression test for issue 48 item 1: one SIGINT to the script's process group (a Ctrl-C in
/// the terminal) stops the broker, the learner and the actors in order, the learner writing
/// its final checkpoint, the script exiting 0, and no process of the run left behind.
#[test]
fn one_ctrl_c_stops_local_run_cleanly_with_a_final_checkpoint() {
    let data = tempfile::tempdir().expect("temp dir");
    let stderr = data.path().join("local-run.stderr");
    let port = free_port();
    let mut script =
        start_local_run(port, data.path(), &stderr, &["--max-env-steps", "100000000", "--target-return", "1e9"]);
    let logs = data.path().join("logs");
    wait_for_file_line(&logs.join("actor-0.log"), "actor joined the run", &mut script);
    wait_for_file_line(&logs.join("learner.log"), "learner progress", &mut script);
    // Issue 46: the broker requires TLS with the CA the script made, and the learner and the
    // actor got there (a plain-text client would have been refused).
    let nats_log = fs::read_to_string(logs.join("nats.log")).unwrap_or_default();
    assert!(nats_log.contains("TLS required for client connections"), "{nats_log}");
    assert!(data.path().join("tls/ca.crt").is_file(), "no CA in the data directory");

    kill_group(&script, "-INT");
    let status = wait_within(&mut script, STOP_BOUND);
    let said = fs::read_to_string(&stderr).unwrap_or_default();
    if status.is_none() {
        kill_group(&script, "-KILL");
        let _ = script.wait();
    }
    let learner_log = fs::read_to_string(logs.join("learner.log")).unwrap_or_default();
    let status = status.unwrap_or_else(|| {
        panic!("one Ctrl-C did not stop local-run.sh within {STOP_BOUND:?}:\n{said}\nlearner:\n{learner_log}")
    });
    assert!(status.success(), "local-run.sh exited {status}:\n{said}\nlearner:\n{learner_log}");
    assert!(said.contains("stopping"), "the script says what it does:\n{said}");
    assert!(learner_log.contains("final checkpoint written"), "{learner_log}");
    assert!(data.path().join("checkpoints/learner-ctrlc.ckpt").is_file(), "no final checkpoint:\n{learner_log}");
    let left: Vec<String> = [data.path().display().to_string(), format!("127.0.0.1:{port}")]
        .iter()
        .flat_map(|needle| processes_naming(needle))
        .collect();
    assert!(left.is_empty(), "processes left behind: {left:#?}");
}

/// Issue 48 item 1: with the port taken by another broker, the script refuses to start instead
/// of silently running against that broker, and says why.
#[test]
fn local_run_refuses_a_taken_port() {
    let other = TestNats::start();
    let data = tempfile::tempdir().expect("temp dir");
    let stderr = data.path().join("local-run.stderr");
    let mut script = start_local_run(other.port(), data.path(), &stderr, &["--max-env-steps", "1000"]);
    let status = wait_within(&mut script, PATIENCE).expect("local-run.sh did not stop");
    let said = fs::read_to_string(&stderr).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains("already in use"), "{said}");
    assert!(!data.path().join("learner.json").exists(), "no learner was started:\n{said}");
}

/// Issue 46 item 3: `local-run.sh -a` runs the repo's broker config, the learner logging in as
/// `learner-local` and each actor as an NKey identity of its own, made by `volley creds actors`
/// in the data directory: the run takes its step budget with no permission violation and no
/// segment refused, and each actor's id is its identity's name.
#[test]
fn local_run_with_auth_runs_each_actor_as_its_own_identity() {
    let data = tempfile::tempdir().expect("temp dir");
    let stderr = data.path().join("local-run.stderr");
    let port = free_port();
    let mut script = spawn_local_run(
        &["-a", "-n", "2", "-p", &port.to_string()],
        data.path(),
        &stderr,
        &["--max-env-steps", "2000"],
    );
    let status = wait_within(&mut script, PATIENCE);
    if status.is_none() {
        kill_group(&script, "-KILL");
        let _ = script.wait();
    }
    let said = fs::read_to_string(&stderr).unwrap_or_default();
    let logs = data.path().join("logs");
    let status = status.unwrap_or_else(|| panic!("local-run.sh -a did not finish within {PATIENCE:?}:\n{said}"));
    assert!(status.success(), "local-run.sh -a exited {status}:\n{said}");
    let summary: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(data.path().join("learner.json")).expect("learner.json"))
            .expect("the learner's summary");
    assert_eq!(summary["stop_reason"], "env_step_budget", "{summary}");
    assert_eq!(summary["segments_rejected"], serde_json::json!({}), "{summary}");
    let nats_log = fs::read_to_string(logs.join("nats.log")).expect("nats.log");
    assert!(!nats_log.contains("Violation"), "permission violations:\n{nats_log}");
    for index in 0..2 {
        let actor_log = fs::read_to_string(logs.join(format!("actor-{index}.log"))).expect("actor log");
        assert!(actor_log.contains(&format!("actor=actor-{index}")), "actor {index}:\n{actor_log}");
    }
    assert!(data.path().join("identities/actor-3.nk").is_file(), "the identities live in the data directory");
}
