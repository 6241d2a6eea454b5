//! Delta refits ([`transport::delta`]): after a base refit, each message
//! goes as what changed since; destinations end bit-exact with a dense
//! refit of the same sources, over in-process channels and over TCP, with
//! far fewer bytes when little changed and hardly more when all did.

use reshard::{parse_layout, plan_baseline, plan_reshard, Layout, Plan, PlanOptions, RankProgram};
use std::time::Duration;
use transport::{
    fill_sources, run_local_delta, run_threads_delta, tcp_fabric_for, DeltaMemo, ExecError, ExecOptions, ExecReport, RankMemory, TcpConfig,
};

/// TP2 by rows, f32 -> TP2 by columns x DP2 on 2 nodes, bf16 (narrowed on
/// the wire, relayed or sent twice across nodes).
const SRC: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [128, 64], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "v", "dtype": "f32", "shape": [64, 96], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;
const DST: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [128, 64], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "v", "dtype": "bf16", "shape": [64, 96], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;

fn layouts() -> (Layout, Layout) {
    (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap())
}

/// Runs every rank's program as a delta refit on `bases`, over TCP or in
/// process; returns the report (`bytes`: on the wire) and the new memos.
fn run_delta(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    bases: Vec<Option<DeltaMemo>>,
    tcp: bool,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    let options = ExecOptions { deadline: Duration::from_secs(20) };
    if tcp {
        run_threads_delta(programs, memory, &options, tcp_fabric_for(programs, &TcpConfig::default()).unwrap(), bases)
    } else {
        run_local_delta(programs, memory, &options, bases)
    }
}

/// Changes every `every`-th f32 element of every source buffer.
fn step(src_memory: &mut [RankMemory], every: usize) {
    for m in src_memory {
        for b in &mut m.buffers {
            for e in b.chunks_exact_mut(4).step_by(every) {
                let x = f32::from_le_bytes(e.try_into().unwrap());
                e.copy_from_slice(&(x * 2.0 + 1.0).to_le_bytes());
            }
        }
    }
}

/// Every destination rank's layout buffers (not the scratch a plan adds).
fn destinations(memory: &[RankMemory], dst: &Layout, n_src: usize) -> Vec<Vec<Vec<u8>>> {
    memory[n_src..].iter().enumerate().map(|(r, m)| m.buffers[..dst.rank_buffers(r as u32).len()].to_vec()).collect()
}

fn check(plan: &Plan, tcp: bool) {
    let (src, dst) = layouts();
    let n_src = src.ranks() as usize;
    let programs = plan.programs(&src, &dst).unwrap();
    let dense = plan.figures().total_bytes;
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..n_src]);
    // The base refit: nothing to compare with, so dense (plus headers).
    let none = vec![None; programs.len()];
    let (first, mut memos) = run_delta(&programs, &mut memory, none, tcp).unwrap();
    let wire = first.bytes;
    assert!(wire >= dense && wire <= dense + 26 * plan.figures().messages, "{wire} vs {dense}");
    transport::verify_destinations(&src, &dst, &memory[n_src..]).unwrap();
    // (every k-th element changed, most wire bytes as a share of dense)
    for (every, share) in [(50, 0.10), (1, 1.05), (1_000_000, 0.10)] {
        step(&mut memory[..n_src], every);
        // Destinations start from garbage: a delta refit writes every
        // element, changed or not.
        for m in &mut memory[n_src..] {
            for b in &mut m.buffers {
                b.fill(0xee);
            }
        }
        let bases: Vec<Option<DeltaMemo>> = memos.into_iter().map(Some).collect();
        let (report, next) = run_delta(&programs, &mut memory, bases, tcp).unwrap();
        let wire = report.bytes;
        memos = next;
        // The same sources, refit densely into fresh memory.
        let mut fresh = RankMemory::for_programs(&programs);
        for (f, m) in fresh.iter_mut().zip(&memory).take(n_src) {
            f.buffers.clone_from(&m.buffers);
        }
        transport::run_local(&programs, &mut fresh, &ExecOptions::default()).unwrap();
        let (got, want) = (destinations(&memory, &dst, n_src), destinations(&fresh, &dst, n_src));
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            for (b, (gb, wb)) in g.iter().zip(w).enumerate() {
                let bad = gb.iter().zip(wb).position(|(x, y)| x != y);
                assert!(
                    bad.is_none(),
                    "{:?} every {every}: dst rank {r} buffer {b} ({} bytes) differs first at byte {bad:?}",
                    plan.strategy(),
                    gb.len()
                );
            }
        }
        assert!((wire as f64) <= share * dense as f64, "every {every}: {wire} bytes on the wire, dense {dense}");
    }
    // A rank whose base is not the one its peers encoded against fails the
    // refit with an error, never with wrong weights.
    step(&mut memory[..n_src], 3);
    let mut bases: Vec<Option<DeltaMemo>> = memos.into_iter().map(Some).collect();
    *bases.last_mut().unwrap() = Some(DeltaMemo::default());
    let err = run_delta(&programs, &mut memory, bases, tcp).unwrap_err().to_string();
    assert!(err.contains("another base"), "{err}");
}

#[test]
fn delta_refits_are_bit_exact_and_small_in_process() {
    let (src, dst) = layouts();
    check(&plan_reshard(&src, &dst, &PlanOptions::default()).unwrap(), false);
    check(&plan_baseline(&src, &dst, &PlanOptions::default()).unwrap(), false);
}

#[test]
fn delta_refits_are_bit_exact_and_small_over_tcp() {
    let (src, dst) = layouts();
    check(&plan_reshard(&src, &dst, &PlanOptions::default()).unwrap(), true);
}
