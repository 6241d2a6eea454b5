//! Fault injection, for tests and tooling (the transport tests, the chaos
//! suite): [`Faults`] is a [`FrameHook`] that corrupts, drops or cuts
//! chosen data frames and makes `abort` hang. The links know nothing of
//! it; they only ask their hook.

use crate::link::{FrameAction, FrameHook};
use std::sync::Arc;
use std::time::Duration;

/// Faults to inject, for tests of failure handling (a chaos suite). Every
/// count is of data frames this rank sends, over all its peers, from 0.
/// Default: none. Install on a link with [`Faults::hook`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Flip one byte of the payload of this data frame after its checksum
    /// was computed (so a receiver checking sums sees it).
    pub corrupt_frame: Option<u64>,
    /// From this data frame on, send nothing: frames are dropped silently
    /// while connections stay up, as if the rank froze.
    pub stall_at_frame: Option<u64>,
    /// At this data frame, shut the connection to its peer down (both
    /// directions, no goodbye) and fail the send.
    pub cut_at_frame: Option<u64>,
    /// Sleep this long in `abort` before telling the peers.
    pub abort_hang: Option<Duration>,
}

impl Faults {
    /// Whether any frame fault is set.
    pub fn any(&self) -> bool {
        self.corrupt_frame.is_some() || self.stall_at_frame.is_some() || self.cut_at_frame.is_some()
    }

    /// These faults as a link's hook ([`crate::tcp::TcpConfig::hook`]);
    /// `None` when none is set, so a link without faults has no hook.
    pub fn hook(self) -> Option<Arc<dyn FrameHook>> {
        if self == Faults::default() {
            None
        } else {
            Some(Arc::new(self))
        }
    }
}

impl FrameHook for Faults {
    fn data_frame(&self, index: u64) -> FrameAction {
        if self.stall_at_frame.is_some_and(|s| index >= s) {
            FrameAction::Stall
        } else if self.cut_at_frame == Some(index) {
            FrameAction::Cut
        } else if self.corrupt_frame == Some(index) {
            FrameAction::Corrupt
        } else {
            FrameAction::Pass
        }
    }

    fn before_abort(&self) {
        if let Some(d) = self.abort_hang {
            std::thread::sleep(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_pick_frames() {
        let f = Faults { corrupt_frame: Some(1), stall_at_frame: Some(5), cut_at_frame: Some(3), abort_hang: None };
        let got: Vec<FrameAction> = (0..7).map(|n| f.data_frame(n)).collect();
        use FrameAction as F;
        assert_eq!(got, vec![F::Pass, F::Corrupt, F::Pass, F::Cut, F::Pass, F::Stall, F::Stall]);
        assert!(!Faults::default().any());
        assert!(Faults::default().hook().is_none());
        assert!(Faults { abort_hang: Some(Duration::ZERO), ..Faults::default() }.hook().is_some());
        assert!(f.hook().is_some());
    }
}
