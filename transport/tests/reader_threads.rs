//! A TCP fabric starts a reader thread for an incoming stream only once a
//! frame comes on it: connected, the ranks have none; after a refit, one
//! per ordered pair that carried a message, and none on a source rank
//! (sources receive nothing, though every destination they send to opened
//! a stream to them). Alone in its test binary: it counts this process's
//! threads by name.

use reshard::{parse_layout, plan_reshard, Group, PlanOptions};
use std::collections::BTreeSet;
use std::time::Duration;
use transport::{fill_sources, run_rank, tcp_fabric_for, verify_destinations, ExecOptions, RankMemory, TcpConfig};

const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [37, 11], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
  {"name": "e", "dtype": "f32", "shape": [64, 8], "mesh": {"shape": [4]}, "placements": ["shard(0)"]}]}"#;
const DST: &str = r#"{"ranks": 6, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [37, 11], "mesh": {"shape": [3, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "e", "dtype": "f32", "shape": [64, 8], "mesh": {"shape": [6]}, "placements": ["replicate"]}]}"#;

/// This process's threads whose name starts with `prefix` (names as the
/// kernel keeps them: the first 15 bytes).
fn threads_named(prefix: &str) -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim_end().to_string())
        .filter(|c| c.starts_with(prefix))
        .collect()
}

#[test]
fn reader_threads_only_for_streams_that_carry_frames() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    // Ordered (sender, receiver) pairs with a message, and the pairs that
    // hold streams (both ways wherever either sends).
    let carrying: BTreeSet<_> =
        programs.iter().flat_map(|p| p.rounds.iter().flat_map(move |r| r.sends.iter().map(move |m| (p.endpoint, m.peer)))).collect();
    let streams: BTreeSet<_> = carrying.iter().flat_map(|&(a, b)| [(a, b), (b, a)]).collect();
    assert!(carrying.iter().any(|(_, to)| to.group == Group::Dst), "sources send");
    assert!(streams.len() > carrying.len(), "some streams carry nothing: {streams:?}");
    let mut transports = tcp_fabric_for(&programs, &TcpConfig::default()).unwrap();
    assert_eq!(threads_named("refit-read-"), Vec::<String>::new(), "readers before any frame came");
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..src.ranks() as usize]);
    let options = ExecOptions { deadline: Duration::from_secs(20) };
    std::thread::scope(|s| {
        let runs: Vec<_> = programs
            .iter()
            .zip(memory.iter_mut())
            .zip(transports.iter_mut())
            .map(|((p, m), t)| s.spawn(move || run_rank(p, m, t, &options)))
            .collect();
        for r in runs {
            r.join().expect("rank thread").expect("rank run");
        }
    });
    verify_destinations(&src, &dst, &memory[src.ranks() as usize..]).unwrap();
    // Every message has been taken, so each stream that carried one has
    // its reader; no stream into a source rank carried one.
    let mut readers = threads_named("refit-read-");
    readers.sort();
    let mut want: Vec<String> =
        carrying.iter().map(|(from, _)| format!("refit-read-{from}").chars().take(15).collect::<String>().trim_end().to_string()).collect();
    want.sort();
    assert_eq!(readers, want, "one reader per ordered pair that carried a message");
    drop(transports);
}
