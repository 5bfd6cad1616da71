//! `volley bench-weights` against a real nats-server: Volley's weights path and the two raw NATS
//! patterns it is measured against (issue 16, item 2) each deliver every version to every
//! follower process. Latencies are the benchmark's business (docs/BENCHMARKS.md), not this test's.

use std::time::Duration;

use volley_testkit::{TestNats, TestNatsOptions};

mod common;
use common::{volley_args, Proc};

#[test]
fn every_pattern_delivers_every_version_to_every_follower() {
    // A broker with 256 MiB of file storage, which a run with the default store limits (over
    // 2 GiB reserved) cannot even be created on: the benchmark sizes its run's stores to what it
    // sends and deletes them afterwards, so all three patterns run one after another on it.
    let nats = TestNats::start_with(TestNatsOptions { max_file_store_bytes: Some(256 << 20), ..Default::default() });
    let dir = tempfile::tempdir().expect("temp dir");
    for pattern in ["volley", "raw-object", "raw-core"] {
        let run = format!("bench-{pattern}");
        let args = volley_args(
            "bench-weights",
            &nats,
            &[
                "--run",
                &run,
                "--pattern",
                pattern,
                "--size-mib",
                "0.5",
                "--followers",
                "2",
                "--versions",
                "3",
                "--pause-ms",
                "10",
            ],
        );
        let mut bench = Proc::volley(dir.path(), pattern, &args, Duration::from_secs(120));
        let summary = bench.summary();
        assert_eq!(summary["versions"], 3, "{pattern}: {summary}\n{}", bench.log());
        assert_eq!(summary["followers"], 2, "{summary}");
        // A full frame of 0.5 MiB of parameters; the raw patterns move all of it every version
        // (Volley's path sends deltas between anchors).
        let full = summary["size_bytes"].as_u64().expect("bytes");
        assert!(full >= 512 * 1024, "{summary}");
        if pattern != "volley" {
            assert_eq!(summary["frame_bytes_max"].as_u64(), Some(full), "{pattern}: {summary}");
        }
        assert!(summary["last_follower_ms"]["p99"].as_f64().is_some(), "{summary}");
    }
}
