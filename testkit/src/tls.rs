//! A throwaway public-key infrastructure for tests: a CA of its own, a server certificate for
//! `127.0.0.1` and `localhost` signed by it, and a client certificate, as PEM files in one
//! directory. [`TestNats`](crate::TestNats) makes one per server, so every NATS test runs over
//! TLS the way a deployment does; `volley-test-certs` writes one for the Python tests.
//!
//! Invariant: the keys never leave the directory they were written to, and nothing outside the
//! tests trusts the CA.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// The names the server certificate is valid for: the loopback address the test servers
/// listen on, and its usual name.
pub const SERVER_NAMES: [&str; 2] = ["127.0.0.1", "localhost"];

/// The PEM files of one test PKI, in one directory.
#[derive(Debug, Clone)]
pub struct TestPki {
    dir: PathBuf,
}

impl TestPki {
    /// Generate a CA, a server certificate for [`SERVER_NAMES`] and a client certificate (common
    /// name `volley-test-client`), and write them under `dir` (created if missing).
    ///
    /// # Panics
    /// When a key cannot be generated or a file cannot be written (a test set-up failure).
    pub fn generate(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap_or_else(|err| panic!("create {}: {err}", dir.display()));
        let pki = TestPki { dir: dir.to_path_buf() };

        let ca_key = KeyPair::generate().expect("generate the test CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("empty names are valid");
        ca_params.distinguished_name.push(DnType::CommonName, "volley test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign the test CA");
        let issuer = Issuer::new(ca_params, ca_key);

        let names: Vec<String> = SERVER_NAMES.iter().map(|name| name.to_string()).collect();
        let mut server_params = CertificateParams::new(names).expect("valid server names");
        server_params.distinguished_name.push(DnType::CommonName, "volley test nats-server");
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().expect("generate the server key");
        let server_cert = server_params.signed_by(&server_key, &issuer).expect("sign the server certificate");

        let mut client_params = CertificateParams::new(Vec::<String>::new()).expect("empty names are valid");
        client_params.distinguished_name.push(DnType::CommonName, "volley-test-client");
        client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().expect("generate the client key");
        let client_cert = client_params.signed_by(&client_key, &issuer).expect("sign the client certificate");

        write(&pki.ca_file(), &ca_cert.pem());
        write(&pki.server_cert_file(), &server_cert.pem());
        write(&pki.server_key_file(), &server_key.serialize_pem());
        write(&pki.client_cert_file(), &client_cert.pem());
        write(&pki.client_key_file(), &client_key.serialize_pem());
        pki
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate clients trust (`--nats-tls-ca`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server's certificate (`tls { cert_file }`).
    pub fn server_cert_file(&self) -> PathBuf {
        self.dir.join("server-cert.pem")
    }

    /// The server's private key (`tls { key_file }`).
    pub fn server_key_file(&self) -> PathBuf {
        self.dir.join("server-key.pem")
    }

    /// A client certificate signed by the CA (`--nats-tls-cert`).
    pub fn client_cert_file(&self) -> PathBuf {
        self.dir.join("client-cert.pem")
    }

    /// The client certificate's private key (`--nats-tls-key`).
    pub fn client_key_file(&self) -> PathBuf {
        self.dir.join("client-key.pem")
    }
}

fn write(path: &Path, pem: &str) {
    std::fs::write(path, pem).unwrap_or_else(|err| panic!("write {}: {err}", path.display()));
}
