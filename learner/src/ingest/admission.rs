//! Admission: the learner's trust checks on every decoded, spec-valid segment, before it can
//! influence anything (the duplicate filter, return statistics, the scheduler, selection, the
//! update).
//!
//! Decode ([`TrajectorySegment::validate`]) checks what the wire format and the run spec
//! define: run, layout, shapes, action range, finiteness. Admission checks what an actor could
//! claim falsely within that format (docs/SECURITY.md, "What a compromised actor can do"):
//!
//! - **versions**: a behaviour version above the learner's own is impossible for an honest
//!   actor (it only runs published versions), so it is rejected as `future_version` instead
//!   of being trained on with lag 0;
//! - **rewards**: every reward within the environment's per-step bound
//!   ([`volley_env::EnvBounds`]), every truncation value within what that bound allows
//!   over a horizon (`reward_bound`);
//! - **episode summaries** (`episode_summary`): at most one per episode end in the segment;
//!   lengths at least 1 and within the time limit of the episode's task; returns within the bound times the length;
//!   and, when every episode end has its summary, each return equal to the segment's own
//!   rewards over the steps the episode spent in the segment, up to the bound times the steps
//!   it spent before (a fresh episode that started inside the segment must match exactly);
//! - **ids** (`bad_id`): snapshot keys of at most [`MAX_KEY_BYTES`] of `[A-Za-z0-9_.-]`, task
//!   ids within the run's tasks, and at most one saved snapshot per step. The run and actor ids
//!   are typed ([`volley_core::ids::RunId`], [`volley_core::ids::ActorId`]): one that breaks
//!   their rules fails to decode, counted as `bad_id` too ([`volley_core::wire::DecodeError::BadId`]).
//!
//! A rejected segment is counted under [`Rejection::reason`], logged and acknowledged, like a
//! malformed one.

use volley_core::ids::PolicyVersion;
use volley_core::spec::RunSpec;
use volley_core::wire::TrajectorySegment;
use volley_env::EnvBounds;

/// Longest snapshot key a segment may name (keys are `w<item>-e<episode>-s<steps>`).
pub const MAX_KEY_BYTES: usize = 128;

/// Why admission refused a segment.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejection {
    /// The segment's body names another actor than the subject it was published on.
    #[error("the segment names actor {body:?} but was published on the subject of actor {subject:?}")]
    ActorMismatch {
        /// The actor token of the subject (cut to 64 characters).
        subject: String,
        /// The actor id in the body.
        body: String,
    },
    /// The behaviour version is above the learner's version.
    #[error("behaviour version {segment} is above the learner's version {learner}")]
    FutureVersion {
        /// The segment's behaviour version.
        segment: u64,
        /// The learner's version when the segment arrived.
        learner: u64,
    },
    /// A reward or truncation value is beyond the environment's bound.
    #[error("{field} {value} at step {step} exceeds the bound {bound}")]
    RewardBound {
        /// Which field.
        field: &'static str,
        /// The step.
        step: usize,
        /// The value.
        value: f32,
        /// The bound.
        bound: f32,
    },
    /// An episode summary the segment cannot back.
    #[error("episode summary: {0}")]
    EpisodeSummary(String),
    /// An id or key of the wrong length or charset, or an unknown task.
    #[error("{field}: {problem}")]
    BadId {
        /// Which field.
        field: &'static str,
        /// What is wrong (the value is cut to 64 characters).
        problem: String,
    },
}

impl Rejection {
    /// Every value [`Rejection::reason`] can return (metrics export each at 0 from the start).
    pub const REASONS: &'static [&'static str] =
        &["future_version", "reward_bound", "episode_summary", "bad_id", "actor_mismatch"];

    /// Bounded label for the `reason` of `volley_learner_segments_rejected_total`; one of
    /// [`Rejection::REASONS`].
    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::FutureVersion { .. } => "future_version",
            Rejection::RewardBound { .. } => "reward_bound",
            Rejection::EpisodeSummary(_) => "episode_summary",
            Rejection::BadId { .. } => "bad_id",
            Rejection::ActorMismatch { .. } => "actor_mismatch",
        }
    }
}

/// The checks of one run (see the module docs).
#[derive(Debug, Clone)]
pub struct Admission {
    /// The loosest bounds over the run's tasks.
    bounds: EnvBounds,
    /// Each task's time limit (`task_id` order; the run's env alone without a task list).
    task_max_len: Vec<Option<u64>>,
    /// The run env's time limit: an actor's slots run the run's env until their first work
    /// item, and report those unscheduled episodes as task 0.
    env_max_len: Option<u64>,
    max_abs_value: f32,
    n_tasks: u32,
}

impl Admission {
    /// The checks for a validated run spec.
    pub fn new(spec: &RunSpec) -> Self {
        // A run's tasks may differ in time limit and reward bound (e.g. chains of several
        // lengths): rewards and values are checked against the loosest task, episode lengths
        // against their own task's limit.
        let tasks = spec.hyper.work.task_list(&spec.env);
        let task_max_len: Vec<Option<u64>> = tasks.iter().map(|task| task.bounds().max_episode_len).collect();
        let bounds = tasks.iter().map(|task| task.bounds()).fold(spec.env.bounds(), |a, b| EnvBounds {
            max_abs_reward: a.max_abs_reward.max(b.max_abs_reward),
            max_episode_len: a.max_episode_len.zip(b.max_episode_len).map(|(a, b)| a.max(b)),
        });
        // A value estimate predicts a (scaled) return: at most the reward bound per step over
        // the horizon, the time limit or the discount's effective horizon 1 / (1 − γ). Twice
        // that leaves room for an untrained value head's overshoot.
        let discount_horizon = if spec.hyper.gamma < 1.0 { 1.0 / (1.0 - f64::from(spec.hyper.gamma)) } else { 1e6 };
        let horizon = bounds.max_episode_len.map_or(discount_horizon, |len| discount_horizon.min(len as f64));
        let scale = f64::from(spec.hyper.reward_scale.abs()).max(1.0);
        let max_abs_value = (2.0 * f64::from(bounds.max_abs_reward) * scale * horizon + 10.0).min(f64::from(f32::MAX));
        Admission {
            bounds,
            task_max_len,
            env_max_len: spec.env.bounds().max_episode_len,
            max_abs_value: max_abs_value as f32,
            n_tasks: spec.hyper.work.tasks.len().max(1) as u32,
        }
    }

    /// The environment bounds admission applies.
    pub fn bounds(&self) -> EnvBounds {
        self.bounds
    }

    /// Check one segment received while the learner is at `learner_version`.
    pub fn check(&self, segment: &TrajectorySegment, learner_version: PolicyVersion) -> Result<(), Rejection> {
        check_ids(segment, self.n_tasks)?;
        if segment.policy_version > learner_version {
            return Err(Rejection::FutureVersion { segment: segment.policy_version.0, learner: learner_version.0 });
        }
        let bound = self.bounds.max_abs_reward;
        if let Some((step, &value)) = segment.rewards.iter().enumerate().find(|(_, r)| r.abs() > bound) {
            return Err(Rejection::RewardBound { field: "reward", step, value, bound });
        }
        let value_bound = self.max_abs_value;
        if let Some((step, &value)) = segment.truncation_values.iter().enumerate().find(|(_, v)| v.abs() > value_bound)
        {
            return Err(Rejection::RewardBound { field: "truncation value", step, value, bound: value_bound });
        }
        self.check_episodes(segment)
    }

    fn check_episodes(&self, segment: &TrajectorySegment) -> Result<(), Rejection> {
        let is_done = |t: usize| segment.terminated[t] != 0 || segment.truncated[t] != 0;
        let t_len = segment.len();
        let n_dones = (0..t_len).filter(|&t| is_done(t)).count();
        let episodes = &segment.finished_episodes;
        if episodes.len() > n_dones {
            return Err(Rejection::EpisodeSummary(format!(
                "{} episodes claimed, {n_dones} ended in the segment",
                episodes.len()
            )));
        }
        let bound = f64::from(self.bounds.max_abs_reward);
        // Every episode end has its summary, in order: the k-th summary is the episode that
        // ended at the k-th done step (with an aborted episode in the segment the mapping is
        // unknown, and only the bounds below apply).
        let mapped = episodes.len() == n_dones;
        let mut done_steps = (0..t_len).filter(|&t| is_done(t));
        let mut previous_end: Option<usize> = None;
        for (k, episode) in episodes.iter().enumerate() {
            let len = u64::from(episode.episode_len);
            let ret = f64::from(episode.episode_return);
            if len == 0 {
                return Err(Rejection::EpisodeSummary(format!("episode {k} has length 0")));
            }
            let mut time_limit =
                self.task_max_len.get(episode.task_id as usize).copied().unwrap_or(self.bounds.max_episode_len);
            if episode.work_item.is_none() {
                time_limit = time_limit.zip(self.env_max_len).map(|(a, b)| a.max(b));
            }
            if let Some(max_len) = time_limit.filter(|&max| len > max) {
                return Err(Rejection::EpisodeSummary(format!(
                    "episode {k} claims {len} steps, the time limit is {max_len}"
                )));
            }
            if !ret.is_finite() || ret.abs() > bound * len as f64 * (1.0 + 1e-5) + 1e-3 {
                return Err(Rejection::EpisodeSummary(format!(
                    "episode {k} claims return {ret} over {len} steps, at most {} per step",
                    self.bounds.max_abs_reward
                )));
            }
            if !mapped {
                continue;
            }
            let end = done_steps.next().expect("as many done steps as summaries");
            let start = previous_end.map_or(0, |previous| previous + 1);
            let steps_in_segment = (end + 1 - start) as u64;
            let partial: f64 = segment.rewards[start..=end].iter().map(|&r| f64::from(r)).sum();
            // Episodes that started in an earlier segment, or resumed from a saved state, had
            // steps before these; a fresh episode that started here had none.
            let started_here_fresh = previous_end.is_some() && episode.start.is_none();
            let steps_before = len.checked_sub(steps_in_segment).ok_or_else(|| {
                Rejection::EpisodeSummary(format!(
                    "episode {k} claims {len} steps but spent {steps_in_segment} in the segment"
                ))
            })?;
            if started_here_fresh && steps_before != 0 {
                return Err(Rejection::EpisodeSummary(format!(
                    "episode {k} started fresh in the segment: {steps_in_segment} steps, not {len}"
                )));
            }
            let tolerance = 1e-4 * (ret.abs() + partial.abs() + bound * len as f64) + 1e-3;
            if (ret - partial).abs() > bound * steps_before as f64 + tolerance {
                return Err(Rejection::EpisodeSummary(format!(
                    "episode {k} claims return {ret}; its {steps_in_segment} steps here earned {partial} and \
                     its {steps_before} steps before can add at most {}",
                    bound * steps_before as f64
                )));
            }
            previous_end = Some(end);
        }
        Ok(())
    }
}

/// Identity (issue 46 item 3): a segment published on the subject of actor `subject_actor`
/// (`volley.<run>.traj.<actor>`, lowercase) must name that actor in its body. Broker
/// permissions bind the subject to the publisher's credentials (one NKey identity per actor,
/// `volley_transport::nats::identity`) while the body is whatever the publisher wrote, so the
/// subject is the identity the learner trusts, and a body that names another actor is
/// refused as `actor_mismatch` before the segment can count under that actor (its return
/// share, its work items, its streams). `None` (the in-process bus) checks nothing.
pub fn check_identity(segment: &TrajectorySegment, subject_actor: Option<&str>) -> Result<(), Rejection> {
    let Some(subject) = subject_actor else { return Ok(()) };
    if segment.actor.as_str().eq_ignore_ascii_case(subject) && subject.bytes().all(|b| !b.is_ascii_uppercase()) {
        return Ok(());
    }
    Err(Rejection::ActorMismatch { subject: cut(subject).to_string(), body: segment.actor.as_str().to_string() })
}

/// The identity a segment counts under once [`check_identity`] passed: the actor id
/// lowercased, as its subject carries it, hashed like the other per-actor keys
/// ([`volley_core::wire::id_hash`]). Ids that differ only in case publish on one subject, so
/// they are one identity.
pub fn identity_key(segment: &TrajectorySegment) -> u64 {
    volley_core::wire::id_hash(segment.actor.as_str().to_ascii_lowercase().as_bytes())
}

/// The ids and keys a segment carries, and its task ids.
fn check_ids(segment: &TrajectorySegment, n_tasks: u32) -> Result<(), Rejection> {
    let keys = segment
        .start_snapshot
        .iter()
        .map(|key| ("start_snapshot", key))
        .chain(segment.finished_episodes.iter().filter_map(|e| e.start.as_ref()).map(|key| ("episode start", key)))
        .chain(segment.saved_snapshots.iter().map(|info| ("saved snapshot", &info.key)));
    for (field, key) in keys {
        check_key(field, key)?;
    }
    if segment.saved_snapshots.len() > segment.len() {
        return Err(Rejection::BadId {
            field: "saved snapshots",
            problem: format!("{} in a segment of {} steps", segment.saved_snapshots.len(), segment.len()),
        });
    }
    let tasks = std::iter::once(segment.task_id)
        .chain(segment.finished_episodes.iter().map(|e| e.task_id))
        .chain(segment.saved_snapshots.iter().map(|info| info.task_id));
    for task_id in tasks {
        if task_id >= n_tasks {
            return Err(Rejection::BadId { field: "task_id", problem: format!("{task_id}, the run has {n_tasks}") });
        }
    }
    if let Some(info) =
        segment.saved_snapshots.iter().find(|i| !(i.progress.is_finite() && i.episode_return.is_finite()))
    {
        return Err(Rejection::BadId {
            field: "saved snapshot",
            problem: format!("{}: non-finite statistics", info.key),
        });
    }
    Ok(())
}

fn check_key(field: &'static str, key: &str) -> Result<(), Rejection> {
    let valid = !key.is_empty()
        && key.len() <= MAX_KEY_BYTES
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        return Ok(());
    }
    Err(Rejection::BadId {
        field,
        problem: format!("{:?} ({} bytes): expected 1-{MAX_KEY_BYTES} of [A-Za-z0-9_.-]", cut(key), key.len()),
    })
}

/// At most 64 characters of an untrusted string, for messages and validation errors.
fn cut(value: &str) -> &str {
    match value.char_indices().nth(65) {
        Some((end, _)) => &value[..end],
        None => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_core::wire::EpisodeSummary;
    use volley_core::work::SnapshotInfo;
    use volley_env::{EnvConfig, MilestonesConfig};
    use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

    const T: usize = 8;

    #[test]
    fn every_reason_is_listed_in_reasons() {
        let rejections = [
            Rejection::FutureVersion { segment: 2, learner: 1 },
            Rejection::RewardBound { field: "rewards", step: 0, value: 1.0, bound: 0.5 },
            Rejection::EpisodeSummary(String::new()),
            Rejection::BadId { field: "actor", problem: String::new() },
            Rejection::ActorMismatch { subject: String::new(), body: String::new() },
        ];
        let reasons: Vec<_> = rejections.iter().map(Rejection::reason).collect();
        assert_eq!(reasons, Rejection::REASONS);
    }

    fn spec() -> RunSpec {
        SpecBuilder::cartpole(T).run("trust").build()
    }

    /// A CartPole segment as an honest actor sends it: reward 1 per step; an episode that
    /// began 10 steps before the segment ends at step 2, a fresh one ends at step 5.
    fn segment() -> TrajectorySegment {
        SegmentBuilder::cartpole(T)
            .actor("actor-0")
            .incarnation(1)
            .segment_idx(3)
            .version(5)
            .terminal_at(2)
            .terminal_at(5)
            .log_prob(-0.7)
            .episode(13.0, 13)
            .episode(3.0, 3)
            .build()
    }

    fn check(segment: &TrajectorySegment) -> Result<(), &'static str> {
        Admission::new(&spec()).check(segment, PolicyVersion(7)).map_err(|r| r.reason())
    }

    #[test]
    fn an_honest_segment_is_admitted() {
        assert_eq!(check(&segment()), Ok(()));
        let mut aborted = segment();
        aborted.truncated[7] = 1;
        assert_eq!(check(&aborted), Ok(()), "an aborted episode has no summary");
    }

    /// Issue 12: segments claiming a behaviour version above the learner's (+1000, 2^63,
    /// 2^64 − 1) were trained on with lag 0 and counted nowhere.
    #[test]
    fn future_versions_are_rejected() {
        for version in [8, 7 + 1000, 1 << 63, u64::MAX] {
            let mut s = segment();
            s.policy_version = PolicyVersion(version);
            assert_eq!(check(&s), Err("future_version"), "version {version}");
        }
        let mut current = segment();
        current.policy_version = PolicyVersion(7);
        assert_eq!(check(&current), Ok(()));
    }

    /// Issue 12: a reward of 1e30 was trained on (gradient norm 1e28, loss inf).
    #[test]
    fn rewards_and_truncation_values_beyond_the_bounds_are_rejected() {
        let mut s = segment();
        s.rewards[4] = 1e30;
        assert_eq!(check(&s), Err("reward_bound"));
        let mut s = segment();
        s.rewards[0] = 1.5;
        assert_eq!(check(&s), Err("reward_bound"), "cartpole pays at most 1 per step");
        let mut s = segment();
        s.truncated[7] = 1;
        s.truncation_values[7] = 1e30;
        assert_eq!(check(&s), Err("reward_bound"));
        s.truncation_values[7] = 50.0;
        assert_eq!(check(&s), Ok(()));
    }

    /// Issue 12: one summary claiming a return of 1e30 stopped the run as solved, and 20,000
    /// fake episodes in one segment set the mean return.
    #[test]
    fn episode_summaries_the_segment_cannot_back_are_rejected() {
        type Forgery = fn(&mut [EpisodeSummary]);
        let forgeries: [(&str, Forgery); 6] = [
            ("a return of 1e30", |e| e[0].episode_return = 1e30),
            ("beyond CartPole's time limit", |e| (e[0].episode_len, e[0].episode_return) = (501, 501.0)),
            ("a fresh episode's return is its rewards' sum", |e| e[1].episode_return = 4.0),
            ("a fresh episode's length is its steps here", |e| (e[1].episode_len, e[1].episode_return) = (30, 30.0)),
            ("shorter than its steps in the segment", |e| (e[0].episode_len, e[0].episode_return) = (2, 2.0)),
            ("an episode of no steps", |e| e[0].episode_len = 0),
        ];
        for (what, forge) in forgeries {
            let mut s = segment();
            forge(&mut s.finished_episodes);
            assert_eq!(check(&s), Err("episode_summary"), "{what}");
        }
        let mut s = segment();
        s.finished_episodes =
            vec![EpisodeSummary { episode_return: 1.0, episode_len: 1, ..Default::default() }; 20_000];
        assert_eq!(check(&s), Err("episode_summary"), "more episodes than episode ends");
        let mut s = segment();
        s.rewards[0] = 0.0;
        assert_eq!(check(&s), Err("episode_summary"), "13 claimed: 2 earned here, at most 10 before");
        s.finished_episodes[0].episode_return = 12.0;
        assert_eq!(check(&s), Ok(()), "2 earned here and 10 before");
    }

    /// Multi-task runs whose tasks have other time limits than the run's env (e.g. memory with
    /// delays 2..32 on a run env of delay 6) had every segment ending a longer episode
    /// rejected: only the run env's task ever reported a finished episode.
    #[test]
    fn episode_lengths_are_checked_against_their_own_task() {
        let memory = |delay| EnvConfig::Memory(volley_env::MemoryConfig { delay, ..Default::default() });
        let mut spec = SpecBuilder::cartpole(T).run("tasks").env(memory(6), 1, 2).build();
        spec.hyper.work.enabled = true;
        spec.hyper.work.tasks = vec![memory(2), memory(32)];
        let admission = Admission::new(&spec);
        let summary = |task_id, len| EpisodeSummary {
            task_id,
            episode_len: len,
            episode_return: 0.0,
            work_item: Some(1),
            ..Default::default()
        };
        let mut s = SegmentBuilder::new(T, 1).terminal_at(2).build();
        s.finished_episodes = vec![summary(1, 34)];
        s.rewards.fill(0.0);
        assert_eq!(admission.check(&s, PolicyVersion(0)), Ok(()), "delay 32: 34 steps");
        s.finished_episodes = vec![summary(1, 35)];
        assert!(matches!(admission.check(&s, PolicyVersion(0)), Err(Rejection::EpisodeSummary(_))));
        s.finished_episodes = vec![summary(0, 5)];
        assert!(matches!(admission.check(&s, PolicyVersion(0)), Err(Rejection::EpisodeSummary(_))), "delay 2: 4 steps");
        s.finished_episodes = vec![summary(0, 4)];
        assert_eq!(admission.check(&s, PolicyVersion(0)), Ok(()));
        // Unscheduled episodes (no work item) may be the run env's: delay 6, 8 steps.
        s.finished_episodes = vec![EpisodeSummary { work_item: None, ..summary(0, 8) }];
        assert_eq!(admission.check(&s, PolicyVersion(0)), Ok(()));
        s.finished_episodes = vec![EpisodeSummary { work_item: None, ..summary(0, 9) }];
        assert!(matches!(admission.check(&s, PolicyVersion(0)), Err(Rejection::EpisodeSummary(_))));
    }

    #[test]
    fn resumed_episodes_may_have_steps_before_the_segment() {
        let mut s = segment();
        s.finished_episodes[1].start = Some("w1-e0-s40".into());
        s.finished_episodes[1].episode_len = 43;
        s.finished_episodes[1].episode_return = 43.0;
        assert_eq!(check(&s), Ok(()));
        s.finished_episodes[1].episode_return = 60.0;
        assert_eq!(check(&s), Err("episode_summary"));
    }

    /// Issue 12: 200 segments with ~1 MB actor ids took the learner from 44 MB to 450 MB.
    #[test]
    fn long_or_odd_ids_and_keys_and_unknown_tasks_are_rejected() {
        // Over-long and odd actor ids no longer decode (`wire::DecodeError::BadId`, tested there).
        let mut s = segment();
        s.start_snapshot = Some("k".repeat(MAX_KEY_BYTES + 1));
        assert_eq!(check(&s), Err("bad_id"));
        let mut s = segment();
        s.finished_episodes[0].start = Some("w1-e0_s8.v2".into());
        assert_eq!(check(&s), Ok(()), "dots, dashes and underscores are allowed");
        s.finished_episodes[0].start = Some("../b".into());
        assert_eq!(check(&s), Err("bad_id"));
        let mut s = segment();
        s.task_id = 1;
        assert_eq!(check(&s), Err("bad_id"));
        let info =
            SnapshotInfo { key: "w1-e0-s8".into(), task_id: 0, progress: 1.0, episode_return: 1.0, episode_len: 8 };
        let mut s = segment();
        s.saved_snapshots = vec![info.clone(); T + 1];
        assert_eq!(check(&s), Err("bad_id"));
        s.saved_snapshots = vec![SnapshotInfo { progress: f32::NAN, ..info }];
        assert_eq!(check(&s), Err("bad_id"));
    }

    /// Issue 46 item 3: the subject's actor is the identity; a body naming another is refused.
    #[test]
    fn a_segment_must_name_the_actor_of_its_subject() {
        let s = segment();
        assert_eq!(check_identity(&s, None), Ok(()), "the in-process bus has no subjects");
        assert_eq!(check_identity(&s, Some("actor-0")), Ok(()));
        let mut upper = segment();
        upper.actor = volley_core::ids::ActorId::new("Actor-0").expect("valid id");
        assert_eq!(check_identity(&upper, Some("actor-0")), Ok(()), "subjects carry ids lowercased");
        assert_eq!(identity_key(&upper), identity_key(&s), "one subject, one identity");
        for subject in ["actor-1", "Actor-0", "actor-0.x", ""] {
            let refused = check_identity(&s, Some(subject)).map_err(|r| r.reason());
            assert_eq!(refused, Err("actor_mismatch"), "subject {subject:?}");
        }
    }

    #[test]
    fn built_in_bounds_hold_what_the_environments_produce() {
        let milestones = EnvConfig::Milestones(MilestonesConfig::default()).bounds();
        assert_eq!((milestones.max_abs_reward, milestones.max_episode_len), (1.0, Some(128)));
        assert_eq!(EnvConfig::Cartpole.bounds().max_episode_len, Some(500));
    }
}
