//! Signed weights (issue 46): the learner signs every weights version with an Ed25519 key, and
//! followers verify it with the public keys they were configured with before applying it.
//!
//! What is signed is one [`SignedVersion`]: the run, the version, the layout hash, the number
//! of parameters and the SHA-256 of the parameters' little-endian bytes, behind a domain tag.
//! The pointer's anchors, deltas, inline frame and live chunks all rebuild the same parameters,
//! so one signature per version covers every path: the follower rebuilds the parameters, hashes
//! them and verifies the signature over what it rebuilt. The wire's XXH3-64 digest stays the
//! integrity check it was (corruption, chain mismatches); it is not what is signed, because a
//! 64-bit non-cryptographic hash can be matched by forged parameters.
//!
//! Binding the run and the version means a signature cannot be replayed for another run or
//! relabelled as another version; an old version of the same run, signed by the learner, can
//! still be replayed, and the follower's bounds on rewinds and jumps decide whether it is taken
//! (`nats::weights`, docs/SECURITY.md).
//!
//! Keys are PEM files, as OpenSSL writes them: the private key PKCS#8 (`BEGIN PRIVATE KEY`),
//! public keys SubjectPublicKeyInfo (`BEGIN PUBLIC KEY`). A public key file may hold several
//! keys, and a follower may be given several files: a version signed by any of them is taken,
//! which is how a key is rotated.

use std::fmt;
use std::path::{Path, PathBuf};

use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};
use volley_core::wire::{self, Weights};

/// Bytes of a signature.
pub const SIGNATURE_BYTES: usize = 64;

/// What every signed message starts with, so a signature made here means nothing elsewhere.
const DOMAIN: &[u8] = b"volley weights signature v1\0";

/// What every signed run-end marker starts with: a weights signature is never a marker's, nor
/// the other way round.
const RUN_END_DOMAIN: &[u8] = b"volley run end signature v1\0";

/// The PEM label of a public key.
const PUBLIC_KEY_BEGIN: &str = "-----BEGIN PUBLIC KEY-----";

/// Why a key file could not be used. Messages name the file.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file could not be read.
    #[error("reading key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The file does not hold what was expected.
    #[error("key file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The file could not be written.
    #[error("writing key file {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

/// Why a version's signature was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The version carries no signature.
    #[error("no signature")]
    Unsigned,
    /// The signature is not one of the trusted keys' over this run, version and parameters.
    #[error("signature verifies with no trusted key for this run, version and parameters")]
    Invalid,
}

impl SignatureError {
    /// The `reason` label of the metrics and logs that count it.
    pub fn reason(&self) -> &'static str {
        match self {
            SignatureError::Unsigned => "unsigned",
            SignatureError::Invalid => "bad_signature",
        }
    }
}

/// One weights version as signed: everything a follower rebuilds, bound to its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignedVersion<'a> {
    /// The run id.
    pub run: &'a str,
    /// The policy version.
    pub version: u64,
    /// Architecture hash of the layout.
    pub layout_hash: u64,
    /// Number of parameters.
    pub n_params: u64,
    /// SHA-256 of the parameters' little-endian bytes ([`params_sha256`]).
    pub params_sha256: [u8; 32],
}

impl<'a> SignedVersion<'a> {
    /// The version `weights` of run `run` (hashes the parameters once).
    pub fn of(run: &'a str, weights: &Weights) -> Self {
        SignedVersion {
            run,
            version: weights.version.0,
            layout_hash: weights.layout_hash,
            n_params: weights.params.len() as u64,
            params_sha256: params_sha256(&weights.params),
        }
    }

    /// The bytes signed: the domain tag, then each field, lengths first, integers little-endian.
    fn message(&self) -> Vec<u8> {
        let mut message = Vec::with_capacity(DOMAIN.len() + 8 + self.run.len() + 3 * 8 + 32);
        message.extend_from_slice(DOMAIN);
        message.extend_from_slice(&(self.run.len() as u64).to_le_bytes());
        message.extend_from_slice(self.run.as_bytes());
        for field in [self.version, self.layout_hash, self.n_params] {
            message.extend_from_slice(&field.to_le_bytes());
        }
        message.extend_from_slice(&self.params_sha256);
        message
    }
}

/// The bytes a run-end marker's signature covers: the domain tag, then the run and the reason,
/// lengths first (little-endian).
fn run_end_message(run: &str, reason: &str) -> Vec<u8> {
    let mut message = Vec::with_capacity(RUN_END_DOMAIN.len() + 16 + run.len() + reason.len());
    message.extend_from_slice(RUN_END_DOMAIN);
    for field in [run, reason] {
        message.extend_from_slice(&(field.len() as u64).to_le_bytes());
        message.extend_from_slice(field.as_bytes());
    }
    message
}

/// SHA-256 of the parameters' little-endian bytes (the same bytes on every host).
pub fn params_sha256(params: &[f32]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    wire::for_le_blocks(params, |bytes| hasher.update(bytes));
    hasher.finalize().into()
}

/// A short, stable name for a public key in logs: the first 8 bytes of its SHA-256, hex.
fn key_id(key: &VerifyingKey) -> String {
    Sha256::digest(key.as_bytes())[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn read(path: &Path) -> Result<String, KeyFileError> {
    std::fs::read_to_string(path).map_err(|source| KeyFileError::Read { path: path.to_owned(), source })
}

/// The learner's private key. `Debug` shows the public key's id only.
pub struct WeightsSigningKey {
    key: SigningKey,
}

impl fmt::Debug for WeightsSigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightsSigningKey").field("public_key_id", &self.public_key_id()).finish_non_exhaustive()
    }
}

impl WeightsSigningKey {
    /// A new key from the operating system's random source.
    pub fn generate() -> Self {
        WeightsSigningKey { key: SigningKey::generate(&mut rand_core::OsRng) }
    }

    /// Read a PKCS#8 PEM private key file (`volley keys generate`, or
    /// `openssl genpkey -algorithm ed25519`).
    pub fn from_file(path: &Path) -> Result<Self, KeyFileError> {
        let text = read(path)?;
        Self::from_pem(&text).map_err(|message| KeyFileError::Parse { path: path.to_owned(), message })
    }

    /// Parse a PKCS#8 PEM private key.
    pub fn from_pem(text: &str) -> Result<Self, String> {
        if text.contains(PUBLIC_KEY_BEGIN) {
            return Err("holds a public key; the signing key is the private key file".into());
        }
        SigningKey::from_pkcs8_pem(text.trim())
            .map(|key| WeightsSigningKey { key })
            .map_err(|err| format!("not an Ed25519 private key in PKCS#8 PEM ({err})"))
    }

    /// The private key as PKCS#8 PEM.
    pub fn to_pem(&self) -> String {
        self.key.to_pkcs8_pem(LineEnding::LF).expect("an Ed25519 key always encodes").to_string()
    }

    /// The public key as SubjectPublicKeyInfo PEM.
    pub fn public_key_pem(&self) -> String {
        self.key.verifying_key().to_public_key_pem(LineEnding::LF).expect("an Ed25519 key always encodes")
    }

    /// The public key's id in logs.
    pub fn public_key_id(&self) -> String {
        key_id(&self.key.verifying_key())
    }

    /// Sign `version`.
    pub fn sign(&self, version: &SignedVersion<'_>) -> [u8; SIGNATURE_BYTES] {
        self.key.sign(&version.message()).to_bytes()
    }

    /// Sign the end of run `run` for `reason` (`crate::run_end`).
    pub fn sign_run_end(&self, run: &str, reason: &str) -> [u8; SIGNATURE_BYTES] {
        self.key.sign(&run_end_message(run, reason)).to_bytes()
    }

    /// The public keys that verify this key's signatures.
    pub fn public_keys(&self) -> WeightsPublicKeys {
        WeightsPublicKeys { keys: vec![self.key.verifying_key()] }
    }
}

/// The public keys a follower trusts: a version signed by any of them is taken (two during a
/// rotation). `Debug` shows their ids.
#[derive(Clone, PartialEq, Eq)]
pub struct WeightsPublicKeys {
    keys: Vec<VerifyingKey>,
}

impl fmt::Debug for WeightsPublicKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.ids()).finish()
    }
}

impl WeightsPublicKeys {
    /// The keys in `paths`, each file holding one or more PEM public keys. At least one key in
    /// all, and every file must hold at least one.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self, KeyFileError> {
        let mut keys = Vec::new();
        for path in paths {
            let text = read(path)?;
            let parsed =
                Self::from_pem(&text).map_err(|message| KeyFileError::Parse { path: path.clone(), message })?;
            keys.extend(parsed.keys);
        }
        keys.dedup();
        Ok(WeightsPublicKeys { keys })
    }

    /// Parse one or more SubjectPublicKeyInfo PEM public keys (concatenated).
    pub fn from_pem(text: &str) -> Result<Self, String> {
        if text.contains("PRIVATE KEY-----") {
            return Err("holds a private key; followers get the public key file only".into());
        }
        let mut keys = Vec::new();
        for (index, block) in text.split(PUBLIC_KEY_BEGIN).skip(1).enumerate() {
            let pem = format!("{PUBLIC_KEY_BEGIN}{block}");
            let key = VerifyingKey::from_public_key_pem(pem.trim())
                .map_err(|err| format!("public key {} is not an Ed25519 public key in PEM ({err})", index + 1))?;
            if key.is_weak() {
                return Err(format!("public key {} is a weak (small-order) key", index + 1));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(format!("holds no public key (expected a `{PUBLIC_KEY_BEGIN}` block)"));
        }
        Ok(WeightsPublicKeys { keys })
    }

    /// The keys' ids, for logs.
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().map(key_id).collect()
    }

    /// Check `signature` over `version` against every trusted key.
    pub fn verify(
        &self,
        version: &SignedVersion<'_>,
        signature: Option<&[u8; SIGNATURE_BYTES]>,
    ) -> Result<(), SignatureError> {
        let signature = Signature::from_bytes(signature.ok_or(SignatureError::Unsigned)?);
        let message = version.message();
        match self.keys.iter().any(|key| key.verify_strict(&message, &signature).is_ok()) {
            true => Ok(()),
            false => Err(SignatureError::Invalid),
        }
    }
}

impl WeightsPublicKeys {
    /// Check `signature` over the end of run `run` for `reason` against every trusted key.
    pub fn verify_run_end(
        &self,
        run: &str,
        reason: &str,
        signature: Option<&[u8; SIGNATURE_BYTES]>,
    ) -> Result<(), SignatureError> {
        let signature = Signature::from_bytes(signature.ok_or(SignatureError::Unsigned)?);
        let message = run_end_message(run, reason);
        match self.keys.iter().any(|key| key.verify_strict(&message, &signature).is_ok()) {
            true => Ok(()),
            false => Err(SignatureError::Invalid),
        }
    }
}

/// Write a new key pair: `weights-signing-key.pem` (the private key, mode 0600 on Unix) into
/// `dir` and `weights-public-key.pem` into `public_dir` (`dir` when `None`); folders are created
/// if missing. An existing private key is never overwritten: it is an error, unless
/// `if_missing`, which keeps it and (re)writes its public key. Returns the paths.
pub fn generate_key_files(
    dir: &Path,
    public_dir: Option<&Path>,
    if_missing: bool,
) -> Result<(PathBuf, PathBuf), KeyFileError> {
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source| KeyFileError::Write { path, source }
    };
    let public_dir = public_dir.unwrap_or(dir);
    for dir in [dir, public_dir] {
        std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    }
    let private = dir.join(SIGNING_KEY_FILE);
    let public = public_dir.join(PUBLIC_KEY_FILE);
    let key = if if_missing && private.exists() {
        WeightsSigningKey::from_file(&private)?
    } else {
        let key = WeightsSigningKey::generate();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&private).map_err(write_err(&private))?;
        std::io::Write::write_all(&mut file, key.to_pem().as_bytes()).map_err(write_err(&private))?;
        key
    };
    std::fs::write(&public, key.public_key_pem()).map_err(write_err(&public))?;
    Ok((private, public))
}

/// File name of the private key [`generate_key_files`] writes.
pub const SIGNING_KEY_FILE: &str = "weights-signing-key.pem";
/// File name of the public key [`generate_key_files`] writes.
pub const PUBLIC_KEY_FILE: &str = "weights-public-key.pem";

#[cfg(test)]
mod tests {
    use super::*;
    use volley_core::ids::PolicyVersion;

    fn weights(version: u64) -> Weights {
        Weights::new(PolicyVersion(version), 0xfeed, vec![0.5, -1.25, 3.0])
    }

    #[test]
    fn a_signature_binds_run_version_layout_and_parameters() {
        let key = WeightsSigningKey::generate();
        let keys = key.public_keys();
        let w = weights(7);
        let signed = SignedVersion::of("run-a", &w);
        let signature = key.sign(&signed);
        assert_eq!(keys.verify(&signed, Some(&signature)), Ok(()));
        assert_eq!(keys.verify(&signed, None), Err(SignatureError::Unsigned));
        let other_run = SignedVersion { run: "run-b", ..signed };
        let other_version = SignedVersion { version: 8, ..signed };
        let other_layout = SignedVersion { layout_hash: 1, ..signed };
        let mut forged = w.clone();
        forged.params[1] = -1.0;
        let other_params = SignedVersion::of("run-a", &forged);
        for other in [other_run, other_version, other_layout, other_params] {
            assert_eq!(keys.verify(&other, Some(&signature)), Err(SignatureError::Invalid), "{other:?}");
        }
        // A run id that is a prefix of another does not collide (lengths are signed).
        assert_ne!(SignedVersion { run: "ab", ..signed }.message(), SignedVersion { run: "a", ..signed }.message());
        let stranger = WeightsSigningKey::generate().public_keys();
        assert_eq!(stranger.verify(&signed, Some(&signature)), Err(SignatureError::Invalid));
    }

    #[test]
    fn keys_round_trip_through_pem_and_several_public_keys_are_trusted() {
        let old = WeightsSigningKey::generate();
        let new = WeightsSigningKey::generate();
        let reread = WeightsSigningKey::from_pem(&old.to_pem()).expect("own pem parses");
        assert_eq!(reread.public_key_pem(), old.public_key_pem());
        let both = WeightsPublicKeys::from_pem(&format!("{}{}", old.public_key_pem(), new.public_key_pem()))
            .expect("two keys parse");
        assert_eq!(both.ids(), vec![old.public_key_id(), new.public_key_id()]);
        let signed = SignedVersion::of("r", &weights(1));
        for key in [&old, &new] {
            assert_eq!(both.verify(&signed, Some(&key.sign(&signed))), Ok(()));
        }
    }

    #[test]
    fn key_file_errors_say_what_is_wrong() {
        let key = WeightsSigningKey::generate();
        let err = WeightsPublicKeys::from_pem(&key.to_pem()).expect_err("a private key is no public key");
        assert!(err.contains("private key"), "{err}");
        let err = WeightsSigningKey::from_pem(&key.public_key_pem()).expect_err("a public key cannot sign");
        assert!(err.contains("public key"), "{err}");
        let err = WeightsPublicKeys::from_pem("hello").expect_err("no key");
        assert!(err.contains("no public key"), "{err}");
        let garbled = key.public_key_pem().replace('A', "B").replacen("MC", "MD", 1);
        let err = WeightsPublicKeys::from_pem(&garbled).expect_err("garbled");
        assert!(err.contains("public key 1"), "{err}");
        let err = WeightsSigningKey::from_pem("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
            .expect_err("garbled");
        assert!(err.contains("PKCS#8"), "{err}");
        let missing = PathBuf::from("/nonexistent/volley-key.pem");
        let err = WeightsPublicKeys::from_files(std::slice::from_ref(&missing)).expect_err("missing file");
        assert!(err.to_string().contains("/nonexistent/volley-key.pem"), "{err}");
    }

    #[test]
    fn generated_key_files_are_private_and_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("volley-keys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (private, public) = generate_key_files(&dir, None, false).expect("generated");
        let key = WeightsSigningKey::from_file(&private).expect("private key reads");
        let keys = WeightsPublicKeys::from_files(&[public]).expect("public key reads");
        assert_eq!(keys.ids(), vec![key.public_key_id()]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&private).expect("exists").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let err = generate_key_files(&dir, None, false).expect_err("an existing key is kept");
        assert!(err.to_string().contains(SIGNING_KEY_FILE), "{err}");
        // With `if_missing` the existing key stays, and its public key goes where asked.
        let public_dir = dir.join("public");
        let (_, public) = generate_key_files(&dir, Some(&public_dir), true).expect("kept");
        assert_eq!(public, public_dir.join(PUBLIC_KEY_FILE));
        let kept = WeightsSigningKey::from_file(&private).expect("still there");
        assert_eq!(kept.public_key_id(), key.public_key_id());
        assert_eq!(WeightsPublicKeys::from_files(&[public]).expect("reads").ids(), vec![key.public_key_id()]);
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
