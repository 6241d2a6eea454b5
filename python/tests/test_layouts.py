"""Layouts: the JSON format, the builder, DTensor placements, TP inference layouts."""

import numpy as np
import pytest

import refit
from refit.dtensor import dtensor_placement


def build(*tensors, ranks=2, ranks_per_node=None):
    b = refit.LayoutBuilder(ranks, ranks_per_node)
    for t in tensors:
        b = b.tensor(t)
    return b.build()


def test_builder_matches_the_file_format():
    built = build(refit.TensorBuilder("w", "bf16", [8, 4]).mesh([2, 2], ["replicate", "shard(0)"]), ranks=4, ranks_per_node=2)
    parsed = refit.Layout.from_json(
        '{"ranks": 4, "ranks_per_node": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],'
        ' "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}'
    )
    assert built == parsed and built.fingerprint == parsed.fingerprint
    assert refit.Layout.from_json(built.to_json()) == built
    import pickle

    assert pickle.loads(pickle.dumps(built)) == built  # to Ray actors and worker processes
    assert built.ranks == 4 and built.ranks_per_node == 2 and built.tensor_names() == ["w"]
    # rank 3 = replica 1, tp 1: rows 4..8
    assert built.blocks(3) == [("w", "bf16", [4, 0], [4, 4])]


def test_sub_mesh_fused_buffers_and_explicit_shards():
    layout = build(
        refit.TensorBuilder("q", "f32", [4, 4]).mesh([2], ["shard(0)"], [2, 3]).buffer("qkv", 0),
        refit.TensorBuilder("k", "f32", [4, 4]).mesh([2], ["shard(0)"], [2, 3]).buffer("qkv", 8),
        refit.TensorBuilder("f", "f32", [4, 4]).shard(0, flat=(0, 6)).shard(1, flat=(6, 10), buffer="flat", at=2),
        ranks=4,
    )
    assert layout.buffers(3) == [("qkv", "f32", 16)]
    assert layout.blocks(2) == [("q", "f32", [0, 0], [2, 4]), ("k", "f32", [0, 0], [2, 4])]
    assert layout.buffers(1) == [("flat", "f32", 12)]


def test_builder_errors_name_the_tensor():
    with pytest.raises(refit.LayoutError, match=r"^tensor 'w': placements\[0\]: shard\(1\) but the tensor has 1 dims$"):
        build(refit.TensorBuilder("w", "f32", [2]).mesh([2], ["shard(1)"]))
    with pytest.raises(refit.LayoutError, match=r"tensors\[0\] \('w'\): no placement: call mesh\(\) or shard\(\)"):
        build(refit.TensorBuilder("w", "f32", [2]))
    with pytest.raises(refit.LayoutError, match=r"tensor 'w': placements\[1\]: unknown placement 'shard\(x\)'"):
        refit.TensorBuilder("w", "f32", [2]).mesh([1, 1], ["replicate", "shard(x)"])
    with pytest.raises(refit.LayoutError, match="tensor 'w': unknown dtype 'float'"):
        refit.TensorBuilder("w", "float", [2])
    with pytest.raises(refit.LayoutError, match="give offset= and extent=, or flat="):
        refit.TensorBuilder("w", "f32", [2]).shard(0, flat=(0, 1), offset=[0])
    with pytest.raises(refit.LayoutError) as e:
        refit.Layout.from_json('{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [8], "mesh": {"shape": [4]}, "placements": ["shard(0)"]}]}')
    assert "mesh [4] has 4 positions but the layout has 2 ranks" in str(e.value)
    assert issubclass(refit.LayoutError, refit.RefitError)
    with pytest.raises(refit.RefitError, match="rank 5: the layout has 2 ranks"):
        build(refit.TensorBuilder("w", "f32", [2]).mesh([2], ["shard(0)"])).blocks(5)


# --- DTensor-like objects (duck-typed as refit reads real DTensors) ---------


class Shard:
    def __init__(self, dim):
        self.dim = dim

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class _StridedShard(Shard):
    def __init__(self, dim, split_factor):
        super().__init__(dim)
        self.split_factor = split_factor

    def __repr__(self):
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


class Replicate:
    pass


class Partial:
    pass


class Mesh:
    def __init__(self, ranks):
        self.mesh = ranks


class FakeDTensor:
    def __init__(self, shape, mesh, placements, dtype="torch.float32"):
        self.shape, self.device_mesh, self.placements, self.dtype = shape, Mesh(mesh), placements, dtype


def test_dtensor_shard_replicate_and_negative_dims():
    dt = FakeDTensor((8, 6), [[0, 1], [2, 3]], [Replicate(), Shard(-2)], "torch.bfloat16")
    layout = refit.layout_from_dtensors({"w": dt})
    expected = build(refit.TensorBuilder("w", "bf16", [8, 6]).mesh([2, 2], ["replicate", "shard(0)"]), ranks=4)
    assert layout == expected
    # A mesh over other ranks (a pipeline stage), listed in its own order.
    stage = FakeDTensor((8,), [6, 4], [Shard(0)])
    assert dtensor_placement(stage) == ([2], ["shard(0)"], [6, 4])
    layout = refit.layout_from_dtensors({"b": stage})
    assert layout.ranks == 7 and layout.blocks(6) == [("b", "f32", [0], [4])] and layout.blocks(4) == [("b", "f32", [4], [4])]


def test_fsdp2_tp_strided_shard_is_the_tp_major_mesh():
    # FSDP2 (dp) over TP (tp): mesh [dp=2, tp=2] of ranks [[0, 1], [2, 3]];
    # TP cuts the rows in 2, FSDP cuts each TP piece in 2 again. So rank
    # (d, t) holds rows 4t + 2d .. 4t + 2d + 2.
    dt = FakeDTensor((8, 3), [[0, 1], [2, 3]], [_StridedShard(0, split_factor=2), Shard(0)])
    assert dtensor_placement(dt) == ([2, 2], ["shard(0)", "shard(0)"], [0, 2, 1, 3])
    layout = refit.layout_from_dtensors({"w": dt})
    for d in range(2):
        for t in range(2):
            rank = 2 * d + t
            assert layout.blocks(rank) == [("w", "f32", [4 * t + 2 * d, 0], [2, 3])], rank
    # dp=3, tp=2: 12 rows, rank (d, t) holds rows 6t + 2d .. +2.
    dt = FakeDTensor((12,), [[0, 1], [2, 3], [4, 5]], [_StridedShard(0, split_factor=2), Shard(0)])
    layout = refit.layout_from_dtensors({"b": dt})
    for d in range(3):
        for t in range(2):
            assert layout.blocks(2 * d + t) == [("b", "f32", [6 * t + 2 * d], [2])]


def test_dtensor_refusals_say_why():
    with pytest.raises(refit.LayoutError, match="tensor 'w': placements\\[1\\]: .*partial.*reduce it"):
        refit.layout_from_dtensors({"w": FakeDTensor((4,), [[0, 1]], [Replicate(), Partial()])})
    with pytest.raises(refit.LayoutError, match="split_factor 3 does not match"):
        refit.layout_from_dtensors({"w": FakeDTensor((8,), [[0, 1], [2, 3]], [_StridedShard(0, split_factor=3), Shard(0)])})
    with pytest.raises(refit.LayoutError, match="uneven _StridedShard is not supported yet"):
        refit.layout_from_dtensors({"w": FakeDTensor((6,), [[0, 1], [2, 3]], [_StridedShard(0, split_factor=2), Shard(0)])})
    with pytest.raises(refit.LayoutError, match="shards dim 2 but the tensor has 2 dims"):
        refit.layout_from_dtensors({"w": FakeDTensor((4, 4), [0, 1], [Shard(2)])})
    with pytest.raises(refit.LayoutError, match="dtype torch.complex64 has no refit equivalent"):
        refit.layout_from_dtensors({"w": FakeDTensor((4,), [0, 1], [Shard(0)], "torch.complex64")})


def test_real_dtensors_when_torch_distributed_is_there():
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate as R, Shard as S
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        pytest.skip(f"torch.distributed.tensor or the fake process group missing: {e}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt = DTensor.from_local(torch.zeros(4, 6, dtype=torch.bfloat16), mesh, [R(), S(-2)], run_check=False)
        layout = refit.layout_from_dtensors({"w": dt})
        assert layout == build(refit.TensorBuilder("w", "bf16", [8, 6]).mesh([2, 2], ["replicate", "shard(0)"]), ranks=4)
    finally:
        dist.destroy_process_group()


def test_plain_parameters_of_parallelize_module_are_named_or_replicated():
    """torch's ``parallelize_module`` leaves the modules its plan does not
    name (a norm) as plain parameters: ``layout_from_dtensors`` names such
    a tensor and says what to do, and with ``plain="replicate"`` holds it
    whole on every rank."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        pytest.skip(f"torch.distributed.tensor.parallel or the fake process group missing: {e}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 8, bias=False), "norm": torch.nn.LayerNorm(8)})
        parallelize_module(model, mesh, {"proj": ColwiseParallel()})
        params = dict(model.named_parameters())
        with pytest.raises(refit.LayoutError, match=r"tensor 'norm.weight': a plain Parameter, not a DTensor: pass plain='replicate'"):
            refit.layout_from_dtensors(params)
        layout = refit.layout_from_dtensors(params, plain="replicate")
        assert layout.ranks == 2
        assert {n: (o, e) for n, _, o, e in layout.blocks(1)} == {
            "proj.weight": ([4, 0], [4, 4]),
            "norm.weight": ([0], [8]),
            "norm.bias": ([0], [8]),
        }
        with pytest.raises(refit.LayoutError, match="plain='shard'"):
            refit.layout_from_dtensors(params, plain="shard")
    finally:
        dist.destroy_process_group()


def test_tp_inference_layout_fuses_qkv_and_gate_up():
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": [8, 4],
        "model.layers.0.self_attn.k_proj.weight": [4, 4],
        "model.layers.0.self_attn.v_proj.weight": [4, 4],
        "model.layers.0.self_attn.o_proj.weight": [4, 8],
        "model.layers.0.mlp.gate_proj.weight": [6, 4],
        "model.layers.0.mlp.up_proj.weight": [6, 4],
        "model.layers.0.mlp.down_proj.weight": [4, 6],
        "model.norm.weight": [4],
    }
    layout = refit.tp_inference_layout(shapes, tp=2, dp=2)
    assert layout.ranks == 4
    # rank 3: replica 1, TP shard 1. qkv: q rows 4..8 (16 elements) at 0,
    # k rows 2..4 (8) at 16, v rows 2..4 at 24.
    buffers = dict((n, e) for n, _, e in layout.buffers(3))
    assert buffers["model.layers.0.self_attn.qkv_proj.weight"] == 32
    assert buffers["model.layers.0.mlp.gate_up_proj.weight"] == 24
    blocks = {n: (o, e) for n, _, o, e in layout.blocks(3)}
    assert blocks["model.layers.0.self_attn.q_proj.weight"] == ([4, 0], [4, 4])
    assert blocks["model.layers.0.self_attn.o_proj.weight"] == ([0, 4], [4, 4])
    assert blocks["model.layers.0.mlp.down_proj.weight"] == ([0, 3], [4, 3])
    assert blocks["model.norm.weight"] == ([0], [4])
    assert "shard(0)" in layout.to_json() and '"at": 16' in layout.to_json()
    with pytest.raises(refit.LayoutError, match="3 rows do not split evenly over tp=2"):
        refit.tp_inference_layout({"a.q_proj.weight": [3, 4], "a.k_proj.weight": [2, 4], "a.v_proj.weight": [2, 4]}, tp=2)
    with pytest.raises(refit.LayoutError, match="tp must be a multiple of num_kv_heads"):
        refit.tp_inference_layout(shapes, tp=4, num_kv_heads=3)
    with pytest.raises(refit.LayoutError, match="num_kv_heads=3 does not split evenly over tp=2"):
        refit.tp_inference_layout(shapes, tp=2, num_kv_heads=3)
    with pytest.raises(refit.LayoutError, match="'model.layers.0.self_attn.k_proj.weight': shape \\[4, 4\\] does not hold num_kv_heads=8"):
        refit.tp_inference_layout(shapes, tp=8, num_kv_heads=8)


def check_kv_replicated(tp, dp, num_kv_heads, fuse):
    """Refit a GQA attention block (q: 8 heads, k/v: `num_kv_heads` heads of
    2 rows, hidden 3) from TP 2 training ranks into `tp_inference_layout`
    and compare every inference rank's buffers with what vLLM's
    QKVParallelLinear holds: its q heads, then whole KV head
    `t // (tp // num_kv_heads)` of k and of v."""
    head, hidden, heads = 2, 3, 8
    names = ["a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight", "a.k_proj.bias"]
    rows = {"a.q_proj.weight": heads * head, "a.k_proj.weight": num_kv_heads * head, "a.v_proj.weight": num_kv_heads * head, "a.k_proj.bias": num_kv_heads * head}
    shapes = {n: [rows[n], hidden] if n.endswith("weight") else [rows[n]] for n in names}
    full = {n: np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * i for i, (n, shape) in enumerate(shapes.items())}
    train = refit.LayoutBuilder(2)
    for n, shape in shapes.items():
        train = train.tensor(refit.TensorBuilder(n, "f32", shape).mesh([2], ["shard(0)"]))
    infer = refit.tp_inference_layout(shapes, tp=tp, dp=dp, dtype="f32", num_kv_heads=num_kv_heads, fuse=fuse)
    system = refit.spawn_local(train.build(), infer)
    for s in system.sources:
        for n in names:
            offset, extent = s.block(n)
            s.register(n, np.ascontiguousarray(full[n][tuple(slice(o, o + e) for o, e in zip(offset, extent))]))
        s.step()
    got = []
    for d in system.destinations:
        # Fused buffers whole, every other tensor as its block.
        arrays = {b: np.zeros(e, np.float32) for b, _, e in infer.buffers(d.rank) if "#" not in b}
        fused = {"a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"} if arrays else set()
        arrays.update({n: np.zeros(extent, np.float32) for n, _, _, extent in infer.blocks(d.rank) if n not in fused})
        d.register_all(arrays)
        got.append(arrays)
    system.refit_latest()
    per_q, kv_replicas = heads * head // tp, max(1, tp // num_kv_heads)
    for rank, arrays in enumerate(got):
        system.destinations[rank].load()
        t = rank % tp
        if num_kv_heads < tp:
            kv_rows = slice(t // kv_replicas * head, (t // kv_replicas + 1) * head)
        else:
            kv_rows = slice(t * num_kv_heads * head // tp, (t + 1) * num_kv_heads * head // tp)
        want = {
            "a.q_proj.weight": full["a.q_proj.weight"][t * per_q:(t + 1) * per_q],
            "a.k_proj.weight": full["a.k_proj.weight"][kv_rows],
            "a.v_proj.weight": full["a.v_proj.weight"][kv_rows],
            "a.k_proj.bias": full["a.k_proj.bias"][kv_rows],
        }
        if fuse:
            qkv = np.concatenate([want[n].ravel() for n in ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight")])
            np.testing.assert_array_equal(arrays["a.qkv_proj.weight"], qkv, err_msg=f"rank {rank}")
            np.testing.assert_array_equal(arrays["a.k_proj.bias"], want["a.k_proj.bias"], err_msg=f"rank {rank}")
        else:
            for n in names:
                np.testing.assert_array_equal(arrays[n].reshape(want[n].shape), want[n], err_msg=f"rank {rank}: {n}")
    system.orchestrator.close()


@pytest.mark.parametrize("tp,dp,num_kv_heads,fuse", [(4, 2, 2, True), (8, 1, 2, True), (4, 1, 1, False), (2, 1, 4, True)])
def test_tp_inference_layout_replicates_whole_kv_heads(tp, dp, num_kv_heads, fuse):
    check_kv_replicated(tp, dp, num_kv_heads, fuse)


def refit_whole_model(shapes, infer):
    """Refits from one training rank holding every tensor of `shapes`
    (tensor i: arange + 100 i, f32) into the layout `infer`, where every
    destination registers its fused buffers whole and its other tensors'
    blocks. Returns the training values and each destination's arrays
    (fused buffers by buffer name, the others by tensor name)."""
    full = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + 100 * i for i, (n, s) in enumerate(shapes.items())}
    train = refit.LayoutBuilder(1)
    for n, shape in shapes.items():
        train = train.tensor(refit.TensorBuilder(n, "f32", shape).mesh([1], ["replicate"]))
    system = refit.spawn_local(train.build(), infer)
    system.sources[0].register_all({n: full[n].copy() for n in shapes})
    system.sources[0].step()
    got = []
    for d in system.destinations:
        buffers = infer.buffers(d.rank)
        own = {b.split("#")[0] for b, _, _ in buffers if "#" in b}  # a tensor's own buffer: "name#k"
        arrays = {b: np.zeros(e, np.float32) for b, _, e in buffers if "#" not in b}
        arrays.update({n: np.zeros(extent, np.float32) for n, _, _, extent in infer.blocks(d.rank) if n in own})
        d.register_all(arrays)
        got.append(arrays)
    system.refit_latest()
    for d in system.destinations:
        d.load()
    system.orchestrator.close()
    return full, got


def check_fused_moe(tp, dp, ep):
    """Refit a MoE layer (4 experts, I=4, H=3, a router and a shared
    expert) from one training rank holding everything into
    `tp_inference_layout` and compare every rank's FusedMoE buffers with
    what vLLM holds: w13 = [gate_e; up_e] and w2 = [down_e] per local
    expert, TP shares without `ep`, whole experts k*E/ep.. with it."""
    experts, inter, hidden = 4, 4, 3
    shapes = {"m.mlp.gate.weight": [experts, hidden], "m.mlp.shared_experts.gate_proj.weight": [inter, hidden],
              "m.mlp.shared_experts.up_proj.weight": [inter, hidden], "m.mlp.shared_experts.down_proj.weight": [hidden, inter]}
    for e in range(experts):
        shapes.update({f"m.mlp.experts.{e}.gate_proj.weight": [inter, hidden], f"m.mlp.experts.{e}.up_proj.weight": [inter, hidden],
                       f"m.mlp.experts.{e}.down_proj.weight": [hidden, inter]})
    full, got = refit_whole_model(shapes, refit.tp_inference_layout(shapes, tp=tp, dp=dp, dtype="f32", ep=ep))
    expert = lambda e, p: full[f"m.mlp.experts.{e}.{p}.weight"]  # noqa: E731
    for rank, arrays in enumerate(got):
        t = rank % tp
        if ep is None:
            rows = slice(t * inter // tp, (t + 1) * inter // tp)
            local = [(expert(e, "gate_proj")[rows], expert(e, "up_proj")[rows], expert(e, "down_proj")[:, rows]) for e in range(experts)]
        else:
            k = rank % ep
            local = [(expert(e, "gate_proj"), expert(e, "up_proj"), expert(e, "down_proj")) for e in range(k * experts // ep, (k + 1) * experts // ep)]
        w13 = np.concatenate([np.concatenate([g.ravel(), u.ravel()]) for g, u, _ in local])
        w2 = np.concatenate([d.ravel() for _, _, d in local])
        np.testing.assert_array_equal(arrays["m.mlp.experts.w13_weight"], w13, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(arrays["m.mlp.experts.w2_weight"], w2, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(arrays["m.mlp.gate.weight"], full["m.mlp.gate.weight"], err_msg=f"rank {rank}")
        rows = slice(t * inter // tp, (t + 1) * inter // tp)
        shared = np.concatenate([full[f"m.mlp.shared_experts.{p}.weight"][rows].ravel() for p in ("gate_proj", "up_proj")])
        np.testing.assert_array_equal(arrays["m.mlp.shared_experts.gate_up_proj.weight"], shared, err_msg=f"rank {rank}")


@pytest.mark.parametrize("tp,dp,ep", [(2, 2, None), (2, 2, 4), (2, 2, 2), (1, 4, 4)])
def test_tp_inference_layout_lays_experts_out_as_fused_moe(tp, dp, ep):
    check_fused_moe(tp, dp, ep)


def test_tp_inference_layout_refuses_experts_it_cannot_place():
    base = {f"m.experts.{e}.{p}.weight": ([4, 3] if p != "down_proj" else [3, 4]) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(refit.LayoutError, match="ep=3: an EP group must be a multiple of tp=2"):
        refit.tp_inference_layout(base, tp=2, dp=2, ep=3)
    with pytest.raises(refit.LayoutError, match="4 experts do not split evenly over ep=8"):
        refit.tp_inference_layout(base, tp=2, dp=4, ep=8)
    with pytest.raises(refit.LayoutError, match="intermediate size 4 does not split evenly over tp=8"):
        refit.tp_inference_layout(base, tp=8)
    gap = {n: s for n, s in base.items() if ".2." not in n}
    with pytest.raises(refit.LayoutError, match=r"experts \[0, 1, 3\] are not 0..2"):
        refit.tp_inference_layout(gap, tp=2)
    no_down = {n: s for n, s in base.items() if n != "m.experts.1.down_proj.weight"}
    with pytest.raises(refit.LayoutError, match=r"'m.experts.1': no \['down_proj'\]"):
        refit.tp_inference_layout(no_down, tp=2)


def test_tp_inference_layout_places_mla_as_vllm_does():
    """DeepSeek's MLA at TP 2: q_a_proj and kv_a_proj_with_mqa replicated in
    one fused_qkv_a_proj buffer, q_b_proj and kv_b_proj split by rows,
    o_proj by columns, the norms replicated; checked by a refit."""
    heads, qk, v, q_lora, kv_lora, rope, hidden = 4, 3, 2, 5, 4, 2, 6
    shapes = {"a.q_a_proj.weight": [q_lora, hidden], "a.q_a_layernorm.weight": [q_lora], "a.q_b_proj.weight": [heads * qk, q_lora],
              "a.kv_a_proj_with_mqa.weight": [kv_lora + rope, hidden], "a.kv_a_layernorm.weight": [kv_lora],
              "a.kv_b_proj.weight": [heads * (qk - rope + v), kv_lora], "a.o_proj.weight": [hidden, heads * v]}
    full, got = refit_whole_model(shapes, refit.tp_inference_layout(shapes, tp=2, dtype="f32"))
    for t, arrays in enumerate(got):
        half = lambda n: full[n][t * full[n].shape[0] // 2:(t + 1) * full[n].shape[0] // 2]  # noqa: E731
        fused = np.concatenate([full["a.q_a_proj.weight"].ravel(), full["a.kv_a_proj_with_mqa.weight"].ravel()])
        np.testing.assert_array_equal(arrays["a.fused_qkv_a_proj.weight"], fused)
        np.testing.assert_array_equal(arrays["a.q_b_proj.weight"], half("a.q_b_proj.weight"))
        np.testing.assert_array_equal(arrays["a.kv_b_proj.weight"], half("a.kv_b_proj.weight"))
        np.testing.assert_array_equal(arrays["a.o_proj.weight"], full["a.o_proj.weight"][:, t * heads * v // 2:(t + 1) * heads * v // 2])
        np.testing.assert_array_equal(arrays["a.kv_a_layernorm.weight"], full["a.kv_a_layernorm.weight"])


def megatron_params(full, tp, pp, heads, groups, vocab_multiple, dp=1, ep=1, etp=None, grouped=True, local=False):
    """What Megatron-Core holds on each rank (t + tp * (d + dp * p)) of the
    HF tensors `full`, built the way Megatron defines it: linear_qkv is the
    whole [q_g; k_g; v_g]-by-group matrix split by rows over TP (evenly, a
    ColumnParallelLinear, however few groups), linear_fc1 each rank's
    [gate_t; up_t], vocab rows padded then split; in MoE layers a stage's
    rank r is expert-TP rank r % etp of EP rank r // etp % ep, which holds
    experts k * E / ep .. whole but for expert TP. `local`: the local
    layer spec's names (get_gpt_layer_local_spec: no norm fused into a
    linear layer)."""
    etp = etp or tp
    layers = len({n.split(".")[2] for n in full if n.startswith("model.layers.")})
    per_stage = layers // pp
    head = full["model.layers.0.self_attn.q_proj.weight"].shape[0] // heads if "model.layers.0.self_attn.q_proj.weight" in full else 0
    q_per = heads // groups * head
    split = lambda x, t, ways=tp, axis=0: np.ascontiguousarray(np.split(x, ways, axis=axis)[t])  # noqa: E731
    fc1 = lambda gate, up, t, ways=tp: np.concatenate([split(gate, t, ways), split(up, t, ways)])  # noqa: E731

    def attention(mine, mg, hf, t):
        for kind in ("weight", "bias"):
            q, k, v = (hf(f"self_attn.{x}_proj.{kind}") for x in "qkv")
            whole = np.concatenate([np.concatenate([q[g * q_per:(g + 1) * q_per], k[g * head:(g + 1) * head], v[g * head:(g + 1) * head]]) for g in range(groups)])
            mine[mg + f"self_attention.linear_qkv.{kind}"] = split(whole, t)
        mine[mg + "self_attention.linear_proj.weight"] = split(hf("self_attn.o_proj.weight"), t, axis=1)
        mine[mg + "self_attention.linear_qkv.layer_norm_weight"] = hf("input_layernorm.weight").copy()
        mine[mg + "self_attention.q_layernorm.weight"] = hf("self_attn.q_norm.weight").copy()
        mine[mg + "self_attention.k_layernorm.weight"] = hf("self_attn.k_norm.weight").copy()

    ranks = [dict() for _ in range(tp * dp * pp)]
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * d  # within the stage
                mine = ranks[r + tp * dp * p]
                for i in range(per_stage):
                    hf = lambda n: full[f"model.layers.{p * per_stage + i}.{n}"]  # noqa: E731
                    has = lambda n: f"model.layers.{p * per_stage + i}.{n}" in full  # noqa: E731
                    mg = f"decoder.layers.{i}."
                    if has("self_attn.kv_a_proj_with_mqa.weight"):  # MLA, Transformer Engine spec
                        mine[mg + "input_layernorm.weight"] = hf("input_layernorm.weight").copy()
                        mine[mg + "self_attention.linear_q_down_proj.weight"] = hf("self_attn.q_a_proj.weight").copy()
                        mine[mg + "self_attention.linear_q_up_proj.layer_norm_weight"] = hf("self_attn.q_a_layernorm.weight").copy()
                        mine[mg + "self_attention.linear_q_up_proj.weight"] = split(hf("self_attn.q_b_proj.weight"), t)
                        mine[mg + "self_attention.linear_kv_down_proj.weight"] = hf("self_attn.kv_a_proj_with_mqa.weight").copy()
                        mine[mg + "self_attention.linear_kv_up_proj.layer_norm_weight"] = hf("self_attn.kv_a_layernorm.weight").copy()
                        mine[mg + "self_attention.linear_kv_up_proj.weight"] = split(hf("self_attn.kv_b_proj.weight"), t)
                        mine[mg + "self_attention.linear_proj.weight"] = split(hf("self_attn.o_proj.weight"), t, axis=1)
                    else:
                        attention(mine, mg, hf, t)
                    if not has("mlp.experts.0.gate_proj.weight"):
                        mine[mg + "mlp.linear_fc1.layer_norm_weight"] = hf("post_attention_layernorm.weight").copy()
                        mine[mg + "mlp.linear_fc1.weight"] = fc1(hf("mlp.gate_proj.weight"), hf("mlp.up_proj.weight"), t)
                        mine[mg + "mlp.linear_fc2.weight"] = split(hf("mlp.down_proj.weight"), t, axis=1)
                        continue
                    mine[mg + "pre_mlp_layernorm.weight"] = hf("post_attention_layernorm.weight").copy()
                    mine[mg + "mlp.router.weight"] = hf("mlp.gate.weight").copy()
                    mine[mg + "mlp.router.expert_bias"] = hf("mlp.gate.e_score_correction_bias").copy()
                    shared = "mlp.shared_experts." if has("mlp.shared_experts.gate_proj.weight") else "mlp.shared_expert."
                    mine[mg + "mlp.shared_experts.linear_fc1.weight"] = fc1(hf(shared + "gate_proj.weight"), hf(shared + "up_proj.weight"), t)
                    mine[mg + "mlp.shared_experts.linear_fc2.weight"] = split(hf(shared + "down_proj.weight"), t, axis=1)
                    if has("mlp.shared_expert_gate.weight"):
                        mine[mg + "mlp.shared_experts.gate_weight"] = hf("mlp.shared_expert_gate.weight").copy()
                    count = len([n for n in full if n.startswith(f"model.layers.{p * per_stage + i}.mlp.experts.") and n.endswith("down_proj.weight")])
                    et, k = r % etp, r // etp % ep
                    for j in range(count // ep):
                        e = k * count // ep + j
                        x = lambda n: hf(f"mlp.experts.{e}.{n}_proj.weight")  # noqa: E731
                        names = (f"mlp.experts.linear_fc1.weight{j}", f"mlp.experts.linear_fc2.weight{j}") if grouped else \
                            (f"mlp.experts.local_experts.{j}.linear_fc1.weight", f"mlp.experts.local_experts.{j}.linear_fc2.weight")
                        mine[mg + names[0]] = fc1(x("gate"), x("up"), et, etp)
                        mine[mg + names[1]] = split(x("down"), et, etp, 1)
                for hf_name, mg_name, stage in (("model.embed_tokens.weight", "embedding.word_embeddings.weight", 0), ("lm_head.weight", "output_layer.weight", pp - 1)):
                    if p == stage:
                        vocab, hidden = full[hf_name].shape
                        padded = np.zeros((-(-vocab // (vocab_multiple * tp)) * vocab_multiple * tp, hidden), np.float32)
                        padded[:vocab] = full[hf_name]
                        mine[mg_name] = split(padded, t)
                if p == pp - 1:
                    mine["decoder.final_layernorm.weight"] = full["model.norm.weight"].copy()
    if local:
        renamed = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                   "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
                   "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight"}
        for mine in ranks:
            for name in list(mine):
                for te, loc in renamed.items():
                    if name.endswith("." + te):
                        mine[name[: -len(te)] + loc] = mine.pop(name)
    return ranks


def model_shapes(layers, heads, groups, head, hidden, ffn, vocab, experts=0, moe_from=0, mla=None, qwen2_shared=False):
    """HF shapes of a Qwen3-like model (GQA, q/k norms, QKV biases, untied
    head); with `experts`, layers from `moe_from` on are MoE layers with
    that many routed experts (intermediate `ffn`), a router with a score
    bias and shared experts (DeepSeek names; `qwen2_shared`: Qwen2-MoE's one
    gated shared expert); with `mla` (q_lora, kv_lora, nope, rope, v),
    DeepSeek's multi-latent attention instead."""
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    for l in range(layers):
        p = f"model.layers.{l}."
        if mla:
            q_lora, kv_lora, nope, rope, v = mla
            shapes.update({p + "self_attn.q_a_proj.weight": [q_lora, hidden], p + "self_attn.q_a_layernorm.weight": [q_lora],
                           p + "self_attn.q_b_proj.weight": [heads * (nope + rope), q_lora],
                           p + "self_attn.kv_a_proj_with_mqa.weight": [kv_lora + rope, hidden], p + "self_attn.kv_a_layernorm.weight": [kv_lora],
                           p + "self_attn.kv_b_proj.weight": [heads * (nope + v), kv_lora], p + "self_attn.o_proj.weight": [hidden, heads * v]})
        else:
            shapes.update({p + "self_attn.q_proj.weight": [heads * head, hidden], p + "self_attn.k_proj.weight": [groups * head, hidden],
                           p + "self_attn.v_proj.weight": [groups * head, hidden], p + "self_attn.q_proj.bias": [heads * head],
                           p + "self_attn.k_proj.bias": [groups * head], p + "self_attn.v_proj.bias": [groups * head],
                           p + "self_attn.o_proj.weight": [hidden, heads * head], p + "self_attn.q_norm.weight": [head],
                           p + "self_attn.k_norm.weight": [head]})
        shapes.update({p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden]})
        shared = "mlp.shared_expert." if qwen2_shared else "mlp.shared_experts."
        mlps = ["mlp."] if not experts or l < moe_from else [shared] + [f"mlp.experts.{e}." for e in range(experts)]
        for m in mlps:
            shapes.update({p + m + "gate_proj.weight": [ffn, hidden], p + m + "up_proj.weight": [ffn, hidden], p + m + "down_proj.weight": [hidden, ffn]})
        if experts and l >= moe_from:
            shapes.update({p + "mlp.gate.weight": [experts, hidden], p + "mlp.gate.e_score_correction_bias": [experts]})
            if qwen2_shared:
                shapes[p + "mlp.shared_expert_gate.weight"] = [1, hidden]
    return shapes


def check_megatron(shapes, train, infer, params):
    """Refits Megatron's parameters `params` (per rank) laid out as `train`
    into `infer` (tensors in their own buffers) and checks every inference
    block against the HF tensor; every Megatron parameter must be a buffer
    of `train`, and nothing else."""
    full = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1000 * i for i, (n, s) in enumerate(shapes.items())}
    system = refit.spawn_local(train, infer)
    for rank, params in enumerate(params(full)):
        buffers = {b for b, _, _ in train.buffers(rank)}
        assert buffers == set(params), f"rank {rank}: {buffers ^ set(params)}"
        system.sources[rank].register_all(refit.param_buffers(train, rank, params))
        system.sources[rank].step()
    got = []
    for d in system.destinations:
        arrays = {n: np.zeros(extent, np.float32) for n, _, _, extent in infer.blocks(d.rank)}
        d.register_all(arrays)
        got.append(arrays)
    system.refit_latest()
    for d, arrays in zip(system.destinations, got):
        d.load()
        for name, _, offset, extent in infer.blocks(d.rank):
            np.testing.assert_array_equal(arrays[name], block(full[name], offset, extent), err_msg=f"dst rank {d.rank}: {name}")
    system.orchestrator.close()


def test_megatron_layout_moves_interleaved_qkv_into_vllm_shards():
    """A Qwen3-like model (GQA with 4 query groups of 2 heads, q/k norms, QKV
    biases, untied head, vocabulary padded) held as Megatron-Core holds it
    at TP 2 x PP 2 (2 groups per rank), refit into vLLM TP 8 (KV heads
    replicated): every inference block equals the HF tensor's; every
    Megatron parameter is a buffer of the layout, and nothing else is."""
    heads, groups = 8, 4
    shapes = model_shapes(4, heads, groups, head=2, hidden=6, ffn=8, vocab=10)
    train = refit.megatron_layout(shapes, tp=2, pp=2, num_attention_heads=heads, num_kv_heads=groups, dtype="f32", vocab_multiple=4)
    infer = refit.tp_inference_layout(shapes, tp=8, dtype="f32", num_kv_heads=groups, fuse=False)
    check_megatron(shapes, train, infer, lambda full: megatron_params(full, 2, 2, heads, groups, 4))


@pytest.mark.parametrize(
    "dp,ep,etp,grouped,qwen2_shared",
    [(2, 2, 1, True, False), (1, 1, 2, False, False), (2, 4, 1, True, True), (2, 1, 2, True, False), (2, 2, 2, False, True), (4, 2, 2, True, False)],
)
def test_megatron_layout_places_moe_layers_on_the_expert_grid(dp, ep, etp, grouped, qwen2_shared):
    """A layer dense, the next MoE (4 routed experts, router with score bias,
    shared experts: DeepSeek's, or Qwen2-MoE's gated one) at TP 2 x DP dp,
    experts EP ep x expert-TP etp, grouped or sequential expert parameters;
    refit into vLLM TP 2 x DP dp."""
    heads, groups = 4, 2
    shapes = model_shapes(2, heads, groups, head=2, hidden=6, ffn=4, vocab=10, experts=4, moe_from=1, qwen2_shared=qwen2_shared)
    train = refit.megatron_layout(shapes, tp=2, dp=dp, num_attention_heads=heads, num_kv_heads=groups, dtype="f32", vocab_multiple=4,
                                  ep=ep, etp=etp, grouped_experts=grouped)
    infer = refit.tp_inference_layout(shapes, tp=2, dp=dp, dtype="f32", num_kv_heads=groups, fuse=False)
    check_megatron(shapes, train, infer, lambda full: megatron_params(full, 2, 1, heads, groups, 4, dp=dp, ep=ep, etp=etp, grouped=grouped))


def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]


def test_megatron_layout_places_mla_as_transformer_engine_builds_it():
    """DeepSeek-like: multi-latent attention in both layers (down-projections
    replicated, up-projections by heads with their norms fused in), the
    second layer MoE (EP 2), at TP 2 x DP 2, refit into vLLM TP 2 x DP 2."""
    heads = 4
    shapes = model_shapes(2, heads, heads, head=0, hidden=6, ffn=4, vocab=10, experts=4, moe_from=1, mla=(5, 4, 3, 2, 2))
    train = refit.megatron_layout(shapes, tp=2, dp=2, num_attention_heads=heads, dtype="f32", vocab_multiple=4, ep=2, etp=1)
    infer = refit.tp_inference_layout(shapes, tp=2, dp=2, dtype="f32", fuse=False)
    check_megatron(shapes, train, infer, lambda full: megatron_params(full, 2, 1, heads, heads, 4, dp=2, ep=2, etp=1))


@pytest.mark.parametrize("tp,heads,groups,head", [(2, 4, 1, 2), (4, 4, 2, 2), (4, 4, 1, 2), (8, 8, 2, 4)])
def test_megatron_layout_splits_fewer_query_groups_than_tp_as_megatron_core_does(tp, heads, groups, head):
    """Fewer query groups than TP ranks: Megatron-Core's linear_qkv is still
    one ColumnParallelLinear, the whole interleaved [q_g; k_g; v_g] matrix
    split evenly by rows, so a rank holds part of a group, cut at any row
    (TP 4 of one group of 4 heads of 2 rows: 3 rows each, mid-head), its KV
    heads on no other rank; refit into vLLM at the same TP (whole KV heads
    replicated) and at TP 1."""
    shapes = model_shapes(2, heads, groups, head=head, hidden=8, ffn=2 * tp, vocab=30)
    train = refit.megatron_layout(shapes, tp=tp, num_attention_heads=heads, num_kv_heads=groups, dtype="f32", vocab_multiple=4)
    for infer_tp in (tp, 1):
        infer = refit.tp_inference_layout(shapes, tp=infer_tp, dtype="f32", num_kv_heads=groups, fuse=False)
        check_megatron(shapes, train, infer, lambda full: megatron_params(full, tp, 1, heads, groups, 4))


@pytest.mark.parametrize("kind", ["dense", "moe", "mla"])
def test_megatron_layout_names_the_local_layer_specs_norms(kind):
    """layer_spec="local" (Megatron-Core's get_gpt_layer_local_spec): the
    norms are input_layernorm / pre_mlp_layernorm of their own (MLA's
    q_layernorm / kv_layernorm), nothing fused into a linear layer; MoE
    layers with SequentialMLP experts. The Transformer Engine names are
    refused by param_buffers, saying which spec the model has."""
    heads, groups = 4, 2
    if kind == "mla":
        shapes = model_shapes(2, heads, heads, head=0, hidden=6, ffn=4, vocab=10, experts=4, moe_from=1, mla=(5, 4, 3, 2, 2))
        groups = heads
    else:
        shapes = model_shapes(2, heads, groups, head=2, hidden=6, ffn=4, vocab=10, experts=4 if kind == "moe" else 0, moe_from=1)
    kw = dict(ep=2, etp=1, grouped_experts=False) if kind != "dense" else {}
    train = refit.megatron_layout(shapes, tp=2, dp=2, num_attention_heads=heads, num_kv_heads=groups, dtype="f32", vocab_multiple=4,
                                  layer_spec="local", **kw)
    infer = refit.tp_inference_layout(shapes, tp=2, dp=2, dtype="f32", num_kv_heads=groups, fuse=False)
    params = lambda full: megatron_params(full, 2, 1, heads, groups, 4, dp=2, ep=kw.get("ep", 1), etp=kw.get("etp"), grouped=False, local=True)  # noqa: E731
    check_megatron(shapes, train, infer, params)
    full = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    te = refit.megatron_layout(shapes, tp=2, dp=2, num_attention_heads=heads, num_kv_heads=groups, dtype="f32", vocab_multiple=4, **kw)
    want = "decoder.layers.0.input_layernorm.weight" if kind != "mla" else "decoder.layers.0.self_attention.q_layernorm.weight"
    with pytest.raises(refit.TensorError, match="no parameter") as e:
        refit.param_buffers(te, 0, params(full)[0])
    if kind != "mla":
        assert f"the model has '{want}'" in str(e.value) and "layer_spec='local'" in str(e.value), e.value
        with pytest.raises(refit.TensorError, match="layer_spec='transformer_engine'"):
            refit.param_buffers(train, 0, megatron_params(full, 2, 1, heads, groups, 4, dp=2, ep=kw.get("ep", 1), etp=kw.get("etp"), grouped=False)[0])


def test_megatron_layout_refuses_what_it_cannot_place():
    base = {"model.layers.0.self_attn.q_proj.weight": [8, 6], "model.layers.0.self_attn.k_proj.weight": [4, 6]}
    with pytest.raises(refit.LayoutError, match="num_kv_heads=2 and tp=3: Megatron-Core needs the query groups a multiple or a divisor of tp"):
        refit.megatron_layout(base, tp=3, num_attention_heads=6, num_kv_heads=2)
    with pytest.raises(refit.LayoutError, match="num_attention_heads=2 does not split over tp=4"):
        refit.megatron_layout(base, tp=4, num_attention_heads=2, num_kv_heads=1)
    odd = {"model.layers.0.self_attn.q_proj.weight": [4, 6], "model.layers.0.self_attn.k_proj.weight": [1, 6]}
    with pytest.raises(refit.LayoutError, match=r"'model.layers.0.self_attn.q_proj.weight': linear_qkv's 6 rows \(1 query groups of 6\) do not split evenly over tp=4"):
        refit.megatron_layout(odd, tp=4, num_attention_heads=4, num_kv_heads=1)
    with pytest.raises(refit.LayoutError, match="layer_spec='apex': expected one of"):
        refit.megatron_layout(base, tp=2, num_attention_heads=4, num_kv_heads=2, layer_spec="apex")
    experts = {f"model.layers.0.mlp.experts.{e}.{p}.weight": [4, 6] for e in (0, 1) for p in ("gate_proj", "up_proj")}
    with pytest.raises(refit.LayoutError, match="'model.layers.0.mlp.experts.0.gate_proj.weight': the local layer spec's grouped experts"):
        refit.megatron_layout({**base, **experts}, tp=2, num_attention_heads=4, num_kv_heads=2, layer_spec="local")
    with pytest.raises(refit.LayoutError, match="'model.layers.0.self_attn.k_proj.weight': not a weight of multi-latent attention"):
        refit.megatron_layout({**base, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": [4, 6]}, tp=2, num_attention_heads=4, num_kv_heads=2)
    with pytest.raises(refit.LayoutError, match="multi-latent attention weights in a layer without kv_a_proj_with_mqa"):
        refit.megatron_layout({"model.layers.0.self_attn.q_a_proj.weight": [4, 6]}, tp=2, num_attention_heads=4)
    experts = {f"model.layers.0.mlp.experts.{e}.{p}.weight": [4, 6] for e in (0, 1, 3) for p in ("gate_proj", "up_proj")}
    with pytest.raises(refit.LayoutError, match=r"'model.layers.0.mlp.experts': experts \[0, 1, 3\] are not 0..2"):
        refit.megatron_layout({**base, **experts}, tp=2, num_attention_heads=4, num_kv_heads=2)
    with pytest.raises(refit.LayoutError, match="ep=4 x etp=2 does not divide the 4 ranks of a stage"):
        refit.megatron_layout(base, tp=2, dp=2, ep=4, num_attention_heads=4, num_kv_heads=2)
    with pytest.raises(refit.LayoutError, match="3 rows do not split evenly over etp=2"):
        refit.megatron_layout({"model.layers.0.mlp.experts.0.gate_proj.weight": [3, 6]}, tp=2, num_attention_heads=2)
    with pytest.raises(refit.LayoutError, match="'model.layers.0.self_attn.k_proj.weight': 4 rows, expected 2"):
        refit.megatron_layout(base, tp=1, num_attention_heads=4, num_kv_heads=1)
    with pytest.raises(refit.LayoutError, match="'model.visual.patch.weight': 'model.visual.patch.weight' is not a Llama/Qwen/DeepSeek weight"):
        refit.megatron_layout({**base, "model.visual.patch.weight": [2]}, tp=2, num_attention_heads=4, num_kv_heads=2)
    with pytest.raises(refit.LayoutError, match="1 layers do not split evenly over pp=2"):
        refit.megatron_layout(base, tp=2, pp=2, num_attention_heads=4, num_kv_heads=2)


def test_megatron_layout_ranks_are_tp_fastest_then_dp_then_pp():
    shapes = {f"model.layers.{l}.mlp.down_proj.weight": [4, 8] for l in range(2)}
    layout = refit.megatron_layout(shapes, tp=2, dp=3, pp=2, num_attention_heads=2)
    assert layout.ranks == 12
    for p in range(2):
        for d in range(3):
            for t in range(2):
                rank = t + 2 * (d + 3 * p)
                assert layout.blocks(rank) == [(f"model.layers.{p}.mlp.down_proj.weight", "bf16", [0, 4 * t], [4, 4])], rank
                assert layout.buffers(rank) == [("decoder.layers.0.mlp.linear_fc2.weight", "bf16", 16)], rank


def test_tp_inference_layout_splits_the_padded_vocabulary_as_the_engines_do():
    """vLLM / SGLang pad the vocabulary to a multiple of 64 and give TP
    rank t rows t * P / tp .. of it: 100 rows at TP 4 are 32, 32, 32 and 4
    (an even split would be 25 each)."""
    shapes = {"model.embed_tokens.weight": [100, 4], "lm_head.weight": [100, 4]}
    layout = refit.tp_inference_layout(shapes, tp=4, dp=2)
    for rank in range(8):
        t = rank % 4
        want = [(n, "bf16", [32 * t, 0], [min(32, 100 - 32 * t), 4]) for n in shapes]
        assert layout.blocks(rank) == want, rank
    even = refit.tp_inference_layout(shapes, tp=4, vocab_padding=1)
    assert [b[3] for b in even.blocks(3)] == [[25, 4], [25, 4]]
    with pytest.raises(refit.LayoutError, match="the padded vocabulary 100 does not split over tp=8"):
        refit.tp_inference_layout(shapes, tp=8, vocab_padding=50)


def test_builders_share_what_came_before_and_stay_unchanged():
    """Each call returns a new builder and leaves the one it was called on
    as it was (a chain shared between them, not copied: a model of tens of
    thousands of tensors builds in about a second); a chain of 300,000
    shards is dropped without exhausting the stack."""
    t = refit.TensorBuilder("w", "f32", [4]).shard(0, offset=[0], extent=[2])
    more = t.shard(1, offset=[2], extent=[2])
    b = refit.LayoutBuilder(2).tensor(more)
    assert refit.LayoutBuilder(2).tensor(t).build().blocks(1) == []  # `t` never got the second shard
    both = b.tensor(refit.TensorBuilder("b", "f32", [2]).mesh([2], ["replicate"]))
    assert [n for n, *_ in b.build().blocks(1)] == ["w"]
    assert [n for n, *_ in both.build().blocks(1)] == ["w", "b"]
    long = refit.TensorBuilder("x", "f32", [1])
    for _ in range(300_000):
        long = long.shard(0, offset=[0], extent=[1])
    del long


def test_param_buffers_hands_the_engines_parameters_to_a_destination():
    """vLLM-like parameters of one inference rank (fused qkv_proj and
    gate_up_proj, an embedding padded to 64 rows per TP share) registered
    through param_buffers: a refit writes the tensors' rows in place and
    leaves the padding rows alone."""
    shapes = {"model.embed_tokens.weight": [100, 4], "model.layers.0.self_attn.q_proj.weight": [4, 4],
              "model.layers.0.self_attn.k_proj.weight": [4, 4], "model.layers.0.self_attn.v_proj.weight": [4, 4],
              "model.layers.0.mlp.gate_proj.weight": [2, 4], "model.layers.0.mlp.up_proj.weight": [2, 4], "model.norm.weight": [4]}
    full = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1000 * i for i, (n, s) in enumerate(shapes.items())}
    train = refit.LayoutBuilder(1)
    for n, shape in shapes.items():
        train = train.tensor(refit.TensorBuilder(n, "f32", shape).mesh([1], ["replicate"]))
    infer = refit.tp_inference_layout(shapes, tp=2, dtype="f32")
    system = refit.spawn_local(train.build(), infer)
    system.sources[0].register_all({n: full[n].copy() for n in shapes})
    system.sources[0].step()
    engines = []
    for d in system.destinations:
        params = {"model.embed_tokens.weight": np.full((64, 4), 7, np.float32), "model.norm.weight": np.zeros(4, np.float32),
                  "model.layers.0.self_attn.qkv_proj.weight": np.zeros((6, 4), np.float32),
                  "model.layers.0.mlp.gate_up_proj.weight": np.zeros((2, 4), np.float32)}
        d.register_all(refit.param_buffers(infer, d.rank, params))
        engines.append(params)
    system.refit_latest()
    for t, (d, params) in enumerate(zip(system.destinations, engines)):
        d.load()
        rows = min(64, 100 - 64 * t)
        np.testing.assert_array_equal(params["model.embed_tokens.weight"][:rows], full["model.embed_tokens.weight"][64 * t:64 * t + rows])
        assert (params["model.embed_tokens.weight"][rows:] == 7).all(), "padding rows are no tensor's"
        qkv = [full[f"model.layers.0.self_attn.{p}_proj.weight"][2 * t:2 * t + 2] for p in "qkv"]
        np.testing.assert_array_equal(params["model.layers.0.self_attn.qkv_proj.weight"], np.concatenate(qkv))
        np.testing.assert_array_equal(params["model.norm.weight"], full["model.norm.weight"])
    system.orchestrator.close()


def test_param_buffers_says_which_parameter_does_not_fit():
    layout = refit.tp_inference_layout({"model.embed_tokens.weight": [100, 4], "model.norm.weight": [4]}, tp=2)
    ok = {"model.embed_tokens.weight": np.zeros((64, 4), np.float32), "model.norm.weight": np.zeros(4, np.float32)}
    assert [v.shape for v in refit.param_buffers(layout, 1, ok).values()] == [(144,), (4,)]
    with pytest.raises(refit.TensorError, match="rank 0: buffer 'model.norm.weight#0': no parameter 'model.norm.weight'"):
        refit.param_buffers(layout, 0, {"model.embed_tokens.weight": ok["model.embed_tokens.weight"]})
    with pytest.raises(refit.TensorError, match=r"parameter 'model.embed_tokens.weight': 200 elements \(shape \[50, 4\]\), the buffer needs 256"):
        refit.param_buffers(layout, 0, {**ok, "model.embed_tokens.weight": np.zeros((50, 4), np.float32)})
    # Padding adds rows of a vocabulary parameter only.
    with pytest.raises(refit.TensorError, match=r"shape \[32, 8\], the buffer's block is \[64, 4\] \(padding may add rows only\)"):
        refit.param_buffers(layout, 0, {**ok, "model.embed_tokens.weight": np.zeros((32, 8), np.float32)})
    # Any other parameter holds its block exactly: a transposed one of the
    # same size, or a larger one, is named with both shapes.
    dense = refit.tp_inference_layout({"model.layers.0.self_attn.o_proj.weight": [64, 32]}, tp=1)
    with pytest.raises(refit.TensorError, match=r"parameter 'model.layers.0.self_attn.o_proj.weight': shape \[32, 64\], the buffer's block is \[64, 32\]"):
        refit.param_buffers(dense, 0, {"model.layers.0.self_attn.o_proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(refit.TensorError, match=r"shape \[65, 32\], the buffer's block is \[64, 32\]"):
        refit.param_buffers(dense, 0, {"model.layers.0.self_attn.o_proj.weight": np.zeros((65, 32), np.float32)})
    # ... unless the caller declares it padded.
    cut = refit.param_buffers(dense, 0, {"model.layers.0.self_attn.o_proj.weight": np.zeros((65, 32), np.float32)}, padded=["o_proj"])
    assert [v.shape for v in cut.values()] == [(2048,)]
    with pytest.raises(refit.TensorError, match="a non-C-contiguous array has no flat view"):
        refit.param_buffers(layout, 0, {**ok, "model.embed_tokens.weight": np.zeros((4, 64), np.float32).T})
    two = refit.LayoutBuilder(1).tensor(refit.TensorBuilder("w", "f32", [4]).shard(0, offset=[0], extent=[2]).shard(0, offset=[2], extent=[2])).build()
    with pytest.raises(refit.TensorError, match="the rank holds several blocks of 'w'"):
        refit.param_buffers(two, 0, {"w": np.zeros(4, np.float32)})


def test_plan_says_what_a_refit_moves_without_running_it():
    shapes = model_shapes(2, 4, 2, head=2, hidden=8, ffn=8, vocab=64)
    train = refit.megatron_layout(shapes, tp=2, pp=2, num_attention_heads=4, num_kv_heads=2, ranks_per_node=2, vocab_multiple=4)
    infer = refit.tp_inference_layout(shapes, tp=2, dp=2, num_kv_heads=2, ranks_per_node=2)
    reshard, baseline = refit.plan(train, infer), refit.plan(train, infer, mode="baseline")
    model_bytes = 2 * sum(int(np.prod(s)) for s in shapes.values())  # bf16
    # Each inference node (one replica) takes in the whole model once.
    assert reshard.dst_node_ingress_bytes == [model_bytes, model_bytes]
    assert reshard.bytes == reshard.src_egress_bytes + reshard.relayed_bytes
    assert len(reshard.src_rank_egress_bytes) == 4 and reshard.messages > 0 and reshard.rounds > 0
    assert baseline.bytes > reshard.bytes and baseline.fingerprint != reshard.fingerprint
    with pytest.raises(refit.PlanError, match="mode 'broadcast'"):
        refit.plan(train, infer, mode="broadcast")
    other = refit.LayoutBuilder(1).tensor(refit.TensorBuilder("model.norm.weight", "bf16", [9]).mesh([1], ["replicate"])).build()
    with pytest.raises(refit.PlanError, match="model.norm.weight"):
        refit.plan(train, other)


class FakeTensor:
    def __init__(self, shape, dtype="torch.float32"):
        self.shape, self.dtype = shape, dtype


def test_dtensors_on_other_world_ranks_map_to_the_groups_ranks():
    # An FSDP trainer group on world ranks 2 and 3 (0 and 1 run inference):
    # with group=, the layout's ranks are the group's, and plain tensors are
    # whole on each of them.
    params = {"w": FakeDTensor((4, 2), [2, 3], [Shard(0)]), "norm": FakeTensor((2,))}
    layout = refit.layout_from_dtensors(params, plain="replicate", group=[2, 3])
    assert layout.ranks == 2
    assert layout.blocks(0) == [("w", "f32", [0, 0], [2, 2]), ("norm", "f32", [0], [2])]
    assert layout.blocks(1) == [("w", "f32", [2, 0], [2, 2]), ("norm", "f32", [0], [2])]
    refit.Source(layout, 0)
    # Without it, world ranks: ranks 0 and 1 hold only the plain tensor.
    assert refit.layout_from_dtensors(params, plain="replicate").ranks == 4
    # The group's order is the layout's: [3, 2] swaps them.
    swapped = refit.layout_from_dtensors(params, plain="replicate", group=[3, 2])
    assert swapped.blocks(0)[0] == ("w", "f32", [2, 0], [2, 2])
    with pytest.raises(refit.LayoutError, match="world rank 3, not in group"):
        refit.layout_from_dtensors({"w": FakeDTensor((4,), [2, 3], [Shard(0)])}, group=[2])
    with pytest.raises(refit.LayoutError, match="distinct"):
        refit.layout_from_dtensors(params, group=[2, 2])


def test_real_dtensors_of_a_group_on_other_world_ranks():
    """A trainer group on world ranks 2 and 3 of 4 (a torch process group
    and a device mesh over it): ``group=`` takes the process group."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard as TorchShard
        from torch.distributed.tensor import distribute_tensor
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        pytest.skip(f"torch.distributed.tensor or the fake process group missing: {e}")
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        group = dist.new_group([2, 3])
        mesh = DeviceMesh("cpu", torch.tensor([2, 3]))
        params = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [TorchShard(0)]), "norm": torch.zeros(2)}
        layout = refit.layout_from_dtensors(params, plain="replicate", group=group)
        assert layout.ranks == 2
        assert layout.blocks(0) == [("w", "f32", [0, 0], [2, 2]), ("norm", "f32", [0], [2])]
        assert layout.blocks(1) == [("w", "f32", [2, 0], [2, 2]), ("norm", "f32", [0], [2])]
        refit.Source(layout, dist.get_process_group_ranks(group).index(dist.get_rank()))
    finally:
        dist.destroy_process_group()
