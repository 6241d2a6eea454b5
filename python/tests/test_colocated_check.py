"""The colocated check (scripts/colocated_check.py) in its CPU mode: the
same three processes as on a GPU (orchestrator, trainer, engine), a tiny
Qwen2 on the node fabric. Every refit verified bit for bit against the
trainer's masters cast to bf16; the trainer killed mid-refit leaves the
engine on its version. (Its timings on the CPU mean nothing; the GPU run
reports them, docs/gpu.md.)"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_slow_colocated_check_on_the_cpu(tmp_path):
    script = os.path.join(ROOT, "scripts", "colocated_check.py")
    run = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--size", "tiny", "--fabric", "node", "--refits", "4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    with open(tmp_path / "colocated.json") as f:
        result = json.load(f)
    assert run.returncode == 0 and result["status"] == "pass", (run.stdout[-4000:], run.stderr[-4000:])
    assert result["failures"] == []
    # Every refit: a new version, every element of the engine compared,
    # none different.
    refits = result["refits"]
    assert [r["version"] for r in refits] == [1, 2, 3, 4]
    for r in refits:
        assert r["mismatched"] == 0 and r["compared"] == r["elements"] == result["model"]["engine_elements"] > 0, r
        assert r["bytes"] == result["model"]["refit_buffer_bytes"] > 0
    timing = result["timing"]
    for key in ("refit_s", "refit_plus_load_s", "by_hand_s", "device_copy_s"):
        assert timing[key] > 0, key
    # The kill: in the middle of the refit of version 5, which fails; the
    # engine's model keeps version 4's parameters and runs a kernel. Its
    # refit buffers, written in place (as vLLM's worker writes them), are
    # torn by the failed refit: a load from them is refused.
    kill = result["kill"]
    assert kill["refit_in_flight_at_kill"] and kill["trainer_exit"] == -9, kill
    assert "error" in kill["refit_outcome"] and kill["new_version"] == 5, kill
    assert kill["served_before"] == 4 and kill["served"] is None, kill
    assert kill["params_unchanged"] and kill["params_after_reload_unchanged"], kill
    assert "VersionError" in kill["reloaded"] and "torn" in kill["reloaded"], kill
    assert kill["kernel_ran"], kill
    env = result["environment"]
    assert env["torch"] and env["refit"]
