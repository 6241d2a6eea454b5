//! Link emulation (token buckets on a rank's egress) and the frame hook
//! through which tests and tooling act on a rank's data frames.

use std::time::{Duration, Instant};

/// Bandwidth caps on each rank's egress, to run a plan on one machine at
/// the speed ratios of a real cluster. Off by default (`None` rates).
///
/// Inter-node traffic (TCP peers) and intra-node traffic (shared-memory
/// peers) each go through their own bucket per rank: a DGX H100 has one
/// 400 Gb/s NIC per GPU (so one NIC bucket per rank is faithful) and
/// 900 GB/s of NVLink per GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkEmulation {
    /// Egress cap per rank towards other nodes (bytes/s); `None`: no cap.
    pub inter_node_bytes_per_s: Option<u64>,
    /// Egress cap per rank towards ranks of its own node (bytes/s).
    pub intra_node_bytes_per_s: Option<u64>,
    /// Bytes a bucket may send at once after being idle (bucket depth);
    /// 0 means one pacing chunk (`PACE_CHUNK`).
    pub burst_bytes: u64,
}

/// Largest piece of a message sent in one go when a rate cap is on, so
/// pacing is smooth.
pub(crate) const PACE_CHUNK: u64 = 1 << 20;

impl LinkEmulation {
    /// DGX H100 links slowed down by `scale` (1.0: real speed): a 400 Gb/s
    /// NIC per GPU, i.e. 50 GB/s / `scale` to other nodes, and 900 GB/s /
    /// `scale` of NVLink per GPU inside the node (ratio 18:1). A `scale`
    /// that is not positive and finite is taken as 1.
    pub fn dgx_h100(scale: f64) -> LinkEmulation {
        let scale = if scale.is_finite() && scale > 0.0 { scale } else { 1.0 };
        let rate = |bps: f64| Some(((bps / scale) as u64).max(1));
        LinkEmulation { inter_node_bytes_per_s: rate(50e9), intra_node_bytes_per_s: rate(900e9), burst_bytes: 0 }
    }

    /// The egress bucket towards other nodes, if capped.
    pub(crate) fn inter_node(&self) -> Option<TokenBucket> {
        self.inter_node_bytes_per_s.map(|r| TokenBucket::new(r, self.burst()))
    }

    /// The egress bucket towards the rank's own node, if capped.
    pub(crate) fn intra_node(&self) -> Option<TokenBucket> {
        self.intra_node_bytes_per_s.map(|r| TokenBucket::new(r, self.burst()))
    }

    fn burst(&self) -> u64 {
        if self.burst_bytes == 0 {
            PACE_CHUNK
        } else {
            self.burst_bytes
        }
    }
}

/// A token bucket: `rate` bytes/s refill up to `burst` bytes. Sending more
/// than the bucket holds goes into debt, which the sender sleeps off.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenBucket {
    rate: u64,
    burst: u64,
    /// Tokens (bytes) available; negative: debt.
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    /// A full bucket of `burst` bytes refilled at `rate` bytes/s (a rate of
    /// 0 is taken as 1).
    pub(crate) fn new(rate: u64, burst: u64) -> TokenBucket {
        TokenBucket { rate: rate.max(1), burst, tokens: burst as f64, last: None }
    }

    /// Takes `bytes` at time `now`; returns how long to wait before they
    /// may go (zero when the bucket held enough).
    pub(crate) fn take(&mut self, bytes: u64, now: Instant) -> Duration {
        if let Some(last) = self.last {
            let dt = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + dt * self.rate as f64).min(self.burst as f64);
        }
        self.last = Some(now.max(self.last.unwrap_or(now)));
        self.tokens -= bytes as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate as f64)
        }
    }

    /// Takes `bytes` now and sleeps until they may go.
    pub(crate) fn pace(&mut self, bytes: u64) {
        let wait = self.take(bytes, Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

/// What a link does with one data frame (see [`FrameHook`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameAction {
    /// Send it as it is.
    Pass,
    /// Send it with one payload byte flipped after its checksum was
    /// computed, so a receiver checking sums sees it.
    Corrupt,
    /// Drop it silently: the send succeeds and the connection stays up.
    Stall,
    /// Shut the connection to its peer down (both directions, no goodbye)
    /// and fail the send.
    Cut,
}

/// A hook on a rank's data links ([`crate::tcp::TcpConfig::hook`]): asked
/// about every data frame the rank sends, on TCP and shared-memory links
/// alike, and told when the rank aborts. Tests and tooling use it to
/// inject faults ([`crate::faults::Faults`] is one); a link without a hook
/// (the default) does no extra work per frame.
pub trait FrameHook: Send + Sync + std::fmt::Debug {
    /// What to do with data frame number `index` of this rank, counted from
    /// 0 over all of the rank's links.
    fn data_frame(&self, index: u64) -> FrameAction;

    /// Called in `abort` before the peers are told (default: nothing).
    fn before_abort(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_lets_a_burst_through_then_paces_at_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 500);
        // The first 500 bytes go at once.
        assert_eq!(b.take(500, t0), Duration::ZERO);
        // 250 more are 250 bytes of debt: a quarter second at 1000 B/s.
        assert_eq!(b.take(250, t0), Duration::from_millis(250));
        // After the debt is slept off and 100 ms more, 100 bytes are there.
        let t1 = t0 + Duration::from_millis(350);
        assert_eq!(b.take(100, t1), Duration::ZERO);
        // Idle for long: the bucket refills to its depth, not beyond.
        let t2 = t1 + Duration::from_secs(60);
        assert_eq!(b.take(500, t2), Duration::ZERO);
        assert_eq!(b.take(1, t2), Duration::from_millis(1));
    }

    #[test]
    fn bucket_average_rate_matches_over_many_sends() {
        // Send 10 MB in 64 KiB pieces, sleeping what the bucket says on an
        // injected clock: the total time is bytes / rate, less the burst.
        let rate = 1_000_000u64;
        let mut b = TokenBucket::new(rate, 65536);
        let mut now = Instant::now();
        let start = now;
        let mut sent = 0u64;
        while sent < 10_000_000 {
            now += b.take(65536, now);
            sent += 65536;
        }
        let want = (sent - 65536) as f64 / rate as f64;
        let got = (now - start).as_secs_f64();
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn a_clock_going_backwards_does_not_mint_tokens() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(100, 100);
        assert_eq!(b.take(100, t0), Duration::ZERO);
        assert_eq!(b.take(100, t0 - Duration::from_secs(5)), Duration::from_secs(1));
    }

    #[test]
    fn dgx_numbers() {
        let e = LinkEmulation::dgx_h100(10.0);
        assert_eq!(e.inter_node_bytes_per_s, Some(5_000_000_000));
        assert_eq!(e.intra_node_bytes_per_s, Some(90_000_000_000));
        assert!(LinkEmulation::default().inter_node().is_none() && LinkEmulation::default().intra_node().is_none());
    }
}
