//! Staging areas kept from run to run of a plan ([`Scratch`]): senders that
//! convert f32 to bf16 make their staging areas in the first run and reuse
//! them in every later one (none made after), and a scratch carried over
//! to another plan (a layout change) still moves every element bit-exact,
//! making only what its kept areas cannot hold.

use reshard::{parse_layout, plan_reshard, Endpoint, Layout, PlanOptions, RankProgram};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;
use transport::fabric::{close_in_process, open_in_process, Fabric, RankEnd, RunMemory, RunOptions, Scratch, Site, StagingKept};
use transport::{fill_sources, verify_destinations, RankMemory};

/// Training TP2 in f32, inference TP2 the other way in bf16: every piece
/// converts at its sender.
fn layouts(rows: u64) -> (Layout, Layout) {
    let src = format!(
        r#"{{"ranks": 2, "tensors": [
  {{"name": "w", "dtype": "f32", "shape": [{rows}, 64], "mesh": {{"shape": [2]}}, "placements": ["shard(0)"]}},
  {{"name": "b", "dtype": "f32", "shape": [64], "mesh": {{"shape": [2]}}, "placements": ["replicate"]}}]}}"#
    );
    let dst = format!(
        r#"{{"ranks": 2, "tensors": [
  {{"name": "w", "dtype": "bf16", "shape": [{rows}, 64], "mesh": {{"shape": [2]}}, "placements": ["shard(1)"]}},
  {{"name": "b", "dtype": "bf16", "shape": [64], "mesh": {{"shape": [2]}}, "placements": ["shard(0)"]}}]}}"#
    );
    (parse_layout(&src).unwrap(), parse_layout(&dst).unwrap())
}

/// One refit of `programs` over the in-process fabric, every rank on its
/// own thread with its scratch; checks every destination element.
fn refit(src: &Layout, dst: &Layout, programs: &[RankProgram], scratch: &mut [Scratch], session: &str) {
    let mut memory = RankMemory::for_programs(programs);
    let n_src = src.ranks() as usize;
    fill_sources(src, &mut memory[..n_src]);
    for m in &mut memory[n_src..] {
        for b in &mut m.buffers {
            b.fill(0xee);
        }
    }
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    open_in_process(session, &endpoints);
    let site = Site { data_ip: IpAddr::V4(Ipv4Addr::LOCALHOST), gpu: None, registered: None };
    std::thread::scope(|s| {
        for ((program, memory), scratch) in programs.iter().zip(memory.iter_mut()).zip(scratch.iter_mut()) {
            s.spawn(move || {
                let (mut end, _) = RankEnd::open(Fabric::InProcess, program, site, session).unwrap();
                let options = RunOptions { deadline: Duration::from_secs(30), delta: None, scratch };
                end.run(program, RunMemory::Host(memory), options).unwrap();
            });
        }
    });
    close_in_process(session);
    verify_destinations(src, dst, &memory[n_src..]).unwrap();
}

#[test]
fn staging_areas_are_made_once_per_plan_and_reused() {
    let (src, dst) = layouts(4096);
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let mut scratch: Vec<Scratch> = programs.iter().map(|_| Scratch::default()).collect();
    // The most areas a rank can need at once: one per message it sends.
    let sends: Vec<usize> = programs.iter().map(|p| p.rounds.iter().map(|r| r.sends.len()).sum()).collect();
    assert!(sends[..2].iter().all(|&n| n >= 2), "each source sends to both destinations: {sends:?}");
    let refits = 10;
    for refit_no in 1..=refits {
        refit(&src, &dst, &programs, &mut scratch, &format!("staging-{refit_no}"));
        let kept: Vec<StagingKept> = scratch.iter().map(Scratch::staging_kept).collect();
        for (rank, (k, &n)) in kept.iter().zip(&sends).enumerate().take(2) {
            // Every area made came back; none is made beyond what one
            // run can hold at once (without reuse, one per message staged:
            // `n` a refit).
            assert_eq!(k.areas, k.made, "refit {refit_no}, src {rank}: {k:?}");
            assert!(k.made >= 1 && k.made <= n, "refit {refit_no}, src {rank}: {k:?}, {n} messages a refit");
            // f32 to bf16: at least the bytes of one message staged.
            assert!(k.bytes >= 4096 / 2 * 64 * 2 / 2, "refit {refit_no}, src {rank}: {k:?}");
        }
        // Destinations convert nothing.
        assert!(kept[2..].iter().all(|k| k.made == 0), "refit {refit_no}: {kept:?}");
    }
}

#[test]
fn kept_areas_serve_another_plan_bit_exact() {
    // A small plan, then a layout change to larger tensors, then back:
    // the kept areas are too small for the larger messages (new ones are
    // made) and large enough for the small plan again (none made).
    let small = layouts(256);
    let large = layouts(8192);
    let plan = |(s, d): &(Layout, Layout)| plan_reshard(s, d, &PlanOptions::default()).unwrap().programs(s, d).unwrap();
    let (p_small, p_large) = (plan(&small), plan(&large));
    let mut scratch: Vec<Scratch> = p_small.iter().map(|_| Scratch::default()).collect();
    refit(&small.0, &small.1, &p_small, &mut scratch, "change-1");
    let made_small = scratch[0].staging_kept().made;
    refit(&large.0, &large.1, &p_large, &mut scratch, "change-2");
    let after_large = scratch[0].staging_kept();
    assert!(after_large.made > made_small, "larger messages need larger areas: {after_large:?}");
    refit(&small.0, &small.1, &p_small, &mut scratch, "change-3");
    assert_eq!(scratch[0].staging_kept().made, after_large.made, "the larger areas serve the small plan");
}
