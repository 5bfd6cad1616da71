//! What signing a weights version costs (issue 46 item 2): the learner signs every version it
//! publishes, and every actor verifies every version it takes, both over the SHA-256 of the
//! parameters (`volley_transport::signing`).
//!
//! Every iteration handles one version of [`SIZES`] parameters (`Throughput::Bytes`, 4 per
//! parameter). Variants (bench ids `<variant>/<n_params>`):
//! - `sha256`: `params_sha256` alone, the part that grows with the parameters;
//! - `sign`: what the learner's publisher does per version: `SignedVersion::of` (the SHA-256)
//!   and `WeightsSigningKey::sign`;
//! - `verify`: what a follower does per version: `SignedVersion::of` (the SHA-256) and
//!   `WeightsPublicKeys::verify` against one trusted key;
//! - `verify_two_keys`: the same with two trusted keys (a rotation), the signing key second;
//! - `sign_only`, `verify_only`: Ed25519 over an already hashed version, the fixed part;
//! - `xxh3_digest`: the peer, `wire::checksum`, the XXH3-64 digest of the parameters that every
//!   version carried and every follower checked before signatures (and still does).
//!
//! Sizes: 10,000 parameters (a small MLP), 1,000,000, and 1,700,000 (the Nature-DQN network
//! for Atari has 1.68 million).
//!
//! Run with `cargo bench -p volley-transport --bench signing`; numbers go in
//! docs/benchmarks/tls.md ("Signing weights").

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_core::ids::PolicyVersion;
use volley_core::wire::{self, Weights};
use volley_transport::signing::{params_sha256, SignedVersion, WeightsPublicKeys, WeightsSigningKey};

/// Parameters per version.
const SIZES: [usize; 3] = [10_000, 1_000_000, 1_700_000];
const RUN: &str = "bench";

fn weights(n_params: usize) -> Weights {
    let params = (0..n_params).map(|i| (i as f32 * 0.001).sin() * 0.05).collect();
    Weights::new(PolicyVersion(7), 0x5167, params)
}

fn bench_signing(c: &mut Criterion) {
    let key = WeightsSigningKey::generate();
    let trusted = key.public_keys();
    let rotation = WeightsPublicKeys::from_pem(&format!(
        "{}{}",
        WeightsSigningKey::generate().public_key_pem(),
        key.public_key_pem()
    ))
    .expect("two public keys");
    let mut group = c.benchmark_group("signing");
    for n_params in SIZES {
        let weights = weights(n_params);
        let signature = key.sign(&SignedVersion::of(RUN, &weights));
        let hashed = SignedVersion::of(RUN, &weights);
        group.throughput(Throughput::Bytes(4 * n_params as u64));
        group.bench_with_input(BenchmarkId::new("sha256", n_params), &weights, |b, weights| {
            b.iter(|| black_box(params_sha256(&weights.params)))
        });
        group.bench_with_input(BenchmarkId::new("xxh3_digest", n_params), &weights, |b, weights| {
            b.iter(|| black_box(wire::checksum(&weights.params)))
        });
        group.bench_with_input(BenchmarkId::new("sign", n_params), &weights, |b, weights| {
            b.iter(|| black_box(key.sign(&SignedVersion::of(RUN, weights))))
        });
        group.bench_with_input(BenchmarkId::new("verify", n_params), &weights, |b, weights| {
            b.iter(|| trusted.verify(&SignedVersion::of(RUN, weights), Some(&signature)).expect("valid"))
        });
        group.bench_with_input(BenchmarkId::new("verify_two_keys", n_params), &weights, |b, weights| {
            b.iter(|| rotation.verify(&SignedVersion::of(RUN, weights), Some(&signature)).expect("valid"))
        });
        group.bench_with_input(BenchmarkId::new("sign_only", n_params), &hashed, |b, hashed| {
            b.iter(|| black_box(key.sign(hashed)))
        });
        group.bench_with_input(BenchmarkId::new("verify_only", n_params), &hashed, |b, hashed| {
            b.iter(|| trusted.verify(hashed, Some(&signature)).expect("valid"))
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_signing
}
criterion_main!(benches);
