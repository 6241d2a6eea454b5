//! The weights of each preset's model: names, shapes, how tensor
//! parallelism splits each, and the training stage (and routed expert) each
//! belongs to; hidden sizes divided by the preset's scale.

use super::{Tp, Weight, DEEPSEEK_EXPERTS, KIMI_EXPERTS};

/// What differs between models of DeepSeek-V3's architecture (MLA
/// attention, dense layers first, then MoE layers of routed experts and one
/// shared expert); the other sizes are DeepSeek-V3's (hidden 7168, q LoRA
/// 1536, kv LoRA 512, head dims 128 + 64 and 128, FFN 18432, expert FFN
/// 2048), which Kimi-K2 shares.
pub(super) struct MlaMoe {
    /// Attention heads.
    heads: u64,
    /// Vocabulary.
    vocab: u64,
    /// Decoder layers.
    pub(super) layers: u32,
    /// The first this many layers have a dense MLP.
    dense_layers: u32,
    /// Routed experts per MoE layer.
    pub(super) experts: u32,
    /// The training pipeline stage of each layer.
    stage_of: fn(u32) -> u32,
    /// The last stage (final norm, output head).
    last_stage: u32,
}

/// DeepSeek-V3 671B: 61 layers over 4 stages (16, 15, 15, 15).
pub(super) const DEEPSEEK_V3: MlaMoe = MlaMoe {
    heads: 128,
    vocab: 129_280,
    layers: 61,
    dense_layers: 3,
    experts: DEEPSEEK_EXPERTS,
    stage_of: |l| if l < 16 { 0 } else { 1 + (l - 16) / 15 },
    last_stage: 3,
};

/// Kimi-K2 1T (its published `config.json`): 61 layers, the first dense,
/// 64 heads, 384 routed experts, vocabulary 163,840; over 8 stages as
/// miles trains it (`--decoder-last-pipeline-num-layers 5`: 7 stages of 8
/// layers, then 5).
pub(super) const KIMI_K2: MlaMoe =
    MlaMoe { heads: 64, vocab: 163_840, layers: 61, dense_layers: 1, experts: KIMI_EXPERTS, stage_of: |l| (l / 8).min(7), last_stage: 7 };

/// DeepSeek-V3 as NeMo RL's recipe trains it: 16 stages,
/// `num_layers_in_first_pipeline_stage: 3`,
/// `num_layers_in_last_pipeline_stage: 2`, the 56 layers between 4 a stage.
pub(super) const DEEPSEEK_V3_NEMO_RL: MlaMoe =
    MlaMoe { stage_of: |l| if l < 3 { 0 } else { (1 + (l - 3) / 4).min(15) }, last_stage: 15, ..DEEPSEEK_V3 };

fn div(x: u64, scale: u64) -> u64 {
    (x / scale).max(1)
}

impl Weight {
    /// A dense weight of pipeline stage `stage`.
    fn new(name: impl Into<String>, shape: Vec<u64>, tp: Tp, stage: u32) -> Weight {
        Weight { name: name.into(), shape, tp, stage, expert: None, kv_heads: None }
    }

    /// A GQA k/v projection made of `kv_heads` heads along dim 0.
    fn kv(name: String, shape: Vec<u64>, stage: u32, kv_heads: u64) -> Weight {
        Weight { kv_heads: Some(kv_heads), ..Weight::new(name, shape, Tp::Col, stage) }
    }
}

/// The token embedding (stage 0).
fn embedding(vocab: u64, h: u64) -> Weight {
    Weight::new("model.embed_tokens.weight", vec![vocab, h], Tp::Col, 0)
}

/// The final norm and the output head, on the last stage.
fn norm_and_head(w: &mut Vec<Weight>, vocab: u64, h: u64, last: u32) {
    w.push(Weight::new("model.norm.weight", vec![h], Tp::None, last));
    w.push(Weight::new("lm_head.weight", vec![vocab, h], Tp::Col, last));
}

/// The gate/up/down projections of an MLP whose weights are named
/// `{prefix}.{gate,up,down}_proj.weight`, of routed expert `expert` if any.
fn mlp(w: &mut Vec<Weight>, prefix: &str, (ffn, h): (u64, u64), stage: u32, expert: Option<u32>) {
    for (proj, shape, tp) in
        [("gate_proj", vec![ffn, h], Tp::Col), ("up_proj", vec![ffn, h], Tp::Col), ("down_proj", vec![h, ffn], Tp::Row)]
    {
        w.push(Weight { expert, ..Weight::new(format!("{prefix}.{proj}.weight"), shape, tp, stage) });
    }
}

pub(super) fn llama_weights(scale: u64) -> Vec<Weight> {
    let (h, ffn, vocab, layers, kv) = (div(4096, scale), div(14336, scale), div(128_256, scale), 32u32, div(1024, scale));
    let mut w = vec![embedding(vocab, h)];
    for l in 0..layers {
        let stage = l / 16;
        let p = |n: &str| format!("model.layers.{l}.{n}");
        w.push(Weight::new(p("input_layernorm.weight"), vec![h], Tp::None, stage));
        w.push(Weight::new(p("self_attn.q_proj.weight"), vec![h, h], Tp::Col, stage));
        w.push(Weight::kv(p("self_attn.k_proj.weight"), vec![kv, h], stage, 8));
        w.push(Weight::kv(p("self_attn.v_proj.weight"), vec![kv, h], stage, 8));
        w.push(Weight::new(p("self_attn.o_proj.weight"), vec![h, h], Tp::Row, stage));
        w.push(Weight::new(p("post_attention_layernorm.weight"), vec![h], Tp::None, stage));
        mlp(&mut w, &p("mlp"), (ffn, h), stage, None);
    }
    norm_and_head(&mut w, vocab, h, 1);
    w
}

/// The weights of a model of DeepSeek-V3's architecture.
pub(super) fn mla_moe_weights(m: &MlaMoe, scale: u64) -> Vec<Weight> {
    mla_moe_weights_staged(m, scale, m.layers, &m.stage_of, m.last_stage)
}

/// The first `layers` layers of a model of DeepSeek-V3's architecture,
/// layer `l` on training stage `stage_of(l)`, the norm and head on `last`.
pub(super) fn mla_moe_weights_staged(m: &MlaMoe, scale: u64, layers: u32, stage_of: &dyn Fn(u32) -> u32, last: u32) -> Vec<Weight> {
    let h = div(7168, scale);
    let (q_lora, kv_lora, heads) = (div(1536, scale), div(512, scale), m.heads);
    let (nope, rope, vdim) = (div(128, scale), div(64, scale), div(128, scale));
    let (ffn, moe_ffn, vocab) = (div(18432, scale), div(2048, scale), div(m.vocab, scale));
    let (dense_layers, experts) = (m.dense_layers, m.experts);
    let mut w = vec![embedding(vocab, h)];
    for l in 0..layers {
        let stage = stage_of(l);
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let mut add = |name: String, shape: Vec<u64>, tp: Tp| w.push(Weight::new(name, shape, tp, stage));
        add(p("input_layernorm.weight"), vec![h], Tp::None);
        add(p("self_attn.q_a_proj.weight"), vec![q_lora, h], Tp::None);
        add(p("self_attn.q_a_layernorm.weight"), vec![q_lora], Tp::None);
        add(p("self_attn.q_b_proj.weight"), vec![heads * (nope + rope), q_lora], Tp::Col);
        add(p("self_attn.kv_a_proj_with_mqa.weight"), vec![kv_lora + rope, h], Tp::None);
        add(p("self_attn.kv_a_layernorm.weight"), vec![kv_lora], Tp::None);
        add(p("self_attn.kv_b_proj.weight"), vec![heads * (nope + vdim), kv_lora], Tp::Col);
        add(p("self_attn.o_proj.weight"), vec![h, heads * vdim], Tp::Row);
        add(p("post_attention_layernorm.weight"), vec![h], Tp::None);
        if l < dense_layers {
            mlp(&mut w, &p("mlp"), (ffn, h), stage, None);
        } else {
            add(p("mlp.gate.weight"), vec![experts as u64, h], Tp::None);
            add(p("mlp.gate.e_score_correction_bias"), vec![experts as u64], Tp::None);
            mlp(&mut w, &p("mlp.shared_experts"), (moe_ffn, h), stage, None);
            for e in 0..experts {
                mlp(&mut w, &p(&format!("mlp.experts.{e}")), (moe_ffn, h), stage, Some(e));
            }
        }
    }
    norm_and_head(&mut w, vocab, h, last);
    w
}

/// Qwen3-235B's 94 layers over the default preset's 4 training stages: 24,
/// 24, 23, 23.
pub(super) fn qwen3_pp4(l: u32) -> u32 {
    if l < 48 {
        l / 24
    } else {
        2 + (l - 48) / 23
    }
}

/// Qwen3-235B's 94 layers over 2 training stages (vLLM RDT's setup): 47
/// each.
pub(super) fn qwen3_pp2(l: u32) -> u32 {
    l / 47
}

/// The weights of Qwen3-235B-A22B, layer `l` on training stage
/// `stage_of(l)`, the output head on the last.
pub(super) fn qwen3_weights(scale: u64, stage_of: fn(u32) -> u32) -> Vec<Weight> {
    let h = div(4096, scale);
    let (heads, kv_heads, head_dim) = (64u64, 4u64, div(128, scale));
    let (moe_ffn, vocab, layers, experts) = (div(1536, scale), div(151_936, scale), 94u32, 128u32);
    let mut w = vec![embedding(vocab, h)];
    for l in 0..layers {
        let stage = stage_of(l);
        let p = |n: &str| format!("model.layers.{l}.{n}");
        w.push(Weight::new(p("input_layernorm.weight"), vec![h], Tp::None, stage));
        w.push(Weight::new(p("self_attn.q_proj.weight"), vec![heads * head_dim, h], Tp::Col, stage));
        w.push(Weight::kv(p("self_attn.k_proj.weight"), vec![kv_heads * head_dim, h], stage, kv_heads));
        w.push(Weight::kv(p("self_attn.v_proj.weight"), vec![kv_heads * head_dim, h], stage, kv_heads));
        w.push(Weight::new(p("self_attn.o_proj.weight"), vec![h, heads * head_dim], Tp::Row, stage));
        w.push(Weight::new(p("self_attn.q_norm.weight"), vec![head_dim], Tp::None, stage));
        w.push(Weight::new(p("self_attn.k_norm.weight"), vec![head_dim], Tp::None, stage));
        w.push(Weight::new(p("post_attention_layernorm.weight"), vec![h], Tp::None, stage));
        w.push(Weight::new(p("mlp.gate.weight"), vec![experts as u64, h], Tp::None, stage));
        for e in 0..experts {
            mlp(&mut w, &p(&format!("mlp.experts.{e}")), (moe_ffn, h), stage, Some(e));
        }
    }
    norm_and_head(&mut w, vocab, h, stage_of(layers - 1));
    w
}
