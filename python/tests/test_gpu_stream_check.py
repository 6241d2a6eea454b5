"""The CPU side of gpu_stream_check.py (the GPU check of in-place ranks and
torch's streams): it refuses with exit 2 and one line saying why where
CUDA is unavailable, and its plumbing (layouts, in-place ranks, versions,
the comparisons, a refit held off by `serving()`) runs as a rehearsal over
`simulated-ipc` with host tensors and torch.cuda's stream calls stubbed."""

import contextlib
import importlib.util
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")


def load():
    path = pathlib.Path(__file__).with_name("gpu_stream_check.py")
    spec = importlib.util.spec_from_file_location("gpu_stream_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing runs nothing
    return module


def lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_without_cuda_it_exits_2_saying_why(monkeypatch, capsys, tmp_path):
    check = load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.jsonl"
    assert check.main(["--out", str(out)]) == 2
    printed = lines(capsys)
    assert len(printed) == 1 and printed[0]["ok"] is False
    assert "has no CUDA device" in printed[0]["unavailable"]
    assert json.loads(out.read_text()) == printed[0]


class FakeStream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, **_):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 25.0


def test_a_rehearsal_on_the_simulated_ipc_plane(monkeypatch, capsys):
    check = load()
    monkeypatch.setattr(check, "DEVICE", "cpu")
    monkeypatch.setattr(check, "FABRIC", "simulated-ipc")
    monkeypatch.setattr(check, "TENSORS", {"w0": [8, 16], "w1": [16, 8], "w2": [4, 32]})
    stream = FakeStream()
    for name, value in {
        "is_available": lambda: True,
        "Stream": lambda device: stream,
        "stream": lambda s: contextlib.nullcontext(),
        "current_stream": lambda device=None: stream,
        "Event": FakeEvent,
        "_sleep": lambda cycles: None,
        "synchronize": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    code = check.main(["--sleep-ms", "20"])
    got = {d["check"]: d for d in lines(capsys)}
    assert got["warm-up"]["ok"] and got["warm-up"]["elements"] == 3 * 128
    for name, versions in (("torch-stream", [2, 3, 4]), ("side-stream-waited", [5, 6]), ("current-side-stream", [7, 8])):
        d = got[name]
        assert "error" not in d and d["versions"] == versions and d["mismatches"] == [], d
        # Host tensors: nothing on a GPU to wait for, so nothing waited.
        assert d["waited"] is False and d["ok"] is False
    assert got["serving-holds-commit"]["ok"], got["serving-holds-commit"]
    assert got["serving-holds-commit"]["held"] == [8, 8] and got["serving-holds-commit"]["versions"] == [9]
    control = got["no-wait-control"]
    assert control["gating"] is False and control["versions"] == [10] and control["stale_seen"] is False
    # Host memory on the simulated plane: nothing fell back to the host.
    assert got["host-fallbacks"] == {
        "check": "host-fallbacks",
        "ok": True,
        "host_fallbacks": 0,
        "host_fallback_work": [],
        "host_work_without_kernel": [],
    }
    assert got["summary"] == {"check": "summary", "ok": False, "failed": 3} and code == 1


def test_any_host_fallback_fails_the_check_naming_it(monkeypatch):
    check = load()
    import refit

    work = [
        {"rank": "dst rank 0", "what": "quantized its block-scaled tensors", "why": "the quantize kernels did not load: x", "times": 2, "fallback": True},
        {"rank": "src rank 1", "what": "converted a piece", "why": "no device kernel converts f32 -> f64", "times": 3, "fallback": False},
    ]
    monkeypatch.setattr(refit._refit, "host_work", lambda: work, raising=False)
    d = check.host_work_result()
    assert d["ok"] is False and d["host_fallbacks"] == 2
    assert d["host_fallback_work"] == ["dst rank 0 quantized its block-scaled tensors on the host x2 (the quantize kernels did not load: x)"]
    assert d["host_work_without_kernel"] == ["src rank 1 converted a piece on the host x3 (no device kernel converts f32 -> f64)"]
    monkeypatch.setattr(refit._refit, "host_work", lambda: work[1:], raising=False)
    assert check.host_work_result()["ok"] is True
