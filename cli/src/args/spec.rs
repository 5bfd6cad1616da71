//! The run-spec flags shared by `volley train` and `volley learner`, and the per-family defaults.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::builder::BoolishValueParser;
use clap::{Args, ValueEnum};
use volley_core::ids::RunId;
use volley_core::spec::{
    Baseline, BpttConfig, HyperParams, LossKind, PriorityConfig, RunSpec, SelectionConfig, TrustConfig,
    ZeroVarianceConfig,
};
use volley_core::work::{BudgetPolicy, WorkConfig};
use volley_env::{EnvConfig, MemoryConfig, MilestonesConfig, MinatarConfig, MinatarGame, RemoteEnvConfig};
use volley_policy::{ActionHead, Activation, ConvInput, ConvSpec, CoreKind, PolicySpec};
use volley_transport::envsvc::EnvServiceName;

use super::{
    parse_env_choice, parse_task, ActivationName, BaselineName, BudgetName, ConvName, CoreName, EnvChoice, EnvName,
    LossName,
};

/// Flags that define the run spec (shared by `volley train` and `volley learner`).
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Environment: cartpole, memory, milestones, pendulum (continuous actions), minatar-GAME
    /// (asterix, breakout, freeway, seaquest, space-invaders), or remote:SERVICE for one served
    /// over NATS (docs/ENV_PROTOCOL.md; `volley learner` asks its servers for the spaces).
    #[arg(long, default_value = "cartpole", env = "VOLLEY_ENV", value_parser = parse_env_choice)]
    pub env: EnvChoice,
    /// Run name ([a-z0-9-]{1,16}).
    #[arg(long, default_value = "local", env = "VOLLEY_RUN")]
    pub run: String,
    /// Base seed of the run.
    #[arg(long, default_value_t = 1, env = "VOLLEY_SEED")]
    pub seed: u64,
    /// Steps per segment (T) [default: 32; served MuJoCo tasks: 64].
    #[arg(long, env = "VOLLEY_SEGMENT_LEN")]
    pub segment_len: Option<usize>,
    /// Segments per learner batch (B) [default: 8; pendulum, served images, served MuJoCo tasks: 32].
    #[arg(long, env = "VOLLEY_BATCH_SEGMENTS")]
    pub batch_segments: Option<usize>,
    /// Credit across segments: train on windows of K consecutive segments of one environment
    /// stream, backpropagating through K·T steps with the recurrent state carried across the
    /// boundaries (needs --core gru; K divides --batch-segments, and a batch is
    /// batch-segments / K windows, so samples per update stay the same). 1: single segments.
    #[arg(long, default_value_t = 1, env = "VOLLEY_BPTT_SEGMENTS")]
    pub bptt_segments: usize,
    /// Seconds an incomplete BPTT window waits for its stream's next segment before the
    /// learner trains on it as a shorter window (with --bptt-segments above 1).
    #[arg(long, default_value_t = 10.0, env = "VOLLEY_BPTT_STREAM_TIMEOUT_SECS")]
    pub bptt_stream_timeout_secs: f64,
    /// Stop after this many environment steps.
    #[arg(long, default_value_t = 300_000, env = "VOLLEY_MAX_ENV_STEPS")]
    pub max_env_steps: u64,
    /// Loss [default: vtrace; pendulum, served images, served MuJoCo tasks: ppo].
    #[arg(long, value_enum, env = "VOLLEY_LOSS")]
    pub loss: Option<LossName>,
    /// Torso widths, comma-separated (empty for none) [default: 64,64; minatar-*: 128; served
    /// images: 512].
    #[arg(long, env = "VOLLEY_TORSO")]
    pub torso: Option<String>,
    /// A separate value network's hidden widths, comma-separated, with the torso's activation
    /// (empty: the value head shares the policy's torso) [default: empty; served MuJoCo tasks:
    /// 64,64]. Needs the MLP core and no conv torso.
    #[arg(long, env = "VOLLEY_CRITIC")]
    pub critic: Option<String>,
    /// Torso activation [default: tanh; minatar-*, served images: relu].
    #[arg(long, value_enum, env = "VOLLEY_ACTIVATION")]
    pub activation: Option<ActivationName>,
    /// Recurrent core.
    #[arg(long, value_enum, default_value = "mlp", env = "VOLLEY_CORE")]
    pub core: CoreName,
    /// Continuous actions: squash the Gaussian head's samples through tanh into the action
    /// box (default: unsquashed samples, clipped by the environment).
    #[arg(long, env = "VOLLEY_SQUASH_ACTIONS")]
    pub squash_actions: bool,
    /// Normalise observations by running statistics that travel with the weights
    /// (`--normalize-obs false` turns the MuJoCo default off) [default: off; served MuJoCo
    /// tasks: on].
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new(),
          env = "VOLLEY_NORMALIZE_OBS")]
    pub normalize_obs: Option<bool>,
    /// GRU width (with --core gru).
    #[arg(long, default_value_t = 64, env = "VOLLEY_GRU_HIDDEN")]
    pub gru_hidden: usize,
    /// Convolutional torso preset in front of --torso (image observations, e.g. MinAtar)
    /// [default: none; minatar-*: minatar; served images: nature].
    #[arg(long, value_enum, env = "VOLLEY_CONV")]
    pub conv: Option<ConvName>,
    /// Frames the actors stack along the channel axis for a remote environment (e.g. 4 for
    /// Atari through `volley-envs serve atari:Pong`); servers send single frames.
    #[arg(long, default_value_t = 1, env = "VOLLEY_FRAME_STACK")]
    pub frame_stack: usize,
    /// Adam learning rate at the start (decays linearly to --final-learning-rate over
    /// --max-env-steps) [default: 2e-3; pendulum: 1.5e-3; minatar-*: 3e-3; served images, MuJoCo: 3e-4].
    #[arg(long, env = "VOLLEY_LEARNING_RATE")]
    pub learning_rate: Option<f32>,
    /// Learning rate reached at the end of the step budget (linear decay).
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_FINAL_LEARNING_RATE")]
    pub final_learning_rate: f32,
    /// Adam ε, added to the root of the second-moment estimate (default: 1e-3 for cartpole,
    /// 1e-8 otherwise). Large for CartPole on purpose: once a run is solved its gradients
    /// shrink by 100x, and with a tiny ε Adam still takes full learning-rate steps on what is
    /// then noise, which drove the policy to a saturated, unrecoverable collapse
    /// (docs/STABILITY.md).
    #[arg(long, env = "VOLLEY_ADAM_EPS")]
    pub adam_eps: Option<f32>,
    /// Discount γ [default: 0.99; pendulum: 0.9].
    #[arg(long, env = "VOLLEY_GAMMA")]
    pub gamma: Option<f32>,
    /// Multiply rewards by this before computing returns [default: 0.05; pendulum, served MuJoCo
    /// tasks: 0.1; minatar-*: 1].
    #[arg(long, env = "VOLLEY_REWARD_SCALE")]
    pub reward_scale: Option<f32>,
    /// Entropy bonus coefficient [default: 0.01 with PPO on discrete actions; minatar-*: 0.02,
    /// decaying to 0; 0 otherwise].
    /// PPO runs ten epochs on each batch; with actors several versions behind, those steps
    /// pushed a policy that was still improving to a deterministic wrong one (CartPole stuck at
    /// a return of ~9) in 2 of 32 runs with 4 and 6 actor processes, and in 1 of 64 with 0.01
    /// (docs/benchmarks/long-runs.md, issue 11).
    #[arg(long, env = "VOLLEY_ENT_COEF")]
    pub ent_coef: Option<f32>,
    /// The entropy bonus at the end of the step budget, reached by linear decay from
    /// --ent-coef on the learning rate's ramp [default: none (constant); minatar-*: 0, unless
    /// --ent-coef is given].
    #[arg(long, env = "VOLLEY_FINAL_ENT_COEF")]
    pub final_ent_coef: Option<f32>,
    /// PPO epochs per batch [default: 10; served images: 3].
    #[arg(long, env = "VOLLEY_PPO_EPOCHS")]
    pub ppo_epochs: Option<u32>,
    /// PPO minibatches per epoch [default: 1; pendulum: 8; served images: 4; served MuJoCo tasks:
    /// 32].
    #[arg(long, env = "VOLLEY_PPO_MINIBATCHES")]
    pub ppo_minibatches: Option<u32>,
    /// GAE λ.
    #[arg(long, default_value_t = 0.95, env = "VOLLEY_GAE_LAMBDA")]
    pub gae_lambda: f32,
    /// PPO: truncation of the behaviour importance weight π_prox/μ of each sample.
    #[arg(long, default_value_t = HyperParams::default().behaviour_is_clip, env = "VOLLEY_BEHAVIOUR_IS_CLIP")]
    pub behaviour_is_clip: f32,
    /// Drop segments whose lag exceeds this many versions. 32 is inside what V-trace's
    /// truncated importance weights (and PPO's behaviour weights) correct, and above the lag
    /// that several actor processes produce on a busy machine (each actor's round of one batch
    /// spans about N versions with N actors, and a descheduled actor falls further behind), so
    /// scale-out does not throw actor work away (issue 11: with 4, 4-6 actors lost 34-46 % of
    /// their segments as stale; with 16, 6 actors on a loaded 2-core machine still lost 7-16 %).
    #[arg(long, default_value_t = 32, env = "VOLLEY_MAX_POLICY_LAG")]
    pub max_policy_lag: u64,
    /// Largest share (0, 1] of the 100-episode return window (and so of the solved stop) one
    /// actor id may hold; 1/k requires k actors to agree (docs/SECURITY.md).
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_MAX_ACTOR_RETURN_SHARE")]
    pub max_actor_return_share: f32,
    /// Trajectory selection: drop segments with a raw reward of larger magnitude (default: no bound).
    #[arg(long, env = "VOLLEY_SELECT_MAX_ABS_REWARD")]
    pub select_max_abs_reward: Option<f32>,
    /// Trajectory selection: drop segments whose start group's last N returns are all equal
    /// (zero variance: no signal for group-relative methods); N >= 2 (default: off).
    #[arg(long, env = "VOLLEY_SELECT_ZERO_VARIANCE_MIN_GROUP")]
    pub select_zero_variance_min_group: Option<usize>,
    /// Trajectory selection: sample each batch from a pool by |advantage|^ALPHA with
    /// importance weights (prioritised selection; default: off, every segment used in order).
    #[arg(long, env = "VOLLEY_SELECT_PRIORITY_ALPHA")]
    pub select_priority_alpha: Option<f32>,
    /// Prioritised selection: importance-correction exponent β in [0, 1] (default 0.4).
    #[arg(long, env = "VOLLEY_SELECT_PRIORITY_BETA", requires = "select_priority_alpha")]
    pub select_priority_beta: Option<f32>,
    /// Prioritised selection: pool size in batches (default 2).
    #[arg(long, env = "VOLLEY_SELECT_POOL_FACTOR", requires = "select_priority_alpha")]
    pub select_pool_factor: Option<usize>,
    /// Memory task: number of cues.
    #[arg(long, default_value_t = 2, env = "VOLLEY_MEMORY_CUES")]
    pub memory_cues: usize,
    /// Memory task: steps between cue and query.
    #[arg(long, default_value_t = 6, env = "VOLLEY_MEMORY_DELAY")]
    pub memory_delay: usize,
    /// Milestones task: rooms.
    #[arg(long, default_value_t = 4, env = "VOLLEY_ROOMS")]
    pub rooms: usize,
    /// Milestones task: cells per room.
    #[arg(long, default_value_t = 8, env = "VOLLEY_ROOM_LEN")]
    pub room_len: usize,
    /// Milestones task: steps before truncation (at least rooms × (room length + 1)).
    #[arg(long, default_value_t = 128, env = "VOLLEY_ROOM_MAX_STEPS")]
    pub room_max_steps: usize,
    /// Milestones task: steps allowed in each room (0: no limit); a room that takes longer
    /// ends the episode (the long sparse chain where restarts from saved states pay;
    /// docs/AGENTIC.md).
    #[arg(long, default_value_t = 0, env = "VOLLEY_ROOM_STEPS")]
    pub room_steps: usize,
    /// Milestones task: the observation also says the chain's size (for task families; the
    /// `--task` entries must set `task_features=true` too).
    #[arg(long, env = "VOLLEY_MILESTONES_TASK_FEATURES")]
    pub milestones_task_features: bool,
    /// Schedule every episode through work items: budget assignment across `--task`s and
    /// saved states, snapshots at milestones (save-load).
    #[arg(long, env = "VOLLEY_WORK")]
    pub work: bool,
    /// A task for `--work` runs, repeatable: `NAME[:key=value,...]` with the environment's
    /// config keys, e.g. `--task memory:delay=2 --task memory:delay=8` (default: `--env` alone).
    /// Several tasks in one value (and in `VOLLEY_TASK`) are separated by `;`.
    #[arg(long = "task", requires = "work", env = "VOLLEY_TASK", value_delimiter = ';')]
    pub tasks: Vec<String>,
    /// How `--work` splits episodes between tasks.
    #[arg(long, value_enum, default_value = "uniform", env = "VOLLEY_BUDGET")]
    pub budget: BudgetName,
    /// Share of work items that restart from a saved state (Go-Explore-style), in [0, 1].
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_RESTART_SHARE")]
    pub restart_share: f32,
    /// Episodes per work item.
    #[arg(long, default_value_t = 1, env = "VOLLEY_EPISODES_PER_ITEM")]
    pub episodes_per_item: u32,
    /// Save a snapshot every this many steps of a scheduled episode (0: at milestones only).
    #[arg(long, default_value_t = 0, env = "VOLLEY_SNAPSHOT_EVERY")]
    pub snapshot_every: u32,
    /// Seconds a taken work item may go without progress before another actor gets it.
    #[arg(long, default_value_t = 30.0, env = "VOLLEY_WORK_ACK_WAIT_SECS")]
    pub work_ack_wait_secs: f64,
    /// Work items one actor identity may hold at once (taken and not yet confirmed by the
    /// learner); give each actor at least twice its environments.
    #[arg(long, default_value_t = 64, env = "VOLLEY_WORK_MAX_ITEMS_PER_ACTOR")]
    pub work_max_items_per_actor: u32,
    /// Seconds the learner waits, after an actor reports an item done, for its episodes to
    /// arrive before another actor gets the item.
    #[arg(long, default_value_t = 120.0, env = "VOLLEY_WORK_CONFIRM_WAIT_SECS")]
    pub work_confirm_wait_secs: f64,
    /// Group rollouts: continuations per group, K (1: no groups). A group is K work items of
    /// one episode each from one start (a fresh reset seed or a saved state), each sampling
    /// actions from its own stream; needs --work.
    #[arg(long, default_value_t = 1, env = "VOLLEY_GROUP_SIZE", requires = "work")]
    pub group_size: u32,
    /// Group rollouts: share of the scheduler's draws that become a group rather than a
    /// single item, in [0, 1].
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_GROUP_SHARE")]
    pub group_share: f32,
    /// The policy gradient's baseline: the critic, or the group's mean return (group rollouts;
    /// group-std also divides by the group's standard deviation, as GRPO does).
    #[arg(long, value_enum, default_value = "critic", env = "VOLLEY_BASELINE")]
    pub baseline: BaselineName,
    /// Group rollouts: segments the learner holds back until their groups complete; beyond
    /// it the oldest are trained on with the critic's advantages.
    #[arg(long, default_value_t = 256, env = "VOLLEY_GROUP_HOLD_SEGMENTS")]
    pub group_hold_segments: u32,
}

/// The defaults of the flags whose best value depends on the environment (a flag given on the
/// command line always wins).
#[derive(Debug, Clone, PartialEq)]
struct EnvDefaults {
    /// Which family of environments these defaults were chosen for (logged).
    family: &'static str,
    loss: LossName,
    gamma: f32,
    reward_scale: f32,
    learning_rate: f32,
    ppo_epochs: u32,
    ppo_minibatches: u32,
    segment_len: usize,
    batch_segments: usize,
    /// The entropy bonus; `None`: 0.01 for a categorical head under PPO, else 0.
    ent_coef: Option<f32>,
    /// The entropy bonus at the end of the step budget (linear decay from `ent_coef`); `None`:
    /// constant. It applies only with the family's own `ent_coef`: an `--ent-coef` given without
    /// `--final-ent-coef` stays constant.
    final_ent_coef: Option<f32>,
    network: NetworkDefaults,
    normalize_obs: bool,
}

/// The policy network a family trains by default (`--conv`, `--torso`, `--activation`).
#[derive(Debug, Clone, PartialEq)]
struct NetworkDefaults {
    conv: ConvName,
    /// Torso widths as `--torso` spells them.
    torso: &'static str,
    activation: ActivationName,
    /// A separate value network's widths as `--critic` spells them (empty: none).
    critic: &'static str,
}

impl NetworkDefaults {
    /// A 64×64 tanh MLP on the observation vector (flattened planes for image observations).
    const MLP: NetworkDefaults =
        NetworkDefaults { conv: ConvName::None, torso: "64,64", activation: ActivationName::Tanh, critic: "" };
    /// The Nature-DQN network (Mnih et al. 2015): three convolutions and 512 ReLU units, the
    /// network of the Atari PPO baselines (CleanRL, the SB3 zoo) and of issue 44's Pong runs.
    const NATURE: NetworkDefaults =
        NetworkDefaults { conv: ConvName::Nature, torso: "512", activation: ActivationName::Relu, critic: "" };
    /// MinAtar's network (Young & Tian 2019, the network of their AC(λ) reference): one 3×3
    /// convolution with 16 filters and 128 ReLU units.
    const MINATAR: NetworkDefaults =
        NetworkDefaults { conv: ConvName::Minatar, torso: "128", activation: ActivationName::Relu, critic: "" };
}

impl EnvDefaults {
    /// Issue 14 (docs/benchmarks/solve.md, "Pendulum-v1"): PPO with γ 0.9 and 8 minibatches
    /// learns Pendulum, where the CartPole defaults (V-trace, γ 0.99) did not in 500 K steps.
    /// Issue 45 (same page, "The Pendulum sweep"): 1,024-step batches (T=32 instead of 64) at
    /// learning rate 1.5e-3 reach a last-20 mean of −250 in a median 33,680 env steps over 10
    /// seeds (all ≤ 36,672) against 62,272 with 2,048-step batches at 1e-3; 2e-3 was as fast but
    /// fell back further after the target.
    const CONTINUOUS: EnvDefaults = EnvDefaults {
        family: "continuous (box actions, Pendulum-like)",
        loss: LossName::Ppo,
        gamma: 0.9,
        reward_scale: 0.1,
        learning_rate: 1.5e-3,
        ppo_epochs: 10,
        ppo_minibatches: 8,
        segment_len: 32,
        batch_segments: 32,
        ent_coef: None,
        final_ent_coef: None,
        network: NetworkDefaults::MLP,
        normalize_obs: false,
    };

    /// Issue 44, item 5 (docs/benchmarks/atari.md, "Pong on two CPU cores"): PPO with 3 epochs
    /// of 4 minibatches over 1,024-step batches at learning rate 3e-4, on unscaled rewards
    /// with an entropy bonus of 0.01, near CleanRL's Atari PPO (4 epochs of 4 at 2.5e-4) with
    /// a quarter fewer gradient steps for the CPU learner. V-trace with one pass over each
    /// sample (the earlier default: 256-step batches at 6e-4) left Pong's policy uniform
    /// (entropy 1.78 of 1.79 nats) and its return at -20.3 after 1M agent steps, where this
    /// PPO had left -21 by 0.75M: on pixels the learner's gradient steps, not its samples, are
    /// what Pong needs, and PPO takes twelve per sample where V-trace took one. The network is
    /// the Nature-DQN one, as in those baselines.
    const IMAGES: EnvDefaults = EnvDefaults {
        family: "image observations (Atari-like)",
        loss: LossName::Ppo,
        gamma: 0.99,
        reward_scale: 1.0,
        learning_rate: 3e-4,
        ppo_epochs: 3,
        ppo_minibatches: 4,
        segment_len: 32,
        batch_segments: 32,
        ent_coef: Some(0.01),
        final_ent_coef: None,
        network: NetworkDefaults::NATURE,
        normalize_obs: false,
    };

    /// Gymnasium's MuJoCo tasks served by `volley-envs serve gymnasium:<Task>` (issue 45, item
    /// 3): CleanRL's `ppo_continuous_action` settings where Volley has the knob (2,048-step
    /// batches, 10 epochs of 32 minibatches, learning rate 3e-4, γ 0.99, no entropy bonus,
    /// observation normalisation), with a fixed reward scale of 0.1 instead of its running
    /// return normaliser. Pendulum's defaults (γ 0.9, 1,024-step batches at 1.5e-3) left Walker2d-v5
    /// at 425 after 1M steps (3 seeds); these took it to 1,821 (2,283, 1,601, 1,579) and, as
    /// `bench/mujoco.sh`'s flags, HalfCheetah-v5 to 1,698 and Hopper-v5 to 2,028; Ant-v5 moved
    /// little (845 against 716; docs/benchmarks/solve.md, "The MuJoCo family").
    const MUJOCO: EnvDefaults = EnvDefaults {
        family: "MuJoCo (Gymnasium's locomotion and manipulation tasks)",
        loss: LossName::Ppo,
        gamma: 0.99,
        reward_scale: 0.1,
        learning_rate: 3e-4,
        ppo_epochs: 10,
        ppo_minibatches: 32,
        segment_len: 64,
        batch_segments: 32,
        ent_coef: Some(0.0),
        final_ent_coef: None,
        network: NetworkDefaults::MLP,
        normalize_obs: true,
    };

    /// CartPole's, for discrete actions on vector observations.
    const DISCRETE: EnvDefaults = EnvDefaults {
        family: "discrete actions, vector observations (CartPole-like)",
        loss: LossName::Vtrace,
        gamma: 0.99,
        reward_scale: 0.05,
        learning_rate: 2e-3,
        ppo_epochs: 10,
        ppo_minibatches: 1,
        segment_len: 32,
        batch_segments: 8,
        ent_coef: None,
        final_ent_coef: None,
        network: NetworkDefaults::MLP,
        normalize_obs: false,
    };

    /// MinAtar (issue 45, item 2; docs/benchmarks/minatar.md, "The Breakout seed-11 collapse"
    /// and "Screening the defaults"): V-trace on unscaled rewards with an entropy bonus. With
    /// CartPole's defaults (reward scale 0.05, no bonus) Breakout seed 11 went deterministic and
    /// its return fell to 0 for good. A bonus of 0.01 at learning rate 2e-3 held the policy near
    /// uniform on Asterix and Seaquest and still let Breakout seeds 4 and 11 collapse. 0.005 at
    /// 1.5e-3 kept the 6 Breakout seeds of a 0.6M-frame screen above 0.06 nats and took Seaquest
    /// from 5-6.5 to 20-25 at 5M frames on 2 of 5 seeds; 0.003 at 2e-3 learned faster still but
    /// collapsed 3 of the 6. The collapse is rarer, not gone: Breakout seed 2 of the 5M suite
    /// went deterministic from 0.87M to 2.0M frames before the bonus pulled it back.
    /// The network is MinAtar's own (one 3×3×16 convolution, 128 ReLU units), not the flattened
    /// 64×64 tanh MLP: over 5 seeds at 5M frames it took Breakout from 6.6 to 12.0, Asterix from
    /// 2.7 to 29.8, Freeway from 52.7 to 63.4 and Space Invaders from 90 to about 125
    /// (docs/benchmarks/minatar.md, "MinAtar's conv network as the default").
    /// The bonus starts at 0.02 and decays linearly to 0 over the step budget: with 0.005 held
    /// constant, Breakout's policy was near deterministic by 0.5M frames (0.1-0.3 nats) and
    /// seeds sat for millions of frames, or for good, in a rally of a few bricks at a return of
    /// 5-6; starting at 0.02 every seed of a 4-seed screen left it by 1-2M frames (17.2 against
    /// 10.0 at 5M), where 0.01 did not (9.8) (docs/benchmarks/minatar.md, "An entropy bonus
    /// that decays").
    /// With that bonus the learning rate starts at 3e-3, twice the rate chosen under the
    /// constant bonus: Space Invaders, the one game then below AC(λ) at 5M frames, was short of
    /// updates (twice the rate, or twice the updates, took both seeds of a screen from 153 to
    /// 203-213; the 5-seed suite with it: same page, "The learning rate with the decaying
    /// bonus").
    const MINATAR: EnvDefaults = EnvDefaults {
        family: "MinAtar",
        loss: LossName::Vtrace,
        gamma: 0.99,
        reward_scale: 1.0,
        learning_rate: 3e-3,
        ppo_epochs: 10,
        ppo_minibatches: 1,
        segment_len: 32,
        batch_segments: 8,
        ent_coef: Some(0.02),
        final_ent_coef: Some(0.0),
        network: NetworkDefaults::MINATAR,
        normalize_obs: false,
    };

    /// The defaults for `env`. A served environment (`--env remote:<service>`) gets them from the
    /// spaces its servers declared, as a built-in one of the same family would (issue 48:
    /// served Pendulum trained with CartPole's defaults and did not learn).
    fn for_env(env: &EnvConfig) -> Self {
        match env {
            EnvConfig::Pendulum => Self::CONTINUOUS,
            EnvConfig::Minatar(_) => Self::MINATAR,
            EnvConfig::Remote(remote) if remote.action_box.is_some() && is_mujoco_task(remote.env.as_deref()) => {
                Self::MUJOCO
            }
            EnvConfig::Remote(remote) if remote.action_box.is_some() => Self::CONTINUOUS,
            EnvConfig::Remote(remote) if remote.image.is_some() => Self::IMAGES,
            _ => Self::DISCRETE,
        }
    }
}

/// Gymnasium's MuJoCo tasks, by the name before the version (`Walker2d` of
/// `gymnasium:Walker2d-v5`), lower case.
const MUJOCO_TASKS: [&str; 11] = [
    "ant",
    "halfcheetah",
    "hopper",
    "humanoid",
    "humanoidstandup",
    "inverteddoublependulum",
    "invertedpendulum",
    "pusher",
    "reacher",
    "swimmer",
    "walker2d",
];

/// Whether a served environment's declared label (`gymnasium:Walker2d-v5`) names one of
/// Gymnasium's MuJoCo tasks.
fn is_mujoco_task(label: Option<&str>) -> bool {
    let Some(label) = label else { return false };
    let id = label.rsplit(':').next().unwrap_or(label);
    let name = id.split("-v").next().unwrap_or(id).to_ascii_lowercase();
    MUJOCO_TASKS.contains(&name.as_str())
}

fn parse_widths(flag: &str, text: &str) -> anyhow::Result<Vec<usize>> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|w| {
            let width: usize = w.trim().parse().with_context(|| format!("{flag}: {w:?} is not a width"))?;
            if width == 0 || width > 4096 {
                bail!("{flag}: width {width} out of range 1..=4096");
            }
            Ok(width)
        })
        .collect()
}

impl SpecArgs {
    /// Build and validate the run spec these flags describe; refuses a remote environment
    /// (whose spaces only its servers know: see [`SpecArgs::to_spec_with`]). For tests: the
    /// commands resolve remote environments over NATS.
    #[cfg(test)]
    pub fn to_spec(&self) -> anyhow::Result<RunSpec> {
        self.to_spec_with(&|service| bail!("--env remote:{service}: remote environments need NATS"))
    }

    /// Build and validate the run spec these flags describe, asking `resolve_remote` for the
    /// spaces of a remote environment.
    pub fn to_spec_with(
        &self,
        resolve_remote: &dyn Fn(&EnvServiceName) -> anyhow::Result<RemoteEnvConfig>,
    ) -> anyhow::Result<RunSpec> {
        let run = RunId::new(self.run.clone()).context("--run")?;
        if self.max_env_steps == 0 {
            bail!("--max-env-steps must be at least 1");
        }
        if self.gru_hidden == 0 || self.gru_hidden > 4096 {
            bail!("--gru-hidden: {} out of range 1..=4096", self.gru_hidden);
        }
        if self.frame_stack == 0 || self.frame_stack > volley_env::MAX_FRAME_STACK {
            bail!("--frame-stack: {} out of range 1..={}", self.frame_stack, volley_env::MAX_FRAME_STACK);
        }
        let env = match &self.env {
            EnvChoice::Builtin(_) if self.frame_stack > 1 => {
                bail!("--frame-stack is for remote environments (built-in ones send what their policy reads)")
            }
            EnvChoice::Builtin(name) => self.builtin_env(*name),
            EnvChoice::Remote(service) => {
                let mut remote = resolve_remote(service)?;
                remote.frame_stack = self.frame_stack;
                EnvConfig::Remote(remote)
            }
        };
        let (obs_dim, n_actions) = env.spaces().context("environment config")?;
        let preset = EnvDefaults::for_env(&env);
        let policy = PolicySpec {
            obs_dim,
            n_actions,
            torso: parse_widths("--torso", self.torso.as_deref().unwrap_or(preset.network.torso))?,
            activation: match self.activation.unwrap_or(preset.network.activation) {
                ActivationName::Tanh => Activation::Tanh,
                ActivationName::Relu => Activation::Relu,
            },
            core: match self.core {
                CoreName::Mlp => CoreKind::Mlp,
                CoreName::Gru => CoreKind::Gru { hidden: self.gru_hidden },
            },
            head: match volley_core::spec::default_action_head(&env).context("environment config")? {
                ActionHead::Gaussian { .. } => ActionHead::Gaussian { squash: self.squash_actions },
                categorical => categorical,
            },
            conv: self.conv_or_family_default(preset.network.conv, &env)?,
            normalize_obs: self.normalize_obs.unwrap_or(preset.normalize_obs),
            critic: parse_widths("--critic", self.critic.as_deref().unwrap_or(preset.network.critic))?,
        };
        if let EnvConfig::Remote(remote) = &env {
            tracing::info!(service = %remote.service, family = preset.family, loss = ?preset.loss, gamma = preset.gamma,
                           reward_scale = preset.reward_scale, learning_rate = preset.learning_rate,
                           segment_len = preset.segment_len, batch_segments = preset.batch_segments,
                           "defaults for a served environment chosen from its declared spaces (flags override)");
        }
        let segment_len = self.segment_len.unwrap_or(preset.segment_len);
        let batch_segments = self.batch_segments.unwrap_or(preset.batch_segments);
        let steps_per_update = (segment_len * batch_segments) as u64;
        let hyper = HyperParams {
            loss: match self.loss.unwrap_or(preset.loss) {
                LossName::Vtrace => LossKind::Vtrace,
                LossName::Ppo => LossKind::Ppo,
            },
            gamma: self.gamma.unwrap_or(preset.gamma),
            reward_scale: self.reward_scale.unwrap_or(preset.reward_scale),
            learning_rate: self.learning_rate.unwrap_or(preset.learning_rate),
            final_learning_rate: self.final_learning_rate,
            lr_decay_updates: (self.max_env_steps / steps_per_update.max(1)).max(1),
            ent_coef: self.ent_coef.or(preset.ent_coef).unwrap_or(
                match (&policy.head, self.loss.unwrap_or(preset.loss)) {
                    (ActionHead::Categorical, LossName::Ppo) => 0.01,
                    _ => 0.0,
                },
            ),
            final_ent_coef: self.final_ent_coef.or(if self.ent_coef.is_none() { preset.final_ent_coef } else { None }),
            adam_eps: self.adam_eps.unwrap_or_else(|| volley_core::spec::default_adam_eps(&env)),
            ppo_epochs: self.ppo_epochs.unwrap_or(preset.ppo_epochs),
            ppo_minibatches: self.ppo_minibatches.unwrap_or(preset.ppo_minibatches),
            gae_lambda: self.gae_lambda,
            behaviour_is_clip: self.behaviour_is_clip,
            batch_segments,
            max_policy_lag: self.max_policy_lag,
            work: WorkConfig {
                enabled: self.work,
                tasks: self.tasks.iter().map(|t| parse_task(t)).collect::<anyhow::Result<_>>()?,
                policy: match self.budget {
                    BudgetName::Uniform => BudgetPolicy::Uniform,
                    BudgetName::Learnability => BudgetPolicy::Learnability,
                    BudgetName::Ucb => BudgetPolicy::Ucb,
                },
                restart_share: self.restart_share,
                episodes_per_item: self.episodes_per_item,
                snapshot_every_steps: self.snapshot_every,
                ack_wait_secs: self.work_ack_wait_secs,
                max_items_per_actor: self.work_max_items_per_actor,
                confirm_wait_secs: self.work_confirm_wait_secs,
                group_size: self.group_size,
                group_share: self.group_share,
                group_hold_segments: self.group_hold_segments,
                ..WorkConfig::default()
            },
            baseline: match self.baseline {
                BaselineName::Critic => Baseline::Critic,
                BaselineName::Group => Baseline::Group,
                BaselineName::GroupStd => Baseline::GroupStd,
            },
            selection: self.selection(),
            trust: TrustConfig { max_actor_return_share: self.max_actor_return_share },
            bptt: BpttConfig {
                segments: self.bptt_segments,
                stream_timeout_secs: self.bptt_stream_timeout_secs,
                ..BpttConfig::default()
            },
            ..HyperParams::default()
        };
        let spec = RunSpec { run, env, policy, segment_len, hyper, seed: self.seed };
        spec.validate().context("invalid training configuration")?;
        Ok(spec)
    }
}

/// The conv torso `conv` names, shaped by the environment's image observations.
fn conv_spec(conv: ConvName, env: &EnvConfig) -> anyhow::Result<Option<ConvSpec>> {
    if conv == ConvName::None {
        return Ok(None);
    }
    let Some([channels, height, width]) = env.image_shape() else {
        bail!("--conv {conv:?} needs image observations; {} has vector observations", env.describe());
    };
    let mut spec = match conv {
        ConvName::None => unreachable!("handled above"),
        ConvName::Minatar => ConvSpec::minatar(channels, height, width),
        ConvName::Nature => ConvSpec::nature(channels, height, width),
    };
    // Served images are 8-bit frames (protocol version 3), read as pixels; MinAtar's
    // planes are 0/1 and read as they are.
    if matches!(env, EnvConfig::Remote(_)) {
        spec.input = ConvInput::Pixels;
    }
    Ok(Some(spec))
}

impl SpecArgs {
    /// The conv torso `--conv` names, or else the family's, which must fit the images: a served
    /// image environment with frames too small for the Nature-DQN network is told how to train
    /// it instead of getting a layer-shape error.
    fn conv_or_family_default(&self, family: ConvName, env: &EnvConfig) -> anyhow::Result<Option<ConvSpec>> {
        let spec = conv_spec(self.conv.unwrap_or(family), env)?;
        if let (None, Some(conv)) = (self.conv, &spec) {
            if let Err(error) = conv.geometries() {
                bail!(
                    "{} has {}x{} images, which the default network for its family (--conv {}) cannot read ({error}); \
                     choose one with --conv none (an MLP on the flattened pixels) or --conv minatar",
                    env.describe(),
                    conv.height,
                    conv.width,
                    family.to_possible_value().map(|value| value.get_name().to_owned()).unwrap_or_default()
                );
            }
        }
        Ok(spec)
    }

    /// The built-in environment `name` with the task flags.
    pub fn builtin_env(&self, name: EnvName) -> EnvConfig {
        match name {
            EnvName::Cartpole => EnvConfig::Cartpole,
            EnvName::Memory => EnvConfig::Memory(MemoryConfig { n_cues: self.memory_cues, delay: self.memory_delay }),
            EnvName::Milestones => EnvConfig::Milestones(MilestonesConfig {
                n_rooms: self.rooms,
                room_len: self.room_len,
                max_steps: self.room_max_steps,
                room_steps: self.room_steps,
                task_features: self.milestones_task_features,
            }),
            EnvName::Pendulum => EnvConfig::Pendulum,
            EnvName::MinatarAsterix
            | EnvName::MinatarBreakout
            | EnvName::MinatarFreeway
            | EnvName::MinatarSeaquest
            | EnvName::MinatarSpaceInvaders => {
                let game = MinatarGame::from_env_name(name.as_str()).expect("every minatar EnvName is a game");
                EnvConfig::Minatar(MinatarConfig::new(game))
            }
        }
    }

    /// The trajectory-selection config these flags describe (validated with the run spec).
    fn selection(&self) -> SelectionConfig {
        let mut selection = SelectionConfig::default();
        selection.guard.max_abs_reward = self.select_max_abs_reward;
        selection.zero_variance = self
            .select_zero_variance_min_group
            .map(|min_group| ZeroVarianceConfig { min_group, ..ZeroVarianceConfig::default() });
        selection.priority = self.select_priority_alpha.map(|alpha| {
            let defaults = PriorityConfig::default();
            PriorityConfig {
                alpha,
                beta: self.select_priority_beta.unwrap_or(defaults.beta),
                pool_factor: self.select_pool_factor.unwrap_or(defaults.pool_factor),
                ..defaults
            }
        });
        selection
    }
}

pub(super) fn check_target(target_return: Option<f32>) -> anyhow::Result<()> {
    if target_return.is_some_and(|t| t.is_nan()) {
        bail!("--target-return must be a number");
    }
    Ok(())
}

pub(super) fn check_secs(flag: &str, secs: f64) -> anyhow::Result<Duration> {
    if !(secs.is_finite() && secs > 0.0) {
        bail!("{flag}: {secs} must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::args::tests::learner_config;
    use crate::args::{Cli, Command};

    /// The run spec `volley train <flags>` describes, a remote environment resolving to `served`.
    fn train_spec(flags: &[&str], served: Option<&RemoteEnvConfig>) -> anyhow::Result<RunSpec> {
        let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
        let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        args.spec.to_spec_with(&|_| served.cloned().ok_or_else(|| anyhow::anyhow!("not served")))
    }

    #[test]
    fn several_tasks_fit_in_one_value_separated_by_semicolons() {
        let cli = Cli::try_parse_from([
            "volley",
            "train",
            "--env",
            "memory",
            "--work",
            "--task",
            "memory:delay=2,n_cues=2;memory:delay=8",
            "--task",
            "memory:delay=16",
        ])
        .expect("valid flags");
        let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        assert_eq!(args.spec.tasks, ["memory:delay=2,n_cues=2", "memory:delay=8", "memory:delay=16"]);
    }

    /// Issue 14: `volley train --env pendulum` gets the defaults that learn pendulum (PPO,
    /// γ 0.9, ...), a flag given on the command line still wins, and other environments keep
    /// theirs; the policy head is Gaussian.
    #[test]
    fn pendulum_gets_its_own_defaults_and_flags_still_win() {
        let spec = |flags: &[&str]| train_spec(flags, None).expect("a valid spec");
        let pendulum = spec(&["--env", "pendulum"]);
        assert_eq!(pendulum.hyper.loss, LossKind::Ppo);
        assert_eq!((pendulum.hyper.gamma, pendulum.hyper.reward_scale), (0.9, 0.1));
        assert_eq!((pendulum.segment_len, pendulum.hyper.batch_segments, pendulum.hyper.ppo_minibatches), (32, 32, 8));
        assert_eq!(pendulum.hyper.learning_rate, 1.5e-3);
        assert_eq!(pendulum.policy.head, ActionHead::Gaussian { squash: false });
        let tuned = spec(&["--env", "pendulum", "--gamma", "0.95", "--loss", "vtrace", "--squash-actions"]);
        assert_eq!((tuned.hyper.gamma, tuned.hyper.loss), (0.95, LossKind::Vtrace));
        assert_eq!(tuned.policy.head, ActionHead::Gaussian { squash: true });
        let cartpole = spec(&[]);
        assert_eq!((cartpole.hyper.loss, cartpole.hyper.gamma, cartpole.segment_len), (LossKind::Vtrace, 0.99, 32));
        assert_eq!(cartpole.policy.head, ActionHead::Categorical);
    }

    /// Issue 48, item 3: a served environment gets the defaults of its family from the spaces
    /// its servers declare: `volley env-serve --env pendulum` (box actions) trains with exactly
    /// the built-in `--env pendulum`'s run settings, a served image environment with the
    /// Atari-like ones, and a served discrete vector environment keeps CartPole's.
    #[test]
    fn a_served_environment_gets_the_defaults_of_its_declared_family() {
        let spec =
            |flags: &[&str], served: Option<RemoteEnvConfig>| train_spec(flags, served.as_ref()).expect("a valid spec");
        let builtin = spec(&["--env", "pendulum"], None);
        // What env-serve's servers declare for the built-in pendulum.
        let pendulum = EnvConfig::Pendulum.build().expect("builds");
        let volley_env::ActionSpace::Box { low, high, .. } = pendulum.action_space() else {
            panic!("pendulum has box actions")
        };
        let service = EnvServiceName::new("pendulum").expect("valid");
        let served = RemoteEnvConfig {
            action_box: Some(volley_env::RemoteActionBox { low, high }),
            ..RemoteEnvConfig::new(service.clone(), pendulum.observation_space().dim(), 1)
        };
        let remote = spec(&["--env", "remote:pendulum"], Some(served));
        assert_eq!(remote.hyper, builtin.hyper);
        assert_eq!((remote.segment_len, &remote.policy), (builtin.segment_len, &builtin.policy));
        let image = RemoteEnvConfig { image: Some([1, 84, 84]), ..RemoteEnvConfig::new(service.clone(), 84 * 84, 6) };
        let pong = spec(&["--env", "remote:pong", "--frame-stack", "4"], Some(image.clone()));
        assert_eq!((pong.hyper.loss, pong.hyper.reward_scale, pong.hyper.ent_coef), (LossKind::Ppo, 1.0, 0.01));
        assert_eq!(
            (pong.hyper.learning_rate, pong.hyper.ppo_epochs, pong.hyper.ppo_minibatches, pong.hyper.batch_segments),
            (3e-4, 3, 4, 32)
        );
        // Issue 45, item 1: the family's network too, the Nature-DQN one over 4 stacked frames.
        let nature = ConvSpec { input: ConvInput::Pixels, ..ConvSpec::nature(4, 84, 84) };
        assert_eq!(
            (&pong.policy.conv, &pong.policy.torso, pong.policy.activation),
            (&Some(nature), &vec![512], Activation::Relu)
        );
        let small =
            spec(&["--env", "remote:pong", "--conv", "none", "--torso", "32", "--activation", "tanh"], Some(image));
        assert_eq!(
            (&small.policy.conv, &small.policy.torso, small.policy.activation),
            (&None, &vec![32], Activation::Tanh)
        );
        let tiny = RemoteEnvConfig { image: Some([1, 12, 12]), ..RemoteEnvConfig::new(service.clone(), 144, 3) };
        let refused =
            train_spec(&["--env", "remote:tiny"], Some(&tiny)).expect_err("12x12 frames are too small for Nature");
        assert!(format!("{refused:#}").contains("(--conv nature)"), "{refused:#}");
        assert!(format!("{refused:#}").contains("--conv none"), "{refused:#}");
        let mlp = train_spec(&["--env", "remote:tiny", "--conv", "none"], Some(&tiny)).expect("an MLP on 12x12 frames");
        assert_eq!(mlp.policy.conv, None);
        // Issue 45, item 3: a served MuJoCo task gets MuJoCo's defaults, not Pendulum's, by the
        // label its servers declare; Gymnasium's Pendulum keeps Pendulum's.
        let walker = RemoteEnvConfig {
            action_box: Some(volley_env::RemoteActionBox { low: vec![-1.0; 6], high: vec![1.0; 6] }),
            env: Some("gymnasium:Walker2d-v5".into()),
            ..RemoteEnvConfig::new(service.clone(), 17, 6)
        };
        let mujoco = spec(&["--env", "remote:walker2d-v5"], Some(walker.clone()));
        assert_eq!((mujoco.hyper.loss, mujoco.hyper.gamma, mujoco.hyper.learning_rate), (LossKind::Ppo, 0.99, 3e-4));
        assert_eq!(
            (mujoco.segment_len, mujoco.hyper.batch_segments, mujoco.hyper.ppo_epochs, mujoco.hyper.ppo_minibatches),
            (64, 32, 10, 32)
        );
        assert_eq!((mujoco.hyper.ent_coef, mujoco.policy.normalize_obs), (0.0, true));
        let raw = spec(&["--env", "remote:walker2d-v5", "--normalize-obs", "false"], Some(walker.clone()));
        assert!(!raw.policy.normalize_obs);
        let gym_pendulum = RemoteEnvConfig { env: Some("gymnasium:Pendulum-v1".into()), ..walker.clone() };
        let pendulum_like = spec(&["--env", "remote:pendulum-v1"], Some(gym_pendulum));
        assert_eq!((pendulum_like.hyper.gamma, pendulum_like.policy.normalize_obs), (0.9, false));
        assert_eq!(
            (remote.hyper.gamma, remote.policy.normalize_obs),
            (0.9, false),
            "a spec written before servers declared their label"
        );
        let discrete = spec(&["--env", "remote:cartpole"], Some(RemoteEnvConfig::new(service, 4, 2)));
        let cartpole = spec(&[], None);
        assert_eq!(discrete.hyper.loss, cartpole.hyper.loss);
        assert_eq!(
            (discrete.hyper.gamma, discrete.hyper.reward_scale),
            (cartpole.hyper.gamma, cartpole.hyper.reward_scale)
        );
        assert_eq!(
            (discrete.segment_len, discrete.hyper.batch_segments),
            (cartpole.segment_len, cartpole.hyper.batch_segments)
        );
    }

    /// Issue 45, item 2: MinAtar games train on unscaled rewards with an entropy bonus (without
    /// it Breakout seed 11 collapsed to a deterministic policy that scored 0), and flags still win.
    #[test]
    fn minatar_gets_an_entropy_bonus_on_unscaled_rewards() {
        let spec = |flags: &[&str]| train_spec(flags, None).expect("a valid spec");
        for game in
            ["minatar-breakout", "minatar-asterix", "minatar-freeway", "minatar-seaquest", "minatar-space-invaders"]
        {
            let minatar = spec(&["--env", game]);
            assert_eq!(
                (minatar.hyper.loss, minatar.hyper.reward_scale, minatar.hyper.ent_coef, minatar.hyper.learning_rate),
                (LossKind::Vtrace, 1.0, 0.02, 3e-3)
            );
            assert_eq!(minatar.hyper.final_ent_coef, Some(0.0), "{game}: the bonus decays to 0");
        }
        let breakout = spec(&["--env", "minatar-breakout"]);
        assert_eq!(
            (&breakout.policy.conv, &breakout.policy.torso, breakout.policy.activation),
            (&Some(ConvSpec::minatar(4, 10, 10)), &vec![128], Activation::Relu)
        );
        let tuned = spec(&["--env", "minatar-breakout", "--ent-coef", "0", "--reward-scale", "0.05", "--conv", "none"]);
        assert_eq!((tuned.hyper.ent_coef, tuned.hyper.reward_scale), (0.0, 0.05));
        // A bonus given on the command line is constant unless its end is given too.
        assert_eq!(tuned.hyper.final_ent_coef, None);
        let decaying = spec(&["--env", "minatar-breakout", "--ent-coef", "0.03", "--final-ent-coef", "0.001"]);
        assert_eq!((decaying.hyper.ent_coef, decaying.hyper.final_ent_coef), (0.03, Some(0.001)));
        let end_only = spec(&["--env", "minatar-breakout", "--final-ent-coef", "0.004"]);
        assert_eq!((end_only.hyper.ent_coef, end_only.hyper.final_ent_coef), (0.02, Some(0.004)));
        assert_eq!((&tuned.policy.conv, &tuned.policy.torso), (&None, &vec![128]));
        let cartpole = spec(&[]);
        assert_eq!((cartpole.hyper.ent_coef, cartpole.hyper.reward_scale), (0.0, 0.05));
    }

    /// `--critic` gives the value head its own network; it is refused, with the flag named, where
    /// a separate value network cannot read the observations (a conv torso, a recurrent core).
    #[test]
    fn the_critic_flag_builds_a_separate_value_network_where_one_fits() {
        let spec = |flags: &[&str]| train_spec(flags, None);
        assert_eq!(spec(&[]).expect("valid").policy.critic, Vec::<usize>::new());
        let separate = spec(&["--critic", "32, 16"]).expect("valid");
        assert_eq!(separate.policy.critic, [32, 16]);
        assert_eq!(spec(&["--env", "pendulum", "--critic", "64,64"]).expect("valid").policy.critic, [64, 64]);
        let bad_width = spec(&["--critic", "64,0"]).expect_err("a zero width");
        assert!(format!("{bad_width:#}").contains("--critic: width 0"), "{bad_width:#}");
        let not_a_width = spec(&["--critic", "wide"]).expect_err("not a number");
        assert!(format!("{not_a_width:#}").contains("--critic: \"wide\""), "{not_a_width:#}");
        for flags in [&["--core", "gru", "--critic", "16"][..], &["--env", "minatar-breakout", "--critic", "16"]] {
            let refused = spec(flags).expect_err("no separate value network there");
            assert!(format!("{refused:#}").contains("critic"), "{flags:?}: {refused:#}");
        }
    }

    /// Issue 11: PPO on discrete actions gets an entropy bonus of 0.01 by default (without it,
    /// distributed CartPole runs collapsed to a deterministic policy); V-trace and the Gaussian
    /// head keep 0, and the flag still wins.
    #[test]
    fn ppo_on_discrete_actions_defaults_to_an_entropy_bonus() {
        let ent_coef = |flags: &[&str]| train_spec(flags, None).expect("a valid spec").hyper.ent_coef;
        assert_eq!(ent_coef(&["--loss", "ppo"]), 0.01);
        assert_eq!(ent_coef(&[]), 0.0);
        assert_eq!(ent_coef(&["--env", "pendulum"]), 0.0);
        assert_eq!(ent_coef(&["--loss", "ppo", "--ent-coef", "0"]), 0.0);
        assert_eq!(ent_coef(&["--ent-coef", "0.02"]), 0.02);
    }

    #[test]
    fn group_flags_reach_the_spec_and_bad_combinations_are_refused() {
        let config =
            learner_config(&["--work", "--group-size", "8", "--group-share", "0.5", "--baseline", "group-std"])
                .expect("valid");
        let hyper = &config.spec.hyper;
        assert_eq!((hyper.work.group_size, hyper.work.group_share), (8, 0.5));
        assert_eq!(hyper.baseline, Baseline::GroupStd);
        let err = format!("{:#}", learner_config(&["--baseline", "group"]).expect_err("refused"));
        assert!(err.contains("needs group rollouts"), "{err}");
        let err = format!("{:#}", learner_config(&["--work", "--baseline", "group"]).expect_err("refused"));
        assert!(err.contains("group_size 1"), "{err}");
        let err =
            learner_config(&["--work", "--group-size", "4", "--baseline", "group", "--group-hold-segments", "995"])
                .expect_err("refused");
        assert!(err.to_string().contains("--group-hold-segments 995"), "{err}");
        let err = format!("{:#}", learner_config(&["--work", "--group-size", "65"]).expect_err("refused"));
        assert!(err.contains("work.group_size 65"), "{err}");
    }
}
