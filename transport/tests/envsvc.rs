//! The environment protocol against a real nats-server: `EnvServer` instances in this process,
//! discovered and stepped through `EnvServiceClient` and `RemoteVecEnv`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use volley_env::{Action, Actions, CartPole, Env, EnvConfig, VecEnv, VecStep, VectorEnv};
use volley_testkit::TestNats;
use volley_transport::envsvc::protocol::{self, ObsBin, ObsEncoding, Op, StepActions, PROTOCOL_VERSION};
use volley_transport::envsvc::{
    EnvFactory, EnvServer, EnvServerConfig, EnvServiceClient, EnvServiceError, EnvServiceName, RemoteVecEnv,
    RemoteVecEnvConfig,
};
use volley_transport::nats::NatsTls;

const TIMEOUT: Duration = Duration::from_secs(5);

fn name(text: &str) -> EnvServiceName {
    EnvServiceName::new(text).expect("valid name")
}

fn cartpole_factory() -> EnvFactory {
    Arc::new(|| EnvConfig::Cartpole.build())
}

/// A runtime hosting the servers, with its own NATS connection.
struct Servers {
    runtime: tokio::runtime::Runtime,
    client: async_nats::Client,
}

impl Servers {
    fn new(nats: &TestNats) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let client = runtime
            .block_on(async_nats::ConnectOptions::new().add_root_certificates(nats.ca_file()).connect(nats.url()))
            .expect("connect");
        Servers { runtime, client }
    }

    fn start(&self, config: EnvServerConfig) -> EnvServer {
        self.runtime.block_on(EnvServer::start(self.client.clone(), cartpole_factory(), config)).expect("server starts")
    }
}

fn client(nats: &TestNats) -> EnvServiceClient {
    EnvServiceClient::connect(&nats.url(), None, &NatsTls::with_ca(nats.ca_file()), TIMEOUT, TIMEOUT).expect("connect")
}

#[test]
fn every_operation_round_trips_against_a_server() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let mut config = EnvServerConfig::new(name("cartpole"), "cartpole");
    config.reward_threshold = Some(475.0);
    let server = servers.start(config);
    let client = client(&nats);
    let instances = client.block_on(client.discover(&name("cartpole"))).unwrap();
    assert_eq!(instances.len(), 1);
    let instance = &instances[0];
    assert_eq!(instance.id, server.id());
    assert_eq!(instance.subject(Op::Step).as_str(), format!("volley.env.cartpole.{}.step", server.id()));
    assert!(client.block_on(client.discover(&name("other"))).unwrap().is_empty());

    let spaces = client.block_on(client.spaces(instance)).unwrap();
    assert_eq!((spaces.obs_dim, spaces.n_actions, spaces.reward_threshold), (4, 2, Some(475.0)));
    assert!(spaces.snapshot);

    let opened = client.block_on(client.open(instance, &[11, 12, 13])).unwrap();
    let mut local = CartPole::new();
    let mut obs = [0.0f32; 4];
    local.reset(12, &mut obs).unwrap();
    assert_eq!(&f32s(&opened.obs)[4..8], &obs, "environment 1 was reset with seed 12");
    assert_eq!(server.n_sessions(), 1);

    let stepped = client.block_on(client.step(instance, opened.session, StepActions::Discrete(vec![0, 1, 1]))).unwrap();
    let outcome = local.step(Action::Discrete(1), &mut obs).unwrap();
    assert_eq!(&f32s(&stepped.obs)[4..8], &obs);
    assert_eq!(stepped.rewards, vec![1.0; 3]);
    assert_eq!(stepped.rewards[1], outcome.reward);
    assert!(stepped.final_obs.is_empty() && stepped.errors.is_empty());

    let state = client.block_on(client.snapshot(instance, opened.session, 1)).unwrap();
    let reset = client
        .block_on(client.reset(instance, opened.session, vec![Some(12), None, None], None, ObsEncoding::F32))
        .unwrap();
    assert_eq!(reset.len(), 12);
    let restored = client.block_on(client.restore(instance, opened.session, 2, state, ObsEncoding::F32)).unwrap();
    assert_eq!(restored, obs, "environment 1's state restored into environment 2");

    client.block_on(client.close(instance, opened.session)).unwrap();
    assert_eq!(server.n_sessions(), 0);
    client.block_on(client.close(instance, opened.session)).expect("closing twice is fine");
    let err = client.block_on(client.step(instance, opened.session, StepActions::Discrete(vec![0, 0, 0]))).unwrap_err();
    assert_eq!(err.reason(), "remote_unknown_session", "{err}");
}

#[test]
fn malformed_and_foreign_requests_are_answered_with_codes_and_counted() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let server = servers.start(EnvServerConfig::new(name("codes"), "cartpole"));
    let client = client(&nats);
    let instance = client.block_on(client.discover(&name("codes"))).unwrap().remove(0);
    let raw = |op: Op, payload: Vec<u8>| {
        let message = client
            .block_on(client.nats().request(instance.subject(op).clone(), Bytes::from(payload)))
            .expect("a reply");
        let headers = message.headers.expect("an error reply has headers");
        (
            headers.get(protocol::ERROR_CODE_HEADER).map(|v| v.as_str().to_string()),
            headers.get(protocol::ERROR_HEADER).map(|v| v.as_str().to_string()).unwrap_or_default(),
        )
    };
    assert_eq!(raw(Op::Step, b"not msgpack".to_vec()).0.as_deref(), Some("400"));
    let future = protocol::encode(&protocol::SpacesRequest { v: PROTOCOL_VERSION + 1 });
    let (code, message) = raw(Op::Spaces, future);
    assert_eq!(code.as_deref(), Some("505"));
    assert!(message.contains(&format!("protocol version {}", PROTOCOL_VERSION + 1)), "{message}");
    // Version 1 is still served for this discrete environment.
    let v1 = client.block_on(client.nats().request(
        instance.subject(Op::Spaces).clone(),
        Bytes::from(protocol::encode(&protocol::SpacesRequest { v: 1 })),
    ));
    let v1 = v1.expect("a reply");
    assert!(v1.headers.is_none(), "a version-1 spaces request is answered");
    let spaces: protocol::SpacesReply = protocol::decode("spaces", &v1.payload).unwrap();
    assert_eq!((spaces.n_actions, spaces.action_space().unwrap().n_actions()), (2, 2));
    let opened = client.block_on(client.open(&instance, &[1, 2])).unwrap();
    let wrong_len = protocol::encode(&protocol::StepRequest {
        v: PROTOCOL_VERSION,
        session: opened.session,
        actions: StepActions::Discrete(vec![0]),
    });
    let (code, message) = raw(Op::Step, wrong_len);
    assert_eq!(code.as_deref(), Some("400"));
    assert!(message.contains("1 actions for 2 environments"), "{message}");
    // Box actions for a discrete environment are a request error, not a panic.
    let floats = protocol::encode(&protocol::StepRequest {
        v: PROTOCOL_VERSION,
        session: opened.session,
        actions: StepActions::Box(vec![0.5, 0.5]),
    });
    let (code, message) = raw(Op::Step, floats);
    assert_eq!(code.as_deref(), Some("400"));
    assert!(message.contains("box actions"), "{message}");
    let too_many = client.block_on(client.open(&instance, &vec![0; 5000])).unwrap_err();
    assert_eq!(too_many.reason(), "remote_server_error", "{too_many}");
    assert_eq!(server.counters().rejected.load(Ordering::Relaxed), 4);

    // An out-of-range action is an environment failure, not a request error: the environment
    // is reset and the step reported as a truncation.
    let stepped = client.block_on(client.step(&instance, opened.session, StepActions::Discrete(vec![0, 7]))).unwrap();
    assert_eq!(stepped.errors.len(), 1);
    assert_eq!(stepped.errors[0].env, 1);
    assert_eq!((stepped.truncated[1], stepped.rewards[1]), (true, 0.0));
    assert_eq!(f32s(&stepped.final_obs).len(), 4);
}

/// Issue 12 (docs/ENV_PROTOCOL.md, "Errors"): fields of the wrong type or range are 400, never
/// 505 (a string version is malformed, not foreign) or 500 (a negative seed).
#[test]
fn fields_of_the_wrong_type_or_range_are_bad_requests() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let server = servers.start(EnvServerConfig::new(name("fields"), "cartpole"));
    let client = client(&nats);
    let instance = client.block_on(client.discover(&name("fields"))).unwrap().remove(0);
    let code = |op: Op, request: serde_json::Value| {
        let payload = rmp_serde::to_vec_named(&request).expect("encodable");
        let message = client
            .block_on(client.nats().request(instance.subject(op).clone(), Bytes::from(payload)))
            .expect("a reply");
        let headers = message.headers.expect("an error reply has headers");
        headers.get(protocol::ERROR_CODE_HEADER).map(|v| v.as_str().to_string()).unwrap_or_default()
    };
    use serde_json::json;
    let opened = client.block_on(client.open(&instance, &[1, 2])).unwrap();
    let bad = [
        (Op::Spaces, json!({"v": "1"})),
        (Op::Spaces, json!({"v": -1})),
        (Op::Spaces, json!({"v": true})),
        (Op::Open, json!({"v": 1, "n_envs": 1, "seeds": [-1]})),
        (Op::Open, json!({"v": 1, "n_envs": 1, "seeds": [1.5]})),
        (Op::Open, json!({"v": 1, "n_envs": "1", "seeds": [0]})),
        (Op::Open, json!({"v": 1, "n_envs": 0, "seeds": []})),
        (Op::Reset, json!({"v": 1, "session": opened.session, "seeds": [-5, null]})),
        (Op::Step, json!({"v": 1, "session": "abc", "actions": [0, 1]})),
        (Op::Step, json!({"v": 1, "session": opened.session, "actions": "01"})),
    ];
    for (op, request) in &bad {
        assert_eq!(code(*op, request.clone()), "400", "{op:?} {request}");
    }
    assert_eq!(server.counters().rejected.load(Ordering::Relaxed), bad.len() as u64);
}

/// With generation-0 seeds, a remote vector env is step for step the in-process one, however
/// its environments are split into sessions over instances.
#[test]
fn remote_vec_env_matches_the_in_process_vec_env_bit_for_bit() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let _a = servers.start(EnvServerConfig::new(name("same"), "cartpole"));
    let _b = servers.start(EnvServerConfig::new(name("same"), "cartpole"));
    let n_envs = 7;
    let mut config = RemoteVecEnvConfig::new(name("same"), n_envs, 42);
    config.envs_per_session = 3;
    config.expected_spaces = Some((4, 2));
    let mut remote = RemoteVecEnv::new(client(&nats), config).unwrap();
    assert_eq!(remote.n_sessions(), 3);
    assert_eq!(remote.instances_in_use().len(), 2, "sessions are spread over both instances");
    let mut local = VecEnv::new(vec![CartPole::new(); n_envs], 42).unwrap();
    assert_eq!(VectorEnv::obs(&remote), local.obs());
    let (mut remote_out, mut local_out) = (VecStep::new(n_envs, 4), VecStep::new(n_envs, 4));
    let mut n_finished = 0;
    for step_idx in 0..600usize {
        let actions: Vec<usize> = (0..n_envs).map(|i| (step_idx * 7 + i * 3 + step_idx / 5) % 2).collect();
        VectorEnv::step(&mut remote, Actions::Discrete(&actions), &mut remote_out).unwrap();
        local.step(Actions::Discrete(&actions), &mut local_out).unwrap();
        assert_eq!(remote_out.rewards, local_out.rewards);
        assert_eq!(remote_out.terminated, local_out.terminated);
        assert_eq!(remote_out.truncated, local_out.truncated);
        assert_eq!(remote_out.finished_episodes, local_out.finished_episodes);
        for env_idx in 0..n_envs {
            if local_out.terminated[env_idx] || local_out.truncated[env_idx] {
                assert_eq!(remote_out.final_obs[env_idx * 4..][..4], local_out.final_obs[env_idx * 4..][..4]);
            }
        }
        assert!(remote_out.env_errors.is_empty());
        assert_eq!(VectorEnv::obs(&remote), local.obs(), "step {step_idx}");
        n_finished += local_out.finished_episodes.len();
    }
    assert!(n_finished > 20, "episodes ended and auto-reset remotely too ({n_finished})");
    // A scheduled fresh start resets that environment alone (protocol version 3).
    remote.reset_env(4, 77).unwrap();
    local.reset_env(4, Some(77)).unwrap();
    assert_eq!(VectorEnv::obs(&remote), local.obs(), "only environment 4 was reset");
    // Snapshot and restore go through the session of the environment.
    let state = remote.snapshot_env(5).unwrap();
    remote.restore_env(0, &state).unwrap();
    assert_eq!(VectorEnv::obs(&remote)[0..4], VectorEnv::obs(&remote)[20..24]);
}

/// A server that stops mid-run aborts the episodes it hosted (reported, counted, not listed as
/// finished); the vector env re-opens those environments on the surviving instance.
#[test]
fn a_lost_server_aborts_its_episodes_and_the_env_moves_to_another_instance() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let a = servers.start(EnvServerConfig::new(name("failover"), "cartpole"));
    let b = servers.start(EnvServerConfig::new(name("failover"), "cartpole"));
    let client = client(&nats);
    let counters = client.counters().clone();
    let mut remote = RemoteVecEnv::new(client, RemoteVecEnvConfig::new(name("failover"), 8, 3)).unwrap();
    assert_eq!(remote.n_sessions(), 2, "auto batching: one session per instance");
    let mut out = VecStep::new(8, 4);
    for _ in 0..5 {
        VectorEnv::step(&mut remote, Actions::Discrete(&[1; 8]), &mut out).unwrap();
    }
    let before = VectorEnv::obs(&remote).to_vec();
    let (dead, survivor) = (a.id().to_string(), b.id().to_string());
    servers.runtime.block_on(a.stop());
    VectorEnv::step(&mut remote, Actions::Discrete(&[1; 8]), &mut out).unwrap();
    assert_eq!(out.env_errors.len(), 4, "the four environments of the dead session: {:?}", out.env_errors);
    for (env_idx, error) in &out.env_errors {
        assert_eq!(error.reason(), "remote_gone", "{error}");
        assert!(out.truncated[*env_idx] && !out.terminated[*env_idx] && out.rewards[*env_idx] == 0.0);
        assert_eq!(out.final_obs[env_idx * 4..][..4], before[env_idx * 4..][..4], "the last observation received");
        assert!(out.finished_episodes.iter().all(|e| e.env_idx != *env_idx), "an aborted episode is not finished");
    }
    assert_eq!(counters.sessions_lost.load(Ordering::Relaxed), 1);
    assert_eq!(counters.sessions_opened.load(Ordering::Relaxed), 3);
    assert_eq!(remote.instances_in_use(), vec![survivor.clone()]);
    assert!(!remote.instances_in_use().contains(&dead));
    assert_eq!(b.n_sessions(), 2);
    for _ in 0..50 {
        VectorEnv::step(&mut remote, Actions::Discrete(&[0; 8]), &mut out).unwrap();
        assert!(out.env_errors.is_empty());
    }
}

/// A session the server expired (idle timeout) is lost and re-opened on the same instance.
#[test]
fn an_expired_session_is_reopened() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let mut config = EnvServerConfig::new(name("expiry"), "cartpole");
    config.idle_timeout = Duration::from_millis(200);
    let server = servers.start(config);
    let client = client(&nats);
    let counters = client.counters().clone();
    let mut remote = RemoteVecEnv::new(client, RemoteVecEnvConfig::new(name("expiry"), 2, 0)).unwrap();
    while server.n_sessions() > 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = VecStep::new(2, 4);
    VectorEnv::step(&mut remote, Actions::Discrete(&[0, 1]), &mut out).unwrap();
    assert!(out.env_errors.iter().all(|(_, e)| e.reason() == "remote_unknown_session"));
    assert_eq!(out.env_errors.len(), 2);
    assert_eq!(counters.sessions_lost.load(Ordering::Relaxed), 1);
    assert_eq!(remote.instances_in_use(), vec![server.id().to_string()]);
    assert_eq!(server.counters().expired.load(Ordering::Relaxed), 1);
    VectorEnv::step(&mut remote, Actions::Discrete(&[0, 1]), &mut out).unwrap();
    assert!(out.env_errors.is_empty());
}

/// Instances serving other spaces are skipped; with none usable and `stop` set, building fails.
#[test]
fn instances_with_other_spaces_are_skipped() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let _server = servers.start(EnvServerConfig::new(name("spaces"), "cartpole"));
    let mut config = RemoteVecEnvConfig::new(name("spaces"), 2, 0);
    config.expected_spaces = Some((5, 2));
    config.stop.store(true, Ordering::Release);
    let err = RemoteVecEnv::new(client(&nats), config.clone()).unwrap_err();
    assert!(matches!(err, EnvServiceError::NoInstances { .. }), "{err}");
    // The right sizes but the other kind of actions (a Gaussian policy needs a box): skipped.
    config.expected_spaces = Some((4, 2));
    config.expected_continuous = Some(true);
    let err = RemoteVecEnv::new(client(&nats), config.clone()).unwrap_err();
    assert!(matches!(err, EnvServiceError::NoInstances { .. }), "{err}");
    config.expected_continuous = Some(false);
    let mut env = RemoteVecEnv::new(client(&nats), config).expect("discrete actions were asked for");
    assert_eq!(VectorEnv::action_space(&env), volley_env::ActionSpace::Discrete { n: 2 });
    // Continuous actions for discrete servers are refused before anything is sent.
    let mut out = VecStep::new(2, 4);
    let err = VectorEnv::step(&mut env, Actions::Continuous { values: &[0.0, 0.0], dim: 1 }, &mut out).unwrap_err();
    assert!(matches!(err, volley_env::EnvError::WrongActionKind { expected: "discrete" }), "{err}");
}

/// Box actions (protocol version 2) through the Rust server: a remote Pendulum steps bit for bit
/// like the in-process one, out-of-range values clipped the same way; a non-finite action fails
/// only its environment; version-1 requests and integer actions are refused.
#[test]
fn pendulum_box_actions_step_like_the_in_process_vec_env() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let _server = servers
        .runtime
        .block_on(EnvServer::start(
            servers.client.clone(),
            Arc::new(|| EnvConfig::Pendulum.build()),
            EnvServerConfig::new(name("pendulum"), "pendulum"),
        ))
        .expect("server starts");
    let n_envs = 3;
    let mut config = RemoteVecEnvConfig::new(name("pendulum"), n_envs, 9);
    config.expected_spaces = Some((3, 1));
    config.expected_continuous = Some(true);
    let mut remote = RemoteVecEnv::new(client(&nats), config).unwrap();
    let space = VectorEnv::action_space(&remote);
    assert_eq!(space, volley_env::ActionSpace::Box { low: vec![-2.0], high: vec![2.0], shape: vec![1] });
    let mut local = VecEnv::new((0..n_envs).map(|_| EnvConfig::Pendulum.build().unwrap()).collect(), 9).unwrap();
    assert_eq!(VectorEnv::obs(&remote), local.obs());
    let (mut remote_out, mut local_out) = (VecStep::new(n_envs, 3), VecStep::new(n_envs, 3));
    let mut n_finished = 0;
    for step_idx in 0..450usize {
        // Values in [-3.5, 3.5]: a third of them outside the bounds.
        let values: Vec<f32> = (0..n_envs).map(|i| ((step_idx * 7 + i * 5) % 15) as f32 * 0.5 - 3.5).collect();
        let actions = Actions::Continuous { values: &values, dim: 1 };
        VectorEnv::step(&mut remote, actions, &mut remote_out).unwrap();
        local.step(actions, &mut local_out).unwrap();
        assert_eq!(remote_out.rewards, local_out.rewards, "step {step_idx}");
        assert_eq!(remote_out.truncated, local_out.truncated);
        assert_eq!(remote_out.finished_episodes, local_out.finished_episodes);
        assert!(remote_out.env_errors.is_empty());
        assert_eq!(VectorEnv::obs(&remote), local.obs(), "step {step_idx}");
        n_finished += local_out.finished_episodes.len();
    }
    assert_eq!(n_finished, 2 * n_envs, "Pendulum truncates at 200 steps, remotely too");
    // Integer actions for box servers are refused before anything is sent.
    let err = VectorEnv::step(&mut remote, Actions::Discrete(&[0, 0, 0]), &mut remote_out).unwrap_err();
    assert!(matches!(err, volley_env::EnvError::WrongActionKind { expected: "continuous" }), "{err}");

    // The raw protocol: a NaN and an infinite action fail their environments only.
    let client = client(&nats);
    let instance = client.block_on(client.discover(&name("pendulum"))).unwrap().remove(0);
    let opened = client.block_on(client.open(&instance, &[1, 2, 3])).unwrap();
    let actions = StepActions::Box(vec![0.5, f32::NAN, f32::NEG_INFINITY]);
    let stepped = client.block_on(client.step(&instance, opened.session, actions)).unwrap();
    assert_eq!(stepped.errors.iter().map(|f| f.env).collect::<Vec<_>>(), vec![1, 2]);
    assert!(stepped.errors.iter().all(|f| f.message.contains("non-finite action")));
    assert_eq!(stepped.truncated, vec![false, true, true]);
    assert_eq!((stepped.rewards[1], stepped.rewards[2]), (0.0, 0.0));
    assert_eq!(f32s(&stepped.final_obs), f32s(&opened.obs)[3..9].to_vec(), "the last valid observations are final");
    // Wrong length and integer actions are request errors; version 1 cannot carry box actions.
    for actions in [StepActions::Box(vec![0.0; 2]), StepActions::Discrete(vec![0, 0, 0])] {
        let err = client.block_on(client.step(&instance, opened.session, actions)).unwrap_err();
        assert!(matches!(err, EnvServiceError::Server { code: 400, .. }), "{err}");
    }
    let v1 = client
        .block_on(client.nats().request(
            instance.subject(Op::Spaces).clone(),
            Bytes::from(protocol::encode(&protocol::SpacesRequest { v: 1 })),
        ))
        .expect("a reply");
    let code = v1.headers.as_ref().and_then(|h| h.get(protocol::ERROR_CODE_HEADER)).map(|v| v.as_str().to_string());
    assert_eq!(code.as_deref(), Some("505"));
}

/// Observations of a vector environment, as floats.
fn f32s(obs: &ObsBin) -> Vec<f32> {
    obs.decode(ObsEncoding::F32).expect("f32 observations")
}

/// Protocol version 3: MinAtar served as `u8` images (one byte per value on the wire) is step
/// for step the in-process game, frame-stacked on the client side as the actor does; a
/// version-2 request to an image server is refused with 505.
#[test]
fn image_observations_travel_as_bytes_and_match_the_in_process_env() {
    let nats = TestNats::start();
    let servers = Servers::new(&nats);
    let game = EnvConfig::from_name("minatar-breakout").unwrap();
    let shape = game.image_shape().expect("MinAtar is an image env");
    let dim: usize = shape.iter().product();
    // No image shape in the config: the server serves what the observation space declares.
    let config = EnvServerConfig::new(name("breakout"), "minatar-breakout");
    let factory: EnvFactory = {
        let game = game.clone();
        Arc::new(move || game.build())
    };
    let _server =
        servers.runtime.block_on(EnvServer::start(servers.client.clone(), factory, config)).expect("server starts");

    // The raw protocol: the spaces declare the image, observations are dim bytes per env.
    let client = client(&nats);
    let instance = client.block_on(client.discover(&name("breakout"))).unwrap().remove(0);
    assert_eq!(instance.protocol, PROTOCOL_VERSION);
    let spaces = client.block_on(client.spaces(&instance)).unwrap();
    assert_eq!(spaces.image_shape(), Ok(Some(shape)));
    assert_eq!(spaces.obs_encoding(), ObsEncoding::U8);
    let opened = client.block_on(client.open(&instance, &[1, 2])).unwrap();
    assert_eq!(opened.obs.0.len(), 2 * dim, "one byte per value");
    let v2 = client.block_on(async {
        let payload = protocol::encode(&protocol::SpacesRequest { v: 2 });
        client.nats().request(instance.subject(Op::Spaces).clone(), payload.into()).await
    });
    let reply = v2.expect("an error reply");
    let headers = reply.headers.expect("error headers");
    assert_eq!(headers.get(protocol::ERROR_CODE_HEADER).map(|v| v.as_str()), Some("505"));

    // Through the remote vector env, with 4 frames stacked: bit for bit the local game.
    let n_envs = 3;
    let mut config = RemoteVecEnvConfig::new(name("breakout"), n_envs, 9);
    config.expected_spaces = Some((dim, 3));
    let remote = RemoteVecEnv::new(client.clone(), config).unwrap();
    assert_eq!(remote.image_shape(), Some(shape));
    let mut remote = volley_env::FrameStack::new(Box::new(remote), 4).unwrap();
    let local = VecEnv::new((0..n_envs).map(|_| game.build().unwrap()).collect(), 9).unwrap();
    let mut local = volley_env::FrameStack::new(Box::new(local), 4).unwrap();
    assert_eq!(VectorEnv::obs(&remote), VectorEnv::obs(&local));
    let (mut remote_out, mut local_out) = (VecStep::new(n_envs, 4 * dim), VecStep::new(n_envs, 4 * dim));
    let mut n_finished = 0;
    for step_idx in 0..400usize {
        let actions: Vec<usize> = (0..n_envs).map(|i| (step_idx * 5 + i + step_idx / 7) % 3).collect();
        VectorEnv::step(&mut remote, Actions::Discrete(&actions), &mut remote_out).unwrap();
        VectorEnv::step(&mut local, Actions::Discrete(&actions), &mut local_out).unwrap();
        assert_eq!(remote_out.rewards, local_out.rewards);
        assert_eq!(remote_out.terminated, local_out.terminated);
        assert_eq!(remote_out.finished_episodes, local_out.finished_episodes);
        for env_idx in 0..n_envs {
            if local_out.terminated[env_idx] || local_out.truncated[env_idx] {
                let row = env_idx * 4 * dim..(env_idx + 1) * 4 * dim;
                assert_eq!(remote_out.final_obs[row.clone()], local_out.final_obs[row]);
            }
        }
        assert!(remote_out.env_errors.is_empty());
        assert_eq!(VectorEnv::obs(&remote), VectorEnv::obs(&local), "step {step_idx}");
        n_finished += local_out.finished_episodes.len();
    }
    assert!(n_finished > 0, "Breakout episodes ended and reset remotely too");
}
