//! Object reads by message gets, without any consumer, so that broker permissions can grant
//! actors reads and no consumer at all (issue 46, broker-config/accounts.conf).
//!
//! async-nats' object get creates an unnamed ordered push consumer. NATS checks no permission
//! on a push consumer's deliver subject, so a user who may create consumers can have the server
//! deliver a stream's messages onto any subject, the learner's live weights and pace subjects
//! included (issue 46: 4 of 4 such relays reached every actor). Here an object is read one chunk
//! per request instead: its metadata, then each chunk by "the next message on this object's
//! chunk subject at or after the sequence after the last one", bounded by the chunk count and
//! size the metadata states.
//!
//! Two flavours, by what the reader is granted: [`read_object_by_direct_gets`] (`$JS.API.DIRECT.GET`,
//! answered by any replica; the weights store, which actors read and never write) and
//! [`read_object_by_gets`] (`$JS.API.STREAM.MSG.GET`; the snapshot store, which actors write).

use async_nats::jetstream::{self, object_store};
use volley_core::subjects;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Object `name` of the object store `store` (bucket `bucket`), or `None` when it does not
/// exist or was deleted, read by one direct get per chunk (`$JS.API.DIRECT.GET.<stream>` with
/// `next_by_subj`, the object's chunk subject `$O.<bucket>.C.<nuid>`). The store's stream must
/// allow direct gets (async-nats creates object stores so).
///
/// At most `limit + 1` bytes are read: a larger object comes back cut there, one byte over the
/// limit, for the caller's decoder to refuse. A chunk missing, or chunks that do not add up to
/// the size the metadata states, is an error naming the object.
///
/// Links are refused (Volley writes none). The store's SHA-256 digest is not checked: every
/// object Volley stores (weights, episode snapshots) carries its own XXH3 checksum, verified
/// by its decoder.
pub(super) async fn read_object_by_direct_gets(
    js: &jetstream::Context,
    store: &object_store::ObjectStore,
    bucket: &str,
    name: &str,
    limit: usize,
) -> Result<Option<Vec<u8>>, BoxError> {
    let stream = js.get_stream_no_info(subjects::object_backing_stream(bucket)).await?;
    read_object_by(store, bucket, name, limit, ChunkReads::Direct(&stream)).await
}

/// [`read_object_by_direct_gets`] with message gets (`$JS.API.STREAM.MSG.GET.<stream>`),
/// for the snapshot store.
///
/// Issue 46: actors write the snapshot store, so a consumer an actor may create there relays
/// its own bytes onto any subject; actors are granted no consumer on that store
/// (broker-config/accounts.conf). Snapshots are small (one chunk, usually), so a get per chunk
/// costs little.
pub(super) async fn read_object_by_gets(
    js: &jetstream::Context,
    store: &object_store::ObjectStore,
    bucket: &str,
    name: &str,
    limit: usize,
) -> Result<Option<Vec<u8>>, BoxError> {
    let stream = js.get_stream_no_info(subjects::object_backing_stream(bucket)).await?;
    read_object_by(store, bucket, name, limit, ChunkReads::Message(&stream)).await
}

/// How [`read_object_by`] gets each chunk.
enum ChunkReads<'a> {
    /// `$JS.API.DIRECT.GET.<stream>` on this stream.
    Direct(&'a jetstream::stream::Stream<()>),
    /// `$JS.API.STREAM.MSG.GET.<stream>` on this stream.
    Message(&'a jetstream::stream::Stream<()>),
}

impl ChunkReads<'_> {
    /// The first message on `subject` at or after `sequence` (from the start when 0): its
    /// sequence and payload.
    async fn next(&self, subject: &str, sequence: u64) -> Result<(u64, bytes::Bytes), BoxError> {
        let message = match self {
            ChunkReads::Direct(stream) => {
                let mut get = stream.direct_get_builder().next_by_subject(subject);
                if sequence > 0 {
                    get = get.sequence(sequence);
                }
                get.send().await?
            }
            ChunkReads::Message(stream) => {
                let mut get = stream.raw_message_builder().next_by_subject(subject);
                if sequence > 0 {
                    get = get.sequence(sequence);
                }
                get.send().await?
            }
        };
        // The server answers with a message on the subject asked for; anything else is not a
        // chunk of this object.
        if message.subject.as_str() != subject {
            return Err(format!("asked for {subject}, got a message on {}", message.subject).into());
        }
        Ok((message.sequence, message.payload))
    }
}

async fn read_object_by(
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
        return if info.size == 0 {
            Ok(Some(bytes))
        } else {
            Err(format!("object {name}: no chunks for {} bytes", info.size).into())
        };
    }
    let chunk_subject = subjects::object_chunk_subject(bucket, &info.nuid);
    let mut next_sequence = 0;
    for chunk_idx in 0..info.chunks {
        let (sequence, payload) = reads.next(&chunk_subject, next_sequence).await.map_err(|err| {
            format!("object {name}: chunk {} of {} ({} bytes stated): {err}", chunk_idx + 1, info.chunks, info.size)
        })?;
        next_sequence = sequence.saturating_add(1);
        let room = (limit + 1).saturating_sub(bytes.len());
        bytes.extend_from_slice(&payload[..payload.len().min(room)]);
        if bytes.len() > limit {
            return Ok(Some(bytes));
        }
    }
    if bytes.len() != info.size {
        let what = if bytes.len() < info.size { "short" } else { "over-long" };
        return Err(format!(
            "object {name}: {what}: its {} chunks hold {} bytes, its metadata says {}",
            info.chunks,
            bytes.len(),
            info.size
        )
        .into());
    }
    Ok(Some(bytes))
}
