//! TLS for every NATS connection (issue 46): which CA a client trusts for the server's
//! certificate, and the client certificate it presents when the server verifies clients.
//!
//! async-nats does the handshake (rustls, the `ring` provider). This module checks the files
//! before the first connection attempt, so a missing or malformed file is one clear error
//! naming the file, not a connect loop that times out, and tells apart the failures that
//! retrying cannot fix ([`is_tls_failure`]).
//!
//! Invariant: with any TLS setting given, a connection is TLS or it fails; it never falls
//! back to plain TCP.

use std::path::{Path, PathBuf};

use async_nats::rustls::pki_types::pem::PemObject;
use async_nats::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use async_nats::{ConnectErrorKind, ConnectOptions};

/// A problem with the TLS files of a [`NatsTls`], found before connecting.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    /// The file could not be read.
    #[error("nats tls {role} {path}: {source}")]
    Read {
        /// Which file (`ca file`, `certificate`, `key`).
        role: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The file holds no PEM block of the kind expected, or a malformed one.
    #[error("nats tls {role} {path}: {message}")]
    Malformed {
        /// Which file.
        role: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("nats tls: a client certificate and its key go together (got only the {given})")]
    Unpaired {
        /// The one given.
        given: &'static str,
    },
}

/// TLS settings of a NATS client. The default is no setting: TLS only when the server asks
/// for it (the broker-config's does), trusting the system's CA certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// PEM file of the CA certificate(s) that signed the server's certificate; trusted instead
    /// of the system's. Implies [`required`](Self::required).
    pub ca_file: Option<PathBuf>,
    /// PEM file of this client's certificate, for a server that verifies clients
    /// (`tls { verify: true }`); needs [`key_file`](Self::key_file).
    pub cert_file: Option<PathBuf>,
    /// PEM file of the private key of [`cert_file`](Self::cert_file).
    pub key_file: Option<PathBuf>,
    /// Refuse a server that does not offer TLS (also with no file given: the system's CAs).
    pub required: bool,
}

impl NatsTls {
    /// Trust the CA certificate(s) in `ca_file` (and require TLS).
    pub fn with_ca(ca_file: impl Into<PathBuf>) -> Self {
        NatsTls { ca_file: Some(ca_file.into()), ..Default::default() }
    }

    /// Also present the client certificate `cert_file` with its key `key_file`.
    pub fn with_client_cert(mut self, cert_file: impl Into<PathBuf>, key_file: impl Into<PathBuf>) -> Self {
        self.cert_file = Some(cert_file.into());
        self.key_file = Some(key_file.into());
        self
    }

    /// Whether a connection must be TLS: asked for, or any file given.
    pub fn is_required(&self) -> bool {
        self.required || self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }

    /// Check that every file given can be read and holds what it should: at least one
    /// certificate in the CA file and the certificate file, a private key in the key file.
    pub fn check(&self) -> Result<(), TlsFileError> {
        if let Some(path) = &self.ca_file {
            check_certificates("ca file", path)?;
        }
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                check_certificates("certificate", cert)?;
                check_key(key)?;
            }
            (Some(_), None) => return Err(TlsFileError::Unpaired { given: "certificate" }),
            (None, Some(_)) => return Err(TlsFileError::Unpaired { given: "key" }),
            (None, None) => {}
        }
        Ok(())
    }

    /// [`check`](Self::check) the files, then set them on `options`.
    pub fn apply(&self, mut options: ConnectOptions) -> Result<ConnectOptions, TlsFileError> {
        self.check()?;
        if let Some(path) = &self.ca_file {
            options = options.add_root_certificates(path.clone());
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(options.require_tls(self.is_required()))
    }

    /// What a connect failure of kind `kind` with message `problem` means for these settings,
    /// when it is a TLS failure that retrying cannot fix; `None` otherwise.
    ///
    /// async-nats reports a TLS set-up failure as [`ConnectErrorKind::Tls`] and a failed
    /// handshake (an untrusted or mismatched server certificate, a client certificate the
    /// server refuses, a server without TLS answering in plain text) as an I/O error carrying
    /// rustls's message, which [`is_tls_failure`] recognises.
    pub fn explain_failure(&self, kind: ConnectErrorKind, problem: &str) -> Option<String> {
        if !is_tls_failure(kind, problem) {
            return None;
        }
        let trusted = match &self.ca_file {
            Some(path) => format!("the CA in {}", path.display()),
            None => "the system's CA certificates".to_string(),
        };
        Some(format!(
            "tls handshake failed: {problem} (the server's certificate must be signed by {trusted} and name the host \
             of the URL; a server without TLS refuses a client that requires it)"
        ))
    }
}

/// How rustls words the handshake failures that async-nats passes on as I/O errors: a
/// certificate that does not verify, an alert from the server (it refused our certificate, or
/// has none), plain text where a TLS record should be (a server without TLS), no certificate.
const TLS_FAILURE_WORDS: [&str; 5] = [
    "invalid peer certificate",
    "received fatal alert",
    "received corrupt message",
    "peer sent no certificates",
    "peer is incompatible",
];

/// Whether a connect failure is a TLS failure (retrying the same settings cannot help).
pub fn is_tls_failure(kind: ConnectErrorKind, problem: &str) -> bool {
    kind == ConnectErrorKind::Tls || TLS_FAILURE_WORDS.iter().any(|words| problem.contains(words))
}

fn read(role: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError::Read { role, path: path.to_path_buf(), source })
}

fn check_certificates(role: &'static str, path: &Path) -> Result<(), TlsFileError> {
    let bytes = read(role, path)?;
    let malformed = |message: String| TlsFileError::Malformed { role, path: path.to_path_buf(), message };
    let certificates = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| malformed(format!("not a PEM certificate file: {err}")))?;
    if certificates.is_empty() {
        return Err(malformed("no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)".to_string()));
    }
    Ok(())
}

fn check_key(path: &Path) -> Result<(), TlsFileError> {
    let bytes = read("key", path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map(|_| ()).map_err(|err| TlsFileError::Malformed {
        role: "key",
        path: path.to_path_buf(),
        message: format!("no PEM private key in it: {err}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUDxo=\n-----END CERTIFICATE-----\n";

    #[test]
    fn missing_files_are_named() {
        let tls = NatsTls::with_ca("/nonexistent/ca.pem");
        let err = tls.check().expect_err("missing file");
        assert!(err.to_string().contains("ca file /nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_file_without_a_certificate_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").expect("write");
        let err = NatsTls::with_ca(&path).check().expect_err("no certificate");
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        std::fs::write(&path, CERT).expect("write");
        NatsTls::with_ca(&path).check().expect("a PEM certificate block is accepted");
    }

    #[test]
    fn a_certificate_needs_its_key() {
        let tls = NatsTls { cert_file: Some("c.pem".into()), ..Default::default() };
        assert!(matches!(tls.check(), Err(TlsFileError::Unpaired { given: "certificate" })));
        let tls = NatsTls { key_file: Some("k.pem".into()), ..Default::default() };
        assert!(matches!(tls.check(), Err(TlsFileError::Unpaired { given: "key" })));
    }

    #[test]
    fn handshake_failures_are_told_apart_from_network_ones() {
        let tls = NatsTls::with_ca("ca.pem");
        let explained = tls
            .explain_failure(ConnectErrorKind::Io, "IO error: invalid peer certificate: BadSignature")
            .expect("a tls failure");
        assert!(explained.contains("the CA in ca.pem"), "{explained}");
        assert!(tls.explain_failure(ConnectErrorKind::Io, "IO error: Connection refused (os error 111)").is_none());
        assert!(tls.explain_failure(ConnectErrorKind::TimedOut, "timed out").is_none());
    }

    #[test]
    fn any_file_requires_tls() {
        assert!(!NatsTls::default().is_required());
        assert!(NatsTls::with_ca("ca.pem").is_required());
        assert!(NatsTls { required: true, ..Default::default() }.is_required());
    }
}
