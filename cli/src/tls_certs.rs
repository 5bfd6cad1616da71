//! `volley tls-certs`: a development CA, a NATS server certificate and optional client
//! certificates as PEM files (issue 46), for deploy/local-run.sh and deploy/compose.yaml, where
//! no cert-manager issues them (k8s/components/tls does). Keys are written readable by their
//! owner only; the CA's key stays in the directory, so guard it as the broker's identity.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};
use tracing::info;

use crate::args::TlsCertsArgs;

/// Write the files `args` asks for, unless the directory holds a CA already.
pub fn tls_certs(args: TlsCertsArgs) -> anyhow::Result<()> {
    let dir = &args.tls_dir;
    if dir.join("ca.crt").exists() {
        info!(dir = %dir.display(), "tls-certs: a CA is there already; keeping the directory as it is");
        return Ok(());
    }
    if args.tls_server_names.iter().all(|name| name.trim().is_empty()) {
        bail!("--tls-server-names: give at least one name");
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let not_before = OffsetDateTime::now_utc() - Duration::hours(1);
    let not_after = not_before + Duration::days(i64::from(args.tls_valid_days));

    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name.push(DnType::CommonName, "volley development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (ca_params.not_before, ca_params.not_after) = (not_before, not_after);
    let ca_cert = ca_params.self_signed(&ca_key).context("signing the CA certificate")?;
    let issuer = Issuer::new(ca_params, ca_key);
    write(dir, "ca.crt", &ca_cert.pem(), false)?;
    write(dir, "ca.key", &issuer.key().serialize_pem(), true)?;

    let names: Vec<String> = args.tls_server_names.iter().map(|name| name.trim().to_string()).collect();
    let mut server_params = CertificateParams::new(names.clone()).context("--tls-server-names")?;
    server_params.distinguished_name.push(DnType::CommonName, names[0].clone());
    server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    (server_params.not_before, server_params.not_after) = (not_before, not_after);
    let server_key = KeyPair::generate().context("generating the server key")?;
    let server_cert = server_params.signed_by(&server_key, &issuer).context("signing the server certificate")?;
    write(dir, "server.crt", &server_cert.pem(), false)?;
    write(dir, "server.key", &server_key.serialize_pem(), true)?;

    for client in args.tls_clients.iter().map(|name| name.trim()).filter(|name| !name.is_empty()) {
        if client.contains(['/', '.']) || client == "ca" || client == "server" {
            bail!("--tls-clients: {client:?} is not usable as a file name");
        }
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, client);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        (params.not_before, params.not_after) = (not_before, not_after);
        let key = KeyPair::generate().context("generating a client key")?;
        let cert = params.signed_by(&key, &issuer).with_context(|| format!("signing the certificate of {client}"))?;
        write(dir, &format!("{client}.crt"), &cert.pem(), false)?;
        write(dir, &format!("{client}.key"), &key.serialize_pem(), true)?;
    }
    info!(dir = %dir.display(), server_names = ?names, clients = ?args.tls_clients, valid_days = args.tls_valid_days,
          "tls-certs: wrote a CA and certificates");
    Ok(())
}

/// Write `pem` to `dir/name`; a key readable by its owner only.
fn write(dir: &Path, name: &str, pem: &str, secret: bool) -> anyhow::Result<()> {
    let path = dir.join(name);
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if secret { 0o600 } else { 0o644 });
    }
    let mut file = options.open(&path).with_context(|| format!("writing {}", path.display()))?;
    file.write_all(pem.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(dir: &Path) -> TlsCertsArgs {
        TlsCertsArgs {
            tls_dir: dir.to_path_buf(),
            tls_server_names: vec!["nats".into(), "127.0.0.1".into()],
            tls_clients: vec!["actor".into()],
            tls_valid_days: 30,
        }
    }

    #[test]
    fn writes_a_ca_a_server_and_a_client_certificate_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        tls_certs(args(dir.path())).expect("written");
        for name in ["ca.crt", "ca.key", "server.crt", "server.key", "actor.crt", "actor.key"] {
            let text = fs::read_to_string(dir.path().join(name)).expect(name);
            assert!(text.starts_with("-----BEGIN"), "{name}: {text}");
        }
        // The transport accepts them as it would at connect time.
        volley_transport::nats::NatsTls::with_ca(dir.path().join("ca.crt"))
            .with_client_cert(dir.path().join("actor.crt"), dir.path().join("actor.key"))
            .check()
            .expect("valid PEM files");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join("server.key")).expect("key").permissions().mode();
            assert_eq!(mode & 0o077, 0, "keys are private: {mode:o}");
        }
        let ca = fs::read_to_string(dir.path().join("ca.crt")).expect("ca");
        tls_certs(args(dir.path())).expect("second run");
        assert_eq!(fs::read_to_string(dir.path().join("ca.crt")).expect("ca"), ca, "an existing CA is kept");
    }

    #[test]
    fn a_client_name_must_be_a_file_name() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut args = args(dir.path());
        args.tls_clients = vec!["../x".into()];
        assert!(tls_certs(args).is_err());
    }
}
