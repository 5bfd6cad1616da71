//! Rejections logged at a bounded rate (issue 46, "unbounded logs": every rejected message was
//! logged on its own, 9.6 times the bytes of the traffic that caused it, 386 MB in two
//! minutes of a forged-pointer stall).
//!
//! Whoever judges peer input (the learner's consumer, the actor, the weights follower) counts
//! every rejection in its metrics, and logs through a [`RejectionLog`]: within each window the
//! first [`RejectionLog::first_per_window`] rejections of a reason are logged in full, the
//! rest only counted, and when the window ends one summary per reason says how many were not
//! logged. So one reason costs at most `first_per_window + 1` events per window, whatever the
//! peer sends. Reasons are bounded labels (`&'static str`, as the metrics' `reason`), and the
//! table holds at most [`MAX_REASONS`] of them.

use std::time::{Duration, Instant};

use tracing::warn;

/// Reasons tracked one by one; any further reason is counted under [`OTHER_REASON`] (reasons
/// are static labels, so this is a guard, not a limit met in practice).
pub const MAX_REASONS: usize = 64;

/// The reason rejections beyond [`MAX_REASONS`] distinct reasons are summarised under.
pub const OTHER_REASON: &str = "other";

/// Default rejections of one reason logged in full per window.
pub const DEFAULT_FIRST_PER_WINDOW: u32 = 5;

/// Default window: one summary per reason at most this often.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct ReasonCount {
    reason: &'static str,
    /// Rejections of the reason in the current window.
    in_window: u64,
    /// Those of them not logged in full.
    suppressed: u64,
}

/// Decides which rejections are logged in full, and logs the summaries (see the module docs).
#[derive(Debug, Clone)]
pub struct RejectionLog {
    what: &'static str,
    first_per_window: u32,
    window: Duration,
    window_started: Instant,
    counts: Vec<ReasonCount>,
}

impl RejectionLog {
    /// A log for rejections of `what` (e.g. `"segment"`, named in the summaries), with the
    /// default window and number logged in full.
    pub fn new(what: &'static str) -> Self {
        Self::with_limits(what, DEFAULT_FIRST_PER_WINDOW, DEFAULT_WINDOW)
    }

    /// A log with `first_per_window` rejections per reason logged in full per `window`.
    pub fn with_limits(what: &'static str, first_per_window: u32, window: Duration) -> Self {
        RejectionLog { what, first_per_window, window, window_started: Instant::now(), counts: Vec::new() }
    }

    /// Rejections of one reason logged in full per window.
    pub fn first_per_window(&self) -> u32 {
        self.first_per_window
    }

    /// Count one rejection of `reason`; returns whether the caller logs it in full. Ends the
    /// window first when it is over (logging its summaries).
    pub fn record(&mut self, reason: &'static str) -> bool {
        self.tick();
        let at = match self.counts.iter().position(|c| c.reason == reason) {
            Some(at) => at,
            None if self.counts.len() < MAX_REASONS => {
                self.counts.push(ReasonCount { reason, in_window: 0, suppressed: 0 });
                self.counts.len() - 1
            }
            None => match self.counts.iter().position(|c| c.reason == OTHER_REASON) {
                Some(at) => at,
                None => {
                    // Replace the last entry's slot: the table never grows past its bound.
                    let last = self.counts.len() - 1;
                    self.summarise(last);
                    self.counts[last] = ReasonCount { reason: OTHER_REASON, in_window: 0, suppressed: 0 };
                    last
                }
            },
        };
        let count = &mut self.counts[at];
        count.in_window += 1;
        if count.in_window <= u64::from(self.first_per_window) {
            true
        } else {
            count.suppressed += 1;
            false
        }
    }

    /// End the window when it is over: one summary per reason with rejections not logged in
    /// full. Call it now and then (a loop's tick) so a summary is not held back when the
    /// rejections stop.
    pub fn tick(&mut self) {
        if self.window_started.elapsed() < self.window {
            return;
        }
        self.end_window();
    }

    /// End the window now, whatever its age (logging its summaries).
    pub fn end_window(&mut self) {
        for at in 0..self.counts.len() {
            self.summarise(at);
        }
        // Reasons quiet for a whole window leave the table.
        self.counts.retain(|c| c.in_window > 0);
        for count in &mut self.counts {
            count.in_window = 0;
        }
        self.window_started = Instant::now();
    }

    fn summarise(&mut self, at: usize) {
        let count = &mut self.counts[at];
        if count.suppressed > 0 {
            warn!(
                what = self.what,
                reason = count.reason,
                rejected = count.in_window,
                not_logged = count.suppressed,
                window_secs = self.window.as_secs_f64(),
                "rejections summarised: only the first of each reason are logged one by one per window"
            );
        }
        count.suppressed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(f: impl FnOnce()) -> Vec<String> {
        volley_testkit::logs::capture_logs(f).1
    }

    /// Issue 46: 100,000 rejections of three reasons within one window log the first few of
    /// each and, at the window's end, one summary per reason with the rest counted.
    #[test]
    fn a_flood_of_rejections_logs_a_bounded_number_of_events() {
        let mut log = RejectionLog::with_limits("segment", 5, Duration::from_secs(3600));
        let reasons = ["corrupt", "non_finite", "future_version"];
        let lines = capture(|| {
            let mut logged = 0;
            for i in 0..100_000 {
                let reason = reasons[i % 3];
                if log.record(reason) {
                    logged += 1;
                    tracing::warn!(reason, "segment rejected");
                }
            }
            assert_eq!(logged, 15);
            log.end_window();
        });
        assert_eq!(lines.len(), 15 + 3, "{lines:#?}");
        let summaries: Vec<_> = lines.iter().filter(|l| l.contains("rejections summarised")).collect();
        assert_eq!(summaries.len(), 3);
        let total_not_logged: u64 = summaries
            .iter()
            .map(|l| {
                let at = l.find("not_logged=").expect("field") + "not_logged=".len();
                l[at..].split_whitespace().next().expect("value").parse::<u64>().expect("a count")
            })
            .sum();
        assert_eq!(total_not_logged, 100_000 - 15);
    }

    /// Each window logs its own first few again, and a quiet window logs nothing.
    #[test]
    fn each_window_starts_afresh_and_a_quiet_one_says_nothing() {
        let mut log = RejectionLog::with_limits("weights", 2, Duration::from_secs(3600));
        let lines = capture(|| {
            for _ in 0..3 {
                let logged = (0..10).filter(|_| log.record("checksum")).count();
                assert_eq!(logged, 2);
                log.end_window();
            }
            log.end_window();
            log.end_window();
        });
        assert_eq!(lines.len(), 3, "one summary per busy window: {lines:#?}");
    }

    /// More distinct reasons than the table holds share one entry; the table stays bounded.
    #[test]
    fn distinct_reasons_beyond_the_bound_share_one_entry() {
        let names: Vec<&'static str> =
            (0..MAX_REASONS * 3).map(|i| &*Box::leak(format!("reason-{i}").into_boxed_str())).collect();
        let mut log = RejectionLog::with_limits("segment", 1, Duration::from_secs(3600));
        let lines = capture(|| {
            for name in &names {
                log.record(name);
            }
            assert!(log.counts.len() <= MAX_REASONS);
        });
        assert!(lines.len() <= 2 * MAX_REASONS, "{}", lines.len());
    }
}
