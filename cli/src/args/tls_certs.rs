//! `volley tls-certs`: where to write a development CA and certificates for NATS TLS.

use std::path::PathBuf;

use clap::Args;

/// Flags of `volley tls-certs`.
#[derive(Debug, Clone, Args)]
pub struct TlsCertsArgs {
    /// Directory to write `ca.crt`, `ca.key`, `server.crt`, `server.key` and one `<name>.crt` and
    /// `<name>.key` per --tls-clients name into (created if missing). A directory that already
    /// holds `ca.crt` is left as it is, so a restarted deployment keeps trusting the same CA;
    /// remove it to issue new certificates.
    #[arg(long, env = "VOLLEY_TLS_DIR", value_name = "DIR")]
    pub tls_dir: PathBuf,
    /// Names the server certificate is valid for, comma-separated: every host name or IP
    /// address that clients put in their NATS URL.
    #[arg(long, env = "VOLLEY_TLS_SERVER_NAMES", value_delimiter = ',', default_value = "localhost,127.0.0.1,nats")]
    pub tls_server_names: Vec<String>,
    /// Client certificates to issue too (their common names, comma-separated), for a broker
    /// that verifies clients (`tls { verify: true }`).
    #[arg(long, env = "VOLLEY_TLS_CLIENTS", value_delimiter = ',')]
    pub tls_clients: Vec<String>,
    /// Days the certificates are valid for.
    #[arg(long, env = "VOLLEY_TLS_VALID_DAYS", default_value_t = 365,
          value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub tls_valid_days: u32,
}
