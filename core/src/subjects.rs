//! Every NATS name Volley uses: subjects, stream, consumer, buckets, keys, object and message ids.
//!
//! No other module spells a NATS name as a literal, so this file is the map of the
//! broker layout for one run `<run>`:
//!
//! | what | name |
//! | --- | --- |
//! | trajectory subject of one actor (publish) | `volley.<run>.traj.<actor, lowercased>` |
//! | all trajectory subjects of a run (stream filter) | `volley.<run>.traj.>` |
//! | trajectory stream | `volley-<run>-traj` |
//! | durable pull consumer of the learner | `learner` |
//! | run KV bucket (keys `spec`, `weights`, `ended`) | `volley-<run>` |
//! | weights object store | `volley-<run>-wts` |
//! | weights object of version `v` | `v<v, 20 digits>` |
//! | live weights chunks (core NATS, learner publishes, actors subscribe) | `volley.<run>.weights.live` |
//! | trajectory message id (`Nats-Msg-Id`, dedup) | `<actor>-<incarnation>-<env_idx>-<segment_idx>` |
//!
//! Environment services (docs/ENV_PROTOCOL.md) are not tied to a run:
//!
//! | what | name |
//! | --- | --- |
//! | NATS micro service of environment service `<name>` | `volley-env-<name>` |
//! | endpoint `<op>` of instance `<id>` | `volley.env.<name>.<id>.<op>` |
//! | discovery (service API) | `$SRV.INFO.volley-env-<name>`, `$SRV.PING.volley-env-<name>` |
//!
//! Rules (checked by the unit tests for the longest and most awkward [`RunId`]s):
//! - Subjects are lowercase tokens separated by dots, general to specific; wildcards appear
//!   only in the subscription subject [`trajectories_all`].
//! - Stream and consumer names contain no `.`, `*`, `>` or whitespace and stay under 32
//!   characters, as NATS advises; that includes the `KV_` and `OBJ_` streams NATS creates
//!   behind the buckets (which is why the object store is `-wts`, not `-weights`).
//! - Bucket names use only `[A-Za-z0-9_-]`.
//!
//! A [`RunId`] is `[a-z0-9-]{1,16}` and an [`ActorId`] `[A-Za-z0-9_-]{1,64}`, so every name
//! built here is valid by construction.

use crate::ids::{ActorId, RunId};
use volley_env::EnvServiceName;

/// Durable name of the learner's pull consumer on the trajectory stream (named after its role).
pub const LEARNER_CONSUMER: &str = "learner";

/// KV key (in [`run_bucket`]) holding the run spec as JSON.
pub const SPEC_KEY: &str = "spec";

/// KV key (in [`run_bucket`]) holding the pointer to the newest weights object as JSON.
pub const WEIGHTS_KEY: &str = "weights";

/// KV key (in [`run_bucket`]) the learner writes when the run is over (solved or a budget
/// spent), with the reason as text; actors that read it stop. A learner starting the run
/// again deletes it.
pub const ENDED_KEY: &str = "ended";

/// The subject an actor publishes its segments to: `volley.<run>.traj.<actor>`.
///
/// The actor token is lowercased to keep subjects lowercase; `_` and `-` stay (both are valid
/// in a subject token, and an [`ActorId`] has no `.`, `*`, `>` or whitespace). Two actors
/// whose names differ only in case share a subject, which is harmless: the subject only routes
/// (and groups in monitoring); a segment's identity is its body and its message id.
pub fn trajectories(run: &RunId, actor: &ActorId) -> String {
    format!("volley.{run}.traj.{}", actor.as_str().to_ascii_lowercase())
}

/// Every trajectory subject of a run, `volley.<run>.traj.>`: the trajectory stream's filter.
/// Subscription only; never publish to it.
pub fn trajectories_all(run: &RunId) -> String {
    format!("volley.{run}.traj.>")
}

/// The JetStream stream holding a run's segments: `volley-<run>-traj`.
pub fn trajectory_stream(run: &RunId) -> String {
    format!("volley-{run}-traj")
}

/// The run's KV bucket, `volley-<run>`, holding [`SPEC_KEY`], [`WEIGHTS_KEY`] and [`ENDED_KEY`].
pub fn run_bucket(run: &RunId) -> String {
    format!("volley-{run}")
}

/// The run's object store for weights buffers: `volley-<run>-wts`.
pub fn weights_bucket(run: &RunId) -> String {
    format!("volley-{run}-wts")
}

/// The object holding policy version `version`: `v` and 20 zero-padded digits, so names sort
/// like versions.
pub fn weights_object(version: u64) -> String {
    format!("v{version:020}")
}

/// The object holding the delta that produces policy version `version` from its parent:
/// `d` and 20 zero-padded digits (a chain of them follows each anchor, [`weights_object`]).
pub fn weights_delta_object(version: u64) -> String {
    format!("d{version:020}")
}

/// The core-NATS subject the learner fans every weights version out on, in chunks
/// ([`crate::wire::live`]), to the followers connected now: `volley.<run>.weights.live`.
/// Outside the trajectory stream's filter (`volley.<run>.traj.>`), so nothing stores it.
pub fn weights_live(run: &RunId) -> String {
    format!("volley.{run}.weights.live")
}

/// The core-NATS subject the learner announces what it has taken from the trajectory stream
/// on ([`crate::wire::pace`]), so that actors pace on pushed notices instead of polling the
/// consumer: `volley.<run>.pace`. Outside the trajectory stream's filter, so nothing stores it.
pub fn pace(run: &RunId) -> String {
    format!("volley.{run}.pace")
}

/// The `Nats-Msg-Id` of one segment: `<actor>-<incarnation>-<env_idx>-<segment_idx>`.
///
/// The server drops a second message with the same id inside the stream's duplicate window,
/// so a sink that retries a publish whose ack was lost stores the segment once.
/// `incarnation` is fixed per sink (a new one per actor process), so an actor that restarts
/// under the same name and counts `segment_idx` from 0 again is not mistaken for a retry.
/// The id stays unambiguous because the last three tokens are numbers or hex.
pub fn trajectory_msg_id(actor: &ActorId, incarnation: &str, env_idx: u32, segment_idx: u64) -> String {
    format!("{actor}-{incarnation}-{env_idx}-{segment_idx}")
}

/// The `Nats-Msg-Id` of a batch frame of `n_segments` segments ([`crate::wire::batch`]) whose
/// first segment has the id [`trajectory_msg_id`]`(actor, incarnation, env_idx, segment_idx)`:
/// that id and `+<n_segments>`.
///
/// A sink sends a retried frame with the same id, so the stream stores it once. No two frames
/// of one sink start with the same segment, and the `+` keeps a frame's id apart from any
/// single segment's.
pub fn trajectory_batch_msg_id(
    actor: &ActorId,
    incarnation: &str,
    env_idx: u32,
    segment_idx: u64,
    n_segments: usize,
) -> String {
    format!("{actor}-{incarnation}-{env_idx}-{segment_idx}+{n_segments}")
}

/// Name of the JetStream stream NATS creates behind the KV bucket `bucket` (`KV_<bucket>`).
pub fn kv_backing_stream(bucket: &str) -> String {
    format!("KV_{bucket}")
}

/// The subject the learner's scheduler publishes work items to: `volley.<run>.work`.
pub fn work(run: &RunId) -> String {
    format!("volley.{}.work", run.as_str())
}

/// The work-queue stream of a run (work-queue retention): `volley-<run>-work`.
pub fn work_stream(run: &RunId) -> String {
    format!("volley-{}-work", run.as_str())
}

/// Durable pull consumer on the work stream. The learner's work dispatcher alone pulls from
/// it and leases items to actors, at most `work.max_items_per_actor` per actor identity
/// (issue 46); actors have no access to the stream.
pub const WORK_CONSUMER: &str = "actors";

/// The verbs of the work-lease protocol between actors and the learner's dispatcher: take
/// (a request), progress and done (plain publishes carrying the lease id).
pub const WORK_LEASE_VERBS: [&str; 3] = ["take", "progress", "done"];

/// Where an actor sends one verb of the work-lease protocol:
/// `volley.<run>.work.<verb>.<actor>`, the actor id lowercased like [`trajectories`], so
/// broker permissions can bind the last token to the actor's credentials.
pub fn work_lease(run: &RunId, verb: &str, actor: &ActorId) -> String {
    format!("volley.{run}.work.{verb}.{}", actor.as_str().to_ascii_lowercase())
}

/// Every actor's subject of one work-lease verb, `volley.<run>.work.<verb>.*`: the
/// dispatcher's subscription. Subscription only; never publish to it.
pub fn work_lease_all(run: &RunId, verb: &str) -> String {
    format!("volley.{run}.work.{verb}.*")
}

/// The object store of episode snapshots: `volley-<run>-snap`.
pub fn snapshot_bucket(run: &RunId) -> String {
    format!("volley-{}-snap", run.as_str())
}

/// The KV bucket mapping each work item to its newest snapshot: `volley-<run>-snapidx`.
pub fn snapshot_index_bucket(run: &RunId) -> String {
    format!("volley-{}-snapidx", run.as_str())
}

/// KV key (in [`snapshot_index_bucket`]) of work item `id`'s newest snapshot.
pub fn snapshot_index_key(work_item: u64) -> String {
    format!("item-{work_item}")
}

/// Name of the JetStream stream NATS creates behind the object store `bucket` (`OBJ_<bucket>`).
pub fn object_backing_stream(bucket: &str) -> String {
    format!("OBJ_{bucket}")
}

/// The subject that holds the metadata (and, after a delete, the delete marker) of `object`
/// in the object store `bucket`: `$O.<bucket>.M.<base64url(object)>`, as the NATS object
/// store defines it. Purging it removes a deleted object's last trace.
pub fn object_meta_subject(bucket: &str, object: &str) -> String {
    format!("$O.{bucket}.M.{}", base64_url(object.as_bytes()))
}

/// The subject of the chunks of one stored object version (`nuid`, from its metadata) in the
/// object store `bucket`: `$O.<bucket>.C.<nuid>`, as the NATS object store defines it.
pub fn object_chunk_subject(bucket: &str, nuid: &str) -> String {
    format!("$O.{bucket}.C.{nuid}")
}

/// The subject that holds the values of `key` in the KV bucket `bucket`: `$KV.<bucket>.<key>`,
/// as the NATS key-value store defines it.
pub fn kv_key_subject(bucket: &str, key: &str) -> String {
    format!("$KV.{bucket}.{key}")
}

/// RFC 4648 §5 base64 ("URL and filename safe") with padding, the object store's name encoding.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The NATS micro service name of environment service `name`: `volley-env-<name>`.
pub fn env_service(name: &EnvServiceName) -> String {
    format!("volley-env-{name}")
}

/// The subject of endpoint `op` of instance `instance` of environment service `name`:
/// `volley.env.<name>.<instance>.<op>`. The instance id is used verbatim (NATS micro ids are
/// mixed-case alphanumerics); clients take subjects from the instance's `$SRV.INFO` reply.
pub fn env_endpoint(name: &EnvServiceName, instance: &str, op: &str) -> String {
    format!("volley.env.{name}.{instance}.{op}")
}

/// The service-API subject that every instance of `service` answers with its `INFO`
/// (endpoints and metadata): `$SRV.INFO.<service>`.
pub fn service_info(service: &str) -> String {
    format!("$SRV.INFO.{service}")
}

/// The service-API subject that every instance of `service` answers with a `PING` reply:
/// `$SRV.PING.<service>`.
pub fn service_ping(service: &str) -> String {
    format!("$SRV.PING.{service}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn object_meta_subject_encodes_the_name_as_the_object_store_does() {
        // RFC 4648 test vectors, then a URL-safe character and a weights object name.
        let cases =
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE=")];
        for (plain, encoded) in cases {
            assert_eq!(super::base64_url(plain.as_bytes()), encoded);
        }
        assert_eq!(super::base64_url(&[0xfb, 0xff]), "-_8=");
        assert_eq!(super::object_meta_subject("b", "v00000000000000000001"), "$O.b.M.djAwMDAwMDAwMDAwMDAwMDAwMDAx");
        assert_eq!(super::object_chunk_subject("b", "Xy12"), "$O.b.C.Xy12");
        assert_eq!(super::kv_key_subject("volley-local", super::WEIGHTS_KEY), "$KV.volley-local.weights");
    }

    use super::*;

    /// NATS advises stream, consumer and account names under 32 characters.
    const MAX_NAME_CHARS: usize = 32;

    fn awkward_runs() -> Vec<RunId> {
        ["a-1-b", "0", "-", "sixteen-chars-xy", "a--b-", "9-9-9-9-9-9-9-9"]
            .into_iter()
            .map(|name| RunId::new(name).expect("a valid run id"))
            .collect()
    }

    fn awkward_actors() -> Vec<ActorId> {
        let long = "A".repeat(64);
        ["Actor_7", "volley-actor-7f9c6d-x2kq", "_", "-", long.as_str()]
            .into_iter()
            .map(|name| ActorId::new(name).expect("a valid actor id"))
            .collect()
    }

    fn assert_publish_subject(subject: &str) {
        assert!(!subject.is_empty(), "empty subject");
        assert_eq!(subject, subject.to_ascii_lowercase(), "subject {subject:?} is not lowercase");
        for token in subject.split('.') {
            assert!(!token.is_empty(), "subject {subject:?} has an empty token");
            assert!(token != "*" && token != ">", "publish subject {subject:?} has a wildcard");
            assert!(
                token.bytes().all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>'),
                "subject {subject:?} token {token:?} has a wildcard, whitespace or control character"
            );
        }
    }

    fn assert_stream_or_consumer_name(name: &str) {
        assert!(!name.is_empty(), "empty name");
        assert!(name.len() < MAX_NAME_CHARS, "name {name:?} is {} characters", name.len());
        assert!(
            name.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>' | b'/' | b'\\')),
            "name {name:?} has a character NATS refuses in stream or consumer names"
        );
    }

    fn assert_bucket_name(name: &str) {
        assert!(!name.is_empty(), "empty bucket name");
        assert!(
            name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "bucket {name:?} is not [A-Za-z0-9_-]"
        );
    }

    #[test]
    fn every_name_is_valid_for_awkward_run_and_actor_ids() {
        for run in awkward_runs() {
            for actor in awkward_actors() {
                let subject = trajectories(&run, &actor);
                assert_publish_subject(&subject);
                assert!(subject.starts_with(&format!("volley.{run}.traj.")), "{subject}");
                assert_eq!(subject.split('.').count(), 4, "{subject} is not volley.<run>.traj.<actor>");
            }
            let live = weights_live(&run);
            assert_publish_subject(&live);
            assert!(!live.starts_with(all_prefix(&run).as_str()), "{live} would be stored with the segments");
            for verb in WORK_LEASE_VERBS {
                for actor in awkward_actors() {
                    let subject = work_lease(&run, verb, &actor);
                    assert_publish_subject(&subject);
                    assert_eq!(subject.split('.').count(), 5, "{subject} is not volley.<run>.work.<verb>.<actor>");
                    assert_ne!(subject, work(&run), "{subject} would be stored with the work items");
                }
                let all = work_lease_all(&run, verb);
                assert!(all.ends_with(".*") && all.matches('*').count() == 1, "{all}");
            }
            let all = trajectories_all(&run);
            assert!(all.ends_with(".>") && all.matches('>').count() == 1, "{all}");
            assert_publish_subject(all.trim_end_matches(".>"));

            assert_stream_or_consumer_name(&trajectory_stream(&run));
            assert_stream_or_consumer_name(LEARNER_CONSUMER);
            for bucket in [run_bucket(&run), weights_bucket(&run)] {
                assert_bucket_name(&bucket);
            }
            assert_stream_or_consumer_name(&kv_backing_stream(&run_bucket(&run)));
            assert_stream_or_consumer_name(&object_backing_stream(&weights_bucket(&run)));
        }
    }

    fn all_prefix(run: &RunId) -> String {
        trajectories_all(run).trim_end_matches('>').to_string()
    }

    #[test]
    fn kv_keys_and_object_names_are_plain_tokens() {
        for key in [
            SPEC_KEY,
            WEIGHTS_KEY,
            ENDED_KEY,
            &weights_object(0),
            &weights_object(u64::MAX),
            &weights_delta_object(u64::MAX),
        ] {
            assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'), "{key:?}");
        }
    }

    #[test]
    fn weights_objects_sort_like_versions() {
        let mut names: Vec<String> = [10u64, 9, 100, 0, u64::MAX].iter().map(|&v| weights_object(v)).collect();
        names.sort();
        assert_eq!(names, [0u64, 9, 10, 100, u64::MAX].iter().map(|&v| weights_object(v)).collect::<Vec<_>>());
        assert_eq!(weights_object(3), "v00000000000000000003");
    }

    #[test]
    fn message_ids_differ_per_segment_and_per_incarnation() {
        let actor = |name: &str| ActorId::new(name).expect("valid");
        let id = trajectory_msg_id(&actor("a-1"), "0f", 2, 3);
        assert_eq!(id, "a-1-0f-2-3");
        assert_ne!(id, trajectory_msg_id(&actor("a-1"), "0f", 2, 4));
        assert_ne!(id, trajectory_msg_id(&actor("a-1"), "10", 2, 3));
        assert_ne!(trajectory_msg_id(&actor("a"), "1", 2, 3), trajectory_msg_id(&actor("a-1"), "2", 3, 3));
        assert_eq!(trajectory_batch_msg_id(&actor("a-1"), "0f", 2, 3, 8), "a-1-0f-2-3+8");
        assert_ne!(trajectory_batch_msg_id(&actor("a-1"), "0f", 2, 3, 1), id);
    }

    #[test]
    fn env_service_names_and_subjects_are_valid() {
        for name in ["cartpole", "cartpole-v1", "a_b", &"z".repeat(EnvServiceName::MAX_LEN)] {
            let name = EnvServiceName::new(name).expect("valid");
            let service = env_service(&name);
            assert!(service.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'), "{service}");
            // nuid ids are 22 mixed-case alphanumerics.
            let subject = env_endpoint(&name, "U6rBnpbkyYmTA9aDk5fTlu", "step");
            assert_eq!(subject.split('.').count(), 5, "{subject}");
            assert!(!subject.contains(['*', '>', ' ']), "{subject}");
            assert_eq!(service_info(&service), format!("$SRV.INFO.volley-env-{name}"));
            assert_eq!(service_ping(&service), format!("$SRV.PING.volley-env-{name}"));
        }
    }

    #[test]
    fn actor_token_is_lowercased() {
        let run = RunId::new("a-1-b").expect("valid");
        let actor = ActorId::new("Actor_B-7").expect("valid");
        assert_eq!(trajectories(&run, &actor), "volley.a-1-b.traj.actor_b-7");
        assert_eq!(trajectories_all(&run), "volley.a-1-b.traj.>");
        assert_eq!(trajectory_stream(&run), "volley-a-1-b-traj");
        assert_eq!(run_bucket(&run), "volley-a-1-b");
        assert_eq!(weights_bucket(&run), "volley-a-1-b-wts");
    }
}
