//! Signed weights end to end (issue 46 item 2, docs/SECURITY.md "Signed weights"): keys from
//! `volley keys generate`, a `volley learner` that signs with the private key, an actor given
//! the public key that trains, and an actor given another key that refuses every version.

use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use volley_testkit::TestNats;

mod common;
use common::{actor_args, learner_args, volley, volley_args, Proc};

/// Upper bound on any wait: a safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(180);

/// `volley keys generate --out DIR`: the two files it says it wrote.
fn generate(dir: &Path) -> (String, String) {
    let output = volley().args(["keys", "generate", "--out"]).arg(dir).output().expect("volley keys generate runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let written: serde_json::Value = serde_json::from_slice(&output.stdout).expect("a JSON line");
    let path = |key: &str| written[key].as_str().expect("a path").to_string();
    (path("signing_key"), path("public_key"))
}

fn metric(addr: &str, series: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    body.lines().find_map(|line| line.strip_prefix(series)).and_then(|value| value.trim().parse().ok())
}

#[test]
fn a_learner_signs_with_generated_keys_and_only_actors_trusting_them_take_its_weights() {
    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let (signing_key, public_key) = generate(&dir.path().join("keys"));
    let (_, stranger_key) = generate(&dir.path().join("other"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&signing_key).expect("written").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the private key is the owner's only");
    }
    // Generating again into the same folder never replaces the key.
    let again = volley().args(["keys", "generate", "--out"]).arg(dir.path().join("keys")).output().expect("runs");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("weights-signing-key.pem"));

    let mut learner = Proc::volley(
        dir.path(),
        "learner",
        &learner_args(
            &nats,
            "signed",
            dir.path(),
            &["--max-env-steps", "20000", "--weights-signing-key", &signing_key],
        ),
        PATIENCE,
    );
    let actor = |id: &str, key: &str, metrics: &str| {
        actor_args(&nats, "signed", id, &["--weights-public-key", key, "--metrics-addr", metrics])
    };
    let stranger_metrics = format!("127.0.0.1:{}", volley_testkit::free_port());
    let mut trusting = Proc::volley(
        dir.path(),
        "actor-0",
        &actor("actor-0", &public_key, &format!("127.0.0.1:{}", volley_testkit::free_port())),
        PATIENCE,
    );
    let mut distrusting =
        Proc::volley(dir.path(), "actor-1", &actor("actor-1", &stranger_key, &stranger_metrics), PATIENCE);
    learner.wait_for_log("signing weights");
    trusting.wait_for_log("actor started");
    distrusting.wait_for_log("first weights refused");
    let refused = "volley_actor_weights_signature_refused_total{reason=\"bad_signature\"} ";
    let started = Instant::now();
    while metric(&stranger_metrics, refused).unwrap_or(0.0) < 1.0 {
        assert!(started.elapsed() < PATIENCE, "no refusal counted:\n{}", distrusting.log());
        thread::sleep(Duration::from_millis(50));
    }
    let summary = learner.summary();
    assert!(summary["env_steps"].as_u64().expect("env_steps") >= 20_000, "{summary}");
    assert!(!distrusting.log().contains("actor started"), "{}", distrusting.log());
    assert!(distrusting.log().contains("no trusted key"), "{}", distrusting.log());
    // The run is over, and its end is signed too (issue 46): the actor that trusts the
    // learner's key stops by itself; the other refuses the end, counts it and goes on.
    assert!(trusting.wait_exit().success(), "{}", trusting.log());
    assert!(trusting.log().contains("run finished"), "{}", trusting.log());
    let end_refused = "volley_actor_run_end_refused_total{reason=\"bad_signature\"} ";
    let started = Instant::now();
    while metric(&stranger_metrics, end_refused).unwrap_or(0.0) < 1.0 {
        assert!(started.elapsed() < PATIENCE, "no refused end counted:\n{}", distrusting.log());
        thread::sleep(Duration::from_millis(50));
    }
    assert!(!distrusting.log().contains("run finished"), "{}", distrusting.log());
    distrusting.terminate();
    assert!(distrusting.wait_exit().success(), "{}", distrusting.log());

    // A key file that is not one fails at start, naming the flag and the file.
    let bad = dir.path().join("bad.pem");
    std::fs::write(&bad, "not a key").expect("written");
    let output = volley()
        .args(volley_args("actor", &nats, &["--run", "signed", "--weights-public-key"]))
        .arg(&bad)
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--weights-public-key") && stderr.contains("bad.pem"), "{stderr}");
}
