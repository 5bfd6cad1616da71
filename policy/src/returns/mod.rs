//! Return estimators: V-trace ([`vtrace()`]) and generalised advantage estimation ([`gae()`]).
//!
//! Both are pure functions over a batch of trajectories stored time-major: a `[T][B]` array is
//! one flat slice of `t_len * b_len` elements and step `t` of column `b` sits at `t * b_len + b`.
//! Each function checks its slice lengths once at entry (mismatches are caller bugs and panic
//! with a message naming the slice) and writes into buffers the caller owns, so the learner can
//! reuse them across steps without allocating.
//!
//! Conventions shared by both estimators:
//! - `discounts[t]` is the discount applied to everything after step `t`: `γ` for an ordinary
//!   step and `0` when the episode terminated at step `t` (a truncation keeps `γ`, so the value
//!   of the next state still bootstraps). A zero discount cuts the backward recursion.
//! - `values[t]` is `V(x_t)`, the critic's estimate at the state in which action `t` was taken,
//!   and `bootstrap_value[b]` is `V(x_T)`, the estimate at the state after the last step of
//!   column `b`.
//! - Recursions run backwards in time in `f32`; each step is a contraction when
//!   `γ · c ≤ 1`, so rounding errors do not grow with `T`.

pub mod gae;
#[cfg(test)]
mod test_inputs;
pub mod vtrace;

pub use gae::gae;
pub use vtrace::{vtrace, VTraceConfig};

/// Panics with a message naming `name` unless `slice_len == expected`.
///
/// Shape mismatches are invariants of the caller (the learner builds every buffer from the same
/// `t_len` and `b_len`), so they are asserted rather than returned as errors.
#[track_caller]
pub(crate) fn assert_len(name: &str, slice_len: usize, expected: usize) {
    assert!(slice_len == expected, "{name}: expected {expected} elements, got {slice_len}");
}
