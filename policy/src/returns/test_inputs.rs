//! Time-major inputs for the tests of both estimators: a `[T][B]` batch, its columns, a
//! proptest strategy over random batches, and a tolerance check against `f64` references.

use proptest::prelude::*;

/// One time-major `[T][B]` batch (`bootstrap` is `[B]`; [`gae()`](super::gae()) ignores
/// `log_rhos`).
#[derive(Debug, Clone)]
pub(super) struct Inputs {
    pub(super) t_len: usize,
    pub(super) b_len: usize,
    pub(super) log_rhos: Vec<f32>,
    pub(super) discounts: Vec<f32>,
    pub(super) rewards: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) bootstrap: Vec<f32>,
}

impl Inputs {
    /// The batch of the `[T][B]` arrays `[log_rhos, discounts, rewards, values]` and `bootstrap`.
    pub(super) fn new(t_len: usize, b_len: usize, per_step: [&[f32]; 4], bootstrap: &[f32]) -> Self {
        let [log_rhos, discounts, rewards, values] = per_step.map(<[f32]>::to_vec);
        Inputs { t_len, b_len, log_rhos, discounts, rewards, values, bootstrap: bootstrap.to_vec() }
    }

    /// Column `b` alone, as a `[T][1]` batch.
    pub(super) fn column(&self, b: usize) -> Inputs {
        let column = |xs: &[f32]| column_of(xs, self.b_len, b);
        Inputs {
            t_len: self.t_len,
            b_len: 1,
            log_rhos: column(&self.log_rhos),
            discounts: column(&self.discounts),
            rewards: column(&self.rewards),
            values: column(&self.values),
            bootstrap: vec![self.bootstrap[b]],
        }
    }
}

/// Column `b` of a time-major `[T][b_len]` array.
pub(super) fn column_of(xs: &[f32], b_len: usize, b: usize) -> Vec<f32> {
    xs.iter().skip(b).step_by(b_len).copied().collect()
}

/// Random batches of up to 11 steps and 4 columns, `|log ρ| ≤ log_rho_range`.
pub(super) fn batch_strategy(log_rho_range: f32) -> impl Strategy<Value = Inputs> {
    (1usize..12, 1usize..5).prop_flat_map(move |(t_len, b_len)| {
        let n = t_len * b_len;
        (
            prop::collection::vec(-log_rho_range..=log_rho_range, n),
            // A quarter of the steps terminate; the rest discount by a random γ.
            prop::collection::vec(prop_oneof![1 => Just(0.0f32), 3 => 0.5f32..=1.0], n),
            prop::collection::vec(-2.0f32..2.0, n),
            prop::collection::vec(-3.0f32..3.0, n),
            prop::collection::vec(-3.0f32..3.0, b_len),
        )
            .prop_map(move |(log_rhos, discounts, rewards, values, bootstrap)| Inputs {
                t_len,
                b_len,
                log_rhos,
                discounts,
                rewards,
                values,
                bootstrap,
            })
    })
}

/// Each of `got` within `tol · (1 + |want|)` of the `f64` reference.
#[track_caller]
pub(super) fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= tol * (1.0 + w.abs()), "index {i}: got {g}, want {w} (err {err})");
    }
}
