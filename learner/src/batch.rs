//! Assembling segments into a time-major batch `[T][B]` (one column per segment).

use volley_core::ids::PolicyVersion;
use volley_core::wire::TrajectorySegment;

/// The segments used by one learner step, laid out time-major with one column per segment.
///
/// Rewards are scaled by the run's `reward_scale` and already include the bootstrap through
/// time limits: where step `t` was truncated, `rewards[t] = c·r_t + γ·V_μ(x_final)` and
/// `discounts[t] = 0` (as Stable-Baselines3 does), so
/// the return estimators only ever see terminations.
#[derive(Debug, Default, Clone)]
pub struct SegmentBatch {
    /// Steps per segment (T).
    pub t_len: usize,
    /// Segments (B).
    pub b_len: usize,
    /// Observation width.
    pub obs_dim: usize,
    /// Recurrent state width (0 for feed-forward).
    pub hidden_size: usize,
    /// `[T + 1][B][obs_dim]`.
    pub observations: Vec<f32>,
    /// `[T + 1][B]`: 1 where a new episode starts at that step (recurrent state reset).
    pub episode_start: Vec<f32>,
    /// `[B][H]` recurrent state before step 0.
    pub initial_hidden: Vec<f32>,
    /// `[T][B]` discrete actions (empty when actions are continuous).
    pub actions: Vec<u32>,
    /// Values per continuous action (0 for discrete actions).
    pub action_dim: usize,
    /// `[T][B][action_dim]` continuous actions (empty for discrete ones).
    pub continuous_actions: Vec<f32>,
    /// `[T][B]` log μ(a|x).
    pub behaviour_log_probs: Vec<f32>,
    /// `[T][B]`, with truncation bootstrap folded in.
    pub rewards: Vec<f32>,
    /// `[T][B]` γ·(1 − done).
    pub discounts: Vec<f32>,
    /// `[T][B]` per-sample loss weight (1 = full weight).
    pub sample_weights: Vec<f32>,
    /// `[B]` behaviour version of each column.
    pub policy_versions: Vec<PolicyVersion>,
    /// Group baselines: `[T][B]` advantages that replace the critic's where finite (NaN: the
    /// critic's), or empty when no column has one ([`SegmentBatch::set_advantage_override`]).
    pub advantage_override: Vec<f32>,
}

impl SegmentBatch {
    /// Lay out validated segments of equal length as columns.
    ///
    /// # Panics
    /// If segments differ in length or width: callers validate against the run spec first.
    pub fn fill(&mut self, segments: &[&TrajectorySegment], gamma: f32, reward_scale: f32, column_weights: &[f32]) {
        assert_eq!(segments.len(), column_weights.len(), "one weight per segment");
        let b_len = segments.len();
        let t_len = segments.first().map_or(0, |s| s.len());
        let obs_dim = segments.first().map_or(0, |s| s.obs_dim as usize);
        let hidden_size = segments.first().map_or(0, |s| s.initial_hidden.len());
        let action_dim = segments.first().map_or(0, |s| s.continuous_actions.len().checked_div(t_len).unwrap_or(0));
        self.action_dim = action_dim;
        self.t_len = t_len;
        self.b_len = b_len;
        self.obs_dim = obs_dim;
        self.hidden_size = hidden_size;
        let steps = t_len * b_len;
        resize(&mut self.observations, (t_len + 1) * b_len * obs_dim);
        resize(&mut self.episode_start, (t_len + 1) * b_len);
        resize(&mut self.initial_hidden, b_len * hidden_size);
        self.actions.clear();
        self.actions.resize(if action_dim == 0 { steps } else { 0 }, 0);
        resize(&mut self.continuous_actions, steps * action_dim);
        resize(&mut self.behaviour_log_probs, steps);
        resize(&mut self.rewards, steps);
        resize(&mut self.discounts, steps);
        resize(&mut self.sample_weights, steps);
        self.policy_versions.clear();
        self.advantage_override.clear();
        for (b, (segment, &weight)) in segments.iter().zip(column_weights).enumerate() {
            assert_eq!(segment.len(), t_len, "segments in a batch share T");
            assert_eq!(segment.obs_dim as usize, obs_dim, "segments in a batch share obs_dim");
            self.policy_versions.push(segment.policy_version);
            self.initial_hidden[b * hidden_size..(b + 1) * hidden_size].copy_from_slice(&segment.initial_hidden);
            for t in 0..=t_len {
                let dst = (t * b_len + b) * obs_dim;
                self.observations[dst..dst + obs_dim]
                    .copy_from_slice(&segment.observations[t * obs_dim..(t + 1) * obs_dim]);
            }
            assert_eq!(segment.continuous_actions.len(), t_len * action_dim, "segments in a batch share action_dim");
            for t in 0..t_len {
                let dst = (t * b_len + b) * action_dim;
                self.continuous_actions[dst..dst + action_dim]
                    .copy_from_slice(&segment.continuous_actions[t * action_dim..(t + 1) * action_dim]);
            }
            self.episode_start[b] = 0.0;
            for t in 0..t_len {
                let i = t * b_len + b;
                let terminated = segment.terminated[t] != 0;
                let truncated = segment.truncated[t] != 0;
                let done = terminated || truncated;
                if action_dim == 0 {
                    self.actions[i] = segment.actions[t];
                }
                self.behaviour_log_probs[i] = segment.behaviour_log_probs[t];
                let bootstrap = if truncated && !terminated { gamma * segment.truncation_values[t] } else { 0.0 };
                self.rewards[i] = segment.rewards[t] * reward_scale + bootstrap;
                self.discounts[i] = if done { 0.0 } else { gamma };
                self.sample_weights[i] = weight;
                self.episode_start[(t + 1) * b_len + b] = if done { 1.0 } else { 0.0 };
            }
        }
    }

    /// Set the group advantages of a filled batch, one optional `[T]` slice per column (NaN
    /// steps and `None` columns keep the critic's advantage); all `None` leaves none.
    ///
    /// # Panics
    /// If there is not one entry per column or a slice is not `T` long.
    pub fn set_advantage_override(&mut self, columns: &[Option<&[f32]>]) {
        assert_eq!(columns.len(), self.b_len, "one entry per column");
        self.advantage_override.clear();
        if columns.iter().all(Option::is_none) {
            return;
        }
        let (t_len, b_len) = (self.t_len, self.b_len);
        self.advantage_override.resize(t_len * b_len, f32::NAN);
        for (b, column) in columns.iter().enumerate() {
            let Some(column) = column else { continue };
            assert_eq!(column.len(), t_len, "a group advantage per step");
            for (t, &a) in column.iter().enumerate() {
                self.advantage_override[t * b_len + b] = a;
            }
        }
    }

    /// Copy the columns `cols` of this batch into `out` (a minibatch of whole sequences).
    pub fn gather_columns(&self, cols: &[usize], out: &mut SegmentBatch) {
        let (t_len, b_len) = (self.t_len, self.b_len);
        out.t_len = t_len;
        out.b_len = cols.len();
        out.obs_dim = self.obs_dim;
        out.hidden_size = self.hidden_size;
        gather(&self.observations, t_len + 1, b_len, self.obs_dim, cols, &mut out.observations);
        gather(&self.episode_start, t_len + 1, b_len, 1, cols, &mut out.episode_start);
        gather(&self.initial_hidden, 1, b_len, self.hidden_size, cols, &mut out.initial_hidden);
        if self.action_dim == 0 {
            gather(&self.actions, t_len, b_len, 1, cols, &mut out.actions);
        } else {
            out.actions.clear();
        }
        out.action_dim = self.action_dim;
        gather(&self.continuous_actions, t_len, b_len, self.action_dim, cols, &mut out.continuous_actions);
        gather(&self.behaviour_log_probs, t_len, b_len, 1, cols, &mut out.behaviour_log_probs);
        gather(&self.rewards, t_len, b_len, 1, cols, &mut out.rewards);
        gather(&self.discounts, t_len, b_len, 1, cols, &mut out.discounts);
        gather(&self.sample_weights, t_len, b_len, 1, cols, &mut out.sample_weights);
        out.policy_versions.clear();
        out.policy_versions.extend(cols.iter().map(|&c| self.policy_versions[c]));
        if self.advantage_override.is_empty() {
            out.advantage_override.clear();
        } else {
            gather(&self.advantage_override, t_len, b_len, 1, cols, &mut out.advantage_override);
        }
    }
}

/// Clear `buffer` and refill it with `len` zeros, keeping its allocation.
pub(crate) fn resize(buffer: &mut Vec<f32>, len: usize) {
    buffer.clear();
    buffer.resize(len, 0.0);
}

/// Gather columns `cols` of a `[rows][b_len][width]` array into `out` (`[rows][cols.len()][width]`).
pub fn gather<T: Copy>(src: &[T], rows: usize, b_len: usize, width: usize, cols: &[usize], out: &mut Vec<T>) {
    assert_eq!(src.len(), rows * b_len * width, "gather: source shape");
    out.clear();
    out.reserve(rows * cols.len() * width);
    for row in 0..rows {
        for &c in cols {
            let start = (row * b_len + c) * width;
            out.extend_from_slice(&src[start..start + width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_testkit::fixtures::SegmentBuilder;

    fn segment(t_len: usize, obs_dim: usize, base: f32) -> TrajectorySegment {
        SegmentBuilder::new(t_len, obs_dim)
            .version(base as u64)
            .observations_from(|i| base + i as f32)
            .actions((0..t_len as u32).collect())
            .log_prob(-0.5)
            .build()
    }

    #[test]
    fn columns_are_time_major_and_truncation_is_bootstrapped() {
        let mut a = segment(3, 2, 0.0);
        let b = segment(3, 2, 100.0);
        a.truncated[1] = 1;
        a.truncation_values[1] = 10.0;
        a.terminated[2] = 1;
        let mut batch = SegmentBatch::default();
        batch.fill(&[&a, &b], 0.9, 1.0, &[1.0, 0.5]);
        // Observation of segment b at t = 1 sits at row 1, column 1.
        assert_eq!(&batch.observations[(2 + 1) * 2..(2 + 1) * 2 + 2], &[102.0, 103.0]);
        assert_eq!(batch.rewards[2], 1.0 + 0.9 * 10.0);
        assert_eq!(batch.discounts[2], 0.0);
        assert_eq!(batch.discounts[4], 0.0);
        assert_eq!(batch.discounts[0], 0.9);
        assert_eq!(batch.episode_start[2 * 2], 1.0, "step after truncation starts an episode");
        assert_eq!(batch.episode_start[3 * 2], 1.0, "step after termination starts an episode");
        assert_eq!(batch.episode_start[2], 0.0);
        assert_eq!(batch.sample_weights[1], 0.5);
        assert_eq!(batch.policy_versions, vec![PolicyVersion(0), PolicyVersion(100)]);
    }

    #[test]
    fn gather_columns_selects_whole_sequences() {
        let segments: Vec<_> = (0..3).map(|i| segment(2, 1, 10.0 * i as f32)).collect();
        let refs: Vec<_> = segments.iter().collect();
        let mut batch = SegmentBatch::default();
        batch.fill(&refs, 0.99, 1.0, &[1.0; 3]);
        let mut mini = SegmentBatch::default();
        batch.gather_columns(&[2, 0], &mut mini);
        assert_eq!(mini.b_len, 2);
        assert_eq!(mini.observations, vec![20.0, 0.0, 21.0, 1.0, 22.0, 2.0]);
        let mut direct = SegmentBatch::default();
        direct.fill(&[&segments[2], &segments[0]], 0.99, 1.0, &[1.0; 2]);
        assert_eq!(mini.rewards, direct.rewards);
        assert_eq!(mini.episode_start, direct.episode_start);
        assert_eq!(mini.observations, direct.observations);
    }
}
