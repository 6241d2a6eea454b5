//! Work the GPU data plane did on the host: pieces converted between
//! dtypes through host memory and block-scaled tensors quantized there,
//! each recorded once per kind (rank, what, why) with how many times it
//! happened. A **host fallback** is such work that the device has a path
//! for (its kernels did not load, or do not take the piece); a dtype pair
//! that no device kernel converts (those with f64) goes through the host
//! by design and is recorded as such, not counted as a fallback.
//! Needs no GPU (the executors that call it do).

use reshard::Endpoint;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Distinct kinds of host work kept; past these, one entry counts the rest.
const KINDS_KEPT: usize = 64;

static HOST_FALLBACKS: AtomicU64 = AtomicU64::new(0);
static LOG: Mutex<Vec<HostWork>> = Mutex::new(Vec::new());

/// One kind of work this process's GPU planes did on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostWork {
    /// The rank that did it (`src rank 0`, ...).
    pub rank: String,
    /// What ran on the host ("converted a piece", "quantized its
    /// block-scaled tensors").
    pub what: String,
    /// Why not on the device.
    pub why: String,
    /// How many times.
    pub times: u64,
    /// Whether the device had a path for it (a fallback), rather than no
    /// device kernel existing for the work (a dtype pair with f64).
    pub fallback: bool,
}

/// Records host work by `rank`: a fallback (logged, the first as a
/// warning) or work no device kernel does (logged at debug level).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the executors that note are the feature's
pub(crate) fn note(rank: Endpoint, what: &str, why: &str, fallback: bool) {
    if fallback {
        if HOST_FALLBACKS.fetch_add(1, Ordering::SeqCst) == 0 {
            tracing::warn!(rank = %rank, why, "{what} on the host, not the GPU (transport::cuda::host_work lists these)");
        } else {
            tracing::debug!(rank = %rank, why, "{what} on the host");
        }
    } else {
        tracing::debug!(rank = %rank, why, "{what} on the host (no device kernel for it)");
    }
    let rank = rank.to_string();
    let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
    let same = |w: &HostWork| w.rank == rank && w.what == what && w.why == why && w.fallback == fallback;
    if let Some(w) = log.iter_mut().find(|w| same(w)) {
        w.times += 1;
        return;
    }
    if log.len() < KINDS_KEPT {
        log.push(HostWork { rank, what: what.into(), why: why.into(), times: 1, fallback });
        return;
    }
    let (rank, what, why) = ("(more ranks)".to_string(), "further kinds of host work".to_string(), "not listed one by one".to_string());
    match log.iter_mut().find(|w| w.rank == rank && w.fallback == fallback) {
        Some(w) => w.times += 1,
        None => log.push(HostWork { rank, what, why, times: 1, fallback }),
    }
}

/// Every kind of work this process's GPU planes (NCCL, IPC, the
/// same-device executor) did on the host so far, in the order first seen.
/// The fallbacks (`fallback: true`) are work the device could not do: a
/// piece converted between dtypes through host staging (the kernels did
/// not load, or do not take its strides), or a rank's block-scaled tensors
/// quantized on the host; none on a healthy GPU, each logged (the first as
/// a warning). Correct either way, but slow: a check of a GPU should fail
/// on any. The others are dtype pairs no device kernel converts.
pub fn host_work() -> Vec<HostWork> {
    LOG.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_kept_once_with_its_count_and_only_fallbacks_are_counted() {
        // Other tests of this process may note work too: look at ours.
        let me = Endpoint::dst(9_001);
        let before = HOST_FALLBACKS.load(Ordering::SeqCst);
        note(me, "converted a piece", "the cast kernels did not load: test", true);
        note(me, "converted a piece", "the cast kernels did not load: test", true);
        note(me, "converted a piece", "no device kernel converts f32 -> f64", false);
        note(me, "quantized its block-scaled tensors", "test", true);
        assert!(HOST_FALLBACKS.load(Ordering::SeqCst) >= before + 3);
        let ours: Vec<HostWork> = host_work().into_iter().filter(|w| w.rank == me.to_string()).collect();
        let kinds: Vec<(&str, u64, bool)> = ours.iter().map(|w| (w.what.as_str(), w.times, w.fallback)).collect();
        assert_eq!(
            kinds,
            [("converted a piece", 2, true), ("converted a piece", 1, false), ("quantized its block-scaled tensors", 1, true)]
        );
    }
}
