//! The run-end marker (issue 48 item 6, issue 46): the value the learner writes under the run
//! bucket's `ended` key when the run is over, and what an actor accepts as one.
//!
//! An actor can have the server store the answer to any request it may make as the newest
//! value of that key (a reply subject of `$KV.volley-<run>.ended`; docs/SECURITY.md, "Relays
//! that remain"). So a marker is one line of a strict format no such answer has:
//!
//! ```text
//! volley-run-end/1 <run> <reason>[ <signature>]
//! ```
//!
//! `<reason>` is one of [`RunEndReason`], `<signature>` the learner's Ed25519 signature over the
//! run and the reason ([`WeightsSigningKey::sign_run_end`]), base64 without padding, present
//! when the learner signs its weights. Answers to requests are JSON documents or the learner's
//! own stored bytes (the spec, the weights pointer), none of which parses. An actor that
//! verifies weights verifies the marker with the same keys and refuses an unsigned one; one
//! that does not takes an unsigned, well-formed marker, as it takes unsigned weights.

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine;

use crate::signing::{SignatureError, WeightsPublicKeys, WeightsSigningKey, SIGNATURE_BYTES};

/// What every marker starts with: the format's name and version.
const MAGIC: &str = "volley-run-end/1";

/// Why a learner ended its run: the closed set it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEndReason {
    /// The target return was reached.
    Solved,
    /// The environment-step budget is spent.
    EnvStepBudget,
    /// The wall-time budget is spent.
    TimeBudget,
    /// The update budget is spent.
    UpdateBudget,
}

impl RunEndReason {
    const ALL: [RunEndReason; 4] =
        [RunEndReason::Solved, RunEndReason::EnvStepBudget, RunEndReason::TimeBudget, RunEndReason::UpdateBudget];

    /// The reason as written in the marker (and logged).
    pub fn as_str(self) -> &'static str {
        match self {
            RunEndReason::Solved => "solved",
            RunEndReason::EnvStepBudget => "env_step_budget",
            RunEndReason::TimeBudget => "time_budget",
            RunEndReason::UpdateBudget => "update_budget",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|reason| reason.as_str() == text)
    }
}

impl std::fmt::Display for RunEndReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a value of the `ended` key was not taken as the end of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RunEndRefusal {
    /// Not a marker: another format, another run, an unknown reason (e.g. a relayed answer).
    #[error("not a run-end marker for this run")]
    Malformed,
    /// A marker with no signature, read by an actor that requires signed weights.
    #[error("run-end marker carries no signature")]
    Unsigned,
    /// A marker whose signature no trusted key made for this run and reason.
    #[error("run-end marker's signature verifies with no trusted key")]
    BadSignature,
}

impl RunEndRefusal {
    /// Every refusal, for metrics that export each reason.
    pub const ALL: [RunEndRefusal; 3] =
        [RunEndRefusal::Malformed, RunEndRefusal::Unsigned, RunEndRefusal::BadSignature];

    /// The `reason` label of the metric and logs that count it.
    pub fn reason(self) -> &'static str {
        match self {
            RunEndRefusal::Malformed => "malformed",
            RunEndRefusal::Unsigned => "unsigned",
            RunEndRefusal::BadSignature => "bad_signature",
        }
    }
}

/// What the `ended` key says about the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// No marker: the run goes on (or does not exist yet).
    Ongoing,
    /// The learner ended the run.
    Ended(RunEndReason),
    /// The key holds a value that is not a marker this actor takes: the run goes on.
    Refused(RunEndRefusal),
}

/// The marker for the end of run `run` for `reason`, signed when `signer` is given.
pub fn encode_marker(run: &str, reason: RunEndReason, signer: Option<&WeightsSigningKey>) -> String {
    match signer {
        Some(key) => {
            let signature = key.sign_run_end(run, reason.as_str());
            format!("{MAGIC} {run} {reason} {}", STANDARD_NO_PAD.encode(signature))
        }
        None => format!("{MAGIC} {run} {reason}"),
    }
}

/// Read `value` as the end of run `run`; with `trusted`, only a marker signed by one of the
/// keys is taken.
pub fn decode_marker(
    value: &[u8],
    run: &str,
    trusted: Option<&WeightsPublicKeys>,
) -> Result<RunEndReason, RunEndRefusal> {
    let text = std::str::from_utf8(value).map_err(|_| RunEndRefusal::Malformed)?;
    let mut fields = text.split(' ');
    let (Some(MAGIC), Some(marker_run), Some(reason)) = (fields.next(), fields.next(), fields.next()) else {
        return Err(RunEndRefusal::Malformed);
    };
    let signature = fields.next();
    if fields.next().is_some() || marker_run != run {
        return Err(RunEndRefusal::Malformed);
    }
    let reason = RunEndReason::parse(reason).ok_or(RunEndRefusal::Malformed)?;
    let signature = match signature {
        Some(text) => Some(
            STANDARD_NO_PAD
                .decode(text)
                .ok()
                .and_then(|bytes| <[u8; SIGNATURE_BYTES]>::try_from(bytes).ok())
                .ok_or(RunEndRefusal::Malformed)?,
        ),
        None => None,
    };
    if let Some(keys) = trusted {
        keys.verify_run_end(run, reason.as_str(), signature.as_ref()).map_err(|err| match err {
            SignatureError::Unsigned => RunEndRefusal::Unsigned,
            SignatureError::Invalid => RunEndRefusal::BadSignature,
        })?;
    }
    Ok(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_round_trip_signed_and_unsigned() {
        let key = WeightsSigningKey::generate();
        let keys = key.public_keys();
        for reason in RunEndReason::ALL {
            let unsigned = encode_marker("run-a", reason, None);
            assert_eq!(decode_marker(unsigned.as_bytes(), "run-a", None), Ok(reason));
            let signed = encode_marker("run-a", reason, Some(&key));
            assert_eq!(decode_marker(signed.as_bytes(), "run-a", None), Ok(reason));
            assert_eq!(decode_marker(signed.as_bytes(), "run-a", Some(&keys)), Ok(reason));
            assert_eq!(decode_marker(unsigned.as_bytes(), "run-a", Some(&keys)), Err(RunEndRefusal::Unsigned));
        }
    }

    #[test]
    fn values_that_are_not_markers_for_this_run_are_refused() {
        let key = WeightsSigningKey::generate();
        let other = WeightsSigningKey::generate().public_keys();
        let signed = encode_marker("run-a", RunEndReason::Solved, Some(&key));
        assert_eq!(decode_marker(signed.as_bytes(), "run-a", Some(&other)), Err(RunEndRefusal::BadSignature));
        // A signature over another reason or run does not carry over.
        let relabelled = signed.replace(" solved ", " time_budget ");
        assert_eq!(
            decode_marker(relabelled.as_bytes(), "run-a", Some(&key.public_keys())),
            Err(RunEndRefusal::BadSignature)
        );
        for value in [
            &b""[..],
            b"solved",
            b"{\"type\":\"io.nats.jetstream.api.v1.stream_msg_get_response\"}",
            b"volley-run-end/1 run-b solved",
            b"volley-run-end/1 run-a interrupted",
            b"volley-run-end/2 run-a solved",
            b"volley-run-end/1 run-a solved ",
            b"volley-run-end/1 run-a solved !!",
            b"volley-run-end/1 run-a solved AAAA",
            b"volley-run-end/1 run-a solved\n",
            b"\xff\xfe",
        ] {
            assert_eq!(decode_marker(value, "run-a", None), Err(RunEndRefusal::Malformed), "{value:?}");
        }
    }
}
