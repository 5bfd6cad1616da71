//! Per-actor NATS identities (issue 46, item 3): one NKey user per actor, allowed to publish
//! only on subjects that carry its own id.
//!
//! Before, every actor of a run connected as the one user `actor-<run>` and named itself in
//! its subjects and segments, so one client could publish under any number of actor ids, and
//! the learner's per-actor bounds (the return share behind the solved stop, the work leases in
//! flight) bounded an id, not a client: forged episode summaries under ten self-declared ids
//! ended a memory run as solved in 0.5 s. Now each actor holds an NKey seed of its own, and
//! the broker config grants the user of that key publishes on `volley.<run>.traj.<id>` and
//! `volley.<run>.work.{take,progress,done}.<id>` only, replies on its own inbox prefix
//! `_INBOX_<id>`, and the reads every actor needs ([`actor_user_block`]). The learner then
//! trusts the id of the subject and refuses a segment whose body names another
//! (`volley_learner`, reason `actor_mismatch`).
//!
//! An identity is a file `<id>.nk` holding the seed (the format of NATS's `nk` tool, with
//! optional `#` comment lines); its name, the file's stem, is the actor id. The seed is the
//! secret; the public key (`U…`) goes into the broker config. `volley creds actors` makes
//! them.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use volley_core::ids::{ActorId, RunId};
use volley_core::subjects;
use volley_env::EnvServiceName;

use super::{NatsAuth, PRIVATE_INBOX_PREFIX};

/// File extension of an identity's seed file (`<id>.nk`).
pub const NKEY_FILE_EXTENSION: &str = "nk";

/// Why an identity could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The identity's name is not a lowercase actor id.
    #[error("identity name {name:?}: {problem}")]
    BadName {
        /// The name (cut to 64 characters).
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// The seed is not a NATS user seed.
    #[error("{path}: not a NATS user NKey seed ({problem})")]
    BadSeed {
        /// Where the seed came from.
        path: String,
        /// What is wrong (never the seed).
        problem: String,
    },
}

/// One actor's identity: its name (the actor id, the last token of its subjects and its
/// inbox prefix) and its NKey pair. `Debug` never shows the seed.
#[derive(Clone)]
pub struct ActorIdentity {
    name: ActorId,
    seed: String,
    public_key: String,
}

impl fmt::Debug for ActorIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorIdentity")
            .field("name", &self.name)
            .field("public_key", &self.public_key)
            .field("seed", &"<redacted>")
            .finish()
    }
}

impl ActorIdentity {
    /// A fresh identity named `name`, with a new random NKey user pair.
    pub fn generate(name: ActorId) -> Result<Self, IdentityError> {
        check_name(&name)?;
        let pair = nkeys::KeyPair::new_user();
        let seed = pair.seed().expect("a generated pair has its seed");
        Ok(ActorIdentity { public_key: pair.public_key(), name, seed })
    }

    /// The identity `name` with the user seed `seed` (from `origin`, for errors).
    pub fn from_seed(name: ActorId, seed: &str, origin: &str) -> Result<Self, IdentityError> {
        check_name(&name)?;
        let bad = |problem: String| IdentityError::BadSeed { path: origin.to_string(), problem };
        let pair = nkeys::KeyPair::from_seed(seed).map_err(|err| bad(err.to_string()))?;
        if pair.key_pair_type() != nkeys::KeyPairType::User {
            return Err(bad(format!("a {:?} key, not a user key", pair.key_pair_type())));
        }
        Ok(ActorIdentity { public_key: pair.public_key(), name, seed: seed.to_string() })
    }

    /// Read an identity file `<id>.nk`: the first line that is neither empty nor a `#`
    /// comment is the seed, and the file's stem is the name.
    pub fn read(path: &Path) -> Result<Self, IdentityError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| IdentityError::Io { path: path.to_path_buf(), source })?;
        let stem = path.file_stem().and_then(|stem| stem.to_str()).unwrap_or_default();
        let name = ActorId::new(stem)
            .map_err(|err| IdentityError::BadName { name: cut(stem).to_string(), problem: err.to_string() })?;
        let seed = text.lines().map(str::trim).find(|line| !line.is_empty() && !line.starts_with('#')).unwrap_or("");
        Self::from_seed(name, seed, &path.display().to_string())
    }

    /// Write this identity to `dir/<id>.nk`, readable by its owner only, and return the path.
    /// An existing file is never overwritten (an identity lost that way would lock its
    /// actor out of the broker until the config is regenerated).
    pub fn write(&self, dir: &Path) -> Result<PathBuf, IdentityError> {
        let path = dir.join(format!("{}.{NKEY_FILE_EXTENSION}", self.name));
        let io = |source| IdentityError::Io { path: path.clone(), source };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&path).map_err(io)?;
        let text = format!(
            "# NKey seed of the Volley actor identity {} (public key {}). Secret: whoever holds it\n\
             # publishes as this actor.\n{}\n",
            self.name, self.public_key, self.seed
        );
        file.write_all(text.as_bytes()).map_err(io)?;
        Ok(path)
    }

    /// The identity's name: the actor id its subjects carry.
    pub fn name(&self) -> &ActorId {
        &self.name
    }

    /// The public key (`U…`), which the broker config names.
    pub fn public_key(&self) -> &str {
        &self.public_key
    }

    /// Credentials that connect as this identity.
    pub fn auth(&self) -> NatsAuth {
        NatsAuth::Nkey { name: self.name.as_str().to_string(), seed: self.seed.clone() }
    }
}

/// An identity's name must be a lowercase actor id: it is the last token of its subjects,
/// which are lowercase ([`subjects::trajectories`]), and its inbox prefix `_INBOX_<name>`.
fn check_name(name: &ActorId) -> Result<(), IdentityError> {
    let text = name.as_str();
    if text != text.to_ascii_lowercase() {
        return Err(IdentityError::BadName {
            name: cut(text).to_string(),
            problem: "must be lowercase (it is the last token of its subjects)".into(),
        });
    }
    Ok(())
}

fn cut(value: &str) -> &str {
    match value.char_indices().nth(64) {
        Some((end, _)) => &value[..end],
        None => value,
    }
}

/// The broker-config user block of actor `actor` of `run`, for `broker-config/accounts.conf`'s
/// account `VOLLEY`: the NKey user `nkey` (a public key, or a `$VARIABLE` the server reads
/// from its environment) may publish its segments and work-lease signals under its own id
/// only, reply on its own inbox prefix, read the run spec, the weights pointer and objects
/// (direct gets and a subscription to the pointer key's subject, no consumer: issue 46),
/// read (by message gets only) and write episode snapshots, and call the environment services `env_services`. Each
/// grant is explained in `broker-config/accounts.conf`; `transport/tests/broker_permissions.rs`
/// checks them.
pub fn actor_user_block(run: &RunId, actor: &ActorId, nkey: &str, env_services: &[EnvServiceName]) -> String {
    let traj = subjects::trajectory_stream(run);
    let run_kv = subjects::kv_backing_stream(&subjects::run_bucket(run));
    let run_bucket = subjects::run_bucket(run);
    let wts_bucket = subjects::weights_bucket(run);
    let wts = subjects::object_backing_stream(&wts_bucket);
    let snap_bucket = subjects::snapshot_bucket(run);
    let snap = subjects::object_backing_stream(&snap_bucket);
    let snapidx_bucket = subjects::snapshot_index_bucket(run);
    let snapidx = subjects::kv_backing_stream(&snapidx_bucket);
    let work = subjects::work_stream(run);
    let mut allow = vec![subjects::trajectories(run, actor)];
    allow.extend(subjects::WORK_LEASE_VERBS.iter().map(|verb| subjects::work_lease(run, verb, actor)));
    allow.extend([
        format!("$JS.API.CONSUMER.INFO.{traj}.{}", subjects::LEARNER_CONSUMER),
        format!("$JS.API.STREAM.INFO.{run_kv}"),
        format!("$JS.API.DIRECT.GET.{run_kv}.>"),
        format!("$JS.API.STREAM.INFO.{wts}"),
        format!("$JS.API.DIRECT.GET.{wts}"),
        format!("$JS.API.DIRECT.GET.{wts}.>"),
        format!("$O.{snap_bucket}.>"),
        format!("$JS.API.STREAM.INFO.{snap}"),
        format!("$JS.API.STREAM.MSG.GET.{snap}"),
        format!("$KV.{snapidx_bucket}.>"),
        format!("$JS.API.STREAM.INFO.{snapidx}"),
        format!("$JS.API.STREAM.MSG.GET.{snapidx}"),
    ]);
    for service in env_services {
        allow.push(subjects::service_info(&subjects::env_service(service)));
        allow.push(format!("volley.env.{service}.>"));
    }
    let deny = [
        format!("$KV.{run_bucket}.>"),
        format!("$O.{wts_bucket}.>"),
        subjects::weights_live(run),
        subjects::pace(run),
        "$JS.API.STREAM.DELETE.>".to_string(),
        "$JS.API.STREAM.PURGE.>".to_string(),
        "$JS.API.CONSUMER.CREATE.>".to_string(),
        "$JS.API.CONSUMER.DURABLE.CREATE.>".to_string(),
        "$JS.API.CONSUMER.DELETE.>".to_string(),
        "$JS.FC.>".to_string(),
        format!("$JS.API.DIRECT.GET.{snap}"),
        format!("$JS.API.DIRECT.GET.{snap}.>"),
        format!("$JS.API.DIRECT.GET.{snapidx}"),
        format!("$JS.API.DIRECT.GET.{snapidx}.>"),
        format!("$JS.API.CONSUMER.MSG.NEXT.{work}.>"),
        format!("$JS.ACK.{work}.>"),
    ];
    let subscribe = [
        format!("{PRIVATE_INBOX_PREFIX}{actor}.>"),
        subjects::weights_live(run),
        subjects::pace(run),
        subjects::kv_key_subject(&run_bucket, subjects::WEIGHTS_KEY),
    ];
    let quoted = |items: &[String]| items.iter().map(|item| format!("\"{item}\"")).collect::<Vec<_>>();
    let mut block = String::new();
    block.push_str("      {\n");
    block.push_str(&format!(
        "        # Actor identity `{actor}` of run `{run}` (`volley creds actors`): its own subjects only.\n"
    ));
    block.push_str(&format!("        nkey: {nkey}\n"));
    block.push_str("        permissions: {\n          publish: {\n            allow: [\n");
    for item in quoted(&allow) {
        block.push_str(&format!("              {item}\n"));
    }
    block.push_str("            ]\n");
    block.push_str(&format!("            deny: [{}]\n", quoted(&deny).join(", ")));
    block.push_str("          }\n");
    block.push_str(&format!("          subscribe: {{ allow: [{}] }}\n", quoted(&subscribe).join(", ")));
    block.push_str("        }\n      }\n");
    block
}

/// The environment variable the repo's broker config reads the public key of identity slot
/// `index` from (`VOLLEY_ACTOR_<index>_NKEY`), as it reads passwords.
pub fn actor_nkey_variable(index: usize) -> String {
    format!("VOLLEY_ACTOR_{index}_NKEY")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(name: &str) -> ActorId {
        ActorId::new(name).expect("valid actor id")
    }

    #[test]
    fn a_written_identity_reads_back_with_its_name_and_key() {
        let dir = tempfile::tempdir().expect("temp dir");
        let identity = ActorIdentity::generate(actor("actor-3")).expect("generate");
        let path = identity.write(dir.path()).expect("write");
        assert_eq!(path.file_name().and_then(|n| n.to_str()), Some("actor-3.nk"));
        let read = ActorIdentity::read(&path).expect("read back");
        assert_eq!(read.name().as_str(), "actor-3");
        assert_eq!(read.public_key(), identity.public_key());
        assert!(identity.public_key().starts_with('U'));
        assert!(!format!("{identity:?}").contains(&identity.seed), "Debug shows no seed");
        assert!(identity.write(dir.path()).is_err(), "an identity file is never overwritten");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).expect("metadata").permissions().mode();
            assert_eq!(mode & 0o077, 0, "readable by its owner only");
        }
    }

    #[test]
    fn bad_names_and_seeds_are_refused() {
        assert!(matches!(ActorIdentity::generate(actor("Actor-1")), Err(IdentityError::BadName { .. })));
        let account = nkeys::KeyPair::new_account().seed().expect("seed");
        assert!(matches!(ActorIdentity::from_seed(actor("a"), &account, "x"), Err(IdentityError::BadSeed { .. })));
        assert!(matches!(ActorIdentity::from_seed(actor("a"), "SUNOTASEED", "x"), Err(IdentityError::BadSeed { .. })));
        let dir = tempfile::tempdir().expect("temp dir");
        let odd = dir.path().join("a.b.nk");
        std::fs::write(&odd, nkeys::KeyPair::new_user().seed().expect("seed")).expect("write");
        assert!(matches!(ActorIdentity::read(&odd), Err(IdentityError::BadName { .. })));
    }

    #[test]
    fn a_user_block_grants_the_actors_own_subjects_only() {
        let run = RunId::new("local").expect("run id");
        let services = [EnvServiceName::new("cartpole").expect("service")];
        let block = actor_user_block(&run, &actor("actor-1"), "$VOLLEY_ACTOR_1_NKEY", &services);
        for own in [
            "\"volley.local.traj.actor-1\"",
            "\"volley.local.work.take.actor-1\"",
            "\"volley.local.work.progress.actor-1\"",
            "\"volley.local.work.done.actor-1\"",
            "\"_INBOX_actor-1.>\"",
            "\"volley.env.cartpole.>\"",
        ] {
            assert!(block.contains(own), "{own} missing from\n{block}");
        }
        assert!(!block.contains("traj.>") && !block.contains("traj.*"), "no wildcard over other actors");
        assert!(!block.contains("work.take.*"), "no wildcard over other actors");
        assert!(block.contains("nkey: $VOLLEY_ACTOR_1_NKEY\n"));
    }

    /// Issue 46: an actor may create no consumer (a push consumer's deliver subject is not
    /// checked, so it could relay onto the learner's subjects); it reads by message gets and
    /// hears of new pointers on the key's subject.
    #[test]
    fn a_user_block_grants_no_consumer_and_the_pointer_notices() {
        let run = RunId::new("local").expect("run id");
        let block = actor_user_block(&run, &actor("actor-1"), "$VOLLEY_ACTOR_1_NKEY", &[]);
        let (allow, rest) = block.split_once("deny:").expect("a deny list");
        for granted_nowhere in ["CONSUMER.CREATE", "CONSUMER.DELETE", "CONSUMER.DURABLE", "$JS.FC"] {
            assert!(!allow.contains(granted_nowhere), "{granted_nowhere} granted in\n{block}");
        }
        for denied in [
            "\"$JS.API.CONSUMER.CREATE.>\"",
            "\"$JS.API.CONSUMER.DURABLE.CREATE.>\"",
            "\"$JS.API.CONSUMER.DELETE.>\"",
            "\"$JS.FC.>\"",
        ] {
            assert!(rest.contains(denied), "{denied} not denied in\n{block}");
        }
        assert!(allow.contains("\"$JS.API.DIRECT.GET.OBJ_volley-local-wts\""), "chunk gets by next_by_subj");
        // Nor direct gets on the stores actors write, whose answers could carry their bytes to
        // any reply subject.
        assert!(
            !allow.contains("DIRECT.GET.OBJ_volley-local-snap")
                && !allow.contains("DIRECT.GET.KV_volley-local-snapidx")
        );
        assert!(allow.contains("\"$JS.API.STREAM.MSG.GET.OBJ_volley-local-snap\""));
        let subscribe = rest.split_once("subscribe:").expect("subscribe grants").1;
        assert!(subscribe.contains("\"$KV.volley-local.weights\""), "pointer notices");
        assert!(!subscribe.contains("$KV.volley-local.>"), "the pointer key only");
    }
}
