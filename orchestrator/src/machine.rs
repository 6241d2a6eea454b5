//! What this machine allows: its available memory, and the planner's work
//! limit that follows from it.

/// Memory the kernel says is available (Linux `MemAvailable`), if known.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The planner's work limit on this machine
/// ([`PlanOptions::max_work`](reshard::PlanOptions::max_work)): what half
/// of its available memory holds at the planner's most per unit of work
/// ([`reshard::max_work_for_memory`]); [`reshard::DEFAULT_MAX_WORK`] where
/// the memory is not known. A pair past it is refused with an error
/// instead of planned into the machine's swap or its OOM killer.
pub fn plan_work_limit() -> u64 {
    available_memory().map_or(reshard::DEFAULT_MAX_WORK, |bytes| reshard::max_work_for_memory(bytes / 2))
}
