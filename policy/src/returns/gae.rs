//! Generalised advantage estimation, GAE(γ, λ) (Schulman et al. 2016, "High-Dimensional
//! Continuous Control Using Generalized Advantage Estimation", eq. (16)).
//!
//! With per-step discounts `γ_t` (zero at a termination) the estimator is
//!
//! ```text
//! δ_t = r_t + γ_t V(x_{t+1}) − V(x_t),
//! Â_t = Σ_{l≥0} (Π_{i=t}^{t+l−1} γ_i λ) δ_{t+l}
//!     = δ_t + γ_t λ Â_{t+1},           Â_T = 0,
//! ```
//!
//! truncated at the end of the segment, where `V(x_T)` is the bootstrap value. The value
//! targets are `Â_t + V(x_t)`, which equal the λ-returns. `λ = 0` gives the one-step TD error and
//! `λ = 1` the discounted return minus the value.

use super::assert_len;

/// GAE(γ, λ) advantages and λ-return value targets for a time-major `[T][B]` batch
/// (Schulman et al. 2016, eq. (16)).
///
/// Inputs, each `[T][B]` flattened as `t * b_len + b` unless noted:
/// - `discounts`: `γ_t`, with `0` where the episode terminated at step `t`.
/// - `rewards`: `r_t`.
/// - `values`: `V(x_t)`.
/// - `bootstrap_value` (`[B]`): `V(x_T)`.
/// - `lambda_`: the GAE `λ` (`gae_lambda`).
///
/// Outputs, each `[T][B]` and overwritten:
/// - `advantages`: `Â_t`.
/// - `returns`: `Â_t + V(x_t)`.
///
/// The recursion runs in `f32`; `advantages` doubles as the carry, so nothing is allocated.
///
/// # Panics
///
/// If any slice length disagrees with `t_len` and `b_len`.
///
/// # Example
///
/// ```
/// use volley_policy::returns::gae;
///
/// // One column, two steps: r = [1, 1], γ = 1, V = [0, 0], V(x_T) = 2, λ = 0.5.
/// let (mut adv, mut ret) = ([0.0; 2], [0.0; 2]);
/// gae(2, 1, &[1.0, 1.0], &[1.0, 1.0], &[0.0, 0.0], &[2.0], 0.5, &mut adv, &mut ret);
/// // δ = [1, 3]; Â_1 = 3 and Â_0 = 1 + 0.5·3 = 2.5.
/// assert_eq!(adv, [2.5, 3.0]);
/// assert_eq!(ret, [2.5, 3.0]);
/// ```
// The flat argument list mirrors rlax and the CUDA scan kernel's parameters one to one.
#[allow(clippy::too_many_arguments)]
pub fn gae(
    t_len: usize,
    b_len: usize,
    discounts: &[f32],
    rewards: &[f32],
    values: &[f32],
    bootstrap_value: &[f32],
    lambda_: f32,
    advantages: &mut [f32],
    returns: &mut [f32],
) {
    let n = t_len * b_len;
    assert_len("discounts", discounts.len(), n);
    assert_len("rewards", rewards.len(), n);
    assert_len("values", values.len(), n);
    assert_len("bootstrap_value", bootstrap_value.len(), b_len);
    assert_len("advantages", advantages.len(), n);
    assert_len("returns", returns.len(), n);
    if n == 0 {
        return;
    }

    for t in (0..t_len).rev() {
        let row = t * b_len..(t + 1) * b_len;
        // Rows t+1.. of `advantages` are final; split so row t can be written while row t+1 is
        // read as the carry.
        let (adv_head, adv_tail) = advantages.split_at_mut(row.end);
        let adv_t = &mut adv_head[row.start..];
        let last = t + 1 == t_len;
        let v_tp1 = if last { bootstrap_value } else { &values[row.end..row.end + b_len] };
        let columns = discounts[row.clone()]
            .iter()
            .zip(&rewards[row.clone()])
            .zip(&values[row.clone()])
            .zip(v_tp1)
            .zip(adv_t.iter_mut().zip(&mut returns[row]));
        for (b, ((((&discount, &reward), &v), &v_next), (adv_out, ret_out))) in columns.enumerate() {
            // Â_T = 0, so the last row is the plain TD error.
            let adv_next = if last { 0.0 } else { adv_tail[b] };
            let delta = reward + discount * v_next - v;
            let adv = delta + discount * lambda_ * adv_next;
            *adv_out = adv;
            *ret_out = adv + v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{assert_close, batch_strategy, column_of, Inputs};
    use super::*;
    use proptest::prelude::*;

    impl Inputs {
        /// Runs [`gae`] with `lambda_` and returns `(advantages, returns)`.
        fn gae(&self, lambda_: f32) -> (Vec<f32>, Vec<f32>) {
            let (mut adv, mut ret) = outputs(self.t_len * self.b_len);
            let (discounts, rewards, values) = (&self.discounts, &self.rewards, &self.values);
            gae(self.t_len, self.b_len, discounts, rewards, values, &self.bootstrap, lambda_, &mut adv, &mut ret);
            (adv, ret)
        }
    }

    /// `(advantages, returns)` for `n` samples, NaN until [`gae`] writes them.
    fn outputs(n: usize) -> (Vec<f32>, Vec<f32>) {
        (vec![f32::NAN; n], vec![f32::NAN; n])
    }

    #[test]
    fn gae_matches_hand_computed_three_step_episode() {
        // One column, T = 3, γ = 0.9 then a termination at t = 2, λ = 0.5.
        // r = [1, 0, 2], V = [0.5, 1, 1.5], V(x_T) = 100 (ignored: γ_2 = 0).
        // δ_2 = 2 + 0 − 1.5 = 0.5
        // δ_1 = 0 + 0.9·1.5 − 1 = 0.35
        // δ_0 = 1 + 0.9·1 − 0.5 = 1.4
        // Â_2 = 0.5
        // Â_1 = 0.35 + 0.9·0.5·0.5 = 0.575
        // Â_0 = 1.4 + 0.9·0.5·0.575 = 1.65875
        // returns = Â + V = [2.15875, 1.575, 2.0]
        let (mut adv, mut ret) = outputs(3);
        gae(3, 1, &[0.9, 0.9, 0.0], &[1.0, 0.0, 2.0], &[0.5, 1.0, 1.5], &[100.0], 0.5, &mut adv, &mut ret);
        assert_close(&adv, &[1.65875, 0.575, 0.5], 1e-6);
        assert_close(&ret, &[2.15875, 1.575, 2.0], 1e-6);
    }

    #[test]
    fn gae_termination_cuts_the_recursion() {
        // γ_0 = 0: Â_0 = r_0 − V_0 whatever follows.
        let (mut adv, mut ret) = outputs(2);
        gae(2, 1, &[0.0, 1.0], &[3.0, 50.0], &[1.0, -9.0], &[9.0], 1.0, &mut adv, &mut ret);
        assert_close(&adv[..1], &[2.0], 0.0);
    }

    proptest! {
        #[test]
        fn gae_with_lambda_zero_equals_the_td_error(
            inputs in batch_strategy(0.0),
        ) {
            let (adv, ret) = inputs.gae(0.0);
            let Inputs { t_len, b_len, ref discounts, ref rewards, ref values, ref bootstrap, .. } = inputs;
            for t in 0..t_len {
                for (b, &bootstrap_b) in bootstrap.iter().enumerate() {
                    let i = t * b_len + b;
                    let v_next = if t + 1 == t_len { bootstrap_b } else { values[i + b_len] };
                    let td = f64::from(rewards[i])
                        + f64::from(discounts[i]) * f64::from(v_next)
                        - f64::from(values[i]);
                    assert_close(&adv[i..=i], &[td], 1e-6);
                    assert_close(&ret[i..=i], &[td + f64::from(values[i])], 1e-6);
                }
            }
        }

        #[test]
        fn gae_with_lambda_one_equals_discounted_return_minus_value(
            inputs in batch_strategy(0.0),
        ) {
            let (adv, ret) = inputs.gae(1.0);
            for b in 0..inputs.b_len {
                let Inputs { t_len, discounts, rewards, values, bootstrap, .. } = inputs.column(b);
                let (adv_b, ret_b) = (column_of(&adv, inputs.b_len, b), column_of(&ret, inputs.b_len, b));
                for s in 0..t_len {
                    // G_s = Σ_k (γ_s…γ_{s+k−1}) r_{s+k} + (γ_s…γ_{T−1}) V(x_T), summed forward.
                    let mut g = 0.0f64;
                    let mut scale = 1.0f64;
                    for t in s..t_len {
                        g += scale * f64::from(rewards[t]);
                        scale *= f64::from(discounts[t]);
                    }
                    g += scale * f64::from(bootstrap[0]);
                    assert_close(&adv_b[s..=s], &[g - f64::from(values[s])], 1e-5);
                    assert_close(&ret_b[s..=s], &[g], 1e-5);
                }
            }
        }

        #[test]
        fn gae_columns_are_independent(
            inputs in batch_strategy(0.0),
            lambda_ in 0.0f32..=1.0,
        ) {
            let (adv, ret) = inputs.gae(lambda_);
            for b in 0..inputs.b_len {
                let (adv_b, ret_b) = inputs.column(b).gae(lambda_);
                prop_assert_eq!(column_of(&adv, inputs.b_len, b), adv_b);
                prop_assert_eq!(column_of(&ret, inputs.b_len, b), ret_b);
            }
        }
    }
}
