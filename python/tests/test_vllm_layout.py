"""refit.vllm's layout pieces, without vLLM: the boxes a dry run's element
sets become, and the destination layout derived from every worker's."""

import numpy as np
import pytest

import refit
import refit.vllm as rv


def cover(boxes, shape):
    got = np.zeros(shape, dtype=bool)
    for offset, extent in boxes:
        part = tuple(slice(o, o + e) for o, e in zip(offset, extent))
        assert not got[part].any(), "boxes overlap"
        got[part] = True
    return got


def test_boxes_are_exactly_the_elements():
    rng = np.random.default_rng(0)
    for _ in range(500):
        shape = tuple(int(s) for s in rng.integers(1, 6, size=rng.integers(1, 4)))
        mask = rng.random(shape) < rng.random()
        if not mask.any():
            assert rv.boxes_of_mask(mask) == []
            continue
        assert (cover(rv.boxes_of_mask(mask), shape) == mask).all()
        assert (cover(rv.boxes_of(np.flatnonzero(mask), shape), shape) == mask).all()


def test_a_split_is_one_box():
    rows = np.zeros((8, 6), dtype=bool)
    rows[4:8] = True
    assert rv.boxes_of_mask(rows) == [([4, 0], [4, 6])]
    cols = np.zeros((8, 6), dtype=bool)
    cols[:, 0:3] = True
    assert rv.boxes_of_mask(cols) == [([0, 0], [8, 3])]
    gate_up = np.zeros((4, 8, 2), dtype=bool)  # experts' gate and up shares of TP rank 0
    gate_up[:, 0:2] = True
    gate_up[:, 4:6] = True
    assert rv.boxes_of_mask(gate_up) == [([0, 0, 0], [4, 2, 2]), ([0, 4, 0], [4, 2, 2])]
    assert rv.boxes_of_mask(np.array(True)) == [([], [])]


def test_derived_layout_tiles_replicas_and_names_buffers():
    tensors = [("w", "f32", [8, 6]), ("b", "f32", [8]), ("step", "i64", []), ("unused", "f32", [2])]
    every = [
        {"w": [([0, 0], [4, 6])], "b": [([0], [2]), ([4], [2])], "step": [([], [])]},
        {"w": [([4, 0], [4, 6])], "b": [([2], [2]), ([6], [2])], "step": [([], [])]},
    ]
    layout, missing = rv.derived_layout(tensors, every, replicas=2, dtype="bf16")
    assert missing == ["unused"]
    assert layout.ranks == 4
    assert layout.tensor("w") == ("bf16", [8, 6])
    assert layout.tensor("step") == ("i64", [])  # integers arrive as they are
    for replica in range(2):
        for r in range(2):
            rank = replica * 2 + r
            names = [n for n, _, _ in layout.buffers(rank)]
            assert names == ["w", "b#0", "b#1", "step"]
    assert [(n, o, e) for n, _, o, e in layout.blocks(3) if n == "b"] == [("b", [2], [2]), ("b", [6], [2])]
    # A training layout of the same tensors plans into it.
    train = refit.LayoutBuilder(1, None)
    for name, dtype, shape in tensors:
        train = train.tensor(refit.TensorBuilder(name, dtype, shape).mesh([1], ["replicate"]))
    assert refit.plan(train.build(), layout).bytes > 0


def test_checkpoint_tensors_lists_a_training_layout():
    train = refit.LayoutBuilder(2, None).tensor(refit.TensorBuilder("w", "f32", [8, 6]).mesh([2], ["shard(0)"])).build()
    assert rv.checkpoint_tensors(train) == [["w", "f32", [8, 6]]]


def test_rollouts_need_a_rendezvous_and_engines():
    system = refit.spawn_local(
        refit.LayoutBuilder(1, None).tensor(refit.TensorBuilder("w", "f32", [2]).mesh([1], ["replicate"])).build(),
        refit.LayoutBuilder(1, None).tensor(refit.TensorBuilder("w", "f32", [2]).mesh([1], ["replicate"])).build(),
    )
    with pytest.raises(refit.RefitError, match="no engine"):
        rv.VLLMRollouts(system.orchestrator, [], None)
    with pytest.raises(refit.RefitError, match="no rendezvous"):
        rv.VLLMRollouts(system.orchestrator, [object()], None)
