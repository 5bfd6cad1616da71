//! One learner update: batch → network forward → loss → backward → clip → Adam → new version.

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{LossKind, RunSpec, SpecError};
use volley_core::wire::Weights;
use volley_policy::distributions::log_softmax;
use volley_policy::returns::gae::gae;
use volley_policy::returns::vtrace::VTraceConfig;
use volley_policy::{ParamLayout, PolicyTape};

use crate::backend::cuda::{CudaEngine, DeviceState};
use crate::backend::{open_cuda, BackendError, BackendKind, CudaDevice, DeviceTiming};
use crate::batch::{gather, resize, SegmentBatch};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::losses::{self, LossStats, PpoLossConfig, SequenceBatch, VTraceLossConfig, VTraceWorkspace};
use crate::optim::{clip_grad_global_norm, Adam, AdamConfig, AdamState, LrSchedule};

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
    /// Samples (steps × segments) in the batch.
    pub samples: usize,
    /// Largest lag among the batch's segments, in versions.
    pub lag_max: u64,
    /// Mean lag.
    pub lag_mean: f32,
    /// Off-policy health of the batch (CPU backend; `None` on the CUDA backend, whose fused
    /// kernels return only the loss sums).
    pub off_policy: Option<crate::telemetry::OffPolicyStats>,
}

/// The learner's parameters, optimiser and scratch buffers.
pub struct Learner {
    spec: RunSpec,
    layout: ParamLayout,
    params: Vec<f32>,
    grads: Vec<f32>,
    adam: Adam,
    schedule: LrSchedule,
    tape: PolicyTape,
    version: PolicyVersion,
    updates: u64,
    rng: Pcg64Mcg,
    // Scratch, reused across updates.
    vtrace_workspace: VTraceWorkspace,
    dlogits: Vec<f32>,
    dvalues: Vec<f32>,
    log_probs_row: Vec<f32>,
    prox_log_probs: Vec<f32>,
    /// `log π_prox − log μ` per sample, for the off-policy statistics.
    prox_log_rhos: Vec<f32>,
    is_weights: Vec<f32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
    minibatch: SegmentBatch,
    mb_advantages: Vec<f32>,
    mb_returns: Vec<f32>,
    mb_prox_log_probs: Vec<f32>,
    mb_is_weights: Vec<f32>,
    columns: Vec<usize>,
    /// The CUDA backend's device state, when in use; `params` and `adam` are then host copies
    /// refreshed by [`Learner::sync_host`].
    device: Option<Box<CudaEngine>>,
    /// Whether the device holds updates the host copies lack.
    host_stale: bool,
    backend: String,
}

impl Learner {
    /// A learner with freshly initialised parameters (version 0).
    pub fn new(spec: RunSpec) -> Result<Self, LearnerError> {
        let layout = spec.validate()?;
        let params = layout.init_params(spec.seed);
        Self::with_state(spec, params, PolicyVersion(0), 0)
    }

    /// A learner resuming from parameters at `version` after `updates` updates.
    pub fn with_state(
        spec: RunSpec,
        params: Vec<f32>,
        version: PolicyVersion,
        updates: u64,
    ) -> Result<Self, LearnerError> {
        let layout = spec.validate()?;
        if params.len() != layout.n_params() {
            return Err(LearnerError::Params { expected: layout.n_params(), got: params.len() });
        }
        let h = &spec.hyper;
        let adam =
            Adam::new(layout.n_params(), AdamConfig { beta1: h.adam_beta1, beta2: h.adam_beta2, eps: h.adam_eps });
        let schedule = if h.final_learning_rate == h.learning_rate {
            LrSchedule::Constant(h.learning_rate)
        } else {
            LrSchedule::Linear { start: h.learning_rate, end: h.final_learning_rate, total_updates: h.lr_decay_updates }
        };
        Ok(Learner {
            grads: vec![0.0; layout.n_params()],
            tape: PolicyTape::new(&layout),
            rng: Pcg64Mcg::seed_from_u64(spec.seed ^ 0x01ea_20e2),
            adam,
            schedule,
            params,
            layout,
            spec,
            version,
            updates,
            vtrace_workspace: VTraceWorkspace::new(),
            dlogits: Vec::new(),
            dvalues: Vec::new(),
            log_probs_row: Vec::new(),
            prox_log_probs: Vec::new(),
            prox_log_rhos: Vec::new(),
            is_weights: Vec::new(),
            advantages: Vec::new(),
            returns: Vec::new(),
            minibatch: SegmentBatch::default(),
            mb_advantages: Vec::new(),
            mb_returns: Vec::new(),
            mb_prox_log_probs: Vec::new(),
            mb_is_weights: Vec::new(),
            columns: Vec::new(),
            device: None,
            host_stale: false,
            backend: "cpu".into(),
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
    /// stays on the CPU with one warning; [`BackendKind::Cuda`] fails when no device works.
    /// Call it before the first update (or after a checkpoint was loaded): the current
    /// parameters and optimiser state move to the device.
    pub fn use_backend(&mut self, kind: BackendKind) -> Result<(), LearnerError> {
        match kind {
            BackendKind::Cpu => {
                self.sync_host();
                self.device = None;
                self.backend = "cpu".into();
            }
            BackendKind::Cuda => {
                let device = open_cuda(0)?;
                self.use_cuda_device(&device)?;
            }
            BackendKind::Auto => match open_cuda(0) {
                Ok(device) => self.use_cuda_device(&device)?,
                Err(err) => {
                    tracing::warn!(%err, "CUDA backend unavailable; the learner runs on the CPU backend");
                }
            },
        }
        tracing::info!(backend = %self.backend, "learner backend");
        Ok(())
    }

    /// Run updates on an already opened CUDA device.
    pub fn use_cuda_device(&mut self, device: &CudaDevice) -> Result<(), LearnerError> {
        self.sync_host();
        let adam = self.adam.state();
        let state =
            DeviceState { params: self.params.clone(), adam_m: adam.m.clone(), adam_v: adam.v.clone(), adam_t: adam.t };
        self.device = Some(Box::new(CudaEngine::new(device, &self.layout, &state)?));
        self.backend = format!("cuda: {}", device.description());
        Ok(())
    }

    /// `cpu` or `cuda: <device>`.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Time each update's copies and kernels with CUDA events (CUDA backend only; a no-op on
    /// the CPU).
    pub fn set_profiling(&mut self, on: bool) -> Result<(), LearnerError> {
        if let Some(engine) = &mut self.device {
            engine.set_profiling(on)?;
        }
        Ok(())
    }

    /// Device timings of the last update, when profiling on the CUDA backend.
    pub fn last_timing(&self) -> Option<DeviceTiming> {
        self.device.as_ref().and_then(|engine| engine.last_timing())
    }

    /// Bring the host copies of the parameters and optimiser state up to date with the device
    /// (a no-op on the CPU backend). [`params`](Self::params), [`weights`](Self::weights) and
    /// [`checkpoint`](Self::checkpoint) call it, so weights leave the GPU only when they are
    /// published or saved.
    ///
    /// # Panics
    /// If the device fails: a learner whose GPU broke cannot continue; restarting it resumes
    /// from the last checkpoint.
    pub fn sync_host(&mut self) {
        if !self.host_stale {
            return;
        }
        let engine = self.device.as_ref().expect("only the device makes the host stale");
        let state = engine.download().unwrap_or_else(|err| device_failed(&err));
        self.params = state.params;
        let h = &self.spec.hyper;
        let config = AdamConfig { beta1: h.adam_beta1, beta2: h.adam_beta2, eps: h.adam_eps };
        self.adam = Adam::from_state(config, AdamState { m: state.adam_m, v: state.adam_v, t: state.adam_t })
            .expect("the device state has the layout's size");
        self.host_stale = false;
    }

    /// The current parameters (copied from the device first on the CUDA backend).
    pub fn params(&mut self) -> &[f32] {
        if self.host_stale {
            let engine = self.device.as_ref().expect("only the device makes the host stale");
            engine.download_params(&mut self.params).unwrap_or_else(|err| device_failed(&err));
        }
        &self.params
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
        self.sync_host();
        let adam = self.adam.state();
        Checkpoint {
            spec_json: serde_json::to_string(&self.spec).expect("a run spec always serializes"),
            layout_hash: self.layout.hash(),
            version: self.version,
            updates: self.updates,
            params: self.params.clone(),
            adam_m: adam.m.clone(),
            adam_v: adam.v.clone(),
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
        let mut learner = Learner::with_state(spec, checkpoint.params, checkpoint.version, checkpoint.updates)?;
        if checkpoint.layout_hash != learner.layout.hash() {
            return Err(mismatch(format!(
                "layout {:016x}, run has {:016x}",
                checkpoint.layout_hash,
                learner.layout.hash()
            ))
            .into());
        }
        let h = &learner.spec.hyper;
        let config = AdamConfig { beta1: h.adam_beta1, beta2: h.adam_beta2, eps: h.adam_eps };
        let state = AdamState { m: checkpoint.adam_m, v: checkpoint.adam_v, t: checkpoint.adam_t };
        learner.adam = Adam::from_state(config, state).map_err(|e| mismatch(e.to_string()))?;
        learner.rng = checkpoint.rng;
        Ok(learner)
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
    pub fn update(&mut self, batch: &SegmentBatch) -> UpdateStats {
        let learning_rate = self.schedule.lr_at(self.updates);
        let lags: Vec<u64> = batch.policy_versions.iter().map(|&v| self.version.lag_of(v)).collect();
        let mut stats = if let Some(engine) = &mut self.device {
            self.host_stale = true;
            let update = engine
                .update(batch, &self.spec.hyper, learning_rate, &mut self.rng)
                .unwrap_or_else(|err| device_failed(&err));
            UpdateStats {
                loss: update.loss,
                grad_norm: update.grad_norm,
                skipped_steps: update.skipped_steps,
                ..UpdateStats::default()
            }
        } else {
            match self.spec.hyper.loss {
                LossKind::Vtrace => self.vtrace_update(batch, learning_rate),
                LossKind::Ppo => self.ppo_update(batch, learning_rate),
            }
        };
        stats.learning_rate = learning_rate;
        stats.samples = batch.t_len * batch.b_len;
        stats.lag_max = lags.iter().copied().max().unwrap_or(0);
        stats.lag_mean = if lags.is_empty() { 0.0 } else { lags.iter().sum::<u64>() as f32 / lags.len() as f32 };
        self.updates += 1;
        // Saturating: versions start at or below MAX_PLAUSIBLE and never come near the end.
        self.version = PolicyVersion(self.version.0.saturating_add(1));
        stats
    }

    /// Clip, then apply Adam; returns the pre-clip norm, or `None` when the step was skipped.
    fn apply_gradients(&mut self, learning_rate: f32) -> Option<f32> {
        let norm = clip_grad_global_norm(&mut self.grads, self.spec.hyper.max_grad_norm);
        if !norm.is_finite() {
            return None;
        }
        self.adam.step(&mut self.params, &self.grads, learning_rate);
        Some(norm)
    }

    fn vtrace_update(&mut self, batch: &SegmentBatch, learning_rate: f32) -> UpdateStats {
        let h = &self.spec.hyper;
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        let n_actions = self.spec.policy.n_actions;
        self.tape.forward(
            &self.params,
            &batch.observations,
            &batch.episode_start,
            &batch.initial_hidden,
            t_len + 1,
            b_len,
        );
        resize(&mut self.dlogits, (t_len + 1) * b_len * n_actions);
        resize(&mut self.dvalues, (t_len + 1) * b_len);
        let config = VTraceLossConfig {
            vtrace: VTraceConfig {
                clip_rho_threshold: h.clip_rho_threshold,
                clip_pg_rho_threshold: h.clip_pg_rho_threshold,
                clip_c_threshold: h.clip_c_threshold,
                lambda_: h.vtrace_lambda,
            },
            value_coef: h.value_coef,
            ent_coef: h.ent_coef,
        };
        let loss = losses::vtrace_loss_with_workspace(
            &sequence_batch(batch, n_actions),
            self.tape.logits(),
            self.tape.values(),
            &config,
            &mut self.vtrace_workspace,
            &mut self.dlogits,
            &mut self.dvalues,
        );
        let n_samples = t_len * b_len;
        let off_policy = crate::telemetry::off_policy_stats(&crate::telemetry::OffPolicyInputs {
            log_rhos: self.vtrace_workspace.log_rhos(),
            weights: &batch.sample_weights,
            values: &self.tape.values()[..n_samples],
            value_targets: self.vtrace_workspace.vs(),
            rho_bar: h.clip_rho_threshold,
            c_bar: h.clip_c_threshold,
        });
        self.tape.backward(&self.params, &self.dlogits, &self.dvalues, &mut self.grads);
        let mut stats = UpdateStats { loss, off_policy: Some(off_policy), ..UpdateStats::default() };
        match self.apply_gradients(learning_rate) {
            Some(norm) => stats.grad_norm = norm,
            None => stats.skipped_steps = 1,
        }
        stats
    }

    fn ppo_update(&mut self, batch: &SegmentBatch, learning_rate: f32) -> UpdateStats {
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        let n_actions = self.spec.policy.n_actions;
        let steps = t_len * b_len;
        // 1. The proximal policy and the value baseline: the learner's parameters before this update.
        self.tape.forward(
            &self.params,
            &batch.observations,
            &batch.episode_start,
            &batch.initial_hidden,
            t_len + 1,
            b_len,
        );
        resize(&mut self.prox_log_probs, steps);
        self.log_probs_row.resize(n_actions, 0.0);
        let logits = self.tape.logits();
        for i in 0..steps {
            log_softmax(&logits[i * n_actions..(i + 1) * n_actions], &mut self.log_probs_row);
            self.prox_log_probs[i] = self.log_probs_row[batch.actions[i] as usize];
        }
        // 2. GAE advantages against the proximal values (Schulman et al. 2016).
        let values = self.tape.values();
        resize(&mut self.advantages, steps);
        resize(&mut self.returns, steps);
        gae(
            t_len,
            b_len,
            &batch.discounts,
            &batch.rewards,
            &values[..steps],
            &values[steps..],
            self.spec.hyper.gae_lambda,
            &mut self.advantages,
            &mut self.returns,
        );
        // 3. Behaviour importance weights min(π_prox/μ, clip) (Hilton et al. 2021).
        resize(&mut self.is_weights, steps);
        losses::behaviour_is_weights(
            &self.prox_log_probs,
            &batch.behaviour_log_probs,
            self.spec.hyper.behaviour_is_clip,
            &mut self.is_weights,
        );
        self.prox_log_rhos.clear();
        self.prox_log_rhos
            .extend(self.prox_log_probs.iter().zip(&batch.behaviour_log_probs).map(|(prox, mu)| prox - mu));
        let off_policy = crate::telemetry::off_policy_stats(&crate::telemetry::OffPolicyInputs {
            log_rhos: &self.prox_log_rhos,
            weights: &batch.sample_weights,
            values: &self.tape.values()[..steps],
            value_targets: &self.returns,
            rho_bar: self.spec.hyper.behaviour_is_clip,
            c_bar: self.spec.hyper.behaviour_is_clip,
        });
        // 4. Epochs of minibatch gradient steps over whole sequences (columns).
        let h = self.spec.hyper.clone();
        let config = PpoLossConfig {
            clip_coef: h.clip_coef,
            value_coef: h.value_coef,
            ent_coef: h.ent_coef,
            normalize_advantages: h.normalize_advantages,
        };
        let n_minibatches = (h.ppo_minibatches as usize).clamp(1, b_len.max(1));
        let mut total = LossStats::default();
        let mut grad_norm_sum = 0.0;
        let mut applied = 0u32;
        let mut skipped = 0u32;
        self.columns.clear();
        self.columns.extend(0..b_len);
        for _ in 0..h.ppo_epochs {
            self.columns.shuffle(&mut self.rng);
            for mb in 0..n_minibatches {
                let lo = mb * b_len / n_minibatches;
                let hi = (mb + 1) * b_len / n_minibatches;
                let cols = &self.columns[lo..hi];
                batch.gather_columns(cols, &mut self.minibatch);
                gather(&self.advantages, t_len, b_len, 1, cols, &mut self.mb_advantages);
                gather(&self.returns, t_len, b_len, 1, cols, &mut self.mb_returns);
                gather(&self.prox_log_probs, t_len, b_len, 1, cols, &mut self.mb_prox_log_probs);
                gather(&self.is_weights, t_len, b_len, 1, cols, &mut self.mb_is_weights);
                let mb_len = cols.len();
                // The bootstrap row is not needed here: targets are already computed.
                let obs_rows = t_len * mb_len * batch.obs_dim;
                self.tape.forward(
                    &self.params,
                    &self.minibatch.observations[..obs_rows],
                    &self.minibatch.episode_start[..t_len * mb_len],
                    &self.minibatch.initial_hidden,
                    t_len,
                    mb_len,
                );
                resize(&mut self.dlogits, t_len * mb_len * n_actions);
                resize(&mut self.dvalues, t_len * mb_len);
                let loss = losses::ppo_loss(
                    &sequence_batch(&self.minibatch, n_actions),
                    &losses::PpoTargets {
                        advantages: &self.mb_advantages,
                        returns: &self.mb_returns,
                        prox_log_probs: &self.mb_prox_log_probs,
                        is_weights: &self.mb_is_weights,
                    },
                    self.tape.logits(),
                    self.tape.values(),
                    &config,
                    &mut self.dlogits,
                    &mut self.dvalues,
                );
                self.tape.backward(&self.params, &self.dlogits, &self.dvalues, &mut self.grads);
                match self.apply_gradients(learning_rate) {
                    Some(norm) => {
                        grad_norm_sum += norm;
                        applied += 1;
                        total.accumulate(&loss);
                    }
                    None => skipped += 1,
                }
            }
        }
        UpdateStats {
            loss: total.mean(),
            grad_norm: if applied > 0 { grad_norm_sum / applied as f32 } else { f32::NAN },
            skipped_steps: skipped,
            off_policy: Some(off_policy),
            ..UpdateStats::default()
        }
    }
}

#[cold]
fn device_failed(err: &BackendError) -> ! {
    panic!(
        "the CUDA backend failed: {err}; the learner cannot continue (restart it to resume from its last checkpoint)"
    )
}

fn sequence_batch(batch: &SegmentBatch, n_actions: usize) -> SequenceBatch<'_> {
    SequenceBatch {
        t_len: batch.t_len,
        b_len: batch.b_len,
        n_actions,
        actions: &batch.actions,
        behaviour_log_probs: &batch.behaviour_log_probs,
        rewards: &batch.rewards,
        discounts: &batch.discounts,
        sample_weights: &batch.sample_weights,
    }
}
