//! The run spec: everything an actor needs to join a run, and the hyper-parameters the learner
//! uses, in one serializable value (written to a KV bucket by the learner in distributed runs).

use crate::env::{EnvConfig, EnvError};
use crate::ids::RunId;
use crate::policy::{ParamLayout, PolicyError, PolicySpec};

/// Which loss the learner optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// IMPALA V-trace actor-critic (Espeholt et al. 2018).
    Vtrace,
    /// PPO-clip with behaviour-policy importance weights (Schulman et al. 2017; Hilton et al. 2021).
    Ppo,
}

impl std::str::FromStr for LossKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vtrace" => Ok(LossKind::Vtrace),
            "ppo" => Ok(LossKind::Ppo),
            other => Err(format!("unknown loss {other:?} (expected vtrace or ppo)")),
        }
    }
}

/// Learner hyper-parameters, named as in the papers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HyperParams {
    /// The loss.
    pub loss: LossKind,
    /// Discount factor γ.
    pub gamma: f32,
    /// Rewards are multiplied by this before the return estimators see them, so value targets
    /// stay of order one for a network whose torso the policy and value heads share.
    pub reward_scale: f32,
    /// Adam learning rate at the first update.
    pub learning_rate: f32,
    /// Learning rate at `lr_decay_updates` (linear decay; equal to `learning_rate` for constant).
    pub final_learning_rate: f32,
    /// Number of updates over which the learning rate decays linearly.
    pub lr_decay_updates: u64,
    /// Adam β1.
    pub adam_beta1: f32,
    /// Adam β2.
    pub adam_beta2: f32,
    /// Adam ε.
    pub adam_eps: f32,
    /// Global gradient-norm clip.
    pub max_grad_norm: f32,
    /// Entropy bonus coefficient.
    pub ent_coef: f32,
    /// Value-loss coefficient.
    pub value_coef: f32,
    /// V-trace ρ̄ for value targets.
    pub clip_rho_threshold: f32,
    /// V-trace ρ̄ for policy-gradient advantages.
    pub clip_pg_rho_threshold: f32,
    /// V-trace c̄.
    pub clip_c_threshold: f32,
    /// V-trace λ.
    pub vtrace_lambda: f32,
    /// GAE λ (PPO).
    pub gae_lambda: f32,
    /// PPO clip ε.
    pub clip_coef: f32,
    /// PPO: truncation of the behaviour importance weight π_prox/μ.
    pub behaviour_is_clip: f32,
    /// PPO epochs over each batch.
    pub ppo_epochs: u32,
    /// PPO minibatches per epoch (split over batch columns, so recurrent sequences stay whole).
    pub ppo_minibatches: u32,
    /// PPO: normalise advantages per minibatch.
    pub normalize_advantages: bool,
    /// Segments per learner batch (B).
    pub batch_segments: usize,
    /// Segments whose lag exceeds this are dropped and counted.
    pub max_policy_lag: u64,
    /// Pacing over NATS: actors wait while the learner's backlog exceeds this many segments.
    pub max_backlog_segments: u64,
    /// Save-load and budget assignment across tasks and saved states (off by default).
    #[serde(default)]
    pub work: crate::work::WorkConfig,
}

impl Default for HyperParams {
    fn default() -> Self {
        HyperParams {
            loss: LossKind::Ppo,
            gamma: 0.99,
            reward_scale: 1.0,
            learning_rate: 3e-3,
            final_learning_rate: 3e-3,
            lr_decay_updates: 1,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            max_grad_norm: 0.5,
            ent_coef: 0.0,
            value_coef: 0.5,
            clip_rho_threshold: 1.0,
            clip_pg_rho_threshold: 1.0,
            clip_c_threshold: 1.0,
            vtrace_lambda: 0.95,
            gae_lambda: 0.95,
            clip_coef: 0.2,
            behaviour_is_clip: 2.0,
            ppo_epochs: 4,
            ppo_minibatches: 4,
            normalize_advantages: true,
            batch_segments: 32,
            max_policy_lag: 8,
            max_backlog_segments: 64,
            work: crate::work::WorkConfig::default(),
        }
    }
}

/// Why a run spec is invalid.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The save-load / budget settings are invalid.
    #[error("invalid work settings: {0}")]
    Work(String),
    /// The environment config is invalid.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The policy spec is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The policy's input/output sizes do not match the environment.
    #[error("policy {what} is {policy} but environment {env_name} has {env}")]
    Mismatch {
        /// `"obs_dim"` or `"n_actions"`.
        what: &'static str,
        /// The policy's value.
        policy: usize,
        /// The environment's value.
        env: usize,
        /// The environment's name.
        env_name: String,
    },
    /// A hyper-parameter is out of range.
    #[error("invalid hyper-parameter {name} = {value}: {rule}")]
    Hyper {
        /// The parameter.
        name: &'static str,
        /// Its value, formatted.
        value: String,
        /// What it must satisfy.
        rule: &'static str,
    },
}

/// Everything shared across the processes of one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunSpec {
    /// The run's name.
    pub run: RunId,
    /// The environment every actor builds.
    pub env: EnvConfig,
    /// The policy architecture.
    pub policy: PolicySpec,
    /// Steps per segment (T).
    pub segment_len: usize,
    /// Learner hyper-parameters.
    pub hyper: HyperParams,
    /// Base seed of the run.
    pub seed: u64,
}

impl RunSpec {
    /// Check cross-field consistency once; the rest of the code trusts a validated spec.
    pub fn validate(&self) -> Result<ParamLayout, SpecError> {
        let (obs_dim, n_actions) = self.env.spaces()?;
        let layout = ParamLayout::new(&self.policy)?;
        if self.policy.obs_dim != obs_dim {
            return Err(SpecError::Mismatch {
                what: "obs_dim",
                policy: self.policy.obs_dim,
                env: obs_dim,
                env_name: self.env.describe(),
            });
        }
        if self.policy.n_actions != n_actions {
            return Err(SpecError::Mismatch {
                what: "n_actions",
                policy: self.policy.n_actions,
                env: n_actions,
                env_name: self.env.describe(),
            });
        }
        let h = &self.hyper;
        let checks: [(&'static str, f64, bool, &'static str); 12] = [
            ("segment_len", self.segment_len as f64, (1..=4096).contains(&self.segment_len), "1..=4096"),
            ("gamma", h.gamma as f64, (0.0..=1.0).contains(&h.gamma), "in [0, 1]"),
            ("learning_rate", h.learning_rate as f64, h.learning_rate > 0.0 && h.learning_rate < 1.0, "in (0, 1)"),
            (
                "final_learning_rate",
                h.final_learning_rate as f64,
                h.final_learning_rate >= 0.0 && h.final_learning_rate < 1.0,
                "in [0, 1)",
            ),
            ("max_grad_norm", h.max_grad_norm as f64, h.max_grad_norm > 0.0, "> 0"),
            ("ent_coef", h.ent_coef as f64, h.ent_coef >= 0.0, ">= 0"),
            ("value_coef", h.value_coef as f64, h.value_coef >= 0.0, ">= 0"),
            ("gae_lambda", h.gae_lambda as f64, (0.0..=1.0).contains(&h.gae_lambda), "in [0, 1]"),
            ("vtrace_lambda", h.vtrace_lambda as f64, (0.0..=1.0).contains(&h.vtrace_lambda), "in [0, 1]"),
            ("clip_coef", h.clip_coef as f64, h.clip_coef > 0.0, "> 0"),
            ("batch_segments", h.batch_segments as f64, (1..=65536).contains(&h.batch_segments), "1..=65536"),
            (
                "ppo_minibatches",
                h.ppo_minibatches as f64,
                h.ppo_minibatches >= 1 && h.ppo_minibatches as usize <= h.batch_segments,
                "1..=batch_segments",
            ),
        ];
        for (name, value, ok, rule) in checks {
            if !ok || !value.is_finite() {
                return Err(SpecError::Hyper { name, value: value.to_string(), rule });
            }
        }
        let positive = [
            ("clip_rho_threshold", h.clip_rho_threshold),
            ("clip_pg_rho_threshold", h.clip_pg_rho_threshold),
            ("clip_c_threshold", h.clip_c_threshold),
            ("behaviour_is_clip", h.behaviour_is_clip),
            ("reward_scale", h.reward_scale),
            ("adam_eps", h.adam_eps),
        ];
        for (name, value) in positive {
            if value.is_nan() || value <= 0.0 {
                return Err(SpecError::Hyper { name, value: value.to_string(), rule: "> 0" });
            }
        }
        if h.ppo_epochs == 0 {
            return Err(SpecError::Hyper { name: "ppo_epochs", value: "0".into(), rule: ">= 1" });
        }
        h.work.validate().map_err(SpecError::Work)?;
        // Every task must fit the one policy: same spaces as the run's env. Save-load needs
        // in-process environments (remote servers may not snapshot).
        if h.work.enabled && matches!(self.env, EnvConfig::Remote(_)) {
            return Err(SpecError::Work("work items need built-in environments, not remote ones".into()));
        }
        for task in &h.work.tasks {
            if matches!(task, EnvConfig::Remote(_)) {
                return Err(SpecError::Work("work.tasks must be built-in environments".into()));
            }
            let task_env = task.build()?;
            for (what, want, got) in [
                ("obs_dim", obs_dim, task_env.observation_space().dim()),
                ("n_actions", n_actions, task_env.action_space().n),
            ] {
                if want != got {
                    return Err(SpecError::Mismatch {
                        what,
                        policy: want,
                        env: got,
                        env_name: task_env.name().to_string(),
                    });
                }
            }
        }
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::RemoteEnvConfig;
    use crate::envsvc::EnvServiceName;
    use crate::policy::{Activation, CoreKind};

    fn spec(env: EnvConfig, obs_dim: usize) -> RunSpec {
        RunSpec {
            run: RunId::new("spec-test").expect("valid"),
            env,
            policy: PolicySpec {
                obs_dim,
                n_actions: 2,
                torso: vec![8],
                activation: Activation::Tanh,
                core: CoreKind::Mlp,
            },
            segment_len: 8,
            hyper: HyperParams::default(),
            seed: 3,
        }
    }

    /// Specs written before remote environments existed still parse, unchanged.
    #[test]
    fn built_in_env_json_is_unchanged() {
        let json = serde_json::to_value(spec(EnvConfig::Cartpole, 4)).unwrap();
        assert_eq!(json["env"], serde_json::json!({"name": "cartpole"}));
        let memory: EnvConfig = serde_json::from_str(r#"{"name":"memory","n_cues":2,"delay":6}"#).unwrap();
        assert!(matches!(memory, EnvConfig::Memory(_)));
    }

    #[test]
    fn a_remote_env_validates_without_the_network_and_round_trips() {
        let remote = EnvConfig::Remote(RemoteEnvConfig {
            service: EnvServiceName::new("cartpole-v1").unwrap(),
            obs_dim: 4,
            n_actions: 2,
            reward_threshold: Some(475.0),
        });
        let spec = spec(remote.clone(), 4);
        spec.validate().expect("declared spaces match the policy");
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains(
            r#""env":{"name":"remote","service":"cartpole-v1","obs_dim":4,"n_actions":2,"reward_threshold":475.0}"#
        ));
        assert_eq!(serde_json::from_str::<RunSpec>(&json).unwrap(), spec);
        assert_eq!(remote.describe(), "remote:cartpole-v1");
        assert!(remote.build().is_err(), "a remote environment is not built in-process");
        let mismatch = self::spec(remote, 5).validate().unwrap_err();
        assert!(mismatch.to_string().contains("remote:cartpole-v1"), "{mismatch}");
        let bad_name = r#"{"name":"remote","service":"Bad.Name","obs_dim":4,"n_actions":2}"#;
        assert!(serde_json::from_str::<EnvConfig>(bad_name).is_err());
    }
}
