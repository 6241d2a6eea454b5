//! DeepSeek-V3 at /128 with a training placement `refit emit` does not
//! write, through worker processes: a rank order that spreads each routed
//! expert's data-parallel copies over four nodes, so each source node holds
//! 128 experts of a layer once (the preset's holds 32 of them, four times)
//! and source nodes fan out to many more destination ranks.
//!
//! Training: PP4 x (EP16 x DP4 for the routed experts, the rest
//! DP64-replicated), TP1, 256 ranks, 8 a node, in Megatron's order
//! (expert parallelism innermost: rank `stage * 64 + dp * 16 + ep`);
//! routed expert `e` whole on ranks `stage * 64 + dp * 16 + e / 16` for
//! dp in 0..4.
//! Inference: the preset's TP8 x DP16, one replica a node, vLLM's column
//! and row splits and fused buffers, 128 ranks. Same tensors and shapes as
//! `refit emit --model deepseek-v3 --scale 128`; only the placement of the
//! training side differs.

use refit_cli::presets::{layouts, Model};
use reshard::{layout_to_json, Layout, Placement};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_refit");

/// Training ranks a stage has (EP16 x DP4).
const PER_STAGE: u32 = 64;
/// Expert-parallel degree of the training side.
const EP: u32 = 16;
/// Data-parallel copies of each routed expert.
const DP: u32 = 4;

/// The preset's training rank `stage * 64 + ep * 4 + dp` in this
/// placement's order, `stage * 64 + dp * 16 + ep`.
fn reordered(rank: u32) -> u32 {
    let (stage, r) = (rank / PER_STAGE, rank % PER_STAGE);
    let (ep, dp) = (r / DP, r % DP);
    stage * PER_STAGE + dp * EP + ep
}

/// The layouts: the preset's tensors, shapes, buffers and inference side;
/// the training ranks reordered.
fn placement_layouts() -> (Layout, Layout) {
    let (src, dst) = layouts(Model::DeepseekV3, 128).expect("the deepseek-v3 preset at /128");
    let tensors = src
        .tensors()
        .iter()
        .cloned()
        .map(|mut t| {
            let Placement::Mesh(m) = &mut t.placement else { panic!("{}: the preset places every tensor on a mesh", t.name) };
            m.ranks = m.ranks.iter().map(|&r| reordered(r)).collect();
            t
        })
        .collect();
    let src = Layout::new(src.ranks(), Some(src.ranks_per_node()), tensors).expect("the reordered training layout validates");
    (src, dst)
}

/// Writes the layouts as `src.json` and `dst.json` under `dir`.
fn write_layouts(dir: &Path) -> (String, String) {
    let (src, dst) = placement_layouts();
    std::fs::create_dir_all(dir).expect("layout directory");
    let path = |name: &str, l: &Layout| {
        let p = dir.join(name);
        std::fs::write(&p, layout_to_json(l).to_string()).expect("layout file written");
        p.to_str().expect("utf-8 path").to_string()
    };
    (path("src.json", &src), path("dst.json", &dst))
}

/// A directory of this test process's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        TempDir(std::env::temp_dir().join(format!("refit-{what}-{}", std::process::id())))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The training side is the placement described: every routed expert whole
/// on the four data-parallel ranks of its EP rank (one per pair of nodes),
/// every other weight replicated over its stage's 64 ranks; the inference
/// side and every shape are the preset's.
#[test]
fn the_placement_is_the_one_described() {
    let (src, dst) = placement_layouts();
    let (preset_src, preset_dst) = layouts(Model::DeepseekV3, 128).expect("preset");
    assert_eq!((src.ranks(), src.ranks_per_node(), dst.ranks(), dst.ranks_per_node()), (256, 8, 128, 8));
    assert_eq!(dst.fingerprint(), preset_dst.fingerprint(), "the inference side is the preset's");
    assert_eq!(src.tensors().len(), preset_src.tensors().len());
    let holders = |l: &Layout, t: u32| -> BTreeSet<u32> { l.holdings(t).iter().flat_map(|h| h.holders.iter().map(|x| x.rank)).collect() };
    let mut experts = 0;
    for (i, (t, p)) in src.tensors().iter().zip(preset_src.tensors()).enumerate() {
        assert_eq!((&t.name, &t.shape, t.dtype), (&p.name, &p.shape, p.dtype), "tensor {i}");
        let held = holders(&src, i as u32);
        let stage = held.first().copied().expect("held") / PER_STAGE;
        match t.name.split_once(".mlp.experts.") {
            Some((_, rest)) => {
                experts += 1;
                let e: u32 = rest.split('.').next().and_then(|e| e.parse().ok()).expect("expert index");
                let want: BTreeSet<u32> = (0..DP).map(|dp| stage * PER_STAGE + dp * EP + e / (256 / EP)).collect();
                assert_eq!(held, want, "{}", t.name);
                let nodes: BTreeSet<u32> = held.iter().map(|&r| src.node_of(r)).collect();
                assert_eq!(nodes.len(), DP as usize, "{}: one copy a node", t.name);
            }
            None => assert_eq!(held, (stage * PER_STAGE..(stage + 1) * PER_STAGE).collect(), "{}: the stage's ranks", t.name),
        }
    }
    assert_eq!(experts, 58 * 256 * 3, "routed expert tensors");
}

/// Two refits of that pair through 48 worker processes (one per node: 32
/// training, 16 inference), every destination element checked after each:
/// both commit and verify. Its fabric holds 35,616 streams at once on
/// this one host (more than `kernel.pid_max`'s 32,768 tasks here: one
/// reader thread per stream could not be). 60-130 s on 2 loaded cores
/// with the release build, which `.ci/run` runs it with (`cargo test
/// --release --test placement_launch`); with the debug build the launcher
/// plans, derives and installs 384 ranks' programs so slowly on 2 cores
/// that its workers hear no heartbeat for longer than the timeout (a
/// launcher starved that long loses its workers: docs/reliability.md).
#[test]
#[cfg_attr(debug_assertions, ignore = "needs the release build: cargo test --release --test placement_launch")]
fn slow_deepseek_v3_with_experts_spread_over_nodes_refits_through_processes() {
    let dir = TempDir::new("placement-launch");
    let (src, dst) = write_layouts(&dir.0);
    let args = ["launch", "--src", &src, "--dst", &dst, "--per-process", "node", "--verify", "--refits", "2", "--json"];
    let out = Command::new(BIN).args(args).output().expect("spawn refit launch");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let tail: String = stderr.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    let what = format!("refit {}: exit {:?}\n{stdout}\n{tail}", args.join(" "), out.status.code());
    assert_eq!(out.status.code(), Some(0), "{what}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {what}"));
    let refits = v["refits"].as_array().unwrap_or_else(|| panic!("no refits: {what}"));
    assert_eq!(refits.len(), 2, "{what}");
    for (i, r) in refits.iter().enumerate() {
        assert_eq!(r["version"].as_u64(), Some(i as u64 + 1), "{what}");
        assert_eq!(r["ok"], true, "refit {}: {what}", i + 1);
    }
    assert_eq!(v["verified"], true, "{what}");
}
