//! The model presets (`src/presets.rs`) against the real models.
//!
//! Expectations come from the models' public Hugging Face `config.json`
//! files and published sizes, not from the preset code:
//! - tensor names and shapes are generated here, Hugging Face style, from
//!   each config and compared one for one with both layouts of a pair;
//! - parameter totals (and active parameters of the MoE models) against the
//!   published sizes;
//! - the parallel structure of docs/benchmarks.md, read back through
//!   `Layout::holdings` (which blocks each rank holds) rather than from the
//!   preset's mesh encoding: pipeline stages, tensor-parallel splits (column
//!   parallel splits the output dim 0, row parallel the input dim 1, norms,
//!   routers and MLA down-projections replicated), expert parallelism, and
//!   TP groups inside one node;
//! - `scale K` divides every hidden size by K and keeps names, counts,
//!   expert counts and placements.
//!
//! - the fused buffers of Megatron (training) and vLLM (inference), read
//!   back per rank through `Layout::holdings`: which tensors share a
//!   buffer, in which order, back to back (`fused_buffers_*`);
//! - KV heads are never split: with more TP ranks than KV heads each rank
//!   holds one whole head.
//!
//! - DeepSeek-V3 served with expert parallelism (`PresetOptions::ep`, the
//!   CLI's `--ep`): the training side unchanged, every non-expert weight
//!   placed as in TP8 x DP16, each routed expert whole on its EP rank of
//!   every EP group, FusedMoE buffers holding a rank's local experts only;
//!   the elements each rank and node hold against closed forms from the
//!   config; plans whose node ingress is what the nodes hold, refits that
//!   verify bit-exact at small scale; bad EP degrees rejected (library and
//!   CLI) with a message.
//!
//! - The anchors' setups (`PresetOptions::setup`, the CLI's `--setup`):
//!   NeMo RL's DeepSeek-V3 PP16 x EP16 -> TP32 x DP8, vLLM RDT's Kimi-K2
//!   TP8 x PP8 x EP32 -> TP32 x EP32 and Qwen3-235B TP4 x PP2 x EP8 ->
//!   DP16 x EP16: every checkpoint tensor and its shape on both sides, and
//!   per tensor which rank holds which block (the TP index of a block
//!   against the rank, the pipeline stage, each expert's EP rank), from the
//!   published recipes; setups a preset lacks, or with `ep`, rejected.
//!
//! What the presets model: bf16 weights (DeepSeek-V3's checkpoint is fp8
//! with `weight_scale_inv` tensors; those are left out, as after a bf16
//! conversion), one logical tensor per routed expert and projection (stored
//! in fused buffers), separate embedding and LM head (none of the three ties
//! them), and no DeepSeek-V3 multi-token-prediction layer
//! (`model.layers.61`, ~14 B parameters: 671 B without it, 685 B with it).

use refit_cli::presets::{layouts, layouts_with, Model, PresetError, PresetOptions, Setup};
use refit_cli::runner::{Driver, DriverConfig};
use reshard::Holding;
use reshard::{plan_reshard, BufferKey, DType, Layout, Placement, PlanOptions, Storage, Strategy};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// Tensors placed alike split alike: (TP split kind, shape, placement with
/// its storage left out) already checked.
type Checked<'a> = HashSet<(Option<usize>, &'a [u64], Placement)>;

/// The attention block of a model.
#[derive(Clone, Copy)]
enum Attn {
    /// Grouped-query attention; `qk_norm`: per-head RMSNorm on q and k (Qwen3).
    Gqa { heads: u64, kv_heads: u64, head_dim: u64, qk_norm: bool },
    /// Multi-head latent attention (DeepSeek-V3).
    Mla { heads: u64, q_lora: u64, kv_lora: u64, nope: u64, rope: u64, v: u64 },
}

/// Facts from a model's public config.json.
#[derive(Clone, Copy)]
struct Config {
    layers: u32,
    /// Leading layers with a dense MLP (`first_k_dense_replace`; all layers of a dense model).
    dense_layers: u32,
    hidden: u64,
    /// Dense MLP intermediate size.
    intermediate: u64,
    vocab: u64,
    attn: Attn,
    /// Routed experts per MoE layer.
    experts: u64,
    /// Experts chosen per token (`num_experts_per_tok`).
    active_experts: u64,
    shared_experts: u64,
    moe_intermediate: u64,
    /// `mlp.gate.e_score_correction_bias` (DeepSeek-V3's aux-loss-free router).
    router_bias: bool,
}

/// Training layout: PP stages of `ranks / pp` ranks; inside a stage dense
/// weights are split `tp` ways and replicated over the rest, each routed
/// expert lives whole (expert TP 1) on `expert_copies` ranks, the experts of
/// a layer spread evenly over `ep` expert-parallel ranks.
struct Train {
    ranks: u32,
    per_node: u32,
    pp: u32,
    tp: u32,
    ep: u32,
    expert_copies: usize,
}

/// Inference layout: `dp` replicas of a TP group; every weight, experts
/// included, split `tp` ways by its kind.
struct Infer {
    ranks: u32,
    per_node: u32,
    tp: u32,
    dp: u32,
}

struct Case {
    model: Model,
    config: Config,
    /// Tensors of the checkpoint (bf16, no MTP layer).
    tensors: usize,
    /// Routed-expert weight tensors (one per expert and projection).
    expert_tensors: usize,
    /// Published parameter count and the relative tolerance.
    params: f64,
    params_tol: f64,
    /// Published active parameters per token (MoE), same tolerance.
    active_params: Option<f64>,
    train: Train,
    infer: Infer,
    /// A scale that divides every hidden size exactly (checked against scale 1).
    scale: u64,
}

const LLAMA3_8B: Config = Config {
    layers: 32,
    dense_layers: 32,
    hidden: 4096,
    intermediate: 14336,
    vocab: 128_256,
    attn: Attn::Gqa { heads: 32, kv_heads: 8, head_dim: 128, qk_norm: false },
    experts: 0,
    active_experts: 0,
    shared_experts: 0,
    moe_intermediate: 0,
    router_bias: false,
};

const QWEN3_235B: Config = Config {
    layers: 94,
    dense_layers: 0,
    hidden: 4096,
    intermediate: 12288, // unused: every layer is MoE (decoder_sparse_step 1, no mlp_only_layers)
    vocab: 151_936,
    attn: Attn::Gqa { heads: 64, kv_heads: 4, head_dim: 128, qk_norm: true },
    experts: 128,
    active_experts: 8,
    shared_experts: 0,
    moe_intermediate: 1536,
    router_bias: false,
};

const DEEPSEEK_V3: Config = Config {
    layers: 61,
    dense_layers: 3,
    hidden: 7168,
    intermediate: 18432,
    vocab: 129_280,
    attn: Attn::Mla { heads: 128, q_lora: 1536, kv_lora: 512, nope: 128, rope: 64, v: 128 },
    experts: 256,
    active_experts: 8,
    shared_experts: 1,
    moe_intermediate: 2048,
    router_bias: true,
};

fn llama3_8b() -> Case {
    Case {
        model: Model::Llama3_8b,
        config: LLAMA3_8B,
        tensors: 291,
        expert_tensors: 0,
        params: 8.030_261_248e9,
        params_tol: 0.0,
        active_params: None,
        train: Train { ranks: 8, per_node: 4, pp: 2, tp: 4, ep: 1, expert_copies: 0 },
        infer: Infer { ranks: 4, per_node: 2, tp: 2, dp: 2 },
        scale: 8,
    }
}

fn qwen3_235b() -> Case {
    Case {
        model: Model::Qwen3_235b,
        config: QWEN3_235B,
        // 94 x (2 norms + q, k, v, o + q_norm, k_norm + router + 128 x 3) + 3
        tensors: 36_945,
        expert_tensors: 94 * 128 * 3,
        params: 235e9,
        params_tol: 0.01,
        active_params: Some(22e9),
        // PP4 x (TP2 x CP2 x DP8), EP16 within a stage.
        train: Train { ranks: 128, per_node: 8, pp: 4, tp: 2, ep: 16, expert_copies: 2 },
        infer: Infer { ranks: 64, per_node: 8, tp: 8, dp: 8 },
        scale: 64,
    }
}

fn deepseek_v3() -> Case {
    Case {
        model: Model::DeepseekV3,
        config: DEEPSEEK_V3,
        // 3 dense layers x 12 + 58 MoE layers x (9 attention + router, bias, 3 shared + 256 x 3) + 3
        tensors: 45_395,
        expert_tensors: 58 * 256 * 3,
        params: 671e9,
        params_tol: 0.01,
        active_params: Some(37e9),
        // PP4 x EP16 x DP4, TP1.
        train: Train { ranks: 256, per_node: 8, pp: 4, tp: 1, ep: 16, expert_copies: 4 },
        infer: Infer { ranks: 128, per_node: 8, tp: 8, dp: 16 },
        scale: 64,
    }
}

/// The checkpoint's tensors, Hugging Face names, in order.
fn hf_tensors(c: &Config) -> Vec<(String, Vec<u64>)> {
    let h = c.hidden;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab, h])];
    for l in 0..c.layers {
        let mut add = |n: &str, shape: Vec<u64>| out.push((format!("model.layers.{l}.{n}"), shape));
        add("input_layernorm.weight", vec![h]);
        match c.attn {
            Attn::Gqa { heads, kv_heads, head_dim, qk_norm } => {
                add("self_attn.q_proj.weight", vec![heads * head_dim, h]);
                add("self_attn.k_proj.weight", vec![kv_heads * head_dim, h]);
                add("self_attn.v_proj.weight", vec![kv_heads * head_dim, h]);
                add("self_attn.o_proj.weight", vec![h, heads * head_dim]);
                if qk_norm {
                    add("self_attn.q_norm.weight", vec![head_dim]);
                    add("self_attn.k_norm.weight", vec![head_dim]);
                }
            }
            Attn::Mla { heads, q_lora, kv_lora, nope, rope, v } => {
                add("self_attn.q_a_proj.weight", vec![q_lora, h]);
                add("self_attn.q_a_layernorm.weight", vec![q_lora]);
                add("self_attn.q_b_proj.weight", vec![heads * (nope + rope), q_lora]);
                add("self_attn.kv_a_proj_with_mqa.weight", vec![kv_lora + rope, h]);
                add("self_attn.kv_a_layernorm.weight", vec![kv_lora]);
                add("self_attn.kv_b_proj.weight", vec![heads * (nope + v), kv_lora]);
                add("self_attn.o_proj.weight", vec![h, heads * v]);
            }
        }
        add("post_attention_layernorm.weight", vec![h]);
        let mut mlp = |prefix: &str, inter: u64| {
            add(&format!("{prefix}gate_proj.weight"), vec![inter, h]);
            add(&format!("{prefix}up_proj.weight"), vec![inter, h]);
            add(&format!("{prefix}down_proj.weight"), vec![h, inter]);
        };
        if l < c.dense_layers {
            mlp("mlp.", c.intermediate);
        } else {
            if c.shared_experts > 0 {
                mlp("mlp.shared_experts.", c.moe_intermediate * c.shared_experts);
            }
            for e in 0..c.experts {
                mlp(&format!("mlp.experts.{e}."), c.moe_intermediate);
            }
            add("mlp.gate.weight", vec![c.experts, h]);
            if c.router_bias {
                add("mlp.gate.e_score_correction_bias", vec![c.experts]);
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    out.push(("lm_head.weight".to_string(), vec![c.vocab, h]));
    out
}

/// Tensor-parallel split dim of a weight (Megatron / vLLM convention):
/// column-parallel (vocab-parallel embedding and head, q/k/v, MLA up-projections,
/// gate/up) split dim 0, row-parallel (o, down) dim 1; the rest is replicated.
fn tp_split(name: &str) -> Option<usize> {
    let leaf = name.strip_suffix(".weight").unwrap_or(name);
    match leaf.rsplit('.').next().unwrap_or(leaf) {
        "embed_tokens" | "lm_head" | "q_proj" | "k_proj" | "v_proj" | "q_b_proj" | "kv_b_proj" | "gate_proj" | "up_proj" => Some(0),
        "o_proj" | "down_proj" => Some(1),
        _ => None,
    }
}

fn is_expert(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

fn layer_of(name: &str) -> Option<u32> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn within(what: &str, got: f64, want: f64, tol: f64) {
    let err = (got - want).abs() / want;
    assert!(err <= tol, "{what}: {got:.4e}, published {want:.4e} ({:.2}% off, tolerance {:.2}%)", err * 100.0, tol * 100.0);
}

/// Name -> shape of a layout, checking dtype and uniqueness on the way.
fn shapes(layout: &Layout) -> BTreeMap<&str, &[u64]> {
    let mut out = BTreeMap::new();
    for t in layout.tensors() {
        assert_eq!(t.dtype, DType::BF16, "{}", t.name);
        assert!(out.insert(t.name.as_str(), t.shape.as_slice()).is_none(), "duplicate {}", t.name);
    }
    out
}

/// Into how many blocks TP `tp` splits tensor `name`: `tp`, except a KV
/// projection with fewer KV heads than `tp`, which is split by heads (each
/// whole head replicated over `tp / kv_heads` ranks, as vLLM does).
fn tp_parts(c: &Config, name: &str, tp: u32) -> u32 {
    match c.attn {
        Attn::Gqa { kv_heads, .. } if (name.ends_with(".k_proj.weight") || name.ends_with(".v_proj.weight")) && kv_heads < tp as u64 => {
            kv_heads as u32
        }
        _ => tp,
    }
}

/// Checks that the holdings of one tensor split it `tp` ways along its
/// TP dim (or not at all), that every rank of `group` holds exactly one
/// block, and that every node holding part of it holds all of it (TP
/// groups inside a node).
fn check_split(layout: &Layout, name: &str, shape: &[u64], hs: &[Holding], tp: u32, group: &BTreeSet<u32>, side: &str) {
    let split = if tp > 1 { tp_split(name) } else { None };
    match split {
        Some(d) => {
            assert_eq!(hs.len(), tp as usize, "{side} {name}: {} blocks, want TP{tp} along dim {d}", hs.len());
            assert_eq!(shape[d] % tp as u64, 0, "{side} {name}: dim {d} of {shape:?} does not split evenly {tp} ways");
            let mut offsets = BTreeSet::new();
            for h in hs {
                for (i, (&e, &s)) in h.block.extent().iter().zip(shape).enumerate() {
                    let want = if i == d { s / tp as u64 } else { s };
                    assert_eq!(e, want, "{side} {name}: block {:?}+{:?}, want TP{tp} along dim {d}", h.block.offset(), h.block.extent());
                }
                offsets.insert(h.block.offset()[d]);
            }
            assert_eq!(offsets.len(), tp as usize, "{side} {name}: repeated blocks");
        }
        None => {
            assert_eq!(hs.len(), 1, "{side} {name}: split into {} blocks, want it replicated", hs.len());
            assert_eq!(hs[0].block.extent(), shape, "{side} {name}: not whole");
        }
    }
    let replicas = hs[0].holders.len();
    let mut held = BTreeSet::new();
    let mut blocks_per_node: HashMap<u32, BTreeSet<usize>> = HashMap::new();
    for (b, h) in hs.iter().enumerate() {
        assert_eq!(h.holders.len(), replicas, "{side} {name}: uneven replication");
        for loc in &h.holders {
            assert!(held.insert(loc.rank), "{side} {name}: rank {} holds two blocks", loc.rank);
            blocks_per_node.entry(layout.node_of(loc.rank)).or_default().insert(b);
        }
    }
    assert_eq!(&held, group, "{side} {name}: held by the wrong ranks");
    for (node, blocks) in blocks_per_node {
        assert_eq!(
            blocks.len(),
            hs.len(),
            "{side} {name}: node {node} holds {} of {} blocks (TP group across nodes)",
            blocks.len(),
            hs.len()
        );
    }
}

fn check_train(case: &Case, layout: &Layout) {
    let t = &case.train;
    let c = &case.config;
    assert_eq!((layout.ranks(), layout.ranks_per_node()), (t.ranks, t.per_node), "training ranks, ranks per node");
    let per_stage = t.ranks / t.pp;
    let stage_ranks = |s: u32| (s * per_stage..(s + 1) * per_stage).collect::<BTreeSet<u32>>();
    let mut layer_stage: BTreeMap<u32, u32> = BTreeMap::new();
    // (layer, rank) -> routed-expert tensors held.
    let mut expert_load: HashMap<(u32, u32), usize> = HashMap::new();
    let mut checked = Checked::new();
    for (i, tensor) in layout.tensors().iter().enumerate() {
        let name = tensor.name.as_str();
        let hs = layout.holdings(i as u32);
        assert!(!hs.is_empty(), "training {name}: held nowhere");
        let stage = hs[0].holders[0].rank / per_stage;
        for loc in hs.iter().flat_map(|h| &h.holders) {
            assert_eq!(loc.rank / per_stage, stage, "training {name}: spans pipeline stages");
        }
        match layer_of(name) {
            Some(l) => assert_eq!(*layer_stage.entry(l).or_insert(stage), stage, "training: layer {l} spans pipeline stages ({name})"),
            None if name == "model.embed_tokens.weight" => assert_eq!(stage, 0, "training: embedding not on the first stage"),
            None => assert_eq!(stage, t.pp - 1, "training: {name} not on the last stage"),
        }
        if is_expert(name) {
            assert_eq!(hs.len(), 1, "training {name}: expert split (want expert TP 1)");
            assert_eq!(hs[0].block.extent(), tensor.shape.as_slice(), "training {name}: not whole");
            assert_eq!(hs[0].holders.len(), t.expert_copies, "training {name}: expert copies");
            let l = layer_of(name).unwrap();
            for loc in &hs[0].holders {
                *expert_load.entry((l, loc.rank)).or_default() += 1;
            }
        } else if checked.insert((tp_split(name), &tensor.shape, without_storage(&tensor.placement))) {
            check_split(layout, name, &tensor.shape, &hs, tp_parts(c, name, t.tp), &stage_ranks(stage), "training");
        }
    }
    // Pipeline: contiguous, balanced stages in layer order.
    let mut sizes = vec![0u32; t.pp as usize];
    let mut last = 0;
    for (&l, &s) in &layer_stage {
        assert!(s >= last, "training: layer {l} on stage {s} after a layer on stage {last}");
        last = s;
        sizes[s as usize] += 1;
    }
    assert_eq!(layer_stage.len() as u32, c.layers);
    let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
    assert!(max - min <= 1, "training: unbalanced pipeline stages {sizes:?}");
    // Expert parallelism: every rank of a stage holds experts/EP experts of each MoE layer.
    for l in c.dense_layers..c.layers {
        let want = 3 * c.experts as usize / t.ep as usize;
        for r in stage_ranks(layer_stage[&l]) {
            let got = expert_load.get(&(l, r)).copied().unwrap_or(0);
            assert_eq!(got, want, "training: rank {r} holds {got} expert tensors of layer {l}, want 3 x {} / EP{}", c.experts, t.ep);
        }
    }
}

fn check_infer(case: &Case, layout: &Layout) {
    let t = &case.infer;
    assert_eq!((layout.ranks(), layout.ranks_per_node()), (t.ranks, t.per_node), "inference ranks, ranks per node");
    assert_eq!(t.tp * t.dp, t.ranks);
    let all: BTreeSet<u32> = (0..t.ranks).collect();
    let mut checked = Checked::new();
    for (i, tensor) in layout.tensors().iter().enumerate() {
        if !checked.insert((tp_split(&tensor.name), &tensor.shape, without_storage(&tensor.placement))) {
            continue;
        }
        let hs = layout.holdings(i as u32);
        let parts = tp_parts(&case.config, &tensor.name, t.tp);
        check_split(layout, &tensor.name, &tensor.shape, &hs, parts, &all, "inference");
        let copies = hs.len() * hs[0].holders.len();
        assert_eq!(copies as u32, t.ranks, "inference {}", tensor.name);
        if tp_split(&tensor.name).is_some() {
            assert_eq!(hs[0].holders.len() as u32, t.dp * (t.tp / parts), "inference {}: DP (and KV-head) replicas", tensor.name);
        }
    }
}

/// Every dim of `small` is the matching dim of `full` divided by `k`,
/// except those counting experts (router rows, router bias).
fn check_scaled(name: &str, full: &[u64], small: &[u64], k: u64, experts: u64) {
    assert_eq!(full.len(), small.len(), "{name}: rank changed with scale");
    let router = name.ends_with(".mlp.gate.weight") || name.ends_with(".e_score_correction_bias");
    for (i, (&f, &s)) in full.iter().zip(small).enumerate() {
        let want = if router && i == 0 { experts } else { f / k };
        assert_eq!(s, want, "{name}: dim {i} is {s} at scale {k}, {f} at scale 1");
    }
}

/// The fused buffers one side must have, by the frameworks' conventions:
/// (buffer name, member tensors in storage order). Training (Megatron):
/// `linear_qkv` = [q; k; v], `linear_fc1` = [gate; up] of the dense MLP, the
/// shared experts and each routed expert. Inference (vLLM): `qkv_proj`,
/// `gate_up_proj` (dense MLP or shared experts), MLA's `fused_qkv_a_proj` =
/// [q_a_proj; kv_a_proj_with_mqa], FusedMoE's `experts.w13_weight` =
/// [gate_0; up_0; gate_1; ...] and `experts.w2_weight` = [down_0; down_1; ...].
fn expected_fused(c: &Config, train: bool) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for l in 0..c.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}.weight");
        let mut add = |buffer: &str, members: Vec<String>| out.push((format!("layers.{l}.{buffer}"), members));
        match (c.attn, train) {
            (Attn::Gqa { .. }, true) => add("linear_qkv", vec![p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj")]),
            (Attn::Gqa { .. }, false) => add("qkv_proj", vec![p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj")]),
            (Attn::Mla { .. }, true) => {}
            (Attn::Mla { .. }, false) => add("fused_qkv_a_proj", vec![p("self_attn.q_a_proj"), p("self_attn.kv_a_proj_with_mqa")]),
        }
        let (dense, shared) =
            (if train { "linear_fc1" } else { "gate_up_proj" }, if train { "shared_experts.linear_fc1" } else { "gate_up_proj" });
        if l < c.dense_layers {
            add(dense, vec![p("mlp.gate_proj"), p("mlp.up_proj")]);
            continue;
        }
        if c.shared_experts > 0 {
            add(shared, vec![p("mlp.shared_experts.gate_proj"), p("mlp.shared_experts.up_proj")]);
        }
        let expert = |e: u64, proj: &str| p(&format!("mlp.experts.{e}.{proj}"));
        if train {
            for e in 0..c.experts {
                add(&format!("experts.{e}.linear_fc1"), vec![expert(e, "gate_proj"), expert(e, "up_proj")]);
            }
        } else if c.experts > 0 {
            add("experts.w13_weight", (0..c.experts).flat_map(|e| [expert(e, "gate_proj"), expert(e, "up_proj")]).collect());
            add("experts.w2_weight", (0..c.experts).map(|e| expert(e, "down_proj")).collect());
        }
    }
    out
}

/// Checks, per rank and through `Layout::holdings`, that the members of
/// every expected fused buffer lie back to back in it (each rank's local
/// block of a member right after its local block of the previous one), on
/// the same ranks, that the buffer is exactly that large, and that every
/// other tensor has buffers of its own.
fn check_fused(layout: &Layout, expected: &[(String, Vec<String>)], side: &str) {
    let mut buffer_ids: HashMap<&str, u32> = HashMap::new();
    for (i, b) in layout.buffer_names().iter().enumerate() {
        buffer_ids.insert(b.as_str(), i as u32);
    }
    let want: BTreeSet<&str> = expected.iter().map(|(b, _)| b.as_str()).collect();
    let got: BTreeSet<&str> = buffer_ids.keys().copied().collect();
    assert_eq!(got, want, "{side}: named buffers");
    let buffers = layout.buffers();
    let mut fused: HashSet<&str> = HashSet::new();
    for (buffer, members) in expected {
        let key = BufferKey::Named(buffer_ids[buffer.as_str()]);
        // rank -> next free element of the buffer.
        let mut next: BTreeMap<u32, u64> = BTreeMap::new();
        for (m, member) in members.iter().enumerate() {
            fused.insert(member);
            let ti = layout.tensor_index(member).unwrap_or_else(|| panic!("{side}: no tensor {member}"));
            let mut ranks = BTreeSet::new();
            for h in layout.holdings(ti) {
                for loc in &h.holders {
                    assert!(ranks.insert(loc.rank), "{side} {member}: rank {} holds two blocks", loc.rank);
                    assert_eq!(
                        loc.buffer,
                        key,
                        "{side} {member}: rank {} stores it in {}, not {buffer}",
                        loc.rank,
                        layout.buffer_name(loc.buffer)
                    );
                    let at = next.entry(loc.rank).or_insert(0);
                    assert!(m == 0 || *at > 0, "{side} {member}: rank {} holds it without the members before it in {buffer}", loc.rank);
                    assert_eq!(
                        loc.at, *at,
                        "{side} {member}: rank {}: at {} in {buffer}, want {} (right after the previous member)",
                        loc.rank, loc.at, *at
                    );
                    *at += h.block.numel();
                }
            }
            assert_eq!(ranks.len(), next.len(), "{side} {member}: not held by the same ranks as the rest of {buffer}");
        }
        for (&rank, &end) in &next {
            let spec = buffers[rank as usize].iter().find(|b| b.key == key).expect("fused buffer allocated");
            assert_eq!(spec.elems, end, "{side}: rank {rank}: buffer {buffer} is {} elements, its members {end}", spec.elems);
        }
    }
    for (i, t) in layout.tensors().iter().enumerate() {
        if fused.contains(t.name.as_str()) {
            continue;
        }
        for h in layout.holdings(i as u32) {
            for loc in &h.holders {
                assert!(matches!(loc.buffer, BufferKey::Own { .. }), "{side} {}: rank {} stores it in a shared buffer", t.name, loc.rank);
            }
        }
    }
}

/// A placement with every block in a buffer of its own.
fn without_storage(p: &Placement) -> Placement {
    let mut p = p.clone();
    match &mut p {
        Placement::Mesh(m) => m.storage = Storage::Own,
        Placement::Shards(shards) => shards.iter_mut().for_each(|s| s.storage = Storage::Own),
    }
    p
}

/// A placement with every offset in a named buffer set to 0.
fn without_at(p: &Placement) -> Placement {
    let mut p = p.clone();
    match &mut p {
        Placement::Mesh(m) => {
            if let Storage::InBuffer { at, .. } = &mut m.storage {
                *at = 0;
            }
        }
        Placement::Shards(shards) => {
            for s in shards {
                if let Storage::InBuffer { at, .. } = &mut s.storage {
                    *at = 0;
                }
            }
        }
    }
    p
}

fn check(case: &Case) {
    let c = &case.config;
    let (src, dst) = layouts(case.model, 1).expect("scale-1 layouts validate");

    // Names and shapes: both sides equal the checkpoint's tensor list.
    let want = hf_tensors(c);
    assert_eq!(want.len(), case.tensors, "checkpoint tensor count from the config");
    let want_map: BTreeMap<&str, &[u64]> = want.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    let (src_map, dst_map) = (shapes(&src), shapes(&dst));
    for (side, got) in [("training", &src_map), ("inference", &dst_map)] {
        assert_eq!(got.len(), case.tensors, "{side}: tensor count");
        for (name, shape) in &want_map {
            assert_eq!(got.get(name), Some(shape), "{side}: {name}");
        }
    }
    assert_eq!(src_map, dst_map, "training and inference tensors differ");

    // Counts.
    let experts = src.tensors().iter().filter(|t| is_expert(&t.name)).count();
    assert_eq!(experts, case.expert_tensors, "routed-expert weight tensors");
    let layers: BTreeSet<u32> = src.tensors().iter().filter_map(|t| layer_of(&t.name)).collect();
    assert_eq!(layers, (0..c.layers).collect(), "decoder layers");
    assert_eq!(src_map["model.embed_tokens.weight"], [c.vocab, c.hidden]);
    assert_eq!(src_map["lm_head.weight"], [c.vocab, c.hidden]);

    // Parameters, total and active per token.
    let total: u64 = src.tensors().iter().map(|t| numel(&t.shape)).sum();
    within("total parameters", total as f64, case.params, case.params_tol);
    if let Some(active) = case.active_params {
        let routed: u64 = src.tensors().iter().filter(|t| is_expert(&t.name)).map(|t| numel(&t.shape)).sum();
        let active_got = (total - routed) as f64 + routed as f64 * c.active_experts as f64 / c.experts as f64;
        within("active parameters", active_got, active, 0.03);
    }

    check_train(case, &src);
    check_infer(case, &dst);
    check_fused(&src, &expected_fused(c, true), "training");
    check_fused(&dst, &expected_fused(c, false), "inference");

    // Scale K: same names, order, placements and rank counts; hidden sizes / K.
    let (ssrc, sdst) = layouts(case.model, case.scale).expect("scaled layouts validate");
    for (side, full, small) in [("training", &src, &ssrc), ("inference", &dst, &sdst)] {
        assert_eq!((small.ranks(), small.ranks_per_node()), (full.ranks(), full.ranks_per_node()), "{side}: ranks at scale {}", case.scale);
        assert_eq!(small.tensors().len(), full.tensors().len(), "{side}: tensor count at scale {}", case.scale);
        for (f, s) in full.tensors().iter().zip(small.tensors()) {
            assert_eq!(s.name, f.name, "{side}: tensor order at scale {}", case.scale);
            assert_eq!(s.dtype, f.dtype, "{side} {}", f.name);
            // Offsets in fused buffers scale with the sizes; the rest must not change.
            assert_eq!(without_at(&s.placement), without_at(&f.placement), "{side} {}: placement changed at scale {}", f.name, case.scale);
            check_scaled(&f.name, &f.shape, &s.shape, case.scale, c.experts);
        }
    }
    assert_eq!(shapes(&ssrc), shapes(&sdst), "scaled training and inference tensors differ");
}

#[test]
fn llama3_8b_matches_the_real_model() {
    check(&llama3_8b());
}

#[test]
fn slow_qwen3_235b_matches_the_real_model() {
    check(&qwen3_235b());
}

#[test]
fn slow_deepseek_v3_matches_the_real_model() {
    check(&deepseek_v3());
}

#[test]
fn scale_zero_means_full_size() {
    assert_eq!(layouts(Model::Llama3_8b, 0).unwrap(), layouts(Model::Llama3_8b, 1).unwrap());
}

#[test]
fn the_expectations_add_up() {
    // The config tables reproduce the published sizes by themselves.
    for case in [llama3_8b(), qwen3_235b(), deepseek_v3()] {
        let want = hf_tensors(&case.config);
        assert_eq!(want.len(), case.tensors);
        let total: u64 = want.iter().map(|(_, s)| numel(s)).sum();
        within("config parameters", total as f64, case.params, case.params_tol);
        assert_eq!(want.iter().filter(|(n, _)| is_expert(n)).count(), case.expert_tensors);
    }
}

/// vLLM's QKVParallelLinear never splits a KV head: with more TP ranks than
/// KV heads it gives each rank one whole head, replicated over
/// `tp / kv_heads` ranks. Qwen3-235B has 4 KV heads of 128 and runs at TP8.
#[test]
fn qwen3_235b_inference_keeps_kv_heads_whole() {
    let Attn::Gqa { kv_heads, head_dim, .. } = QWEN3_235B.attn else { unreachable!() };
    let (_, dst) = layouts(Model::Qwen3_235b, 1).unwrap();
    for proj in ["k_proj", "v_proj"] {
        let name = format!("model.layers.0.self_attn.{proj}.weight");
        let hs = dst.holdings(dst.tensor_index(&name).unwrap());
        for h in &hs {
            assert_eq!(
                h.block.extent()[0] % head_dim,
                0,
                "{name}: a rank holds rows {:?}+{:?}, not whole heads",
                h.block.offset(),
                h.block.extent()
            );
        }
        assert_eq!(hs.len() as u64, kv_heads, "{name}: one distinct block per KV head");
        // Head h on the TP ranks 2h and 2h + 1 of every DP replica.
        let (tp, dp) = (8u32, 8u32);
        for h in &hs {
            let head = h.block.offset()[0] / head_dim;
            let ranks: Vec<u32> = h.holders.iter().map(|l| l.rank).collect();
            let want: Vec<u32> = (0..dp)
                .flat_map(|d| (0..tp).filter(move |t| (t / (tp / kv_heads as u32)) as u64 == head).map(move |t| d * tp + t))
                .collect();
            assert_eq!(ranks, want, "{name}: holders of KV head {head}");
        }
    }
}

// ---------------------------------------------------------------------------
// DeepSeek-V3 inference with expert parallelism.

/// The EP degrees the DeepSeek-V3 inference side takes: multiples of 8 (a
/// node's TP8 group) dividing its 128 ranks.
const DEEPSEEK_EP: [u32; 5] = [8, 16, 32, 64, 128];

fn deepseek_ep(scale: u64, ep: u32) -> (Layout, Layout) {
    layouts_with(Model::DeepseekV3, scale, PresetOptions { ep: Some(ep), setup: None })
        .unwrap_or_else(|e| panic!("EP{ep} at scale {scale}: {e}"))
}

/// Expert index of a routed-expert tensor name.
fn expert_of(name: &str) -> Option<u32> {
    name.split(".mlp.experts.").nth(1)?.split('.').next()?.parse().ok()
}

/// The DeepSeek-V3 config with every hidden size divided by `k` (the
/// expert count stays).
fn deepseek_scaled(k: u64) -> Config {
    let Attn::Mla { heads, q_lora, kv_lora, nope, rope, v } = DEEPSEEK_V3.attn else { unreachable!() };
    Config {
        hidden: DEEPSEEK_V3.hidden / k,
        intermediate: DEEPSEEK_V3.intermediate / k,
        vocab: DEEPSEEK_V3.vocab / k,
        moe_intermediate: DEEPSEEK_V3.moe_intermediate / k,
        attn: Attn::Mla { heads, q_lora: q_lora / k, kv_lora: kv_lora / k, nope: nope / k, rope: rope / k, v: v / k },
        ..DEEPSEEK_V3
    }
}

/// Closed forms from the config, in elements: (what one inference rank
/// holds, what one inference node holds) under EP `ep`. Every node is a
/// TP8 group holding the non-expert weights once (a rank 1/8 of each
/// TP-split one and all of each replicated one) plus its 8 ranks' experts:
/// 256 / ep whole experts per rank and MoE layer.
fn deepseek_ep_expected(c: &Config, ep: u32) -> (u64, u64) {
    let (tp, per_node) = (8u64, 8u64);
    let mut rank = 0;
    let mut node = 0;
    for (name, shape) in hf_tensors(c) {
        if is_expert(&name) {
            continue;
        }
        rank += numel(&shape) / if tp_split(&name).is_some() { tp } else { 1 };
        node += numel(&shape);
    }
    let moe_layers = (c.layers - c.dense_layers) as u64;
    let expert = 3 * c.moe_intermediate * c.hidden;
    let per_rank = c.experts / ep as u64;
    (rank + moe_layers * per_rank * expert, node + moe_layers * per_node * per_rank * expert)
}

/// Checks an EP inference layout against the default TP8 x DP16 one
/// (`tp8`, itself checked by `deepseek_v3_matches_the_real_model`) and the
/// EP rules; returns (elements per rank, distinct elements per node) read
/// back through `Layout::holdings`.
fn check_infer_ep(dst: &Layout, tp8: &Layout, ep: u32) -> (Vec<u64>, Vec<u64>) {
    let (ranks, experts) = (128u32, DEEPSEEK_V3.experts as u32);
    let (per_rank, groups) = (experts / ep, ranks / ep);
    assert_eq!((dst.ranks(), dst.ranks_per_node()), (128, 8), "EP{ep}: inference ranks, ranks per node");
    assert_eq!(dst.tensors().len(), tp8.tensors().len(), "EP{ep}: tensor count");
    let mut rank_elems = vec![0u64; ranks as usize];
    // node -> distinct (tensor, block offset) it holds, with their sizes.
    let mut node_blocks: Vec<HashMap<(u32, Vec<u64>), u64>> = vec![HashMap::new(); (ranks / 8) as usize];
    // (layer, rank) -> expert tensors held.
    let mut expert_load: HashMap<(u32, u32), u32> = HashMap::new();
    let mut fused_members = 0usize;
    for (i, (t, d)) in dst.tensors().iter().zip(tp8.tensors()).enumerate() {
        assert_eq!((&t.name, t.dtype, &t.shape), (&d.name, d.dtype, &d.shape), "EP{ep}: tensor {i}");
        let hs = dst.holdings(i as u32);
        match expert_of(&t.name) {
            None => assert_eq!(t.placement, d.placement, "EP{ep} {}: a non-expert weight placed unlike TP8 x DP16", t.name),
            Some(e) => {
                // Whole, one copy per EP group, on EP rank e / (experts / ep).
                assert_eq!(hs.len(), 1, "EP{ep} {}: split into {} blocks, want it whole", t.name, hs.len());
                assert_eq!(hs[0].block.extent(), t.shape.as_slice(), "EP{ep} {}: not whole", t.name);
                let got: Vec<u32> = hs[0].holders.iter().map(|l| l.rank).collect();
                let want: Vec<u32> = (0..groups).map(|g| g * ep + e / per_rank).collect();
                assert_eq!(got, want, "EP{ep} {}: holders", t.name);
                let l = layer_of(&t.name).unwrap();
                for &r in &got {
                    *expert_load.entry((l, r)).or_default() += 1;
                }
                fused_members += 1;
            }
        }
        for h in &hs {
            for loc in &h.holders {
                rank_elems[loc.rank as usize] += h.block.numel();
                node_blocks[dst.node_of(loc.rank) as usize].insert((i as u32, h.block.offset().to_vec()), h.block.numel());
            }
        }
    }
    assert_eq!(fused_members, 58 * 256 * 3, "EP{ep}: routed-expert tensors");
    for l in DEEPSEEK_V3.dense_layers..DEEPSEEK_V3.layers {
        for r in 0..ranks {
            let got = expert_load.get(&(l, r)).copied().unwrap_or(0);
            assert_eq!(got, 3 * per_rank, "EP{ep}: rank {r} holds {got} expert tensors of layer {l}, want 3 x 256 / EP");
        }
    }
    let node_elems = node_blocks.iter().map(|m| m.values().sum()).collect();
    (rank_elems, node_elems)
}

/// FusedMoE with expert parallelism: on every rank, `layers.{l}.experts.w13_weight`
/// = [gate_e; up_e] and `w2_weight` = [down_e] for its local experts e only,
/// in expert order, from offset 0, the buffer exactly that large; the other
/// fused buffers as in TP8 x DP16 (same placements, checked there).
fn check_fused_ep(dst: &Layout, ep: u32) {
    let per_rank = 256 / ep;
    let key = |name: &str| BufferKey::Named(dst.buffer_names().iter().position(|b| b == name).expect("buffer") as u32);
    let buffers = dst.buffers();
    for l in DEEPSEEK_V3.dense_layers..DEEPSEEK_V3.layers {
        let (w13, w2) = (key(&format!("layers.{l}.experts.w13_weight")), key(&format!("layers.{l}.experts.w2_weight")));
        // rank -> next free element of w13, w2.
        let mut next: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for e in 0..256u32 {
            for proj in ["gate_proj", "up_proj", "down_proj"] {
                let name = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
                let hs = dst.holdings(dst.tensor_index(&name).expect("expert tensor"));
                for loc in &hs[0].holders {
                    let k = loc.rank % ep;
                    assert_eq!(k, e / per_rank, "{name}: on EP rank {k}");
                    let at = next.entry(loc.rank).or_insert((0, 0));
                    let (buffer, at) = if proj == "down_proj" { (w2, &mut at.1) } else { (w13, &mut at.0) };
                    assert_eq!(loc.buffer, buffer, "{name}: rank {} stores it in {}", loc.rank, dst.buffer_name(loc.buffer));
                    assert_eq!(loc.at, *at, "{name}: rank {}: at {}, want {} (its local experts back to back)", loc.rank, loc.at, *at);
                    *at += hs[0].block.numel();
                }
            }
        }
        assert_eq!(next.len(), 128, "layer {l}: every rank holds experts");
        let expert = 3 * DEEPSEEK_V3.moe_intermediate * DEEPSEEK_V3.hidden;
        for (&rank, &(end13, end2)) in &next {
            assert_eq!((end13, end2), (per_rank as u64 * expert * 2 / 3, per_rank as u64 * expert / 3), "layer {l} rank {rank}");
            for (b, end) in [(w13, end13), (w2, end2)] {
                let spec = buffers[rank as usize].iter().find(|s| s.key == b).expect("allocated");
                assert_eq!(spec.elems, end, "rank {rank}: {} is {} elements, its experts {end}", spec.name, spec.elems);
            }
        }
    }
}

/// The EP layouts at full size: training unchanged, the inference side as
/// deployed, every rank and node holding exactly what the closed forms say,
/// each node far less than the whole model once EP spans several nodes.
#[test]
fn slow_deepseek_v3_expert_parallel_inference() {
    let (src0, tp8) = layouts(Model::DeepseekV3, 1).unwrap();
    let whole: u64 = hf_tensors(&DEEPSEEK_V3).iter().map(|(_, s)| numel(s)).sum();
    let routed: u64 = hf_tensors(&DEEPSEEK_V3).iter().filter(|(n, _)| is_expert(n)).map(|(_, s)| numel(s)).sum();
    for ep in DEEPSEEK_EP {
        let (src, dst) = deepseek_ep(1, ep);
        assert!(src == src0, "EP{ep}: the training side changed");
        let (rank_elems, node_elems) = check_infer_ep(&dst, &tp8, ep);
        check_fused_ep(&dst, ep);
        let (want_rank, want_node) = deepseek_ep_expected(&DEEPSEEK_V3, ep);
        for (r, &got) in rank_elems.iter().enumerate() {
            assert_eq!(got, want_rank, "EP{ep}: rank {r} holds {got} elements, want {want_rank}");
        }
        for (n, &got) in node_elems.iter().enumerate() {
            assert_eq!(got, want_node, "EP{ep}: node {n} holds {got} distinct elements, want {want_node}");
        }
        // A node holds the non-expert weights and 8 / EP of the routed experts.
        assert_eq!(want_node, whole - routed + routed * 8 / ep as u64, "EP{ep}: node share");
        if ep > 8 {
            assert!(want_node * 10 < whole * 6, "EP{ep}: a node holds {want_node} of {whole} elements");
        }
    }
    // EP128: about 1/12 of the model per node (2 x 56.4 B of 671 B parameters).
    let (_, node) = deepseek_ep_expected(&DEEPSEEK_V3, 128);
    assert!(node * 11 < whole, "EP128: a node holds {node} of {whole} elements");
}

/// The default layouts are the ones without options.
#[test]
fn slow_default_options_are_the_plain_presets() {
    for model in [Model::Llama3_8b, Model::Qwen3_235b, Model::DeepseekV3] {
        let plain = layouts(model, 64).unwrap();
        assert!(layouts_with(model, 64, PresetOptions::default()).unwrap() == plain, "{model:?}");
    }
}

/// The tensors of `layout` that `keep` selects, with their placements
/// (fused buffers stay whole when whole layers are kept).
fn slice(layout: &Layout, keep: impl Fn(&str) -> bool) -> Layout {
    let tensors = layout.tensors().iter().filter(|t| keep(&t.name)).cloned().collect();
    Layout::new(layout.ranks(), Some(layout.ranks_per_node()), tensors).expect("a slice of a valid layout is valid")
}

/// Planned at scale 64 (which divides every hidden size), the reshard
/// brings every EP node exactly what it holds (once per node, fanned out
/// inside it) and no more.
#[test]
fn deepseek_v3_expert_parallel_plans_node_ingress() {
    let k = 64;
    let c = deepseek_scaled(k);
    for ep in [16, 128] {
        let (src, dst) = deepseek_ep(k, ep);
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap_or_else(|e| panic!("EP{ep}: {e}"));
        let (_, want_node) = deepseek_ep_expected(&c, ep);
        let f = plan.figures();
        assert_eq!(f.dst_node_ingress_bytes.len(), 16, "EP{ep}: destination nodes");
        for (n, &b) in f.dst_node_ingress_bytes.iter().enumerate() {
            assert_eq!(b, 2 * want_node, "EP{ep}: node {n} takes in {b} bytes, want {} (what it holds, bf16)", 2 * want_node);
        }
    }
}

/// A refit with EP32 (both strategies) and EP128 (the reshard) runs on the
/// in-process data plane and every destination element verifies bit-exact. On a slice
/// of the model at scale 512 — the embedding, layer 0 (dense), the first
/// MoE layer of each training stage (3, 16, 31, 46), the final norm and the
/// head, with the preset's placements and fused buffers — to keep the debug
/// build's per-rank pattern fill (ranks x tensors) short; every stage, EP
/// rank and kind of buffer is in it.
#[test]
fn slow_deepseek_v3_expert_parallel_refit_verifies() {
    let keep = |name: &str| !name.starts_with("model.layers.") || matches!(layer_of(name), Some(0 | 3 | 16 | 31 | 46));
    for ep in [32, 128] {
        let (src, dst) = deepseek_ep(512, ep);
        let (src, dst) = (slice(&src, keep), slice(&dst, keep));
        assert_eq!(dst.tensors().iter().filter(|t| is_expert(&t.name)).count(), 4 * 256 * 3, "EP{ep}: the slice's experts");
        let held: u64 =
            (0..dst.tensors().len() as u32).flat_map(|i| dst.holdings(i)).map(|h| h.block.numel() * h.holders.len() as u64).sum();
        // The baseline once: it is the slower one to run in a debug build.
        let strategies: &[Strategy] = if ep == 32 { &[Strategy::Reshard, Strategy::Baseline] } else { &[Strategy::Reshard] };
        for &strategy in strategies {
            let config = DriverConfig { strategy, options: PlanOptions::default(), ..DriverConfig::default() };
            let mut p = Driver::start(&src, &dst, config, |_| {}).unwrap_or_else(|e| panic!("EP{ep} {strategy}: {e}"));
            p.refit(None).unwrap_or_else(|e| panic!("EP{ep} {strategy}: refit: {e}"));
            let checked = p.verify(None).unwrap_or_else(|e| panic!("EP{ep} {strategy}: verify: {e}"));
            assert_eq!(checked, held, "EP{ep} {strategy}: every destination element checked");
        }
    }
}

/// Bad EP degrees and models without an EP layout are errors that say why,
/// from the library and from every command that takes `--ep`.
#[test]
fn bad_expert_parallelism_is_rejected() {
    for ep in [0, 1, 4, 12, 24, 48, 96, 256, 1024, u32::MAX] {
        let e = layouts_with(Model::DeepseekV3, 512, PresetOptions { ep: Some(ep), setup: None }).expect_err("bad EP accepted");
        assert_eq!(e, PresetError::EpDegree { ep });
        assert!(e.to_string().contains("multiple of 8 that divides 128"), "{e}");
    }
    for model in [Model::Llama3_8b, Model::Qwen3_235b] {
        let e = layouts_with(model, 512, PresetOptions { ep: Some(8), setup: None }).expect_err("EP accepted");
        assert_eq!(e, PresetError::EpUnsupported { model });
        assert!(e.to_string().contains(model.name()) && e.to_string().contains("only deepseek-v3"), "{e}");
    }
    let bin = env!("CARGO_BIN_EXE_refit");
    let out_dir = std::env::temp_dir().join(format!("refit-presets-ep-{}", std::process::id()));
    let out = out_dir.to_str().expect("utf-8 temp dir");
    let cases: [(&[&str], &str); 6] = [
        (&["plan", "--model", "deepseek-v3", "--scale", "512", "--ep", "12"], "--ep 12: EP 12 does not fit"),
        (&["plan", "--model", "llama3-8b", "--ep", "8"], "--ep 8: the llama3-8b preset has no expert-parallel"),
        (&["plan-bench", "--model", "deepseek-v3", "--scale", "512", "--ep", "0"], "--ep 0: EP 0 does not fit"),
        (&["plan-bench", "--model", "qwen3-235b", "--scale", "512", "--ep", "16"], "the qwen3-235b preset has no expert-parallel"),
        (&["emit", "--model", "deepseek-v3", "--scale", "512", "--ep", "256", "--out", out], "--ep 256: EP 256 does not fit"),
        (&["bench", "--model", "deepseek-v3", "--scale", "512", "--ep", "48"], "--ep 48: EP 48 does not fit"),
    ];
    for (args, want) in cases {
        let o = std::process::Command::new(bin).args(args).output().expect("spawn refit");
        let err = String::from_utf8_lossy(&o.stderr);
        let what = format!("refit {}: exit {:?}, stderr {err:?}", args.join(" "), o.status.code());
        assert_eq!(o.status.code(), Some(2), "{what}");
        assert!(o.stdout.is_empty(), "{what}");
        assert!(err.starts_with("error: ") && err.lines().count() == 1 && err.contains(want), "{what}; want {want:?}");
    }
    assert!(!out_dir.exists(), "a rejected emit wrote {out}");
    // With layout files there is no preset to apply it to: a usage error.
    let o = std::process::Command::new(bin).args(["plan", "--src", "a.json", "--dst", "b.json", "--ep", "8"]).output().expect("spawn");
    assert_eq!(o.status.code(), Some(2), "--ep with files: {}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--ep"), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `refit plan --model deepseek-v3 --ep N` plans the EP layout: every
/// node takes in what an EP64 node holds, under half the model.
#[test]
fn plan_takes_ep() {
    let bin = env!("CARGO_BIN_EXE_refit");
    let args = ["plan", "--model", "deepseek-v3", "--scale", "64", "--ep", "64", "--json"];
    let o = std::process::Command::new(bin).args(args).output().expect("spawn refit");
    assert!(o.status.success(), "refit {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let ingress: Vec<u64> =
        v["reshard"]["dst_node_ingress_bytes"].as_array().expect("ingress").iter().map(|b| b.as_u64().expect("bytes")).collect();
    let c = deepseek_scaled(64);
    let whole: u64 = hf_tensors(&c).iter().map(|(_, s)| numel(s)).sum();
    let (_, node) = deepseek_ep_expected(&c, 64);
    assert_eq!(ingress, vec![2 * node; 16], "EP64: every node takes in what it holds");
    assert!(node * 2 < whole, "EP64: a node holds {node} of {whole} elements");
}

// ---------------------------------------------------------------------------
// Kimi-K2.

/// Kimi-K2's published `config.json`: DeepSeek-V3's architecture with 64
/// heads, one dense layer, 384 routed experts and a vocabulary of 163,840.
const KIMI_K2: Config = Config {
    dense_layers: 1,
    vocab: 163_840,
    attn: Attn::Mla { heads: 64, q_lora: 1536, kv_lora: 512, nope: 128, rope: 64, v: 128 },
    experts: 384,
    ..DEEPSEEK_V3
};

/// The ranks holding each block of tensor `t`, in rank order.
fn holder_ranks(layout: &Layout, t: u32) -> BTreeSet<u32> {
    layout.holdings(t).iter().flat_map(|h| h.holders.iter().map(|l| l.rank)).collect()
}

/// The preset is the published model (every checkpoint tensor, its shape;
/// about 1 T parameters, 32 B active), trained as miles' recipe places it
/// (TP8 x CP4 x PP8: 7 stages of 8 layers then 5; 12 whole experts per rank
/// of a stage's EP32) and served on 128 ranks in 8 instances of EP16 (24
/// whole experts per rank, one copy per instance).
#[test]
fn kimi_k2_matches_the_published_model_and_recipe() {
    let (src, dst) = layouts(Model::KimiK2, 1).expect("scale-1 layouts validate");
    assert_eq!((src.ranks(), src.ranks_per_node(), dst.ranks(), dst.ranks_per_node()), (256, 8, 128, 8));
    let want = hf_tensors(&KIMI_K2);
    // 1 dense layer x 12 + 60 MoE layers x (9 attention + router, bias, 3 shared + 384 x 3) + 3
    assert_eq!(want.len(), 12 + 60 * (9 + 2 + 3 + 384 * 3) + 3);
    let want_map: BTreeMap<&str, &[u64]> = want.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    assert!(shapes(&src) == want_map, "training: the checkpoint's tensors and shapes");
    assert!(shapes(&dst) == want_map, "inference: the checkpoint's tensors and shapes");
    let total: u64 = src.tensors().iter().map(|t| numel(&t.shape)).sum();
    assert!((1.0e12..1.05e12).contains(&(total as f64)), "total parameters {total}: the published model has 1 T");
    let routed: u64 = src.tensors().iter().filter(|t| is_expert(&t.name)).map(|t| numel(&t.shape)).sum();
    within("active parameters", (total - routed) as f64 + routed as f64 * 8.0 / 384.0, 32e9, 0.03);
    let stage_of = |l: u32| (l / 8).min(7);
    for (i, t) in src.tensors().iter().enumerate() {
        let (train, infer) = (holder_ranks(&src, i as u32), holder_ranks(&dst, i as u32));
        let stage = match layer_of(&t.name) {
            Some(l) => stage_of(l),
            None if t.name.starts_with("model.embed_tokens") => 0,
            None => 7,
        };
        match expert_of(&t.name) {
            Some(e) => {
                assert_eq!(train, BTreeSet::from([stage * 32 + e / 12]), "training {}", t.name);
                assert_eq!(infer, (0..8).map(|g| g * 16 + e / 24).collect(), "inference {}", t.name);
            }
            None => {
                assert_eq!(train, (stage * 32..stage * 32 + 32).collect(), "training {}: the stage's ranks", t.name);
                assert_eq!(infer, (0..128).collect(), "inference {}: every node", t.name);
            }
        }
    }
    // Stages: 8 layers each, the last 5.
    let per_stage: Vec<usize> = (0..8).map(|s| (0..61).filter(|&l| stage_of(l) == s).count()).collect();
    assert_eq!(per_stage, [8, 8, 8, 8, 8, 8, 8, 5]);
}

/// Refits of a slice of the model (the dense layer, the first MoE layer
/// and the last) through the orchestrator, reshard and baseline, verify.
#[test]
fn slow_kimi_k2_refit_verifies() {
    let (src, dst) = layouts(Model::KimiK2, 512).expect("layouts");
    let keep = |name: &str| !name.starts_with("model.layers.") || matches!(layer_of(name), Some(0 | 1 | 60));
    let (src, dst) = (slice(&src, keep), slice(&dst, keep));
    for strategy in [Strategy::Reshard, Strategy::Baseline] {
        let config = DriverConfig { strategy, ..DriverConfig::default() };
        let mut p = Driver::start(&src, &dst, config, |_| {}).unwrap_or_else(|e| panic!("{strategy}: {e}"));
        p.refit(None).unwrap_or_else(|e| panic!("{strategy}: refit: {e}"));
        let held: u64 =
            (0..dst.tensors().len() as u32).flat_map(|i| dst.holdings(i)).map(|h| h.block.numel() * h.holders.len() as u64).sum();
        assert_eq!(p.verify(None).unwrap_or_else(|e| panic!("{strategy}: verify: {e}")), held, "{strategy}: every element checked");
    }
}

// ---------------------------------------------------------------------------
// The anchors' setups.

fn setup_layouts(model: Model, setup: Setup, scale: u64) -> (Layout, Layout) {
    layouts_with(model, scale, PresetOptions { ep: None, setup: Some(setup) }).unwrap_or_else(|e| panic!("{model} {setup}: {e}"))
}

/// Checks tensor `t` of `layout` (of shape `shape`) against a tensor-parallel
/// split `tp` ways by its kind (`tp_split`; one whole block where `tp` is 1
/// or the kind is not split) over exactly the ranks `holders`, each block
/// on as many of them, and rank `r` holding the block at TP index `r % tp`
/// of a split tensor (ranks in row-major (replica, tp) order, as Megatron
/// and vLLM number them).
fn check_blocks(layout: &Layout, t: u32, shape: &[u64], tp: u32, holders: &BTreeSet<u32>, side: &str) {
    let name = &layout.tensors()[t as usize].name;
    let hs = layout.holdings(t);
    let split = if tp > 1 { tp_split(name) } else { None };
    let blocks = if split.is_some() { tp as usize } else { 1 };
    assert_eq!(hs.len(), blocks, "{side} {name}: {} blocks, want {blocks}", hs.len());
    assert_eq!(&holder_ranks(layout, t), holders, "{side} {name}: held by the wrong ranks");
    for h in &hs {
        assert_eq!(h.holders.len() * blocks, holders.len(), "{side} {name}: uneven replication");
        match split {
            Some(d) => {
                let part = shape[d] / tp as u64;
                assert_eq!(part * tp as u64, shape[d], "{side} {name}: dim {d} of {shape:?} does not split {tp} ways");
                for (i, (&e, &s)) in h.block.extent().iter().zip(shape).enumerate() {
                    assert_eq!(e, if i == d { part } else { s }, "{side} {name}: block extent {:?}", h.block.extent());
                }
                let index = h.block.offset()[d] / part;
                for loc in &h.holders {
                    assert_eq!(u64::from(loc.rank % tp), index, "{side} {name}: rank {} holds TP block {index} of {tp}", loc.rank);
                }
            }
            None => assert_eq!(h.block.extent(), shape, "{side} {name}: not whole"),
        }
    }
}

/// The training stage of tensor `name` given each stage's layer count:
/// the embedding on the first stage, the final norm and head on the last.
fn stage_by_sizes(name: &str, sizes: &[u32]) -> u32 {
    match layer_of(name) {
        Some(l) => {
            let mut end = 0;
            for (s, &n) in sizes.iter().enumerate() {
                end += n;
                if l < end {
                    return s as u32;
                }
            }
            panic!("layer {l} past the last stage")
        }
        None if name.starts_with("model.embed_tokens") => 0,
        None => sizes.len() as u32 - 1,
    }
}

/// Both layouts hold exactly the checkpoint's tensors, with its shapes.
fn check_checkpoint(src: &Layout, dst: &Layout, c: &Config) {
    let want = hf_tensors(c);
    let want: BTreeMap<&str, &[u64]> = want.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    assert!(shapes(src) == want, "training: the checkpoint's tensors and shapes");
    assert!(shapes(dst) == want, "inference: the checkpoint's tensors and shapes");
    for (a, b) in src.tensors().iter().zip(dst.tensors()) {
        assert_eq!(a.name, b.name, "both sides list the tensors in the same order");
    }
}

/// NeMo RL's DeepSeek-V3 recipe (grpo-deepseek-v3-32n8g.yaml, run
/// non-colocated): Megatron PP16 x EP16 on 256 ranks, TP1 (the default),
/// 3 layers in the first stage and 2 in the last (the 56 others 4 a stage),
/// DP16 within a stage replicating the dense weights, 16 whole experts per
/// rank of a stage, once -> vLLM TP32 x DP8 on 256 ranks: every weight,
/// experts included, split 32 ways by its kind over 4 nodes, 8 replicas.
#[test]
fn deepseek_v3_nemo_rl_matches_the_recipe() {
    let (src, dst) = setup_layouts(Model::DeepseekV3, Setup::NemoRl, 1);
    assert_eq!((src.ranks(), src.ranks_per_node(), dst.ranks(), dst.ranks_per_node()), (256, 8, 256, 8));
    check_checkpoint(&src, &dst, &DEEPSEEK_V3);
    let sizes: Vec<u32> = [3].into_iter().chain([4; 14]).chain([2]).collect();
    assert_eq!(sizes.iter().sum::<u32>(), DEEPSEEK_V3.layers);
    let everyone: BTreeSet<u32> = (0..256).collect();
    for (i, t) in src.tensors().iter().enumerate() {
        let stage = stage_by_sizes(&t.name, &sizes);
        let train = match expert_of(&t.name) {
            Some(e) => BTreeSet::from([stage * 16 + e / 16]),
            None => (stage * 16..stage * 16 + 16).collect(),
        };
        check_blocks(&src, i as u32, &t.shape, 1, &train, "training");
        check_blocks(&dst, i as u32, &t.shape, 32, &everyone, "inference");
    }
    check_fused(&src, &expected_fused(&DEEPSEEK_V3, true), "training");
    check_fused(&dst, &expected_fused(&DEEPSEEK_V3, false), "inference");
}

/// vLLM RDT's Kimi-K2 run (48 DGX H100 nodes): Megatron TP8 x PP8 x EP32,
/// ETP1 on 32 nodes (TP8 within a node, 4 replicas of the dense weights in
/// a stage of 32 ranks, 12 whole experts per rank) -> vLLM TP32 x EP32 on
/// 16 nodes: 4 instances of 32 ranks, the non-expert weights split 32 ways
/// within each, 12 whole experts per rank, one copy per instance. The
/// layer split over 8 stages is not published: miles' (8 a stage, the last
/// 5) is the assumption checked here.
#[test]
fn kimi_k2_vllm_rdt_matches_the_published_setup() {
    let (src, dst) = setup_layouts(Model::KimiK2, Setup::VllmRdt, 1);
    assert_eq!((src.ranks(), src.ranks_per_node(), dst.ranks(), dst.ranks_per_node()), (256, 8, 128, 8));
    check_checkpoint(&src, &dst, &KIMI_K2);
    let sizes = [8, 8, 8, 8, 8, 8, 8, 5];
    let everyone: BTreeSet<u32> = (0..128).collect();
    for (i, t) in src.tensors().iter().enumerate() {
        let stage = stage_by_sizes(&t.name, &sizes);
        match expert_of(&t.name) {
            Some(e) => {
                check_blocks(&src, i as u32, &t.shape, 1, &BTreeSet::from([stage * 32 + e / 12]), "training");
                check_blocks(&dst, i as u32, &t.shape, 1, &(0..4).map(|g| g * 32 + e / 12).collect(), "inference");
            }
            None => {
                check_blocks(&src, i as u32, &t.shape, 8, &(stage * 32..stage * 32 + 32).collect(), "training");
                check_blocks(&dst, i as u32, &t.shape, 32, &everyone, "inference");
            }
        }
    }
    check_fused(&src, &expected_fused(&KIMI_K2, true), "training");
    // The default Kimi-K2 training side is the same placement (CP4 there,
    // DP4 here: both replicate the dense weights over the same ranks).
    assert!(layouts(Model::KimiK2, 64).unwrap().0 == setup_layouts(Model::KimiK2, Setup::VllmRdt, 64).0);
}

/// vLLM RDT's Qwen3-235B-A22B run in SkyRL (4 DGX H100 nodes): Megatron
/// TP4 x PP2 x EP8, ETP1 on 2 nodes (a stage per node; 47 layers each,
/// assumed; TP4 groups, 2 replicas of the dense weights, 16 whole experts
/// per rank) -> vLLM DP16 x EP16 on 2 nodes: every non-expert weight whole
/// on every rank, 8 whole experts per rank.
#[test]
fn qwen3_235b_vllm_rdt_matches_the_published_setup() {
    let (src, dst) = setup_layouts(Model::Qwen3_235b, Setup::VllmRdt, 1);
    assert_eq!((src.ranks(), src.ranks_per_node(), dst.ranks(), dst.ranks_per_node()), (16, 8, 16, 8));
    check_checkpoint(&src, &dst, &QWEN3_235B);
    let everyone: BTreeSet<u32> = (0..16).collect();
    for (i, t) in src.tensors().iter().enumerate() {
        let stage = stage_by_sizes(&t.name, &[47, 47]);
        match expert_of(&t.name) {
            Some(e) => {
                check_blocks(&src, i as u32, &t.shape, 1, &BTreeSet::from([stage * 8 + e / 16]), "training");
                check_blocks(&dst, i as u32, &t.shape, 1, &BTreeSet::from([e / 8]), "inference");
            }
            None => {
                check_blocks(&src, i as u32, &t.shape, 4, &(stage * 8..stage * 8 + 8).collect(), "training");
                check_blocks(&dst, i as u32, &t.shape, 1, &everyone, "inference");
            }
        }
    }
    check_fused(&src, &expected_fused(&QWEN3_235B, true), "training");
}

/// Each preset takes exactly its own setups; a setup does not combine with
/// `ep`; names round-trip.
#[test]
fn setups_belong_to_their_presets() {
    for setup in Setup::ALL {
        assert_eq!(Setup::from_name(setup.name()), Some(setup));
        for model in [Model::Llama3_8b, Model::DeepseekV3, Model::Qwen3_235b, Model::KimiK2] {
            let got = layouts_with(model, 512, PresetOptions { ep: None, setup: Some(setup) });
            if model.setups().contains(&setup) {
                got.unwrap_or_else(|e| panic!("{model} {setup}: {e}"));
                let e = layouts_with(model, 512, PresetOptions { ep: Some(16), setup: Some(setup) }).expect_err("EP with a setup");
                assert_eq!(e, PresetError::SetupWithEp { model, setup });
            } else {
                let e = got.expect_err("a setup the preset lacks");
                assert_eq!(e, PresetError::SetupUnsupported { model, setup });
                let text = e.to_string();
                assert!(text.contains(model.name()) && text.contains(setup.name()) && text.contains(&model.setup_names()), "{text}");
            }
        }
    }
    assert_eq!(Setup::from_name("nemo"), None);
    assert_eq!(Model::Llama3_8b.setup_names(), "none");
}

/// Refits of a slice of each setup (the first layer, the first MoE layer
/// and the last) through the orchestrator, reshard and baseline, verify.
#[test]
fn slow_anchor_setups_refit_verifies() {
    for (model, setup, moe) in
        [(Model::DeepseekV3, Setup::NemoRl, 3), (Model::KimiK2, Setup::VllmRdt, 1), (Model::Qwen3_235b, Setup::VllmRdt, 0)]
    {
        let (src, dst) = setup_layouts(model, setup, 256);
        let keep = |name: &str| {
            !name.starts_with("model.layers.") || matches!(layer_of(name), Some(l) if l == 0 || l == moe || l == 60 || l == 93)
        };
        let (src, dst) = (slice(&src, keep), slice(&dst, keep));
        for strategy in [Strategy::Reshard, Strategy::Baseline] {
            let config = DriverConfig { strategy, ..DriverConfig::default() };
            let mut p = Driver::start(&src, &dst, config, |_| {}).unwrap_or_else(|e| panic!("{model} {setup} {strategy}: {e}"));
            p.refit(None).unwrap_or_else(|e| panic!("{model} {setup} {strategy}: refit: {e}"));
            let held: u64 =
                (0..dst.tensors().len() as u32).flat_map(|i| dst.holdings(i)).map(|h| h.block.numel() * h.holders.len() as u64).sum();
            assert_eq!(
                p.verify(None).unwrap_or_else(|e| panic!("{model} {setup} {strategy}: verify: {e}")),
                held,
                "{model} {setup} {strategy}"
            );
        }
    }
}
