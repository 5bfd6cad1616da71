//! Writes a throwaway test PKI ([`volley_testkit::tls::TestPki`]: a CA, a server certificate
//! for 127.0.0.1 and localhost, a client certificate) into the directory given as the only
//! argument, and prints that directory: the Python tests (python/tests/conftest.py) start
//! their nats-server with it, so they run over TLS like the Rust tests.

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: volley-test-certs DIR");
        std::process::exit(2);
    };
    let pki = volley_testkit::tls::TestPki::generate(std::path::Path::new(&dir));
    println!("{}", pki.dir().display());
}
