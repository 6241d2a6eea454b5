//! Model-shaped layout pairs generated in code: real tensor names, counts
//! and parallel structure, hidden sizes divided by `scale` to fit in RAM.
//!
//! - `llama3-8b`: training TP4 x PP2 on 8 ranks (4 per node) -> inference
//!   TP2 x DP2 on 4 ranks (2 per node).
//! - `qwen3-235b`: training PP4 x (TP2 x CP2 x DP8) on 128 ranks (8 per
//!   node; dense weights TP2-sharded and replicated over CP x DP, experts
//!   EP16 within a stage, each on 2 ranks) -> inference TP8 x DP8 on 64 ranks.
//! - `deepseek-v3`: training PP4 x EP16 x DP4 on 256 ranks (8 per node;
//!   dense weights replicated over EP x DP within a stage, each expert on one
//!   EP rank, replicated over DP) -> inference TP8 x DP16 on 128 ranks
//!   (8 per node; every weight, experts included, TP-sharded), so every
//!   inference node is a full replica that takes in the whole model.
//! - `deepseek-v3` with inference expert parallelism ([`PresetOptions::ep`]
//!   = EP, a multiple of 8 dividing 128), as vLLM serves it with
//!   `--tensor-parallel-size 8 --data-parallel-size EP/8
//!   --enable-expert-parallel` (EP size = TP x DP; SGLang's DP-attention +
//!   EP-MoE places the experts the same way): the 128 inference ranks form
//!   128 / EP independent instances of one EP group each (ranks
//!   `g * EP .. (g + 1) * EP`). Attention, the dense MLPs, the shared
//!   experts, routers, embedding and head are placed exactly as in the
//!   TP8 x DP16 layout (TP8-sharded within each node or replicated, by
//!   kind; every node holds them once); the 256 routed experts of a layer
//!   are spread whole over the EP group, 256 / EP consecutive experts per
//!   rank (vLLM's linear expert placement: EP rank k holds experts
//!   `k * 256 / EP ..`), each expert replicated once per instance. Each
//!   node then takes in the non-expert weights plus 8 x 256 / EP experts
//!   per MoE layer instead of the whole model. The training side is the
//!   same.
//! - `kimi-k2` (Kimi-K2 1T, DeepSeek-V3's architecture with 64 heads, one
//!   dense layer and 384 routed experts): training as miles' published
//!   Kimi-K2 recipe, TP8 x CP4 x PP8 on 256 ranks (8 per node; 7 stages of
//!   8 layers, then 5; dense weights TP8-sharded and replicated over CP,
//!   routed experts EP32 over a stage's 32 ranks, 12 whole experts each) ->
//!   inference on 128 ranks as the 256 -> 128 GPU refit Perplexity
//!   published, placed as `deepseek-v3 --ep` places it (their inference
//!   placement is not published): 8 instances of EP16 by default (the
//!   smallest EP group that holds an FP8 copy of the 1T model on 80 GB
//!   GPUs, about 64 GB a rank), the non-expert weights TP8 within each
//!   node, 24 whole experts per rank; `--ep` chooses another.
//!
//! - The anchors' own setups ([`PresetOptions::setup`], `--setup`): the
//!   training -> inference layouts on which others published a measured
//!   refit, so our modelled time can be set beside theirs.
//!   - `deepseek-v3` [`Setup::NemoRl`]: NeMo RL's DeepSeek-V3 GRPO recipe
//!     (`grpo-deepseek-v3-32n8g.yaml`, non-colocated as in
//!     `grpo-deepseek-v3-64n8g-async-1off.yaml`): Megatron PP16 x EP16 on
//!     256 ranks (TP1 and DP16 within a stage, the NeMo RL defaults; 3
//!     layers in the first stage, 2 in the last, 4 in each other; rank =
//!     stage * 16 + dp; dense weights replicated over a stage's 16 ranks,
//!     routed experts EP16 over them, 16 whole experts per rank) -> vLLM
//!     TP32 x DP8 on 256 ranks (every weight TP32-sharded, experts
//!     included: no expert parallelism).
//!   - `kimi-k2` [`Setup::VllmRdt`]: vLLM's sharded weight transfer over
//!     Ray Direct Transport, as its blog measured it on 48 DGX H100 nodes:
//!     Megatron TP8 x PP8 x EP32 (ETP1) on 256 ranks, placed as the default
//!     Kimi-K2 training side (the layer split over 8 stages is not
//!     published: miles' 7 x 8 + 5 is assumed) -> vLLM TP32 x EP32 on 128
//!     ranks: 4 instances of 32 ranks (4 nodes each), the non-expert
//!     weights TP32-sharded within an instance, 12 whole experts per rank.
//!   - `qwen3-235b` [`Setup::VllmRdt`]: the same blog's 4-node setup:
//!     Megatron TP4 x PP2 x EP8 (ETP1) on 16 ranks (2 nodes; 47 layers a
//!     stage, assumed; rank = stage * 8 + dp * 4 + tp; dense weights TP4,
//!     replicated over DP2; experts EP8 over a stage's 8 ranks, 16 whole
//!     experts each) -> vLLM DP16 x EP16 on 16 ranks (2 nodes): every
//!     non-expert weight whole on every rank, 8 whole experts per rank.
//!
//! Fused buffers, as the frameworks store them (buffer names are per rank;
//! members lie back to back, each rank's local block after the previous
//! member's local block, among the members that rank holds):
//! - training (Megatron-like): `layers.{l}.linear_qkv` = [q; k; v] (each
//!   rank's q, k and v shares back to back; Megatron-Core itself
//!   interleaves them by query group, which the Python front's
//!   `megatron_layout` models: the same elements on the same ranks, in
//!   another order within the buffer),
//!   `layers.{l}.linear_fc1` = [gate; up] of a dense MLP,
//!   `layers.{l}.shared_experts.linear_fc1` and
//!   `layers.{l}.experts.{e}.linear_fc1` likewise (one per expert, as
//!   Megatron's grouped-GEMM experts keep them);
//! - inference (vLLM): `layers.{l}.qkv_proj` = [q; k; v],
//!   `layers.{l}.gate_up_proj` = [gate; up] of the dense MLP or of the shared
//!   experts, `layers.{l}.fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa]
//!   (MLA, replicated), and FusedMoE's `layers.{l}.experts.w13_weight` =
//!   [gate_0; up_0; gate_1; up_1; ...] and `layers.{l}.experts.w2_weight` =
//!   [down_0; down_1; ...]; with expert parallelism a rank's FusedMoE
//!   buffers hold only its local experts, whole, in expert order
//!   ([gate_e; up_e; ...] and [down_e; ...] for its 256 / EP experts,
//!   starting at offset 0).
//!
//! With more TP ranks than KV heads, k_proj and v_proj are not split below a
//! head: each rank holds one whole KV head, replicated over `tp / kv_heads`
//! ranks (vLLM's `QKVParallelLinear`).

use reshard::{DType, Layout, LayoutError, MeshDim, MeshPlacement, Placement, Storage, TensorLayout};
use std::collections::HashMap;
use thiserror::Error;

mod weights;

use weights::{
    llama_weights, mla_moe_weights, mla_moe_weights_staged, qwen3_pp2, qwen3_pp4, qwen3_weights, DEEPSEEK_V3, DEEPSEEK_V3_NEMO_RL, KIMI_K2,
};

/// A model preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Model {
    /// Llama 3 8B.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// DeepSeek-V3 671B.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// Qwen3-235B-A22B.
    #[value(name = "qwen3-235b")]
    Qwen3_235b,
    /// Kimi-K2 1T (DeepSeek-V3's architecture: MLA, 384 routed experts).
    #[value(name = "kimi-k2")]
    KimiK2,
}

impl Model {
    /// The preset's name on the command line (`deepseek-v3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Model::Llama3_8b => "llama3-8b",
            Model::DeepseekV3 => "deepseek-v3",
            Model::Qwen3_235b => "qwen3-235b",
            Model::KimiK2 => "kimi-k2",
        }
    }
}

/// The preset's name as typed on the command line: `deepseek-v3`, not
/// `DeepseekV3`.
impl std::fmt::Display for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A published training -> inference setup of a preset's model: the
/// layouts an anchor measured a refit on (`--setup`). The preset's default
/// layouts are kept when none is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// NeMo RL's DeepSeek-V3 recipe: Megatron PP16 x EP16 (256 ranks) ->
    /// vLLM TP32 x DP8 (256 ranks). `deepseek-v3` only.
    NemoRl,
    /// vLLM's sharded weight transfer over Ray Direct Transport (RDT):
    /// Kimi-K2 TP8 x PP8 x EP32 (256 ranks) -> TP32 x EP32 (128 ranks);
    /// Qwen3-235B TP4 x PP2 x EP8 (16 ranks) -> DP16 x EP16 (16 ranks).
    VllmRdt,
}

impl Setup {
    /// Every setup, in the order they are listed.
    pub const ALL: [Setup; 2] = [Setup::NemoRl, Setup::VllmRdt];

    /// The setup's name on the command line (`nemo-rl`, `vllm-rdt`).
    pub fn name(self) -> &'static str {
        match self {
            Setup::NemoRl => "nemo-rl",
            Setup::VllmRdt => "vllm-rdt",
        }
    }

    /// The setup called `name`, if any.
    pub fn from_name(name: &str) -> Option<Setup> {
        Setup::ALL.into_iter().find(|s| s.name() == name)
    }
}

impl std::fmt::Display for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Model {
    /// The anchors' setups this preset models (`--setup`).
    pub fn setups(self) -> &'static [Setup] {
        match self {
            Model::Llama3_8b => &[],
            Model::DeepseekV3 => &[Setup::NemoRl],
            Model::Qwen3_235b | Model::KimiK2 => &[Setup::VllmRdt],
        }
    }

    /// The names of [`Model::setups`], comma-separated, or `none`.
    pub fn setup_names(self) -> String {
        let names: Vec<&str> = self.setups().iter().map(|s| s.name()).collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    }
}

/// Inference ranks of the DeepSeek-V3 preset.
const DEEPSEEK_INFER_RANKS: u32 = 128;
/// Inference TP degree (and ranks per node) of the DeepSeek-V3 preset.
const DEEPSEEK_INFER_TP: u32 = 8;
/// Routed experts per MoE layer of DeepSeek-V3.
const DEEPSEEK_EXPERTS: u32 = 256;
/// Routed experts per MoE layer of Kimi-K2.
const KIMI_EXPERTS: u32 = 384;
/// The expert-parallel degree of the Kimi-K2 preset's inference side.
const KIMI_DEFAULT_EP: u32 = 16;

/// Choices of a preset beyond its scale; the default is the preset as
/// described in the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PresetOptions {
    /// Expert parallelism of the inference side (`deepseek-v3` and
    /// `kimi-k2`): the routed experts spread whole over EP groups of this
    /// many ranks, the other weights TP8-sharded within each node. `None`:
    /// the preset's default (DeepSeek-V3: every weight TP8-sharded, TP8 x
    /// DP16; Kimi-K2: EP16). Must be a multiple of 8 that divides 128.
    pub ep: Option<u32>,
    /// An anchor's published setup instead of the preset's default
    /// layouts (both sides); see [`Model::setups`]. It fixes the inference
    /// layout, so it does not combine with `ep`.
    pub setup: Option<Setup>,
}

/// Why a preset cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PresetError {
    /// Expert parallelism was asked of a preset that does not model it.
    #[error("the {} preset has no expert-parallel inference layout (only deepseek-v3 and kimi-k2 have)", model.name())]
    EpUnsupported {
        /// The preset.
        model: Model,
    },
    /// The EP degree does not fit the inference ranks.
    #[error(
        "EP {ep} does not fit the inference side (128 ranks, 8 per node, TP8 within a node): \
         EP must be a multiple of 8 that divides 128 (8, 16, 32, 64 or 128)"
    )]
    EpDegree {
        /// The EP degree asked for.
        ep: u32,
    },
    /// The preset does not model this setup.
    #[error("the {model} preset has no {setup} setup (its setups: {})", model.setup_names())]
    SetupUnsupported {
        /// The preset.
        model: Model,
        /// The setup asked for.
        setup: Setup,
    },
    /// Expert parallelism was given with a setup, which fixes it.
    #[error("the {model} {setup} setup fixes the inference layout: give a setup or an EP degree, not both")]
    SetupWithEp {
        /// The preset.
        model: Model,
        /// The setup asked for.
        setup: Setup,
    },
    /// The rank counts or layers of a scaled-out pair ([`scaled_out`])
    /// do not fit its parallel structure.
    #[error("{0}")]
    ScaleOut(String),
    /// The generated layouts are invalid (a bug in the preset).
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Checks an inference EP degree for `model`.
fn check_ep(model: Model, ep: u32) -> Result<(), PresetError> {
    if !matches!(model, Model::DeepseekV3 | Model::KimiK2) {
        return Err(PresetError::EpUnsupported { model });
    }
    if ep == 0 || !ep.is_multiple_of(DEEPSEEK_INFER_TP) || !DEEPSEEK_INFER_RANKS.is_multiple_of(ep) {
        return Err(PresetError::EpDegree { ep });
    }
    Ok(())
}

/// How one weight is split by tensor parallelism.
#[derive(Clone, Copy)]
enum Tp {
    /// Column-parallel: output dim (0) split.
    Col,
    /// Row-parallel: input dim (1) split.
    Row,
    /// Not split (norms, small vectors).
    None,
}

struct Weight {
    name: String,
    shape: Vec<u64>,
    tp: Tp,
    /// Pipeline stage (training) it belongs to.
    stage: u32,
    /// Expert index, for routed experts.
    expert: Option<u32>,
    /// Number of KV heads making up dim 0 (GQA k_proj and v_proj).
    kv_heads: Option<u64>,
}

impl Weight {
    /// This weight as a BF16 tensor placed by `placement`.
    fn placed(&self, placement: Placement) -> TensorLayout {
        TensorLayout { name: self.name.clone(), dtype: DType::BF16, shape: self.shape.clone(), placement, scale: None }
    }
}

fn mesh(shape: Vec<u32>, ranks: Vec<u32>, dims: Vec<MeshDim>) -> Placement {
    Placement::Mesh(MeshPlacement { shape, ranks, dims, storage: Storage::Own })
}

/// A weight split `tp` ways by its kind over `ranks` (row-major (outer,
/// tp), the outer dim replicated). A KV projection with fewer heads than
/// `tp` is split by heads instead: mesh (outer, kv_heads, tp / kv_heads),
/// each head replicated over consecutive TP ranks.
fn tp_placement(w: &Weight, outer: u32, tp: u32, ranks: Vec<u32>) -> Placement {
    match w.kv_heads {
        Some(kv) if kv < tp as u64 && (tp as u64).is_multiple_of(kv) => {
            let kv = kv as u32;
            mesh(vec![outer, kv, tp / kv], ranks, vec![MeshDim::Replicate, MeshDim::Shard(0), MeshDim::Replicate])
        }
        _ => mesh(vec![outer, tp], ranks, vec![MeshDim::Replicate, tp_dim(w.tp)]),
    }
}

/// Which side of a refit a fused buffer belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Megatron-style training.
    Train,
    /// vLLM-style inference.
    Infer,
}

/// The fused buffer a tensor lives in on one side, if any.
fn fused_buffer(name: &str, side: Side) -> Option<String> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, leaf) = rest.split_once('.')?;
    let leaf = leaf.strip_suffix(".weight")?;
    let train = side == Side::Train;
    if let Some(e) = leaf.strip_prefix("mlp.experts.") {
        let (e, proj) = e.split_once('.')?;
        return match (proj, train) {
            ("gate_proj" | "up_proj", true) => Some(format!("layers.{l}.experts.{e}.linear_fc1")),
            ("gate_proj" | "up_proj", false) => Some(format!("layers.{l}.experts.w13_weight")),
            ("down_proj", false) => Some(format!("layers.{l}.experts.w2_weight")),
            _ => None,
        };
    }
    match (leaf, train) {
        ("self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj", true) => Some(format!("layers.{l}.linear_qkv")),
        ("self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj", false) => Some(format!("layers.{l}.qkv_proj")),
        ("mlp.gate_proj" | "mlp.up_proj", true) => Some(format!("layers.{l}.linear_fc1")),
        ("mlp.shared_experts.gate_proj" | "mlp.shared_experts.up_proj", true) => Some(format!("layers.{l}.shared_experts.linear_fc1")),
        ("mlp.gate_proj" | "mlp.up_proj" | "mlp.shared_experts.gate_proj" | "mlp.shared_experts.up_proj", false) => {
            Some(format!("layers.{l}.gate_up_proj"))
        }
        ("self_attn.q_a_proj" | "self_attn.kv_a_proj_with_mqa", false) => Some(format!("layers.{l}.fused_qkv_a_proj")),
        _ => None,
    }
}

/// Elements of the largest local block of a mesh placement (the first
/// chunk of every split).
fn max_local_elems(shape: &[u64], m: &MeshPlacement) -> u64 {
    let mut ext = shape.to_vec();
    for (i, d) in m.dims.iter().enumerate() {
        if let MeshDim::Shard(d) = d {
            ext[*d] = ext[*d].div_ceil(m.shape[i] as u64);
        }
    }
    ext.iter().product()
}

/// Stores the tensors of each fused buffer back to back, in tensor order:
/// every rank's local block of a member starts after the largest local
/// block of the members before it on the same ranks. Members are grouped
/// by the ranks holding them: with expert parallelism each rank's
/// `experts.w13_weight` holds only its own experts, from offset 0 (the
/// members of one buffer on one rank always share the rank list, so every
/// rank sees its members back to back).
fn fuse(tensors: &mut [TensorLayout], side: Side) {
    let mut next: HashMap<(String, Vec<u32>), u64> = HashMap::new();
    for t in tensors {
        let (Some(buffer), Placement::Mesh(m)) = (fused_buffer(&t.name, side), &mut t.placement) else { continue };
        let at = next.entry((buffer.clone(), m.ranks.clone())).or_insert(0);
        m.storage = Storage::InBuffer { buffer, at: *at };
        *at += max_local_elems(&t.shape, m);
    }
}

fn tp_dim(tp: Tp) -> MeshDim {
    match tp {
        Tp::Col => MeshDim::Shard(0),
        Tp::Row => MeshDim::Shard(1),
        Tp::None => MeshDim::Replicate,
    }
}

/// The inference side of every preset: DP replicas of a TP group, ranks
/// in row-major order of (dp, tp), every weight split by its TP kind, the
/// vLLM fused buffers.
fn inference_dp_tp(ws: &[Weight], dp: u32, tp: u32) -> Vec<TensorLayout> {
    let mut out: Vec<TensorLayout> = ws.iter().map(|w| w.placed(tp_placement(w, dp, tp, (0..dp * tp).collect()))).collect();
    fuse(&mut out, Side::Infer);
    out
}

/// DeepSeek-V3 inference with expert parallelism `ep` over `ranks` ranks
/// (row-major (dp, tp) within a node as [`inference_dp_tp`]): every weight
/// but the routed experts split TP`tp` as there; routed expert `e` whole on
/// rank `g * ep + e / (experts / ep)` of every EP group `g`, in the
/// FusedMoE buffers of that rank.
fn inference_ep(ws: &[Weight], ranks: u32, tp: u32, ep: u32, experts: u32) -> Vec<TensorLayout> {
    let (per_rank, groups) = (experts / ep, ranks / ep);
    let mut out: Vec<TensorLayout> = ws
        .iter()
        .map(|w| {
            let placement = match w.expert {
                Some(e) => mesh(vec![groups], (0..groups).map(|g| g * ep + e / per_rank).collect(), vec![MeshDim::Replicate]),
                None => tp_placement(w, ranks / tp, tp, (0..ranks).collect()),
            };
            w.placed(placement)
        })
        .collect();
    fuse(&mut out, Side::Infer);
    out
}

/// Source and destination layouts of a preset at `scale` (1 = full size),
/// with the default options.
pub fn layouts(model: Model, scale: u64) -> Result<(Layout, Layout), LayoutError> {
    build(model, scale, None)
}

/// Source and destination layouts of a preset at `scale` (1 = full size)
/// with `options`; an option the preset does not model is an error.
pub fn layouts_with(model: Model, scale: u64, options: PresetOptions) -> Result<(Layout, Layout), PresetError> {
    if let Some(setup) = options.setup {
        if !model.setups().contains(&setup) {
            return Err(PresetError::SetupUnsupported { model, setup });
        }
        if options.ep.is_some() {
            return Err(PresetError::SetupWithEp { model, setup });
        }
        return build_setup(model, setup, scale);
    }
    if let Some(ep) = options.ep {
        check_ep(model, ep)?;
    }
    Ok(build(model, scale, options.ep)?)
}

/// Kimi-K2's training side, as miles' recipe and vLLM RDT's setup place
/// it: TP8 x PP8 on 256 ranks, rank = stage * 32 + r (r = cp * 8 + tp, or
/// dp * 8 + tp: the 4 replicas of the dense weights); dense weights
/// TP8-sharded, replicated 4 times; routed experts EP32 over the stage's
/// 32 ranks with expert-TP 1: 12 whole experts per rank.
fn kimi_training(ws: &[Weight]) -> Vec<TensorLayout> {
    let per_rank = KIMI_EXPERTS / 32;
    let mut src: Vec<TensorLayout> = ws
        .iter()
        .map(|w| {
            let placement = match w.expert {
                Some(e) => mesh(vec![1], vec![w.stage * 32 + e / per_rank], vec![MeshDim::Replicate]),
                None => tp_placement(w, 4, 8, (0..32).map(|r| w.stage * 32 + r).collect()),
            };
            w.placed(placement)
        })
        .collect();
    fuse(&mut src, Side::Train);
    src
}

/// A training side of `stages` pipeline stages of `per_stage` ranks each
/// (rank = stage * per_stage + r), `tp`-way tensor parallel (r = dp * tp +
/// tp rank; dense weights replicated over the per_stage / tp data-parallel
/// replicas) and expert parallel over all of a stage's ranks with expert-TP
/// 1: routed expert `e` whole on rank `e / (experts / per_stage)` of its
/// stage, once.
fn megatron_ep_training(ws: &[Weight], per_stage: u32, tp: u32, experts: u32) -> Vec<TensorLayout> {
    let per_rank = experts / per_stage;
    let mut src: Vec<TensorLayout> = ws
        .iter()
        .map(|w| {
            let first = w.stage * per_stage;
            let placement = match w.expert {
                Some(e) => mesh(vec![1], vec![first + e / per_rank], vec![MeshDim::Replicate]),
                None => tp_placement(w, per_stage / tp, tp, (first..first + per_stage).collect()),
            };
            w.placed(placement)
        })
        .collect();
    fuse(&mut src, Side::Train);
    src
}

/// The layouts of an anchor's setup (one of [`Model::setups`]).
fn build_setup(model: Model, setup: Setup, scale: u64) -> Result<(Layout, Layout), PresetError> {
    let scale = scale.max(1);
    match (model, setup) {
        (Model::DeepseekV3, Setup::NemoRl) => {
            // Megatron PP16 x EP16, TP1, DP16 within a stage -> vLLM TP32 x DP8.
            let ws = mla_moe_weights(&DEEPSEEK_V3_NEMO_RL, scale);
            let src = megatron_ep_training(&ws, 16, 1, DEEPSEEK_EXPERTS);
            let dst = inference_dp_tp(&ws, 8, 32);
            Ok((Layout::new(256, Some(8), src)?, Layout::new(256, Some(8), dst)?))
        }
        (Model::KimiK2, Setup::VllmRdt) => {
            // Megatron TP8 x PP8 x EP32 -> vLLM TP32 x EP32: 4 instances of 32.
            let ws = mla_moe_weights(&KIMI_K2, scale);
            let dst = inference_ep(&ws, 128, 32, 32, KIMI_EXPERTS);
            Ok((Layout::new(256, Some(8), kimi_training(&ws))?, Layout::new(128, Some(8), dst)?))
        }
        (Model::Qwen3_235b, Setup::VllmRdt) => {
            // Megatron TP4 x PP2 x EP8 (DP2) -> vLLM DP16 x EP16.
            let ws = qwen3_weights(scale, qwen3_pp2);
            let src = megatron_ep_training(&ws, 8, 4, 128);
            let dst = inference_ep(&ws, 16, 1, 16, 128);
            Ok((Layout::new(16, Some(8), src)?, Layout::new(16, Some(8), dst)?))
        }
        _ => Err(PresetError::SetupUnsupported { model, setup }),
    }
}

/// The layouts; `ep` (already checked) only for DeepSeek-V3.
fn build(model: Model, scale: u64, ep: Option<u32>) -> Result<(Layout, Layout), LayoutError> {
    let scale = scale.max(1);
    match model {
        Model::Llama3_8b => {
            let ws = llama_weights(scale);
            // Training: rank = stage * 4 + tp.
            let mut src: Vec<TensorLayout> =
                ws.iter().map(|w| w.placed(tp_placement(w, 1, 4, (0..4).map(|t| w.stage * 4 + t).collect()))).collect();
            fuse(&mut src, Side::Train);
            let dst = inference_dp_tp(&ws, 2, 2);
            Ok((Layout::new(8, Some(4), src)?, Layout::new(4, Some(2), dst)?))
        }
        Model::Qwen3_235b => {
            let ws = qwen3_weights(scale, qwen3_pp4);
            // Training: rank = stage * 32 + dp * 4 + cp * 2 + tp.
            let mut src: Vec<TensorLayout> = ws
                .iter()
                .map(|w| {
                    let placement = match w.expert {
                        // 128 experts over EP16: 8 per EP rank; EP rank k is the
                        // pair of ranks 2k, 2k + 1 of the stage.
                        Some(e) => mesh(vec![2], (0..2).map(|i| w.stage * 32 + (e / 8) * 2 + i).collect(), vec![MeshDim::Replicate]),
                        // Dense: mesh [DP x CP = 16, TP = 2].
                        None => tp_placement(w, 16, 2, (0..32).map(|r| w.stage * 32 + r).collect()),
                    };
                    w.placed(placement)
                })
                .collect();
            fuse(&mut src, Side::Train);
            let dst = inference_dp_tp(&ws, 8, 8);
            Ok((Layout::new(128, Some(8), src)?, Layout::new(64, Some(8), dst)?))
        }
        Model::DeepseekV3 => {
            let ws = mla_moe_weights(&DEEPSEEK_V3, scale);
            // Training: rank = stage * 64 + ep * 4 + dp.
            let mut src: Vec<TensorLayout> = ws
                .iter()
                .map(|w| {
                    let placement = match w.expert {
                        Some(e) => mesh(vec![4], (0..4).map(|d| w.stage * 64 + (e / 16) * 4 + d).collect(), vec![MeshDim::Replicate]),
                        None => mesh(vec![64], (0..64).map(|r| w.stage * 64 + r).collect(), vec![MeshDim::Replicate]),
                    };
                    w.placed(placement)
                })
                .collect();
            fuse(&mut src, Side::Train);
            let (ranks, tp) = (DEEPSEEK_INFER_RANKS, DEEPSEEK_INFER_TP);
            let dst = match ep {
                Some(ep) => inference_ep(&ws, ranks, tp, ep, DEEPSEEK_EXPERTS),
                None => inference_dp_tp(&ws, ranks / tp, tp),
            };
            Ok((Layout::new(256, Some(8), src)?, Layout::new(ranks, Some(tp), dst)?))
        }
        Model::KimiK2 => {
            let ws = mla_moe_weights(&KIMI_K2, scale);
            // Training as miles' Kimi-K2 recipe: TP8 x CP4 x PP8 on 256
            // ranks (DP 1), the dense weights replicated over CP.
            let src = kimi_training(&ws);
            // Inference on 128 ranks in EP groups (EP16 by default: the
            // smallest that holds an FP8 copy on 80 GB GPUs, about 64 GB
            // a rank; over 8 it would be 129 GB).
            let dst = inference_ep(&ws, 128, 8, ep.unwrap_or(KIMI_DEFAULT_EP), KIMI_EXPERTS);
            Ok((Layout::new(256, Some(8), src)?, Layout::new(128, Some(8), dst)?))
        }
    }
}

/// A scaled-out pair of a preset of DeepSeek-V3's architecture
/// (`deepseek-v3`, `kimi-k2`): thousands of ranks on both sides, for
/// measuring the orchestrator (`refit controller-bench`), not a published
/// setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleOut {
    /// Training ranks: PP x EP x DP, 8 per node.
    pub src_ranks: u32,
    /// Inference ranks: EP16 instances (TP8 within a node for the
    /// non-expert weights), 8 per node.
    pub dst_ranks: u32,
    /// The model's first this many layers (its dense layers first).
    pub layers: u32,
}

/// Pipeline stages of a scaled-out training side: 16, or fewer when there
/// are fewer layers (a power of two dividing the layers' count from
/// below).
fn scale_out_stages(layers: u32) -> u32 {
    let mut pp = 16;
    while pp > layers {
        pp /= 2;
    }
    pp
}

/// The layouts of a scaled-out pair: the model's first `layers` layers at
/// `scale`; training Megatron PP x EP x DP on `src_ranks` (PP 16, or the
/// largest power of two up to the layers; a stage's ranks `stage *
/// per_stage ..`; TP 1, the dense weights replicated over a stage's ranks;
/// routed experts EP16 over `stage * per_stage + dp * 16 ..`, whole,
/// replicated over the stage's DP groups, as NeMo RL's PP16 x EP16 with
/// more data parallelism); inference as vLLM's TP8 x DP2
/// `--enable-expert-parallel` instances of EP16 (`deepseek-v3 --ep 16`),
/// `dst_ranks / 16` of them.
pub fn scaled_out(model: Model, scale: u64, s: ScaleOut) -> Result<(Layout, Layout), PresetError> {
    let m = match model {
        Model::DeepseekV3 => &DEEPSEEK_V3,
        Model::KimiK2 => &KIMI_K2,
        _ => return Err(PresetError::ScaleOut(format!("the {model} preset is not of DeepSeek-V3's architecture (deepseek-v3, kimi-k2)"))),
    };
    const EP: u32 = 16;
    let layers = s.layers.clamp(1, m.layers);
    let pp = scale_out_stages(layers);
    if s.src_ranks == 0 || !s.src_ranks.is_multiple_of(pp * EP) {
        return Err(PresetError::ScaleOut(format!(
            "{} training ranks do not split into PP{pp} x EP{EP} x DP (a multiple of {})",
            s.src_ranks,
            pp * EP
        )));
    }
    if s.dst_ranks == 0 || !s.dst_ranks.is_multiple_of(EP) {
        return Err(PresetError::ScaleOut(format!("{} inference ranks are not instances of EP{EP} (a multiple of {EP})", s.dst_ranks)));
    }
    let per_stage = s.src_ranks / pp;
    let (experts, per_rank) = (m.experts, m.experts / EP);
    let stage_of = move |l: u32| l * pp / layers;
    let ws = mla_moe_weights_staged(m, scale.max(1), layers, &stage_of, pp - 1);
    let mut src: Vec<TensorLayout> = ws
        .iter()
        .map(|w| {
            let first = w.stage * per_stage;
            let placement = match w.expert {
                Some(e) => {
                    let dp = per_stage / EP;
                    mesh(vec![dp], (0..dp).map(|d| first + d * EP + e / per_rank).collect(), vec![MeshDim::Replicate])
                }
                None => mesh(vec![per_stage], (first..first + per_stage).collect(), vec![MeshDim::Replicate]),
            };
            w.placed(placement)
        })
        .collect();
    fuse(&mut src, Side::Train);
    let dst = inference_ep(&ws, s.dst_ranks, DEEPSEEK_INFER_TP, EP, experts);
    Ok((Layout::new(s.src_ranks, Some(8), src)?, Layout::new(s.dst_ranks, Some(8), dst)?))
}
