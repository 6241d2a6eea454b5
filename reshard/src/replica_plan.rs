//! Plans for destination groups made of replicas, derived from one
//! replica's plan ([`Plan::for_replicas`]) instead of planned from scratch:
//! what a group that gains or loses whole replicas needs between refits.
//!
//! Replica `r` of `n` ([`Layout::replicated`]) receives exactly what the
//! one replica's plan delivers, on its own ranks: every transfer is copied
//! with its destination ranks moved by `r * k`. Its source sends go to
//! the next holder of the same piece, `r` places on in the piece's holders
//! (data-parallel source replicas take turns feeding the inference
//! replicas), and the planner's last step, moving source sends among
//! holders while that lowers the busiest source rank, runs over the whole.
//! Nothing is intersected again: deriving costs a pass over the
//! transfers, where planning costs the overlap of every tensor pair.
//!
//! The derived plan never relays between replicas: each replica's nodes
//! receive their bytes from source ranks as one replica's plan has them.
//! A plan of the whole group may instead send a piece once and relay it
//! from replica to replica, which sends fewer source bytes where source
//! egress is the narrow link; `docs/benchmarks.md` compares the two.

use crate::layout::{Layout, Rank};
use crate::plan::{derived_fingerprint, fingerprint, Endpoint, Group, Plan, PlanError, PlanParts, SenderLists, Strategy};
use crate::rebalance::rebalance;
use crate::route::{offered_holdings, scale_block};
use std::collections::HashMap;

impl Plan {
    /// The plan for `dst`, `n` replicas of `one` ([`Layout::replicated`]),
    /// derived from this plan, a reshard from `src` to `one`: the same
    /// pieces delivered to every replica, each replica's source sends
    /// spread over the pieces' holders (see the module doc). One replica's
    /// plan is itself.
    ///
    /// Fails if this plan is not a reshard from `src` to `one`, if `dst`
    /// is not replicas of `one`, or if a replica does not fill whole nodes
    /// (then replicas share nodes, and only a plan of the whole group
    /// sends each node its bytes once).
    pub fn for_replicas(&self, src: &Layout, one: &Layout, dst: &Layout) -> Result<Plan, PlanError> {
        let n = self.replica_count(src, one, dst)?;
        if n == 1 && dst.fingerprint() == one.fingerprint() {
            return Ok(self.clone());
        }
        let alike = dst.tensors().len() == one.tensors().len() && dst.tensors().iter().zip(one.replicated_tensors(n)).all(|(d, r)| *d == r);
        if dst.ranks_per_node() != one.ranks_per_node() || !alike {
            return Err(derive(format!("the destination layout is not {n} replicas of the replica's layout")));
        }
        let (pool, holders) = self.piece_holders(src, one);
        let (mut lists, load) = self.replica_sends(src, dst, (one.ranks(), n), (&pool, &holders))?;
        rebalance(&mut lists, load, &holders, &pool);
        let needed_node_bytes = (0..n).flat_map(|_| self.needed_node_bytes.iter().copied()).collect();
        let parts = PlanParts {
            pieces: self.pieces.clone(),
            wire: self.wire.clone(),
            routes: self.routes.clone(),
            needed_node_bytes,
            unique_bytes: self.unique_bytes,
            scratch_blocks: Vec::new(),
        };
        let mut plan = Plan::assemble_by_sender(Strategy::Reshard, src, dst, &self.options, parts, lists);
        plan.replicas = Some(n);
        plan.fingerprint = derived_fingerprint(plan.fingerprint);
        Ok(plan)
    }

    /// The number of replicas of `one` in `dst`, once this plan is checked
    /// to be a reshard from `src` to `one` made by the planner, and `dst`'s
    /// ranks to be whole replicas of whole nodes.
    fn replica_count(&self, src: &Layout, one: &Layout, dst: &Layout) -> Result<u32, PlanError> {
        if self.strategy != Strategy::Reshard {
            return Err(derive("only a reshard plan is derived for replicas".into()));
        }
        if self.replicas.is_some() {
            return Err(derive("the plan is itself derived for replicas; derive from one replica's plan".into()));
        }
        let layouts = fingerprint(src, one, &self.options, self.strategy);
        if layouts != self.fingerprint {
            return Err(PlanError::FingerprintMismatch { plan: self.fingerprint, layouts });
        }
        let k = one.ranks();
        if !k.is_multiple_of(one.ranks_per_node()) {
            return Err(derive(format!(
                "a replica's {k} ranks do not fill whole nodes of {} ranks; replicas would share nodes",
                one.ranks_per_node()
            )));
        }
        if !dst.ranks().is_multiple_of(k) {
            return Err(derive(format!("the destination's {} ranks are not replicas of {k} ranks", dst.ranks())));
        }
        Ok(dst.ranks() / k)
    }

    /// Each piece's holders among the source ranks (those the plan may
    /// take it from, lost sources aside), as ranges of one pool: (pool,
    /// ranges).
    fn piece_holders(&self, src: &Layout, one: &Layout) -> (Vec<Rank>, Vec<(u32, u32)>) {
        let mut pool: Vec<Rank> = Vec::new();
        let mut holders: Vec<(u32, u32)> = Vec::with_capacity(self.pieces.len());
        let mut by_tensor: HashMap<u32, Vec<(crate::block::Block, Vec<Rank>)>> = HashMap::new();
        for p in &self.pieces {
            let held = by_tensor.entry(p.src_tensor).or_insert_with(|| {
                let route = self.routes[p.dst_tensor as usize];
                offered_holdings(src, p.src_tensor, route, scale_block(one, p.dst_tensor))
                    .into_iter()
                    .map(|h| {
                        let mut ranks: Vec<Rank> = h.holders.iter().map(|l| l.rank).collect();
                        ranks.retain(|r| self.options.lost_sources.binary_search(r).is_err());
                        ranks.sort_unstable();
                        ranks.dedup();
                        (h.block, ranks)
                    })
                    .filter(|(_, ranks)| !ranks.is_empty())
                    .collect()
            });
            // Every source rank holding the whole piece.
            let mut ranks: Vec<Rank> = held.iter().filter(|(b, _)| b.contains(&p.block)).flat_map(|(_, r)| r.iter().copied()).collect();
            ranks.sort_unstable();
            ranks.dedup();
            let (start, len) = (pool.len() as u32, ranks.len() as u32);
            pool.extend(ranks);
            holders.push((start, len));
        }
        (pool, holders)
    }

    /// This plan's transfers copied onto each of `n` replicas of `k` ranks
    /// of `dst`: destination ranks moved by `r * k`, source sends turned to
    /// the holder `r` places on in the piece's holders (`pool`, `holders`
    /// from [`piece_holders`](Self::piece_holders)); with each source rank's
    /// bytes sent.
    fn replica_sends(
        &self,
        src: &Layout,
        dst: &Layout,
        (k, n): (u32, u32),
        (pool, holders): (&[Rank], &[(u32, u32)]),
    ) -> Result<(SenderLists, Vec<u64>), PlanError> {
        let holders_of = |piece: u32| {
            let (start, len) = holders[piece as usize];
            &pool[start as usize..(start + len) as usize]
        };
        let moved = |e: Endpoint, r: u32| match e.group {
            Group::Src => e,
            Group::Dst => Endpoint::dst(e.rank + r * k),
        };
        let mut lists = SenderLists::new(src.ranks(), dst.ranks(), self.transfers.len().saturating_mul(n as usize));
        let mut load = vec![0u64; src.ranks() as usize];
        if self.transfers.iter().any(|t| t.from_scratch || t.to_scratch || t.to.group != Group::Dst) {
            return Err(derive("a transfer reads or writes scratch, or goes to a source rank".into()));
        }
        let bytes: Vec<u64> = self.transfers.iter().map(|t| self.wire_bytes(t)).collect();
        for r in 0..n {
            for (t, &bytes) in self.transfers.iter().zip(&bytes) {
                let from = match t.from.group {
                    Group::Dst => moved(t.from, r),
                    Group::Src => {
                        let held = holders_of(t.piece);
                        let sender = match held.iter().position(|&h| h == t.from.rank) {
                            Some(at) => held[(at + r as usize) % held.len()],
                            // The plan took it from a rank that holds it
                            // under another cut: that rank holds it here too.
                            None => t.from.rank,
                        };
                        load[sender as usize] += bytes;
                        Endpoint::src(sender)
                    }
                };
                lists.push(t.stage, from, moved(t.to, r), t.piece, bytes);
            }
        }
        Ok((lists, load))
    }

    /// How many replicas this plan was derived for from one replica's
    /// ([`for_replicas`](Self::for_replicas)); `None` for a plan made by a
    /// planner.
    pub fn derived_for_replicas(&self) -> Option<u32> {
        self.replicas
    }
}

/// A plan that cannot be derived for replicas, and why.
fn derive(problem: String) -> PlanError {
    PlanError::Derive { problem }
}
