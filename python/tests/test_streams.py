"""In-place sources are read only after the producer's kernels end: the
stream hand-off of `Source.stepping()`, checked without a GPU (the real
ordering is for scripts/gpu-check.sh on a GPU)."""

import numpy as np
import pytest

import refit
from refit import _arrays, _ranks

torch = pytest.importorskip("torch")


class FakeCudaTensor:
    """What `_wait_for_producers` reads of a CUDA tensor."""

    def __init__(self, device):
        self.is_cuda = True
        self.device = device


def test_each_cuda_device_waits_for_torchs_current_stream_once(monkeypatch):
    synced = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(self.device)

    monkeypatch.setattr(_arrays, "_torch_tensor", lambda obj: isinstance(obj, (FakeCudaTensor, torch.Tensor)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(device))
    objects = [FakeCudaTensor("cuda:0"), FakeCudaTensor("cuda:1"), FakeCudaTensor("cuda:0"), torch.zeros(4), np.zeros(4)]
    _arrays._wait_for_producers(objects)
    assert synced == ["cuda:0", "cuda:1"]
    synced.clear()
    _arrays._wait_for_producers([torch.zeros(4), np.zeros(4)])  # host memory: nothing to wait for
    assert synced == []


def test_stepping_waits_for_the_producers_before_the_version_goes_up(monkeypatch):
    layout = refit.LayoutBuilder(1, None).tensor(refit.TensorBuilder("w", "f32", [4]).mesh([1], ["replicate"]).buffer("w", 0)).build()
    w = np.zeros(4, dtype=np.float32)
    src = refit.Source.in_place(layout, 0, {"w": w})
    seen = []

    def wait(objects):
        seen.append((src.version, [id(o) for o in objects]))

    monkeypatch.setattr(_ranks, "_wait_for_producers", wait)
    with src.stepping():
        w[:] = 1.0
    assert seen == [(None, [id(w)])], "waited once, before the version went up, for the registered objects"
    assert src.version == 1
    # A failed step raises no version and waits for nothing.
    with pytest.raises(RuntimeError):
        with src.stepping():
            raise RuntimeError("the optimizer failed")
    assert len(seen) == 1 and src.version == 1
