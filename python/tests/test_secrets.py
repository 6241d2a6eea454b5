"""The rendezvous secret never appears in a repr, a log line or an error:
every object that holds it, and every way of failing to join or connect
with it."""

import logging
import socket
import sys
import traceback
import types
import typing
from dataclasses import dataclass

import pytest

import refit
import refit.vllm

SECRET = "s3cr3t-" + "0123456789abcdef" * 2
OTHER = "0th3r-" + "fedcba9876543210" * 2


def text_of(error):
    """Everything an error would print: its text, repr, arguments and the
    whole traceback with its chain."""
    return "\n".join([str(error), repr(error), repr(error.args), "".join(traceback.format_exception(type(error), error, error.__traceback__))])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def orchestrator():
    orch = refit.Orchestrator(SECRET)
    yield orch
    orch.close()


def test_no_object_holding_the_secret_shows_it(orchestrator, caplog):
    caplog.set_level(logging.DEBUG)
    joined = refit.join(orchestrator.address, SECRET)
    try:
        for obj in [orchestrator, orchestrator._inner, joined, joined._inner]:
            for shown in (repr(obj), str(obj)):
                assert SECRET not in shown, shown
    finally:
        joined.shutdown()
    assert SECRET not in caplog.text


@pytest.mark.parametrize("secret", [OTHER, "short-secret"])
def test_a_failing_join_never_shows_either_secret(orchestrator, secret):
    with pytest.raises(refit.RefitError) as e:
        refit.join(orchestrator.address, secret)
    shown = text_of(e.value)
    assert SECRET not in shown and secret not in shown, shown


def test_a_join_to_nobody_never_shows_the_secret():
    with pytest.raises(refit.RefitError) as e:
        refit.join(f"127.0.0.1:{free_port()}", SECRET)
    assert SECRET not in text_of(e.value)


def fake_vllm_modules():
    """The names ``refit._vllm_worker`` imports from vLLM at its top."""

    @dataclass
    class WeightTransferInitInfo:
        pass

    @dataclass
    class WeightTransferUpdateInfo:
        pass

    class WeightTransferEngine(typing.Generic[typing.TypeVar("I"), typing.TypeVar("U")]):
        pass

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferInitInfo = WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    base.WeightTransferEngine = WeightTransferEngine
    names = ["vllm", "vllm.distributed", "vllm.distributed.weight_transfer"]
    return {**{n: types.ModuleType(n) for n in names}, base.__name__: base}


def test_the_workers_init_info_never_shows_the_secret(monkeypatch):
    pytest.importorskip("torch")
    if "vllm" in sys.modules or any(k.startswith("vllm.") for k in sys.modules):
        pytest.skip("a real vLLM is loaded in this process")
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "refit._vllm_worker", raising=False)
    import refit._vllm_worker as worker

    try:
        info = worker.RefitInitInfo(rendezvous="127.0.0.1:1", secret=SECRET, tensors=[["w", "f32", [4]]])
        assert info.secret == SECRET
        for shown in (repr(info), str(info)):
            assert SECRET not in shown and "127.0.0.1:1" in shown, shown
    finally:
        sys.modules.pop("refit._vllm_worker", None)


class Engine:
    """A ``vllm.LLM`` as ``VLLMRollouts`` sees it, whose connect fails with
    ``error(info)``."""

    def __init__(self, error):
        self.error = error
        parallel = types.SimpleNamespace(world_size=1)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel))

    def init_weight_transfer_engine(self, request):
        raise self.error(request["init_info"])


def layout():
    return refit.LayoutBuilder(1).tensor(refit.TensorBuilder("w", "f32", [4]).mesh([1], ["replicate"])).build()


def echoing(info):
    # An engine that echoes its arguments in its error, chained to another
    # that holds them as an argument.
    try:
        raise ValueError("bad request", info)
    except ValueError as inner:
        try:
            raise RuntimeError(f"worker 0 refused init_info={info}") from inner
        except RuntimeError as e:
            return e


def test_a_failing_connect_never_shows_the_secret(orchestrator):
    rollouts = refit.vllm.VLLMRollouts(orchestrator, [Engine(echoing)], layout())
    with pytest.raises(refit.RefitError) as e:
        rollouts.connect(src_ranks=1, timeout=1.0)
    shown = text_of(e.value)
    assert SECRET not in shown, shown
    assert "engine 0: connecting its workers failed: RuntimeError: worker 0 refused init_info=" in shown and "<secret>" in shown, shown
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)


def test_a_failing_connect_without_the_secret_keeps_its_cause(orchestrator):
    rollouts = refit.vllm.VLLMRollouts(orchestrator, [Engine(lambda info: KeyError("tensors"))], layout())
    with pytest.raises(refit.RefitError) as e:
        rollouts.connect(src_ranks=1, timeout=1.0)
    assert isinstance(e.value.__cause__, KeyError), text_of(e.value)
    assert SECRET not in text_of(e.value)
