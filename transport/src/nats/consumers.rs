//! Reads that need a consumer on a KV bucket or object store, made so that broker permissions
//! can grant exactly them (issue 12, broker-config/accounts.conf).
//!
//! async-nats' own KV watch and object get create *unnamed* ordered consumers, whose create
//! request goes to `$JS.API.CONSUMER.CREATE.<stream>` with the filter subject only in the JSON
//! body, which permissions cannot see: a user allowed that subject may create any consumer on
//! the stream. The consumers here are ordered push consumers too (flow control, heartbeats,
//! re-created on a gap), but *named*, so their create request is
//! `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`, and the server refuses a body whose
//! filter differs from the subject's. The actor's grants name the filter: the `weights` key of
//! its run bucket, and object chunks (`$O.<bucket>.C.*`) of the weights store. Snapshots, which
//! actors write, are read with no consumer at all ([`read_object_by_gets`], issue 46).

use async_nats::jetstream::consumer::push::{Ordered, OrderedConfig};
use async_nats::jetstream::consumer::{DeliverPolicy, ReplayPolicy};
use async_nats::jetstream::{self, object_store};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use volley_core::subjects;

/// The header that marks a KV delete or purge (absent on a put).
const KV_OPERATION_HEADER: &str = "KV-Operation";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A consumer name no one else uses: the unique token of a fresh inbox.
fn unique_name(client: &async_nats::Client, role: &str) -> String {
    let inbox = client.new_inbox();
    let token = inbox.rsplit('.').next().unwrap_or(inbox.as_str());
    format!("{role}-{token}")
}

/// One change of a watched key.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct KeyChange {
    /// The value written (empty for a delete or purge).
    pub value: Bytes,
    /// A delete or purge rather than a put.
    pub deleted: bool,
}

/// Whether a KV message is a delete or purge marker rather than a put.
fn is_delete(headers: Option<&HeaderMap>) -> bool {
    headers.and_then(|headers| headers.get(KV_OPERATION_HEADER)).is_some()
}

/// The newest value of `key` in KV bucket `bucket`, then every later change, through one named
/// ordered consumer filtered on the key's subject (`$KV.<bucket>.<key>`). The caller must know
/// the bucket exists ([`open_kv`](super::open_kv)).
pub(super) async fn watch_key(
    js: &jetstream::Context,
    client: &async_nats::Client,
    bucket: &str,
    key: &str,
) -> Result<KeyWatch, BoxError> {
    let config = OrderedConfig {
        name: Some(unique_name(client, "watch")),
        deliver_subject: client.new_inbox(),
        description: Some(format!("volley watch of {key}")),
        filter_subject: subjects::kv_key_subject(bucket, key),
        replay_policy: ReplayPolicy::Instant,
        deliver_policy: DeliverPolicy::LastPerSubject,
        ..Default::default()
    };
    let consumer = js.create_consumer_on_stream(config, subjects::kv_backing_stream(bucket)).await?;
    Ok(KeyWatch { messages: consumer.messages().await? })
}

/// The changes of one key ([`watch_key`]).
pub(super) struct KeyWatch {
    messages: Ordered,
}

impl KeyWatch {
    /// The next change; `None` when the watch ended (the caller re-creates it).
    pub async fn next(&mut self) -> Option<Result<KeyChange, BoxError>> {
        let message = match self.messages.next().await? {
            Ok(message) => message,
            Err(err) => return Some(Err(err.into())),
        };
        let deleted = is_delete(message.headers.as_ref());
        Some(Ok(KeyChange { value: message.payload.clone(), deleted }))
    }
}

/// Object `name` of the object store `store` (bucket `bucket`), or `None` when it does not
/// exist or was deleted. At most `limit + 1` bytes are read: a larger object comes back cut
/// there, one byte over the limit, for the caller's decoder to refuse. The object's chunks come through one named
/// ordered consumer filtered on their subject (`$O.<bucket>.C.<nuid>`).
///
/// Links are refused (Volley writes none). The store's SHA-256 digest is not checked: every
/// object Volley stores (weights, episode snapshots) carries its own XXH3 checksum, verified
/// by its decoder; here the size and chunk count must match the metadata.
pub(super) async fn read_object(
    js: &jetstream::Context,
    client: &async_nats::Client,
    store: &object_store::ObjectStore,
    bucket: &str,
    name: &str,
    limit: usize,
) -> Result<Option<Vec<u8>>, BoxError> {
    read_object_by(js, client, store, bucket, name, limit, ChunkReads::Consumer).await
}

/// [`read_object`] without a consumer: one message get per chunk
/// (`$JS.API.STREAM.MSG.GET.<stream>`, the next message on the object's chunk subject after
/// the one before), for stores whose readers may create no consumer at all.
///
/// Issue 46: NATS checks no permission on a push consumer's deliver subject, and actors write
/// the snapshot store, so a consumer an actor may create there relays its own bytes onto any
/// subject, the learner's live weights and pace subjects included. Snapshots are small (one
/// chunk, usually), so a get per chunk costs little, and the actor user is granted no consumer
/// on that store (broker-config/accounts.conf).
pub(super) async fn read_object_by_gets(
    js: &jetstream::Context,
    client: &async_nats::Client,
    store: &object_store::ObjectStore,
    bucket: &str,
    name: &str,
    limit: usize,
) -> Result<Option<Vec<u8>>, BoxError> {
    let stream = js.get_stream_no_info(subjects::object_backing_stream(bucket)).await?;
    read_object_by(js, client, store, bucket, name, limit, ChunkReads::Gets(&stream)).await
}

/// How [`read_object_by`] reads an object's chunks.
enum ChunkReads<'a> {
    /// Through one named ordered consumer filtered on the chunks.
    Consumer,
    /// One message get per chunk on this stream.
    Gets(&'a jetstream::stream::Stream<()>),
}

async fn read_object_by(
    js: &jetstream::Context,
    client: &async_nats::Client,
    store: &object_store::ObjectStore,
    bucket: &str,
    name: &str,
    limit: usize,
    reads: ChunkReads<'_>,
) -> Result<Option<Vec<u8>>, BoxError> {
    let info = match store.info(name).await {
        Ok(info) => info,
        Err(err) if matches!(err.kind(), object_store::InfoErrorKind::NotFound) => return Ok(None),
        Err(err) => return Err(err.into()),
    };
    if info.deleted {
        return Ok(None);
    }
    if info.options.as_ref().is_some_and(|options| options.link.is_some()) {
        return Err(format!("object {name} in {bucket} is a link; volley stores none").into());
    }
    let mut bytes = Vec::with_capacity(info.size.min(limit));
    if info.chunks == 0 {
        return if info.size == 0 { Ok(Some(bytes)) } else { Err(format!("object {name}: no chunks").into()) };
    }
    let chunk_subject = subjects::object_chunk_subject(bucket, &info.nuid);
    if let ChunkReads::Gets(stream) = reads {
        let mut next_sequence = 0;
        for _ in 0..info.chunks {
            let mut get = stream.raw_message_builder().next_by_subject(chunk_subject.clone());
            if next_sequence > 0 {
                get = get.sequence(next_sequence);
            }
            let message = get.send().await.map_err(|err| format!("object {name}: chunk: {err}"))?;
            next_sequence = message.sequence.saturating_add(1);
            let room = (limit + 1).saturating_sub(bytes.len());
            bytes.extend_from_slice(&message.payload[..message.payload.len().min(room)]);
            if bytes.len() > limit {
                return Ok(Some(bytes));
            }
        }
        if bytes.len() != info.size {
            return Err(format!("object {name}: read {} bytes, its metadata says {}", bytes.len(), info.size).into());
        }
        return Ok(Some(bytes));
    }
    let config = OrderedConfig {
        name: Some(unique_name(client, "get")),
        deliver_subject: client.new_inbox(),
        description: Some(format!("volley get of {name}")),
        filter_subject: chunk_subject,
        replay_policy: ReplayPolicy::Instant,
        deliver_policy: DeliverPolicy::All,
        ..Default::default()
    };
    let consumer = js.create_consumer_on_stream(config, subjects::object_backing_stream(bucket)).await?;
    let mut messages = consumer.messages().await?;
    let mut chunks = 0;
    while chunks < info.chunks {
        let message = messages.next().await.ok_or_else(|| format!("object {name}: chunk stream ended"))??;
        chunks += 1;
        let room = (limit + 1).saturating_sub(bytes.len());
        bytes.extend_from_slice(&message.payload[..message.payload.len().min(room)]);
        if bytes.len() > limit {
            return Ok(Some(bytes));
        }
    }
    if bytes.len() != info.size {
        return Err(format!("object {name}: read {} bytes, its metadata says {}", bytes.len(), info.size).into());
    }
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_message_is_a_delete_only_with_the_operation_header() {
        assert!(!is_delete(None));
        let mut headers = HeaderMap::new();
        assert!(!is_delete(Some(&headers)));
        headers.insert(KV_OPERATION_HEADER, "DEL");
        assert!(is_delete(Some(&headers)));
    }
}
