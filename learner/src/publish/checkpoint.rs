//! Learner checkpoints: parameters, optimiser state, version, update count, RNG state and
//! progress counters in one file, written atomically (temp file, fsync, rename), so a crash
//! at any moment leaves either the old or the new checkpoint, never a torn one.
//!
//! The file is a private format of the learner (it never crosses the bus): magic `VLCK`, a
//! format version, then the bincode-2 body.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;

const MAGIC: [u8; 4] = *b"VLCK";
const FORMAT_VERSION: u16 = 1;
/// Largest checkpoint this build reads (4 GiB).
const MAX_CHECKPOINT_BYTES: usize = 4 << 30;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File-system failure.
    #[error("{operation} {path}: {source}")]
    Io {
        /// What was attempted.
        operation: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a checkpoint this build reads.
    #[error("{path} is not a readable checkpoint: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint belongs to another architecture or run.
    #[error("checkpoint {path} does not match this run: {reason}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
}

/// Everything needed to resume a learner exactly where it stopped.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Checkpoint {
    /// The run spec the learner was trained with, as JSON (the spec's environment config is an
    /// internally tagged enum, which bincode cannot decode; JSON also keeps it readable).
    pub spec_json: String,
    /// Layout hash of `params`.
    pub layout_hash: u64,
    /// Policy version of `params`.
    pub version: PolicyVersion,
    /// Updates applied.
    pub updates: u64,
    /// The flat parameters.
    pub params: Vec<f32>,
    /// Adam first moments.
    pub adam_m: Vec<f32>,
    /// Adam second moments.
    pub adam_v: Vec<f32>,
    /// Adam step count.
    pub adam_t: u64,
    /// The learner's random generator (PPO minibatch shuffling).
    pub rng: Pcg64Mcg,
    /// Environment steps consumed so far (budgets continue across restarts).
    pub env_steps: u64,
}

impl Checkpoint {
    /// The checkpoint file inside `dir` for `run`.
    pub fn path_in(dir: &Path, run: &str) -> PathBuf {
        dir.join(format!("learner-{run}.ckpt"))
    }

    /// Write atomically: a temp file in the same directory, fsync, rename over the target.
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let io = |operation: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { operation, path, source }
        };
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(io("creating directory", dir))?;
        let mut bytes = Vec::with_capacity(16 + self.params.len() * 12);
        bytes.extend_from_slice(&MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bincode::serde::encode_into_std_write(self, &mut bytes, bincode::config::standard())
            .expect("encoding into a Vec cannot fail");
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut file = File::create(&tmp).map_err(io("creating", &tmp))?;
        file.write_all(&bytes).map_err(io("writing", &tmp))?;
        file.sync_all().map_err(io("syncing", &tmp))?;
        drop(file);
        fs::rename(&tmp, path).map_err(io("renaming into place", path))?;
        // Make the rename itself durable.
        if let Ok(dir_handle) = File::open(dir) {
            let _ = dir_handle.sync_all();
        }
        Ok(())
    }

    /// Read a checkpoint; `Ok(None)` when the file does not exist.
    pub fn load(path: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(CheckpointError::Io { operation: "reading", path: path.to_path_buf(), source }),
        };
        let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
        if bytes.len() < 6 || bytes[..4] != MAGIC {
            return Err(corrupt("bad magic".into()));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != FORMAT_VERSION {
            return Err(corrupt(format!("format version {version}, this build reads {FORMAT_VERSION}")));
        }
        let config = bincode::config::standard().with_limit::<MAX_CHECKPOINT_BYTES>();
        let (checkpoint, used): (Checkpoint, usize) =
            bincode::serde::decode_from_slice(&bytes[6..], config).map_err(|e| corrupt(e.to_string()))?;
        if used != bytes.len() - 6 {
            return Err(corrupt(format!("{} trailing bytes", bytes.len() - 6 - used)));
        }
        let n = checkpoint.params.len();
        if checkpoint.adam_m.len() != n || checkpoint.adam_v.len() != n {
            return Err(corrupt("optimiser state does not match the parameters".into()));
        }
        Ok(Some(checkpoint))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SegmentBatch;
    use crate::learner::Learner;
    use volley_core::ids::PolicyVersion;
    use volley_core::spec::{HyperParams, LossKind, RunSpec};
    use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

    fn spec(torso: Vec<usize>) -> RunSpec {
        let hyper =
            HyperParams { loss: LossKind::Ppo, batch_segments: 2, ppo_minibatches: 2, ..HyperParams::default() };
        SpecBuilder::cartpole(4).run("ckpt").torso(torso).hyper(hyper).seed(1).build()
    }

    fn batch() -> SegmentBatch {
        let segment = |shift: f32| {
            SegmentBuilder::cartpole(4)
                .observations_from(|i| (i as f32 * 0.1 + shift).sin())
                .actions(vec![0, 1, 1, 0])
                .terminal_at(3)
                .log_prob(-0.7)
                .build()
        };
        let (a, b) = (segment(0.0), segment(1.0));
        let mut batch = SegmentBatch::default();
        batch.fill(&[&a, &b], 0.99, 1.0, &[1.0, 1.0]);
        batch
    }

    #[test]
    fn a_resumed_learner_continues_bit_identically() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = Checkpoint::path_in(dir.path(), "ckpt");
        let batch = batch();
        let mut original = Learner::new(spec(vec![8])).expect("valid");
        original.update(&batch);
        original.checkpoint(123).save(&path).expect("saved");
        let loaded = Checkpoint::load(&path).expect("readable").expect("exists");
        assert_eq!(loaded.env_steps, 123);
        let mut resumed = Learner::from_checkpoint(spec(vec![8]), loaded, &path).expect("compatible");
        assert_eq!(resumed.version(), original.version());
        // Adam moments and the shuffling RNG are restored too, so the next update is identical.
        original.update(&batch);
        resumed.update(&batch);
        assert_eq!(resumed.params(), original.params());
    }

    #[test]
    fn missing_corrupt_and_foreign_checkpoints_are_clear_errors() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = Checkpoint::path_in(dir.path(), "ckpt");
        assert!(Checkpoint::load(&path).expect("absent is fine").is_none());
        fs::write(&path, b"VLCK\x01\x00garbage").expect("write");
        assert!(matches!(Checkpoint::load(&path), Err(CheckpointError::Corrupt { .. })));
        fs::write(&path, b"nope").expect("write");
        assert!(matches!(Checkpoint::load(&path), Err(CheckpointError::Corrupt { .. })));
        let mut learner = Learner::new(spec(vec![8])).expect("valid");
        learner.checkpoint(0).save(&path).expect("saved");
        let loaded = Checkpoint::load(&path).expect("readable").expect("exists");
        // A different architecture cannot resume from it.
        assert!(Learner::from_checkpoint(spec(vec![16]), loaded, &path).is_err());
    }

    #[test]
    fn versions_never_go_backwards_after_a_restart() {
        let mut learner = Learner::new(spec(vec![8])).expect("valid");
        learner.advance_version_past(PolicyVersion(41)).expect("plausible");
        assert_eq!(learner.version(), PolicyVersion(42));
        learner.advance_version_past(PolicyVersion(3)).expect("older");
        assert_eq!(learner.version(), PolicyVersion(42));
    }

    /// Issue 12: after a pointer at 2^64 − 1 a restarted learner went back to version 0
    /// (`published=18446744073709551615 next=0`). It now keeps its own version and says why.
    #[test]
    fn an_absurd_published_version_is_refused_without_a_wrap() {
        let mut learner = Learner::new(spec(vec![8])).expect("valid");
        learner.advance_version_past(PolicyVersion(37_886)).expect("plausible");
        for absurd in [u64::MAX, 1 << 63, PolicyVersion::MAX_PLAUSIBLE.0] {
            let err = learner.advance_version_past(PolicyVersion(absurd)).expect_err("absurd");
            assert_eq!(err.kept, PolicyVersion(37_887));
            assert_eq!(learner.version(), PolicyVersion(37_887), "never wraps, never goes back");
        }
    }
}
