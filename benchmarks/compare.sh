#!/bin/sh
# Alternates, for one layout pair, R rounds of: torch gather-broadcast, torch
# p2p (benchmarks/torch_refit.py), `refit launch` (reshard) and
# `refit launch --baseline`, K timed refits each; prints every per-refit time
# and the ranges. Loopback only. See benchmarks/README.md.
#
#   benchmarks/compare.sh --src S.json --dst D.json [--refits K] [--rounds R] [--refit-bin PATH] [--old-refit-bin PATH]
#
# --old-refit-bin adds a fifth row: `launch --baseline` of another build (to
# compare two versions of the baseline in the same rounds).
#
# Needs target/release/refit (cargo build --release); without torch only the
# two refit rows are measured.
exec python3 "$(dirname "$0")/torch_refit.py" --compare "$@"
