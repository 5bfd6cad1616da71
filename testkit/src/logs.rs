//! What a test's code logs through `tracing`, captured as plain-text lines (to count the
//! events a flood of bad input produces, for example).

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A `tracing` writer that keeps every byte written to it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("not poisoned").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Run `f` with a plain-text (no ANSI colours) `tracing` subscriber as this thread's default,
/// and return what `f` returned and every line logged meanwhile on this thread.
pub fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&captured.0.lock().expect("not poisoned")).into_owned();
    (result, text.lines().map(str::to_string).collect())
}
