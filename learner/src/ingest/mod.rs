//! Ingest: what a received segment passes before the learner lets it count. Decoding and the
//! run spec's shape checks happen in `volley_core::wire`; then [`admission`] applies the
//! learner's trust checks (the identity of the subject, versions, rewards, returns) and [`seen`] skips a segment delivered
//! again. Only a segment that passes both reaches the report, the scheduler and selection
//! ([`crate::select`]). `Intake` runs the three in the loop's order.

pub mod admission;
pub mod seen;

use tracing::{debug, warn};
use volley_core::ids::PolicyVersion;
use volley_core::spec::RunSpec;
use volley_core::wire::TrajectorySegment;
use volley_transport::rejection_log::RejectionLog;
use volley_transport::{Delivery, DeliveryToken, TrajectorySource};

use crate::ingest::admission::{check_identity, Admission};
use crate::ingest::seen::{SeenSegments, SEEN_STREAMS};
use crate::learner::Learner;
use crate::report::LearnerReport;

/// The admit stage of the learner loop: the run spec's checks, admission, the duplicate
/// filter, with every rejection counted by reason.
pub(crate) struct Intake {
    spec: RunSpec,
    layout_hash: u64,
    hidden_size: usize,
    admission: Admission,
    seen: SeenSegments,
    /// Every rejection is counted by reason; the log says the first few of each reason per
    /// window and then how many it left out (issue 46: one line per rejected part was 9.6
    /// times the bytes of the hostile traffic). The loop logs its own rare events here too.
    pub(crate) rejections: RejectionLog,
}

impl Intake {
    /// The checks of `learner`'s run.
    pub(crate) fn new(learner: &Learner) -> Self {
        let spec = learner.spec().clone();
        Intake {
            admission: Admission::new(&spec),
            layout_hash: learner.layout().hash(),
            hidden_size: learner.layout().recurrent_size(),
            spec,
            seen: SeenSegments::new(SEEN_STREAMS),
            rejections: RejectionLog::new("segment"),
        }
    }

    /// The segment of `delivery`, with its token, if it is valid for the run, passes
    /// admission at the learner's `version` and was not seen before. A rejected delivery is
    /// rejected on `source`; a duplicate's token goes to `settled` (it was used before). Both
    /// are counted in `report`.
    pub(crate) fn admit(
        &mut self,
        delivery: Delivery,
        version: PolicyVersion,
        source: &mut dyn TrajectorySource,
        report: &mut LearnerReport,
        settled: &mut Vec<DeliveryToken>,
    ) -> Option<(TrajectorySegment, DeliveryToken)> {
        let Delivery { segment, token, subject_actor, .. } = delivery;
        let checked = segment
            .and_then(|segment| segment.validate(&self.spec, self.layout_hash, self.hidden_size).map(|()| segment));
        // Admission: what an actor could claim falsely within the format, and the identity
        // of its subject, which its credentials bind (docs/SECURITY.md).
        let admitted = match checked {
            Ok(segment) => check_identity(&segment, subject_actor.as_deref())
                .and_then(|()| self.admission.check(&segment, version))
                .map(|()| segment)
                .map_err(|rejection| (rejection.reason(), rejection.to_string())),
            Err(err) => Err((err.reason(), err.to_string())),
        };
        let segment = match admitted {
            Ok(segment) => segment,
            Err((reason, err)) => {
                *report.segments_rejected.entry(reason).or_default() += 1;
                if self.rejections.record(reason) {
                    warn!(reason, %err, "segment rejected");
                }
                if let Err(err) = source.reject(token) {
                    if self.rejections.record("reject_failed") {
                        warn!(%err, "could not reject a segment; it may be redelivered and rejected again");
                    }
                }
                return None;
            }
        };
        if !self.seen.insert(&segment) {
            report.segments_duplicate += 1;
            debug!(actor = %segment.actor, segment_idx = segment.segment_idx, "duplicate segment skipped");
            settled.push(token);
            return None;
        }
        Some((segment, token))
    }
}
