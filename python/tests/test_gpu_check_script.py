"""scripts/gpu-check.sh and scripts/gpu_record.py without a GPU: the dry
run's plan against a fake carry (what fits, what does not), the record
added to every kind of file a Python check writes, and a run whose check
cannot start still leaving a file that says what ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_record  # noqa: E402

# What `gpu_check --list` prints: name, timeout, expected, basis.
LIST = [
    ("environment", 60, 2, "measured: H200, run 8"),
    ("throughput", 200, 124, "measured: H200, run 8"),
    ("fp8-at-source", 60, 3, "estimate: not yet run on a GPU"),
]


def fake_carry(tmp_path, checks=LIST, wheel_bytes=1 << 20, record='{"commit": "abc123", "gpu": "unavailable: no GPU"}'):
    carry = tmp_path / "carry"
    carry.mkdir()
    table = "".join(f"{n}\\t{t}\\t{e}\\t{b}\\n" for n, t, e, b in checks)
    program = carry / "gpu_check"
    program.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --list) printf "{table}" ;; --record) echo \'{record}\' ;; *) exit 2 ;; esac\n'
    )
    program.chmod(0o755)
    with open(carry / "refit-0.1.0-cp39-abi3-linux_x86_64.whl", "wb") as f:
        f.truncate(wheel_bytes)  # sparse: its size is what counts
    (carry / "BUILD_INFO.json").write_text('{"commit": "abc123", "dirty": false, "built_at": "2026-12-07T09:00:00Z"}\n')
    return carry


def gpu_check(carry, *args):
    env = dict(os.environ, GPU_CHECK_CARRY=str(carry))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_dry_run_lists_every_check_the_carry_and_the_time_and_fits(tmp_path):
    r = gpu_check(fake_carry(tmp_path), "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for name, timeout, expected, basis in LIST:
        assert f"{name}" in out and basis in out
    assert "torch-stream (python)" in out and "colocated (python)" in out
    assert "120  estimate" in out, "colocated's expected time, marked as an estimate"
    assert "refit-0.1.0-cp39-abi3-linux_x86_64.whl" in out and "1048576 bytes" in out
    assert "BUILD_INFO.json" in out and "abc123" in out
    assert "carried in all:" in out and "of 64 MiB" in out
    # 2 + 124 + 3 (Rust) + 15 + 120 (Python) + 15 (set-up) = 279; + 124 again.
    assert "expected: 279 s in all" in out, out
    assert "throughput (124 s), run again: 403 s of the call's 480 s" in out, out
    assert out.rstrip().endswith("fits")


def test_a_carry_over_64_mib_does_not_fit(tmp_path):
    r = gpu_check(fake_carry(tmp_path, wheel_bytes=65 << 20), "--dry-run")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DOES NOT FIT: the carry is over 64 MiB" in r.stdout


def test_no_room_to_rerun_the_longest_check_does_not_fit(tmp_path):
    checks = LIST + [("slow", 290, 200, "estimate: test")]
    r = gpu_check(fake_carry(tmp_path, checks=checks), "--dry-run")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "slow (200 s), run again" in r.stdout
    assert "DOES NOT FIT: no room to re-run the longest check in one call" in r.stdout


def test_the_dry_run_without_the_build_says_so(tmp_path):
    r = gpu_check(tmp_path / "nothing", "--dry-run")
    assert r.returncode == 2
    assert "--build first" in r.stderr


def test_a_python_check_that_cannot_start_still_records_what_ran(tmp_path):
    # The fake wheel is no wheel: installing it fails, so the check cannot
    # run; its file must still say so, with the record.
    carry = fake_carry(tmp_path)
    out = tmp_path / "out"
    r = gpu_check(carry, "--only", "colocated", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    got = json.loads((out / "colocated.json").read_text())
    assert got["check"] == "colocated" and got["ok"] is False
    assert got["run"]["commit"] == "abc123"
    assert "torch" in got["run"] and "torch_cuda" in got["run"]


def test_the_record_goes_into_one_object_or_first_into_json_lines():
    run = {"commit": "abc123", "torch": "2.11.0"}
    one = json.loads(gpu_record.stamp('{"check": "colocated", "ok": true}', "colocated", run))
    assert one == {"check": "colocated", "ok": True, "run": run}
    lines = gpu_record.stamp('{"check": "warm-up", "ok": true}\n{"check": "summary", "ok": true}\n', "torch-stream", run)
    parsed = [json.loads(line) for line in lines.splitlines()]
    assert parsed[0] == {"check": "run", "run": run}
    assert [p["check"] for p in parsed[1:]] == ["warm-up", "summary"]
    # Stamped twice: one record line, the newest.
    again = [json.loads(line) for line in gpu_record.stamp(lines, "torch-stream", {"commit": "def"}).splitlines()]
    assert [p["check"] for p in again] == ["run", "warm-up", "summary"] and again[0]["run"] == {"commit": "def"}
    empty = json.loads(gpu_record.stamp("", "colocated", run))
    assert empty == {"check": "colocated", "ok": False, "line": "the check wrote no result", "run": run}
    with pytest.raises(ValueError):
        gpu_record.stamp("Traceback (most recent call last):\n", "colocated", run)


def test_the_record_says_why_when_the_rust_record_is_missing(tmp_path):
    target = tmp_path / "colocated.json"
    target.write_text("not json\n")
    assert gpu_record.main(["--record", str(tmp_path / "missing.json"), "--check", "colocated", str(target)]) == 0
    got = json.loads(target.read_text())
    assert got["ok"] is False and got["output"] == "not json\n"
    assert got["run"]["commit"].startswith("unknown: ")
