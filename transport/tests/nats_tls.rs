//! TLS on every NATS connection (issue 46 item 6), against real `nats-server` processes with
//! the test kit's CA: a client that trusts the CA connects and works; a plain-text client, a
//! client trusting another CA and a client that requires TLS of a server without it are
//! refused at once with an error that says so; a server that verifies clients takes a client
//! certificate signed by its CA and refuses a client without one.
//!
//! No assertion depends on timing: a refused connection must fail well within the connect
//! timeout, which is long (60 s) so that only a retry loop could reach it.

#[allow(dead_code)] // this test uses only the run spec of the shared fixtures
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use volley_core::ids::{ActorId, RunId};
use volley_testkit::tls::TestPki;
use volley_testkit::{TestNats, TestNatsOptions, TestTls};
use volley_transport::envsvc::EnvServiceClient;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};

/// Connect timeout of these tests: a refusal that waits for it is a retry loop, not a refusal.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

fn config(server: &TestNats, tls: NatsTls) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), RunId::new("tls").expect("valid")).with_tls(tls);
    config.connect_timeout = CONNECT_TIMEOUT;
    config
}

/// Connect with `tls` and return the error, checking that it came without waiting out the
/// connect timeout (a TLS failure is not retried).
fn refused(server: &TestNats, tls: NatsTls) -> String {
    let started = Instant::now();
    let err = NatsBus::connect(config(server, tls)).expect_err("the connection is refused");
    assert!(started.elapsed() < CONNECT_TIMEOUT / 2, "refused only after {:?}: {err}", started.elapsed());
    err.to_string()
}

#[test]
fn a_client_trusting_the_ca_works_over_tls() {
    let server = TestNats::start();
    let bus = NatsBus::connect(config(&server, NatsTls::with_ca(server.ca_file()))).expect("connect over tls");
    bus.ensure_run(&common::spec("tls")).expect("create the run over tls");
    let mut sink =
        bus.trajectory_sink(&ActorId::new("a").expect("valid"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.flush().expect("flush over tls");
    // The server lists the connection as TLS (`/connz` would show its cipher); the handshake
    // is the only way in, as the next test shows.
    assert!(server.log().contains("TLS required for client connections"), "{}", server.log());
}

/// A client that sends its CONNECT in plain text is dropped without an answer: the server
/// takes its bytes for a TLS handshake, which fails.
#[test]
fn a_plain_text_client_is_refused() {
    let server = TestNats::start();
    let stream = TcpStream::connect(("127.0.0.1", server.port())).expect("tcp connect");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut info = String::new();
    reader.read_line(&mut info).expect("INFO");
    assert!(info.contains("\"tls_required\":true"), "{info}");
    (&stream).write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n").expect("write");
    let mut answer = String::new();
    // The server closes the connection: the read ends (EOF, or a reset) with no PONG.
    let _ = reader.read_to_string(&mut answer);
    assert!(!answer.contains("PONG"), "plain text was answered with {answer:?}");
}

#[test]
fn a_client_trusting_another_ca_is_refused_with_a_clear_error() {
    let server = TestNats::start();
    let elsewhere = tempfile::tempdir().expect("temp dir");
    let other = TestPki::generate(elsewhere.path());
    let err = refused(&server, NatsTls::with_ca(other.ca_file()));
    assert!(err.contains("tls handshake failed"), "{err}");
    assert!(err.contains(&other.ca_file().display().to_string()), "names the CA file: {err}");
    // The system's CAs do not know the test CA either.
    let err = refused(&server, NatsTls { required: true, ..Default::default() });
    assert!(err.contains("tls handshake failed"), "{err}");
}

#[test]
fn a_client_requiring_tls_refuses_a_server_without_it() {
    let server = TestNats::start_with(TestNatsOptions { tls: TestTls::Off, ..Default::default() });
    let err = refused(&server, NatsTls::with_ca(server.ca_file()));
    assert!(err.contains("tls handshake failed"), "{err}");
    // Without TLS settings the client follows the server: plain text here.
    NatsBus::connect(config(&server, NatsTls::default())).expect("plain text when nobody asks for tls");
}

#[test]
fn a_server_verifying_clients_takes_a_signed_certificate_and_refuses_none() {
    let server = TestNats::start_with(TestNatsOptions { tls: TestTls::VerifyClients, ..Default::default() });
    let pki = server.pki();
    let with_cert = NatsTls::with_ca(server.ca_file()).with_client_cert(pki.client_cert_file(), pki.client_key_file());
    NatsBus::connect(config(&server, with_cert)).expect("a client certificate signed by the CA is accepted");
    // Without a certificate the server ends the handshake with an alert.
    let err = refused(&server, NatsTls::with_ca(server.ca_file()));
    assert!(err.contains("tls handshake failed"), "{err}");
}

#[test]
fn missing_or_malformed_tls_files_are_named_before_connecting() {
    let server = TestNats::start();
    let err = refused(&server, NatsTls::with_ca("/nonexistent/ca.pem"));
    assert!(err.contains("/nonexistent/ca.pem"), "{err}");
    let dir = tempfile::tempdir().expect("temp dir");
    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "hello\n").expect("write");
    let err = refused(&server, NatsTls::with_ca(&not_pem));
    assert!(err.contains("no PEM certificate"), "{err}");
    let err = refused(&server, NatsTls::with_ca(server.ca_file()).with_client_cert(server.ca_file(), &not_pem));
    assert!(err.contains("no PEM private key"), "{err}");
}

/// The environment service's connections (actors' env clients, environment servers) take the
/// same settings and fail the same way.
#[test]
fn environment_clients_use_tls_too() {
    let server = TestNats::start();
    EnvServiceClient::connect(
        &server.url(),
        None,
        &NatsTls::with_ca(server.ca_file()),
        CONNECT_TIMEOUT,
        CONNECT_TIMEOUT,
    )
    .expect("connect over tls");
    let elsewhere = tempfile::tempdir().expect("temp dir");
    let other = TestPki::generate(elsewhere.path());
    let started = Instant::now();
    let err = EnvServiceClient::connect(
        &server.url(),
        None,
        &NatsTls::with_ca(other.ca_file()),
        CONNECT_TIMEOUT,
        CONNECT_TIMEOUT,
    )
    .expect_err("another CA");
    assert!(started.elapsed() < CONNECT_TIMEOUT / 2, "{err}");
    assert!(err.to_string().contains("tls handshake failed"), "{err}");
}
