//! Which of this process's memory is writable, as the kernel maps it.

/// The writable mappings of this process (`/proc/self/maps`), to refuse
/// writing where the object does not say its memory is read-only (a
/// torch tensor over a read-only memory map).
pub(crate) struct WritableMaps(Vec<(u64, u64)>);

impl WritableMaps {
    pub(crate) fn read() -> Result<WritableMaps, String> {
        let text = std::fs::read_to_string("/proc/self/maps").map_err(|e| format!("cannot read /proc/self/maps: {e}"))?;
        let mut ranges = Vec::new();
        for line in text.lines() {
            let mut parts = line.split_whitespace();
            let (Some(range), Some(perms)) = (parts.next(), parts.next()) else { continue };
            let Some((lo, hi)) = range.split_once('-') else { continue };
            let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else { continue };
            if perms.as_bytes().get(1) == Some(&b'w') {
                ranges.push((lo, hi));
            }
        }
        ranges.sort_unstable();
        Ok(WritableMaps(ranges))
    }

    /// Whether `len` bytes at `addr` all lie in writable mappings.
    pub(crate) fn covers(&self, addr: u64, len: usize) -> bool {
        let Some(end) = addr.checked_add(len as u64) else { return false };
        let mut at = addr;
        for &(lo, hi) in &self.0 {
            if hi <= at {
                continue;
            }
            if lo > at {
                return false;
            }
            at = hi;
            if at >= end {
                return true;
            }
        }
        at >= end
    }
}
