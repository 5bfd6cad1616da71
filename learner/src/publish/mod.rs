//! Publish: what leaves the learner after an update. Weights versions go out through a
//! [`volley_transport::WeightsPublisher`] (the loop in [`crate::consume`] hands them over, and
//! `Unpublished` holds the segments behind a version until it is out); [`checkpoint`]
//! writes the learner's whole state to disk.

pub mod checkpoint;

use std::collections::VecDeque;

use volley_core::ids::PolicyVersion;
use volley_transport::{DeliveryToken, WeightsPublisher};

/// The segments behind updates whose version is not published yet, by version, oldest
/// first: they are acknowledged only once their version is out (a publisher that publishes in
/// the background says when, [`WeightsPublisher::is_published`]).
#[derive(Debug)]
pub(crate) struct Unpublished {
    versions: VecDeque<(PolicyVersion, Vec<DeliveryToken>)>,
    /// Versions the learner may be ahead of its publisher before it waits for it.
    max_versions: usize,
}

impl Unpublished {
    /// Nothing held; the learner may run `max_policy_lag / 2` versions (at least 2) ahead of
    /// its publisher, so a publisher that fell behind costs lag, never stale data.
    pub(crate) fn new(max_policy_lag: u64) -> Self {
        let max_versions = usize::try_from(max_policy_lag / 2).unwrap_or(usize::MAX).max(2);
        Unpublished { versions: VecDeque::new(), max_versions }
    }

    /// Hold the tokens in `settled` until `version` is published. Whether more versions wait
    /// than the learner may run ahead: then the caller waits for its publisher.
    pub(crate) fn hold(&mut self, version: PolicyVersion, settled: &mut Vec<DeliveryToken>) -> bool {
        self.versions.push_back((version, std::mem::take(settled)));
        self.versions.len() > self.max_versions
    }

    /// Move the tokens of versions `publisher` has published to `settled`.
    pub(crate) fn release_published(&mut self, publisher: &dyn WeightsPublisher, settled: &mut Vec<DeliveryToken>) {
        while let Some((version, _)) = self.versions.front() {
            if !publisher.is_published(*version) {
                break;
            }
            if let Some((_, tokens)) = self.versions.pop_front() {
                settled.extend(tokens);
            }
        }
    }

    /// Every token held, published or not (the caller has flushed its publisher).
    pub(crate) fn release_all(self, settled: &mut Vec<DeliveryToken>) {
        settled.extend(self.versions.into_iter().flat_map(|(_, tokens)| tokens));
    }
}
