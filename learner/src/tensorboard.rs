//! TensorBoard scalar logs (`--tensorboard DIR`): one event file per process, written where the
//! learner reports its metrics.
//!
//! The format is TensorFlow's TFRecord of `Event` protobufs, which TensorBoard reads from any
//! file whose name contains `tfevents`.
//! Each record is `u64 length (LE) | u32 masked CRC32C of the length | data | u32 masked CRC32C of
//! the data` (tensorflow/core/lib/io/record_writer.cc).
//! The protobuf is encoded here by hand: an `Event` needs only `wall_time` (field 1, double),
//! `step` (field 2, int64), `file_version` (field 3, string) and `summary` (field 5), and a
//! `Summary.Value` only `tag` (field 1, string) and `simple_value` (field 2, float)
//! (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto).
//!
//! Invariant: a write error is kept, not retried: the file stays a sequence of whole records up
//! to the first failure, and the error is reported once by [`TensorBoardLog::finish`].

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use volley_core::wire::TrajectorySegment;

use crate::{LearnerReport, UpdateStats};

/// What the first record of every event file says (TensorBoard checks the prefix).
const FILE_VERSION: &str = "brain.Event:2";

/// Episodes whose lengths the mean episode length is taken over (the same window as the
/// last-100 return).
const EPISODE_WINDOW: usize = 100;

/// How often the buffered records are flushed, so a running TensorBoard sees them.
const FLUSH_EVERY: Duration = Duration::from_secs(5);

/// Failures writing an event file.
#[derive(Debug, thiserror::Error)]
pub enum TensorBoardError {
    /// The directory or file could not be created.
    #[error("creating {path}: {source}")]
    Create {
        /// The path that failed.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A record could not be written or flushed.
    #[error("writing {path}: {source}")]
    Write {
        /// The event file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// TFRecord's masked CRC32C: checksums of data that contains checksums are hard to tell apart
/// from the data, so TensorFlow rotates and offsets them (tensorflow/core/lib/hash/crc32c.h).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Append one TFRecord framing `data` to `out`.
pub fn encode_record(data: &[u8], out: &mut Vec<u8>) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

fn put_varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A protobuf field key: `field_number << 3 | wire_type`.
fn put_key(field: u32, wire_type: u8, out: &mut Vec<u8>) {
    put_varint(u64::from(field) << 3 | u64::from(wire_type), out);
}

fn put_bytes_field(field: u32, bytes: &[u8], out: &mut Vec<u8>) {
    put_key(field, 2, out);
    put_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// Encode an `Event` with `wall_time`, `step` and either a `file_version` or a `Summary` of
/// `simple_value` scalars.
pub fn encode_event(wall_time: f64, step: i64, file_version: Option<&str>, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut event = Vec::with_capacity(32 + scalars.len() * 40);
    put_key(1, 1, &mut event);
    event.extend_from_slice(&wall_time.to_le_bytes());
    put_key(2, 0, &mut event);
    // int64 is a two's-complement varint: a negative step takes ten bytes.
    put_varint(step as u64, &mut event);
    if let Some(version) = file_version {
        put_bytes_field(3, version.as_bytes(), &mut event);
    }
    if !scalars.is_empty() {
        let mut summary = Vec::with_capacity(scalars.len() * 40);
        let mut value = Vec::with_capacity(64);
        for (tag, scalar) in scalars {
            value.clear();
            put_bytes_field(1, tag.as_bytes(), &mut value);
            put_key(2, 5, &mut value);
            value.extend_from_slice(&scalar.to_le_bytes());
            put_bytes_field(1, &value, &mut summary);
        }
        put_bytes_field(5, &summary, &mut event);
    }
    event
}

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// An event file: records are buffered and flushed every few seconds and at the end.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
    record: Vec<u8>,
}

impl std::fmt::Debug for EventWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWriter").field("path", &self.path).finish_non_exhaustive()
    }
}

impl EventWriter {
    /// Create `dir` if needed and a new event file in it, named as TensorFlow names them
    /// (`events.out.tfevents.<seconds>.<host>.<pid>`, here with `volley` for the host), and write
    /// the file-version record.
    pub fn create(dir: &Path) -> Result<Self, TensorBoardError> {
        std::fs::create_dir_all(dir).map_err(|source| TensorBoardError::Create { path: dir.to_path_buf(), source })?;
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let pid = std::process::id();
        // A second file of the same second and process (a restarted writer) gets a suffix
        // rather than truncating the first.
        let mut attempt = 0u32;
        let (path, file) = loop {
            let name = match attempt {
                0 => format!("events.out.tfevents.{secs}.volley.{pid}"),
                n => format!("events.out.tfevents.{secs}.volley.{pid}.{n}"),
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(source) => return Err(TensorBoardError::Create { path, source }),
            }
        };
        let mut writer = EventWriter { path, file: BufWriter::new(file), record: Vec::new() };
        writer.write_event(&encode_event(now_secs(), 0, Some(FILE_VERSION), &[]))?;
        writer.flush()?;
        Ok(writer)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&mut self, event: &[u8]) -> Result<(), TensorBoardError> {
        self.record.clear();
        encode_record(event, &mut self.record);
        self.file.write_all(&self.record).map_err(|source| TensorBoardError::Write { path: self.path.clone(), source })
    }

    /// Write one event holding `scalars` at `step` (non-finite values are left out: TensorBoard
    /// plots them as gaps anyway, and a NaN says nothing a missing point does not).
    pub fn write_scalars(&mut self, step: i64, scalars: &[(&str, f32)]) -> Result<(), TensorBoardError> {
        let finite: Vec<(&str, f32)> = scalars.iter().copied().filter(|(_, v)| v.is_finite()).collect();
        if finite.is_empty() {
            return Ok(());
        }
        self.write_event(&encode_event(now_secs(), step, None, &finite))
    }

    /// Flush buffered records to the file.
    pub fn flush(&mut self) -> Result<(), TensorBoardError> {
        self.file.flush().map_err(|source| TensorBoardError::Write { path: self.path.clone(), source })
    }
}

/// The learner's scalars, one event per update with the env steps as the step (the x axis of
/// cleanrl's and Sample Factory's curves):
/// - `episode/return_mean_100`, `episode/return_mean_20`: undiscounted return of the last 100 and
///   20 finished episodes.
/// - `episode/length_mean_100`: steps of the last 100 finished episodes.
/// - `loss/total`, `loss/policy`, `loss/value`: the loss terms of the update.
/// - `policy/entropy`: mean policy entropy in nats.
/// - `policy/approx_kl`: the `k3` KL estimate between the policy the loss measured against and
///   the updated one (cleanrl's `approx_kl`).
/// - `policy/behaviour_kl`: `KL(μ ‖ π)` of the batch against its behaviour policies (CPU backend).
/// - `optim/learning_rate`, `optim/grad_norm`: learning rate used, gradient norm before clipping.
/// - `optim/ent_coef`: the entropy bonus coefficient used.
/// - `throughput/env_steps_per_sec`: env steps per second of wall time since the previous update.
/// - `lag/mean`, `lag/max`: policy lag of the batch in versions.
#[derive(Debug)]
pub struct TensorBoardLog {
    writer: EventWriter,
    episode_lens: VecDeque<u32>,
    last: Option<(u64, Duration)>,
    last_flush: Instant,
    error: Option<TensorBoardError>,
}

impl TensorBoardLog {
    /// A log writing a new event file in `dir`.
    pub fn create(dir: &Path) -> Result<Self, TensorBoardError> {
        Ok(TensorBoardLog {
            writer: EventWriter::create(dir)?,
            episode_lens: VecDeque::with_capacity(EPISODE_WINDOW),
            last: None,
            last_flush: Instant::now(),
            error: None,
        })
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    /// Note the episodes that finished in a segment (for the episode length).
    pub fn on_segment(&mut self, segment: &TrajectorySegment) {
        for episode in &segment.finished_episodes {
            if self.episode_lens.len() == EPISODE_WINDOW {
                self.episode_lens.pop_front();
            }
            self.episode_lens.push_back(episode.episode_len);
        }
    }

    /// Write the scalars of one update.
    /// After a write error nothing more is written; [`finish`](Self::finish) reports it.
    pub fn on_update(&mut self, report: &LearnerReport, stats: &UpdateStats) {
        if self.error.is_some() {
            return;
        }
        let (prev_steps, prev_elapsed) = self.last.unwrap_or((0, Duration::ZERO));
        let dt = report.elapsed.saturating_sub(prev_elapsed).as_secs_f64();
        let steps_per_sec =
            if dt > 0.0 { report.env_steps.saturating_sub(prev_steps) as f64 / dt } else { f64::NAN } as f32;
        self.last = Some((report.env_steps, report.elapsed));
        let length_mean = if self.episode_lens.is_empty() {
            f32::NAN
        } else {
            self.episode_lens.iter().map(|&n| f64::from(n)).sum::<f64>() as f32 / self.episode_lens.len() as f32
        };
        let scalars = [
            (
                "episode/return_mean_100",
                if report.recent_returns.is_empty() { f32::NAN } else { report.mean_return(100) },
            ),
            (
                "episode/return_mean_20",
                if report.recent_returns.is_empty() { f32::NAN } else { report.mean_return(20) },
            ),
            ("episode/length_mean_100", length_mean),
            ("loss/total", stats.loss.total),
            ("loss/policy", stats.loss.policy),
            ("loss/value", stats.loss.value),
            ("policy/entropy", stats.loss.entropy),
            ("policy/approx_kl", stats.loss.approx_kl),
            ("policy/behaviour_kl", stats.off_policy.as_ref().map_or(f32::NAN, |o| o.behaviour_kl)),
            ("optim/learning_rate", stats.learning_rate),
            ("optim/grad_norm", stats.grad_norm),
            ("optim/ent_coef", stats.ent_coef),
            ("throughput/env_steps_per_sec", steps_per_sec),
            ("lag/mean", stats.lag_mean),
            ("lag/max", stats.lag_max as f32),
        ];
        let step = i64::try_from(report.env_steps).unwrap_or(i64::MAX);
        let mut result = self.writer.write_scalars(step, &scalars);
        if result.is_ok() && self.last_flush.elapsed() >= FLUSH_EVERY {
            self.last_flush = Instant::now();
            result = self.writer.flush();
        }
        if let Err(err) = result {
            tracing::warn!(%err, "TensorBoard log stopped");
            self.error = Some(err);
        }
    }

    /// Flush, and report the first write error if there was one.
    pub fn finish(mut self) -> Result<PathBuf, TensorBoardError> {
        if let Some(err) = self.error.take() {
            return Err(err);
        }
        self.writer.flush()?;
        Ok(self.writer.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC32C check value ("123456789" → 0xe3069283, RFC 3720 B.4) and TensorFlow's masking of
    /// it, 0xc78ab0e5 (what `tensorboard.summary.writer.record_writer.masked_crc32c` returns).
    #[test]
    fn masked_crc_matches_tensorflow() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
    }

    /// The record framing of an empty payload, byte for byte: length 0, the masked CRC of eight
    /// zero bytes, no data, the masked CRC of nothing (`crc32c("") = 0`).
    #[test]
    fn empty_record_is_framed_with_both_checksums() {
        let mut out = Vec::new();
        encode_record(&[], &mut out);
        assert_eq!(out.len(), 16);
        assert_eq!(&out[..8], &[0; 8]);
        assert_eq!(u32::from_le_bytes(out[8..12].try_into().expect("4 bytes")), masked_crc32c(&[0; 8]));
        assert_eq!(u32::from_le_bytes(out[12..16].try_into().expect("4 bytes")), 0xa282_ead8);
    }

    /// The encoding of `Event { wall_time: 1.5, step: 300, summary { value { tag: "a",
    /// simple_value: 2.0 } } }`, written out from the protobuf encoding rules.
    #[test]
    fn scalar_event_encodes_as_protobuf() {
        let bytes = encode_event(1.5, 300, None, &[("a", 2.0)]);
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0xac, 0x02]); // 300 = 0b10_0101100
        let value = [0x0a, 0x01, b'a', 0x15, 0x00, 0x00, 0x00, 0x40];
        let summary = [&[0x0a, value.len() as u8][..], &value].concat();
        expected.extend_from_slice(&[0x2a, summary.len() as u8]);
        expected.extend_from_slice(&summary);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn file_version_event_carries_the_version_string() {
        let bytes = encode_event(0.0, 0, Some(FILE_VERSION), &[]);
        let tail = [&[0x1a, FILE_VERSION.len() as u8][..], FILE_VERSION.as_bytes()].concat();
        assert!(bytes.ends_with(&tail), "{bytes:?}");
        assert_eq!(&bytes[9..11], &[0x10, 0x00]);
    }

    #[test]
    fn negative_step_is_a_ten_byte_varint() {
        let bytes = encode_event(0.0, -1, None, &[]);
        assert_eq!(&bytes[9..], &[0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    }

    /// Read the file back record by record, checking both checksums of each.
    fn read_records(path: &Path) -> Vec<Vec<u8>> {
        let bytes = std::fs::read(path).expect("event file");
        let mut records = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4")), masked_crc32c(len_bytes));
            let len = u64::from_le_bytes(len_bytes.try_into().expect("8")) as usize;
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().expect("4"));
            assert_eq!(crc, masked_crc32c(data));
            records.push(data.to_vec());
            at += 16 + len;
        }
        records
    }

    #[test]
    fn writer_leaves_non_finite_values_out_and_frames_every_record() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut writer = EventWriter::create(&dir.path().join("tb")).expect("writer");
        writer.write_scalars(7, &[("x", 1.0), ("nan", f32::NAN), ("inf", f32::INFINITY)]).expect("write");
        writer.write_scalars(8, &[("nan", f32::NAN)]).expect("write nothing");
        writer.flush().expect("flush");
        let name = writer.path().file_name().expect("name").to_string_lossy().into_owned();
        assert!(name.contains("tfevents"), "{name}");
        let records = read_records(writer.path());
        assert_eq!(records.len(), 2, "the version record and one scalar event");
        assert!(records[0].ends_with(FILE_VERSION.as_bytes()));
        let scalar = &records[1];
        assert!(scalar.windows(3).any(|w| w == [0x0a, 0x01, b'x']));
        assert!(!scalar.windows(3).any(|w| w == b"nan") && !scalar.windows(3).any(|w| w == b"inf"));
    }

    #[test]
    fn second_writer_in_the_same_directory_gets_its_own_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let first = EventWriter::create(dir.path()).expect("first");
        let second = EventWriter::create(dir.path()).expect("second");
        assert_ne!(first.path(), second.path());
    }

    #[test]
    fn unwritable_directory_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").expect("file");
        let err = EventWriter::create(&file.join("tb")).expect_err("a file is in the way");
        assert!(err.to_string().starts_with("creating "), "{err}");
    }
}
