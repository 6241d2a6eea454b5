//! The planner's work limit ([`PlanOptions::max_work`]): what a plan of a
//! pair will cost is counted, cheaply and before it is done, in *units of
//! work* — a piece, a delivery of a piece to a rank (a transfer), a source
//! holding compared with a destination atom, a hop of a broadcast chain, a
//! pair of ranks the round packer weighs against another of the same rank
//! — and a pair that would take more than the limit is refused with
//! [`PlanError::TooMuchWork`] instead of being planned. A few hundred bytes
//! of layout can describe a mesh of a million ranks or a tensor cut into
//! a million pieces on each side; without the limit such a pair plans for
//! minutes and gigabytes.
//!
//! [`PlanOptions::max_work`]: crate::PlanOptions::max_work

use super::PlanError;

/// The default of [`PlanOptions::max_work`](crate::PlanOptions::max_work):
/// 2^26 units, about 4 GiB of planner memory at its worst (64 bytes a
/// unit: [`max_work_for_memory`]); the largest preset, DeepSeek-V3 as NeMo RL
/// places it, takes 16-32 million
/// (docs/benchmarks.md, "Planner work limit").
pub const DEFAULT_MAX_WORK: u64 = 1 << 26;

/// Bytes of planner memory one unit of work may cost, at most (a transfer
/// and its share of the pieces, lists and rounds): what turns a memory
/// budget into a work limit ([`max_work_for_memory`]).
pub(crate) const BYTES_PER_WORK: u64 = 64;

/// The work limit that keeps the planner within `bytes` of memory.
pub fn max_work_for_memory(bytes: u64) -> u64 {
    (bytes / BYTES_PER_WORK).max(1)
}

/// Work still allowed to one plan.
pub(crate) struct Budget {
    limit: u64,
    left: u64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget { limit, left: limit }
    }

    /// Takes `units` of work, or refuses the plan: `what` says what would
    /// have passed the limit (a tensor, a count).
    pub(crate) fn take(&mut self, units: u64, what: impl FnOnce() -> String) -> Result<(), PlanError> {
        if units > self.left {
            return Err(PlanError::TooMuchWork { what: what(), limit: self.limit });
        }
        self.left -= units;
        Ok(())
    }

    /// Units still allowed.
    pub(crate) fn left(&self) -> u64 {
        self.left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_past_the_limit_is_refused_naming_it() {
        let mut b = Budget::new(10);
        assert!(b.take(4, String::new).is_ok());
        assert!(b.take(6, String::new).is_ok());
        assert_eq!(b.left(), 0);
        let e = b.take(1, || "tensor 'w': 1 piece".into()).unwrap_err().to_string();
        assert!(e.contains("tensor 'w': 1 piece") && e.contains("more than 10 units") && e.contains("--max-plan-work"), "{e}");
        assert_eq!(max_work_for_memory(6400), 100);
    }
}
