"""A look-up that runs user code cannot make a refit use memory that code
freed. Before a refit uses registered memory, every registered object is
looked up (the objects' own code may run: a torch subclass's
``__torch_function__``), then every buffer is checked again with no Python
code running, then the memory is used with no Python code in between. A
look-up that frees or resizes another, already looked-up buffer fails the
refit with an error naming that buffer; the destinations keep their
version. Each case runs in a subprocess, so a crash (SIGSEGV in the
shared-memory send or in a direct destination's write) is a failure of
the test, not of pytest."""

import os
import subprocess
import sys
import textwrap

import pytest

# Source rank 0 and destination rank 0 of the "node" fabric in one process:
# the source's registered memory is read by the shared-memory send, a
# direct destination's written by the refit in place. Buffer 'a#0' (large:
# its old memory is unmapped when freed) is looked up before 'b#0', whose
# look-up frees it when `armed` is set.
SCRIPT = """
import sys
import numpy as np
import torch
import refit

SIDE, KIND = sys.argv[1], sys.argv[2]
N = 1 << 22  # 16 MiB of f32: allocated (and freed) by its own mapping
armed = []

whole = lambda name: refit.TensorBuilder(name, "f32", [N]).mesh([1], ["replicate"])
layout = refit.LayoutBuilder(1).tensor(whole("a")).tensor(whole("b")).build()


def free_the_victim():
    if armed:
        victim.resize_(2 * N).fill_(5.0)  # new memory, the old unmapped
        victim.resize_(N)


class Sneaky(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        free_the_victim()
        return super().__torch_function__(func, types, args, kwargs or {})


class SneakyArray(np.ndarray):
    @property
    def __array_interface__(self):
        free_the_victim()
        return np.asarray(self).__array_interface__


victim = torch.zeros(N)
if KIND == "torch":
    sneaky = torch.zeros(N).as_subclass(Sneaky)
    plain = lambda t: t.as_subclass(torch.Tensor)
    fill = lambda t, v: torch.Tensor.fill_(t.as_subclass(torch.Tensor), v)
else:
    sneaky = np.zeros(N, np.float32).view(SneakyArray)
    plain = lambda a: torch.from_numpy(a.view(np.ndarray))
    fill = lambda a, v: a.view(np.ndarray).fill(v)
mine = {"a#0": victim, "b#0": sneaky}


def ends(x):
    return float(x[0]), float(x[-1])

orch = refit.Orchestrator(fabric="node", deadline=20.0)
if SIDE == "src":
    src = refit.Source.in_place(layout, 0, mine)
    dst_a, dst_b = np.zeros(N, np.float32), np.zeros(N, np.float32)
    dst = refit.Destination.in_place(layout, 0, {"a#0": dst_a, "b#0": dst_b})
    def write(step):
        with src.stepping():
            victim.fill_(step)
            fill(sneaky, 10 * step)
    def served():
        with dst.serving() as version:
            return version, ends(dst_a), ends(dst_b)
else:
    src_a, src_b = np.zeros(N, np.float32), np.zeros(N, np.float32)
    src = refit.Source.in_place(layout, 0, {"a#0": src_a, "b#0": src_b})
    dst = refit.Destination.in_place(layout, 0, mine, direct=True)
    def write(step):
        with src.stepping():
            src_a[:] = step
            src_b[:] = 10 * step
    def served():
        # Read as they are (the victim was moved: serving would refuse it).
        # (Torch tensors read by torch: a numpy view of the victim would
        # make its storage one torch refuses to resize.)
        return dst.version, ends(victim), ends(plain(sneaky))
joined = refit.join(orch.address, orch.secret)
src.join(joined=joined)
dst.join(joined=joined)
orch.connect(1, 1)

write(1)
orch.refit(1)
version, a, b = served()
assert (version, a, b) == (1, (1.0, 1.0), (10.0, 10.0)), (version, a, b)
write(2)
armed.append(1)  # from here, every look-up of 'b#0' frees 'a#0'
try:
    orch.refit(2)
    outcome = "COMMITTED"
except refit.RefitError as e:
    outcome = "FAILED " + str(e).replace(chr(10), " ")
armed.clear()
version, a, b = served()
print(outcome)
print("SERVED", version, *a, *b)
joined.shutdown()
orch.close()
"""


def run_case(tmp_path, side, kind):
    script = tmp_path / "lookups.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(script), side, kind], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{side} {kind}: exited with {out.returncode} (a negative number is the signal that killed it)\n{out.stdout}\n{out.stderr[-4000:]}"
    lines = out.stdout.splitlines()
    outcome = next(line for line in lines if line.startswith(("COMMITTED", "FAILED")))
    served = next(line for line in lines if line.startswith("SERVED")).split()[1:]
    return outcome, served


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_torch_look_up_that_frees_another_buffer_fails_the_refit_naming_it(tmp_path, side):
    pytest.importorskip("torch")
    outcome, served = run_case(tmp_path, side, "torch")
    assert outcome.startswith("FAILED"), outcome
    assert "buffer 'a#0': changed while the registered objects were looked up" in outcome, outcome
    assert f"{side} rank 0" in outcome, outcome
    if side == "src":
        # Nothing of the failed refit was committed: version 1 everywhere.
        assert served == ["1", "1.0", "1.0", "10.0", "10.0"], served
    else:
        # A direct destination failed before its first byte: torn (no
        # version), its memory never written by the failed refit; the
        # victim is where the look-up moved it (5.0), untouched since.
        assert served[0] == "None" and served[1:3] == ["5.0", "5.0"], served


@pytest.mark.parametrize("side", ["src", "dst"])
def test_an_ndarray_subclass_property_never_runs_in_a_look_up(tmp_path, side):
    """numpy arrays are read from their C struct: the property that would
    free the other buffer never runs, and the refit commits correctly."""
    pytest.importorskip("torch")
    outcome, served = run_case(tmp_path, side, "numpy")
    assert outcome == "COMMITTED", outcome
    assert served == ["2", "2.0", "2.0", "20.0", "20.0"], served
