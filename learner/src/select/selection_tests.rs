//! Tests of [`super`]: the filters, the draw, group rollouts, and the pool's bookkeeping
//! (every token leaves exactly once), with properties over random arrival orders.

use super::*;
use proptest::prelude::*;
use volley_core::ids::RunId;
use volley_core::spec::{BpttConfig, HyperParams, SelectionConfig};
use volley_core::wire::EpisodeSummary;
use volley_env::EnvConfig;
use volley_policy::{Activation, PolicySpec};
use volley_testkit::fixtures::SegmentBuilder;

const T: usize = 4;

fn spec(batch_segments: usize, selection: SelectionConfig) -> RunSpec {
    RunSpec {
        run: RunId::new("select").expect("valid run id"),
        env: EnvConfig::Cartpole,
        policy: PolicySpec::mlp(4, 2, &[8], Activation::Tanh),
        segment_len: T,
        hyper: HyperParams {
            batch_segments,
            ppo_minibatches: 1,
            max_policy_lag: 2,
            selection,
            ..HyperParams::default()
        },
        seed: 7,
    }
}

fn learner_with(spec: &RunSpec, params: Vec<f32>) -> crate::Learner {
    crate::Learner::with_state(spec.clone(), params, PolicyVersion(0), 0).expect("valid state")
}

fn learner_for(spec: &RunSpec) -> crate::Learner {
    crate::Learner::new(spec.clone()).expect("valid spec")
}

fn selector(spec: &RunSpec) -> Selector {
    Selector::new(spec)
}

fn segment(idx: u64, version: u64, reward: f32) -> TrajectorySegment {
    SegmentBuilder::cartpole(T)
        .episode_id(idx)
        .segment_idx(idx)
        .version(version)
        .observations_from(|i| (i as f32 * 0.1 + idx as f32).sin() * 0.1)
        .reward(reward)
        .log_prob(-0.7)
        .build()
}

fn with_return(mut segment: TrajectorySegment, task_id: u32, start: Option<&str>, ret: f32) -> TrajectorySegment {
    segment.task_id = task_id;
    segment.start_snapshot = start.map(str::to_owned);
    segment.finished_episodes =
        vec![EpisodeSummary { episode_return: ret, episode_len: 3, ..EpisodeSummary::default() }];
    segment
}

/// A spec with group rollouts of `K = 4` and `baseline`.
/// A selector and a learner for [`group_spec`].
fn group_run(batch_segments: usize, baseline: Baseline, selection: SelectionConfig) -> (Selector, crate::Learner) {
    let spec = group_spec(batch_segments, baseline, selection);
    (selector(&spec), learner_for(&spec))
}

fn group_spec(batch_segments: usize, baseline: Baseline, selection: SelectionConfig) -> RunSpec {
    let mut spec = spec(batch_segments, selection);
    spec.hyper.baseline = baseline;
    spec.hyper.reward_scale = 0.5;
    spec.hyper.work = volley_core::work::WorkConfig {
        enabled: true,
        group_size: 4,
        group_hold_segments: 8,
        ..volley_core::work::WorkConfig::default()
    };
    spec
}

fn tag(group: u64, member: u32) -> GroupMember {
    GroupMember { group, member, size: 4 }
}

/// Segment `idx` of member `member` of `group`: the episode runs through the segment, and
/// with `ret` it ends at the last step with that return.
fn member_segment(idx: u64, version: u64, group: u64, member: u32, ret: Option<f32>) -> TrajectorySegment {
    let mut segment = segment(idx, version, 0.0);
    segment.episode_groups = vec![Some(tag(group, member))];
    if let Some(ret) = ret {
        segment.terminated[T - 1] = 1;
        segment.finished_episodes = vec![EpisodeSummary {
            episode_return: ret,
            episode_len: 9,
            group: Some(tag(group, member)),
            ..EpisodeSummary::default()
        }];
    }
    segment
}

fn reasons(dropped: &[Dropped]) -> Vec<(u64, &'static str)> {
    dropped.iter().map(|d| (d.token.0, d.reason.as_str())).collect()
}

#[test]
fn the_default_config_takes_the_first_batch_in_arrival_order_with_unit_weights() {
    let spec = spec(3, SelectionConfig::default());
    let mut selector = selector(&spec);
    assert_eq!(selector.pool_target(), 3);
    assert!(!selector.needs_values());
    let mut dropped = Vec::new();
    for idx in 0..3 {
        selector.offer(segment(idx, 0, 1.0), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
    }
    assert!(selector.prepare(PolicyVersion(0), &mut learner_for(&spec), &mut dropped));
    let draw = selector.draw();
    assert_eq!(draw.windows.iter().map(|w| w[0].segment_idx).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(draw.column_weights, &[1.0; 3]);
    let mut settled = Vec::new();
    assert_eq!(selector.settle_drawn(&mut settled), 3);
    assert_eq!(settled, vec![DeliveryToken(0), DeliveryToken(1), DeliveryToken(2)]);
    assert!(selector.is_empty() && dropped.is_empty());
}

#[test]
fn lag_bound_drops_on_arrival_and_again_in_the_pool() {
    let spec = spec(2, SelectionConfig::default());
    let mut selector = selector(&spec);
    let mut dropped = Vec::new();
    selector.offer(segment(0, 1, 1.0), DeliveryToken(0), PolicyVersion(4), &mut dropped); // lag 3 > 2
    selector.offer(segment(1, 2, 1.0), DeliveryToken(1), PolicyVersion(4), &mut dropped); // lag 2: kept
    assert_eq!(reasons(&dropped), vec![(0, "stale")]);
    assert_eq!(selector.len(), 1);
    // Two updates later it has aged past the bound while waiting.
    assert!(!selector.prepare(PolicyVersion(5), &mut learner_for(&spec), &mut dropped));
    assert_eq!(reasons(&dropped), vec![(0, "stale"), (1, "stale")]);
    assert!(selector.is_empty());
}

#[test]
fn guard_drops_absurd_and_overflowing_rewards_and_non_finite_returns() {
    let selection = SelectionConfig {
        guard: GuardConfig { enabled: true, max_abs_reward: Some(1e6) },
        ..SelectionConfig::default()
    };
    let mut spec = spec(4, selection);
    // A scale this large makes c·r + γ·V overflow for a raw reward within the bound.
    spec.hyper.reward_scale = 1e33;
    let mut selector = selector(&spec);
    let mut dropped = Vec::new();
    let mut absurd = segment(0, 0, 1.0);
    absurd.rewards[1] = -1e30;
    // A truncation bootstrap that overflows once added: the raw reward is within the bound.
    let mut overflowing = segment(1, 0, 1.0);
    overflowing.truncated[2] = 1;
    overflowing.truncation_values[2] = f32::MAX;
    overflowing.rewards[2] = 1e5;
    let mut bad_return = with_return(segment(2, 0, 1.0), 0, None, f32::NAN);
    bad_return.finished_episodes.push(EpisodeSummary {
        episode_return: 1.0,
        episode_len: 1,
        ..EpisodeSummary::default()
    });
    let fine = segment(3, 0, 1.0);
    for (idx, s) in [absurd, overflowing, bad_return, fine].into_iter().enumerate() {
        selector.offer(s, DeliveryToken(idx as u64), PolicyVersion(0), &mut dropped);
    }
    assert_eq!(reasons(&dropped), vec![(0, "out_of_range"), (1, "non_finite"), (2, "non_finite")]);
    assert_eq!(selector.len(), 1);

    // Without a raw bound an overflowing scaled reward is caught as non-finite; with the guard
    // switched off, nothing is checked.
    let mut spec = spec.clone();
    spec.hyper.selection.guard.max_abs_reward = None;
    for (idx, enabled, expected) in [(5, true, vec![(5, "non_finite")]), (6, false, vec![])] {
        spec.hyper.selection.guard.enabled = enabled;
        let mut selector = Selector::new(&spec);
        let mut overflowing = segment(idx, 0, 1.0);
        overflowing.rewards[0] = f32::MAX / 2.0;
        let mut dropped = Vec::new();
        selector.offer(overflowing, DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        assert_eq!(reasons(&dropped), expected, "guard enabled: {enabled}");
    }
}

#[test]
fn group_returns_window_and_spread() {
    let mut groups = GroupReturns::new(3, 2);
    groups.record(0, None, 1.0);
    groups.record(0, None, 1.0);
    assert!(!groups.is_zero_variance(0, None, 0.0), "window not full yet");
    groups.record(0, None, 1.0);
    assert!(groups.is_zero_variance(0, None, 0.0));
    groups.record(0, None, 1.5);
    assert!(!groups.is_zero_variance(0, None, 0.0));
    assert!(groups.is_zero_variance(0, None, 0.5), "spread within tolerance");
    groups.record(0, Some("s1"), 0.0);
    assert!(!groups.is_zero_variance(0, Some("s1"), 0.0), "another start is another group");
    groups.record(1, None, 0.0);
    assert_eq!(groups.len(), 2, "bounded: the oldest group was forgotten");
    assert!(!groups.is_zero_variance(0, None, 10.0));
}

#[test]
fn zero_variance_groups_are_dropped_once_the_group_is_large_enough() {
    let selection = SelectionConfig {
        zero_variance: Some(ZeroVarianceConfig { min_group: 3, tolerance: 0.0 }),
        ..SelectionConfig::default()
    };
    let spec = spec(2, selection);
    let mut selector = selector(&spec);
    let mut dropped = Vec::new();
    let v = PolicyVersion(0);
    // Start "a": three rollouts, all return 1 → no signal. Start "b": returns 0 and 1.
    // Task 1 from "a": only two rollouts, below min_group, kept.
    let offers = [
        with_return(segment(0, 0, 1.0), 0, Some("a"), 1.0),
        with_return(segment(1, 0, 1.0), 0, Some("b"), 0.0),
        with_return(segment(2, 0, 1.0), 0, Some("a"), 1.0),
        with_return(segment(3, 0, 1.0), 0, Some("b"), 1.0),
        with_return(segment(4, 0, 1.0), 1, Some("a"), 1.0),
        with_return(segment(5, 0, 1.0), 0, Some("a"), 1.0),
        segment(6, 0, 1.0), // "a" without a finished episode of its own: still its group
        with_return(segment(7, 0, 1.0), 1, Some("a"), 1.0),
    ];
    for (idx, mut s) in offers.into_iter().enumerate() {
        if idx == 6 {
            s.start_snapshot = Some("a".into());
        }
        selector.offer(s, DeliveryToken(idx as u64), v, &mut dropped);
    }
    assert!(dropped.is_empty(), "the filter runs before the step, not on arrival");
    assert!(selector.prepare(v, &mut learner_for(&spec), &mut dropped));
    assert_eq!(
        reasons(&dropped),
        vec![(0, "zero_variance"), (2, "zero_variance"), (5, "zero_variance"), (6, "zero_variance")]
    );
    let kept: Vec<u64> = selector.draw().windows.iter().map(|w| w[0].segment_idx).collect();
    assert_eq!(kept, vec![1, 3]);
}

#[test]
fn priority_sampling_scores_draws_and_weights_columns() {
    let selection = SelectionConfig {
        priority: Some(PriorityConfig { pool_factor: 2, alpha: 1.0, beta: 1.0, epsilon: 1e-3 }),
        ..SelectionConfig::default()
    };
    let spec = spec(3, selection);
    let layout = spec.validate().expect("valid");
    let params = layout.init_params(3);
    let mut learner = learner_with(&spec, params.clone());
    let mut selector = Selector::new(&spec);
    assert_eq!(selector.pool_target(), 6);
    assert!(selector.needs_values());
    let mut dropped = Vec::new();
    for idx in 0..5 {
        // Rewards of growing size: larger advantages under a near-zero initial value head.
        selector.offer(segment(idx, 0, idx as f32), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
    }
    assert!(!selector.prepare(PolicyVersion(0), &mut learner, &mut dropped), "pool not full");
    selector.offer(segment(5, 0, 5.0), DeliveryToken(5), PolicyVersion(0), &mut dropped);
    assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
    let priorities: Vec<f32> = selector.pool.iter().map(|c| c.priority.expect("scored")).collect();
    assert!(priorities.windows(2).all(|w| w[0] < w[1]), "priority grows with |advantage|: {priorities:?}");
    let draw = selector.draw();
    assert_eq!(draw.windows.len(), 3);
    assert!(draw.column_weights.iter().all(|&w| w > 0.0 && w <= 1.0));
    let mut settled = Vec::new();
    let distinct = selector.settle_drawn(&mut settled);
    assert_eq!(distinct, settled.len());
    assert_eq!(selector.len(), 6 - distinct);
    assert!(selector.pool.iter().all(|c| c.priority.is_some()), "leftovers keep their scores");

    // Non-finite parameters make every new value non-finite: dropped by the guard.
    let mut nan_learner = learner_with(&spec, vec![f32::NAN; params.len()]);
    for idx in 10..10 + distinct as u64 {
        selector.offer(segment(idx, 0, 1.0), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
    }
    assert!(!selector.prepare(PolicyVersion(0), &mut nan_learner, &mut dropped));
    assert_eq!(dropped.len(), distinct);
    assert!(dropped.iter().all(|d| d.reason == DropReason::NonFinite && d.token.0 >= 10));
}

#[test]
fn importance_weights_are_one_for_the_least_likely_and_shrink_with_probability() {
    let probs = [0.1, 0.2, 0.3, 0.4];
    let mut weights = Vec::new();
    importance_weights(&probs, &[0, 1, 3, 3], 1.0, &mut weights);
    let expected = [1.0, 0.5, 0.25, 0.25];
    for (w, e) in weights.iter().zip(expected) {
        assert!((w - e).abs() < 1e-6, "{weights:?}");
    }
    importance_weights(&probs, &[3], 0.0, &mut weights);
    assert_eq!(weights, vec![1.0], "β = 0: no correction");
}

#[test]
fn alpha_zero_is_uniform() {
    let mut probs = Vec::new();
    sampling_probabilities(&[0.1, 5.0, 100.0], 0.0, &mut probs);
    assert!(probs.iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-12));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn sampling_frequencies_match_the_probabilities(
        priorities in prop::collection::vec(0.01f32..10.0, 1..12),
        alpha in 0.0f32..2.0,
        seed in any::<u64>(),
    ) {
        let mut probs = Vec::new();
        sampling_probabilities(&priorities, alpha, &mut probs);
        prop_assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let n = 40_000;
        let mut rng = Pcg64Mcg::seed_from_u64(seed);
        let (mut cumulative, mut drawn) = (Vec::new(), Vec::new());
        sample_with_replacement(&probs, n, &mut rng, &mut cumulative, &mut drawn);
        let mut counts = vec![0usize; probs.len()];
        drawn.iter().for_each(|&i| counts[i] += 1);
        for (&count, &p) in counts.iter().zip(&probs) {
            // Five binomial standard deviations (plus a little slack for tiny p).
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            prop_assert!((count as f64 - n as f64 * p).abs() <= 5.0 * sd + 2.0,
                "count {} vs expected {} (p = {})", count, n as f64 * p, p);
        }
    }

    #[test]
    fn importance_weights_are_normalised_to_at_most_one(
        priorities in prop::collection::vec(0.001f32..100.0, 1..16),
        alpha in 0.0f32..2.0,
        beta in 0.0f32..=1.0,
    ) {
        let mut probs = Vec::new();
        sampling_probabilities(&priorities, alpha, &mut probs);
        let all: Vec<usize> = (0..probs.len()).collect();
        let mut weights = Vec::new();
        importance_weights(&probs, &all, beta, &mut weights);
        prop_assert!(weights.iter().all(|&w| w > 0.0 && w <= 1.0 + 1e-6));
        let max = weights.iter().copied().fold(0.0f32, f32::max);
        prop_assert!((max - 1.0).abs() < 1e-5, "the least likely segment has weight 1, max = {}", max);
        // A more likely segment never gets a larger weight.
        for i in 0..probs.len() {
            for j in 0..probs.len() {
                if probs[i] > probs[j] {
                    prop_assert!(weights[i] <= weights[j] + 1e-6);
                }
            }
        }
    }

    /// Random offers (some stale, some absurd, some of zero-variance groups), versions and
    /// draws: every token leaves the selector exactly once (dropped or settled) or is still
    /// in the pool, never twice.
    #[test]
    fn pool_bookkeeping_never_loses_or_double_acks_a_segment(
        ops in prop::collection::vec((0usize..6, 0u64..4, 0u8..4, prop::bool::ANY), 1..80),
        priority_on in prop::bool::ANY,
    ) {
        let selection = SelectionConfig {
            guard: GuardConfig { enabled: true, max_abs_reward: Some(100.0) },
            zero_variance: Some(ZeroVarianceConfig { min_group: 2, tolerance: 0.0 }),
            priority: priority_on.then(|| PriorityConfig { pool_factor: 2, ..PriorityConfig::default() }),
        };
        let spec = spec(2, selection);
        let layout = spec.validate().expect("valid");
        let mut learner = learner_with(&spec, layout.init_params(1));
        let mut selector = Selector::new(&spec);
        let mut version = 0u64;
        let mut next_token = 0u64;
        let mut offered = Vec::new();
        let mut dropped = Vec::new();
        let mut settled = Vec::new();
        for (n_offers, behind, kind, step) in ops {
            for _ in 0..n_offers {
                let reward = if kind == 3 { 1e4 } else { 1.0 };
                let mut s = segment(next_token, version.saturating_sub(behind), reward);
                if kind == 1 {
                    s = with_return(s, 0, Some("same"), 1.0);
                } else if kind == 2 {
                    s = with_return(s, 0, Some("varied"), next_token as f32);
                }
                selector.offer(s, DeliveryToken(next_token), PolicyVersion(version), &mut dropped);
                offered.push(next_token);
                next_token += 1;
            }
            if selector.prepare(PolicyVersion(version), &mut learner, &mut dropped) {
                let draw = selector.draw();
                prop_assert_eq!(draw.windows.len(), 2);
                let n = selector.settle_drawn(&mut settled);
                prop_assert!((1..=2).contains(&n));
                if step {
                    version += 1;
                }
            }
        }
        let mut seen: Vec<u64> = dropped.iter().map(|d| d.token.0).chain(settled.iter().map(|t| t.0)).collect();
        seen.extend(selector.pool.iter().flat_map(|c| c.window.tokens.iter().map(|t| t.0)));
        seen.sort_unstable();
        prop_assert_eq!(seen, offered);
    }

    /// Issue 18, stitched windows of 2 segments from 3 streams with gaps, stale segments
    /// and priority sampling or not: every draw is `batch_segments / K` windows of
    /// consecutive segments, and every token leaves exactly once (dropped, settled, or still
    /// in the pool or held for a window).
    #[test]
    fn stitched_windows_never_lose_or_double_ack_a_segment(
        ops in prop::collection::vec((0usize..6, 0u64..4, prop::bool::ANY, prop::bool::ANY), 1..60),
        priority_on in prop::bool::ANY,
    ) {
        let selection = SelectionConfig {
            priority: priority_on.then(|| PriorityConfig { pool_factor: 2, ..PriorityConfig::default() }),
            ..SelectionConfig::default()
        };
        let mut spec = spec(4, selection);
        spec.policy = PolicySpec::gru(4, 2, &[8], Activation::Tanh, 3);
        spec.hyper.bptt = BpttConfig { segments: 2, ..BpttConfig::default() };
        let layout = spec.validate().expect("valid");
        let mut learner = learner_with(&spec, layout.init_params(1));
        let mut selector = Selector::new(&spec);
        let (mut version, mut next_token) = (0u64, 0u64);
        let mut next_idx = [0u64; 3];
        let (mut offered, mut dropped, mut settled) = (Vec::new(), Vec::new(), Vec::new());
        for (n_offers, behind, gap, step) in ops {
            for _ in 0..n_offers {
                let env = (next_token % 3) as usize;
                next_idx[env] += u64::from(gap && next_token % 5 == 0);
                let idx = next_idx[env];
                next_idx[env] += 1;
                let mut s = SegmentBuilder::cartpole(T)
                    .env_idx(env as u32)
                    .segment_idx(idx)
                    .version(version.saturating_sub(behind))
                    .observations_from(|i| ((idx as usize * T + i / 4) as f32 * 0.1).sin())
                    .log_prob(-0.7)
                    .initial_hidden(vec![0.1; 3])
                    .build();
                s.env_idx = env as u32;
                selector.offer(s, DeliveryToken(next_token), PolicyVersion(version), &mut dropped);
                offered.push(next_token);
                next_token += 1;
            }
            if selector.prepare(PolicyVersion(version), &mut learner, &mut dropped) {
                let draw = selector.draw();
                prop_assert_eq!((draw.windows.len(), draw.window_segments), (2, 2));
                for window in &draw.windows {
                    for pair in window.windows(2) {
                        prop_assert!(crate::select::windows::continues(&pair[0], &pair[1]));
                    }
                }
                selector.settle_drawn(&mut settled);
                if step {
                    version += 1;
                }
            }
        }
        let mut held = Vec::new();
        selector.assembler.flush_all(&mut held);
        let mut seen: Vec<u64> = dropped.iter().map(|d| d.token.0).chain(settled.iter().map(|t| t.0)).collect();
        seen.extend(selector.pool.iter().flat_map(|c| c.window.tokens.iter().map(|t| t.0)));
        seen.extend(held.iter().flat_map(|w| w.tokens.iter().map(|t| t.0)));
        seen.sort_unstable();
        prop_assert_eq!(seen, offered);
    }
}

/// Issue 18, item 2: on a hand-built group (returns 1, 0, 0, 3, so the mean is 1), every
/// step of member k gets `reward_scale · (G_k − mean G)`, and nothing is trained on before
/// the group is complete.
#[test]
fn group_advantages_are_each_members_return_minus_the_group_mean() {
    let (mut selector, mut learner) = group_run(9, Baseline::Group, SelectionConfig::default());
    let mut dropped = Vec::new();
    let returns = [1.0, 0.0, 0.0, 3.0];
    // Each member's episode spans two segments; the first ones arrive before any return.
    for member in 0..4u32 {
        let idx = u64::from(member) * 2;
        selector.offer(member_segment(idx, 0, 50, member, None), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
    }
    for member in 0..3u32 {
        let idx = u64::from(member) * 2 + 1;
        let last = member_segment(idx, 0, 50, member, Some(returns[member as usize]));
        selector.offer(last, DeliveryToken(idx), PolicyVersion(0), &mut dropped);
    }
    // An ungrouped segment goes straight to the pool.
    selector.offer(segment(99, 0, 1.0), DeliveryToken(99), PolicyVersion(0), &mut dropped);
    assert!(!selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
    assert_eq!((selector.held(), selector.len()), (7, 1), "the incomplete group waits outside the pool");
    selector.offer(member_segment(7, 0, 50, 3, Some(3.0)), DeliveryToken(7), PolicyVersion(0), &mut dropped);
    assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
    assert!(dropped.is_empty());
    assert_eq!(selector.held(), 0);
    let draw = selector.draw();
    let segments: Vec<&TrajectorySegment> = draw.windows.iter().map(|w| &w[0]).collect();
    for (segment, advantages) in segments.iter().zip(&draw.advantages) {
        match segment.episode_groups.first().copied().flatten() {
            Some(tag) => {
                let expected = 0.5 * (returns[tag.member as usize] - 1.0);
                assert_eq!(advantages.expect("a grouped segment has advantages"), &[expected; T][..]);
            }
            None => assert!(advantages.is_none(), "the ungrouped segment keeps the critic's"),
        }
    }
    let mut batch = SegmentBatch::default();
    batch.fill(&segments, 0.99, 0.5, draw.column_weights);
    batch.set_advantage_override(&draw.advantages);
    let column = segments.iter().position(|s| s.segment_idx == 7).expect("member 3's last segment");
    assert_eq!(batch.advantage_override[(T - 1) * 9 + column], 1.0);
    let stats = selector.group_stats();
    assert_eq!((stats.segments_grouped, stats.groups.completed), (8, 1));
}

/// The zero-variance filter on groups: a complete group whose returns are all equal is
/// dropped, whatever the baseline; a group with spread is kept.
#[test]
fn zero_variance_groups_of_continuations_are_dropped_when_complete() {
    let zero = SelectionConfig {
        zero_variance: Some(ZeroVarianceConfig { min_group: 2, tolerance: 0.0 }),
        ..SelectionConfig::default()
    };
    let (mut selector, mut learner) = group_run(4, Baseline::Critic, zero);
    let mut dropped = Vec::new();
    for member in 0..4u32 {
        let flat = member_segment(u64::from(member), 0, 1, member, Some(0.0));
        selector.offer(flat, DeliveryToken(u64::from(member)), PolicyVersion(0), &mut dropped);
        let spread = member_segment(10 + u64::from(member), 0, 2, member, Some(member as f32));
        selector.offer(spread, DeliveryToken(10 + u64::from(member)), PolicyVersion(0), &mut dropped);
    }
    assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
    assert_eq!(reasons(&dropped), (0..4).map(|t| (t, "zero_variance")).collect::<Vec<_>>());
    let draw = selector.draw();
    assert!(draw.windows.iter().all(|w| w[0].segment_idx >= 10));
    assert!(draw.advantages.iter().all(Option::is_none), "the critic baseline adds no group advantages");
}

/// docs/SECURITY.md: segments naming groups that never complete (forged ids, or members
/// that never report) cannot pile up: the hold keeps at most `group_hold_segments`, the
/// oldest go to the critic (counted), and a segment at the lag bound goes too.
#[test]
fn a_flood_of_forged_group_ids_stays_bounded_and_falls_back_to_the_critic() {
    let (mut selector, mut learner) = group_run(4, Baseline::Group, SelectionConfig::default());
    let mut dropped = Vec::new();
    for idx in 0..1000u64 {
        let forged = member_segment(idx, 0, 1_000_000 + idx, (idx % 4) as u32, None);
        selector.offer(forged, DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        selector.prepare(PolicyVersion(0), &mut learner, &mut dropped);
        assert!(selector.held() <= 8, "the hold stays within its bound");
    }
    let stats = selector.group_stats();
    assert_eq!(stats.segments_critic_capacity, 1000 - 8);
    assert_eq!(selector.len(), 1000 - 8, "released segments are trained on with the critic");
    assert!(dropped.is_empty(), "nothing is dropped silently");
    // Two versions later (the test spec's lag bound) the rest go to the critic as well.
    selector.prepare(PolicyVersion(2), &mut learner, &mut dropped);
    assert_eq!(selector.held(), 0);
    assert_eq!(selector.group_stats().segments_critic_lag, 8);
}
