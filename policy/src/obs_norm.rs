//! Observation normalisation by running statistics that live in the flat parameter buffer
//! (`PolicySpec::normalize_obs`), as Stable-Baselines3's `VecNormalize` and cleanrl's
//! continuous-control scripts do it, but versioned with the weights: the learner updates the
//! statistics from each batch it trains on and publishes them inside the parameters, and every
//! forward (actor inference, the learner's network) normalises with the statistics of the
//! weights it runs, so actors and learner never disagree about them.
//!
//! The statistics are `[mean (obs_dim), var (obs_dim), count]`; a normalised observation is
//! `clip((x − mean) / sqrt(var + VAR_EPS), ±OBS_CLIP)`. They are not trained by gradient: their
//! gradient is always zero, so Adam leaves them where the learner put them.
//!
//! Image observations held as bytes (issue 44 item 3) are normalised after conversion: they are
//! widened to `f32` exactly, and the statistics and the normalised values are those of the
//! widened values, as if the observations had been `f32` all along (normalised values are not
//! bytes, so a normalised batch is staged as `f32`).

/// Normalised values are clipped to `±OBS_CLIP` (Stable-Baselines3's default).
pub const OBS_CLIP: f32 = 10.0;
/// Added to the variance before the square root.
pub const VAR_EPS: f32 = 1e-8;

/// Length of the statistics block for `obs_dim` observations.
pub fn stats_len(obs_dim: usize) -> usize {
    2 * obs_dim + 1
}

/// Normalise `obs` (`[n][obs_dim]`) into `out` with `stats` (`[mean, var, count]`).
///
/// # Panics
/// If the lengths disagree.
///
/// # Example
///
/// ```
/// use volley_policy::obs_norm::normalize;
/// let mut out = [0.0f32; 2];
/// normalize(&[1.0, 0.0, 4.0, 1.0, 10.0], &[5.0, 100.0], &mut out);
/// assert_eq!(out, [2.0, 10.0]);
/// ```
pub fn normalize(stats: &[f32], obs: &[f32], out: &mut [f32]) {
    assert!(
        stats.len() % 2 == 1 && out.len() == obs.len(),
        "obs_norm: {} stats, {} obs, {} out",
        stats.len(),
        obs.len(),
        out.len()
    );
    let obs_dim = stats.len() / 2;
    let (mean, var) = (&stats[..obs_dim], &stats[obs_dim..2 * obs_dim]);
    for (row, out_row) in obs.chunks_exact(obs_dim).zip(out.chunks_exact_mut(obs_dim)) {
        for ((o, &x), (&m, &v)) in out_row.iter_mut().zip(row).zip(mean.iter().zip(var)) {
            *o = ((x - m) / (v + VAR_EPS).sqrt()).clamp(-OBS_CLIP, OBS_CLIP);
        }
    }
}

/// Merge the moments of a batch of observations (`[n][obs_dim]`) into `stats` (Chan et al.
/// 1979, the parallel variance update): afterwards `stats` describe every observation seen.
/// Non-finite rows are skipped (the segment decoder refuses them anyway).
///
/// # Panics
/// If the lengths disagree.
pub fn update(stats: &mut [f32], obs: &[f32]) {
    assert!(stats.len() % 2 == 1, "obs_norm: {} stats", stats.len());
    let obs_dim = stats.len() / 2;
    assert!(obs.len().is_multiple_of(obs_dim), "obs_norm: {} values for width {obs_dim}", obs.len());
    let rows = || obs.chunks_exact(obs_dim).filter(|row| row.iter().all(|x| x.is_finite()));
    let n = rows().count();
    if n == 0 {
        return;
    }
    let (old_count, new_count) = (f64::from(stats[2 * obs_dim]), n as f64);
    let total = old_count + new_count;
    for j in 0..obs_dim {
        let batch_mean = rows().map(|row| f64::from(row[j])).sum::<f64>() / new_count;
        let batch_var = rows().map(|row| (f64::from(row[j]) - batch_mean).powi(2)).sum::<f64>() / new_count;
        let (mean, var) = (f64::from(stats[j]), f64::from(stats[obs_dim + j]));
        let delta = batch_mean - mean;
        stats[j] = (mean + delta * new_count / total) as f32;
        let m2 = var * old_count + batch_var * new_count + delta * delta * old_count * new_count / total;
        stats[obs_dim + j] = (m2 / total) as f32;
    }
    stats[2 * obs_dim] = total as f32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_from_fresh_stats_give_the_batch_moments_and_merge_like_one_batch() {
        let obs: Vec<f32> = (0..40).map(|i| (i as f32 * 0.7).sin() * 3.0 + (i % 2) as f32).collect();
        let mut stats = vec![0.0, 0.0, 1.0, 1.0, 0.0];
        update(&mut stats, &obs);
        let col = |j: usize| obs.iter().skip(j).step_by(2).map(|&x| f64::from(x)).collect::<Vec<_>>();
        for j in 0..2 {
            let c = col(j);
            let mean = c.iter().sum::<f64>() / c.len() as f64;
            let var = c.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / c.len() as f64;
            assert!(
                (f64::from(stats[j]) - mean).abs() < 1e-5 && (f64::from(stats[2 + j]) - var).abs() < 1e-4,
                "{stats:?}"
            );
        }
        assert_eq!(stats[4], 20.0);
        let mut halves = vec![0.0, 0.0, 1.0, 1.0, 0.0];
        update(&mut halves, &obs[..16]);
        update(&mut halves, &obs[16..]);
        for (a, b) in halves.iter().zip(&stats) {
            assert!((a - b).abs() < 1e-4, "{halves:?} vs {stats:?}");
        }
        let normalised = {
            let mut out = vec![0.0; obs.len()];
            normalize(&stats, &obs, &mut out);
            out
        };
        let mean0 = normalised.iter().step_by(2).sum::<f32>() / 20.0;
        assert!(mean0.abs() < 1e-4, "{mean0}");
    }

    #[test]
    fn non_finite_rows_are_skipped_and_outliers_clipped() {
        let mut stats = vec![0.0, 1.0, 0.0];
        update(&mut stats, &[f32::NAN, 1.0, 3.0]);
        assert_eq!(stats, [2.0, 1.0, 2.0]);
        let mut out = [0.0f32; 1];
        normalize(&stats, &[1e9], &mut out);
        assert_eq!(out, [OBS_CLIP]);
    }
}
