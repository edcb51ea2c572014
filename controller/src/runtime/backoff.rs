//! When a failed reconcile runs again: soon after one failure, exponentially later while the
//! same object keeps failing, so an object whose cause does not go away (a tenant's hosting
//! cluster that never answers, a foreign object in the way) costs little, and at once again
//! after a success. Steps that wait on purpose say when to look again themselves
//! (the error's `retry_after`).

use std::{collections::HashMap, sync::Mutex, time::Duration};

use backon::{BackoffBuilder, ExponentialBuilder};

/// The wait after the first failure.
pub const FIRST: Duration = Duration::from_secs(2);
/// The longest wait between two attempts.
pub const MAX: Duration = Duration::from_secs(300);
/// How long one reconcile may take before it is abandoned and retried: every request it makes
/// has its own timeout, and this bounds their sum, so a slow cluster holds a reconcile slot no
/// longer.
pub const RECONCILE_DEADLINE: Duration = Duration::from_secs(60);

/// Consecutive failures per object.
#[derive(Default)]
pub struct ReconcileBackoff {
    failures: Mutex<HashMap<String, u32>>,
}

/// The key of an object: its kind, namespace and name.
pub fn key(kind: &str, ns: Option<&str>, name: &str) -> String {
    format!("{kind}/{}/{name}", ns.unwrap_or_default())
}

impl ReconcileBackoff {
    /// Records a failure of `key`; returns how long to wait before the next attempt.
    pub fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().expect("backoff lock");
        let n = failures.entry(key.to_owned()).or_default();
        *n = n.saturating_add(1);
        delay(*n)
    }

    /// Records a success of `key`: its next failure waits [`FIRST`] again.
    pub fn succeeded(&self, key: &str) {
        self.forget(key);
    }

    /// Forgets `key`'s failures: it succeeded, or its object is gone.
    pub fn forget(&self, key: &str) {
        self.failures.lock().expect("backoff lock").remove(key);
    }

    /// How many objects have failures on record.
    pub fn objects(&self) -> usize {
        self.failures.lock().expect("backoff lock").len()
    }
}

/// The wait after `failures` consecutive failures (1 = the first): [`FIRST`], doubled per
/// failure, at most [`MAX`].
pub fn delay(failures: u32) -> Duration {
    doubling(FIRST, MAX, failures)
}

/// The wait after the `attempt`th failure (1 = the first) of an exponential back-off that starts
/// at `first` and doubles up to `max` (`backon`'s, without jitter: a wait shown in a condition
/// or an Event is the wait taken).
pub fn doubling(first: Duration, max: Duration, attempt: u32) -> Duration {
    // Sixteen doublings exceed any `max` used here: the sequence is not walked further.
    let n = attempt.saturating_sub(1).min(16) as usize;
    ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .without_max_times()
        .build()
        .nth(n)
        .unwrap_or(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_per_failure_up_to_five_minutes_and_a_success_resets_it() {
        let b = ReconcileBackoff::default();
        let k = key("KVMMachine", Some("team-a"), "m");
        let waits: Vec<u64> = (0..10).map(|_| b.failed(&k).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        // Another object is not slowed down by this one.
        assert_eq!(b.failed(&key("KVMMachine", Some("team-b"), "m")), FIRST);
        b.succeeded(&k);
        assert_eq!(b.failed(&k), FIRST);
        assert_eq!(delay(u32::MAX), MAX);
    }
}
