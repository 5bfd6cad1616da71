//! The run's broker objects: [`NatsBus::ensure_run`] creates them (the trajectory stream and the
//! learner's consumer, the run bucket, the weights store, and the work objects when work items
//! are on), the run bucket's `spec` and `ended` keys are read and written here, and
//! [`open_kv`] and [`open_objects`] open a bucket or store for every component.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream, ErrorCode};
use bytes::Bytes;
use tracing::info;

use super::work::ensure_work_objects;
use super::{call, failed, timed, NatsBus, NatsConfig};
use crate::run_end::{self, RunEnd, RunEndReason};
use crate::signing::{WeightsPublicKeys, WeightsSigningKey};
use crate::TransportError;
use volley_core::spec::{RunSpec, StoreLimits, StoredSpecError};
use volley_core::subjects;

impl NatsBus {
    /// Learner side: idempotently create the run's broker objects and publish the run spec.
    ///
    /// Creates or updates the trajectory stream (file storage, limits retention so consumed
    /// segments stay for replay, the run spec's `hyper.stores.trajectory_max_bytes` /
    /// `trajectory_max_age_secs` bounds discarding the oldest, a [`NatsConfig::duplicate_window`] for `Nats-Msg-Id` dedup), the
    /// durable pull consumer `learner` (explicit ack, `ack_wait`, `max_deliver`), the KV bucket
    /// and the object store, all with [`NatsConfig::replicas`] copies, then puts `spec` as JSON
    /// under key `spec`. Safe to call again,
    /// e.g. by a restarted learner; changed limits are applied to the existing stream and
    /// consumer.
    pub fn ensure_run(&self, spec: &RunSpec) -> Result<(), TransportError> {
        let shared = &self.shared;
        let config = &shared.config;
        if spec.run != config.run {
            return Err(failed(
                "ensure run",
                format!("spec is for run {} but the bus serves run {}", spec.run, config.run),
            ));
        }
        let stored_spec = spec.encode_stored();
        let timeout = config.request_timeout;
        let stores = &spec.hyper.stores;
        let max_age = Duration::try_from_secs_f64(stores.trajectory_max_age_secs).map_err(|err| {
            failed("ensure run", format!("stores.trajectory_max_age_secs {}: {err}", stores.trajectory_max_age_secs))
        })?;
        // The server refuses a duplicate window longer than the stream's age limit.
        let duplicate_window =
            if max_age.is_zero() { config.duplicate_window } else { config.duplicate_window.min(max_age) };
        let created = shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&config.run);
            let stream_config = stream::Config {
                name: stream_name.clone(),
                description: Some(format!("volley run {} trajectory segments", config.run)),
                subjects: vec![subjects::trajectories_all(&config.run)],
                retention: stream::RetentionPolicy::Limits,
                storage: stream::StorageType::File,
                discard: stream::DiscardPolicy::Old,
                max_bytes: stores.trajectory_max_bytes as i64,
                max_age,
                duplicate_window,
                num_replicas: config.replicas,
                ..Default::default()
            };
            call("create trajectory stream", timeout, shared.js.create_or_update_stream(stream_config)).await?;
            let stream = call("open trajectory stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
            call("create learner consumer", timeout, stream.create_consumer(learner_consumer_config(config))).await?;

            let bucket = subjects::run_bucket(&config.run);
            let kv = match open_kv(&shared.js, &bucket, timeout).await? {
                Some(kv) => kv,
                None => {
                    let kv_config = kv::Config {
                        bucket: bucket.clone(),
                        description: format!("volley run {}: spec and weights pointer", config.run),
                        history: stores.kv_history as i64,
                        max_bytes: stores.kv_max_bytes as i64,
                        storage: stream::StorageType::File,
                        num_replicas: config.replicas,
                        ..Default::default()
                    };
                    match call("create run bucket", timeout, shared.js.create_key_value(kv_config)).await {
                        Ok(kv) => kv,
                        // Another learner may have created it in between.
                        Err(err) => open_kv(&shared.js, &bucket, timeout).await?.ok_or(err)?,
                    }
                }
            };
            let weights_bucket = subjects::weights_bucket(&config.run);
            if open_objects(&shared.js, &weights_bucket, timeout).await?.is_none() {
                let objects_config = object_store::Config {
                    bucket: weights_bucket.clone(),
                    description: Some(format!("volley run {}: weights buffers", config.run)),
                    max_bytes: stores.weights_max_bytes as i64,
                    storage: stream::StorageType::File,
                    num_replicas: config.replicas,
                    ..Default::default()
                };
                if let Err(err) =
                    call("create weights store", timeout, shared.js.create_object_store(objects_config)).await
                {
                    open_objects(&shared.js, &weights_bucket, timeout).await?.ok_or(err)?;
                }
            }
            if spec.hyper.work.enabled {
                ensure_work_objects(shared, &spec.hyper.work, stores).await?;
            }
            call("put run spec", timeout, kv.put(subjects::SPEC_KEY, Bytes::from(stored_spec))).await?;
            // The run goes on (again): actors must not take an earlier end for this one.
            if call("read run end", timeout, kv.get(subjects::ENDED_KEY)).await?.is_some() {
                call("clear run end", timeout, kv.delete(subjects::ENDED_KEY)).await?;
            }
            info!(run = %config.run, stream = %stream_name, "run ready on nats");
            Ok(())
        });
        created.map_err(|err| with_storage_hint(err, stores))
    }

    /// Actor side: the run spec, or `Ok(None)` when the run's bucket or its `spec` key does not
    /// exist (yet). The stored value's checksum is verified before it is decoded
    /// ([`RunSpec::decode_stored`]): the inner error is the value's (corrupt or malformed, to
    /// be counted and read again later), the outer one the broker's.
    pub fn read_spec(&self) -> Result<Option<Result<RunSpec, StoredSpecError>>, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let Some(kv) = open_kv(&shared.js, &subjects::run_bucket(&shared.config.run), timeout).await? else {
                return Ok(None);
            };
            let Some(bytes) = call("read run spec", timeout, kv.get(subjects::SPEC_KEY)).await? else {
                return Ok(None);
            };
            Ok(Some(RunSpec::decode_stored(&bytes)))
        })
    }

    /// Learner side: say that the run is over, so that actors stop instead of waiting for
    /// weights that will not come ([`NatsBus::read_run_ended`]). The marker is signed with
    /// `signer` when given ([`crate::run_end`]). [`NatsBus::ensure_run`] clears it when a learner
    /// starts the run again.
    pub fn mark_run_ended(
        &self,
        reason: RunEndReason,
        signer: Option<&WeightsSigningKey>,
    ) -> Result<(), TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        let marker = run_end::encode_marker(shared.config.run.as_str(), reason, signer);
        shared.block_on(async {
            let bucket = subjects::run_bucket(&shared.config.run);
            let kv = open_kv(&shared.js, &bucket, timeout)
                .await?
                .ok_or_else(|| failed("mark run ended", format!("bucket {bucket} does not exist")))?;
            call("mark run ended", timeout, kv.put(subjects::ENDED_KEY, Bytes::from(marker))).await?;
            Ok(())
        })
    }

    /// Actor side: whether the learner ended the run. Any value of the `ended` key that is not
    /// a marker for this run ([`run_end::decode_marker`], signed by one of `trusted` when given)
    /// is [`RunEnd::Refused`]: the run goes on (issue 46: an actor had an answer to its request
    /// stored there, and every actor of the run stopped).
    pub fn read_run_ended(&self, trusted: Option<&WeightsPublicKeys>) -> Result<RunEnd, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let Some(kv) = open_kv(&shared.js, &subjects::run_bucket(&shared.config.run), timeout).await? else {
                return Ok(RunEnd::Ongoing);
            };
            let Some(value) = call("read run end", timeout, kv.get(subjects::ENDED_KEY)).await? else {
                return Ok(RunEnd::Ongoing);
            };
            Ok(match run_end::decode_marker(&value, shared.config.run.as_str(), trusted) {
                Ok(reason) => RunEnd::Ended(reason),
                Err(refusal) => RunEnd::Refused(refusal),
            })
        })
    }

    /// Learner side: put `stored_spec` ([`RunSpec::encode_stored`], what
    /// [`NatsBus::ensure_run`] wrote) under the `spec` key again unless it is the key's newest
    /// value; returns whether it was written. Costs one get when nothing changed. An actor can
    /// have an answer to its request stored there (docs/SECURITY.md, "Relays that remain"),
    /// and actors started after that could not read the spec until it is written again.
    pub fn reassert_spec(&self, stored_spec: &[u8]) -> Result<bool, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let bucket = subjects::run_bucket(&shared.config.run);
            let kv = open_kv(&shared.js, &bucket, timeout)
                .await?
                .ok_or_else(|| failed("reassert run spec", format!("bucket {bucket} does not exist")))?;
            let current = call("read run spec", timeout, kv.get(subjects::SPEC_KEY)).await?;
            if current.as_deref() == Some(stored_spec) {
                return Ok(false);
            }
            call("put run spec", timeout, kv.put(subjects::SPEC_KEY, Bytes::copy_from_slice(stored_spec))).await?;
            Ok(true)
        })
    }
}

/// Deliveries the learner's NATS consumer hands out unacknowledged: nats-server's default
/// `max_ack_pending`, which `learner_consumer_config` keeps (it does not set its own). A
/// learner holding more segments than this unacknowledged stops receiving new ones.
pub const CONSUMER_MAX_ACK_PENDING: u64 = 1000;

pub(super) fn learner_consumer_config(config: &NatsConfig) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(subjects::LEARNER_CONSUMER.to_string()),
        description: Some(format!("volley run {} learner", config.run)),
        deliver_policy: consumer::DeliverPolicy::All,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: config.max_deliver,
        ..Default::default()
    }
}

/// JetStream's "insufficient storage resources" (error code 10047): a stream's `max_bytes` is
/// reserved against the server's storage limit when the stream is created, so a run whose
/// store limits exceed what is left cannot be created even on an empty broker. Say which
/// limits those are and what to change.
fn with_storage_hint(err: TransportError, stores: &StoreLimits) -> TransportError {
    match err {
        TransportError::Failed { operation, message } if message.contains("10047") => TransportError::Failed {
            operation,
            message: format!(
                "{message}; the broker reserves each stream's byte limit when it is created, and this run's \
                 (stores.trajectory_max_bytes {}, stores.weights_max_bytes {}, stores.kv_max_bytes {}; with \
                 work items on, also stores.work_max_bytes and stores.snapshot_max_bytes) do not fit what is \
                 left of its JetStream storage: lower them in the run spec, or raise the broker's jetstream \
                 max_file_store (unset, 75 % of the store directory's free disk)",
                stores.trajectory_max_bytes, stores.weights_max_bytes, stores.kv_max_bytes
            ),
        },
        err => err,
    }
}

/// Whether the JetStream stream `name` exists.
async fn stream_exists(js: &jetstream::Context, name: &str, timeout: Duration) -> Result<bool, TransportError> {
    match timed("look up stream", timeout, js.get_stream(name)).await? {
        Ok(_) => Ok(true),
        Err(err) => match err.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(js_err)
                if js_err.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(false)
            }
            _ => Err(failed("look up stream", err)),
        },
    }
}

/// The KV bucket, or `None` when it does not exist.
pub(super) async fn open_kv(
    js: &jetstream::Context,
    bucket: &str,
    timeout: Duration,
) -> Result<Option<kv::Store>, TransportError> {
    if !stream_exists(js, &subjects::kv_backing_stream(bucket), timeout).await? {
        return Ok(None);
    }
    call("open kv bucket", timeout, js.get_key_value(bucket)).await.map(Some)
}

/// The object store, or `None` when it does not exist.
pub(super) async fn open_objects(
    js: &jetstream::Context,
    bucket: &str,
    timeout: Duration,
) -> Result<Option<object_store::ObjectStore>, TransportError> {
    if !stream_exists(js, &subjects::object_backing_stream(bucket), timeout).await? {
        return Ok(None);
    }
    call("open object store", timeout, js.get_object_store(bucket)).await.map(Some)
}
