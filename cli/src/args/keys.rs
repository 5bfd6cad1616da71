//! Signed weights: the learner's `--weights-signing-key`, the actor's `--weights-public-key`,
//! and `volley keys generate` (docs/SECURITY.md, "signed weights").

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use volley_transport::signing::{WeightsPublicKeys, WeightsSigningKey};

/// The learner's signing key.
#[derive(Debug, Args)]
pub struct WeightsSigningArgs {
    /// Sign every weights version with this Ed25519 private key (PKCS#8 PEM, as written by
    /// `volley keys generate` or `openssl genpkey -algorithm ed25519`). Without it, versions
    /// are unsigned and actors that require signatures refuse them.
    #[arg(long, env = "VOLLEY_WEIGHTS_SIGNING_KEY")]
    pub weights_signing_key: Option<PathBuf>,
}

impl WeightsSigningArgs {
    /// The key, read and checked once.
    pub fn load(&self) -> anyhow::Result<Option<Arc<WeightsSigningKey>>> {
        let Some(path) = &self.weights_signing_key else { return Ok(None) };
        let key = WeightsSigningKey::from_file(path).context("--weights-signing-key")?;
        Ok(Some(Arc::new(key)))
    }
}

/// The public keys an actor trusts.
#[derive(Debug, Args)]
pub struct WeightsTrustArgs {
    /// Take only weights versions signed by one of these Ed25519 public keys (PEM files, each
    /// holding one or more keys; repeat the flag or separate files with commas): two during a
    /// key rotation. Without any, the actor takes unsigned weights and says so at startup.
    #[arg(long, env = "VOLLEY_WEIGHTS_PUBLIC_KEY", value_delimiter = ',')]
    pub weights_public_key: Vec<PathBuf>,
}

impl WeightsTrustArgs {
    /// The keys, read and checked once (`None` when none is configured).
    pub fn load(&self) -> anyhow::Result<Option<WeightsPublicKeys>> {
        if self.weights_public_key.is_empty() {
            return Ok(None);
        }
        let keys = WeightsPublicKeys::from_files(&self.weights_public_key).context("--weights-public-key")?;
        Ok(Some(keys))
    }
}

/// `volley keys`.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// `volley keys` subcommands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Write a new weights signing key pair: `weights-signing-key.pem` (private, mode 0600; for
    /// the learner) and `weights-public-key.pem` (for the actors). An existing private key is
    /// never overwritten.
    Generate(KeysGenerateArgs),
}

/// `volley keys generate`.
#[derive(Debug, Args)]
pub struct KeysGenerateArgs {
    /// Folder to write the two key files into (created if missing).
    #[arg(long, env = "VOLLEY_KEYS_OUT")]
    pub out: PathBuf,
    /// Write the public key into this folder instead (created if missing), e.g. a volume that
    /// actors mount while only the learner mounts `--out`.
    #[arg(long, env = "VOLLEY_KEYS_PUBLIC_OUT")]
    pub public_out: Option<PathBuf>,
    /// Keep a private key already in `--out` (and write its public key) instead of failing:
    /// for start-up scripts that run on every start.
    #[arg(long, env = "VOLLEY_KEYS_IF_MISSING")]
    pub if_missing: bool,
}
