//! The run's broker objects on a JetStream cluster: with `NatsConfig::replicas = 3` on three
//! real `nats-server` processes clustered over loopback routes (the layout of
//! k8s/base/nats), the trajectory stream, the run bucket, the weights store, the work queue
//! and the snapshot stores each keep a copy on every server. On a single server the same setting is refused by the server, which
//! shows the setting reaches it.
//!
//! No assertion depends on timing; waits are bounded by attempt counts.

// Shared fixtures; this file needs only the spec.
#[allow(dead_code)]
mod common;

use std::thread;
use std::time::Duration;

use volley_core::ids::RunId;
use volley_core::subjects;
use volley_testkit::{free_port, TestNats};
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};

/// Attempts at creating the run while the cluster elects its meta leader (one per 500 ms).
const ELECTION_ATTEMPTS: usize = 120;

fn config(server: &TestNats, run: &str, replicas: usize) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), RunId::new(run).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(5);
    config.replicas = replicas;
    config
}

/// Three servers `n0`, `n1`, `n2` routed to each other, JetStream on each.
fn cluster() -> Vec<TestNats> {
    let cluster_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let routes: Vec<String> = cluster_ports.iter().map(|port| format!("nats://127.0.0.1:{port}")).collect();
    cluster_ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let config = format!(
                "server_name: n{i}\ncluster {{\n  name: volley-test\n  listen: 127.0.0.1:{port}\n  routes: [{}]\n}}\n",
                routes.join(", ")
            );
            TestNats::start_with_config(&config, &[])
        })
        .collect()
}

#[test]
fn run_objects_are_replicated_on_every_server_of_a_cluster() {
    let servers = cluster();
    let bus = NatsBus::connect(config(&servers[0], "repl", 3)).expect("connect to the cluster");
    let mut spec = common::spec("repl");
    // With work items the run also has a work queue and snapshot stores.
    spec.hyper.work.enabled = true;
    // Until the servers have elected a meta leader, JetStream answers "temporarily unavailable".
    let mut last_error = None;
    for _ in 0..ELECTION_ATTEMPTS {
        match bus.ensure_run(&spec) {
            Ok(()) => {
                last_error = None;
                break;
            }
            Err(err) => last_error = Some(err),
        }
        thread::sleep(Duration::from_millis(500));
    }
    if let Some(err) = last_error {
        let logs: Vec<String> = servers.iter().map(|s| s.log()).collect();
        panic!("the run was never created on the cluster: {err}\n{}", logs.join("\n---\n"));
    }
    let run = &bus.config().run;
    let streams = [
        subjects::trajectory_stream(run),
        format!("KV_{}", subjects::run_bucket(run)),
        format!("OBJ_{}", subjects::weights_bucket(run)),
        subjects::work_stream(run),
        format!("OBJ_{}", subjects::snapshot_bucket(run)),
        format!("KV_{}", subjects::snapshot_index_bucket(run)),
    ];
    bus.block_on(async {
        for name in streams {
            let mut stream = bus.jetstream().get_stream(&name).await.expect("the stream exists");
            let info = stream.info().await.expect("stream info");
            assert_eq!(info.config.num_replicas, 3, "{name}: configured replicas");
            let cluster = info.cluster.as_ref().expect("clustered stream info");
            assert!(cluster.leader.is_some(), "{name}: has a leader");
            assert_eq!(cluster.replicas.len(), 2, "{name}: a copy on each of the other two servers");
        }
    });
    // The run works as usual: the spec written by ensure_run reads back.
    assert_eq!(bus.read_spec().expect("read the spec").expect("stored").expect("verified"), spec);
}

#[test]
fn replicas_above_one_are_refused_by_a_single_server() {
    let server = TestNats::start();
    let bus = NatsBus::connect(config(&server, "single", 3)).expect("connect");
    let err = bus.ensure_run(&common::spec("single")).expect_err("a lone server cannot keep 3 copies");
    assert!(err.to_string().contains("replicas"), "the server's reason reaches the caller: {err}");
    // With one replica the same run is created.
    let bus = NatsBus::connect(config(&server, "single", 1)).expect("connect");
    bus.ensure_run(&common::spec("single")).expect("one replica on one server");
}
