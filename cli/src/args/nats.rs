//! NATS connection flags, remote-environment flags and the metrics endpoint flags.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use volley_core::ids::RunId;
use volley_env::RemoteEnvConfig;
use volley_transport::envsvc::EnvServiceName;
use volley_transport::nats::identity::ActorIdentity;
use volley_transport::nats::{NatsAuth, NatsConfig, NatsTls};

use super::check_secs;

/// How the learner, actors, `volley train --nats` and `volley bench-weights` reach NATS: the
/// connection of [`NatsConnectArgs`], an actor's NKey identity, and how weights and segments
/// travel. `Debug` shows no password.
#[derive(Clone, Args)]
pub struct NatsArgs {
    /// Server, deadline, user and TLS.
    #[command(flatten)]
    pub connect: NatsConnectArgs,
    /// An actor's own NKey identity file (`<id>.nk`, made by `volley creds actors`; issue 46):
    /// connect as that identity instead of `--nats-user`, which then may publish under its
    /// own id only; the actor id defaults to the identity's name (the file's stem).
    #[arg(long, env = "VOLLEY_NATS_NKEY_FILE", conflicts_with_all = ["nats_user", "nats_password"])]
    pub nats_nkey_file: Option<PathBuf>,
    /// Weights also travel by core-NATS fan-out to connected actors (the live path), besides
    /// the object store and pointer; `false` turns it off (the learner does not send, actors
    /// do not subscribe), e.g. for a broker whose permissions lack the live subject.
    #[arg(long, env = "VOLLEY_NATS_WEIGHTS_LIVE", default_value_t = true, action = clap::ArgAction::Set)]
    pub nats_weights_live: bool,
    /// Learner: with the live path on, write the weights pointer (KV) of small, inline
    /// weights for at least every this many versions; the versions between reach connected
    /// actors by the live path alone (15 % less CPU for distributed CartPole at 8). An actor
    /// without the live path trails by up to this many versions less one; 1 writes every one.
    #[arg(long, env = "VOLLEY_NATS_WEIGHTS_POINTER_EVERY", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=volley_transport::nats::weights::MAX_POINTER_EVERY))]
    pub nats_weights_pointer_every: u64,
    /// Learner: `recv` calls' worth of messages its pull asks for at a time. 1 keeps the
    /// policy lag lowest; 2–4 let a learner whose update is faster than a broker round trip
    /// (a GPU learner at large batches) take segments faster, at about a batch of lag each.
    #[arg(long, env = "VOLLEY_NATS_PREFETCH_CALLS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub nats_prefetch_calls: u16,
    /// Worker threads of this process's NATS client runtime. 0: none, the threads that use
    /// NATS run it while they wait on it (fewer thread hand-offs per message; distributed
    /// CartPole 7 % less CPU per env step). Give 1–2 to a process that computes for minutes
    /// between NATS calls, so its connection keeps answering the server's pings.
    #[arg(long, env = "VOLLEY_NATS_RUNTIME_WORKERS", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=64))]
    pub nats_runtime_workers: u16,
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field("connect", &self.connect)
            .field("nats_nkey_file", &self.nats_nkey_file)
            .field("nats_weights_live", &self.nats_weights_live)
            .field("nats_weights_pointer_every", &self.nats_weights_pointer_every)
            .field("nats_prefetch_calls", &self.nats_prefetch_calls)
            .field("nats_runtime_workers", &self.nats_runtime_workers)
            .finish()
    }
}

impl NatsArgs {
    /// The transport config for `run`.
    pub fn config(&self, run: RunId) -> anyhow::Result<NatsConfig> {
        let mut config = NatsConfig::new(self.connect.nats_url.clone(), run);
        config.request_timeout = self.connect.timeout()?;
        config.auth = self.auth()?;
        config.tls = self.connect.tls.tls();
        config.weights_live = self.nats_weights_live;
        config.weights_pointer_every = self.nats_weights_pointer_every;
        config.prefetch_calls = usize::from(self.nats_prefetch_calls);
        config.runtime_workers = usize::from(self.nats_runtime_workers);
        Ok(config)
    }

    /// The credentials, if any: the NKey identity of `--nats-nkey-file`, else the user.
    pub fn auth(&self) -> anyhow::Result<Option<NatsAuth>> {
        if let Some(path) = &self.nats_nkey_file {
            let identity = ActorIdentity::read(path).context("--nats-nkey-file")?;
            return Ok(Some(identity.auth()));
        }
        self.connect.auth()
    }

    /// The spaces of environment service `service`, asked of its servers over this connection's
    /// settings, waiting up to `wait` for one to appear (`--env remote:<service>`).
    pub fn remote_env_config(&self, service: &EnvServiceName, wait: Duration) -> anyhow::Result<RemoteEnvConfig> {
        self.auth()
            .and_then(|auth| {
                crate::remote_env::remote_env_config(
                    &self.connect.nats_url,
                    auth.as_ref(),
                    &self.connect.tls.tls(),
                    self.connect.timeout()?,
                    service,
                    wait,
                )
            })
            .with_context(|| format!("asking the servers of environment service {service} for its spaces"))
    }
}

/// How an actor steps a remote environment (shared by `volley actor` and the learner's
/// lookup of the environment's spaces).
#[derive(Debug, Clone, Args)]
pub struct RemoteEnvArgs {
    /// Deadline of every request to an environment server; a server that misses it is
    /// treated as lost (its episodes are aborted and restarted elsewhere).
    #[arg(long, env = "VOLLEY_ENV_TIMEOUT_SECS", default_value_t = 5.0)]
    pub env_timeout_secs: f64,
    /// Environments per session, i.e. per step request (0: spread the actor's environments over
    /// the servers found at start, one session each).
    #[arg(long, env = "VOLLEY_ENVS_PER_SESSION", default_value_t = 0)]
    pub envs_per_session: usize,
    /// Step requests in flight at once.
    #[arg(long, env = "VOLLEY_ENV_MAX_IN_FLIGHT", default_value_t = 8)]
    pub env_max_in_flight: usize,
}

impl RemoteEnvArgs {
    /// The per-request deadline.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        check_secs("--env-timeout-secs", self.env_timeout_secs)
    }

    /// Check the ranges once.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.timeout()?;
        if self.envs_per_session > 4096 {
            bail!("--envs-per-session: {} out of range 0..=4096", self.envs_per_session);
        }
        if self.env_max_in_flight == 0 || self.env_max_in_flight > 1024 {
            bail!("--env-max-in-flight: {} out of range 1..=1024", self.env_max_in_flight);
        }
        Ok(())
    }
}

/// How a process connects to NATS: server, deadline, user and TLS. An environment server
/// (`volley env-serve`) takes these alone; [`NatsArgs`] adds the learner's and actors' identity,
/// weights and prefetch settings, which mean nothing to a server. `Debug` shows no password.
#[derive(Clone, Args)]
pub struct NatsConnectArgs {
    /// NATS server to connect to.
    #[arg(long = "nats", env = "VOLLEY_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Deadline for connecting and for every NATS request, fetch and publish ack.
    #[arg(long, env = "VOLLEY_NATS_TIMEOUT_SECS", default_value_t = 5.0)]
    pub nats_timeout_secs: f64,
    /// NATS user name (see broker-config/: `learner-<run>`, `actor-<run>`, or `env-<service>`
    /// for an environment server, e.g. `env-cartpole`); needs a password.
    #[arg(long, env = "VOLLEY_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// Password of `--nats-user`; prefer the environment variable over the flag (flags show up
    /// in process listings). Never logged.
    #[arg(long, env = "VOLLEY_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,
    /// TLS towards NATS.
    #[command(flatten)]
    pub tls: NatsTlsArgs,
}

impl std::fmt::Debug for NatsConnectArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConnectArgs")
            .field("nats_url", &self.nats_url)
            .field("nats_timeout_secs", &self.nats_timeout_secs)
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl NatsConnectArgs {
    /// The deadline of every NATS request.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        check_secs("--nats-timeout-secs", self.nats_timeout_secs)
    }

    /// The credentials, if any: `--nats-user` and `--nats-password`.
    pub fn auth(&self) -> anyhow::Result<Option<NatsAuth>> {
        Ok(match (&self.nats_user, &self.nats_password) {
            (Some(user), Some(password)) => {
                Some(NatsAuth::UserPassword { user: user.clone(), password: password.clone() })
            }
            (None, None) => None,
            _ => bail!("--nats-user and --nats-password go together"),
        })
    }
}

/// TLS towards NATS (issue 46), shared by every process that connects: the learner, actors,
/// environment servers and `volley bench-weights`. Without any of these flags a process speaks
/// TLS when the server asks for it (broker-config/ does) and trusts the system's CA
/// certificates; with a CA file or `--nats-tls-required` it refuses a server without TLS.
#[derive(Debug, Clone, Default, Args)]
pub struct NatsTlsArgs {
    /// PEM file of the CA certificate that signed the NATS server's certificate (e.g. the
    /// `ca.crt` that `volley tls-certs` writes, or the one of a cert-manager Issuer); trusted
    /// instead of the system's CAs. Implies --nats-tls-required.
    #[arg(long, env = "VOLLEY_NATS_TLS_CA", value_name = "FILE")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM file of this process's client certificate, for a server that verifies clients
    /// (`tls { verify: true }`); needs --nats-tls-key.
    #[arg(long, env = "VOLLEY_NATS_TLS_CERT", value_name = "FILE", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM file of the private key of --nats-tls-cert.
    #[arg(long, env = "VOLLEY_NATS_TLS_KEY", value_name = "FILE", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS server that does not offer TLS, also without --nats-tls-ca (then the
    /// system's CAs must trust its certificate).
    #[arg(long, env = "VOLLEY_NATS_TLS_REQUIRED", default_value_t = false, action = clap::ArgAction::Set)]
    pub nats_tls_required: bool,
}

impl NatsTlsArgs {
    /// The transport's TLS settings; the files are checked when connecting.
    pub fn tls(&self) -> NatsTls {
        NatsTls {
            ca_file: self.nats_tls_ca.clone(),
            cert_file: self.nats_tls_cert.clone(),
            key_file: self.nats_tls_key.clone(),
            required: self.nats_tls_required,
        }
    }
}

/// Where a long-running process serves `/metrics`, `/healthz` and `/readyz`.
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Address for the metrics endpoint (port 0 picks a free port, logged at start; in
    /// Kubernetes use 0.0.0.0:9100).
    #[arg(long, env = "VOLLEY_METRICS_ADDR", default_value = "127.0.0.1:0")]
    pub metrics_addr: String,
    /// `/healthz` fails (503) once the main loop has made no progress for this many seconds:
    /// for the learner, no update while data arrives; for an actor, no env step while it is
    /// not waiting on pacing, the broker or the first weights. Waiting for actors or for the
    /// learner is not a failure.
    #[arg(long, env = "VOLLEY_LIVENESS_TIMEOUT_SECS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub liveness_timeout_secs: u64,
}

impl MetricsArgs {
    /// The liveness limit.
    pub fn liveness_timeout(&self) -> Duration {
        Duration::from_secs(self.liveness_timeout_secs)
    }
}

#[cfg(test)]
mod tests {
    use crate::args::tests::learner_config;

    #[test]
    fn nats_replicas_reach_the_transport_config() {
        assert_eq!(learner_config(&[]).expect("defaults are valid").nats.replicas, 1);
        assert_eq!(learner_config(&["--nats-replicas", "3"]).expect("valid").nats.replicas, 3);
        for out_of_range in ["0", "6"] {
            let err = learner_config(&["--nats-replicas", out_of_range]).expect_err("refused");
            assert!(err.to_string().contains("--nats-replicas"), "{err}");
        }
    }

    /// The connection flags are one group flattened into `NatsArgs` (issue 47): a user still
    /// needs its password, and an actor's NKey identity still excludes them, across the group.
    #[test]
    fn nats_credentials_reach_the_config_and_exclude_each_other() {
        let config = learner_config(&["--nats-user", "learner-x", "--nats-password", "secret"]).expect("valid");
        let expected = volley_transport::nats::NatsAuth::UserPassword {
            user: "learner-x".to_string(),
            password: "secret".to_string(),
        };
        assert_eq!(config.nats.auth, Some(expected));
        let err = learner_config(&["--nats-user", "learner-x"]).expect_err("a user without its password");
        assert!(err.to_string().contains("--nats-password"), "{err}");
        let err = learner_config(&["--nats-nkey-file", "a.nk", "--nats-user", "u", "--nats-password", "p"])
            .expect_err("an identity and a user at once");
        assert!(err.to_string().contains("--nats-nkey-file"), "{err}");
    }

    /// Issue 46: the TLS flags reach the transport; a certificate needs its key.
    #[test]
    fn nats_tls_flags_reach_the_transport_config() {
        let default = learner_config(&[]).expect("defaults are valid").nats.tls;
        assert_eq!(default, volley_transport::nats::NatsTls::default(), "no tls setting by default");
        let config =
            learner_config(&["--nats-tls-ca", "ca.pem", "--nats-tls-cert", "c.pem", "--nats-tls-key", "k.pem"])
                .expect("valid");
        let expected = volley_transport::nats::NatsTls::with_ca("ca.pem").with_client_cert("c.pem", "k.pem");
        assert_eq!(config.nats.tls, expected);
        assert!(config.nats.tls.is_required());
        let err = learner_config(&["--nats-tls-cert", "c.pem"]).expect_err("a certificate without its key");
        assert!(err.to_string().contains("--nats-tls-key"), "{err}");
        let required = learner_config(&["--nats-tls-required", "true"]).expect("valid").nats.tls;
        assert!(required.required && required.ca_file.is_none());
    }
}
