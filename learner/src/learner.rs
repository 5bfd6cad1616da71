//! One learner update: batch → network forward → loss → backward → clip → Adam → new version.

use std::sync::Arc;

use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{HyperParams, RunSpec, SpecError};
use volley_core::wire::Weights;
use volley_policy::ParamLayout;

use crate::backend::cuda::DeviceTiming;
use crate::backend::{open_cuda, BackendError, BackendKind, CpuBackend, CudaBackend, CudaDevice};
use crate::batch::SegmentBatch;
use crate::losses::LossStats;
use crate::optim::{AdamConfig, AdamState, LrSchedule};
use crate::publish::checkpoint::{Checkpoint, CheckpointError};
use crate::train::{with_trainer, AnyTrainer, HostState, Trainer, ValueEstimates};

/// A published version the learner refuses to continue above (see
/// [`Learner::advance_version_past`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "published version {published} is above the plausible maximum {}; continuing from {kept}",
    PolicyVersion::MAX_PLAUSIBLE
)]
pub struct AbsurdVersion {
    /// The version the run claims to have published.
    pub published: PolicyVersion,
    /// The version the learner keeps (its checkpoint's, or 0).
    pub kept: PolicyVersion,
}

/// Why the learner cannot start or continue.
#[derive(Debug, thiserror::Error)]
pub enum LearnerError {
    /// The run spec is invalid.
    #[error("invalid run spec: {0}")]
    Spec(#[from] SpecError),
    /// A checkpoint could not be used.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The requested backend cannot run.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Initial parameters do not match the layout.
    #[error("initial parameters: expected {expected}, got {got}")]
    Params {
        /// Expected count.
        expected: usize,
        /// Actual count.
        got: usize,
    },
}

/// What one update measured.
#[derive(Debug, Clone, Default)]
pub struct UpdateStats {
    /// Loss terms, averaged over the gradient steps of this update.
    pub loss: LossStats,
    /// Global gradient norm before clipping (mean over gradient steps).
    pub grad_norm: f32,
    /// Gradient steps skipped because the gradient was not finite.
    pub skipped_steps: u32,
    /// Learning rate used.
    pub learning_rate: f32,
    /// Entropy bonus coefficient used (`HyperParams::final_ent_coef` decays it).
    pub ent_coef: f32,
    /// Samples (steps × segments) in the batch.
    pub samples: usize,
    /// Largest lag among the batch's segments, in versions.
    pub lag_max: u64,
    /// Mean lag.
    pub lag_mean: f32,
    /// Off-policy health of the batch (both backends).
    pub off_policy: Option<crate::telemetry::OffPolicyStats>,
}

/// The learner: its run spec, policy version and update count, and a [`Trainer`] on the backend
/// that holds the parameters and optimiser state and runs the update.
pub struct Learner {
    spec: RunSpec,
    layout: ParamLayout,
    schedule: LrSchedule,
    /// The entropy bonus per update (`HyperParams::final_ent_coef`), on the learning rate's ramp.
    ent_schedule: LrSchedule,
    version: PolicyVersion,
    updates: u64,
    rng: Pcg64Mcg,
    trainer: AnyTrainer,
    /// Host copy of the parameters, refreshed from the backend when `host_params_stale`.
    host_params: Vec<f32>,
    host_params_stale: bool,
    /// Threads of the CPU backend ([`Learner::set_cpu_threads`]; 1 until set).
    cpu_threads: usize,
}

fn adam_config(spec: &RunSpec) -> AdamConfig {
    let h = &spec.hyper;
    AdamConfig { beta1: h.adam_beta1, beta2: h.adam_beta2, eps: h.adam_eps }
}

impl Learner {
    /// A learner with freshly initialised parameters (version 0).
    pub fn new(spec: RunSpec) -> Result<Self, LearnerError> {
        let layout = spec.validate()?;
        let params = layout.init_params(spec.seed);
        Self::with_state(spec, params, PolicyVersion(0), 0)
    }

    /// A learner resuming from parameters at `version` after `updates` updates (fresh Adam state).
    pub fn with_state(
        spec: RunSpec,
        params: Vec<f32>,
        version: PolicyVersion,
        updates: u64,
    ) -> Result<Self, LearnerError> {
        let n = params.len();
        let adam = AdamState { m: vec![0.0; n], v: vec![0.0; n], t: 0 };
        let rng = Pcg64Mcg::seed_from_u64(spec.seed ^ 0x01ea_20e2);
        Self::build(spec, HostState { params, adam }, version, updates, rng)
    }

    fn build(
        spec: RunSpec,
        state: HostState,
        version: PolicyVersion,
        updates: u64,
        rng: Pcg64Mcg,
    ) -> Result<Self, LearnerError> {
        let layout = spec.validate()?;
        if state.params.len() != layout.n_params() {
            return Err(LearnerError::Params { expected: layout.n_params(), got: state.params.len() });
        }
        let h = &spec.hyper;
        let schedule = if h.final_learning_rate == h.learning_rate {
            LrSchedule::Constant(h.learning_rate)
        } else {
            LrSchedule::Linear { start: h.learning_rate, end: h.final_learning_rate, total_updates: h.lr_decay_updates }
        };
        let ent_schedule = match h.final_ent_coef {
            Some(end) if end != h.ent_coef => {
                LrSchedule::Linear { start: h.ent_coef, end, total_updates: h.lr_decay_updates }
            }
            _ => LrSchedule::Constant(h.ent_coef),
        };
        let trainer = AnyTrainer::Cpu(Trainer::new(CpuBackend::new(), &layout, &state, adam_config(&spec))?);
        Ok(Learner {
            host_params: state.params,
            host_params_stale: false,
            cpu_threads: 1,
            trainer,
            rng,
            schedule,
            ent_schedule,
            layout,
            spec,
            version,
            updates,
        })
    }

    /// The run spec.
    pub fn spec(&self) -> &RunSpec {
        &self.spec
    }

    /// The parameter layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Run updates on `kind`: [`BackendKind::Auto`] picks CUDA when a device works and otherwise
    /// stays on the CPU, with one info line when the machine has no GPU and a warning when one
    /// is there but failed; [`BackendKind::Cuda`] fails when no device works.
    /// The current parameters and optimiser state move to the chosen backend.
    pub fn use_backend(&mut self, kind: BackendKind) -> Result<(), LearnerError> {
        match kind {
            BackendKind::Cpu => {
                let backend = CpuBackend::with_threads(self.cpu_threads)?;
                let state = self.host_state();
                self.trainer = AnyTrainer::Cpu(Trainer::new(backend, &self.layout, &state, adam_config(&self.spec))?);
            }
            BackendKind::Cuda => {
                let device = open_cuda(0)?;
                self.use_cuda_device(&device)?;
            }
            BackendKind::Auto => match open_cuda(0) {
                Ok(device) => self.use_cuda_device(&device)?,
                // No GPU here: the CPU backend is what `auto` means on this machine.
                Err(err) if err.means_no_gpu() => {
                    tracing::info!(reason = %err, "no GPU here; the learner runs on the CPU backend");
                }
                Err(err) => {
                    tracing::warn!(%err, "a GPU is here but the CUDA backend failed; the learner runs on the CPU backend");
                }
            },
        }
        tracing::info!(backend = %self.backend(), "learner backend");
        Ok(())
    }

    /// Run CPU updates on `threads` threads (`--learner-threads`; see
    /// [`CpuBackend::with_threads`]). On the CPU backend the current parameters and optimiser
    /// state move to the new thread count at once; on CUDA it applies when the learner next
    /// moves to the CPU.
    pub fn set_cpu_threads(&mut self, threads: usize) -> Result<(), LearnerError> {
        let backend = CpuBackend::with_threads(threads)?;
        self.cpu_threads = threads;
        if self.trainer.is_cpu() {
            let state = self.host_state();
            self.trainer = AnyTrainer::Cpu(Trainer::new(backend, &self.layout, &state, adam_config(&self.spec))?);
        }
        Ok(())
    }

    /// The threads CPU updates run on.
    pub fn cpu_threads(&self) -> usize {
        self.cpu_threads
    }

    /// Run updates on an already opened CUDA device.
    pub fn use_cuda_device(&mut self, device: &CudaDevice) -> Result<(), LearnerError> {
        let state = self.host_state();
        let backend = CudaBackend::new(device)?;
        self.trainer = AnyTrainer::Cuda(Trainer::new(backend, &self.layout, &state, adam_config(&self.spec))?);
        Ok(())
    }

    /// `cpu` or `cuda: <device>`.
    pub fn backend(&self) -> String {
        self.trainer.description()
    }

    /// Time each update's copies and kernels with CUDA events (CUDA backend only; a no-op on
    /// the CPU).
    pub fn set_profiling(&mut self, on: bool) -> Result<(), LearnerError> {
        if let AnyTrainer::Cuda(trainer) = &mut self.trainer {
            trainer.backend_mut().set_profiling(on)?;
        }
        Ok(())
    }

    /// Device timings of the last update, when profiling on the CUDA backend.
    pub fn last_timing(&self) -> Option<DeviceTiming> {
        match &self.trainer {
            AnyTrainer::Cuda(trainer) => trainer.backend().last_timing(),
            AnyTrainer::Cpu(_) => None,
        }
    }

    /// Parameters and optimiser state, copied from the backend.
    ///
    /// # Panics
    /// If the device fails: a learner whose GPU broke cannot continue; restarting it resumes
    /// from the last checkpoint.
    fn host_state(&mut self) -> HostState {
        self.trainer.download_state().unwrap_or_else(|err| backend_failed(&err))
    }

    /// The current parameters (copied from the backend once per update that changed them, so on
    /// CUDA weights leave the GPU only when they are published or saved).
    pub fn params(&mut self) -> &[f32] {
        if self.host_params_stale {
            self.trainer.download_params(&mut self.host_params).unwrap_or_else(|err| backend_failed(&err));
            self.host_params_stale = false;
        }
        &self.host_params
    }

    /// The current policy version.
    pub fn version(&self) -> PolicyVersion {
        self.version
    }

    /// Updates done so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The current weights as a publishable, checksummed value.
    pub fn weights(&mut self) -> Arc<Weights> {
        let params = self.params().to_vec();
        Arc::new(Weights::new(self.version, self.layout.hash(), params))
    }

    /// Snapshot everything needed to resume (see [`Learner::from_checkpoint`]).
    pub fn checkpoint(&mut self, env_steps: u64) -> Checkpoint {
        let HostState { params, adam } = self.host_state();
        Checkpoint {
            spec_json: serde_json::to_string(&self.spec).expect("a run spec always serializes"),
            layout_hash: self.layout.hash(),
            version: self.version,
            updates: self.updates,
            params,
            adam_m: adam.m,
            adam_v: adam.v,
            adam_t: adam.t,
            rng: self.rng.clone(),
            env_steps,
        }
    }

    /// Resume from a checkpoint written for the same architecture. The run spec of `spec`
    /// wins for hyper-parameters; the layout must match.
    pub fn from_checkpoint(
        spec: RunSpec,
        checkpoint: Checkpoint,
        path: &std::path::Path,
    ) -> Result<Self, LearnerError> {
        let mismatch = |reason: String| CheckpointError::Mismatch { path: path.to_path_buf(), reason };
        let layout = spec.validate()?;
        if checkpoint.layout_hash != layout.hash() {
            return Err(
                mismatch(format!("layout {:016x}, run has {:016x}", checkpoint.layout_hash, layout.hash())).into()
            );
        }
        let n = checkpoint.params.len();
        for (field, len) in [("adam m", checkpoint.adam_m.len()), ("adam v", checkpoint.adam_v.len())] {
            if len != n {
                return Err(mismatch(format!("{field}: expected {n} elements, got {len}")).into());
            }
        }
        let state = HostState {
            params: checkpoint.params,
            adam: AdamState { m: checkpoint.adam_m, v: checkpoint.adam_v, t: checkpoint.adam_t },
        };
        Self::build(spec, state, checkpoint.version, checkpoint.updates, checkpoint.rng)
    }

    /// Make sure the next published version is above `published` (a version some earlier
    /// learner of this run already published), so versions never go backwards after a restart.
    ///
    /// A published version above [`PolicyVersion::MAX_PLAUSIBLE`] is absurd (a forged or
    /// corrupted pointer; issue 12: 2^64 − 1 wrapped the next version to 0): the learner keeps
    /// its own version (its checkpoint's) and returns the refusal for the caller to log.
    pub fn advance_version_past(&mut self, published: PolicyVersion) -> Result<(), AbsurdVersion> {
        if self.version > published {
            return Ok(());
        }
        match published.next() {
            Some(next) => {
                self.version = next;
                Ok(())
            }
            None => Err(AbsurdVersion { published, kept: self.version }),
        }
    }

    /// One update from a batch; the version advances by one.
    ///
    /// # Panics
    /// If the backend fails (see [`Learner::params`]).
    pub fn update(&mut self, batch: &SegmentBatch) -> UpdateStats {
        let learning_rate = self.schedule.lr_at(self.updates);
        let ent_coef = self.ent_schedule.lr_at(self.updates);
        let scheduled;
        let hyper = if ent_coef == self.spec.hyper.ent_coef {
            &self.spec.hyper
        } else {
            scheduled = HyperParams { ent_coef, ..self.spec.hyper.clone() };
            &scheduled
        };
        let rng = &mut self.rng;
        let outcome = with_trainer!(&mut self.trainer, trainer => trainer.train_step(batch, hyper, learning_rate, rng))
            .unwrap_or_else(|err| backend_failed(&err));
        self.host_params_stale = true;
        let lags = batch.policy_versions.iter().map(|&v| self.version.lag_of(v));
        let (lag_max, lag_sum) = lags.fold((0, 0u64), |(max, sum), lag| (max.max(lag), sum.saturating_add(lag)));
        let n_columns = batch.policy_versions.len();
        let stats = UpdateStats {
            loss: outcome.loss,
            grad_norm: outcome.grad_norm,
            skipped_steps: outcome.skipped_steps,
            learning_rate,
            ent_coef,
            samples: batch.data_samples(),
            lag_max,
            lag_mean: if n_columns == 0 { 0.0 } else { lag_sum as f32 / n_columns as f32 },
            off_policy: outcome.off_policy,
        };
        self.updates += 1;
        // Saturating: versions start at or below MAX_PLAUSIBLE and never come near the end.
        self.version = PolicyVersion(self.version.0.saturating_add(1));
        stats
    }

    /// Values and GAE(γ, `gae_lambda`) advantages of `batch` under the current parameters, from
    /// the backend's forward pass: trajectory selection's priorities.
    ///
    /// # Panics
    /// If the backend fails (see [`Learner::params`]).
    pub fn values_and_advantages(&mut self, batch: &SegmentBatch, gae_lambda: f32, out: &mut ValueEstimates) {
        with_trainer!(&mut self.trainer, trainer => trainer.values_and_advantages(batch, gae_lambda, out))
            .unwrap_or_else(|err| backend_failed(&err));
    }
}

#[cold]
fn backend_failed(err: &BackendError) -> ! {
    panic!("the learner backend failed: {err}; the learner cannot continue (restart it to resume from its last checkpoint)")
}
