//! Assembling segments into a time-major batch `[T][B]`: one column per segment, or one column
//! per stitched window of consecutive segments (`hyper.bptt.segments`, [`crate::select::windows`]).

use volley_core::ids::PolicyVersion;
use volley_core::wire::{ObsElement, Observations, TrajectorySegment};

/// A recurrent state that replaces the one entering step `t` of column `b`: row `state` of
/// [`SegmentBatch::restore_states`]. The batch also sets `episode_start` there, so no
/// gradient flows across it (the restored state is a constant of the data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateRestore {
    /// The step whose entering state is replaced.
    pub t: usize,
    /// The column.
    pub b: usize,
    /// The row of the restored state in [`SegmentBatch::restore_states`].
    pub state: usize,
}

/// The segments used by one learner step, laid out time-major with one column per segment
/// (or per stitched window of consecutive segments).
///
/// Rewards are scaled by the run's `reward_scale` and already include the bootstrap through
/// time limits: where step `t` was truncated, `rewards[t] = c·r_t + γ·V_μ(x_final)` and
/// `discounts[t] = 0` (as Stable-Baselines3 does), so
/// the return estimators only ever see terminations.
#[derive(Debug, Default, Clone)]
pub struct SegmentBatch {
    /// Steps per column (T, or K·T for windows of K segments).
    pub t_len: usize,
    /// Columns (B).
    pub b_len: usize,
    /// Observation width.
    pub obs_dim: usize,
    /// Recurrent state width (0 for feed-forward).
    pub hidden_size: usize,
    /// `[T + 1][B][obs_dim]`: bytes when every segment's observations are (image
    /// observations, `volley_core::wire::observations`), else `f32` (bytes widened).
    pub observations: Observations,
    /// `[T + 1][B]`: 1 where a new episode starts at that step (recurrent state reset to zero,
    /// or to a restored state: [`SegmentBatch::restores`]).
    pub episode_start: Vec<f32>,
    /// `[B][H]` recurrent state before step 0.
    pub initial_hidden: Vec<f32>,
    /// Steps whose entering recurrent state is a restored one rather than zero, sorted by
    /// step: an episode resumed from a saved state mid-segment (the segment's
    /// `restored_states`), a window's next episode that started from a saved state at a
    /// segment boundary, and the first real step of a padded window.
    pub restores: Vec<StateRestore>,
    /// `[restores.len()][H]`: the restored states.
    pub restore_states: Vec<f32>,
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
    /// `[T][B]` per-sample loss weight (1 = full weight; 0 on padding).
    pub sample_weights: Vec<f32>,
    /// `[B]` behaviour version of each column (a window's oldest, which its lag is measured by).
    pub policy_versions: Vec<PolicyVersion>,
    /// Group baselines: `[T][B]` advantages that replace the critic's where finite (NaN: the
    /// critic's), or empty when no column has one ([`SegmentBatch::set_advantage_override`]).
    pub advantage_override: Vec<f32>,
    /// Steps that carry no data: the padding in front of windows shorter than K segments
    /// (weight 0, so they take no part in the loss).
    pub padded_steps: usize,
}

impl SegmentBatch {
    /// A new batch of `segments`, laid out as [`fill`](Self::fill) lays them out.
    ///
    /// # Panics
    /// As [`fill`](Self::fill).
    pub fn from_segments(
        segments: &[TrajectorySegment],
        gamma: f32,
        reward_scale: f32,
        column_weights: &[f32],
    ) -> Self {
        let refs: Vec<&TrajectorySegment> = segments.iter().collect();
        let mut batch = Self::default();
        batch.fill(&refs, gamma, reward_scale, column_weights);
        batch
    }

    /// Lay out validated segments of equal length as columns.
    ///
    /// # Panics
    /// If segments differ in length or width: callers validate against the run spec first.
    pub fn fill(&mut self, segments: &[&TrajectorySegment], gamma: f32, reward_scale: f32, column_weights: &[f32]) {
        let windows: Vec<&[TrajectorySegment]> = segments.iter().map(|s| std::slice::from_ref(*s)).collect();
        self.fill_windows(&windows, 1, gamma, reward_scale, column_weights);
    }

    /// Lay out windows of consecutive segments of one stream (each 1 to `window_segments`
    /// long, in stream order) as columns of `window_segments · T` steps, so backpropagation
    /// through time runs across the segment boundaries inside a window.
    ///
    /// A column starts from its first segment's `initial_hidden` and carries the recurrent
    /// state across its segment boundaries; where an episode ended at a boundary, the state is
    /// reset to the next segment's `initial_hidden` (zero for a fresh episode, the saved state
    /// for a resumed one). A window of `n < window_segments` segments (a stream that broke) is
    /// padded in front with `(window_segments − n)·T` steps of weight 0 and its data starts
    /// from a restore of its first segment's `initial_hidden`. Each step keeps its own
    /// behaviour log-probability, so V-trace's and PPO's importance weights are per step
    /// whatever versions a window mixes.
    ///
    /// # Panics
    /// If segments differ in length or width, or a window is empty or longer than
    /// `window_segments`: callers validate against the run spec first.
    pub fn fill_windows(
        &mut self,
        windows: &[&[TrajectorySegment]],
        window_segments: usize,
        gamma: f32,
        reward_scale: f32,
        column_weights: &[f32],
    ) {
        assert_eq!(windows.len(), column_weights.len(), "one weight per window");
        assert!(window_segments >= 1, "windows hold at least one segment");
        let first = windows.first().and_then(|w| w.first());
        let seg_len = first.map_or(0, |s| s.len());
        let obs_dim = first.map_or(0, |s| s.obs_dim as usize);
        let hidden_size = first.map_or(0, |s| s.initial_hidden.len());
        let action_dim = first.map_or(0, |s| s.continuous_actions.len().checked_div(seg_len).unwrap_or(0));
        let b_len = windows.len();
        let t_len = seg_len * window_segments;
        self.action_dim = action_dim;
        self.t_len = t_len;
        self.b_len = b_len;
        self.obs_dim = obs_dim;
        self.hidden_size = hidden_size;
        let steps = t_len * b_len;
        // One element type for the whole batch, chosen once: frames stay bytes unless a
        // segment holds `f32` observations, and then every segment's are widened (exactly).
        let all_bytes = windows.iter().flat_map(|w| w.iter()).all(|s| s.observations.element() == ObsElement::U8);
        let element = if all_bytes && first.is_some() { ObsElement::U8 } else { ObsElement::F32 };
        self.observations.reset(element, (t_len + 1) * b_len * obs_dim);
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
        self.restores.clear();
        self.restore_states.clear();
        self.padded_steps = 0;
        for (b, (window, &weight)) in windows.iter().zip(column_weights).enumerate() {
            assert!(!window.is_empty() && window.len() <= window_segments, "a window holds 1..=K segments");
            let pad = (window_segments - window.len()) * seg_len;
            self.padded_steps += pad;
            if pad == 0 {
                self.initial_hidden[b * hidden_size..(b + 1) * hidden_size].copy_from_slice(&window[0].initial_hidden);
            } else {
                // Padding: zero observations and actions with weight 0 and discount 0 (so no
                // return estimate reads across it); the data starts from its own state.
                self.episode_start[pad * b_len + b] = 1.0;
                self.push_restore(pad, b, &window[0].initial_hidden);
            }
            self.policy_versions.push(window.iter().map(|s| s.policy_version).min().expect("not empty"));
            for (k, segment) in window.iter().enumerate() {
                assert_eq!(segment.len(), seg_len, "segments in a batch share T");
                assert_eq!(segment.obs_dim as usize, obs_dim, "segments in a batch share obs_dim");
                assert_eq!(
                    segment.continuous_actions.len(),
                    seg_len * action_dim,
                    "segments in a batch share action_dim"
                );
                let offset = pad + k * seg_len;
                // The segment's rows 0..T; its row T is the next segment's row 0, or the
                // column's bootstrap row after the last segment.
                let rows = if k + 1 == window.len() { seg_len + 1 } else { seg_len };
                for t in 0..rows {
                    let dst = ((offset + t) * b_len + b) * obs_dim;
                    self.observations.write_from(dst, &segment.observations, t * obs_dim..(t + 1) * obs_dim);
                }
                for t in 0..seg_len {
                    let dst = ((offset + t) * b_len + b) * action_dim;
                    self.continuous_actions[dst..dst + action_dim]
                        .copy_from_slice(&segment.continuous_actions[t * action_dim..(t + 1) * action_dim]);
                }
                for t in 0..seg_len {
                    let i = (offset + t) * b_len + b;
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
                    self.episode_start[(offset + t + 1) * b_len + b] = if done { 1.0 } else { 0.0 };
                }
                // Episodes resumed from a saved state mid-segment start from that state.
                for restored in &segment.restored_states {
                    let t = restored.step as usize;
                    debug_assert!(t > 0 && segment.terminated[t - 1] + segment.truncated[t - 1] > 0, "validated");
                    self.episode_start[(offset + t) * b_len + b] = 1.0;
                    self.push_restore(offset + t, b, &restored.hidden);
                }
                // An episode that ended at the boundary to the next segment of the window:
                // the next one starts from that segment's initial state (a saved one, when
                // it was resumed there; zero otherwise, which the reset already gives).
                if let Some(next) = window.get(k + 1) {
                    let boundary = offset + seg_len;
                    if self.episode_start[boundary * b_len + b] != 0.0 && next.initial_hidden.iter().any(|&h| h != 0.0)
                    {
                        self.push_restore(boundary, b, &next.initial_hidden);
                    }
                }
            }
        }
        // The network walks restores in step order.
        if !self.restores.is_sorted_by_key(|r| r.t) {
            let hidden = hidden_size;
            let mut order: Vec<usize> = (0..self.restores.len()).collect();
            order.sort_by_key(|&i| (self.restores[i].t, self.restores[i].b));
            let states = std::mem::take(&mut self.restore_states);
            let restores = std::mem::take(&mut self.restores);
            for (row, &i) in order.iter().enumerate() {
                self.restores.push(StateRestore { state: row, ..restores[i] });
                self.restore_states.extend_from_slice(&states[i * hidden..(i + 1) * hidden]);
            }
        }
    }

    /// Record that the state entering step `t` of column `b` is `hidden` (nothing to record
    /// for a feed-forward policy).
    fn push_restore(&mut self, t: usize, b: usize, hidden: &[f32]) {
        // A zero state is what the reset at that step gives anyway.
        if hidden.iter().all(|&h| h == 0.0) {
            return;
        }
        self.restores.push(StateRestore { t, b, state: self.restores.len() });
        self.restore_states.extend_from_slice(hidden);
    }

    /// Samples that carry data (steps less padding).
    pub fn data_samples(&self) -> usize {
        self.t_len * self.b_len - self.padded_steps
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
        match &self.observations {
            Observations::F32(values) => {
                out.observations.reset(ObsElement::F32, 0);
                let Observations::F32(dst) = &mut out.observations else { unreachable!("reset to f32") };
                gather(values, t_len + 1, b_len, self.obs_dim, cols, dst);
            }
            Observations::U8(bytes) => {
                out.observations.reset(ObsElement::U8, 0);
                let Observations::U8(dst) = &mut out.observations else { unreachable!("reset to u8") };
                gather(bytes, t_len + 1, b_len, self.obs_dim, cols, dst);
            }
        }
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
        out.restores.clear();
        out.restore_states.clear();
        let hidden = self.hidden_size;
        for restore in &self.restores {
            for (j, _) in cols.iter().enumerate().filter(|(_, &c)| c == restore.b) {
                out.restores.push(StateRestore { t: restore.t, b: j, state: out.restores.len() });
                out.restore_states
                    .extend_from_slice(&self.restore_states[restore.state * hidden..(restore.state + 1) * hidden]);
            }
        }
        out.padded_steps = (0..t_len)
            .flat_map(|t| cols.iter().map(move |&c| t * b_len + c))
            .filter(|&i| self.sample_weights[i] == 0.0)
            .count();
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
    use volley_core::wire::RestoredState;
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
        assert_eq!(&batch.observations.to_f32_vec()[(2 + 1) * 2..(2 + 1) * 2 + 2], &[102.0, 103.0]);
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

    /// Stream segment `idx` (T = 2, one observation `10·idx + t`, hidden size 2).
    fn stream_segment(idx: u64, version: u64, initial_hidden: Vec<f32>) -> TrajectorySegment {
        let mut segment = SegmentBuilder::new(2, 1)
            .version(version)
            .observations_from(|t| 10.0 * idx as f32 + t as f32)
            .actions(vec![1, 0])
            .log_prob(-0.25)
            .initial_hidden(initial_hidden)
            .build();
        segment.segment_idx = idx;
        segment
    }

    /// Issue 18: a window of K segments is one column of K·T steps that carries the state
    /// across its boundaries; where an episode starts inside it from a saved state (at a
    /// boundary or mid-segment) the batch restores that state; a short window is padded in
    /// front with weight-0 steps and starts from its own initial state.
    #[test]
    fn windows_stitch_consecutive_segments_into_one_column_and_pad_short_ones() {
        let s0 = stream_segment(0, 5, vec![0.1, 0.2]);
        let mut s1 = stream_segment(1, 3, vec![0.3, 0.4]);
        let mut s2 = stream_segment(2, 4, vec![0.7, 0.8]);
        // s1's last step ends an episode; s2's episode was resumed at the boundary from a saved
        // state, and another one mid-way through s2.
        s1.terminated[1] = 1;
        s2.terminated[0] = 1;
        s2.restored_states = vec![RestoredState { step: 1, hidden: vec![-1.0, 1.0] }];
        let short = stream_segment(7, 9, vec![0.5, 0.5]);
        let window = [s0.clone(), s1, s2];
        let mut batch = SegmentBatch::default();
        batch.fill_windows(&[&window[..], std::slice::from_ref(&short)], 3, 0.9, 1.0, &[1.0, 0.5]);
        assert_eq!((batch.t_len, batch.b_len, batch.padded_steps, batch.data_samples()), (6, 2, 4, 8));
        // Column 0: observations 0, 1 | 10, 11 | 20, 21, then the bootstrap row 22.
        let column = |field: &[f32], b: usize| field.iter().skip(b).step_by(2).copied().collect::<Vec<_>>();
        let observations = batch.observations.to_f32_vec();
        assert_eq!(column(&observations, 0), vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
        // Column 1: four padding steps, then the short window's data.
        assert_eq!(column(&observations, 1), vec![0.0, 0.0, 0.0, 0.0, 70.0, 71.0, 72.0]);
        assert_eq!(column(&batch.sample_weights, 1), vec![0.0, 0.0, 0.0, 0.0, 0.5, 0.5]);
        assert_eq!(column(&batch.discounts, 1), vec![0.0, 0.0, 0.0, 0.0, 0.9, 0.9]);
        assert_eq!(column(&batch.behaviour_log_probs, 0), vec![-0.25; 6]);
        // The state carries across the first boundary (no start), resets at the episode ends.
        assert_eq!(column(&batch.episode_start, 0), vec![0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(column(&batch.episode_start, 1), vec![0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        assert_eq!(&batch.initial_hidden, &[0.1, 0.2, 0.0, 0.0], "the first segment's state; padding starts at zero");
        let restores: Vec<(usize, usize)> = batch.restores.iter().map(|r| (r.t, r.b)).collect();
        assert_eq!(restores, vec![(4, 0), (4, 1), (5, 0)], "sorted by step");
        let state = |t: usize, b: usize| {
            let r = batch.restores.iter().find(|r| (r.t, r.b) == (t, b)).expect("restored");
            batch.restore_states[r.state * 2..r.state * 2 + 2].to_vec()
        };
        assert_eq!(state(4, 0), vec![0.7, 0.8], "the next segment's saved initial state at the boundary");
        assert_eq!(state(5, 0), vec![-1.0, 1.0], "the state an episode resumed from mid-segment");
        assert_eq!(state(4, 1), vec![0.5, 0.5], "a short window's data starts from its own state");
        assert_eq!(batch.policy_versions, vec![PolicyVersion(3), PolicyVersion(9)], "each column's oldest version");
        // One window of one segment is exactly `fill`.
        let mut single = SegmentBatch::default();
        single.fill_windows(&[std::slice::from_ref(&s0)], 1, 0.9, 1.0, &[1.0]);
        let mut direct = SegmentBatch::default();
        direct.fill(&[&s0], 0.9, 1.0, &[1.0]);
        assert_eq!(
            (single.observations, single.episode_start, single.restores),
            (direct.observations, direct.episode_start, direct.restores)
        );
    }

    #[test]
    fn gather_columns_selects_whole_sequences() {
        let segments: Vec<_> = (0..3).map(|i| segment(2, 1, 10.0 * i as f32)).collect();
        let batch = SegmentBatch::from_segments(&segments, 0.99, 1.0, &[1.0; 3]);
        let mut mini = SegmentBatch::default();
        batch.gather_columns(&[2, 0], &mut mini);
        assert_eq!(mini.b_len, 2);
        assert_eq!(mini.observations, Observations::F32(vec![20.0, 0.0, 21.0, 1.0, 22.0, 2.0]));
        let mut direct = SegmentBatch::default();
        direct.fill(&[&segments[2], &segments[0]], 0.99, 1.0, &[1.0; 2]);
        assert_eq!(mini.rewards, direct.rewards);
        assert_eq!(mini.episode_start, direct.episode_start);
        assert_eq!(mini.observations, direct.observations);
    }
}
