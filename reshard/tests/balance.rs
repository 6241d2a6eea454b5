//! Planner balance against the optimum: how much the busiest source rank
//! sends, compared with the least any assignment of the same bytes to the
//! source ranks holding them could make it send.
//!
//! **What is compared.** The reshard planner sends every needed element
//! from the sources either once per destination node that needs it (direct)
//! or once in all (relayed node to node); which one is a time trade-off of
//! the link model, not a matter of balance. So the optimum is taken over
//! the *same bytes that leave the sources in the plan*: for every element of
//! every tensor, `copies` = the number of the plan's source transfers that
//! carry it, and those `copies × wire bytes` must come from source ranks that
//! hold the element, split among them in any way (arbitrarily divisible, as
//! a linear program would). The least possible busiest-source load of that
//! problem is exact without an LP: by the max-flow/min-cut (Hall) theorem
//! for a supply–demand bipartite graph, a busiest load `T` is feasible iff
//! every set `S` of source ranks can carry what only `S` holds, so
//! `T* = max over S of (bytes held only within S) / |S|`; with at most 8
//! source ranks that is 255 sets. The plan itself is a feasible point, so
//! `planner / T* ≥ 1` always (checked). Every source transfer of a reshard
//! crosses nodes (source and destination nodes are distinct machines), so
//! the planner's figure is its `src_rank_egress_bytes` maximum.
//!
//! For information the test also prints the ratio to the lower bound of
//! *any* plan: every needed element leaving the sources once (`unique`).
//!
//! Run with the figures printed:
//! `cargo test --release -p reshard --test balance -- --nocapture`

use reshard::{plan_reshard, Block, DType, Group, Layout, Placement, Plan, PlanOptions, Region, ShardSpec, Storage, TensorLayout};
use std::collections::HashMap;

/// A seeded generator (splitmix64): the same 200 cases on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// `k` distinct ranks of `0..n`.
    fn ranks(&mut self, n: u32, k: u32) -> Vec<u32> {
        let mut all: Vec<u32> = (0..n).collect();
        for i in 0..all.len() {
            let j = i + self.below((all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k.min(n) as usize);
        all
    }
}

/// Uneven cut points of `0..n` (0 and `n` included), at most `max_cuts`
/// inside.
fn cuts(rng: &mut Rng, n: u64, max_cuts: u64) -> Vec<u64> {
    let mut c = vec![0, n];
    for _ in 0..rng.below(max_cuts + 1) {
        if n > 1 {
            c.push(1 + rng.below(n - 1));
        }
    }
    c.sort_unstable();
    c.dedup();
    c
}

/// The boxes of the grid the cut points of each dimension make.
fn grid(cuts: &[Vec<u64>]) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut boxes = vec![(Vec::new(), Vec::new())];
    for c in cuts {
        let mut next = Vec::new();
        for (off, ext) in &boxes {
            for w in c.windows(2) {
                let (mut o, mut e): (Vec<u64>, Vec<u64>) = (off.clone(), ext.clone());
                o.push(w[0]);
                e.push(w[1] - w[0]);
                next.push((o, e));
            }
        }
        boxes = next;
    }
    boxes
}

fn shard(rank: u32, (offset, extent): (Vec<u64>, Vec<u64>)) -> ShardSpec {
    ShardSpec { rank, region: Region::Block { offset, extent }, storage: Storage::Own }
}

/// A grid partition of `shape` (at most `max_cuts` cuts per dimension),
/// every box on `copies` distinct random ranks.
fn partition(rng: &mut Rng, shape: &[u64], ranks: u32, max_cuts: u64, copies: u32) -> Vec<ShardSpec> {
    let c: Vec<Vec<u64>> = shape.iter().map(|&n| cuts(rng, n, max_cuts)).collect();
    let mut shards = Vec::new();
    for b in grid(&c) {
        let k = 1 + rng.below(copies as u64) as u32;
        for r in rng.ranks(ranks, k) {
            shards.push(shard(r, b.clone()));
        }
    }
    shards
}

/// Source shards of one tensor: replicated whole, a grid partition with
/// replicas (uneven cuts), overlapping partitions cut differently (partial
/// overlaps), or a partition plus arbitrary boxes.
fn src_shards(rng: &mut Rng, shape: &[u64], ranks: u32) -> Vec<ShardSpec> {
    let whole = (vec![0; shape.len()], shape.to_vec());
    match rng.below(4) {
        0 => {
            let k = 1 + rng.below(ranks as u64) as u32;
            rng.ranks(ranks, k).into_iter().map(|r| shard(r, whole.clone())).collect()
        }
        1 => partition(rng, shape, ranks, 3, 3),
        2 => {
            // Two or three partitions cut differently, sometimes one of
            // them a whole copy (the 4×4 case of the issue).
            let mut s = Vec::new();
            if rng.one_in(2) {
                s.push(shard(rng.below(ranks as u64) as u32, whole));
            }
            for _ in 0..2 + rng.below(2) {
                s.extend(partition(rng, shape, ranks, 2, 1));
            }
            s
        }
        _ => {
            let mut s = partition(rng, shape, ranks, 1, 2);
            for _ in 0..1 + rng.below(3) {
                let (mut off, mut ext) = (Vec::new(), Vec::new());
                for &n in shape {
                    let a = rng.below(n);
                    off.push(a);
                    ext.push(1 + rng.below(n - a));
                }
                s.push(shard(rng.below(ranks as u64) as u32, (off, ext)));
            }
            s
        }
    }
}

/// Destination shards: a grid partition, boxes on one or two ranks, some
/// boxes not needed at all.
fn dst_shards(rng: &mut Rng, shape: &[u64], ranks: u32) -> Vec<ShardSpec> {
    let mut s = partition(rng, shape, ranks, 2, 2);
    if s.len() > 1 && rng.one_in(3) {
        s.remove(rng.below(s.len() as u64) as usize);
    }
    s
}

/// Case `seed`: 2–8 source ranks, 1–6 destination ranks, 1–3 tensors of
/// 1 to 3 dimensions (sizes up to 16), bf16 or f32.
fn case(seed: u64) -> (Layout, Layout) {
    let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x1234_5678);
    let src_ranks = 2 + rng.below(7) as u32;
    let dst_ranks = 1 + rng.below(6) as u32;
    let src_rpn = if rng.one_in(2) { 1 } else { 1 + rng.below(src_ranks as u64) as u32 };
    let dst_rpn = if rng.one_in(2) { 1 } else { 1 + rng.below(dst_ranks as u64) as u32 };
    let (mut st, mut dt) = (Vec::new(), Vec::new());
    for i in 0..1 + rng.below(3) {
        let ndim = [1usize, 2, 2, 2, 3][rng.below(5) as usize];
        let shape: Vec<u64> = (0..ndim).map(|_| 1 + rng.below(if ndim == 1 { 64 } else { 16 })).collect();
        let (sd, dd) = match rng.below(3) {
            0 => (DType::F32, DType::F32),
            1 => (DType::F32, DType::BF16),
            _ => (DType::BF16, DType::BF16),
        };
        let name = format!("t{i}");
        let s = Placement::Shards(src_shards(&mut rng, &shape, src_ranks));
        let d = Placement::Shards(dst_shards(&mut rng, &shape, dst_ranks));
        st.push(TensorLayout { name: name.clone(), dtype: sd, shape: shape.clone(), placement: s, scale: None });
        dt.push(TensorLayout { name, dtype: dd, shape, placement: d, scale: None });
    }
    let src = Layout::new(src_ranks, Some(src_rpn), st).expect("generated source layout is valid");
    let dst = Layout::new(dst_ranks, Some(dst_rpn), dt).expect("generated destination layout is valid");
    (src, dst)
}

/// Every element of `b`, as a one-element block.
fn elements(b: &Block) -> Vec<Block> {
    let mut out = vec![(Vec::new(), Vec::new())];
    for (&o, &e) in b.offset().iter().zip(b.extent()) {
        out = out
            .into_iter()
            .flat_map(|(off, ext): (Vec<u64>, Vec<u64>)| {
                (o..o + e).map(move |i| {
                    let (mut off, mut ext) = (off.clone(), ext.clone());
                    off.push(i);
                    ext.push(1);
                    (off, ext)
                })
            })
            .collect();
    }
    out.into_iter().map(|(o, e)| Block::new(&o, &e)).collect()
}

/// Per set of source ranks (a bit mask), the bytes only its members can
/// send: for every element the plan sends from sources, its copies times
/// its wire bytes (`unique`: once) go to the mask of the ranks holding it.
fn demand(src: &Layout, plan: &Plan, unique: bool) -> HashMap<u32, u64> {
    let mut by_tensor: HashMap<u32, Vec<(Block, u64)>> = HashMap::new();
    for t in plan.transfers().iter().filter(|t| t.from.group == Group::Src && t.from != t.to) {
        let p = &plan.pieces()[t.piece as usize];
        by_tensor.entry(p.src_tensor).or_default().push((p.block, plan.wire_bytes(t) / p.block.numel().max(1)));
    }
    let mut d: HashMap<u32, u64> = HashMap::new();
    for (ts, sent) in by_tensor {
        let holdings = src.holdings(ts);
        let shape = &src.tensors()[ts as usize].shape;
        for e in elements(&Block::new(&vec![0; shape.len()], shape)) {
            let carried: Vec<u64> = sent.iter().filter(|(b, _)| b.contains(&e)).map(|&(_, w)| w).collect();
            if carried.is_empty() {
                continue;
            }
            let bytes = if unique { carried[0] } else { carried.iter().sum() };
            let mut mask = 0u32;
            for h in holdings.iter().filter(|h| h.block.contains(&e)) {
                for l in &h.holders {
                    mask |= 1 << l.rank;
                }
            }
            assert_ne!(mask, 0, "the plan sends an element no source holds");
            *d.entry(mask).or_default() += bytes;
        }
    }
    d
}

/// The least possible busiest-rank load: max over sets `S` of source
/// ranks of (bytes only `S` holds) / |S| (see the module doc).
fn optimum(demand: &HashMap<u32, u64>, ranks: u32) -> f64 {
    let mut best: f64 = 0.0;
    for s in 1u32..1 << ranks {
        let inside: u64 = demand.iter().filter(|(&m, _)| m & !s == 0).map(|(_, &b)| b).sum();
        best = best.max(inside as f64 / s.count_ones() as f64);
    }
    best
}

/// Checks that the plan delivers every needed element to every destination
/// rank exactly once, each transfer sent by a rank that holds its piece (a
/// source's holdings, or what a destination received in an earlier stage).
fn check_delivery(src: &Layout, dst: &Layout, plan: &Plan) {
    // (dst rank, dst tensor) -> received blocks with their stage.
    let mut got: HashMap<(u32, u32), Vec<(Block, u16)>> = HashMap::new();
    let mut transfers: Vec<_> = plan.transfers().to_vec();
    transfers.sort_by_key(|t| t.stage);
    for t in &transfers {
        let p = &plan.pieces()[t.piece as usize];
        match t.from.group {
            Group::Src => {
                let held = src.rank_holdings(p.src_tensor, t.from.rank);
                assert!(held.iter().any(|(b, _)| b.contains(&p.block)), "{} sends {} it does not hold", t.from, p.block);
            }
            Group::Dst => {
                let had = got.get(&(t.from.rank, p.dst_tensor)).map(Vec::as_slice).unwrap_or(&[]);
                assert!(had.iter().any(|(b, s)| b.contains(&p.block) && *s < t.stage), "{} forwards {} before it has it", t.from, p.block);
            }
        }
        if t.to.group == Group::Dst {
            got.entry((t.to.rank, p.dst_tensor)).or_default().push((p.block, t.stage));
        }
    }
    for (td, tensor) in dst.tensors().iter().enumerate() {
        for h in dst.holdings(td as u32) {
            for l in &h.holders {
                let have = got.get(&(l.rank, td as u32)).map(Vec::as_slice).unwrap_or(&[]);
                for e in elements(&h.block) {
                    let n = have.iter().filter(|(b, _)| b.contains(&e)).count();
                    assert_eq!(n, 1, "tensor '{}' dst rank {} element {e}: received {n} times", tensor.name, l.rank);
                }
            }
        }
    }
}

/// Median, 90th percentile and worst of `ratios`.
fn stats(ratios: &mut [f64]) -> (f64, f64, f64) {
    ratios.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9), ratios[ratios.len() - 1])
}

/// Plans case `seed` with `options`: the planner's busiest source rank
/// against the optimum of the same bytes and against the unique-bytes
/// bound, and the plan's messages and pieces.
fn check(seed: u64, options: &PlanOptions) -> (f64, f64, u64, u64) {
    let (src, dst) = case(seed);
    let plan = plan_reshard(&src, &dst, options).unwrap_or_else(|e| panic!("case {seed}: {e}"));
    check_delivery(&src, &dst, &plan);
    let f = plan.figures();
    let busiest = f.max_src_rank_egress_bytes() as f64;
    let same = optimum(&demand(&src, &plan, false), src.ranks());
    let unique = optimum(&demand(&src, &plan, true), src.ranks());
    assert!(busiest + 1e-9 >= same, "case {seed}: the planner ({busiest}) beats the optimum ({same}): the optimum is wrong");
    let ratio = |opt: f64| if opt > 0.0 { busiest / opt } else { 1.0 };
    (ratio(same), ratio(unique), f.messages, f.pieces)
}

const CASES: u64 = 200;

/// The figures of all cases under `options`: (median, p90, worst) of the
/// ratio to the optimum of the same bytes and to the unique-bytes bound,
/// and the messages and pieces of all plans.
struct Measured {
    same: (f64, f64, f64),
    unique: (f64, f64, f64),
    messages: u64,
    pieces: u64,
}

fn measure(options: &PlanOptions) -> Measured {
    let (mut same, mut unique) = (Vec::new(), Vec::new());
    let (mut messages, mut pieces) = (0, 0);
    for seed in 0..CASES {
        let (s, u, m, p) = check(seed, options);
        same.push(s);
        unique.push(u);
        messages += m;
        pieces += p;
    }
    Measured { same: stats(&mut same), unique: stats(&mut unique), messages, pieces }
}

/// The least part of a split in these cases: one byte, so that the
/// parts are bounded only by whole rows. The cases' tensors are a few
/// bytes to a few KiB; the default (64 KiB) would never split them, and a
/// larger threshold measures its granularity, not the planner's balance.
const MIN_SPLIT: u64 = 1;

/// What the planner must meet on the 200 cases (median, p90, worst): the
/// bar of issue 35 (median at most 1.05, worst at most 1.5), p90 set from
/// what it measured (1.001, 1.150, 1.500; before the last step moved
/// source sends among holders, 1.002, 1.162, 1.595); without splitting it
/// measures (1.169, 2.349, 7.000), and before splitting existed (every
/// piece whole from one holder, no outlook) (1.269, 2.457, 7.000).
const BOUND: (f64, f64, f64) = (1.05, 1.2, 1.5);

fn meets(m: &Measured) -> bool {
    m.same.0 <= BOUND.0 && m.same.1 <= BOUND.1 && m.same.2 <= BOUND.2
}

/// The planner's busiest source rank against the optimum of the same
/// bytes: it meets [`BOUND`] when it may split pieces among their holders,
/// and does not when it may not (the same planner with `min_split_bytes`
/// at `u64::MAX`: every piece sent whole by one holder, as before
/// splitting existed).
#[test]
fn busiest_source_rank_against_the_optimum() {
    let never = measure(&PlanOptions { min_split_bytes: u64::MAX, ..PlanOptions::default() });
    let coarse = measure(&PlanOptions { min_split_bytes: 8, ..PlanOptions::default() });
    let split = measure(&PlanOptions { min_split_bytes: MIN_SPLIT, ..PlanOptions::default() });
    for (what, m) in [("never split", &never), ("parts of at least 8 bytes", &coarse), ("parts of at least 1 byte", &split)] {
        let ((a, b, c), (d, e, f)) = (m.same, m.unique);
        println!("{what}: busiest source rank / optimum of the same bytes, {CASES} cases: median {a:.3}, p90 {b:.3}, worst {c:.3}");
        println!("{what}: busiest source rank / unique-bytes bound: median {d:.3}, p90 {e:.3}, worst {f:.3}");
        println!("{what}: messages {}, pieces {} in all", m.messages, m.pieces);
    }
    assert!(meets(&split), "with splitting: median/p90/worst {:?}, bound {BOUND:?}", split.same);
    assert!(!meets(&never), "without splitting the bound is met too ({:?}): it shows nothing", never.same);
}

/// Source ranks 0, 1, 2 on nodes of their own; rank 0 holds a bf16
/// tensor of `rows` × `cols`, ranks 1 and 2 its top and bottom halves;
/// one destination rank needs all of it.
fn halves(rows: u64, cols: u64) -> (Layout, Layout) {
    let t = |placement| TensorLayout { name: "w".into(), dtype: DType::BF16, shape: vec![rows, cols], placement, scale: None };
    let half = rows / 2;
    let src = Placement::Shards(vec![
        shard(0, (vec![0, 0], vec![rows, cols])),
        shard(1, (vec![0, 0], vec![half, cols])),
        shard(2, (vec![half, 0], vec![rows - half, cols])),
    ]);
    let dst = Placement::Shards(vec![shard(0, (vec![0, 0], vec![rows, cols]))]);
    (Layout::new(3, Some(1), vec![t(src)]).unwrap(), Layout::new(1, Some(1), vec![t(dst)]).unwrap())
}

/// The smallest case: a 4×4 bf16 tensor (32 bytes) on rank 0 and
/// its halves on ranks 1 and 2. Before, rank 0 sent all 32 bytes (only a
/// rank holding the whole atom could send it); now ranks 1 and 2 send
/// their halves' share. Rows are 8 bytes, so the best split by whole rows
/// is 8 / 8 / 16 (the optimum, 32/3 each, would cut rows).
#[test]
fn three_ranks_share_a_4x4_tensor() {
    let (src, dst) = halves(4, 4);
    let options = PlanOptions { min_split_bytes: 1, ..PlanOptions::default() };
    let plan = plan_reshard(&src, &dst, &options).unwrap();
    check_delivery(&src, &dst, &plan);
    let egress = &plan.figures().src_rank_egress_bytes;
    assert_eq!(egress.iter().sum::<u64>(), 32, "{egress:?}");
    assert!(egress[0] < 32 && egress[1] > 0 && egress[2] > 0, "{egress:?}");
    assert_eq!(plan.figures().max_src_rank_egress_bytes(), 16, "{egress:?}");
    // Under the default threshold (parts of 64 KiB) 32 bytes stay whole.
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    assert_eq!((plan.figures().max_src_rank_egress_bytes(), plan.figures().pieces), (32, 1));
}

/// The same at 1024 × 1024 (2 MiB) under the default options: the three
/// ranks share it, none sending more than 3/8 of it (the optimum is 1/3).
#[test]
fn three_ranks_share_a_large_tensor_by_default() {
    let (src, dst) = halves(1024, 1024);
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let egress = &plan.figures().src_rank_egress_bytes;
    let total = 2 << 20;
    assert_eq!(egress.iter().sum::<u64>(), total, "{egress:?}");
    assert!(egress.iter().all(|&e| e > 0 && e * 8 <= total * 3), "{egress:?}");
}

/// Replicas of one piece on 4 ranks of their own nodes, one destination
/// node needing it: by default a 1 MiB piece goes out in 4 parts, one from
/// each replica; a 96 KiB one (parts would be under 64 KiB) whole.
#[test]
fn replicas_share_a_piece_above_the_threshold() {
    for (rows, parts) in [(512u64, 4u64), (48, 1)] {
        let t = |placement| TensorLayout { name: "w".into(), dtype: DType::BF16, shape: vec![rows, 1024], placement, scale: None };
        let whole = (vec![0, 0], vec![rows, 1024]);
        let src = Placement::Shards((0..4).map(|r| shard(r, whole.clone())).collect());
        let dst = Placement::Shards(vec![shard(0, whole.clone()), shard(1, whole.clone())]);
        let src = Layout::new(4, Some(1), vec![t(src)]).unwrap();
        let dst = Layout::new(2, Some(2), vec![t(dst)]).unwrap();
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
        check_delivery(&src, &dst, &plan);
        let f = plan.figures();
        assert_eq!(f.pieces, parts, "{rows} rows");
        assert_eq!(f.max_src_rank_egress_bytes(), rows * 1024 * 2 / parts, "{rows} rows: {:?}", f.src_rank_egress_bytes);
    }
}

/// With `BALANCE_DUMP=<file>`: writes every case's problem for
/// `benchmarks/balance_lp.py`, which solves it as a linear program
/// (scipy's HiGHS) and sets the planner beside it: one JSON object per
/// line, `{"seed", "ranks", "demand": [[mask, bytes], ...], "planner",
/// "exact"}` (the bytes each set of source ranks alone can send, the
/// planner's busiest source rank, and this file's exact optimum). Without
/// it, does nothing.
#[test]
fn dump_cases_for_the_lp_benchmark() {
    let Some(path) = std::env::var_os("BALANCE_DUMP") else { return };
    let options = PlanOptions { min_split_bytes: MIN_SPLIT, ..PlanOptions::default() };
    let mut out = String::new();
    for seed in 0..CASES {
        let (src, dst) = case(seed);
        let plan = plan_reshard(&src, &dst, &options).unwrap();
        let mut demand: Vec<(u32, u64)> = demand(&src, &plan, false).into_iter().collect();
        demand.sort_unstable();
        let pairs: Vec<String> = demand.iter().map(|(m, b)| format!("[{m}, {b}]")).collect();
        let exact = optimum(&demand.iter().copied().collect(), src.ranks());
        out += &format!(
            "{{\"seed\": {seed}, \"ranks\": {}, \"demand\": [{}], \"planner\": {}, \"exact\": {exact}}}\n",
            src.ranks(),
            pairs.join(", "),
            plan.figures().max_src_rank_egress_bytes()
        );
    }
    std::fs::write(&path, out).unwrap();
}
