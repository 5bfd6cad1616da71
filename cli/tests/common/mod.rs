#![allow(dead_code)] // each test crate uses part of these helpers
//! Process helpers shared by the CLI's integration tests: the command lines of `volley`
//! processes connected to a test broker, and [`Proc`], which spawns `volley` (or another
//! program) with its stderr in a log file, waits for log lines, exit and the JSON summary, and
//! always reaps the child.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use volley_testkit::TestNats;

/// `args` as owned strings, for [`Proc::spawn`].
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|arg| arg.to_string()).collect()
}

/// The `volley` binary under test, as a `Command` to run to completion.
pub fn volley() -> Command {
    Command::new(env!("CARGO_BIN_EXE_volley"))
}

/// A small GRU (16 units over a 16-unit torso) on the memory task: the recurrent runs' flags.
pub const SMALL_GRU_ON_MEMORY: [&str; 8] = ["--env", "memory", "--core", "gru", "--gru-hidden", "16", "--torso", "16"];

/// Run `volley train ARGS --progress quiet --run-dir RUN_DIR` to its end and return the JSON
/// summary it printed; fails with its stderr when it does not succeed.
pub fn train_in(run_dir: &Path, args: &[&str]) -> serde_json::Value {
    let output = volley()
        .arg("train")
        .args(args)
        .args(["--progress", "quiet", "--run-dir"])
        .arg(run_dir)
        .output()
        .expect("run volley");
    assert!(output.status.success(), "volley train {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("one JSON summary on stdout")
}

/// The JSON file at `path` (a run directory's `spec.json`, a summary).
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("{} is not JSON: {err}", path.display()))
}

/// `volley <subcommand>` connected to `nats` ([`TestNats::client_args`]), then `rest`.
pub fn volley_args(subcommand: &str, nats: &TestNats, rest: &[&str]) -> Vec<String> {
    let mut args = vec![subcommand.to_string()];
    args.extend(nats.client_args());
    args.extend(strings(rest));
    args
}

/// `volley learner` of run `run` on `nats`, checkpointing in `<dir>/checkpoints`, then `extra`.
pub fn learner_args(nats: &TestNats, run: &str, dir: &Path, extra: &[&str]) -> Vec<String> {
    let checkpoints = dir.join("checkpoints").display().to_string();
    let mut args = volley_args("learner", nats, &["--run", run, "--checkpoint-dir", &checkpoints]);
    args.extend(strings(extra));
    args
}

/// `volley actor` with id `id` in run `run` on `nats`, stepping 8 environments, then `extra`.
pub fn actor_args(nats: &TestNats, run: &str, id: &str, extra: &[&str]) -> Vec<String> {
    let mut args = volley_args("actor", nats, &["--run", run, "--actor-id", id, "--envs", "8"]);
    args.extend(strings(extra));
    args
}

/// A child process whose stderr goes to `<dir>/<name>.log`; killed when dropped.
pub struct Proc {
    /// The child.
    pub child: Child,
    log_path: PathBuf,
    patience: Duration,
}

impl Proc {
    /// Spawn `program` with `args`; `patience` bounds every wait (a safety net against hangs,
    /// not a timed assertion).
    pub fn spawn(dir: &Path, name: &str, program: &str, args: &[String], patience: Duration) -> Proc {
        let log_path = dir.join(format!("{name}.log"));
        let log = fs::File::create(&log_path).expect("log file");
        let child = Command::new(program)
            .args(args)
            .env("RUST_LOG", "info")
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {program}: {err}"));
        Proc { child, log_path, patience }
    }

    /// Spawn the `volley` binary under test.
    pub fn volley(dir: &Path, name: &str, args: &[String], patience: Duration) -> Proc {
        Proc::spawn(dir, name, env!("CARGO_BIN_EXE_volley"), args, patience)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Wait until the log contains `needle`; fails if the process exits first.
    pub fn wait_for_log(&mut self, needle: &str) {
        let started = Instant::now();
        while !self.log().contains(needle) {
            let exited = self.child.try_wait().expect("wait");
            assert!(exited.is_none(), "exited ({exited:?}) without logging {needle:?}:\n{}", self.log());
            assert!(started.elapsed() < self.patience, "never logged {needle:?}:\n{}", self.log());
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait for a successful exit and parse the one JSON line it printed.
    pub fn summary(&mut self) -> serde_json::Value {
        self.summary_with_exit_code(0)
    }

    /// Wait for the exit, check its status code, and parse the JSON summary on stdout.
    pub fn summary_with_exit_code(&mut self, code: i32) -> serde_json::Value {
        let status = self.wait_exit();
        let mut stdout = String::new();
        self.child.stdout.take().expect("piped").read_to_string(&mut stdout).expect("stdout");
        assert_eq!(status.code(), Some(code), "exit {status}:\n{}", self.log());
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("summary {stdout:?}: {e}\n{}", self.log()))
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send SIGTERM (returns at once; see [`Proc::wait_exit`]).
    pub fn terminate(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
    }

    /// Send SIGINT, as a Ctrl-C would (returns at once; see [`Proc::wait_exit`]).
    pub fn interrupt(&mut self) {
        let _ = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status();
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate_and_wait(&mut self) -> ExitStatus {
        self.terminate();
        self.wait_exit()
    }

    /// Wait for the process to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(started.elapsed() < self.patience, "process did not stop:\n{}", self.log());
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
