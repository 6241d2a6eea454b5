//! The reshard planner's last step: source sends moved among the ranks
//! that hold their pieces where that lowers the busiest source rank's
//! egress.
//!
//! The planner assigns pieces largest first, choosing senders by what it
//! knows so far (egress, plus what pieces only one rank holds will add);
//! a piece given early to a rank that later pieces, shared with few
//! others, load heavily is not taken back. This local search does: while
//! the busiest source rank sends a piece that another of its holders
//! could send and still stay below it, the send moves to the holder that
//! ends lowest. Each move lowers the sum of squared egress (the mover's
//! and the taker's loads both end below the mover's before), so the
//! search ends; it stops too after [`MAX_MOVES_PER_RANK`] moves per
//! source rank. Receivers, stages and bytes stay as planned: only the
//! sender of a stage-0 send changes, to a rank holding the piece. Where
//! no move helps (the presets), it costs one look at the busiest rank's
//! sends.

use crate::layout::Rank;
use crate::plan::SenderLists;
use std::collections::HashMap;

/// Most moves per source rank (a bound on the search's time).
const MAX_MOVES_PER_RANK: usize = 4;

/// A send by where it was planned: (sender, position in its list).
type Origin = (Rank, u32);

/// A send a rank took from another: where it was planned, its piece and
/// bytes.
type Taken = (Origin, u32, u64);

/// A candidate move: the higher of the two ranks' loads after it, the
/// send (as [`Taken`]) and the rank taking it.
type Move = (u64, Taken, Rank);

/// Moves stage-0 sends in `lists` off the busiest source rank while that
/// lowers it (see the module doc). `load` is each source rank's stage-0
/// egress; `holders[piece]` the ranks holding each piece, as a (start,
/// len) range of `pool`.
pub(crate) fn rebalance(lists: &mut SenderLists, mut load: Vec<u64>, holders: &[(u32, u32)], pool: &[Rank]) {
    // A send by where it was planned (sender, position); where it is now,
    // if moved; and what each rank took from others: (origin, piece,
    // bytes).
    let mut owner: HashMap<Origin, Rank> = HashMap::new();
    let mut taken: Vec<Vec<Taken>> = vec![Vec::new(); load.len()];
    let holders_of = |piece: u32| {
        let (start, len) = holders.get(piece as usize).copied().unwrap_or((0, 0));
        &pool[start as usize..(start + len) as usize]
    };
    for _ in 0..MAX_MOVES_PER_RANK.saturating_mul(load.len()) {
        // The busiest rank (the lowest of equals).
        let Some(r) = (0..load.len() as Rank).max_by_key(|&r| (load[r as usize], std::cmp::Reverse(r))) else { break };
        let here = load[r as usize];
        // The move that leaves the pair's higher load lowest.
        let mut best: Option<Move> = None;
        let own =
            lists.source_sends(r).filter(|&(at, ..)| !owner.contains_key(&(r, at))).map(|(at, _, piece, bytes)| ((r, at), piece, bytes));
        for (origin, piece, bytes) in own.chain(taken[r as usize].iter().copied()) {
            for &c in holders_of(piece).iter().filter(|&&c| c != r) {
                let ends = load[c as usize].saturating_add(bytes);
                let after = ends.max(here - bytes);
                if ends < here && best.is_none_or(|b| after < b.0) {
                    best = Some((after, (origin, piece, bytes), c));
                }
            }
        }
        let Some((_, (origin, piece, bytes), c)) = best else { break };
        taken[r as usize].retain(|t| t.0 != origin);
        taken[c as usize].push((origin, piece, bytes));
        owner.insert(origin, c);
        load[r as usize] -= bytes;
        load[c as usize] += bytes;
    }
    let mut moves: Vec<(Rank, u32, Rank)> =
        owner.into_iter().filter(|&((from, _), to)| from != to).map(|((from, at), to)| (from, at, to)).collect();
    // In the order planned (a map's order is not).
    moves.sort_unstable();
    lists.move_source_sends(&moves);
}
