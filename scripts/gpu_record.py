"""Adds what ran to a Python GPU check's JSON file (scripts/gpu-check.sh).

    python3 scripts/gpu_record.py --record RUN.json --check NAME FILE

RUN.json is `gpu_check --record`'s output (the commit of the carried
build, the GPU and its UUID, the driver, CUDA driver API, NVRTC and NCCL
versions: cli/examples/gpu_check/record.rs gathers them, one place for every
file); this adds torch's version and the CUDA it was built with, then
writes the record into FILE: as its `run` field where FILE is one JSON
object, as a first line `{"check": "run", "run": ...}` where it is JSON
lines. A FILE the check never wrote (it crashed or timed out) is written
as a failed result of NAME with the record, so every file says what ran.
Exit 0 unless FILE cannot be written.
"""

import argparse
import json
import os
import sys


def torch_versions():
    """torch's version and torch.version.cuda, or why not."""
    try:
        import torch  # noqa: PLC0415 (optional: the record says when absent)
    except Exception as e:  # noqa: BLE001 (any import failure is reported)
        why = f"unavailable: {type(e).__name__}: {e}"
        return {"torch": why, "torch_cuda": why}
    cuda = getattr(torch.version, "cuda", None)
    return {"torch": str(torch.__version__), "torch_cuda": cuda if cuda else "unavailable: torch built without CUDA"}


def read_record(path):
    """The Rust side's record, or one saying why it is missing."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        return record
    except (OSError, ValueError) as e:
        return {"commit": f"unknown: {path}: {e}"}


def stamp(text, name, run):
    """FILE's new text: `run` added to one object or as a first line."""
    stripped = text.strip()
    if not stripped:
        result = {"check": name, "ok": False, "line": "the check wrote no result", "run": run}
        return json.dumps(result) + "\n"
    try:
        whole = json.loads(stripped)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        whole["run"] = run
        return json.dumps(whole, indent=2) + "\n"
    lines = [line for line in stripped.splitlines() if line.strip()]
    for line in lines:
        json.loads(line)  # JSON lines, each one an object: else ValueError
    lines = [line for line in lines if json.loads(line).get("check") != "run"]
    return "\n".join([json.dumps({"check": "run", "run": run})] + lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", required=True, help="gpu_check --record's output")
    p.add_argument("--check", required=True, help="the check's name (for a file it never wrote)")
    p.add_argument("file")
    args = p.parse_args(argv)
    run = dict(read_record(args.record))
    run.update(torch_versions())
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    try:
        new = stamp(text, args.check, run)
    except ValueError as e:
        # Not JSON: kept as it was, beside the record.
        new = json.dumps({"check": args.check, "ok": False, "line": f"not JSON: {e}", "output": text, "run": run}) + "\n"
    tmp = args.file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(tmp, args.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
