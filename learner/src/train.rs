//! The update, written once over [`Backend`]: stage the batch, run the network, take the
//! V-trace or PPO loss, backprop, clip and step Adam, and read back a few statistics.
//!
//! [`Trainer<B>`] owns the parameters, gradients and optimiser state on its backend, the
//! network's activations and every intermediate of the loss; steady-state updates allocate
//! nothing on the device. [`AnyTrainer`] is the one enum at the edge: [`crate::Learner`] matches
//! on it once per update.
//!
//! - V-trace (Espeholt et al. 2018): one forward over the `T + 1` rows of the batch (the last
//!   row supplies the bootstrap value), the fused loss, one backward, one optimiser step.
//! - PPO (Schulman et al. 2017, decoupled as in Hilton et al. 2021): a forward over `T + 1`
//!   rows under the parameters before the update gives the proximal log-probabilities and
//!   values, GAE (Schulman et al. 2016) gives advantages and returns, the behaviour weights
//!   `min(π_prox/μ, clip)` correct for lag; then `ppo_epochs` epochs of `ppo_minibatches`
//!   minibatches of whole columns (sequences), shuffled by the learner's seeded generator,
//!   each a forward over `T` rows, the fused loss, a backward and an optimiser step.

use std::ops::Range;

use rand::seq::SliceRandom;
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{HyperParams, LossKind};
use volley_core::wire::Observations;
use volley_policy::returns::VTraceConfig;
use volley_policy::{ActionHead, ParamLayout};

use crate::backend::{
    pack_byte_rows, packed_words, Backend, BackendError, BehaviourWeights, ClipAdamStep, CpuBackend, CudaBackend,
    Evaluation, GaeScan, GatherColumns, Head, LogProbs, OffPolicyViews, PpoLoss, PpoLossInputs, PpoLossOutputs,
    VTraceLoss, VTraceLossInputs, VTraceLossOutputs, View, ViewMut,
};
use crate::batch::{SegmentBatch, StateRestore};
use crate::losses::{LossStats, PpoLossConfig, VTraceLossConfig};
use crate::net::{ensure, Input, Network, Restores};
use crate::optim::{AdamConfig, AdamState};
use crate::telemetry::{OffPolicyStats, OffPolicySums, NO_RATIO};

/// Host copies of everything a checkpoint needs.
#[derive(Debug, Clone, PartialEq)]
pub struct HostState {
    /// The flat parameters.
    pub params: Vec<f32>,
    /// Adam's moments and step count.
    pub adam: AdamState,
}

/// What one update measured, before the learner adds its bookkeeping.
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    /// Loss statistics, averaged over the applied gradient steps.
    pub loss: LossStats,
    /// Mean pre-clip gradient norm of the applied steps (NaN when none was applied).
    pub grad_norm: f32,
    /// Gradient steps skipped because the gradient was not finite.
    pub skipped_steps: u32,
    /// Off-policy health of the batch (on every backend; `None` only before the first update).
    pub off_policy: Option<OffPolicyStats>,
}

/// Where each field of a staged batch sits in its one buffer.
#[derive(Debug, Clone, Default, PartialEq)]
struct StagedLayout {
    observations: Range<usize>,
    episode_start: Range<usize>,
    initial_hidden: Range<usize>,
    restore_states: Range<usize>,
    actions: Range<usize>,
    behaviour_log_probs: Range<usize>,
    rewards: Range<usize>,
    discounts: Range<usize>,
    sample_weights: Range<usize>,
    /// Group advantages (`[T][B]`), or empty when the batch has none.
    advantage_override: Range<usize>,
    len: usize,
}

impl StagedLayout {
    /// `obs_words` words per observation row (`obs_dim`, or [`packed_words`] of it for bytes);
    /// `action_width` words per action: 1 for a discrete index, `A` for a continuous action;
    /// `advantages`: room for the group advantages; `n_restores` restored recurrent states.
    #[allow(clippy::too_many_arguments)]
    fn new(
        t_len: usize,
        b_len: usize,
        obs_words: usize,
        hidden: usize,
        action_width: usize,
        advantages: bool,
        n_restores: usize,
    ) -> Self {
        let steps = t_len * b_len;
        let mut end = 0;
        let mut take = |n: usize| {
            let range = end..end + n;
            end += n;
            range
        };
        StagedLayout {
            observations: take((t_len + 1) * b_len * obs_words),
            episode_start: take((t_len + 1) * b_len),
            initial_hidden: take(b_len * hidden),
            restore_states: take(n_restores * hidden),
            actions: take(steps * action_width),
            behaviour_log_probs: take(steps),
            rewards: take(steps),
            discounts: take(steps),
            sample_weights: take(steps),
            advantage_override: take(if advantages { steps } else { 0 }),
            len: end,
        }
    }
}

impl StagedLayout {
    /// The staged group advantages, when the batch has them.
    fn advantage_override_view<'a, B: Backend>(&self, staged: &'a B::Floats) -> Option<View<'a, B>> {
        (!self.advantage_override.is_empty()).then(|| View::range(staged, self.advantage_override.clone()))
    }
}

/// The `[T][B]` intermediates of the loss, each sized to the batch.
struct LossBuffers<B: Backend> {
    log_rhos: B::Floats,
    /// Each sample's importance ratio, for the off-policy histogram.
    ratios: B::Floats,
    vs: B::Floats,
    pg_advantages: B::Floats,
    prox_log_probs: B::Floats,
    is_weights: B::Floats,
    advantages: B::Floats,
    returns: B::Floats,
    d_heads: B::Floats,
    /// The head parameters' per-sample gradient, `[n][n_params]`.
    d_head_params: B::Floats,
}

/// One PPO minibatch, gathered column by column on the device.
struct Minibatch<B: Backend> {
    observations: B::Floats,
    episode_start: B::Floats,
    initial_hidden: B::Floats,
    actions: B::Floats,
    sample_weights: B::Floats,
    advantages: B::Floats,
    returns: B::Floats,
    prox_log_probs: B::Floats,
    is_weights: B::Floats,
}

/// The learner's state and update on one backend (see the module documentation).
pub struct Trainer<B: Backend> {
    backend: B,
    net: Network<B>,
    n_params: usize,
    params: B::Floats,
    grads: B::Floats,
    adam_m: B::Floats,
    adam_v: B::Floats,
    adam_step: B::StepCount,
    adam_config: AdamConfig,
    staged: B::Floats,
    staged_layout: StagedLayout,
    /// The staged batch's restored recurrent states (rows of `staged_layout.restore_states`).
    restores: Vec<StateRestore>,
    /// The restores of the current PPO minibatch, in its column numbering.
    minibatch_restores: Vec<StateRestore>,
    loss: LossBuffers<B>,
    minibatch: Minibatch<B>,
    /// PPO's column permutations, one per epoch, on the device (after the first PPO update).
    permutations: Option<B::Indices>,
    // Host scratch.
    columns: Vec<usize>,
    host_permutations: Vec<u32>,
    evaluations: Vec<Evaluation>,
    host_ratios: Vec<f32>,
    /// The policy head's kind.
    head_kind: ActionHead,
    /// Where the head's own parameters sit (`policy.log_std`; empty for a categorical head).
    head_params: Range<usize>,
    /// Floats per staged action ([`ActionHead::action_width`]).
    action_width: usize,
    /// Observation normalisation (`normalize_obs`): where the statistics sit in the parameters,
    /// and the host copy this trainer updates and uploads there before every update.
    obs_norm: Option<(Range<usize>, Vec<f32>)>,
    /// The factor observations are scaled by ([`ParamLayout::input_scale`]): when staged for
    /// `f32` observations, in the first layer for bytes.
    input_scale: f32,
    /// Whether the staged batch's observations are bytes packed four to a word (image
    /// observations without normalisation), which the network's first layer converts.
    staged_bytes: bool,
    /// Host scratch: byte observations widened, where normalisation needs `f32` values.
    host_widened: Vec<f32>,
}

/// `bytes` widened to `f32` in `scratch` (resized to fit), for normalisation's statistics and
/// inputs, which are `f32`.
fn widen<'a>(bytes: &[u8], scratch: &'a mut Vec<f32>) -> &'a [f32] {
    scratch.clear();
    scratch.extend(bytes.iter().map(|&byte| f32::from(byte)));
    scratch
}

impl<B: Backend> Trainer<B> {
    /// Move `state` (parameters and Adam state laid out by `layout`) onto `backend`.
    ///
    /// # Panics
    /// If `state` does not match the layout's size (the learner checks it first).
    pub fn new(
        mut backend: B,
        layout: &ParamLayout,
        state: &HostState,
        adam_config: AdamConfig,
    ) -> Result<Self, BackendError> {
        let n = layout.n_params();
        assert!(
            state.params.len() == n && state.adam.m.len() == n && state.adam.v.len() == n,
            "the state matches the layout"
        );
        let upload = |backend: &mut B, host: &[f32]| -> Result<B::Floats, BackendError> {
            let mut buffer = backend.alloc(host.len())?;
            backend.upload(host, ViewMut::of(&mut buffer))?;
            Ok(buffer)
        };
        let params = upload(&mut backend, &state.params)?;
        let adam_m = upload(&mut backend, &state.adam.m)?;
        let adam_v = upload(&mut backend, &state.adam.v)?;
        let grads = backend.alloc(n)?;
        let adam_step = backend.step_count(state.adam.t)?;
        let net = Network::new(&mut backend, layout)?;
        let mut empty = || backend.alloc(0);
        let loss = LossBuffers {
            log_rhos: empty()?,
            ratios: empty()?,
            vs: empty()?,
            pg_advantages: empty()?,
            prox_log_probs: empty()?,
            is_weights: empty()?,
            advantages: empty()?,
            returns: empty()?,
            d_heads: empty()?,
            d_head_params: empty()?,
        };
        let minibatch = Minibatch {
            observations: empty()?,
            episode_start: empty()?,
            initial_hidden: empty()?,
            actions: empty()?,
            sample_weights: empty()?,
            advantages: empty()?,
            returns: empty()?,
            prox_log_probs: empty()?,
            is_weights: empty()?,
        };
        let staged = empty()?;
        Ok(Trainer {
            backend,
            net,
            n_params: n,
            params,
            grads,
            adam_m,
            adam_v,
            adam_step,
            adam_config,
            staged,
            staged_layout: StagedLayout::default(),
            restores: Vec::new(),
            minibatch_restores: Vec::new(),
            loss,
            minibatch,
            permutations: None,
            columns: Vec::new(),
            host_permutations: Vec::new(),
            evaluations: Vec::new(),
            host_ratios: Vec::new(),
            obs_norm: layout.obs_norm_range().map(|range| (range.clone(), state.params[range].to_vec())),
            input_scale: layout.input_scale(),
            staged_bytes: false,
            host_widened: Vec::new(),
            head_kind: layout.head(),
            head_params: layout.log_std_range().unwrap_or(0..0),
            action_width: layout.head().action_width(layout.spec().n_actions),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (for profiling hooks).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Copy the parameters to `out` (`n_params` long).
    pub fn download_params(&mut self, out: &mut [f32]) -> Result<(), BackendError> {
        self.backend.download(View::of(&self.params), out)
    }

    /// Copy parameters and optimiser state to the host.
    pub fn download_state(&mut self) -> Result<HostState, BackendError> {
        let n = self.n_params;
        let (mut params, mut m, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        self.backend.download(View::of(&self.params), &mut params)?;
        self.backend.download(View::of(&self.adam_m), &mut m)?;
        self.backend.download(View::of(&self.adam_v), &mut v)?;
        let t = self.backend.read_step_count(&self.adam_step)?;
        Ok(HostState { params, adam: AdamState { m, v, t } })
    }

    /// Pack `batch` into one buffer on the backend.
    ///
    /// Image observations (bytes) are staged as bytes, four to a word, and converted by the
    /// network's first layer; with normalisation on they are widened here and normalised like
    /// `f32` observations (normalised values are not bytes). The choice is made once per batch.
    fn stage(&mut self, batch: &SegmentBatch) -> Result<(), BackendError> {
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        let (obs_dim, hidden, n_actions) = (self.net.obs_dim(), self.net.hidden(), self.net.n_actions());
        let action_width = self.action_width;
        let with_override = !batch.advantage_override.is_empty();
        let n_restores = batch.restores.len();
        let bytes = batch.observations.as_u8().filter(|_| self.obs_norm.is_none());
        let obs_words = if bytes.is_some() { packed_words(obs_dim) } else { obs_dim };
        let layout = StagedLayout::new(t_len, b_len, obs_words, hidden, action_width, with_override, n_restores);
        let steps = t_len * b_len;
        // A head's actions arrive as indices or as values, never both.
        let (discrete_len, continuous_len) =
            if self.head_kind.is_continuous() { (0, steps * n_actions) } else { (steps, 0) };
        let shapes = [
            ("observations", batch.observations.len(), (t_len + 1) * b_len * obs_dim),
            ("episode_start", batch.episode_start.len(), (t_len + 1) * b_len),
            ("initial_hidden", batch.initial_hidden.len(), b_len * hidden),
            ("restore_states", batch.restore_states.len(), n_restores * hidden),
            ("actions", batch.actions.len(), discrete_len),
            ("continuous_actions", batch.continuous_actions.len(), continuous_len),
            ("behaviour_log_probs", batch.behaviour_log_probs.len(), steps),
            ("rewards", batch.rewards.len(), steps),
            ("discounts", batch.discounts.len(), steps),
            ("sample_weights", batch.sample_weights.len(), steps),
            ("advantage_override", batch.advantage_override.len(), if with_override { steps } else { 0 }),
        ];
        for (operand, got, expected) in shapes {
            crate::backend::check_len("stage", operand, expected, got)?;
        }
        if let Some(index) = batch.continuous_actions.iter().position(|a| !a.is_finite()) {
            // Decode refuses these; a batch built another way must not reach the loss.
            return Err(BackendError::Shape {
                op: "stage",
                operand: "continuous_actions (non-finite value at the index in `got`)",
                expected: 0,
                got: index,
            });
        }
        if let Some(&action) = batch.actions.iter().find(|&&a| a as usize >= n_actions) {
            return Err(BackendError::Shape {
                op: "stage",
                operand: "action",
                expected: n_actions,
                got: action as usize,
            });
        }
        let obs_stats = self.obs_norm.as_ref().map(|(_, stats)| stats.as_slice());
        let input_scale = self.input_scale;
        let floats: &[f32] = match (&batch.observations, bytes) {
            (Observations::F32(values), _) => values,
            (Observations::U8(_), Some(_)) => &[],
            (Observations::U8(values), None) => widen(values, &mut self.host_widened),
        };
        let mut pack = |words: &mut [f32]| {
            match (bytes, obs_stats) {
                (Some(bytes), _) => pack_byte_rows(bytes, obs_dim, &mut words[layout.observations.clone()]),
                (None, Some(stats)) => {
                    volley_policy::obs_norm::normalize(stats, floats, &mut words[layout.observations.clone()])
                }
                // Pixels become [0, 1] here, inside the network (conv `input = pixels`).
                (None, None) if input_scale != 1.0 => {
                    for (word, &value) in words[layout.observations.clone()].iter_mut().zip(floats) {
                        *word = value * input_scale;
                    }
                }
                (None, None) => words[layout.observations.clone()].copy_from_slice(floats),
            }
            words[layout.episode_start.clone()].copy_from_slice(&batch.episode_start);
            words[layout.initial_hidden.clone()].copy_from_slice(&batch.initial_hidden);
            words[layout.restore_states.clone()].copy_from_slice(&batch.restore_states);
            // One of the two is empty (checked above): values are staged as they are, indices
            // as their bit patterns (`volley_policy::head`).
            let actions = &mut words[layout.actions.clone()];
            actions[..batch.continuous_actions.len()].copy_from_slice(&batch.continuous_actions);
            for (word, &action) in actions.iter_mut().zip(&batch.actions) {
                *word = f32::from_bits(action);
            }
            words[layout.behaviour_log_probs.clone()].copy_from_slice(&batch.behaviour_log_probs);
            words[layout.rewards.clone()].copy_from_slice(&batch.rewards);
            words[layout.discounts.clone()].copy_from_slice(&batch.discounts);
            words[layout.sample_weights.clone()].copy_from_slice(&batch.sample_weights);
            words[layout.advantage_override.clone()].copy_from_slice(&batch.advantage_override);
        };
        self.backend.upload_packed(layout.len, &mut pack, &mut self.staged)?;
        self.staged_layout = layout;
        self.staged_bytes = bytes.is_some();
        self.restores.clear();
        self.restores.extend_from_slice(&batch.restores);
        Ok(())
    }

    /// One update from `batch` with `learning_rate`; `rng` shuffles PPO's minibatch columns.
    pub fn train_step(
        &mut self,
        batch: &SegmentBatch,
        hyper: &HyperParams,
        learning_rate: f32,
        rng: &mut Pcg64Mcg,
    ) -> Result<StepOutcome, BackendError> {
        // Observation statistics move with the data before the update, and the new ones go
        // into the parameters, so the version this update publishes carries them.
        if let Some((range, stats)) = &mut self.obs_norm {
            let observations = match &batch.observations {
                Observations::F32(values) => values,
                Observations::U8(bytes) => widen(bytes, &mut self.host_widened),
            };
            volley_policy::obs_norm::update(stats, observations);
            self.backend.upload(stats, ViewMut::range(&mut self.params, range.clone()))?;
        }
        self.stage(batch)?;
        match hyper.loss {
            LossKind::Vtrace => self.vtrace_step(batch.t_len, batch.b_len, hyper, learning_rate)?,
            LossKind::Ppo => self.ppo_step(batch.t_len, batch.b_len, hyper, learning_rate, rng)?,
        };
        let mut off_policy = OffPolicySums::default();
        self.backend.read_evaluations(&mut self.evaluations, &mut off_policy)?;
        let n = batch.t_len * batch.b_len;
        self.host_ratios.resize(n, 0.0);
        self.backend.download(View::range(&self.loss.ratios, 0..n), &mut self.host_ratios)?;
        let off_policy = off_policy.finish(self.host_ratios.iter().copied().filter(|&r| r != NO_RATIO).collect());
        // Statistics of applied steps only; a skipped step's loss is not finite anyway.
        let mut total = LossStats::default();
        let (mut norm_sum, mut applied, mut skipped) = (0.0f32, 0u32, 0u32);
        for evaluation in &self.evaluations {
            if !evaluation.grad_norm.is_finite() {
                skipped += 1;
                continue;
            }
            applied += 1;
            norm_sum += evaluation.grad_norm;
            total.accumulate(&evaluation.sums.stats(evaluation.weight_sum, hyper.value_coef, hyper.ent_coef));
        }
        Ok(StepOutcome {
            loss: total.mean(),
            grad_norm: if applied > 0 { norm_sum / applied as f32 } else { f32::NAN },
            skipped_steps: skipped,
            off_policy: Some(off_policy),
        })
    }

    /// Clip and take an Adam step on the gradient of evaluation `slot`.
    fn apply_gradients(&mut self, hyper: &HyperParams, learning_rate: f32, slot: usize) -> Result<(), BackendError> {
        self.backend.clip_adam_step(ClipAdamStep {
            params: ViewMut::of(&mut self.params),
            grads: ViewMut::of(&mut self.grads),
            adam_m: ViewMut::of(&mut self.adam_m),
            adam_v: ViewMut::of(&mut self.adam_v),
            step: &mut self.adam_step,
            config: &self.adam_config,
            learning_rate,
            max_grad_norm: hyper.max_grad_norm,
            slot,
        })
    }

    /// The network's view of observations staged (or gathered) in `buffer`'s `range`.
    fn obs_input<'a>(&self, buffer: &'a B::Floats, range: Range<usize>) -> Input<'a, B> {
        let view = View::range(buffer, range);
        if self.staged_bytes {
            Input::U8 { packed: view, scale: self.input_scale }
        } else {
            Input::F32(view)
        }
    }

    /// Words per staged observation row.
    fn obs_words(&self) -> usize {
        if self.staged_bytes {
            packed_words(self.net.obs_dim())
        } else {
            self.net.obs_dim()
        }
    }

    /// The forward over the staged batch's `T + 1` rows.
    fn forward_batch(&mut self, t_len: usize, b_len: usize) -> Result<(), BackendError> {
        let s = &self.staged_layout;
        let obs = self.obs_input(&self.staged, s.observations.clone());
        let restores = Restores { steps: &self.restores, states: View::range(&self.staged, s.restore_states.clone()) };
        self.net.forward(
            &mut self.backend,
            &self.params,
            obs,
            View::range(&self.staged, s.episode_start.clone()),
            View::range(&self.staged, s.initial_hidden.clone()),
            Some(restores),
            t_len + 1,
            b_len,
        )
    }

    fn vtrace_step(
        &mut self,
        t_len: usize,
        b_len: usize,
        h: &HyperParams,
        learning_rate: f32,
    ) -> Result<(), BackendError> {
        let n = t_len * b_len;
        let stride = self.net.n_actions() + 1;
        self.backend.begin_evaluations(1)?;
        self.forward_batch(t_len, b_len)?;
        let loss = &mut self.loss;
        for buffer in [&mut loss.log_rhos, &mut loss.ratios, &mut loss.vs, &mut loss.pg_advantages] {
            ensure(&mut self.backend, buffer, n)?;
        }
        ensure(&mut self.backend, &mut loss.d_heads, (n + b_len) * stride)?;
        let n_head_params = self.head_params.len();
        ensure(&mut self.backend, &mut loss.d_head_params, n * n_head_params)?;
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
        let s = &self.staged_layout;
        let staged = |range: &Range<usize>| View::range(&self.staged, range.clone());
        let inputs = VTraceLossInputs {
            t_len,
            b_len,
            n_actions: self.net.n_actions(),
            head: Head { kind: self.head_kind, params: View::range(&self.params, self.head_params.clone()) },
            heads: self.net.heads(),
            values: self.net.values(),
            actions: staged(&s.actions),
            behaviour_log_probs: staged(&s.behaviour_log_probs),
            rewards: staged(&s.rewards),
            discounts: staged(&s.discounts),
            sample_weights: staged(&s.sample_weights),
            advantage_override: s.advantage_override_view(&self.staged),
        };
        let outputs = VTraceLossOutputs {
            log_rhos: ViewMut::range(&mut loss.log_rhos, 0..n),
            vs: ViewMut::range(&mut loss.vs, 0..n),
            pg_advantages: ViewMut::range(&mut loss.pg_advantages, 0..n),
            d_heads: ViewMut::range(&mut loss.d_heads, 0..(n + b_len) * stride),
            d_head_params: ViewMut::range(&mut loss.d_head_params, 0..n * n_head_params),
        };
        let (weights, values) = (inputs.sample_weights, inputs.values.slice(0..n));
        self.backend.vtrace_loss(VTraceLoss { inputs, config: &config, outputs, slot: 0 })?;
        let off_policy = OffPolicyViews {
            log_rhos: View::range(&loss.log_rhos, 0..n),
            reference: None,
            weights,
            values,
            value_targets: View::range(&loss.vs, 0..n),
            rho_bar: h.clip_rho_threshold,
            c_bar: h.clip_c_threshold,
        };
        self.backend.off_policy_sums(&off_policy, ViewMut::range(&mut loss.ratios, 0..n))?;
        let obs = self.obs_input(&self.staged, s.observations.clone());
        self.net.backward(
            &mut self.backend,
            &self.params,
            View::range(&self.loss.d_heads, 0..(n + b_len) * stride),
            obs,
            View::range(&self.staged, s.episode_start.clone()),
            &mut self.grads,
        )?;
        self.head_params_gradient(n)?;
        self.apply_gradients(h, learning_rate, 0)
    }

    /// The head parameters' gradient (a Gaussian head's log-std): the sum over the `n`
    /// samples' rows of `loss.d_head_params` (the network's backward does not touch those
    /// entries). Nothing for a head without parameters.
    fn head_params_gradient(&mut self, n: usize) -> Result<(), BackendError> {
        let params = self.head_params.clone();
        if params.is_empty() {
            return Ok(());
        }
        let rows = View::range(&self.loss.d_head_params, 0..n * params.len());
        self.backend.column_sums(rows, n, ViewMut::range(&mut self.grads, params))
    }

    /// The value pass shared by PPO and trajectory selection: the forward over the staged
    /// batch under the current parameters, then GAE(γ, λ) advantages and returns against its
    /// values, `[T][B]`.
    fn value_pass(&mut self, t_len: usize, b_len: usize, gae_lambda: f32) -> Result<(), BackendError> {
        let n = t_len * b_len;
        self.forward_batch(t_len, b_len)?;
        let loss = &mut self.loss;
        for buffer in [&mut loss.prox_log_probs, &mut loss.is_weights, &mut loss.advantages, &mut loss.returns] {
            ensure(&mut self.backend, buffer, n)?;
        }
        let s = &self.staged_layout;
        let staged = |range: &Range<usize>| View::range(&self.staged, range.clone());
        let values = self.net.values();
        self.backend.gae_scan(GaeScan {
            t_len,
            b_len,
            discounts: staged(&s.discounts),
            rewards: staged(&s.rewards),
            values: values.slice(0..n),
            bootstrap_value: values.slice(n..n + b_len),
            lambda_: gae_lambda,
            advantage_override: s.advantage_override_view(&self.staged),
            advantages: ViewMut::range(&mut loss.advantages, 0..n),
            returns: ViewMut::range(&mut loss.returns, 0..n),
        })
    }

    fn ppo_step(
        &mut self,
        t_len: usize,
        b_len: usize,
        h: &HyperParams,
        learning_rate: f32,
        rng: &mut Pcg64Mcg,
    ) -> Result<(), BackendError> {
        let n = t_len * b_len;
        let (n_actions, obs_words, hidden) = (self.net.n_actions(), self.obs_words(), self.net.hidden());
        let stride = n_actions + 1;
        // 1. The value baseline under the parameters before this update, and GAE advantages
        // against it (Schulman et al. 2016).
        self.value_pass(t_len, b_len, h.gae_lambda)?;
        // 2. The proximal policy: log π_prox of the taken actions, from the same forward.
        let s = self.staged_layout.clone();
        self.backend.log_probs(LogProbs {
            heads: self.net.heads().slice(0..n * stride),
            n_actions,
            head: Head { kind: self.head_kind, params: View::range(&self.params, self.head_params.clone()) },
            actions: View::range(&self.staged, s.actions.clone()),
            reference: None,
            out: ViewMut::range(&mut self.loss.prox_log_probs, 0..n),
        })?;
        let action_width = self.action_width;
        // 3. Behaviour importance weights min(π_prox/μ, clip) (Hilton et al. 2021).
        self.backend.behaviour_weights(BehaviourWeights {
            prox_log_probs: View::range(&self.loss.prox_log_probs, 0..n),
            behaviour_log_probs: View::range(&self.staged, s.behaviour_log_probs.clone()),
            clip: h.behaviour_is_clip,
            out: ViewMut::range(&mut self.loss.is_weights, 0..n),
        })?;

        // 4. Epochs of minibatch gradient steps over whole sequences (columns).
        let n_minibatches = (h.ppo_minibatches as usize).clamp(1, b_len.max(1));
        let epochs = h.ppo_epochs as usize;
        self.columns.clear();
        self.columns.extend(0..b_len);
        self.host_permutations.clear();
        for _ in 0..epochs {
            self.columns.shuffle(rng);
            self.host_permutations.extend(self.columns.iter().map(|&c| c as u32));
        }
        self.backend.begin_evaluations(epochs * n_minibatches)?;
        self.ppo_off_policy(n, h, &s)?;
        if self.host_permutations.is_empty() {
            return Ok(());
        }
        self.backend.upload_indices(&self.host_permutations, &mut self.permutations)?;
        let max_mb_len =
            (0..n_minibatches).map(|mb| (mb + 1) * b_len / n_minibatches - mb * b_len / n_minibatches).max();
        let max_m = t_len * max_mb_len.unwrap_or(0);
        let mb = &mut self.minibatch;
        ensure(&mut self.backend, &mut mb.observations, max_m * obs_words)?;
        ensure(&mut self.backend, &mut mb.initial_hidden, max_mb_len.unwrap_or(0) * hidden)?;
        ensure(&mut self.backend, &mut mb.actions, max_m * action_width)?;
        for buffer in [
            &mut mb.episode_start,
            &mut mb.sample_weights,
            &mut mb.advantages,
            &mut mb.returns,
            &mut mb.prox_log_probs,
            &mut mb.is_weights,
        ] {
            ensure(&mut self.backend, buffer, max_m)?;
        }
        ensure(&mut self.backend, &mut self.loss.d_heads, max_m * stride)?;
        let n_head_params = self.head_params.len();
        ensure(&mut self.backend, &mut self.loss.d_head_params, max_m * n_head_params)?;
        let config = PpoLossConfig {
            clip_coef: h.clip_coef,
            value_coef: h.value_coef,
            ent_coef: h.ent_coef,
            normalize_advantages: h.normalize_advantages,
        };
        let mut slot = 0;
        for epoch in 0..epochs {
            for minibatch_idx in 0..n_minibatches {
                let lo = minibatch_idx * b_len / n_minibatches;
                let hi = (minibatch_idx + 1) * b_len / n_minibatches;
                let (mb_len, m) = (hi - lo, t_len * (hi - lo));
                self.gather_minibatch(t_len, b_len, epoch * b_len + lo, mb_len)?;
                let mb = &self.minibatch;
                let obs = self.obs_input(&mb.observations, 0..m * obs_words);
                let starts = View::range(&mb.episode_start, 0..m);
                let restore_states = View::range(&self.staged, self.staged_layout.restore_states.clone());
                self.net.forward(
                    &mut self.backend,
                    &self.params,
                    obs,
                    starts,
                    View::range(&mb.initial_hidden, 0..mb_len * hidden),
                    Some(Restores { steps: &self.minibatch_restores, states: restore_states }),
                    t_len,
                    mb_len,
                )?;
                let inputs = PpoLossInputs {
                    n_samples: m,
                    n_actions,
                    head: Head { kind: self.head_kind, params: View::range(&self.params, self.head_params.clone()) },
                    heads: self.net.heads(),
                    values: self.net.values(),
                    actions: View::range(&mb.actions, 0..m * action_width),
                    sample_weights: View::range(&mb.sample_weights, 0..m),
                    advantages: View::range(&mb.advantages, 0..m),
                    returns: View::range(&mb.returns, 0..m),
                    prox_log_probs: View::range(&mb.prox_log_probs, 0..m),
                    is_weights: View::range(&mb.is_weights, 0..m),
                };
                let outputs = PpoLossOutputs {
                    d_heads: ViewMut::range(&mut self.loss.d_heads, 0..m * stride),
                    d_head_params: ViewMut::range(&mut self.loss.d_head_params, 0..m * n_head_params),
                };
                self.backend.ppo_loss(PpoLoss { inputs, config: &config, outputs, slot })?;
                self.net.backward(
                    &mut self.backend,
                    &self.params,
                    View::range(&self.loss.d_heads, 0..m * stride),
                    obs,
                    starts,
                    &mut self.grads,
                )?;
                self.head_params_gradient(m)?;
                self.apply_gradients(h, learning_rate, slot)?;
                slot += 1;
            }
        }
        Ok(())
    }

    /// PPO's off-policy statistics: the proximal policy (the parameters before the update)
    /// against the behaviour's (the proximal log-probabilities the value pass wrote, less the
    /// behaviour's, per sample), weighted by the samples' weights, with GAE's returns as the
    /// value targets and the behaviour IS clip as both `ρ̄` and `c̄` (PPO has no traces).
    fn ppo_off_policy(&mut self, n: usize, h: &HyperParams, s: &StagedLayout) -> Result<(), BackendError> {
        let loss = &mut self.loss;
        ensure(&mut self.backend, &mut loss.ratios, n)?;
        let inputs = OffPolicyViews {
            log_rhos: View::range(&loss.prox_log_probs, 0..n),
            reference: Some(View::range(&self.staged, s.behaviour_log_probs.clone())),
            weights: View::range(&self.staged, s.sample_weights.clone()),
            values: self.net.values().slice(0..n),
            value_targets: View::range(&loss.returns, 0..n),
            rho_bar: h.behaviour_is_clip,
            c_bar: h.behaviour_is_clip,
        };
        self.backend.off_policy_sums(&inputs, ViewMut::range(&mut loss.ratios, 0..n))
    }

    /// Gather the columns `permutations[offset..offset + mb_len]` of every per-sample field into
    /// the minibatch buffers.
    fn gather_minibatch(
        &mut self,
        t_len: usize,
        b_len: usize,
        offset: usize,
        mb_len: usize,
    ) -> Result<(), BackendError> {
        let (obs_words, hidden) = (self.obs_words(), self.net.hidden());
        let action_width = self.action_width;
        let n = t_len * b_len;
        let m = t_len * mb_len;
        // The minibatch's restores, renumbered to its columns; their states stay where the
        // batch staged them.
        self.minibatch_restores.clear();
        let columns = &self.host_permutations[offset..offset + mb_len];
        for restore in &self.restores {
            if let Some(j) = columns.iter().position(|&c| c as usize == restore.b) {
                self.minibatch_restores.push(StateRestore { b: j, ..*restore });
            }
        }
        let s = &self.staged_layout;
        let staged = &self.staged;
        let mb = &mut self.minibatch;
        let backend = &mut self.backend;
        let Some(columns) = &self.permutations else {
            return Err(BackendError::Shape {
                op: "gather_minibatch",
                operand: "permutations",
                expected: offset + mb_len,
                got: 0,
            });
        };
        // The bootstrap row is not needed: targets are already computed.
        let fields: [(View<'_, B>, usize, usize, &mut B::Floats); 9] = [
            (
                View::range(staged, s.observations.start..s.observations.start + n * obs_words),
                t_len,
                obs_words,
                &mut mb.observations,
            ),
            (View::range(staged, s.episode_start.start..s.episode_start.start + n), t_len, 1, &mut mb.episode_start),
            (View::range(staged, s.initial_hidden.clone()), 1, hidden, &mut mb.initial_hidden),
            (View::range(staged, s.actions.clone()), t_len, action_width, &mut mb.actions),
            (View::range(staged, s.sample_weights.clone()), t_len, 1, &mut mb.sample_weights),
            (View::range(&self.loss.advantages, 0..n), t_len, 1, &mut mb.advantages),
            (View::range(&self.loss.returns, 0..n), t_len, 1, &mut mb.returns),
            (View::range(&self.loss.prox_log_probs, 0..n), t_len, 1, &mut mb.prox_log_probs),
            (View::range(&self.loss.is_weights, 0..n), t_len, 1, &mut mb.is_weights),
        ];
        for (src, rows, width, dst) in fields {
            if width == 0 {
                continue;
            }
            let len = rows * mb_len * width;
            debug_assert!(rows == 1 || len == m * width);
            let dst = ViewMut::range(dst, 0..len);
            let (columns_offset, n_columns) = (offset, mb_len);
            backend.gather_columns(GatherColumns {
                src,
                rows,
                b_len,
                width,
                columns,
                columns_offset,
                n_columns,
                dst,
            })?;
        }
        Ok(())
    }

    /// Values and GAE(γ, `gae_lambda`) advantages of `batch` under the current parameters, from
    /// the backend's forward pass (trajectory selection's priorities; no weights leave the
    /// device).
    pub fn values_and_advantages(
        &mut self,
        batch: &SegmentBatch,
        gae_lambda: f32,
        out: &mut ValueEstimates,
    ) -> Result<(), BackendError> {
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        let n = t_len * b_len;
        self.stage(batch)?;
        self.value_pass(t_len, b_len, gae_lambda)?;
        out.values.resize(n + b_len, 0.0);
        out.advantages.resize(n, 0.0);
        self.backend.download(self.net.values(), &mut out.values)?;
        self.backend.download(View::range(&self.loss.advantages, 0..n), &mut out.advantages)
    }
}

/// Values `[T+1][B]` and GAE advantages `[T][B]` of a batch under the learner's current
/// parameters ([`Trainer::values_and_advantages`]), in buffers kept across calls.
#[derive(Debug, Clone, Default)]
pub struct ValueEstimates {
    /// `V(x_t)` for the `T` steps and the state after the last, `[T+1][B]`.
    pub values: Vec<f32>,
    /// The GAE advantages, `[T][B]`.
    pub advantages: Vec<f32>,
}

/// The trainer on whichever backend the learner runs: the one place the backend is matched.
#[allow(clippy::large_enum_variant)]
pub enum AnyTrainer {
    /// The CPU backend.
    Cpu(Trainer<CpuBackend>),
    /// The CUDA backend.
    Cuda(Trainer<CudaBackend>),
}

/// Run `$body` with `$trainer` bound to the concrete trainer inside `$any`: the learner's
/// calls into the trainer ([`Trainer::train_step`], [`Trainer::values_and_advantages`]) match
/// through it, once per call.
macro_rules! with_trainer {
    ($any:expr, $trainer:ident => $body:expr) => {
        match $any {
            $crate::train::AnyTrainer::Cpu($trainer) => $body,
            $crate::train::AnyTrainer::Cuda($trainer) => $body,
        }
    };
}
pub(crate) use with_trainer;

impl AnyTrainer {
    /// `cpu` or `cuda: <device>`.
    pub fn description(&self) -> String {
        with_trainer!(self, trainer => trainer.backend().description())
    }

    /// Whether this is the CPU backend (whose buffers are host memory).
    pub fn is_cpu(&self) -> bool {
        matches!(self, AnyTrainer::Cpu(_))
    }

    /// See [`Trainer::download_params`].
    pub fn download_params(&mut self, out: &mut [f32]) -> Result<(), BackendError> {
        with_trainer!(self, trainer => trainer.download_params(out))
    }

    /// See [`Trainer::download_state`].
    pub fn download_state(&mut self) -> Result<HostState, BackendError> {
        with_trainer!(self, trainer => trainer.download_state())
    }
}
