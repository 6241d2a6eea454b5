//! [`Clock`]: how long this process could not run its tasks, so that a
//! deadline on a peer's silence counts the time this process was running,
//! not wall time under CPU starvation.
//!
//! A node's clock ticks every heartbeat interval; a tick that comes later
//! than that means the process (or its runtime) was not running for the
//! difference: the host was starved (more runnable threads than cores, a
//! throttled cgroup), the process was stopped, or every runtime thread was
//! held up. On a busy host every process is held up alike, so a peer's
//! frames are late for the same reason this process could not run; while
//! it could not, the peer's silence is not held against it. A peer that is
//! silent while this process runs on time is silent for its own reasons and
//! is declared dead after the heartbeat timeout, as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::conn::wait_true;

/// A stall at least this many ticks long is logged.
const LOGGED_STALL_TICKS: u32 = 4;

/// Time this process could not run, measured by a task that ticks every
/// `interval`.
pub(crate) struct Clock {
    origin: Instant,
    interval: Duration,
    /// When the last tick ran, in nanoseconds since `origin`.
    last_tick: AtomicU64,
    /// Time lost before the last tick, in nanoseconds.
    stalled: AtomicU64,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Clock {
    /// A clock ticking every `interval`, from a task on the current
    /// runtime that ends when `shutdown` turns true or the clock is
    /// dropped.
    pub(crate) fn start(interval: Duration, shutdown: watch::Receiver<bool>) -> Arc<Clock> {
        let clock = Arc::new(Clock::new(interval));
        tokio::spawn(tick_loop(Arc::downgrade(&clock), interval, shutdown));
        clock
    }

    fn new(interval: Duration) -> Clock {
        Clock { origin: Instant::now(), interval, last_tick: AtomicU64::new(0), stalled: AtomicU64::new(0) }
    }

    fn now(&self) -> u64 {
        nanos(self.origin.elapsed())
    }

    /// How long this process could not run since the clock started,
    /// counting a stall still in progress (the tick task not run yet, as
    /// when every task of the runtime wakes at once after a stall and
    /// others run first): never decreases.
    pub(crate) fn stalled(&self) -> Duration {
        let last = self.last_tick.load(Ordering::Acquire);
        let recorded = self.stalled.load(Ordering::Acquire);
        let late = self.now().saturating_sub(last).saturating_sub(nanos(self.interval));
        Duration::from_nanos(recorded.saturating_add(late))
    }

    /// Records a tick at `now` (nanoseconds since the origin).
    fn tick_at(&self, now: u64) -> Duration {
        let last = self.last_tick.load(Ordering::Acquire);
        let late = now.saturating_sub(last).saturating_sub(nanos(self.interval));
        // Stalled first, then the tick: a reader in between counts the
        // stall at most twice over a few nanoseconds, never less.
        self.stalled.fetch_add(late, Ordering::AcqRel);
        self.last_tick.store(now, Ordering::Release);
        Duration::from_nanos(late)
    }

    /// Time this process ran between `since` (a reading of
    /// [`Clock::stalled`] taken at `started`) and now.
    pub(crate) fn ran_since(&self, started: Instant, since: Duration) -> Duration {
        started.elapsed().saturating_sub(self.stalled().saturating_sub(since))
    }
}

async fn tick_loop(clock: Weak<Clock>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = wait_true(&mut shutdown) => return,
            () = tokio::time::sleep(interval) => {}
        }
        let Some(clock) = clock.upgrade() else { return };
        let late = clock.tick_at(clock.now());
        if late >= interval * LOGGED_STALL_TICKS {
            tracing::info!(
                ?late,
                "this process could not run its tasks for a while (a busy host?): peers' silence during it is not held against them"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn ticks_on_time_record_no_stall() {
        let clock = Clock::new(Duration::from_millis(250));
        for k in 1..=8 {
            assert_eq!(clock.tick_at(k * 250 * MS), Duration::ZERO);
        }
        assert_eq!(clock.stalled.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_late_tick_records_what_it_was_late_by() {
        let clock = Clock::new(Duration::from_millis(250));
        clock.tick_at(250 * MS);
        assert_eq!(clock.tick_at(3_250 * MS), Duration::from_millis(2_750));
        assert_eq!(clock.tick_at(3_500 * MS), Duration::ZERO);
        assert_eq!(clock.stalled.load(Ordering::Relaxed), 2_750 * MS);
    }
}
