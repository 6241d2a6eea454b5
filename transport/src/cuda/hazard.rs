//! Which steps of a same-device schedule may run at once: the schedule
//! cut into groups of consecutive steps, no two in a group touching one
//! byte where either writes it. Running a group's steps in any order, or
//! all at once, then gives what running them one by one gives, so the
//! device executor forks each group over streams and joins only between
//! groups.
//!
//! Rounds are such groups too, but far coarser: on one device, most
//! rounds of a reshard read only source buffers and write disjoint
//! destination bytes, so whole rounds fuse; a step that forwards bytes an
//! earlier step wrote (a relay), or overwrites bytes an earlier one reads,
//! starts a new group.
//!
//! Pure, compiled and tested without a GPU. Every region is a strided box
//! of bytes ([`CopyOp`] on one side); two boxes conflict when they share a
//! byte, decided exactly (rows of one pitch at once, otherwise row by row
//! up to a bound, past which they are taken to conflict): a false conflict
//! only costs a join, a missed one would race.

use crate::cuda::copyplan::{plan_copies, CopyOp, Side};
use crate::cuda::schedule::{Place, Step};
use std::collections::HashMap;
use std::ops::Range;

/// Bytes of one buffer a step reads or writes: `depth` slices of
/// `height` rows of `width` bytes from `start`, rows `pitch` bytes apart,
/// slices `pitch * rows` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Region {
    start: u64,
    width: u64,
    height: u64,
    depth: u64,
    pitch: u64,
    rows: u64,
}

impl Region {
    fn of(op: &CopyOp) -> Region {
        Region { start: op.src, width: op.width, height: op.height, depth: op.depth, pitch: op.src_pitch, rows: op.src_height }
    }

    /// One past the last byte (`None` past `u64`).
    fn end(&self) -> Option<u64> {
        if self.width == 0 || self.height == 0 || self.depth == 0 {
            return Some(self.start);
        }
        let slices = (self.depth - 1).checked_mul(self.pitch.checked_mul(self.rows)?)?;
        let rows = (self.height - 1).checked_mul(self.pitch)?;
        self.start.checked_add(slices)?.checked_add(rows)?.checked_add(self.width)
    }

    fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0 || self.depth == 0
    }

    /// Whether the two share a byte; may say yes when they do not (never
    /// the reverse). Exact unless deciding would take more than
    /// [`EXACT_ROWS`] row tests.
    fn overlaps(&self, other: &Region) -> bool {
        if self.is_empty() || other.is_empty() {
            return false;
        }
        let (Some(a_end), Some(b_end)) = (self.end(), other.end()) else { return true };
        if a_end <= other.start || b_end <= self.start {
            return false;
        }
        // Slices one by one (each a box of rows), the fewer against the
        // other's.
        if self.depth > 1 || other.depth > 1 {
            let (few, many) = if self.depth <= other.depth { (self, other) } else { (other, self) };
            if few.depth.saturating_mul(many.depth) > EXACT_ROWS {
                return true;
            }
            return few.slices().any(|a| many.slices().any(|b| a.overlaps(&b)));
        }
        match (self.height > 1, other.height > 1) {
            (true, true) if self.pitch != other.pitch => {
                // Rows of two pitches: the shorter box row by row.
                let (few, many) = if self.height <= other.height { (self, other) } else { (other, self) };
                if few.height > EXACT_ROWS {
                    return true;
                }
                (0..few.height).any(|y| {
                    let row = Region { start: few.start + y * few.pitch, height: 1, ..*few };
                    rows_overlap(&row, many, many.pitch)
                })
            }
            (true, _) => rows_overlap(self, other, self.pitch),
            (false, true) => rows_overlap(self, other, other.pitch),
            // Two runs whose extents overlap.
            (false, false) => true,
        }
    }

    /// Each slice as a box of one slice (`end` was computed, so no
    /// offset overflows).
    fn slices(&self) -> impl Iterator<Item = Region> + '_ {
        (0..self.depth).map(|z| Region { start: self.start + z * self.pitch * self.rows, depth: 1, ..*self })
    }
}

/// Most row or slice tests one overlap question takes before it answers
/// "may overlap".
const EXACT_ROWS: u64 = 1 << 12;

/// Whether rows `a.start + i * pitch` (`i < a.height`, `a.width` bytes
/// each) and rows `b.start + j * pitch` share a byte: some row distance
/// `k = j - i` has `-b.width < d + k * pitch < a.width`, `d` being
/// `b.start - a.start`.
fn rows_overlap(a: &Region, b: &Region, pitch: u64) -> bool {
    if pitch == 0 {
        return true;
    }
    let (p, d) = (i128::from(pitch), i128::from(b.start) - i128::from(a.start));
    let (wa, wb) = (i128::from(a.width), i128::from(b.width));
    // Smallest k with k * p > -d - wb; largest with k * p < wa - d.
    let lo = (-d - wb).div_euclid(p) + 1;
    let hi = (wa - d - 1).div_euclid(p);
    let lo = lo.max(1 - i128::from(a.height));
    let hi = hi.min(i128::from(b.height) - 1);
    lo <= hi
}

/// A step's bytes in one buffer: (rank, buffer) and its regions.
type Touch = ((usize, u32), Vec<Region>);

fn touch(place: &Place, counts: &[u64]) -> Touch {
    let side = Side { base: place.span.base, strides: place.span.strides };
    let regions = plan_copies(counts, &side, &side, place.dtype.size(), u64::MAX).iter().map(Region::of).collect();
    ((place.rank, place.span.buffer), regions)
}

/// The bytes a group's steps read and write, by buffer.
#[derive(Default)]
struct Touched {
    reads: HashMap<(usize, u32), Vec<Region>>,
    writes: HashMap<(usize, u32), Vec<Region>>,
}

impl Touched {
    fn hits(map: &HashMap<(usize, u32), Vec<Region>>, (key, regions): &Touch) -> bool {
        map.get(key).is_some_and(|have| have.iter().any(|h| regions.iter().any(|r| h.overlaps(r))))
    }

    fn add(map: &mut HashMap<(usize, u32), Vec<Region>>, (key, regions): Touch) {
        map.entry(key).or_default().extend(regions);
    }
}

/// The schedule's steps cut into groups of consecutive steps (ranges of
/// indices, in order, covering every step) such that within a group no
/// step writes a byte another reads or writes. The scratch buffer of
/// converting steps is not looked at: the executor runs those in order
/// on one stream.
pub fn concurrent_groups(steps: &[Step]) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let mut start = 0;
    let mut group = Touched::default();
    for (i, step) in steps.iter().enumerate() {
        let counts = step.block.extent();
        let read = touch(&step.from, counts);
        let writes: Vec<Touch> = step.to.iter().map(|t| touch(t, counts)).collect();
        let conflict = Touched::hits(&group.writes, &read)
            || writes.iter().any(|w| Touched::hits(&group.writes, w) || Touched::hits(&group.reads, w))
            // A step writing what it reads, or two of its own destinations
            // overlapping, is left alone in a group of its own.
            || writes.iter().enumerate().any(|(k, w)| {
                (w.0 == read.0 && w.1.iter().any(|x| read.1.iter().any(|y| x.overlaps(y))))
                    || writes[..k].iter().any(|v| v.0 == w.0 && v.1.iter().any(|x| w.1.iter().any(|y| x.overlaps(y))))
            });
        if conflict && i > start {
            groups.push(start..i);
            start = i;
            group = Touched::default();
        }
        Touched::add(&mut group.reads, read);
        for w in writes {
            Touched::add(&mut group.writes, w);
        }
    }
    if start < steps.len() {
        groups.push(start..steps.len());
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(r: &Region) -> Vec<u64> {
        let mut out = Vec::new();
        for z in 0..r.depth {
            for y in 0..r.height {
                for x in 0..r.width {
                    out.push(r.start + z * r.pitch * r.rows + y * r.pitch + x);
                }
            }
        }
        out
    }

    fn region() -> impl Strategy<Value = Region> {
        (0u64..40, 1u64..6, 1u64..5, 1u64..3, 0u64..5, 1u64..3).prop_map(|(start, width, height, depth, gap, extra_rows)| Region {
            start,
            width,
            height,
            depth,
            pitch: width + gap,
            rows: height + extra_rows - 1,
        })
    }

    proptest! {
        /// Exact for small boxes, of one pitch or two, of rows or slices.
        #[test]
        fn overlap_is_never_missed_and_exact_for_one_pitch(a in region(), b in region(), same_pitch in any::<bool>()) {
            let b = if same_pitch { Region { pitch: a.pitch.max(b.width), ..b } } else { b };
            let (x, y) = (bytes(&a), bytes(&b));
            let truth = x.iter().any(|v| y.contains(v));
            let said = a.overlaps(&b);
            prop_assert!(said || !truth, "{a:?} and {b:?} share a byte");
            prop_assert_eq!(said, truth, "{:?} and {:?}", a, b);
        }
    }

    #[test]
    fn interleaved_column_halves_do_not_conflict() {
        // Two halves of 2048 rows of 7168 bytes, as two column shards
        // write them into one row-major buffer.
        let left = Region { start: 0, width: 3584, height: 2048, depth: 1, pitch: 7168, rows: 2048 };
        let right = Region { start: 3584, ..left };
        assert!(!left.overlaps(&right));
        assert!(left.overlaps(&Region { start: 3583, ..left }));
        assert!(right.overlaps(&Region { start: 7168 * 2047 + 3584, width: 1, height: 1, ..left }));
    }
}
