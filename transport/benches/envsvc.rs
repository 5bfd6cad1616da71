//! Remote environment throughput: CartPole steps per second through `RemoteVecEnv` over a real
//! `nats-server` (started by `volley_testkit::TestNats`, loopback), against the in-process
//! `VecEnv`, with and without batching.
//!
//! Every iteration steps [`N_ENVS`] environments once (`Throughput::Elements(64)`), as an
//! actor's `VecEnv::step` does. Variants (bench ids `<server>/<variant>`):
//! - `in_process/vec_env`: `VecEnv<CartPole>`, no network;
//! - `rust/batch64`: one session of 64 environments: one request per step;
//! - `rust/batch8`: 8 sessions of 8, their requests concurrent;
//! - `rust/batch1`: 64 sessions of 1 (no batching), 8 requests in flight;
//! - `rust/batch1_sequential`: 64 sessions of 1, one request at a time (a round trip per
//!   environment step: what a remote `Env` without batching costs);
//! - `gymnasium/…`: the same against Gymnasium's CartPole-v1 served by the Python package,
//!   when `VOLLEY_ENVS_PYTHON` names a Python with `volley_envs` installed (skipped otherwise).
//!
//! The Rust server (`EnvServer`, what `volley env-serve` runs) lives in this process on a
//! runtime of its own (2 threads); the Python server is one `volley-envs serve` process. Client,
//! servers and broker share the machine's cores.
//!
//! Run with `cargo bench -p volley-env --bench envsvc`; numbers go in docs/BENCHMARKS.md.

use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use volley_env::{Actions, CartPole, EnvConfig, VecEnv, VecStep, VectorEnv};
use volley_testkit::TestNats;
use volley_transport::envsvc::{
    EnvServer, EnvServerConfig, EnvServiceClient, EnvServiceName, RemoteVecEnv, RemoteVecEnvConfig,
};
use volley_transport::nats::NatsTls;

/// Environments stepped per iteration.
const N_ENVS: usize = 64;
const TIMEOUT: Duration = Duration::from_secs(10);

/// Alternating actions, so episodes last a while and some end.
fn actions(step_idx: usize) -> Vec<usize> {
    (0..N_ENVS).map(|i| (step_idx + i / 3) % 2).collect()
}

fn bench_vector_env(c: &mut Criterion, group_name: &str, id: &str, envs: &mut dyn VectorEnv) {
    let mut group = c.benchmark_group(group_name);
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    group.sample_size(10);
    group.throughput(Throughput::Elements(N_ENVS as u64));
    let all_actions: Vec<Vec<usize>> = (0..64).map(actions).collect();
    let mut out = VecStep::new(N_ENVS, envs.obs_dim());
    let mut step_idx = 0;
    group.bench_function(id, |b| {
        b.iter(|| {
            envs.step(Actions::Discrete(&all_actions[step_idx % all_actions.len()]), &mut out).expect("actions fit");
            step_idx += 1;
            black_box(&out);
        })
    });
    group.finish();
}

/// Remote variants against whatever serves `service` on `nats`.
fn bench_remote(c: &mut Criterion, nats: &TestNats, group: &str, service: &EnvServiceName) {
    for (id, envs_per_session, max_in_flight) in
        [("batch64", 64, 1), ("batch8", 8, 8), ("batch1", 1, 8), ("batch1_sequential", 1, 1)]
    {
        let client = EnvServiceClient::connect(&nats.url(), None, &NatsTls::with_ca(nats.ca_file()), TIMEOUT, TIMEOUT)
            .expect("connect");
        let mut config = RemoteVecEnvConfig::new(service.clone(), N_ENVS, 1);
        config.envs_per_session = envs_per_session;
        config.max_in_flight = max_in_flight;
        let mut envs = RemoteVecEnv::new(client, config).expect("servers are up");
        bench_vector_env(c, group, id, &mut envs);
    }
}

/// A `volley-envs serve` process, killed on drop.
struct PythonServer(Child);

impl Drop for PythonServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python_server(python: &str, nats: &TestNats) -> PythonServer {
    let mut child = Command::new(python)
        .args(["-m", "volley_envs", "serve", "gymnasium:CartPole-v1", "--nats", &nats.url(), "--name", "gym"])
        .env("PYTHONUNBUFFERED", "1")
        .envs(nats.client_env())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the python environment server");
    let stderr = child.stderr.take().expect("piped");
    let server = PythonServer(child);
    for line in BufReader::new(stderr).lines() {
        if line.expect("server log").contains("environment server ready") {
            return server;
        }
    }
    panic!("the python environment server exited before it was ready");
}

fn bench_envsvc(c: &mut Criterion) {
    let mut local = VecEnv::new(vec![CartPole::new(); N_ENVS], 1).expect("cartpole resets");
    bench_vector_env(c, "in_process", "vec_env", &mut local);

    let nats = TestNats::start();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let service = EnvServiceName::new("bench").expect("valid");
    let server = runtime.block_on(async {
        let client = async_nats::ConnectOptions::new()
            .add_root_certificates(nats.ca_file())
            .connect(nats.url())
            .await
            .expect("connect");
        let config = EnvServerConfig::new(service.clone(), "cartpole");
        EnvServer::start(client, Arc::new(|| EnvConfig::Cartpole.build()), config).await.expect("server")
    });
    bench_remote(c, &nats, "rust", &service);
    runtime.block_on(server.stop());

    match std::env::var("VOLLEY_ENVS_PYTHON") {
        Ok(python) => {
            let _server = python_server(&python, &nats);
            bench_remote(c, &nats, "gymnasium", &EnvServiceName::new("gym").expect("valid"));
        }
        Err(_) => eprintln!("gymnasium variants skipped: set VOLLEY_ENVS_PYTHON to a python with volley_envs"),
    }
}

criterion_group!(benches, bench_envsvc);
criterion_main!(benches);
