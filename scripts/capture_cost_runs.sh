#!/bin/bash
# What capture costs SGLang, in one device call: the capture's GPU tests, then scripts/capture_cost.py, packed
# into one file (a device call brings back at most eight).
#
#   scripts/capture_cost_runs.sh OUT SECONDS [capture_cost.py arguments ...]
#
# Run it through scripts/sglang_bundle.sh run (SGLang 0.5.17 offline), alone on the GPU. First the GPU tests named
# by GPU_TESTS (a pytest -k expression; default: the capture hooks' host synchronisation and their CUDA graphs
# against eager; GPU_TESTS= skips them), at most TESTS_S seconds (default 120), into OUT/gpu-tests.txt. With
# DEVICE_BENCH=WIDTHS (real, builtin or tiny), scripts/bench_capture_device.py --widths WIDTHS next, at most BENCH_S
# seconds (default 120), into OUT/device-bench.txt and OUT/device-bench.json (the hooks' device work part by part). Then
# `capture_cost.py --out OUT/cost --until U ARGUMENTS`, where U is the seconds left after the tests less END_S (default
# 45, or 150 with --model among ARGUMENTS: the last cell's shutdown and trace reading; after 53 rounds the real-width
# pair's took more than 45 s), so every cell's timing rounds end in time however long its
# engine took to start (an --until among ARGUMENTS wins); it is killed SECONDS after this script began if still
# running (the cells it finished are in its JSON: it writes each as it ends), into OUT/log.txt; with fewer than
# MIN_S seconds (default 30) left after the tests, or no U left, no measurement starts. Last, OUT/capture-cost.tgz packs
# the logs, the device bench's table and JSON, capture_cost.json and .md, each cell's job.json and result.json, and
# the profile windows its scheduler processes wrote (records/profile-*.txt, with REFCHECK_CAPTURE_PROFILE=FIRST:COUNT
# in this script's environment).
# Exit: capture_cost.py's (124 when killed), 2 for bad arguments.
set -uo pipefail
out=${1:-}; seconds=${2:-}
if [ -z "$out" ] || ! [[ "$seconds" =~ ^[0-9]+$ ]]; then
  echo "capture_cost_runs.sh: usage: capture_cost_runs.sh OUT SECONDS [capture_cost.py arguments ...]" >&2; exit 2
fi
shift 2
start=$(date +%s)
mkdir -p "$out/cost"
tests=${GPU_TESTS-no_host_sync or same_from or cuda_graph_equals}
if [ -n "$tests" ]; then
  timeout "${TESTS_S:-120}" python3 -m pytest -o addopts= -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    -k "$tests" >"$out/gpu-tests.txt" 2>&1
  echo "exit $?" >>"$out/gpu-tests.txt"
fi
if [ -n "${DEVICE_BENCH:-}" ]; then
  timeout "${BENCH_S:-120}" python3 scripts/bench_capture_device.py --widths "$DEVICE_BENCH" \
    --json "$out/device-bench.json" >"$out/device-bench.txt" 2>&1
  echo "exit $?" >>"$out/device-bench.txt"
fi
left=$(( seconds - ($(date +%s) - start) ))
end_s=45
for arg in "$@"; do case "$arg" in --model|--model=*) end_s=150 ;; esac; done
until=$(( left - ${END_S:-$end_s} ))
if [ "$left" -lt "${MIN_S:-30}" ] || [ "$until" -lt 1 ]; then
  echo "capture_cost_runs.sh: $left s left after the GPU tests: no measurement" >"$out/log.txt"; rc=124
else
  REFCHECK_SGLANG_START_LOCK=${REFCHECK_SGLANG_START_LOCK:-/tmp/sgl.lock} timeout "$left" \
    python3 scripts/capture_cost.py --out "$out/cost" --until "$until" "$@" >"$out/log.txt" 2>&1
  rc=$?
fi
(cd "$out" && tar czf capture-cost.tgz log.txt \
   $(ls gpu-tests.txt device-bench.txt device-bench.json cost/capture_cost.json cost/capture_cost.md \
        cost/*/job.json cost/*/result.json cost/*/records/profile-*.txt 2>/dev/null))
exit "$rc"
