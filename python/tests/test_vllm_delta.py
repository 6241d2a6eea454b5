"""Delta refits into a running vLLM (vLLM's CPU build, as shipped).

With ``refit.Orchestrator(delta=True)`` each worker keeps what it received
(its base) and every refit after a clean one sends only the changed
elements; the worker then loads the whole version into its model as for a
dense refit. Checked here as users train: every step changes a few
percent of the elements (scattered, as AdamW at an RL learning rate does),
ten steps in a row, each refitted as a delta; the engine then generates
exactly as a fresh engine loaded from the same weights. An engine that
restarts (its workers hold no base) gets a dense refit by itself, and the
deltas resume after it.

No download: the checkpoints are tiny random-weight models made here with
transformers, the prompts token ids.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402
from test_vllm_refit import dense_config, save  # noqa: E402
from vllm_engines import TRAIN_RANKS, Trainer, assert_same, generate, start, stop, train_layout  # noqa: E402

STEPS = 10
CHANGED = 0.02  # of the elements, per step


def sparse_step(state, gen):
    """The next step's weights: ``CHANGED`` of every tensor's elements,
    scattered, each moved by a small update."""
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=gen) < CHANGED
        out[name] = torch.where(mask, t + 1e-3 * torch.randn(t.shape, generator=gen), t)
    return out


def save_state(config, state, path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(path)
    return str(path)


def test_ten_delta_refits_equal_a_fresh_engine_and_a_restarted_engine_gets_a_dense_refit(tmp_path):
    config = dense_config(2)
    path_b, _, state_b = save(config, tmp_path / "b", seed=1)
    train = train_layout(state_b)
    gen = torch.Generator().manual_seed(11)

    llm = start(path_b, 1)
    orch = refit.Orchestrator(deadline=20.0, delta=True)
    engines = [llm]
    try:
        trainer = Trainer(train, state_b, orch)
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], train, dtype="f32")
        dense = rollouts.connect(src_ranks=TRAIN_RANKS).bytes

        # The first refit has no base: dense. Every one after it: only the
        # changed elements (2% of them, f32, with their positions) cross.
        state = sparse_step(state_b, gen)
        first = rollouts.refit(trainer.step(state))
        assert first.bytes >= dense, (first.bytes, dense)
        sent = []
        for _ in range(STEPS):
            state = sparse_step(state, gen)
            report = rollouts.refit(trainer.step(state))
            assert llm.get_weight_version() == str(report.version)
            sent.append(report.bytes)
        assert all(0 < b < 0.15 * dense for b in sent), (sent, dense)
        print(f"dense {dense} bytes; first refit {first.bytes}; deltas {min(sent)}..{max(sent)} bytes ({min(sent) / dense:.1%}..{max(sent) / dense:.1%} of dense)")

        # After ten deltas in a row: exactly as a fresh engine loaded from
        # the same weights (tokens and top-3 logprobs).
        got = generate(llm)
        path_now = save_state(config, state, tmp_path / "now")
        stop(engines.pop())
        fresh = start(path_now, 1)
        engines.append(fresh)
        assert_same(generate(fresh), got)
        stop(engines.pop())

        # An engine restarted from the original checkpoint: its workers hold
        # no base. Connected again, its first refit is dense and brings it
        # to the training ranks' weights; the next is a delta again.
        restarted = start(path_b, 1)
        engines.append(restarted)
        rollouts = refit.vllm.VLLMRollouts(orch, [restarted], train, dtype="f32")
        rollouts.connect(src_ranks=TRAIN_RANKS)
        again = rollouts.refit(trainer.step(state))
        assert again.bytes >= dense, (again.bytes, dense)
        assert_same(generate(restarted), got)
        state = sparse_step(state, gen)
        after = rollouts.refit(trainer.step(state))
        assert 0 < after.bytes < 0.15 * dense, (after.bytes, dense)
        assert_same(generate(restarted), generate_fresh(config, state, tmp_path / "after", engines))
    finally:
        orch.close()
        for e in engines:
            stop(e)


def generate_fresh(config, state, path, engines):
    """Generation of a fresh engine loaded from ``state`` (started and
    stopped here; ``engines`` lists it meanwhile for the test's cleanup)."""
    fresh = start(save_state(config, state, path), 1)
    engines.append(fresh)
    try:
        return generate(fresh)
    finally:
        stop(engines.pop())
