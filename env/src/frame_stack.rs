//! Frame stacking on the actor: the policy sees the last `k` frames of each environment,
//! stacked along the channel axis, while environments (and environment servers) send single
//! frames. An Atari frame of `[1][84][84]` becomes the `[4][84][84]` observation of the
//! Nature-DQN network (Mnih et al. 2015) with `k = 4`.
//!
//! Layout: environment `i`'s observation is `k` frames, oldest first, each `frame_dim` values
//! (so for images `[k·C][H][W]`, channel-major). When an episode starts (first reset, auto-reset
//! after an episode ended, a scheduled reset or a restore) the stack is filled with copies of
//! the first frame, as Gymnasium's `FrameStackObservation(padding_type="reset")` does. The
//! final observation of an ended episode is the stack with the last frame pushed in, so it
//! bootstraps exactly like any other observation.
//!
//! A snapshot is the inner environment's: restoring it refills the stack with the restored
//! frame (the frames before it are not part of the snapshot).

use super::{ActionSpace, Actions, EnvConfig, EnvError, VecStep, VectorEnv};

/// Largest `k` a [`FrameStack`] accepts (and a run spec's `frame_stack`).
pub const MAX_FRAME_STACK: usize = 16;

/// `k` frames per environment from an inner [`VectorEnv`] that produces one.
pub struct FrameStack {
    inner: Box<dyn VectorEnv>,
    k: usize,
    frame_dim: usize,
    /// `[n_envs][k][frame_dim]`, oldest frame first.
    obs: Vec<f32>,
    /// The inner environment's step, reused.
    inner_step: VecStep,
}

impl std::fmt::Debug for FrameStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameStack").field("k", &self.k).field("frame_dim", &self.frame_dim).finish()
    }
}

impl FrameStack {
    /// Stack the last `k` frames of `inner` (`1..=`[`MAX_FRAME_STACK`]).
    pub fn new(inner: Box<dyn VectorEnv>, k: usize) -> Result<Self, EnvError> {
        if k == 0 || k > MAX_FRAME_STACK {
            return Err(EnvError::Config(format!("frame stack of {k} frames (1..={MAX_FRAME_STACK})")));
        }
        let (n_envs, frame_dim) = (inner.n_envs(), inner.obs_dim());
        let mut stack = FrameStack {
            inner_step: VecStep::new(n_envs, frame_dim),
            obs: vec![0.0; n_envs * k * frame_dim],
            inner,
            k,
            frame_dim,
        };
        for env_idx in 0..n_envs {
            stack.fill(env_idx);
        }
        Ok(stack)
    }

    /// Frames per observation.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Fill environment `env_idx`'s stack with copies of its current inner frame.
    fn fill(&mut self, env_idx: usize) {
        let (k, d) = (self.k, self.frame_dim);
        let frame = &self.inner.obs()[env_idx * d..(env_idx + 1) * d];
        for slot in self.obs[env_idx * k * d..(env_idx + 1) * k * d].chunks_exact_mut(d) {
            slot.copy_from_slice(frame);
        }
    }
}

/// Drop the oldest frame of `stack` (`k` frames of `frame.len()`) and append `frame`.
fn push(stack: &mut [f32], frame: &[f32]) {
    let d = frame.len();
    stack.copy_within(d.., 0);
    let len = stack.len();
    stack[len - d..].copy_from_slice(frame);
}

impl VectorEnv for FrameStack {
    fn n_envs(&self) -> usize {
        self.inner.n_envs()
    }

    fn obs_dim(&self) -> usize {
        self.k * self.frame_dim
    }

    fn n_actions(&self) -> usize {
        self.inner.n_actions()
    }

    fn action_space(&self) -> ActionSpace {
        self.inner.action_space()
    }

    fn obs(&self) -> &[f32] {
        &self.obs
    }

    fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError> {
        self.inner.step(actions, &mut self.inner_step)?;
        let (n_envs, k, d) = (self.inner.n_envs(), self.k, self.frame_dim);
        out.prepare(n_envs, k * d);
        let inner = &self.inner_step;
        out.rewards.copy_from_slice(&inner.rewards);
        out.terminated.copy_from_slice(&inner.terminated);
        out.truncated.copy_from_slice(&inner.truncated);
        out.finished_episodes.extend_from_slice(&inner.finished_episodes);
        out.env_errors.extend(inner.env_errors.iter().map(|(env_idx, err)| (*env_idx, err.clone())));
        out.action_repairs = inner.action_repairs;
        let frames = self.inner.obs();
        for env_idx in 0..n_envs {
            let stack = &mut self.obs[env_idx * k * d..(env_idx + 1) * k * d];
            let frame = &frames[env_idx * d..(env_idx + 1) * d];
            if inner.terminated[env_idx] || inner.truncated[env_idx] {
                // The ended episode's last stack, then a fresh stack of the new first frame.
                push(stack, &inner.final_obs[env_idx * d..(env_idx + 1) * d]);
                out.final_obs[env_idx * k * d..(env_idx + 1) * k * d].copy_from_slice(stack);
                for slot in stack.chunks_exact_mut(d) {
                    slot.copy_from_slice(frame);
                }
            } else {
                push(stack, frame);
            }
        }
        Ok(())
    }

    fn snapshot_env(&mut self, env_idx: usize) -> Result<Vec<u8>, EnvError> {
        self.inner.snapshot_env(env_idx)
    }

    fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError> {
        self.inner.restore_env(env_idx, bytes)?;
        self.fill(env_idx);
        Ok(())
    }

    fn reset_env(&mut self, env_idx: usize, seed: u64) -> Result<(), EnvError> {
        self.inner.reset_env(env_idx, seed)?;
        self.fill(env_idx);
        Ok(())
    }

    fn switch_task(&mut self, env_idx: usize, task: &EnvConfig, seed: u64) -> Result<(), EnvError> {
        self.inner.switch_task(env_idx, task, seed)?;
        self.fill(env_idx);
        Ok(())
    }

    fn env_at_milestone(&self, env_idx: usize) -> bool {
        self.inner.env_at_milestone(env_idx)
    }

    fn env_progress(&self, env_idx: usize) -> f32 {
        self.inner.env_progress(env_idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Env, EnvConfig, MinatarConfig, MinatarGame, VecEnv};

    fn breakout(n_envs: usize, seed: u64) -> VecEnv<Box<dyn Env>> {
        let config = EnvConfig::Minatar(MinatarConfig::new(MinatarGame::Breakout));
        VecEnv::new((0..n_envs).map(|_| config.build().unwrap()).collect(), seed).unwrap()
    }

    /// The stack holds exactly the last `k` frames of the unstacked run, oldest first, copies
    /// of the first frame at an episode's start, and the ended episode's last `k` frames as its
    /// final observation.
    #[test]
    fn stacks_are_the_last_k_frames_and_restart_with_each_episode() {
        let (n_envs, k) = (3, 4);
        let mut plain = breakout(n_envs, 7);
        let mut stacked = FrameStack::new(Box::new(breakout(n_envs, 7)), k).unwrap();
        let d = plain.obs_dim();
        assert_eq!(VectorEnv::obs_dim(&stacked), k * d);
        // history[i]: env i's frames since its episode began.
        let mut history: Vec<Vec<Vec<f32>>> =
            (0..n_envs).map(|i| vec![plain.obs()[i * d..(i + 1) * d].to_vec()]).collect();
        let expect = |frames: &[Vec<f32>]| -> Vec<f32> {
            let first = &frames[0];
            let padded: Vec<&Vec<f32>> = std::iter::repeat_n(first, k.saturating_sub(frames.len()))
                .chain(frames.iter().rev().take(k).rev())
                .collect();
            padded.into_iter().flatten().copied().collect()
        };
        let (mut plain_out, mut stacked_out) = (VecStep::new(n_envs, d), VecStep::new(n_envs, k * d));
        let mut n_ended = 0;
        for step in 0..600 {
            let actions: Vec<usize> = (0..n_envs).map(|i| (step * 7 + i * 3) % 3).collect();
            plain.step(Actions::Discrete(&actions), &mut plain_out).unwrap();
            stacked.step(Actions::Discrete(&actions), &mut stacked_out).unwrap();
            assert_eq!(stacked_out.rewards, plain_out.rewards);
            assert_eq!(stacked_out.terminated, plain_out.terminated);
            assert_eq!(stacked_out.finished_episodes, plain_out.finished_episodes);
            for (i, frames) in history.iter_mut().enumerate() {
                if plain_out.terminated[i] || plain_out.truncated[i] {
                    frames.push(plain_out.final_obs[i * d..(i + 1) * d].to_vec());
                    assert_eq!(&stacked_out.final_obs[i * k * d..(i + 1) * k * d], &expect(frames)[..]);
                    *frames = vec![plain.obs()[i * d..(i + 1) * d].to_vec()];
                    n_ended += 1;
                } else {
                    frames.push(plain.obs()[i * d..(i + 1) * d].to_vec());
                }
                assert_eq!(&stacked.obs()[i * k * d..(i + 1) * k * d], &expect(frames)[..], "step {step} env {i}");
            }
        }
        assert!(n_ended > 0, "some Breakout episode ended");
    }

    #[test]
    fn a_restore_refills_the_stack_with_the_restored_frame() {
        let k = 2;
        let mut stacked = FrameStack::new(Box::new(breakout(2, 3)), k).unwrap();
        let d = stacked.frame_dim;
        let snapshot = stacked.snapshot_env(0).unwrap();
        let mut out = VecStep::new(2, k * d);
        for _ in 0..5 {
            stacked.step(Actions::Discrete(&[1, 2]), &mut out).unwrap();
        }
        stacked.restore_env(1, &snapshot).unwrap();
        let mut single = MinatarConfig::new(MinatarGame::Breakout).build().unwrap();
        let mut frame = vec![0.0; d];
        single.restore(&snapshot, &mut frame).unwrap();
        assert_eq!(&stacked.obs()[k * d..2 * k * d], &[frame.clone(), frame].concat()[..]);
    }

    #[test]
    fn out_of_range_depths_are_refused() {
        assert!(FrameStack::new(Box::new(breakout(1, 0)), 0).is_err());
        assert!(FrameStack::new(Box::new(breakout(1, 0)), MAX_FRAME_STACK + 1).is_err());
        assert!(FrameStack::new(Box::new(breakout(1, 0)), 1).is_ok());
    }
}
